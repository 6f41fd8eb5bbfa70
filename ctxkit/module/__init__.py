"""Modules: load PTX, cubin or fatbin and look up kernels.

``Module.load`` takes a ``ck.ObjectCode``, bytes, PTX text or a path. By default it
loads a context-independent *library* (``cuLibraryLoadData``): one :class:`Kernel`
then launches in whichever context is current, on any device, with the per-context
``CUfunction`` fetched once per context. ``context=`` loads a classic module bound to
that context instead.

``Kernel.launch`` checks arguments against the PTX ``.entry`` signature before
anything runs (:class:`~ctxkit.errors.LaunchArgumentError` names the parameter);
``Kernel.prepare`` packs them once for the cheapest repeated launch; :func:`capture`
records launches on a stream into a replayable :class:`Graph`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import KernelNotFoundError
from .image import jit_detail, missing_kernel_message, read_image
from .kernel import Kernel
from .launch import LaunchConfig
from .module import Module
from .prepared import PreparedLaunch

__all__ = [
    "Graph",
    "Kernel",
    "KernelNotFoundError",
    "LaunchConfig",
    "Module",
    "PreparedLaunch",
    "capture",
    "jit_detail",
    "missing_kernel_message",
    "read_image",
]

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import Graph, capture


def __getattr__(name: str) -> Any:
    """``Graph`` and ``capture`` live in :mod:`ctxkit.graph` (which builds on modules):
    re-exported here on first use so that this package never imports it."""
    if name in ("Graph", "capture"):
        from .. import graph

        return getattr(graph, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
