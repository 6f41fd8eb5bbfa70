"""Graph nodes and the driver structures that describe them.

:class:`GraphNode` is one node of a :class:`~ctxkit.graph.graph.Graph`. The helpers here
check what a node builder was given -- dependencies, kernel arguments (packed by the
kernel's own :class:`~ctxkit.module.params.ArgPacker`, exactly as ``Kernel.launch``
packs them), copy and memset targets -- and build the ``CUDA_*_NODE_PARAMS`` structures,
before anything reaches the driver.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._driver import drv
from ..context import Context
from ..errors import PageableCopyError, WrongContextError
from ..memory.copies import Mem, device_mem
from ..memory.host import is_pinned, plain_dtype
from ..registry import guard
from .conditional import ConditionalHandle

if TYPE_CHECKING:
    from ..module.kernel import Kernel
    from ..module.params import ParamBuffer
    from .graph import Graph

__all__ = ["GraphNode", "KernelSpec", "node_type_name"]

_INVALID_HANDLE = 400

#: readable names of ``CUgraphNodeType`` members (others: the member's suffix, lower case)
_TYPE_NAMES = {
    "GRAPH": "child",
    "WAIT_EVENT": "event_wait",
    "EVENT_RECORD": "event_record",
    "MEM_ALLOC": "mem_alloc",
    "MEM_FREE": "mem_free",
}


def node_type_name(member: Any) -> str:
    """``"kernel"``, ``"memcpy"``, ``"memset"``, ``"host"``, ``"child"``, ``"empty"``,
    ``"event_record"``, ``"event_wait"``, ``"conditional"``, ... for a ``CUgraphNodeType``."""
    name = getattr(member, "name", None)
    if not isinstance(name, str):
        return f"type {int(member)}"
    suffix = name.removeprefix("CU_GRAPH_NODE_TYPE_")
    return _TYPE_NAMES.get(suffix, suffix.lower())


class KernelSpec:
    """What a kernel node runs: the kernel, its launch shape and its packed arguments
    (kept alive with the node, so buffers passed as arguments outlive it)."""

    __slots__ = ("args", "block", "buf", "grid", "kernel", "shared_mem")

    def __init__(
        self,
        kernel: Kernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        args: tuple[Any, ...],
        buf: ParamBuffer,
    ) -> None:
        self.kernel = kernel
        self.grid = grid
        self.block = block
        self.shared_mem = shared_mem
        self.args = args
        self.buf = buf

    def replaced(
        self,
        ctx: Context,
        args: tuple[Any, ...] | None,
        grid: Any,
        block: Any,
        shared_mem: int | None,
    ) -> KernelSpec:
        """A new spec: the given fields changed, the others kept; arguments re-checked."""
        return kernel_spec(
            self.kernel,
            ctx,
            self.grid if grid is None else grid,
            self.block if block is None else block,
            self.args if args is None else args,
            self.shared_mem if shared_mem is None else shared_mem,
        )

    def params(self, ctx: Context) -> Any:
        """The ``CUDA_KERNEL_NODE_PARAMS`` (the function of *ctx*, which must be bound)."""
        p = drv.CUDA_KERNEL_NODE_PARAMS()
        p.func = self.kernel._function(ctx)
        p.gridDimX, p.gridDimY, p.gridDimZ = self.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = self.block
        p.sharedMemBytes = self.shared_mem
        p.kernelParams = self.buf.address
        return p

    def describe(self) -> str:
        return f"{self.kernel.name} grid={self.grid} block={self.block}"


def kernel_spec(
    kernel: Kernel, ctx: Context, grid: Any, block: Any, args: tuple[Any, ...], shared_mem: Any
) -> KernelSpec:
    """Check a kernel node's launch shape and arguments and pack them.

    Raises ``LaunchArgumentError`` for arguments that do not fit the kernel's parameters
    (the message names the parameter), as ``Kernel.launch`` does.
    """
    # imported here: ctxkit.module re-exports this family, which must import without it
    from ..module.launch import normalize_dims, shared_mem_arg
    from ..module.params import ParamBuffer

    if not hasattr(kernel, "_require_packer"):
        raise TypeError(f"kernel must be a ctxkit Kernel, got {type(kernel).__name__}")
    packer = kernel._require_packer()
    g = normalize_dims(grid, "grid")
    b = normalize_dims(block, "block")
    smem = shared_mem_arg(shared_mem, kernel.name)
    values = tuple(int(a) if isinstance(a, ConditionalHandle) else a for a in args)
    buf = ParamBuffer(packer.sig)
    packer.pack_into(buf, values, ctx)
    return KernelSpec(kernel, g, b, smem, tuple(args), buf)


class GraphNode:
    """One node of a :class:`~ctxkit.graph.graph.Graph`.

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
            (err,) = drv.cuGraphKernelNodeSetParams(self.handle, new.params(ctx))
        if err:
            raise ctx.note_error(err, f"cuGraphKernelNodeSetParams({new.describe()})")
        self._spec = new
        graph._keep_spec(self, new)

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
    items: Iterable[Any] = (depends_on,) if isinstance(depends_on, GraphNode) else depends_on
    try:
        nodes = list(items)
    except TypeError:
        raise TypeError(
            f"{what}: depends_on must be a GraphNode or a list of them, "
            f"got {type(depends_on).__name__}"
        ) from None
    out = []
    for n in nodes:
        if not isinstance(n, GraphNode):
            raise TypeError(f"{what}: depends_on holds {type(n).__name__}, not a GraphNode")
        if n.graph is not graph:
            raise ValueError(
                f"{what}: {n!r} belongs to another graph ({n.graph!r}), not to {graph!r}; "
                "a node can only depend on nodes of its own graph (add a child graph node "
                "with graph.child(other) to run another graph inside this one)"
            )
        out.append(n.handle)
    return out


