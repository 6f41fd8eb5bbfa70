"""Staging of a map's host data: the host threads that copy and register pages, just-in-time
page registration, and the per-device slots of device and pinned buffers.

Host threads: staging copies split into pieces, page registrations. Two queues feed the
threads: *fill* work (input staging copies, registrations ahead of an H2D) and *drain* work
(output staging copies, unregistrations). A thread takes fill work first: the GPU waits on
fills, while a drain may lag as long as its slot is not needed again. A copy is queued as a
:class:`CopyBatch` of pieces and never waited for by the thread that queued it unless it
asks (:meth:`CopyBatch.wait`), so the pieces of many chunks are in flight at once and no
chunk's stragglers idle the other threads.

A closed Pipeline leaves its pool idle for the next one (:func:`take_host_pool`,
:func:`give_back_host_pool`): starting and joining 16 threads cost a new Pipeline about 3-4
ms on an H200 host, 8-10% of a 1 GiB map.

Just-in-time page-locking of the user's pageable arrays (``host_path="register"``): the
whole pages of each chunk (:func:`ctxkit.pipeline.plan.host_pieces`) are registered with
``cuMemHostRegister(PORTABLE)`` on the host pool a few chunks ahead of the feeder, the
chunk's DMA runs straight from/to them, and the drain thread unregisters them once the
chunk's D2H has completed. A page is registered by at most one chunk at a time, and
:meth:`Registrar.finish` undoes every registration of a device before its run returns, also
after an error or Ctrl-C.

Per device: worker threads, streams, slots of device and pinned buffers, an event pool
(:class:`DeviceState`).
"""

from __future__ import annotations

import collections
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .. import _driver
from .._driver import describe, drv, in_forked_child
from ..context import Context
from ..errors import OutOfMemoryError
from ..executor import ContextExecutor
from ..memory.device import DeviceBuffer
from ..memory.host import register_pages as lock_pages
from ..memory.pinned import pinned_pool
from ..memory.streamcopy import copy_streaming
from ..stream import Event, Stream
from ..trace import HOST_PREFIX, Recorder, nvtx_range
from .plan import PAGE, MapPlan, MiB, round_up

__all__ = [
    "NO_USABLE_CONTEXT",
    "CopyBatch",
    "DeviceState",
    "HostPool",
    "Progress",
    "Registrar",
    "Segment",
    "Slot",
    "close_idle_host_threads",
    "default_host_threads",
    "give_back_host_pool",
    "register_pages",
    "relaxed_capture",
    "take_host_pool",
    "unregister_pages",
]


# --- host threads ---

MIN_PIECE_BYTES = 1 * MiB

MAX_IDLE_POOLS = 2
"""Idle host pools kept for later Pipelines; more are closed (their threads joined)."""


T = TypeVar("T")


NVTX_COLORS = {"fill": "yellow", "drain": "orange"}


class CopyBatch:
    """The pieces of one staging copy on the host pool; done when every piece is.

    *stop* (a :class:`threading.Event`) skips the pieces not started when it is set;
    *on_done* is called with the batch by the thread that finishes its last piece,
    before the batch counts as done (a failure of it becomes the batch's error).
    """

    __slots__ = ("_done", "_left", "_lock", "error", "on_done", "stop")

    def __init__(
        self,
        pieces: int,
        stop: threading.Event | None = None,
        on_done: Callable[[CopyBatch], None] | None = None,
    ) -> None:
        self._left = pieces
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.stop = stop
        self.on_done = on_done

    @property
    def done(self) -> bool:
        """True once every piece finished (or was skipped)."""
        return self._done.is_set()

    def piece_done(self, exc: BaseException | None) -> None:
        """One piece finished (*exc*: how it failed; the first failure is kept)."""
        with self._lock:
            if exc is not None and self.error is None:
                self.error = exc
            self._left -= 1
            last = self._left == 0
        if last:
            try:
                if self.on_done is not None:
                    self.on_done(self)
            except BaseException as exc:  # kept, never raised into a pool thread
                if self.error is None:
                    self.error = exc
            finally:
                self._done.set()

    def settle(self) -> None:
        """Wait for every piece, whatever became of them."""
        self._done.wait()

    def wait(self) -> None:
        """Wait for every piece; raise the first piece's failure."""
        self._done.wait()
        if self.error is not None:
            raise self.error


