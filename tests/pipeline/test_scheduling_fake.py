"""How a staged map schedules its host work, on the simulated GPU: the fills of several
chunks run at once (no per-chunk barrier), a slot's output buffer is written again only
after its drain finished, a failing piece is reported with its own chunk, and slot
buffers are allocated when first used (a new Pipeline page-locks nothing itself)."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.pipeline import Pipeline, PipelineError
from ctxkit.pipeline import staging as _threads
from tests.support.fakegpu import scale_body

MiB = 1 << 20


class Pieces:
    """Wraps ``copy_piece``: records every traced piece, optionally slowed or failing."""

    def __init__(self, monkeypatch, delay=None, fail=None) -> None:
        self.real = _threads.copy_piece
        self.delay = delay or {}
        self.fail = fail
        self.lock = threading.Lock()
        self.rows: list[tuple[str, int, float, float]] = []
        self.streamed: set[tuple[str, bool]] = set()
        self.active: dict[int, tuple[int, int]] = {}  # id -> (src address, length)
        monkeypatch.setattr(_threads, "copy_piece", self.piece)

    def piece(self, dst, src, trace, label, streaming=False):
        name, chunk = trace[1], trace[3]
        with self.lock:
            self.streamed.add((name, streaming))
        if self.fail is not None and (name, chunk) == self.fail:
            raise MemoryError(f"{name} piece of chunk {chunk} failed")
        key = object()
        with self.lock:
            self.active[id(key)] = (src.ctypes.data, src.nbytes)
        t0 = time.perf_counter()
        time.sleep(self.delay.get(name, 0.0))
        try:
            self.real(dst, src, trace, label, streaming)
        finally:
            with self.lock:
                del self.active[id(key)]
                self.rows.append((name, chunk, t0, time.perf_counter()))

    def most_at_once(self, name: str) -> int:
        """The most pieces of *name* of distinct chunks that ran at the same time."""
        rows = [r for r in self.rows if r[0] == name]
        best = 0
        for _, _, t0, _ in rows:
            best = max(best, len({c for _, c, a, b in rows if a <= t0 < b}))
        return best


def test_fills_of_several_chunks_run_at_once(gpu, monkeypatch):
    pieces = Pieces(monkeypatch)
    x = np.arange(8 * MiB // 4, dtype=np.float32)  # 8 chunks of one 1 MiB piece each
    with Pipeline(
        [0], options=ck.PipelineOptions(chunk_bytes=MiB, staging_buffers=4, host_threads=4)
    ) as p:
        p.map(scale_body(gpu, 2.0), x)  # threads started, buffers allocated
        pieces.rows.clear()
        pieces.delay["fill"] = 0.05
        out = p.map(scale_body(gpu, 2.0), x)
    np.testing.assert_array_equal(out, x * 2)
    assert sorted(c for n, c, _, _ in pieces.rows if n == "fill") == list(range(8))
    assert pieces.most_at_once("fill") >= 2  # no waiting for chunk k before filling k+1


@pytest.mark.parametrize("cache_mib,streamed", [(4, True), (64, False)])
def test_maps_bigger_than_the_cache_stage_with_streaming_copies(
    gpu, monkeypatch, cache_mib, streamed
):
    """8 MiB in, 8 MiB out (staged): non-temporal copies when that is at least the
    last-level cache, plain ones below it, and exact either way."""
    from ctxkit.memory import streamcopy

    monkeypatch.setattr(streamcopy, "last_level_cache_bytes", lambda: cache_mib * MiB)
    pieces = Pieces(monkeypatch)
    x = np.random.default_rng(9).random(8 * MiB // 4, dtype=np.float32)
    out = np.zeros_like(x)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=MiB, host_threads=3)) as p:
        p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=staged, out=staged"
    np.testing.assert_array_equal(out, x * 2)
    assert pieces.streamed == {("fill", streamed), ("drain", streamed)}


def test_a_slot_is_written_again_only_after_its_drain(gpu, monkeypatch):
    """Slow drains on the host pool: the D2H of chunk k + staging_buffers must not be
    enqueued into a staging buffer a drain of chunk k still reads."""
    pieces = Pieces(monkeypatch, delay={"drain": 0.01})
    clashes: list[str] = []
    real_d2h = gpu.cuMemcpyDtoHAsync

    def d2h(dst, src, n, h):
        a0, a1 = int(dst), int(dst) + n
        with pieces.lock:
            for s0, sn in pieces.active.values():
                if s0 < a1 and a0 < s0 + sn:
                    clashes.append(f"D2H into {a0:#x}+{n} while a drain reads {s0:#x}+{sn}")
        return real_d2h(dst, src, n, h)

    monkeypatch.setattr(gpu, "cuMemcpyDtoHAsync", d2h)
    x = np.random.default_rng(3).random(12 * MiB // 8)
    with Pipeline(
        [0, 1], options=ck.PipelineOptions(chunk_bytes=MiB, staging_buffers=2, host_threads=3)
    ) as p:
        out = p.map(scale_body(gpu, 2.0), x, out="pageable")
    np.testing.assert_array_equal(out, x * 2)
    assert not clashes, clashes[:3]
    assert pieces.most_at_once("drain") >= 2  # drains do overlap each other


@pytest.mark.parametrize("step", ["fill", "drain"])
def test_a_failing_piece_is_reported_with_its_chunk(gpu, monkeypatch, step):
    pieces = Pieces(monkeypatch, delay={"drain": 0.005}, fail=(step, 5))
    x = np.arange(8 * MiB // 4, dtype=np.float32)
    with Pipeline(
        [0], options=ck.PipelineOptions(chunk_bytes=MiB, staging_buffers=3, host_threads=3)
    ) as p:
        with pytest.raises(PipelineError) as info:
            p.map(scale_body(gpu, 2.0), x, out="pageable")
        err = info.value
        assert (err.device, err.chunk, err.step) == (0, 5, step)
        assert "chunk 5" in str(err) and isinstance(err.__cause__, MemoryError)
        pieces.fail = None
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), x), x * 2)  # reusable


class Allocs:
    """Counts and times the simulated GPU's pinned allocations."""

    def __init__(self, gpu, monkeypatch, delay: float = 0.0) -> None:
        self.times: list[float] = []
        self.threads: list[str] = []
        real = gpu.cuMemHostAlloc

        def alloc(n, flags):
            time.sleep(delay)
            self.times.append(time.perf_counter())
            self.threads.append(threading.current_thread().name)
            return real(n, flags)

        monkeypatch.setattr(gpu, "cuMemHostAlloc", alloc)


