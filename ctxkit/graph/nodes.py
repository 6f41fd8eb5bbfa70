"""The parameters of graph nodes: checked, then built as the driver structures.

The helpers here check what a node builder of :class:`~ctxkit.graph.graph.Graph` was
given -- kernel arguments (packed by an :class:`~ctxkit.module.params.ArgPacker` of the
kernel's signature, exactly as ``Kernel.launch`` packs them), copy and memset targets,
conditional kinds, objects of other contexts -- and build the ``CUDA_*_NODE_PARAMS``
structures, before anything reaches the driver.

Conditional nodes (``if`` and ``while``, CUDA 12.4+) run their body graph once (``if``)
or again and again (``while``) while the value of their :class:`ConditionalHandle` is
non-zero. The value is set on the device by a kernel of the graph (before the node, or
in the body for a loop) with ``cudaGraphSetConditional(handle, value)``; NVRTC code
declares it with :data:`CONDITIONAL_DEVICE_API` and takes the handle as an ``unsigned
long long`` parameter. Every launch starts with the handle's *default* value.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .. import _driver
from .._driver import drv
from ..context import Context
from ..errors import CudaError, PageableCopyError, WrongContextError
from ..memory.copies import Mem, device_mem
from ..memory.host import host_array, is_pinned
from ..memory.sizes import nbytes_arg
from ..module.kernel import Kernel, normalize_dims, shared_mem_arg
from ..module.params import ParamBuffer

__all__ = ["CONDITIONAL_DEVICE_API", "ConditionalHandle"]

_INVALID_HANDLE = 400


def check_context(
    ctx: Context, owner: Context, what: str, obj: str, fix: str = "", mine: str = "the graph"
) -> None:
    """Raise :class:`WrongContextError` (``CUDA_ERROR_INVALID_HANDLE``) when *obj*, of the
    context *owner*, is not of *ctx*, the context of *mine*; *fix* says what to do."""
    if owner.handle != ctx.handle:
        raise WrongContextError(
            f"{what}: {obj} belongs to {owner!r}, but {mine} belongs to {ctx!r}{fix}",
            _INVALID_HANDLE,
            "CUDA_ERROR_INVALID_HANDLE",
        )


def fill(struct: Any, **fields: Any) -> Any:
    """Set *fields* on the driver structure *struct*, in the order given; return it."""
    for name, value in fields.items():
        setattr(struct, name, value)
    return struct


#: Declarations to put in front of NVRTC source that sets a conditional handle.
CONDITIONAL_DEVICE_API = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
"""

_NOT_SUPPORTED = 801
_NEEDS = (12, 4)


class ConditionalHandle:
    """The condition of a conditional node; pass it to a kernel as an
    ``unsigned long long`` argument (``int(handle)`` is its value).

    Attributes
    ----------
    graph : Graph
        The graph it was created in (only its nodes may use it).
    kind : str or None
        ``"if"`` or ``"while"`` once a node uses it.
    default : int
        The value every launch of the graph starts with.
    """

    __slots__ = ("_graph", "default", "handle", "kind")

    def __init__(self, handle: Any, graph: Any, default: int) -> None:
        self.handle = handle
        self._graph = weakref.ref(graph)  # kernel nodes of the graph hold the handle
        self.kind: str | None = None
        self.default = default

    @property
    def graph(self) -> Any:
        """The graph it was created in (``None`` once collected)."""
        return self._graph()

    def __index__(self) -> int:
        return int(self.handle)

    def __repr__(self) -> str:
        return f"<ConditionalHandle {self.kind} default={self.default} {int(self.handle):#x}>"


def check_supported(what: str) -> None:
    """Raise ``CudaError`` (``CUDA_ERROR_NOT_SUPPORTED``) naming what is missing when the
    bindings or the driver cannot make conditional nodes."""
    if getattr(drv, "cuGraphConditionalHandleCreate", None) is None:
        need = (
            "cuda-bindings with cuGraphConditionalHandleCreate (12.4 or newer); "
            "upgrade cuda-bindings"
        )
    elif (version := _driver.driver_version()) is not None and version < _NEEDS:
        need = (
            f"a CUDA {_NEEDS[0]}.{_NEEDS[1]} driver or newer; this driver is CUDA "
            f"{version[0]}.{version[1]}: upgrade the driver"
        )
    else:
        return
    raise CudaError(
        f"{what}: conditional graph nodes need {need}", _NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"
    )


