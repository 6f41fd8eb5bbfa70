"""How devices reach host memory: page-lock flags, device addresses of pinned arrays, and
pageable arrays as kernel arguments on devices that access pageable memory (HMM/ATS).

Re-exported by :mod:`ctxkit.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _driver
from .._driver import drv
from ..binding import bind
from ..context import require_current
from ..errors import LaunchArgumentError
from . import host as _host
from .host import (
    MEMHOST_DEVICEMAP,
    MEMHOST_PORTABLE,
    MEMHOST_REGISTER_READ_ONLY,
    MEMHOST_WRITECOMBINED,
    host_array,
    host_device_pointer,
    host_pointer_kind,
    pageable_memory_access,
)

__all__ = [
    "HostMemoryFlags",
    "PageableArg",
    "device_pointer",
    "host_memory_flags",
    "pageable_arg",
]


_INVALID_CONTEXT = 201


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def _attr(name: str) -> Any:
    return getattr(drv.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + name)


@dataclass(frozen=True)
class HostMemoryFlags:
    """How a host array's memory is page-locked (:func:`host_memory_flags`).

    Attributes
    ----------
    kind : str
        ``"allocated"`` (``cuMemHostAlloc``: :func:`pinned_empty`), ``"registered"``
        (``cuMemHostRegister``: :func:`register_host`), ``"managed"`` or ``"pageable"``.
    portable, mapped, write_combined, read_only : bool or None
        The ``CU_MEMHOSTALLOC_*`` / ``CU_MEMHOSTREGISTER_*`` flags: for allocations as
        ``cuMemHostGetFlags`` reports them, for :func:`register_host` blocks as ctxkit
        registered them; ``None`` where nobody can tell (memory another library
        registered, managed and pageable memory).
    device_pointer : int or None
        The address kernels use for it (``None``: pageable).
    """

    kind: str
    portable: bool | None = None
    mapped: bool | None = None
    write_combined: bool | None = None
    read_only: bool | None = None
    device_pointer: int | None = None

    @property
    def pinned(self) -> bool:
        """True for page-locked memory (allocated or registered)."""
        return self.kind in ("allocated", "registered")


def _registered_flags(first: int, last: int) -> int | None:
    with _host._registered_lock:
        for start, (end, flags) in _host._registered.items():
            if start <= first and last < end:
                return flags
    return None


def host_memory_flags(arr: Any) -> HostMemoryFlags:
    """How *arr*'s memory is page-locked: allocated or registered, and with which flags.

    The whole array counts (first and last byte, as for :func:`is_pinned`). For
    :func:`pinned_empty` memory the flags come from the driver (``cuMemHostGetFlags``); on
    systems with unified addressing the driver may report ``mapped`` even where it was not
    asked for, since all pinned memory is device-accessible there.
    """
    a = host_array(arr, "host_memory_flags") if not isinstance(arr, np.ndarray) else arr
    if a.size == 0:
        return HostMemoryFlags("pageable")
    first = _address(a)
    last = first + a.nbytes - 1
    kinds = {host_pointer_kind(first), host_pointer_kind(last)}
    if kinds != {"pinned"}:
        kind = "managed" if kinds == {"managed"} else "pageable"
        return HostMemoryFlags(
            kind, device_pointer=host_device_pointer(a) if kind == "managed" else None
        )
    dptr = _device_pointer_of(first, "host_memory_flags")
    reg = _registered_flags(first, last)
    if reg is not None:
        return _flags("registered", reg, dptr, read_only=bool(reg & MEMHOST_REGISTER_READ_ONLY))
    flags = _host_alloc_flags(first)
    if flags is None:
        return HostMemoryFlags("registered", device_pointer=dptr)
    return _flags("allocated", flags, dptr, read_only=False)


def _flags(kind: str, flags: int, dptr: int, *, read_only: bool) -> HostMemoryFlags:
    return HostMemoryFlags(
        kind,
        portable=bool(flags & MEMHOST_PORTABLE),
        mapped=bool(flags & MEMHOST_DEVICEMAP),
        write_combined=kind == "allocated" and bool(flags & MEMHOST_WRITECOMBINED),
        read_only=read_only,
        device_pointer=dptr,
    )


def _with_any_context(fn: Any, *args: Any) -> tuple[Any, Any]:
    """``fn(*args)`` in the current context, or in device 0's when the thread has none."""
    _driver.init()
    err, value = fn(*args)
    if err == _INVALID_CONTEXT:
        with bind(0):
            err, value = fn(*args)
    return err, value


