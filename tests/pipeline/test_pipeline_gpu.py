"""Pipeline.map on real GPUs: bit-exact results on every host path, real overlap in the
trace, kernel preloading, unified memory, errors (in a child process where a fault
poisons a context) and Ctrl-C (also twice)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit.module import Module
from ctxkit.pipeline import Pipeline, PipelineError
from tests.pipeline.gpu_support import (  # noqa: F401
    GREEN_LANES,
    PAGE,
    PATH_NAMES,
    SCALE,
    SPIN_CYCLES,
    assert_unregistered,
    kern,
    lane_count,
    lanes,
    need_devices,
    random_array,
    scaled,
    seconds_of,
    spin_copy_body,
)

# --- exact results --------------------------------------------------------------------


@pytest.mark.parametrize("host_path", ["staged", "register"])
@pytest.mark.parametrize("ndev", [1, pytest.param(2, marks=pytest.mark.multigpu), *GREEN_LANES])
@pytest.mark.parametrize("n", [0, 1, 7, 1_000_003])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_map_pageable_bit_exact(kern, ndev, n, dtype, host_path):
    entry, alpha = SCALE[dtype]
    x = random_array(n, dtype, n)
    with Pipeline(lanes(ndev), options=ck.PipelineOptions(chunk_bytes=1 << 20)) as p:
        out = p.map(kern[entry], x, args=(alpha,), options=ck.PipelineOptions(host_path=host_path))
        assert out.dtype == x.dtype and out.shape == x.shape
        np.testing.assert_array_equal(out, scaled(x, alpha))
        if n:
            assert p.last_stats.path == PATH_NAMES[host_path]
            assert p.last_stats.fallbacks == 0
            assert len(p.last_stats.devices) == min(lane_count(ndev), n)
    assert_unregistered(x, out)


@pytest.mark.parametrize("ndev", [1, pytest.param(2, marks=pytest.mark.multigpu), *GREEN_LANES])
def test_map_pinned_zero_copy_and_small_chunks(kern, ndev):
    n = 1_000_003
    ctx = ck.registry.context(0)
    x = ck.pinned_empty(n, np.float32, context=ctx)
    x[...] = random_array(n, np.float32, 5)
    out = ck.pinned_empty(n, np.float32, context=ctx)
    with Pipeline(lanes(ndev)) as p:
        assert p.map(kern["scale_f32"], x, out, args=(2.0,), chunk_bytes=300_000) is out
        assert p.last_stats.path == "pinned"
        np.testing.assert_array_equal(out, x * np.float32(2))
        # The pipeline needed no staging buffers and no host copy threads.
        assert all(s.pin_in is None and s.pin_out is None for d in p._devices for s in d.slots)


@pytest.mark.slow
@pytest.mark.parametrize("ndev", [1, pytest.param(2, marks=pytest.mark.multigpu)])
def test_map_one_gib_float32_bit_exact(kern, ndev):
    n = (1 << 30) // 4 + 3
    x = random_array(n, np.float32, 11)
    out = np.empty_like(x)  # never touched: registering it faults its pages in
    with Pipeline(need_devices(ndev)) as p:
        p.map(kern["scale_f32"], x, out, args=(2.0,))
        assert sum(d.nbytes for d in p.last_stats.devices) == x.nbytes
        assert p.last_stats.path == PATH_NAMES["staged"]  # the default (measured faster)
        assert p.last_stats.fallbacks == 0
    assert np.array_equal(out, x * np.float32(2))
    assert_unregistered(x, out)


@pytest.mark.parametrize("offset", [16, 4000])
def test_register_path_unaligned_in_place_and_wider_output_rows(kern, offset):
    n = 3_000_001
    raw = np.empty(n * 4 + 2 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + offset
    x = raw[start : start + n * 4].view(np.float32)
    x[...] = random_array(n, np.float32, 13)
    orig = x.copy()
    with Pipeline(
        [0], options=ck.PipelineOptions(chunk_bytes=(1 << 20) + 12)
    ) as p:  # chunk ends fall mid-page
        p.map(
            kern["scale_f32"],
            x,
            out=x,
            args=(2.0,),
            options=ck.PipelineOptions(host_path="register"),
        )
        assert p.last_stats.fallbacks == 0
        np.testing.assert_array_equal(x, orig * np.float32(2))
        # Output rows of 2 floats (8 bytes) from input rows of 1 float: each chunk's
        # output holds 2 * x of its rows, then 3 * x.
        wide = np.zeros((n, 2), np.float32)

        def two_scales(ctx, stream, d_in, d_out, rows):
            k = kern["scale_f32"]
            k.launch(64, 256, d_in.ptr, d_out.ptr, rows, 2.0, stream=stream)
            k.launch(64, 256, d_in.ptr, d_out.ptr + 4 * rows, rows, 3.0, stream=stream)

        p.map(two_scales, orig, wide, options=ck.PipelineOptions(host_path="register"))
        assert p.last_stats.fallbacks == 0
        chunks = p._run.plan.chunks
    assert len(chunks) > 2
    for c in chunks:
        flat = wide[c.row0 : c.row1].reshape(-1)
        part = orig[c.row0 : c.row1]
        np.testing.assert_array_equal(flat[: c.rows], part * np.float32(2))
        np.testing.assert_array_equal(flat[c.rows :], part * np.float32(3))
    assert_unregistered(x, wide)


def test_register_path_reads_a_read_only_file_mapping(kern, tmp_path):
    """Pages of a read-only np.memmap cannot be locked for writing: the input is
    registered read-only (where the device supports it) or staged; the result is exact."""
    n = 4_000_003
    src = random_array(n, np.float32, 14)
    path = tmp_path / "x.f32"
    src.tofile(path)
    x = np.memmap(path, np.float32, mode="r", shape=(n,))
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=1 << 20)) as p:
        out = p.map(
            kern["scale_f32"], x, args=(2.0,), options=ck.PipelineOptions(host_path="register")
        )
        print("read-only input: fallbacks", p.last_stats.fallbacks)
    np.testing.assert_array_equal(out, src * np.float32(2))
    assert_unregistered(out)
    del x


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_register_path_leaves_the_arrays_readable_in_a_forked_child(kern):
    """Registration may mark pages MADV_DONTFORK; after map they must be ordinary again,
    or a child process would lose the arrays."""
    x = random_array(8 << 20, np.float32, 15)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=4 << 20)) as p:
        out = p.map(
            kern["scale_f32"], x, args=(2.0,), options=ck.PipelineOptions(host_path="register")
        )
    expected = float(np.float64(out.astype(np.float64).sum()))
    pid = os.fork()
    if pid == 0:  # the child touches every page of both arrays, no CUDA
        try:
            same = float(np.float64(out.astype(np.float64).sum())) == expected
            os._exit(0 if same and np.array_equal(out, x * np.float32(2)) else 1)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def _child_maps_after_fork(p: Pipeline, k, x: np.ndarray) -> None:
    """In a forked child: exit 0 only if both entry points raise ForkError."""
    got = []
    for call in (lambda: p.map(k, x[:1024], args=(2.0,)), lambda: Pipeline([0])):
        try:
            call()
            got.append("returned")
        except ck.ForkError:
            got.append("ForkError")
        except BaseException as exc:
            got.append(type(exc).__name__)
    os._exit(0 if got == ["ForkError", "ForkError"] else 1)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_child_forked_while_a_thread_maps_gets_fork_error_at_once(kern):
    """Issue 27 item 3: children forked while another thread is inside Pipeline.map hung
    on locks that thread held; each must get ForkError within 5 s."""
    k = kern["scale_f32"]
    x = np.ones(16 << 20, dtype=np.float32)  # 64 MiB: each map runs long enough to fork in
    stop = threading.Event()
    with Pipeline([0]) as p:
        p.map(k, x[:1024], args=(2.0,))

        def loop() -> None:
            while not stop.is_set():
                p.map(k, x, args=(2.0,))

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        try:
            for _ in range(3):
                time.sleep(0.05)
                pid = os.fork()
                if pid == 0:
                    try:
                        _child_maps_after_fork(p, k, x)
                    finally:
                        os._exit(2)
                deadline = time.monotonic() + 5
                while not (done := os.waitpid(pid, os.WNOHANG))[0]:
                    if time.monotonic() > deadline:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        pytest.fail("the forked child hung (killed after 5 s)")
                    time.sleep(0.01)
                status = done[1]
                assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        finally:
            stop.set()
            t.join(30)


@pytest.mark.multigpu
def test_map_dynamic_schedule_and_2d_rows(kern):
    x = random_array(3 * 400_001, np.float64, 3).reshape(400_001, 3)
    with Pipeline(
        need_devices(2), options=ck.PipelineOptions(schedule="dynamic", chunk_bytes=1 << 20)
    ) as p:
        out = p.map(kern["scale_f64"], x, args=(2.0,))
        assert sum(d.rows for d in p.last_stats.devices) == 400_001
    np.testing.assert_array_equal(out, x * 2.0)


def test_map_object_code_pair_and_reuse(kern):
    obj = ck.compile(C.kernel_source("scale.cu"), name="scale.cu", arch=ck.Device(0).arch)
    x = random_array(500_000, np.float32, 9)
    with Pipeline([0]) as p:
        first = p.map((obj, "scale_f32"), x, args=(2.0,))
        slots = [s.d_in for d in p._devices for s in d.slots]
        second = p.map((obj, "scale_f32"), x, args=(2.0,))
        assert [s.d_in for d in p._devices for s in d.slots] == slots  # buffers reused
    np.testing.assert_array_equal(first, x * np.float32(2))
    np.testing.assert_array_equal(second, first)


def test_map_forgotten_args_is_a_clear_error(kern):
    with Pipeline([0]) as p, pytest.raises(ck.LaunchArgumentError, match=r"args=\(\.\.\.\)"):
        p.map(kern["scale_f32"], np.ones(10, np.float32))


# --- overlap, from the trace ----------------------------------------------------------------


@pytest.mark.parametrize("host_path", ["staged", "register"])
@pytest.mark.parametrize("ndev", [1, pytest.param(2, marks=pytest.mark.multigpu), "green2"])
def test_trace_shows_h2d_overlapping_the_previous_kernel(kern, ndev, host_path, tmp_path):
    x = random_array(16 << 20, np.float32, 4)  # 64 MiB, 16 chunks of 4 MiB
    # Registering a chunk's pages takes longer than staging them: a longer kernel keeps
    # the device the bottleneck, so that the next chunk's H2D can land during it.
    cycles = SPIN_CYCLES * (4 if host_path == "register" else 1)
    with Pipeline(lanes(ndev), options=ck.PipelineOptions(chunk_bytes=4 << 20)) as p:
        out = p.map(
            spin_copy_body(kern, cycles), x, options=ck.PipelineOptions(host_path=host_path)
        )
        tl = p.trace()
    np.testing.assert_array_equal(out, x)
    assert tl.dropped == 0
    assert len(tl.select(name="kernel")) == 16
    pairs = [
        (h, k)
        for h, k in tl.overlaps({"name": "h2d"}, {"name": "kernel"})
        if h.device == k.device and h.chunk == k.chunk + 1
    ]
    assert pairs, tl.summary()
    # Stronger: some H2D of chunk c+1 finished while the kernel of chunk c still ran.
    assert any(k.start_ms < h.end_ms < k.end_ms for h, k in pairs), tl.summary()
    host_steps = ("fill", "drain") if host_path == "staged" else ("register", "unregister")
    assert all(tl.select(name=step) for step in host_steps), tl.summary()
    if lane_count(ndev) == 2:  # two devices, or two partitions of one
        both = tl.overlaps(
            {"device": 0, "name": "kernel"}, {"device": 1, "name": "kernel"}, min_overlap_ms=1.0
        )
        assert both, tl.summary()
    data = tl.to_chrome_trace(tmp_path / "trace.json")
    assert {e["pid"] for e in data["traceEvents"] if e["ph"] == "X"} == set(range(lane_count(ndev)))


# --- lazy loading ----------------------------------------------------------------------------


def test_preloaded_kernel_launches_without_waiting_for_a_running_kernel(kern):
    """With lazy loading, the first launch of a kernel may wait until the context is
    idle; Kernel.preload moves that load to a moment of our choice."""
    ctx = ck.registry.context(0)
    fresh = Module.load(
        ck.compile(C.kernel_source("fill.cu"), name="fill.cu", arch=ctx.device.arch)
    )
    fill = fresh.function("fill_f32")  # a new library: never loaded in ctx
    buf = ck.DeviceBuffer(4 << 20, context=ctx)
    with ctx:
        kern["spin"].preload()
        fill.preload()
        s1, s2 = ck.Stream(), ck.Stream()
        kern["spin"].launch(1, 1, 100_000_000, 0, stream=s1)  # ~50 ms
        t0 = time.perf_counter()
        fill.launch(256, 256, buf, 1.0, 1 << 20, stream=s2)
        launch_s = time.perf_counter() - t0
        s2.synchronize()
        s1.synchronize()
        got = buf.copy_to_host().view(np.float32)
    assert launch_s < 0.02, f"the launch blocked {launch_s * 1e3:.1f} ms"
    assert (got == 1.0).all()
    buf.close()
    fresh.close()


# --- unified memory -------------------------------------------------------------------


@pytest.mark.multigpu
def test_map_managed_on_twoneed_devices(kern, ctx0):
    n = 4 << 20  # 16 MiB: keep managed allocations small on the shared machine
    buf = ck.ManagedBuffer(n * 4, context=ctx0)
    xm = buf.as_numpy(np.float32)
    xm[...] = random_array(n, np.float32, 21)
    expected = xm * np.float32(2)
    with Pipeline(need_devices(2), options=ck.PipelineOptions(chunk_bytes=1 << 20)) as p:
        out = p.map_managed(kern["scale_f32"], buf, dtype=np.float32, args=(2.0,))
        np.testing.assert_array_equal(out, expected)
        assert {d.device for d in p.last_stats.devices} == {0, 1}
        assert {"prefetch", "kernel"} <= set(p.trace().names())
        p.map_managed(kern["scale_f32"], xm, xm, args=(2.0,))  # in place
        np.testing.assert_array_equal(xm, expected)
        with pytest.raises(ValueError, match="not unified"):
            p.map_managed(kern["scale_f32"], np.ones(4, np.float32), args=(2.0,))
    del xm, out


# --- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("ndev", [1, pytest.param(2, marks=pytest.mark.multigpu)])
def test_error_in_one_chunk_names_device_and_chunk(kern, ndev):
    x = random_array(4 << 20, np.float32, 8)  # 16 MiB, 1 MiB chunks
    bad_device = ndev - 1
    seen = {}

    def body(ctx, stream, d_in, d_out, n):
        d = ctx.device.ordinal
        seen[d] = seen.get(d, 0) + 1
        if d == bad_device and seen[d] == 3:
            raise RuntimeError("refusing this chunk")
        kern["scale_f32"].launch(64, 256, d_in.ptr, d_out.ptr, n, 2.0, stream=stream)

    with Pipeline(need_devices(ndev), options=ck.PipelineOptions(chunk_bytes=1 << 20)) as p:
        with pytest.raises(PipelineError) as info:
            p.map(body, x)
        err = info.value
        assert err.device == bad_device and err.step == "kernel" and not err.poisoned
        first = min(c.index for c in p._run.plan.chunks if c.part == bad_device)
        assert err.chunk == first + 2
        assert f"device {bad_device}" in str(err) and f"chunk {err.chunk}" in str(err)
        assert isinstance(err.__cause__, RuntimeError)
        out = p.map(kern["scale_f32"], x, args=(2.0,))  # reusable afterwards
    np.testing.assert_array_equal(out, x * np.float32(2))


def test_kernel_fault_in_a_chunk_poisons_the_pipeline_clearly():
    script = textwrap.dedent(
        """
        import numpy as np, ctxkit as ck
        from ctxkit import compiler as C
        from ctxkit.pipeline import Pipeline, PipelineError, PipelineOptions
        arch = ck.Device(0).arch
        fault = ck.Module.load(ck.compile(C.kernel_source("fault.cu"), arch=arch)).function("fault")
        scale = ck.Module.load(ck.compile(C.kernel_source("scale.cu"), arch=arch)).function(
            "scale_f32")
        calls = []
        def body(ctx, stream, d_in, d_out, n):
            calls.append(n)
            if len(calls) == 3:
                fault.launch(1, 1, d_out.ptr, stream=stream)
            else:
                scale.launch(64, 256, d_in.ptr, d_out.ptr, n, 2.0, stream=stream)
        p = Pipeline([0], options=PipelineOptions(chunk_bytes=1 << 20))
        x = np.ones(4 << 20, np.float32)
        try:
            p.map(body, x)
        except PipelineError as e:
            print("ERR", e.device, e.chunk is not None and e.chunk >= 2, e.poisoned, e.name,
                  flush=True)
            print("MSG", "device 0" in str(e), "chunk" in str(e), "poisoned" in str(e),
                  flush=True)
        print("POISONED_FLAG", p.poisoned, flush=True)
        try:
            p.map(body, x)
        except ck.ContextPoisonedError as e:
            print("POISONED_AGAIN", "device 0 was poisoned" in str(e), flush=True)
        p.close()
        print("CLOSED", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    out = proc.stdout
    assert "ERR 0 True True CUDA_ERROR_ILLEGAL_ADDRESS" in out, (out, proc.stderr)
    assert "MSG True True True" in out, out
    assert "POISONED_FLAG True" in out and "POISONED_AGAIN True" in out, out
    assert "CLOSED" in out, (out, proc.stderr)


@pytest.mark.parametrize("host_path", ["staged", "register"])
def test_ctrl_c_during_map_stops_workers_and_leaves_the_pipeline_usable(kern, host_path):
    x = random_array(16 << 20, np.float32, 6)  # 64 chunks of 1 MiB, ~10 ms kernels
    body = spin_copy_body(kern, 20_000_000)
    main = threading.main_thread().ident
    assert main is not None
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=1 << 20)) as p:
        one = x[: 1 << 18]  # exactly one chunk; the first run also sets everything up
        chunk_s = min(
            seconds_of(lambda: p.map(body, one, options=ck.PipelineOptions(host_path=host_path)))
            for _ in range(3)
        )
        # Stopping must not run the remaining chunks: the whole map takes ~64 chunk times.
        limit = 0.6 * (x.nbytes // one.nbytes) * chunk_s
        fired: list[float] = []

        def interrupt() -> None:
            fired.append(time.perf_counter())
            signal.pthread_kill(main, signal.SIGINT)

        timer = threading.Timer(0.03, interrupt)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                p.map(body, x, options=ck.PipelineOptions(host_path=host_path))
        finally:
            timer.cancel()
        stopped_s = time.perf_counter() - fired[0]
        assert stopped_s < limit, (
            f"map stopped {stopped_s * 1e3:.0f} ms after Ctrl-C; limit {limit * 1e3:.0f} ms "
            f"= 0.6 x the whole map ({chunk_s * 1e3:.1f} ms per chunk)\n" + p.trace().summary()
        )
        out = p.map(
            kern["scale_f32"], x, args=(2.0,), options=ck.PipelineOptions(host_path=host_path)
        )
    np.testing.assert_array_equal(out, x * np.float32(2))
    assert_unregistered(x, out)


def test_second_ctrl_c_during_cleanup_still_waits_for_every_chunk(kern):
    x = random_array(16 << 20, np.float32, 7)  # 64 chunks of 1 MiB
    body = spin_copy_body(kern, 100_000_000)  # ~50 ms per chunk
    main = threading.main_thread().ident
    assert main is not None
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=1 << 20)) as p:
        p.map(body, x[: 1 << 18])  # set up (buffers, kernel) before timing anything
        timers = [
            threading.Timer(t, signal.pthread_kill, (main, signal.SIGINT)) for t in (0.03, 0.06)
        ]
        for t in timers:
            t.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                p.map(body, x)
            idle = [s.query() for s in p._devices[0].streams()]
        finally:
            for t in timers:
                t.cancel()
        assert all(idle), "map returned while its chunks still ran on the device"
        out = p.map(kern["scale_f32"], x, args=(2.0,))
    np.testing.assert_array_equal(out, x * np.float32(2))
