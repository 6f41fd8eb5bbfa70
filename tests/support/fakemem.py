"""A fake of the driver's memory, stream and event API for CPU tests of ctxkit.memory and
ctxkit.stream: the fake context stack of tests/support/fakedriver.py plus "device" memory
that is really host memory (so copies are bit-exact checks), streams, events, host
callbacks run on another thread, peer access and sticky errors. It records which context
was current for every call, which is how tests prove allocations and frees happen in the
owning context from any thread. Import the fixtures into a test module:
``from tests.support.fakemem import ctx0, ctx1, fake  # noqa: F401``.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import threading
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as real

import ctxkit as ck
from ctxkit.context import Context
from ctxkit.memory import host as _hostmem
from tests.support.fakedriver import FakeHandle, spans_registration_edge, swap_driver

# ======================================================================================
# A fake of the driver's memory / stream / event API on top of the fake context stack
# ======================================================================================

OK = 0
INVALID_VALUE = 1
OUT_OF_MEMORY = 2
INVALID_CONTEXT = 201
INVALID_HANDLE = 400
NOT_READY = 600
ILLEGAL_ADDRESS = 700
PEER_ALREADY = 704
HOST_ALREADY_REGISTERED = 712
HOST_NOT_REGISTERED = 713
PAGE = 4096
_HostFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeMemDriver:
    """Memory, streams, events and peer access; everything else goes to the context fake.

    ``cuMemHostRegister`` keeps the exact byte range (registrations may share a page but
    not a byte); a copy whose host bytes start inside a registration and end beyond it
    is ``CUDA_ERROR_INVALID_VALUE``, as on the driver.

    "Device" memory is host memory from ctypes, so copies really move bytes. Like the
    real driver, memsets, device-to-device/peer copies and host-to-device copies without
    a stream are only *queued* on the context's legacy default stream: they take effect
    when that stream is synchronized (``cuStreamSynchronize(0)``, ``cuCtxSynchronize``,
    a device-to-host copy, a free). Work on a ctxkit (non-blocking) stream runs at once,
    so it overtakes queued legacy work exactly as it may on a GPU.
    """

    CUstream = real.CUstream
    CUhostFn = real.CUhostFn
    CUpointer_attribute = real.CUpointer_attribute
    CUmem_advise = real.CUmem_advise
    CUmemLocation = real.CUmemLocation
    CUmemLocationType = real.CUmemLocationType
    CUdevice_attribute = real.CUdevice_attribute

    def __init__(self, base: Any, total: int = 1 << 20) -> None:
        self.base = base
        self.total = total
        self.used = 0
        self.allocs: dict[int, tuple[Any, int, int, str]] = {}  # addr -> (buf, n, ctx, kind)
        self.host_allocs: dict[int, tuple[Any, int, int]] = {}  # addr -> (buf, n, ctx)
        self.registered: dict[int, int] = {}  # start -> end, exact bytes as on the driver
        self.log: list[tuple[str, int, Any]] = []  # (call, current ctx, detail)
        self.streams: dict[int, int] = {}  # handle -> ctx
        self.stream_info: dict[int, tuple[int, int]] = {}  # handle -> (flags, priority)
        self.events: dict[int, tuple[int, int]] = {}  # handle -> (ctx, flags)
        self.host_funcs: dict[int, list[tuple[int, int]]] = {}
        self.waits: list[tuple[int, int]] = []
        self.peers: set[tuple[int, int]] = set()
        self.no_peer = False
        self.concurrent_managed = 1
        self.sticky: dict[int, int] = {}  # ctx -> error code
        self.host_oom = False
        self.legacy: dict[int, list[Any]] = {}  # ctx -> queued legacy-stream work
        self._ids = itertools.count(0x5000, 0x10)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    # helpers ----------------------------------------------------------------------
    def cur(self) -> int:
        return self.base.current()

    def note(self, call: str, detail: Any = None) -> None:
        self.log.append((call, self.cur(), detail))

    def calls(self, name: str) -> list[tuple[str, int, Any]]:
        return [e for e in self.log if e[0] == name]

    def _dev_range(self, ptr: int, n: int) -> bool:
        for addr, (_b, size, _c, _k) in self.allocs.items():
            if addr <= ptr and ptr + n <= addr + size:
                return True
        return False

    def _stream_ok(self, h: Any) -> int:
        v = int(h)
        if v in (0, 1, 2):
            return OK
        return OK if v in self.streams else INVALID_HANDLE

    def _err(self) -> int:
        # On current drivers a fault poisons every context of the process, not only its own.
        return next(iter(self.sticky.values()), OK)

    def _queue(self, work: Any) -> None:
        self.legacy.setdefault(self.cur(), []).append(work)

    def flush(self, ctx: int) -> None:
        """Run the legacy-stream work queued in *ctx* (the stream reached it)."""
        for work in self.legacy.pop(ctx, []):
            work()

    # device memory ----------------------------------------------------------------
    def _alloc(self, n: int, kind: str) -> tuple[int, int]:
        _size_t(n)
        if not self.cur():
            return (INVALID_CONTEXT, 0)
        if self.used + n > self.total:
            return (OUT_OF_MEMORY, 0)
        buf = ctypes.create_string_buffer(n)
        addr = ctypes.addressof(buf)
        self.allocs[addr] = (buf, n, self.cur(), kind)
        self.used += n
        self.note("alloc", (addr, n, kind))
        return (OK, addr)

    def cuMemAlloc(self, n: int) -> tuple[int, int]:
        return self._alloc(n, "device")

    def cuMemAllocManaged(self, n: int, flags: int) -> tuple[int, int]:
        assert flags == 1
        return self._alloc(n, "managed")

    def cuMemFree(self, ptr: Any) -> tuple[int]:
        p = int(ptr)
        entry = self.allocs.get(p)
        if entry is None:
            return (INVALID_VALUE,)
        if self.cur() != entry[2]:
            return (INVALID_CONTEXT,)
        self.flush(self.cur())
        del self.allocs[p]
        self.used -= entry[1]
        self.note("free", p)
        return (OK,)

    def cuMemGetInfo(self) -> tuple[int, int, int]:
        if not self.cur():
            return (INVALID_CONTEXT, 0, 0)
        return (OK, self.total - self.used, self.total)

    def _copy(
        self,
        name: str,
        dst: int,
        src: int,
        n: int,
        stream: Any = None,
        queued: bool = False,
        host: int | None = None,
    ) -> tuple[int]:
        """*host*: the address of the host side, whose bytes must not start inside a
        registration and end beyond it (the driver refuses that copy)."""
        if not self.cur():
            return (INVALID_CONTEXT,)
        if self._err():
            return (self._err(),)
        ranges = list(self.registered.items())
        if host is not None and spans_registration_edge(ranges, int(host), n):
            return (INVALID_VALUE,)
        if stream is not None and self._stream_ok(stream):
            return (INVALID_HANDLE,)
        self.note(name, (n, None if stream is None else int(stream)))
        if queued:
            staged = ctypes.create_string_buffer(ctypes.string_at(int(src), n), n)
            self._queue(lambda: ctypes.memmove(int(dst), staged, n))
        else:
            ctypes.memmove(int(dst), int(src), n)
        return (OK,)

    def cuMemcpyHtoD(self, dst: int, src: int, n: int) -> tuple[int]:
        assert self._dev_range(dst, n)
        return self._copy("HtoD", dst, src, n, queued=True, host=src)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, s: Any) -> tuple[int]:
        assert self._dev_range(dst, n)
        return self._copy("HtoDAsync", dst, src, n, s, host=src)

    def cuMemcpyDtoH(self, dst: int, src: int, n: int) -> tuple[int]:
        assert self._dev_range(src, n)
        self.flush(self.cur())
        return self._copy("DtoH", dst, src, n, host=dst)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, n: int, s: Any) -> tuple[int]:
        assert self._dev_range(src, n)
        return self._copy("DtoHAsync", dst, src, n, s, host=dst)

    def cuMemcpyDtoD(self, dst: int, src: int, n: int) -> tuple[int]:
        assert self._dev_range(src, n) and self._dev_range(dst, n)
        return self._copy("DtoD", dst, src, n, queued=True)

    def cuMemcpyDtoDAsync(self, dst: int, src: int, n: int, s: Any) -> tuple[int]:
        return self._copy("DtoDAsync", dst, src, n, s)

    def cuMemcpyPeer(self, dst: int, dctx: Any, src: int, sctx: Any, n: int) -> tuple[int]:
        self.note("Peer", (int(dctx), int(sctx)))
        return self._copy("PeerCopy", dst, src, n, queued=True)

    def cuMemcpyPeerAsync(
        self, dst: int, dctx: Any, src: int, sctx: Any, n: int, s: Any
    ) -> tuple[int]:
        self.note("PeerAsync", (int(dctx), int(sctx), int(s)))
        return self._copy("PeerCopy", dst, src, n, s)

    def cuMemsetD8(self, ptr: int, value: int, n: int) -> tuple[int]:
        assert self._dev_range(ptr, n)
        self.note("memset", (value, n))
        self._queue(lambda: ctypes.memset(ptr, value, n))
        return (OK,)

    def cuMemsetD8Async(self, ptr: int, value: int, n: int, s: Any) -> tuple[int]:
        self.note("memsetAsync", (value, n, int(s)))
        ctypes.memset(ptr, value, n)
        return (OK,)

    # host memory ------------------------------------------------------------------
    def cuMemHostAlloc(self, n: int, flags: int) -> tuple[int, int]:
        _size_t(n)
        if not self.cur():
            return (INVALID_CONTEXT, 0)
        if self.host_oom:
            return (OUT_OF_MEMORY, 0)
        buf = ctypes.create_string_buffer(n + PAGE)
        addr = (ctypes.addressof(buf) + PAGE - 1) // PAGE * PAGE
        self.host_allocs[addr] = (buf, n, self.cur())
        self.note("hostalloc", (n, flags))
        return (OK, addr)

    def cuMemFreeHost(self, p: int) -> tuple[int]:
        entry = self.host_allocs.get(int(p))
        if entry is None:
            return (INVALID_VALUE,)
        if not self.cur():
            return (INVALID_CONTEXT,)
        del self.host_allocs[int(p)]
        self.note("freehost", int(p))
        return (OK,)

    def cuMemHostRegister(self, p: int, n: int, flags: int) -> tuple[int]:
        if not self.cur():
            return (INVALID_CONTEXT,)
        if any(s < p + n and p < e for s, e in self.registered.items()):
            return (HOST_ALREADY_REGISTERED,)
        self.registered[p] = p + n
        self.note("register", (p, n, flags))
        return (OK,)

    def cuMemHostUnregister(self, p: int) -> tuple[int]:
        if p not in self.registered:
            return (HOST_NOT_REGISTERED,)
        del self.registered[p]
        self.note("unregister", p)
        return (OK,)

    def cuPointerGetAttribute(self, attr: Any, ptr: int) -> tuple[int, Any]:
        A = real.CUpointer_attribute
        p = int(ptr)
        for addr, (_b, n, ctx, kind) in self.allocs.items():
            if addr <= p < addr + n:
                if attr == A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
                    return (OK, 2)
                if attr == A.CU_POINTER_ATTRIBUTE_IS_MANAGED:
                    return (OK, kind == "managed")
                if attr == A.CU_POINTER_ATTRIBUTE_CONTEXT:
                    return (OK, FakeHandle(ctx))
                if attr == A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
                    return (OK, self.base.ctx_device[ctx])
        pinned = any(a <= p < a + n for a, (_b, n, _c) in self.host_allocs.items()) or any(
            s <= p < e for s, e in self.registered.items()
        )
        if pinned and attr == A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
            return (OK, 1)
        return (INVALID_VALUE, None)

    # streams and events ---------------------------------------------------------
    def cuCtxGetStreamPriorityRange(self) -> tuple[int, int, int]:
        return (OK, 0, -5)

    def cuStreamCreateWithPriority(self, flags: int, priority: int) -> tuple[int, Any]:
        if not self.cur():
            return (INVALID_CONTEXT, None)
        h = next(self._ids)
        self.streams[h] = self.cur()
        self.stream_info[h] = (flags, priority)
        self.note("streamcreate", (h, flags, priority))
        return (OK, FakeHandle(h))

    def cuStreamDestroy(self, h: Any) -> tuple[int]:
        if self.streams.get(int(h)) != self.cur():
            return (INVALID_CONTEXT,)
        del self.streams[int(h)]
        self.note("streamdestroy", int(h))
        return (OK,)

    def cuStreamGetFlags(self, h: Any) -> tuple[int, int]:
        entry = self.stream_info.get(int(h))
        return (OK, entry[0]) if entry else (INVALID_HANDLE, 0)

    def cuStreamGetPriority(self, h: Any) -> tuple[int, int]:
        entry = self.stream_info.get(int(h))
        return (OK, entry[1]) if entry else (INVALID_HANDLE, 0)

    def cuStreamGetCtx(self, h: Any) -> tuple[int, Any]:
        ctx = self.streams.get(int(h))
        return (OK, FakeHandle(ctx)) if ctx else (INVALID_HANDLE, None)

    def cuStreamSynchronize(self, h: Any) -> tuple[int]:
        if self._stream_ok(h):
            return (INVALID_HANDLE,)
        self.note("streamsync", int(h))
        if int(h) == 0:
            self.flush(self.cur())
        funcs = self.host_funcs.pop(int(h), [])
        if funcs:  # the driver runs host functions on its own thread
            t = threading.Thread(target=lambda: [_HostFn(f)(u) for f, u in funcs])
            t.start()
            t.join()
        return (self._err(),)

    def cuStreamQuery(self, h: Any) -> tuple[int]:
        return (OK,) if not self.host_funcs.get(int(h)) else (NOT_READY,)

    def cuStreamWaitEvent(self, h: Any, ev: Any, flags: int) -> tuple[int]:
        self.note("wait", (int(h), int(ev)))
        self.waits.append((int(h), int(ev)))
        return (OK,)

    def cuLaunchHostFunc(self, h: Any, fn: Any, user: int) -> tuple[int]:
        self.note("hostfunc", int(h))
        self.host_funcs.setdefault(int(h), []).append((int(fn), int(user)))
        return (OK,)

    def cuCtxSynchronize(self) -> tuple[int]:
        if not self.cur():
            return (INVALID_CONTEXT,)
        self.note("ctxsync")
        self.flush(self.cur())
        return (self._err(),)

    def cuEventCreate(self, flags: int) -> tuple[int, Any]:
        if not self.cur():
            return (INVALID_CONTEXT, None)
        h = next(self._ids)
        self.events[h] = (self.cur(), flags)
        return (OK, FakeHandle(h))

    def cuEventDestroy(self, h: Any) -> tuple[int]:
        if self.events.get(int(h), (None,))[0] != self.cur():
            return (INVALID_CONTEXT,)
        del self.events[int(h)]
        self.note("eventdestroy", int(h))
        return (OK,)

    def cuEventRecord(self, ev: Any, s: Any) -> tuple[int]:
        sctx = self.streams.get(int(s), self.cur())
        if self.events[int(ev)][0] != sctx:
            return (INVALID_HANDLE,)
        self.note("record", (int(ev), int(s)))
        return (OK,)

    def cuEventQuery(self, ev: Any) -> tuple[int]:
        return (OK,)

    def cuEventSynchronize(self, ev: Any) -> tuple[int]:
        self.note("eventsync", int(ev))
        return (self._err(),)

    def cuEventElapsedTime(self, a: Any, b: Any) -> tuple[int, float]:
        return (OK, 1.5)

    # peers, attributes, managed hints ------------------------------------------
    def cuDeviceCanAccessPeer(self, a: Any, b: Any) -> tuple[int, int]:
        return (OK, 0 if self.no_peer else 1)

    def cuCtxEnablePeerAccess(self, peer: Any, flags: int) -> tuple[int]:
        key = (self.cur(), int(peer))
        self.note("enablepeer", key)
        if key in self.peers:
            return (PEER_ALREADY,)
        self.peers.add(key)
        return (OK,)

    def cuDeviceGetAttribute(self, attr: Any, dev: Any) -> tuple[int, int]:
        if attr == real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
            return (OK, self.concurrent_managed)
        return (OK, 0)

    def cuMemPrefetchAsync(self, *args: Any) -> tuple[int]:
        self.note("prefetch", args)
        return (OK,)

    def cuMemAdvise(self, *args: Any) -> tuple[int]:
        self.note("advise", args)
        return (OK,)


def install(monkeypatch: pytest.MonkeyPatch, f: Any) -> Any:
    """Patch the memory fake *f* into every ctxkit module for one test, with the memory
    family's per-process records (peer pairs, concurrent-managed answers, strict copies,
    the raw pointer query) reset; returns *f*."""
    from ctxkit import _driver
    from ctxkit.memory import copies as _copies
    from ctxkit.memory import managed as _managed

    swap_driver(monkeypatch, f)
    monkeypatch.setattr(_managed, "_concurrent_managed", {})
    monkeypatch.setattr(_copies, "_peer_pairs", {})
    monkeypatch.setattr(_hostmem, "_strict", False)
    monkeypatch.setattr(_driver, "_raw_pointer_get_attribute", False)
    return f


@pytest.fixture
def fake(fake_driver, monkeypatch):
    """The context fake of conftest, extended with memory/streams, patched everywhere."""
    yield install(monkeypatch, FakeMemDriver(fake_driver))
    gc.collect()


@pytest.fixture
def ctx0(fake) -> Context:
    return ck.registry.context(0)


@pytest.fixture
def ctx1(fake) -> Context:
    return ck.registry.context(1)


def rand_bytes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def in_thread(fn: Any) -> Any:
    """Run fn() in a fresh thread (no context current there); return or raise its result."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _size_t(n: int) -> None:
    """The bindings refuse a size that does not fit a ``size_t``, as OverflowError."""
    if not 0 <= n < 1 << 64:
        raise OverflowError(f"size {n} does not fit a size_t")
