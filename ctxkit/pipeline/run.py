"""Carrying out one map: the run state its worker threads share (:class:`Run`), a chunk as
its device processes it (:class:`ChunkJob`), the feeder (:func:`feed`) and drain thread
(:func:`drain`) of each device, the split input path (:class:`Split`), the kernel launcher,
the progress bar, and the result and error types (re-exported by ``ctxkit.pipeline``).

Per device, a feeder thread enqueues every chunk (host input -> H2D -> kernel -> D2H) and a
drain thread waits for each chunk's last event, finishes its host output and unregisters its
pages. Both run with the device's context current; :meth:`Run.execute` starts them and
waits for them in short timed waits, so that Ctrl-C stops the run promptly, yet it never
returns while a worker may still touch the arrays.

The feeder starts chunks ahead of the GPU (:class:`Starter`: claims them, begins
registering the pages of their registered sides, queues the staging copies of their inputs
on the host pool), then enqueues each chunk's H2D -> kernel -> D2H on its slot's stream
(prefetch -> kernel -> prefetch back over unified memory) and hands it to the drain thread.
The drain thread waits for each chunk's D2H, then queues the staging copy of its output on
the host pool (the slot is free again when that copy is done) or copies the chunk's bounced
bytes itself, and unregisters the chunk's pages; when the device's feeder is done it
synchronizes the slot streams and undoes the device's remaining registrations, so nothing of
the run is in flight once ``map`` returns.

Nothing waits chunk by chunk on the host pool: the feeder queues the input fills of
every chunk whose slot is free and enqueues chunk *k*'s H2D as soon
as *k*'s pieces are done (helping with fill pieces meanwhile); the drain thread queues
chunk *k*'s output drain after its D2H and moves on; the slot is free again when that
drain's last piece finishes (:class:`~ctxkit.pipeline.staging.Progress`). A slot's
buffers are allocated at its first chunk.

Host data of a side (input or output) moves one of five ways (the map's
:class:`~ctxkit.pipeline.plan.MapPlan` says which):

* ``pinned``: the user's array is page-locked already; copies use it directly;
* ``held``: the user's array kept locked by pin on reuse
  (:mod:`ctxkit.pipeline.pincache`) and used directly;
* ``staged``: through a pinned staging buffer of the slot, filled (input) or drained
  (output) by the host copy pool;
* ``register``: the chunk's whole pages are registered ahead of time by the host pool
  and DMAed directly; the partial pages at the chunk's ends go through the slot's small
  bounce buffer. A chunk whose pages the driver refuses to register is staged instead;
* ``split`` (input): ``register`` for the chunks a host-pool thread registered from the
  device's last chunk backwards before the feeder got there, ``staged`` for the rest.

``split`` exists because staging costs two host memory copies per byte and the host pool's
threads, while registering pages (``cuMemHostRegister``) lets the H2D read the user's pages
directly but one thread registers about as fast as several (the driver serializes it). So
one host-pool thread registers a device's input chunks from its last one backwards while the
feeder stages them from the first one forwards on the other threads; each chunk goes one
way, decided under a lock by whichever of the two reaches it first. Registered chunks are
unregistered after their D2H, like ``host_path="register"`` does.

A device never has more than ``staging_buffers`` chunks (twice that when nothing is
staged) past their D2H enqueue and not yet drained, so stopping a run waits for at most
those chunks. A failure names the step it happened in (:class:`Step`). The progress bar of
``map(..., progress=True)`` counts finished chunks, shown with tqdm when it is installed (an
optional extra, imported at the first bar), else as one line on stderr rewritten in place.
"""

from __future__ import annotations

import collections
import functools
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import _driver
from .._driver import drv
from ..errors import ContextPoisonedError, LaunchArgumentError, PipelineError
from ..memory.streamcopy import streaming_pays
from ..module.kernel import Kernel
from ..stream import Stream
from ..trace import Recorder, nvtx_range
from .plan import (
    PAGE,
    Chunk,
    HostPieces,
    MapPlan,
    addr,
    grid_size,
    host_pieces,
    row_bytes,
)
from .staging import (
    CopyBatch,
    DeviceState,
    HostPool,
    Progress,
    Registrar,
    Segment,
    Slot,
    calibrate,
    check_result,
    ensure_slot,
    grow_pinned,
    sync_event,
)

__all__ = [
    "ChunkView",
    "DeviceStats",
    "Run",
    "RunStats",
    "drain",
    "feed",
    "make_launcher",
    "run_stats",
]


# --- results and errors ---


