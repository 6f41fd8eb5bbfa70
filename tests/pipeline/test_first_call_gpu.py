"""The first call on real GPUs (issue 16): a new Pipeline per call on arrays never seen
is right for every size and page-locks nothing after the first (staging comes from the
process's pinned pool); many pipelines share the pool within one process budget; the
pool is kept at close() and freed cleanly at exit; ``out="pinned"`` outputs go back to
the pool when dropped and are reused."""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.memory.host import host_pointer_kind
from ctxkit.pipeline import Pipeline
from ctxkit.pipeline.pincache import process_pins
from ctxkit.pipeline.plan import POOLED_OUT_BYTES
from tests.pipeline.gpu_support import (  # noqa: F401
    assert_unregistered,
    kern,
    lane_count,
    lanes,
    need_devices,
    random_array,
    scaled,
)
from tests.support.helpers import run_python

MiB = 1 << 20


def first_calls(kern, n: int, calls: int, out: str | None) -> list[int]:
    """*calls* maps of fresh float32 arrays of *n* elements, each on a new Pipeline; the
    pool's ``cuMemHostAlloc`` count after each."""
    pool = ck.pinned_pool()
    allocations = []
    for seed in range(calls):
        x = random_array(n, np.float32, seed)
        with Pipeline([0]) as p:
            y = p.map(kern["scale_f32"], x, args=(2.0,), **({"out": out} if out else {}))
            if n:
                pooled = out == "pinned" or (out is None and x.nbytes >= POOLED_OUT_BYTES)
                want = "in=staged, out=" + ("pinned" if pooled else "staged")
                assert p.last_stats.path == want
                assert ck.pinned_pool().owns(y) == pooled
        assert y.shape == x.shape and y.dtype == x.dtype
        assert np.array_equal(y, scaled(x, 2.0))
        del x, y
        allocations.append(pool.stats().allocations)
    return allocations


