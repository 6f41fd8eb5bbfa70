"""Pinned host memory is freed once the user's last reference is gone (CPU).

compute-sanitizer's leak check on scripts/sanitizer_workload.py reported the
``pinned_empty`` arrays of ``per_device`` and ``threads_and_pipeline`` as still
allocated at exit. Here the whole workload runs against a simulated GPU (the pipeline's
FakeGPU of tests/support/fakegpu.py plus libraries, kernels written in Python, graphs,
synchronous/peer copies and memsets), and the test asserts that every page-locked
allocation made by the workload's own functions is freed -- in its context, through
``cuMemFreeHost`` -- as soon as those functions have returned. The free path itself is
checked too: a failing free is no longer silent (``ctxkit.lifetime.failed_frees``, one
``ResourceWarning``).
"""

from __future__ import annotations

import ctypes
import gc
import struct
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as _real

import ctxkit as ck
from ctxkit import context, lifetime
from ctxkit.memory import host as _hostmem
from tests.support import fakegpu as pipeline_fakegpu
from tests.support.fakedriver import FakeHandle
from tests.support.fakegpu import FakeGPU
from tests.support.helpers import load_file_module

ROOT = Path(__file__).resolve().parents[2]
PEER_ALREADY = 704
NOT_FOUND = 500

#: kernel name -> struct format of its parameters (PTX .param order) and its body
_PARAMS = {
    "vector_add": "QQQQ",
    "vector_add_ptx": "QQQI",
    "saxpy": "fQQQ",
    "scale_f32": "QQQf",
    "reduce_sum_f32": "QQQ",
    "fill_f32": "QfQ",
}


def _f32(ptr: int, n: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_float * n).from_address(ptr), np.float32)


def _body(name: str, v: tuple[Any, ...]) -> Callable[[], None]:
    def run() -> None:
        if name in ("vector_add", "vector_add_ptx"):
            a, b, c, n = v
            _f32(c, n)[:] = _f32(a, n) + _f32(b, n)
        elif name == "saxpy":
            alpha, x, y, n = v
            _f32(y, n)[:] = np.float32(alpha) * _f32(x, n) + _f32(y, n)
        elif name == "scale_f32":
            src, dst, n, alpha = v
            _f32(dst, n)[:] = np.float32(alpha) * _f32(src, n)
        elif name == "reduce_sum_f32":
            src, dst, n = v
            _f32(dst, 1)[0] += _f32(src, n).sum(dtype=np.float32)
        else:
            dst, value, n = v
            _f32(dst, n)[:] = np.float32(value)

    return run