def chunk_error(
    device: int, ctx_poisoned: bool, chunk: Any, step: str, exc: BaseException
) -> PipelineError:
    """The PipelineError of a failed chunk (``chunk=None``: the device's setup)."""
    poisoned = isinstance(exc, ContextPoisonedError) or ctx_poisoned
    where = (
        f"chunk {chunk.index} (rows {chunk.row0}..{chunk.row1})" if chunk is not None else "setup"
    )
    msg = f"Pipeline.map failed on device {device}, {where}, step {step!r}: {exc}"
    if poisoned:
        msg += (
            f"\nThe context of device {device} is poisoned (a kernel faulted; other "
            "chunks running at the same time may have caused it): this pipeline cannot be "
            "used again. close() it; the device needs a fresh context (restart the process)."
        )
    return PipelineError(msg, device, chunk.index if chunk else None, step, exc, poisoned)


@dataclass
class DeviceStats:
    """What one device did in the last run."""

    device: int
    chunks: int = 0
    rows: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Input gigabytes (1e9) per second of this device's worker time."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class RunStats:
    """Totals of the last run: input bytes, wall seconds and the per-device breakdown.

    ``path`` says how host data moved: ``"pinned"``, ``"managed"``, or per side
    ``"in=<how>, out=<how>"`` with ``staged``, ``registered``, ``pinned`` or ``held``
    (kept page-locked between calls by pin on reuse).
    ``fallbacks`` counts chunk sides of a registered path that were staged instead
    because the driver refused to register their pages.
    """

    nbytes: int = 0
    seconds: float = 0.0
    path: str = ""
    devices: list[DeviceStats] = field(default_factory=list)
    fallbacks: int = 0

    @property
    def gbps(self) -> float:
        """Input gigabytes (1e9) per wall-clock second."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class ChunkView:
    """One chunk's device (or managed) memory, handed to a callable map body.

    Has ``.ptr``, ``.shape``, ``.dtype``, ``.size``, ``.nbytes`` and
    ``__cuda_array_interface__`` (v3), so it can be passed to ``Kernel.launch`` or
    wrapped by CuPy/Numba/PyTorch without a copy.
    """

    __slots__ = ("dtype", "ptr", "shape")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.ptr = int(ptr)
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.size * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
        }

    def __repr__(self) -> str:
        return f"<ChunkView {self.ptr:#x} shape={self.shape} dtype={self.dtype}>"


# --- progress bar ---


class Bar(Protocol):
    """What a map needs of a progress bar (a tqdm bar has both)."""

    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


#: The line bar rewrites its line at most this often (the last chunk always shows).
LINE_INTERVAL_S = 0.1


class LineBar:
    """``ctxkit map: 12/40 chunks (30%)`` on *stream* (default stderr), rewritten in place
    with a carriage return; safe to update from several drain threads."""

    def __init__(self, total: int, desc: str = "ctxkit map", stream: Any = None) -> None:
        self.total = total
        self.desc = desc
        self.n = 0
        self._stream = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()
        self._shown = 0.0
        self._closed = False
        self._draw()

    def update(self, n: int = 1) -> None:
        """*n* more chunks finished."""
        with self._lock:
            self.n += n
            now = time.monotonic()
            if self.n >= self.total or now - self._shown >= LINE_INTERVAL_S:
                self._shown = now
                self._draw()

    def close(self) -> None:
        """Show the final count and end the line. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._draw("\n")

    def _draw(self, end: str = "") -> None:
        pct = 100 * self.n // self.total if self.total else 100
        self._stream.write(f"\r{self.desc}: {self.n}/{self.total} chunks ({pct}%){end}")
        self._stream.flush()


def make_bar(total: int, desc: str = "ctxkit map") -> Bar:
    """A bar counting *total* chunks: ``tqdm.tqdm`` when importable, else :class:`LineBar`."""
    try:
        from tqdm import tqdm
    except ImportError:
        return LineBar(total, desc)
    return tqdm(total=total, desc=desc, unit="chunk")


# --- kernel launcher and step tags ---


