"""``Graph``: a ``CUgraph`` built node by node (or captured from a stream), in its context.

Node builders return :class:`~ctxkit.graph.nodes.GraphNode` objects; ``depends_on=``
wires the edges (default: none, a root node). Everything a node uses -- packed kernel
arguments and the buffers among them, the arrays of copies, host callbacks, events --
is kept alive by the graph and by every executable graph made from it.

Here: the graph's state, adding a node with its dependencies, the nodes that hold other
graphs (child, conditional) and the whole-graph operations (clone, instantiate, launch).
The builders of the other nodes are in :class:`~ctxkit.graph.builders.NodeBuilders`, its
base class.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from .. import _driver
from .._driver import drv
from ..binding import ContextLike, guard, resolve_context
from ..context import Context
from ..errors import ContextClosedError, CudaError, WrongContextError
from ..lifetime import finalizer
from .builders import NodeBuilders
from .conditional import (
    ConditionalHandle,
    add_node_args,
    check_supported,
    default_arg,
    kind_member,
    node_params,
)
from .exec import GraphExec
from .host import HostCallback
from .nodes import GraphNode, KernelSpec, dependency_handles, node_type_name

__all__ = ["Graph"]

_INVALID_HANDLE = 400
_EMPTY = "the graph is empty: its capture block has not finished, or it was closed"


class Graph(NodeBuilders):
    """A CUDA graph (``CUgraph``) in its own context.

    ``g = ck.Graph()`` creates an empty graph in the current context (or *context*);
    :func:`~ctxkit.graph.capture` yields one filled from a stream. Add nodes with
    :meth:`kernel`, :meth:`memcpy`, :meth:`memset`, :meth:`host`, :meth:`event_record`,
    :meth:`event_wait`, :meth:`empty`, :meth:`child` and :meth:`conditional`, then
    :meth:`instantiate` it (a :class:`~ctxkit.graph.exec.GraphExec`, launched and
    updated on its own) or just :meth:`launch` it. Every call binds the graph's context.

    Parameters
    ----------
    context : Context, Device, int or None
        ``None``: the calling thread's current context.

    Attributes
    ----------
    context : Context
    handle : CUgraph or None
        ``None`` once closed (and, for a captured graph, until its block ends).
    """

    def __init__(self, context: ContextLike | None = None) -> None:
        ctx = resolve_context(context, "Graph()")
        with ctx:
            err, handle = drv.cuGraphCreate(0)
        if err:
            raise ctx.note_error(err, "cuGraphCreate")
        self._setup(ctx, handle, None)
        self._own(handle)

    @classmethod
    def _pending(cls, ctx: Context) -> Graph:
        """A graph without a ``CUgraph`` yet (a capture in progress)."""
        obj = cls.__new__(cls)
        obj._setup(ctx, None, None)
        return obj

    @classmethod
    def _body(cls, ctx: Context, handle: Any, parent: Graph) -> Graph:
        """The body graph of a conditional node of *parent* (the node owns it)."""
        obj = cls.__new__(cls)
        obj._setup(ctx, handle, parent)
        obj._keep = parent._keep
        obj._specs = parent._specs
        obj._callbacks = parent._callbacks
        return obj

    def _setup(self, ctx: Context, handle: Any, parent: Graph | None) -> None:
        self.context = ctx
        self.handle = handle
        self._parent = parent
        self._fin: weakref.finalize | None = None
        self._keep: list[Any] = []  # what nodes use: arrays, events, callbacks, children's
        self._specs: dict[int, KernelSpec] = {}  # kernel node -> its current arguments
        self._callbacks: list[HostCallback] = []  # host nodes, also of children
        self._nodes: weakref.WeakValueDictionary[int, GraphNode] = weakref.WeakValueDictionary()
        self._origin: Graph | None = None  # the graph this one was cloned from
        self._origin_specs: dict[int, KernelSpec] = {}  # its kernel nodes' arguments
        self._exec: GraphExec | None = None
        self._exec_version = -1
        self._version = 0
        self._count = 0

    def _own(self, handle: Any) -> None:
        self.handle = handle
        self._fin = finalizer(self, self.context, drv.cuGraphDestroy, handle)

    # --- state -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (or while its capture block runs)."""
        return self._open_handle() is None

    def _open_handle(self) -> Any:
        parent = self._parent
        if parent is not None and parent.closed:
            return None
        return self.handle

    def _open(self, what: str) -> Any:
        handle = self._open_handle()
        if handle is None:
            why = (
                "the graph holding this conditional body was closed"
                if self._parent is not None
                else "it was closed, or its capture block has not finished"
            )
            raise ContextClosedError(f"{what}: the graph cannot be used: {why}")
        return handle

    def _bump(self) -> None:
        self._version += 1
        if self._parent is not None:
            self._parent._bump()

    @property
    def num_nodes(self) -> int:
        """Nodes in the graph (its own; a child graph or conditional body counts as one)."""
        handle = self._open_handle()
        if handle is None:
            return self._count
        err, _nodes, n = drv.cuGraphGetNodes(handle, 0)
        if err:
            raise self.context.note_error(err, "cuGraphGetNodes")
        self._count = int(n)
        return self._count

    def nodes(self) -> list[GraphNode]:
        """The graph's nodes (``cuGraphGetNodes``), each with its ``type``; nodes built by
        ctxkit come back as the objects the builders returned."""
        handle = self._open("Graph.nodes")
        n = self.num_nodes
        if not n:
            return []
        err, raw, n = drv.cuGraphGetNodes(handle, n)
        if err:
            raise self.context.note_error(err, "cuGraphGetNodes")
        return [self._wrap(h) for h in list(raw)[: int(n)]]

    def _wrap(self, handle: Any) -> GraphNode:
        node = self._nodes.get(int(handle))
        if node is None:
            err, member = drv.cuGraphNodeGetType(handle)
            if err:
                raise self.context.note_error(err, "cuGraphNodeGetType")
            node = GraphNode(self, handle, node_type_name(member), self._specs.get(int(handle)))
            self._nodes[int(handle)] = node
        return node

    def _add(
        self,
        what: str,
        fn: Any,
        *params: Any,
        depends_on: Any,
        kind: str,
        keep: tuple[Any, ...] = (),
        spec: KernelSpec | None = None,
    ) -> GraphNode:
        handle = self._open(what)
        deps = dependency_handles(self, depends_on, what)
        ctx = self.context
        with guard(ctx, what):
            err, node = fn(handle, deps, len(deps), *params)
        if err:
            raise ctx.note_error(err, f"{getattr(fn, '__name__', what)} ({what})")
        self._keep.extend(keep)
        self._bump()
        out = GraphNode(self, node, kind, spec)
        self._nodes[int(node)] = out
        if spec is not None:
            self._specs[int(node)] = spec
        return out

    def _keep_spec(self, node: GraphNode, spec: KernelSpec) -> None:
        self._specs[int(node.handle)] = spec
        self._bump()

    # --- child and conditional nodes -------------------------------------------------

    def child(self, graph: Graph, *, depends_on: Any = None) -> GraphNode:
        """A child graph node (``cuGraphAddChildGraphNode``): a copy of *graph* as it is
        now runs as one node (later changes to *graph* do not reach it)."""
        what = "Graph.child"
        if not isinstance(graph, Graph):
            raise TypeError(f"{what}: expected a ctxkit.Graph, got {type(graph).__name__}")
        if graph is self:
            raise ValueError(f"{what}: a graph cannot contain itself")
        child = graph._open(what)
        if graph.context.handle != self.context.handle:
            raise WrongContextError(
                f"{what}: {graph!r} belongs to {graph.context!r}, but this graph belongs to "
                f"{self.context!r}; build both in one context",
                _INVALID_HANDLE,
                "CUDA_ERROR_INVALID_HANDLE",
            )
        node = self._add(
            what,
            drv.cuGraphAddChildGraphNode,
            child,
            depends_on=depends_on,
            kind="child",
            keep=(list(graph._keep), dict(graph._specs)),
        )
        self._callbacks.extend(graph._callbacks)
        return node

    def conditional_handle(self, default: int = 0) -> ConditionalHandle:
        """A condition for a conditional node of this graph
        (``cuGraphConditionalHandleCreate``), made before the node so that a kernel
        node setting it can come first: ``h = g.conditional_handle(); s =
        g.kernel(setter, 1, 1, h); node, body, h = g.conditional("if", handle=h,
        depends_on=s)``. Every launch starts with *default*.

        Raises
        ------
        CudaError
            ``CUDA_ERROR_NOT_SUPPORTED``: the bindings or the driver predate conditional
            nodes (CUDA 12.4); the message names which.
        """
        what = "Graph.conditional_handle"
        value = default_arg(default, what)
        handle = self._open(what)
        check_supported(what)
        ctx = self.context
        flags = int(getattr(drv, "CU_GRAPH_COND_ASSIGN_DEFAULT", 1))
        with guard(ctx, what):
            err, cond = drv.cuGraphConditionalHandleCreate(handle, ctx._cu, value, flags)
        if err:
            raise ctx.note_error(err, "cuGraphConditionalHandleCreate")
        return ConditionalHandle(cond, self, value)

    def conditional(
        self,
        kind: str,
        default: int = 0,
        *,
        handle: ConditionalHandle | None = None,
        depends_on: Any = None,
    ) -> tuple[GraphNode, Graph, ConditionalHandle]:
        """A conditional node: ``(node, body, handle)``.

        ``kind="if"`` runs *body* once when the handle's value is non-zero as the node
        runs; ``kind="while"`` runs it again and again while the value is non-zero
        (checked before each run). Kernels set the value with
        ``cudaGraphSetConditional(handle, value)`` (see
        :data:`~ctxkit.graph.conditional.CONDITIONAL_DEVICE_API`), taking *handle* as an
        ``unsigned long long`` argument: a kernel in *body* for a loop, or one this node
        depends on (make the handle first with :meth:`conditional_handle`). Without
        *handle* a new one starting every launch at *default* is made. Add the body's
        nodes to *body*.

        Raises
        ------
        CudaError
            ``CUDA_ERROR_NOT_SUPPORTED``: the bindings or the driver predate conditional
            nodes (CUDA 12.4); the message names which.
        ValueError
            *handle* belongs to another graph.
        """
        what = f"Graph.conditional({kind!r})"
        kind_enum = kind_member(kind, what)
        graph_handle = self._open(what)
        if handle is None:
            handle = self.conditional_handle(default)
        elif not isinstance(handle, ConditionalHandle):
            raise TypeError(f"{what}: handle must be a ConditionalHandle, got {handle!r}")
        elif handle.graph is not self:
            raise ValueError(
                f"{what}: {handle!r} was made for {handle.graph!r}; make it with this "
                "graph's conditional_handle()"
            )
        deps = dependency_handles(self, depends_on, what)
        ctx = self.context
        params = node_params(handle.handle, kind_enum, ctx._cu)
        args = add_node_args(_driver.BINDINGS_VERSION[0], graph_handle, deps, params)
        with guard(ctx, what):
            err, node = drv.cuGraphAddNode(*args)
        if err:
            raise ctx.note_error(err, f"cuGraphAddNode (conditional {kind})")
        handle.kind = kind
        self._bump()
        out = GraphNode(self, node, "conditional")
        self._nodes[int(node)] = out
        body = Graph._body(ctx, params.conditional.phGraph_out[0], self)
        return out, body, handle

    # --- whole-graph operations ------------------------------------------------------

    def clone(self) -> Graph:
        """A copy of the graph (``cuGraphClone``); :meth:`find` maps nodes to the copy's."""
        what = "Graph.clone"
        handle = self._open(what)
        if self._parent is not None:
            raise ValueError(f"{what}: clone the graph holding the conditional body instead")
        ctx = self.context
        with guard(ctx, what):
            err, copy = drv.cuGraphClone(handle)
        if err:
            raise ctx.note_error(err, "cuGraphClone")
        out = Graph._pending(ctx)
        out._own(copy)
        out._keep = list(self._keep)
        out._specs = {}
        out._callbacks = list(self._callbacks)
        out._origin = self
        out._origin_specs = dict(self._specs)
        return out

    def find(self, node: GraphNode) -> GraphNode:
        """This clone's node for *node* of the graph it was cloned from
        (``cuGraphNodeFindInClone``)."""
        what = "Graph.find"
        handle = self._open(what)
        if not isinstance(node, GraphNode):
            raise TypeError(f"{what}: expected a GraphNode, got {type(node).__name__}")
        if node.graph is self:
            return node
        if self._origin is None or node.graph is not self._origin:
            raise ValueError(
                f"{what}: {node!r} is not a node of the graph this one was cloned from"
            )
        with guard(self.context, what):
            err, mine = drv.cuGraphNodeFindInClone(node.handle, handle)
        if err:
            raise self.context.note_error(err, "cuGraphNodeFindInClone")
        hit = self._nodes.get(int(mine))
        if hit is not None:
            return hit
        origin_spec = self._origin_specs.get(int(node.handle))
        if origin_spec is not None:
            self._specs[int(mine)] = origin_spec
        out = GraphNode(self, mine, node.type, origin_spec)
        self._nodes[int(mine)] = out
        return out

    def instantiate(self) -> GraphExec:
        """An executable graph of the graph as it is now (``cuGraphInstantiate``).

        Later changes to this graph do not reach it; apply them with
        ``exec.update(graph)``. It lives on its own (closing the graph does not close it).
        """
        what = "Graph.instantiate"
        self._open(what)
        if self._parent is not None:
            raise ValueError(
                f"{what}: a conditional body runs as part of its node; instantiate the graph "
                "that holds it"
            )
        return GraphExec(self)

    def _ready(self, what: str) -> GraphExec:
        exe = self._exec
        if exe is not None and exe.handle is not None and self._exec_version == self._version:
            return exe
        if self._open_handle() is None or self._parent is not None:
            raise CudaError(_EMPTY if self._parent is None else f"{what}: {_EMPTY}")
        if exe is not None:
            exe.close()
        self._exec = self.instantiate()
        self._exec_version = self._version
        return self._exec

    def launch(self, stream: Any = None) -> None:
        """Launch the graph on *stream* (``None``: the thread's current stream of the
        graph's context, by default its legacy default stream).

        Uses an executable graph ctxkit keeps (a captured graph's is made at the end of
        its capture block); it is instantiated again after nodes changed.

        Raises
        ------
        CudaError
            The graph is empty (capture unfinished, or closed).
        NoCurrentContextError
            Strict mode and the calling thread has no current context.
        """
        self._ready("Graph.launch")._enqueue(drv.cuGraphLaunch, stream, "Graph.launch")

    def upload(self, stream: Any = None) -> None:
        """Upload the graph to the device ahead of its first launch (``cuGraphUpload``)."""
        self._ready("Graph.upload")._enqueue(drv.cuGraphUpload, stream, "Graph.upload")

    def debug_dot(self, path: str | os.PathLike[str], *, verbose: bool = False) -> None:
        """Write the graph as Graphviz DOT to *path* (``cuGraphDebugDotPrint``)."""
        handle = self._open("Graph.debug_dot")
        flags = 1 if verbose else 0  # CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE
        with guard(self.context, "Graph.debug_dot"):
            (err,) = drv.cuGraphDebugDotPrint(handle, os.fsencode(path), flags)
        if err:
            raise self.context.note_error(err, f"cuGraphDebugDotPrint({os.fspath(path)!r})")

    def close(self) -> None:
        """Destroy the graph (in its context) and the executable graph :meth:`launch`
        used; idempotent. Executable graphs from :meth:`instantiate` stay usable."""
        if self._open_handle() is not None and self._parent is None:
            self.num_nodes  # noqa: B018  (remembered for repr)
        if self._exec is not None:
            self._exec.close()
        if self._fin is not None:
            self._fin()
        self.handle = None

    def __repr__(self) -> str:
        if self._open_handle() is None:
            state = "empty"
        elif self._exec is not None and self._exec_version == self._version:
            state = "ready"
        else:
            state = "not instantiated"
        kind = " body" if self._parent is not None else ""
        count = self._count
        if state != "empty":
            try:
                count = self.num_nodes
            except CudaError:
                pass
        return f"<Graph{kind} {count} nodes {state} in {self.context!r}>"
