"""Stream capture: record the work enqueued on a stream into a :class:`Graph`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import _driver
from .._driver import drv
from ..binding import guard
from ..context import Context, require_current
from ..lifetime import capture_begins, capture_ends, stream_capture_begins, stream_capture_ends
from ..stream import stream_for
from .graph import Graph

__all__ = ["capture"]


_CAPTURE_MODES = {
    "global": "CU_STREAM_CAPTURE_MODE_GLOBAL",
    "thread_local": "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL",
    "relaxed": "CU_STREAM_CAPTURE_MODE_RELAXED",
}


_SPECIAL_STREAMS = (0, 1, 2)  # legacy default, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD


@contextmanager
def capture(stream: Any, *, mode: str = "thread_local") -> Iterator[Graph]:
    """Record the work enqueued on *stream* inside the block into a :class:`Graph`.

    ``with capture(s) as g: k.launch(..., stream=s)`` -- after the block ``g.launch()``
    replays it (an executable graph is made as the block ends, so what cannot be
    instantiated fails there). The graph is kept: clone it, list its nodes, instantiate it
    again, or capture the same work with other pointers and ``exe.update(g2)``. The
    stream's context is bound for the block. Work inside must be asynchronous and on
    *stream* (no synchronize, no pageable copies, no allocation). ctxkit objects closed or
    garbage collected inside the block (the collector runs at any allocation) are freed
    after it: a ``cuMemFree`` there would invalidate the capture. In ``global`` mode that
    holds for frees in every thread.

    Parameters
    ----------
    stream : Stream or foreign stream
        A created stream; the legacy default stream cannot be captured.
    mode : {"thread_local", "global", "relaxed"}
        ``cuStreamBeginCapture`` mode: whose unsafe calls invalidate the capture -- this
        thread's (``thread_local``), every thread's (``global``), none (``relaxed``:
        frees are not held back then).

    Raises
    ------
    CudaError
        The capture was invalidated (``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED``); the
        stream is usable again afterwards.
    """
    if stream is None:
        raise ValueError(
            "capture needs a created stream (ck.Stream()); the default stream cannot be captured"
        )
    try:
        mode_enum = getattr(drv.CUstreamCaptureMode, _CAPTURE_MODES[mode])
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(_CAPTURE_MODES)}, not {mode!r}") from None
    sc = getattr(stream, "context", None)
    ctx = sc if isinstance(sc, Context) else require_current("graph capture")
    hs = stream_for(stream, ctx, "graph")
    if int(hs) in _SPECIAL_STREAMS:
        raise ValueError("the default stream cannot be captured; capture a ck.Stream()")
    graph = Graph._pending(ctx)
    tracked, global_mode = mode != "relaxed", mode == "global"
    with guard(ctx, "graph capture"):
        _begin(hs, mode_enum, tracked, global_mode)
        try:
            yield graph
        except BaseException:
            res = _end(hs, tracked, global_mode)
            if not res[0] and res[1] is not None and int(res[1]):
                drv.cuGraphDestroy(res[1])
            raise
        err, cu_graph = _end(hs, tracked, global_mode)
        if err:
            raise _driver.from_result(
                int(err),
                "cuStreamEndCapture",
                "something in the capture block could not be captured (a synchronize, a "
                "synchronous or pageable copy, work on the legacy default stream, an "
                "allocation, or work forked to another stream and not joined back) or, in "
                "mode='global', another thread made such a call; enqueue everything "
                "asynchronously on the captured stream",
            )
        graph._captured(cu_graph)


def _begin(hs: Any, mode_enum: Any, tracked: bool, global_mode: bool) -> None:
    """Mark the capture open (frees are held back from now on; the block cache hands
    nothing out for the stream), then begin it: a free between the two -- the garbage
    collector runs at any allocation -- would invalidate it."""
    if tracked:
        capture_begins(global_mode)
    stream_capture_begins(int(hs))
    try:
        (err,) = drv.cuStreamBeginCapture(hs, mode_enum)
    except BaseException:
        _forget(hs, tracked, global_mode)
        raise
    if err:
        _forget(hs, tracked, global_mode)
        raise _driver.from_result(int(err), "cuStreamBeginCapture")


def _end(hs: Any, tracked: bool, global_mode: bool) -> Any:
    """End the capture, then run the frees it held back."""
    try:
        return drv.cuStreamEndCapture(hs)
    finally:
        _forget(hs, tracked, global_mode)


def _forget(hs: Any, tracked: bool, global_mode: bool) -> None:
    stream_capture_ends(int(hs))
    if tracked:
        capture_ends(global_mode)
