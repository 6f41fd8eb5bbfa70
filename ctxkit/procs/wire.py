"""Plumbing shared by :mod:`ctxkit.procs` and its ``DevicePool``: the error type, checks
done before spawning, messages, shared-memory transport, child set-up, reaping.

Transport: objects are pickled with protocol 5. Out-of-band buffers (contiguous numpy
arrays, bytearrays) of at least ``threshold`` bytes go into a POSIX shared-memory block
each instead of through the pipe; the message carries the block names. The receiver
maps the block, unlinks its name at once (the mapping lives on as the array's memory),
so nothing is left in ``/dev/shm`` once the message is consumed. Blocks are registered
with multiprocessing's resource tracker by the sender and unregistered by the receiver,
so a message lost with a dead process is still cleaned up when the tracker exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

from ..context import Context
from ..device import Device, device_count
from ..errors import CudaError, DeviceTaskError
from ..registry import check_devices

#: Buffers at least this large travel through shared memory (see ``procs`` for numbers).
SHM_THRESHOLD = 1 << 20


#: Seconds between SIGTERM and SIGKILL when a child must be stopped.
TERM_GRACE_S = 2.0


#: Seconds a child may take to exit after it sent its result (e.g. teardown after a fault).
EXIT_GRACE_S = 10.0


#: The logical device ordinal a ctxkit child process serves (``procs.worker_device``).
current_device: int | None = None


_SHM_DIR = "/dev/shm"


_PR_SET_PDEATHSIG = 1


Blocks = list[tuple[str, int]]


def encode(obj: Any, threshold: int | None = SHM_THRESHOLD) -> tuple[bytes, Blocks]:
    """Pickle *obj*; buffers of ``threshold`` bytes or more go to shared-memory blocks.

    ``threshold=None`` keeps everything in the pickle.
    """
    blocks: Blocks = []

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if threshold is None or raw.nbytes < max(threshold, 1):
            return True
        shm = shared_memory.SharedMemory(create=True, size=raw.nbytes)
        try:
            shm.buf[: raw.nbytes] = raw  # type: ignore[index]
            blocks.append((shm.name, raw.nbytes))
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        shm.close()
        return False

    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=out_of_band)
    except BaseException:
        discard(blocks)
        raise
    return data, blocks


def decode(data: bytes, blocks: Blocks) -> Any:
    """Inverse of :func:`encode`; consumes (unlinks) the blocks, also when it fails."""
    buffers = []
    try:
        for name, size in blocks:
            buffers.append(attach(name, size))
    except BaseException:
        discard(blocks[len(buffers) :])
        raise
    return pickle.loads(data, buffers=buffers)


def attach(name: str, size: int) -> Any:
    """Map shared-memory block *name* and unlink it: a buffer that owns the memory.

    On Linux the mapping itself becomes the buffer (no copy); elsewhere the block is
    copied into a ``bytearray``.
    """
    path = os.path.join(_SHM_DIR, name)
    if os.path.isdir(_SHM_DIR) and os.path.exists(path):
        fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        os.unlink(path)
        _untrack(name)
        return mapped
    return _attach_copy(name, size)


def _attach_copy(name: str, size: int) -> bytearray:
    shm = shared_memory.SharedMemory(name=name)
    try:
        out = bytearray(shm.buf[:size])  # type: ignore[index]
    finally:
        shm.close()
        shm.unlink()
    return out


def _untrack(name: str) -> None:
    with contextlib.suppress(Exception):
        resource_tracker.unregister("/" + name, "shared_memory")


def discard(blocks: Iterable[tuple[str, int]]) -> None:
    """Unlink blocks that will never be received (the receiver died or was cancelled)."""
    for name, _size in blocks:
        try:
            shm = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        shm.close()
        shm.unlink()


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What the parent needs to rebuild a child's exception: picklable plain data."""
    pickled: bytes | None
    try:
        pickled = pickle.dumps(exc, protocol=5)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    cls = type(exc)
    return {
        "type": f"{cls.__module__}.{cls.__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(cls, exc, exc.__traceback__)),
        "code": int(getattr(exc, "code", 0) or 0) if _is_cuda_error(exc) else 0,
        "name": str(getattr(exc, "name", "")) if _is_cuda_error(exc) else "",
        "pickled": pickled,
    }


def _is_cuda_error(exc: BaseException) -> bool:
    return isinstance(exc, CudaError)


def unpickle_exception(desc: dict[str, Any]) -> BaseException | None:
    """The child's exception object, when it could be pickled; else ``None``."""
    data: bytes | None = desc.get("pickled")
    if data is None:
        return None
    try:
        exc = pickle.loads(data)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None


