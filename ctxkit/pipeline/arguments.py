"""What a Pipeline is given, turned into what it works on: ``devices=`` into contexts
(:func:`_resolve_contexts`), a device argument into an ordinal (:func:`_ordinal`), an
array into the kind of its host memory (:func:`_memory_kind`, for
:func:`~ctxkit.pipeline.plan.plan_map`) and the ``x``/``out`` of ``map_managed`` into
numpy views of managed memory (:func:`_managed_array`). The checks of a map's host arrays
and options are :func:`~ctxkit.pipeline.plan.prepare_io` and
:class:`~ctxkit.pipeline.plan.MapOptions`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _driver
from ..binding import registry
from ..context import Context
from ..device import Device, device_count
from ..errors import CudaError
from ..memory.host import is_pinned
from ..memory.managed import ManagedBuffer

__all__: list[str] = []


_NO_DEVICE = 100


def _ordinal(device: object) -> int | None:
    if isinstance(device, Device):
        return device.ordinal
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    return None


def _resolve_contexts(specs: list[int | Device | Context] | None) -> list[Context]:
    if specs is None:
        n = device_count()
        if n == 0:
            _driver.init()
            raise CudaError(
                "Pipeline(devices=None): no CUDA device is visible (the driver reports "
                "none); check nvidia-smi and CUDA_VISIBLE_DEVICES",
                _NO_DEVICE,
                "CUDA_ERROR_NO_DEVICE",
            )
        specs = list(range(n))
    contexts = [registry.resolve(d) for d in specs]
    for ctx in contexts:
        ctx.check_usable()
    return contexts


def _memory_kind(a: np.ndarray) -> str:
    return "pinned" if a.nbytes and is_pinned(a) else "pageable"


def _managed_array(obj: Any, dtype: Any, shape: Sequence[int] | None, what: str) -> np.ndarray:
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, ManagedBuffer):
        if dtype is None:
            raise TypeError(f"map_managed: pass dtype= to view the ManagedBuffer {what} as")
        if shape is None:
            return obj.as_numpy(dtype)
        return obj.as_numpy(dtype, tuple(shape))
    raise TypeError(
        f"map_managed: {what} must be a ManagedBuffer or a numpy view of one, "
        f"got {type(obj).__name__}"
    )
