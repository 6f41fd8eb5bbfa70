"""``GraphExec``: an instantiated graph (``CUgraphExec``) -- launch, upload, update.

An executable graph is a snapshot of its graph at :meth:`Graph.instantiate
<ctxkit.graph.graph.Graph.instantiate>`: :meth:`GraphExec.update` applies another graph
of the same shape (``cuGraphExecUpdate``; a :class:`~ctxkit.errors.GraphUpdateError`
names the node and the reason when the driver refuses), :meth:`GraphExec.set_kernel_params`
changes one kernel node (``cuGraphExecKernelNodeSetParams``). Both are much cheaper than
instantiating again.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from .. import _driver
from .._driver import drv
from ..binding import guard
from ..context import thread_state
from ..errors import ContextClosedError, CudaError, GraphUpdateError, WrongContextError
from ..lifetime import finalizer
from ..stream import Stream, implicit_stream, stream_for
from .nodes import GraphNode, KernelSpec

if TYPE_CHECKING:
    from .graph import Graph

__all__ = ["GraphExec"]

_INVALID_HANDLE = 400

#: CUgraphExecUpdateResult suffix -> what it means
_REASONS = {
    "ERROR": "the update failed for a reason the driver does not name",
    "TOPOLOGY_CHANGED": "the graph's topology differs (other nodes or edges)",
    "NODE_TYPE_CHANGED": "a node's type differs",
    "FUNCTION_CHANGED": "a kernel node runs another function",
    "PARAMETERS_CHANGED": "a node's parameters changed in a way that cannot be applied in "
    "place (e.g. a copy between other kinds of memory, a memset of another shape)",
    "NOT_SUPPORTED": "a node's change cannot be applied to an executable graph (e.g. an "
    "event or child graph node changed)",
    "UNSUPPORTED_FUNCTION_CHANGE": "a kernel node's function changed in a way that cannot "
    "be applied (e.g. to or from a kernel using CUDA dynamic parallelism)",
    "ATTRIBUTES_CHANGED": "a node's attributes changed in a way that cannot be applied",
}


class GraphExec:
    """An executable graph made by :meth:`Graph.instantiate`; it binds its context for
    every call and keeps alive what its nodes use.

    Attributes
    ----------
    context : Context
    handle : CUgraphExec or None
        ``None`` once closed.
    """

    def __init__(self, graph: Graph) -> None:
        what = "Graph.instantiate"
        handle = graph._open(what)
        ctx = graph.context
        with guard(ctx, what):
            err, exe = drv.cuGraphInstantiate(handle, 0)
        if err:
            raise ctx.note_error(err, "cuGraphInstantiate")
        self.context = ctx
        self._graph = weakref.ref(graph)  # a graph launching its own exec holds it
        self.handle = exe
        self._uses = (list(graph._keep), dict(graph._specs))
        self._updated: tuple[list[Any], dict[int, KernelSpec]] | None = None
        self._params: dict[int, KernelSpec] = {}  # set_kernel_params, by node handle
        self._callbacks = list(graph._callbacks)
        self._fin: weakref.finalize | None = finalizer(self, ctx, drv.cuGraphExecDestroy, exe)

    @property
    def graph(self) -> Graph | None:
        """The graph it was instantiated from (:meth:`set_kernel_params` takes its
        nodes); ``None`` once that graph was garbage collected."""
        return self._graph()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self.handle is None

    def _open(self, what: str) -> Any:
        exe = self.handle
        if exe is None:
            raise ContextClosedError(f"{what}: the executable graph was closed")
        return exe

    # --- launching -------------------------------------------------------------------

    def launch(self, stream: Any = None) -> None:
        """Launch on *stream* (``None``: the thread's current stream of the graph's
        context, by default its legacy default stream); returns at once.

        Raises
        ------
        ContextClosedError
            The executable graph was closed.
        NoCurrentContextError
            Strict mode and the calling thread has no current context.
        """
        self._enqueue(drv.cuGraphLaunch, stream, "GraphExec.launch")

    def upload(self, stream: Any = None) -> None:
        """Upload to the device ahead of the first launch (``cuGraphUpload``), ordered on
        *stream*; optional (the first launch uploads otherwise)."""
        self._enqueue(drv.cuGraphUpload, stream, "GraphExec.upload")

    def _enqueue(self, fn: Any, stream: Any, what: str) -> None:
        exe = self.handle
        if exe is None:
            raise CudaError(
                f"{what}: the graph is empty: its capture block has not finished, or it was closed"
            )
        ctx = self.context
        hs = stream_for(stream, ctx, "graph")
        if self._callbacks:
            self._route(stream)
        if thread_state().top is ctx:
            (err,) = fn(exe, hs)
        else:
            with guard(ctx, what):
                (err,) = fn(exe, hs)
        if err:
            raise ctx.note_error(int(err), getattr(fn, "__name__", what))

    def _route(self, stream: Any) -> None:
        """Host nodes report exceptions to the ctxkit stream of this launch."""
        s = stream if stream is not None else implicit_stream(self.context)
        ref = weakref.ref(s) if isinstance(s, Stream) else None
        for cb in self._callbacks:
            cb.stream_ref = ref

    # --- updating --------------------------------------------------------------------

    def update(self, graph: Graph) -> None:
        """Make this executable graph run *graph* (``cuGraphExecUpdate``).

        *graph* must have the same topology and node types as the instantiated one
        (a clone changed with ``node.set_params``, a graph built the same way with other
        arguments, or the same stream work captured again with other pointers).

        Raises
        ------
        GraphUpdateError
            The driver refused: ``reason`` says why (``"topology_changed"``, ...) and
            ``node`` which node of *graph*, also named in the message.
        WrongContextError
            *graph* belongs to another context.
        """
        what = "GraphExec.update"
        exe = self._open(what)
        opener = getattr(graph, "_open", None)
        if opener is None or not hasattr(graph, "_specs"):
            raise TypeError(f"{what}: expected a ctxkit.Graph, got {type(graph).__name__}")
        handle = opener(what)
        ctx = self.context
        if graph.context.handle != ctx.handle:
            raise WrongContextError(
                f"{what}: {graph!r} belongs to {graph.context!r}, but the executable graph "
                f"belongs to {ctx!r}",
                _INVALID_HANDLE,
                "CUDA_ERROR_INVALID_HANDLE",
            )
        with guard(ctx, what):
            err, info = drv.cuGraphExecUpdate(exe, handle)
            if err and getattr(info, "result", None) is None:
                err, info = _ask_libcuda(exe, handle, int(err), info)
        if err:
            raise update_error(int(err), info, graph)
        self._updated = (list(graph._keep), dict(graph._specs))
        self._params.clear()
        self._callbacks = list(graph._callbacks)

    def set_kernel_params(
        self,
        node: GraphNode,
        *args: Any,
        grid: Any = None,
        block: Any = None,
        shared_mem: int | None = None,
    ) -> None:
        """Change one kernel node of this executable graph (``cuGraphExecKernelNodeSetParams``).

        *node* is a kernel node of the graph it was instantiated from (built by
        ``graph.kernel()``). Without arguments the node keeps those ctxkit last set for it;
        otherwise pass all of them, checked against the kernel's signature. The graph
        itself is unchanged.

        Raises
        ------
        LaunchArgumentError
            The arguments do not fit the kernel's parameters.
        ValueError
            *node* belongs to another graph.
        """
        what = "GraphExec.set_kernel_params"
        exe = self._open(what)
        if not isinstance(node, GraphNode):
            raise TypeError(f"{what}: expected a GraphNode, got {type(node).__name__}")
        if node.graph is not self._graph():
            raise ValueError(
                f"{what}: {node!r} belongs to {node.graph!r}, not to the graph this "
                f"executable graph was instantiated from ({self.graph!r}); pass its node"
            )
        key = int(node.handle)
        base = self._params.get(key) or self._uses[1].get(key) or node._require_spec(what)
        ctx = self.context
        with guard(ctx, what):
            new = base.replaced(ctx, args or None, grid, block, shared_mem)
            (err,) = drv.cuGraphExecKernelNodeSetParams(exe, node.handle, new.params(ctx))
        if err:
            raise ctx.note_error(err, f"cuGraphExecKernelNodeSetParams({new.describe()})")
        self._params[key] = new

    def close(self) -> None:
        """Destroy the executable graph (in its context); idempotent."""
        if self._fin is not None:
            self._fin()
        self.handle = None

    def __repr__(self) -> str:
        state = "closed" if self.handle is None else f"{int(self.handle):#x}"
        return f"<GraphExec {state} of {self.graph!r}>"


def _ask_libcuda(exe: Any, handle: Any, err: int, info: Any) -> tuple[int, Any]:
    """Update again through libcuda to learn why the driver refused (cuda-bindings returns
    no result info on failure); ``(err, info)`` as the bindings would have given them."""
    raw = _driver.graph_exec_update_info(exe, handle)
    if raw is None:
        return err, info
    code, result, node = raw
    if not code:
        return 0, None
    try:
        member = drv.CUgraphExecUpdateResult(result)
    except ValueError:
        member = result
    return code, SimpleNamespace(result=member, errorNode=drv.CUgraphNode(node) if node else None)


def update_error(code: int, info: Any, graph: Graph) -> GraphUpdateError:
    """The :class:`GraphUpdateError` for a refused ``cuGraphExecUpdate``."""
    member = getattr(info, "result", None)
    full = getattr(member, "name", None) or f"CUgraphExecUpdateResult {member}"
    suffix = full.removeprefix("CU_GRAPH_EXEC_UPDATE_").removeprefix("ERROR_")
    if full == "CU_GRAPH_EXEC_UPDATE_ERROR" or member is None:
        suffix = "ERROR"
    if member is None:
        full = "no CUgraphExecUpdateResultInfo: the driver gave no reason"
    reason = suffix.lower()
    why = _REASONS.get(suffix, f"the driver answered {full}")
    node = _error_node(graph, getattr(info, "errorNode", None))
    at = f"; the node: {node!r}" if node is not None else ""
    name, _text = _driver.describe(code)
    return GraphUpdateError(
        f"GraphExec.update: cuGraphExecUpdate refused {graph!r}: {why} ({full}){at}. Fix: "
        "instantiate the new graph (graph.instantiate()) instead, or keep the nodes, edges "
        "and node types and change only parameters (kernel arguments and launch shape, "
        "copy and memset addresses)",
        code,
        name,
        reason=reason,
        node=node,
    )


def _error_node(graph: Graph, handle: Any) -> GraphNode | None:
    if handle is None or not int(handle):
        return None
    try:
        return graph._wrap(handle)
    except CudaError:
        return None