class WorkloadGPU(FakeGPU):
    """FakeGPU plus what scripts/sanitizer_workload.py needs beyond the pipeline."""

    CUjit_option = _real.CUjit_option
    CUfunction_attribute = _real.CUfunction_attribute
    CUstreamCaptureMode = _real.CUstreamCaptureMode
    CUmem_advise = _real.CUmem_advise

    def __init__(self, ndev: int = 2, jitter: float = 0.0) -> None:
        super().__init__(ndev, jitter)
        self.attrs["CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"] = 9
        self.attrs["CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"] = 0
        self.names: dict[int, str] = {}  # kernel / function handle -> name
        self.capturing: dict[int, list[Callable[[], None]]] = {}
        self.graphs: dict[int, list[Callable[[], None]]] = {}
        self.host_frees: list[tuple[int, int]] = []  # (pointer, current context)
        self.free_host_error = 0

    def _new(self) -> FakeHandle:
        return FakeHandle(next(self._handles))

    # --- libraries and launches --------------------------------------------------

    def cuLibraryLoadData(self, code: bytes, *args: Any) -> tuple[int, FakeHandle]:
        return (0, self._new())

    def cuLibraryUnload(self, lib: Any) -> tuple[int]:
        return (0,)

    def cuLibraryGetKernel(self, lib: Any, name: bytes) -> tuple[int, Any]:
        if name.decode() not in _PARAMS:
            return (NOT_FOUND, None)
        h = self._new()
        self.names[int(h)] = name.decode()
        return (0, h)

    def cuKernelGetFunction(self, kernel: Any) -> tuple[int, Any]:
        if not self.current():
            return (201, None)
        h = self._new()
        self.names[int(h)] = self.names[int(kernel)]
        return (0, h)

    def cuLaunchKernel(self, f: Any, *dims_shm_stream_params_extra: Any) -> tuple[int]:
        *_dims, _shm, hs, params, _extra = dims_shm_stream_params_extra
        name = self.names[int(f)]
        fmt = _PARAMS[name]
        ptrs = (ctypes.c_void_p * len(fmt)).from_address(params)
        values = tuple(
            struct.unpack(c, ctypes.string_at(ptrs[i], struct.calcsize(c)))[0]
            for i, c in enumerate(fmt)
        )
        self._enqueue(hs, _body(name, values))
        return (0,)

    def _enqueue(self, hs: Any, op: Callable[[], None]) -> None:
        ops = self.capturing.get(int(hs))
        if ops is not None:
            ops.append(op)
        else:
            self._stream(hs).put(op)

    # --- graphs --------------------------------------------------------------------

    def cuStreamBeginCapture(self, hs: Any, mode: Any) -> tuple[int]:
        self.capturing[int(hs)] = []
        return (0,)

    def cuStreamEndCapture(self, hs: Any) -> tuple[int, FakeHandle]:
        g = self._new()
        self.graphs[int(g)] = self.capturing.pop(int(hs))
        return (0, g)

    def cuGraphGetNodes(self, g: Any, n: int) -> tuple[int, None, int]:
        return (0, None, len(self.graphs[int(g)]))

    def cuGraphInstantiate(self, g: Any, flags: int) -> tuple[int, FakeHandle]:
        h = self._new()
        self.graphs[int(h)] = list(self.graphs[int(g)])
        return (0, h)

    def cuGraphLaunch(self, exe: Any, hs: Any) -> tuple[int]:
        for op in self.graphs[int(exe)]:
            self._stream(hs).put(op)
        return (0,)

    def cuGraphDestroy(self, g: Any) -> tuple[int]:
        self.graphs.pop(int(g), None)
        return (0,)

    cuGraphExecDestroy = cuGraphDestroy

    # --- synchronous, device and peer copies, memsets ------------------------------

    def _sync_default(self) -> None:
        self.cuStreamSynchronize(0)

    def cuMemcpyHtoD(self, dst: Any, src: Any, n: int) -> tuple[int]:
        self._sync_default()
        ctypes.memmove(int(dst), int(src), n)
        return (0,)

    def cuMemcpyDtoH(self, dst: Any, src: Any, n: int) -> tuple[int]:
        self._sync_default()
        ctypes.memmove(int(dst), int(src), n)
        return (0,)

    def _device_copy(self, dst: Any, src: Any, n: int, hs: Any) -> tuple[int]:
        d, s = int(dst), int(src)
        self._enqueue(hs, lambda: ctypes.memmove(d, s, n))
        return (0,)

    def cuMemcpyDtoD(self, dst: Any, src: Any, n: int) -> tuple[int]:
        return self._device_copy(dst, src, n, 0)

    def cuMemcpyDtoDAsync(self, dst: Any, src: Any, n: int, hs: Any) -> tuple[int]:
        return self._device_copy(dst, src, n, hs)

    def cuMemcpyPeer(self, dst: Any, dctx: Any, src: Any, sctx: Any, n: int) -> tuple[int]:
        return self._device_copy(dst, src, n, 0)

    def cuMemcpyPeerAsync(
        self, dst: Any, dctx: Any, src: Any, sctx: Any, n: int, hs: Any
    ) -> tuple[int]:
        return self._device_copy(dst, src, n, hs)

    def cuMemsetD8(self, ptr: Any, value: int, n: int) -> tuple[int]:
        return self.cuMemsetD8Async(ptr, value, n, 0)

    def cuMemsetD8Async(self, ptr: Any, value: int, n: int, hs: Any) -> tuple[int]:
        p = int(ptr)
        self._enqueue(hs, lambda: ctypes.memset(p, value, n))
        return (0,)

    def cuCtxSynchronize(self) -> tuple[int]:
        ctx = self.current()
        if not ctx:
            return (201,)
        for h, s in list(self.streams.items()):
            if s.ctx == ctx:
                self.cuStreamSynchronize(FakeHandle(h))
        self._sync_default()
        return (self._sticky(ctx),)

    # --- peers ------------------------------------------------------------------------

    def cuDeviceCanAccessPeer(self, a: Any, b: Any) -> tuple[int, int]:
        return (0, 1)

    def cuCtxEnablePeerAccess(self, peer: Any, flags: int) -> tuple[int]:
        return (0,)

    # --- host memory: where and how it is freed -----------------------------------

    def cuMemFreeHost(self, ptr: Any) -> tuple[int]:
        if self.free_host_error:
            return (self.free_host_error,)
        self.host_frees.append((int(ptr), self.current()))
        return super().cuMemFreeHost(ptr)

    def pinned(self) -> list[int]:
        """Pointers of the page-locked allocations still alive."""
        with self._mlock:
            return [p for p, (_arr, kind) in self.mem.items() if kind == "host"]


@pytest.fixture
def _workload_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline_fakegpu, "FakeGPU", WorkloadGPU)


@pytest.fixture
def wgpu(_workload_gpu: None, gpu: WorkloadGPU) -> Iterator[WorkloadGPU]:
    """A 2-device WorkloadGPU in every ctxkit module, the registry reset."""
    assert isinstance(gpu, WorkloadGPU)
    yield gpu
    gc.collect()