def kind_member(kind: Any, what: str) -> Any:
    """The ``CUgraphConditionalNodeType`` member for ``"if"`` or ``"while"``."""
    if kind not in ("if", "while"):
        raise ValueError(f"{what}: kind must be 'if' or 'while', got {kind!r}")
    return getattr(drv.CUgraphConditionalNodeType, f"CU_GRAPH_COND_TYPE_{kind.upper()}")


def default_arg(default: Any, what: str) -> int:
    """A conditional handle's default value, checked: an unsigned 32-bit int."""
    if isinstance(default, bool):
        default = int(default)
    if not isinstance(default, int) or not 0 <= default < 1 << 32:
        raise ValueError(f"{what}: default must be an unsigned 32-bit int, got {default!r}")
    return default


def conditional_params(handle: Any, kind_enum: Any, cu_ctx: Any) -> Any:
    """The ``CUgraphNodeParams`` of a conditional node with one body graph."""
    p = drv.CUgraphNodeParams()
    p.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    fill(p.conditional, handle=handle, type=kind_enum, size=1, ctx=cu_ctx)
    return p


def add_node_args(graph: Any, deps: list[Any], params: Any) -> tuple[Any, ...]:
    """Arguments of ``cuGraphAddNode``: 13.x bindings take edge data (default edges, one
    per dependency: the bindings check the list's length), 12.x do not."""
    if _driver.BINDINGS_VERSION[0] >= 13:
        edges = [drv.CUgraphEdgeData() for _ in deps] if deps else None
        return (graph, deps, edges, len(deps), params)
    return (graph, deps, len(deps), params)


# --- kernel nodes --------------------------------------------------------------------


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
    if not isinstance(name := getattr(member, "name", None), str):
        return f"type {int(member)}"
    suffix = name.removeprefix("CU_GRAPH_NODE_TYPE_")
    return _TYPE_NAMES.get(suffix, suffix.lower())


@dataclass(frozen=True, slots=True, eq=False)
class KernelSpec:
    """What a kernel node runs: the kernel, its launch shape and its packed arguments
    (kept alive with the node, so buffers passed as arguments outlive it)."""

    kernel: Kernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple[Any, ...]
    buf: ParamBuffer

    def replaced(
        self,
        ctx: Context,
        args: tuple[Any, ...] | None,
        grid: Any,
        block: Any,
        shared_mem: int | None,
    ) -> KernelSpec:
        """A new spec: each field given (not ``None``) changed, the others kept; the
        arguments checked and packed again."""
        given: tuple[Any, ...] = (grid, block, args, shared_mem)
        kept: tuple[Any, ...] = (self.grid, self.block, self.args, self.shared_mem)
        return kernel_spec(self.kernel, ctx, *(k if g is None else g for g, k in zip(given, kept)))

    def params(self, ctx: Context) -> Any:
        """The ``CUDA_KERNEL_NODE_PARAMS``, with the kernel's function in *ctx*."""
        p = fill(drv.CUDA_KERNEL_NODE_PARAMS(), func=self.kernel.function_handle(ctx))
        p.gridDimX, p.gridDimY, p.gridDimZ = self.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = self.block
        return fill(p, sharedMemBytes=self.shared_mem, kernelParams=self.buf.address)

    def describe(self) -> str:
        """The kernel and its launch shape, for messages and reprs."""
        return f"{self.kernel.name} grid={self.grid} block={self.block}"


def kernel_spec(
    kernel: Kernel, ctx: Context, grid: Any, block: Any, args: tuple[Any, ...], shared_mem: Any
) -> KernelSpec:
    """Check a kernel node's launch shape and arguments and pack them.

    Raises ``LaunchArgumentError`` for arguments that do not fit the kernel's parameters
    (the message names the parameter), as ``Kernel.launch`` does.
    """
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel must be a ctxkit Kernel, got {type(kernel).__name__}")
    packer = kernel.packer  # LaunchArgumentError naming why when the parameters are unknown
    g = normalize_dims(grid, "grid")
    b = normalize_dims(block, "block")
    smem = shared_mem_arg(shared_mem, kernel.name)
    values = tuple(int(a) if isinstance(a, ConditionalHandle) else a for a in args)
    return KernelSpec(kernel, g, b, smem, tuple(args), packer.packed(values, ctx))


