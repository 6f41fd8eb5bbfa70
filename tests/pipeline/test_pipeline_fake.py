"""Pipeline.map on a simulated GPU: every host path end to end, buffer reuse, the trace,
unified memory, and the demo built on it.

The simulated GPU (tests/support/fakegpu.py) runs every stream on its own thread with
random delays, so the staging logic (buffer reuse only after the copy that used it,
drains after their D2H, cross-device waits) is checked for real; the GPU suite
(tests/pipeline/test_pipeline_gpu.py) checks the same against the driver.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.pipeline import Pipeline, PipelineOptions, close_idle_host_threads
from tests.support.fakegpu import host_view, scale_body
from tests.support.helpers import OBJECT_DTYPES, object_array, object_dtype_message

# --- whole runs on the simulated GPU ---------------------------------------------------------


def _pinned(arr: np.ndarray) -> np.ndarray:
    p = ck.pinned_empty(arr.shape, arr.dtype, context=ck.registry.context(0))
    p[...] = arr
    return p


@pytest.mark.parametrize("dtype,alpha", [(np.float32, 2.0), (np.float64, 2.0), (np.int32, 3)])
@pytest.mark.parametrize("n", [0, 1, 7, 100_003])
@pytest.mark.parametrize("devices", [[0], [0, 1]])
def test_map_pageable_exact(gpu, dtype, alpha, n, devices):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 100).astype(dtype)
    with Pipeline(
        devices,
        options=ck.PipelineOptions(chunk_bytes=16 * 1024, staging_buffers=3, host_threads=3),
    ) as p:
        out = p.map(scale_body(gpu, alpha), x)
        assert out.dtype == x.dtype and out.shape == x.shape
        np.testing.assert_array_equal(out, (x * alpha).astype(dtype))
        stats = p.last_stats
        assert stats.nbytes == x.nbytes
        if n:
            assert stats.path == "in=staged, out=staged"
            assert sum(d.rows for d in stats.devices) == n
            assert len(stats.devices) == min(len(devices), n)
    assert not gpu.kernel_errors


def test_map_is_reusable_and_buffers_are_reused(gpu):
    x = np.arange(50_000, dtype=np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=8192, host_threads=2)) as p:
        first = p.map(scale_body(gpu, 2.0), x)
        slots = [(s.d_in, s.pin_in) for d in p._devices for s in d.slots]
        second = p.map(scale_body(gpu, 2.0), x[:30_000])
        again = [(s.d_in, s.pin_in) for d in p._devices for s in d.slots]
        assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(slots, again))
        np.testing.assert_array_equal(first, x * 2)
        np.testing.assert_array_equal(second, x[:30_000] * 2)
        # A bigger chunk grows the buffers.
        p.map(scale_body(gpu, 2.0), x, chunk_bytes=64 * 1024)
        assert p._devices[0].slots[0].d_in.nbytes >= 64 * 1024


def test_map_many_chunks_through_few_slots_stress(gpu):
    gpu.jitter = 0.001
    x = np.random.default_rng(1).random(40_000)
    with Pipeline(
        [0, 1], options=ck.PipelineOptions(chunk_bytes=4096, staging_buffers=2, host_threads=4)
    ) as p:
        out = p.map(scale_body(gpu, 2.0), x)
    np.testing.assert_array_equal(out, x * 2)


def test_map_with_slow_host_copies_stress(gpu, monkeypatch):
    """Host copies slower than the GPU: a staging buffer must not be overwritten by the
    next D2H (or refilled before its H2D ran) however the threads interleave."""
    from ctxkit.pipeline import staging as _staging

    real = _staging.copy_piece
    rng = np.random.default_rng(5)

    def slow_piece(dst, src, trace, label, streaming=False):
        slow = 0.004 if trace[1] == "drain" else 0.0005
        if "-drain" in label:  # the drain thread's own piece: the slowest of all
            slow = 0.008
        time.sleep(float(rng.uniform(0, slow)))
        real(dst, src, trace, label, streaming)

    monkeypatch.setattr(_staging, "copy_piece", slow_piece)
    gpu.jitter = 0.0
    x = np.random.default_rng(2).random(30_000)
    with Pipeline(
        [0, 1], options=ck.PipelineOptions(chunk_bytes=4096, staging_buffers=2, host_threads=3)
    ) as p:
        out = p.map(scale_body(gpu, 2.0), x)
    np.testing.assert_array_equal(out, x * 2)


def test_drains_stream_into_a_given_output_but_not_into_one_the_map_made(gpu, monkeypatch):
    """Non-temporal stores into pages first touched by the drain (``out="pageable"``'s
    ``np.empty_like``) cost more than plain ones: the drain copies those with np.copyto;
    a caller's output (and every fill) is streamed where the size pays."""
    from ctxkit.pipeline import run as _run
    from ctxkit.pipeline import staging as _staging

    monkeypatch.setattr(_run, "streaming_pays", lambda nbytes: True)
    real = _staging.copy_piece
    pieces: list[tuple[np.ndarray, bool]] = []

    def spy(dst, src, trace, label, streaming=False):
        pieces.append((dst, streaming))
        real(dst, src, trace, label, streaming)

    monkeypatch.setattr(_staging, "copy_piece", spy)
    x = np.arange(20_000, dtype=np.float32)
    given = np.zeros_like(x)
    opts = ck.PipelineOptions(chunk_bytes=8192, host_path="staged")
    with Pipeline([0], options=opts) as p:
        for out in ("pageable", given):
            pieces.clear()
            res = p.map(scale_body(gpu, 2.0), x, out)
            np.testing.assert_array_equal(res, x * 2)
            drains = [s for dst, s in pieces if np.shares_memory(dst, res)]
            fills = [s for dst, s in pieces if not np.shares_memory(dst, res)]
            assert drains and fills and all(fills)
            assert all(drains) == (out is given) and any(drains) == (out is given)