def _workload_module() -> Any:
    return load_file_module(ROOT / "scripts" / "sanitizer_workload.py", "sanitizer_workload_cpu")


@pytest.fixture
def host_allocs(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref[Any]]:
    """Weak references to every page-locked HostMemory (``pinned_empty``) created."""
    refs: list[weakref.ref[Any]] = []
    original = _hostmem.HostMemory.__init__

    def init(self: Any, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        if self.owner is None:  # not a view of a ManagedBuffer
            refs.append(weakref.ref(self))

    monkeypatch.setattr(_hostmem.HostMemory, "__init__", init)
    return refs


def _assert_freed(gpu: WorkloadGPU, refs: list[weakref.ref[Any]], before: int, what: str) -> None:
    gc.collect()
    ck.pinned_pool().release()  # pipelines cache staging blocks in the process pool
    alive = [r() for r in refs[before:] if r() is not None]
    assert not alive, f"{what}: pinned memory still referenced: {alive} by " + repr(
        [type(o).__name__ for m in alive for o in gc.get_referrers(m)]
    )
    assert len(gpu.host_frees) >= len(refs), (  # + the pool's cached blocks it released
        f"{what}: {len(refs)} allocations, frees {gpu.host_frees}"
    )


def test_workload_frees_its_pinned_memory_when_each_function_returns(wgpu, host_allocs):
    wl = _workload_module()
    ctxs = [ck.registry.context(i) for i in range(2)]
    k = wl.load()
    rng = np.random.default_rng(0)
    for ctx in ctxs:
        n = len(host_allocs)
        wl.per_device(ctx, k, rng)
        assert len(host_allocs) == n + 1
        _assert_freed(wgpu, host_allocs, n, "per_device")
        assert wgpu.host_frees[-1][1] == ctx.handle  # freed inside the allocating context
    wl.cross_device(ctxs, k)
    n = len(host_allocs)
    wl.threads_and_pipeline(k)
    assert len(host_allocs) > n  # the user's array and the pipeline's staging buffers
    _assert_freed(wgpu, host_allocs, n, "threads_and_pipeline")
    assert not wgpu.pinned()
    assert not wgpu.kernel_errors


def test_workload_main_leaves_no_pinned_memory(wgpu, host_allocs, capsys):
    wl = _workload_module()
    assert wl.main() == 0
    assert "sanitizer workload OK on 2 device(s)" in capsys.readouterr().out
    _assert_freed(wgpu, host_allocs, 0, "main")
    assert not wgpu.pinned()


def test_pinned_array_used_for_async_copies_is_freed_with_its_last_view(wgpu, host_allocs):
    def use() -> weakref.ref[Any]:
        with ck.registry.context(0):
            s = ck.Stream()
            buf = ck.DeviceBuffer(4096)
            pin = ck.pinned_empty(1024, np.float32)
            pin[:] = np.arange(1024, dtype=np.float32)
            buf.copy_from_host(pin, stream=s)
            view = pin[::2]
            buf.copy_to_host(pin, stream=s)
            s.synchronize()
            s.close()
            buf.close()
            return weakref.ref(view)

    ref = use()
    gc.collect()
    assert ref() is None and not wgpu.pinned()
    assert wgpu.host_frees[-1][1] == ck.registry.context(0).handle


def test_failed_free_is_recorded_and_warned_once(wgpu, monkeypatch):
    monkeypatch.setattr(lifetime, "_failed_frees", [])
    monkeypatch.setattr(lifetime, "_warned_failed_free", False)
    wgpu.free_host_error = 1  # CUDA_ERROR_INVALID_VALUE
    with ck.registry.context(0):
        a = ck.pinned_empty(16, np.uint8)
        b = ck.pinned_empty(16, np.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del a
        gc.collect()
        del b
        gc.collect()
    failed = lifetime.failed_frees()
    assert [f.function for f in failed] == ["cuMemFreeHost", "cuMemFreeHost"]
    assert all("CUDA_ERROR_INVALID_VALUE" in f.error for f in failed)
    assert all(f.context == ck.registry.context(0).handle for f in failed)
    assert all(f.thread == threading.current_thread().name for f in failed)
    msgs = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(msgs) == 1 and "cuMemFreeHost" in msgs[0] and "failed_frees" in msgs[0]
    wgpu.free_host_error = 0


def test_skipped_frees_are_not_failures(wgpu, monkeypatch):
    monkeypatch.setattr(lifetime, "_failed_frees", [])
    ctx = ck.registry.context(0)
    with ctx:
        a = ck.pinned_empty(16, np.uint8)
    monkeypatch.setattr(context, "_shutting_down", True)
    del a
    gc.collect()
    assert lifetime.failed_frees() == [] and wgpu.host_frees == []
