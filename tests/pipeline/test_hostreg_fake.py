"""Pipeline host paths on CPU: page-range planning, just-in-time registration
(``host_path="register"``), fallbacks, bounded work in flight, kernel preloading.

The simulated GPU (tests/support/fakegpu.py) refuses unaligned or overlapping
registrations and records every asynchronous copy whose host memory is not page-locked
when it is enqueued or when it runs, so these tests fail if a page is registered twice,
a DMA touches pageable memory, or pages are unregistered before their DMA finished.
"""

from __future__ import annotations

import itertools
import random
import signal
import threading

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.module import Kernel
from ctxkit.pipeline import HostPieces, Pipeline, PipelineError, host_pieces
from ctxkit.pipeline import plan as _plan
from ctxkit.pipeline.plan import (
    AUTO_HOST_PATH,
    AUTO_REGISTER_MIN_BYTES,
    check_host_path,
    choose_host_path,
)
from ctxkit.pipeline.staging import REGISTER_READ_ONLY, HostPool, Registrar, Segment
from tests.support.fakegpu import ALREADY_REGISTERED, scale_body

PAGE = 4096
OUT_OF_MEMORY, NOT_PERMITTED = 2, 800


def at_offset(arr: np.ndarray, offset: int) -> np.ndarray:
    """A copy of *arr* whose data starts *offset* bytes past a page boundary."""
    raw = np.empty(arr.nbytes + offset + 2 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + offset
    out = raw[start : start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    assert out.ctypes.data % PAGE == offset
    return out


def assert_clean(gpu) -> None:
    """Every DMA used page-locked memory and no page is left registered."""
    assert not gpu.pageable_dma, gpu.pageable_dma[:5]
    assert not gpu.registered, gpu.registered
    assert not gpu.kernel_errors


# --- page ranges (pure) -------------------------------------------------------------------


@pytest.mark.parametrize("page", [64, 4096])
def test_host_pieces_partition_every_chunk_and_register_each_page_once(page):
    rng = random.Random(page)
    for _ in range(300):
        base = rng.randrange(0, 4 * page)
        total = rng.randrange(0, 40 * page)
        cuts = sorted({0, total, *(rng.randrange(0, total + 1) for _ in range(rng.randrange(6)))})
        owned: list[tuple[int, int]] = []
        for b0, b1 in itertools.pairwise(cuts):
            pc = host_pieces(base, total, b0, b1, page)
            assert pc.head + pc.direct + pc.tail == b1 - b0
            assert pc.bounced == pc.head + pc.tail
            if pc.seg_len:
                assert pc.seg_ptr % page == 0 and pc.seg_len % page == 0
                assert base <= pc.seg_ptr and pc.seg_ptr + pc.seg_len <= base + total
                assert pc.head < page and pc.tail < page
                # The DMA'd bytes lie inside the registered pages.
                assert pc.seg_ptr == base + b0 + pc.head
                assert base + b0 + pc.head + pc.direct <= pc.seg_ptr + pc.seg_len
                owned.append((pc.seg_ptr, pc.seg_ptr + pc.seg_len))
            else:
                assert pc.direct == 0 and pc.tail == 0 and pc.head < 2 * page
        owned.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(owned)), "a page registered twice"


def test_host_pieces_examples_and_errors():
    assert host_pieces(0, 3 * PAGE, 0, 3 * PAGE) == HostPieces(0, 3 * PAGE, 0, 0, 3 * PAGE)
    # 16 bytes past a page: the first chunk bounces the rest of that page.
    pc = host_pieces(PAGE + 16, 10 * PAGE, 0, 5 * PAGE)
    assert (pc.head, pc.tail, pc.seg_ptr) == (PAGE - 16, 0, 2 * PAGE)
    last = host_pieces(PAGE + 16, 10 * PAGE, 5 * PAGE, 10 * PAGE)
    assert last.tail == 16 and last.seg_ptr + last.seg_len == 11 * PAGE
    assert host_pieces(100, 50, 0, 50) == HostPieces(50, 0, 0, 0, 0)
    assert host_pieces(100, 0, 0, 0).direct == 0
    with pytest.raises(ValueError, match="not inside"):
        host_pieces(0, 100, 50, 200)


def test_host_path_options():
    assert check_host_path("auto") == ("auto", "auto")
    assert check_host_path(("register", "staged")) == ("register", "staged")
    for bad in ("pinned", ("register",), ["staged", "staged"], 3):
        with pytest.raises(ValueError, match="host_path"):
            check_host_path(bad)
    assert choose_host_path("staged", 1 << 30) == "staged"
    assert choose_host_path("register", 10) == "register"
    assert choose_host_path("auto", AUTO_REGISTER_MIN_BYTES) == AUTO_HOST_PATH
    assert choose_host_path("auto", AUTO_REGISTER_MIN_BYTES - 1) == "staged"
    with pytest.raises(ValueError, match="host_path"):
        Pipeline(devices=[0], options=ck.PipelineOptions(host_path="fast"))


# --- whole runs, host_path="register" -----------------------------------------------------


@pytest.mark.parametrize("offset", [0, 16, 4000])
@pytest.mark.parametrize("devices", [[0], [0, 1]])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_register_path_exact_and_clean(gpu, offset, devices, dtype):
    n = 50_003
    x = at_offset((np.arange(n) % 1000).astype(dtype), offset)
    out = at_offset(np.zeros(n, dtype), (offset * 7) % PAGE)
    with Pipeline(
        devices, options=ck.PipelineOptions(chunk_bytes=3 * PAGE + 100, host_threads=3)
    ) as p:
        res = p.map(scale_body(gpu, 3), x, out, options=ck.PipelineOptions(host_path="register"))
        stats = p.last_stats
        names = set(p.trace().names())
    assert res is out
    np.testing.assert_array_equal(out, (x * 3).astype(dtype))
    assert stats.path == "in=registered, out=registered" and stats.fallbacks == 0
    assert {"register", "unregister"} <= names
    assert len(gpu.register_calls) > 10
    assert_clean(gpu)


def test_register_path_small_and_empty_arrays(gpu):
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=PAGE, host_threads=2)) as p:
        for n in (1, 7, 1000):
            x = np.arange(n, dtype=np.float32)
            np.testing.assert_array_equal(
                p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="register")),
                x * 2,
            )
        assert p.map(
            scale_body(gpu, 2.0), np.zeros(0), options=ck.PipelineOptions(host_path="register")
        ).shape == (0,)
    assert_clean(gpu)


