"""Virtual memory management: chunked, striped buffers over several devices.

The driver side of a :class:`VirtualBuffer`: physical chunks
(``cuMemCreate``) and their granularity, reserved address ranges (``cuMemAddressReserve``),
mappings with read/write access for every accessing device (``cuMemMap`` /
``cuMemSetAccess``), and their release in order (unmap, release, free the range).

Also the checks made before anything is created: which devices support virtual memory
management (and POSIX file-descriptor handles), and which have a peer path to the chunks.

Virtual memory management: one contiguous device address range backed by physical
chunks on one or several devices (``cuMemAddressReserve`` / ``cuMemCreate`` /
``cuMemMap`` / ``cuMemSetAccess``).

A :class:`VirtualBuffer` looks like a :class:`~ctxkit.memory.DeviceBuffer` (``ptr``,
``nbytes``, copies, views, ``__cuda_array_interface__``, DLPack, kernel argument) but its
bytes may live on several GPUs (striped round-robin, as in NVIDIA's ``vectorAddMMAP``
sample) and it can :meth:`~VirtualBuffer.grow` without copying: new physical chunks are
mapped after the old ones, in place when the address space there is free, otherwise the
existing chunks are remapped into a larger range (the data stays where it is physically).
It is freed in order (unmap, release, free the address range) by :meth:`close`, garbage
collection in any thread, or interpreter exit.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _driver
from .._driver import check_fork, drv, in_forked_child
from ..binding import check_devices, resolve_context
from ..context import Context, shutting_down
from ..device import Device
from ..errors import ContextClosedError
from ..lifetime import free_quietly
from .alloc import OUT_OF_MEMORY, out_of_memory
from .copies import Copyable, Mem
from .device import DeviceArray, DeviceBuffer
from .interop import KDL_CUDA
from .sizes import nbytes_arg, require_capability

__all__ = ["Chunk", "VirtualBuffer", "allocation_granularity", "map_imported"]


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


def _map(space: _Space, chunk: Chunk, base: int, what: str) -> None:
    """Map *chunk* at ``base + offset`` and give every accessing device read/write."""
    ptr = base + chunk.offset
    (err,) = drv.cuMemMap(ptr, chunk.nbytes, 0, chunk.handle, 0)
    _driver.raise_for(err, f"{what}: cuMemMap({ptr:#x}, {chunk.nbytes})")
    descs = [_access_desc(d) for d in space.access]
    (err,) = drv.cuMemSetAccess(ptr, chunk.nbytes, descs, len(descs))
    if err:
        drv.cuMemUnmap(ptr, chunk.nbytes)
        _driver.raise_for(
            err, f"{what}: cuMemSetAccess({ptr:#x}, {chunk.nbytes}, devices {space.access})"
        )


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
    if not space.reservations or shutting_down():
        return
    if ctx.closed or ctx.poisoned:  # VMM memory belongs to no context: free it anyway
        with contextlib.suppress(Exception):
            _release_all(space)
        return
    free_quietly(ctx, _release_all, space)


def _devices(spec: Any, what: str, name: str) -> tuple[int, ...]:
    checked = check_devices(spec, f"{what} {name}=") or ()  # None: none given
    return tuple(c.device.ordinal if isinstance(c, Context) else Device(c).ordinal for c in checked)


def _reserve_range(space: _Space, size: int, what: str) -> None:
    err, ptr = drv.cuMemAddressReserve(size, 0, 0, 0)
    _driver.raise_for(err, f"{what}: cuMemAddressReserve({size})")
    space.reservations.append((int(ptr), size))


def _check_support(devs: tuple[int, ...], acc: tuple[int, ...], shareable: bool, what: str) -> None:
    for d in dict.fromkeys((*devs, *acc)):
        dev = Device(d)
        require_capability(
            dev,
            "virtual_memory_management_supported",
            what,
            "does not support virtual memory management",
            "use DeviceBuffer",
        )
        if shareable:
            require_capability(
                dev,
                "handle_type_posix_file_descriptor_supported",
                what,
                "cannot export memory as POSIX file descriptors",
                "create it without shareable=True and share a DeviceBuffer through "
                "ctxkit.memory.ipc instead",
            )
    for a in acc:
        for d in devs:
            if a != d and not Device(a).can_access_peer(d):
                raise ValueError(
                    f"{what}: device {a} cannot access memory of device {d} "
                    "(cuDeviceCanAccessPeer is 0), so it cannot be given access to chunks "
                    f"there; pass access= without device {a}, or devices= without device {d}"
                )


class VirtualBuffer(Copyable):
    """Device memory in a reserved virtual address range, backed by physical chunks on one
    or several devices (CUDA virtual memory management).

    Parameters
    ----------
    nbytes : int
        Size in bytes; the mapped size is rounded up to whole chunks.
    devices : sequence of ints/Devices/Contexts, optional
        Where the physical chunks live, round-robin (default: the context's device).
    context : Context, Device, int or None
        The context that copies and memsets run in, as for ``DeviceBuffer``.
    access : sequence, optional
        Devices that may read and write the whole range (default: ``devices`` and the
        context's device). Each needs a peer path (``can_access_peer``) to every other
        device in ``devices``; no ``enable_peer_access`` is needed.
    stripe : int, optional
        Bytes per chunk (rounded up to the allocation granularity). Default: the size
        split evenly over ``devices``, one chunk each, as in ``vectorAddMMAP``.
    reserve : int
        Address space to reserve up front, so that :meth:`grow` up to it never moves.
    shareable : bool
        Create the chunks exportable as POSIX file descriptors
        (:func:`ctxkit.memory.ipc.export_buffer`).

    Raises
    ------
    CudaError
        ``CUDA_ERROR_NOT_SUPPORTED``: a device lacks virtual memory management (or, with
        *shareable*, POSIX file-descriptor handles).
    OutOfMemoryError
        A device has too little free memory for its chunks.
    ValueError
        An accessing device has no peer path to a device holding chunks.

    Notes
    -----
    :meth:`grow` may move the buffer: views, arrays and ``ptr`` values taken before are
    invalid then (ctxkit's own views raise ``ContextClosedError``; pointers given to other
    libraries are not tracked). Reserve enough address space to avoid it.
    """

    def __init__(
        self,
        nbytes: int,
        devices: Sequence[Any] | None = None,
        *,
        context: Any = None,
        access: Sequence[Any] | None = None,
        stripe: int | None = None,
        reserve: int = 0,
        shareable: bool = False,
    ) -> None:
        what = f"VirtualBuffer({nbytes})"
        n = nbytes_arg(nbytes, what)
        ctx = resolve_context(context, what)
        devs = _devices(devices, what, "devices") or (ctx.device.ordinal,)
        acc = _devices(access, what, "access") or tuple(dict.fromkeys((*devs, ctx.device.ordinal)))
        _check_support(devs, acc, shareable, what)
        gran = max(allocation_granularity(d, shareable=shareable) for d in (*devs, *acc))
        want = stripe if stripe is not None else -(-max(n, 1) // len(devs))
        stripe = _round_up(nbytes_arg(want, what, "stripe") or gran, gran)
        reserve = _round_up(nbytes_arg(reserve, what, "reserve"), stripe)
        self.context = ctx
        self.devices = tuple(Device(d) for d in devs)
        self.granularity = gran
        self.stripe = stripe
        self.shareable = bool(shareable)
        self.space = _Space(acc)
        self.nbytes = 0
        self._reserve = reserve  # -1: imported (map_imported), cannot grow
        self._closed = False
        self._lock = threading.RLock()
        self._views: weakref.WeakSet[DeviceBuffer] = weakref.WeakSet()
        self._fin = weakref.finalize(self, _finalize, ctx, self.space)
        self._fin.atexit = False
        if n:
            try:
                self.grow(n)
            except BaseException:
                self._fin()  # now: the traceback keeps this half-made object alive
                raise

    # --- state -----------------------------------------------------------------------

    @property
    def ptr(self) -> int:
        """The start of the address range (raises ``ContextClosedError`` after close)."""
        if self._closed:
            raise ContextClosedError(
                "VirtualBuffer.ptr: the buffer was closed (its memory is freed); allocate a new one"
            )
        return self.space.base

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (the mappings and the address range are released)."""
        return self._closed

    @property
    def access(self) -> tuple[Device, ...]:
        """The devices that may read and write the buffer."""
        return tuple(Device(d) for d in self.space.access)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """The physical chunks, in address order."""
        return tuple(self.space.chunks)

    @property
    def mapped(self) -> int:
        """Bytes of physical memory mapped (``nbytes`` rounded up to whole chunks)."""
        return sum(c.nbytes for c in self.space.chunks)

    @property
    def reserved(self) -> int:
        """Bytes of address space reserved."""
        return self.space.reserved

    def __repr__(self) -> str:
        if self._closed:
            return f"<VirtualBuffer closed nbytes={self.nbytes}>"
        devs = ",".join(str(d.ordinal) for d in self.devices)
        return (
            f"<VirtualBuffer {self.space.base:#x} nbytes={self.nbytes} chunks="
            f"{len(self.space.chunks)}x{self.stripe} devices=[{devs}]>"
        )

    def __enter__(self) -> VirtualBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap and free the memory now (from any thread). Idempotent; views made by
        :meth:`as_buffer`, :meth:`view` and slicing become unusable. In a forked child
        it does nothing (the memory is the parent's)."""
        if in_forked_child():
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._invalidate_views()
            self._fin()

    def _invalidate_views(self) -> None:
        for v in list(self._views):
            v.close()
        self._views = weakref.WeakSet()

    # --- growing ---------------------------------------------------------------------

    def grow(self, nbytes: int) -> bool:
        """Grow the buffer to *nbytes*, keeping its contents; never shrinks.

        New chunks continue the round-robin over ``devices``. Returns True when the buffer
        moved to another address (see the class notes), False when it grew in place.
        """
        what = "VirtualBuffer.grow"
        n = nbytes_arg(nbytes, what)
        check_fork(what)
        with self._lock:
            self.ptr  # noqa: B018 - raises once closed
            if self._reserve < 0:
                raise ValueError(f"{what}: an imported VirtualBuffer cannot grow")
            if n < self.nbytes:
                raise ValueError(f"{what}: {n} bytes is smaller than the {self.nbytes} it has")
            need = _round_up(n, self.stripe)
            if need <= self.mapped:
                self.nbytes = n
                return False
            with self.context:
                moved = self._make_room(need, what)
                self._add_chunks(need, what)
            self.nbytes = n
            return moved

    def _make_room(self, need: int, what: str) -> bool:
        space = self.space
        if need <= space.reserved:
            return False
        if not space.reservations:
            _reserve_range(space, max(need, self._reserve), what)
            return False
        extra = need - space.reserved
        hint = space.base + space.reserved
        err, ptr = drv.cuMemAddressReserve(extra, 0, hint, 0)
        if not err and int(ptr) == hint:
            space.reservations.append((hint, extra))
            return False
        if not err:
            drv.cuMemAddressFree(ptr, extra)
        self._relocate(_round_up(max(need, 2 * space.reserved), self.stripe), what)
        return True

    def _relocate(self, size: int, what: str) -> None:
        """Map every chunk into a new range of *size* bytes, then drop the old range."""
        space = self.space
        new = _Space(space.access)
        _reserve_range(new, size, what)
        try:
            for c in space.chunks:
                _map(new, c, new.base, what)
                new.chunks.append(c)
        except BaseException:
            _unmap(new.chunks, new.base)
            drv.cuMemAddressFree(new.base, size)
            raise
        _unmap(space.chunks, space.base)
        for ptr, n in space.reservations:
            drv.cuMemAddressFree(ptr, n)
        space.reservations[:] = new.reservations
        self._invalidate_views()

    def _add_chunks(self, need: int, what: str) -> None:
        space = self.space
        while self.mapped < need:
            device = self.devices[len(space.chunks) % len(self.devices)].ordinal
            chunk = Chunk(self.mapped, self.stripe, device, self._create(device, what))
            try:
                _map(space, chunk, space.base, what)
            except BaseException:
                drv.cuMemRelease(chunk.handle)
                raise
            space.chunks.append(chunk)

    def _create(self, device: int, what: str) -> Any:
        err, handle = drv.cuMemCreate(self.stripe, _prop(device, self.shareable), 0)
        if not err:
            return handle
        if int(err) != OUT_OF_MEMORY:
            _driver.raise_for(err, f"{what}: cuMemCreate({self.stripe}, device {device})")
        raise out_of_memory(
            resolve_context(device, what),
            err,
            self.stripe,
            f"{what}: cuMemCreate",
            "close buffers you no longer need, or stripe over more devices",
        )

    # --- views and interop ------------------------------------------------------------

    def as_buffer(self) -> DeviceBuffer:
        """A :class:`~ctxkit.memory.DeviceBuffer` view of the whole buffer (no copy); it
        keeps the buffer alive and becomes unusable when the buffer moves or closes."""
        view = DeviceBuffer.from_pointer(self.ptr, self.nbytes, self.context, owner=self)
        self._views.add(view)
        return view

    def __getitem__(self, key: slice) -> DeviceBuffer:
        """``vb[a:b]``: a DeviceBuffer view of bytes ``a..b`` (see :meth:`as_buffer`)."""
        return self.as_buffer()[key]

    def view(self, shape: Any = None, dtype: Any = np.uint8) -> DeviceArray:
        """A typed :class:`~ctxkit.memory.DeviceArray` over the whole buffer (no copy)."""
        return self.as_buffer().view(shape, dtype)

    def _ctxkit_mem(self) -> Mem:
        return Mem(self.ptr, self.nbytes, self.context, None, None, None)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The buffer as a 1-D uint8 array (CUDA Array Interface v3)."""
        return self.as_buffer().__cuda_array_interface__

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.view().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.context.device.ordinal)


def map_imported(
    chunks: Sequence[Chunk], nbytes: int, stripe: int, context: Context
) -> VirtualBuffer:
    """A :class:`VirtualBuffer` over chunks this process did not create (their handles
    imported from another process): mapped for *context*'s device; it cannot grow, and
    closing it releases only this process's handles (those of *chunks* are its now, also
    when mapping them fails)."""
    vb = VirtualBuffer(0, context=context)  # empty: no chunk, no address range yet
    vb.devices = tuple(dict.fromkeys(Device(c.device) for c in chunks if c.device >= 0))
    vb.granularity = vb.stripe = stripe
    vb._reserve = -1
    space = vb.space
    what = "import of a VirtualBuffer"
    with context:
        try:
            _reserve_range(space, sum(c.nbytes for c in chunks), what)
            for c in chunks:
                _map(space, c, space.base, what)
                space.chunks.append(c)
        except BaseException:
            for c in chunks[len(space.chunks) :]:  # not mapped: released here
                drv.cuMemRelease(c.handle)
            _release_all(space)
            raise
    vb.nbytes = int(nbytes)
    return vb