def make_launcher(
    kernel: Any, x: np.ndarray, out: np.ndarray, args: tuple[Any, ...], block: int
) -> Callable[..., None]:
    """``launch(dev, stream, d_in, d_out, n, chunk)`` for a Kernel or a callable body."""
    if isinstance(kernel, Kernel):
        check_param_count(kernel, args)

        def launch_kernel(
            dev: DeviceState, s: Stream, d_in: int, d_out: int, n: int, c: Chunk
        ) -> None:
            grid = grid_size(n, block, dev.max_blocks(block))
            kernel.launch(grid, block, d_in, d_out, n, *args, stream=s)

        return launch_kernel
    if callable(kernel):
        in_tail, out_tail = x.shape[1:], out.shape[1:]
        in_dtype, out_dtype = x.dtype, out.dtype  # not the arrays: keep them collectable

        def launch_body(
            dev: DeviceState, s: Stream, d_in: int, d_out: int, n: int, c: Chunk
        ) -> None:
            kernel(
                dev.ctx,
                s,
                ChunkView(d_in, (c.rows, *in_tail), in_dtype),
                ChunkView(d_out, (c.rows, *out_tail), out_dtype),
                n,
                *args,
            )

        return launch_body
    raise TypeError(
        "kernel must be a ctxkit Kernel, an (ObjectCode, 'entry') pair or a callable "
        f"body(ctx, stream, d_in, d_out, n); got {type(kernel).__name__}"
    )


class Stopped(Exception):
    """Internal: the run was stopped while a worker waited."""


