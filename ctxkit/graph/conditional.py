"""Conditional graph nodes (``if`` and ``while``, CUDA 12.4+).

A conditional node runs its body graph once (``if``) or again and again (``while``)
while the value of its :class:`ConditionalHandle` is non-zero. The value is set on the
device by a kernel of the graph (before the node, or in the body for a loop) with
``cudaGraphSetConditional(handle, value)``; NVRTC code declares it with
:data:`CONDITIONAL_DEVICE_API` and takes the handle as an ``unsigned long long``
parameter. Every launch starts with the handle's *default* value.
"""

from __future__ import annotations

import weakref
from typing import Any

from .. import _driver
from .._driver import drv
from ..errors import CudaError

__all__ = ["CONDITIONAL_DEVICE_API", "ConditionalHandle", "check_supported"]

#: Declarations to put in front of NVRTC source that sets a conditional handle.
CONDITIONAL_DEVICE_API = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
"""

_NOT_SUPPORTED = 801
_NEEDS = (12, 4)
KINDS = ("if", "while")


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

    def __int__(self) -> int:
        return int(self.handle)

    def __index__(self) -> int:
        return int(self.handle)

    def __repr__(self) -> str:
        return f"<ConditionalHandle {self.kind} default={self.default} {int(self.handle):#x}>"


def check_supported(what: str) -> None:
    """Raise ``CudaError`` (``CUDA_ERROR_NOT_SUPPORTED``) naming what is missing when the
    bindings or the driver cannot make conditional nodes."""
    if getattr(drv, "cuGraphConditionalHandleCreate", None) is None:
        raise CudaError(
            f"{what}: conditional graph nodes need cuda-bindings with "
            "cuGraphConditionalHandleCreate (12.4 or newer); upgrade cuda-bindings",
            _NOT_SUPPORTED,
            "CUDA_ERROR_NOT_SUPPORTED",
        )
    version = _driver.driver_version()
    if version is not None and version < _NEEDS:
        raise CudaError(
            f"{what}: conditional graph nodes need a CUDA {_NEEDS[0]}.{_NEEDS[1]} driver or "
            f"newer; this driver is CUDA {version[0]}.{version[1]}: upgrade the driver",
            _NOT_SUPPORTED,
            "CUDA_ERROR_NOT_SUPPORTED",
        )


def kind_member(kind: Any, what: str) -> Any:
    """The ``CUgraphConditionalNodeType`` member for ``"if"`` or ``"while"``."""
    if kind not in KINDS:
        raise ValueError(f"{what}: kind must be 'if' or 'while', got {kind!r}")
    return getattr(drv.CUgraphConditionalNodeType, f"CU_GRAPH_COND_TYPE_{kind.upper()}")


def default_arg(default: Any, what: str) -> int:
    if isinstance(default, bool):
        default = int(default)
    if not isinstance(default, int) or not 0 <= default < 1 << 32:
        raise ValueError(f"{what}: default must be an unsigned 32-bit int, got {default!r}")
    return default


def node_params(handle: Any, kind_enum: Any, cu_ctx: Any) -> Any:
    """The ``CUgraphNodeParams`` of a conditional node with one body graph."""
    p = drv.CUgraphNodeParams()
    p.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = kind_enum
    p.conditional.size = 1
    p.conditional.ctx = cu_ctx
    return p


def add_node_args(bindings_major: int, graph: Any, deps: list[Any], params: Any) -> tuple[Any, ...]:
    """Arguments of ``cuGraphAddNode``: 13.x takes edge data (default edges, one per
    dependency: the bindings check the list's length), 12.x does not."""
    if bindings_major >= 13:
        edges = [drv.CUgraphEdgeData() for _ in deps] if deps else None
        return (graph, deps, edges, len(deps), params)
    return (graph, deps, len(deps), params)