def exit_reason(exitcode: int | None) -> str:
    """Human words for a process exit code (negative: killed by that signal)."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        return f"was killed by {sig} ({-exitcode})"
    return f"exited with code {exitcode}"


def child_setup(parent_pid: int, visible: str | None) -> None:
    """First thing a spawned child does, before it unpickles any user code.

    Ignores SIGINT (the parent turns Ctrl-C into stopping its children), asks Linux to
    kill this process when the parent thread that started it dies, and applies
    ``CUDA_VISIBLE_DEVICES`` isolation while CUDA is still uninitialised.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    if visible is not None:
        from .. import _driver

        if _driver._init_pid is not None:
            raise RuntimeError(
                "isolate=True: CUDA was already initialised in the child before "
                "CUDA_VISIBLE_DEVICES could be set (the main module touched CUDA at import); "
                "guard the program's top-level code with `if __name__ == '__main__':`"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def visible_entry(ordinal: int, env: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows a child only logical device *ordinal*.

    *env* is the parent's value: its ordinal-th entry is picked (ids, UUIDs and MIG
    names alike), or ``str(ordinal)`` when the parent sets none.
    """
    if env is None:
        return str(ordinal)
    entries = [e.strip() for e in env.split(",") if e.strip()]
    if ordinal >= len(entries):
        raise ValueError(
            f"isolate=True: device {ordinal} is not in this process's "
            f"CUDA_VISIBLE_DEVICES={env!r} ({len(entries)} entries)"
        )
    return entries[ordinal]


def stop_processes(procs: Iterable[Any], grace: float) -> None:
    """SIGTERM every live process, wait up to *grace* seconds in total, then SIGKILL."""
    live = [p for p in procs if p.is_alive()]
    for p in live:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in live:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.kill()
            p.join()


def spawn_context(mp_context: Any) -> Any:
    if mp_context is None:
        return multiprocessing.get_context("spawn")
    method = mp_context.get_start_method()
    if method != "spawn":
        raise ValueError(
            f"ctxkit.procs needs the 'spawn' start method, got a {method!r} context: a "
            "process forked after CUDA was initialised cannot use CUDA (every driver call "
            "fails), and forking a multithreaded process can deadlock. Pass "
            "multiprocessing.get_context('spawn') or leave mp_context=None"
        )
    return mp_context


def check_shippable(what: str, fn: Any) -> None:
    """Refuse, before any process starts, a function a spawned child cannot import."""
    if not callable(fn):
        raise TypeError(f"{what}: expected a callable, got {type(fn).__name__}")
    qual = getattr(fn, "__qualname__", "")
    if "<lambda>" in qual or "<locals>" in qual:
        raise TypeError(
            f"{what}: {fn!r} is a lambda or a nested function, which a spawned process "
            "cannot import; define it at module level (def name(...): at the top of a "
            "module) and pass that"
        )
    if getattr(fn, "__module__", None) == "__main__":
        main = sys.modules.get("__main__")
        if getattr(main, "__file__", None) is None and getattr(main, "__spec__", None) is None:
            raise TypeError(
                f"{what}: {fn!r} was defined in an interactive session (python -c, REPL, "
                "notebook) and a spawned process cannot import it; put it in a module "
                "file and import it from there"
            )


def pickled(what: str, obj: Any, threshold: int | None) -> tuple[bytes, Blocks]:
    try:
        return encode(obj, threshold)
    except Exception as exc:
        raise TypeError(
            f"{what}: the function and its arguments must be picklable to reach a spawned "
            f"process, but pickling failed: {exc}"
        ) from exc


def resolve_ordinals(devices: Sequence[Device | int] | None, bind: bool) -> list[int]:
    if devices is None:
        if not bind:
            raise ValueError("_bind=False needs an explicit list of device ordinals")
        n = device_count()
        if n == 0:
            Device(0)  # raises the precise reason (no driver / no device)
        ordinals = list(range(n))
    else:
        specs = check_devices(devices, "run_per_device/DevicePool", contexts=False) or []
        ordinals = [ordinal_of(d, bind) for d in specs if not isinstance(d, Context)]
    return ordinals


def ordinal_of(d: Device | int, bind: bool) -> int:
    if bind:
        return Device(d).ordinal
    if isinstance(d, bool) or not isinstance(d, (int, Device)):
        raise TypeError(f"device must be an int ordinal or a ctxkit.Device, got {d!r}")
    return int(d)


def visible_for(ordinals: list[int], isolate: bool) -> list[str | None]:
    if not isolate:
        return [None] * len(ordinals)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [visible_entry(o, env) for o in ordinals]


@contextlib.contextmanager
def bound_context(ordinal: int, bind: bool) -> Iterator[Any]:
    if not bind:
        yield None
        return
    from .. import registry

    ctx = registry.default.context(ordinal)
    with ctx:
        yield ctx


def error_from(
    desc: dict[str, Any],
    device: int,
    pid: int | None,
    exitcode: int | None,
    attempts: int,
    head: str,
    kind: str = "exception",
) -> DeviceTaskError:
    tb = desc["traceback"]
    return DeviceTaskError(
        f"{head}: {desc['type']}: {desc['message']}\n--- traceback in child process {pid} ---\n"
        f"{tb.rstrip()}",
        device=device,
        kind=kind,
        pid=pid,
        exitcode=exitcode,
        traceback=tb,
        exception_type=desc["type"],
        child_exception=unpickle_exception(desc),
        attempts=attempts,
        code=desc["code"],
        name=desc["name"],
    )


def result_bytes(fn: Any, ordinal: int, value: Any, threshold: int | None = SHM_THRESHOLD) -> Any:
    try:
        return encode(value, threshold)
    except Exception as exc:
        raise TypeError(
            f"the result of {getattr(fn, '__qualname__', fn)!r} on device {ordinal} cannot be "
            f"pickled back to the parent ({exc}); return host data (numpy arrays, numbers), "
            "not device objects"
        ) from exc