def test_the_first_chunk_fills_before_every_slot_is_allocated(gpu, monkeypatch):
    pieces = Pieces(monkeypatch)
    # 0.1 s per allocation: a fill thread a loaded machine schedules late (80 ms seen in a
    # CI-like run at 0.03 s) still starts well before the third buffer exists
    allocs = Allocs(gpu, monkeypatch, delay=0.1)
    x = np.arange(8 * MiB // 4, dtype=np.float32)
    with Pipeline(
        [0], options=ck.PipelineOptions(chunk_bytes=MiB, staging_buffers=4, host_threads=2)
    ) as p:
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), x, out="pageable"), x * 2)
    first_fill = min(t0 for n, _, t0, _ in pieces.rows if n == "fill")
    assert len(allocs.times) == 8  # an input and an output buffer per slot
    assert first_fill < allocs.times[2]  # after one slot's input buffer, not all eight


def test_a_map_allocates_only_the_slots_it_uses(gpu, monkeypatch):
    allocs = Allocs(gpu, monkeypatch)
    x = np.arange(2 * MiB // 4, dtype=np.float32)  # 2 chunks, 6 slots
    with Pipeline(
        [0], options=ck.PipelineOptions(chunk_bytes=MiB, staging_buffers=6, host_threads=2)
    ) as p:
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), x), x * 2)
        assert len(allocs.times) == 4
        assert sum(s.d_in is not None for s in p._devices[0].slots) == 2
    # input buffers by the feeder as it starts a chunk, output buffers on the host pool
    # meanwhile (ready by the chunk's D2H)
    feeder = [t for t in allocs.threads if t.startswith("ctxkit-pipeline-gpu0")]
    pool = [t for t in allocs.threads if t.startswith("ctxkit-stage")]
    assert len(feeder) == len(pool) == 2


def test_creating_a_pipeline_page_locks_nothing(gpu, monkeypatch):
    allocs = Allocs(gpu, monkeypatch)
    registered = dict(gpu.registered)
    p = Pipeline([0, 1])
    assert allocs.times == [] and gpu.registered == registered
    p.close()


def test_a_dropped_pipeline_leaves_its_blocks_to_the_next(gpu, monkeypatch):
    """``Pipeline().map(k, x)`` without close(): the next new Pipeline finds the staging
    blocks in the process's pinned pool and page-locks nothing."""
    x = np.arange(4 * MiB // 4, dtype=np.float32)
    np.testing.assert_array_equal(
        Pipeline([0], options=ck.PipelineOptions(chunk_bytes=MiB)).map(
            scale_body(gpu, 2.0), x, out="pageable"
        ),
        x * 2,
    )
    gc.collect()
    allocs = Allocs(gpu, monkeypatch)
    for k in range(3):
        out = Pipeline([0], options=ck.PipelineOptions(chunk_bytes=MiB)).map(
            scale_body(gpu, k), x, out="pageable"
        )
        np.testing.assert_array_equal(out, x * k)
        gc.collect()
    assert allocs.times == []
    assert ck.pinned_pool().stats().in_use_blocks == 0


def test_small_chunks_many_in_flight_stress(gpu):
    gpu.jitter = 0.0005
    x = np.random.default_rng(9).integers(-1000, 1000, 3 * MiB // 4).astype(np.int32)
    with Pipeline(
        [0, 1], options=ck.PipelineOptions(chunk_bytes=64 * 1024, staging_buffers=6, host_threads=4)
    ) as p:
        for _ in range(2):
            np.testing.assert_array_equal(p.map(scale_body(gpu, 3), x), x * 3)
    assert not gpu.kernel_errors