def _host_alloc_flags(ptr: int) -> int | None:
    """``cuMemHostGetFlags`` of pinned *ptr*; ``None`` when the driver refuses, as it does
    for memory that is not a ``cuMemHostAlloc`` block (registered memory)."""
    err, flags = _with_any_context(drv.cuMemHostGetFlags, ptr)
    return None if err else int(flags)


def _device_pointer_of(ptr: int, what: str) -> int:
    err, dptr = _with_any_context(drv.cuPointerGetAttribute, _attr("DEVICE_POINTER"), ptr)
    _driver.raise_for(err, f"{what}: cuPointerGetAttribute(DEVICE_POINTER, {ptr:#x})")
    return int(dptr)


def device_pointer(arr: Any) -> int:
    """The device address of page-locked (or managed) host memory, for kernels.

    Kernels read and write the host memory through it directly, over the bus (zero-copy),
    e.g. memory from ``pinned_empty(..., mapped=True)`` or ``register_host(arr,
    mapped=True)``. ctxkit's kernels also take such arrays as arguments directly.

    Raises
    ------
    ValueError
        The array is in pageable memory (or empty): allocate it with :func:`pinned_empty`
        or pin it with :func:`register_host` first.
    """
    a = host_array(arr, "device_pointer") if not isinstance(arr, np.ndarray) else arr
    kind = host_pointer_kind(_address(a)) if a.size else "pageable"
    if kind not in ("pinned", "managed"):
        raise ValueError(
            f"device_pointer: the array ({a.nbytes} bytes at {_address(a):#x}) is in "
            "pageable memory, which has no device address; allocate it with "
            "ctxkit.pinned_empty(..., mapped=True) or pin it with "
            "`with ctxkit.register_host(arr, mapped=True):`"
        )
    return _device_pointer_of(_address(a), "device_pointer")


class PageableArg:
    """A host array passed to a kernel by its host address (see :func:`pageable_arg`)."""

    __slots__ = ("array",)

    def __init__(self, arr: Any) -> None:
        self.array = host_array(arr, "pageable_arg")

    @property
    def ptr(self) -> int:
        """The address for the current context's device.

        Raises
        ------
        LaunchArgumentError
            That device cannot access pageable memory.
        """
        pinned = host_device_pointer(self.array)
        if pinned is not None:
            return pinned
        dev = require_current("pageable_arg").device
        if not pageable_memory_access(dev):
            raise LaunchArgumentError(
                f"pageable_arg: device {dev.ordinal} cannot access pageable host memory "
                "(CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0: no HMM or ATS on this "
                "system); copy the array to the device (ctxkit.to_device) or pin it "
                "(ctxkit.pinned_empty / ctxkit.register_host)"
            )
        return _address(self.array)

    def __repr__(self) -> str:
        return f"<PageableArg {self.array.shape} {self.array.dtype} at {_address(self.array):#x}>"


def pageable_arg(arr: Any) -> PageableArg:
    """Opt in for one kernel argument: pass pageable *arr* by its host address.

    ``k.launch(grid, block, ctxkit.memory.hostaccess.pageable_arg(x), n)`` lets the kernel read
    and write *x* in place on a device that accesses pageable memory (HMM/ATS); on other
    devices the launch raises ``LaunchArgumentError``. Keep *x* alive and do not touch it
    from the host until the kernel has finished.
    """
    return PageableArg(arr)
