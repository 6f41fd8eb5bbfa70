"""The pipeline's host threads (``ctxkit.pipeline.staging``) and the chunk progress
a feeder waits on: queued copies split into pieces, fill work before drain work,
failures and stops, helping, out-of-order completion. No driver needed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from ctxkit.pipeline import staging as _threads
from ctxkit.pipeline.staging import (
    MIN_PIECE_BYTES,
    CopyBatch,
    HostPool,
    Progress,
    default_host_threads,
)


@pytest.fixture
def pool():
    p = HostPool(2, prefix="test-pool")
    yield p
    p.close()


def test_default_host_threads(monkeypatch):
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: set(range(32)))
    assert default_host_threads(1) == 16
    assert default_host_threads(2) == 16
    assert default_host_threads(8) == 15
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert default_host_threads(2) == 3
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: {0})
    assert default_host_threads(1) == 2


def test_host_pool_submit_returns_results_and_exceptions(pool):
    ok: Future[int] = pool.submit(lambda a, b: a + b, 2, 3)
    bad = pool.submit(lambda: 1 / 0, urgent=False)
    assert ok.result(5) == 5
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    src = np.arange(3 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    pool.help_until(pool.copy_async(dst, src, None))
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("n", [0, 1, MIN_PIECE_BYTES - 1, 5 * MIN_PIECE_BYTES + 77])
def test_copy_async_copies_every_byte_and_calls_back_once(pool, n):
    src = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
    dst = np.zeros_like(src)
    calls: list[CopyBatch] = []
    batch = pool.copy_async(dst, src, None, on_done=calls.append)
    batch.wait()
    assert batch.done and calls == [batch]
    assert np.array_equal(dst, src)


def test_copy_pieces_are_traced_per_thread(pool):
    class Rec:
        def __init__(self) -> None:
            self.rows: list[tuple] = []

        def host(self, name, device, label, chunk, t0, t1):
            assert t1 >= t0
            self.rows.append((name, device, label, chunk))

    rec = Rec()
    src = np.ones(4 * MIN_PIECE_BYTES, np.uint8)
    dst = np.zeros_like(src)
    pool.copy_async(dst, src, (rec, "drain", 1, 7), urgent=False).wait()
    assert len(rec.rows) == 2  # one piece per thread
    assert {r[:2] + r[3:] for r in rec.rows} == {("drain", 1, 7)}
    assert all(r[2].startswith("host test-pool_") for r in rec.rows)
    assert dst.all()


def test_fill_work_runs_before_queued_drain_work():
    pool = HostPool(1, prefix="test-prio")
    order: list[str] = []
    gate = threading.Event()
    try:
        pool.submit(gate.wait, 5)  # the only thread is busy while both kinds queue up
        drains = [pool.submit(order.append, f"drain{i}", urgent=False) for i in range(3)]
        fills = [pool.submit(order.append, f"fill{i}") for i in range(3)]
        gate.set()
        for f in drains + fills:
            f.result(5)
    finally:
        pool.close()
    assert order == ["fill0", "fill1", "fill2", "drain0", "drain1", "drain2"]


def test_a_failed_piece_fails_its_batch_only(pool, monkeypatch):
    real = _threads.copy_piece

    def failing(dst, src, trace, label, streaming=False):
        if trace is not None and trace[3] == 2:
            raise MemoryError("piece of chunk 2")
        real(dst, src, trace, label, streaming)

    monkeypatch.setattr(_threads, "copy_piece", failing)

    class Rec:
        def host(self, *args):
            pass

    src = np.ones(2 * MIN_PIECE_BYTES, np.uint8)
    outs = [np.zeros_like(src) for _ in range(3)]
    batches = [pool.copy_async(o, src, (Rec(), "fill", 0, i)) for i, o in enumerate(outs)]
    batches[0].wait()
    batches[1].wait()
    with pytest.raises(MemoryError, match="chunk 2"):
        batches[2].wait()
    assert isinstance(batches[2].error, MemoryError)
    assert outs[0].all() and outs[1].all()


def test_pieces_not_started_are_skipped_once_the_run_stops():
    pool = HostPool(1, prefix="test-stop")
    gate = threading.Event()
    stop = threading.Event()
    try:
        pool.submit(gate.wait, 5)
        src = np.ones(4 * MIN_PIECE_BYTES, np.uint8)
        dst = np.zeros_like(src)
        batch = pool.copy_async(dst, src, None, stop=stop)
        stop.set()
        gate.set()
        batch.settle()
        batch.wait()  # skipped pieces are no failure
    finally:
        pool.close()
    assert not dst.any()


def test_help_until_runs_fill_pieces_in_the_calling_thread():
    pool = HostPool(1, prefix="test-help")
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(5)

    try:
        blocker = pool.submit(hold)
        assert held.wait(5)  # the pool's only thread is held (not just queued)
        src = np.arange(3 * MIN_PIECE_BYTES, dtype=np.uint64).view(np.uint8)
        dst = np.zeros_like(src)
        t0 = time.perf_counter()
        pool.help_until(pool.copy_async(dst, src, None))
        assert time.perf_counter() - t0 < 4  # done without the pool thread
        assert np.array_equal(dst, src)
        gate.set()
        blocker.result(5)
        # the pool thread still answers jobs queued after the helped ones
        assert pool.submit(lambda: 42).result(5) == 42
    finally:
        gate.set()
        pool.close()


def test_close_runs_queued_jobs_first():
    pool = HostPool(2, prefix="test-close")
    done: list[int] = []
    for i in range(20):
        pool.submit(done.append, i, urgent=bool(i % 2))
    pool.close()
    assert sorted(done) == list(range(20))
    assert not [t for t in threading.enumerate() if t.name.startswith("test-close")]


def test_progress_waits_for_drained_chunks_and_gives_up_on_stop():
    prog, stop = Progress(), threading.Event()
    assert prog.wait_for(0, stop)
    threading.Timer(0.02, prog.advance).start()
    assert prog.wait_for(1, stop) and prog.done == 1
    threading.Timer(0.02, stop.set).start()
    t0 = time.perf_counter()
    assert not prog.wait_for(5, stop)
    assert time.perf_counter() - t0 < 1.0


def test_progress_counts_only_the_finished_prefix():
    """Drains finish out of order: waiting for chunk 0's slot must not be satisfied by
    chunks 1 and 2 finishing first."""
    prog, stop = Progress(), threading.Event()
    prog.advance(2)
    prog.advance(1)
    assert prog.done == 0
    threading.Timer(0.2, stop.set).start()
    assert not prog.wait_for(1, stop)
    prog.advance(0)
    assert prog.done == 3
    assert Progress().wait_for(0, threading.Event())


def test_help_until_leaves_other_jobs_to_the_pool():
    """A feeder that helps with fill pieces must not run an allocation or registration
    queued with them: it has GPU work to enqueue."""
    pool = HostPool(1, prefix="test-leave")
    ran_in: list[str] = []
    gate = threading.Event()
    try:
        blocker = pool.submit(gate.wait, 5)
        job = pool.submit(lambda: ran_in.append(threading.current_thread().name))
        src = np.ones(2 * MIN_PIECE_BYTES, np.uint8)
        dst = np.zeros_like(src)
        batch = pool.copy_async(dst, src, None)
        threading.Timer(0.05, gate.set).start()
        pool.help_until(batch)
        job.result(5)
        blocker.result(5)
    finally:
        gate.set()
        pool.close()
    assert ran_in == ["test-leave_0"] and dst.all()


def test_a_failing_callback_becomes_the_batch_error_and_the_pool_lives_on(pool):
    def boom(batch):
        raise RuntimeError("callback failed")

    src = np.ones(MIN_PIECE_BYTES, np.uint8)
    batch = pool.copy_async(np.zeros_like(src), src, None, on_done=boom)
    with pytest.raises(RuntimeError, match="callback failed"):
        batch.wait()
    for _ in range(3):  # both threads still answer
        assert pool.submit(lambda: 7).result(5) == 7


# --- idle pools kept for later Pipelines ---------------------------------------------------


@pytest.fixture
def no_idle_pools():
    _threads.close_idle_host_threads()
    yield
    _threads.close_idle_host_threads()


def _threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_a_pool_given_back_is_taken_again_with_its_threads(no_idle_pools):
    first = _threads.take_host_pool(3)
    threads = set(first._threads)
    _threads.give_back_host_pool(first)
    assert _threads.idle_host_pools() == 1
    again = _threads.take_host_pool(3)
    assert again is first and set(again._threads) == threads
    assert _threads.idle_host_pools() == 0
    src, dst = np.arange(1 << 20, dtype=np.uint8), np.zeros(1 << 20, np.uint8)
    again.help_until(again.copy_async(dst, src, None))  # still works
    np.testing.assert_array_equal(dst, src)
    _threads.give_back_host_pool(again)


def test_a_pool_of_another_size_is_not_taken(no_idle_pools):
    two = _threads.take_host_pool(2)
    _threads.give_back_host_pool(two)
    three = _threads.take_host_pool(3)
    assert three is not two and three.size == 3
    assert _threads.idle_host_pools() == 1
    three.close()


def test_at_most_max_idle_pools_are_kept_the_rest_are_joined(no_idle_pools):
    pools = [_threads.take_host_pool(2) for _ in range(_threads.MAX_IDLE_POOLS + 2)]
    for p in pools:
        _threads.give_back_host_pool(p)
    assert _threads.idle_host_pools() == _threads.MAX_IDLE_POOLS
    joined = pools[_threads.MAX_IDLE_POOLS :]
    assert not any(t.is_alive() for p in joined for t in p._threads)
    kept = pools[: _threads.MAX_IDLE_POOLS]
    assert all(t.is_alive() for p in kept for t in p._threads)
    assert _threads.close_idle_host_threads() == 2 * _threads.MAX_IDLE_POOLS
    assert not any(t.is_alive() for p in kept for t in p._threads)
    assert _threads.idle_host_pools() == 0


def test_a_pool_with_queued_work_or_a_dead_thread_is_closed_not_kept(no_idle_pools):
    busy = HostPool(1, prefix="test-busy")
    gate = threading.Event()
    busy.submit(gate.wait)
    busy.submit(int)  # queued behind the blocked job
    time.sleep(0.05)
    assert not busy.reusable
    gate.set()
    busy.close()
    assert not busy.reusable  # its threads are gone
    _threads.give_back_host_pool(busy)
    assert _threads.idle_host_pools() == 0


def test_a_forked_child_forgets_the_parents_idle_pools(no_idle_pools):
    _threads.give_back_host_pool(_threads.take_host_pool(2))
    assert _threads.idle_host_pools() == 1
    import os

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no parent threads, so no idle pool to hand out
        try:
            n = _threads.idle_host_pools()
            fresh = _threads.take_host_pool(2)
            ok = n == 0 and all(t.is_alive() for t in fresh._threads)
            fresh.close()
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and status == 0
    os.close(r)
    assert _threads.idle_host_pools() == 1