def test_register_path_in_place_registers_shared_pages_once(gpu):
    x = at_offset(np.arange(40_000, dtype=np.int32), 100)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=5 * PAGE, host_threads=4)) as p:
        assert (
            p.map(scale_body(gpu, 3), x, out=x, options=ck.PipelineOptions(host_path="register"))
            is x
        )
        assert p.last_stats.fallbacks == 0
    np.testing.assert_array_equal(x, np.arange(40_000, dtype=np.int32) * 3)
    # One registration per chunk (input and output share the pages), none read-only.
    assert all(not flags & REGISTER_READ_ONLY for _, _, flags in gpu.register_calls)
    ptrs = [p for p, _, _ in gpu.register_calls]
    assert len(ptrs) == len(set(ptrs))
    assert_clean(gpu)


def test_register_path_2d_rows_other_dtype_and_dynamic_schedule(gpu):
    x = at_offset(np.arange(3 * 20_000, dtype=np.float32).reshape(20_000, 3), 12)
    out = np.zeros((20_000, 3), np.float64)
    with Pipeline(
        [0, 1], options=ck.PipelineOptions(chunk_bytes=7 * PAGE, schedule="dynamic", host_threads=4)
    ) as p:
        p.map(scale_body(gpu, 2.0), x, out, options=ck.PipelineOptions(host_path="register"))
        by_dev = {d.device: d.rows for d in p.last_stats.devices}
    np.testing.assert_array_equal(out, x.astype(np.float64) * 2)
    assert sum(by_dev.values()) == 20_000
    assert_clean(gpu)


