"""Inter-process sharing of device memory and events.

What an IPC handle carries between processes: the raw driver handle bytes
(``CUipcMemHandle`` / ``CUipcEventHandle``), where the handle was made (:class:`_Origin`:
process, device UUID) and how an importer finds that device again, and the POSIX file
descriptors of shareable VMM chunks, which travel through ``multiprocessing`` pickling.

Events other processes can wait for: :func:`ipc_event` creates one
(``CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING``), and :meth:`Event.adopt` makes an
:class:`~ctxkit.Event` of a driver handle, one created here or opened from another
process's handle, destroyed in its context when dropped. Their handles are exchanged by
:func:`export_event` and :func:`import_event`.

Legacy CUDA IPC memory (``cuIpc*MemHandle``) on both sides: which device memory
``cuIpcGetMemHandle`` can export (not pool, managed or VMM memory), and
:class:`ImportedBuffer`, a :class:`~ctxkit.memory.DeviceBuffer` over another process's
memory that is unmapped (``cuIpcCloseMemHandle``) when its last view goes.

Sharing device memory and events with other processes on the same machine (CUDA IPC).

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

The export and import functions tell this process from others by ``_PROCESS_TAG``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from .. import _driver
from .._driver import drv
from ..binding import guard, resolve_context
from ..context import Context, require_current
from ..device import Device, devices
from ..errors import CudaError
from ..lifetime import finalizer
from ..stream import EVENT_BLOCKING_SYNC, EVENT_DISABLE_TIMING, Event
from .copies import context_of_pointer, device_mem
from .device import DeviceBuffer
from .host import pointer_attribute
from .sizes import nbytes_arg, require_capability
from .vmm import Chunk, VirtualBuffer, map_imported

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


IPC_HANDLE_SIZE = 64  # CU_IPC_HANDLE_SIZE

_INVALID_DEVICE = 101


@dataclass(frozen=True)
class _Origin:
    """Where a handle was made: the process and the device (its UUID survives
    ``CUDA_VISIBLE_DEVICES`` renumbering)."""

    pid: int
    process: str
    device_uuid: str
    pci_bus_id: str
    ordinal: int


class _Exported:
    """What every IPC handle says about its origin (the dataclasses hold ``origin``)."""

    origin: _Origin

    @property
    def pid(self) -> int:
        """The id of the process that exported the handle."""
        return self.origin.pid


def _device_with_uuid(device_uuid: str) -> Device | None:
    for dev in devices():
        err, raw = drv.cuDeviceGetUuid(dev.handle)
        if not err and bytes(raw.bytes).hex() == device_uuid:
            return dev
    return None


def _import_context(origin: _Origin, context: Any, what: str) -> Context:
    if context is not None:
        return resolve_context(context, what)
    if (dev := _device_with_uuid(origin.device_uuid)) is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise CudaError(
            f"{what}: the memory is on device {origin.ordinal} (PCI {origin.pci_bus_id}) of "
            f"process {origin.pid}, which this process does not see{where}; make that GPU "
            "visible here, or pass context= of a device with peer access to it",
            _INVALID_DEVICE,
            "CUDA_ERROR_INVALID_DEVICE",
        )
    return resolve_context(dev.ordinal, what)


def _to_bytes(struct: Any) -> bytes:
    return ctypes.string_at(int(struct.getPtr()), IPC_HANDLE_SIZE)


def _from_bytes(cls: Any, data: bytes) -> Any:
    if not isinstance(data, bytes) or len(data) != IPC_HANDLE_SIZE:
        raise ValueError(f"an IPC handle is {IPC_HANDLE_SIZE} bytes, got {data!r:.40}")
    struct = cls()
    ctypes.memmove(int(struct.getPtr()), data, IPC_HANDLE_SIZE)
    return struct


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class _SharedFd:
    """A file descriptor that travels through ``multiprocessing`` pickling (the receiver
    gets its own duplicate, by SCM_RIGHTS); closed when the object goes."""

    __slots__ = ("__weakref__", "_fin", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = int(fd)
        self._fin = weakref.finalize(self, _close_fd, self.fd)

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd  # only where handles are sent

        return (_received_fd, (DupFd(self.fd),))


def _received_fd(dup: Any) -> _SharedFd:
    return _SharedFd(dup.detach())


EVENT_INTERPROCESS = 4  # CU_EVENT_INTERPROCESS


def ipc_event(context: Any = None, *, blocking: bool = False) -> Event:
    """An event other processes can wait for (``CU_EVENT_INTERPROCESS |
    CU_EVENT_DISABLE_TIMING``); share it with :func:`export_event`.

    Parameters
    ----------
    context : Context, Device, int or None
        As for :class:`~ctxkit.Event`.
    blocking : bool
        ``CU_EVENT_BLOCKING_SYNC``: ``synchronize()`` sleeps instead of spinning.

    Raises
    ------
    CudaError
        ``CUDA_ERROR_NOT_SUPPORTED``: the device cannot share events
        (``ipc_event_supported`` is 0).
    """
    ctx = resolve_context(context, "ipc_event")
    require_capability(
        ctx.device,
        "ipc_event_supported",
        "ipc_event",
        "cannot share events between processes",
        "order the processes through the host instead (synchronize, then send a message)",
    )
    flags = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING | (EVENT_BLOCKING_SYNC if blocking else 0)
    with ctx:
        err, handle = drv.cuEventCreate(flags)
    if err:
        raise ctx.note_error(err, f"cuEventCreate(INTERPROCESS|DISABLE_TIMING, flags={flags})")
    return Event.adopt(handle, ctx)


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
    err, value = pointer_attribute(name, ptr)
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


IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS

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


def _check_ipc(err: Any, what: str) -> None:
    """Raise the driver's error of a failed IPC call, with what it means for IPC."""
    if err:
        hint = _HINTS.get(int(err), "")
        raise _driver.from_result(int(err), what, f"IPC: {hint}." if hint else "")


