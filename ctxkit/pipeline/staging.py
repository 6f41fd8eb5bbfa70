"""Staging machinery of ``ctxkit.pipeline``: per-device state (worker threads, streams,
slots of device and pinned buffers, an event pool) and the host thread pool."""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from .._driver import drv
from ..context import Context
from ..errors import OutOfMemoryError
from ..executor import ContextExecutor
from ..memory.device import DeviceBuffer
from ..memory.hostpool import pinned_pool
from ..stream import Event, Stream
from ..trace import HOST_PREFIX, Recorder
from .plan import PAGE, MiB, round_up

__all__ = ["DeviceState", "HostPool", "Progress", "Slot"]


MIN_PIECE_BYTES = 1 * MiB


BOUNCE_BYTES = 4 * PAGE


T = TypeVar("T")


class HostPool:
    """Host threads for the pipeline: parallel numpy copies (``np.copyto`` releases the
    GIL for large copies) and jobs such as page registration (:meth:`submit`)."""

    def __init__(self, n_threads: int, prefix: str = "ctxkit-stage") -> None:
        self.size = n_threads
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{prefix}_{i}", daemon=True)
            for i in range(n_threads)
        ]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            job()
            del job  # an idle thread must not keep the last job's arrays alive

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a pool thread; its result or exception lands in the Future."""
        fut: Future[T] = Future()

        def job() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._q.put(job)
        return fut

    def copy(self, dst: np.ndarray, src: np.ndarray, trace: tuple[Any, ...] | None) -> None:
        """Copy *src* into *dst* (1-D uint8, same length) in parallel pieces; the calling
        thread copies one piece itself."""
        n = dst.shape[0]
        pieces = max(1, min(self.size + 1, n // MIN_PIECE_BYTES))
        bounds = [(i * n // pieces) & ~63 if i < pieces else n for i in range(pieces + 1)]
        done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        for a, b in itertools.pairwise(bounds[1:]):
            self._q.put(functools.partial(_pool_piece, dst[a:b], src[a:b], trace, done))
        first: BaseException | None = None
        try:
            copy_piece(dst[: bounds[1]], src[: bounds[1]], trace, thread_label())
        except BaseException as exc:
            first = exc
        for _ in range(pieces - 1):
            err = done.get()
            if err is not None and first is None:
                first = err
        if first is not None:
            raise first

    def close(self) -> None:
        """Stop and join the threads (queued jobs run first)."""
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()


def thread_label() -> str:
    """The trace stream name of the calling host thread."""
    return f"{HOST_PREFIX} {threading.current_thread().name}"


def _pool_piece(
    dst: np.ndarray,
    src: np.ndarray,
    trace: tuple[Any, ...] | None,
    done: queue.SimpleQueue[BaseException | None],
) -> None:
    try:
        copy_piece(dst, src, trace, thread_label())
    except BaseException as exc:
        done.put(exc)
    else:
        done.put(None)


def copy_piece(dst: np.ndarray, src: np.ndarray, trace: tuple[Any, ...] | None, label: str) -> None:
    if trace is None:
        np.copyto(dst, src)
        return
    rec, name, device, chunk = trace
    t0 = time.perf_counter()
    np.copyto(dst, src)
    rec.host(name, device, label, chunk, t0, time.perf_counter())


class Slot:
    """One staging slot of a device: device buffers, pinned buffers and a stream.

    ``pin_in``/``pin_out`` stage whole chunks (``host_path="staged"``); ``bounce`` holds
    the few bytes at the unaligned ends of a chunk whose pages are registered
    (``host_path="register"``): input at ``[0, 2 pages)``, output at ``[2, 4 pages)``.
    """

    def __init__(self, index: int, stream: Stream) -> None:
        self.index = index
        self.label = f"stream {index}"
        self.stream = stream
        self.d_in: DeviceBuffer | None = None
        self.d_out: DeviceBuffer | None = None
        self.pin_in: np.ndarray | None = None
        self.pin_out: np.ndarray | None = None
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
        self.h2d_done = None
        self.stream.close()


class Progress:
    """How many of a device's chunks the drain thread has finished in this run."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.done = 0

    def advance(self) -> None:
        """One more chunk finished."""
        with self._cond:
            self.done += 1
            self._cond.notify_all()

    def wait_for(self, n: int, stop: threading.Event) -> bool:
        """Wait until *n* chunks finished; False if *stop* was set first (checked every
        10 ms, so an interrupted run never waits on a drain that will not come)."""
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
    process teardown frees everything anyway."""
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


def ensure_buffers(
    dev: DeviceState, in_bytes: int, out_bytes: int, stage_in: bool, stage_out: bool, bounce: bool
) -> None:
    """Grow the slots' device buffers (and the pinned staging/bounce buffers needed)."""
    try:
        for slot in dev.slots:
            slot.d_in = grow_device(slot.d_in, in_bytes, dev.ctx)
            slot.d_out = grow_device(slot.d_out, out_bytes, dev.ctx)
            if stage_in:
                slot.pin_in = grow_pinned(slot.pin_in, in_bytes, dev.ctx)
            if stage_out:
                slot.pin_out = grow_pinned(slot.pin_out, out_bytes, dev.ctx)
            if bounce and slot.bounce is None:
                slot.bounce = pinned_pool().empty((BOUNCE_BYTES,), np.uint8, context=dev.ctx)
    except OutOfMemoryError as exc:
        raise OutOfMemoryError(
            f"Pipeline: cannot allocate {len(dev.slots)} staging slots of {in_bytes} + "
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


def default_host_threads(n_devices: int) -> int:
    """Host threads: 16, leaving one CPU per device worker thread (feeder, drainer) and one
    for the caller; at least 2.

    The staging copies are bound by host memory bandwidth, which every device shares, so
    the count does not grow with the devices. Measured on 2x H200 with 32 CPUs (2 GiB
    float32 pageable in and out, staged, 32 MiB chunks): 1 GPU 17.5 GB/s with 12 threads,
    21.1 GB/s with 16, 15.0 GB/s with 24; 2 GPUs 22.2-23.0 GB/s with 16 and 16.0 GB/s with
    24 (over-subscribed next to the spinning event waits of feeders and drainers).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(2, min(cpus - 2 * n_devices - 1, 16))
