"""Sharing device memory and events with other processes on the same machine (CUDA IPC).

A process exports a buffer with :func:`export_buffer` (``cuIpcGetMemHandle``) and sends
the :class:`IpcBufferHandle` (a small picklable value: no data travels) to another
process, which opens it with :func:`import_buffer` (``cuIpcOpenMemHandle``) and gets an
:class:`ImportedBuffer`: a :class:`~ctxkit.memory.DeviceBuffer` over the *same* device
memory. Closing or dropping it unmaps it (``cuIpcCloseMemHandle``, in its context, from
any thread); the memory stays the exporter's, who must keep the buffer alive until every
importer has closed it (freeing it earlier is undefined behaviour in the driver).

Work is ordered across processes with events: :func:`ipc_event` creates an event that
can be shared (``CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING``), :func:`export_event`
/ :func:`import_event` hand it over; both processes may record it, wait for it on a
stream (``Stream.wait``) or synchronize with it.

Legacy IPC works on ``cuMemAlloc`` memory (``DeviceBuffer(nbytes)``, CuPy's and PyTorch's
default allocations). Stream-ordered pool allocations, managed memory and VMM
allocations are refused with the reason. A :class:`~ctxkit.memory.vmm.VirtualBuffer`
made with ``shareable=True`` is exported as POSIX file descriptors of its chunks instead
(:class:`IpcVirtualBufferHandle`, passed by ``multiprocessing``'s file-descriptor
transfer). Legacy handles open only in *other* processes, on Linux, and not across
containers that do not share their PID and IPC namespaces.

This module holds the handles and the functions that export and import them, which all
tell this process from others by ``_PROCESS_TAG``. What a handle carries is in
:mod:`ctxkit.memory.ipcwire`, legacy IPC memory on either side (what can be exported,
:class:`ImportedBuffer`) in :mod:`ctxkit.memory.ipcmem`, and the shareable event itself
(:func:`ipc_event`) in :mod:`ctxkit.memory.ipcevent`; all are importable from here.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from .. import _driver
from .._driver import drv
from ..binding import guard, resolve_context
from ..context import require_current
from ..device import Device
from ..errors import CudaError
from ..stream import Event
from .copies import context_of_pointer, device_mem
from .device import DeviceBuffer
from .ipcevent import _wrap_event, ipc_event
from .ipcmem import ImportedBuffer, _check_legacy_capable, _Mapping
from .ipcwire import (
    _device_with_uuid,
    _Exported,
    _from_bytes,
    _import_context,
    _Origin,
    _SharedFd,
    _to_bytes,
)
from .sizes import nbytes_arg
from .vmm import Chunk, VirtualBuffer

__all__ = [
    "ImportedBuffer",
    "IpcBufferHandle",
    "IpcEventHandle",
    "IpcVirtualBufferHandle",
    "export_buffer",
    "export_event",
    "export_pointer",
    "import_buffer",
    "import_event",
    "ipc_event",
]


IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


#: identifies this process in handles (a pid alone repeats across PID namespaces)
_PROCESS_TAG = uuid.uuid4().hex


def _process_token() -> str:
    return f"{os.getpid()}:{_PROCESS_TAG}"


_HINTS = {
    1: "the exporting process may have freed the buffer (or exited), or the handle was "
    "made on another machine",
    201: "a process's exported memory may be opened by one context per device in each "
    "importing process; open all its handles in the same context (the default is the "
    "registry's context of the exporting device)",
    205: "the driver could not map the other process's memory: processes in different "
    "containers (separate PID or IPC namespaces; docker needs --ipc=host --pid=host) or "
    "without permission to each other cannot use legacy CUDA IPC",
    400: "the exporting process freed the buffer or exited, or the handle is from another machine",
    711: "the device has mapped memory of too many other devices or processes; close "
    "imported buffers you no longer need",
    800: "the operating system or a container policy forbids CUDA IPC here",
    801: "this system does not support legacy CUDA IPC (it needs Linux and unified addressing)",
}


def _ipc_error(err: Any, what: str) -> CudaError:
    code = int(err)
    hint = _HINTS.get(code, "")
    return _driver.from_result(code, what, f"IPC: {hint}." if hint else "")


def _origin(dev: Device) -> _Origin:
    err, raw = drv.cuDeviceGetUuid(dev.handle)
    _driver.raise_for(err, f"cuDeviceGetUuid(device {dev.ordinal})")
    return _Origin(
        os.getpid(), _process_token(), bytes(raw.bytes).hex(), dev.pci_bus_id, dev.ordinal
    )


def _check_other_process(origin: _Origin, what: str, use: str) -> None:
    if origin.process == _process_token():
        raise ValueError(
            f"{what}: the handle was exported by this process (pid {origin.pid}); CUDA IPC "
            f"handles open only in other processes: use the {use} itself here"
        )


# --- buffers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcBufferHandle(_Exported):
    """What another process needs to open an exported buffer (:func:`import_buffer`).

    A small picklable value (send it through a ``multiprocessing`` queue or pipe, a
    socket, ...); it holds no data and does not keep the buffer alive.

    Attributes
    ----------
    handle : bytes
        The ``CUipcMemHandle`` of the whole allocation.
    offset, nbytes : int
        The shared bytes within the allocation (a slice ``buf[a:b]`` exports only those).
    pid : int
        The exporting process.
    """

    handle: bytes = field(repr=False)
    offset: int
    nbytes: int
    origin: _Origin = field(repr=False)

    def open(self, context: Any = None) -> ImportedBuffer:
        """:func:`import_buffer` (self, context)."""
        buf = import_buffer(self, context)
        assert isinstance(buf, ImportedBuffer)
        return buf


def export_buffer(buf: Any) -> IpcBufferHandle | IpcVirtualBufferHandle:
    """Export device memory for other processes (``cuIpcGetMemHandle``).

    Parameters
    ----------
    buf : DeviceBuffer, DeviceArray, slice view, or a ``__cuda_array_interface__`` object
        ``cuMemAlloc`` memory (a CuPy or PyTorch array works too). Keep it alive until
        every importer has closed its :class:`ImportedBuffer`. A ``VirtualBuffer`` made
        with ``shareable=True`` gives an :class:`IpcVirtualBufferHandle`.

    Raises
    ------
    ValueError
        The memory cannot be shared through legacy IPC (pool, managed or VMM memory; the
        message says which and what to use), or it is empty.
    CudaError
        The driver refused (e.g. ``CUDA_ERROR_NOT_SUPPORTED`` where IPC is unavailable).
    """
    what = "export_buffer"
    if isinstance(buf, VirtualBuffer):
        return _export_virtual(buf, what)
    m = device_mem(buf, what)
    ctx = m.context
    if ctx is None:
        with guard(require_current(what), what):
            ctx = context_of_pointer(m.ptr, what)
    return export_pointer(m.ptr, m.nbytes, ctx)


def export_pointer(ptr: int, nbytes: int, context: Any) -> IpcBufferHandle:
    """:func:`export_buffer` for ``nbytes`` of raw device memory at *ptr* of *context*."""
    what = "export_pointer"
    nbytes = nbytes_arg(nbytes, what)
    if nbytes == 0:
        raise ValueError(f"{what}: nothing to share ({nbytes} bytes)")
    ctx = resolve_context(context, what)
    with guard(ctx, what):
        _check_legacy_capable(int(ptr), what)
        err, base, size = drv.cuMemGetAddressRange(int(ptr))
        _driver.raise_for(err, f"{what}: cuMemGetAddressRange({int(ptr):#x})")
        base, size = int(base), int(size)
        if int(ptr) + nbytes > base + size:
            raise ValueError(
                f"{what}: {nbytes} bytes at {int(ptr):#x} run past the end of their "
                f"allocation ({size} bytes at {base:#x})"
            )
        err, handle = drv.cuIpcGetMemHandle(base)
    if err:
        raise _ipc_error(err, f"{what}: cuIpcGetMemHandle({base:#x}) in {ctx!r}")
    return IpcBufferHandle(_to_bytes(handle), int(ptr) - base, int(nbytes), _origin(ctx.device))


def import_buffer(
    handle: IpcBufferHandle | IpcVirtualBufferHandle, context: Any = None
) -> DeviceBuffer | VirtualBuffer:
    """Open memory another process exported (``cuIpcOpenMemHandle``).

    Parameters
    ----------
    handle : IpcBufferHandle or IpcVirtualBufferHandle
        From :func:`export_buffer` in another process. An :class:`IpcBufferHandle` gives
        an :class:`ImportedBuffer`; an :class:`IpcVirtualBufferHandle` a
        ``VirtualBuffer`` mapping the exporter's chunks (it cannot grow).
    context : Context, Device, int or None
        Where to map it. Default: the registry's context of the exporting GPU (found by
        its UUID, so ``CUDA_VISIBLE_DEVICES`` renumbering does not matter). A context of
        another device maps it through peer access.

    Raises
    ------
    ValueError
        The handle was exported by this very process.
    CudaError
        The GPU is not visible here, or the driver refused (the message gives the reason,
        e.g. ``CUDA_ERROR_MAP_FAILED`` between containers).
    """
    what = "import_buffer"
    if isinstance(handle, IpcVirtualBufferHandle):
        return _import_virtual(handle, context, what)
    if not isinstance(handle, IpcBufferHandle):
        raise TypeError(f"{what}: expected an IpcBufferHandle, got {type(handle).__name__}")
    _check_other_process(handle.origin, what, "buffer")
    ctx = _import_context(handle.origin, context, what)
    raw = _from_bytes(drv.CUipcMemHandle, handle.handle)
    with ctx:
        err, base = drv.cuIpcOpenMemHandle(raw, IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    if err:
        raise _ipc_error(
            err, f"{what}: cuIpcOpenMemHandle (memory of process {handle.pid}) in {ctx!r}"
        )
    mapping = _Mapping(ctx, int(base))
    buf = ImportedBuffer.from_pointer(int(base) + handle.offset, handle.nbytes, ctx, owner=mapping)
    assert isinstance(buf, ImportedBuffer)
    return buf


# --- VMM memory: POSIX file descriptors -----------------------------------------------


_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


@dataclass(frozen=True)
class IpcVirtualBufferHandle(_Exported):
    """What another process needs to map a shareable :class:`VirtualBuffer`.

    Holds one POSIX file descriptor per physical chunk; pass it to the other process
    through ``multiprocessing`` (``Process`` arguments, a ``Queue`` or ``Pipe``), whose
    pickling hands each descriptor over (``multiprocessing.reduction.DupFd``). Unlike
    legacy IPC handles it may also be opened in the exporting process.

    Attributes
    ----------
    chunks : tuple of (offset, nbytes, device UUID)
    nbytes : int
    """

    chunks: tuple[tuple[int, int, str], ...]
    fds: tuple[_SharedFd, ...] = field(repr=False)
    nbytes: int
    stripe: int
    origin: _Origin = field(repr=False)

    def open(self, context: Any = None) -> VirtualBuffer:
        """:func:`import_buffer` (self, context)."""
        return _import_virtual(self, context, "IpcVirtualBufferHandle.open")


def _export_virtual(vb: VirtualBuffer, what: str) -> IpcVirtualBufferHandle:
    if not vb.shareable:
        raise ValueError(
            f"{what}: {vb!r} was not created shareable; create it with "
            "VirtualBuffer(..., shareable=True) to export it"
        )
    ptr = vb.ptr
    if not vb.nbytes:
        raise ValueError(f"{what}: nothing to share ({vb!r} is empty)")
    uuids = {d.ordinal: _origin(d).device_uuid for d in vb.devices}
    fds: list[_SharedFd] = []
    with vb.context:
        for c in vb.chunks:
            err, fd = drv.cuMemExportToShareableHandle(
                c.handle, drv.CUmemAllocationHandleType(_POSIX_FD), 0
            )
            if err:
                raise _ipc_error(
                    err, f"{what}: cuMemExportToShareableHandle(POSIX_FD) of {ptr + c.offset:#x}"
                )
            fds.append(_SharedFd(int(fd)))
    return IpcVirtualBufferHandle(
        tuple((c.offset, c.nbytes, uuids[c.device]) for c in vb.chunks),
        tuple(fds),
        vb.nbytes,
        vb.stripe,
        _origin(vb.context.device),
    )


def _import_virtual(handle: IpcVirtualBufferHandle, context: Any, what: str) -> VirtualBuffer:
    ctx = _import_context(handle.origin, context, what)
    chunks: list[Chunk] = []
    try:
        with ctx:
            for (offset, nbytes, dev_uuid), shared in zip(handle.chunks, handle.fds):
                fd = shared.take()
                try:
                    err, h = drv.cuMemImportFromShareableHandle(
                        fd, drv.CUmemAllocationHandleType(_POSIX_FD)
                    )
                finally:
                    os.close(fd)
                if err:
                    raise _ipc_error(
                        err, f"{what}: cuMemImportFromShareableHandle(POSIX_FD) in {ctx!r}"
                    )
                dev = _device_with_uuid(dev_uuid)
                chunks.append(Chunk(offset, nbytes, dev.ordinal if dev else -1, h))
    except BaseException:
        for c in chunks:
            drv.cuMemRelease(c.handle)
        raise
    return VirtualBuffer._adopt(chunks, handle.nbytes, handle.stripe, ctx)


# --- events -----------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcEventHandle(_Exported):
    """What another process needs to open an exported event (:func:`import_event`)."""

    handle: bytes = field(repr=False)
    origin: _Origin = field(repr=False)

    def open(self, context: Any = None) -> Event:
        """:func:`import_event` (self, context)."""
        return import_event(self, context)


def export_event(event: Event) -> IpcEventHandle:
    """Export an :func:`ipc_event` for other processes (``cuIpcGetEventHandle``).

    Raises
    ------
    ValueError
        The event records timestamps (``Event(timing=True)``), which IPC events cannot.
    CudaError
        The driver refused, e.g. for an event not created with ``CU_EVENT_INTERPROCESS``.
    """
    what = "export_event"
    if not isinstance(event, Event):
        raise TypeError(f"{what}: expected a ctxkit.Event, got {type(event).__name__}")
    if event.timing:
        raise ValueError(
            f"{what}: {event!r} records timestamps; events shared between processes cannot. "
            "Create it with ctxkit.memory.ipc.ipc_event()"
        )
    handle = event._open_handle(what)
    ctx = event.context
    with guard(ctx, what):
        err, raw = drv.cuIpcGetEventHandle(handle)
    if err:
        raise _driver.from_result(
            int(err),
            f"{what}: cuIpcGetEventHandle({event!r})",
            "IPC: create the event with ctxkit.memory.ipc.ipc_event() (CU_EVENT_INTERPROCESS "
            "| CU_EVENT_DISABLE_TIMING).",
        )
    return IpcEventHandle(_to_bytes(raw), _origin(ctx.device))


def import_event(handle: IpcEventHandle, context: Any = None) -> Event:
    """Open an event another process exported (``cuIpcOpenEventHandle``).

    The event behaves like a local ``Event(timing=False)``: record it, wait for it on a
    stream, synchronize with it. Dropping or closing it destroys only this process's
    handle (``cuEventDestroy``). *context* is chosen as for :func:`import_buffer`.
    """
    what = "import_event"
    if not isinstance(handle, IpcEventHandle):
        raise TypeError(f"{what}: expected an IpcEventHandle, got {type(handle).__name__}")
    _check_other_process(handle.origin, what, "event")
    ctx = _import_context(handle.origin, context, what)
    raw = _from_bytes(drv.CUipcEventHandle, handle.handle)
    with ctx:
        err, ev = drv.cuIpcOpenEventHandle(raw)
    if err:
        raise _ipc_error(
            err, f"{what}: cuIpcOpenEventHandle (event of process {handle.pid}) in {ctx!r}"
        )
    return _wrap_event(ctx, ev)
