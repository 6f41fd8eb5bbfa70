"""The pinned host pool (ctxkit/memory/pinned.py) on the fake memory driver: handing
out and reuse by size class, accounting, the budget, LRU eviction, claims, the OS refusing
memory, trim/prefill, failing frees and the process-wide pool (stream work:
test_hostpool_streams_fake.py)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import lifetime
from ctxkit.errors import OutOfMemoryError
from ctxkit.memory import pinned
from ctxkit.memory.device import DeviceBuffer
from ctxkit.memory.host import MEMHOST_PORTABLE, is_pinned
from ctxkit.memory.pinned import PinnedPool
from tests.support.fakemem import (  # noqa: F401
    OUT_OF_MEMORY,
    ctx0,
    ctx1,
    fake,
    in_thread,
)
from tests.support.helpers import OBJECT_DTYPES, object_dtype_message

KiB, MiB = 1 << 10, 1 << 20


def ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def allocs(fake) -> list[int]:
    return [n for _c, _ctx, (n, _f) in fake.calls("hostalloc")]


# --- handing out and reuse ---------------------------------------------------------


def test_empty_returns_a_pinned_array_of_any_shape_and_dtype(fake, ctx0):
    pool = PinnedPool(budget=64 * MiB)
    a = pool.empty((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags.writeable
    assert a.flags.c_contiguous and is_pinned(a) and pool.owns(a) and pool.owns(a[1:])
    a[...] = 7
    assert float(a.sum()) == 105.0
    ((_c, ctx, (n, flags)),) = fake.calls("hostalloc")
    assert (ctx, n, flags) == (ctx0.handle, 4 * KiB, MEMHOST_PORTABLE)
    s = pool.stats()
    assert (s.in_use_bytes, s.in_use_blocks, s.requests, s.allocations) == (4 * KiB, 1, 1, 1)
    z = pool.zeros(10, np.int64)
    assert z.dtype == np.int64 and not z.any()


def test_a_block_returns_when_its_last_view_dies_and_is_reused(fake, ctx0):
    pool = PinnedPool(budget=64 * MiB)
    a = pool.empty(3 * MiB, np.uint8)
    view = a[10:20].view(np.uint16)
    where = ptr(a)
    del a
    assert pool.stats().in_use_blocks == 1  # the view keeps the block
    del view
    s = pool.stats()
    assert (s.in_use_blocks, s.cached_blocks, s.cached_bytes) == (0, 1, 4 * MiB)
    b = pool.empty((1000, 1000), np.float32)  # 4e6 bytes: the same 4 MiB class
    assert ptr(b) == where and len(fake.calls("hostalloc")) == 1
    s = pool.stats()
    assert (s.requests, s.hits, s.allocations, s.hit_rate) == (2, 1, 1, 0.5)
    assert not fake.calls("freehost")


def test_blocks_serve_requests_of_their_class_or_a_quarter_smaller(fake, ctx0):
    pool = PinnedPool(budget=64 * MiB)
    big = pool.empty(12 * MiB, np.uint8)
    where = ptr(big)
    del big
    assert ptr(pool.empty(7 * MiB, np.uint8)) != where  # 8 MiB class: 12 MiB is too big
    c = pool.empty(10 * MiB, np.uint8)  # 10 MiB class: 12 <= 12.5
    assert ptr(c) == where
    assert allocs(fake) == [12 * MiB, 8 * MiB]


def test_the_smallest_fitting_block_is_reused(fake, ctx0):
    pool = PinnedPool(budget=64 * MiB)
    a, b = pool.empty(12 * MiB, np.uint8), pool.empty(10 * MiB, np.uint8)
    want = ptr(b)
    del a, b
    assert ptr(pool.empty(10 * MiB, np.uint8)) == want


def test_zero_size_requests_allocate_nothing(fake, ctx0):
    pool = PinnedPool(budget=MiB)
    a = pool.empty((0, 4), np.float32)
    assert a.shape == (0, 4) and not pool.owns(a)
    assert not fake.calls("hostalloc") and pool.stats().requests == 0


@pytest.mark.parametrize(
    ("shape", "dtype", "error"),
    [((-1, 2), np.uint8, ValueError), ((2.5,), np.uint8, TypeError), (4, "nonsense", TypeError)],
)
def test_bad_requests_fail_before_allocating(fake, ctx0, shape, dtype, error):
    with pytest.raises(error):
        PinnedPool(budget=MiB).empty(shape, dtype)
    assert not fake.calls("hostalloc")


def test_blocks_live_in_the_registrys_context_not_an_owned_one(fake, ctx0):
    """cuMemHostAlloc memory dies with its context: a block made while the caller's own
    context is current must survive that context's close."""
    pool = PinnedPool(budget=MiB)
    own = ck.Context.create(0)
    with own:
        a = pool.empty(100, np.uint8)
    own.close()
    ((_c, ctx, _d),) = fake.calls("hostalloc")
    assert ctx == ctx0.handle != own.handle
    a[...] = 1
    del a
    assert pool.stats().cached_blocks == 1


