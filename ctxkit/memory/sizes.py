"""The checks of every size a user passes to an allocation or a copy (byte counts and
shapes), in one place, so each entry point refuses the same bad values the same way."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..device import Device
from ..errors import CudaError

#: The largest size the driver takes (``size_t``).
SIZE_MAX = (1 << 64) - 1


def nbytes_arg(nbytes: Any, what: str, name: str = "nbytes") -> int:
    """*nbytes* as an int; TypeError when it is not an int, ValueError when it is below 0
    or above :data:`SIZE_MAX` (a size that large fits no device, and no ``size_t``)."""
    label = f"{what}: {name}" if name else what
    if isinstance(nbytes, (bool, np.bool_)) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"{label} must be an int number of bytes, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"{label} must be >= 0, got {nbytes}")
    if nbytes > SIZE_MAX:
        raise ValueError(f"{label} is {nbytes}, above 2**64 - 1, the most bytes CUDA can address")
    return int(nbytes)


def shape_arg(shape: Any) -> tuple[int, ...]:
    """*shape* (an int or a sequence of ints >= 0) as a tuple of ints."""
    shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    for s in shp:
        if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"shape entries must be ints, got {shape!r}")
        if s < 0:
            raise ValueError(f"negative dimension in shape {shape!r}")
    return tuple(int(s) for s in shp)


def shape_nbytes(shape: Any, dtype: np.dtype[Any], what: str) -> tuple[tuple[int, ...], int]:
    """*shape* checked by :func:`shape_arg` and the bytes it covers in *dtype*, checked by
    :func:`nbytes_arg` (computed without overflow)."""
    shp = shape_arg(shape)
    n = nbytes_arg(math.prod(shp) * dtype.itemsize, what, f"shape {shp} of {dtype}")
    return shp, n


def covering_shape(nbytes: int, dtype: np.dtype[Any], shape: Any, what: str) -> tuple[int, ...]:
    """*shape* (checked by :func:`shape_arg`; ``None``: 1-D) of *dtype* items that covers
    exactly *nbytes* bytes, as views of a buffer need; ValueError when it does not."""
    if shape is None:
        if nbytes % dtype.itemsize:
            raise ValueError(
                f"{what}: {nbytes} bytes is not a multiple of {dtype} ({dtype.itemsize} B)"
            )
        return (nbytes // dtype.itemsize,)
    shp = shape_arg(shape)
    need = math.prod(shp) * dtype.itemsize
    if need != nbytes:
        raise ValueError(
            f"{what}: shape {shp} of {dtype} needs {need} bytes and does not cover the "
            f"{nbytes} bytes of the buffer"
        )
    return shp


def require_capability(device: Device, attribute: str, what: str, cannot: str, fix: str) -> None:
    """Refuse a request *device* cannot serve, before anything is made: a
    ``CUDA_ERROR_NOT_SUPPORTED`` :class:`~ctxkit.errors.CudaError` saying what it
    *cannot* do (its *attribute* is 0) and the *fix*."""
    if not device.attribute(attribute):
        raise CudaError(
            f"{what}: device {device.ordinal} {cannot} ({attribute} is 0); {fix}",
            801,
            "CUDA_ERROR_NOT_SUPPORTED",
        )


def gib(n: int) -> str:
    """*n* bytes in GiB with two decimals, for error messages."""
    return f"{n / 2**30:.2f} GiB"