class Step:
    """Tag an exception raised in the block with the pipeline step it happened in (the
    innermost step names it); :meth:`Run.fail` reports it."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and not hasattr(exc, "_ctxkit_step"):
            with suppress(AttributeError):
                exc._ctxkit_step = self.name  # type: ignore[attr-defined]


def _unblock_if_not_run(q: queue.SimpleQueue[Any], feeder: Future[Any]) -> None:
    """A feeder task that never ran (its worker could not start) still ends the drainer."""
    if feeder.cancelled() or feeder.exception() is not None:
        q.put(None)


INTERRUPT_POLL_S = 0.05


def _result_interruptibly(f: Future[Any]) -> Any:
    """``f.result()``, with Ctrl-C handled within :data:`INTERRUPT_POLL_S`.

    A signal that arrives just before a thread blocks on a lock without a timeout is only
    handled once the lock is released (CPython checks pending signals between bytecodes,
    not before the wait): ``map`` would run to its end before raising KeyboardInterrupt.
    Short timed waits bound that delay.
    """
    while not f.done():
        wait_futures([f], timeout=INTERRUPT_POLL_S)
    return f.result()


def check_param_count(kernel: Kernel, args: tuple[Any, ...]) -> None:
    try:
        want = len(kernel.params)
    except Exception:  # no PTX signature to check against (e.g. a bare cubin)
        return
    if want != 3 + len(args):
        name = getattr(kernel, "name", "kernel")
        raise LaunchArgumentError(
            f"Pipeline.map calls {name}(d_in, d_out, n, *args) with {3 + len(args)} "
            f"arguments but {name} takes {want}: pass its extra parameters with "
            f"args=(...) (got args={args!r})"
        )


# --- run state ---


@dataclass(slots=True)
class ChunkJob:
    """One chunk as its device processes it: the staging copy of its input queued on the
    host pool, pieces and segments of held and registered sides."""

    chunk: Chunk
    fill: CopyBatch | None = None
    in_pieces: HostPieces | None = None
    out_pieces: HostPieces | None = None
    in_seg: Segment | None = None
    out_seg: Segment | None = None

    def segments(self) -> list[Segment]:
        """The distinct segments of the chunk (one when input and output share pages)."""
        segs = [s for s in (self.in_seg, self.out_seg) if s is not None]
        return segs[:1] if len(segs) == 2 and segs[0] is segs[1] else segs


class Run:
    """The state shared by the worker threads of one map call, carried out as *plan*
    says (its modes, chunks and how far feeders claim ahead); *fresh_out*: the map made
    *out* itself with ``np.empty_like`` (its pages not yet touched)."""

    def __init__(
        self,
        x: np.ndarray,
        out: np.ndarray,
        plan: MapPlan,
        launch: Callable[..., None],
        recorder: Recorder | None,
        fresh_out: bool = False,
    ) -> None:
        self.pool: HostPool | None = None
        self.registrar: Registrar | None = None
        self.x = x
        self.out = out
        self.x_bytes = x.reshape(-1).view(np.uint8)
        self.out_bytes = out.reshape(-1).view(np.uint8)
        self.x_ptr = addr(x)
        self.out_ptr = addr(out)
        self.in_place = self.x_ptr == self.out_ptr and x.nbytes == out.nbytes
        self.stream_in = streaming_pays(x.nbytes)
        # a fresh output (np.empty_like, made by the map) is first touched by the drain,
        # whose page faults leave the zeroed lines in the cache, where plain stores beat
        # non-temporal ones (H200: 70 ms less per GiB)
        self.stream_out = streaming_pays(out.nbytes) and not fresh_out
        self.in_row = row_bytes(x)
        self.out_row = row_bytes(out)
        self.row_elems = math.prod(x.shape[1:])
        self.plan = plan
        self.in_mode, self.out_mode = plan.in_mode, plan.out_mode
        self.launch = launch
        self.rec = recorder
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.stats: dict[int, DeviceStats] = {}
        self.progress: dict[int, Progress] = {}
        self.started: dict[int, float] = {}
        self.fallbacks = 0
        self.bar: Bar | None = None
        self._bar_lock = threading.Lock()
        self._queue = iter(plan.chunks)

    def execute(self, devices: list[DeviceState], pool: HostPool | None, progress: bool) -> None:
        """Run a feeder and a drain thread on each of *devices* (the plan's active ones;
        *pool*: the host threads, when the plan needs them) and wait for them in short
        timed waits, so that Ctrl-C stops the run promptly, yet never return while a
        worker may still touch the arrays. Failures are left in :attr:`errors`."""
        self.pool = pool
        if self.plan.registers:
            assert pool is not None
            self.registrar = Registrar(pool, self.stop, self.rec)
        if progress:
            self.bar = make_bar(len(self.plan.chunks))
        futures: list[Future[Any]] = []
        try:
            for dev in devices:
                q: queue.SimpleQueue[Any] = queue.SimpleQueue()
                self.stats[dev.lane] = DeviceStats(dev.ordinal)
                self.progress[dev.lane] = Progress()
                feeder = dev.worker.submit(feed, self, dev, q)
                feeder.add_done_callback(functools.partial(_unblock_if_not_run, q))
                futures.append(feeder)
                futures.append(dev.drainer.submit(drain, self, dev, q))
            for f in futures:
                _result_interruptibly(f)
        except BaseException:
            # However many more Ctrl-C arrive meanwhile (the first one is what map
            # raises), the workers must be done before map is back in the caller's hands.
            while True:
                try:
                    self.stop.set()
                    wait_futures(futures)
                    break
                except BaseException:
                    continue
            raise
        finally:
            self.drop_arrays()
            if self.bar is not None:
                self.bar.close()

    def drop_arrays(self) -> None:
        """The run is over: stop referencing the user's arrays (the pipeline keeps the
        finished run for its trace events)."""
        self.x = self.out = self.x_bytes = self.out_bytes = np.empty(0, np.uint8)

    def chunk_finished(self) -> None:
        """Advance the progress bar (drain threads of every device call this)."""
        if self.bar is not None:
            with self._bar_lock:
                self.bar.update(1)

    def chunks_for(self, part: int) -> Iterator[Chunk]:
        """The chunks device slot *part* processes (taken from a shared queue if dynamic)."""
        if self.plan.schedule == "static":
            yield from self.plan.for_part(part)
            return
        while not self.stop.is_set():
            with self.lock:
                chunk = next(self._queue, None)
            if chunk is None:
                return
            yield chunk

    def note_fallback(self) -> None:
        """A registered side of a chunk is staged instead."""
        with self.lock:
            self.fallbacks += 1

    def fail(self, dev: DeviceState, chunk: Chunk | None, step: str, exc: BaseException) -> None:
        """Record a failure (as a PipelineError naming device and chunk) and stop the run."""
        self.stop.set()
        if isinstance(exc, Exception) and not isinstance(exc, PipelineError):
            exc = chunk_error(dev.ordinal, dev.ctx.poisoned, chunk, step, exc)
        with self.lock:
            self.errors.append(exc)


def run_stats(run: Run, seconds: float, nbytes: int) -> RunStats:
    """The :class:`RunStats` of a finished run."""
    devices = [run.stats[k] for k in sorted(run.stats)]
    return RunStats(nbytes, seconds, run.plan.path, devices, run.fallbacks)


# --- split input path ---


class Split:
    """The meeting of a device's feeder (staging from the front) and its background
    registrar (registering from the back) over the device's input chunks."""

    def __init__(self, run: Run, dev: DeviceState, chunks: list[Chunk]) -> None:
        assert run.pool is not None and run.registrar is not None
        self._run = run
        self._dev = dev
        self._lock = threading.Lock()
        self._staged: set[int] = set()
        self._registered: dict[int, tuple[HostPieces, Segment | None]] = {}
        self._job: Future[None] = run.pool.submit(self._register_backwards, chunks, run.registrar)

    def take(self, c: Chunk) -> tuple[HostPieces, Segment | None] | None:
        """The feeder reached chunk *c*: its pieces and segment when the registrar got
        there first (its registration may still run: :meth:`Registrar.wait`), else None
        and the chunk is the feeder's to stage (the registrar stops there)."""
        with self._lock:
            got = self._registered.get(c.index)
            if got is None:
                self._staged.add(c.index)
            return got

    def settle(self) -> None:
        """Wait until the registrar stopped (it stops at the first chunk taken for
        staging, at the run's stop, or after the device's first chunk)."""
        self._job.exception()

    def _register_backwards(self, chunks: list[Chunk], registrar: Registrar) -> None:
        run, dev = self._run, self._dev
        for c in reversed(chunks):
            if run.stop.is_set():
                return
            pieces = host_pieces(run.x_ptr, run.x.nbytes, c.row0 * run.in_row, c.row1 * run.in_row)
            seg = _segment(dev, c, pieces, not run.in_place)
            with self._lock:
                if c.index in self._staged:
                    return
                self._registered[c.index] = (pieces, seg)
            if seg is not None:  # registered here, one chunk after the other
                registrar.register(seg, here=True)