def test_the_context_argument_picks_the_device(fake, ctx0, ctx1):
    pool = PinnedPool(budget=MiB)
    a = pool.empty(100, np.uint8, context=1)
    assert fake.calls("hostalloc")[0][1] == ctx1.handle
    del a
    pool.trim()
    assert fake.calls("freehost")[0][1] == ctx1.handle  # freed where it was allocated


# --- the budget --------------------------------------------------------------------


def test_a_request_over_the_budget_frees_cached_blocks_least_recent_first(fake, ctx0):
    pool = PinnedPool(budget=16 * MiB)
    a, b, c = (pool.empty(4 * MiB, np.uint8) for _ in range(3))
    pa, pb, pc = ptr(a), ptr(b), ptr(c)
    del b
    del a
    del c  # returned in the order b, a, c
    assert pool.stats().cached_bytes == 12 * MiB
    d = pool.empty(8 * MiB, np.uint8)  # needs 8 MiB: 12 cached + 8 > 16 -> free b only
    assert [p for _c, _x, p in fake.calls("freehost")] == [pb]
    s = pool.stats()
    assert (s.cached_bytes, s.in_use_bytes, s.evictions, s.frees) == (8 * MiB, 8 * MiB, 1, 1)
    assert ptr(pool.empty(4 * MiB, np.uint8)) == pc  # the most recently returned
    assert pa in fake.host_allocs
    del d


def test_over_the_budget_with_blocks_in_use_raises_a_clear_error(fake, ctx0):
    pool = PinnedPool(budget=8 * MiB)
    a = pool.empty(6 * MiB, np.uint8)
    with pytest.raises(OutOfMemoryError) as info:
        pool.empty(4 * MiB, np.uint8)
    msg = str(info.value)
    assert "budget of 8388608 bytes" in msg and "6291456 bytes are in use" in msg
    assert "CTXKIT_PINNED_POOL_BYTES" in msg and "set_budget" in msg
    assert isinstance(info.value, MemoryError) and len(fake.calls("hostalloc")) == 1
    del a
    assert pool.empty(8 * MiB, np.uint8).nbytes == 8 * MiB  # nothing leaked by the failure


def test_a_request_larger_than_the_budget_fails_at_once(fake, ctx0):
    pool = PinnedPool(budget=4 * MiB)
    with pytest.raises(OutOfMemoryError, match="does not fit the pinned pool's budget"):
        pool.empty(5 * MiB, np.uint8)
    assert not fake.calls("hostalloc")


def test_set_budget_frees_what_no_longer_fits(fake, ctx0):
    pool = PinnedPool(budget=16 * MiB)
    a, b = pool.empty(4 * MiB, np.uint8), pool.empty(4 * MiB, np.uint8)
    del a
    assert pool.set_budget(4 * MiB) == 4 * MiB  # the cached one goes, b stays
    assert pool.budget == 4 * MiB and pool.stats().in_use_bytes == 4 * MiB
    with pytest.raises(OutOfMemoryError):
        pool.empty(1, np.uint8)
    del b
    with pytest.raises(TypeError, match="int number of bytes"):
        pool.set_budget(1.5)
    with pytest.raises(ValueError, match=">= 0"):
        PinnedPool(budget=-1)


def test_claims_count_against_the_budget(fake, ctx0):
    pool = PinnedPool(budget=16 * MiB)
    a = pool.empty(8 * MiB, np.uint8)
    del a
    assert pool.claim(12 * MiB)  # frees the cached block to make room
    s = pool.stats()
    assert (s.claimed_bytes, s.cached_bytes, len(fake.calls("freehost"))) == (12 * MiB, 0, 1)
    assert not pool.claim(8 * MiB) and pool.stats().claimed_bytes == 12 * MiB
    with pytest.raises(OutOfMemoryError, match="12582912 are claimed"):
        pool.empty(8 * MiB, np.uint8)
    pool.unclaim(12 * MiB)
    assert pool.empty(8 * MiB, np.uint8).nbytes == 8 * MiB
    with pytest.raises(ValueError, match="only 0 bytes are claimed"):
        pool.unclaim(1)


