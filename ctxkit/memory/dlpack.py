"""DLPack capsules built with ctypes (no compiled extension needed).

A capsule owns a ``DLManagedTensor`` (legacy, capsule name ``"dltensor"``) or a
``DLManagedTensorVersioned`` (DLPack >= 1.0, ``"dltensor_versioned"``). The struct, its
shape/strides arrays and the Python object that owns the memory are kept in
``_live`` until the tensor's deleter runs: the consumer calls it when it is done (after
renaming the capsule ``"used_..."``), or the capsule destructor calls it when nobody
consumed the capsule. Both callbacks are module-level ctypes thunks that live for the
whole process and take the GIL themselves, so a consumer may release the tensor from
any thread.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["KDL_CPU", "KDL_CUDA", "KDL_CUDA_MANAGED", "dlpack_dtype", "live_count", "to_capsule"]


KDL_CPU = 1


KDL_CUDA = 2


KDL_CUDA_HOST = 3


KDL_CUDA_MANAGED = 13


_INT, _UINT, _FLOAT, _COMPLEX, _BOOL = 0, 1, 2, 5, 6


_KIND_CODE = {"i": _INT, "u": _UINT, "f": _FLOAT, "c": _COMPLEX, "b": _BOOL}


FLAG_READ_ONLY = 1


DLPACK_VERSION = (1, 0)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_NAME_LEGACY = b"dltensor"


_NAME_VERSIONED = b"dltensor_versioned"


#: address of the managed struct -> everything that must outlive it
_live: dict[int, tuple[Any, ...]] = {}


_pyapi = ctypes.pythonapi


_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _Destructor)(
    ("PyCapsule_New", _pyapi)
)


# The destructor runs while the capsule is being freed: use raw pointers, not py_object.
_capsule_is_valid = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _pyapi)
)


_capsule_get_pointer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _pyapi)
)


def _delete(addr: int | None) -> None:
    if addr:
        _live.pop(addr, None)


def _capsule_destructor(capsule: int | None) -> None:
    for name in (_NAME_LEGACY, _NAME_VERSIONED):
        if _capsule_is_valid(capsule, name):
            _delete(_capsule_get_pointer(capsule, name))
            return


_DELETER = _Deleter(_delete)


_DESTRUCTOR = _Destructor(_capsule_destructor)


def live_count() -> int:
    """Number of exported tensors whose deleter has not run yet (for tests/diagnostics)."""
    return len(_live)


def dlpack_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int]:
    """``(code, bits, lanes)`` of a numpy dtype; ``BufferError`` when DLPack has none."""
    dt = np.dtype(dtype)
    code = _KIND_CODE.get(dt.kind)
    if code is None or dt.fields is not None or dt.subdtype is not None:
        raise BufferError(f"dtype {dt} has no DLPack equivalent (numeric and bool only)")
    return code, dt.itemsize * 8, 1


def _int64_array(values: tuple[int, ...]) -> Any:
    return (ctypes.c_int64 * max(len(values), 1))(*values)


def _fill_tensor(
    t: DLTensor,
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    dtype: np.dtype[Any],
    device: tuple[int, int],
) -> tuple[Any, Any]:
    code, bits, lanes = dlpack_dtype(dtype)
    c_shape = _int64_array(shape)
    c_strides = _int64_array(strides) if strides is not None else None
    t.data = ptr or None
    t.device = DLDevice(device[0], device[1])
    t.ndim = len(shape)
    t.dtype = DLDataType(code, bits, lanes)
    t.shape = ctypes.cast(c_shape, ctypes.POINTER(ctypes.c_int64))
    if c_strides is not None:
        t.strides = ctypes.cast(c_strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    return c_shape, c_strides


def to_capsule(
    ptr: int,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    device: tuple[int, int],
    owner: object,
    *,
    strides: tuple[int, ...] | None = None,
    versioned: bool = False,
    read_only: bool = False,
) -> Any:
    """A DLPack capsule for memory at *ptr* that keeps *owner* alive until released.

    Parameters
    ----------
    ptr : int
        Address of the first element.
    shape : tuple of int
        Extent of each dimension.
    dtype : numpy.dtype
        Element type (numeric or bool).
    device : (int, int)
        ``(DLDeviceType, device_id)``, e.g. ``(KDL_CUDA, 0)``.
    owner : object
        Kept alive until the consumer (or the unconsumed capsule) releases the tensor.
    strides : tuple of int, optional
        Strides in *elements*; ``None`` for C-contiguous.
    versioned : bool
        Build a DLPack 1.0 ``DLManagedTensorVersioned`` (``"dltensor_versioned"``)
        instead of the legacy ``DLManagedTensor`` (``"dltensor"``).
    read_only : bool
        Set the read-only flag (versioned capsules only).
    """
    managed: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = FLAG_READ_ONLY if read_only else 0
        name = _NAME_VERSIONED
    else:
        managed = DLManagedTensor()
        name = _NAME_LEGACY
    arrays = _fill_tensor(managed.dl_tensor, ptr, shape, strides, dtype, device)
    managed.deleter = _DELETER
    addr = ctypes.addressof(managed)
    managed.manager_ctx = addr
    _live[addr] = (managed, arrays, owner)
    try:
        return _capsule_new(addr, name, _DESTRUCTOR)
    except BaseException:
        _live.pop(addr, None)
        raise
