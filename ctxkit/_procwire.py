"""Plumbing of :mod:`ctxkit.procs`: messages, shared-memory transport, child set-up, reaping.

Nothing here touches CUDA; the public API and the binding of contexts live in ``procs``.

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
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Iterable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

#: Buffers at least this large travel through shared memory (see ``procs`` for numbers).
SHM_THRESHOLD = 1 << 20

_SHM_DIR = "/dev/shm"
_PR_SET_PDEATHSIG = 1

Blocks = list[tuple[str, int]]


# --- transport ------------------------------------------------------------------------


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


# --- failures -------------------------------------------------------------------------


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
    from .errors import CudaError

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


# --- child side -----------------------------------------------------------------------


def child_setup(parent_pid: int, visible: str | None) -> None:
    """First thing a spawned child does, before it unpickles any user code.

    Ignores SIGINT (the parent turns Ctrl-C into stopping its children), asks Linux to
    kill this process when the parent thread that started it dies, and applies
    ``CUDA_VISIBLE_DEVICES`` isolation while CUDA is still uninitialised.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    if visible is not None:
        from . import _driver

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


# --- parent side ----------------------------------------------------------------------


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
