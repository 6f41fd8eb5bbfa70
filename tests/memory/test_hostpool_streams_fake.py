"""The pinned host pool (ctxkit/memory/pinned.py) and stream work: a block is reused
only after the work queued on its streams completed (fake events that stay busy, and the
simulated GPU whose streams really run asynchronously), frees from other threads and
during stream captures, blocks of a closed context, and no lock held across a slow
driver call."""

from __future__ import annotations

import gc
import random
import threading
import time

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import lifetime
from ctxkit.errors import OutOfMemoryError
from ctxkit.memory.device import DeviceBuffer
from ctxkit.memory.pinned import PinnedPool
from tests.support.fakemem import (  # noqa: F401
    NOT_READY,
    OK,
    ctx0,
    ctx1,
    fake,
    in_thread,
)

KiB, MiB = 1 << 10, 1 << 20


def ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.fixture
def busy(fake, monkeypatch) -> set[int]:
    """Every event recorded from now on stays NOT_READY for cuEventQuery (the stream
    work before it is running) until it is removed from the returned set or
    cuEventSynchronize waits for it."""
    pending: set[int] = set()
    record, sync = fake.cuEventRecord, fake.cuEventSynchronize

    def record_busy(ev, stream):
        pending.add(int(ev))
        return record(ev, stream)

    def synchronize(ev):
        pending.discard(int(ev))
        return sync(ev)

    monkeypatch.setattr(fake, "cuEventRecord", record_busy)
    monkeypatch.setattr(fake, "cuEventSynchronize", synchronize)
    monkeypatch.setattr(
        fake, "cuEventQuery", lambda ev: (NOT_READY,) if int(ev) in pending else (OK,)
    )
    return pending


def recorded(fake) -> list[int]:
    """Handles of the events recorded so far."""
    return [ev for _c, _ctx, (ev, _s) in fake.calls("record")]


# --- reuse only after stream work ----------------------------------------------------


def test_a_block_used_on_a_stream_waits_for_its_event(fake, ctx0, busy):
    pool = PinnedPool(budget=64 * MiB)
    s = ck.Stream(context=ctx0)
    a = pool.empty(MiB, np.uint8, stream=s)
    first = ptr(a)
    del a
    (ev,) = recorded(fake)  # at once, in the thread that dropped the array
    st = pool.stats()
    assert (st.pending_blocks, st.cached_blocks) == (1, 0)
    b = pool.empty(MiB, np.uint8)  # the stream may still use the first block
    assert ptr(b) != first and len(fake.calls("hostalloc")) == 2
    busy.discard(ev)  # the stream reached the event
    assert ptr(pool.empty(MiB, np.uint8)) == first
    assert pool.stats().pending_blocks == 0


def test_events_are_recorded_on_every_stream_and_reused(fake, ctx0, ctx1):
    pool = PinnedPool(budget=64 * MiB)
    s0, s1 = ck.Stream(context=ctx0), ck.Stream(context=ctx1)
    a = pool.empty(MiB, np.uint8, stream=[s0])
    pool.record_stream(a, s1)
    pool.record_stream(a[5:], s1)  # once is enough
    del a
    pool.stats()
    events = recorded(fake)
    assert [s for _c, _x, (_e, s) in fake.calls("record")] == [int(s0.handle), int(s1.handle)]
    assert {fake.events[e][0] for e in events} == {ctx0.handle, ctx1.handle}
    b = pool.empty(MiB, np.uint8, stream=s0)
    del b
    pool.stats()
    assert recorded(fake)[2] in events  # the pool's spare event is recorded again


def test_a_user_event_delays_reuse_until_it_completes(fake, ctx0, busy):
    pool = PinnedPool(budget=64 * MiB)
    s = ck.Stream(context=ctx0)
    a = pool.empty(MiB, np.uint8)
    mine = ck.Event(timing=False, context=ctx0).record(s)
    pool.record_event(a, mine)
    first = ptr(a)
    del a
    assert pool.stats().pending_blocks == 1
    assert ptr(pool.empty(MiB, np.uint8)) != first
    busy.clear()
    assert ptr(pool.empty(MiB, np.uint8)) == first
    assert int(mine.handle) in fake.events  # the pool never destroys the caller's event


