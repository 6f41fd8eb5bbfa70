"""Foreign arrays used on a capturing stream, on the simulated GPU, which enforces the
driver's isolation rule (a capturing stream that waits for uncaptured work fails with
``CUDA_ERROR_STREAM_CAPTURE_ISOLATION`` and loses its capture) and the rule that a
``global``/``thread_local`` capture forbids ``cuEventSynchronize`` in its thread unless the
thread relaxed its interaction mode (both measured on an H200).

ctxkit's rule (ctxkit.memory.interop): an uncaptured producer's work enqueued so far is
finished before the consumer's work is recorded, so every replay runs after it.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.memory.interop import order_after_producers
from tests.support.fakegpu import CAPTURE_GLOBAL, FakeGPU

N = 16
MODES = ["global", "thread_local", "relaxed"]


class CaiArray:
    """A foreign array (``__cuda_array_interface__`` v3) written on *stream*."""

    def __init__(self, ptr: int, stream: int) -> None:
        self.ptr, self.stream = ptr, stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (N,),
            "typestr": "<f4",
            "data": (self.ptr, False),
            "version": 3,
            "stream": self.stream,
        }


def f32(ptr: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_float * N).from_address(ptr), dtype=np.float32)


def _slow_fill(gpu: FakeGPU, stream: Any, x: np.ndarray, value: float) -> None:
    """A producer kernel that writes *x* only after a while."""

    def fill() -> None:
        time.sleep(0.05)
        x[:] = value

    gpu.launch(stream, fill)


@pytest.mark.parametrize("producer_kind", ["stream", "legacy"])
@pytest.mark.parametrize("mode", MODES)
def test_uncaptured_producer_is_finished_before_the_launch_is_captured(
    gpu: FakeGPU, mode: str, producer_kind: str
) -> None:
    ctx = ck.registry.context(0)
    with ctx:
        src, dst = ck.DeviceBuffer(4 * N), ck.DeviceBuffer(4 * N)
        x, y = f32(src.ptr), f32(dst.ptr)
        side = ck.Stream()
        producer = int(side.handle) if producer_kind == "stream" else 1  # CAI: 1 = legacy
        s = ck.Stream()  # non-blocking: the legacy stream may be used during its capture
        _slow_fill(gpu, side if producer_kind == "stream" else 0, x, 3.0)
        with ck.capture(s, mode=mode) as g:
            order_after_producers([CaiArray(src.ptr, producer)], s.handle, ctx, s)
            assert (x == 3.0).all(), "the producer's work was not finished"
            gpu.launch(s, lambda: y.__setitem__(slice(None), 2 * x))
        assert (y == 0).all()  # captured, not run
        assert gpu.invalidations == []
        g.launch(s)
        s.synchronize()
        assert (y == 6.0).all()


@pytest.mark.parametrize("mode", MODES)
def test_blocking_capture_and_legacy_producer_leave_the_legacy_stream_alone(
    gpu: FakeGPU, mode: str
) -> None:
    """The legacy stream cannot be used while a blocking stream is captured: no order is
    possible there, and ctxkit does not break the capture trying (the rule is documented)."""
    ctx = ck.registry.context(0)
    with ctx:
        src = ck.DeviceBuffer(4 * N)
        s = ck.Stream(nonblocking=False)
        with ck.capture(s, mode=mode):
            order_after_producers([CaiArray(src.ptr, 1)], s.handle, ctx, s)
            gpu.launch(s, lambda: None)
        assert gpu.invalidations == []


def test_capture_begun_outside_ctxkit_gets_a_typed_error(gpu: FakeGPU) -> None:
    ctx = ck.registry.context(0)
    with ctx:
        src = ck.DeviceBuffer(4 * N)
        side, s = ck.Stream(), ck.Stream()
        (err,) = gpu.cuStreamBeginCapture(s.handle, CAPTURE_GLOBAL)
        assert not err
        with pytest.raises(ck.CaptureOrderError, match="ck.capture") as info:
            order_after_producers([CaiArray(src.ptr, int(side.handle))], s.handle, ctx, s)
        assert info.value.name == "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"
        err, _g = gpu.cuStreamEndCapture(s.handle)
        assert err == 901  # the failed wait invalidated the foreign capture


def test_event_synchronize_in_a_capturing_thread_needs_a_relaxed_thread_mode(
    gpu: FakeGPU,
) -> None:
    """The fake's rule, as measured on an H200: forbidden in a ``thread_local`` capture's
    thread, allowed once the thread's interaction mode is relaxed."""
    ctx = ck.registry.context(0)
    with ctx:
        side, s = ck.Stream(), ck.Stream()
        ev = ck.Event()
        ev.record(side)
        with pytest.raises(ck.CudaError, match="INVALIDATED"):
            with ck.capture(s, mode="thread_local"):
                gpu.launch(s, lambda: None)
                (err,) = gpu.cuEventSynchronize(ev.handle)
                assert err == 900
        relaxed = gpu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        with ck.capture(s, mode="thread_local"):
            gpu.launch(s, lambda: None)
            err, before = gpu.cuThreadExchangeStreamCaptureMode(relaxed)
            assert gpu.cuEventSynchronize(ev.handle) == (0,)
            gpu.cuThreadExchangeStreamCaptureMode(before)
