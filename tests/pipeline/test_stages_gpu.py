"""Cross-device stages (``Pipeline.submit``) on real GPUs: ordering across devices by
events, failures named, completed stages dropped with their events."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.pipeline import Pipeline, PipelineError
from tests.pipeline.gpu_support import kern  # noqa: F401


def test_completed_stages_are_dropped_with_their_events():
    def live_events() -> int:
        gc.collect()
        return sum(isinstance(o, ck.Event) for o in gc.get_objects())

    with Pipeline([0]) as p:
        p.submit(0, lambda c, s: None).synchronize()
        before = live_events()
        last = None
        for _ in range(6000):
            last = p.submit(0, lambda c, s: None, name="tick")
        assert last is not None
        last.synchronize()
        p.submit(0, lambda c, s: None).synchronize()
        p.submit(0, lambda c, s: None)
        assert live_events() - before < 100  # 6,000 stages once kept 12,002 events
        assert len(p.trace().select(name="stage:tick").intervals) == 6000


@pytest.mark.multigpu
def test_submit_device1_consumes_device0_output_after_waiting(kern, ctx0, ctx1):
    n = 1 << 20
    nbytes = n * 4
    a = ck.DeviceBuffer(nbytes, context=ctx0)
    b = ck.DeviceBuffer(nbytes, context=ctx1)
    c = ck.DeviceBuffer(nbytes, context=ctx1)
    with ctx0:
        a.memset(0)
        kern["spin"].preload()  # lazily loaded here, fill_f32 would wait for spin to end
        kern["fill_f32"].preload()
    with ctx1:
        kern["scale_f32"].preload()
    with Pipeline([0, 1]) as p:

        def produce(ctx, stream):
            kern["spin"].launch(1, 1, 40_000_000, 0, stream=stream)  # ~20 ms
            kern["fill_f32"].launch(256, 256, a.ptr, 3.0, n, stream=stream)

        def consume(ctx, stream):
            ck.copy_peer(b, a, nbytes, stream=stream)
            kern["scale_f32"].launch(256, 256, b.ptr, c.ptr, n, 2.0, stream=stream)

        h0 = p.submit(0, produce)
        h1 = p.submit(1, consume, after=[h0])
        p.wait([h1])
        assert h1.done() and h0.done()
        with ctx1:
            got = c.copy_to_host().view(np.float32)
        assert (got == 6.0).all()  # without the wait, device 1 would copy zeros
        tl = p.trace()
    (wait,) = tl.select(name="wait", device=1).intervals
    (made,) = tl.select(name="stage:produce", device=0).intervals
    (used,) = tl.select(name="stage:consume", device=1).intervals
    assert wait.duration_ms > 5, tl.summary()
    assert wait.end_ms >= made.end_ms - 1.0, tl.summary()
    assert used.start_ms >= made.end_ms - 1.0, tl.summary()
    for buf in (a, b, c):
        buf.close()


def test_submit_failure_names_device_and_stage(kern):
    with Pipeline([0]) as p:

        def bad(ctx, stream):
            kern["scale_f32"].launch(1, 256, 0, 0, 1, stream=stream)  # missing alpha

        h = p.submit(0, bad, name="bad-stage")
        with pytest.raises(PipelineError, match="'bad-stage' on device 0") as info:
            h.synchronize()
        assert isinstance(info.value.__cause__, ck.LaunchArgumentError)
