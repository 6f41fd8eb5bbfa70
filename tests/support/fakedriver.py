"""A small fake of the CUDA driver's context API: per-thread context stacks, primary
context refcounts and call counters. Enough to unit-test ctxkit's context and registry
logic on a machine without a GPU; the real GPU suite is the truth."""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Any

from cuda.bindings import driver as _real

INVALID_CONTEXT = 201
CONTEXT_IS_DESTROYED = 709


class FakeHandle:
    """Stands in for CUcontext / CUdevice: an int-convertible handle."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __int__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeHandle) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"FakeHandle({self.value:#x})"


class FakeDriver:
    """Implements the driver calls ctxkit's context layer makes."""

    CUresult = _real.CUresult
    CUdevice_attribute = _real.CUdevice_attribute

    def __init__(self, ndev: int = 2) -> None:
        self.ndev = ndev
        self.calls: Counter[str] = Counter()
        self.pushes_by_thread: Counter[str] = Counter()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._ids = itertools.count(0x1000, 0x100)
        self.primary = {d: FakeHandle(next(self._ids)) for d in range(ndev)}
        self.primary_refs = dict.fromkeys(range(ndev), 0)
        self.ctx_device: dict[int, int] = {int(h): d for d, h in self.primary.items()}
        self.destroyed: set[int] = set()
        self.stacks: dict[int, list[FakeHandle]] = {}

    # per-thread stack -----------------------------------------------------------
    def stack(self) -> list[FakeHandle]:
        st = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
            with self._lock:
                self.stacks[threading.get_ident()] = st
        return st

    def current(self) -> int:
        st = self.stack()
        return int(st[-1]) if st else 0

    # driver API -----------------------------------------------------------------
    def cuInit(self, flags: int) -> tuple[int]:
        self.calls["cuInit"] += 1
        return (0,)

    def cuDeviceGetCount(self) -> tuple[int, int]:
        return (0, self.ndev)

    def cuDeviceGet(self, ordinal: int) -> tuple[int, FakeHandle]:
        return (0, FakeHandle(ordinal))

    def cuDevicePrimaryCtxRetain(self, dev: FakeHandle) -> tuple[int, FakeHandle]:
        self.calls["cuDevicePrimaryCtxRetain"] += 1
        with self._lock:
            self.primary_refs[int(dev)] += 1
        return (0, self.primary[int(dev)])

    def cuDevicePrimaryCtxRelease(self, dev: FakeHandle) -> tuple[int]:
        self.calls["cuDevicePrimaryCtxRelease"] += 1
        with self._lock:
            self.primary_refs[int(dev)] -= 1
        return (0,)

    def cuCtxCreate(self, *args: Any) -> tuple[int, FakeHandle]:
        self.calls["cuCtxCreate"] += 1
        dev = int(args[-1])
        h = FakeHandle(next(self._ids))
        with self._lock:
            self.ctx_device[int(h)] = dev
        self.stack().append(h)
        return (0, h)

    def cuCtxDestroy(self, ctx: FakeHandle) -> tuple[int]:
        self.calls["cuCtxDestroy"] += 1
        self.destroyed.add(int(ctx))
        return (0,)

    def cuCtxPushCurrent(self, ctx: FakeHandle) -> tuple[int]:
        self.calls["cuCtxPushCurrent"] += 1
        self.pushes_by_thread[threading.current_thread().name] += 1
        if int(ctx) in self.destroyed:
            return (CONTEXT_IS_DESTROYED,)
        self.stack().append(ctx)
        return (0,)

    def cuCtxPopCurrent(self) -> tuple[int, FakeHandle]:
        self.calls["cuCtxPopCurrent"] += 1
        st = self.stack()
        if not st:
            return (INVALID_CONTEXT, FakeHandle(0))
        return (0, st.pop())

    def cuCtxGetCurrent(self) -> tuple[int, FakeHandle]:
        self.calls["cuCtxGetCurrent"] += 1
        st = self.stack()
        return (0, st[-1] if st else FakeHandle(0))

    def cuCtxGetDevice(self) -> tuple[int, int]:
        cur = self.current()
        if not cur:
            return (INVALID_CONTEXT, 0)
        return (0, self.ctx_device[cur])

    def cuCtxSynchronize(self) -> tuple[int]:
        return (0,) if self.current() else (INVALID_CONTEXT,)

    def cuMemGetInfo(self) -> tuple[int, int, int]:
        return (0, 1 << 30, 2 << 30) if self.current() else (INVALID_CONTEXT, 0, 0)

    def cuGetErrorString(self, code: Any) -> tuple[int, bytes]:
        return (0, b"fake explanation")

    def cuDriverGetVersion(self) -> tuple[int, int]:
        return (0, 13000)

    # fake resource for free() tests -----------------------------------------------
    def fake_free(self, handle: int) -> tuple[int]:
        """A 'free' call that records the context current while it runs."""
        self.calls["fake_free"] += 1
        self.freed_in = getattr(self, "freed_in", [])
        self.freed_in.append((handle, self.current()))
        return (0,) if self.current() else (INVALID_CONTEXT,)


def swap_driver(monkeypatch: Any, fake: Any) -> None:
    """Make *fake* the driver of every ctxkit module for one test (undone by monkeypatch).

    Every family is imported first, so a module loaded later in the test cannot pick up
    the real driver; then each module's ``drv`` global is replaced.
    """
    import importlib
    import sys

    for name in (
        "ctxkit.memory",
        "ctxkit.module",
        "ctxkit.compiler",
        "ctxkit.graph",
        "ctxkit.executor",
        "ctxkit.pipeline",
        "ctxkit.procs",
        "ctxkit.cli.demo",
        "ctxkit.cli.info",
    ):
        importlib.import_module(name)
    for name, mod in list(sys.modules.items()):
        if (name == "ctxkit" or name.startswith("ctxkit.")) and hasattr(mod, "drv"):
            monkeypatch.setattr(mod, "drv", fake)
