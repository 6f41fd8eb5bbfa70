"""CUDA events (``CUevent``) on their own: create, query, wait for, time, destroy.

:class:`EventBase` is all of :class:`ctxkit.stream.Event` except
:meth:`~ctxkit.stream.Event.record`. Recording takes a stream, and streams make events
(``Stream.record``, ``Stream.wait``), so ``Event`` itself is defined in
:mod:`ctxkit.stream` on top of this module: the import runs one way, stream -> event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._driver import drv
from .context import Context
from .device import Device
from .errors import ContextClosedError
from .lifetime import finalizer
from .registry import ContextLike, guard, resolve_context

if TYPE_CHECKING:
    from .stream import Event

__all__ = ["EventBase", "check_elapsed"]

EVENT_BLOCKING_SYNC = 1
EVENT_DISABLE_TIMING = 2
_NOT_READY = 600


class EventBase:
    """A CUDA event in its own context, without the stream side (see
    :class:`ctxkit.stream.Event`, the class to use)."""

    __slots__ = ("__weakref__", "_fin", "_recorded", "context", "handle", "timing")

    def __init__(
        self, timing: bool = True, context: ContextLike | None = None, *, blocking: bool = False
    ):
        ctx = resolve_context(context, "Event()")
        flags = (0 if timing else EVENT_DISABLE_TIMING) | (EVENT_BLOCKING_SYNC if blocking else 0)
        with ctx:
            err, handle = drv.cuEventCreate(flags)
        if err:
            raise ctx.note_error(err, f"cuEventCreate(flags={flags})")
        self.context = ctx
        self.handle = handle
        self.timing = bool(timing)
        self._recorded = False
        self._fin = finalizer(self, ctx, drv.cuEventDestroy, handle)

    def __repr__(self) -> str:
        if self.handle is None:
            return "<Event closed>"
        return (
            f"<Event {int(self.handle):#x} device={self.context.device.ordinal} "
            f"timing={self.timing}>"
        )

    def _open_handle(self, what: str) -> Any:
        handle = self.handle
        if handle is None:
            raise ContextClosedError(f"{what}: the event was closed")
        return handle

    @property
    def device(self) -> Device:
        """The device of the event's context."""
        return self.context.device

    def query(self) -> bool:
        """True when the work before the recorded point has completed."""
        return _query(self.context, self._open_handle("Event.query"), "Event.query")

    def synchronize(self) -> None:
        """Wait until the recorded work has completed (GIL released while waiting)."""
        handle = self._open_handle("Event.synchronize")
        ctx = self.context
        ctx.check_usable()
        with guard(ctx, "Event.synchronize"):
            (err,) = drv.cuEventSynchronize(handle)
        if err:
            raise ctx.note_error(err, "cuEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to *end*; waits for *end* to complete first.

        Raises
        ------
        ValueError
            Either event was created with ``timing=False``, was never recorded, or the
            two belong to different devices/contexts.
        """
        check_elapsed(self, end)
        end.synchronize()
        ctx = self.context
        with guard(ctx, "Event.elapsed_ms"):
            err, ms = drv.cuEventElapsedTime(self.handle, end.handle)
        if err == _NOT_READY:
            raise ValueError(
                f"{self!r} has not completed although {end!r} has: record the start event "
                "before the end event on the same stream"
            )
        if err:
            raise ctx.note_error(err, "cuEventElapsedTime")
        return float(ms)

    def close(self) -> None:
        """Destroy the event now (in its context); idempotent."""
        self._fin()
        self.handle = None


def check_elapsed(start: EventBase, end: Event) -> None:
    """The checks of :meth:`Event.elapsed_ms`, before any driver call."""
    if not isinstance(end, EventBase):
        raise TypeError(f"end must be a ctxkit.Event, got {type(end).__name__}")
    start._open_handle("Event.elapsed_ms")
    end._open_handle("Event.elapsed_ms")
    for ev, name in ((start, "start"), (end, "end")):
        if not ev.timing:
            raise ValueError(
                f"elapsed_ms: the {name} event {ev!r} was created with timing=False and has "
                "no timestamp; create both events with Event(timing=True)"
            )
        if not ev._recorded:
            raise ValueError(f"elapsed_ms: the {name} event {ev!r} was never recorded")
    d0, d1 = start.context.device.ordinal, end.context.device.ordinal
    if d0 != d1:
        raise ValueError(
            f"elapsed_ms: the events are on different devices ({d0} and {d1}); GPU clocks "
            "are per device: time each device with its own pair of events"
        )
    if start.context != end.context:
        raise ValueError(
            f"elapsed_ms: the events belong to different contexts ({start.context!r} and "
            f"{end.context!r}) of device {d0}; create both in one context"
        )


def _query(ctx: Context, handle: Any, what: str) -> bool:
    """``cuStreamQuery``/``cuEventQuery`` (by *what*) in *ctx*: done, or still running."""
    name = "cuStreamQuery" if what.startswith("Stream") else "cuEventQuery"
    with guard(ctx, what):
        (err,) = getattr(drv, name)(handle)
    if err == _NOT_READY:
        return False
    if err:
        raise ctx.note_error(err, name)
    return True
