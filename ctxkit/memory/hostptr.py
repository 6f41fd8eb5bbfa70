"""What a host address is to CUDA: pointer queries for host arrays.

:func:`host_pointer_kind` asks the driver (``cuPointerGetAttribute``) whether an address
is pinned, managed, device or pageable memory; :func:`is_pinned` applies it to both ends
of an array; :func:`host_array` turns a host argument into a C-contiguous numpy array (or
a clear error) without copying; :func:`plain_dtype` refuses dtypes holding Python objects
wherever memory is read or written as bytes. Every host copy, the honest-async check and
:mod:`ctxkit.memory.hostaccess` build on these; they change no driver state.

Re-exported by :mod:`ctxkit.memory.host` and :mod:`ctxkit.memory`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _driver
from .._driver import drv
from ..binding import bind
from ..errors import DriverNotFoundError

__all__ = ["host_array", "host_pointer_kind", "is_pinned", "plain_dtype"]


_INVALID_VALUE = 1


_INVALID_CONTEXT = 201


_MEMORYTYPE_HOST, _MEMORYTYPE_DEVICE, _MEMORYTYPE_ARRAY, _MEMORYTYPE_UNIFIED = 1, 2, 3, 4


def host_pointer_kind(ptr: int) -> str:
    """What the driver knows about a host-side address.

    Returns ``"pinned"`` (page-locked: ``cuMemHostAlloc`` or ``cuMemHostRegister``),
    ``"managed"`` (unified memory), ``"device"`` or ``"pageable"`` (unknown to CUDA).
    """
    if not ptr:
        return "pageable"
    _driver.init()
    err, value = drv.cuPointerGetAttribute(_attr("MEMORY_TYPE"), ptr)
    if err == _INVALID_CONTEXT:
        with bind(0):
            err, value = drv.cuPointerGetAttribute(_attr("MEMORY_TYPE"), ptr)
    if err == _INVALID_VALUE:
        return "pageable"
    _driver.raise_for(err, f"cuPointerGetAttribute(MEMORY_TYPE, {ptr:#x})")
    kind = int(value)
    if kind == _MEMORYTYPE_HOST:
        return "pinned"
    if kind == _MEMORYTYPE_UNIFIED:
        return "managed"
    err, managed = drv.cuPointerGetAttribute(_attr("IS_MANAGED"), ptr)
    return "managed" if not err and managed else "device"


def _attr(name: str) -> Any:
    return getattr(drv.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + name)


def plain_dtype(dtype: Any, what: str) -> np.dtype[Any]:
    """*dtype* as a numpy dtype, refused when its items hold Python objects.

    An object array (``dtype=object``, or a structured dtype with an object field) stores
    references into the interpreter's heap: copied to a device they are meaningless
    addresses, and device bytes copied into one become references that crash the
    interpreter. Every ctxkit path that reads or writes memory as bytes (copies, page
    locking, numpy views of pinned, managed or device memory, the pipeline) asks here.

    Raises
    ------
    TypeError
        ``dtype.hasobject``.
    """
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(
            f"{what}: dtype {dt} holds Python objects (references into the interpreter's "
            "heap), which cannot go to or come from a GPU as bytes; use a numeric, bool or "
            "fixed-width string dtype (e.g. arr.astype(np.float64), arr.astype('U16'))"
        )
    return dt


def host_array(arr: Any, what: str, *, writable: bool = False) -> np.ndarray:
    """*arr* as a C-contiguous numpy array without copying, or a clear error.

    Accepts numpy arrays and objects with the buffer protocol (bytes, bytearray,
    memoryview, array.array).

    Raises
    ------
    TypeError
        *arr* is not an array or buffer, or its dtype holds Python objects
        (:func:`plain_dtype`).
    ValueError
        It is not C-contiguous, or not writable when *writable*.
    """
    if not isinstance(arr, np.ndarray):
        try:
            arr = np.frombuffer(arr, dtype=np.uint8) if _is_buffer(arr) else None
        except (TypeError, ValueError):
            arr = None
        if arr is None:
            raise TypeError(
                f"{what}: expected a numpy array or a buffer (bytes, bytearray, memoryview); "
                "convert with np.asarray(...) first"
            )
    plain_dtype(arr.dtype, what)
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{what}: the host array is not C-contiguous (strides {arr.strides}); pass "
            "np.ascontiguousarray(arr)"
        )
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: the destination host array is read-only")
    return arr


def _is_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def _driver_present() -> bool:
    try:
        _driver.init()
    except DriverNotFoundError:
        return False
    return True


def is_pinned(arr: Any) -> bool:
    """True when the array's memory is page-locked (``pinned_empty``/``register_host``
    or another library's pinned allocator); False for ordinary pageable memory.

    Both its first and its last byte are checked: an array that merely shares its first
    page with a neighbour's registration is not pinned.

    Async copies need pinned memory: from pageable memory the driver blocks the host for
    the whole copy. :func:`ctxkit.memory.hostaccess.host_memory_flags` tells how it is
    pinned. Without a driver (or cuda-bindings) no memory is pinned: False.
    """
    a = host_array(arr, "is_pinned") if not isinstance(arr, np.ndarray) else arr
    if a.size == 0 or not _driver_present():
        return False
    first = _address(a)
    last = first + a.nbytes - 1
    return host_pointer_kind(first) == "pinned" and host_pointer_kind(last) == "pinned"