def test_map_pinned_takes_the_zero_copy_path(gpu):
    x = _pinned(np.arange(10_000, dtype=np.float32))
    out = _pinned(np.zeros(10_000, np.float32))
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096)) as p:
        res = p.map(scale_body(gpu, 2.0), x, out)
        assert res is out
        assert p.last_stats.path == "pinned"
        assert all(s.pin_in is None and s.pin_out is None for d in p._devices for s in d.slots)
        assert p._host_pool == []  # no host copy threads needed
    np.testing.assert_array_equal(out, np.arange(10_000, dtype=np.float32) * 2)


def test_map_mixed_pinned_input_pageable_output(gpu):
    x = _pinned(np.arange(5000, dtype=np.float64))
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=4096)) as p:
        out = p.map(scale_body(gpu, 2.0), x)
        assert p.last_stats.path == "in=pinned, out=staged"
    np.testing.assert_array_equal(out, np.arange(5000) * 2.0)


def test_map_2d_rows_and_other_out_dtype(gpu):
    x = np.arange(3000, dtype=np.float32).reshape(1000, 3)
    out = np.zeros((1000, 3), np.float64)
    seen = []

    def body(ctx, stream, d_in, d_out, n):
        seen.append((d_in.shape, d_out.dtype, n, ctx.device.ordinal))
        assert d_in.shape[1:] == (3,) and n == d_in.size

        def kernel():
            host_view(d_out)[...] = host_view(d_in) + 0.5

        gpu.launch(stream, kernel)

    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=1200)) as p:
        p.map(body, x, out)
    np.testing.assert_array_equal(out, x.astype(np.float64) + 0.5)
    assert {s[3] for s in seen} == {0, 1}
    assert all(s[0][0] == 50 for s in seen)  # 1200 // 24: sized by the wider (output) rows


def test_map_in_place(gpu):
    x = np.arange(9000, dtype=np.int32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096)) as p:
        res = p.map(scale_body(gpu, 3), x, out=x)
    assert res is x
    np.testing.assert_array_equal(x, np.arange(9000, dtype=np.int32) * 3)


