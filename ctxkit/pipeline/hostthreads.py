"""The host threads of a Pipeline: staging copies split into pieces, page registrations.

Two queues feed the threads: *fill* work (input staging copies, registrations ahead of
an H2D) and *drain* work (output staging copies, unregistrations). A thread takes fill
work first: the GPU waits on fills, while a drain may lag as long as its slot is not
needed again. A copy is queued as a :class:`CopyBatch` of pieces and never waited for by
the thread that queued it unless it asks (:meth:`CopyBatch.wait`), so the pieces of
many chunks are in flight at once and no chunk's stragglers idle the other threads.

A closed Pipeline leaves its pool idle for the next one (:func:`take_host_pool`,
:func:`give_back_host_pool`): starting and joining 16 threads cost a new Pipeline about
3-4 ms on an H200 host, 8-10% of a 1 GiB map.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

import numpy as np

from ..memory.streamcopy import copy_streaming
from ..trace import HOST_PREFIX, nvtx_range
from .plan import MiB

__all__ = [
    "MAX_IDLE_POOLS",
    "CopyBatch",
    "HostPool",
    "close_idle_host_threads",
    "copy_piece",
    "default_host_threads",
    "give_back_host_pool",
    "idle_host_pools",
    "take_host_pool",
    "thread_label",
]


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
            try:
                return True, dq.popleft()
            except IndexError:
                pass
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

        def job() -> None:
            try:
                result = fn(*args)
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._put(job, urgent)
        return fut

    def copy_async(
        self,
        dst: np.ndarray,
        src: np.ndarray,
        trace: tuple[Any, ...] | None,
        *,
        name: str = "fill",
        urgent: bool = True,
        stop: threading.Event | None = None,
        on_done: Callable[[CopyBatch], None] | None = None,
        streaming: bool = False,
    ) -> CopyBatch:
        """Queue the copy of *src* into *dst* (1-D uint8, same length) as pieces of at
        least :data:`MIN_PIECE_BYTES`, one per thread at most; return its batch.
        *streaming*: with non-temporal stores (:func:`copy_streaming`)."""
        n = dst.shape[0]
        pieces = max(1, min(self.size, n // MIN_PIECE_BYTES))
        batch = CopyBatch(pieces, stop, on_done)
        a = 0
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

    def copy(self, dst: np.ndarray, src: np.ndarray, trace: tuple[Any, ...] | None) -> None:
        """Copy *src* into *dst* in parallel pieces and wait (the calling thread helps)."""
        self.help_until(self.copy_async(dst, src, trace))

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


class _Idle:
    lock = threading.Lock()
    pools: ClassVar[list[HostPool]] = []


def take_host_pool(n_threads: int) -> HostPool:
    """A host pool of *n_threads* threads: one a closed Pipeline left idle, else new."""
    with _Idle.lock:
        for i, pool in enumerate(_Idle.pools):
            if pool.size == n_threads and pool.reusable:
                return _Idle.pools.pop(i)
    return HostPool(n_threads)


def give_back_host_pool(pool: HostPool) -> None:
    """Keep *pool* idle for a later Pipeline (at most :data:`MAX_IDLE_POOLS`), else close
    it."""
    if pool.reusable:
        with _Idle.lock:
            if len(_Idle.pools) < MAX_IDLE_POOLS:
                _Idle.pools.append(pool)
                return
    pool.close()


def idle_host_pools() -> int:
    """How many idle host pools the process keeps now."""
    with _Idle.lock:
        return len(_Idle.pools)


def close_idle_host_threads() -> int:
    """Join the threads closed Pipelines left idle for later ones; return how many.

    They cost nothing while idle (each waits on a queue); call this to be rid of them,
    e.g. before counting threads or after the last Pipeline a program makes.
    """
    with _Idle.lock:
        pools, _Idle.pools = _Idle.pools, []
    for pool in pools:
        pool.close()
    return sum(pool.size for pool in pools)


def _forget_idle_pools_in_child() -> None:
    # A forked child has none of the parent's threads: its idle pools are empty shells.
    _Idle.lock = threading.Lock()
    _Idle.pools = []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_idle_pools_in_child)


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
    copy = copy_streaming if streaming else np.copyto
    if trace is None:
        copy(dst, src)
        return
    rec, name, device, chunk = trace
    t0 = time.perf_counter()
    copy(dst, src)
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
