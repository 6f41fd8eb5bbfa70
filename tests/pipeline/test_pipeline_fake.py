"""Pipeline on CPU: pure planning and validation, then whole runs on a simulated GPU.

The simulated GPU (tests/support/fakegpu.py) runs every stream on its own thread with
random delays, so the staging logic (buffer reuse only after the copy that used it,
drains after their D2H, cross-device waits) is checked for real; the GPU suite
(tests/pipeline/test_pipeline_gpu.py) checks the same against the driver.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.context import thread_state
from ctxkit.pipeline import (
    Chunk,
    ChunkView,
    DeviceStats,
    Pipeline,
    PipelineError,
    RunStats,
    default_chunk_bytes,
    grid_size,
    make_plan,
    prepare_io,
    split_rows,
)
from ctxkit.pipeline.plan import check_device_specs, check_options
from tests.support.fakegpu import Fault, gpu_fixture, host_view, scale_body  # noqa: F401

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]

# --- pure planning ----------------------------------------------------------------------


@pytest.mark.parametrize("n,parts", [(0, 1), (0, 3), (1, 2), (7, 2), (10, 3), (1000003, 2)])
def test_split_rows_covers_everything_evenly(n, parts):
    spans = split_rows(n, parts)
    assert len(spans) == parts
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1


def test_split_rows_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_parts"):
        split_rows(5, 0)
    with pytest.raises(ValueError, match="n_rows"):
        split_rows(-1, 2)


def test_default_chunk_bytes():
    assert default_chunk_bytes(2 << 30, 1) == 32 * MiB
    assert default_chunk_bytes(40 * MiB, 1) == 10 * MiB  # at least 4 chunks per device
    assert default_chunk_bytes(40 * MiB, 2) == 5 * MiB
    assert default_chunk_bytes(100, 2) == MiB  # never below 1 MiB
    assert default_chunk_bytes(0, 1) == MiB


def test_grid_size():
    assert grid_size(1, 256, 100) == 1
    assert grid_size(256, 256, 100) == 1
    assert grid_size(257, 256, 100) == 2
    assert grid_size(10**9, 256, 528) == 528  # capped: kernels loop (grid-stride)
    assert grid_size(0, 256, 10) == 1
    with pytest.raises(ValueError, match="block"):
        grid_size(10, 0, 10)


def test_make_plan_static_chunks_are_row_aligned_and_complete():
    plan = make_plan(n_rows=1000, row_bytes=12, n_devices=2, chunk_bytes=1000)
    assert plan.rows_per_chunk == 83  # 1000 // 12
    assert plan.parts == ((0, 500), (500, 1000))
    for part, (lo, hi) in enumerate(plan.parts):
        mine = plan.for_part(part)
        assert mine[0].row0 == lo and mine[-1].row1 == hi
        assert all(a.row1 == b.row0 for a, b in itertools.pairwise(mine))
        assert all(0 < c.rows <= 83 for c in mine)
    assert [c.index for c in plan.chunks] == list(range(len(plan.chunks)))
    assert sum(c.rows for c in plan.chunks) == 1000


def test_make_plan_fewer_rows_than_devices_and_empty():
    plan = make_plan(1, 4, 3, 1 << 20)
    assert [len(plan.for_part(p)) for p in range(3)] == [0, 0, 1]
    assert make_plan(0, 4, 2, 1024).chunks == ()


def test_make_plan_row_bigger_than_chunk_gives_one_row_chunks():
    plan = make_plan(5, 4096, 1, 1000)
    assert plan.rows_per_chunk == 1 and len(plan.chunks) == 5


def test_make_plan_dynamic_shares_one_queue():
    plan = make_plan(100, 4, 3, 40, schedule="dynamic")
    assert plan.schedule == "dynamic"
    assert all(c.part == -1 for c in plan.chunks)
    assert [c.rows for c in plan.chunks] == [10] * 10


def test_make_plan_default_chunk_and_errors():
    plan = make_plan(2**20, 4, 1)  # 4 MiB -> 1 MiB chunks
    assert plan.rows_per_chunk == 2**18
    with pytest.raises(ValueError, match="schedule"):
        make_plan(10, 4, 1, 8, schedule="round-robin")
    with pytest.raises(ValueError, match="at least one device"):
        make_plan(10, 4, 0, 8)
    with pytest.raises(ValueError, match="chunk_bytes"):
        make_plan(10, 4, 1, 0)
    with pytest.raises(ValueError, match="row_bytes"):
        make_plan(10, -4, 1, 8)


def test_chunk_rows():
    assert Chunk(3, 0, 10, 25).rows == 15


# --- array and option validation -----------------------------------------------------------


def test_prepare_io_defaults_and_contiguity():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    xx, out = prepare_io(x)
    assert xx is x and out.shape == x.shape and out.dtype == x.dtype
    xt, _ = prepare_io(x.T)  # non-contiguous input is copied
    assert xt.flags.c_contiguous and np.array_equal(xt, x.T)
    _same, out2 = prepare_io(x, x)  # in place
    assert out2 is x


def test_prepare_io_accepts_other_out_dtype_and_row_shape():
    x = np.zeros((5, 2), np.float32)
    out = np.zeros((5, 3), np.float64)
    assert prepare_io(x, out)[1] is out


@pytest.mark.parametrize(
    "x,out,exc,match",
    [
        ([1.0, 2.0], None, TypeError, "numpy array"),
        (np.array(1.0, np.float32), None, ValueError, "at least one dimension"),
        (np.array([object()]), None, TypeError, "object"),
        (np.zeros(4), [0.0] * 4, TypeError, "out must be a numpy array"),
        (np.zeros(4), np.zeros(5), ValueError, "as many rows"),
        (np.zeros(4), np.zeros((4, 2))[:, 0], ValueError, "C-contiguous"),
        (np.zeros(4), np.array([None] * 4), TypeError, "object"),
    ],
)
def test_prepare_io_errors(x, out, exc, match):
    with pytest.raises(exc, match=match):
        prepare_io(x, out)


def test_prepare_io_read_only_and_partial_overlap():
    x = np.zeros(8)
    ro = np.zeros(8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        prepare_io(x, ro)
    big = np.zeros(9)
    with pytest.raises(ValueError, match="partially overlaps"):
        prepare_io(big[:8], big[1:])


def test_option_validation():
    check_options(None, 3, None, "static")
    with pytest.raises(ValueError, match="staging_buffers"):
        check_options(None, 0, None, "static")
    with pytest.raises(TypeError, match="chunk_bytes must be an int"):
        check_options(1.5, 3, None, "static")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_threads"):
        check_options(None, 3, 0, "static")
    with pytest.raises(ValueError, match="schedule"):
        check_options(None, 3, None, "greedy")


def test_device_spec_validation():
    assert check_device_specs(None) is None
    assert check_device_specs((0, 1)) == [0, 1]
    with pytest.raises(ValueError, match="at least one device"):
        check_device_specs([])
    with pytest.raises(TypeError, match="sequence"):
        check_device_specs(0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ints, Devices or Contexts"):
        check_device_specs(["gpu0"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="listed twice"):
        check_device_specs([1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        check_device_specs([-1])


def test_pipeline_constructor_validates_before_touching_the_driver():
    with pytest.raises(ValueError, match="at least one device"):
        Pipeline(devices=[])
    with pytest.raises(ValueError, match="staging_buffers"):
        Pipeline(devices=[0], staging_buffers=0)
    with pytest.raises(ValueError, match="schedule"):
        Pipeline(devices=[0], schedule="random")


@pytest.mark.skipif(ck.device_count() > 0, reason="checks the machine-without-GPU error")
def test_pipeline_without_gpu_is_a_clear_error():
    with pytest.raises(ck.CudaError, match="driver|no CUDA device"):
        Pipeline()


def test_result_types():
    v = ChunkView(0x1000, (4, 2), np.dtype(np.float32))
    assert v.size == 8 and v.nbytes == 32
    cai = v.__cuda_array_interface__
    assert cai["data"] == (0x1000, False) and cai["shape"] == (4, 2) and cai["typestr"] == "<f4"
    assert "ChunkView" in repr(v)
    d = DeviceStats(0, chunks=2, rows=10, nbytes=4_000_000_000, seconds=0.5)
    assert d.gbps == pytest.approx(8.0)
    assert DeviceStats(1).gbps == 0.0
    r = RunStats(2_000_000_000, 0.1, "pinned", [d])
    assert r.gbps == pytest.approx(20.0) and RunStats().gbps == 0.0
    e = PipelineError("boom", device=1, chunk=3, step="kernel")
    assert (e.device, e.chunk, e.step, e.poisoned) == (1, 3, "kernel", False)
    assert isinstance(e, ck.CudaError)


def test_pipeline_error_survives_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(PipelineError("device 1, chunk 2", 1, 2, "h2d")))
    assert "chunk 2" in str(e)


def test_benchmark_exits_2_without_gpu():
    if ck.device_count() > 0:
        pytest.skip("checks the machine-without-GPU path")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2, res.stderr
    assert "no GPU" in (res.stdout + res.stderr)


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
    with Pipeline(devices, chunk_bytes=16 * 1024, staging_buffers=3, host_threads=3) as p:
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
    with Pipeline([0, 1], chunk_bytes=8192, host_threads=2) as p:
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
    with Pipeline([0, 1], chunk_bytes=4096, staging_buffers=2, host_threads=4) as p:
        out = p.map(scale_body(gpu, 2.0), x)
    np.testing.assert_array_equal(out, x * 2)


def test_map_with_slow_host_copies_stress(gpu, monkeypatch):
    """Host copies slower than the GPU: a staging buffer must not be overwritten by the
    next D2H (or refilled before its H2D ran) however the threads interleave."""
    from ctxkit.pipeline import staging as _staging

    real = _staging.copy_piece
    rng = np.random.default_rng(5)

    def slow_piece(dst, src, trace, label):
        slow = 0.004 if trace[1] == "drain" else 0.0005
        if "-drain" in label:  # the drain thread's own piece: the slowest of all
            slow = 0.008
        time.sleep(float(rng.uniform(0, slow)))
        real(dst, src, trace, label)

    monkeypatch.setattr(_staging, "copy_piece", slow_piece)
    gpu.jitter = 0.0
    x = np.random.default_rng(2).random(30_000)
    with Pipeline([0, 1], chunk_bytes=4096, staging_buffers=2, host_threads=3) as p:
        out = p.map(scale_body(gpu, 2.0), x)
    np.testing.assert_array_equal(out, x * 2)


def test_map_pinned_takes_the_zero_copy_path(gpu):
    x = _pinned(np.arange(10_000, dtype=np.float32))
    out = _pinned(np.zeros(10_000, np.float32))
    with Pipeline([0, 1], chunk_bytes=4096) as p:
        res = p.map(scale_body(gpu, 2.0), x, out)
        assert res is out
        assert p.last_stats.path == "pinned"
        assert all(s.pin_in is None and s.pin_out is None for d in p._devices for s in d.slots)
        assert p._pool == []  # no host copy threads needed
    np.testing.assert_array_equal(out, np.arange(10_000, dtype=np.float32) * 2)


def test_map_mixed_pinned_input_pageable_output(gpu):
    x = _pinned(np.arange(5000, dtype=np.float64))
    with Pipeline([0], chunk_bytes=4096) as p:
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

    with Pipeline([0, 1], chunk_bytes=1200) as p:
        p.map(body, x, out)
    np.testing.assert_array_equal(out, x.astype(np.float64) + 0.5)
    assert {s[3] for s in seen} == {0, 1}
    assert all(s[0][0] == 50 for s in seen)  # 1200 // 24: sized by the wider (output) rows


def test_map_in_place(gpu):
    x = np.arange(9000, dtype=np.int32)
    with Pipeline([0, 1], chunk_bytes=4096) as p:
        res = p.map(scale_body(gpu, 3), x, out=x)
    assert res is x
    np.testing.assert_array_equal(x, np.arange(9000, dtype=np.int32) * 3)


def test_map_dynamic_schedule(gpu):
    x = np.arange(20_000, dtype=np.float32)
    with Pipeline([0, 1], chunk_bytes=4096, schedule="dynamic") as p:
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

    with Pipeline([0, 1], chunk_bytes=4096, staging_buffers=2) as p:
        out = p.map(body, x, schedule="dynamic")
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
            p.map(scale_body(gpu, 2), np.zeros(4), block=2048)
        with pytest.raises(TypeError, match="args must be a tuple"):
            p.map(scale_body(gpu, 2), np.zeros(4), args=2.0)
        with pytest.raises(ValueError, match="mode"):
            p.map(scale_body(gpu, 2), np.zeros(4), mode="magic")
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


def test_close_frees_every_buffer_and_stops_threads(gpu):
    before = set(gpu.mem)
    threads_before = {t.name for t in threading.enumerate()}
    p = Pipeline([0, 1], chunk_bytes=4096, host_threads=2)
    p.map(scale_body(gpu, 2.0), np.arange(20_000, dtype=np.float32))
    assert len(gpu.mem) > len(before)
    p.close()
    assert set(gpu.mem) == before
    time.sleep(0.05)
    left = {t.name for t in threading.enumerate()} - threads_before
    assert not [n for n in left if n.startswith(("ctxkit-pipeline", "ctxkit-stage"))]


# --- errors ---------------------------------------------------------------------------


def test_error_in_one_chunk_names_device_and_chunk_and_pipeline_is_reusable(gpu):
    x = np.arange(8000, dtype=np.float32)  # 2 devices x 4 chunks of 1000 rows

    def body(ctx, stream, d_in, d_out, n):
        calls.append((ctx.device.ordinal, n))
        if ctx.device.ordinal == 1 and sum(1 for c in calls if c[0] == 1) == 2:
            raise ValueError("bad kernel argument")
        scale_body(gpu, 2.0)(ctx, stream, d_in, d_out, n)

    calls: list[tuple[int, int]] = []
    with Pipeline([0, 1], chunk_bytes=4000) as p:
        with pytest.raises(PipelineError) as info:
            p.map(body, x)
        err = info.value
        assert err.device == 1 and err.chunk == 5 and err.step == "kernel"
        assert "device 1" in str(err) and "chunk 5" in str(err) and "rows 5000..6000" in str(err)
        assert isinstance(err.__cause__, ValueError) and not err.poisoned
        assert not p.poisoned
        calls.clear()
        out = p.map(scale_body(gpu, 2.0), x)  # buffers reusable afterwards
        np.testing.assert_array_equal(out, x * 2)


def test_kernel_fault_poisons_the_pipeline_with_a_clear_message(gpu):
    x = np.arange(8000, dtype=np.float32)

    def body(ctx, stream, d_in, d_out, n):
        if ctx.device.ordinal == 0 and not faulted:
            faulted.append(1)

            def bad():
                raise Fault

            gpu.launch(stream, bad)
            return
        scale_body(gpu, 2.0)(ctx, stream, d_in, d_out, n)

    faulted: list[int] = []
    with Pipeline([0, 1], chunk_bytes=4000) as p:
        with pytest.raises(PipelineError) as info:
            p.map(body, x)
        err = info.value
        assert err.device == 0 and err.poisoned
        assert err.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert "poisoned" in str(err) and "chunk" in str(err)
        assert p.poisoned
        with pytest.raises(ck.ContextPoisonedError, match="device 0 was poisoned"):
            p.map(scale_body(gpu, 2.0), x)
    assert p.closed


def test_keyboard_interrupt_from_a_worker_propagates_and_pipeline_recovers(gpu):
    x = np.arange(8000, dtype=np.float32)
    n_calls = []

    def body(ctx, stream, d_in, d_out, n):
        n_calls.append(1)
        if len(n_calls) == 3:
            raise KeyboardInterrupt
        scale_body(gpu, 2.0)(ctx, stream, d_in, d_out, n)

    with Pipeline([0, 1], chunk_bytes=4000) as p:
        with pytest.raises(KeyboardInterrupt):
            p.map(body, x)
        out = p.map(scale_body(gpu, 2.0), x)
    np.testing.assert_array_equal(out, x * 2)


def test_ctrl_c_in_the_main_thread_during_map(gpu):
    """A real SIGINT while map waits: workers stop early, nothing stays pushed, and the
    pipeline works afterwards."""
    x = np.arange(64_000, dtype=np.float32)  # 64 chunks of 20 ms kernels: >= 320 ms in all
    calls = []

    def body(ctx, stream, d_in, d_out, n):
        calls.append(n)
        scale_body(gpu, 2.0, delay=0.02)(ctx, stream, d_in, d_out, n)

    with Pipeline([0, 1], chunk_bytes=4000, staging_buffers=2) as p:
        main = threading.main_thread().ident
        assert main is not None
        timer = threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGINT))
        t0 = time.perf_counter()
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                p.map(body, x)
        finally:
            timer.cancel()
        assert time.perf_counter() - t0 < 0.2  # interrupted, not run to the end
        assert len(calls) < 64
        assert not thread_state().stack
        assert p._inflight == []
        out = p.map(scale_body(gpu, 2.0), x)
        np.testing.assert_array_equal(out, x * 2)


# --- trace ----------------------------------------------------------------------------


def test_trace_shows_overlap_of_copies_kernels_and_devices(gpu, tmp_path):
    x = np.arange(16_000, dtype=np.float32)
    with Pipeline([0, 1], chunk_bytes=4000, staging_buffers=3) as p:
        p.map(scale_body(gpu, 2.0, delay=0.01), x)
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
    with Pipeline([0, 1], chunk_bytes=4000) as p:
        p.map(scale_body(gpu, 2.0), np.arange(4000, dtype=np.float32))
    tl = p.trace()
    assert tl.dropped == 0 and len(tl.select(name="kernel")) == 4


def test_trace_off(gpu):
    with Pipeline([0], trace=False) as p:
        p.map(scale_body(gpu, 2.0), np.arange(100.0))
        assert len(p.trace()) == 0
        assert p._devices[0].events[False]  # pooled sync events came back


def test_map_managed(gpu):
    n = 10_000
    with Pipeline([0, 1], chunk_bytes=4096) as p:
        buf = ck.ManagedBuffer(n * 4, context=p.contexts[0])
        xm = buf.as_numpy(np.float32)
        xm[...] = np.arange(n, dtype=np.float32)
        out = p.map_managed(scale_body(gpu, 2.0), buf, dtype=np.float32)
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) * 2)
        assert p.last_stats.path == "managed"
        targets = {t for _, _, t in gpu.prefetches}
        assert targets == {0, 1, "cpu"}
        # mode="managed" with the numpy view, in place.
        p.map(scale_body(gpu, 2.0), xm, xm, mode="managed")
        np.testing.assert_array_equal(xm, np.arange(n, dtype=np.float32) * 2)
        assert {"prefetch", "kernel", "prefetch_back"} <= set(p.trace().names())
        with pytest.raises(ValueError, match="not unified"):
            p.map_managed(scale_body(gpu, 2.0), np.zeros(10))
        with pytest.raises(TypeError, match="dtype="):
            p.map_managed(scale_body(gpu, 2.0), buf)
        with pytest.raises(TypeError, match="ManagedBuffer"):
            p.map_managed(scale_body(gpu, 2.0), [1, 2])
        del xm, out


# --- cross-device stages ---------------------------------------------------------------------


def test_submit_orders_device_1_after_device_0(gpu):
    order: list[str] = []
    with Pipeline([0, 1]) as p:

        def produce(ctx, stream):
            assert ctx.device.ordinal == 0 and stream is p.stream(0)
            gpu.launch(stream, lambda: (time.sleep(0.05), order.append("produce")))
            return "made"

        def consume(ctx, stream):
            gpu.launch(stream, lambda: order.append("consume"))

        h0 = p.submit(0, produce)
        h1 = p.submit(1, consume, after=[h0], name="consume")
        p.wait()
        assert order == ["produce", "consume"]
        assert h0.result() == "made" and h0.done() and h1.done()
        assert "consume" in repr(h1)
        tl = p.trace()
        (wait,) = tl.select(name="wait").intervals
        (made,) = tl.select(name="stage:produce").intervals
        assert wait.device == 1 and wait.duration_ms > 20
        assert wait.end_ms >= made.end_ms - 5
        # Handles can still be used after wait() (and with a ctxkit Event).
        h2 = p.submit(1, consume, after=[h0, h1.event])
        h2.synchronize()


def test_submit_errors(gpu):
    with Pipeline([0, 1]) as p, Pipeline([0]) as other:
        with pytest.raises(TypeError, match="fn must be callable"):
            p.submit(0, 42)
        with pytest.raises(TypeError, match="StageHandles or ctxkit Events"):
            p.submit(0, lambda c, s: None, after=["x"])
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
        with pytest.raises(PipelineError):
            p.wait()


# --- the demo, end to end on the simulated GPU --------------------------------------------


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


def _demo_args(tmp_path, **kw):
    base = {"size_mb": 1.0, "devices": None, "trace": str(tmp_path / "demo.json"), "quick": False}
    return argparse.Namespace(**{**base, **kw})


def _fake_kernel(monkeypatch, gpu, error=1.0):
    from ctxkit.cli import demo as _demo

    obj = SimpleNamespace(target="cubin", arch="sm_90", from_cache=True)
    monkeypatch.setattr(
        _demo, "load_scale_kernel", lambda: (obj, FakeScaleKernel(gpu, error), 0.01)
    )


def test_demo_runs_verifies_and_writes_the_trace(gpu, monkeypatch, tmp_path, capsys):
    from ctxkit.cli.demo import run_demo

    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_demo_args(tmp_path)) == 0
    text = capsys.readouterr().out
    for needle in ("GPU 0: Fake GPU 0", "from the cache", "naive pattern, 1 chunk(s)",
                   "naive pattern, 8 chunk(s)", "ctxkit pageable", "ctxkit pinned",
                   "per device", "OK: every result matches numpy exactly"):  # fmt: skip
        assert needle in text, needle
    assert "GB/s" in text and "  GPU 1: " in text
    back = ck.trace.Timeline.from_chrome_trace(tmp_path / "demo.json")
    assert back.devices() == [0, 1] and {"h2d", "kernel", "d2h"} <= set(back.names())


def test_demo_reports_a_wrong_result(gpu, monkeypatch, tmp_path, capsys):
    from ctxkit.cli.demo import run_demo

    _fake_kernel(monkeypatch, gpu, error=1.5)
    assert run_demo(_demo_args(tmp_path, devices=1, quick=True, trace=None)) == 1
    text = capsys.readouterr().out
    assert "VERIFY FAILED (naive)" in text and "FAILED: results differ" in text


def test_demo_rejects_a_bad_device_count(gpu, monkeypatch, tmp_path, capsys):
    from ctxkit.cli.demo import run_demo

    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_demo_args(tmp_path, devices=3)) == 1
    assert "--devices must be 1..2" in capsys.readouterr().err


def test_demo_times_arrays_seen_once_then_reused(gpu, monkeypatch, tmp_path, capsys):
    from ctxkit.cli.demo import run_demo
    from ctxkit.pipeline import pincache as _pincache

    monkeypatch.setattr(_pincache, "MIN_HOLD_BYTES", 1 << 20)
    _fake_kernel(monkeypatch, gpu)
    assert run_demo(_demo_args(tmp_path, size_mb=8.0, devices=2, trace=None, quick=True)) == 0
    text = capsys.readouterr().out
    once = text.index("ctxkit pageable, arrays seen once (staged)")
    assert text.index("ctxkit pageable, reused arrays (in=held, out=held)") > once
    assert "per device (ctxkit pageable, in=held, out=held)" in text
    assert gpu.register_calls and not gpu.registered  # locked by pin on reuse, then released


def test_waiting_for_a_run_handles_a_pending_ctrl_c_promptly():
    """A KeyboardInterrupt that is pending but interrupts no system call (here
    ``_thread.interrupt_main``, or a signal landing just before the wait starts) must not
    wait for the whole run."""
    import _thread
    from concurrent.futures import Future

    from ctxkit.pipeline.pipeline import _result_interruptibly

    fut: Future[int] = Future()
    done_later = threading.Timer(3.0, fut.set_result, (1,))
    done_later.start()
    threading.Timer(0.1, _thread.interrupt_main).start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            _result_interruptibly(fut)
        assert time.perf_counter() - t0 < 1.0
    finally:
        done_later.cancel()
    done: Future[int] = Future()
    done.set_result(7)
    assert _result_interruptibly(done) == 7
    failed: Future[int] = Future()
    failed.set_exception(TimeoutError("from the task"))
    with pytest.raises(TimeoutError, match="from the task"):
        _result_interruptibly(failed)
