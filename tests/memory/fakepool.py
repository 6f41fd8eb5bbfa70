"""The fake memory driver of tests/support/fakemem.py plus stream-ordered allocation and
memory pools, for CPU tests of the block cache and MemoryPool.

Like the real driver, ``cuMemAllocAsync`` / ``cuMemFreeAsync`` need the context current
and a valid stream of it; a pool's used bytes drop only when the stream of a free has
reached it (the fake completes a free at the next ``cuStreamSynchronize`` of its stream
or ``cuCtxSynchronize``), and ``cuMemPoolTrimTo`` releases what is reserved and unused.
Import the fixtures: ``from tests.memory.fakepool import ctx0, ctx1, pfake  # noqa: F401``.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
from cuda.bindings import driver as real

import ctxkit as ck
from ctxkit.context import Context
from ctxkit.memory import alloc
from tests.support.fakedriver import FakeHandle
from tests.support.fakemem import (
    INVALID_CONTEXT,
    INVALID_HANDLE,
    INVALID_VALUE,
    OK,
    OUT_OF_MEMORY,
    FakeMemDriver,
    install,
)

DEFAULT_POOL = 0x7000


class FakePoolDriver(FakeMemDriver):
    """Stream-ordered allocation from per-device pools (handle -> state)."""

    CUmemPoolProps = real.CUmemPoolProps
    CUmemAllocationType = real.CUmemAllocationType
    CUmemAllocationHandleType = real.CUmemAllocationHandleType
    CUmemPool_attribute = real.CUmemPool_attribute
    CUmemoryPool = real.CUmemoryPool
    cuuint64_t = real.cuuint64_t

    def __init__(self, base: Any, total: int = 1 << 20) -> None:
        super().__init__(base, total)
        self.pools: dict[int, dict[str, int]] = {}  # handle -> used/reserved/threshold
        self.pool_of: dict[int, int] = {}  # address -> pool
        self.pending: dict[int, list[int]] = {}  # stream -> addresses freed, not reached
        self.fail_next_async_oom = 0
        # the log and the memory counters are shared by every thread of a test
        self._lock = threading.RLock()

    def note(self, call: str, detail: Any = None) -> None:
        with self._lock:
            super().note(call, detail)

    def _pool(self, handle: int) -> dict[str, int]:
        return self.pools.setdefault(handle, {"used": 0, "reserved": 0, "threshold": 0})

    def _ctx_device(self) -> int:
        return self.base.ctx_device[self.cur()]

    def cuDeviceGetDefaultMemPool(self, dev: Any) -> tuple[int, Any]:
        return (OK, FakeHandle(DEFAULT_POOL + int(dev)))

    def cuMemPoolCreate(self, props: Any) -> tuple[int, Any]:
        h = next(self._ids)
        self._pool(h)
        return (OK, FakeHandle(h))

    def cuMemPoolDestroy(self, pool: Any) -> tuple[int]:
        self.pools.pop(int(pool), None)
        self.note("pooldestroy", int(pool))
        return (OK,)

    def _alloc_async(self, n: int, pool: int, s: Any) -> tuple[int, int]:
        if not self.cur():
            return (INVALID_CONTEXT, 0)
        if self._stream_ok(s):
            return (INVALID_HANDLE, 0)
        if self.fail_next_async_oom:
            self.fail_next_async_oom -= 1
            return (OUT_OF_MEMORY, 0)
        with self._lock:  # the entry _alloc logs is the last one until the lock is let go
            err, addr = self._alloc(n, "async")
            if err:
                return (err, 0)
            self.log[-1] = ("allocasync", self.cur(), (addr, n, int(s)))
            st = self._pool(pool)
            st["used"] += n
            st["reserved"] = max(st["reserved"], st["used"])
            self.pool_of[addr] = pool
        return (OK, addr)

    def cuMemAllocAsync(self, n: int, s: Any) -> tuple[int, int]:
        return self._alloc_async(n, DEFAULT_POOL + self._ctx_device(), s)

    def cuMemAllocFromPoolAsync(self, n: int, pool: Any, s: Any) -> tuple[int, int]:
        return self._alloc_async(n, int(pool), s)

    def cuMemFreeAsync(self, ptr: Any, s: Any) -> tuple[int]:
        p = int(ptr)
        entry = self.allocs.get(p)
        if entry is None or entry[3] != "async":
            return (INVALID_VALUE,)
        if self.cur() != entry[2]:
            return (INVALID_CONTEXT,)
        if self._stream_ok(s):
            return (INVALID_HANDLE,)
        self.note("freeasync", (p, int(s)))
        self.pending.setdefault(int(s), []).append(p)
        return (OK,)

    def _complete(self, stream: int) -> None:
        with self._lock:
            for p in self.pending.pop(stream, []):
                _buf, n, _ctx, _kind = self.allocs.pop(p)
                self.used -= n
                self._pool(self.pool_of.pop(p))["used"] -= n

    def cuStreamSynchronize(self, h: Any) -> tuple[int]:
        res = super().cuStreamSynchronize(h)
        self._complete(int(h))
        return res

    def cuCtxSynchronize(self) -> tuple[int]:
        res = super().cuCtxSynchronize()
        for s in [s for s in self.pending if s in (0, 1) or self.streams.get(s) == self.cur()]:
            self._complete(s)
        return res

    def cuMemPoolGetAttribute(self, pool: Any, attr: Any) -> tuple[int, int]:
        st = self._pool(int(pool))
        name = attr.name
        if name.endswith("USED_MEM_CURRENT"):
            return (OK, st["used"])
        if name.endswith("RESERVED_MEM_CURRENT"):
            return (OK, st["reserved"])
        if name.endswith("RELEASE_THRESHOLD"):
            return (OK, st["threshold"])
        return (OK, 0)

    def cuMemPoolSetAttribute(self, pool: Any, attr: Any, value: Any) -> tuple[int]:
        if attr.name.endswith("RELEASE_THRESHOLD"):
            self._pool(int(pool))["threshold"] = int(value)
        return (OK,)

    def cuMemPoolTrimTo(self, pool: Any, keep: int) -> tuple[int]:
        st = self._pool(int(pool))
        st["reserved"] = max(st["used"], min(st["reserved"], keep))
        self.note("trim", int(pool))
        return (OK,)

    # what the tests look at ----------------------------------------------------------
    def async_allocs(self) -> list[tuple[int, int, int]]:
        """``(address, bytes, stream)`` of every cuMemAllocAsync, oldest first."""
        return [e[2] for e in self.log if e[0] == "allocasync"]

    def async_frees(self) -> list[tuple[int, int]]:
        """``(address, stream)`` of every cuMemFreeAsync, oldest first."""
        return [e[2] for e in self.log if e[0] == "freeasync"]

    def live_async(self) -> int:
        """Stream-ordered allocations not freed (in a cache or in use)."""
        pending = {p for ps in self.pending.values() for p in ps}
        return sum(1 for a, e in self.allocs.items() if e[3] == "async" and a not in pending)


@pytest.fixture
def pfake(fake_driver, monkeypatch):
    """The memory fake with pools, patched everywhere, and an empty enabled block cache."""
    f = install(monkeypatch, FakePoolDriver(fake_driver))
    monkeypatch.delenv("CTXKIT_ALLOC_CACHE", raising=False)
    _reset_cache()
    yield f
    # This teardown runs before monkeypatch's undo: drop a value the test set, or the
    # cache would keep its settings (or its error) for the tests after this one.
    monkeypatch.delenv("CTXKIT_ALLOC_CACHE", raising=False)
    _reset_cache()
    gc.collect()


def _reset_cache() -> None:
    with alloc._lock:
        alloc._caches.clear()
        alloc._held.clear()
        alloc._limits.clear()
    alloc.configure()


@pytest.fixture
def ctx0(pfake) -> Context:
    return ck.registry.context(0)


@pytest.fixture
def ctx1(pfake) -> Context:
    return ck.registry.context(1)
