"""Cross-device stages of a Pipeline (``Pipeline.submit``), ordered by CUDA events.

Re-exported by :mod:`ctxkit.pipeline`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from ..context import Context
from ..device import Device
from ..errors import ContextPoisonedError, CudaError, PipelineError
from ..stream import Event, Stream
from ..trace import Recorder
from .staging import DeviceState, calibrate

__all__ = ["StageHandle", "StageMixin", "run_stage", "stage_error"]


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


class StageMixin:
    """The cross-device stage API of :class:`~ctxkit.pipeline.Pipeline`."""

    _lock: threading.RLock
    _recorder: Recorder | None
    _stages: list[StageHandle]
    tracing: bool
    _check_usable: Callable[[], None]
    _device_for: Callable[[int | Device | Context], DeviceState]

    def stream(self, device: int | Device | Context) -> Stream:
        """The stream :meth:`submit` stages of *device* run on."""
        return self._device_for(device).stage_stream

    def submit(
        self,
        device: int | Device | Context,
        fn: Callable[[Context, Stream], Any],
        after: Iterable[StageHandle | Event] = (),
        *,
        name: str | None = None,
    ) -> StageHandle:
        """Enqueue ``fn(ctx, stream)`` on *device* after the stages in *after* completed.

        ``fn`` runs on the device's worker thread with its context current and enqueues
        work on ``stream`` (:meth:`stream`); an event recorded after it completes the
        returned handle. The device's stream waits for every handle (or Event) in
        *after* on the GPU (``cuStreamWaitEvent``, across devices), without blocking
        the host. Stages on one device run in submission order.

        Load the kernels ``fn`` launches beforehand (:meth:`Kernel.preload`): under
        lazy loading the first launch of a kernel may wait until the context is idle,
        which delays the stage's event and with it every stage waiting for it.
        """
        self._check_usable()
        dev = self._device_for(device)
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
            if self._recorder is None and self.tracing:
                self._recorder = Recorder()
            rec = self._recorder
            self._stages.append(handle)
        handle._future = dev.worker.submit(run_stage, dev, fn, deps, handle, rec)
        return handle

    def wait(self, handles: Iterable[StageHandle] | None = None) -> None:
        """Wait for the GPU work of *handles* (default: every stage submitted so far).

        Raises
        ------
        PipelineError
            A stage failed; the message names its device and name.
        """
        todo = list(self._stages if handles is None else handles)
        first: BaseException | None = None
        for h in todo:
            try:
                h.synchronize()
            except BaseException as exc:
                if first is None:
                    first = exc
        if handles is None:
            with self._lock:
                self._stages = [h for h in self._stages if h not in todo]
        if first is not None:
            raise first
