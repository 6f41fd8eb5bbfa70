"""How a map runs, decided before it starts (``ctxkit.pipeline.plan``): the split of rows
over devices and chunks, the host path of each side, and the checks of a map's arrays and
options. Pure functions: no driver."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from ctxkit.pipeline import (
    Chunk,
    MapPlan,
    PipelineOptions,
    default_chunk_bytes,
    grid_size,
    plan_map,
    prepare_io,
    split_rows,
)
from ctxkit.pipeline.plan import AUTO_REGISTER_MIN_BYTES, DEFAULT_STAGING_BUFFERS, MAX_CHUNKS
from tests.support.helpers import OBJECT_DTYPES, object_array, object_dtype_message

MiB = 1 << 20


# --- splitting rows -----------------------------------------------------------------------


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
    assert default_chunk_bytes(2 << 30, 1) == 64 * MiB  # big inputs: 64 MiB chunks
    assert default_chunk_bytes(1 << 30, 2) == 64 * MiB  # 8 per device
    assert default_chunk_bytes(256 * MiB, 1) == 32 * MiB  # at least 8 chunks per device
    assert default_chunk_bytes(80 * MiB, 2) == 5 * MiB
    assert default_chunk_bytes(100, 2) == MiB  # never below 1 MiB
    assert default_chunk_bytes(0, 1) == MiB


@pytest.mark.parametrize("total_mib", [8, 64, 100, 512, 1024, 4096])
@pytest.mark.parametrize("devices", [1, 2, 8])
def test_default_chunks_keep_every_device_busy(total_mib, devices):
    """Every device gets at least 8 chunks to overlap (unless chunks hit the 1 MiB floor),
    and chunks are only made smaller than 64 MiB to get there."""
    nbytes = total_mib * MiB
    plan = plan_map(nbytes // 4, (4, 4), devices)
    per_device = [len(plan.for_part(d)) for d in range(devices)]
    chunk = plan.in_chunk_bytes
    assert MiB <= chunk <= 64 * MiB
    assert min(per_device) >= 8 or chunk == MiB
    assert chunk in (MiB, 64 * MiB) or max(per_device) <= 9  # no smaller than needed


def test_grid_size():
    assert grid_size(1, 256, 100) == 1
    assert grid_size(256, 256, 100) == 1
    assert grid_size(257, 256, 100) == 2
    assert grid_size(10**9, 256, 528) == 528  # capped: kernels loop (grid-stride)
    assert grid_size(0, 256, 10) == 1
    with pytest.raises(ValueError, match="block"):
        grid_size(10, 0, 10)


def test_chunk_rows():
    assert Chunk(3, 0, 10, 25).rows == 15


# --- plan_map: chunks and devices -----------------------------------------------------------


def test_static_chunks_are_row_aligned_and_complete():
    plan = plan_map(1000, (12, 12), 2, PipelineOptions(chunk_bytes=1000))
    assert isinstance(plan, MapPlan)
    assert plan.rows_per_chunk == 83  # 1000 // 12
    assert plan.parts == ((0, 500), (500, 1000))
    for part, (lo, hi) in enumerate(plan.parts):
        mine = plan.for_part(part)
        assert mine[0].row0 == lo and mine[-1].row1 == hi
        assert all(a.row1 == b.row0 for a, b in itertools.pairwise(mine))
        assert all(0 < c.rows <= 83 for c in mine)
    assert [c.index for c in plan.chunks] == list(range(len(plan.chunks)))
    assert sum(c.rows for c in plan.chunks) == 1000
    assert plan.active == (0, 1)


def test_chunks_are_sized_by_the_wider_rows():
    plan = plan_map(1000, (12, 24), 1, PipelineOptions(chunk_bytes=1200))
    assert plan.rows_per_chunk == 50
    assert (plan.in_chunk_bytes, plan.out_chunk_bytes) == (600, 1200)


def test_fewer_rows_than_devices_and_empty():
    plan = plan_map(1, (4, 4), 3, PipelineOptions(chunk_bytes=MiB))
    assert [len(plan.for_part(p)) for p in range(3)] == [0, 0, 1]
    assert plan.active == (2,)  # only the device with work runs
    empty = plan_map(0, (4, 4), 2, PipelineOptions(chunk_bytes=1024))
    assert empty.chunks == () and empty.empty and empty.active == ()
    assert plan_map(5, (0, 0), 1).empty  # rows of zero bytes: nothing to move


def test_row_bigger_than_chunk_gives_one_row_chunks():
    plan = plan_map(5, (4096, 4096), 1, PipelineOptions(chunk_bytes=1000))
    assert plan.rows_per_chunk == 1 and len(plan.chunks) == 5


def test_dynamic_schedule_shares_one_queue():
    plan = plan_map(100, (4, 4), 3, PipelineOptions(chunk_bytes=40, schedule="dynamic"))
    assert plan.schedule == "dynamic"
    assert all(c.part == -1 for c in plan.chunks)
    assert [c.rows for c in plan.chunks] == [10] * 10
    assert plan.active == (0, 1, 2)  # every device takes chunks from the queue


def test_default_chunk_size_and_errors():
    plan = plan_map(2**20, (4, 4), 1)  # 4 MiB -> 1 MiB chunks
    assert plan.rows_per_chunk == 2**18
    with pytest.raises(ValueError, match="at least one device"):
        plan_map(10, (4, 4), 0)
    with pytest.raises(ValueError, match="row_bytes"):
        plan_map(10, (-4, 4), 1)
    with pytest.raises(ValueError, match="host kinds"):
        plan_map(10, (4, 4), 1, host=("pageable", "mapped"))


# --- plan_map: how host data moves ------------------------------------------------------------


def _modes(host=("pageable", "pageable"), n_rows=1 << 20, **kw) -> tuple[str, str, str]:
    plan = plan_map(n_rows, (4, 4), 1, PipelineOptions(**kw), host)
    return plan.in_mode, plan.out_mode, plan.path


def test_pageable_sides_are_staged_by_default():
    assert _modes() == ("staged", "staged", "in=staged, out=staged")
    plan = plan_map(1 << 20, (4, 4), 1)
    assert plan.stage_in and plan.stage_out and plan.needs_pool and not plan.registers


def test_pinned_and_held_sides_are_copied_directly():
    assert _modes(("pinned", "pinned"))[2] == "pinned"
    assert _modes(("held", "pageable")) == ("held", "staged", "in=held, out=staged")
    plan = plan_map(1 << 20, (4, 4), 1, host=("pinned", "pinned"))
    assert not plan.needs_pool  # no host threads for direct copies


def test_host_path_applies_per_side_to_pageable_memory_only():
    got = _modes(("pageable", "pinned"), host_path=("register", "staged"))
    assert got == ("register", "pinned", "in=registered, out=pinned")
    assert _modes(host_path="register")[:2] == ("register", "register")
    assert _modes(host_path=("staged", "register"))[:2] == ("staged", "register")


def test_empty_sides_are_never_pinned():
    plan = plan_map(0, (4, 4), 1, host=("pinned", "held"))
    assert (plan.in_mode, plan.out_mode) == ("staged", "staged")


def test_small_auto_sides_are_staged(monkeypatch):
    from ctxkit.pipeline import plan as _plan

    monkeypatch.setattr(_plan, "AUTO_HOST_PATH", "register")
    big = AUTO_REGISTER_MIN_BYTES // 4
    assert _modes(n_rows=big)[:2] == ("register", "register")
    assert _modes(n_rows=big - 1)[:2] == ("staged", "staged")


def test_managed_map_prefetches_instead_of_copying():
    opts = PipelineOptions(prefetch=False, to_host=True)
    plan = plan_map(1000, (4, 4), 2, opts, host=("managed", "managed"))
    assert plan.managed and plan.path == "managed" and not plan.needs_pool
    assert (plan.prefetch, plan.to_host) == (False, True)
    with pytest.raises(ValueError, match="managed on both sides"):
        plan_map(1000, (4, 4), 2, opts, host=("managed", "pinned"))


def test_registering_feeders_claim_a_few_chunks_ahead():
    opts = PipelineOptions(host_path="register", staging_buffers=3, host_threads=16)
    assert plan_map(1 << 20, (4, 4), 1, opts).ahead == 6  # min(16, 2 * 3)
    assert plan_map(1 << 20, (4, 4), 4, opts).ahead == 4  # 16 threads over 4 devices
    few = dataclasses.replace(opts, host_threads=2)
    assert plan_map(1 << 20, (4, 4), 2, few).ahead == 3  # at least staging_buffers
    staged = PipelineOptions(staging_buffers=4)
    assert plan_map(1 << 20, (4, 4), 2, staged).ahead == 4  # every slot's input fills at once
    assert plan_map(1 << 20, (4, 4), 2).ahead == DEFAULT_STAGING_BUFFERS
    dynamic = PipelineOptions(staging_buffers=6, schedule="dynamic")
    assert plan_map(1 << 20, (4, 4), 2, dynamic).ahead == 3  # leaves chunks to steal
    pinned_in = plan_map(1 << 20, (4, 4), 2, staged, host=("pinned", "pageable"))
    assert pinned_in.ahead == 1  # nothing to fill or register ahead
    mixed = PipelineOptions(host_path=("staged", "register"), staging_buffers=2, host_threads=16)
    assert plan_map(1 << 20, (4, 4), 1, mixed).ahead == 4  # registrations go further


# --- options ----------------------------------------------------------------------------------


def test_map_options_normalise_the_host_path():
    assert PipelineOptions(host_path="register").host_path == ("register", "register")
    assert PipelineOptions(host_path=("register", "staged")).host_path == ("register", "staged")
    with pytest.raises(dataclasses.FrozenInstanceError):
        PipelineOptions().block = 128  # type: ignore[misc]


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"staging_buffers": 0}, ValueError, "staging_buffers must be in 1..64, got 0"),
        ({"staging_buffers": 2**40}, ValueError, "staging_buffers must be in 1..64, got 1099"),
        ({"host_threads": 257}, ValueError, "host_threads must be in 1..256, got 257"),
        ({"chunk_bytes": 1.5}, TypeError, "chunk_bytes must be an int"),
        ({"chunk_bytes": 0}, ValueError, "chunk_bytes must be >= 1"),
        ({"host_threads": 0}, ValueError, "host_threads"),
        ({"host_threads": True}, TypeError, "host_threads must be an int"),
        ({"schedule": "greedy"}, ValueError, "schedule must be one of"),
        ({"block": 2048}, ValueError, "block must be an int in 1..1024"),
        ({"block": 1.0}, ValueError, "block"),
        ({"host_path": "fast"}, ValueError, "host_path must be one of"),
        ({"host_path": ("staged",)}, ValueError, "host_path"),
    ],
)
def test_map_options_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        PipelineOptions(**kw)


def test_chunk_bytes_that_cut_a_map_into_too_many_chunks_are_refused():
    with pytest.raises(ValueError, match=r"chunk_bytes=1 cuts .* 65536 chunks.*chunk_bytes >= "):
        plan_map(1 << 20, (4, 4), 1, PipelineOptions(chunk_bytes=1))
    fewest = -(-(1 << 20) // (MAX_CHUNKS - 2)) * 4
    plan = plan_map(1 << 20, (4, 4), 2, PipelineOptions(chunk_bytes=fewest))
    assert len(plan.chunks) <= MAX_CHUNKS


def test_default_chunks_of_a_huge_map_stay_under_the_chunk_limit():
    plan = plan_map(1 << 40, (64, 64), 3)
    assert len(plan.chunks) <= MAX_CHUNKS
    assert plan.rows_per_chunk * 64 >= (1 << 46) // MAX_CHUNKS


def test_chunk_bytes_beyond_the_array_size_slot_buffers_by_the_array():
    plan = plan_map(10, (4, 8), 1, PipelineOptions(chunk_bytes=2**62))
    assert (plan.rows_per_chunk, plan.in_chunk_bytes, plan.out_chunk_bytes) == (10, 40, 80)
    assert plan_map(0, (4, 4), 1, PipelineOptions(chunk_bytes=2**62)).chunks == ()


# --- arrays -------------------------------------------------------------------------------


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


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_prepare_io_refuses_python_objects_naming_the_dtype(dtype):
    arr = object_array(dtype, 64)
    for x, out in ((arr, None), (arr, "pageable"), (np.zeros(len(arr)), arr)):
        with pytest.raises(TypeError, match=object_dtype_message(dtype)):
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