# --- feeder ---


class Starter:
    """The chunks a feeder started and has not enqueued yet, oldest first.

    Starting a chunk claims it, begins registering its registered sides and queues the
    staging copy of a staged input on the host pool (fill work), so the fills of up to
    ``plan.ahead`` chunks run while the feeder waits for the oldest one. A staged input
    needs its slot's input buffer: chunk ``p`` starts once chunk ``p - staging_buffers``
    (the slot's previous user) was enqueued and its H2D has read the buffer.
    """

    def __init__(self, run: Run, dev: DeviceState) -> None:
        self.run = run
        self.dev = dev
        self.split: Split | None = None
        self.jobs: collections.deque[ChunkJob] = collections.deque()
        self._claimed = run.chunks_for(dev.part)
        self._next = 0
        self._exhausted = False

    def top_up(self, enqueued: int) -> None:
        """Start chunks while the plan allows; *enqueued* chunks were enqueued so far."""
        run, dev = self.run, self.dev
        n_slots = len(dev.slots)
        stage_in = run.plan.stage_in
        while not self._exhausted and len(self.jobs) < run.plan.ahead:
            p = self._next
            slot = dev.slots[p % n_slots]
            if stage_in and not self._input_free(slot, p, enqueued):
                return
            if (c := next(self._claimed, None)) is None:
                self._exhausted = True
                return
            if p < n_slots and not run.plan.managed:
                with Step("setup"):
                    ensure_slot(dev, slot, run.plan, run.pool)
            job = _claim(run, dev, c)
            self.jobs.append(job)  # before the fill: settle() must see its batch
            self._next += 1
            got = self.split.take(c) if self.split is not None else None
            if got is not None:  # registered from the far end: DMAed directly
                job.in_pieces, job.in_seg = got
            elif stage_in:
                job.fill = _fill(run, dev, slot, c)

    def _input_free(self, slot: Slot, p: int, enqueued: int) -> bool:
        if p - len(self.dev.slots) >= enqueued:
            return False
        if slot.h2d_done is None:
            return True
        if self.jobs:
            return slot.h2d_done.query()
        _wait_h2d(self.dev, slot, p)
        return True

    def settle(self) -> None:
        """Wait for the started fills (skipped once the run stopped) to leave the pool."""
        for job in self.jobs:
            if job.fill is not None:
                job.fill.settle()


def feed(run: Run, dev: DeviceState, q: queue.SimpleQueue[Any]) -> None:
    """Worker thread of *dev*: enqueue every chunk (runs with dev's context current)."""
    chunk: Chunk | None = None
    stats = run.stats[dev.lane]
    run.started[dev.lane] = time.perf_counter()
    starter = Starter(run, dev)
    try:
        with Step("setup"):
            for slot in dev.slots:
                slot.h2d_done = None
            if run.rec is not None and not run.rec.calibrated(dev.lane):
                calibrate(dev, run.rec)
        if run.in_mode == "split":
            starter.split = Split(run, dev, run.plan.for_part(dev.part))
        k = 0
        while not run.stop.is_set():
            starter.top_up(k)
            if not starter.jobs:
                break
            job = starter.jobs[0]
            chunk = job.chunk
            _enqueue(run, dev, dev.slots[k % len(dev.slots)], job, q, k)
            starter.jobs.popleft()
            k += 1
            stats.chunks += 1
            stats.rows += chunk.rows
            stats.nbytes += chunk.rows * run.in_row
        chunk = None
    except Stopped:
        pass
    except BaseException as exc:
        run.fail(dev, chunk, getattr(exc, "_ctxkit_step", "enqueue"), exc)
    finally:
        if starter.split is not None:
            starter.split.settle()
        starter.settle()
        q.put(None)


