"""Cross-device stages of a Pipeline (``Pipeline.submit``), ordered by CUDA events.

Re-exported by :mod:`ctxkit.pipeline`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ._pipework import PipelineError
from ._staging import DeviceState, calibrate
from .context import Context
from .errors import ContextPoisonedError, CudaError
from .stream import Event, Stream
from .trace import Recorder

__all__ = ["StageHandle", "run_stage", "stage_error"]


class StageHandle:
    """A stage enqueued by :meth:`Pipeline.submit`: its completion is :attr:`event`.

    Pass handles in ``after=`` of later stages (on any device) to order them.
    """

    def __init__(self, device: int, name: str, context: Context, owner: object) -> None:
        self.device = device
        self.name = name
        self._context = context
        self._owner = weakref.ref(owner)
        self._future: Future[Any] = Future()
        self._event: Event | None = None

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
        if self._future.exception() is not None:
            return True
        with self._context:
            return self.event.query()

    def synchronize(self) -> None:
        """Wait for the stage's GPU work; raises :class:`PipelineError` if it failed."""
        ev = self.event
        try:
            with self._context:
                ev.synchronize()
        except CudaError as exc:
            raise stage_error(self, "synchronize", exc) from exc

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<StageHandle {self.name!r} device={self.device} {state}>"


def stage_error(handle: StageHandle, step: str, exc: BaseException) -> PipelineError:
    """The PipelineError for a failed stage, naming its device and name."""
    poisoned = isinstance(exc, ContextPoisonedError) or handle._context.poisoned
    return PipelineError(
        f"Pipeline stage {handle.name!r} on device {handle.device} failed ({step}): {exc}",
        handle.device,
        None,
        "stage",
        exc,
        poisoned,
    )


# --- the pipeline -------------------------------------------------------------------------


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
    try:
        if rec is not None and not rec.calibrated(dev.ordinal):
            calibrate(dev, rec)
        timing = rec is not None
        if events:
            w0 = Event(timing=timing, context=dev.ctx).record(s)
            for ev in events:
                s.wait(ev)
            w1 = Event(timing=timing, context=dev.ctx).record(s)
            if rec is not None:
                rec.mark("wait", dev.ordinal, "stage", None, w0, w1)
        s0 = Event(timing=timing, context=dev.ctx).record(s)
        result = fn(dev.ctx, s)
        end = Event(timing=timing, context=dev.ctx).record(s)
    except PipelineError:
        raise
    except BaseException as exc:
        if not isinstance(exc, Exception):
            raise
        raise stage_error(handle, "enqueue", exc) from exc
    handle._event = end
    if rec is not None:
        rec.mark(f"stage:{handle.name}", dev.ordinal, "stage", None, s0, end)
    return result
