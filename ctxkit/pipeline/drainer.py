"""The drain thread of a ``Pipeline.map`` run, one per device (:func:`drain`).

It waits for each chunk's D2H, then queues the staging copy of its output on the host
pool (the slot is free again when that copy is done) or copies the chunk's bounced bytes
itself, and unregisters the chunk's pages; when the device's feeder is done it
synchronizes the slot streams and undoes the device's remaining registrations, so
nothing of the run is in flight once ``map`` returns.
"""

from __future__ import annotations

import collections
import functools
import queue
import time
from typing import Any

from .._driver import drv
from .hostthreads import CopyBatch
from .plan import PAGE, Chunk
from .run import ChunkJob, Run
from .staging import DeviceState, Slot, sync_event

__all__ = ["drain"]


def drain(run: Run, dev: DeviceState, q: queue.SimpleQueue[Any]) -> None:
    """Drain thread of *dev*: wait for each chunk's D2H, then queue the staging copy of
    its output on the host pool (drain work; it finishes the chunk when done) or finish
    it here, unregister its pages (runs with dev's context current)."""
    progress = run.progress[dev.ordinal]
    copies: collections.deque[CopyBatch] = collections.deque()
    try:
        while True:
            item = q.get()
            if item is None:
                break
            job, slot, ev, mode, k = item
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
                    _finish_output(run, dev, slot, job, mode)
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
    assert run.pool is not None and slot.pin_out is not None
    trace = (run.rec, "drain", dev.ordinal, c.index) if run.rec is not None else None
    done = functools.partial(_drained, run, dev, c, k)
    return run.pool.copy_async(
        run.out_bytes[b0 : b0 + nb],
        slot.pin_out[:nb],
        trace,
        name="drain",
        urgent=False,
        stop=run.stop,
        on_done=done,
        streaming=run.stream_out,
    )


def _drained(run: Run, dev: DeviceState, c: Chunk, k: int, batch: CopyBatch) -> None:
    try:
        if batch.error is not None:
            run.fail(dev, c, "drain", batch.error)
        run.chunk_finished()
    finally:
        run.progress[dev.ordinal].advance(k)


def _finish_output(run: Run, dev: DeviceState, slot: Slot, job: ChunkJob, mode: str) -> None:
    c = job.chunk
    nb, b0 = c.rows * run.out_row, c.row0 * run.out_row
    dst = run.out_bytes[b0 : b0 + nb]
    if mode in ("held", "register"):
        pc = job.out_pieces
        if pc is not None and pc.bounced:
            bounce = slot.bounce_out
            dst[: pc.head] = bounce[: pc.head]
            dst[nb - pc.tail :] = bounce[PAGE : PAGE + pc.tail]


def _finish_device(run: Run, dev: DeviceState) -> None:
    try:
        for slot in dev.slots:
            (err,) = drv.cuStreamSynchronize(slot.stream.handle)
            if err:
                raise dev.ctx.note_error(err, "cuStreamSynchronize")
    except BaseException as exc:
        if not any(getattr(e, "device", None) == dev.ordinal for e in run.errors):
            run.fail(dev, None, "synchronize", exc)
    if run.registrar is not None:
        for failure in run.registrar.finish(dev.ordinal):
            run.fail(dev, None, "unregister", failure)
    run.stats[dev.ordinal].seconds = time.perf_counter() - run.started[dev.ordinal]
