"""When and where resources are freed.

Every buffer, stream, event and module registers a finalizer (:func:`finalizer`) that
frees it inside its own context, from whichever thread the garbage collector runs in,
and never raises (:func:`free_quietly`). Frees the driver refuses are kept in
:func:`failed_frees` and warned about once. While a stream capture that a free would
invalidate is open (``cuMemFree`` is an unsafe call during capture), such frees wait
and run when it ends (:func:`capture_begins` / :func:`capture_ends`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .context import Context

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["FailedFree", "failed_frees"]


class FailedFree(NamedTuple):
    """A free run by a finalizer that the driver refused (the resource is still held)."""

    function: str
    context: int
    thread: str
    error: str


_failed_frees: list[FailedFree] = []


_MAX_FAILED_FREES = 100


_warned_failed_free = False


def failed_frees() -> list[FailedFree]:
    """Frees made by finalizers (garbage collection, ``weakref.finalize``) that failed.

    A finalizer must not raise, so a driver error there would otherwise be invisible
    and the memory would stay allocated until the process ends. Oldest first, at most
    100 (the first ones are kept); the first failure also emits one ``ResourceWarning``.
    """
    return list(_failed_frees)


def free_quietly(ctx: Context, fn: Callable[..., Any], *args: Any) -> None:
    """:meth:`Context.free` for finalizers: never raises (GC must not see exceptions);
    a failure is recorded in :func:`failed_frees`. While a stream capture that such a
    free would invalidate is open, the free waits for its end (:func:`capture_begins`)."""
    if (_capturing_threads or _global_captures) and _defer_free(ctx, fn, args):
        return
    try:
        ctx.free(fn, *args)
    except Exception as exc:
        _note_failed_free(ctx, getattr(fn, "__name__", "free"), str(exc))


_capture_lock = threading.Lock()


_capturing_threads: dict[int, int] = {}


_global_captures = 0


_deferred_frees: list[tuple[Context, Callable[..., Any], tuple[Any, ...]]] = []


def capture_begins(global_mode: bool) -> None:
    """A stream capture starts in this thread (``thread_local`` or ``global`` mode)."""
    global _global_captures
    with _capture_lock:
        tid = threading.get_ident()
        _capturing_threads[tid] = _capturing_threads.get(tid, 0) + 1
        _global_captures += int(global_mode)


def capture_ends(global_mode: bool) -> None:
    """The capture started by :func:`capture_begins` in this thread ended: run the frees
    it held back that nothing forbids any more."""
    global _global_captures
    with _capture_lock:
        tid = threading.get_ident()
        depth = _capturing_threads.pop(tid, 1) - 1
        if depth:
            _capturing_threads[tid] = depth
        _global_captures -= int(global_mode)
        pending = list(_deferred_frees)
        _deferred_frees.clear()
    for ctx, fn, args in pending:
        free_quietly(ctx, fn, *args)


def _defer_free(ctx: Context, fn: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    with _capture_lock:
        if not (_global_captures or threading.get_ident() in _capturing_threads):
            return False
        _deferred_frees.append((ctx, fn, args))
        return True


def _note_failed_free(ctx: Context, name: str, error: str) -> None:
    global _warned_failed_free
    entry = FailedFree(name, ctx.handle, threading.current_thread().name, error)
    if len(_failed_frees) < _MAX_FAILED_FREES:
        _failed_frees.append(entry)
    if _warned_failed_free:
        return
    _warned_failed_free = True
    try:
        warnings.warn(
            f"ctxkit: {name} in {ctx!r} failed while a finalizer freed a resource, which "
            f"stays allocated: {error}. Later failures are listed by "
            "ctxkit.lifetime.failed_frees() without further warnings",
            ResourceWarning,
            stacklevel=2,
        )
    except Exception:
        pass


def finalizer(owner: object, ctx: Context, fn: Callable[..., Any], *args: Any) -> weakref.finalize:
    """Free ``fn(*args)`` in *ctx* when *owner* is collected or the finalizer is called."""
    fin = weakref.finalize(owner, free_quietly, ctx, fn, *args)
    fin.atexit = False
    return fin
