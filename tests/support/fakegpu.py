"""A simulated GPU for testing ``ctxkit.pipeline`` on machines without one.

It extends tests/fakedriver.FakeDriver (per-thread context stacks) with what the pipeline
uses, modelled on CUDA's semantics:

* every stream is a thread executing its operations in order, each after a small random
  delay, so work really runs asynchronously to the host and to other streams: a pipeline
  that reuses a staging buffer too early reads the wrong data here too;
* events carry generations (re-recording captures the new point of the stream);
  ``cuStreamWaitEvent`` blocks a stream until the captured generation completed;
* "device" memory is host memory (so copies are ``memmove``); pinned and managed
  allocations and registered ranges are known to ``cuPointerGetAttribute``, anything
  else is pageable;
* ``cuMemHostRegister`` is strict: page-aligned ranges only, never a page twice
  (``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``); ``register_error`` can make it fail.
  Every async copy whose host side is pageable - when enqueued or when it runs (an
  unregister before the DMA finished) - is recorded in ``pageable_dma``;
* a kernel is a Python function enqueued with :meth:`FakeGPU.launch`; raising
  :class:`Fault` in it poisons the context the way an illegal address does: later
  operations there are skipped and synchronization returns error 700.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as _real

from ctxkit.context import thread_state
from tests.support.fakedriver import FakeDriver, FakeHandle, swap_driver

ILLEGAL_ADDRESS = 700
NOT_READY = 600
INVALID_HANDLE = 400
INVALID_VALUE = 1
INVALID_CONTEXT = 201
ALREADY_REGISTERED = 712
NOT_REGISTERED = 713
EVENT_DISABLE_TIMING = 2
MEMORYTYPE_HOST, MEMORYTYPE_DEVICE = 1, 2


class Fault(Exception):
    """Raise inside a fake kernel to simulate CUDA_ERROR_ILLEGAL_ADDRESS."""


class _Event:
    def __init__(self, ctx: int, flags: int) -> None:
        self.ctx = ctx
        self.flags = flags
        self.gen = 0
        self.done = 0
        self.stamps: dict[int, float] = {}
        self.cond = threading.Condition()

    def capture(self) -> int:
        with self.cond:
            self.gen += 1
            return self.gen

    def complete(self, gen: int) -> None:
        with self.cond:
            self.stamps[gen] = time.perf_counter()
            self.done = max(self.done, gen)
            self.cond.notify_all()

    def wait(self, gen: int) -> None:
        with self.cond:
            while self.done < gen:
                self.cond.wait()

    def ready(self) -> bool:
        with self.cond:
            return self.done >= self.gen

    def stamp(self) -> float | None:
        with self.cond:
            return self.stamps.get(self.gen) if self.done >= self.gen else None


class _Stream:
    def __init__(self, gpu: FakeGPU, ctx: int) -> None:
        self.gpu = gpu
        self.ctx = ctx
        self.q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="fake-stream")
        self.thread.start()

    def _run(self) -> None:
        while True:
            op = self.q.get()
            if op is None:
                return
            if self.gpu.jitter:
                time.sleep(random.uniform(0, self.gpu.jitter))
            try:
                op()
            except Fault:
                self.gpu.poisoned.add(self.ctx)
            except BaseException as exc:  # a bug in a test kernel: poison, keep it
                self.gpu.kernel_errors.append(exc)
                self.gpu.poisoned.add(self.ctx)

    def put(self, op: Callable[[], None], always: bool = False) -> None:
        gpu, ctx = self.gpu, self.ctx

        def guarded() -> None:
            if always or ctx not in gpu.poisoned:
                op()

        self.q.put(guarded)


class FakeGPU(FakeDriver):
    """The fake driver plus streams, events, memory, copies and kernels."""

    CUpointer_attribute = _real.CUpointer_attribute
    CUmemLocation = _real.CUmemLocation
    CUmemLocationType = _real.CUmemLocationType
    CUstream = _real.CUstream

    def __init__(self, ndev: int = 2, jitter: float = 0.0003) -> None:
        super().__init__(ndev)
        self.jitter = jitter
        self.poisoned: set[int] = set()
        self.kernel_errors: list[BaseException] = []
        self.streams: dict[int, _Stream] = {}
        self.default_streams: dict[int, _Stream] = {}
        self.events: dict[int, _Event] = {}
        self.mem: dict[int, tuple[np.ndarray, str]] = {}
        self.prefetches: list[tuple[int, int, Any]] = []
        self.registered: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, flags)
        self.register_calls: list[tuple[int, int, int]] = []
        self.max_registered = 0
        self.register_error: Callable[[int, int, int], int] | None = None
        self.pageable_dma: list[str] = []
        self.attrs = {
            "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": 4,
            "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR": 2048,
            "CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS": 1,
        }
        self._handles = itertools.count(0x100000)
        self._mlock = threading.Lock()

    # --- helpers -------------------------------------------------------------------

    def _stream(self, h: Any) -> _Stream:
        key = int(h)
        if key == 0:
            ctx = self.current()
            with self._lock:
                s = self.default_streams.get(ctx)
                if s is None:
                    s = self.default_streams[ctx] = _Stream(self, ctx)
            return s
        return self.streams[key]

    def _sticky(self, ctx: int) -> int:
        return ILLEGAL_ADDRESS if ctx in self.poisoned else 0

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        """Enqueue a fake kernel on a ctxkit Stream (or handle)."""
        handle = getattr(stream, "handle", stream)
        self._stream(handle).put(fn)

    def shutdown(self) -> None:
        for s in [*self.streams.values(), *self.default_streams.values()]:
            s.q.put(None)

    def page_locked(self, ptr: int, n: int) -> bool:
        """True when host bytes ``[ptr, ptr + n)`` are pinned or registered."""
        hit = self.allocation(ptr)
        if hit is not None:
            base, arr, kind = hit
            return kind == "host" and ptr + n <= base + arr.nbytes
        with self._mlock:
            return any(b <= ptr and ptr + n <= b + m for b, (m, _) in self.registered.items())

    def allocation(self, ptr: int) -> tuple[int, np.ndarray, str] | None:
        with self._mlock:
            for base, (arr, kind) in self.mem.items():
                if base <= ptr < base + max(arr.nbytes, 1):
                    return base, arr, kind
        return None

    def _alloc(self, n: int, kind: str) -> tuple[int, int]:
        arr = np.zeros(max(n, 1), np.uint8)
        ptr = int(arr.ctypes.data)
        with self._mlock:
            self.mem[ptr] = (arr, kind)
        return 0, ptr

    def _free(self, ptr: Any) -> tuple[int]:
        with self._mlock:
            self.mem.pop(int(ptr), None)
        return (0,)

    # --- devices -------------------------------------------------------------------

    def cuDeviceGetAttribute(self, attr: Any, dev: Any) -> tuple[int, int]:
        return (0, self.attrs.get(attr.name, 1))

    def cuDeviceGetName(self, length: int, dev: Any) -> tuple[int, bytes]:
        return (0, f"Fake GPU {int(dev)}".encode())

    def cuDeviceTotalMem(self, dev: Any) -> tuple[int, int]:
        return (0, 80 << 30)

    def cuDeviceGetPCIBusId(self, length: int, dev: Any) -> tuple[int, bytes]:
        return (0, f"0000:{int(dev):02x}:00.0".encode())

    def cuCtxGetStreamPriorityRange(self) -> tuple[int, int, int]:
        return (0, 0, -5)

    # --- streams and events ----------------------------------------------------------

    def cuStreamCreateWithPriority(self, flags: int, priority: int) -> tuple[int, FakeHandle]:
        ctx = self.current()
        if not ctx:
            return (INVALID_CONTEXT, FakeHandle(0))
        h = FakeHandle(next(self._handles))
        self.streams[int(h)] = _Stream(self, ctx)
        return (0, h)

    def cuStreamDestroy(self, h: Any) -> tuple[int]:
        s = self.streams.pop(int(h), None)
        if s is not None:
            s.q.put(None)
        return (0,)

    def cuStreamSynchronize(self, h: Any) -> tuple[int]:
        s = self._stream(h)
        done = threading.Event()
        s.put(done.set, always=True)
        done.wait()
        return (self._sticky(s.ctx),)

    def cuStreamQuery(self, h: Any) -> tuple[int]:
        return self.cuStreamSynchronize(h)

    def cuStreamWaitEvent(self, h: Any, ev: Any, flags: int) -> tuple[int]:
        s = self._stream(h)
        if self._sticky(s.ctx):
            return (ILLEGAL_ADDRESS,)
        e = self.events[int(ev)]
        gen = e.gen
        s.put(lambda: e.wait(gen), always=True)
        return (0,)

    def cuEventCreate(self, flags: int) -> tuple[int, FakeHandle]:
        ctx = self.current()
        if not ctx:
            return (INVALID_CONTEXT, FakeHandle(0))
        h = FakeHandle(next(self._handles))
        self.events[int(h)] = _Event(ctx, int(flags))
        return (0, h)

    def cuEventDestroy(self, h: Any) -> tuple[int]:
        self.events.pop(int(h), None)
        return (0,)

    def cuEventRecord(self, ev: Any, h: Any) -> tuple[int]:
        s = self._stream(h)
        e = self.events[int(ev)]
        if self._sticky(s.ctx):
            return (ILLEGAL_ADDRESS,)
        gen = e.capture()
        s.put(lambda: e.complete(gen), always=True)
        return (0,)

    def cuEventSynchronize(self, ev: Any) -> tuple[int]:
        e = self.events[int(ev)]
        e.wait(e.gen)
        return (self._sticky(e.ctx),)

    def cuEventQuery(self, ev: Any) -> tuple[int]:
        e = self.events[int(ev)]
        if self._sticky(e.ctx):
            return (ILLEGAL_ADDRESS,)
        return (0,) if e.ready() else (NOT_READY,)

    def cuEventElapsedTime(self, a: Any, b: Any) -> tuple[int, float]:
        ea, eb = self.events[int(a)], self.events[int(b)]
        if (ea.flags | eb.flags) & EVENT_DISABLE_TIMING:
            return (INVALID_HANDLE, 0.0)
        ta, tb = ea.stamp(), eb.stamp()
        if ta is None or tb is None:
            return (NOT_READY, 0.0)
        return (0, (tb - ta) * 1000.0)

    # --- memory --------------------------------------------------------------------

    def cuMemAlloc(self, n: int) -> tuple[int, int]:
        if not self.current():
            return (INVALID_CONTEXT, 0)
        return self._alloc(n, "device")

    def cuMemAllocManaged(self, n: int, flags: int) -> tuple[int, int]:
        if not self.current():
            return (INVALID_CONTEXT, 0)
        return self._alloc(n, "managed")

    def cuMemHostAlloc(self, n: int, flags: int) -> tuple[int, int]:
        if not self.current():
            return (INVALID_CONTEXT, 0)
        return self._alloc(n, "host")

    def cuMemFree(self, ptr: Any) -> tuple[int]:
        return self._free(ptr)

    def cuMemFreeHost(self, ptr: Any) -> tuple[int]:
        return self._free(ptr)

    def cuMemHostRegister(self, ptr: Any, n: int, flags: int) -> tuple[int]:
        p = int(ptr)
        if not self.current():
            return (INVALID_CONTEXT,)
        if p % mmap.PAGESIZE or n % mmap.PAGESIZE or n <= 0:
            return (INVALID_VALUE,)
        self.register_calls.append((p, n, int(flags)))
        err = self.register_error(p, n, int(flags)) if self.register_error else 0
        if err:
            return (err,)
        with self._mlock:
            if any(b < p + n and p < b + m for b, (m, _) in self.registered.items()):
                return (ALREADY_REGISTERED,)
            self.registered[p] = (n, int(flags))
            total = sum(m for m, _ in self.registered.values())
            self.max_registered = max(self.max_registered, total)
        return (0,)

    def cuMemHostUnregister(self, ptr: Any) -> tuple[int]:
        if not self.current():
            return (INVALID_CONTEXT,)
        with self._mlock:
            if self.registered.pop(int(ptr), None) is None:
                return (NOT_REGISTERED,)
        return (0,)

    def cuPointerGetAttribute(self, attr: Any, ptr: Any) -> tuple[int, int]:
        hit = self.allocation(int(ptr))
        if hit is None:
            if self.page_locked(int(ptr), 1):
                if attr == _real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
                    return (0, MEMORYTYPE_HOST)
                return (0, 0)
            return (INVALID_VALUE, 0)
        kind = hit[2]
        if attr == _real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
            return (0, MEMORYTYPE_HOST if kind == "host" else MEMORYTYPE_DEVICE)
        if attr == _real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED:
            return (0, int(kind == "managed"))
        return (INVALID_VALUE, 0)

    def _copy(self, dst: Any, src: Any, n: int, h: Any, host: int) -> tuple[int]:
        s = self._stream(h)
        if self._sticky(s.ctx):
            return (ILLEGAL_ADDRESS,)
        d, sr = int(dst), int(src)
        if not self.page_locked(host, n):
            self.pageable_dma.append(f"enqueued {host:#x}+{n}")

        def run() -> None:
            if not self.page_locked(host, n):
                self.pageable_dma.append(f"ran {host:#x}+{n}")
            ctypes.memmove(d, sr, n)

        s.put(run)
        return (0,)

    def cuMemcpyHtoDAsync(self, dst: Any, src: Any, n: int, h: Any) -> tuple[int]:
        return self._copy(dst, src, n, h, int(src))

    def cuMemcpyDtoHAsync(self, dst: Any, src: Any, n: int, h: Any) -> tuple[int]:
        return self._copy(dst, src, n, h, int(dst))

    def cuMemPrefetchAsync(self, ptr: Any, n: int, loc: Any, flags: int, h: Any) -> tuple[int]:
        s = self._stream(h)
        if self._sticky(s.ctx):
            return (ILLEGAL_ADDRESS,)
        target = "cpu" if loc.type == _real.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST else loc.id
        self.prefetches.append((int(ptr), n, target))
        return (0,)


def host_view(view: Any) -> np.ndarray:
    """A numpy array over a ChunkView's (fake device = host) memory."""
    raw = (ctypes.c_char * view.nbytes).from_address(view.ptr)
    return np.frombuffer(raw, dtype=view.dtype).reshape(view.shape)