def _fill(run: Run, dev: DeviceState, slot: Slot, c: Chunk) -> CopyBatch:
    """Queue the staging copy of chunk *c*'s input into *slot* (fill work)."""
    nb, b0 = c.rows * run.in_row, c.row0 * run.in_row
    assert slot.pin_in is not None
    return _stage(run, dev, c, slot.pin_in[:nb], run.x_bytes[b0 : b0 + nb], True)


def _stage(
    run: Run,
    dev: DeviceState,
    c: Chunk,
    dst: np.ndarray,
    src: np.ndarray,
    fill: bool,
    on_done: Callable[[CopyBatch], None] | None = None,
) -> CopyBatch:
    """Queue a staging copy of chunk *c* on the host pool: its input's fill, or its
    output's drain (*on_done*: see :class:`CopyBatch`)."""
    assert run.pool is not None
    name = "fill" if fill else "drain"
    trace = (run.rec, name, dev.lane, c.index) if run.rec is not None else None
    streaming = run.stream_in if fill else run.stream_out
    return run.pool.copy_async(
        dst, src, trace, urgent=fill, stop=run.stop, on_done=on_done, streaming=streaming
    )


def _claim(run: Run, dev: DeviceState, c: Chunk) -> ChunkJob:
    """A job for chunk *c*: the pieces of its held and registered sides (the pages of
    registered ones start registering now)."""
    job = ChunkJob(c)
    if run.plan.managed:
        return job
    job.in_pieces, job.in_seg = _side(
        run, dev, c, run.in_mode, run.x_ptr, run.x.nbytes, run.in_row, not run.in_place
    )
    if run.in_place and run.in_mode == run.out_mode == "register":
        job.out_pieces, job.out_seg = job.in_pieces, job.in_seg  # the same pages
    else:
        job.out_pieces, job.out_seg = _side(
            run, dev, c, run.out_mode, run.out_ptr, run.out.nbytes, run.out_row, False
        )
    return job


def _side(
    run: Run, dev: DeviceState, c: Chunk, mode: str, base: int, total: int, row: int, ro: bool
) -> tuple[HostPieces | None, Segment | None]:
    """How chunk *c* of one side moves when its pages are held or registered (else
    ``(None, None)``); a registered side's segment starts registering now (*ro*: the
    device only reads it)."""
    b0, b1 = c.row0 * row, c.row1 * row
    if mode == "held":
        return HostPieces(0, b1 - b0, 0, base + b0, b1 - b0), None  # all of it registered
    if mode != "register":
        return None, None
    pieces = host_pieces(base, total, b0, b1)
    if (seg := _segment(dev, c, pieces, ro)) is not None:
        assert run.registrar is not None
        run.registrar.register(seg)
    return pieces, seg


def _segment(dev: DeviceState, c: Chunk, pieces: HostPieces, ro: bool) -> Segment | None:
    """The segment of chunk *c*'s registered pages (None: it owns no whole page)."""
    if not pieces.seg_len:
        return None
    return Segment(dev.ctx, dev.lane, c.index, pieces.seg_ptr, pieces.seg_len, ro)


def _registered(run: Run, seg: Segment | None) -> bool:
    if seg is None:
        return True
    assert run.registrar is not None
    if not (ok := run.registrar.wait(seg)):
        run.note_fallback()
    return ok


