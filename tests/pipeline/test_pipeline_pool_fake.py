"""Pipeline.map and the process's pinned pool on a simulated GPU: staging buffers drawn
from the pool (a new Pipeline per call page-locks nothing), ``out="pinned"`` (a pooled
output, given back when the caller drops it), NVTX ranges around the chunk stages and
the ``progress=True`` bar."""

from __future__ import annotations

import gc
import sys
import types
from typing import ClassVar

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.trace as cn
from ctxkit.pipeline import Pipeline
from ctxkit.pipeline.plan import POOLED_OUT_BYTES
from tests.support.fakegpu import scale_body

MiB = 1 << 20


def host_allocs(gpu) -> int:
    return sum(1 for _arr, kind in gpu.mem.values() if kind == "host")


# --- out="pinned" ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 100_003])
def test_pinned_output_is_right_and_pooled(gpu, n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2)) as p:
        out = p.map(scale_body(gpu, 2.0), x, out="pinned")
        assert out.shape == x.shape and out.dtype == x.dtype
        np.testing.assert_array_equal(out, x * 2)
        if n:
            assert ck.pinned_pool().owns(out) and ck.is_pinned(out)
            assert p.last_stats.path == "in=staged, out=pinned"  # DMAed, not drained
    assert not gpu.pageable_dma and not gpu.kernel_errors


def test_pinned_output_block_returns_when_dropped_and_is_reused(gpu):
    x = np.arange(50_000, dtype=np.float32)
    pool = ck.pinned_pool()
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2)) as p:
        out = p.map(scale_body(gpu, 2.0), x, out="pinned")
        ptr = out.ctypes.data
        view = out[10:]
        in_use = pool.stats().in_use_blocks
        del out
        gc.collect()
        assert pool.stats().in_use_blocks == in_use  # a view keeps the block
        np.testing.assert_array_equal(view, x[10:] * 2)
        del view
        gc.collect()
        assert pool.stats().in_use_blocks == in_use - 1
        allocs = host_allocs(gpu)
        again = p.map(scale_body(gpu, 3.0), x, out="pinned")
        assert again.ctypes.data == ptr and host_allocs(gpu) == allocs  # the same block
        np.testing.assert_array_equal(again, x * 3)
        kept = p.map(scale_body(gpu, 4.0), x, out="pinned")
        assert kept.ctypes.data != again.ctypes.data  # a live output is never reused
        np.testing.assert_array_equal(again, x * 3)


def test_pinned_output_of_other_shapes_and_2d(gpu):
    x = np.arange(3000, dtype=np.float64).reshape(1000, 3)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4096, host_threads=2)) as p:
        out = p.map(scale_body(gpu, 2.0), x, out="pinned")
    assert out.shape == (1000, 3)
    np.testing.assert_array_equal(out, x * 2)


def test_pinned_output_does_not_fit_the_budget(gpu):
    x = np.zeros(1 << 20, np.uint8)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=4096, host_threads=2)) as p:
        p.map(scale_body(gpu, 1), x[:4096])  # staging buffers first
        ck.pinned_pool().set_budget(ck.pinned_pool().stats().in_use_bytes)
        with pytest.raises(ck.OutOfMemoryError, match="CTXKIT_PINNED_POOL_BYTES"):
            p.map(scale_body(gpu, 1), x, out="pinned")


# --- the default output ----------------------------------------------------------------------


def test_default_output_of_a_large_map_is_pooled_and_reused(gpu):
    x = np.arange(POOLED_OUT_BYTES // 4 + 5, dtype=np.float32)  # just over the threshold
    pool = ck.pinned_pool()
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=MiB, host_threads=2)) as p:
        out = p.map(scale_body(gpu, 2.0), x)
        assert pool.owns(out) and p.last_stats.path == "in=staged, out=pinned"
        np.testing.assert_array_equal(out, x * 2)
        ptr = out.ctypes.data
        del out
        gc.collect()
        allocs = pool.stats().allocations
        again = p.map(scale_body(gpu, 3.0), x)
        assert again.ctypes.data == ptr and pool.stats().allocations == allocs
        kept = p.map(scale_body(gpu, 4.0), x)  # `again` is alive: another block
        assert kept.ctypes.data != ptr
        np.testing.assert_array_equal(again, x * 3)
        np.testing.assert_array_equal(kept, x * 4)
    assert not gpu.pageable_dma