@pytest.mark.parametrize("out", [None, "pinned", "pageable"])
@pytest.mark.parametrize("n", [0, 1, 7, 1_000_003, (8 << 20) // 4 + 3])
def test_first_calls_on_new_pipelines_are_exact_and_page_lock_once(kern, n, out):
    allocations = first_calls(kern, n, 3, out)
    assert allocations[1] == allocations[2] == allocations[0]  # later pipelines reuse
    assert ck.pinned_pool().stats().in_use_blocks == 0  # outputs dropped: all returned


@pytest.mark.slow
@pytest.mark.parametrize("out", [None, "pinned", "pageable"])
def test_first_calls_of_one_gib_plus_three_elements(kern, out):
    allocations = first_calls(kern, (1 << 30) // 4 + 3, 2, out)
    assert allocations[1] == allocations[0]


def test_default_outputs_come_from_the_pool_and_fall_back_when_it_is_full(kern):
    """A stream of fresh 64 MiB batches: each default output is a pool block, written by
    DMA (no drain), reused once the caller drops the previous one; with the budget full
    the output is pageable and still exact."""
    pool = ck.pinned_pool()
    n = (64 << 20) // 4
    with Pipeline([0]) as p:
        ptrs = set()
        for seed in range(3):
            x = random_array(n, np.float32, 40 + seed)
            y = p.map(kern["scale_f32"], x, args=(2.0,))
            assert p.last_stats.path == "in=staged, out=pinned" and pool.owns(y)
            assert host_pointer_kind(int(y.ctypes.data)) == "pinned"
            assert not p.trace().select(name="drain")
            assert np.array_equal(y, scaled(x, 2.0))
            ptrs.add(int(y.ctypes.data))
            del x, y
        assert len(ptrs) == 1  # one block served every call
        budget = pool.budget
        keep = p.map(kern["scale_f32"], random_array(n, np.float32, 50), args=(2.0,))
        pool.set_budget(pool.stats().in_use_bytes + 64 * MiB)  # room for staging only
        try:
            x = random_array(n, np.float32, 51)
            y = p.map(kern["scale_f32"], x, args=(3.0,))
            assert not pool.owns(y) and p.last_stats.path == "in=staged, out=staged"
            assert np.array_equal(y, scaled(x, 3.0))
        finally:
            pool.set_budget(budget)
        assert pool.owns(keep)


@pytest.mark.parametrize("slots", [2, 6, 12])
@pytest.mark.parametrize(
    "ndev,schedule",
    [
        (1, "static"),
        pytest.param(2, "dynamic", marks=pytest.mark.multigpu),
        ("green2", "dynamic"),
        ("green3", "static"),
    ],
)
def test_many_small_chunks_in_flight_are_exact(kern, slots, ndev, schedule):
    """64 MiB + 5 elements in 1 MiB chunks: the fills and drains of many chunks run on the
    host pool at once, slots are reused as soon as their drains finish."""
    with Pipeline(
        lanes(ndev), options=ck.PipelineOptions(chunk_bytes=MiB, staging_buffers=slots)
    ) as p:
        for seed in range(2):  # a new pipeline's first call, then fresh arrays again
            x = random_array((16 << 20) + 5, np.float32, 11 + seed)
            y = p.map(
                kern["scale_f32"],
                x,
                args=(2.0,),
                out="pageable",
                options=ck.PipelineOptions(schedule=schedule),
            )
            assert p.last_stats.path == "in=staged, out=staged"
            assert np.array_equal(y, scaled(x, 2.0))
            # 65 chunks of 1 MiB on one lane; a static split over several lanes may end
            # each lane's share with a short chunk of its own (66 over 3 green lanes)
            n = sum(d.chunks for d in p.last_stats.devices)
            assert 65 <= n <= 64 + lane_count(ndev)
            tl = p.trace()
            assert {i.chunk for i in tl.select(name="fill")} == set(range(n))
            assert {i.chunk for i in tl.select(name="drain")} == set(range(n))
            del x, y
    assert ck.pinned_pool().stats().in_use_blocks == 0


@pytest.mark.parametrize("n", [0, 1, 7, 1_000_003, (16 << 20) + 5])
def test_split_input_is_exact_and_leaves_nothing_registered(kern, n):
    """``host_path="split"``: the input registered from its far end, staged from its near
    end; every chunk lands once and no page stays locked."""
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=MiB)) as p:
        for seed in range(2):
            x = random_array(n, np.float32, 21 + seed)
            y = p.map(
                kern["scale_f32"],
                x,
                args=(2.0,),
                options=ck.PipelineOptions(host_path=("split", "auto")),
            )
            assert np.array_equal(y, scaled(x, 2.0))
            assert_unregistered(x)
            if n >= 2 * MiB:
                assert p.last_stats.path == "in=split, out=pinned"  # a pooled default out
                tl = p.trace()
                staged = {i.chunk for i in tl.select(name="fill")}
                registered = {i.chunk for i in tl.select(name="register")}
                every = set(range(len(p._run.plan.chunks)))
                # a tail chunk smaller than a page may lie on pages its neighbour registered
                assert every - (staged | registered) <= {max(every)}
                if not p.last_stats.fallbacks:  # no registration refused: one way each
                    assert not staged & registered


def own_pages(n: int, dtype: type) -> np.ndarray:
    """A 1-D array in an anonymous mapping of its own (whole pages, shared with nothing)."""
    import mmap

    nbytes = n * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=n)


def test_many_pipelines_share_the_pool_within_one_budget(kern):
    pool = ck.pinned_pool()
    pipes = [
        Pipeline(
            [0], options=ck.PipelineOptions(chunk_bytes=MiB, staging_buffers=3, host_threads=2)
        )
        for _ in range(8)
    ]  # 8 x 3 x 2 MiB staging
    room = 40 * MiB  # two 16 MiB arrays (and their partial pages) may be held
    budget = 48 * MiB + room
    pool.set_budget(budget)
    try:
        for seed, p in enumerate(pipes):  # fresh arrays: staged, buffers from the pool
            x = random_array(1 << 20, np.float32, seed)
            y = p.map(kern["scale_f32"], x, args=(2.0,), out="pageable")
            assert np.array_equal(y, scaled(x, 2.0))
            st = pool.stats()
            assert st.held_bytes + st.claimed_bytes <= budget
        assert pool.stats().in_use_bytes == 48 * MiB
        # 16 MiB in and out, seen by every pipeline, each on pages of its own
        x = own_pages(4 << 20, np.float32)
        x[:] = random_array(4 << 20, np.float32, 99)
        out = own_pages(4 << 20, np.float32)
        for _ in range(2):
            for p in pipes:
                out[:] = 0
                p.map(kern["scale_f32"], x, out, args=(2.0,))
                assert np.array_equal(out, scaled(x, 2.0))
                st = pool.stats()
                assert st.held_bytes + st.claimed_bytes <= budget
        assert pipes[-1].last_stats.path == "in=held, out=held"
        st = pool.stats()
        assert st.claimed_bytes == process_pins().nbytes <= room  # held once for all 8
        assert st.peak_bytes <= budget
    finally:
        for p in pipes:
            p.close()
    st = pool.stats()
    assert st.claimed_bytes == 0 and st.in_use_blocks == 0
    # held maps DMA every byte directly: no slot has a bounce buffer
    assert st.cached_bytes == 48 * MiB and st.frees == 0  # close() does not trim
    assert host_pointer_kind(x.ctypes.data) == "pageable"