def test_the_budget_waits_for_blocks_still_used_by_streams(fake, ctx0, busy):
    pool = PinnedPool(budget=2 * MiB)
    s = ck.Stream(context=ctx0)
    a = pool.empty(2 * MiB, np.uint8, stream=s)
    first = ptr(a)
    del a
    pool.stats()
    (ev,) = recorded(fake)
    b = pool.empty(2 * MiB, np.uint8)  # no room: waits for the event, then reuses
    assert ptr(b) == first and [d for _c, _x, d in fake.calls("eventsync")] == [ev]
    assert len(fake.calls("hostalloc")) == 1


def test_a_stream_closed_before_the_array_died_is_waited_for(fake, ctx0):
    pool = PinnedPool(budget=64 * MiB)
    s = ck.Stream(context=ctx0)
    a = pool.empty(MiB, np.uint8, stream=s)
    s.close()  # its queued work may still use the block
    del a
    s = pool.stats()
    assert s.cached_blocks == 1 and not recorded(fake)
    assert fake.calls("ctxsync")  # the context's work completed before it was cached


def test_record_stream_and_record_event_refuse_foreign_arrays(fake, ctx0):
    pool, other = PinnedPool(budget=MiB), PinnedPool(budget=MiB)
    s = ck.Stream(context=ctx0)
    mine = other.empty(10, np.uint8)
    for bad in (np.zeros(10), mine, ck.pinned_empty(10, np.uint8)):
        with pytest.raises(ValueError, match="not in a block of this pool"):
            pool.record_stream(bad, s)
        assert not pool.owns(bad)
    with pytest.raises(TypeError, match="expected a numpy array"):
        pool.record_stream([1, 2], s)
    a = pool.empty(10, np.uint8)
    with pytest.raises(TypeError, match="needs a ctxkit.Event"):
        pool.record_event(a, s)
    with pytest.raises(TypeError, match="may not contain None"):
        pool.empty(10, np.uint8, stream=[s, None])
    assert not pool.owns("text")


# --- threads, captures, contexts ---------------------------------------------------


def test_arrays_dying_in_other_threads_come_back_and_are_freed_in_their_context(fake, ctx0):
    failed = len(lifetime.failed_frees())
    pool = PinnedPool(budget=64 * MiB)
    arrays = [pool.empty(MiB, np.uint8) for _ in range(4)]
    box = [arrays]
    del arrays

    def drop():
        box.clear()
        gc.collect()

    in_thread(drop)
    s = pool.stats()
    assert (s.in_use_blocks, s.cached_blocks) == (0, 4)
    assert in_thread(pool.trim) == 4 * MiB
    frees = fake.calls("freehost")
    assert len(frees) == 4 and {ctx for _c, ctx, _p in frees} == {ctx0.handle}
    assert len(lifetime.failed_frees()) == failed


def test_many_threads_share_the_pool_within_its_budget(fake, ctx0):
    budget = 24 * MiB
    pool = PinnedPool(budget=budget)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            held = []
            for _ in range(60):
                try:
                    held.append(pool.empty(rng.choice([KiB, 64 * KiB, MiB, 3 * MiB]), np.uint8))
                except OutOfMemoryError:
                    held.clear()
                if held and (len(held) > 2 or rng.random() < 0.3):
                    held.pop(0)
                stats = pool.stats()
                assert stats.held_bytes <= budget
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    gc.collect()
    s = pool.stats()
    assert s.in_use_blocks == 0 and s.peak_bytes <= budget
    assert s.allocations - s.frees == s.cached_blocks == len(fake.host_allocs)
    assert s.hits > s.allocations  # the cache served most requests
    pool.trim()
    assert not fake.host_allocs


def test_a_block_returned_during_a_capture_settles_when_it_ends(fake, ctx0):
    """Recording the block's event inside a capture would add it to the captured graph
    (or invalidate the capture): the pool waits for the capture to end."""
    pool = PinnedPool(budget=64 * MiB)
    s = ck.Stream(context=ctx0)
    a = pool.empty(MiB, np.uint8, stream=s)
    lifetime.capture_begins(False)
    try:
        del a
        st = pool.stats()
        assert st.in_use_blocks == 1 and not recorded(fake)
    finally:
        lifetime.capture_ends(False)
    st = pool.stats()
    assert (st.in_use_blocks, st.cached_blocks + st.pending_blocks) == (0, 1)
    assert len(recorded(fake)) == 1 and lifetime.held_back_frees() == 0


