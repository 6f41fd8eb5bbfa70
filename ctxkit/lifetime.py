"""When and where resources are freed.

Every buffer, stream, event and module registers a finalizer (:func:`finalizer`) that
frees it inside its own context, from whichever thread the garbage collector runs in,
and never raises (:func:`free_quietly`). Frees the driver refuses are kept in
:func:`failed_frees` and warned about once.

While a stream capture is open, a free is a call the driver forbids (``cuMemFree``,
``cuMemFreeHost``, ``cuMemHostUnregister``, ``cuModuleUnload``, ``cuLibraryUnload``,
stream/event/graph destruction: they synchronize or change what the captured work may
use) and a forbidden call invalidates the capture. The driver forbids them in the
capturing thread (``thread_local`` and ``global`` mode) and, during a ``global`` capture,
in every other thread too. So every free ctxkit makes -- by a finalizer, by ``close()``,
through :meth:`Context.free <ctxkit.context.Context.free>` -- asks :func:`begin_free`
first: a free the open captures forbid is held back and runs when they end
(:func:`held_back_frees` counts them). A capture is marked open *before*
``cuStreamBeginCapture`` (:func:`capture_begins`), and a ``global`` one first waits for
the frees other threads have already started, so no free slips in between.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn, Protocol

from . import _driver

__all__ = ["FailedFree", "failed_frees", "held_back_frees"]


class _Context(Protocol):
    """What a free needs of its context (:class:`ctxkit.context.Context`, which imports
    this module: the frees are its and its resources')."""

    handle: int

    def free(self, fn: Callable[..., Any], *args: Any) -> None: ...


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


# --- the capture hold-back -----------------------------------------------------------

# A re-entrant lock: the garbage collector can run a finalizer (and so free_quietly) at
# any allocation, also in a thread that holds the lock already.
_capture_cond = threading.Condition(threading.RLock())
_driver.renew_at_fork(__name__, "_capture_cond", lambda: threading.Condition(threading.RLock()))


capturing_threads: dict[int, int] = {}  # thread ident -> open thread_local/global captures


_global_captures = 0


_frees_running: dict[int, int] = {}  # thread ident -> frees started and not finished


_held_back: list[tuple[_Context | None, Callable[..., Any], tuple[Any, ...]]] = []


def held_back_frees() -> int:
    """How many frees wait for an open stream capture to end (they run when it does)."""
    with _capture_cond:
        return len(_held_back)


def begin_free(ctx: _Context | None, fn: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """Ask before a free: ``True`` -- make it now, then call :func:`end_free`; ``False``
    -- an open capture forbids it in this thread, so it was held back and runs (through
    :func:`free_quietly`) when the capture ends."""
    tid = threading.get_ident()
    with _capture_cond:
        if _global_captures or tid in capturing_threads:
            _held_back.append((ctx, fn, args))
            return False
        _frees_running[tid] = _frees_running.get(tid, 0) + 1
        return True


def end_free() -> None:
    """The free allowed by :func:`begin_free` in this thread is done."""
    tid = threading.get_ident()
    with _capture_cond:
        left = _frees_running.pop(tid, 1) - 1
        if left:
            _frees_running[tid] = left
        else:
            _capture_cond.notify_all()


#: stream handle -> open ctxkit captures on it, in every mode (``relaxed`` included)
captured_streams: dict[int, int] = {}


def stream_capture_begins(handle: int) -> None:
    """ctxkit begins capturing the stream *handle* (any mode): memory handed out for use
    on it must come from the driver now (a graph keeps the address)."""
    with _capture_cond:
        captured_streams[handle] = captured_streams.get(handle, 0) + 1


def stream_capture_ends(handle: int) -> None:
    """The capture of :func:`stream_capture_begins` on *handle* ended."""
    with _capture_cond:
        depth = captured_streams.pop(handle, 1) - 1
        if depth:
            captured_streams[handle] = depth


def capture_begins(global_mode: bool) -> None:
    """A ``thread_local`` or ``global`` stream capture is about to begin in this thread.

    Call it *before* ``cuStreamBeginCapture`` (and :func:`capture_ends` if that fails):
    from now on this thread's frees -- and in ``global`` mode every thread's -- are held
    back. In ``global`` mode it first waits for frees other threads have started.
    """
    global _global_captures
    tid = threading.get_ident()
    with _capture_cond:
        capturing_threads[tid] = capturing_threads.get(tid, 0) + 1
        if global_mode:
            _global_captures += 1
            _capture_cond.wait_for(lambda: all(t == tid for t in _frees_running))


def capture_ends(global_mode: bool) -> None:
    """The capture of :func:`capture_begins` in this thread ended: run the frees it held
    back that no capture still open forbids."""
    global _global_captures
    tid = threading.get_ident()
    with _capture_cond:
        depth = capturing_threads.pop(tid, 1) - 1
        if depth:
            capturing_threads[tid] = depth
        _global_captures -= int(global_mode)
        pending = list(_held_back)
        _held_back.clear()
    for ctx, fn, args in pending:
        free_quietly(ctx, fn, *args)


# --- frees that never raise ----------------------------------------------------------


def free_quietly(ctx: _Context | None, fn: Callable[..., Any], *args: Any) -> None:
    """:meth:`Context.free <ctxkit.context.Context.free>` for finalizers: never raises (GC
    must not see exceptions); a failure is recorded in :func:`failed_frees`. A free an
    open capture forbids waits for its end (:func:`begin_free`). ``ctx=None``: a free
    that needs no context (``cuLibraryUnload``). In a forked child it does nothing: the
    memory is the parent's."""
    if _driver.in_forked_child() or not begin_free(ctx, fn, args):
        return
    try:
        if ctx is None:
            check_free(fn(*args), fn)
        else:
            ctx.free(fn, *args)
    except Exception as exc:
        _note_failed_free(ctx, getattr(fn, "__name__", "free"), str(exc))
    finally:
        end_free()


def check_free(res: Any, fn: Callable[..., Any]) -> None:
    """Raise the ctxkit exception for a failed free: *res* is what the driver's *fn* returned."""
    err = res[0] if isinstance(res, tuple) else res
    if err:
        raise _driver.from_result(int(err), getattr(fn, "__name__", "free"))


def _note_failed_free(ctx: _Context | None, name: str, error: str) -> None:
    global _warned_failed_free
    handle = 0 if ctx is None else ctx.handle
    entry = FailedFree(name, handle, threading.current_thread().name, error)
    if len(_failed_frees) < _MAX_FAILED_FREES:
        _failed_frees.append(entry)
    if _warned_failed_free:
        return
    _warned_failed_free = True
    where = "" if ctx is None else f" in {ctx!r}"
    with contextlib.suppress(Exception):  # a warnings filter may raise: a finalizer must not
        warnings.warn(
            f"ctxkit: {name}{where} failed while a finalizer freed a resource, which "
            f"stays allocated: {error}. Later failures are listed by "
            "ctxkit.lifetime.failed_frees() without further warnings",
            ResourceWarning,
            stacklevel=2,
        )


def finalizer(
    owner: object, ctx: _Context | None, fn: Callable[..., Any], *args: Any
) -> weakref.finalize:
    """Free ``fn(*args)`` in *ctx* (``None``: no context needed) when *owner* is
    collected or the finalizer is called."""
    fin = weakref.finalize(owner, free_quietly, ctx, fn, *args)
    fin.atexit = False
    return fin


def process_local(fix: str) -> Callable[[Any], NoReturn]:
    """A ``__reduce__`` for a class whose objects own driver handles: pickling or copying
    one (``pickle``, ``copy.copy``, ``copy.deepcopy``, ``multiprocessing``) raises a
    ``TypeError`` that says *fix* (how to get one in the other process). A handle is valid
    only in the process that made it, and a copy would own it a second time."""

    def __reduce__(self: Any) -> NoReturn:
        how = "pickled" if hasattr(self, "__deepcopy__") else "pickled or copied"
        raise TypeError(
            f"a ctxkit {type(self).__name__} cannot be {how}: it owns CUDA "
            f"driver handles that are valid only in this process; {fix}"
        )

    return __reduce__


# --- before a context is closed ------------------------------------------------------

_context_close_hooks: list[Callable[[Any], None]] = []


def on_context_close(fn: Callable[[Any], None]) -> None:
    """Call ``fn(ctx)`` when a context is about to be closed (while it still exists), e.g.
    to free memory a cache holds in it."""
    _context_close_hooks.append(fn)


def context_closing(ctx: _Context) -> None:
    """Run the :func:`on_context_close` hooks for *ctx*; never raises (a failure is
    recorded in :func:`failed_frees`)."""
    for fn in list(_context_close_hooks):
        try:
            fn(ctx)
        except Exception as exc:
            _note_failed_free(ctx, getattr(fn, "__name__", "hook"), str(exc))