def test_the_os_refusing_pinned_memory_empties_the_cache_and_retries(fake, ctx0, monkeypatch):
    pool = PinnedPool(budget=64 * MiB)
    a = pool.empty(4 * MiB, np.uint8)
    del a
    real_alloc, refusals = fake.cuMemHostAlloc, [1]

    def alloc(n, flags):
        if refusals:
            refusals.pop()
            return (OUT_OF_MEMORY, 0)
        return real_alloc(n, flags)

    monkeypatch.setattr(fake, "cuMemHostAlloc", alloc)
    b = pool.empty(8 * MiB, np.uint8)
    assert b.nbytes == 8 * MiB and len(fake.calls("freehost")) == 1
    fake.host_oom = True
    monkeypatch.setattr(fake, "cuMemHostAlloc", real_alloc)
    with pytest.raises(OutOfMemoryError, match="the OS refused to page-lock") as info:
        pool.empty(16 * MiB, np.uint8)
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert pool.stats().in_use_bytes == 8 * MiB  # the failure reserved nothing


# --- trim, release, prefill, the process pool ------------------------------------------


def test_prefill_allocates_only_the_missing_blocks(fake, ctx0):
    pool = PinnedPool(budget=64 * MiB)
    assert pool.prefill(3 * MiB, count=2) == 2
    assert pool.prefill(3 * MiB, count=2) == 0
    assert pool.prefill(0) == 0
    st = pool.stats()
    assert (st.cached_blocks, st.cached_bytes, st.allocations) == (2, 8 * MiB, 2)
    a, b = pool.empty(3 * MiB, np.uint8), pool.empty(4 * MiB, np.uint8)
    assert pool.stats().hits == 2 and len(fake.calls("hostalloc")) == 2
    del a, b
    with pytest.raises(OutOfMemoryError):
        pool.prefill(32 * MiB, count=3)  # the third does not fit; the first two stay
    st = pool.stats()
    assert (st.cached_blocks, st.cached_bytes) == (2, 64 * MiB)


def test_a_failing_free_is_recorded_not_raised(fake, ctx0, monkeypatch):
    failed = len(lifetime.failed_frees())
    pool = PinnedPool(budget=64 * MiB)
    a = pool.empty(MiB, np.uint8)
    del a

    def cuMemFreeHost(p):
        return (999,)

    monkeypatch.setattr(fake, "cuMemFreeHost", cuMemFreeHost)
    monkeypatch.setattr(lifetime, "_warned_failed_free", False)
    with pytest.warns(ResourceWarning, match="cuMemFreeHost"):
        assert pool.trim() == MiB
    assert [f.function for f in lifetime.failed_frees()[failed:]] == ["cuMemFreeHost"]
    assert pool.stats().cached_blocks == 0


def test_a_collected_private_pool_frees_its_cache(fake, ctx0):
    pool = PinnedPool(budget=64 * MiB)
    a = pool.empty(MiB, np.uint8)
    del a
    pool.stats()
    del pool
    gc.collect()
    assert len(fake.calls("freehost")) == 1 and not fake.host_allocs


def test_pinned_pool_is_one_per_process(fake, ctx0, monkeypatch):
    monkeypatch.setattr(pinned, "_process_pool", None)
    monkeypatch.setenv("CTXKIT_PINNED_POOL_BYTES", str(32 * MiB))
    pools = [in_thread(pinned.pinned_pool) for _ in range(4)]
    assert all(p is pools[0] for p in pools) and pools[0] is pinned.pinned_pool()
    assert pools[0].budget == 32 * MiB
    a = pools[0].empty(MiB, np.uint8)
    assert repr(pools[0]) == (
        "<PinnedPool in_use=1.0 MiB cached=0.0 MiB pending=0.0 MiB budget=32.0 MiB>"
    )
    del a


def test_pooled_arrays_are_async_copy_sources(fake, ctx0):
    """A pooled array is pinned: a stream copy from it is asynchronous (no pageable
    warning even in strict mode)."""
    ck.memory.set_strict_async(True)
    try:
        pool = PinnedPool(budget=MiB)
        s = ck.Stream(context=ctx0)
        a = pool.empty(1000, np.uint8, stream=s)
        a[...] = np.arange(1000) % 251
        buf = DeviceBuffer(1000, context=ctx0)
        buf.copy_from_host(a, stream=s)
        s.synchronize()
        assert np.array_equal(buf.copy_to_host(), a)
    finally:
        ck.memory.set_strict_async(False)


def test_a_bad_context_fails_even_when_the_cache_could_serve(fake, ctx0):
    pool = PinnedPool(budget=MiB)
    a = pool.empty(100, np.uint8)
    del a
    with pytest.raises(TypeError, match="expected a ctxkit.Context"):
        pool.empty(100, np.uint8, context="gpu0")
    assert pool.stats().cached_blocks == 1  # nothing was taken or evicted


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_pool_arrays_refuse_python_objects(fake, ctx0, dtype):
    pool = PinnedPool()
    for call in (
        lambda: pool.empty(8, dtype, context=ctx0),
        lambda: pool.try_empty(8, dtype, context=ctx0),
        lambda: pool.zeros((2, 4), dtype, context=ctx0),
    ):
        with pytest.raises(TypeError, match=object_dtype_message(dtype)):
            call()
    assert not fake.calls("hostalloc")
