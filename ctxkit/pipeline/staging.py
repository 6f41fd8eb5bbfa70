"""Staging machinery of ``ctxkit.pipeline``: per-device state (worker threads, streams,
slots of device and pinned buffers, an event pool); the host threads are in
:mod:`ctxkit.pipeline.hostthreads`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np

from .._driver import drv, in_forked_child
from ..context import Context
from ..errors import OutOfMemoryError
from ..executor import ContextExecutor
from ..memory.device import DeviceBuffer
from ..memory.pinned import pinned_pool
from ..stream import Event, Stream
from ..trace import Recorder
from .hostthreads import HostPool
from .plan import PAGE, round_up

__all__ = ["DeviceState", "Progress", "Slot"]


BOUNCE_BYTES = 4 * PAGE


NOT_READY = 600


class Slot:
    """One staging slot of a device: device buffers, pinned buffers and a stream.

    ``pin_in``/``pin_out`` stage whole chunks (``host_path="staged"``); ``bounce`` holds
    the few bytes at the unaligned ends of a chunk whose pages are registered
    (``host_path="register"``) or held by pin on reuse: input at ``[0, 2 pages)``,
    output at ``[2, 4 pages)``.
    """

    def __init__(self, index: int, stream: Stream) -> None:
        self.index = index
        self.label = f"stream {index}"
        self.stream = stream
        self.d_in: DeviceBuffer | None = None
        self.d_out: DeviceBuffer | None = None
        self.pin_in: np.ndarray | None = None
        self.pin_out: np.ndarray | None = None
        #: the output staging buffer being allocated on the host pool (first use)
        self.pin_out_next: Future[np.ndarray] | None = None
        self.bounce: np.ndarray | None = None
        self.h2d_done: Event | None = None

    @property
    def bounce_in(self) -> np.ndarray:
        """The input half of the bounce buffer."""
        assert self.bounce is not None
        return self.bounce[: BOUNCE_BYTES // 2]

    @property
    def bounce_out(self) -> np.ndarray:
        """The output half of the bounce buffer."""
        assert self.bounce is not None
        return self.bounce[BOUNCE_BYTES // 2 :]

    def release(self) -> None:
        """Free the device buffers and the stream; the pinned buffers go back to the
        process's pinned pool (cached there, not freed, for the next Pipeline)."""
        for buf in (self.d_in, self.d_out):
            if buf is not None:
                buf.close()
        self.d_in = self.d_out = None
        self.pin_in = self.pin_out = self.bounce = None
        self.pin_out_next = None
        self.h2d_done = None
        self.stream.close()


class Progress:
    """Which of a device's chunks (numbered in the order its feeder enqueues them) are
    finished in this run; ``done`` counts the finished prefix: chunks ``0 .. done - 1``
    (drains finish out of order once their copies run on the host pool)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ahead: set[int] = set()
        self.done = 0

    def advance(self, k: int | None = None) -> None:
        """Chunk *k* finished (default: the next one in order)."""
        with self._cond:
            self._ahead.add(self.done if k is None else k)
            while self.done in self._ahead:
                self._ahead.discard(self.done)
                self.done += 1
            self._cond.notify_all()

    def wait_for(self, n: int, stop: threading.Event) -> bool:
        """Wait until chunks ``0 .. n - 1`` finished; False if *stop* was set first
        (checked every 10 ms, so an interrupted run never waits on a drain that will
        not come)."""
        with self._cond:
            while self.done < n:
                if stop.is_set():
                    return False
                self._cond.wait(0.01)
        return not stop.is_set()


class DeviceState:
    """A device of the pipeline: its context, worker threads, streams and staging."""

    def __init__(self, part: int, ctx: Context, slots: int) -> None:
        self.part = part
        self.ctx = ctx
        self.ordinal = ctx.device.ordinal
        name = f"ctxkit-pipeline-gpu{self.ordinal}"
        self.worker = ContextExecutor(ctx, max_workers=1, thread_name_prefix=name)
        self.drainer = ContextExecutor(ctx, max_workers=1, thread_name_prefix=name + "-drain")
        self.slots = [Slot(i, Stream(context=ctx)) for i in range(slots)]
        self.stage_stream = Stream(context=ctx)
        self.ref_stream = Stream(context=ctx)
        self.events: dict[bool, list[Event]] = {True: [], False: []}
        self.clock: tuple[Recorder, Event, float] | None = None
        dev = ctx.device
        per_sm = max(1, dev.attribute("max_threads_per_multiprocessor"))
        self.sm_threads = dev.multiprocessor_count * per_sm
        self.prefetch_ok = bool(dev.attribute("concurrent_managed_access"))

    def start_threads(self) -> None:
        """Start the worker threads now rather than at the first map: a map then never
        starts a thread (which fails once the interpreter exits), and live workers keep
        ctxkit from releasing the contexts at exit under a map in a daemon thread."""
        for executor in (self.worker, self.drainer):
            executor.submit(int).result()

    def streams(self) -> list[Stream]:
        """Every stream the pipeline enqueues work on for this device."""
        return [*(slot.stream for slot in self.slots), self.stage_stream]

    def max_blocks(self, block: int) -> int:
        """Blocks of *block* threads that fill every SM once."""
        return max(1, self.sm_threads // block)

    def take_event(self, timing: bool, taken: list[Event]) -> Event:
        """An event from the pool (or a new one), remembered in *taken*."""
        pool = self.events[timing]
        ev = pool.pop() if pool else Event(timing=timing, context=self.ctx)
        taken.append(ev)
        return ev

    def give_back(self, events: Iterable[Event]) -> None:
        """Return events to the pool once nothing reads them any more."""
        for ev in events:
            self.events[ev.timing].append(ev)

    def release(self) -> None:
        """Stop the worker threads; free slots, streams and pooled events."""
        self.worker.shutdown(wait=True)
        self.drainer.shutdown(wait=True)
        for slot in self.slots:
            slot.release()
        for s in (self.stage_stream, self.ref_stream):
            s.close()
        for pool in self.events.values():
            for ev in pool:
                ev.close()
            pool.clear()


def shutdown_all(devices: list[DeviceState], pool: list[HostPool], pins: Any = None) -> None:
    """Finalizer of a Pipeline collected without :meth:`close`: stop its threads, unlock
    the memory it kept page-locked (a :class:`ctxkit.pipeline.pincache.PinClaims`).

    Never run at interpreter exit: a map may still run in a daemon thread then, and the
    process teardown frees everything anyway. In a forked child it does nothing: the
    threads and the memory are the parent's."""
    if in_forked_child():
        return
    for dev in devices:
        dev.worker.shutdown(wait=False)
        dev.drainer.shutdown(wait=False)
    for p in pool:
        p.close()
    if pins is not None:
        pins.release()


