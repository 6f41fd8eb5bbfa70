"""Child processes of ``ctxkit.procs``: how they are started, set up, stopped and described.

Spawn only (see ``procs``); a child ignores SIGINT (the parent turns Ctrl-C into stopping
its children), dies with its parent on Linux, and sees only its device when isolated.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from ..binding import check_devices
from ..context import Context
from ..device import Device, device_count
from . import shm

#: Seconds between SIGTERM and SIGKILL when a child must be stopped.
TERM_GRACE_S = 2.0


#: Seconds a child may take to exit after it sent its result (e.g. teardown after a fault).
EXIT_GRACE_S = 10.0


#: The logical device ordinal a ctxkit child process serves (``procs.worker_device``).
current_device: int | None = None


_PR_SET_PDEATHSIG = 1


def child_setup(parent_pid: int, visible: str | None, shm_prefix: str | None = None) -> None:
    """First thing a spawned child does, before it unpickles any user code.

    Ignores SIGINT, asks Linux to kill this process when the parent thread that started
    it dies, names its shared-memory blocks with the prefix its parent chose (so the
    parent can remove them if this process dies while sending), and applies
    ``CUDA_VISIBLE_DEVICES`` isolation while CUDA is still uninitialised.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    if shm_prefix is not None:
        shm.set_prefix(shm_prefix)
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


def death_hint(exitcode: int | None) -> str:
    """What a child's death without a result most likely means, for the error message."""
    if exitcode == -signal.SIGBUS:
        free, total = shm.space()
        room = f"{free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB" if total else "absent"
        return (
            "out of shared memory: a process gets SIGBUS when it writes to a shared-memory "
            f"mapping that /dev/shm cannot back (/dev/shm now: {room}). Docker's default "
            "/dev/shm is 64 MiB: start the container with --shm-size=<size> or --ipc=host, "
            "or free /dev/shm"
        )
    return (
        "a native crash, os._exit(), the OOM killer or a fatal GPU fault look like this; "
        "check the child's stderr and `dmesg`"
    )


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


def visible_for(ordinals: list[int], isolate: bool) -> list[str | None]:
    if not isolate:
        return [None] * len(ordinals)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [visible_entry(o, env) for o in ordinals]


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


@contextlib.contextmanager
def bound_context(ordinal: int, bind: bool) -> Iterator[Any]:
    if not bind:
        yield None
        return
    from ..binding import registry

    ctx = registry.context(ordinal)
    with ctx:
        yield ctx
