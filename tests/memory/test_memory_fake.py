"""CPU tests of ctxkit.memory and ctxkit.stream.

Two kinds:

* pure logic that needs no driver (DLPack capsules consumed by numpy, stream-handle
  conversion, the pageable-copy warning and strict mode, host-array validation, the
  host-callback trampoline, and the errors users get on a machine without a driver);
* the full API against ``FakeMemDriver``: the fake context stack of
  ``tests/support/fakedriver.py`` plus "device" memory that is really host memory (so copies are
  bit-exact checks), streams, events, host callbacks run on another thread, peer access
  and sticky errors. It records which context was current for every call, which is how
  these tests prove allocations and frees happen in the owning context from any thread.

The GPU suite (tests/memory/test_device_gpu.py, tests/core/test_stream_gpu.py, ...) is the
truth for the real driver's behaviour.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import logging
import subprocess
import sys
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as real

import ctxkit as ck
import ctxkit.memory as memory
from ctxkit import stream
from ctxkit.context import Context
from ctxkit.errors import (
    ContextClosedError,
    ContextPoisonedError,
    CudaError,
    DriverNotFoundError,
    NoCurrentContextError,
    OutOfMemoryError,
)
from ctxkit.memory import (
    DeviceArray,
    DeviceBuffer,
    ManagedBuffer,
    PageableCopyError,
    PageableCopyWarning,
)
from ctxkit.memory import dlpack as _dlpack
from ctxkit.memory import host as _hostmem
from ctxkit.stream import Event, Stream, stream_handle
from tests.conftest import GPU_COUNT
from tests.support.fakedriver import FakeHandle, swap_driver

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
        self.registered: dict[int, tuple[int, int, int]] = {}  # start -> (end, page range)
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
        return self.sticky.get(self.cur(), OK)

    def _queue(self, work: Any) -> None:
        self.legacy.setdefault(self.cur(), []).append(work)

    def flush(self, ctx: int) -> None:
        """Run the legacy-stream work queued in *ctx* (the stream reached it)."""
        for work in self.legacy.pop(ctx, []):
            work()

    # device memory ----------------------------------------------------------------
    def _alloc(self, n: int, kind: str) -> tuple[int, int]:
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
        self, name: str, dst: int, src: int, n: int, stream: Any = None, queued: bool = False
    ) -> tuple[int]:
        if not self.cur():
            return (INVALID_CONTEXT,)
        if self._err():
            return (self._err(),)
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
        return self._copy("HtoD", dst, src, n, queued=True)

    def cuMemcpyHtoDAsync(self, dst: int, src: int, n: int, s: Any) -> tuple[int]:
        assert self._dev_range(dst, n)
        return self._copy("HtoDAsync", dst, src, n, s)

    def cuMemcpyDtoH(self, dst: int, src: int, n: int) -> tuple[int]:
        assert self._dev_range(src, n)
        self.flush(self.cur())
        return self._copy("DtoH", dst, src, n)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, n: int, s: Any) -> tuple[int]:
        assert self._dev_range(src, n)
        return self._copy("DtoHAsync", dst, src, n, s)

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
        start, end = p // PAGE * PAGE, (p + n + PAGE - 1) // PAGE * PAGE
        for _e, s, e in self.registered.values():
            if start < e and s < end:
                return (HOST_ALREADY_REGISTERED,)
        self.registered[p] = (p + n, start, end)
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
            s <= p < e for s, (e, _ps, _pe) in self.registered.items()
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
        return (self.sticky.get(self.streams.get(int(h), self.cur()), OK),)

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


@pytest.fixture
def fake(fake_driver, monkeypatch):
    """The context fake of conftest, extended with memory/streams, patched everywhere."""
    from ctxkit import _driver
    from ctxkit.memory import copies as _copies
    from ctxkit.memory import managed as _managed

    f = FakeMemDriver(fake_driver)
    swap_driver(monkeypatch, f)
    monkeypatch.setattr(_managed, "_concurrent_managed", {})
    monkeypatch.setattr(_copies, "_peer_pairs", {})
    monkeypatch.setattr(_hostmem, "_strict", False)
    monkeypatch.setattr(_driver, "_raw_pointer_get_attribute", False)
    yield f
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


# ======================================================================================
# DLPack capsules (no driver needed: numpy consumes host-memory capsules)
# ======================================================================================


class HostProducer:
    """Exports a numpy array through ctxkit's capsule builder (as kDLCPU)."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.KDL_CPU, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        versioned = max_version is not None and max_version[0] >= 1
        return _dlpack.to_capsule(
            self.arr.ctypes.data,
            self.arr.shape,
            self.arr.dtype,
            (_dlpack.KDL_CPU, 0),
            self.arr,
            versioned=versioned,
        )


class LegacyConsumerView(HostProducer):
    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return super().__dlpack__(stream)


@pytest.mark.parametrize("producer", [HostProducer, LegacyConsumerView])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.complex64, np.bool_])
def test_dlpack_capsule_is_consumed_without_copy(producer, dtype):
    src = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
    before = _dlpack.live_count()
    out = np.from_dlpack(producer(src))
    assert out.ctypes.data == src.ctypes.data and out.dtype == src.dtype
    np.testing.assert_array_equal(out, src)
    assert _dlpack.live_count() == before + 1
    del out
    gc.collect()
    assert _dlpack.live_count() == before


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_unconsumed_capsule_releases_its_tensor(versioned):
    arr = np.zeros(5, np.float64)
    before = _dlpack.live_count()
    cap = _dlpack.to_capsule(
        arr.ctypes.data, arr.shape, arr.dtype, (2, 1), arr, versioned=versioned
    )
    assert _dlpack.live_count() == before + 1
    del cap
    gc.collect()
    assert _dlpack.live_count() == before


def read_capsule(cap: Any) -> tuple[Any, str]:
    """The DLTensor of a capsule (either kind) and the capsule name."""
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    name = get_name(cap).decode()
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    addr = get_ptr(cap, name.encode())
    cls = _dlpack.DLManagedTensorVersioned if "versioned" in name else _dlpack.DLManagedTensor
    return cls.from_address(addr), name


def test_dlpack_capsule_fields():
    arr = np.zeros((3, 5), np.float32)
    cap = _dlpack.to_capsule(0x7000, (3, 5), arr.dtype, (2, 1), arr, versioned=True, read_only=True)
    m, name = read_capsule(cap)
    assert name == "dltensor_versioned"
    assert (m.version.major, m.version.minor) == _dlpack.DLPACK_VERSION
    assert m.flags == _dlpack.FLAG_READ_ONLY
    t = m.dl_tensor
    assert t.data == 0x7000 and (t.device.device_type, t.device.device_id) == (2, 1)
    assert t.ndim == 2 and [t.shape[0], t.shape[1]] == [3, 5] and not t.strides
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)


