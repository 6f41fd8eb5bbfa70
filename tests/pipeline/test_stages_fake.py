"""Cross-device stages (``Pipeline.submit``) on a simulated GPU: ordering by events,
errors, and completed stages dropped (their handles and events are not kept)."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from ctxkit.pipeline import Pipeline, PipelineError, PipelineOptions, StageHandle
from ctxkit.stream import Event
from tests.support.fakegpu import scale_body


def test_submit_orders_device_1_after_device_0(gpu):
    order: list[str] = []
    release = threading.Event()
    with Pipeline([0, 1]) as p:

        def produce(ctx, stream):
            assert ctx.device.ordinal == 0 and stream is p.stream(0)

            def kernel():
                release.wait(5)
                time.sleep(0.03)
                order.append("produce")

            gpu.launch(stream, kernel)
            return "made"

        def consume(ctx, stream):
            gpu.launch(stream, lambda: order.append("consume"))

        h0 = p.submit(0, produce)
        h1 = p.submit(1, consume, after=[h0], name="consume")
        h1.result(5)  # device 1's stream waits for h0 from here on; h0 is still running
        release.set()
        p.wait()
        assert order == ["produce", "consume"]
        assert h0.result() == "made" and h0.done() and h1.done()
        assert "consume" in repr(h1)
        tl = p.trace()
        (wait,) = tl.select(name="wait").intervals
        (made,) = tl.select(name="stage:produce").intervals
        (used,) = tl.select(name="stage:consume").intervals
        # The fake stamps an event when its stream's thread reaches it, and aligns device
        # 0's and device 1's times by their own calibrations: on a loaded machine stamps
        # run some ms late and the devices some ms apart. The wait (30 ms of producer
        # after the release; no wait takes ~0.1 ms) and the ends agree within that.
        skew = 20
        assert wait.device == 1 and wait.duration_ms >= 30 - skew
        assert wait.end_ms >= made.end_ms - skew and used.start_ms >= made.end_ms - skew
        # Handles can still be used after wait() (and with a ctxkit Event).
        h2 = p.submit(1, consume, after=[h0, h1.event])
        h2.synchronize()


def test_submit_errors(gpu):
    with Pipeline([0, 1]) as p, Pipeline([0]) as other:
        with pytest.raises(TypeError, match="fn must be callable"):
            p.submit(0, 42)
        with pytest.raises(TypeError, match="StageHandles or ctxkit Events"):
            p.submit(0, lambda c, s: None, after=["x"])
        with pytest.raises(ValueError, match="not one of this pipeline's devices"):
            p.submit(7, lambda c, s: None)
        foreign = other.submit(0, lambda c, s: None)
        with pytest.raises(ValueError, match="not submitted to this pipeline"):
            p.submit(1, lambda c, s: None, after=[foreign])

        def broken(ctx, stream):
            raise RuntimeError("cannot enqueue")

        bad = p.submit(1, broken)
        with pytest.raises(PipelineError, match="'broken' on device 1") as info:
            p.wait([bad])
        assert info.value.device == 1 and info.value.chunk is None
        dep = p.submit(0, lambda c, s: None, after=[bad])
        with pytest.raises(PipelineError, match="dependency failed"):
            dep.synchronize()
        for _ in range(3):  # later submits drop completed stages, not failed ones
            p.submit(1, lambda c, s: None).synchronize()
        with pytest.raises(PipelineError, match="'broken'"):
            p.wait()
        p.wait()  # reported once: forgotten afterwards


def _live_events(gpu) -> int:
    gc.collect()
    return len(gpu.events)


@pytest.mark.parametrize("trace", [True, False])
def test_completed_stages_are_dropped_with_their_events(gpu, trace):
    """Thousands of stages whose handles the caller drops keep no handle and no event
    alive (they once kept two events each), and the trace still shows every stage."""
    gpu.jitter = 0.0
    n = 2000
    with Pipeline([0, 1], options=PipelineOptions(trace=trace)) as p:
        p.submit(0, lambda c, s: None).synchronize()
        before = _live_events(gpu)
        last: StageHandle | None = None
        for i in range(n):
            last = p.submit(i % 2, lambda c, s: None, name="tick")
        assert last is not None
        last.synchronize()
        for device in (0, 1, 0):  # each submit drops the stages found complete
            p.submit(device, lambda c, s: None).synchronize()
        assert len(p._stages.outstanding()) <= 2
        assert _live_events(gpu) - before < 10
        tl = p.trace()
        if trace:
            ticks = tl.select(name="stage:tick").intervals
            assert len(ticks) == n and {i.device for i in ticks} == {0, 1}
            assert all(i.stream == "stage" and i.duration_ms >= 0 for i in ticks)
        else:
            assert len(tl) == 0
        del last
        p.wait()
        assert p._stages.outstanding() == []


def test_a_dropped_stage_can_still_be_waited_for_through_its_handle(gpu):
    gpu.jitter = 0.0
    seen: list[int] = []
    with Pipeline([0, 1]) as p:
        first = p.submit(0, lambda c, s: gpu.launch(s, lambda: seen.append(0)))
        first.synchronize()
        for _ in range(5):
            p.submit(0, lambda c, s: None).synchronize()
        assert first not in p._stages.outstanding()
        assert first.done() and isinstance(first.event, Event)
        after = p.submit(1, lambda c, s: gpu.launch(s, lambda: seen.append(1)), after=[first])
        p.wait([after])
    assert seen == [0, 1]


def test_stages_and_maps_share_the_pipeline(gpu):
    x = np.arange(10_000, dtype=np.float32)
    with Pipeline([0, 1], options=PipelineOptions(chunk_bytes=4096)) as p:
        h = p.submit(1, lambda c, s: "staged before the map")
        out = p.map(scale_body(gpu, 2.0), x)
        assert h.result() == "staged before the map"
        later = p.submit(0, lambda c, s: None, name="after-map")
        p.wait()
        assert later.done()
        names = set(p.trace().names())
    np.testing.assert_array_equal(out, x * 2)
    assert "stage:after-map" in names  # the map started a new recording: the stage is in it
