"""Device memory: buffers, typed arrays and stream-ordered memory pools.

Typed views of device memory: :class:`DeviceArray` (a shape and dtype over a
:class:`~ctxkit.memory.device.DeviceBuffer`, no copy), its copies, and its CUDA Array
Interface v3 / DLPack exports with the stream consumers are ordered after
(:func:`~ctxkit.memory.copies.cai_stream`). ``DeviceBuffer.view`` makes these arrays.

Device memory: :class:`DeviceBuffer` (linear memory in one context, ``cuMemAlloc`` or
stream-ordered) with its copies and its CUDA Array Interface / DLPack exports (as bytes),
and :func:`device_array` / :func:`to_device`, which make typed arrays (the family's
overview is in :mod:`ctxkit.memory`).

Stream-ordered memory pools (``cuMemAllocAsync`` / ``cuMemFreeAsync``).

A :class:`MemoryPool` is a device's default pool (``cuDeviceGetDefaultMemPool``, what
``DeviceBuffer(n, stream=s)`` draws from), a pool ctxkit creates (``cuMemPoolCreate``),
or one another library made (:meth:`MemoryPool.from_handle`, e.g. a pool CuPy or PyTorch
uses). Freed memory returns to the pool in stream order and is reused without a driver
allocation, which is what makes allocating per iteration cheap; the release threshold
says how much unused memory the pool keeps across synchronizations. On top of it, ctxkit
caches freed blocks per stream for reuse without a driver call, like PyTorch's caching
allocator (:mod:`ctxkit.memory.alloc`): they count as used in the driver's statistics
and in :attr:`MemoryPool.cached_bytes`; :meth:`MemoryPool.trim` gives them back.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, ClassVar, TypeVar

import numpy as np

from .._driver import drv
from ..binding import ContextLike, guard, resolve_context
from ..context import Context, thread_state
from ..device import Device
from ..errors import ContextClosedError
from ..lifetime import finalizer
from ..stream import Stream, call_stream, implicit_stream
from . import alloc
from .alloc import Block, MemoryKind
from .copies import Copyable, Mem, c_strides, cai_stream
from .host import host_array, plain_dtype
from .interop import order_stream, to_capsule
from .sizes import covering_shape, nbytes_arg, shape_nbytes

__all__ = [
    "DeviceArray",
    "DeviceBuffer",
    "MemoryPool",
    "device_array",
    "to_device",
]


class DeviceArray(Copyable):
    """A typed, C-contiguous view of device memory (no copy).

    Exposes ``__cuda_array_interface__`` (v3) and DLPack (``__dlpack__`` /
    ``__dlpack_device__`` = ``(kDLCUDA, ordinal)``), so ``cupy.asarray(a)``,
    ``torch.from_dlpack(a)`` and ``numba.cuda.as_cuda_array(a)`` share its memory.

    Attributes
    ----------
    buffer : DeviceBuffer
        The memory (kept alive by the array).
    context : Context
        The context the memory was allocated in (its buffer's).
    shape : tuple of int
    dtype : numpy.dtype
    stream : Stream, stream-like or None
        The stream with pending writes to the array, exported for consumers to
        synchronize with (``None``: nothing pending). ctxkit's async copies into the
        array set it; set it yourself after launching a kernel that writes it.
    """

    __slots__ = ("__weakref__", "buffer", "context", "dtype", "shape", "stream")

    def __init__(self, buffer: DeviceBuffer, shape: Any, dtype: Any, stream: Any = None):
        if not isinstance(buffer, DeviceBuffer):
            raise TypeError(f"buffer must be a DeviceBuffer, got {type(buffer).__name__}")
        dt = plain_dtype(dtype, "DeviceArray")
        shp = covering_shape(buffer.nbytes, dt, shape, "DeviceArray")
        if buffer.ptr % dt.alignment:
            raise ValueError(
                f"device address {buffer.ptr:#x} is not aligned for {dt} "
                f"({dt.alignment} bytes); slice the buffer at a multiple of {dt.alignment}"
            )
        self.buffer = buffer
        self.context = buffer.context
        self.shape = shp
        self.dtype = dt
        self.stream = stream

    def _ctxkit_mem(self) -> Mem:
        return Mem(self.ptr, self.nbytes, self.context, None, self.dtype, self.shape)

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

    def _written(self, stream: Any) -> None:
        self.stream = stream

    def copy_to_host(self, out: Any = None, stream: Any = None) -> np.ndarray:
        """Copy into *out* (same shape and dtype; a new array when ``None``); return it."""
        return super().copy_to_host(out, stream)

    def to_host(self, stream: Any = None) -> np.ndarray:
        """A new numpy array with the contents (synchronous unless *stream* is given)."""
        return self.copy_to_host(None, stream)

    def __deepcopy__(self, memo: Any) -> DeviceArray:
        """A new array of the same shape and dtype in the same context, holding a copy
        made on the device (``copy.copy`` too), as CuPy and numpy copy arrays."""
        out = self.buffer._alike(self.nbytes).view(self.shape, self.dtype)
        out.copy_from(self)
        return out

    def __copy__(self) -> DeviceArray:
        return self.__deepcopy__(None)

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
        producer = None if stream == -1 else cai_stream(self.stream)
        if producer is not None:  # pending writes: the consumer stream waits for them
            if stream == 0:
                raise BufferError("__dlpack__(stream=0) is ambiguous for CUDA; pass 1 (legacy)")
            with guard(self.context, "DeviceArray.__dlpack__"):
                order_stream(self.context, producer, 1 if stream is None else int(stream))
        versioned = max_version is not None and int(max_version[0]) >= 1
        return to_capsule(ptr, self.shape, self.dtype, device, self, versioned=versioned)


def _resolve_reshape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    dims = [int(s) for s in shape]
    if dims.count(-1) > 1:
        raise ValueError("reshape: only one dimension may be -1")
    rest = math.prod(d for d in dims if d != -1)
    if -1 in dims and rest and size % rest == 0:
        dims[dims.index(-1)] = size // rest  # else the -1 stays and is refused below
    if math.prod(dims) != size or any(d < 0 for d in dims):
        raise ValueError(f"reshape: cannot reshape {size} elements into {shape}")
    return tuple(dims)


_Buffer = TypeVar("_Buffer", bound="DeviceBuffer")


class DeviceBuffer(Copyable):
    """Linear device memory in one context: ``cuMemAlloc``, or stream-ordered from a pool.

    Parameters
    ----------
    nbytes : int
        Size in bytes (0 allocates nothing).
    context : Context, Device, int or None
        Where to allocate. ``None``: the stream's context, else the calling thread's
        current context (``NoCurrentContextError`` when it has none); a Context is bound
        for the allocation, whatever else is current.
    stream : Stream or stream-like, optional
        Allocate stream-ordered on *stream* (``cuMemAllocAsync``) from the device's
        default pool or *pool*; the memory is usable by work enqueued on that stream
        after this call, and :meth:`close` frees it with ``cuMemFreeAsync`` on the same
        stream (or ``close(stream=)``). Inside ``with stream:`` a ``DeviceBuffer(n)``
        without *stream* is stream-ordered on the current stream. Freed stream-ordered
        blocks are cached for reuse on their stream, like PyTorch's caching allocator:
        :meth:`MemoryPool.trim` gives them back to the driver, ``CTXKIT_ALLOC_CACHE=0``
        disables the cache (:mod:`ctxkit.memory.alloc`).
    pool : MemoryPool, optional
        The pool to allocate from (``cuMemAllocFromPoolAsync``); implies stream-ordered
        allocation (on the current stream when *stream* is not given).

    Raises
    ------
    OutOfMemoryError
        The allocation does not fit; the message (and ``.requested``/``.free``) give
        the requested and the free bytes (``cuMemGetInfo``).

    Notes
    -----
    ``buf[a:b]`` is a view of bytes ``a..b`` (no copy; it keeps the buffer alive): use it
    for copies at an offset. After :meth:`close` every use of the buffer or its views
    raises :class:`ContextClosedError`. Operations from a thread with no current context
    raise ``NoCurrentContextError``; with another context current, the buffer's own
    context is bound for the call.
    """

    __slots__ = ("__weakref__", "_base", "_fin", "_ptr", "_stream", "context", "nbytes")

    #: The kind of memory the class allocates (:mod:`ctxkit.memory.alloc`).
    kind: ClassVar[MemoryKind] = alloc.DEVICE

    _ptr: int | None
    _base: DeviceBuffer | None
    _stream: Stream | None
    _fin: weakref.finalize | Block | None
    context: Context
    nbytes: int

    def __init__(
        self, nbytes: int, context: Any = None, *, stream: Any = None, pool: Any = None
    ) -> None:
        # Fast path: DeviceBuffer(n, stream=s) / `with s: DeviceBuffer(n)` served from the
        # block cache of s: no resolver, no push/pop, no driver call.
        if pool is None and type(nbytes) is int and nbytes > 0 and self.kind.stream_ordered:
            s = stream
            if s is None and context is None and (top := thread_state().top) is not None:
                s = implicit_stream(top)
            if type(s) is Stream and (context is None or context is s.context):
                blk = alloc.take(s, nbytes)
                if blk is not None:
                    self._hold(blk, nbytes, s.context, s)
                    return
        self._init(nbytes, context, stream, pool)

    def _init(self, nbytes: int, context: Any, stream: Any, pool: Any) -> None:
        what = f"{type(self).__name__}({nbytes})"
        n = nbytes_arg(nbytes, what)
        if context is None and isinstance(stream, Stream):
            context = stream.context
        ctx = resolve_context(context, what)
        self._setup_view(0, n, ctx, None)
        if (stream is not None or pool is not None) and not self.kind.stream_ordered:
            raise TypeError(f"{what}: {type(self).__name__} cannot be stream-ordered")
        sh = None
        if self.kind.stream_ordered and (stream, pool, implicit_stream(ctx)) != (None,) * 3:
            stream, sh, _ = call_stream(stream, ctx, what)  # else cuMemAlloc, green or not
        if n == 0:
            return
        if stream is None and pool is None:
            err, ptr = self.kind.allocate(ctx, n)
            if err:
                raise alloc.out_of_memory(ctx, err, n, what)
            self._ptr = int(ptr)
            self._fin = self.kind.deallocate(self, ctx, ptr)
            return
        s = stream if isinstance(stream, Stream) else Stream.from_handle(stream or 0, ctx)
        ph = None if pool is None else pool.handle
        self._hold(alloc.take(s, n, ph) or alloc.allocate(ctx, n, s, sh, ph, what), n, ctx, s)

    def _hold(self, blk: Block, n: int, ctx: Context, s: Stream) -> None:
        """Own the stream-ordered block *blk* of *n* bytes on *s*. The block holds the
        stream while the buffer lives, so the free (or the return to the stream's cache)
        is ordered after every use enqueued on it."""
        self._setup_view(blk.ptr, n, ctx, None)
        self._stream = s
        self._fin = blk

    @classmethod
    def from_pointer(
        cls: type[_Buffer], ptr: int, nbytes: int, context: Any = None, owner: Any = None
    ) -> _Buffer:
        """Wrap device memory allocated elsewhere (not freed by ctxkit).

        *owner* is kept alive as long as the wrapper (and its views) live.
        """
        n = nbytes_arg(nbytes, "DeviceBuffer.from_pointer")
        ctx = resolve_context(context, "DeviceBuffer.from_pointer")
        buf = cls.__new__(cls)
        buf._setup_view(int(ptr), n, ctx, None)
        buf._fin = weakref.finalize(buf, _keep, owner) if owner is not None else None
        return buf

    def _setup_view(self, ptr: int, n: int, ctx: Context, base: DeviceBuffer | None) -> None:
        """The state of a buffer (a view of *base*, or with nothing to free yet)."""
        self._ptr = ptr
        self.nbytes = n
        self.context = ctx
        self._base = base
        self._stream = None if base is None else base._stream
        self._fin = None

    def _ctxkit_mem(self) -> Mem:
        return Mem(self.ptr, self.nbytes, self.context, None, None, None)

    # --- state -----------------------------------------------------------------------

    @property
    def ptr(self) -> int:
        """The device address (raises ``ContextClosedError`` after :meth:`close`)."""
        ptr, base = self._ptr, self._base  # :attr:`closed`, inline: every launch asks
        if ptr is None or (base is not None and base._ptr is None):
            raise self._closed_error("ptr")
        return ptr

    @property
    def base(self) -> DeviceBuffer | None:
        """The buffer this one is a view of (``buf[a:b]``); ``None`` for an allocation."""
        return self._base

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (of this buffer or, for a view, of its parent)."""
        return self._ptr is None or (self._base is not None and self._base._ptr is None)

    def _closed_error(self, what: str) -> ContextClosedError:
        """The error of a use after :meth:`close` (a subclass may say why it closed)."""
        return ContextClosedError(
            f"{type(self).__name__}.{what}: the buffer was closed (its memory is freed); "
            "allocate a new one"
        )

    def __repr__(self) -> str:
        if self.closed:
            return f"<{type(self).__name__} closed nbytes={self.nbytes}>"
        view = " view" if self._base is not None else ""
        return (
            f"<{type(self).__name__}{view} {self._ptr:#x} nbytes={self.nbytes} "
            f"device={self.context.device.ordinal}>"
        )

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, stream: Any = None) -> None:
        """Free the memory now (inside its context, from any thread). Idempotent.

        Stream-ordered memory goes back to the block cache of its allocation stream, or
        of *stream* when given (a later allocation on that stream reuses it, ordered
        after the work on that stream only: make sure nothing else still uses the
        memory); the cache frees it with ``cuMemFreeAsync`` on that stream
        (:mod:`ctxkit.memory.alloc`). Closing a slice view only invalidates the view.
        """
        fin = self._fin
        if self._base is None and fin is not None:
            if isinstance(fin, Block):
                self._fin = None
                if stream is not None and not isinstance(stream, Stream):
                    stream = Stream.from_handle(stream, self.context)
                alloc.give_back(fin, stream)
            else:
                fin()
        self._ptr = None

    @property
    def stream(self) -> Stream | None:
        """The allocation stream of stream-ordered memory (``None`` for ``cuMemAlloc``)."""
        return self._stream

    def __getitem__(self, key: slice) -> DeviceBuffer:
        """``buf[a:b]``: a view of bytes ``a..b`` (step 1 only)."""
        if not isinstance(key, slice):
            raise TypeError("index a DeviceBuffer with a byte slice, e.g. buf[16:32]")
        start, stop, step = key.indices(self.nbytes)
        if step != 1:
            raise ValueError("DeviceBuffer slices must be contiguous (step 1)")
        base = self._base if self._base is not None else self
        view = type(self).__new__(type(self))
        view._setup_view(self.ptr + start, max(0, stop - start), self.context, base)
        return view

    def _alike(self, nbytes: int) -> DeviceBuffer:
        """New memory of this kind in this context (a copy's destination)."""
        return DeviceBuffer(nbytes, self.context)

    def __deepcopy__(self, memo: Any) -> DeviceBuffer:
        """A new buffer of the same size and kind in the same context, holding a copy made
        on the device (``copy.copy`` too); a view's copy holds the view's bytes."""
        out = self._alike(self.nbytes)
        out.copy_from(self)
        return out

    def __copy__(self) -> DeviceBuffer:
        return self.__deepcopy__(None)

    # --- typed views and interop -----------------------------------------------------

    def view(self, shape: Any = None, dtype: Any = np.uint8) -> DeviceArray:
        """A typed, C-contiguous :class:`DeviceArray` over the whole buffer (no copy).

        ``shape=None`` means 1-D; the shape must cover exactly ``nbytes`` bytes.
        """
        return DeviceArray(self, shape, dtype)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The buffer as a 1-D uint8 array (CUDA Array Interface v3)."""
        return self.view().__cuda_array_interface__

    def __dlpack__(self, **kwargs: Any) -> Any:
        """The buffer as a 1-D uint8 DLPack tensor (see ``DeviceArray.__dlpack__``)."""
        return self.view().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, ordinal)``; ``(kDLCUDAManaged, ordinal)`` for managed memory."""
        return (self.kind.dlpack_device, self.context.device.ordinal)


def _keep(owner: Any) -> None:
    """Finalizer target that only holds *owner* until the wrapper dies."""


def device_array(shape: Any, dtype: Any = np.float64, context: Any = None) -> DeviceArray:
    """An uninitialised :class:`DeviceArray` (``DeviceBuffer(nbytes, context).view``)."""
    dt = plain_dtype(dtype, "device_array")
    shp, nbytes = shape_nbytes(shape, dt, "device_array")
    return DeviceBuffer(nbytes, context).view(shp, dt)


def to_device(arr: Any, context: Any = None, stream: Any = None) -> DeviceArray:
    """Copy a host array to a new :class:`DeviceArray` of the same shape and dtype."""
    a = np.ascontiguousarray(arr) if stream is None else host_array(arr, "to_device")
    out = device_array(a.shape, a.dtype, context)
    out.copy_from_host(a, stream)
    return out


def _pool_attr(name: str) -> Any:
    return getattr(drv.CUmemPool_attribute, f"CU_MEMPOOL_ATTR_{name}")


class MemoryPool:
    """A device memory pool for stream-ordered allocations.

    Parameters
    ----------
    device : Context, Device, int or None
        The device (its registry context is used for driver calls); ``None``: the
        calling thread's current context.
    release_threshold : int, optional
        Bytes of unused memory the pool keeps reserved across synchronizations (default
        0: everything unused is released at the next synchronization). ``None`` keeps
        the driver's value.
    max_size : int, optional
        Upper bound of the pool's reserved memory (0: no bound; new pools only).

    Notes
    -----
    ``MemoryPool(0)`` creates a new, private pool; ``MemoryPool.default(0)`` is the
    device's default pool, shared with every ``cuMemAllocAsync`` user of the process.
    Freed stream-ordered buffers keep their block in ctxkit's cache of their stream for
    the next allocation of that size there (no driver call): those blocks count in
    :attr:`used_bytes` and :attr:`cached_bytes` until :meth:`trim` (or
    ``CTXKIT_ALLOC_CACHE=0``, which disables the cache) gives them back.
    """

    __slots__ = ("__weakref__", "_fin", "context", "handle", "owned")

    _fin: weakref.finalize | None

    def __init__(
        self,
        device: ContextLike | None = 0,
        *,
        release_threshold: int | None = 0,
        max_size: int = 0,
    ) -> None:
        ctx = resolve_context(device, "MemoryPool()")
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = ctx.device.ordinal
        if max_size:
            props.maxSize = nbytes_arg(max_size, "MemoryPool", "max_size")
        with ctx:
            err, handle = drv.cuMemPoolCreate(props)
        if err:
            raise ctx.note_error(err, f"cuMemPoolCreate(device {ctx.device.ordinal})")
        self._setup(ctx, handle, finalizer(self, ctx, drv.cuMemPoolDestroy, handle))
        if release_threshold is not None:
            self.release_threshold = release_threshold

    def _setup(self, ctx: Context, handle: Any, fin: weakref.finalize | None = None) -> MemoryPool:
        """The pool's state: owned (destroyed by *fin*) or borrowed (*fin* ``None``)."""
        self.context = ctx
        self.handle = handle
        self.owned = fin is not None
        self._fin = fin
        return self

    @classmethod
    def default(cls, device: ContextLike | None = 0) -> MemoryPool:
        """The device's default pool (``cuDeviceGetDefaultMemPool``); never destroyed."""
        ctx = resolve_context(device, "MemoryPool.default()")
        with ctx:
            err, handle = drv.cuDeviceGetDefaultMemPool(ctx.device.handle)
        if err:
            raise ctx.note_error(err, f"cuDeviceGetDefaultMemPool(device {ctx.device.ordinal})")
        return cls.__new__(cls)._setup(ctx, handle)

    @classmethod
    def from_handle(cls, handle: Any, device: ContextLike | None = None) -> MemoryPool:
        """Wrap a pool made elsewhere (a ``CUmemoryPool`` or its int value); not owned."""
        ctx = resolve_context(device, "MemoryPool.from_handle()")
        value = handle if isinstance(handle, drv.CUmemoryPool) else drv.CUmemoryPool(int(handle))
        return cls.__new__(cls)._setup(ctx, value)

    # --- attributes ------------------------------------------------------------------

    def _get(self, name: str) -> int:
        self._check_open()
        err, value = drv.cuMemPoolGetAttribute(self.handle, _pool_attr(name))
        if err:
            raise self.context.note_error(err, f"cuMemPoolGetAttribute({name})")
        return int(value)

    def _set(self, name: str, value: int) -> None:
        self._check_open()
        (err,) = drv.cuMemPoolSetAttribute(self.handle, _pool_attr(name), drv.cuuint64_t(value))
        if err:
            raise self.context.note_error(err, f"cuMemPoolSetAttribute({name}, {value})")

    @property
    def release_threshold(self) -> int:
        """Unused bytes the pool keeps reserved across synchronizations."""
        return self._get("RELEASE_THRESHOLD")

    @release_threshold.setter
    def release_threshold(self, nbytes: int) -> None:
        self._set("RELEASE_THRESHOLD", nbytes_arg(nbytes, "MemoryPool", "release_threshold"))

    @property
    def reserved_bytes(self) -> int:
        """Device memory the pool holds now (in use or cached)."""
        return self._get("RESERVED_MEM_CURRENT")

    @property
    def used_bytes(self) -> int:
        """Memory handed out to allocations that are not freed yet (the driver's count:
        blocks in ctxkit's cache, :attr:`cached_bytes`, are included)."""
        return self._get("USED_MEM_CURRENT")

    @property
    def cached_bytes(self) -> int:
        """Bytes of freed buffers ctxkit's block cache holds for reuse from this pool."""
        self._check_open()
        dev = self.context.device
        total = alloc.cached_bytes(dev.ordinal, int(self.handle))
        with self.context:
            err, default = drv.cuDeviceGetDefaultMemPool(dev.handle)
        if not err and int(default) == int(self.handle):
            total += alloc.cached_bytes(dev.ordinal, 0)
        return total

    @property
    def reserved_high(self) -> int:
        """High-water mark of :attr:`reserved_bytes`."""
        return self._get("RESERVED_MEM_HIGH")

    @property
    def used_high(self) -> int:
        """High-water mark of :attr:`used_bytes`."""
        return self._get("USED_MEM_HIGH")

    @property
    def device(self) -> Device:
        """The device whose memory the pool holds."""
        return self.context.device

    # --- operations ------------------------------------------------------------------

    def trim(self, keep: int = 0) -> None:
        """Release unused memory, keeping at least *keep* bytes reserved (``cuMemPoolTrimTo``).

        The blocks ctxkit's cache holds on the device are freed first, on their
        streams, and the device's contexts with cached blocks are synchronized so those
        frees complete: afterwards :attr:`used_bytes` and :attr:`reserved_bytes` have
        dropped. Other memory freed in stream order counts as in use until that free
        has completed: synchronize the freeing stream first to release it.
        """
        self._check_open()
        alloc.flush(device=self.context.device.ordinal, sync=True)
        (err,) = drv.cuMemPoolTrimTo(self.handle, nbytes_arg(keep, "MemoryPool.trim", "keep"))
        if err:
            raise self.context.note_error(err, f"cuMemPoolTrimTo({keep})")

    def allocate(self, nbytes: int, stream: Any = None) -> DeviceBuffer:
        """A :class:`~ctxkit.DeviceBuffer` from this pool, ordered on *stream*.

        A pool belongs to its device, not to one context: a stream of another context of
        that device (a green partition, an owned context) allocates from it in the
        stream's context."""
        sc = getattr(stream, "context", None)
        same_device = isinstance(sc, Context) and sc.device.ordinal == self.context.device.ordinal
        ctx = sc if same_device else self.context
        return DeviceBuffer(nbytes, context=ctx, stream=stream, pool=self)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self.handle is None

    def _check_open(self) -> None:
        if self.handle is None:
            raise ContextClosedError("the memory pool was closed")

    def close(self) -> None:
        """Destroy an owned pool (its allocations must be freed first); idempotent.
        A borrowed or default pool is only forgotten. Blocks of an owned pool in
        ctxkit's cache are freed first."""
        fin = self._fin
        if fin is not None:
            if fin.alive:
                alloc.flush(device=self.context.device.ordinal, sync=True)
            fin()
        self.handle = None

    def __repr__(self) -> str:
        if self.handle is None:
            return "<MemoryPool closed>"
        kind = "owned" if self.owned else "borrowed"
        return f"<MemoryPool {int(self.handle):#x} {kind} device={self.device.ordinal}>"