def test_pinned_output_lifetime(kern):
    pool = ck.pinned_pool()
    x = random_array(1_000_003, np.float32, 3)
    with Pipeline([0]) as p:
        y = p.map(kern["scale_f32"], x, args=(2.0,), out="pinned")
        assert pool.owns(y) and host_pointer_kind(y.ctypes.data) == "pinned"
        assert np.array_equal(y, scaled(x, 2.0))
        ptr, before = y.ctypes.data, pool.stats()
        del y
        after = pool.stats()
        assert after.in_use_blocks == before.in_use_blocks - 1
        z = p.map(kern["scale_f32"], x, args=(3.0,), out="pinned")
        assert z.ctypes.data == ptr and pool.stats().allocations == after.allocations
        assert np.array_equal(z, scaled(x, 3.0))
    assert np.array_equal(z, scaled(x, 3.0))  # outlives its pipeline


def test_pool_kept_at_close_and_freed_cleanly_at_exit():
    res = run_python(
        timeout=300,
        code="""
        import numpy as np
        import ctxkit as ck
        import ctxkit.compiler as C
        from ctxkit.module import Module

        src = C.kernel_source("scale.cu")
        k = Module.load(ck.compile(src, arch=ck.Device(0).arch)).function("scale_f32")
        pool = ck.pinned_pool()
        x = np.arange(3_000_001, dtype=np.float32)
        with ck.Pipeline([0]) as p:
            p.map(k, x, args=(2.0,))
        st = pool.stats()
        kept = st.cached_blocks > 0 and st.in_use_blocks == 0 and st.frees == 0
        with ck.Pipeline([0]) as p:
            p.map(k, x, args=(2.0,))
        again = pool.stats().allocations == st.allocations
        left = ck.Pipeline([0])  # never closed
        y = left.map(k, x, args=(2.0,), out="pinned")  # alive at exit
        print("ok", kept, again, bool(np.array_equal(y, x * 2)))
        """,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok", "True", "True", "True"]
    assert res.stderr == ""


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("out", [None, "pageable"])
def test_staging_copies_with_and_without_non_temporal_stores_are_exact(
    kern, streaming, out, monkeypatch
):
    """The DMA reads what the streaming copy wrote (its stores are fenced before the H2D is
    enqueued), in odd-sized pieces at unaligned offsets; and a drained output is exact.
    The cache is said to be 1 MiB, so these 48 MiB maps take streaming copies."""
    from ctxkit.memory import streamcopy

    monkeypatch.setattr(streamcopy, "last_level_cache_bytes", lambda: MiB)
    n = (48 << 20) // 4 + 5
    previous = ck.memory.set_streaming_copy(streaming)
    try:
        info = ck.memory.streaming_copy_info()
        assert info.enabled == streaming
        with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=3 * MiB + 4 * 11)) as p:
            for seed in range(2):
                x = random_array(n + 1, np.float32, 60 + seed)[1:]  # not page aligned
                y = p.map(kern["scale_f32"], x, args=(2.0,), **({"out": out} if out else {}))
                assert p.last_stats.path.startswith("in=staged")
                assert np.array_equal(y, scaled(x, 2.0))
                del y
    finally:
        ck.memory.set_streaming_copy(previous)


def test_the_gpu_machine_builds_the_streaming_copy():
    """Where llvmlite is installed on x86-64 (the GPU check machine has it), the pipeline's
    staging copies really use non-temporal stores."""
    import platform

    pytest.importorskip("llvmlite")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the streaming copy is built for x86-64 only")
    info = ck.memory.streaming_copy_info()
    if not info.enabled:
        pytest.skip("switched off (CTXKIT_STREAMING_COPY)")
    assert info.active, info.reason
