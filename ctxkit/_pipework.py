"""The worker side of a ``Pipeline.map`` run (re-exported by :mod:`ctxkit.pipeline`).

Per device, a feeder thread enqueues every chunk (fill a pinned staging buffer, H2D,
kernel, D2H) and a drain thread waits for each chunk's last event and copies staged
output back to the user's array. Both run with the device's context current.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _driver
from ._driver import drv
from ._plan import Chunk, Plan, addr, grid_size, row_bytes
from ._staging import CopyPool, DeviceState, Slot, calibrate, ensure_buffers, sync_event
from .errors import ContextPoisonedError, CudaError, LaunchArgumentError
from .memory import is_pinned
from .module import Kernel
from .stream import Event, Stream
from .trace import Recorder

__all__ = ["ChunkView", "DeviceStats", "PipelineError", "Run", "RunStats", "drain", "feed"]


# --- public result types ------------------------------------------------------------------


class PipelineError(CudaError):
    """A failure inside a pipeline run, naming the device, chunk (or stage) and step.

    Attributes
    ----------
    device : int
        Ordinal of the device the failing work ran on.
    chunk : int or None
        Index of the chunk (``None`` for a :meth:`Pipeline.submit` stage).
    step : str
        ``"h2d"``, ``"kernel"``, ``"d2h"``, ``"fill"``, ``"drain"``, ``"setup"``, ``"stage"``...
    poisoned : bool
        True when the device's context is poisoned (a kernel faulted): the pipeline
        cannot be used again and says so.

    The original exception is ``__cause__``; ``code``/``name`` are copied from it.
    """

    def __init__(
        self,
        message: str,
        device: int = -1,
        chunk: int | None = None,
        step: str = "",
        cause: BaseException | None = None,
        poisoned: bool = False,
    ) -> None:
        code = getattr(cause, "code", 0) if isinstance(cause, CudaError) else 0
        name = getattr(cause, "name", "") if isinstance(cause, CudaError) else ""
        super().__init__(message, code, name)
        self.device = device
        self.chunk = chunk
        self.step = step
        self.poisoned = poisoned
        if cause is not None:
            self.__cause__ = cause


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
    """Totals of the last run: input bytes, wall seconds and the per-device breakdown."""

    nbytes: int = 0
    seconds: float = 0.0
    path: str = ""
    devices: list[DeviceStats] = field(default_factory=list)

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


# --- runs ---------------------------------------------------------------------------------


class Run:
    """The state shared by the worker threads of one map call."""

    def __init__(
        self,
        x: np.ndarray,
        out: np.ndarray,
        plan: Plan,
        launch: Callable[..., None],
        recorder: Recorder | None,
        managed: bool,
        prefetch: bool = True,
        to_host: bool = True,
    ) -> None:
        self.pool: CopyPool | None = None
        self.x = x
        self.out = out
        self.x_bytes = x.reshape(-1).view(np.uint8)
        self.out_bytes = out.reshape(-1).view(np.uint8)
        self.x_ptr = addr(x)
        self.out_ptr = addr(out)
        self.in_row = row_bytes(x)
        self.out_row = row_bytes(out)
        self.row_elems = math.prod(x.shape[1:])
        self.plan = plan
        self.launch = launch
        self.rec = recorder
        self.managed = managed
        self.prefetch = prefetch
        self.to_host = to_host
        self.stage_in = not managed and not is_pinned(x)
        self.stage_out = not managed and not is_pinned(out)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.taken: dict[int, list[Event]] = {}
        self.stats: dict[int, DeviceStats] = {}
        self.started: dict[int, float] = {}
        self._queue = iter(plan.chunks)

    def copy(self, dst: np.ndarray, src: np.ndarray, trace: tuple[Any, ...] | None) -> None:
        """A staging copy through the host copy pool."""
        assert self.pool is not None
        self.pool.copy(dst, src, trace)

    @property
    def path(self) -> str:
        """Which path the data took: ``"pinned"``, ``"managed"`` or the staging per side."""
        if self.managed:
            return "managed"
        kinds = ("staged" if self.stage_in else "pinned", "staged" if self.stage_out else "pinned")
        return "pinned" if kinds == ("pinned", "pinned") else f"in={kinds[0]}, out={kinds[1]}"

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

    def fail(self, dev: DeviceState, chunk: Chunk | None, step: str, exc: BaseException) -> None:
        """Record a failure (as a PipelineError naming device and chunk) and stop the run."""
        self.stop.set()
        if not isinstance(exc, Exception) or isinstance(exc, PipelineError):
            err: BaseException = exc
        else:
            err = _chunk_error(dev, chunk, step, exc)
        with self.lock:
            self.errors.append(err)


def _chunk_error(
    dev: DeviceState, chunk: Chunk | None, step: str, exc: BaseException
) -> PipelineError:
    poisoned = isinstance(exc, ContextPoisonedError) or dev.ctx.poisoned
    where = (
        f"chunk {chunk.index} (rows {chunk.row0}..{chunk.row1})" if chunk is not None else "setup"
    )
    msg = f"Pipeline.map failed on device {dev.ordinal}, {where}, step {step!r}: {exc}"
    if poisoned:
        msg += (
            f"\nThe context of device {dev.ordinal} is poisoned (a kernel faulted; other "
            "chunks running at the same time may have caused it): this pipeline cannot be "
            "used again. close() it; the device needs a fresh context (restart the process)."
        )
    return PipelineError(msg, dev.ordinal, chunk.index if chunk else None, step, exc, poisoned)


def _check_copy(dev: DeviceState, err: Any, what: str, step: str) -> None:
    if err:
        exc = dev.ctx.note_error(err, what)
        exc._ctxkit_step = step  # type: ignore[attr-defined]
        raise exc


# --- worker side ---------------------------------------------------------------


def feed(run: Run, dev: DeviceState, q: queue.SimpleQueue[Any]) -> None:
    """Worker thread of *dev*: enqueue every chunk (runs with dev's context current)."""
    chunk: Chunk | None = None
    stats = run.stats[dev.ordinal]
    run.started[dev.ordinal] = time.perf_counter()
    try:
        _prepare_device(run, dev)
        for k, chunk in enumerate(run.chunks_for(dev.part)):
            if run.stop.is_set():
                break
            slot = dev.slots[k % len(dev.slots)]
            if run.managed:
                _enqueue_managed(run, dev, slot, chunk, q)
            else:
                _enqueue(run, dev, slot, chunk, q)
            stats.chunks += 1
            stats.rows += chunk.rows
            stats.nbytes += chunk.rows * run.in_row
        chunk = None
    except Stopped:
        pass
    except BaseException as exc:
        run.fail(dev, chunk, getattr(exc, "_ctxkit_step", "enqueue"), exc)
    finally:
        q.put(None)


def _prepare_device(run: Run, dev: DeviceState) -> None:
    try:
        for slot in dev.slots:
            slot.h2d_done = None
            slot.out_free.set()
        if not run.managed:
            rows = run.plan.rows_per_chunk
            ensure_buffers(dev, rows * run.in_row, rows * run.out_row, run.stage_in, run.stage_out)
        if run.rec is not None and not run.rec.calibrated(dev.ordinal):
            calibrate(dev, run.rec)
    except BaseException as exc:
        exc._ctxkit_step = "setup"  # type: ignore[attr-defined]
        raise


def _enqueue(run: Run, dev: DeviceState, slot: Slot, c: Chunk, q: queue.SimpleQueue[Any]) -> None:
    s = slot.stream
    sh = s.handle
    nb_in, nb_out = c.rows * run.in_row, c.rows * run.out_row
    b_in, b_out = c.row0 * run.in_row, c.row0 * run.out_row
    rec, taken, timing = run.rec, run.taken[dev.ordinal], run.rec is not None
    assert slot.d_in is not None and slot.d_out is not None
    if run.stage_in:
        assert slot.pin_in is not None
        if slot.h2d_done is not None:
            sync_event(dev, slot.h2d_done, f"waiting for the H2D copy before chunk {c.index}")
        trace = (rec, "fill", dev.ordinal, c.index) if rec is not None else None
        dst_in, src_in = slot.pin_in[:nb_in], run.x_bytes[b_in : b_in + nb_in]
        tagged(run.copy, "fill", dst_in, src_in, trace)
        src = addr(slot.pin_in)
    else:
        src = run.x_ptr + b_in
    e0 = dev.take_event(True, taken).record(s) if timing else None
    (err,) = drv.cuMemcpyHtoDAsync(slot.d_in.ptr, src, nb_in, sh)
    _check_copy(dev, err, "cuMemcpyHtoDAsync", "h2d")
    e1 = dev.take_event(timing, taken).record(s)
    slot.h2d_done = e1
    n = c.rows * run.row_elems
    tagged(run.launch, "kernel", dev, s, slot.d_in.ptr, slot.d_out.ptr, n, c)
    e2 = dev.take_event(True, taken).record(s) if timing else None
    if run.stage_out:
        assert slot.pin_out is not None
        while not slot.out_free.wait(0.01):
            if run.stop.is_set():
                raise Stopped
        if run.stop.is_set():
            raise Stopped
        slot.out_free.clear()
        dst = addr(slot.pin_out)
    else:
        dst = run.out_ptr + b_out
    (err,) = drv.cuMemcpyDtoHAsync(dst, slot.d_out.ptr, nb_out, sh)
    _check_copy(dev, err, "cuMemcpyDtoHAsync", "d2h")
    e3 = dev.take_event(timing, taken).record(s)
    q.put((c, slot, e3, b_out, nb_out))
    if rec is not None:
        rec.mark("h2d", dev.ordinal, slot.label, c.index, e0, e1)
        rec.mark("kernel", dev.ordinal, slot.label, c.index, e1, e2)
        rec.mark("d2h", dev.ordinal, slot.label, c.index, e2, e3)


def _enqueue_managed(
    run: Run, dev: DeviceState, slot: Slot, c: Chunk, q: queue.SimpleQueue[Any]
) -> None:
    s = slot.stream
    rec, taken, timing = run.rec, run.taken[dev.ordinal], run.rec is not None
    nb_in, nb_out = c.rows * run.in_row, c.rows * run.out_row
    p_in, p_out = run.x_ptr + c.row0 * run.in_row, run.out_ptr + c.row0 * run.out_row
    prefetch = dev.prefetch_ok and run.prefetch
    to_host = dev.prefetch_ok and run.to_host
    e0 = dev.take_event(True, taken).record(s) if timing else None
    if prefetch:
        tagged(_driver.mem_prefetch, "prefetch", p_in, nb_in, dev.ordinal, s.handle)
        if p_out != p_in:
            tagged(_driver.mem_prefetch, "prefetch", p_out, nb_out, dev.ordinal, s.handle)
    e1 = dev.take_event(True, taken).record(s) if timing else None
    tagged(run.launch, "kernel", dev, s, p_in, p_out, c.rows * run.row_elems, c)
    e2 = dev.take_event(True, taken).record(s) if timing else None
    if to_host:
        tagged(_driver.mem_prefetch, "prefetch", p_out, nb_out, "cpu", s.handle)
    e3 = dev.take_event(timing, taken).record(s)
    q.put((c, slot, e3, 0, 0))
    if rec is not None:
        rec.mark("prefetch", dev.ordinal, slot.label, c.index, e0, e1)
        rec.mark("kernel", dev.ordinal, slot.label, c.index, e1, e2)
        rec.mark("prefetch_back", dev.ordinal, slot.label, c.index, e2, e3)


def drain(run: Run, dev: DeviceState, q: queue.SimpleQueue[Any]) -> None:
    """Drain thread of *dev*: wait for each chunk, copy staged output to the user's array."""
    rec = run.rec
    try:
        while True:
            item = q.get()
            if item is None:
                break
            c, slot, ev, b_out, nb_out = item
            try:
                if run.stop.is_set():
                    continue
                sync_event(dev, ev, f"cuEventSynchronize after chunk {c.index}")
                if run.stage_out:
                    trace = (rec, "drain", dev.ordinal, c.index) if rec is not None else None
                    run.copy(run.out_bytes[b_out : b_out + nb_out], slot.pin_out[:nb_out], trace)
            except BaseException as exc:
                run.fail(dev, c, "drain" if run.stage_out else "kernel", exc)
            finally:
                slot.out_free.set()
    finally:
        _finish_device(run, dev)


def _finish_device(run: Run, dev: DeviceState) -> None:
    try:
        for slot in dev.slots:
            (err,) = drv.cuStreamSynchronize(slot.stream.handle)
            if err:
                raise dev.ctx.note_error(err, "cuStreamSynchronize")
    except BaseException as exc:
        if not any(getattr(e, "device", None) == dev.ordinal for e in run.errors):
            run.fail(dev, None, "synchronize", exc)
    run.stats[dev.ordinal].seconds = time.perf_counter() - run.started[dev.ordinal]


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
        body = kernel
        in_tail, out_tail = x.shape[1:], out.shape[1:]

        def launch_body(
            dev: DeviceState, s: Stream, d_in: int, d_out: int, n: int, c: Chunk
        ) -> None:
            body(
                dev.ctx,
                s,
                ChunkView(d_in, (c.rows, *in_tail), x.dtype),
                ChunkView(d_out, (c.rows, *out_tail), out.dtype),
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


def tagged(fn: Callable[..., Any], step: str, *args: Any) -> Any:
    """Call *fn*; tag an exception with the pipeline step it happened in."""
    try:
        return fn(*args)
    except BaseException as exc:
        if not hasattr(exc, "_ctxkit_step"):
            try:
                exc._ctxkit_step = step  # type: ignore[attr-defined]
            except AttributeError:
                pass
        raise


def unblock_if_not_run(q: queue.SimpleQueue[Any], feeder: Future[Any]) -> None:
    """A feeder task that never ran (its worker could not start) still ends the drainer."""
    if feeder.cancelled() or feeder.exception() is not None:
        q.put(None)


def run_stats(run: Run, seconds: float, nbytes: int) -> RunStats:
    return RunStats(nbytes, seconds, run.path, [run.stats[k] for k in sorted(run.stats)])


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