# --- memcpy and memset ---------------------------------------------------------------


_MEM_FIX = (
    "; build the graph in the memory's context (ck.Graph(context=buf.context)) or "
    "copy the data there first"
)


class HostSide(NamedTuple):
    """Pinned host memory taking part in a memcpy node (the node keeps its array)."""

    ptr: int
    nbytes: int


def copy_side(obj: Any, ctx: Context, what: str, name: str, write: bool) -> Mem | HostSide:
    """One side of a memcpy or memset node: device memory of *ctx*, or a pinned numpy
    array."""
    if isinstance(obj, np.ndarray):
        host_array(obj, what, writable=write)
        if obj.nbytes and not is_pinned(obj):
            raise PageableCopyError(
                f"{what}: the {name} array is pageable host memory; a graph copies host "
                "memory asynchronously, which needs page-locked memory: allocate it with "
                "ck.pinned_empty(...) or pin it with `with ck.register_host(arr):`"
            )
        return HostSide(int(obj.ctypes.data), int(obj.nbytes))
    mem = device_mem(obj, what, write=write)
    if isinstance(mem.context, Context):
        check_context(ctx, mem.context, what, f"the {name} ({type(obj).__name__})", _MEM_FIX)
    return mem


def memcpy_params(dst: Any, src: Any, nbytes: Any, ctx: Context, what: str) -> Any:
    """A 1-D ``CUDA_MEMCPY3D`` from *src* to *dst* (device memory of *ctx* or pinned
    numpy arrays) of *nbytes*, by default both sides' common size."""
    d = copy_side(dst, ctx, what, "destination", write=True)
    s = copy_side(src, ctx, what, "source", write=False)
    if isinstance(d, HostSide) and isinstance(s, HostSide):
        raise ValueError(f"{what}: both sides are host memory; copy them with numpy")
    if nbytes is None:
        if d.nbytes != s.nbytes:
            raise ValueError(
                f"{what}: the destination holds {d.nbytes} bytes and the source "
                f"{s.nbytes}; pass nbytes= to copy a prefix"
            )
        nbytes = s.nbytes
    n = nbytes_arg(nbytes, what)
    for side, label in ((d, "destination"), (s, "source")):
        if n > side.nbytes:
            raise ValueError(f"{what}: nbytes={n} exceeds the {label}'s {side.nbytes} bytes")
    if n == 0:
        raise ValueError(
            f"{what}: nothing to copy (0 bytes); use graph.empty() for a node that does nothing"
        )
    p = drv.CUDA_MEMCPY3D()
    for side, end in ((s, "src"), (d, "dst")):
        where = "Host" if isinstance(side, HostSide) else "Device"
        setattr(p, f"{end}MemoryType", getattr(drv.CUmemorytype, f"CU_MEMORYTYPE_{where.upper()}"))
        setattr(p, f"{end}{where}", side.ptr)
    return fill(p, WidthInBytes=n, Height=1, Depth=1)


def memset_params(
    obj: Any, value: Any, count: Any, element_size: Any, ctx: Context, what: str
) -> Any:
    """A 1-D ``CUDA_MEMSET_NODE_PARAMS``: *count* elements of *element_size* bytes of
    the device memory *obj* (of *ctx*), by default all of it."""
    if isinstance(obj, np.ndarray):
        raise TypeError(
            f"{what}: dst must be device memory (a ctxkit buffer/array or a device array "
            "of another library), got a numpy array"
        )
    dst = copy_side(obj, ctx, what, "destination", write=True)
    assert isinstance(dst, Mem)
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
    if not count:
        raise ValueError(f"{what}: nothing to set (0 elements)")
    p = fill(drv.CUDA_MEMSET_NODE_PARAMS(), dst=dst.ptr, elementSize=int(element_size))
    return fill(p, value=int(value), width=int(count), height=1, pitch=0)
