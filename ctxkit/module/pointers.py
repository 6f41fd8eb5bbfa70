"""Which device address a Python argument carries.

ctxkit buffers and arrays (``.ptr``), ``__cuda_array_interface__`` objects (CuPy,
Numba, PyTorch), DLPack producers and page-locked/managed numpy arrays all pass as
device pointers. The way to read each type's address is worked out once per type and
cached, so the launch hot path pays one dictionary lookup per pointer argument.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _driver
from ..errors import LaunchArgumentError
from ..memory.host import host_device_pointer, plain_dtype

__all__ = [
    "Refused",
    "device_pointer",
    "dlpack_pointer",
    "getters",
    "pointer_getter",
    "short_repr",
]


class Refused(Exception):
    """A value does not fit a parameter; the message says why."""


_HOST_ARRAY_FIX = (
    "copy it to the device first (ck.DeviceBuffer / ck.device_array) or allocate it "
    "device-visible (ck.pinned_empty, ck.ManagedBuffer(...).as_numpy())"
)


def _ndarray_pointer(arr: np.ndarray, ctx: Any = None) -> int:
    plain_dtype(arr.dtype, "kernel argument")
    ptr = host_device_pointer(arr)
    if ptr is None:
        raise Refused(
            f"got a numpy array {arr.shape} {arr.dtype} in pageable host memory, which a "
            f"kernel cannot read; {_HOST_ARRAY_FIX}"
        )
    return int(ptr)


def _torch_pointer(t: Any, ctx: Any = None) -> int:
    if not t.is_cuda:
        raise Refused(f"got a torch tensor on {t.device} (host memory); move it with .cuda()")
    return int(t.data_ptr())


def _cupy_pointer(a: Any, ctx: Any = None) -> int:
    return int(a.data.ptr)


def _attr_pointer(a: Any, ctx: Any = None) -> int:
    return int(a.ptr)


def _cai_pointer(a: Any, ctx: Any = None) -> int:
    return int(a.__cuda_array_interface__["data"][0] or 0)


_DLPACK_HOST = 1


_DLPACK_DEVICE_TYPES = {2, 3, 13}  # CUDA, CUDA host (pinned), CUDA managed


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer


_capsule_pointer.restype = ctypes.c_void_p


_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


_DLTENSOR_BYTE_OFFSET = 40  # data, device, ndim, dtype, shape, strides precede it


def dlpack_pointer(obj: Any) -> int:
    """Address of the first element of a DLPack producer (``__dlpack__``)."""
    capsule = obj.__dlpack__()
    base = _capsule_pointer(capsule, b"dltensor")
    data = ctypes.c_void_p.from_address(base).value or 0
    return data + ctypes.c_uint64.from_address(base + _DLTENSOR_BYTE_OFFSET).value


def _dlpack_device_pointer(obj: Any, ctx: Any = None) -> int:
    dev_type = int(obj.__dlpack_device__()[0])
    if dev_type not in _DLPACK_DEVICE_TYPES:
        where = "host memory" if dev_type == _DLPACK_HOST else f"DLPack device type {dev_type}"
        raise Refused(f"got a {type(obj).__name__} in {where}; a kernel needs device memory")
    return dlpack_pointer(obj)


#: type -> ``getter(value, ctx=None)`` of its device address (``None``: not memory)
getters: dict[type, Callable[..., int] | None] = {}


_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_lock")


def _classify(v: Any) -> Callable[..., int] | None:
    t = type(v)
    if isinstance(v, np.ndarray):
        return _ndarray_pointer
    if isinstance(v, np.generic) or hasattr(t, "__cuda_stream__"):
        return None  # numbers, and streams (which carry .ptr too) are not memory
    mod = t.__module__ or ""
    if mod.startswith("torch") and hasattr(v, "data_ptr") and hasattr(v, "is_cuda"):
        return _torch_pointer
    if mod.startswith("cupy") and hasattr(getattr(v, "data", None), "ptr"):
        return _cupy_pointer
    if hasattr(t, "ptr") or "ptr" in getattr(v, "__dict__", ()):
        return _attr_pointer
    if hasattr(v, "__cuda_array_interface__"):
        return _cai_pointer
    if hasattr(v, "__dlpack__") and hasattr(v, "__dlpack_device__"):
        return _dlpack_device_pointer
    return None


def pointer_getter(v: Any) -> Callable[..., int] | None:
    """How to read *v*'s device address, worked out once per type: ``getter(v)`` (it
    also takes the launch context as a second argument, which it ignores), or ``None``
    when *v* is not a memory object."""
    t = type(v)
    try:
        return getters[t]
    except KeyError:
        pass
    g = _classify(v)
    with _lock:
        getters[t] = g
    return g


def device_pointer(v: Any) -> int | None:
    """The device address *v* carries, or ``None`` when *v* is not a memory object.

    Understands ctxkit buffers and arrays (``.ptr``), ``__cuda_array_interface__``
    (CuPy, Numba, PyTorch), DLPack producers and page-locked/managed numpy arrays.

    Raises
    ------
    LaunchArgumentError
        *v* is memory a kernel cannot use (pageable numpy array, CPU tensor).
    """
    g = pointer_getter(v)
    if g is None:
        return None
    try:
        return g(v)
    except Refused as exc:
        raise LaunchArgumentError(str(exc)) from None


def short_repr(v: Any) -> str:
    r = repr(v)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{type(v).__name__} {r}"
