"""Modules: load PTX, cubin or fatbin and look up kernels.

``Module.load`` takes a ``ck.ObjectCode``, bytes, PTX text or a path. By default it
loads a context-independent *library* (``cuLibraryLoadData``): one :class:`Kernel`
then launches in whichever context is current, on any device, with the per-context
``CUfunction`` fetched once per context. ``context=`` loads a classic module bound to
that context instead.

``Kernel.launch`` checks arguments against the PTX ``.entry`` signature before
anything runs (:class:`~ctxkit.errors.LaunchArgumentError` names the parameter);
``Kernel.prepare`` packs them once for the cheapest repeated launch;
:func:`ctxkit.graph.capture` records launches on a stream into a replayable graph.
"""

from __future__ import annotations

from ..errors import KernelNotFoundError
from .kernel import Kernel, LaunchConfig, PreparedLaunch
from .module import Module, jit_detail, missing_kernel_message, read_image

__all__ = [
    "Kernel",
    "KernelNotFoundError",
    "LaunchConfig",
    "Module",
    "PreparedLaunch",
    "jit_detail",
    "missing_kernel_message",
    "read_image",
]
