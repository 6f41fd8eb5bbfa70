"""CUDA graphs: record the work enqueued on a stream, replay it with one call."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import _driver
from ._driver import call, drv
from .context import Context, require_current, thread_state
from .errors import CudaError
from .lifetime import capture_begins, capture_ends, finalizer
from .registry import guard
from .stream import stream_for

__all__ = ["Graph", "capture"]


_CAPTURE_MODES = {
    "global": "CU_STREAM_CAPTURE_MODE_GLOBAL",
    "thread_local": "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL",
    "relaxed": "CU_STREAM_CAPTURE_MODE_RELAXED",
}


_SPECIAL_STREAMS = (0, 1, 2)  # legacy default, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD


class Graph:
    """An instantiated CUDA graph from :func:`capture`; replay with :meth:`launch`.

    Attributes
    ----------
    context : Context
    num_nodes : int
        Nodes captured (one per kernel launch or copy).
    """

    def __init__(self, context: Context) -> None:
        self.context = context
        self.num_nodes = 0
        self._exec: Any = None
        self._fin: weakref.finalize | None = None

    def _instantiate(self, graph: Any) -> None:
        res = drv.cuGraphGetNodes(graph, 0)
        if not res[0]:
            self.num_nodes = int(res[-1])
        self._exec = call(drv.cuGraphInstantiate, graph, 0, what="cuGraphInstantiate")
        self._fin = finalizer(self, self.context, drv.cuGraphExecDestroy, self._exec)

    def launch(self, stream: Any = None) -> None:
        """Replay the graph on *stream* (``None``: the context's legacy default stream).

        Runs in the graph's own context, bound for the call when another one is current.

        Raises
        ------
        NoCurrentContextError
            The calling thread has no current context.
        CudaError
            The graph is empty (capture unfinished, or closed).
        """
        self._enqueue(drv.cuGraphLaunch, stream, "Graph.launch")

    def upload(self, stream: Any = None) -> None:
        """Upload the graph to the device ahead of its first launch (``cuGraphUpload``).

        Optional: the first :meth:`launch` uploads it otherwise. Ordered on *stream*.
        """
        self._enqueue(drv.cuGraphUpload, stream, "Graph.upload")

    def _enqueue(self, fn: Any, stream: Any, what: str) -> None:
        if self._exec is None:
            raise CudaError(
                "the graph is empty: its capture block has not finished, or it was closed"
            )
        ctx = self.context
        hs = 0 if stream is None else stream_for(stream, ctx, "graph")
        if thread_state().top is ctx:
            (err,) = fn(self._exec, hs)
        else:
            with guard(ctx, what):
                (err,) = fn(self._exec, hs)
        if err:
            raise ctx.note_error(int(err), getattr(fn, "__name__", what))

    def close(self) -> None:
        """Free the executable graph (in its context). Idempotent."""
        if self._fin is not None:
            self._fin()
        self._exec = None

    def __repr__(self) -> str:
        state = "ready" if self._exec is not None else "empty"
        return f"<Graph {self.num_nodes} nodes {state} in {self.context!r}>"


@contextmanager
def capture(stream: Any, *, mode: str = "thread_local") -> Iterator[Graph]:
    """Record the work enqueued on *stream* inside the block into a :class:`Graph`.

    ``with capture(s) as g: k.launch(..., stream=s)`` -- after the block ``g.launch()``
    replays it. The stream's context is bound for the block. Work inside must be
    asynchronous and on *stream* (no synchronize, no pageable copies, no allocation).
    ctxkit objects closed or garbage collected inside the block (the collector runs at
    any allocation) are freed after it: a ``cuMemFree`` there would invalidate the
    capture. In ``global`` mode that holds for frees in every thread.

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
    graph = Graph(ctx)
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
        try:
            graph._instantiate(cu_graph)
        finally:
            drv.cuGraphDestroy(cu_graph)


def _begin(hs: Any, mode_enum: Any, tracked: bool, global_mode: bool) -> None:
    """Mark the capture open (frees are held back from now on), then begin it: a free
    between the two -- the garbage collector runs at any allocation -- would invalidate
    it."""
    if tracked:
        capture_begins(global_mode)
    try:
        (err,) = drv.cuStreamBeginCapture(hs, mode_enum)
    except BaseException:
        if tracked:
            capture_ends(global_mode)
        raise
    if err:
        if tracked:
            capture_ends(global_mode)
        raise _driver.from_result(int(err), "cuStreamBeginCapture")


def _end(hs: Any, tracked: bool, global_mode: bool) -> Any:
    """End the capture, then run the frees it held back."""
    try:
        return drv.cuStreamEndCapture(hs)
    finally:
        if tracked:
            capture_ends(global_mode)
