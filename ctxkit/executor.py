"""Threads that keep one context current: a :class:`concurrent.futures.Executor`, and a
:class:`LaunchQueue` that issues the launches many threads hand it.

Each worker binds the context once for its whole life, so tasks never pay a push/pop
and never meet ``CUDA_ERROR_INVALID_CONTEXT``. ``blas_threads`` caps the BLAS thread
pools (threadpoolctl) while the executor runs, so N workers doing host math do not
oversubscribe the cores. At interpreter exit the registry's contexts are released once
no ctxkit worker is alive (:func:`_at_exit`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from . import _driver
from .binding import ContextLike, registry
from .context import begin_shutdown, entry_context, thread_state
from .errors import LaunchQueueError

__all__ = ["ContextExecutor", "LaunchQueue"]

R = TypeVar("R")


_blas_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_blas_lock")


_blas_users = 0


_blas_limiter: Any = None


def _blas_acquire(limit: int) -> None:
    global _blas_users, _blas_limiter
    with _blas_lock:
        if _blas_users == 0:
            from threadpoolctl import threadpool_limits

            _blas_limiter = threadpool_limits(limits=limit, user_api="blas")
        _blas_users += 1


def _blas_release() -> None:
    global _blas_users, _blas_limiter
    with _blas_lock:
        _blas_users -= 1
        if _blas_users == 0 and _blas_limiter is not None:
            _blas_limiter.restore_original_limits()
            _blas_limiter = None


#: A queued task: its future, the function and its arguments (``None``: a worker stops).
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _run(future: Future[Any], fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


class ContextExecutor(Executor):
    """A thread pool whose workers always run with one context current.

    Each worker binds the context once when it starts and pops it when it exits, so a
    task pays nothing for the binding; tasks may nest other binds freely.

    Parameters
    ----------
    target : Context, Device or int
        The context (or the registry's context of that device).
    max_workers : int
        Number of worker threads (default: ``min(32, os.cpu_count() + 4)``).
    blas_threads : int, "auto" or None
        Limit BLAS (OpenBLAS/MKL) to this many threads while the executor is alive, so
        N workers doing numpy linear algebra do not start N x cores threads. ``"auto"``
        means ``max(1, cpu_count // max_workers)``. Default ``None`` leaves BLAS alone:
        the limit is process-wide (OpenBLAS has one thread count per process), so
        changing it must be the caller's explicit choice.
    thread_name_prefix : str
        Prefix of the worker thread names.
    """

    def __init__(
        self,
        target: ContextLike,
        max_workers: int | None = None,
        blas_threads: int | str | None = None,
        thread_name_prefix: str = "ctxkit-worker",
    ) -> None:
        self.context = registry.resolve(target)
        self.context.check_usable()
        if max_workers is None:
            max_workers = min(32, (os.cpu_count() or 1) + 4)
        if max_workers <= 0:
            raise ValueError("max_workers must be at least 1")
        if blas_threads == "auto":
            blas_threads = max(1, (os.cpu_count() or 1) // max_workers)
        if blas_threads is not None and (not isinstance(blas_threads, int) or blas_threads < 1):
            raise ValueError(
                f"blas_threads must be a positive int, 'auto' or None, not {blas_threads!r}"
            )
        self.max_workers = max_workers
        self.blas_threads = blas_threads
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shutdown = False
        self._idle = threading.Semaphore(0)
        if blas_threads is not None:
            _blas_acquire(blas_threads)
        self._blas_held = blas_threads is not None
        _live_executors.add(self)

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        """Schedule ``fn(*args, **kwargs)`` on a worker with the context current."""
        _driver.check_fork("ContextExecutor.submit")
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to a ContextExecutor after shutdown()")
            future: Future[R] = Future()
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self.max_workers:
                name = f"{self._prefix}-{len(self._threads)}"  # no idle worker: one more
                t = threading.Thread(target=self._worker, name=name, daemon=True)
                t.start()
                self._threads.append(t)
        return future

    def _worker(self) -> None:
        ctx = self.context
        try:
            ctx.push()
        except BaseException as exc:
            self._drain(exc)
            return
        st = thread_state()
        depth = len(st.stack)
        try:
            while (item := self._queue.get()) is not None:
                _run(*item)
                del item
                while len(st.stack) > depth:  # a task left contexts pushed: the next starts clean
                    entry_context(st.stack[-1]).pop()
                self._idle.release()
        finally:
            while len(st.stack) > depth:
                entry_context(st.stack[-1]).pop()
            ctx.pop()

    def _drain(self, exc: BaseException | None) -> None:
        """Take the queued tasks (up to a worker's stop) off the queue: fail them with
        *exc*, or cancel them (``None``)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._queue.put(None)
                return
            future = item[0]
            if exc is None:
                future.cancel()
            elif future.set_running_or_notify_cancel():
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; workers finish queued tasks, pop the context and exit.
        In a forked child it returns at once (the workers are the parent's)."""
        if _driver.in_forked_child():
            return
        with self._lock:
            if self._shutdown and not self._threads:
                return
            self._shutdown = True
            if cancel_futures:
                self._drain(None)
            threads = list(self._threads)
            for _ in threads:
                self._queue.put(None)
        if wait:
            for t in threads:
                t.join()
            with self._lock:
                self._threads = []
        if self._blas_held:
            self._blas_held = False
            _blas_release()

    def __repr__(self) -> str:
        return f"<ContextExecutor {self.context!r} workers={self.max_workers}>"


_live_executors: weakref.WeakSet[ContextExecutor] = weakref.WeakSet()


class _Channel:
    """One submitting thread's side of a :class:`LaunchQueue`: the first error of its
    launches (``None``: none), what failed, and how many of its later launches were
    dropped since."""

    __slots__ = ("dropped", "error", "failed")

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.failed = ""
        self.dropped = 0


#: A queued launch and its submitter's channel; a flush marker is ``(event, None)``.
_Item = tuple[Any, "_Channel | None"]


class LaunchQueue:
    """One thread that issues the launches many threads hand it.

    Every driver call releases the GIL, and threads that each launch for themselves queue
    for it again after every call, so their combined rate falls as threads are added (on
    an H200 8 raw cuda.bindings threads launch at about half the rate of one). Threads
    that :meth:`submit` their launches here only append to a queue; its one thread, with
    the context current, issues them, so the rate stays near one thread's. It pays from
    about 4 threads; with 1 or 2 the hand-over costs more than it saves.

    What the caller sees differently from launching itself:

    * ``submit`` returns before the launch is issued. Launches are issued in submission
      order (each thread's in its own order); work the thread enqueues on the same
      stream itself (a copy, a direct launch) comes after its submitted launches only
      once :meth:`flush` returned.
    * An error of a launch is raised in the thread that submitted it, at its next
      ``submit``, ``flush`` or ``close``, as :class:`~ctxkit.errors.LaunchQueueError`;
      that thread's later launches are not issued until then (other threads' are).

    Parameters
    ----------
    target : Context, Device or int
        The context (or the registry's context of that device) the launches run in.
    name : str
        The launching thread's name.

    Examples
    --------
    >>> with ck.LaunchQueue(0) as q:                       # doctest: +SKIP
    ...     launch = kernel.prepare(grid, block, x, n, stream=s)
    ...     for _ in range(1000):
    ...         q.submit(launch)                        # from any number of threads
    ...     q.flush()                                   # issued; now s.synchronize()
    """

    def __init__(self, target: ContextLike, *, name: str = "ctxkit-launcher") -> None:
        self.context = registry.resolve(target)
        self.context.check_usable()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._put = self._queue.put
        self._local = threading.local()
        self._open = True
        self._start_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._issue, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()
        if self._start_error is not None:
            self._open = False
            self._thread.join()  # it has nothing left to do: gone before the error is seen
            raise self._start_error
        _live_queues.add(self)

    def submit(self, launch: Callable[[], object]) -> None:
        """Hand *launch* -- a :class:`~ctxkit.PreparedLaunch`, or any callable without
        arguments -- to the launching thread, which calls it with the context current.

        Raises
        ------
        LaunchQueueError
            An earlier launch of this thread failed (nothing of this thread was issued
            after it, and *launch* is not submitted either; submit it again to go on).
        RuntimeError
            The queue is closed.
        ForkError
            In a forked child (the launching thread is the parent's).
        """
        try:
            ch = self._local.ch
        except AttributeError:
            ch = self._local.ch = _Channel()
        if ch.error is not None or not self._open:
            self._refuse(ch, "submit")
        self._put((launch, ch))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every launch submitted before this call, from any thread, has been
        issued to the driver (not run: synchronize the stream for that).

        Raises
        ------
        LaunchQueueError
            A launch this thread submitted failed.
        TimeoutError
            Launches were still queued after *timeout* seconds.
        RuntimeError
            Called from a launch the queue is running (it would wait for itself).
        """
        ch = self._channel()
        if self._open:
            if threading.current_thread() is self._thread:
                raise RuntimeError("LaunchQueue.flush from a launch it runs would wait for itself")
            done = threading.Event()
            self._put((done, None))
            if not done.wait(timeout):
                raise TimeoutError(f"LaunchQueue.flush: launches still queued after {timeout} s")
        elif _driver.in_forked_child():
            self._refuse(ch, "flush")
        if ch.error is not None:
            self._raise(ch)

    def close(self) -> None:
        """Issue what is queued, stop the launching thread (it pops the context);
        idempotent. A launch of this thread that failed is raised as by :meth:`flush`."""
        if self._open and not _driver.in_forked_child():
            self._open = False
            self._put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()
                self._refuse_late()
        self._open = False
        ch = self._channel()
        if ch.error is not None:
            self._raise(ch)

    def __enter__(self) -> LaunchQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"<LaunchQueue {state} {self.context!r}>"

    def _channel(self) -> _Channel:
        ch: _Channel | None = getattr(self._local, "ch", None)
        if ch is None:
            ch = self._local.ch = _Channel()
        return ch

    def _issue(self, ready: threading.Event) -> None:
        """The launching thread: bind the context (a failure is ``_start_error``), say
        so through *ready*, then run each queued launch."""
        try:
            self.context.push()
        except BaseException as exc:
            self._start_error = exc
            return
        finally:
            ready.set()
        try:
            self._run_queued()
        finally:
            self.context.pop()

    def _run_queued(self) -> None:
        get = self._queue.get
        while (item := get()) is not None:
            fn, ch = item
            if ch is None:
                fn.set()  # a flush marker
            elif ch.error is not None:
                ch.dropped += 1
            else:
                try:
                    fn()
                except BaseException as exc:
                    ch.error, ch.failed = exc, repr(fn)
            del item, fn

    def _refuse_late(self) -> None:
        """After the thread stopped: fail what other threads submitted while it stopped."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1] is not None and item[1].error is None:
                item[1].error = RuntimeError("the LaunchQueue closed before it was issued")
                item[1].failed = repr(item[0])

    def _refuse(self, ch: _Channel, what: str) -> None:
        _driver.check_fork(f"LaunchQueue.{what}")
        if ch.error is not None:
            self._raise(ch)
        raise RuntimeError(f"LaunchQueue.{what}: the queue is closed")

    def _raise(self, ch: _Channel) -> None:
        """Raise the failure *ch* holds (it has one) and clear it: the thread goes on."""
        exc, dropped = ch.error, ch.dropped
        ch.error, ch.dropped = None, 0
        if exc is None:
            return
        raise LaunchQueueError(
            f"{ch.failed}, submitted to {self!r} from this thread, failed: "
            f"{type(exc).__name__}: {exc}; {dropped} later launch(es) of this thread were "
            "not issued",
            exc,
            dropped,
        )


_live_queues: weakref.WeakSet[LaunchQueue] = weakref.WeakSet()


def _forget_queues() -> None:
    """In a forked child: every queue's launching thread is the parent's."""
    for q in list(_live_queues):
        q._open = False


_driver.on_fork_in_child(_forget_queues)


def _at_exit() -> None:
    """Interpreter exit: stop freeing, and release the registry's contexts when that is safe.

    Executor workers are daemon threads: a task still running at exit (a busy pipeline, a
    blocked request) must neither hang the exit nor see its executor shut down under it,
    so ctxkit does not join them; call ``shutdown()`` to wait for queued work. Contexts are
    released only when no ctxkit worker is alive and they are current nowhere; otherwise the
    process teardown releases them. Nothing here may raise or print.
    """
    begin_shutdown()
    if _driver.in_forked_child():
        return  # the contexts are the parent's
    if any(t.is_alive() for ex in list(_live_executors) for t in list(ex._threads)):
        return
    if any(q._thread.is_alive() for q in list(_live_queues)):
        return
    with contextlib.suppress(Exception):
        registry.close(quiet=True)


atexit.register(_at_exit)