def _enqueue(
    run: Run, dev: DeviceState, slot: Slot, job: ChunkJob, q: queue.SimpleQueue[Any], k: int
) -> None:
    """Enqueue chunk *k* of the device on *slot*'s stream: H2D -> kernel -> D2H, or
    over unified memory prefetch -> kernel -> prefetch back, between events; hand it to
    the drain thread."""
    c = job.chunk
    s = slot.stream
    rec, timing = run.rec, run.rec is not None
    managed = run.plan.managed
    if managed:
        _wait_window(run, dev, k, False)
        d_in, d_out = run.x_ptr + c.row0 * run.in_row, run.out_ptr + c.row0 * run.out_row
        nb_in, nb_out = c.rows * run.in_row, c.rows * run.out_row
    else:
        assert slot.d_in is not None and slot.d_out is not None
        d_in, d_out = slot.d_in.ptr, slot.d_out.ptr
        h2d = _input(run, dev, slot, job)
    e0 = dev.take_event(True).record(s) if timing else None
    if managed:
        if dev.prefetch_ok and run.plan.prefetch:
            with Step("prefetch"):
                _driver.mem_prefetch(d_in, nb_in, dev.ordinal, s.handle)
                if d_out != d_in:
                    _driver.mem_prefetch(d_out, nb_out, dev.ordinal, s.handle)
        e1 = dev.take_event(True).record(s) if timing else None
    else:
        with nvtx_range("h2d", "green"), Step("h2d"):
            for off, src, n in h2d:
                result = drv.cuMemcpyHtoDAsync(d_in + off, src, n, s.handle)
                check_result(dev, result, "cuMemcpyHtoDAsync")
        e1 = slot.h2d_done = dev.take_event(timing).record(s)
    with nvtx_range("kernel", "blue"), Step("kernel"):
        run.launch(dev, s, d_in, d_out, c.rows * run.row_elems, c)
    e2 = dev.take_event(True).record(s) if timing else None
    if managed:
        out_mode = "managed"
        if dev.prefetch_ok and run.plan.to_host:
            with Step("prefetch"):
                _driver.mem_prefetch(d_out, nb_out, "cpu", s.handle)
    else:
        out_mode, d2h = _output(run, dev, slot, job, k)
        with nvtx_range("d2h", "red"), Step("d2h"):
            for dst, off, n in d2h:
                result = drv.cuMemcpyDtoHAsync(dst, d_out + off, n, s.handle)
                check_result(dev, result, "cuMemcpyDtoHAsync")
    e3 = dev.take_event(timing).record(s)
    q.put((job, slot, e3, out_mode, k))
    if rec is not None:
        first, last = ("prefetch", "prefetch_back") if managed else ("h2d", "d2h")
        for name, start, end in ((first, e0, e1), ("kernel", e1, e2), (last, e2, e3)):
            rec.mark(name, dev.lane, slot.label, c.index, start, end)


def _input(run: Run, dev: DeviceState, slot: Slot, job: ChunkJob) -> list[tuple[int, int, int]]:
    """Prepare the chunk's input on the host; the H2D copies ``(d_in offset, src, n)``."""
    c = job.chunk
    nb, b0 = c.rows * run.in_row, c.row0 * run.in_row
    if run.in_mode == "pinned":
        return [(0, run.x_ptr + b0, nb)]
    pc = job.in_pieces  # held or registered pages (staged: None)
    if pc is not None and _registered(run, job.in_seg):
        if pc.bounced:
            _wait_h2d(dev, slot, c.index)
            bounce = slot.bounce_in
            src = run.x_bytes[b0 : b0 + nb]
            bounce[: pc.head] = src[: pc.head]
            bounce[PAGE : PAGE + pc.tail] = src[nb - pc.tail :]
        return _pieces(pc, addr(slot.bounce_in) if pc.bounced else 0, run.x_ptr + b0)
    with Step("fill"):
        if job.fill is None:  # a registration the driver refused: staged here
            _wait_h2d(dev, slot, c.index)
            slot.pin_in = grow_pinned(slot.pin_in, nb, dev.ctx)
            job.fill = _fill(run, dev, slot, c)
        assert run.pool is not None and slot.pin_in is not None
        run.pool.help_until(job.fill)
    return [(0, addr(slot.pin_in), nb)]


def _output(
    run: Run, dev: DeviceState, slot: Slot, job: ChunkJob, k: int
) -> tuple[str, list[tuple[int, int, int]]]:
    """Wait until the chunk may write its host output; the mode used and the D2H copies
    ``(dst, d_out offset, n)``."""
    c = job.chunk
    nb, b0 = c.rows * run.out_row, c.row0 * run.out_row
    mode = run.out_mode
    pc = job.out_pieces
    if mode == "register" and (pc is None or not _registered(run, job.out_seg)):
        mode = "staged"
    into_slot = mode == "staged" or (pc is not None and pc.bounced > 0)
    _wait_window(run, dev, k, into_slot)
    if mode == "pinned":
        return mode, [(run.out_ptr + b0, 0, nb)]
    if mode == "staged":
        with Step("d2h"):
            if slot.pin_out_next is not None:
                nxt, slot.pin_out_next = slot.pin_out_next, None
                slot.pin_out = nxt.result()
            slot.pin_out = grow_pinned(slot.pin_out, nb, dev.ctx)
        return mode, [(addr(slot.pin_out), 0, nb)]
    assert pc is not None
    bounce = addr(slot.bounce_out) if pc.bounced else 0
    return mode, [(dst, off, n) for off, dst, n in _pieces(pc, bounce, run.out_ptr + b0)]