@pytest.mark.parametrize(
    "paths,expected",
    [
        (("register", "staged"), "in=registered, out=staged"),
        (("staged", "register"), "in=staged, out=registered"),
        (("staged", "staged"), "in=staged, out=staged"),
    ],
)
def test_mixed_host_paths(gpu, paths, expected):
    x = at_offset(np.arange(30_000, dtype=np.float64), 8)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4 * PAGE, host_threads=3)) as p:
        out = p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path=paths))
        assert p.last_stats.path == expected
        slots = [s for d in p._devices for s in d.slots]
        assert all((s.pin_in is not None) == (paths[0] == "staged") for s in slots)
        assert all((s.pin_out is not None) == (paths[1] == "staged") for s in slots)
    np.testing.assert_array_equal(out, x * 2)
    assert_clean(gpu)


def test_pinned_input_with_registered_output(gpu):
    x = ck.pinned_empty(20_000, np.float32, context=ck.registry.context(0))
    x[...] = np.arange(20_000)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=3 * PAGE, host_path="register")) as p:
        out = p.map(scale_body(gpu, 2.0), x)
        assert p.last_stats.path == "in=pinned, out=registered"
    np.testing.assert_array_equal(out, np.arange(20_000, dtype=np.float32) * 2)
    assert all(p >= out.ctypes.data for p, _, _ in gpu.register_calls)
    assert_clean(gpu)


def test_auto_stages_and_registration_is_explicit(gpu, monkeypatch):
    assert AUTO_HOST_PATH == "staged"
    big = np.arange(AUTO_REGISTER_MIN_BYTES // 4, dtype=np.float32)
    small = np.arange(1000, dtype=np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=1 << 20, host_threads=3)) as p:
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), big, out="pageable"), big * 2)
        assert p.last_stats.path == "in=staged, out=staged" and not gpu.register_calls
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), big), big * 2)
        assert p.last_stats.path == "in=staged, out=pinned"  # default out: the pool
        np.testing.assert_array_equal(
            p.map(scale_body(gpu, 2.0), big, options=ck.PipelineOptions(host_path="register")),
            big * 2,
        )
        assert p.last_stats.path == "in=registered, out=registered"
        monkeypatch.setattr(_plan, "AUTO_HOST_PATH", "register")
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), big, out="pageable"), big * 2)
        assert p.last_stats.path == "in=registered, out=registered"
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), big), big * 2)
        assert p.last_stats.path == "in=registered, out=pinned"
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), small), small * 2)
        assert p.last_stats.path == "in=staged, out=staged"
    assert_clean(gpu)


def test_refused_registration_falls_back_to_staging(gpu):
    refused = set()

    def refuse_some(ptr, n, flags):
        if (ptr // PAGE) % 3 == 0:
            refused.add(ptr)
            return OUT_OF_MEMORY
        return 0

    gpu.register_error = refuse_some
    x = at_offset(np.arange(60_000, dtype=np.float32), 40)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=5 * PAGE, host_threads=3)) as p:
        out = p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="register"))
        stats = p.last_stats
        grown = [s.pin_in is not None or s.pin_out is not None for d in p._devices for s in d.slots]
    np.testing.assert_array_equal(out, x * 2)
    assert refused and stats.fallbacks >= len(refused) and any(grown)
    assert_clean(gpu)


def test_read_only_input_is_registered_read_only_after_a_refusal(gpu):
    def needs_read_only(ptr, n, flags):
        return 0 if flags & REGISTER_READ_ONLY else NOT_PERMITTED

    gpu.register_error = needs_read_only
    x = at_offset(np.arange(30_000, dtype=np.float32), 0)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=4 * PAGE, host_threads=2)) as p:
        out = p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="register"))
        fallbacks = p.last_stats.fallbacks
    np.testing.assert_array_equal(out, x * 2)
    in_lo, in_hi = x.ctypes.data, x.ctypes.data + x.nbytes
    ro = [p for p, _, f in gpu.register_calls if f & REGISTER_READ_ONLY]
    assert ro and all(in_lo <= p < in_hi for p in ro)  # only input is retried read-only
    assert fallbacks > 0  # the output pages, refused, were staged
    assert_clean(gpu)