def test_blocks_of_a_closed_context_are_dropped_not_freed(fake, ctx0):
    pool = PinnedPool(budget=64 * MiB)
    a, b = pool.empty(MiB, np.uint8), pool.empty(MiB, np.uint8)
    del a
    pool.stats()
    ctx0.close()  # the driver freed the context's host allocations
    del b
    s = pool.stats()
    assert s.cached_blocks == 1 and s.in_use_blocks == 0  # b was dropped at once
    c = pool.empty(MiB, np.uint8)  # the cached one is gone too: a new block
    assert len(fake.calls("hostalloc")) == 3 and not fake.calls("freehost")
    assert pool.stats().cached_blocks == 0
    del c


def test_trim_keeps_what_is_asked_and_release_waits_for_pending_blocks(fake, ctx0, busy):
    pool = PinnedPool(budget=64 * MiB)
    s = ck.Stream(context=ctx0)
    blocks = [pool.empty(MiB, np.uint8) for _ in range(3)]
    used = pool.empty(MiB, np.uint8, stream=s)
    keep = pool.empty(MiB, np.uint8)
    del blocks, used
    assert pool.stats().pending_blocks == 1
    assert pool.trim(keep_bytes=MiB) == 2 * MiB
    st = pool.stats()
    assert (st.cached_blocks, st.pending_blocks, st.in_use_blocks) == (1, 1, 1)
    assert pool.release() == 2 * MiB  # waited for the pending one
    st = pool.stats()
    assert (st.cached_blocks, st.pending_blocks, st.in_use_blocks) == (0, 0, 1)
    assert keep.nbytes == MiB
    with pytest.raises(ValueError):
        pool.trim(-1)


# --- the simulated GPU: streams really run asynchronously ----------------------------


def test_a_block_is_not_reused_while_a_copy_into_it_is_queued(gpu):
    """On the simulated GPU, a D2H copy queued behind a slow kernel is still to come
    when the array is dropped: the next request must get another block, and the old
    block must hold the copy's bytes when it is reused."""
    ctx = ck.registry.context(0)
    pool = PinnedPool(budget=64 * MiB)
    n = MiB
    s = ck.Stream(context=ctx)
    src = DeviceBuffer(n, context=ctx)
    src.copy_from_host(np.full(n, 7, np.uint8))
    a = pool.empty(n, np.uint8, stream=s)
    first = ptr(a)
    gpu.launch(s, lambda: time.sleep(0.3))
    src.copy_to_host(a, stream=s)
    del a
    b = pool.empty(n, np.uint8)
    assert ptr(b) != first
    assert pool.stats().pending_blocks == 1
    b[...] = 0
    s.synchronize()
    c = pool.empty(n, np.uint8)
    assert ptr(c) == first and (c == 7).all()  # the copy landed, nothing overwrote it
    del b, c
    assert pool.release() == 2 * n


def test_no_lock_is_held_while_the_driver_page_locks(fake, ctx0, monkeypatch):
    """A slow cuMemHostAlloc in one thread does not stall another thread's cache hit,
    stats or trim."""
    pool = PinnedPool(budget=64 * MiB)
    small = pool.empty(MiB, np.uint8)
    del small
    gate, entered = threading.Event(), threading.Event()
    real_alloc = fake.cuMemHostAlloc

    def slow_alloc(n, flags):
        entered.set()
        assert gate.wait(10)
        return real_alloc(n, flags)

    monkeypatch.setattr(fake, "cuMemHostAlloc", slow_alloc)
    big: list[np.ndarray] = []
    t = threading.Thread(target=lambda: big.append(pool.empty(16 * MiB, np.uint8)))
    t.start()
    try:
        assert entered.wait(10)
        t0 = time.perf_counter()
        hit = pool.empty(MiB, np.uint8)
        assert pool.stats().in_use_blocks == 1 and pool.trim() == 0
        assert time.perf_counter() - t0 < 1.0 and pool.owns(hit)
    finally:
        gate.set()
        t.join()
    assert big[0].nbytes == 16 * MiB and pool.stats().in_use_blocks == 2


def test_an_array_dropped_in_a_bare_thread_in_strict_mode_records_its_event(
    fake, ctx0, monkeypatch
):
    """Strict mode refuses implicit binds; the pool's finalizer binds the stream's
    context itself, so the event is recorded (no fallback to a context synchronize)."""
    monkeypatch.setattr(ck.registry, "strict", True)
    pool = PinnedPool(budget=64 * MiB)
    s = ck.Stream(context=ctx0)
    box = [pool.empty(MiB, np.uint8, stream=s)]
    in_thread(box.clear)
    assert len(recorded(fake)) == 1 and not fake.calls("ctxsync")
    assert pool.stats().cached_blocks == 1