def test_map_dynamic_schedule(gpu):
    x = np.arange(20_000, dtype=np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096, schedule="dynamic")) as p:
        out = p.map(scale_body(gpu, 2.0), x)
        stats = p.last_stats
    np.testing.assert_array_equal(out, x * 2)
    assert sum(d.chunks for d in stats.devices) == 20
    assert sum(d.rows for d in stats.devices) == 20_000


def test_dynamic_schedule_gives_a_slow_device_less_work(gpu):
    x = np.arange(64 * 1024, dtype=np.float32)

    def body(ctx, stream, d_in, d_out, n):
        delay = 0.02 if ctx.device.ordinal == 0 else 0.0
        scale_body(gpu, 2.0, delay)(ctx, stream, d_in, d_out, n)

    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096, staging_buffers=2)) as p:
        out = p.map(body, x, options=ck.PipelineOptions(schedule="dynamic"))
        by_dev = {d.device: d.chunks for d in p.last_stats.devices}
    np.testing.assert_array_equal(out, x * 2)
    assert by_dev[1] > by_dev[0]


def test_map_passes_args_to_a_body(gpu):
    got = []

    def body(ctx, stream, d_in, d_out, n, alpha, note):
        got.append((n, note))
        scale_body(gpu, alpha)(ctx, stream, d_in, d_out, n)

    x = np.ones(10, np.float32)
    with Pipeline([0]) as p:
        out = p.map(body, x, args=(3.0, "hi"))
    assert got == [(10, "hi")]
    np.testing.assert_array_equal(out, x * 3)


def test_map_argument_errors(gpu):
    with Pipeline([0]) as p:
        with pytest.raises(TypeError, match="kernel must be"):
            p.map(42, np.zeros(4))
        with pytest.raises(TypeError, match=r"\(ObjectCode, 'entry_name'\)"):
            p.map(("x", 1), np.zeros(4))
        with pytest.raises(TypeError, match="ObjectCode"):
            p.map((3.5, "scale_f32"), np.zeros(4))
        with pytest.raises(ValueError, match="block"):
            p.map(scale_body(gpu, 2), np.zeros(4), options=ck.PipelineOptions(block=2048))
        with pytest.raises(TypeError, match="args must be a tuple"):
            p.map(scale_body(gpu, 2), np.zeros(4), args=2.0)
        with pytest.raises(TypeError, match="PipelineOptions"):
            p.map(scale_body(gpu, 2), np.zeros(4), options={"block": 64})
        with pytest.raises(ValueError, match=r"options.staging_buffers=8 differs"):
            p.map(scale_body(gpu, 2), np.zeros(4), options=PipelineOptions(staging_buffers=8))
        with pytest.raises(ValueError, match="chunk_bytes"):
            p.map(scale_body(gpu, 2), np.zeros(4), chunk_bytes=0)
        with pytest.raises(ValueError, match="as many rows"):
            p.map(scale_body(gpu, 2), np.zeros(4), np.zeros(3))


def test_pipeline_devices_and_repr(gpu):
    with Pipeline() as p:
        assert [d.ordinal for d in p.devices] == [0, 1]
        assert all(c.is_primary for c in p.contexts)
        assert "devices=[0, 1]" in repr(p)
        assert p.stream(1).context.device.ordinal == 1
        with pytest.raises(ValueError, match="not one of this pipeline's devices"):
            p.stream(5)
    assert p.closed and "closed" in repr(p)
    with pytest.raises(ValueError, match="closed"):
        p.map(scale_body(gpu, 2), np.zeros(4))
    p.close()  # idempotent


def test_pipeline_rejects_out_of_range_device(gpu):
    with pytest.raises(ValueError, match="out of range"):
        Pipeline([0, 7])


def test_pipeline_uses_a_given_context(gpu):
    own = ck.Context.create(1)
    try:
        with Pipeline([own]) as p:
            assert p.contexts == [own]
            out = p.map(scale_body(gpu, 2.0), np.arange(100.0))
        np.testing.assert_array_equal(out, np.arange(100.0) * 2)
    finally:
        own.close()


def host_blocks(gpu) -> set[int]:
    return {ptr for ptr, (_arr, kind) in gpu.mem.items() if kind == "host"}


