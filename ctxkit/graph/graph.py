"""CUDA graphs: ``Graph`` (a ``CUgraph`` built node by node or captured from a stream),
its nodes, and ``GraphExec`` (an instantiated ``CUgraphExec``: launch, update).

A graph's node builders check their arguments and build the node's parameters (with
:mod:`ctxkit.graph.nodes`) before anything reaches the driver; ``depends_on=`` wires the
edges (default: none, a root node). Everything a node uses -- packed kernel arguments
and the buffers among them, the arrays of copies, host callbacks, events -- is kept
alive by the graph and by every executable graph made from it. An executable graph is a
snapshot of its graph at :meth:`Graph.instantiate`: :meth:`GraphExec.update` applies
another graph of the same shape (``cuGraphExecUpdate``; a
:class:`~ctxkit.errors.GraphUpdateError` names the node and the reason when the driver
refuses), :meth:`GraphExec.set_kernel_params` changes one kernel node
(``cuGraphExecKernelNodeSetParams``). Both live here because both hold and read what the
graph keeps alive.

:func:`capture` is the other way to make a graph: it yields a :class:`Graph` that is
empty until its block ends, then holds the ``CUgraph`` the stream's work was recorded
into. While the capture is open, ctxkit's frees are held back (:mod:`ctxkit.lifetime`):
a free would invalidate it.

Host nodes share one C trampoline, a key per callback: a host node runs at every launch
of every executable graph made from its graph, so its callback is not popped when it
runs (unlike ``Stream.launch_host_func``'s): it stays in :data:`_callbacks` while the
:class:`HostCallback` object lives, and the graphs and executable graphs that use it hold
that object. A key whose callback is gone (its graph and every executable graph of it
were dropped while a launch was still queued) is skipped.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import TYPE_CHECKING, Any

from .. import _driver, lifetime
from .._driver import drv
from ..binding import ContextLike, guard, resolve_context
from ..context import Context, require_current, thread_state
from ..errors import ContextClosedError, CudaError, GraphUpdateError
from ..stream import Event, Stream, call_stream
from . import nodes
from .nodes import ConditionalHandle, KernelSpec

if TYPE_CHECKING:
    from ..module.kernel import Kernel

__all__ = ["Graph", "GraphExec", "GraphNode", "capture"]

_EMPTY = "the graph is empty: its capture block has not finished, or it was closed"

#: node type -> the driver function that adds such a node
_ADD = {
    "kernel": "cuGraphAddKernelNode",
    "memcpy": "cuGraphAddMemcpyNode",
    "memset": "cuGraphAddMemsetNode",
    "host": "cuGraphAddHostNode",
    "event_record": "cuGraphAddEventRecordNode",
    "event_wait": "cuGraphAddEventWaitNode",
    "empty": "cuGraphAddEmptyNode",
    "child": "cuGraphAddChildGraphNode",
    "conditional": "cuGraphAddNode",
}


def _call(ctx: Context, what: str, name: str, *args: Any, call: str = "") -> Any:
    """``drv.<name>(*args)`` with *ctx* bound for *what* (as :func:`guard` allows; no
    bind without *what*), its status checked (the error names *call*, by default *name*):
    ``None``, the one result, or the results after the status."""
    with guard(ctx, what) if what else nullcontext():
        err, *out = getattr(drv, name)(*args)
    if err:
        raise ctx.note_error(err, call or name)
    return out[0] if len(out) == 1 else out or None


def _expect(obj: Any, cls: type, name: str, what: str) -> None:
    """Raise ``TypeError`` (*what* names the call) unless *obj* is a *cls*, named *name*."""
    if not isinstance(obj, cls):
        raise TypeError(f"{what}: expected a {name}, got {type(obj).__name__}")


# --- host node callbacks -------------------------------------------------------------

log = logging.getLogger("ctxkit.graph")

_callbacks: weakref.WeakValueDictionary[int, HostCallback] = weakref.WeakValueDictionary()
_keys = itertools.count(1)


class HostCallback:
    """``fn(*args)`` for a host node, and where an exception it raises goes.

    The exception is handed to the ctxkit stream of the latest launch (re-raised by its
    next ``synchronize()``, like ``Stream.launch_host_func``'s), or logged when that
    launch was on a foreign or the legacy default stream.
    """

    __slots__ = ("__weakref__", "args", "fn", "key", "stream_ref")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.key = next(_keys)
        self.stream_ref: weakref.ref[Any] | None = None
        _callbacks[self.key] = self

    def run(self) -> None:
        try:
            self.fn(*self.args)
        except BaseException as exc:
            stream = self.stream_ref() if self.stream_ref is not None else None
            if stream is None:
                log.error("graph host node %r raised", self.fn, exc_info=exc)
            else:
                stream.report_callback_error(exc)

    def __repr__(self) -> str:
        return f"<HostCallback {self.key} {self.fn!r}>"


def _run_host_node(key: int | None) -> None:
    if (cb := _callbacks.get(key or 0)) is not None:
        cb.run()


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_run_host_node)

#: address of the one C trampoline every host node calls (its userData is the key)
HOST_FN_ADDR: int = ctypes.cast(_HOST_FN, ctypes.c_void_p).value or 0


def _host_callbacks(keep: list[Any]) -> list[HostCallback]:
    """The callbacks of the host nodes among what a graph keeps alive (also its
    children's)."""
    return [x for x in keep if isinstance(x, HostCallback)]


# --- nodes ---------------------------------------------------------------------------


class GraphNode:
    """One node of a :class:`Graph`.

    Made by the graph's node builders (``graph.kernel(...)``, ``graph.memcpy(...)``, ...)
    or listed by ``graph.nodes()``. Pass nodes as ``depends_on=`` of later nodes of the
    same graph.

    Attributes
    ----------
    graph : Graph
        The graph it belongs to.
    handle : CUgraphNode
    type : str
        ``"kernel"``, ``"memcpy"``, ``"memset"``, ``"host"``, ``"event_record"``,
        ``"event_wait"``, ``"empty"``, ``"child"``, ``"conditional"``, ...
    """

    __slots__ = ("__weakref__", "_spec", "graph", "handle", "type")

    def __init__(self, graph: Graph, handle: Any, type_: str, spec: KernelSpec | None = None):
        self.graph = graph
        self.handle = handle
        self.type = type_
        self._spec = spec

    @property
    def kernel(self) -> Kernel | None:
        """The kernel of a kernel node built by ctxkit (``None`` otherwise)."""
        return self._spec.kernel if self._spec is not None else None

    @property
    def args(self) -> tuple[Any, ...] | None:
        """The arguments of a kernel node built by ctxkit, as last set on the graph."""
        return self._spec.args if self._spec is not None else None

    def _require_spec(self, what: str) -> KernelSpec:
        if self._spec is None:
            detail = (
                "it was captured from a stream, so ctxkit does not know its kernel's "
                "parameters; build it with graph.kernel(...)"
                if self.type == "kernel"
                else f"it is a {self.type} node"
            )
            raise TypeError(f"{what} needs a kernel node built by graph.kernel(), but {detail}")
        return self._spec

    def set_params(
        self,
        *args: Any,
        grid: Any = None,
        block: Any = None,
        shared_mem: int | None = None,
    ) -> None:
        """Change this kernel node of the (uninstantiated) graph (``cuGraphKernelNodeSetParams``).

        No argument keeps the current arguments (change only *grid*/*block*/*shared_mem*);
        otherwise pass all of them, checked against the kernel's signature. Executable
        graphs made before are unchanged: update them with ``exec.update(graph)`` or
        ``exec.set_kernel_params(node, ...)``.

        Raises
        ------
        LaunchArgumentError
            The arguments do not fit the kernel's parameters.
        TypeError
            Not a kernel node built by ``graph.kernel()``.
        """
        what = "GraphNode.set_params"
        spec = self._require_spec(what)
        graph = self.graph
        graph._open(what)
        ctx = graph.context
        with guard(ctx, what):
            new = spec.replaced(ctx, args or None, grid, block, shared_mem)
            call = f"cuGraphKernelNodeSetParams({new.describe()})"
            _call(ctx, what, "cuGraphKernelNodeSetParams", self.handle, new.params(ctx), call=call)
        self._spec = graph._specs[int(self.handle)] = new
        graph._changed()

    __reduce__ = lifetime.process_local("build or capture the graph there")

    def __repr__(self) -> str:
        detail = f" {self._spec.describe()}" if self._spec is not None else ""
        return f"<GraphNode {self.type}{detail} {int(self.handle):#x}>"


def dependency_handles(graph: Graph, depends_on: Any, what: str) -> list[Any]:
    """The ``CUgraphNode`` list of *depends_on* (a node, nodes, or ``None``).

    Raises ``ValueError`` for a node of another graph and ``TypeError`` for anything that
    is not a :class:`GraphNode`.
    """
    if depends_on is None:
        return []
    try:
        given = list((depends_on,) if isinstance(depends_on, GraphNode) else depends_on)
    except TypeError:
        raise TypeError(
            f"{what}: depends_on must be a GraphNode or a list of them, "
            f"got {type(depends_on).__name__}"
        ) from None
    for n in given:
        if not isinstance(n, GraphNode):
            raise TypeError(f"{what}: depends_on holds {type(n).__name__}, not a GraphNode")
        if n.graph is not graph:
            raise ValueError(
                f"{what}: {n!r} belongs to another graph ({n.graph!r}), not to {graph!r}; "
                "a node can only depend on nodes of its own graph (add a child graph node "
                "with graph.child(other) to run another graph inside this one)"
            )
    return [n.handle for n in given]


class Graph:
    """A CUDA graph (``CUgraph``) in its own context.

    ``g = ck.Graph()`` creates an empty graph in the current context (or *context*);
    :func:`~ctxkit.graph.capture` yields one filled from a stream. Add nodes with
    :meth:`kernel`, :meth:`memcpy`, :meth:`memset`, :meth:`host`, :meth:`event_record`,
    :meth:`event_wait`, :meth:`empty`, :meth:`child` and :meth:`conditional`, then
    :meth:`instantiate` it (a :class:`GraphExec`, launched and
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
        self._setup(ctx, None, None)
        self._own(handle)

    @classmethod
    def _pending(cls, ctx: Context, handle: Any = None, parent: Graph | None = None) -> Graph:
        """A graph not made by ``cuGraphCreate``: one without a ``CUgraph`` yet (a capture
        in progress, a clone), or the body graph of a conditional node of *parent* (the
        node owns it; it shares what *parent* keeps alive)."""
        obj = cls.__new__(cls)
        obj._setup(ctx, handle, parent)
        return obj

    def _setup(self, ctx: Context, handle: Any, parent: Graph | None) -> None:
        self.context = ctx
        self.handle = handle
        self._parent = parent
        self._fin: weakref.finalize | None = None
        # what nodes use (arrays, events, host callbacks, children's) and kernel node ->
        # its current arguments: a body shares its parent's
        self._keep: list[Any] = parent._keep if parent else []
        self._specs: dict[int, KernelSpec] = parent._specs if parent else {}
        self._nodes: weakref.WeakValueDictionary[int, GraphNode] = weakref.WeakValueDictionary()
        self._origin: Graph | None = None  # the graph this one was cloned from
        self._origin_specs: dict[int, KernelSpec] = {}  # its kernel nodes' arguments
        self._exec: GraphExec | None = None  # what launch() uses; dropped when nodes change
        self._count = 0

    def _own(self, handle: Any) -> None:
        self.handle = handle
        self._fin = lifetime.finalizer(self, self.context, drv.cuGraphDestroy, handle)

    # --- state -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (or while its capture block runs)."""
        return self.open_handle() is None

    def open_handle(self) -> Any:
        """The live ``CUgraph``, or None once it (or the graph holding this conditional
        body) was closed, or while its capture block runs."""
        return None if self._parent is not None and self._parent.closed else self.handle

    def _open(self, what: str) -> Any:
        if (handle := self.open_handle()) is None:
            why = (
                "the graph holding this conditional body was closed"
                if self._parent is not None
                else "it was closed, or its capture block has not finished"
            )
            raise ContextClosedError(f"{what}: the graph cannot be used: {why}")
        return handle

    def _changed(self) -> None:
        """Nodes were added or changed: the executable graph :meth:`launch` used is stale
        (also its parent's, for a conditional body)."""
        if self._exec is not None:
            self._exec.close()
            self._exec = None
        if self._parent is not None:
            self._parent._changed()

    @property
    def num_nodes(self) -> int:
        """Nodes in the graph (its own; a child graph or conditional body counts as one)."""
        if (handle := self.open_handle()) is not None:
            self._count = int(_call(self.context, "", "cuGraphGetNodes", handle, 0)[1])
        return self._count

    def nodes(self) -> list[GraphNode]:
        """The graph's nodes (``cuGraphGetNodes``), each with its ``type``; nodes built by
        ctxkit come back as the objects the builders returned."""
        handle = self._open("Graph.nodes")
        if not (n := self.num_nodes):
            return []
        raw, n = _call(self.context, "", "cuGraphGetNodes", handle, n)
        return [self._wrap(h) for h in list(raw)[: int(n)]]

    def _wrap(self, handle: Any) -> GraphNode:
        if (node := self._nodes.get(int(handle))) is None:
            member = _call(self.context, "", "cuGraphNodeGetType", handle)
            node = self._node(handle, nodes.node_type_name(member), self._specs.get(int(handle)))
        return node

    def _node(self, handle: Any, kind: str, spec: KernelSpec | None = None) -> GraphNode:
        """The :class:`GraphNode` of *handle*, remembered (with its kernel arguments)."""
        node = self._nodes[int(handle)] = GraphNode(self, handle, kind, spec)
        if spec is not None:
            self._specs[int(handle)] = spec
        return node

    def _add(
        self,
        kind: str,
        *params: Any,
        depends_on: Any,
        keep: tuple[Any, ...] = (),
        spec: KernelSpec | None = None,
        what: str = "",
    ) -> GraphNode:
        """Add a *kind* node: ``drv.<_ADD[kind]>(graph, deps, len(deps), *params)`` (for
        ``cuGraphAddNode``, the arguments of the bindings' version); keep *keep* alive
        with the graph."""
        what = what or f"Graph.{kind}"
        handle = self._open(what)
        deps = dependency_handles(self, depends_on, what)
        name = _ADD[kind]
        plain = (handle, deps, len(deps), *params)
        args = nodes.add_node_args(handle, deps, *params) if name == "cuGraphAddNode" else plain
        node = _call(self.context, what, name, *args, call=f"{name} ({what})")
        self._keep.extend(keep)
        self._changed()
        return self._node(node, kind, spec)

    # --- nodes that do one thing -------------------------------------------------------

    def kernel(
        self,
        kernel: Kernel,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        *args: Any,
        shared_mem: int = 0,
        depends_on: Any = None,
    ) -> GraphNode:
        """A kernel node (``cuGraphAddKernelNode``); arguments as for ``Kernel.launch``.

        The arguments are checked and packed now, exactly as a launch would, and kept
        (with the buffers among them) while the graph or an executable graph of it lives.
        A :class:`~ctxkit.graph.ConditionalHandle` passes as its value.

        Raises
        ------
        LaunchArgumentError
            The arguments do not fit the kernel's parameters (named in the message).
        CudaError
            The kernel's module is bound to another context, or is closed.
        """
        what = f"Graph.kernel({getattr(kernel, 'name', kernel)!r})"
        self._open(what)
        ctx = self.context
        with guard(ctx, what):
            spec = nodes.kernel_spec(kernel, ctx, grid, block, args, shared_mem)
            params = spec.params(ctx)
        return self._add("kernel", params, depends_on=depends_on, spec=spec, what=what)

    def memcpy(
        self, dst: Any, src: Any, nbytes: int | None = None, *, depends_on: Any = None
    ) -> GraphNode:
        """A copy node (``cuGraphAddMemcpyNode``): device to device, pinned host to
        device or device to pinned host.

        *dst* and *src* are ctxkit buffers/arrays (of the graph's context), other
        libraries' device arrays (``__cuda_array_interface__``) or page-locked numpy
        arrays (``ck.pinned_empty``, ``ck.register_host``). *nbytes* defaults to the size
        both sides share.

        Raises
        ------
        PageableCopyError
            A numpy array is pageable: graphs copy host memory asynchronously.
        WrongContextError
            A ctxkit buffer belongs to another context.
        ValueError
            Sizes differ (without *nbytes*), *nbytes* exceeds a side, or nothing to copy.
        """
        what = "Graph.memcpy"
        self._open(what)
        params = nodes.memcpy_params(dst, src, nbytes, self.context, what)
        return self._add("memcpy", params, self.context.cu, depends_on=depends_on, keep=(dst, src))

    def memset(
        self,
        dst: Any,
        value: int,
        count: int | None = None,
        element_size: int = 1,
        *,
        depends_on: Any = None,
    ) -> GraphNode:
        """A memset node (``cuGraphAddMemsetNode``): *count* elements of *element_size*
        (1, 2 or 4) bytes of device memory *dst* set to *value* (the element's bit
        pattern); *count* defaults to the whole of *dst*."""
        what = "Graph.memset"
        self._open(what)
        params = nodes.memset_params(dst, value, count, element_size, self.context, what)
        return self._add("memset", params, self.context.cu, depends_on=depends_on, keep=(dst,))

    def host(self, fn: Any, *args: Any, depends_on: Any = None) -> GraphNode:
        """A host node (``cuGraphAddHostNode``): ``fn(*args)`` runs on a driver thread at
        every launch, when the nodes it depends on have completed.

        ``fn`` must not call CUDA. An exception it raises is re-raised by the next
        ``synchronize()`` of the ctxkit stream the graph was launched on (logged for
        other streams). ``fn`` stays alive while the graph or an executable graph of it
        does.
        """
        what = "Graph.host"
        if not callable(fn):
            raise TypeError(f"{what}: fn must be callable, got {type(fn).__name__}")
        self._open(what)
        cb = HostCallback(fn, args)
        params = drv.CUDA_HOST_NODE_PARAMS()
        params.fn = drv.CUhostFn(HOST_FN_ADDR)
        params.userData = cb.key
        return self._add("host", params, depends_on=depends_on, keep=(cb,))

    def event_record(self, event: Event, *, depends_on: Any = None) -> GraphNode:
        """An event record node (``cuGraphAddEventRecordNode``); *event* must belong to
        the graph's context."""
        return self._event_node(event, depends_on, "event_record")

    def event_wait(self, event: Event, *, depends_on: Any = None) -> GraphNode:
        """An event wait node (``cuGraphAddEventWaitNode``): the nodes after it wait for
        the work before *event*'s latest record (of any context)."""
        return self._event_node(event, depends_on, "event_wait")

    def _event_node(self, event: Event, depends_on: Any, kind: str) -> GraphNode:
        what = f"Graph.{kind}"
        _expect(event, Event, "ctxkit.Event", what)
        if (handle := event.handle) is None:
            raise ContextClosedError(f"{what}: the event was closed")
        if kind == "event_record":
            fix = "; create the event in the graph's context (ck.Event(context=graph.context))"
            nodes.check_context(self.context, event.context, what, repr(event), fix)
        return self._add(kind, handle, depends_on=depends_on, keep=(event,))

    def empty(self, *, depends_on: Any = None) -> GraphNode:
        """A node that does nothing (``cuGraphAddEmptyNode``): a join point of edges."""
        return self._add("empty", depends_on=depends_on)

    # --- child and conditional nodes -------------------------------------------------

    def child(self, graph: Graph, *, depends_on: Any = None) -> GraphNode:
        """A child graph node (``cuGraphAddChildGraphNode``): a copy of *graph* as it is
        now runs as one node (later changes to *graph* do not reach it)."""
        what = "Graph.child"
        _expect(graph, Graph, "ctxkit.Graph", what)
        if graph is self:
            raise ValueError(f"{what}: a graph cannot contain itself")
        child = graph._open(what)
        fix = "; build both in one context"
        nodes.check_context(self.context, graph.context, what, repr(graph), fix)
        keep = (*graph._keep, *graph._specs.values())
        return self._add("child", child, depends_on=depends_on, keep=keep)

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
        value = nodes.default_arg(default, what)
        handle = self._open(what)
        nodes.check_supported(what)
        ctx = self.context
        flags = int(getattr(drv, "CU_GRAPH_COND_ASSIGN_DEFAULT", 1))
        cond = _call(ctx, what, "cuGraphConditionalHandleCreate", handle, ctx.cu, value, flags)
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
        :data:`~ctxkit.graph.nodes.CONDITIONAL_DEVICE_API`), taking *handle* as an
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
        kind_enum = nodes.kind_member(kind, what)
        self._open(what)
        if handle is None:
            handle = self.conditional_handle(default)
        elif not isinstance(handle, ConditionalHandle):
            raise TypeError(f"{what}: handle must be a ConditionalHandle, got {handle!r}")
        elif handle.graph is not self:
            raise ValueError(
                f"{what}: {handle!r} was made for {handle.graph!r}; make it with this "
                "graph's conditional_handle()"
            )
        params = nodes.conditional_params(handle.handle, kind_enum, self.context.cu)
        node = self._add("conditional", params, depends_on=depends_on, what=what)
        handle.kind = kind
        return node, Graph._pending(self.context, params.conditional.phGraph_out[0], self), handle

    # --- whole-graph operations ------------------------------------------------------

    def clone(self) -> Graph:
        """A copy of the graph (``cuGraphClone``); :meth:`find` maps nodes to the copy's."""
        what = "Graph.clone"
        handle = self._open(what)
        if self._parent is not None:
            raise ValueError(f"{what}: clone the graph holding the conditional body instead")
        out = Graph._pending(self.context)
        out._own(_call(self.context, what, "cuGraphClone", handle))
        out._keep, out._origin, out._origin_specs = list(self._keep), self, dict(self._specs)
        return out

    def find(self, node: GraphNode) -> GraphNode:
        """This clone's node for *node* of the graph it was cloned from
        (``cuGraphNodeFindInClone``)."""
        what = "Graph.find"
        handle = self._open(what)
        _expect(node, GraphNode, "GraphNode", what)
        if node.graph is self:
            return node
        if self._origin is None or node.graph is not self._origin:
            raise ValueError(
                f"{what}: {node!r} is not a node of the graph this one was cloned from"
            )
        mine = _call(self.context, what, "cuGraphNodeFindInClone", node.handle, handle)
        spec = self._origin_specs.get(int(node.handle))
        return self._nodes.get(int(mine)) or self._node(mine, node.type, spec)

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
        if self._exec is None:
            if self.open_handle() is None or self._parent is not None:
                raise CudaError(_EMPTY if self._parent is None else f"{what}: {_EMPTY}")
            self._exec = self.instantiate()
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
        what = "Graph.debug_dot"
        handle = self._open(what)
        name = "cuGraphDebugDotPrint"
        call = f"{name}({os.fspath(path)!r})"
        # flags: 1 is CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE
        _call(self.context, what, name, handle, os.fsencode(path), 1 if verbose else 0, call=call)

    def close(self) -> None:
        """Destroy the graph (in its context) and the executable graph :meth:`launch`
        used; idempotent. Executable graphs from :meth:`instantiate` stay usable."""
        if self.open_handle() is not None and self._parent is None:
            self.num_nodes  # noqa: B018  (remembered for repr)
        if self._exec is not None:
            self._exec.close()
            self._exec = None
        if self._fin is not None:
            self._fin()
        self.handle = None

    __reduce__ = lifetime.process_local("build or capture the graph there")

    def __repr__(self) -> str:
        ready = "ready" if self._exec is not None else "not instantiated"
        state = ready if self.open_handle() is not None else "empty"
        kind = " body" if self._parent is not None else ""
        with suppress(CudaError):  # refreshes self._count while the graph is open
            self.num_nodes  # noqa: B018
        return f"<Graph{kind} {self._count} nodes {state} in {self.context!r}>"


# --- stream capture ------------------------------------------------------------------

#: the modes of ``capture``: ``CU_STREAM_CAPTURE_MODE_<MODE>``
_CAPTURE_MODES = ("global", "relaxed", "thread_local")

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
    if mode not in _CAPTURE_MODES:
        raise ValueError(f"mode must be one of {list(_CAPTURE_MODES)}, not {mode!r}")
    mode_enum = getattr(drv.CUstreamCaptureMode, f"CU_STREAM_CAPTURE_MODE_{mode.upper()}")
    sc = getattr(stream, "context", None)
    ctx = sc if isinstance(sc, Context) else require_current("graph capture")
    _, hs, _ = call_stream(stream, ctx, "graph")
    if int(hs) in _SPECIAL_STREAMS:
        raise ValueError("the default stream cannot be captured; capture a ck.Stream()")
    graph = Graph._pending(ctx)
    tracked, global_mode = mode != "relaxed", mode == "global"
    with guard(ctx, "graph capture"):
        # marked open before it begins (frees are held back, the block cache hands
        # nothing out for the stream): a free between the two -- the garbage collector
        # runs at any allocation -- would invalidate it
        if tracked:
            lifetime.capture_begins(global_mode)
        lifetime.stream_capture_begins(int(hs))
        try:
            _driver.raise_for(drv.cuStreamBeginCapture(hs, mode_enum)[0], "cuStreamBeginCapture")
            try:
                yield graph
            except BaseException:
                err, cu_graph = drv.cuStreamEndCapture(hs)
                if not err and cu_graph is not None and int(cu_graph):
                    drv.cuGraphDestroy(cu_graph)
                raise
            err, cu_graph = drv.cuStreamEndCapture(hs)
        finally:  # the capture is over: run the frees it held back
            lifetime.stream_capture_ends(int(hs))
            if tracked:
                lifetime.capture_ends(global_mode)
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
        graph._own(cu_graph)
        graph.num_nodes  # noqa: B018  (remembered: repr and num_nodes after close)
        graph._ready("graph capture")


# --- executable graphs ---------------------------------------------------------------

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
        ctx = graph.context
        exe = _call(ctx, what, "cuGraphInstantiate", graph._open(what), 0)
        self.context = ctx
        self._graph = weakref.ref(graph)  # a graph launching its own exec holds it
        self.handle = exe
        self._uses = (list(graph._keep), dict(graph._specs))
        self._params: dict[int, KernelSpec] = {}  # set_kernel_params, by node handle
        self._callbacks = _host_callbacks(graph._keep)
        self._fin: weakref.finalize = lifetime.finalizer(self, ctx, drv.cuGraphExecDestroy, exe)

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
        if (exe := self.handle) is None:
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
        exe = self._open(what)
        ctx = self.context
        s, hs, _ = call_stream(stream, ctx, "graph")
        if self._callbacks:  # host nodes report exceptions to the stream of this launch
            ref = weakref.ref(s) if isinstance(s, Stream) else None
            for cb in self._callbacks:
                cb.stream_ref = ref
        if thread_state().top is ctx:
            (err,) = fn(exe, hs)
        else:
            with guard(ctx, what):
                (err,) = fn(exe, hs)
        if err:
            raise ctx.note_error(int(err), getattr(fn, "__name__", what))

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
        _expect(graph, Graph, "ctxkit.Graph", what)
        handle = graph._open(what)
        ctx = self.context
        nodes.check_context(ctx, graph.context, what, repr(graph), mine="the executable graph")
        with guard(ctx, what):
            err, info = drv.cuGraphExecUpdate(exe, handle)
            result, node = getattr(info, "result", None), getattr(info, "errorNode", None)
            if err and result is None:
                err, result, node = _ask_libcuda(exe, handle, int(err))
        if err:
            raise _update_error(int(err), result, node, graph)
        self._updated = (list(graph._keep), dict(graph._specs))  # kept alive while it runs
        self._params.clear()
        self._callbacks = _host_callbacks(graph._keep)

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
        _expect(node, GraphNode, "GraphNode", what)
        if node.graph is not self._graph():
            raise ValueError(
                f"{what}: {node!r} belongs to {node.graph!r}, not to the graph this "
                f"executable graph was instantiated from ({self.graph!r}); pass its node"
            )
        key = int(node.handle)
        base = self._params.get(key) or self._uses[1].get(key) or node._require_spec(what)
        ctx = self.context
        name = "cuGraphExecKernelNodeSetParams"
        with guard(ctx, what):
            new = base.replaced(ctx, args or None, grid, block, shared_mem)
            call = f"{name}({new.describe()})"
            _call(ctx, what, name, exe, node.handle, new.params(ctx), call=call)
        self._params[key] = new

    def close(self) -> None:
        """Destroy the executable graph (in its context); idempotent."""
        self._fin()
        self.handle = None

    __reduce__ = lifetime.process_local("build or capture the graph there")

    def __repr__(self) -> str:
        state = "closed" if self.handle is None else f"{int(self.handle):#x}"
        return f"<GraphExec {state} of {self.graph!r}>"


def _ask_libcuda(exe: Any, handle: Any, err: int) -> tuple[int, Any, Any]:
    """Update again through libcuda to learn why the driver refused (cuda-bindings returns
    no result info on failure): the status, the ``CUgraphExecUpdateResult`` and the
    ``CUgraphNode`` it names (``None`` where libcuda cannot be asked)."""
    if (raw := _driver.graph_exec_update_info(exe, handle)) is None:
        return err, None, None
    code, result, node = raw
    with suppress(ValueError):
        result = drv.CUgraphExecUpdateResult(result)
    return code, result, drv.CUgraphNode(node) if node else None


def _update_error(code: int, result: Any, handle: Any, graph: Graph) -> GraphUpdateError:
    """The :class:`GraphUpdateError` for a refused ``cuGraphExecUpdate``: *result* says
    why, *handle* is the node it names (either may be ``None``)."""
    if result is None:
        suffix, full = "ERROR", "no CUgraphExecUpdateResultInfo: the driver gave no reason"
    else:
        full = getattr(result, "name", None) or f"CUgraphExecUpdateResult {result}"
        suffix = full.removeprefix("CU_GRAPH_EXEC_UPDATE_").removeprefix("ERROR_")
    why = _REASONS.get(suffix, f"the driver answered {full}")
    try:
        node = graph._wrap(handle) if handle is not None and int(handle) else None
    except CudaError:
        node = None
    at = f"; the node: {node!r}" if node is not None else ""
    name, _text = _driver.describe(code)
    return GraphUpdateError(
        f"GraphExec.update: cuGraphExecUpdate refused {graph!r}: {why} ({full}){at}. Fix: "
        "instantiate the new graph (graph.instantiate()) instead, or keep the nodes, edges "
        "and node types and change only parameters (kernel arguments and launch shape, "
        "copy and memset addresses)",
        code,
        name,
        reason=suffix.lower(),
        node=node,
    )
