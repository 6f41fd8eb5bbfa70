"""Cross-device stages of a Pipeline (``Pipeline.submit``), ordered by CUDA events.

A Pipeline owns one :class:`Stages`: the stages not yet known to be complete (per
device, in submission order, the order they run in) and the failed ones until
:meth:`Stages.wait` reports them. A stage found complete is dropped at the next submit,
its trace intervals resolved to times then, so neither its handle nor its events stay
alive unless the caller keeps the handle. Re-exported by :mod:`ctxkit.pipeline`.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import suppress
from typing import Any

from ..context import Context
from ..errors import ContextPoisonedError, CudaError, PipelineError
from ..stream import Event, Stream
from ..trace import Recorder
from .staging import DeviceState, calibrate

__all__ = ["StageHandle", "Stages"]


STAGE_STREAM = "stage"


class StageHandle:
    """A stage enqueued by :meth:`Pipeline.submit`: its completion is :attr:`event`.

    Pass handles in ``after=`` of later stages (on any device) to order them.
    """

    def __init__(self, device: int, name: str, context: Context, owner: Stages) -> None:
        self.device = device
        self.name = name
        self._context = context
        self._owner = weakref.ref(owner)
        self._future: Future[Any] = Future()
        self._event: Event | None = None
        self._marks: list[tuple[str, Event, Event]] = []
        self._clock: tuple[Recorder, Event, float] | None = None

    @property
    def event(self) -> Event:
        """The event recorded after the stage's work (waits until it was enqueued)."""
        self._future.result()
        assert self._event is not None
        return self._event

    def result(self, timeout: float | None = None) -> Any:
        """What the stage function returned (once it ran on the device's worker thread).

        The GPU work it enqueued may still be running: use :meth:`synchronize` for that.
        """
        return self._future.result(timeout)

    def done(self) -> bool:
        """True when the stage was enqueued and its GPU work has completed."""
        if not self._future.done():
            return False
        return self._future.exception() is not None or self.event.query()

    def synchronize(self) -> None:
        """Wait for the stage's GPU work; raises :class:`PipelineError` if it failed."""
        ev = self.event
        try:
            ev.synchronize()
        except CudaError as exc:
            raise stage_error(self, "synchronize", exc) from exc

    def _resolve_trace(self) -> None:
        """The GPU work is complete: turn the stage's event pairs into trace intervals
        and let the events go."""
        marks, self._marks = self._marks, []
        clock, self._clock = self._clock, None
        if clock is None:
            return
        rec, ref, ref_s = clock
        for name, start, end in marks:
            try:
                t0 = ref_s + ref.elapsed_ms(start) / 1e3
                t1 = ref_s + ref.elapsed_ms(end) / 1e3
            except Exception:  # the timeline is a diagnostic: a lost interval is no error
                continue
            rec.host(name, self.device, STAGE_STREAM, None, t0, max(t0, t1))

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<StageHandle {self.name!r} device={self.device} {state}>"


def stage_error(handle: StageHandle, step: str, exc: BaseException) -> PipelineError:
    """The PipelineError for a failed stage, naming its device and name."""
    poisoned = isinstance(exc, ContextPoisonedError) or handle._context.poisoned
    msg = f"Pipeline stage {handle.name!r} on device {handle.device} failed ({step}): {exc}"
    return PipelineError(msg, handle.device, None, "stage", exc, poisoned)


def run_stage(
    dev: DeviceState,
    fn: Callable[[Context, Stream], Any],
    deps: list[StageHandle | Event],
    handle: StageHandle,
    rec: Recorder | None,
) -> Any:
    """Worker thread of *dev*: wait (on the GPU) for *deps*, then enqueue ``fn(ctx, stream)``
    between events; the last one completes *handle*."""
    s = dev.stage_stream
    try:
        events = [h.event if isinstance(h, StageHandle) else h for h in deps]
    except BaseException as exc:
        raise stage_error(handle, "dependency failed", exc) from exc
    marks: list[tuple[str, Event, Event]] = []
    try:
        if rec is not None and not rec.calibrated(dev.lane):
            calibrate(dev, rec)
        timing = rec is not None
        w0 = Event(context=dev.ctx).record(s) if timing and events else None
        for ev in events:
            s.wait(ev)
        if w0 is not None:
            marks.append(("wait", w0, Event(context=dev.ctx).record(s)))
        s0 = Event(context=dev.ctx).record(s) if timing else None
        result = fn(dev.ctx, s)
        end = Event(timing=timing, context=dev.ctx).record(s)
    except PipelineError:
        raise
    except Exception as exc:
        raise stage_error(handle, "enqueue", exc) from exc
    if rec is not None and s0 is not None:
        marks.append((f"stage:{handle.name}", s0, end))
        clock = dev.clock
        handle._marks = marks
        handle._clock = clock if clock is not None and clock[0] is rec else None
    handle._event = end
    return result


