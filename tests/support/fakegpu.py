"""A simulated GPU for testing ctxkit on machines without one.

It extends tests/support/fakedriver.FakeDriver (per-thread context stacks) with streams,
events, memory, copies, kernels, libraries and graphs, modelled on CUDA's semantics:

* every stream is a thread executing its operations in order, each after a small random
  delay, so work really runs asynchronously to the host and to other streams: a pipeline
  that reuses a staging buffer too early reads the wrong data here too; ``cuStreamQuery``
  answers ``CUDA_ERROR_NOT_READY`` while work is queued, ``cuCtxSynchronize`` waits for
  every stream of the context;
* events carry generations (re-recording captures the new point of the stream);
  ``cuStreamWaitEvent`` blocks a stream until the captured generation completed;
* "device" memory is host memory (so copies are ``memmove``); pinned and managed
  allocations and registered ranges are known to ``cuPointerGetAttribute``, anything
  else is pageable; freeing memory that is not allocated (twice, or after the primary
  context was reset) is ``CUDA_ERROR_INVALID_VALUE``;
* ``cuMemHostRegister`` keeps exact byte ranges, as the driver does (unaligned ones
  too): never a byte twice nor a byte of ``cuMemHostAlloc`` memory
  (``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``), while two registrations may share a
  page; ``register_error`` can make it fail.
  A copy whose host range starts inside a registration and ends beyond it is
  ``CUDA_ERROR_INVALID_VALUE``, as on the driver.
  Every async copy whose host side is pageable - when enqueued or when it runs (an
  unregister before the DMA finished) - is recorded in ``pageable_dma``;
* a kernel is a Python function enqueued with :meth:`FakeGPU.launch`; raising
  :class:`Fault` in it is an illegal address: as on current drivers, it poisons every
  context of the process (later operations are skipped, synchronization returns 700);
* stream capture follows the driver's rules (tests/support/fakecapture.py): work on a
  capturing stream becomes graph nodes, an unsafe call by a thread the capture's mode
  forbids invalidates it, and ``cuStreamEndCapture`` then fails;
  ``invalidations`` says what did it.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as _real

from ctxkit.context import thread_state
from tests.support.fakecapture import (  # noqa: F401  (re-exported for tests)
    CAPTURE_GLOBAL,
    CAPTURE_RELAXED,
    CAPTURE_THREAD_LOCAL,
    LEGACY_STREAMS,
    STREAM_CAPTURE_INVALIDATED,
    STREAM_CAPTURE_UNSUPPORTED,
    STREAM_NON_BLOCKING,
    Capture,
    CaptureRules,
)
from tests.support.fakedriver import (
    FakeDriver,
    FakeHandle,
    fresh_registry,
    spans_registration_edge,
    swap_driver,
)
from tests.support.fakegreen import GreenRules

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
        self.captured_by: Capture | None = None  # recorded inside this open capture

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
    def __init__(self, gpu: FakeGPU, ctx: int, flags: int = 0) -> None:
        self.gpu = gpu
        self.ctx = ctx
        self.flags = flags
        self.pending = 0
        self._plock = threading.Lock()
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
                self.gpu.fault = ILLEGAL_ADDRESS
            except BaseException as exc:  # a bug in a test kernel: poison, keep it
                self.gpu.kernel_errors.append(exc)
                self.gpu.fault = ILLEGAL_ADDRESS
            finally:
                with self._plock:
                    self.pending -= 1

    def put(self, op: Callable[[], None], always: bool = False) -> None:
        gpu = self.gpu

        def guarded() -> None:
            if always or not gpu.fault:
                op()

        with self._plock:
            self.pending += 1
        self.q.put(guarded)

    def stop(self) -> None:
        self.q.put(None)


class FakeGPU(GreenRules, CaptureRules, FakeDriver):
    """The fake driver plus streams, events, memory, copies, kernels and green contexts
    (tests/support/fakegreen.py)."""

    CUpointer_attribute = _real.CUpointer_attribute
    CUmemLocation = _real.CUmemLocation
    CUmemLocationType = _real.CUmemLocationType
    CUstream = _real.CUstream
    CUstreamCaptureMode = _real.CUstreamCaptureMode
    CUjit_option = _real.CUjit_option
    CUmem_advise = _real.CUmem_advise

    def __init__(
        self, ndev: int = 2, jitter: float = 0.0003, bindings_major: int | None = None
    ) -> None:
        super().__init__(ndev, bindings_major)
        self.jitter = jitter
        self.kernel_errors: list[BaseException] = []
        self.init_capture_rules()
        self.init_green()
        self.streams: dict[int, _Stream] = {}
        self.default_streams: dict[int, _Stream] = {}
        self.events: dict[int, _Event] = {}
        self.mem: dict[int, tuple[np.ndarray, str]] = {}
        self.mem_ctx: dict[int, int] = {}  # pointer -> allocating context
        self.prefetches: list[tuple[int, int, Any]] = []
        self.advice: list[tuple[int, int, Any, Any]] = []  # (ptr, n, advice, target)
        self.peer_access: set[tuple[int, int]] = set()  # (device, peer): cuDeviceCanAccessPeer
        self.registered: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, flags)
        self.registered_in: dict[int, int] = {}  # ptr -> the context that registered it
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
        # Re-entrant, and readers scan copies: a collection inside a locked section may
        # run a finalizer that frees or unregisters memory in the same thread (a dropped
        # pool's blocks, a dead array's pages), which must neither deadlock nor change a
        # dict being scanned.
        self._mlock = threading.RLock()

    # --- helpers -------------------------------------------------------------------

    def _stream(self, h: Any) -> _Stream:
        key = int(h)
        if key in LEGACY_STREAMS:
            ctx = self.current()
            with self._lock:
                s = self.default_streams.get(ctx)
            if s is None:  # started outside the lock: a finalizer in its start may need it
                new = _Stream(self, ctx)
                with self._lock:
                    s = self.default_streams.setdefault(ctx, new)
                if s is not new:
                    new.q.put(None)
            return s
        return self.streams[key]

    def _sticky(self, ctx: int) -> int:
        """The sticky error of *ctx*: a fault anywhere poisons every context."""
        return self.fault

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        """Enqueue a fake kernel on a ctxkit Stream (or handle); recorded as a graph node
        when the stream is capturing."""
        handle = int(getattr(stream, "handle", stream))
        self._submit(handle, fn, "kernel launch")

    def _submit(self, h: Any, op: Callable[[], None], what: str, always: bool = False) -> int:
        """Run *op* on stream *h*, record it in the stream's open capture, or refuse it
        (the capture rules); returns the CUresult. ``always``: run it after a fault too
        (event completions, waits)."""
        key = int(h)
        cap = self.captures.get(key)
        if cap is not None:
            cap.nodes.append(op)
            return 0
        if key in LEGACY_STREAMS:
            err = self._legacy(what)
            if err:
                return err
        elif key not in self.streams:
            return INVALID_HANDLE
        self._stream(key).put(op, always)
        return 0

    def shutdown(self) -> None:
        for s in [*self.streams.values(), *self.default_streams.values()]:
            s.stop()

    # --- context reset -----------------------------------------------------------------

    def reset_context(self, ctx: int) -> None:
        """Reset/destroy: the context's memory, registrations (as on an H200: a
        ``PORTABLE`` one too), streams and events are gone."""
        with self._mlock:
            for ptr in [p for p, c in self.mem_ctx.copy().items() if c == ctx]:
                self.mem.pop(ptr, None)
                self.mem_ctx.pop(ptr, None)
            for ptr in [p for p, c in self.registered_in.copy().items() if c == ctx]:
                self.registered.pop(ptr, None)
                self.registered_in.pop(ptr, None)
        for h in [h for h, st in self.streams.items() if st.ctx == ctx]:
            self.streams.pop(h).stop()
        for h in [h for h, e in self.events.items() if e.ctx == ctx]:
            self.events.pop(h)

    def page_locked(self, ptr: int, n: int) -> bool:
        """True when host bytes ``[ptr, ptr + n)`` are pinned or registered."""
        hit = self.allocation(ptr)
        if hit is not None:
            base, arr, kind = hit
            return kind == "host" and ptr + n <= base + arr.nbytes
        with self._mlock:
            return any(
                b <= ptr and ptr + n <= b + m for b, (m, _) in self.registered.copy().items()
            )

    def spans_edge(self, ptr: int, n: int) -> bool:
        """True when host bytes ``[ptr, ptr + n)`` start inside a registration and end
        beyond it."""
        with self._mlock:
            ranges = [(b, b + m) for b, (m, _) in self.registered.copy().items()]
        return spans_registration_edge(ranges, ptr, n)

    def allocation(self, ptr: int) -> tuple[int, np.ndarray, str] | None:
        with self._mlock:
            for base, (arr, kind) in self.mem.copy().items():
                if base <= ptr < base + max(arr.nbytes, 1):
                    return base, arr, kind
        return None

    def _alloc(self, n: int, kind: str, what: str) -> tuple[int, int]:
        err = self.context_error() or self.unsafe(what)
        if err:
            return err, 0
        arr = np.zeros(max(n, 1), np.uint8)
        ptr = int(arr.ctypes.data)
        with self._mlock:
            self.mem[ptr] = (arr, kind)
            self.mem_ctx[ptr] = self.current()
        return 0, ptr

    def _free(self, ptr: Any, what: str) -> tuple[int]:
        err = self.unsafe(what)
        if err:
            return (err,)
        with self._mlock:
            if self.mem.pop(int(ptr), None) is None:
                return (INVALID_VALUE,)
            self.mem_ctx.pop(int(ptr), None)
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

    def cuDeviceCanAccessPeer(self, dev: Any, peer: Any) -> tuple[int, int]:
        return (0, int((int(dev), int(peer)) in self.peer_access))

    def cuCtxGetStreamPriorityRange(self) -> tuple[int, int, int]:
        return (0, 0, -5)

    def cuCtxSynchronize(self) -> tuple[int]:
        """Waits for every stream of the current context; reports a pending fault."""
        self.calls["cuCtxSynchronize"] += 1
        err = self.context_error() if not self.fault else 0
        if err:
            return (err,)
        err = self.unsafe("cuCtxSynchronize")
        if err:
            return (err,)
        ctx = self.current()
        for s in [*self.streams.values(), self._stream(0)]:
            if s.ctx == ctx:
                self._drain(s)
        return (self.fault,)

    # --- streams and events ----------------------------------------------------------

    def _drain(self, s: _Stream) -> None:
        done = threading.Event()
        s.put(done.set, always=True)
        done.wait()

    def make_stream(self, ctx: int, flags: int) -> _Stream:
        """A new stream of context *ctx* (its worker thread started)."""
        return _Stream(self, ctx, flags)

    def cuStreamCreateWithPriority(self, flags: int, priority: int) -> tuple[int, FakeHandle]:
        ctx = self.current()
        if not ctx:
            return (INVALID_CONTEXT, FakeHandle(0))
        h = FakeHandle(next(self._handles))
        self.streams[int(h)] = _Stream(self, ctx, int(flags))
        return (0, h)

    def cuStreamDestroy(self, h: Any) -> tuple[int]:
        err = self._conflicts(h, "cuStreamDestroy of the capturing stream") or self.unsafe(
            "cuStreamDestroy"
        )
        if err:
            return (err,)
        s = self.streams.pop(int(h), None)
        if s is None:
            return (INVALID_HANDLE,)
        s.stop()
        return (0,)

    def cuStreamGetFlags(self, h: Any) -> tuple[int, int]:
        s = self.streams.get(int(h))
        return (INVALID_HANDLE, 0) if s is None else (0, s.flags)

    def cuStreamGetPriority(self, h: Any) -> tuple[int, int]:
        return (0, 0) if int(h) in self.streams else (INVALID_HANDLE, 0)

    def cuStreamGetCtx(self, h: Any) -> tuple[int, Any]:
        s = self.streams.get(int(h))
        return (INVALID_HANDLE, None) if s is None else (0, FakeHandle(s.ctx))

    def _wait_for_stream(self, h: Any, what: str) -> int:
        key = int(h)
        err = self._conflicts(h, f"{what} of the capturing stream")
        if not err and key in LEGACY_STREAMS:
            err = self._legacy(what)
        if not err and key not in LEGACY_STREAMS and key not in self.streams:
            err = INVALID_HANDLE
        return err

    def cuStreamSynchronize(self, h: Any) -> tuple[int]:
        err = self._wait_for_stream(h, "cuStreamSynchronize")
        if err:
            return (err,)
        s = self._stream(h)
        self._drain(s)
        return (self._sticky(s.ctx),)

    def cuStreamQuery(self, h: Any) -> tuple[int]:
        err = self._wait_for_stream(h, "cuStreamQuery")
        if err:
            return (err,)
        s = self._stream(h)
        if self.fault:
            return (self.fault,)
        with s._plock:
            return (NOT_READY if s.pending else 0,)

    def cuStreamWaitEvent(self, h: Any, ev: Any, flags: int) -> tuple[int]:
        e = self.events.get(int(ev))
        if e is None:
            return (INVALID_HANDLE,)
        if e.captured_by is not None and e.captured_by.stream != int(h):
            raise AssertionError("fake: joining another stream into a capture is not modelled")
        if self._sticky(0):
            return (ILLEGAL_ADDRESS,)
        err = self.isolation(h, e.captured_by)
        if err or int(h) in self.captures:
            return (err,)  # an event of this capture: an edge, in program order here
        gen = e.gen
        return (self._submit(h, lambda: e.wait(gen), "cuStreamWaitEvent", always=True),)

    def cuEventCreate(self, flags: int) -> tuple[int, FakeHandle]:
        ctx = self.current()
        if not ctx:
            return (INVALID_CONTEXT, FakeHandle(0))
        h = FakeHandle(next(self._handles))
        self.events[int(h)] = _Event(ctx, int(flags))
        return (0, h)

    def cuEventDestroy(self, h: Any) -> tuple[int]:
        err = self.unsafe("cuEventDestroy")
        if err:
            return (err,)
        return (0,) if self.events.pop(int(h), None) is not None else (INVALID_HANDLE,)

    def cuEventRecord(self, ev: Any, h: Any) -> tuple[int]:
        e = self.events.get(int(ev))
        if e is None:
            return (INVALID_HANDLE,)
        cap = self.captures.get(int(h))
        if cap is not None:
            e.captured_by = cap
            return (0,)
        if self._sticky(e.ctx):
            return (ILLEGAL_ADDRESS,)
        key = int(h)
        if key in LEGACY_STREAMS:
            err = self._legacy("cuEventRecord", unsafe=False)
            if err:
                return (err,)
        elif key not in self.streams:
            return (INVALID_HANDLE,)
        e.captured_by = None
        gen = e.capture()
        self._stream(key).put(lambda: e.complete(gen), always=True)
        return (0,)

    def _event_conflict(self, e: _Event, what: str) -> int:
        cap = e.captured_by
        if cap is None or self.captures.get(cap.stream) is not cap:
            return 0
        with self._clock:
            self._invalidate(cap, f"{what} of an event recorded in the capture")
        return STREAM_CAPTURE_UNSUPPORTED

    def cuEventSynchronize(self, ev: Any) -> tuple[int]:
        e = self.events[int(ev)]
        err = self._event_conflict(e, "cuEventSynchronize") or self.unsafe("cuEventSynchronize")
        if err:
            return (err,)
        e.wait(e.gen)
        return (self._sticky(e.ctx),)

    def cuEventQuery(self, ev: Any) -> tuple[int]:
        e = self.events[int(ev)]
        err = self._event_conflict(e, "cuEventQuery")
        if err:
            return (err,)
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
        return self._alloc(n, "device", "cuMemAlloc")

    def cuMemAllocManaged(self, n: int, flags: int) -> tuple[int, int]:
        return self._alloc(n, "managed", "cuMemAllocManaged")

    def cuMemHostAlloc(self, n: int, flags: int) -> tuple[int, int]:
        return self._alloc(n, "host", "cuMemHostAlloc")

    def cuMemFree(self, ptr: Any) -> tuple[int]:
        return self._free(ptr, "cuMemFree")

    def cuMemFreeHost(self, ptr: Any) -> tuple[int]:
        return self._free(ptr, "cuMemFreeHost")

    def cuMemHostRegister(self, ptr: Any, n: int, flags: int) -> tuple[int]:
        p = int(ptr)
        if not self.current():
            return (INVALID_CONTEXT,)
        err = self.unsafe("cuMemHostRegister")
        if err:
            return (err,)
        if n <= 0:
            return (INVALID_VALUE,)
        self.register_calls.append((p, n, int(flags)))
        err = self.register_error(p, n, int(flags)) if self.register_error else 0
        if err:
            return (err,)
        with self._mlock:
            locked = [(b, b + m) for b, (m, _) in self.registered.copy().items()]
            locked += [(b, b + a.nbytes) for b, (a, k) in self.mem.copy().items() if k == "host"]
            if any(b < p + n and p < e for b, e in locked):  # registered or cuMemHostAlloc
                return (ALREADY_REGISTERED,)
            self.registered[p] = (n, int(flags))
            self.registered_in[p] = self.current()
            total = sum(m for m, _ in self.registered.copy().values())
            self.max_registered = max(self.max_registered, total)
        return (0,)

    def cuMemHostUnregister(self, ptr: Any) -> tuple[int]:
        if not self.current():
            return (INVALID_CONTEXT,)
        err = self.unsafe("cuMemHostUnregister")
        if err:
            return (err,)
        with self._mlock:
            if self.registered.pop(int(ptr), None) is None:
                return (NOT_REGISTERED,)
            self.registered_in.pop(int(ptr), None)
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

    def _copy(self, dst: Any, src: Any, n: int, h: Any, host: int, what: str) -> tuple[int]:
        if self._sticky(0):
            return (ILLEGAL_ADDRESS,)
        d, sr = int(dst), int(src)
        if self.spans_edge(host, n):
            return (INVALID_VALUE,)
        cap = self.captures.get(int(h))
        if not self.page_locked(host, n):
            if cap is not None:  # a pageable copy is synchronous: it cannot be captured
                with self._clock:
                    self._invalidate(cap, f"{what} from pageable host memory")
                return (STREAM_CAPTURE_UNSUPPORTED,)
            self.pageable_dma.append(f"enqueued {host:#x}+{n}")

        def run() -> None:
            if not self.page_locked(host, n):
                self.pageable_dma.append(f"ran {host:#x}+{n}")
            ctypes.memmove(d, sr, n)

        return (self._submit(h, run, what),)

    def cuMemcpyHtoDAsync(self, dst: Any, src: Any, n: int, h: Any) -> tuple[int]:
        return self._copy(dst, src, n, h, int(src), "cuMemcpyHtoDAsync")

    def cuMemcpyDtoHAsync(self, dst: Any, src: Any, n: int, h: Any) -> tuple[int]:
        return self._copy(dst, src, n, h, int(dst), "cuMemcpyDtoHAsync")

    def _on_legacy(
        self, what: str, work: Callable[[], Any], host: tuple[int, int] | None = None
    ) -> tuple[int]:
        """Synchronous *work*: ordered on the legacy default stream, the host waits for it.
        *host*: the ``(ptr, n)`` host side of a copy, refused when it spans the edge of a
        registration."""
        err = self.context_error() or self._legacy(what)
        if err:
            return (err,)
        if host is not None and self.spans_edge(*host):
            return (INVALID_VALUE,)
        self._drain(self._stream(0))
        work()
        return (self.fault,)

    def cuMemcpyHtoD(self, dst: Any, src: Any, n: int) -> tuple[int]:
        copy = partial(ctypes.memmove, int(dst), int(src), n)
        return self._on_legacy("cuMemcpyHtoD", copy, (int(src), n))

    def cuMemcpyDtoH(self, dst: Any, src: Any, n: int) -> tuple[int]:
        copy = partial(ctypes.memmove, int(dst), int(src), n)
        return self._on_legacy("cuMemcpyDtoH", copy, (int(dst), n))

    def cuMemcpyDtoD(self, dst: Any, src: Any, n: int) -> tuple[int]:
        return self._on_legacy("cuMemcpyDtoD", partial(ctypes.memmove, int(dst), int(src), n))

    def cuMemsetD8(self, ptr: Any, value: int, n: int) -> tuple[int]:
        return self._on_legacy("cuMemsetD8", partial(ctypes.memset, int(ptr), value, n))

    def cuMemsetD8Async(self, ptr: Any, value: int, n: int, h: Any) -> tuple[int]:
        p = int(ptr)
        return (self._submit(h, lambda: ctypes.memset(p, value, n), "cuMemsetD8Async"),)

    def _target(
        self, rest: tuple[Any, ...], n13: int, n12: int, what: str
    ) -> tuple[Any, tuple[Any, ...]]:
        """The device ordinal or ``"cpu"`` a prefetch/advise names: a ``CUmemLocation``
        (cuda-bindings 13.x) or an ordinal with ``-1`` for the host (12.x)."""
        if self.bindings_major >= 13:
            if len(rest) != n13:
                raise TypeError(f"{what} takes a CUmemLocation in cuda-bindings 13.x")
            loc = rest[0]
            host = loc.type == _real.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
            return ("cpu" if host else int(loc.id)), rest[1:]
        if len(rest) != n12 or not isinstance(rest[0], int):
            raise TypeError(f"{what} takes a device ordinal in cuda-bindings 12.x")
        return ("cpu" if rest[0] == -1 else rest[0]), rest[1:]

    def cuMemPrefetchAsync(self, ptr: Any, n: int, *rest: Any) -> tuple[int]:
        """``(ptr, n, CUmemLocation, flags, stream)`` (13.x) or ``(ptr, n, device, stream)``
        (12.x)."""
        target, _stream = self._target(rest, 3, 2, "cuMemPrefetchAsync")
        if self._sticky(0):
            return (ILLEGAL_ADDRESS,)
        self.prefetches.append((int(ptr), n, target))
        return (0,)

    def cuMemAdvise(self, ptr: Any, n: int, advice: Any, where: Any) -> tuple[int]:
        """``(ptr, n, advice, CUmemLocation)`` (13.x) or ``(ptr, n, advice, device)``
        (12.x)."""
        target, _ = self._target((where,), 1, 1, "cuMemAdvise")
        self.advice.append((int(ptr), n, advice, target))
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


#: The module and launch calls a benchmark's raw side makes, which FakeGPU leaves to a test.
RAW_LAUNCH_CALLS = (
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuStreamCreate",
    "cuLaunchKernel",
)


def install_raw_calls(monkeypatch: Any, gpu: FakeGPU, calls: Any) -> None:
    """Give *gpu* the :data:`RAW_LAUNCH_CALLS` of *calls* (a test's model of them)."""
    for name in RAW_LAUNCH_CALLS:
        monkeypatch.setattr(gpu, name, getattr(calls, name), raising=False)


def launch_scale_f32(gpu: FakeGPU, stream: Any, params: int) -> None:
    """Enqueue ptx/scale.cu's ``scale_f32(in, out, n, alpha)`` from its packed ``void**``
    *params*: what a fake ``cuLaunchKernel`` of the benchmarks' scale kernel runs."""
    ptrs = (ctypes.c_uint64 * 4).from_address(params)
    d_in, d_out, n = (ctypes.c_uint64.from_address(ptrs[i]).value for i in range(3))
    alpha = ctypes.c_float.from_address(ptrs[3]).value

    def kernel() -> None:
        src = np.frombuffer((ctypes.c_char * (n * 4)).from_address(d_in), np.float32)
        dst = np.frombuffer((ctypes.c_char * (n * 4)).from_address(d_out), np.float32)
        dst[:] = src * np.float32(alpha)

    gpu.launch(stream, kernel)


@pytest.fixture(name="gpu")
def gpu_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGPU]:
    """Fixture ``gpu``: swap the driver for a 2-device FakeGPU in every ctxkit module for
    one test (import ``gpu_fixture`` into a test module to use it)."""

    from ctxkit import _driver, context, device
    from ctxkit.memory import managed

    fake = FakeGPU(ndev=2)
    swap_driver(monkeypatch, fake)
    monkeypatch.setattr(_driver, "_init_pid", None)
    monkeypatch.setattr(_driver, "_no_device", False)
    monkeypatch.setattr(_driver, "_parent_initialized_pid", None)
    monkeypatch.setattr(device.Device, "_instances", {})
    monkeypatch.setattr(context.Context, "_primaries", {})
    monkeypatch.setattr(context.Context, "_known", type(context.Context._known)())
    monkeypatch.setattr(managed, "_concurrent_managed", {})
    from ctxkit.memory import pinned

    monkeypatch.setattr(pinned, "_process_pool", None)  # blocks of earlier fakes are gone
    from ctxkit.pipeline import pincache

    monkeypatch.setattr(pincache, "_process", None)  # and so are their pin-on-reuse records
    fresh_registry(monkeypatch)
    st = thread_state()
    saved = (st.top, list(st.stack))
    st.top, st.stack[:] = None, []
    yield fake
    assert not st.stack, f"the test left contexts pushed in the main thread: {st.stack}"
    st.top, st.stack[:] = saved[0], saved[1]
    fake.shutdown()