def test_dlpack_strides_are_in_elements():
    arr = np.zeros((4, 4), np.int16)[:, ::2]
    strides = tuple(s // arr.itemsize for s in arr.strides)
    cap = _dlpack.to_capsule(arr.ctypes.data, arr.shape, arr.dtype, (1, 0), arr, strides=strides)
    m, name = read_capsule(cap)
    assert name == "dltensor"
    assert [m.dl_tensor.strides[0], m.dl_tensor.strides[1]] == [4, 2]


@pytest.mark.parametrize("dtype", [object, np.dtype([("a", "i4"), ("b", "f4")]), "U3"])
def test_dlpack_rejects_non_numeric_dtypes(dtype):
    with pytest.raises(BufferError, match="no DLPack equivalent"):
        _dlpack.dlpack_dtype(np.dtype(dtype))


# ======================================================================================
# stream handles, pageable warnings, strict mode, host-array validation
# ======================================================================================


class CudaStreamProto:
    def __cuda_stream__(self):
        return (0, 0x1234)


class CupyLike:
    ptr = 0x2345


class TorchLike:
    cuda_stream = 0x3456


@pytest.mark.parametrize(
    ("obj", "value"),
    [
        (None, 0),
        (7, 7),
        (real.CUstream(0x55), 0x55),
        (CudaStreamProto(), 0x1234),
        (CupyLike(), 0x2345),
        (TorchLike(), 0x3456),
    ],
)
def test_stream_handle_conversions(obj, value):
    h = stream_handle(obj)
    assert isinstance(h, real.CUstream) and int(h) == value


@pytest.mark.parametrize("bad", [True, 1.5, "s", object()])
def test_stream_handle_rejects_other_objects(bad):
    with pytest.raises(TypeError, match="stream"):
        stream_handle(bad)


def test_pageable_warning_points_at_the_caller_once_per_call_site():
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        for _ in range(3):
            _hostmem.pageable_async("DeviceBuffer.copy_from_host")  # one call site
        _hostmem.pageable_async("DeviceBuffer.copy_to_host")  # another one
    assert [w.category for w in got] == [PageableCopyWarning, PageableCopyWarning]
    assert all(w.filename == __file__ for w in got)
    msg = str(got[0].message)
    assert "7.8 GB/s" in msg and "pinned_empty" in msg and "register_host" in msg
    assert issubclass(PageableCopyWarning, UserWarning)


def test_strict_async_raises(monkeypatch):
    monkeypatch.setattr(_hostmem, "_strict", False)
    memory.set_strict_async(True)
    assert memory.strict_async()
    with pytest.raises(PageableCopyError, match="strict async mode"):
        _hostmem.pageable_async("copy")
    memory.set_strict_async(False)
    assert not memory.strict_async()
    assert issubclass(PageableCopyError, ValueError)


@pytest.mark.parametrize(("value", "expected"), [("1", "True"), ("0", "False"), ("", "False")])
def test_strict_async_from_environment(value, expected):
    code = "import ctxkit.memory as m; print(m.strict_async())"
    env = {"CTXKIT_STRICT_ASYNC": value, "PATH": "", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == expected, out.stderr


def test_host_array_validation():
    assert _hostmem.host_array(b"abc", "w").tolist() == [97, 98, 99]
    with pytest.raises(TypeError, match="numpy array or a buffer"):
        _hostmem.host_array([1, 2, 3], "w")
    with pytest.raises(ValueError, match="C-contiguous"):
        _hostmem.host_array(np.zeros((4, 4))[:, 1], "w")
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _hostmem.host_array(ro, "w", writable=True)


@pytest.mark.skipif(GPU_COUNT > 0, reason="checks the behaviour without a driver")
def test_without_a_driver_the_errors_say_so():
    with pytest.raises(DriverNotFoundError):
        DeviceBuffer(16)
    with pytest.raises(DriverNotFoundError):
        ck.pinned_empty(4, np.float32)
    with pytest.raises(DriverNotFoundError):
        Stream()


def test_validation_happens_before_the_driver_is_needed():
    with pytest.raises(ValueError, match="negative"):
        ck.pinned_empty((2, -1))
    with pytest.raises(TypeError, match="ints"):
        ck.pinned_empty((2.5,))
    with pytest.raises(TypeError, match="nbytes must be an int"):
        DeviceBuffer(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        DeviceBuffer(-1)
    with pytest.raises(ValueError, match="C-contiguous"), ck.register_host(np.zeros((4, 4)).T):
        pass


def test_host_callback_trampoline_from_a_foreign_thread(caplog):
    """The ctypes thunk the driver calls runs the callable and keeps its exception."""
    holder = Stream.__new__(Stream)
    holder._setup(None, FakeHandle(1), True, 0, owned=False, owner=None)  # type: ignore[arg-type]
    seen = []
    key_ok, key_bad = next(stream._keys), next(stream._keys)
    stream._pending[key_ok] = (
        lambda: seen.append(threading.current_thread().name),
        holder_ref(holder),
    )
    stream._pending[key_bad] = (lambda: 1 / 0, holder_ref(holder))
    fn = _HostFn(stream._HOST_FN_ADDR)
    t = threading.Thread(target=lambda: (fn(key_ok), fn(key_bad), fn(99999)), name="driver")
    t.start()
    t.join()
    assert seen == ["driver"]
    assert len(holder._callback_errors) == 1
    assert isinstance(holder._callback_errors[0], ZeroDivisionError)
    assert key_ok not in stream._pending and key_bad not in stream._pending
    with pytest.raises(ZeroDivisionError):
        holder._raise_callback_error()
    assert holder._callback_errors == []
    # the stream is gone before its callback fails: the error is logged, not lost
    key = next(stream._keys)
    gone = Stream.__new__(Stream)
    gone._setup(None, FakeHandle(2), True, 0, owned=False, owner=None)  # type: ignore[arg-type]
    stream._pending[key] = (lambda: 1 / 0, holder_ref(gone))
    del gone
    gc.collect()
    with caplog.at_level(logging.ERROR, logger="ctxkit.stream"):
        fn(key)
    assert "after its stream was dropped" in caplog.text


def holder_ref(s: Stream) -> Any:
    return weakref.ref(s)


# ======================================================================================
# DeviceBuffer against the fake driver
# ======================================================================================


def test_buffer_allocates_in_the_current_context(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(100)
    assert buf.context is ctx0 and buf.nbytes == 100 and buf.device.ordinal == 0
    assert fake.calls("alloc")[-1][1] == ctx0.handle
    assert "nbytes=100" in repr(buf)


def test_buffer_context_argument_is_bound_for_the_allocation(fake, ctx0, ctx1):
    with ctx0:
        buf = DeviceBuffer(64, context=ctx1)
        other = DeviceBuffer(64, context=1)
        assert fake.cur() == ctx0.handle
    assert buf.context is ctx1 and other.context is ctx1
    assert [c[1] for c in fake.calls("alloc")] == [ctx1.handle, ctx1.handle]


def test_buffer_without_a_current_context_names_the_fix(fake, ctx0):
    with pytest.raises(NoCurrentContextError, match=r"ctxkit.bind"):
        in_thread(lambda: DeviceBuffer(16))


def test_zero_size_buffer_allocates_nothing(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(0)
        buf.copy_from_host(np.zeros(0, np.uint8))
        assert buf.copy_to_host().size == 0
        buf.memset(3)
    assert not fake.calls("alloc") and not fake.calls("HtoD") and not fake.calls("memset")
    buf.close()
    assert buf.closed


def test_out_of_memory_reports_requested_and_free_bytes(fake, ctx0):
    with ctx0:
        keep = DeviceBuffer(1000)
        with pytest.raises(OutOfMemoryError) as info:
            DeviceBuffer(fake.total)
    exc = info.value
    assert exc.requested == fake.total and exc.free == fake.total - 1000  # type: ignore[attr-defined]
    assert f"{fake.total} bytes" in str(exc) and f"{fake.total - 1000} bytes" in str(exc)
    assert exc.name == "CUDA_ERROR_OUT_OF_MEMORY" and isinstance(exc, MemoryError)
    keep.close()


def test_close_is_idempotent_and_use_after_close_is_clear(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(32)
        view = buf[8:16]
        buf.close()
        buf.close()
        assert fake.used == 0 and buf.closed and view.closed
        for op in (
            lambda: buf.ptr,
            lambda: buf.copy_from_host(np.zeros(32, np.uint8)),
            lambda: buf.copy_to_host(),
            lambda: buf.memset(0),
            lambda: view.copy_to_host(),
            lambda: buf.view(),
            lambda: buf[0:4],
        ):
            with pytest.raises(ContextClosedError, match="closed"):
                op()
    assert "closed" in repr(buf)
    assert len(fake.calls("free")) == 1


def test_from_pointer_wraps_without_owning(fake, ctx0):
    class Owner:
        pass

    with ctx0:
        real_buf = DeviceBuffer(32)
        owner = Owner()
        alive = weakref.ref(owner)
        wrapped = DeviceBuffer.from_pointer(real_buf.ptr + 8, 16, owner=owner)
        del owner
        gc.collect()
        assert alive() is not None and wrapped.context is ctx0
        wrapped.copy_from_host(np.arange(16, dtype=np.uint8))
        assert real_buf.copy_to_host()[8:24].tolist() == list(range(16))
        assert wrapped.view((4,), np.float32).ptr == real_buf.ptr + 8
        wrapped.close()  # forgets the memory and the owner; frees nothing
        gc.collect()
        assert alive() is None and fake.used == 32 and not fake.calls("free")
        with pytest.raises(ContextClosedError):
            wrapped.copy_to_host()
        bare = DeviceBuffer.from_pointer(real_buf.ptr, 32, context=0)
        assert bare.context is ctx0 and bare.nbytes == 32


def test_context_manager_closes(fake, ctx0):
    with ctx0, DeviceBuffer(8) as buf:
        assert not buf.closed
    assert buf.closed and fake.used == 0


def test_buffer_dropped_in_another_thread_is_freed_in_its_context(fake, ctx0, ctx1):
    holder: dict[str, Any] = {}

    def make() -> None:
        with ctx1:
            holder["buf"] = DeviceBuffer(4096)

    in_thread(make)
    assert fake.used == 4096
    hooks: list[Any] = []
    old = sys.unraisablehook
    sys.unraisablehook = hooks.append
    try:

        def drop() -> None:
            assert fake.cur() == 0
            holder.clear()
            gc.collect()

        in_thread(drop)
    finally:
        sys.unraisablehook = old
    assert fake.used == 0 and not hooks
    assert fake.calls("free")[-1][1] == ctx1.handle


@pytest.mark.parametrize("n", [1, 3, 5, 255, 1023, 4097])
@pytest.mark.parametrize("use_stream", [False, True])
def test_host_device_round_trip_is_bit_exact(fake, ctx0, n, use_stream):
    data = rand_bytes(n, seed=n)
    with ctx0:
        s = Stream() if use_stream else None
        buf = DeviceBuffer(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PageableCopyWarning)
            buf.copy_from_host(data, stream=s)
            out = buf.copy_to_host(stream=s)
            other = DeviceBuffer(n)
            other.copy_from(buf, stream=s)
            back = np.empty(n, np.uint8)
            assert other.copy_to_host(back, stream=s) is back
    np.testing.assert_array_equal(out, data)
    np.testing.assert_array_equal(back, data)
    kinds = {c[0] for c in fake.log}
    assert ("HtoDAsync" in kinds) == use_stream and ("DtoD" in kinds) != use_stream


def test_slices_copy_at_odd_offsets(fake, ctx0):
    data = rand_bytes(37, seed=1)
    with ctx0:
        buf = DeviceBuffer(64)
        buf.memset(0xAB)
        buf[3:40].copy_from_host(data)
        got = buf.copy_to_host()
        tail = buf[-5:].copy_to_host()
        with pytest.raises(TypeError, match="byte slice"):
            buf[3]  # type: ignore[index]
        with pytest.raises(ValueError, match="step 1"):
            buf[::2]
    assert (got[:3] == 0xAB).all() and (got[40:] == 0xAB).all()
    np.testing.assert_array_equal(got[3:40], data)
    assert (tail == 0xAB).all() and buf[3:40].nbytes == 37 and "view" in repr(buf[1:2])


def test_copy_mismatches_raise_before_any_driver_call(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(16)
        other = DeviceBuffer(8)
        fake.log.clear()
        with pytest.raises(ValueError, match="17 bytes but the device memory has 16"):
            buf.copy_from_host(np.zeros(17, np.uint8))
        with pytest.raises(ValueError, match="sizes must match"):
            buf.copy_to_host(np.zeros(4, np.float64))
        with pytest.raises(ValueError, match="C-contiguous"):
            buf.copy_from_host(np.zeros((4, 4), np.uint8)[:, :1])
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros(16, np.uint8)
            ro.flags.writeable = False
            buf.copy_to_host(ro)
        with pytest.raises(ValueError, match="sizes must match"):
            buf.copy_from(other)
        with pytest.raises(TypeError, match="__cuda_array_interface__"):
            buf.copy_from(np.zeros(16, np.uint8))
        with pytest.raises(TypeError, match="int byte"):
            buf.memset(1.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="0..255"):
            buf.memset(256)
    assert fake.log == []


def test_memset_sync_and_async(fake, ctx0):
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(10)
        buf.memset(7)
        assert (buf.copy_to_host() == 7).all()
        buf[2:4].memset(np.uint8(9), stream=s)
    with ctx0:
        assert buf.copy_to_host().tolist() == [7, 7, 9, 9, 7, 7, 7, 7, 7, 7]
    assert fake.calls("memsetAsync")[0][2] == (9, 2, int(s.handle))


def test_memset_without_stream_is_done_before_a_stream_memset_runs(fake, ctx0):
    """The first GPU run's failure: the legacy-stream memset landed after the slice's
    memset on a non-blocking stream, overwriting it. The fake queues legacy work."""
    with ctx0:
        s = Stream()
        b = DeviceBuffer(4099)
        b.memset(0x11)
        assert not fake.legacy.get(ctx0.handle)
        b[7:4000].memset(0xEE, stream=s)
        s.synchronize()
        out = b.copy_to_host()
    assert (out[:7] == 0x11).all() and (out[7:4000] == 0xEE).all() and (out[4000:] == 0x11).all()
    assert fake.calls("memsetAsync")[0][2] == (0xEE, 3993, int(s.handle))


def test_default_stream_operations_complete_before_returning(fake, ctx0, ctx1):
    """stream=None: H2D, D2D, peer copies and memsets wait for the default stream of the
    context they ran in; stream=s: nothing waits."""
    data = np.arange(16, dtype=np.uint8)
    a = DeviceBuffer(16, context=ctx0)
    b = DeviceBuffer(16, context=ctx0)
    c = DeviceBuffer(16, context=ctx1)
    steps = [
        (lambda: a.copy_from_host(data), ctx0),
        (lambda: b.copy_from(a), ctx0),
        (lambda: a.view().copy_to(b.view()), ctx0),
        (lambda: ck.copy_peer(c, a), ctx1),
        (lambda: c.copy_from(b), ctx1),
        (lambda: c.memset(5), ctx1),
        (lambda: ck.memory.to_device(data, context=ctx1), ctx1),
    ]
    with ctx0:
        for step, where in steps:
            fake.log.clear()
            step()
            assert not any(fake.legacy.values()), step
            assert ("streamsync", where.handle, 0) in fake.log, step
        s = Stream()
        fake.log.clear()
        a.copy_from_host(ck.pinned_empty(16, np.uint8), stream=s)
        b.copy_from(a, stream=s)
        b.memset(1, stream=s)
        assert not fake.calls("streamsync")
    with ctx1:
        np.testing.assert_array_equal(c.copy_to_host(), np.full(16, 5, np.uint8))


def test_default_stream_wait_reports_a_fault(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(8)
        fake.sticky[ctx0.handle] = ILLEGAL_ADDRESS
        with pytest.raises(ContextPoisonedError, match="cuStreamSynchronize"):
            buf.memset(0)
    assert ctx0.poisoned


def test_stream_of_another_context_is_refused(fake, ctx0, ctx1):
    s1 = Stream(ctx1)
    with ctx0:
        buf = DeviceBuffer(8)
        fake.log.clear()
        with pytest.raises(ValueError, match="belongs to"):
            buf.copy_from_host(ck.pinned_empty(8, np.uint8), stream=s1)
        with pytest.raises(ValueError, match="belongs to"):
            buf.memset(0, stream=s1)
    assert not [c for c in fake.log if "HtoD" in c[0] or "memset" in c[0]]


def test_operations_bind_the_buffer_context(fake, ctx0, ctx1):
    with ctx1:
        buf = DeviceBuffer(8)
    with ctx0:
        buf.memset(1)
        assert fake.cur() == ctx0.handle
    assert fake.calls("memset")[-1][1] == ctx1.handle
    with pytest.raises(NoCurrentContextError):
        in_thread(lambda: buf.memset(2))


def test_pageable_async_copy_warns_and_pinned_does_not(fake, ctx0):
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(64)
        pinned = ck.pinned_empty(64, np.uint8)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            buf.copy_from_host(np.zeros(64, np.uint8), stream=s)
            buf.copy_from_host(pinned, stream=s)
            buf.copy_to_host(pinned, stream=s)
            buf.copy_from_host(np.zeros(64, np.uint8))  # synchronous: nothing to warn about
            buf.copy_to_host(stream=s)
    assert [w.category for w in got] == [PageableCopyWarning, PageableCopyWarning]
    assert all(w.filename == __file__ for w in got)
    assert "copy_from_host" in str(got[0].message) and "copy_to_host" in str(got[1].message)


def test_strict_mode_refuses_before_copying(fake, ctx0):
    memory.set_strict_async(True)
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(8)
        with pytest.raises(PageableCopyError):
            buf.copy_from_host(np.ones(8, np.uint8), stream=s)
        buf.copy_from_host(ck.pinned_zeros(8, np.uint8), stream=s)
    assert len(fake.calls("HtoDAsync")) == 1


# ======================================================================================
# DeviceArray, CUDA Array Interface, DLPack
# ======================================================================================


class ForeignArray:
    """A CuPy-like object: device memory described by __cuda_array_interface__."""

    def __init__(
        self, buf: DeviceBuffer, shape, typestr, strides=None, readonly=False, stream=None
    ):
        self.buf = buf
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (buf.ptr, readonly),
            "version": 3,
            "strides": strides,
            "stream": stream,
        }


def test_device_array_round_trip_and_attributes(fake, ctx0):
    host = np.random.default_rng(2).standard_normal((3, 7)).astype(np.float32)
    with ctx0:
        arr = ck.memory.to_device(host)
        assert isinstance(arr, DeviceArray)
        assert (arr.shape, arr.dtype, arr.size, arr.nbytes, arr.ndim) == (
            (3, 7),
            host.dtype,
            21,
            84,
            2,
        )
        assert arr.strides == host.strides and len(arr) == 3 and arr.itemsize == 4
        assert arr.context is ctx0 and arr.device.ordinal == 0 and arr.ptr == arr.buffer.ptr
        np.testing.assert_array_equal(arr.to_host(), host)
        flat = arr.reshape(-1)
        assert flat.shape == (21,) and arr.reshape(7, 3).shape == (7, 3)
        out = np.empty((3, 7), np.float32)
        assert arr.copy_to_host(out) is out
        np.testing.assert_array_equal(out, host)
        again = ck.device_array((3, 7), np.float32)
        again.copy_from(arr)
        np.testing.assert_array_equal(again.to_host(), host)
        dst = ck.device_array((3, 7), np.float32)
        arr.copy_to(dst)
        np.testing.assert_array_equal(dst.to_host(), host)
    assert "shape=(3, 7)" in repr(arr)


def test_device_array_checks(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(24)
        with pytest.raises(ValueError, match="needs 16 bytes"):
            buf.view((4,), np.float32)
        with pytest.raises(ValueError, match="not a multiple"):
            DeviceBuffer(20).view(dtype=np.float64)
        with pytest.raises(ValueError, match="not aligned"):
            buf[1:9].view((2,), np.float32)
        with pytest.raises(TypeError, match="Python objects"):
            DeviceArray(buf, (3,), object)
        with pytest.raises(TypeError, match="DeviceBuffer"):
            DeviceArray(np.zeros(3), (3,), np.float64)  # type: ignore[arg-type]
        arr = buf.view((6,), np.float32)
        with pytest.raises(ValueError, match="dtype float64"):
            arr.copy_from_host(np.zeros(6, np.float64))
        with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
            arr.copy_from_host(np.zeros((3, 2), np.float32))
        with pytest.raises(ValueError, match="dtype"):
            arr.copy_to_host(np.zeros(6, np.int32))
        with pytest.raises(ValueError, match="cannot reshape"):
            arr.reshape(4, -1)
        with pytest.raises(ValueError, match="only one"):
            arr.reshape(-1, -1)
        with pytest.raises(ValueError, match="has dtype int32"):
            arr.copy_from(buf.view((6,), np.int32))
        with pytest.raises(TypeError, match="0-d"):
            len(DeviceBuffer(4).view((), np.float32))


def test_cuda_array_interface(fake, ctx0):
    with ctx0:
        s = Stream()
        arr = ck.device_array((2, 3), np.int16)
        cai = arr.__cuda_array_interface__
        assert cai == {
            "shape": (2, 3),
            "typestr": "<i2",
            "data": (arr.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
        arr.copy_from_host(ck.pinned_zeros((2, 3), np.int16), stream=s)
        assert arr.stream is s and arr.__cuda_array_interface__["stream"] == int(s.handle)
        arr.stream = 0  # legacy default stream is exported as 1 (0 is disallowed by v3)
        assert arr.__cuda_array_interface__["stream"] == 1
        buf_cai = arr.buffer.__cuda_array_interface__
        assert buf_cai["shape"] == (12,) and buf_cai["typestr"] == "|u1"
        empty = ck.device_array((0,), np.float32)
        assert empty.__cuda_array_interface__["data"] == (0, False)
        s.close()
        arr.stream = s
        assert arr.__cuda_array_interface__["stream"] is None


def test_foreign_arrays_as_copy_source_and_target(fake, ctx0):
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    with ctx0:
        theirs = ForeignArray(DeviceBuffer(48), (3, 4), "<f4")
        mine = ck.memory.to_device(data)
        mine.copy_to(theirs)
        back = ck.device_array((3, 4), np.float32)
        back.copy_from(theirs)
        np.testing.assert_array_equal(back.to_host(), data)
        raw = DeviceBuffer(48)
        raw.copy_from(theirs)
        np.testing.assert_array_equal(raw.view((3, 4), np.float32).to_host(), data)
        with pytest.raises(ValueError, match="not C-contiguous"):
            back.copy_from(ForeignArray(theirs.buf, (3, 4), "<f4", strides=(4, 12)))
        column = ck.device_array((3, 1), np.float32)
        column.copy_from(ForeignArray(theirs.buf[:12], (3, 1), "<f4", strides=(4, 99)))
        np.testing.assert_array_equal(column.to_host().ravel(), data.ravel()[:3])
        with pytest.raises(ValueError, match="read-only"):
            mine.copy_to(ForeignArray(theirs.buf, (3, 4), "<f4", readonly=True))
        with pytest.raises(ValueError, match="shape"):
            mine.copy_to(ForeignArray(theirs.buf, (4, 3), "<f4"))


def test_foreign_source_stream_is_synchronized_v3(fake, ctx0):
    with ctx0:
        s = Stream()
        theirs = ForeignArray(DeviceBuffer(16), (4,), "<f4", stream=int(s.handle))
        mine = ck.device_array((4,), np.float32)
        mine.copy_from(theirs)
        # the producer's stream first, then the default stream the copy ran on
        assert [c[2] for c in fake.calls("streamsync")][-2:] == [int(s.handle), 0]
        n = len(fake.calls("streamsync"))
        mine.copy_from(theirs, stream=s)  # same stream: stream order suffices
        assert len(fake.calls("streamsync")) == n


def test_foreign_memory_of_another_context_goes_peer(fake, ctx0, ctx1):
    with ctx1:
        theirs = ForeignArray(DeviceBuffer(16), (4,), "<f4")
    with ctx0:
        mine = ck.memory.to_device(np.arange(4, dtype=np.float32))
        mine.copy_to(theirs)
    assert fake.calls("Peer")[-1][2] == (ctx1.handle, ctx0.handle)
    with ctx1:
        np.testing.assert_array_equal(theirs.buf.view((4,), np.float32).to_host(), np.arange(4))


def test_memory_without_a_context_attribute_is_placed_by_device_ordinal(
    fake, ctx0, ctx1, monkeypatch
):
    """Pool/VMM allocations report no context: the device ordinal picks the primary one."""
    with ctx1:
        theirs = DeviceBuffer(16)
    plain = fake.cuPointerGetAttribute

    def no_context(attr: Any, ptr: int) -> tuple[int, Any]:
        if attr == real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT:
            return (OK, FakeHandle(0))
        return plain(attr, ptr)

    monkeypatch.setattr(fake, "cuPointerGetAttribute", no_context)
    from ctxkit.memory import copies as _copies

    with ctx0:
        assert _copies.context_of_pointer(theirs.ptr, "t") is ck.Context.primary(1)
        with pytest.raises(ValueError, match="not device memory known to CUDA"):
            _copies.context_of_pointer(12345, "t")


def test_pointer_device_ordinal_reads_libcuda_directly(monkeypatch):
    from ctxkit import _driver

    seen: list[tuple[int, int]] = []

    def raw(out: Any, attr: int, ptr: int) -> int:
        seen.append((attr, ptr))
        if ptr == 0xBAD:
            return INVALID_VALUE
        out.contents.value = 3
        return OK

    monkeypatch.setattr(_driver, "_raw_pointer_get_attribute", raw)
    assert _driver.pointer_device_ordinal(0x7000) == (OK, 3)
    assert _driver.pointer_device_ordinal(0xBAD)[0] == INVALID_VALUE
    assert seen == [(9, 0x7000), (9, 0xBAD)]
    assert int(real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) == 9


def test_pointer_device_ordinal_loader(monkeypatch):
    from ctxkit import _driver

    class Lib:
        def __init__(self, name: str) -> None:
            if name == "missing":
                raise OSError(name)
            self.cuPointerGetAttribute = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)

    monkeypatch.setattr(_driver.ctypes, "CDLL", lambda name: Lib(name))
    fn = _driver._load_raw_pointer_get_attribute()
    assert fn.restype is ctypes.c_int and fn.argtypes[2] is ctypes.c_uint64
    monkeypatch.setattr(_driver.ctypes, "CDLL", lambda name: Lib("missing"))
    assert _driver._load_raw_pointer_get_attribute() is False
    monkeypatch.setattr(_driver, "_raw_pointer_get_attribute", None)
    monkeypatch.setattr(_driver, "drv", FakeOrdinalBindings())
    assert _driver.pointer_device_ordinal(0x10) == (OK, 1)  # falls back to the bindings
    assert _driver._raw_pointer_get_attribute is False


class FakeOrdinalBindings:
    CUpointer_attribute = real.CUpointer_attribute

    def cuPointerGetAttribute(self, attr: Any, ptr: int) -> tuple[int, int]:
        assert attr == real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        return (OK, 1)


def test_dlpack_export(fake, ctx0, ctx1):
    with ctx1:
        arr = ck.device_array((2, 5), np.float64)
    assert arr.__dlpack_device__() == (2, 1)
    cap = arr.__dlpack__()
    m, name = read_capsule(cap)
    assert name == "dltensor"
    t = m.dl_tensor
    assert t.data == arr.ptr and (t.device.device_type, t.device.device_id) == (2, 1)
    assert [t.shape[i] for i in range(t.ndim)] == [2, 5] and (t.dtype.code, t.dtype.bits) == (2, 64)
    _, vname = read_capsule(arr.__dlpack__(max_version=(1, 2)))
    assert vname == "dltensor_versioned"
    with pytest.raises(BufferError, match="copy=True"):
        arr.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="not on the requested"):
        arr.__dlpack__(dl_device=(2, 0))
    assert arr.buffer.__dlpack_device__() == (2, 1)
    _, bname = read_capsule(arr.buffer.__dlpack__())
    assert bname == "dltensor"


def test_dlpack_keeps_the_memory_alive(fake, ctx0):
    with ctx0:
        arr = ck.device_array(4, np.float32)
    cap = arr.__dlpack__()
    del arr
    gc.collect()
    assert fake.used == 16
    del cap
    gc.collect()
    assert fake.used == 0


def test_dlpack_orders_the_consumer_stream_after_pending_writes(fake, ctx0):
    with ctx0:
        s = Stream()
        arr = ck.device_array(4, np.float32)
        arr.__dlpack__(stream=5)
        assert not fake.waits  # nothing pending
        arr.copy_from_host(ck.pinned_zeros(4, np.float32), stream=s)
        arr.__dlpack__(stream=-1)
        arr.__dlpack__(stream=int(s.handle))
        assert not fake.waits  # no sync asked / same stream
        arr.__dlpack__(stream=0x77)
        arr.__dlpack__()  # None: the legacy default stream (1)
        with pytest.raises(BufferError, match="ambiguous"):
            arr.__dlpack__(stream=0)
    assert [w[0] for w in fake.waits] == [0x77, 1]
    recorded = [c[2] for c in fake.calls("record")]
    assert all(r[1] == int(s.handle) for r in recorded) and len(recorded) == 2


# ======================================================================================
# pinned and registered host memory
# ======================================================================================


def test_pinned_empty_and_is_pinned(fake, ctx0):
    with ctx0:
        a = ck.pinned_empty((3, 5), np.float32)
        z = ck.pinned_zeros(7, np.int64)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags.c_contiguous
    assert (z == 0).all() and z.dtype == np.int64
    assert ck.is_pinned(a) and ck.is_pinned(a[1:]) and ck.is_pinned(z)
    with ctx0:
        assert not ck.is_pinned(np.zeros(10))
        assert not ck.is_pinned(np.zeros(0))
        assert not ck.is_pinned(bytearray(8))
    assert fake.calls("hostalloc")[0][2] == (60, 1)  # PORTABLE
    assert ck.pinned_empty(0, np.float32).size == 0


def test_pinned_memory_freed_with_the_last_view_without_a_context(fake, ctx0, ctx1):
    with ctx1:
        a = ck.pinned_empty(1000, np.uint8)
    view = a[10:20].reshape(2, 5)
    del a
    gc.collect()
    assert len(fake.host_allocs) == 1  # the view keeps it alive

    def drop() -> None:
        nonlocal view
        assert fake.cur() == 0
        view = None
        gc.collect()

    in_thread(drop)
    assert not fake.host_allocs
    assert fake.calls("freehost")[0][1] == ctx1.handle


def test_pinned_without_current_context_uses_device_0(fake):
    arr = in_thread(lambda: ck.pinned_empty(4, np.float32))
    assert fake.calls("hostalloc")[0][1] == ck.registry.context(0).handle
    assert ck.is_pinned(arr)
    arr2 = ck.pinned_empty(4, np.float32, context=1)
    assert fake.calls("hostalloc")[1][1] == ck.registry.context(1).handle and arr2.size == 4


def test_pinned_out_of_memory(fake, ctx0):
    fake.host_oom = True
    with ctx0, pytest.raises(OutOfMemoryError, match="page-lock"):
        ck.pinned_empty(1 << 20, np.uint8)


def test_register_host_pins_in_place_and_unregisters(fake, ctx0):
    arr = np.zeros(3 * PAGE, np.uint8)
    with ctx0:
        assert not ck.is_pinned(arr)
        with ck.register_host(arr) as same:
            assert same is arr and ck.is_pinned(arr)
            with ck.register_host(arr[10:]):  # already pinned: left alone
                pass
            assert ck.is_pinned(arr)
            with pytest.raises(ValueError, match="shares a page"):
                neighbour = np.frombuffer(
                    (ctypes.c_uint8 * 16).from_address(arr.ctypes.data + arr.nbytes), np.uint8
                )
                with ck.register_host(neighbour):
                    pass
        assert not ck.is_pinned(arr)
    assert len(fake.calls("register")) == 1 and len(fake.calls("unregister")) == 1
    assert fake.calls("register")[0][2][2] == 1  # PORTABLE


def test_register_host_unregisters_on_error_and_accepts_pinned(fake, ctx0):
    arr = np.zeros(100, np.float64)
    with ctx0:
        with pytest.raises(KeyError), ck.register_host(arr):
            raise KeyError("x")
        assert not fake.registered
        pinned = ck.pinned_empty(8, np.float64)
        with ck.register_host(pinned):
            pass
        with ck.register_host(np.zeros(0)):
            pass
        managed_view = ManagedBuffer(64).as_numpy()
        with ck.register_host(managed_view) as same:
            assert same is managed_view
    assert len(fake.calls("register")) == 1


def test_async_copy_inside_register_host_does_not_warn(fake, ctx0):
    arr = np.ones(256, np.uint8)
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(256)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with ck.register_host(arr):
                buf.copy_from_host(arr, stream=s)


# ======================================================================================
# managed memory
# ======================================================================================


def test_managed_buffer_host_and_device_views(fake, ctx0):
    with ctx0:
        m = ManagedBuffer(64)
        host = m.as_numpy(np.float32, (4, 4))
        host[...] = np.arange(16).reshape(4, 4)
        out = m.view((4, 4), np.float32).to_host()
        np.testing.assert_array_equal(out, host)
        m.copy_from_host(np.full(64, 1, np.uint8))
        assert (m.as_numpy() == 1).all()
        assert fake.calls("alloc")[0][2][2] == "managed"
        with pytest.raises(ValueError, match="not a multiple"):
            ManagedBuffer(6).as_numpy(np.float32)
        with pytest.raises(ValueError, match="does not cover"):
            m.as_numpy(np.float32, (3,))
        assert ManagedBuffer(0).as_numpy(np.float32).size == 0
    assert not fake.calls("ctxsync")  # concurrent managed access: no sync


def test_managed_close_refused_while_host_views_live(fake, ctx0):
    with ctx0:
        m = ManagedBuffer(32)
        v = m[8:16].as_numpy()
        with pytest.raises(ValueError, match="still alive"):
            m.close()
        del v
        gc.collect()
        m.close()
    assert m.closed and fake.used == 0


def test_managed_view_keeps_buffer_alive(fake, ctx0):
    with ctx0:
        v = ManagedBuffer(16).as_numpy(np.int32)
    gc.collect()
    assert fake.used == 16
    v[:] = 3
    del v
    gc.collect()
    assert fake.used == 0


def test_managed_synchronizes_without_concurrent_access(fake, ctx0):
    fake.concurrent_managed = 0
    with ctx0:
        ManagedBuffer(8).as_numpy()
    assert len(fake.calls("ctxsync")) == 1


def test_managed_prefetch_on_a_stream_of_another_context(fake, ctx0, ctx1):
    """Managed memory of ctx0 prefetched to device 1 on device 1's stream (the per-device
    prefetch of examples/unified_memory.py): enqueued in the stream's context."""
    with ctx0:
        m = ManagedBuffer(4096)
    s1 = Stream(ctx1)
    with ctx0:
        m[:2048].prefetch(1, stream=s1)
    (call,) = fake.calls("prefetch")
    assert call[1] == ctx1.handle
    assert int(call[2][-1]) == int(s1.handle)


def test_managed_prefetch_and_advise(fake, ctx0, ctx1):
    with ctx0:
        s = Stream()
        m = ManagedBuffer(4096)
        m.prefetch()
        m.prefetch("cpu", stream=s)
        m.prefetch(ctx1)
        m.advise("read_mostly")
        m.advise("unset_read_mostly")
        m.advise("preferred_location", "cpu")
        m.advise(real.CUmem_advise.CU_MEM_ADVISE_SET_ACCESSED_BY, 1)
        with pytest.raises(ValueError, match="unknown memory advice"):
            m.advise("fast_please")
        with pytest.raises(ValueError, match="'cpu'"):
            m.prefetch("gpu")
        ManagedBuffer(0).prefetch()
    pre = [c[2] for c in fake.calls("prefetch")]
    assert len(pre) == 3
    if ck._driver.uses_mem_location(ck._driver.BINDINGS_VERSION[0]):
        locs = [p[2] for p in pre]
        assert [int(loc.type) for loc in locs] == [1, 2, 1]  # device, host, device
        assert [loc.id for loc in locs] == [0, 0, 1]
        assert int(pre[1][4]) == int(s.handle)
    adv = [c[2] for c in fake.calls("advise")]
    names = [a[2].name for a in adv]
    assert names == [
        "CU_MEM_ADVISE_SET_READ_MOSTLY",
        "CU_MEM_ADVISE_UNSET_READ_MOSTLY",
        "CU_MEM_ADVISE_SET_PREFERRED_LOCATION",
        "CU_MEM_ADVISE_SET_ACCESSED_BY",
    ]


# ======================================================================================
# peer access
# ======================================================================================


def test_enable_peer_access_is_idempotent(fake, ctx0, ctx1):
    assert not memory.peer_access_enabled(0, 1)
    ck.enable_peer_access(0, 1)
    ck.enable_peer_access(ctx0, ctx1)  # driver says ALREADY_ENABLED: fine
    assert memory.peer_access_enabled(0, 1) and not memory.peer_access_enabled(1, 0)
    assert [c[2] for c in fake.calls("enablepeer")] == [(ctx0.handle, ctx1.handle)] * 2
    ck.enable_peer_access(0, ck.Context.create(0))  # same device: nothing to do
    assert len(fake.calls("enablepeer")) == 2


def test_peer_state_does_not_survive_a_closed_context(fake, ctx0):
    other = ck.Context.create(1)
    ck.enable_peer_access(ctx0, other)
    assert memory.peer_access_enabled(ctx0, other)
    other.close()
    reborn = Context(FakeHandle(other.handle), ck.Device(1), "owned")  # same handle, new context
    assert not memory.peer_access_enabled(ctx0, reborn)


def test_enable_peer_access_unsupported(fake, ctx0, ctx1):
    fake.no_peer = True
    with pytest.raises(CudaError, match="cannot access device 1") as info:
        ck.enable_peer_access(0, 1)
    assert info.value.name == "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"


def test_copy_peer_both_directions_with_and_without_access(fake, ctx0, ctx1):
    data = rand_bytes(301, seed=3)
    a = DeviceBuffer(301, context=ctx0)
    b = DeviceBuffer(301, context=ctx1)
    with ctx0:
        a.copy_from_host(data)
        assert ck.copy_peer(b, a) is False
        ck.enable_peer_access(1, 0)
        assert ck.copy_peer(a, b) is True  # either direction counts
        s1 = Stream(ctx1)
        assert ck.copy_peer(b[:10], a, 10, stream=s1) is True
    with ctx1:
        np.testing.assert_array_equal(b.copy_to_host(), data)
    peer_async = fake.calls("PeerAsync")[-1]
    assert peer_async[1] == ctx1.handle and peer_async[2] == (
        ctx1.handle,
        ctx0.handle,
        int(s1.handle),
    )
    with ctx0:
        with pytest.raises(ValueError, match="do not fit"):
            ck.copy_peer(b[:10], a)
        assert ck.copy_peer(b, a, 0) is True
        with pytest.raises(ValueError, match=">= 0"):
            ck.copy_peer(b, a, -1)


def test_copy_from_another_device_uses_peer_copy(fake, ctx0, ctx1):
    data = rand_bytes(50, seed=4)
    with ctx1:
        src = DeviceBuffer(50)
        src.copy_from_host(data)
    with ctx0:
        dst = DeviceBuffer(50)
        dst.copy_from(src)
        np.testing.assert_array_equal(dst.copy_to_host(), data)
    assert fake.calls("Peer")[-1][2] == (ctx0.handle, ctx1.handle)


# ======================================================================================
# streams and events
# ======================================================================================


def test_stream_created_in_its_own_context(fake, ctx0, ctx1):
    with ctx0:
        s = Stream(ctx1, priority=-2)
        d = Stream(nonblocking=False)
    assert s.context is ctx1 and s.device.ordinal == 1 and s.owned and s.priority == -2
    assert fake.calls("streamcreate")[0][1] == ctx1.handle
    assert fake.calls("streamcreate")[0][2][1:] == (1, -2)
    assert fake.calls("streamcreate")[1][2][1:] == (0, 0) and d.context is ctx0
    assert s.__cuda_stream__() == (0, int(s.handle)) and s.ptr == int(s.handle)
    assert stream_handle(s) is s.handle and int(stream_handle(CudaStreamProto())) == 0x1234
    assert (
        s == Stream.from_handle(s)
        and s != d
        and hash(s) == hash(Stream.from_handle(int(s.handle), ctx1))
    )
    assert "priority=-2" in repr(s)


def test_stream_priority_and_context_errors(fake, ctx0):
    with pytest.raises(ValueError, match=r"-5 \(highest\) .. 0 \(lowest\)"):
        Stream(ctx0, priority=3)
    with pytest.raises(TypeError, match="priority"):
        Stream(ctx0, priority=1.0)  # type: ignore[arg-type]
    with pytest.raises(NoCurrentContextError):
        in_thread(Stream)


def test_stream_sync_query_and_host_callback_errors(fake, ctx0):
    ran = []
    with ctx0:
        s = Stream()
        s.launch_host_func(lambda: ran.append(threading.current_thread().name))
        s.launch_host_func(lambda: {}["missing"])
        s.launch_host_func(lambda: 1 / 0)
        assert s.query() is False
        with pytest.raises(KeyError, match="missing"):
            s.synchronize()
        assert ran and ran[0] != threading.current_thread().name
        s.synchronize()  # reported once, then clean
        assert s.query() is True
        with pytest.raises(TypeError, match="callable"):
            s.launch_host_func(42)  # type: ignore[arg-type]
    assert not stream._pending


def test_stream_wait_event_and_stream_across_devices(fake, ctx0, ctx1):
    s0 = Stream(ctx0)
    s1 = Stream(ctx1)
    with ctx0:
        e0 = s0.record()
        s1.wait(e0)
        s1.wait(s0)
    assert fake.waits[0] == (int(s1.handle), int(e0.handle))
    rec = fake.calls("record")
    assert rec[0][1] == ctx0.handle and rec[1][2][1] == int(s0.handle)
    assert fake.calls("wait")[1][1] == ctx1.handle
    assert isinstance(e0, Event) and e0.timing and e0.context is ctx0


def test_stream_from_foreign_handles(fake, ctx0, ctx1):
    s1 = Stream(ctx1)

    class TorchStream:
        cuda_stream = int(s1.handle)

    t = TorchStream()
    w = Stream.from_handle(t)
    assert w.context is ctx1 and not w.owned and w._owner is t
    assert w.nonblocking and w.priority == 0
    assert Stream.from_handle(np.int64(int(s1.handle))).context is ctx1
    with pytest.raises(NoCurrentContextError):
        in_thread(lambda: Stream.from_handle(0))
    with ctx0:
        legacy = Stream.from_handle(0)
    assert legacy.context is ctx0 and int(legacy.handle) == 0
    w.close()
    assert w.closed and not fake.calls("streamdestroy")
    with pytest.raises(ContextClosedError, match="stream was closed"):
        w.synchronize()
    assert repr(w) == "<Stream closed>"


def test_stream_closed_and_cross_thread_destroy(fake, ctx0, ctx1):
    holder = {}

    def make() -> None:
        with ctx1:
            holder["s"] = Stream()
            holder["e"] = Event()

    in_thread(make)
    in_thread(lambda: (holder.clear(), gc.collect()))
    assert fake.calls("streamdestroy")[0][1] == ctx1.handle
    assert fake.calls("eventdestroy")[0][1] == ctx1.handle
    with ctx0:
        s = Stream()
        s.close()
        s.close()
        with pytest.raises(ContextClosedError, match="stream was closed"):
            stream_handle(s)
        for op in (
            s.synchronize,
            s.query,
            lambda: s.wait(Event()),
            lambda: s.launch_host_func(print),
        ):
            with pytest.raises(ContextClosedError):
                op()


def test_event_record_query_sync_and_timing(fake, ctx0, ctx1):
    with ctx0:
        s = Stream()
        start, end = Event(), Event(blocking=True)
        assert start.record(s) is start
        s.record(end)
        assert start.query() and end.query()
        end.synchronize()
        assert start.elapsed_ms(end) == 1.5
        assert fake.calls("eventsync")
        with pytest.raises(ValueError, match="stream's context"):
            Event().record(Stream(ctx1))
        assert "timing=True" in repr(start) and start.device.ordinal == 0
        start.close()
        start.close()
        assert repr(start) == "<Event closed>"
        with pytest.raises(ContextClosedError, match="event was closed"):
            start.query()


def test_elapsed_ms_errors(fake, ctx0, ctx1):
    with ctx0:
        plain = Event(timing=False).record()
        a, b, never = Event().record(), Event().record(), Event()
        owned = ck.Context.create(0)
        other_ctx = Event(context=owned).record()
        other_dev = Event(context=ctx1).record()
    with pytest.raises(ValueError, match="timing=False"):
        plain.elapsed_ms(b)
    with pytest.raises(ValueError, match="timing=False"):
        a.elapsed_ms(plain)
    with pytest.raises(ValueError, match="never recorded"):
        a.elapsed_ms(never)
    with pytest.raises(ValueError, match="different devices"):
        a.elapsed_ms(other_dev)
    with pytest.raises(ValueError, match="different contexts"):
        a.elapsed_ms(other_ctx)
    with pytest.raises(TypeError, match="ctxkit.Event"):
        a.elapsed_ms(3)  # type: ignore[arg-type]
    with ctx0:
        assert a.elapsed_ms(b) == 1.5


# ======================================================================================
# sticky errors
# ======================================================================================


def test_sticky_error_poisons_only_its_context(fake, ctx0, ctx1):
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(8)
    fake.sticky[ctx0.handle] = ILLEGAL_ADDRESS
    with ctx1:  # device 0's objects bind their own context
        with pytest.raises(ContextPoisonedError, match="ILLEGAL_ADDRESS"):
            s.synchronize()
        assert ctx0.poisoned
        n = len(fake.log)
        for op in (
            lambda: DeviceBuffer(8, context=ctx0),
            lambda: Stream(ctx0),
            lambda: Event(context=ctx0),
            s.synchronize,
            ctx0.synchronize,
            lambda: ck.pinned_empty(4, context=ctx0),
            lambda: buf.copy_to_host(),
        ):
            with pytest.raises(ContextPoisonedError):
                op()
        assert len(fake.log) == n  # failed fast: no driver call reached
        ok = DeviceBuffer(8)
        ok.copy_from_host(np.arange(8, dtype=np.uint8))
        assert ok.copy_to_host().tolist() == list(range(8))
    buf = ok = None
    gc.collect()  # freeing in a poisoned context is skipped, silently
    frees = fake.calls("free")  # only `ok`: device 0's buffer is not freed in a dead context
    assert [f[1] for f in frees] == [ctx1.handle]


def test_sticky_error_from_a_copy_inside_the_context(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(8)
        fake.sticky[ctx0.handle] = ILLEGAL_ADDRESS
        with pytest.raises(ContextPoisonedError):
            buf.copy_from_host(np.zeros(8, np.uint8))
        with pytest.raises(ContextPoisonedError):
            buf.copy_to_host()
    assert ctx0.poisoned


def test_bench_memory_peer_section_waits_and_syncs_before_freeing(fake, monkeypatch, capsys):
    """benchmarks/bench_memory.py's peer section (the first GPU run faulted device 0 after
    it): every copy is awaited, both contexts are synchronized before peer access is
    enabled and before the buffers are freed, and the bytes arrive."""
    from pathlib import Path

    from tests.support.helpers import load_file_module

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_memory.py"
    bench = load_file_module(path, "bench_memory_under_test")
    monkeypatch.setattr(bench, "PEER_SIZE", 64 << 10)
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    bench.bench_peer(2, 2)
    out = capsys.readouterr().out
    assert "SUMMARY memory.peer_data_ok 1.00 (target 1 (bytes arrived)) PASS" in out
    for key in ("staged", "p2p"):
        assert f"SUMMARY memory.peer_{key}_vs_raw" in out
        assert f"SUMMARY memory.peer_{key}_gbps" in out
    log = [(call, ctx) for call, ctx, _ in fake.log]
    frees = [i for i, (call, _) in enumerate(log) if call == "free"]
    assert len(frees) == 2
    for ctx in (c0, c1):
        assert ("ctxsync", ctx.handle) in log[: frees[0]]
    first_enable = next(i for i, (call, _) in enumerate(log) if call == "enablepeer")
    assert {("ctxsync", c0.handle), ("ctxsync", c1.handle)} <= set(log[:first_enable])
    assert not any(fake.legacy.values())
    peer_calls = fake.calls("Peer") + fake.calls("PeerAsync")
    assert peer_calls and all(c[1] == c1.handle for c in peer_calls)


def test_public_names_are_exported():
    for name in (
        "DeviceBuffer",
        "DeviceArray",
        "device_array",
        "pinned_empty",
        "pinned_zeros",
        "register_host",
        "is_pinned",
        "ManagedBuffer",
        "enable_peer_access",
        "copy_peer",
        "Stream",
        "Event",
    ):
        assert getattr(ck, name) is getattr(memory if hasattr(memory, name) else stream, name)