def test_close_frees_every_buffer_and_stops_threads(gpu):
    before = set(gpu.mem)
    threads_before = {t.name for t in threading.enumerate()}
    p = Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096, host_threads=2))
    p.map(scale_body(gpu, 2.0), np.arange(20_000, dtype=np.float32))
    assert len(gpu.mem) > len(before)
    p.close()
    cached = host_blocks(gpu) - before
    assert set(gpu.mem) - before == cached  # device buffers freed
    stats = ck.pinned_pool().stats()
    assert stats.in_use_blocks == 0 and stats.cached_blocks == len(cached) > 0
    time.sleep(0.05)
    left = {t.name for t in threading.enumerate()} - threads_before
    assert not [n for n in left if n.startswith("ctxkit-pipeline")]
    close_idle_host_threads()  # the copy threads were left idle for the next Pipeline
    left = {t.name for t in threading.enumerate()} - threads_before
    assert not [n for n in left if n.startswith("ctxkit-stage")]


def test_a_new_pipeline_takes_the_host_threads_a_closed_one_left(gpu):
    close_idle_host_threads()
    x = np.arange(20_000, dtype=np.float32)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=4096, host_threads=3)) as p:
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), x), 2 * x)
        first = set(p._host_pool[0]._threads)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=4096, host_threads=3)) as p:
        np.testing.assert_array_equal(p.map(scale_body(gpu, 3.0), x), 3 * x)
        assert set(p._host_pool[0]._threads) == first
    assert close_idle_host_threads() == 3


def test_new_pipelines_reuse_the_staging_blocks_of_closed_ones(gpu):
    x = np.arange(20_000, dtype=np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096, host_threads=2)) as p:
        p.map(scale_body(gpu, 2.0), x)
    blocks = host_blocks(gpu)
    for k in range(3):  # a new Pipeline per call page-locks nothing
        with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096, host_threads=2)) as p:
            np.testing.assert_array_equal(p.map(scale_body(gpu, k), x), x * k)
        assert host_blocks(gpu) == blocks
    stats = ck.pinned_pool().stats()
    assert stats.in_use_blocks == 0 and stats.hits >= 3 * len(blocks)


# --- trace ----------------------------------------------------------------------------


def test_trace_shows_overlap_of_copies_kernels_and_devices(gpu, tmp_path):
    x = np.arange(16_000, dtype=np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4000, staging_buffers=3)) as p:
        # kernels long enough that the next chunk's fill and H2D fit inside one on a
        # loaded CI host (at 10 ms they once all missed)
        p.map(scale_body(gpu, 2.0, delay=0.03), x)
        tl = p.trace()
    names = set(tl.names())
    assert {"h2d", "kernel", "d2h", "fill", "drain"} <= names
    assert tl.dropped == 0
    assert len(tl.select(name="kernel")) == 16
    # The H2D of chunk c+1 runs while the kernel of chunk c does (same device).
    pairs = [
        (a, b)
        for a, b in tl.overlaps({"name": "h2d"}, {"name": "kernel"})
        if a.device == b.device and a.chunk == b.chunk + 1
    ]
    assert pairs
    assert tl.overlaps({"device": 0, "name": "kernel"}, {"device": 1, "name": "kernel"})
    assert {i.stream for i in tl.select(name="fill")} <= {i.stream for i in tl if i.is_host}
    data = tl.to_chrome_trace(tmp_path / "t.json")
    assert {e["pid"] for e in data["traceEvents"] if e["ph"] == "X"} == {0, 1}


def test_trace_survives_close(gpu):
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4000)) as p:
        p.map(scale_body(gpu, 2.0), np.arange(4000, dtype=np.float32))
    tl = p.trace()
    assert tl.dropped == 0 and len(tl.select(name="kernel")) == 4


def test_trace_off(gpu):
    with Pipeline([0], options=ck.PipelineOptions(trace=False)) as p:
        p.map(scale_body(gpu, 2.0), np.arange(100.0))
        assert len(p.trace()) == 0
        assert p._devices[0].events[False]  # pooled sync events came back