def _origin(dev: Device) -> _Origin:
    err, raw = drv.cuDeviceGetUuid(dev.handle)
    _driver.raise_for(err, f"cuDeviceGetUuid(device {dev.ordinal})")
    return _Origin(
        os.getpid(), _process_token(), bytes(raw.bytes).hex(), dev.pci_bus_id, dev.ordinal
    )


def _opening(
    handle: Any, kind: type[IpcBufferHandle | IpcEventHandle], raw: Any, context: Any, what: str
) -> tuple[Context, Any]:
    """The context to open a legacy *handle* (of class *kind*) in and its driver struct
    (of class *raw*), after refusing other values and handles of this very process."""
    if not isinstance(handle, kind):
        raise TypeError(f"{what}: expected an {kind.__name__}, got {type(handle).__name__}")
    origin = handle.origin
    if origin.process == _process_token():
        use = "event" if kind is IpcEventHandle else "buffer"
        raise ValueError(
            f"{what}: the handle was exported by this process (pid {origin.pid}); CUDA IPC "
            f"handles open only in other processes: use the {use} itself here"
        )
    return _import_context(origin, context, what), _from_bytes(raw, handle.handle)


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
        return import_buffer(self, context)  # type: ignore[return-value]


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
    if (ctx := m.context) is None:
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
    _check_ipc(err, f"{what}: cuIpcGetMemHandle({base:#x}) in {ctx!r}")
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
    ctx, raw = _opening(handle, IpcBufferHandle, drv.CUipcMemHandle, context, what)
    with ctx:
        err, base = drv.cuIpcOpenMemHandle(raw, IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    _check_ipc(err, f"{what}: cuIpcOpenMemHandle (memory of process {handle.pid}) in {ctx!r}")
    mapping = _Mapping(ctx, int(base))
    return ImportedBuffer.from_pointer(int(base) + handle.offset, handle.nbytes, ctx, owner=mapping)


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
            _check_ipc(
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
                fd = os.dup(shared.fd)  # ours to use and close
                try:
                    err, h = drv.cuMemImportFromShareableHandle(
                        fd, drv.CUmemAllocationHandleType(_POSIX_FD)
                    )
                finally:
                    os.close(fd)
                _check_ipc(err, f"{what}: cuMemImportFromShareableHandle(POSIX_FD) in {ctx!r}")
                dev = _device_with_uuid(dev_uuid)
                chunks.append(Chunk(offset, nbytes, dev.ordinal if dev else -1, h))
    except BaseException:
        for c in chunks:
            drv.cuMemRelease(c.handle)
        raise
    return map_imported(chunks, handle.nbytes, handle.stripe, ctx)


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
    handle = event.open_handle(what)
    ctx = event.context
    with guard(ctx, what):
        err, raw = drv.cuIpcGetEventHandle(handle)
    _driver.raise_for(
        err,
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
    ctx, raw = _opening(handle, IpcEventHandle, drv.CUipcEventHandle, context, what)
    with ctx:
        err, ev = drv.cuIpcOpenEventHandle(raw)
    _check_ipc(err, f"{what}: cuIpcOpenEventHandle (event of process {handle.pid}) in {ctx!r}")
    return Event.adopt(ev, ctx)
