"""Legacy CUDA IPC memory (``cuIpc*MemHandle``) on both sides: which device memory
``cuIpcGetMemHandle`` can export (not pool, managed or VMM memory), and
:class:`ImportedBuffer`, a :class:`~ctxkit.memory.DeviceBuffer` over another process's
memory that is unmapped (``cuIpcCloseMemHandle``) when its last view goes.

Used by the export/import functions of :mod:`ctxkit.memory.ipc`, which re-exports
:class:`ImportedBuffer`.
"""

from __future__ import annotations

from typing import Any

from .. import _driver
from .._driver import drv
from ..context import Context
from ..lifetime import finalizer
from .device import DeviceBuffer

__all__ = ["ImportedBuffer"]


class ImportedBuffer(DeviceBuffer):
    """Device memory of another process, opened from an :class:`IpcBufferHandle`.

    A :class:`~ctxkit.memory.DeviceBuffer` in every respect (copies, views, memset,
    kernel arguments, ``__cuda_array_interface__``) except ownership: :meth:`close` (or
    garbage collection) unmaps it with ``cuIpcCloseMemHandle`` in its context and leaves
    the memory to the exporting process. Made by :func:`import_buffer` only.
    """

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("ImportedBuffer is made by ctxkit.memory.ipc.import_buffer(handle)")


class _Mapping:
    """One ``cuIpcOpenMemHandle`` of an allocation; closed when the last buffer on it
    goes (the driver counts repeated opens of one handle in one context)."""

    __slots__ = ("__weakref__", "_fin", "base")

    def __init__(self, ctx: Context, base: int) -> None:
        self.base = base
        self._fin = finalizer(self, ctx, drv.cuIpcCloseMemHandle, base)


def _pointer_attribute(name: str, ptr: int, what: str) -> Any:
    err, value = drv.cuPointerGetAttribute(
        getattr(drv.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + name), ptr
    )
    _driver.raise_for(err, f"{what}: cuPointerGetAttribute({name}, {ptr:#x})")
    return value


def _check_legacy_capable(ptr: int, what: str) -> None:
    if _pointer_attribute("IS_MANAGED", ptr, what):
        why = (
            "it is managed (unified) memory, which cannot be shared between processes; "
            "share a DeviceBuffer instead"
        )
    elif int(_pointer_attribute("MEMPOOL_HANDLE", ptr, what) or 0):
        why = (
            "it is a stream-ordered pool allocation (cuMemAllocAsync); allocate it with "
            "DeviceBuffer(nbytes) without stream= to share it"
        )
    elif not _pointer_attribute("IS_LEGACY_CUDA_IPC_CAPABLE", ptr, what):
        why = (
            "it is not cuMemAlloc memory (VMM/cuMemCreate or another allocator's); "
            "export a whole VirtualBuffer(..., shareable=True) instead"
        )
    else:
        return
    raise ValueError(
        f"{what}: the memory at {ptr:#x} cannot be exported with cuIpcGetMemHandle: {why}"
    )
