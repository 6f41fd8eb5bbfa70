"""Result and error types of ``ctxkit.pipeline`` (re-exported there)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ContextPoisonedError, PipelineError

__all__ = ["ChunkView", "DeviceStats", "RunStats", "chunk_error"]


def chunk_error(
    device: int, ctx_poisoned: bool, chunk: Any, step: str, exc: BaseException
) -> PipelineError:
    """The PipelineError of a failed chunk (``chunk=None``: the device's setup)."""
    poisoned = isinstance(exc, ContextPoisonedError) or ctx_poisoned
    where = (
        f"chunk {chunk.index} (rows {chunk.row0}..{chunk.row1})" if chunk is not None else "setup"
    )
    msg = f"Pipeline.map failed on device {device}, {where}, step {step!r}: {exc}"
    if poisoned:
        msg += (
            f"\nThe context of device {device} is poisoned (a kernel faulted; other "
            "chunks running at the same time may have caused it): this pipeline cannot be "
            "used again. close() it; the device needs a fresh context (restart the process)."
        )
    return PipelineError(msg, device, chunk.index if chunk else None, step, exc, poisoned)


@dataclass
class DeviceStats:
    """What one device did in the last run."""

    device: int
    chunks: int = 0
    rows: int = 0
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Input gigabytes (1e9) per second of this device's worker time."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class RunStats:
    """Totals of the last run: input bytes, wall seconds and the per-device breakdown.

    ``path`` says how host data moved: ``"pinned"``, ``"managed"``, or per side
    ``"in=<how>, out=<how>"`` with ``staged``, ``registered``, ``pinned`` or ``held``
    (kept page-locked between calls by pin on reuse).
    ``fallbacks`` counts chunk sides of a registered path that were staged instead
    because the driver refused to register their pages.
    """

    nbytes: int = 0
    seconds: float = 0.0
    path: str = ""
    devices: list[DeviceStats] = field(default_factory=list)
    fallbacks: int = 0

    @property
    def gbps(self) -> float:
        """Input gigabytes (1e9) per wall-clock second."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class ChunkView:
    """One chunk's device (or managed) memory, handed to a callable map body.

    Has ``.ptr``, ``.shape``, ``.dtype``, ``.size``, ``.nbytes`` and
    ``__cuda_array_interface__`` (v3), so it can be passed to ``Kernel.launch`` or
    wrapped by CuPy/Numba/PyTorch without a copy.
    """

    __slots__ = ("dtype", "ptr", "shape")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
        self.ptr = int(ptr)
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.size * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
        }

    def __repr__(self) -> str:
        return f"<ChunkView {self.ptr:#x} shape={self.shape} dtype={self.dtype}>"
