"""The feeder thread of a ``Pipeline.map`` run, one per device (:func:`feed`).

It starts chunks ahead of the GPU (:class:`Starter`: claims them, begins registering
the pages of their registered sides, queues the staging copies of their inputs on the
host pool), then enqueues each chunk's H2D -> kernel -> D2H on its slot's stream
(prefetch -> kernel -> prefetch back over unified memory) and hands it to the device's
drain thread (:mod:`ctxkit.pipeline.drainer`). How each side's host data moves is
described in :mod:`ctxkit.pipeline.run`.
"""

from __future__ import annotations

import collections
import queue
import time
from typing import Any

from .. import _driver
from .._driver import drv
from ..trace import nvtx_range
from .hostreg import Segment
from .hostthreads import CopyBatch
from .launch import Stopped, tagged
from .plan import PAGE, Chunk, HostPieces, addr, held_pieces, host_pieces
from .run import ChunkJob, Run
from .split import Split
from .staging import (
    DeviceState,
    Slot,
    calibrate,
    ensure_slot,
    event_ready,
    grow_pinned,
    sync_event,
)

__all__ = ["Starter", "feed"]


def _check_copy(dev: DeviceState, err: Any, what: str, step: str) -> None:
    if err:
        exc = dev.ctx.note_error(err, what)
        exc._ctxkit_step = step  # type: ignore[attr-defined]
        raise exc


class Starter:
    """The chunks a feeder started and has not enqueued yet, oldest first.

    Starting a chunk claims it, begins registering its registered sides and queues the
    staging copy of a staged input on the host pool (fill work), so the fills of up to
    ``plan.ahead`` chunks run while the feeder waits for the oldest one. A staged input
    needs its slot's input buffer: chunk ``p`` starts once chunk ``p - staging_buffers``
    (the slot's previous user) was enqueued and its H2D has read the buffer.
    """

    def __init__(self, run: Run, dev: DeviceState, split: Split | None = None) -> None:
        self.run = run
        self.dev = dev
        self.split = split
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
            c = next(self._claimed, None)
            if c is None:
                self._exhausted = True
                return
            if p < n_slots and not run.plan.managed:
                _setup_slot(run, dev, slot)
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
            return event_ready(self.dev, slot.h2d_done)
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
    stats = run.stats[dev.ordinal]
    run.started[dev.ordinal] = time.perf_counter()
    starter = Starter(run, dev)
    try:
        _prepare_device(run, dev)
        if run.in_mode == "split":
            starter.split = Split(run, dev, run.plan.for_part(dev.part))
        n_slots = len(dev.slots)
        k = 0
        while not run.stop.is_set():
            starter.top_up(k)
            if not starter.jobs:
                break
            job = starter.jobs[0]
            chunk = job.chunk
            slot = dev.slots[k % n_slots]
            if run.plan.managed:
                _enqueue_managed(run, dev, slot, chunk, q, k)
            else:
                _enqueue(run, dev, slot, job, q, k)
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


def _prepare_device(run: Run, dev: DeviceState) -> None:
    try:
        for slot in dev.slots:
            slot.h2d_done = None
        if run.rec is not None and not run.rec.calibrated(dev.ordinal):
            calibrate(dev, run.rec)
    except BaseException as exc:
        exc._ctxkit_step = "setup"  # type: ignore[attr-defined]
        raise


def _setup_slot(run: Run, dev: DeviceState, slot: Slot) -> None:
    """The slot's buffers for this run, at its first chunk (the first chunk starts after
    one slot's allocations, not all of them)."""
    plan = run.plan
    try:
        ensure_slot(
            dev, slot, plan.in_chunk_bytes, plan.out_chunk_bytes, plan.stage_in, plan.bounces
        )
    except BaseException as exc:
        exc._ctxkit_step = "setup"  # type: ignore[attr-defined]
        raise
    out = slot.pin_out
    if plan.stage_out and (out is None or out.nbytes < plan.out_chunk_bytes):
        # Allocated on the host pool while the chunk fills, ready by its D2H.
        assert run.pool is not None
        slot.pin_out_next = run.pool.submit(grow_pinned, out, plan.out_chunk_bytes, dev.ctx)


def _fill(run: Run, dev: DeviceState, slot: Slot, c: Chunk) -> CopyBatch:
    """Queue the staging copy of chunk *c*'s input into *slot* (fill work)."""
    nb, b0 = c.rows * run.in_row, c.row0 * run.in_row
    assert run.pool is not None and slot.pin_in is not None
    trace = (run.rec, "fill", dev.ordinal, c.index) if run.rec is not None else None
    return run.pool.copy_async(
        slot.pin_in[:nb],
        run.x_bytes[b0 : b0 + nb],
        trace,
        name="fill",
        stop=run.stop,
        streaming=run.stream_in,
    )


