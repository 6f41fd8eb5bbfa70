"""Helpers of the process tests: process liveness, this test process's shared-memory blocks,
and how an array reached a child."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ctxkit.procs import wire

SHM = Path("/dev/shm")

#: Pools a module's tests share (``tests/procs/test_pool.py``'s ``pool``): their workers
#: outlive each test, so the check that a test leaves no child behind leaves them out.
SHARED_POOLS: list[Any] = []


def alive(pid: int) -> bool:
    """True for a running (not zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def wait_dead(pids: Iterable[int], seconds: float = 10.0) -> list[int]:
    """The processes among *pids* still alive after up to *seconds*."""
    pids = list(pids)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def wait_for(condition: Any, seconds: float = 60.0, what: str = "condition") -> None:
    """Poll *condition* until it is true; fail the test after *seconds*."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def stray_children() -> list[Any]:
    """The running child processes of this process that no shared pool owns."""
    children = multiprocessing.active_children()
    shared = {pid for p in SHARED_POOLS for pid in p.pids.values()}
    return [c for c in children if c.pid not in shared]


def own_blocks() -> set[str]:
    """Shared-memory blocks of this test process and of the children it started.

    Other processes' blocks (another pytest-xdist worker, another program) have other
    prefixes and are not looked at.
    """
    if not SHM.is_dir():
        return set()
    mine = wire.shm_prefix()
    return {p.name for p in SHM.iterdir() if p.name.startswith((mine + "-", mine + "."))}


def transport(a: np.ndarray) -> str:
    """How *a* reached this process: ``"shm"`` (a mapped block) or ``"pipe"`` (bytes)."""
    base: Any = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    import mmap

    return "shm" if isinstance(base, mmap.mmap) else "pipe"


def gate_open(path: str) -> None:
    """Block until the file *path* exists (a task waits for the test to let it go)."""
    while not os.path.exists(path):
        time.sleep(0.01)
