"""One ``Pipeline.map`` run: the state its worker threads share (:class:`Run`), a chunk
as its device processes it (:class:`ChunkJob`), and the run's totals (:func:`run_stats`).

Per device, a feeder thread enqueues every chunk (host input -> H2D -> kernel -> D2H;
:mod:`ctxkit.pipeline.feeder`) and a drain thread waits for each chunk's last event,
finishes its host output and unregisters its pages (:mod:`ctxkit.pipeline.drainer`).
Both run with the device's context current.

Nothing waits chunk by chunk on the host pool: the feeder queues the input fills of
every chunk whose slot is free (:class:`Starter`) and enqueues chunk *k*'s H2D as soon
as *k*'s pieces are done (helping with fill pieces meanwhile); the drain thread queues
chunk *k*'s output drain after its D2H and moves on; the slot is free again when that
drain's last piece finishes (:class:`~ctxkit.pipeline.staging.Progress`). A slot's
buffers are allocated at its first chunk.

Host data of a side (input or output) moves one of five ways (the map's
:class:`~ctxkit.pipeline.plan.MapPlan` says which):

* ``pinned``: the user's array is page-locked already; copies use it directly;
* ``held``: the whole pages inside the user's array kept locked by pin on reuse
  (:mod:`ctxkit.pipeline.pincache`) and used directly; the bytes on its partial first
  and last pages go through the slot's small bounce buffer;
* ``staged``: through a pinned staging buffer of the slot, filled (input) or drained
  (output) by the host copy pool;
* ``register``: the chunk's whole pages are registered ahead of time by the host pool
  and DMAed directly; the partial pages at the chunk's ends go through the slot's small
  bounce buffer. A chunk whose pages the driver refuses to register is staged instead;
* ``split`` (input): ``register`` for the chunks a host-pool thread registered from the
  device's last chunk backwards before the feeder got there, ``staged`` for the rest
  (:mod:`ctxkit.pipeline.split`).

A device never has more than ``staging_buffers`` chunks (twice that when nothing is
staged) past their D2H enqueue and not yet drained, so stopping a run waits for at most
those chunks.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import PipelineError
from ..memory.streamcopy import streaming_pays
from ..stream import Event
from ..trace import Recorder
from .hostreg import Registrar, Segment
from .hostthreads import CopyBatch, HostPool
from .plan import Chunk, HostPieces, MapPlan, addr, row_bytes
from .progressbar import Bar
from .staging import DeviceState, Progress
from .types import DeviceStats, RunStats, chunk_error

__all__ = ["ChunkJob", "Run", "run_stats"]


class ChunkJob:
    """One chunk as its device processes it: the staging copy of its input queued on the
    host pool, pieces and segments of registered sides."""

    __slots__ = ("chunk", "fill", "in_pieces", "in_seg", "out_pieces", "out_seg")

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.fill: CopyBatch | None = None
        self.in_pieces: HostPieces | None = None
        self.out_pieces: HostPieces | None = None
        self.in_seg: Segment | None = None
        self.out_seg: Segment | None = None

    def segments(self) -> list[Segment]:
        """The distinct segments of the chunk (one when input and output share pages)."""
        segs = [s for s in (self.in_seg, self.out_seg) if s is not None]
        return segs[:1] if len(segs) == 2 and segs[0] is segs[1] else segs


class Run:
    """The state shared by the worker threads of one map call, carried out as *plan*
    says (its modes, chunks and how far feeders claim ahead)."""

    def __init__(
        self,
        x: np.ndarray,
        out: np.ndarray,
        plan: MapPlan,
        launch: Callable[..., None],
        recorder: Recorder | None,
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
        self.stream_out = streaming_pays(out.nbytes)
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
        self.taken: dict[int, list[Event]] = {}
        self.stats: dict[int, DeviceStats] = {}
        self.progress: dict[int, Progress] = {}
        self.started: dict[int, float] = {}
        self.fallbacks = 0
        self.bar: Bar | None = None
        self._bar_lock = threading.Lock()
        self._queue = iter(plan.chunks)

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
        if not isinstance(exc, Exception) or isinstance(exc, PipelineError):
            err: BaseException = exc
        else:
            err = chunk_error(dev.ordinal, dev.ctx.poisoned, chunk, step, exc)
        with self.lock:
            self.errors.append(err)


def run_stats(run: Run, seconds: float, nbytes: int) -> RunStats:
    """The :class:`RunStats` of a finished run."""
    devices = [run.stats[k] for k in sorted(run.stats)]
    return RunStats(nbytes, seconds, run.plan.path, devices, run.fallbacks)