# --- memcpy and memset ---------------------------------------------------------------


class HostSide:
    """Pinned host memory taking part in a memcpy node."""

    __slots__ = ("array", "nbytes", "ptr")

    def __init__(self, array: np.ndarray, ptr: int, nbytes: int) -> None:
        self.array = array
        self.ptr = ptr
        self.nbytes = nbytes


def copy_side(obj: Any, ctx: Context, what: str, name: str, write: bool) -> Mem | HostSide:
    """One side of a memcpy node: device memory of *ctx*, or a pinned numpy array."""
    if isinstance(obj, np.ndarray):
        plain_dtype(obj.dtype, what)
        if not obj.flags.c_contiguous:
            raise ValueError(f"{what}: the {name} array is not C-contiguous; pass a contiguous one")
        if write and not obj.flags.writeable:
            raise ValueError(f"{what}: the {name} array is read-only")
        if obj.nbytes and not is_pinned(obj):
            raise PageableCopyError(
                f"{what}: the {name} array is pageable host memory; a graph copies host "
                "memory asynchronously, which needs page-locked memory: allocate it with "
                "ck.pinned_empty(...) or pin it with `with ck.register_host(arr):`"
            )
        return HostSide(obj, int(obj.ctypes.data), int(obj.nbytes))
    mem = device_mem(obj, what, write=write)
    mc = mem.context
    if isinstance(mc, Context) and mc.handle != ctx.handle:
        raise WrongContextError(
            f"{what}: the {name} ({type(obj).__name__}) belongs to {mc!r}, but the graph "
            f"belongs to {ctx!r}; build the graph in the memory's context "
            "(ck.Graph(context=buf.context)) or copy the data there first",
            _INVALID_HANDLE,
            "CUDA_ERROR_INVALID_HANDLE",
        )
    return mem


def copy_nbytes(dst: Mem | HostSide, src: Mem | HostSide, nbytes: Any, what: str) -> int:
    """The byte count of a memcpy node: *nbytes*, or both sides' common size."""
    if nbytes is None:
        if dst.nbytes != src.nbytes:
            raise ValueError(
                f"{what}: the destination holds {dst.nbytes} bytes and the source "
                f"{src.nbytes}; pass nbytes= to copy a prefix"
            )
        return int(src.nbytes)
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"{what}: nbytes must be an int >= 0, got {nbytes!r}")
    n = int(nbytes)
    for side, label in ((dst, "destination"), (src, "source")):
        if n > side.nbytes:
            raise ValueError(f"{what}: nbytes={n} exceeds the {label}'s {side.nbytes} bytes")
    return n


def memcpy_params(dst: Mem | HostSide, src: Mem | HostSide, n: int) -> Any:
    """A 1-D ``CUDA_MEMCPY3D`` from *src* to *dst*."""
    kinds = drv.CUmemorytype
    p = drv.CUDA_MEMCPY3D()
    if isinstance(src, HostSide):
        p.srcMemoryType = kinds.CU_MEMORYTYPE_HOST
        p.srcHost = src.ptr
    else:
        p.srcMemoryType = kinds.CU_MEMORYTYPE_DEVICE
        p.srcDevice = src.ptr
    if isinstance(dst, HostSide):
        p.dstMemoryType = kinds.CU_MEMORYTYPE_HOST
        p.dstHost = dst.ptr
    else:
        p.dstMemoryType = kinds.CU_MEMORYTYPE_DEVICE
        p.dstDevice = dst.ptr
    p.WidthInBytes = n
    p.Height = 1
    p.Depth = 1
    return p


def memset_params(dst: Mem, value: Any, count: Any, element_size: Any, what: str) -> Any:
    """A 1-D ``CUDA_MEMSET_NODE_PARAMS``: *count* elements of *element_size* bytes."""
    if element_size not in (1, 2, 4) or isinstance(element_size, bool):
        raise ValueError(f"{what}: element_size must be 1, 2 or 4, got {element_size!r}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: value must be an int, got {type(value).__name__}")
    hi = 1 << (8 * element_size)
    if not 0 <= int(value) < hi:
        raise ValueError(
            f"{what}: value {value} does not fit {element_size} byte(s) (0..{hi - 1}); "
            "pass the bit pattern of one element"
        )
    if count is None:
        if dst.nbytes % element_size:
            raise ValueError(
                f"{what}: the destination's {dst.nbytes} bytes are not a whole number of "
                f"{element_size}-byte elements; pass count="
            )
        count = dst.nbytes // element_size
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"{what}: count must be an int >= 0, got {count!r}")
    if count * element_size > dst.nbytes:
        raise ValueError(
            f"{what}: count={count} elements of {element_size} bytes exceed the "
            f"destination's {dst.nbytes} bytes"
        )
    if dst.ptr % element_size:
        raise ValueError(f"{what}: the destination is not aligned to {element_size} bytes")
    p = drv.CUDA_MEMSET_NODE_PARAMS()
    p.dst = dst.ptr
    p.elementSize = int(element_size)
    p.value = int(value)
    p.width = int(count)
    p.height = 1
    p.pitch = 0
    return p
