"""Typed views of device memory: :class:`DeviceArray` (a shape and dtype over a
:class:`~ctxkit.memory.device.DeviceBuffer`, no copy), its copies, and its CUDA Array
Interface v3 / DLPack exports with the stream consumers are ordered after
(:func:`cai_stream`).

Re-exported by :mod:`ctxkit.memory.device`, whose ``DeviceBuffer.view`` makes these
arrays. :class:`BufferBase`, the base class of ``DeviceBuffer``, lets :class:`DeviceArray`
check its buffer without importing that module, which imports this one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._driver import drv
from ..binding import guard
from ..context import Context
from ..device import Device
from ..stream import Event, Stream, stream_handle
from .copies import Mem, c_strides, check_same_size, copy_device, device_mem, dtoh, htod, shape_arg
from .dlpack import to_capsule
from .host import host_array
from .hostptr import plain_dtype

if TYPE_CHECKING:  # pragma: no cover
    from .device import DeviceBuffer

__all__ = ["BufferBase", "DeviceArray", "cai_stream"]


class BufferBase:
    """The base class of :class:`~ctxkit.memory.device.DeviceBuffer` (and so of every
    buffer class): what :class:`DeviceArray` accepts as its memory."""

    __slots__ = ()


class DeviceArray:
    """A typed, C-contiguous view of device memory (no copy).

    Exposes ``__cuda_array_interface__`` (v3) and DLPack (``__dlpack__`` /
    ``__dlpack_device__`` = ``(kDLCUDA, ordinal)``), so ``cupy.asarray(a)``,
    ``torch.from_dlpack(a)`` and ``numba.cuda.as_cuda_array(a)`` share its memory.

    Attributes
    ----------
    buffer : DeviceBuffer
        The memory (kept alive by the array).
    shape : tuple of int
    dtype : numpy.dtype
    stream : Stream, stream-like or None
        The stream with pending writes to the array, exported for consumers to
        synchronize with (``None``: nothing pending). ctxkit's async copies into the
        array set it; set it yourself after launching a kernel that writes it.
    """

    __slots__ = ("__weakref__", "buffer", "dtype", "shape", "stream")

    def __init__(self, buffer: DeviceBuffer, shape: Any, dtype: Any, stream: Any = None):
        if not isinstance(buffer, BufferBase):
            raise TypeError(f"buffer must be a DeviceBuffer, got {type(buffer).__name__}")
        dt = plain_dtype(dtype, "DeviceArray")
        shp = shape_arg(shape)
        need = math.prod(shp) * dt.itemsize
        if need != buffer.nbytes:
            raise ValueError(
                f"shape {shp} of {dt} needs {need} bytes but the buffer has {buffer.nbytes}"
            )
        if buffer.ptr % dt.alignment:
            raise ValueError(
                f"device address {buffer.ptr:#x} is not aligned for {dt} "
                f"({dt.alignment} bytes); slice the buffer at a multiple of {dt.alignment}"
            )
        self.buffer = buffer
        self.shape = shp
        self.dtype = dt
        self.stream = stream

    def _ctxkit_mem(self) -> Mem:
        return Mem(self.ptr, self.nbytes, self.buffer.context, None, self.dtype, self.shape)

    # --- numpy-like attributes -------------------------------------------------------

    @property
    def ptr(self) -> int:
        """Device address of the first element."""
        return self.buffer.ptr

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.buffer.nbytes

    @property
    def ndim(self) -> int:
        """Number of dimensions, ``len(self.shape)`` (as ``numpy.ndarray.ndim``)."""
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element, ``self.dtype.itemsize``."""
        return self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        """C-contiguous strides in bytes."""
        return c_strides(self.shape, self.dtype.itemsize)

    @property
    def context(self) -> Context:
        """The context the memory was allocated in (its buffer's)."""
        return self.buffer.context

    @property
    def device(self) -> Device:
        """The device the memory is on."""
        return self.buffer.context.device

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<DeviceArray shape={self.shape} dtype={self.dtype} device={self.device.ordinal}>"

    def reshape(self, *shape: Any) -> DeviceArray:
        """The same memory with another shape of the same size (``-1`` allowed once)."""
        shp = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        target = _resolve_reshape(tuple(shp), self.size)
        return DeviceArray(self.buffer, target, self.dtype, self.stream)

    # --- copies ----------------------------------------------------------------------

    def _check_host(self, arr: np.ndarray, what: str) -> None:
        if arr.dtype != self.dtype:
            raise ValueError(f"{what}: dtype {arr.dtype} does not match the array's {self.dtype}")
        if arr.shape != self.shape:
            raise ValueError(f"{what}: shape {arr.shape} does not match the array's {self.shape}")

    def copy_from_host(self, arr: Any, stream: Any = None) -> None:
        """Copy a numpy array of the same shape and dtype into the device array."""
        what = "DeviceArray.copy_from_host"
        dst = self.ptr
        a = host_array(arr, what)
        self._check_host(a, what)
        htod(self.context, dst, a, stream, what)
        self.stream = stream

    def copy_to_host(self, out: Any = None, stream: Any = None) -> np.ndarray:
        """Copy into *out* (same shape and dtype; a new array when ``None``); return it."""
        what = "DeviceArray.copy_to_host"
        src = self.ptr
        if out is None:
            dst = np.empty(self.shape, self.dtype)
        else:
            dst = host_array(out, what, writable=True)
            self._check_host(dst, what)
        dtoh(self.context, dst, src, stream, what)
        return dst

    def to_host(self, stream: Any = None) -> np.ndarray:
        """A new numpy array with the contents (synchronous unless *stream* is given)."""
        return self.copy_to_host(None, stream)

    def copy_from(self, src: Any, stream: Any = None) -> None:
        """Device-to-device copy from another device array (ctxkit, CuPy, PyTorch, ...)
        of the same shape and dtype, or a buffer of the same size."""
        what = "DeviceArray.copy_from"
        dst = self._ctxkit_mem()
        s = device_mem(src, what)
        _check_typed(s, self, what, "source")
        copy_device(dst, s, self.nbytes, stream, what)
        self.stream = stream

    def copy_to(self, dst: Any, stream: Any = None) -> None:
        """Device-to-device copy into another device array of the same shape and dtype."""
        what = "DeviceArray.copy_to"
        src = self._ctxkit_mem()
        d = device_mem(dst, what, write=True)
        _check_typed(d, self, what, "destination")
        copy_device(d, src, self.nbytes, stream, what)

    # --- interop ---------------------------------------------------------------------

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3; ``"stream"`` is the pending-writes stream or None."""
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr if self.nbytes else 0, False),
            "version": 3,
            "strides": None,
            "stream": cai_stream(self.stream),
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, device ordinal)``; ``kDLCUDAManaged`` for managed memory."""
        return self.buffer.__dlpack_device__()

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule sharing the memory (no copy).

        *stream* is the consumer's stream (``None``: the legacy default stream; ``-1``:
        no synchronization). When :attr:`stream` has pending writes on another stream,
        the consumer's stream is made to wait for them (an event, no host block).
        A DLPack 1.x versioned capsule is returned when *max_version* allows it.
        """
        if copy:
            raise BufferError("ctxkit exports device memory without copying; copy=True")
        device = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"the array is on {device}, not on the requested {dl_device}")
        ptr = self.ptr
        self._order_for_consumer(stream)
        versioned = max_version is not None and int(max_version[0]) >= 1
        return to_capsule(ptr, self.shape, self.dtype, device, self, versioned=versioned)

    def _order_for_consumer(self, consumer: int | None) -> None:
        producer = self.stream
        if producer is None or consumer == -1:
            return
        if consumer == 0:
            raise BufferError("__dlpack__(stream=0) is ambiguous for CUDA; pass 1 (legacy)")
        consumer = 1 if consumer is None else int(consumer)
        value = cai_stream(producer)
        if value is None or value == consumer:
            return
        ctx = self.context
        event = Event(timing=False, context=ctx)
        event.record(producer)
        with guard(ctx, "DeviceArray.__dlpack__"):
            (err,) = drv.cuStreamWaitEvent(drv.CUstream(consumer), event.handle, 0)
        if err:
            raise ctx.note_error(err, "cuStreamWaitEvent for the DLPack consumer")


def _resolve_reshape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    dims = [int(s) for s in shape]
    unknown = [i for i, s in enumerate(dims) if s == -1]
    if len(unknown) > 1:
        raise ValueError("reshape: only one dimension may be -1")
    if unknown:
        rest = math.prod(d for d in dims if d != -1)
        if rest == 0 or size % rest:
            raise ValueError(f"reshape: cannot reshape {size} elements into {shape}")
        dims[unknown[0]] = size // rest
    if math.prod(dims) != size or any(d < 0 for d in dims):
        raise ValueError(f"reshape: cannot reshape {size} elements into {shape}")
    return tuple(dims)


def _check_typed(m: Mem, arr: DeviceArray, what: str, name: str) -> None:
    if m.dtype is None:
        check_same_size(m.nbytes, arr.nbytes, what, name)
        return
    if m.dtype != arr.dtype:
        raise ValueError(f"{what}: the {name} has dtype {m.dtype}, the array {arr.dtype}")
    if m.shape != arr.shape:
        raise ValueError(f"{what}: the {name} has shape {m.shape}, the array {arr.shape}")


def cai_stream(stream: Any) -> int | None:
    if stream is None:
        return None
    if isinstance(stream, Stream) and stream.closed:
        return None
    value = int(stream_handle(stream))
    return value or 1  # CAI v3: 1 is the legacy default stream (0 is disallowed)