def test_pages_registered_elsewhere_are_not_registered_again(gpu):
    x = at_offset(np.arange(40_000, dtype=np.float32), 0)
    lock_ptr = x.ctypes.data + 8 * PAGE
    with ck.registry.context(0):
        assert gpu.cuMemHostRegister(lock_ptr, 4 * PAGE, 1) == (0,)
    try:
        with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=3 * PAGE, host_threads=2)) as p:
            out = p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="register"))
            assert p.last_stats.fallbacks > 0
        np.testing.assert_array_equal(out, x * 2)
        assert lock_ptr in gpu.registered  # someone else's registration is left alone
    finally:
        with ck.registry.context(0):
            gpu.cuMemHostUnregister(lock_ptr)
    assert_clean(gpu)


def test_register_path_error_mid_run_unregisters_everything(gpu):
    x = at_offset(np.arange(64_000, dtype=np.float32), 4)
    calls: list[int] = []

    def body(ctx, stream, d_in, d_out, n):
        calls.append(n)
        if len(calls) == 5:
            raise RuntimeError("bad chunk")
        scale_body(gpu, 2.0, delay=0.002)(ctx, stream, d_in, d_out, n)

    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4 * PAGE, host_threads=3)) as p:
        with pytest.raises(PipelineError, match="bad chunk") as info:
            p.map(body, x, options=ck.PipelineOptions(host_path="register"))
        assert info.value.step == "kernel"
        assert_clean(gpu)
        out = p.map(
            scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="register")
        )  # usable afterwards
    np.testing.assert_array_equal(out, x * 2)
    assert_clean(gpu)


def test_register_path_ctrl_c_unregisters_everything(gpu):
    x = at_offset(np.arange(256_000, dtype=np.float32), 4)  # 64 chunks of 4 pages
    main = threading.main_thread().ident
    assert main is not None
    with Pipeline(
        [0, 1], options=ck.PipelineOptions(chunk_bytes=4 * PAGE, staging_buffers=2, host_threads=3)
    ) as p:
        timer = threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                p.map(
                    scale_body(gpu, 2.0, delay=0.01),
                    x,
                    options=ck.PipelineOptions(host_path="register"),
                )
        finally:
            timer.cancel()
        assert_clean(gpu)
        out = p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="register"))
    np.testing.assert_array_equal(out, x * 2)


def test_registrar_finish_undoes_registrations_never_released(gpu):
    ctx = ck.registry.context(0)
    buf = at_offset(np.zeros(8 * PAGE, np.uint8), 0)
    pool = HostPool(2, prefix="test-reg")
    try:
        reg = Registrar(pool, threading.Event(), None)
        a = Segment(ctx, 0, 0, buf.ctypes.data, 4 * PAGE, read_only=True)
        b = Segment(ctx, 0, 1, buf.ctypes.data + 4 * PAGE, 4 * PAGE, read_only=False)
        again = Segment(ctx, 0, 2, buf.ctypes.data, PAGE, read_only=False)
        for seg in (a, b, again):
            reg.register(seg)
        assert reg.wait(a) and reg.wait(b)
        assert not reg.wait(again) and "ALREADY_REGISTERED" in again.error
        reg.release(a)
        reg.release(again)  # never registered: nothing to undo
        assert reg.finish(0) == [] and not gpu.registered
        stopped = threading.Event()
        stopped.set()
        late = Registrar(pool, stopped, None)
        c = Segment(ctx, 0, 3, buf.ctypes.data, PAGE, read_only=False)
        late.register(c)
        assert not late.wait(c) and c.error == "the run stopped"
        assert "Segment" in repr(c)
    finally:
        pool.close()
    assert gpu.cuMemHostRegister.__self__ is gpu and ALREADY_REGISTERED == 712


