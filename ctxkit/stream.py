"""CUDA streams and events (``CUstream``, ``CUevent``).

Every stream and event is created *in its own context* (the context passed in, or the
caller's current one), remembers it in ``.context``, and is destroyed inside it from
whatever thread drops the last reference. Streams of other libraries (CuPy, PyTorch,
anything with ``__cuda_stream__``) are accepted wherever a stream is, and can be wrapped
without being owned (:meth:`Stream.from_handle`).

Here: :class:`Stream`, :class:`Event`, the current stream per thread, the one stream
resolver of a call (:func:`call_stream`), and the handles and contexts of streams ctxkit did not
create.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _driver, lifetime
from ._driver import call, drv
from .binding import ContextLike, guard, resolve_context
from .context import Context, context_of_cu, require_current
from .device import Device
from .errors import ContextClosedError, WrongContextError
from .lifetime import finalizer

__all__ = ["Event", "Stream", "current_stream", "stream_handle"]

log = logging.getLogger("ctxkit.stream")

STREAM_NON_BLOCKING = 1
EVENT_BLOCKING_SYNC = 1
EVENT_DISABLE_TIMING = 2
_NOT_READY = 600


def stream_handle(obj: Any) -> Any:
    """A ``CUstream`` for *obj*, for passing to driver calls.

    Accepts ``None`` (the current context's legacy default stream, handle 0), a
    :class:`Stream`, a ``CUstream``, an int handle, an object with ``__cuda_stream__``
    (returns ``(version, handle)``), a CuPy stream (``.ptr``) or a PyTorch stream
    (``.cuda_stream``).

    Raises
    ------
    TypeError
        *obj* is none of these.
    """
    return _NULL_STREAM if obj is None else _handle_of(obj, "using the stream")


def call_stream(stream: Any, ctx: Context, what: str) -> tuple[Any, Any, bool]:
    """``(stream, handle, implicit)``: what an operation in *ctx* given *stream* runs on.

    The one stream resolver of a call, asked once at its entry point. ``stream=None`` means
    the calling thread's current stream of *ctx* (:func:`current_stream`): then *stream* is
    that :class:`Stream` and *implicit* is True (a ``stream=None`` operation has completed
    when it returns, so the caller waits for it), or, with no current stream, ``None`` and
    the legacy default stream's handle -- in a green context its own default stream
    instead (:func:`green_default`), as an implicit one. A given stream comes back as it
    is, with its driver handle (:func:`stream_handle`); a ctxkit stream (or any stream object with a
    ``context``) of another context is refused with
    :class:`~ctxkit.errors.WrongContextError` instead of reaching the driver.
    """
    if stream is None:
        cur = _current.by_context.get(ctx.handle) if _current.by_context else None
        if cur is None:
            if ctx.cu_green is None:
                return None, _NULL_STREAM, False
            cur = green_default(ctx)
        return cur, cur.open_handle(what), True
    sc = getattr(stream, "context", None)
    if isinstance(sc, Context) and sc.handle != ctx.handle:
        raise WrongContextError(
            f"{what}: stream {stream!r} belongs to {sc!r}, but the operation runs in {ctx!r}; "
            "use a stream of that context, or run it inside `with stream.context:`"
        )
    return stream, _handle_of(stream, what), False


def _handle_of(stream: Any, what: str) -> Any:
    if isinstance(stream, Stream):
        return stream.open_handle(what)
    return drv.CUstream(_foreign_stream_int(stream))


# --- streams and contexts made elsewhere ----------------------------------------------
def _foreign_stream_int(obj: Any) -> int:
    if isinstance(obj, bool):
        raise TypeError("a stream cannot be a bool")
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if drv is not None and isinstance(obj, drv.CUstream):
        return int(obj)
    proto = getattr(obj, "__cuda_stream__", None)
    if proto is not None:
        _version, handle = proto() if callable(proto) else proto
        return int(handle)
    for attr in ("ptr", "cuda_stream"):
        value = getattr(obj, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise TypeError(
        f"expected a stream (ctxkit.Stream, CUstream, int handle, an object with "
        f"__cuda_stream__, a CuPy or PyTorch stream) or None, got {type(obj).__name__}"
    )


class _CurrentStreams(threading.local):
    """This thread's current stream per context (``with stream:``), and what to restore."""

    def __init__(self) -> None:
        self.by_context: dict[int, Stream] = {}
        self.saved: list[tuple[int, Stream | None]] = []


_current = _CurrentStreams()


def implicit_stream(ctx: Context) -> Stream | None:
    """The stream ``stream=None`` means in this thread for *ctx*; ``None``: the legacy
    default stream (no ``with stream:`` of that context is open)."""
    by_context = _current.by_context
    return by_context.get(ctx.handle) if by_context else None


def current_stream(context: ContextLike | None = None) -> Stream:
    """The stream that ``stream=None`` means in the calling thread.

    ``with stream:`` makes a stream current for its context in this thread (nestable,
    restored on exit, invisible to other threads); every ctxkit operation given
    ``stream=None`` (launches, copies, memsets, stream-ordered allocations, pipeline
    bodies) then runs on it. Without one, it is the legacy default stream (handle 0),
    as in the CUDA Driver API; in a green context, the context's own default stream
    (:func:`green_default`).

    Parameters
    ----------
    context : Context, Device, int or None
        Whose current stream; ``None``: the calling thread's current context.
    """
    ctx = resolve_context(context, "current_stream()")
    if ctx.cu_green is not None:
        return implicit_stream(ctx) or green_default(ctx)
    return implicit_stream(ctx) or Stream.from_handle(0, ctx)


_green_defaults: dict[int, Stream] = {}
_green_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_green_lock")


def green_default(ctx: Context) -> Stream:
    """The stream ``stream=None`` means in the green context *ctx* when no ``with
    stream:`` of it is open: one per context, made at first use (``cuGreenCtxStreamCreate``)
    and destroyed when the context closes.

    The legacy default stream (handle 0) of a green context runs its work on every SM of
    the device, outside the partition, and does not order with the context's
    (non-blocking) streams: ctxkit never uses it there.
    """
    s = _green_defaults.get(ctx.handle)
    if s is None or s.closed or s.context is not ctx:
        with _green_lock:
            s = _green_defaults.get(ctx.handle)
            if s is None or s.closed or s.context is not ctx:
                s = _green_defaults[ctx.handle] = Stream(ctx)
    return s


def _drop_green_default(ctx: Any) -> None:
    s = _green_defaults.pop(ctx.handle, None)
    if s is not None:
        s.close()


lifetime.on_context_close(_drop_green_default)


_NULL_STREAM: Any = drv.CUstream(0) if drv is not None else None


# --- host callbacks -------------------------------------------------------------------

_pending: dict[int, tuple[Callable[[], Any], weakref.ref[Stream]]] = {}
_keys = itertools.count(1)


def _run_host_func(key: int | None) -> None:
    entry = _pending.pop(key or 0, None)
    if entry is None:
        return
    fn, stream_ref = entry
    try:
        fn()
    except BaseException as exc:
        stream = stream_ref()
        if stream is None:
            log.error("host function %r raised after its stream was dropped", fn, exc_info=exc)
        else:
            stream.report_callback_error(exc)


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_run_host_func)
_HOST_FN_ADDR = ctypes.cast(_HOST_FN, ctypes.c_void_p).value or 0


