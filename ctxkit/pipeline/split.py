"""``host_path="split"`` for a map's input: its pages registered from the far end while
the near end is staged, meeting in the middle.

Staging costs two host memory copies per byte and the host pool's threads; registering
pages (``cuMemHostRegister``) lets the H2D read the user's pages directly, but one
thread registers about as fast as several (the driver serializes it). So one host-pool
thread registers a device's input chunks from its last one backwards while the feeder
stages them from the first one forwards on the other threads; each chunk goes one way,
decided under a lock by whichever of the two reaches it first. Registered chunks are
unregistered after their D2H, like ``host_path="register"`` does
(:mod:`ctxkit.pipeline.hostreg`).
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from .hostreg import Registrar, Segment
from .plan import Chunk, HostPieces, host_pieces

if TYPE_CHECKING:
    from .run import Run
    from .staging import DeviceState

__all__ = ["Split"]


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
            b0, b1 = c.row0 * run.in_row, c.row1 * run.in_row
            pieces = host_pieces(run.x_ptr, run.x.nbytes, b0, b1)
            if not pieces.seg_len:
                if not self._claim(c, pieces, None):
                    return
                continue
            seg = Segment(
                dev.ctx, dev.ordinal, c.index, pieces.seg_ptr, pieces.seg_len, not run.in_place
            )
            claim = functools.partial(self._claim, c, pieces, seg)
            if not registrar.register_here(seg, claim):
                return

    def _claim(self, c: Chunk, pieces: HostPieces, seg: Segment | None) -> bool:
        with self._lock:
            if c.index in self._staged:
                return False
            self._registered[c.index] = (pieces, seg)
            return True
