"""A small fake of the CUDA driver's context API: per-thread context stacks, primary
context refcounts and call counters. Enough to unit-test ctxkit's context and registry
logic on a machine without a GPU; the real GPU suite is the truth.

Where ctxkit relies on a driver rule the fake enforces it, as the real driver does:

* ``cuDeviceGet`` checks its range (``CUDA_ERROR_INVALID_DEVICE``);
* ``cuDevicePrimaryCtxRelease`` without a retain left is ``CUDA_ERROR_INVALID_CONTEXT``;
  the release that brings the count to 0 resets the context (:meth:`reset_context`:
  its resources are gone, :attr:`resets` counts it);
* ``cuCtxCreate`` takes the arguments of the cuda-bindings major in
  :attr:`bindings_major` -- ``(flags, dev)`` for 12.x, ``(params, flags, dev)`` for
  13.x -- and raises ``TypeError`` for the other form, like the real bindings;
* a primary context that every retainer released is a new context when retained again:
  same handle, new ``cuCtxGetId``;
* ``cuCtxDestroy`` of the calling thread's current context pops it; a destroyed
  context answers ``CUDA_ERROR_CONTEXT_IS_DESTROYED``;
* a sticky fault (:attr:`fault`) poisons every context of the process, and
  ``cuCtxSynchronize`` reports it.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from typing import Any

from cuda.bindings import driver as _real

INVALID_DEVICE = 101
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

    def __reduce__(self) -> Any:
        # cuda.bindings' handle types refuse pickling and copying just so
        raise TypeError("no default __reduce__ due to non-trivial __cinit__")


class FakeDriver:
    """Implements the driver calls ctxkit's context layer makes."""

    CUresult = _real.CUresult
    CUdevice_attribute = _real.CUdevice_attribute

    def __init__(self, ndev: int = 2, bindings_major: int | None = None) -> None:
        from ctxkit import _driver

        self.ndev = ndev
        self.bindings_major = bindings_major or _driver.BINDINGS_VERSION[0]
        self.fault = 0  # a sticky error code: once set, every context of the process fails
        self.calls: Counter[str] = Counter()
        self.pushes_by_thread: Counter[str] = Counter()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._ids = itertools.count(0x1000, 0x100)
        self.primary = {d: FakeHandle(next(self._ids)) for d in range(ndev)}
        self.primary_refs = dict.fromkeys(range(ndev), 0)
        self.primary_life = dict.fromkeys(range(ndev), 1)  # a reset makes a new context
        self.ctx_device: dict[int, int] = {int(h): d for d, h in self.primary.items()}
        self.ctx_flags: dict[int, int] = {}
        self.destroyed: set[int] = set()
        self.resets: Counter[int] = Counter()  # device -> primary context resets
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
        if not 0 <= int(ordinal) < self.ndev:
            return (INVALID_DEVICE, FakeHandle(0))
        return (0, FakeHandle(int(ordinal)))

    def cuDevicePrimaryCtxRetain(self, dev: FakeHandle) -> tuple[int, FakeHandle]:
        self.calls["cuDevicePrimaryCtxRetain"] += 1
        with self._lock:
            self.primary_refs[int(dev)] += 1
        return (0, self.primary[int(dev)])

    def cuDevicePrimaryCtxRelease(self, dev: FakeHandle) -> tuple[int]:
        self.calls["cuDevicePrimaryCtxRelease"] += 1
        d = int(dev)
        with self._lock:
            if self.primary_refs[d] <= 0:
                return (INVALID_CONTEXT,)
            self.primary_refs[d] -= 1
            reset = self.primary_refs[d] == 0
        if reset:
            self.resets[d] += 1
            self.primary_life[d] += 1
            self.reset_context(int(self.primary[d]))
        return (0,)

    def cuDevicePrimaryCtxGetState(self, dev: FakeHandle) -> tuple[int, int, int]:
        d = int(dev)
        return (0, 0, int(self.primary_refs[d] > 0))

    def cuCtxGetId(self, ctx: FakeHandle) -> tuple[int, int]:
        """Unique per context: a primary context reset and made again gets a new id."""
        c = int(ctx)
        if c in self.destroyed or c not in self.ctx_device:
            return (CONTEXT_IS_DESTROYED, 0)
        for d, h in self.primary.items():
            if int(h) == c:
                return (0, (c << 20) | self.primary_life[d])
        return (0, c)

    def reset_context(self, ctx: int) -> None:
        """The primary context *ctx* was reset or destroyed: its resources are gone
        (subclasses drop their memory, streams and events here)."""

    def cuCtxCreate(self, *args: Any) -> tuple[int, FakeHandle]:
        self.calls["cuCtxCreate"] += 1
        if self.bindings_major >= 13:
            if len(args) != 3:
                raise TypeError(
                    "cuCtxCreate() takes exactly 3 positional arguments "
                    f"(ctxCreateParams, flags, dev) in cuda-bindings 13.x ({len(args)} given)"
                )
            params, flags, dev = args
            assert params is None or type(params).__name__ == "CUctxCreateParams", params
        else:
            if len(args) != 2:
                raise TypeError(
                    "cuCtxCreate() takes exactly 2 positional arguments (flags, dev) in "
                    f"cuda-bindings 12.x ({len(args)} given)"
                )
            flags, dev = args
        if not 0 <= int(dev) < self.ndev:
            return (INVALID_DEVICE, FakeHandle(0))
        h = FakeHandle(next(self._ids))
        with self._lock:
            self.ctx_device[int(h)] = int(dev)
            self.ctx_flags[int(h)] = int(flags)
        self.stack().append(h)
        return (0, h)

    def cuCtxDestroy(self, ctx: FakeHandle) -> tuple[int]:
        self.calls["cuCtxDestroy"] += 1
        c = int(ctx)
        if c in self.destroyed or c not in self.ctx_device:
            return (INVALID_CONTEXT,)
        self.destroyed.add(c)
        st = self.stack()
        if st and int(st[-1]) == c:
            st.pop()
        self.reset_context(c)
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

    def context_error(self) -> int:
        """The error a call needing the current context gets (0: none)."""
        cur = self.current()
        if not cur:
            return INVALID_CONTEXT
        if cur in self.destroyed:
            return CONTEXT_IS_DESTROYED
        return self.fault

    def cuCtxGetDevice(self) -> tuple[int, int]:
        cur = self.current()
        if not cur:
            return (INVALID_CONTEXT, 0)
        if cur in self.destroyed:
            return (CONTEXT_IS_DESTROYED, 0)
        return (0, self.ctx_device[cur])

    def cuCtxSynchronize(self) -> tuple[int]:
        self.calls["cuCtxSynchronize"] += 1
        return (self.context_error(),)

    def cuMemGetInfo(self) -> tuple[int, int, int]:
        """Device *d* has ``(d + 1)`` GiB, half of it free: each device answers apart."""
        err = self.context_error()
        if err:
            return (err, 0, 0)
        total = (self.ctx_device[self.current()] + 1) << 30
        return (0, total // 2, total)

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


def fresh_registry(monkeypatch: Any) -> None:
    """Give the process-wide ``ck.registry`` a new registry's state for one test (undone
    by monkeypatch): no contexts of an earlier driver, strict mode from the environment."""
    from ctxkit.binding import ContextRegistry, registry

    for name, value in vars(ContextRegistry()).items():
        monkeypatch.setattr(registry, name, value)


def swap_driver(monkeypatch: Any, fake: Any) -> None:
    """Make *fake* the driver of every ctxkit module for one test (undone by monkeypatch).

    Every family is imported first, so a module loaded later in the test cannot pick up
    the real driver; then each module's ``drv`` global is replaced. New pinned pool
    blocks come from ``cuMemHostAlloc`` (``CTXKIT_PINNED_ALLOC=hostalloc``), so tests
    count registrations of the caller's arrays only; the tests of the registering
    allocator (``tests/memory/test_pagelock_fake.py``) set ``register`` themselves.
    """
    import importlib
    import sys

    from ctxkit.context import thread_state
    from ctxkit.memory import host

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
    monkeypatch.setenv("CTXKIT_PINNED_ALLOC", "hostalloc")
    monkeypatch.setattr(host, "_refused", False)
    # a new driver: this thread's stack there is unknown, so outermost blocks ask again
    monkeypatch.setattr(thread_state(), "probe", True)


def spans_registration_edge(ranges: Any, ptr: int, n: int) -> bool:
    """True when host bytes ``[ptr, ptr + n)`` start inside a registered byte range
    ``(start, end)`` of *ranges* and end beyond it: the driver refuses such a copy with
    ``CUDA_ERROR_INVALID_VALUE`` (measured on H200, driver 580: a copy that starts
    before a registration and ends inside it or beyond it goes through)."""
    return any(s <= ptr < e < ptr + n for s, e in ranges)