class HostPool:
    """Host threads for the pipeline: parallel copies (``np.copyto``, or
    :func:`copy_streaming` when asked; both release the GIL) and jobs such as page
    registration (:meth:`submit`)."""

    def __init__(self, n_threads: int, prefix: str = "ctxkit-stage") -> None:
        self.size = n_threads
        self.pid = os.getpid()
        # One token per queued job, put after the job: a thread holding a token finds a
        # job unless a helping thread (:meth:`help_until`) ran it, then it waits again.
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._fill: collections.deque[Callable[[], None] | None] = collections.deque()
        self._drain: collections.deque[Callable[[], None] | None] = collections.deque()
        self._threads = [
            threading.Thread(target=self._work, name=f"{prefix}_{i}", daemon=True)
            for i in range(n_threads)
        ]
        for t in self._threads:
            t.start()

    def _put(self, job: Callable[[], None] | None, urgent: bool) -> None:
        (self._fill if urgent else self._drain).append(job)
        self._tokens.put(None)

    def _take(self) -> tuple[bool, Callable[[], None] | None]:
        for dq in (self._fill, self._drain):
            with suppress(IndexError):
                return True, dq.popleft()
        return False, None

    def _work(self) -> None:
        while True:
            self._tokens.get()
            found, job = self._take()
            if not found:
                continue
            if job is None:
                return
            job()
            del job  # an idle thread must not keep the last job's arrays alive

    def submit(self, fn: Callable[..., T], *args: Any, urgent: bool = True) -> Future[T]:
        """Run ``fn(*args)`` on a pool thread; its result or exception lands in the
        Future. *urgent*: queued with the fills (else with the drains)."""
        fut: Future[T] = Future()
        self._put(functools.partial(run_into, fut, fn, *args), urgent)
        return fut

    def copy_async(
        self,
        dst: np.ndarray,
        src: np.ndarray,
        trace: tuple[Any, ...] | None,
        *,
        urgent: bool = True,
        stop: threading.Event | None = None,
        on_done: Callable[[CopyBatch], None] | None = None,
        streaming: bool = False,
    ) -> CopyBatch:
        """Queue the copy of *src* into *dst* (1-D uint8, same length) as pieces of at
        least :data:`MIN_PIECE_BYTES`, one per thread at most; return its batch.
        *urgent*: fill work (an input staging copy), else drain work (an output one).
        *streaming*: with non-temporal stores (:func:`copy_streaming`)."""
        n = dst.shape[0]
        pieces = max(1, min(self.size, n // MIN_PIECE_BYTES))
        batch = CopyBatch(pieces, stop, on_done)
        name, a = "fill" if urgent else "drain", 0
        for i in range(1, pieces + 1):
            b = (i * n // pieces) & ~63 if i < pieces else n
            self._put(_Piece(batch, dst[a:b], src[a:b], trace, name, streaming), urgent)
            a = b
        return batch

    def help_until(self, batch: CopyBatch) -> None:
        """Run queued fill pieces in the calling thread until *batch* is done (then wait
        for its pieces other threads still run); raise its first failure. Other jobs
        (a registration, an allocation) are left to the pool: the caller has GPU work
        to enqueue."""
        while not batch.done:
            try:
                job = self._fill.popleft()
            except IndexError:
                break
            if not isinstance(job, _Piece):
                self._fill.appendleft(job)
                break
            job()
        batch.wait()

    @property
    def reusable(self) -> bool:
        """True when nothing is queued and every thread runs in this process."""
        return (
            self.pid == os.getpid()
            and not self._fill
            and not self._drain
            and all(t.is_alive() for t in self._threads)
        )

    def close(self) -> None:
        """Stop and join the threads (queued jobs run first)."""
        for _ in self._threads:
            self._put(None, urgent=False)
        for t in self._threads:
            t.join()


def run_into(fut: Future[T], fn: Callable[..., T], *args: Any) -> None:
    """Run ``fn(*args)``; its result or exception lands in *fut*."""
    try:
        result = fn(*args)
    except BaseException as exc:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


_idle_lock = threading.Lock()
_idle_pools: list[HostPool] = []
_driver.renew_at_fork(__name__, "_idle_lock")
# A forked child has none of the parent's threads: its idle pools are empty shells.
_driver.renew_at_fork(__name__, "_idle_pools", list)


def take_host_pool(n_threads: int) -> HostPool:
    """A host pool of *n_threads* threads: one a closed Pipeline left idle, else new."""
    with _idle_lock:
        for i, pool in enumerate(_idle_pools):
            if pool.size == n_threads and pool.reusable:
                return _idle_pools.pop(i)
    return HostPool(n_threads)


def give_back_host_pool(pool: HostPool) -> None:
    """Keep *pool* idle for a later Pipeline (at most :data:`MAX_IDLE_POOLS`), else close
    it."""
    if pool.reusable:
        with _idle_lock:
            if len(_idle_pools) < MAX_IDLE_POOLS:
                _idle_pools.append(pool)
                return
    pool.close()


def idle_host_pools() -> int:
    """How many idle host pools the process keeps now."""
    with _idle_lock:
        return len(_idle_pools)


def close_idle_host_threads() -> int:
    """Join the threads closed Pipelines left idle for later ones; return how many.

    They cost nothing while idle (each waits on a queue); call this to be rid of them,
    e.g. before counting threads or after the last Pipeline a program makes.
    """
    with _idle_lock:
        pools = _idle_pools[:]
        _idle_pools.clear()
    for pool in pools:
        pool.close()
    return sum(pool.size for pool in pools)


class _Piece:
    """One piece of a :class:`CopyBatch`, a pool job."""

    __slots__ = ("batch", "dst", "name", "src", "streaming", "trace")

    def __init__(
        self,
        batch: CopyBatch,
        dst: np.ndarray,
        src: np.ndarray,
        trace: tuple[Any, ...] | None,
        name: str,
        streaming: bool,
    ) -> None:
        self.batch, self.dst, self.src, self.trace, self.name = batch, dst, src, trace, name
        self.streaming = streaming

    def __call__(self) -> None:
        batch = self.batch
        failure: BaseException | None = None
        if batch.stop is None or not batch.stop.is_set():
            try:
                with nvtx_range(self.name, NVTX_COLORS.get(self.name, "yellow")):
                    copy_piece(self.dst, self.src, self.trace, thread_label(), self.streaming)
            except BaseException as exc:
                failure = exc
        batch.piece_done(failure)


def thread_label() -> str:
    """The trace stream name of the calling host thread."""
    return f"{HOST_PREFIX} {threading.current_thread().name}"


def copy_piece(
    dst: np.ndarray,
    src: np.ndarray,
    trace: tuple[Any, ...] | None,
    label: str,
    streaming: bool = False,
) -> None:
    """Copy one piece (with non-temporal stores when *streaming*), recording a host
    interval when *trace* is ``(recorder, name, device, chunk)``."""
    t0 = time.perf_counter()
    (copy_streaming if streaming else np.copyto)(dst, src)
    if trace is not None:
        rec, name, device, chunk = trace
        rec.host(name, device, label, chunk, t0, time.perf_counter())


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


# --- page registration ---

REGISTER_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: usable by every context


REGISTER_READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY: the device only reads it


_ALREADY_REGISTERED = 712


NO_USABLE_CONTEXT = -1


def register_pages(ptr: int, nbytes: int, read_only: bool) -> int:
    """``cuMemHostRegister(PORTABLE)`` of whole pages in the current context; memory the
    device only reads is retried ``READ_ONLY`` (read-only mappings refuse the first).
    Returns the CUresult as an int."""
    err = lock_pages(ptr, nbytes, REGISTER_PORTABLE)
    if err and read_only and err != _ALREADY_REGISTERED:
        err = lock_pages(ptr, nbytes, REGISTER_PORTABLE | REGISTER_READ_ONLY)
    return err


@contextmanager
def relaxed_capture() -> Iterator[None]:
    """This thread's stream-capture mode relaxed for the block
    (``cuThreadExchangeStreamCaptureMode``): an unsafe call such as
    ``cuMemHostUnregister`` then neither fails nor invalidates a capture open in this
    thread or, in global mode, in another one. A driver that cannot exchange the mode
    leaves it as it was."""
    try:
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        err, previous = drv.cuThreadExchangeStreamCaptureMode(mode)
    except Exception:
        err, previous = 1, None
    try:
        yield
    finally:
        if not err:
            drv.cuThreadExchangeStreamCaptureMode(previous)


def unregister_pages(ptr: int, contexts: Iterable[Context]) -> int:
    """``cuMemHostUnregister(ptr)`` now, in relaxed capture mode, in the first usable
    context of *contexts* (a ``PORTABLE`` registration is known to every context, so a
    closed or poisoned one can be stood in for; a closed primary context that another
    retainer keeps alive still can, :meth:`~ctxkit.Context.freeing`). Returns the CUresult
    as an int, or :data:`NO_USABLE_CONTEXT`."""
    for ctx in contexts:
        try:
            with ctx.freeing() as live:
                if live:
                    with relaxed_capture():
                        (err,) = drv.cuMemHostUnregister(ptr)
                    return int(err)
        except Exception:
            continue
    return NO_USABLE_CONTEXT


@dataclass(eq=False)
class Segment:
    """Whole pages ``[ptr, ptr + nbytes)`` of a user array, registered for one chunk.

    ``registered`` is done once the registration was tried (True: the pages are
    locked), ``unregistered`` once their unregistration (queued after the DMA) ran;
    ``error`` says why a registration failed.
    """

    ctx: Context
    device: int
    chunk: int
    ptr: int
    nbytes: int
    read_only: bool
    error: str = ""
    registered: Future[bool] = field(default_factory=Future, repr=False)
    unregistered: Future[None] | None = field(default=None, repr=False)


class Registrar:
    """Registers segments on a :class:`HostPool` and unregisters them after their DMA.

    Parameters
    ----------
    pool : HostPool
        Threads that run the (blocking) driver calls in parallel.
    stop : threading.Event
        Set when the run stops: registrations not started yet are skipped.
    recorder : Recorder, optional
        Gets a ``register``/``unregister`` host interval per call.
    """

    def __init__(self, pool: HostPool, stop: threading.Event, recorder: Recorder | None) -> None:
        self.pool = pool
        self.stop = stop
        self.rec = recorder
        self._lock = threading.Lock()
        self._segments: dict[int, list[Segment]] = {}

    def register(self, seg: Segment, here: bool = False) -> None:
        """Queue the registration of *seg* on the pool, or (*here*) run it in the
        calling thread now (see :meth:`wait`)."""
        with self._lock:
            self._segments.setdefault(seg.device, []).append(seg)
        if here:
            run_into(seg.registered, self._register, seg)
        else:
            self.pool.submit(run_into, seg.registered, self._register, seg)

    def wait(self, seg: Segment) -> bool:
        """Wait for *seg*'s registration: True when its pages are locked; False when the
        driver refused (``seg.error`` says why) or the run stopped first."""
        return seg.registered.result()

    def release(self, seg: Segment) -> None:
        """Queue the unregistration of a registered *seg* whose DMA has completed."""
        if seg.unregistered is None and self.wait(seg):
            seg.unregistered = self.pool.submit(self._unregister, seg, urgent=False)

    def finish(self, device: int) -> list[BaseException]:
        """Once *device*'s streams are idle: wait for each of its registrations, undo
        those never released, wait for every unregistration; return the failures."""
        with self._lock:
            segments = self._segments.pop(device, [])
        errors: list[BaseException] = []
        for seg in segments:
            try:
                if seg.unregistered is not None:
                    seg.unregistered.result()
                elif self.wait(seg):
                    self._unregister(seg)
            except BaseException as exc:
                errors.append(exc)
        return errors

    def _register(self, seg: Segment) -> bool:
        if self.stop.is_set():
            seg.error = "the run stopped"
            return False
        t0 = time.perf_counter()
        try:
            with seg.ctx:
                err = register_pages(seg.ptr, seg.nbytes, seg.read_only)
        except Exception as exc:
            seg.error = f"{type(exc).__name__}: {exc}"
            return False
        self._trace("register", seg, t0)
        if err:
            seg.error = describe(int(err))[0]
        return not err

    def _unregister(self, seg: Segment) -> None:
        t0 = time.perf_counter()
        err = unregister_pages(seg.ptr, (seg.ctx,))
        self._trace("unregister", seg, t0)
        if err:
            raise seg.ctx.note_error(
                err, f"cuMemHostUnregister({seg.ptr:#x}) of {seg.nbytes} bytes of chunk {seg.chunk}"
            )

    def _trace(self, name: str, seg: Segment, t0: float) -> None:
        if self.rec is not None:
            self.rec.host(name, seg.device, thread_label(), seg.chunk, t0, time.perf_counter())


# --- per-device state and slots ---

BOUNCE_BYTES = 4 * PAGE


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
    """A lane of the pipeline (a device, or one of several contexts of a device: green
    partitions): its context, worker threads, streams and staging.

    ``lane`` is what its stats and trace rows go by: the device ordinal, or the lane's
    position where the pipeline has several contexts of one device.
    """

    def __init__(self, part: int, ctx: Context, slots: int, lane: int | None = None) -> None:
        self.part = part
        self.ctx = ctx
        self.ordinal = ctx.device.ordinal
        self.lane = self.ordinal if lane is None else lane
        name = f"ctxkit-pipeline-gpu{self.ordinal}"
        self.worker = ContextExecutor(ctx, max_workers=1, thread_name_prefix=name)
        self.drainer = ContextExecutor(ctx, max_workers=1, thread_name_prefix=name + "-drain")
        self.slots = [Slot(i, Stream(context=ctx)) for i in range(slots)]
        self.stage_stream = Stream(context=ctx)
        self.ref_stream = Stream(context=ctx)
        self.events: dict[bool, list[Event]] = {True: [], False: []}
        self.taken: list[Event] = []  # handed out since the last recycle()
        self.clock: tuple[Recorder, Event, float] | None = None
        dev = ctx.device
        per_sm = max(1, dev.attribute("max_threads_per_multiprocessor"))
        self.sm_threads = ctx.sm_count * per_sm  # a green lane fills its own SMs
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

    def take_event(self, timing: bool) -> Event:
        """An event from the pool (or a new one), remembered in :attr:`taken`."""
        pool = self.events[timing]
        ev = pool.pop() if pool else Event(timing=timing, context=self.ctx)
        self.taken.append(ev)
        return ev

    def recycle(self) -> None:
        """Return the events taken so far to the pool (nothing reads them any more: the
        run is over, and so is its trace)."""
        for ev in self.taken:
            self.events[ev.timing].append(ev)
        self.taken.clear()

    def release(self) -> None:
        """Stop the worker threads; free slots, streams and pooled events."""
        self.recycle()
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


def shutdown_all(devices: list[DeviceState], pool: list[HostPool], pins: Any) -> None:
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
    pins.release()


def check_result(dev: DeviceState, result: tuple[Any, ...], what: str) -> None:
    """Raise the error (noted on the device's context) of the driver call *what* made
    for *dev* that returned *result*, the 1-tuple of its status."""
    (err,) = result
    if err:
        raise dev.ctx.note_error(err, what)


def sync_event(dev: DeviceState, ev: Event, what: str) -> None:
    """Wait for *ev* (GIL released); a failure is noted on the device's context."""
    check_result(dev, drv.cuEventSynchronize(ev.handle), what)


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
    rec.calibrate(dev.lane, ev, host_s)
    dev.clock = (rec, ev, host_s)


def ensure_slot(dev: DeviceState, slot: Slot, plan: MapPlan, pool: HostPool | None) -> None:
    """Grow *slot*'s buffers for a run as *plan* says, at the slot's first use in it (the
    first chunk starts after one slot's allocations, not all of them): its device
    buffers, and its input staging or bounce buffer when needed. Its output staging
    buffer is allocated on the host *pool* meanwhile, ready by the chunk's D2H
    (``slot.pin_out_next``)."""
    in_bytes, out_bytes = plan.in_chunk_bytes, plan.out_chunk_bytes
    try:
        slot.d_in = grow_device(slot.d_in, in_bytes, dev.ctx)
        slot.d_out = grow_device(slot.d_out, out_bytes, dev.ctx)
        if plan.stage_in:
            slot.pin_in = grow_pinned(slot.pin_in, in_bytes, dev.ctx)
        if plan.bounces and slot.bounce is None:
            slot.bounce = pinned_pool().empty((BOUNCE_BYTES,), np.uint8, context=dev.ctx)
    except OutOfMemoryError as exc:
        msg = (
            f"Pipeline: cannot allocate staging slot {slot.index} of {in_bytes} + "
            f"{out_bytes} bytes on device {dev.ordinal}: {exc}. Use a smaller chunk_bytes "
            "or fewer staging_buffers"
        )
        raise OutOfMemoryError(msg, exc.code, exc.name) from exc
    out = slot.pin_out
    if plan.stage_out and (out is None or out.nbytes < out_bytes):
        assert pool is not None
        slot.pin_out_next = pool.submit(grow_pinned, out, out_bytes, dev.ctx)


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
