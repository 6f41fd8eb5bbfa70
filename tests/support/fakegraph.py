"""Explicitly built graphs for tests/support/fakegpu.py (mixed in through CaptureRules).

A graph is a list of nodes with dependency edges. ``cuGraphLaunch`` enqueues one
operation on the stream that runs the nodes in a topological order which, among the nodes
ready at a time, takes the one added *last*: work whose order matters gives a wrong result
here unless the graph has the edge, as on a GPU, where unordered nodes run concurrently.

What the driver copies at node creation the fake copies too: a kernel node's argument
bytes (read through the ``void**`` with the argument sizes the test registered for the
kernel, :meth:`GraphNodes.kernel_impl`), copy and memset parameters. A kernel node runs
its registered Python implementation with the decoded arguments; a host node calls the
C function pointer with its userData, as the driver does; a conditional node runs its
body while (or if) the handle's value, set by kernels through
:meth:`GraphNodes.set_conditional`, is non-zero. ``cuGraphExecUpdate`` refuses another
topology or node type, naming the node, with ``CUgraphExecUpdateResultInfo``.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from cuda.bindings import driver as _real

INVALID_VALUE = 1
INVALID_HANDLE = 400
GRAPH_EXEC_UPDATE_FAILURE = 910
COND_ASSIGN_DEFAULT = 1
_T = _real.CUgraphNodeType
_R = _real.CUgraphExecUpdateResult
_HOST_CALL = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_ids = itertools.count(0x7000_0000, 0x10)


class Node:
    """One node: its type, dependencies (indices into the graph's list) and payload."""

    def __init__(self, kind: Any, deps: list[int], payload: Any) -> None:
        self.kind = kind
        self.deps = deps
        self.payload = payload
        self.handle = next(_ids)
        self.origin = self.handle  # the node of the original graph (clones, execs)

    def copy(self) -> Node:
        payload = self.payload
        if isinstance(payload, FakeGraph):
            payload = payload.copy()
        elif isinstance(payload, dict):
            payload = {k: (v.copy() if isinstance(v, FakeGraph) else v) for k, v in payload.items()}
        out = Node(self.kind, list(self.deps), payload)
        out.origin = self.handle
        return out


class FakeGraph:
    """A CUgraph or CUgraphExec of the fake."""

    def __init__(self, ctx: int, executable: bool = False) -> None:
        self.ctx = ctx
        self.executable = executable
        self.nodes: list[Node] = []

    def copy(self, executable: bool = False) -> FakeGraph:
        out = FakeGraph(self.ctx, executable)
        out.nodes = [n.copy() for n in self.nodes]
        return out

    def order(self) -> list[Node]:
        """Topological order; among ready nodes the one added last first."""
        done: set[int] = set()
        out: list[Node] = []
        while len(out) < len(self.nodes):
            ready = [
                i
                for i, n in enumerate(self.nodes)
                if i not in done and all(d in done for d in n.deps)
            ]
            i = ready[-1]
            done.add(i)
            out.append(self.nodes[i])
        return out


class GraphNodes:
    """Mixed into FakeGPU (through CaptureRules), which supplies ``current()``,
    ``events``, ``unsafe()``, ``_submit`` and ``_handles``."""

    CUDA_KERNEL_NODE_PARAMS = _real.CUDA_KERNEL_NODE_PARAMS
    CUDA_MEMCPY3D = _real.CUDA_MEMCPY3D
    CUDA_MEMSET_NODE_PARAMS = _real.CUDA_MEMSET_NODE_PARAMS
    CUDA_HOST_NODE_PARAMS = _real.CUDA_HOST_NODE_PARAMS
    CUgraphNodeParams = _real.CUgraphNodeParams
    CUgraphNodeType = _real.CUgraphNodeType
    CUgraphExecUpdateResult = _real.CUgraphExecUpdateResult
    CUgraphNode = _real.CUgraphNode
    CUgraphConditionalNodeType = _real.CUgraphConditionalNodeType
    CUmemorytype = _real.CUmemorytype
    CUhostFn = _real.CUhostFn
    CUgraphEdgeData = _real.CUgraphEdgeData
    CU_GRAPH_COND_ASSIGN_DEFAULT = COND_ASSIGN_DEFAULT

    def init_graph_nodes(self) -> None:
        self.graphs: dict[int, FakeGraph] = {}  # CUgraph and CUgraphExec handles
        self.kernel_names: dict[int, str] = {}  # CUkernel and CUfunction -> name
        self.kernel_impls: dict[str, tuple[tuple[str, ...], Callable[..., None]]] = {}
        self.conditionals: dict[int, list[int]] = {}  # handle -> [value, default, flags]
        self.graph_calls: list[str] = []
        self.update_calls = 0
        self._glock = threading.Lock()

    # --- test API ----------------------------------------------------------------------

    def kernel_impl(self, name: str, formats: tuple[str, ...], fn: Callable[..., None]) -> None:
        """Register what kernel *name* does on the fake: ``fn(grid, block, *args)`` with
        the arguments decoded by the struct *formats* (one per parameter)."""
        self.kernel_impls[name] = (formats, fn)

    def set_conditional(self, handle: int, value: int) -> None:
        """``cudaGraphSetConditional`` for fake kernels."""
        self.conditionals[int(handle)][0] = int(value)

    def node_kinds(self, g: Any) -> list[str]:
        """The node types of graph *g*, in the order they were added."""
        return [
            _T(n.kind).name.removeprefix("CU_GRAPH_NODE_TYPE_") for n in self.graphs[int(g)].nodes
        ]

    # --- helpers -----------------------------------------------------------------------

    def _graph(self, g: Any) -> FakeGraph | None:
        return self.graphs.get(int(g))

    def _find(self, node: Any) -> tuple[FakeGraph, int] | None:
        h = int(node)
        for g in self._all_graphs():
            for i, n in enumerate(g.nodes):
                if n.handle == h:
                    return g, i
        return None

    def _all_graphs(self) -> list[FakeGraph]:
        out: list[FakeGraph] = []
        todo = list(self.graphs.values())
        while todo:
            g = todo.pop()
            out.append(g)
            for n in g.nodes:
                if isinstance(n.payload, FakeGraph):
                    todo.append(n.payload)
                elif isinstance(n.payload, dict) and isinstance(n.payload.get("body"), FakeGraph):
                    todo.append(n.payload["body"])
        return out

    def _add(self, g: Any, deps: Any, n: int, kind: Any, payload: Any) -> tuple[int, Any]:
        graph = self._graph(g)
        if graph is None or graph.executable:
            return (INVALID_VALUE, None)
        deps = list(deps or [])
        if len(deps) != n:
            return (INVALID_VALUE, None)
        index = {node.handle: i for i, node in enumerate(graph.nodes)}
        try:
            dep_ix = [index[int(d)] for d in deps]
        except KeyError:
            return (INVALID_VALUE, None)  # a node of another graph
        node = Node(kind, dep_ix, payload)
        graph.nodes.append(node)
        return (0, _real.CUgraphNode(node.handle))

    def _kernel_payload(self, p: Any) -> tuple[int, dict[str, Any]]:
        name = self.kernel_names.get(int(p.func))
        if name is None:
            return INVALID_HANDLE, {}
        formats, _fn = self.kernel_impls.get(name, ((), None))
        addr = int(p.kernelParams)
        raw = []
        for i, fmt in enumerate(formats):
            ptr = ctypes.c_void_p.from_address(addr + 8 * i).value or 0
            raw.append(ctypes.string_at(ptr, struct.calcsize("<" + fmt)))
        return 0, {
            "name": name,
            "grid": (p.gridDimX, p.gridDimY, p.gridDimZ),
            "block": (p.blockDimX, p.blockDimY, p.blockDimZ),
            "shared": int(p.sharedMemBytes),
            "raw": raw,
        }

    # --- kernels (libraries) -----------------------------------------------------------

    def cuKernelGetFunction(self, kernel: Any) -> tuple[int, Any]:
        name = self.kernel_names.get(int(kernel))
        if name is None:
            return (INVALID_HANDLE, None)
        f = _real.CUfunction(next(_ids))
        self.kernel_names[int(f)] = name
        return (0, f)

    # --- building ----------------------------------------------------------------------

    def cuGraphCreate(self, flags: int) -> tuple[int, Any]:
        ctx = self.current()  # type: ignore[attr-defined]
        h = _real.CUgraph(next(_ids))
        self.graphs[int(h)] = FakeGraph(ctx)
        return (0, h)

    def cuGraphAddKernelNode(self, g: Any, deps: Any, n: int, p: Any) -> tuple[int, Any]:
        err, payload = self._kernel_payload(p)
        if err:
            return (err, None)
        return self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_KERNEL, payload)

    def cuGraphKernelNodeSetParams(self, node: Any, p: Any) -> tuple[int]:
        hit = self._find(node)
        if hit is None or hit[0].executable:
            return (INVALID_VALUE,)
        err, payload = self._kernel_payload(p)
        if err:
            return (err,)
        hit[0].nodes[hit[1]].payload = payload
        return (0,)

    def cuGraphExecKernelNodeSetParams(self, exe: Any, node: Any, p: Any) -> tuple[int]:
        graph = self._graph(exe)
        if graph is None or not graph.executable:
            return (INVALID_VALUE,)
        target = [x for x in graph.nodes if x.origin == int(node)]
        if not target:
            return (INVALID_VALUE,)
        err, payload = self._kernel_payload(p)
        if err:
            return (err,)
        target[0].payload = payload
        return (0,)

    def cuGraphAddMemcpyNode(self, g: Any, deps: Any, n: int, p: Any, ctx: Any) -> tuple[int, Any]:
        host = _real.CUmemorytype.CU_MEMORYTYPE_HOST
        src = int(p.srcHost) if p.srcMemoryType == host else int(p.srcDevice)
        dst = int(p.dstHost) if p.dstMemoryType == host else int(p.dstDevice)
        payload = {"src": src, "dst": dst, "n": int(p.WidthInBytes)}
        return self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_MEMCPY, payload)

    def cuGraphAddMemsetNode(self, g: Any, deps: Any, n: int, p: Any, ctx: Any) -> tuple[int, Any]:
        payload = {
            "dst": int(p.dst),
            "value": int(p.value),
            "size": int(p.elementSize),
            "count": int(p.width),
        }
        return self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_MEMSET, payload)

    def cuGraphAddHostNode(self, g: Any, deps: Any, n: int, p: Any) -> tuple[int, Any]:
        payload = {"fn": int(p.fn), "data": int(p.userData)}
        return self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_HOST, payload)

    def cuGraphAddEventRecordNode(self, g: Any, deps: Any, n: int, ev: Any) -> tuple[int, Any]:
        if int(ev) not in self.events:  # type: ignore[attr-defined]
            return (INVALID_HANDLE, None)
        return self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_EVENT_RECORD, int(ev))

    def cuGraphAddEventWaitNode(self, g: Any, deps: Any, n: int, ev: Any) -> tuple[int, Any]:
        if int(ev) not in self.events:  # type: ignore[attr-defined]
            return (INVALID_HANDLE, None)
        return self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_WAIT_EVENT, int(ev))

    def cuGraphAddEmptyNode(self, g: Any, deps: Any, n: int) -> tuple[int, Any]:
        return self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_EMPTY, None)

    def cuGraphAddChildGraphNode(self, g: Any, deps: Any, n: int, child: Any) -> tuple[int, Any]:
        c = self._graph(child)
        if c is None:
            return (INVALID_VALUE, None)
        return self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_GRAPH, c.copy())

    def cuGraphConditionalHandleCreate(
        self, g: Any, ctx: Any, default: int, flags: int
    ) -> tuple[int, Any]:
        if self._graph(g) is None:
            return (INVALID_VALUE, None)
        h = next(_ids)
        self.conditionals[h] = [int(default), int(default), int(flags)]
        return (0, _real.CUgraphConditionalHandle(h))

    def cuGraphAddNode(self, g: Any, deps: Any, *rest: Any) -> tuple[int, Any]:
        """``(g, deps, edgeData, n, params)`` in cuda-bindings 13.x, ``(g, deps, n,
        params)`` in 12.x; only conditional nodes are modelled."""
        if self.bindings_major >= 13:  # type: ignore[attr-defined]
            if len(rest) != 3:
                raise TypeError("cuGraphAddNode takes 5 arguments (with edge data) in 13.x")
            edges, n, p = rest
            if n and len(edges or ()) != n:
                raise RuntimeError("fake: the edge data list is shorter than the dependencies")
        else:
            if len(rest) != 2:
                raise TypeError("cuGraphAddNode takes 4 arguments in cuda-bindings 12.x")
            n, p = rest
        if p.type != _T.CU_GRAPH_NODE_TYPE_CONDITIONAL or p.conditional.size != 1:
            return (INVALID_VALUE, None)
        graph = self._graph(g)
        if graph is None:
            return (INVALID_VALUE, None)
        body = FakeGraph(graph.ctx)
        payload = {
            "handle": int(p.conditional.handle),
            "type": p.conditional.type.name,
            "body": body,
        }
        err, node = self._add(g, deps, n, _T.CU_GRAPH_NODE_TYPE_CONDITIONAL, payload)
        if err:
            return (err, None)
        body_handle = next(_ids)
        self.graphs[body_handle] = body  # the node owns it; cuGraphDestroy of it is a bug
        body.owned_by_node = True  # type: ignore[attr-defined]
        out = (ctypes.c_uint64 * 1)(body_handle)
        payload["out"] = out  # phGraph_out points at it, like the driver's own storage
        ctypes.c_uint64.from_address(p.conditional.getPtr() + 16).value = ctypes.addressof(out)
        return (0, node)

    # --- queries -----------------------------------------------------------------------

    def cuGraphGetNodes(self, g: Any, num: int = 0) -> tuple[int, Any, int]:
        graph = self._graph(g)
        if graph is None:
            return (INVALID_VALUE, None, 0)
        if not num:
            return (0, None, len(graph.nodes))
        handles = [_real.CUgraphNode(n.handle) for n in graph.nodes[:num]]
        return (0, handles, len(handles))

    def cuGraphNodeGetType(self, node: Any) -> tuple[int, Any]:
        hit = self._find(node)
        if hit is None:
            return (INVALID_VALUE, None)
        return (0, _T(hit[0].nodes[hit[1]].kind))

    def cuGraphClone(self, g: Any) -> tuple[int, Any]:
        graph = self._graph(g)
        if graph is None:
            return (INVALID_VALUE, None)
        h = _real.CUgraph(next(_ids))
        self.graphs[int(h)] = graph.copy()
        return (0, h)

    def cuGraphNodeFindInClone(self, node: Any, clone: Any) -> tuple[int, Any]:
        graph = self._graph(clone)
        if graph is None:
            return (INVALID_VALUE, None)
        for n in graph.nodes:
            if n.origin == int(node):
                return (0, _real.CUgraphNode(n.handle))
        return (INVALID_VALUE, None)

    def cuGraphDebugDotPrint(self, g: Any, path: bytes, flags: int) -> tuple[int]:
        graph = self._graph(g)
        if graph is None:
            return (INVALID_VALUE,)
        lines = ["digraph fake {"]
        for i, n in enumerate(graph.nodes):
            lines.append(f'  n{i} [label="{_T(n.kind).name}"];')
            lines += [f"  n{d} -> n{i};" for d in n.deps]
        with open(path, "w") as f:
            f.write("\n".join([*lines, "}"]) + "\n")
        return (0,)

    # --- instantiate, update, launch -----------------------------------------------------

    def cuGraphInstantiate(self, g: Any, flags: int) -> tuple[int, Any]:
        graph = self._graph(g)
        if graph is None or graph.executable or getattr(graph, "owned_by_node", False):
            return (INVALID_VALUE, None)
        h = _real.CUgraphExec(next(_ids))
        self.graphs[int(h)] = graph.copy(executable=True)
        return (0, h)

    def cuGraphExecUpdate(self, exe: Any, g: Any) -> tuple[int, Any]:
        """As cuda-bindings answers: no result info when the update is refused (the
        reason is what ``_driver.graph_exec_update_info`` reads from libcuda)."""
        self.update_calls += 1
        code, info = self._update(exe, g)
        return (code, info if not code else None)

    def graph_exec_update_info(self, exe: Any, g: Any) -> tuple[int, int, int]:
        """The fake's ``_driver.graph_exec_update_info``: (CUresult, result, node)."""
        code, info = self._update(exe, g)
        return (code, int(info.result), int(info.errorNode or 0))

    def _update(self, exe: Any, g: Any) -> tuple[int, Any]:
        target, graph = self._graph(exe), self._graph(g)
        info = _real.CUgraphExecUpdateResultInfo()
        if target is None or graph is None or not target.executable:
            info.result = _R.CU_GRAPH_EXEC_UPDATE_ERROR
            return (INVALID_VALUE, info)
        failure = _mismatch(target.nodes, graph.nodes)
        if failure is not None:
            result, node = failure
            info.result = result
            if node is not None:
                info.errorNode = _real.CUgraphNode(node.handle)
            return (GRAPH_EXEC_UPDATE_FAILURE, info)
        for mine, theirs in zip(target.nodes, graph.nodes):
            mine.payload = theirs.copy().payload
        info.result = _R.CU_GRAPH_EXEC_UPDATE_SUCCESS
        return (0, info)

    def cuGraphLaunch(self, exe: Any, h: Any) -> tuple[int]:
        graph = self._graph(exe)
        if graph is None or not graph.executable:
            return (INVALID_VALUE,)
        self.graph_calls.append("launch")
        plan = self._plan(graph)
        return (self._submit(h, lambda: self._run(plan), "cuGraphLaunch"),)  # type: ignore[attr-defined]

    def _plan(self, graph: FakeGraph) -> list[tuple[Node, Any]]:
        """The launch-time half of each node: event generations are taken at enqueue."""
        out: list[tuple[Node, Any]] = []
        for node in graph.order():
            extra: Any = None
            if node.kind == _T.CU_GRAPH_NODE_TYPE_EVENT_RECORD:
                extra = self.events[node.payload].capture()  # type: ignore[attr-defined]
            elif node.kind == _T.CU_GRAPH_NODE_TYPE_WAIT_EVENT:
                extra = self.events[node.payload].gen  # type: ignore[attr-defined]
            elif node.kind == _T.CU_GRAPH_NODE_TYPE_GRAPH:
                extra = self._plan(node.payload)
            elif node.kind == _T.CU_GRAPH_NODE_TYPE_CONDITIONAL:
                c = self.conditionals[node.payload["handle"]]
                if c[2] & COND_ASSIGN_DEFAULT:
                    c[0] = c[1]
            out.append((node, extra))
        return out

    def _run(self, plan: list[tuple[Node, Any]]) -> None:
        for node, extra in plan:
            self._run_node(node, extra)

    def _run_node(self, node: Node, extra: Any) -> None:
        kind, p = node.kind, node.payload
        if kind == _T.CU_GRAPH_NODE_TYPE_KERNEL:
            if callable(p):  # captured from a stream
                p()
                return
            formats, fn = self.kernel_impls[p["name"]]
            args = [struct.unpack("<" + f, b)[0] for f, b in zip(formats, p["raw"])]
            fn(p["grid"], p["block"], *args)
        elif kind == _T.CU_GRAPH_NODE_TYPE_MEMCPY:
            ctypes.memmove(p["dst"], p["src"], p["n"])
        elif kind == _T.CU_GRAPH_NODE_TYPE_MEMSET:
            dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[p["size"]]
            raw = (ctypes.c_char * (p["count"] * p["size"])).from_address(p["dst"])
            np.frombuffer(raw, dtype=dtype)[:] = p["value"]
        elif kind == _T.CU_GRAPH_NODE_TYPE_HOST:
            _HOST_CALL(p["fn"])(p["data"])
        elif kind == _T.CU_GRAPH_NODE_TYPE_EVENT_RECORD:
            self.events[p].complete(extra)  # type: ignore[attr-defined]
        elif kind == _T.CU_GRAPH_NODE_TYPE_WAIT_EVENT:
            self.events[p].wait(extra)  # type: ignore[attr-defined]
        elif kind == _T.CU_GRAPH_NODE_TYPE_GRAPH:
            self._run(extra)
        elif kind == _T.CU_GRAPH_NODE_TYPE_CONDITIONAL:
            c = self.conditionals[p["handle"]]
            body = p["body"]
            if p["type"].endswith("_IF"):
                if c[0]:
                    self._run(self._plan(body))
                return
            for _ in range(10_000):  # a runaway while loop fails the test, not the process
                if not c[0]:
                    return
                self._run(self._plan(body))
            raise AssertionError("fake: a conditional while loop ran 10000 times")


def _mismatch(old: list[Node], new: list[Node]) -> tuple[Any, Node | None] | None:
    """Why *new* cannot update an executable graph of *old* (``None``: it can)."""
    if len(old) != len(new):
        return _R.CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED, new[-1] if new else None
    for a, b in zip(old, new):
        if a.kind != b.kind:
            return _R.CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED, b
        if sorted(a.deps) != sorted(b.deps):
            return _R.CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED, b
        kernel = a.kind == _T.CU_GRAPH_NODE_TYPE_KERNEL and not callable(a.payload)
        if kernel and a.payload["name"] != b.payload["name"]:
            return _R.CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED, b
    return None