def test_map_managed(gpu):
    n = 10_000
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096)) as p:
        buf = ck.ManagedBuffer(n * 4, context=p.contexts[0])
        xm = buf.as_numpy(np.float32)
        xm[...] = np.arange(n, dtype=np.float32)
        out = p.map_managed(scale_body(gpu, 2.0), buf, dtype=np.float32)
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) * 2)
        assert p.last_stats.path == "managed"
        targets = {t for _, _, t in gpu.prefetches}
        assert targets == {0, 1, "cpu"}
        # the numpy view, in place.
        p.map_managed(scale_body(gpu, 2.0), xm, xm)
        np.testing.assert_array_equal(xm, np.arange(n, dtype=np.float32) * 2)
        assert {"prefetch", "kernel", "prefetch_back"} <= set(p.trace().names())
        with pytest.raises(ValueError, match="not unified"):
            p.map_managed(scale_body(gpu, 2.0), np.zeros(10))
        with pytest.raises(TypeError, match="dtype="):
            p.map_managed(scale_body(gpu, 2.0), buf)
        with pytest.raises(TypeError, match="ManagedBuffer"):
            p.map_managed(scale_body(gpu, 2.0), [1, 2])
        del xm, out


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_map_refuses_python_objects_in_and_out(gpu, dtype):
    arr = object_array(dtype, 4096)
    with Pipeline([0]) as p:
        buf = ck.ManagedBuffer(4096, context=p.contexts[0])
        for call in (
            lambda: p.map(scale_body(gpu, 2.0), arr),
            lambda: p.map(scale_body(gpu, 2.0), arr, out="pinned"),
            lambda: p.map(scale_body(gpu, 2.0), np.zeros(len(arr)), out=arr),
            lambda: p.map_managed(scale_body(gpu, 2.0), buf, dtype=dtype),
            lambda: p.map_managed(scale_body(gpu, 2.0), buf, arr, dtype=np.float64),
        ):
            with pytest.raises(TypeError, match=object_dtype_message(dtype)):
                call()
        assert p.last_stats.nbytes == 0  # nothing ran


# --- tests/benchmarks/test_bench_pipeline_fake.py imports this stand-in for scale_f32 ----


class FakeScaleKernel:
    """Stands in for the compiled ``scale_f32`` on the simulated GPU: ``launch`` for the
    naive pattern, a map body (``p(ctx, stream, d_in, d_out, n, alpha)``) for Pipeline."""

    def __init__(self, gpu, error: float = 1.0) -> None:
        self.gpu = gpu
        self.error = error

    def launch(self, grid, block, d_in, d_out, n, alpha, stream=None):
        assert grid >= 1 and block == 256

        def kernel():
            src = np.frombuffer((ctypes.c_char * (n * 4)).from_address(d_in), np.float32)
            dst = np.frombuffer((ctypes.c_char * (n * 4)).from_address(d_out), np.float32)
            dst[:] = src * np.float32(alpha * self.error)

        self.gpu.launch(stream, kernel)

    def __call__(self, ctx, stream, d_in, d_out, n, alpha):
        self.launch(1, 256, d_in.ptr, d_out.ptr, n, alpha, stream=stream)


def test_call_options_change_only_what_they_set(gpu):
    """A call's options override the fields they set; the rest are the pipeline's."""
    with Pipeline([0], options=PipelineOptions(chunk_bytes=4096, schedule="dynamic")) as p:
        assert p.options.chunk_bytes == 4096 and p.options.staging_buffers == 4
        x = np.arange(10_000, dtype=np.float32)
        out = p.map(scale_body(gpu, 2.0), x, options=PipelineOptions(host_path="staged"))
        np.testing.assert_array_equal(out, x * 2)
        assert (p._run.plan.rows_per_chunk, p._run.plan.schedule) == (1024, "dynamic")
        p.map(scale_body(gpu, 2.0), x, chunk_bytes=8192, options=PipelineOptions(schedule="static"))
        assert (p._run.plan.rows_per_chunk, p._run.plan.schedule) == (2048, "static")
        assert p.options.chunk_bytes == 4096  # the pipeline's own options are unchanged