def _claim(run: Run, dev: DeviceState, c: Chunk) -> ChunkJob:
    """A job for chunk *c*: the pieces of its held sides; the pages of its registered
    sides start registering now."""
    job = ChunkJob(c)
    if run.plan.managed:
        return job
    if run.in_mode == "held":
        b0, b1 = c.row0 * run.in_row, c.row1 * run.in_row
        job.in_pieces = held_pieces(run.x_ptr, run.x.nbytes, b0, b1)
    if run.out_mode == "held":
        b0, b1 = c.row0 * run.out_row, c.row1 * run.out_row
        job.out_pieces = held_pieces(run.out_ptr, run.out.nbytes, b0, b1)
    if run.in_mode == "register":
        job.in_pieces, job.in_seg = _side(run, dev, c, run.x_ptr, run.x.nbytes, run.in_row, True)
    if run.out_mode == "register":
        if run.in_place and run.in_mode == "register":
            job.out_pieces, job.out_seg = job.in_pieces, job.in_seg
        else:
            job.out_pieces, job.out_seg = _side(
                run, dev, c, run.out_ptr, run.out.nbytes, run.out_row, False
            )
    return job


def _side(
    run: Run, dev: DeviceState, c: Chunk, base: int, total: int, row: int, is_input: bool
) -> tuple[HostPieces, Segment | None]:
    pieces = host_pieces(base, total, c.row0 * row, c.row1 * row)
    if not pieces.seg_len:
        return pieces, None
    read_only = is_input and not run.in_place
    seg = Segment(dev.ctx, dev.ordinal, c.index, pieces.seg_ptr, pieces.seg_len, read_only)
    assert run.registrar is not None
    run.registrar.register(seg)
    return pieces, seg


def _registered(run: Run, seg: Segment | None) -> bool:
    if seg is None:
        return True
    assert run.registrar is not None
    if run.registrar.wait(seg):
        return True
    run.note_fallback()
    return False


def _enqueue(
    run: Run, dev: DeviceState, slot: Slot, job: ChunkJob, q: queue.SimpleQueue[Any], k: int
) -> None:
    c = job.chunk
    s = slot.stream
    sh = s.handle
    rec, taken, timing = run.rec, run.taken[dev.ordinal], run.rec is not None
    assert slot.d_in is not None and slot.d_out is not None
    h2d = _input(run, dev, slot, job)
    e0 = dev.take_event(True, taken).record(s) if timing else None
    with nvtx_range("h2d", "green"):
        for off, src, n in h2d:
            (err,) = drv.cuMemcpyHtoDAsync(slot.d_in.ptr + off, src, n, sh)
            _check_copy(dev, err, "cuMemcpyHtoDAsync", "h2d")
    e1 = dev.take_event(timing, taken).record(s)
    slot.h2d_done = e1
    n_elems = c.rows * run.row_elems
    with nvtx_range("kernel", "blue"):
        tagged(run.launch, "kernel", dev, s, slot.d_in.ptr, slot.d_out.ptr, n_elems, c)
    e2 = dev.take_event(True, taken).record(s) if timing else None
    out_mode, d2h = _output(run, dev, slot, job, k)
    with nvtx_range("d2h", "red"):
        for dst, off, n in d2h:
            (err,) = drv.cuMemcpyDtoHAsync(dst, slot.d_out.ptr + off, n, sh)
            _check_copy(dev, err, "cuMemcpyDtoHAsync", "d2h")
    e3 = dev.take_event(timing, taken).record(s)
    q.put((job, slot, e3, out_mode, k))
    if rec is not None:
        rec.mark("h2d", dev.ordinal, slot.label, c.index, e0, e1)
        rec.mark("kernel", dev.ordinal, slot.label, c.index, e1, e2)
        rec.mark("d2h", dev.ordinal, slot.label, c.index, e2, e3)


