"""ctxkit: explicit CUDA contexts, run-time compiled kernels and multi-GPU pipelines.

Submodules are imported on first use, so ``import ctxkit`` is cheap and works on a
machine without a GPU or driver.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Names of the families, loaded on first use (the core below is imported eagerly).
_LAZY: dict[str, str] = {
    "compiler": "Program ObjectCode compile kernel_source",
    "module": "Module Kernel PreparedLaunch LaunchConfig",
    "graph": "Graph GraphExec GraphNode capture",
    "memory": "DeviceBuffer DeviceArray device_array pinned_empty pinned_zeros pinned_pool "
    "PinnedPool register_host is_pinned ManagedBuffer enable_peer_access copy_peer to_device "
    "MemoryPool VirtualBuffer disable_peer_access export_buffer import_buffer ipc_event "
    "export_event import_event host_memory_flags",
    "stream": "Stream Event current_stream",
    "pipeline": "Pipeline PipelineOptions StageHandle",
    "procs": "DevicePool TaskOptions",
    "trace": "Timeline",
}
_EXPORTS = {name: mod for mod, names in _LAZY.items() for name in names.split()}
_SUBMODULES = {*_LAZY, "errors", "lifetime", "cli"}

# A literal list, so type checkers read it (a computed one hides the API from them).
__all__ = [
    "CaptureOrderError",
    "CompileError",
    "Context",
    "ContextClosedError",
    "ContextExecutor",
    "ContextInUseError",
    "ContextPoisonedError",
    "ContextRegistry",
    "ContextStackError",
    "CudaError",
    "Device",
    "DeviceArray",
    "DeviceBuffer",
    "DevicePool",
    "DeviceTaskError",
    "DriverNotFoundError",
    "Event",
    "ForkError",
    "Graph",
    "GraphExec",
    "GraphNode",
    "GraphUpdateError",
    "Kernel",
    "KernelCacheWarning",
    "KernelNotFoundError",
    "LaunchArgumentError",
    "LaunchConfig",
    "LaunchQueue",
    "LaunchQueueError",
    "ManagedBuffer",
    "MemoryPool",
    "Module",
    "NoCurrentContextError",
    "ObjectCode",
    "OutOfMemoryError",
    "PageableCopyError",
    "PageableCopyWarning",
    "PinLeakWarning",
    "PinnedPool",
    "Pipeline",
    "PipelineError",
    "PipelineOptions",
    "PreparedLaunch",
    "Program",
    "PtxVersionWarning",
    "StageHandle",
    "Stream",
    "TaskOptions",
    "Timeline",
    "VirtualBuffer",
    "WrongContextError",
    "__version__",
    "bind",
    "bound",
    "capture",
    "compile",
    "copy_peer",
    "current_context",
    "current_stream",
    "device_array",
    "device_count",
    "devices",
    "disable_peer_access",
    "enable_peer_access",
    "export_buffer",
    "export_event",
    "host_memory_flags",
    "import_buffer",
    "import_event",
    "ipc_event",
    "is_pinned",
    "kernel_source",
    "pinned_empty",
    "pinned_pool",
    "pinned_zeros",
    "procs",
    "register_host",
    "registry",
    "to_device",
]

# The core is imported eagerly (it needs no driver to import). ``ctxkit.registry`` is the
# process-wide ContextRegistry (the module is ctxkit.binding).
from .binding import ContextRegistry, bind, bound, registry  # noqa: E402
from .context import Context, current_context  # noqa: E402
from .device import Device, device_count, devices  # noqa: E402
from .errors import (  # noqa: E402
    CaptureOrderError,
    CompileError,
    ContextClosedError,
    ContextInUseError,
    ContextPoisonedError,
    ContextStackError,
    CudaError,
    DeviceTaskError,
    DriverNotFoundError,
    ForkError,
    GraphUpdateError,
    KernelCacheWarning,
    KernelNotFoundError,
    LaunchArgumentError,
    LaunchQueueError,
    NoCurrentContextError,
    OutOfMemoryError,
    PageableCopyError,
    PageableCopyWarning,
    PinLeakWarning,
    PipelineError,
    PtxVersionWarning,
    WrongContextError,
)
from .executor import ContextExecutor, LaunchQueue  # noqa: E402


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is not None:
        value = getattr(importlib.import_module(f".{mod}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ctxkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover
    from . import procs as procs
    from .compiler import ObjectCode, Program, compile, kernel_source
    from .graph import Graph, GraphExec, GraphNode, capture
    from .memory import (
        DeviceArray,
        DeviceBuffer,
        ManagedBuffer,
        MemoryPool,
        PinnedPool,
        VirtualBuffer,
        copy_peer,
        device_array,
        disable_peer_access,
        enable_peer_access,
        export_buffer,
        export_event,
        host_memory_flags,
        import_buffer,
        import_event,
        ipc_event,
        is_pinned,
        pinned_empty,
        pinned_pool,
        pinned_zeros,
        register_host,
        to_device,
    )
    from .module import Kernel, LaunchConfig, Module, PreparedLaunch
    from .pipeline import Pipeline, PipelineOptions, StageHandle
    from .procs import DevicePool, TaskOptions
    from .stream import Event, Stream, current_stream
    from .trace import Timeline