def sync_event(dev: DeviceState, ev: Event, what: str) -> None:
    """Wait for *ev* (GIL released); a failure is noted on the device's context."""
    (err,) = drv.cuEventSynchronize(ev.handle)
    if err:
        raise dev.ctx.note_error(err, what)


def quiet_sync(dev: DeviceState) -> None:
    """Wait for the device's pipeline streams before their buffers are freed."""
    if dev.ctx.closed or dev.ctx.poisoned:
        return
    with dev.ctx:
        for s in dev.streams():
            drv.cuStreamSynchronize(s.handle)


def calibrate(dev: DeviceState, rec: Recorder) -> None:
    """Tie *dev*'s event clock to the host clock with one event on an idle stream (kept
    in ``dev.clock`` too, to resolve stage intervals early)."""
    ev = Event(timing=True, context=dev.ctx).record(dev.ref_stream)
    ev.synchronize()
    host_s = time.perf_counter()
    rec.calibrate(dev.ordinal, ev, host_s)
    dev.clock = (rec, ev, host_s)


def ensure_slot(
    dev: DeviceState, slot: Slot, in_bytes: int, out_bytes: int, stage_in: bool, bounce: bool
) -> None:
    """Grow *slot*'s device buffers (and its input staging or bounce buffer when needed)
    at its first use in a run; its output staging buffer grows when its first D2H is
    enqueued (:func:`grow_pinned`), so the first chunk waits for one slot only."""
    try:
        slot.d_in = grow_device(slot.d_in, in_bytes, dev.ctx)
        slot.d_out = grow_device(slot.d_out, out_bytes, dev.ctx)
        if stage_in:
            slot.pin_in = grow_pinned(slot.pin_in, in_bytes, dev.ctx)
        if bounce and slot.bounce is None:
            slot.bounce = pinned_pool().empty((BOUNCE_BYTES,), np.uint8, context=dev.ctx)
    except OutOfMemoryError as exc:
        raise OutOfMemoryError(
            f"Pipeline: cannot allocate staging slot {slot.index} of {in_bytes} + "
            f"{out_bytes} bytes on device {dev.ordinal}: {exc}. Use a smaller chunk_bytes "
            "or fewer staging_buffers",
            exc.code,
            exc.name,
        ) from exc


def grow_device(buf: DeviceBuffer | None, need: int, ctx: Context) -> DeviceBuffer:
    """*buf* if it holds *need* bytes, else a new buffer (rounded up to MiB)."""
    if buf is not None and buf.nbytes >= need:
        return buf
    if buf is not None:
        buf.close()
    return DeviceBuffer(round_up(max(need, 1)), context=ctx)


def grow_pinned(arr: np.ndarray | None, need: int, ctx: Context) -> np.ndarray:
    """*arr* if it holds *need* bytes, else a uint8 array (rounded up to MiB) from the
    process's pinned pool (:func:`ctxkit.pinned_pool`): a new Pipeline reuses the blocks
    earlier ones gave back instead of page-locking memory again.

    No stream is named: a slot's pinned buffer is only replaced or dropped once the
    stream work that used it completed (after the slot's previous H2D or drain, at the
    start of a run, or in :meth:`Slot.release` after the streams were synchronized), so
    its block is reusable at once."""
    if arr is not None and arr.nbytes >= need:
        return arr
    return pinned_pool().empty((round_up(max(need, 1)),), np.uint8, context=ctx)


def event_ready(dev: DeviceState, ev: Event) -> bool:
    """True when *ev* completed, False while its work runs (``cuEventQuery``, no wait)."""
    (err,) = drv.cuEventQuery(ev.handle)
    if err == NOT_READY:
        return False
    if err:
        raise dev.ctx.note_error(err, "cuEventQuery")
    return True
