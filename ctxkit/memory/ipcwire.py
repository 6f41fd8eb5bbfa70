"""What an IPC handle carries between processes: the raw driver handle bytes
(``CUipcMemHandle`` / ``CUipcEventHandle``), where the handle was made (:class:`_Origin`:
process, device UUID) and how an importer finds that device again, and the POSIX file
descriptors of shareable VMM chunks, which travel through ``multiprocessing`` pickling.

The handle classes and the export/import functions built on these are in
:mod:`ctxkit.memory.ipc`.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from dataclasses import dataclass
from typing import Any

from .._driver import drv
from ..binding import resolve_context
from ..context import Context
from ..device import Device, devices
from ..errors import CudaError

__all__: list[str] = []


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
    dev = _device_with_uuid(origin.device_uuid)
    if dev is None:
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
    try:
        os.close(fd)
    except OSError:
        pass


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

    def take(self) -> int:
        """A duplicate for the caller to use and close."""
        return os.dup(self.fd)


def _received_fd(dup: Any) -> _SharedFd:
    return _SharedFd(dup.detach())