def _wait_window(run: Run, dev: DeviceState, k: int, into_slot: bool) -> None:
    """Before the D2H of the device's chunk *k*: wait until chunk ``k - staging_buffers``
    (whose slot buffers chunk *k* reuses) is drained, or ``k - 2 * staging_buffers``
    when chunk *k* writes no slot buffer; this bounds the work in flight."""
    window = len(dev.slots) * (1 if into_slot else 2)
    if not run.progress[dev.lane].wait_for(k - window + 1, run.stop):
        raise Stopped


def _pieces(pc: HostPieces, bounce: int, host: int) -> list[tuple[int, int, int]]:
    """``(device offset, host address, n)`` of the head, direct and tail pieces."""
    pieces = [
        (0, bounce, pc.head),
        (pc.head, host + pc.head, pc.direct),
        (pc.head + pc.direct, bounce + PAGE, pc.tail),
    ]
    return [p for p in pieces if p[2]]


def _wait_h2d(dev: DeviceState, slot: Slot, index: int) -> None:
    """Wait until the slot's previous H2D has read its host buffers (before chunk
    *index* uses them)."""
    if slot.h2d_done is not None:
        sync_event(dev, slot.h2d_done, f"waiting for the H2D copy before chunk {index}")


# --- drainer ---


def drain(run: Run, dev: DeviceState, q: queue.SimpleQueue[Any]) -> None:
    """Drain thread of *dev*: wait for each chunk's D2H, then queue the staging copy of
    its output on the host pool (drain work; it finishes the chunk when done) or finish
    it here, unregister its pages (runs with dev's context current)."""
    progress = run.progress[dev.lane]
    copies: collections.deque[CopyBatch] = collections.deque()
    try:
        for job, slot, ev, mode, k in iter(q.get, None):
            queued = False
            try:
                if run.stop.is_set():
                    continue
                sync_event(dev, ev, f"cuEventSynchronize after chunk {job.chunk.index}")
                if mode == "staged":
                    copies.append(_drain_staged(run, dev, slot, job.chunk, k))
                    queued = True
                    while copies and copies[0].done:
                        copies.popleft()
                else:
                    _finish_output(run, slot, job)
                if run.registrar is not None:
                    for seg in job.segments():
                        run.registrar.release(seg)
            except BaseException as exc:
                step = "drain" if mode in ("staged", "register") else "kernel"
                run.fail(dev, job.chunk, step, exc)
            finally:
                if not queued:
                    progress.advance(k)
                    run.chunk_finished()
    finally:
        for batch in copies:
            batch.settle()
        _finish_device(run, dev)


def _drain_staged(run: Run, dev: DeviceState, slot: Slot, c: Chunk, k: int) -> CopyBatch:
    """Queue the copy of chunk *c*'s output from *slot* into the user's array; the slot
    is free for chunk ``k + staging_buffers`` once it is done."""
    nb, b0 = c.rows * run.out_row, c.row0 * run.out_row
    assert slot.pin_out is not None
    done = functools.partial(_drained, run, dev, c, k)
    return _stage(run, dev, c, run.out_bytes[b0 : b0 + nb], slot.pin_out[:nb], False, on_done=done)


def _drained(run: Run, dev: DeviceState, c: Chunk, k: int, batch: CopyBatch) -> None:
    try:
        if batch.error is not None:
            run.fail(dev, c, "drain", batch.error)
        run.chunk_finished()
    finally:
        run.progress[dev.lane].advance(k)


def _finish_output(run: Run, slot: Slot, job: ChunkJob) -> None:
    """Copy the bounced bytes of a chunk whose output pages are held or registered into
    the user's array (nothing to do for other outputs, written by the DMA itself)."""
    if (pc := job.out_pieces) is not None and pc.bounced:
        c = job.chunk
        nb, b0 = c.rows * run.out_row, c.row0 * run.out_row
        dst, bounce = run.out_bytes[b0 : b0 + nb], slot.bounce_out
        dst[: pc.head] = bounce[: pc.head]
        dst[nb - pc.tail :] = bounce[PAGE : PAGE + pc.tail]


def _finish_device(run: Run, dev: DeviceState) -> None:
    try:
        for slot in dev.slots:
            check_result(dev, drv.cuStreamSynchronize(slot.stream.handle), "cuStreamSynchronize")
    except BaseException as exc:
        if not any(getattr(e, "device", None) == dev.ordinal for e in run.errors):
            run.fail(dev, None, "synchronize", exc)
    if run.registrar is not None:
        for failure in run.registrar.finish(dev.lane):
            run.fail(dev, None, "unregister", failure)
    run.stats[dev.lane].seconds = time.perf_counter() - run.started[dev.lane]