# --- streams --------------------------------------------------------------------------


class _InContext:
    """What streams and events share: a driver handle (``None`` once closed) that lives
    in its own context."""

    __slots__ = ("__weakref__", "context", "fin", "handle")

    handle: Any
    context: Context
    fin: weakref.finalize | None  # destroys the handle in its context; None when borrowed

    __reduce__ = lifetime.process_local("make one there (ck.export_event shares an event)")

    @property
    def device(self) -> Device:
        """The device of its context."""
        return self.context.device

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self.handle is None

    def close(self) -> None:
        """Destroy it now (in its context); idempotent."""
        if self.fin is not None:
            self.fin()
        self.handle = None

    def open_handle(self, what: str) -> Any:
        """The live driver handle, for a call named ``what``.

        Raises
        ------
        ContextClosedError
            After :meth:`close`: the handle is gone and ``what`` names the call refused.
        """
        handle = self.handle
        if handle is None:
            raise ContextClosedError(f"{what}: the {type(self).__name__.lower()} was closed")
        return handle


class Stream(_InContext):
    """A CUDA stream, created in its own context.

    Parameters
    ----------
    context : Context, Device, int or None
        The context to create it in; ``None`` means the calling thread's current context
        (``NoCurrentContextError`` when it has none). The stream is created with that
        context bound, whatever else is current.
    nonblocking : bool
        ``CU_STREAM_NON_BLOCKING``: no implicit synchronization with the legacy default
        stream (handle 0). A green context's streams are always non-blocking (made with
        ``cuGreenCtxStreamCreate``, restricted to its SMs): ``False`` is refused there.
    priority : int
        Lower numbers are higher priority; must lie in the context's
        ``cuCtxGetStreamPriorityRange`` (0 is always valid).

    Raises
    ------
    ValueError
        *priority* is outside the device's range (the message gives the range), or
        ``nonblocking=False`` in a green context.
    """

    __slots__ = ("_callback_errors", "_lock", "_owner", "nonblocking", "owned", "priority")

    def __init__(
        self, context: ContextLike | None = None, nonblocking: bool = True, priority: int = 0
    ) -> None:
        ctx = resolve_context(context, "Stream()")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        flags = STREAM_NON_BLOCKING if nonblocking else 0
        if ctx.cu_green is not None and not nonblocking:
            raise ValueError(
                f"Stream(context={ctx!r}, nonblocking=False): the streams of a green context "
                "are non-blocking (cuGreenCtxStreamCreate requires CU_STREAM_NON_BLOCKING)"
            )
        with ctx:
            if priority:  # 0 is always valid: no range to ask for
                err, least, greatest = drv.cuCtxGetStreamPriorityRange()
                if err:
                    raise ctx.note_error(err, "cuCtxGetStreamPriorityRange")
                if not greatest <= priority <= least:
                    raise ValueError(
                        f"stream priority {priority} is outside the range of device "
                        f"{ctx.device.ordinal}: {greatest} (highest) .. {least} (lowest)"
                    )
            if ctx.cu_green is None:
                err, handle = drv.cuStreamCreateWithPriority(flags, priority)
            else:  # cuStreamCreate would make a stream free to run on every SM
                err, handle = drv.cuGreenCtxStreamCreate(ctx.cu_green, flags, priority)
        if err:
            raise ctx.note_error(err, f"stream creation (flags={flags}, priority {priority})")
        self._setup(ctx, handle, bool(nonblocking), priority, owned=True, owner=None)
        self.fin = finalizer(self, ctx, drv.cuStreamDestroy, handle)

    def _setup(
        self, ctx: Context, handle: Any, nonblocking: bool, priority: int, owned: bool, owner: Any
    ) -> None:
        self.context = ctx
        self.handle = handle
        self.nonblocking = nonblocking
        self.priority = priority
        self.owned = owned
        self._owner = owner
        self.fin = None
        self._lock = threading.Lock()
        self._callback_errors: list[BaseException] = []

    @classmethod
    def from_handle(cls, stream: Any, context: ContextLike | None = None) -> Stream:
        """Wrap an existing stream without owning it (it is never destroyed by ctxkit);
        :meth:`wrap` is the same.

        *stream* is anything :func:`stream_handle` accepts (a PyTorch, CuPy, cuda.core or
        Numba stream, an object with ``__cuda_stream__``, an int or ``CUstream``); the
        wrapper keeps a Python object alive while it lives. *context* defaults to the
        stream's own context (``cuStreamGetCtx``); for the special handles 0 (legacy
        default), 1 and 2 it is the current context.
        """
        if isinstance(stream, Stream):
            return stream
        value = _foreign_stream_int(stream)
        handle = drv.CUstream(value)
        if context is not None:
            ctx = resolve_context(context, "Stream.from_handle")
        elif value in (0, 1, 2):
            ctx = require_current("Stream.from_handle(default stream)")
        else:
            cu = call(drv.cuStreamGetCtx, handle, what=f"cuStreamGetCtx({value:#x})")
            ctx = context_of_cu(cu)
        obj = cls.__new__(cls)
        owner = None if isinstance(stream, (int, np.integer)) else stream
        nonblocking, priority = False, 0  # what the special handles 0, 1 and 2 have
        if value not in (0, 1, 2):
            err, flags = drv.cuStreamGetFlags(handle)
            nonblocking = not err and bool(int(flags) & STREAM_NON_BLOCKING)
            err, prio = drv.cuStreamGetPriority(handle)
            priority = 0 if err else int(prio)
        obj._setup(ctx, handle, nonblocking, priority, owned=False, owner=owner)
        return obj

    #: ``Stream.wrap(obj)``: the same as :meth:`from_handle`, a ctxkit view of another
    #: library's stream; ``with ck.Stream.wrap(torch.cuda.current_stream()):`` runs ctxkit
    #: work in torch's stream order.
    wrap = from_handle

    # --- current stream --------------------------------------------------------------

    def __enter__(self) -> Stream:
        """Make this stream (and its context) current in the calling thread."""
        self.open_handle("with stream")
        self.context.__enter__()
        by_context, key = _current.by_context, self.context.handle
        _current.saved.append((key, by_context.get(key)))
        by_context[key] = self
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        cur = _current
        key, prev = cur.saved.pop()
        if prev is None:
            cur.by_context.pop(key, None)
        else:
            cur.by_context[key] = prev
        self.context.__exit__(et, ev, tb)

    # --- protocol / identity ---------------------------------------------------------

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: ``(0, handle)``."""
        return (0, int(self.handle))

    @property
    def ptr(self) -> int:
        """The stream handle as an int."""
        return int(self.handle)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Stream):
            a, b = self.handle, other.handle
            return a is not None and b is not None and int(a) == int(b)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("stream", int(self.handle or 0)))

    def __repr__(self) -> str:
        if self.handle is None:
            return "<Stream closed>"
        kind = "" if self.owned else " borrowed"
        return (
            f"<Stream{kind} {int(self.handle):#x} device={self.context.device.ordinal} "
            f"priority={self.priority}>"
        )

    def report_callback_error(self, exc: BaseException) -> None:
        """Keep *exc*, raised by a host function run on this stream (also a graph's host
        node), for the next :meth:`synchronize` to raise (they run on a driver thread)."""
        with self._lock:
            self._callback_errors.append(exc)

    # --- operations ------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for all work in the stream (the GIL is released while waiting).

        Raises
        ------
        ContextPoisonedError
            A kernel faulted; the context can no longer be used.
        BaseException
            The first exception raised by a host function (:meth:`launch_host_func`)
            since the last synchronize; later ones are logged.
        """
        handle = self.open_handle("Stream.synchronize")
        _call(self.context, "Stream.synchronize", drv.cuStreamSynchronize, handle)
        if self._callback_errors:
            self._raise_callback_error()

    def _raise_callback_error(self) -> None:
        with self._lock:
            errors, self._callback_errors = self._callback_errors, []
        for extra in errors[1:]:
            log.error("another host function on %r raised", self, exc_info=extra)
        if errors:
            raise errors[0]

    def query(self) -> bool:
        """True when all work in the stream has completed (``cuStreamQuery``)."""
        handle = self.open_handle("Stream.query")
        (err,) = _call(self.context, "Stream.query", drv.cuStreamQuery, handle, ok=_NOT_READY)
        return not err

    def wait(self, event_or_stream: Event | Stream | Any) -> None:
        """Make later work in this stream wait for an event or for another stream's work.

        The event may belong to another context or device (the cross-device dependency
        of a multi-GPU program). A stream argument waits for everything enqueued on it so
        far: an event is recorded there and waited on.
        """
        handle = self.open_handle("Stream.wait")
        if isinstance(event_or_stream, Event):
            event = event_or_stream
        else:  # everything enqueued on that stream so far
            event = Stream.from_handle(event_or_stream).record(timing=False)
        ev = event.open_handle("Stream.wait")
        _call(self.context, "Stream.wait", drv.cuStreamWaitEvent, handle, ev, 0)

    def record(self, event: Event | None = None, *, timing: bool = True) -> Event:
        """Record *event* (a new one when ``None``) at this point of the stream."""
        if event is None:
            event = Event(timing=timing, context=self.context)
        return event.record(self)

    def launch_host_func(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on a driver thread once the work enqueued so far has completed.

        ``fn`` must not call CUDA. An exception it raises is kept and re-raised by the
        next :meth:`synchronize` of this stream (logged if the stream is gone by then).
        ``fn`` is kept alive until it has run; the driver skips it if the context faults.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        handle = self.open_handle("Stream.launch_host_func")
        key = next(_keys)
        _pending[key] = (fn, weakref.ref(self))
        ctx = self.context
        with guard(ctx, "Stream.launch_host_func"):
            (err,) = drv.cuLaunchHostFunc(handle, drv.CUhostFn(_HOST_FN_ADDR), key)
        if err:
            _pending.pop(key, None)
            raise ctx.note_error(err, "cuLaunchHostFunc")

    def close(self) -> None:
        """Destroy an owned stream now (in its context); idempotent. Borrowed: forget it."""
        super().close()
        self._owner = None


# --- events ---------------------------------------------------------------------------


class Event(_InContext):
    """A CUDA event, created in its own context.

    Parameters
    ----------
    timing : bool
        Record timestamps (needed by :meth:`elapsed_ms`); ``False`` makes the event
        cheaper for pure dependencies (``CU_EVENT_DISABLE_TIMING``).
    context : Context, Device, int or None
        As for :class:`Stream`.
    blocking : bool
        ``CU_EVENT_BLOCKING_SYNC``: :meth:`synchronize` sleeps instead of spinning.
    """

    __slots__ = ("_recorded", "timing")

    def __init__(
        self, timing: bool = True, context: ContextLike | None = None, *, blocking: bool = False
    ):
        ctx = resolve_context(context, "Event()")
        flags = (0 if timing else EVENT_DISABLE_TIMING) | (EVENT_BLOCKING_SYNC if blocking else 0)
        with ctx:
            err, handle = drv.cuEventCreate(flags)
        if err:
            raise ctx.note_error(err, f"cuEventCreate(flags={flags})")
        self._own(ctx, handle, bool(timing))

    @classmethod
    def adopt(cls, handle: Any, context: Context, *, timing: bool = False) -> Event:
        """An Event owning *handle*, an event of *context* made by other means (an
        interprocess event, one opened with ``cuIpcOpenEventHandle``): destroyed in
        *context* when dropped, like one made by ``Event()``."""
        ev = cls.__new__(cls)
        ev._own(context, handle, timing)
        return ev

    def _own(self, ctx: Context, handle: Any, timing: bool) -> None:
        self.context = ctx
        self.handle = handle
        self.timing = timing
        self._recorded = False
        self.fin = finalizer(self, ctx, drv.cuEventDestroy, handle)

    def __repr__(self) -> str:
        if self.handle is None:
            return "<Event closed>"
        return (
            f"<Event {int(self.handle):#x} device={self.context.device.ordinal} "
            f"timing={self.timing}>"
        )

    def query(self) -> bool:
        """True when the work before the recorded point has completed."""
        handle = self.open_handle("Event.query")
        (err,) = _call(self.context, "Event.query", drv.cuEventQuery, handle, ok=_NOT_READY)
        return not err

    def synchronize(self) -> None:
        """Wait until the recorded work has completed (GIL released while waiting)."""
        handle = self.open_handle("Event.synchronize")
        _call(self.context, "Event.synchronize", drv.cuEventSynchronize, handle)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to *end*; waits for *end* to complete first.

        Raises
        ------
        ValueError
            Either event was created with ``timing=False``, was never recorded, or the
            two belong to different devices/contexts.
        """
        if not isinstance(end, Event):
            raise TypeError(f"end must be a ctxkit.Event, got {type(end).__name__}")
        for ev, name in ((self, "start"), (end, "end")):
            ev.open_handle("Event.elapsed_ms")
            if not ev.timing:
                raise ValueError(
                    f"elapsed_ms: the {name} event {ev!r} was created with timing=False and has "
                    "no timestamp; create both events with Event(timing=True)"
                )
            if not ev._recorded:
                raise ValueError(f"elapsed_ms: the {name} event {ev!r} was never recorded")
        d0, d1 = self.context.device.ordinal, end.context.device.ordinal
        if d0 != d1:
            raise ValueError(
                f"elapsed_ms: the events are on different devices ({d0} and {d1}); GPU clocks "
                "are per device: time each device with its own pair of events"
            )
        if self.context != end.context:
            raise ValueError(
                f"elapsed_ms: the events belong to different contexts ({self.context!r} and "
                f"{end.context!r}) of device {d0}; create both in one context"
            )
        end.synchronize()
        fn = drv.cuEventElapsedTime
        err, ms = _call(
            self.context, "Event.elapsed_ms", fn, self.handle, end.handle, ok=_NOT_READY
        )
        if err:
            raise ValueError(
                f"{self!r} has not completed although {end!r} has: record the start event "
                "before the end event on the same stream"
            )
        return float(ms)

    def record(self, stream: Stream | Any = None) -> Event:
        """Record the event on *stream* (default: the context's legacy default stream; in
        a green context, the stream ``stream=None`` means there, :func:`green_default`).

        Raises
        ------
        ValueError
            *stream* is a ctxkit Stream of another context (the driver requires the
            event and the stream to share a context).
        """
        handle = self.open_handle("Event.record")
        ctx = self.context
        if isinstance(stream, Stream) and stream.context != ctx:
            raise ValueError(
                f"cannot record {self!r} (context {ctx!r}) on {stream!r} of context "
                f"{stream.context!r}: create the event in the stream's context "
                "(Event(context=stream.context) or stream.record())"
            )
        if stream is None and ctx.cu_green is not None:
            stream = current_stream(ctx)
        _call(ctx, "Event.record", drv.cuEventRecord, handle, stream_handle(stream))
        self._recorded = True
        return self


def _call(ctx: Context, what: str, fn: Callable[..., Any], *args: Any, ok: int = 0) -> Any:
    """``fn(*args)``, a driver call for an object of *ctx* named *what*: *ctx* must be
    usable, and is bound as ``guard`` says; an error other than *ok* raises, noted by
    *ctx*. Returns what *fn* returned, its status first."""
    ctx.check_usable()
    with guard(ctx, what):
        res = fn(*args)
    err = res[0]
    if err and err != ok:
        raise ctx.note_error(err, getattr(fn, "__name__", what))
    return res