def test_default_output_of_a_small_map_is_an_ordinary_array(gpu):
    x = np.arange(POOLED_OUT_BYTES // 4 - 1, dtype=np.float32)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=MiB, host_threads=2)) as p:
        out = p.map(scale_body(gpu, 2.0), x)
        assert not ck.pinned_pool().owns(out) and p.last_stats.path == "in=staged, out=staged"
    np.testing.assert_array_equal(out, x * 2)


def test_default_output_without_room_in_the_pool_is_pageable_not_an_error(gpu):
    x = np.ones(POOLED_OUT_BYTES // 4, dtype=np.float32)
    pool = ck.pinned_pool()
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=MiB, host_threads=2)) as p:
        p.map(scale_body(gpu, 1.0), x, out="pageable")  # every staging buffer first
        pool.set_budget(pool.stats().in_use_bytes)
        out = p.map(scale_body(gpu, 2.0), x)
        assert not pool.owns(out) and p.last_stats.path == "in=staged, out=staged"
        np.testing.assert_array_equal(out, x * 2)
        with pytest.raises(ck.OutOfMemoryError):  # asked for explicitly: the pool's error
            p.map(scale_body(gpu, 2.0), x, out="pinned")


def test_default_output_leaves_room_for_the_staging_of_a_fallback(gpu):
    """Outputs kept by the caller fill the pool only up to where the staging buffers a
    pageable output needs still fit: the call after that falls back and works."""
    x = np.ones(8 * MiB // 4, dtype=np.float32)
    pool = ck.pinned_pool()
    with Pipeline(
        [0], options=ck.PipelineOptions(chunk_bytes=MiB, staging_buffers=2, host_threads=2)
    ) as p:
        staging = 2 * 2 * MiB  # in and out, 2 slots of 1 MiB: held, or kept free
        pool.set_budget(3 * x.nbytes + 2 * staging)
        kept = [p.map(scale_body(gpu, float(k)), x) for k in range(4)]
        assert [pool.owns(y) for y in kept] == [True, True, True, False]
        assert p.last_stats.path == "in=staged, out=staged"
        assert pool.stats().peak_bytes <= pool.budget
        for k, y in enumerate(kept):
            np.testing.assert_array_equal(y, x * k)


def test_try_empty_never_waits_and_keeps_the_headroom(gpu):
    pool = ck.PinnedPool(budget=8 * MiB)
    assert pool.try_empty(4 * MiB, np.uint8, headroom=5 * MiB) is None
    a = pool.try_empty(4 * MiB, np.uint8, headroom=4 * MiB)
    assert a is not None and pool.owns(a)
    assert pool.try_empty(5 * MiB, np.uint8) is None  # over budget: None, not an error
    assert pool.try_empty(0, np.uint8).size == 0


def test_pageable_output_is_never_pooled(gpu):
    x = np.ones(POOLED_OUT_BYTES // 4, dtype=np.float32)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=MiB, host_threads=2)) as p:
        out = p.map(scale_body(gpu, 2.0), x, out="pageable")
        assert not ck.pinned_pool().owns(out) and p.last_stats.path == "in=staged, out=staged"
    np.testing.assert_array_equal(out, x * 2)


@pytest.mark.parametrize("bad", ["", "PINNED", "managed"])
def test_unknown_out_strings_are_refused(gpu, bad):
    with Pipeline([0]) as p, pytest.raises(ValueError, match='"pinned"'):
        p.map(scale_body(gpu, 1.0), np.ones(4), out=bad)


def test_pinned_output_on_a_closed_pipeline(gpu):
    p = Pipeline([0])
    p.close()
    with pytest.raises(ValueError, match="closed"):
        p.map(scale_body(gpu, 1.0), np.ones(4), out="pinned")
    assert ck.pinned_pool().stats().requests == 0  # nothing allocated first


# --- staging buffers from the pool ----------------------------------------------------------


def test_staging_and_bounce_buffers_come_from_the_pool(gpu):
    x = np.arange(100_003, dtype=np.float32)
    pool = ck.pinned_pool()
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2)) as p:
        p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="register"))
        slots = [s for d in p._devices for s in d.slots]
        assert all(pool.owns(s.bounce) for s in slots)
        p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="staged"))
        assert all(pool.owns(s.pin_in) and pool.owns(s.pin_out) for s in slots)
        in_use = pool.stats().in_use_blocks
        assert in_use == 3 * len(slots)
    stats = pool.stats()
    assert stats.in_use_blocks == 0 and stats.cached_blocks == in_use  # not trimmed