class Stages:
    """The stages of one Pipeline: submission, waiting, and dropping completed ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, collections.deque[StageHandle]] = {}
        self._failed: list[StageHandle] = []

    def submit(
        self,
        dev: DeviceState,
        fn: Callable[[Context, Stream], Any],
        after: Iterable[StageHandle | Event],
        name: str | None,
        rec: Recorder | None,
    ) -> StageHandle:
        """Enqueue ``fn(ctx, stream)`` on *dev*'s worker after *after* (see
        :meth:`Pipeline.submit`)."""
        if not callable(fn):
            raise TypeError(f"fn must be callable as fn(ctx, stream), got {type(fn).__name__}")
        deps = list(after)
        for h in deps:
            if isinstance(h, StageHandle):
                if h._owner() is not self:
                    raise ValueError(f"{h!r} was not submitted to this pipeline")
            elif not isinstance(h, Event):
                raise TypeError(
                    f"after= takes StageHandles or ctxkit Events, got {type(h).__name__}"
                )
        label = str(name or getattr(fn, "__name__", "stage"))
        handle = StageHandle(dev.ordinal, label, dev.ctx, self)
        with self._lock:
            self._drop_completed()
            self._pending.setdefault(dev.lane, collections.deque()).append(handle)
        handle._future = dev.worker.submit(run_stage, dev, fn, deps, handle, rec)
        return handle

    def outstanding(self) -> list[StageHandle]:
        """The stages not dropped yet: pending ones and failed ones not yet reported."""
        with self._lock:
            return [*self._failed, *(h for q in self._pending.values() for h in q)]

    def wait(self, handles: Iterable[StageHandle] | None = None) -> None:
        """Wait for the GPU work of *handles* (default: every outstanding stage, which is
        then forgotten); raise the first failure."""
        todo = self.outstanding() if handles is None else list(handles)
        errors = self._sync(todo)
        if handles is None:
            done = set(map(id, todo))
            with self._lock:
                self._failed = [h for h in self._failed if id(h) not in done]
                for k, q in self._pending.items():
                    self._pending[k] = collections.deque(h for h in q if id(h) not in done)
        if errors:
            raise errors[0]

    def settle(self) -> None:
        """Wait for every outstanding stage without raising (before a trace or close)."""
        self._sync(self.outstanding())

    def _sync(self, handles: list[StageHandle]) -> list[BaseException]:
        """Wait for the GPU work of *handles*; return their failures."""
        errors = []
        for h in handles:
            try:
                h.synchronize()
            except BaseException as exc:
                errors.append(exc)
            else:
                with self._lock:
                    h._resolve_trace()
        return errors

    def join(self) -> None:
        """Wait until every stage function has run (its worker may be shut down next)."""
        for h in self.outstanding():
            with suppress(BaseException):
                h._future.exception()

    def clear(self) -> None:
        """Forget every stage."""
        with self._lock:
            self._pending.clear()
            self._failed.clear()

    def _drop_completed(self) -> None:
        """Drop the stages at the front of each device's queue whose GPU work completed;
        failed ones are kept for :meth:`wait`."""
        for q in self._pending.values():
            while q and q[0]._future.done():
                h = q[0]
                if h._future.exception() is not None:
                    self._failed.append(q.popleft())
                    continue
                try:
                    complete = h.event.query()
                except Exception:
                    self._failed.append(q.popleft())
                    continue
                if not complete:
                    break
                q.popleft()._resolve_trace()