def scale_body(gpu: FakeGPU, alpha: Any, delay: float = 0.0) -> Callable[..., None]:
    """A map body whose fake kernel computes out = alpha * in (in the input's dtype)."""

    def body(ctx: Any, stream: Any, d_in: Any, d_out: Any, n: int) -> None:
        assert d_in.size == n

        def kernel() -> None:
            if delay:
                time.sleep(delay)
            src, dst = host_view(d_in), host_view(d_out)
            dst[...] = (src * alpha).astype(dst.dtype)

        gpu.launch(stream, kernel)

    return body


@pytest.fixture(name="gpu")
def gpu_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGPU]:
    """Fixture ``gpu``: swap the driver for a 2-device FakeGPU in every ctxkit module for
    one test (import ``gpu_fixture`` into a test module to use it)."""
    import ctxkit.registry as registry_mod
    from ctxkit import _driver, context, device
    from ctxkit.memory import managed
    from ctxkit.registry import ContextRegistry

    fake = FakeGPU(ndev=2)
    swap_driver(monkeypatch, fake)
    monkeypatch.setattr(_driver, "_init_pid", None)
    monkeypatch.setattr(_driver, "_no_device", False)
    monkeypatch.setattr(_driver, "_parent_initialized_pid", None)
    monkeypatch.setattr(device.Device, "_instances", {})
    monkeypatch.setattr(context.Context, "_primaries", {})
    monkeypatch.setattr(context.Context, "_known", type(context.Context._known)())
    monkeypatch.setattr(managed, "_concurrent_managed", {})
    monkeypatch.setattr(registry_mod, "default", ContextRegistry())
    st = thread_state()
    saved = (st.top, list(st.stack))
    st.top, st.stack[:] = None, []
    yield fake
    assert not st.stack, f"the test left contexts pushed in the main thread: {st.stack}"
    st.top, st.stack[:] = saved[0], saved[1]
    fake.shutdown()