# --- NVTX -----------------------------------------------------------------------------------


class FakeDomain:
    def __init__(self) -> None:
        self.pushed: list[str] = []
        self.depth = 0

    def get_event_attributes(self, message=None, color=None, **_: object):
        return message

    def push_range(self, name):
        self.pushed.append(name)
        self.depth += 1

    def pop_range(self):
        self.depth -= 1


@pytest.fixture
def fake_nvtx(monkeypatch) -> FakeDomain:
    dom = FakeDomain()
    mod = types.ModuleType("nvtx")
    mod.get_domain = lambda name: dom  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvtx", mod)
    monkeypatch.setattr(cn, "_nvtx_domain", None)
    monkeypatch.setattr(cn, "_nvtx_attrs", {})
    monkeypatch.setattr(cn, "_nvtx_available", lambda: True)
    monkeypatch.setattr(cn, "_nvtx_enabled", True)
    return dom


def test_chunk_stages_are_nvtx_ranges(gpu, fake_nvtx):
    x = np.arange(40_000, dtype=np.float32)  # 10 chunks
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2)) as p:
        p.map(scale_body(gpu, 2.0), x, options=ck.PipelineOptions(host_path="staged"))
    names = fake_nvtx.pushed
    for stage in ("h2d", "kernel", "d2h", "fill", "drain"):
        assert names.count(stage) == 10, (stage, names)
    assert fake_nvtx.depth == 0  # every range was closed


def test_no_nvtx_ranges_when_off(gpu, fake_nvtx, monkeypatch):
    monkeypatch.setattr(cn, "_nvtx_enabled", False)
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2)) as p:
        p.map(scale_body(gpu, 2.0), np.arange(40_000, dtype=np.float32))
    assert fake_nvtx.pushed == []


# --- progress=True --------------------------------------------------------------------------


class FakeTqdm:
    made: ClassVar[list[FakeTqdm]] = []

    def __init__(self, total=None, desc=None, unit=None) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.closed = False
        FakeTqdm.made.append(self)

    def update(self, n=1) -> None:
        assert not self.closed
        self.n += n

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tqdm(monkeypatch):
    FakeTqdm.made = []
    mod = types.ModuleType("tqdm")
    mod.tqdm = FakeTqdm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tqdm", mod)
    return FakeTqdm.made


def test_progress_uses_tqdm_when_installed(gpu, fake_tqdm):
    x = np.arange(40_000, dtype=np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2)) as p:
        p.map(scale_body(gpu, 2.0), x)
        assert fake_tqdm == []  # off by default
        out = p.map(scale_body(gpu, 2.0), x, progress=True)
    np.testing.assert_array_equal(out, x * 2)
    (bar,) = fake_tqdm
    assert (bar.total, bar.n, bar.closed, bar.unit) == (10, 10, True, "chunk")


def test_progress_line_on_stderr_without_tqdm(gpu, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    x = np.arange(40_000, dtype=np.float32)
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=16 * 1024, host_threads=2)) as p:
        p.map(scale_body(gpu, 2.0), x, progress=True)
    err = capsys.readouterr().err
    assert err.endswith("ctxkit map: 10/10 chunks (100%)\n")
    assert err.startswith("\rctxkit map: 0/10 chunks (0%)")


def test_progress_bar_is_closed_when_the_map_fails(gpu, fake_tqdm):
    def body(ctx, stream, d_in, d_out, n):
        raise RuntimeError("bad body")

    with (
        Pipeline([0], options=ck.PipelineOptions(chunk_bytes=16 * 1024)) as p,
        pytest.raises(Exception, match="bad body"),
    ):
        p.map(body, np.arange(40_000, dtype=np.float32), progress=True)
    assert fake_tqdm[0].closed