def test_unregister_failure_is_reported(gpu):
    real = gpu.cuMemHostUnregister

    def failing(ptr):
        real(ptr)
        return (999,)

    gpu.cuMemHostUnregister = failing
    x = at_offset(np.arange(20_000, dtype=np.float32), 0)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=4 * PAGE, host_threads=2)) as p:
        with pytest.raises(PipelineError, match="cuMemHostUnregister") as info:
            p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="register"))
        assert info.value.step == "unregister"


# --- bounded work in flight ------------------------------------------------------------------


@pytest.mark.parametrize("paths", ["register", "staged"])
def test_work_in_flight_is_bounded(gpu, paths):
    """At each launch, a device has at most 2 * staging_buffers + 1 chunks launched and
    not finished (staging_buffers + 1 when the chunks pass through slot buffers)."""
    x = at_offset(np.arange(128_000, dtype=np.float32), 0)  # 32 chunks of 4 pages per device
    launched = {0: 0, 1: 0}
    finished = {0: 0, 1: 0}
    worst = {0: 0, 1: 0}
    lock = threading.Lock()

    def body(ctx, stream, d_in, d_out, n):
        d = ctx.device.ordinal
        with lock:
            launched[d] += 1
            worst[d] = max(worst[d], launched[d] - finished[d])

        def done():
            with lock:
                finished[d] += 1

        scale_body(gpu, 2.0, delay=0.002)(ctx, stream, d_in, d_out, n)
        gpu.launch(stream, done)

    with Pipeline(
        [0, 1], options=ck.PipelineOptions(chunk_bytes=4 * PAGE, staging_buffers=2, host_threads=3)
    ) as p:
        out = p.map(body, x, options=ck.PipelineOptions(host_path=paths))
    np.testing.assert_array_equal(out, x * 2)
    limit = 3 if paths == "staged" else 5
    assert max(worst.values()) <= limit, worst


def test_pinned_path_bounds_work_in_flight(gpu):
    x = ck.pinned_empty(64_000, np.float32, context=ck.registry.context(0))
    x[...] = np.arange(64_000)
    out = ck.pinned_empty(64_000, np.float32, context=ck.registry.context(0))
    state = {"launched": 0, "finished": 0, "worst": 0}
    lock = threading.Lock()

    def body(ctx, stream, d_in, d_out, n):
        with lock:
            state["launched"] += 1
            state["worst"] = max(state["worst"], state["launched"] - state["finished"])

        def done():
            with lock:
                state["finished"] += 1

        scale_body(gpu, 2.0, delay=0.002)(ctx, stream, d_in, d_out, n)
        gpu.launch(stream, done)

    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=2 * PAGE, staging_buffers=2)) as p:
        p.map(body, x, out)
        assert p.last_stats.path == "pinned"
    np.testing.assert_array_equal(out, np.arange(64_000, dtype=np.float32) * 2)
    assert state["worst"] <= 5, state  # 32 chunks, never all in flight at once


# --- kernels are loaded on every device before the first chunk -------------------------------


def test_map_preloads_a_kernel_in_every_context_before_launching(gpu, monkeypatch):
    events: list[tuple[str, int]] = []

    def preload(self, context=None):
        events.append(("preload", context.device.ordinal))

    def launch(self, grid, block, d_in, d_out, n, alpha, stream=None):
        events.append(("launch", stream.context.device.ordinal))
        body = scale_body(gpu, alpha)
        view = ck.pipeline.ChunkView
        body(None, stream, view(d_in, (n,), np.float32), view(d_out, (n,), np.float32), n)

    monkeypatch.setattr(Kernel, "preload", preload)
    monkeypatch.setattr(Kernel, "launch", launch)
    monkeypatch.setattr(Kernel, "params", property(lambda self: (1, 2, 3, 4)))
    kern = Kernel.__new__(Kernel)
    x = np.arange(10_000, dtype=np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096)) as p:
        out = p.map(kern, x, args=(2.0,))
    np.testing.assert_array_equal(out, x * 2)
    first_launch = next(i for i, e in enumerate(events) if e[0] == "launch")
    assert sorted(events[:first_launch]) == [("preload", 0), ("preload", 1)]
    assert len(events) == 2 + 10
