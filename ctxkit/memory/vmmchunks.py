"""The driver side of a :class:`~ctxkit.memory.vmm.VirtualBuffer`: physical chunks
(``cuMemCreate``) and their granularity, reserved address ranges (``cuMemAddressReserve``),
mappings with read/write access for every accessing device (``cuMemMap`` /
``cuMemSetAccess``), and their release in order (unmap, release, free the range).

Also the checks made before anything is created: which devices support virtual memory
management (and POSIX file-descriptor handles), and which have a peer path to the chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import _driver
from .. import context as _context
from .._driver import drv
from ..binding import check_devices
from ..context import Context
from ..device import Device
from ..errors import CudaError
from ..lifetime import free_quietly

__all__ = ["Chunk", "allocation_granularity"]


_NOT_SUPPORTED = 801


@dataclass(frozen=True)
class Chunk:
    """One physical allocation mapped into a :class:`VirtualBuffer`.

    Attributes
    ----------
    offset, nbytes : int
        Where it sits in the buffer's address range.
    device : int
        The device whose memory backs it.
    """

    offset: int
    nbytes: int
    device: int
    handle: Any = field(default=None, repr=False, compare=False)


class _Space:
    """Everything a VirtualBuffer holds in the driver, shared with its finalizer."""

    __slots__ = ("access", "chunks", "reservations")

    def __init__(self, access: tuple[int, ...]) -> None:
        self.access = access
        self.reservations: list[tuple[int, int]] = []  # (address, size), contiguous
        self.chunks: list[Chunk] = []

    @property
    def base(self) -> int:
        return self.reservations[0][0] if self.reservations else 0

    @property
    def reserved(self) -> int:
        return sum(n for _p, n in self.reservations)


def _prop(device: int, shareable: bool) -> Any:
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(device)
    if shareable:
        prop.requestedHandleTypes = (
            drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
    return prop


def allocation_granularity(device: Any = 0, *, shareable: bool = False) -> int:
    """The size and alignment unit of physical chunks on *device*
    (``cuMemGetAllocationGranularity``, minimum)."""
    dev = Device(device.device if isinstance(device, Context) else device)
    _driver.init()
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    err, gran = drv.cuMemGetAllocationGranularity(_prop(dev.ordinal, shareable), flag)
    _driver.raise_for(err, f"cuMemGetAllocationGranularity(device {dev.ordinal})")
    return int(gran)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _access_desc(device: int) -> Any:
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = int(device)
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def _check(err: Any, what: str) -> None:
    if err:
        raise _driver.from_result(int(err), what)


def _map(space: _Space, chunk: Chunk, base: int, what: str) -> None:
    """Map *chunk* at ``base + offset`` and give every accessing device read/write."""
    ptr = base + chunk.offset
    (err,) = drv.cuMemMap(ptr, chunk.nbytes, 0, chunk.handle, 0)
    _check(err, f"{what}: cuMemMap({ptr:#x}, {chunk.nbytes})")
    descs = [_access_desc(d) for d in space.access]
    (err,) = drv.cuMemSetAccess(ptr, chunk.nbytes, descs, len(descs))
    if err:
        drv.cuMemUnmap(ptr, chunk.nbytes)
        _check(err, f"{what}: cuMemSetAccess({ptr:#x}, {chunk.nbytes}, devices {space.access})")


def _unmap(chunks: Sequence[Chunk], base: int) -> int:
    first = 0
    for c in reversed(chunks):
        (err,) = drv.cuMemUnmap(base + c.offset, c.nbytes)
        first = first or int(err)
    return first


def _release_all(space: _Space) -> tuple[int]:
    """Unmap every chunk, release its memory, free the address range; first error."""
    first = _unmap(space.chunks, space.base)
    for c in reversed(space.chunks):
        (err,) = drv.cuMemRelease(c.handle)
        first = first or int(err)
    for ptr, size in reversed(space.reservations):
        (err,) = drv.cuMemAddressFree(ptr, size)
        first = first or int(err)
    space.chunks.clear()
    space.reservations.clear()
    return (first,)


def _finalize(ctx: Context, space: _Space) -> None:
    if not space.reservations or _context._shutting_down:
        return
    if ctx.closed or ctx.poisoned:  # VMM memory belongs to no context: free it anyway
        try:
            _release_all(space)
        except Exception:
            pass
        return
    free_quietly(ctx, _release_all, space)


def _devices(spec: Any, what: str, name: str) -> tuple[int, ...]:
    if spec is None:
        return ()
    checked = check_devices(spec, f"{what} {name}=")
    assert checked is not None
    return tuple(c.device.ordinal if isinstance(c, Context) else Device(c).ordinal for c in checked)


def _reserve_range(space: _Space, size: int, what: str) -> None:
    err, ptr = drv.cuMemAddressReserve(size, 0, 0, 0)
    _check(err, f"{what}: cuMemAddressReserve({size})")
    space.reservations.append((int(ptr), size))


def _check_support(devs: tuple[int, ...], acc: tuple[int, ...], shareable: bool, what: str) -> None:
    for d in dict.fromkeys((*devs, *acc)):
        dev = Device(d)
        if not dev.attribute("virtual_memory_management_supported"):
            raise CudaError(
                f"{what}: device {d} does not support virtual memory management "
                "(virtual_memory_management_supported is 0); use DeviceBuffer",
                _NOT_SUPPORTED,
                "CUDA_ERROR_NOT_SUPPORTED",
            )
        if shareable and not dev.attribute("handle_type_posix_file_descriptor_supported"):
            raise CudaError(
                f"{what}: device {d} cannot export memory as POSIX file descriptors "
                "(handle_type_posix_file_descriptor_supported is 0); create it without "
                "shareable=True and share a DeviceBuffer through ctxkit.memory.ipc instead",
                _NOT_SUPPORTED,
                "CUDA_ERROR_NOT_SUPPORTED",
            )
    for a in acc:
        for d in devs:
            if a != d and not Device(a).can_access_peer(d):
                raise ValueError(
                    f"{what}: device {a} cannot access memory of device {d} "
                    "(cuDeviceCanAccessPeer is 0), so it cannot be given access to chunks "
                    f"there; pass access= without device {a}, or devices= without device {d}"
                )
