"""One shared context per device, usable from any thread.

The classic Driver-API bug: a context created in the main thread is used from a worker
thread, and the driver answers ``CUDA_ERROR_INVALID_CONTEXT`` because the current
context is per thread. ctxkit's answer:

* :data:`registry` hands out one context per device (primary by default);
* :func:`bind` / :func:`bound` make it current in whatever thread runs the code;
* :class:`ContextExecutor` runs every task with the context current;
* a thread with no context gets :class:`NoCurrentContextError` naming the fix, before
  the driver would answer ``INVALID_CONTEXT``.
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

from . import context as _context
from .context import Context, current_handle, entry_context, thread_bindings, thread_state
from .device import Device
from .errors import NoCurrentContextError

__all__ = [
    "ContextExecutor",
    "ContextRegistry",
    "bind",
    "bound",
    "guard",
    "no_context_error",
    "registry",
]

P = ParamSpec("P")
R = TypeVar("R")
CtxLike = Context | Device | int


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


class ContextRegistry:
    """One shared context per device, created on first use (thread-safe).

    Parameters
    ----------
    kind : {"primary", "owned"}
        ``"primary"`` (default) shares the device's primary context with PyTorch, CuPy
        and Numba; ``"owned"`` creates a private context per device with ``flags``.
    flags : int
        ``CUctx_flags`` for owned contexts.
    auto_bind : bool, optional
        When true, an operation on a ctxkit object in a thread with *no* current context
        binds the object's context for that operation instead of raising
        :class:`NoCurrentContextError`. Default: the ``CTXKIT_AUTO_BIND`` environment
        variable (off). Off by default because silently binding hides the per-thread
        nature of contexts, which is exactly what breaks code that mixes raw calls in.
    """

    def __init__(self, kind: str = "primary", flags: int = 0, auto_bind: bool | None = None):
        if kind not in ("primary", "owned"):
            raise ValueError(f"kind must be 'primary' or 'owned', not {kind!r}")
        self.kind = kind
        self.flags = flags
        self.auto_bind = _env_flag("CTXKIT_AUTO_BIND") if auto_bind is None else auto_bind
        self._contexts: dict[int, Context] = {}
        self._created: list[Context] = []
        self._lock = threading.Lock()

    def context(self, device: CtxLike = 0) -> Context:
        """The shared context of *device* (created once; later calls take no lock)."""
        if isinstance(device, Context):
            return device
        ordinal = device if type(device) is int else Device(device).ordinal
        ctx = self._contexts.get(ordinal)
        if ctx is not None and not ctx.closed:
            return ctx
        return self._create(ordinal)

    def _create(self, ordinal: int) -> Context:
        dev = Device(ordinal)
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None or ctx.closed:
                if self.kind == "primary":
                    ctx = Context.primary(dev)
                else:
                    ctx = Context.create(dev, flags=self.flags)
                self._contexts[ordinal] = ctx
                self._created.append(ctx)
        return ctx

    def set(self, device: Device | int, ctx: Context) -> None:
        """Register a context the caller made as the shared one for *device*.

        The registry never closes a context registered this way.
        """
        dev = Device(device)
        if not isinstance(ctx, Context):
            raise TypeError(f"expected a ctxkit.Context, got {type(ctx).__name__}")
        if ctx.device.ordinal != dev.ordinal:
            raise ValueError(
                f"{ctx!r} belongs to device {ctx.device.ordinal}, not device {dev.ordinal}"
            )
        ctx.check_usable()
        with self._lock:
            self._contexts[dev.ordinal] = ctx

    def resolve(self, target: CtxLike) -> Context:
        """A Context for a Context, Device or ordinal."""
        if isinstance(target, Context):
            return target
        if isinstance(target, (Device, int)) and not isinstance(target, bool):
            return self.context(target)
        raise TypeError(
            f"expected a ctxkit.Context, ctxkit.Device or device ordinal, "
            f"got {type(target).__name__}"
        )

    def contexts(self) -> dict[int, Context]:
        """The registered contexts by device ordinal (open ones only)."""
        return {k: c for k, c in self._contexts.items() if not c.closed}

    def bindings(self) -> dict[str, list[Context]]:
        """Which threads have which contexts bound by ctxkit right now."""
        return thread_bindings()

    def close(self) -> None:
        """Close what this registry created, newest first. Safe to call twice."""
        with self._lock:
            created, self._created = self._created, []
            self._contexts = {k: c for k, c in self._contexts.items() if c not in created}
        for ctx in reversed(created):
            ctx.close()


#: The process-wide registry (primary contexts).
registry = ContextRegistry()


def bind(target: CtxLike) -> Context:
    """Make a context current in the calling thread for a ``with`` block.

    ``with ctxkit.bind(0): ...`` binds the registry's context for device 0; a Context
    binds itself. Already current -> no driver call. Nestable, exception-safe; the
    previous context is restored on exit.
    """
    if isinstance(target, Context):
        return target
    return registry.resolve(target)


def bound(target: CtxLike) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run the function with *target*'s context bound (resolved per call)."""

    def deco(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with bind(target):
                return fn(*args, **kwargs)

        return wrapper

    return deco


def no_context_error(what: str) -> NoCurrentContextError:
    """The error for an operation that needs a context in a thread that has none."""
    t = threading.current_thread()
    known = registry.contexts()
    listing = ", ".join(f"device {k}: {c!r}" for k, c in sorted(known.items())) or "none yet"
    return NoCurrentContextError(
        f"{what} needs a current CUDA context, but thread {t.name!r} (ident {t.ident}) "
        f"has none (the driver would answer CUDA_ERROR_INVALID_CONTEXT: contexts are "
        f"current per thread). Contexts ctxkit knows: {listing}. Fix: wrap the work in "
        "`with ctxkit.bind(device_or_ctx):`, decorate the function with "
        "`@ctxkit.bound(device)`, or run it on a `ctxkit.ContextExecutor`.",
        201,
        "CUDA_ERROR_INVALID_CONTEXT",
    )


def guard(owner: Context, what: str) -> Context:
    """The context to bind for an operation on an object owned by *owner*.

    Returns *owner* (use it as ``with guard(owner, "..."):``). A thread with no current
    context at all gets :class:`NoCurrentContextError` unless the registry's
    ``auto_bind`` is on; a thread with another context current binds *owner* for the
    operation, so objects always act in their own context.
    """
    if thread_state().top is not None or registry.auto_bind:
        return owner
    if current_handle():
        return owner
    raise no_context_error(what)


# --- executor -------------------------------------------------------------------------

_blas_lock = threading.Lock()
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


class _WorkItem:
    __slots__ = ("args", "fn", "future", "kwargs")

    def __init__(self, future: Future[Any], fn: Callable[..., Any], args: Any, kwargs: Any):
        self.future = future
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


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
        target: CtxLike,
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
        self._queue: queue.SimpleQueue[_WorkItem | None] = queue.SimpleQueue()
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
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to a ContextExecutor after shutdown()")
            future: Future[R] = Future()
            self._queue.put(_WorkItem(future, fn, args, kwargs))
            self._maybe_start_worker()
        return future

    def _maybe_start_worker(self) -> None:
        if self._idle.acquire(blocking=False):
            return
        if len(self._threads) < self.max_workers:
            t = threading.Thread(
                target=self._worker,
                name=f"{self._prefix}-{len(self._threads)}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def _worker(self) -> None:
        ctx = self.context
        try:
            ctx.push()
        except BaseException as exc:
            self._drain_with(exc)
            return
        st = thread_state()
        depth = len(st.stack)
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    break
                item.run()
                del item
                if len(st.stack) != depth or st.top is not ctx:
                    self._repair(st, depth)
                self._idle.release()
        finally:
            self._repair(st, depth)
            ctx.pop()

    @staticmethod
    def _repair(st: Any, depth: int) -> None:
        """A task left contexts pushed: pop them so the next task starts clean."""
        while len(st.stack) > depth:
            entry_context(st.stack[-1]).pop()

    def _drain_with(self, exc: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._queue.put(None)
                return
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; workers finish queued tasks, pop the context and exit."""
        with self._lock:
            if self._shutdown and not self._threads:
                return
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item.future.cancel()
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
    _context.begin_shutdown()
    if any(t.is_alive() for ex in list(_live_executors) for t in list(ex._threads)):
        return
    with registry._lock:
        created, registry._created = registry._created, []
    for ctx in reversed(created):
        try:
            ctx.close()
        except Exception:
            pass


atexit.register(_at_exit)
