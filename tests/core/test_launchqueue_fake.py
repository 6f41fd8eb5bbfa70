"""ck.LaunchQueue on the fake drivers: many threads' launches issued by one thread, each
thread's in its order and with the context current; a failure raised in the thread that
submitted it; flush, close and a forked child never hang."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest

import ctxkit as ck
from ctxkit.context import Context
from tests.module.fakemodule import load, mem_fake  # noqa: F401
from tests.pipeline.test_fork_fake import in_child, outcomes
from tests.support.helpers import in_threads


def _boom() -> None:
    raise ck.CudaError("cuLaunchKernel failed", 1, "CUDA_ERROR_INVALID_VALUE")


def test_launches_of_many_threads_are_issued_in_each_threads_order(gpu):
    issued: list[tuple[int, int]] = []
    with ck.LaunchQueue(0) as q:

        def producer(t: int) -> None:
            for i in range(300):
                q.submit(functools.partial(issued.append, (t, i)))
            q.flush()  # every launch this thread submitted is issued now
            assert sum(1 for u, _ in issued if u == t) == 300

        in_threads(4, producer)
    for t in range(4):
        assert [i for u, i in issued if u == t] == list(range(300))


def test_launches_run_in_the_launching_thread_with_the_context_current(gpu):
    ctx = ck.registry.context(0)
    seen: list[tuple[Any, str]] = []
    with ck.LaunchQueue(ctx, name="my-launcher") as q:
        q.submit(lambda: seen.append((ck.current_context(), threading.current_thread().name)))
        q.flush()
        assert "open" in repr(q)
    assert seen == [(ctx, "my-launcher")]
    assert ck.current_context() is None  # the submitting thread binds nothing


def test_prepared_launches_from_threads_all_reach_the_driver(mem_fake):
    ctx = ck.registry.context(0)
    with ctx:
        kernel = load().function("vector_add")
        launch = kernel.prepare(1, 32, 1, 2, 3, 4)
    before = len(mem_fake.launches)
    with ck.LaunchQueue(ctx) as q:
        in_threads(3, lambda _: [q.submit(launch) for _ in range(50)])
    assert len(mem_fake.launches) - before == 150


def test_a_failed_launch_is_raised_in_its_thread_and_its_later_launches_dropped(gpu):
    ran: list[str] = []
    with ck.LaunchQueue(0) as q:
        q.submit(_boom)
        q.submit(lambda: ran.append("after"))  # depends on the failed one: not issued
        in_threads(1, lambda _: (q.submit(lambda: ran.append("other")), q.flush()))
        assert ran == ["other"]  # another thread's launches are issued
        with pytest.raises(ck.LaunchQueueError) as info:
            q.flush()
        err = info.value
        assert err.dropped == 1 and err.code == 1 and err.name == "CUDA_ERROR_INVALID_VALUE"
        assert isinstance(err.__cause__, ck.CudaError) and "_boom" in str(err)
        assert isinstance(err, ck.CudaError)
        q.submit(lambda: ran.append("again"))  # reported: this thread launches again
        q.flush()
    assert ran == ["other", "again"]


def test_submit_raises_a_failure_of_this_thread_that_flush_did_not_report(gpu):
    with ck.LaunchQueue(0) as q:
        q.submit(_boom)
        in_threads(1, lambda _: q.flush())  # the failure has been met
        with pytest.raises(ck.LaunchQueueError, match="CUDA_ERROR_INVALID_VALUE|failed"):
            q.submit(print)
        q.flush()  # reported once


def test_close_issues_what_is_queued_then_refuses_more(gpu):
    ran: list[int] = []
    gate = threading.Event()
    q = ck.LaunchQueue(0)
    q.submit(gate.wait)  # keeps the launching thread busy
    for i in range(5):
        q.submit(functools.partial(ran.append, i))
    threading.Timer(0.05, gate.set).start()
    q.close()
    assert ran == [0, 1, 2, 3, 4] and not q._thread.is_alive()
    assert "closed" in repr(q)
    with pytest.raises(RuntimeError, match="closed"):
        q.submit(print)
    q.close()  # idempotent
    q.flush()  # nothing queued: returns


def test_close_raises_a_failure_of_this_thread(gpu):
    q = ck.LaunchQueue(0)
    q.submit(_boom)
    with pytest.raises(ck.LaunchQueueError):
        q.close()
    assert not q._thread.is_alive()


def test_flush_times_out_with_a_clear_error(gpu):
    gate = threading.Event()
    with ck.LaunchQueue(0) as q:
        q.submit(gate.wait)
        with pytest.raises(TimeoutError, match="still queued after 0.05 s"):
            q.flush(timeout=0.05)
        gate.set()
        q.flush()


def test_flush_from_a_launch_it_runs_is_refused_not_a_hang(gpu):
    with ck.LaunchQueue(0) as q:
        q.submit(q.flush)
        with pytest.raises(ck.LaunchQueueError, match="wait for itself"):
            q.flush()


def test_a_context_that_cannot_be_made_current_is_refused_at_creation(gpu, monkeypatch):
    closed = ck.Context.create(0)
    closed.close()
    with pytest.raises(ck.ContextClosedError):
        ck.LaunchQueue(closed)

    def refuse(self: Context) -> None:
        raise ck.ContextPoisonedError("poisoned by an earlier fault")

    monkeypatch.setattr(Context, "push", refuse)
    before = threading.active_count()
    with pytest.raises(ck.ContextPoisonedError):
        ck.LaunchQueue(0)
    assert threading.active_count() == before  # no launching thread left behind


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_a_forked_child_gets_fork_error_instead_of_a_hang(gpu):
    q = ck.LaunchQueue(0)
    try:
        q.submit(print)
        q.flush()
        got = in_child(
            lambda: outcomes(
                {"submit": lambda: q.submit(print), "flush": q.flush, "close": q.close}
            )
        )
    finally:
        q.close()
    assert got == "submit=ForkError flush=ForkError close=returned", got