def _input(run: Run, dev: DeviceState, slot: Slot, job: ChunkJob) -> list[tuple[int, int, int]]:
    """Prepare the chunk's input on the host; the H2D copies ``(d_in offset, src, n)``."""
    c = job.chunk
    nb, b0 = c.rows * run.in_row, c.row0 * run.in_row
    if run.in_mode == "pinned":
        return [(0, run.x_ptr + b0, nb)]
    pc = job.in_pieces
    registered = run.in_mode in ("held", "register", "split") and job.fill is None
    if registered and pc is not None and _registered(run, job.in_seg):
        if pc.bounced:
            _wait_h2d(dev, slot, c.index)
            bounce = slot.bounce_in
            src = run.x_bytes[b0 : b0 + nb]
            bounce[: pc.head] = src[: pc.head]
            bounce[PAGE : PAGE + pc.tail] = src[nb - pc.tail :]
        return _pieces(pc, addr(slot.bounce_in) if pc.bounced else 0, run.x_ptr + b0)
    try:
        if job.fill is None:  # a registration the driver refused: staged here
            _wait_h2d(dev, slot, c.index)
            slot.pin_in = grow_pinned(slot.pin_in, nb, dev.ctx)
            job.fill = _fill(run, dev, slot, c)
        assert run.pool is not None and slot.pin_in is not None
        run.pool.help_until(job.fill)
    except BaseException as exc:
        exc._ctxkit_step = "fill"  # type: ignore[attr-defined]
        raise
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
    if mode == "staged":
        try:
            if slot.pin_out_next is not None:
                nxt, slot.pin_out_next = slot.pin_out_next, None
                slot.pin_out = nxt.result()
            slot.pin_out = grow_pinned(slot.pin_out, nb, dev.ctx)
        except BaseException as exc:
            exc._ctxkit_step = "d2h"  # type: ignore[attr-defined]
            raise
    if mode == "pinned":
        return mode, [(run.out_ptr + b0, 0, nb)]
    if mode == "staged":
        assert slot.pin_out is not None
        return mode, [(addr(slot.pin_out), 0, nb)]
    assert pc is not None
    bounce = addr(slot.bounce_out) if pc.bounced else 0
    return mode, [(dst, off, n) for off, dst, n in _pieces(pc, bounce, run.out_ptr + b0)]


def _wait_window(run: Run, dev: DeviceState, k: int, into_slot: bool) -> None:
    """Before the D2H of the device's chunk *k*: wait until chunk ``k - staging_buffers``
    (whose slot buffers chunk *k* reuses) is drained, or ``k - 2 * staging_buffers``
    when chunk *k* writes no slot buffer; this bounds the work in flight."""
    window = len(dev.slots) * (1 if into_slot else 2)
    if not run.progress[dev.ordinal].wait_for(k - window + 1, run.stop):
        raise Stopped


def _pieces(pc: HostPieces, bounce: int, host: int) -> list[tuple[int, int, int]]:
    """``(device offset, host address, n)`` of the head, direct and tail pieces."""
    out = []
    if pc.head:
        out.append((0, bounce, pc.head))
    if pc.direct:
        out.append((pc.head, host + pc.head, pc.direct))
    if pc.tail:
        out.append((pc.head + pc.direct, bounce + PAGE, pc.tail))
    return out


def _wait_h2d(dev: DeviceState, slot: Slot, index: int) -> None:
    """Wait until the slot's previous H2D has read its host buffers (before chunk
    *index* uses them)."""
    if slot.h2d_done is not None:
        sync_event(dev, slot.h2d_done, f"waiting for the H2D copy before chunk {index}")


def _enqueue_managed(
    run: Run, dev: DeviceState, slot: Slot, c: Chunk, q: queue.SimpleQueue[Any], k: int
) -> None:
    _wait_window(run, dev, k, False)
    s = slot.stream
    rec, taken, timing = run.rec, run.taken[dev.ordinal], run.rec is not None
    nb_in, nb_out = c.rows * run.in_row, c.rows * run.out_row
    p_in, p_out = run.x_ptr + c.row0 * run.in_row, run.out_ptr + c.row0 * run.out_row
    prefetch = dev.prefetch_ok and run.plan.prefetch
    to_host = dev.prefetch_ok and run.plan.to_host
    e0 = dev.take_event(True, taken).record(s) if timing else None
    if prefetch:
        tagged(_driver.mem_prefetch, "prefetch", p_in, nb_in, dev.ordinal, s.handle)
        if p_out != p_in:
            tagged(_driver.mem_prefetch, "prefetch", p_out, nb_out, dev.ordinal, s.handle)
    e1 = dev.take_event(True, taken).record(s) if timing else None
    with nvtx_range("kernel", "blue"):
        tagged(run.launch, "kernel", dev, s, p_in, p_out, c.rows * run.row_elems, c)
    e2 = dev.take_event(True, taken).record(s) if timing else None
    if to_host:
        tagged(_driver.mem_prefetch, "prefetch", p_out, nb_out, "cpu", s.handle)
    e3 = dev.take_event(timing, taken).record(s)
    q.put((ChunkJob(c), slot, e3, "managed", k))
    if rec is not None:
        rec.mark("prefetch", dev.ordinal, slot.label, c.index, e0, e1)
        rec.mark("kernel", dev.ordinal, slot.label, c.index, e1, e2)
        rec.mark("prefetch_back", dev.ordinal, slot.label, c.index, e2, e3)
