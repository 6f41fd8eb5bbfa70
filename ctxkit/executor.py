"""A :class:`concurrent.futures.Executor` whose worker threads keep one context current.

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

__all__ = ["ContextExecutor"]

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
    with contextlib.suppress(Exception):
        registry.close(quiet=True)


atexit.register(_at_exit)
