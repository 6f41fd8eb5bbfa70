"""CUDA graphs: build them node by node or capture them from a stream; launch, update.

``g = ck.Graph()`` is a ``CUgraph`` in the current context. Its node builders --
:meth:`~Graph.kernel` (arguments checked and packed as ``Kernel.launch`` does),
:meth:`~Graph.memcpy`, :meth:`~Graph.memset`, :meth:`~Graph.host` (a Python callback),
:meth:`~Graph.event_record`, :meth:`~Graph.event_wait`, :meth:`~Graph.empty`,
:meth:`~Graph.child` and :meth:`~Graph.conditional` (``if``/``while``, CUDA 12.4+) --
return :class:`GraphNode` objects that later nodes name in ``depends_on=``.
``exe = g.instantiate()`` is a :class:`GraphExec`: ``exe.launch(stream)``,
``exe.update(g2)`` (a graph of the same shape; :class:`~ctxkit.errors.GraphUpdateError`
names what cannot be updated) and ``exe.set_kernel_params(node, ...)`` change it in
place. ``with capture(stream) as g:`` records a stream's work into a :class:`Graph` that
is kept after the block: ``g.launch()``, ``g.clone()``, ``g.nodes()``, ``exe.update(g)``.
Graphs and executable graphs know their context and bind it for every call.
"""

from __future__ import annotations

from ..errors import GraphUpdateError
from .graph import Graph, GraphExec, GraphNode, capture
from .nodes import CONDITIONAL_DEVICE_API, ConditionalHandle

__all__ = [
    "CONDITIONAL_DEVICE_API",
    "ConditionalHandle",
    "Graph",
    "GraphExec",
    "GraphNode",
    "GraphUpdateError",
    "capture",
]
