"""Device memory: :class:`DeviceBuffer` (linear memory in one context, ``cuMemAlloc`` or
stream-ordered) with its copies and its CUDA Array Interface / DLPack exports (as bytes),
and :func:`device_array` / :func:`to_device`, which make typed arrays. :class:`DeviceArray`,
the typed view, lives in :mod:`ctxkit.memory.devicearray` and is re-exported here (the
family's overview is in :mod:`ctxkit.memory`)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from .._driver import drv
from ..binding import guard, resolve_context
from ..context import Context, thread_state
from ..device import Device
from ..errors import (
    ContextClosedError,
    CudaError,
    OutOfMemoryError,
)
from ..lifetime import finalizer
from ..stream import Stream, implicit_stream
from . import blockcache
from .blockcache import Block
from .copies import (
    Mem,
    check_same_size,
    copy_device,
    device_mem,
    dtoh,
    finish_default_stream,
    gib,
    htod,
    implicit,
    nbytes_arg,
    stream_for,
    wait_for,
)
from .devicearray import BufferBase, DeviceArray, cai_stream
from .dlpack import KDL_CUDA
from .host import (
    host_array,
)
from .hostptr import plain_dtype
from .sizes import shape_nbytes

__all__ = ["DeviceArray", "DeviceBuffer", "cai_stream", "device_array", "to_device"]


_OUT_OF_MEMORY = 2


class DeviceBuffer(BufferBase):
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
        disables the cache (:mod:`ctxkit.memory.blockcache`).
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

    #: False for subclasses whose memory cannot come from a stream-ordered pool.
    _pooled_ok = True
    #: DLPack device type of the memory (kDLCUDA; managed memory overrides it).
    _dlpack_device_type = KDL_CUDA

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
        if pool is None and type(nbytes) is int and nbytes > 0 and self._pooled_ok:
            s = stream
            if s is None and context is None:
                top = thread_state().top
                if top is not None:
                    s = implicit_stream(top)
            if type(s) is Stream and (context is None or context is s.context):
                blk = blockcache.take(s, nbytes)
                if blk is not None:
                    self.context = s.context
                    self.nbytes = nbytes
                    self._base = None
                    self._stream = s
                    self._ptr = blk.ptr
                    self._fin = blk
                    return
        self._init(nbytes, context, stream, pool)

    def _init(self, nbytes: int, context: Any, stream: Any, pool: Any) -> None:
        what = f"{type(self).__name__}({nbytes})"
        n = nbytes_arg(nbytes, what)
        if context is None and isinstance(stream, Stream):
            context = stream.context
        ctx = resolve_context(context, what)
        self.context = ctx
        self.nbytes = n
        self._base = None
        self._fin = None
        self._stream = None
        self._ptr = 0
        if (stream is not None or pool is not None) and not self._pooled_ok:
            raise TypeError(f"{what}: {type(self).__name__} cannot be stream-ordered")
        if stream is None and self._pooled_ok:
            stream = implicit_stream(ctx)
        if n == 0:
            return
        if stream is None and pool is None:
            with ctx:
                err, ptr = self._alloc(n)
            if err:
                raise _alloc_error(ctx, err, n, what)
            self._ptr = int(ptr)
            self._fin = finalizer(self, ctx, drv.cuMemFree, ptr)
            return
        self._alloc_ordered(ctx, n, stream, pool, what)

    def _alloc_ordered(self, ctx: Context, n: int, stream: Any, pool: Any, what: str) -> None:
        s = stream if isinstance(stream, Stream) else Stream.from_handle(stream or 0, ctx)
        sh = stream_for(s, ctx, what)
        ph = None if pool is None else pool.handle
        blk = blockcache.take_from(s, n, ph)
        if blk is None:
            with ctx:
                err, blk = blockcache.allocate(ctx, n, s, sh, ph)
            if err or blk is None:
                raise _alloc_error(ctx, err, n, f"{what} (stream-ordered)")
        self._ptr = blk.ptr
        self._stream = s
        # The block holds the stream while the buffer lives, so the free (or the return to
        # the stream's cache) is ordered after every use enqueued on it.
        self._fin = blk

    @staticmethod
    def _alloc(n: int) -> tuple[Any, Any]:
        return drv.cuMemAlloc(n)  # type: ignore[no-any-return]

    @classmethod
    def from_pointer(
        cls, ptr: int, nbytes: int, context: Any = None, owner: Any = None
    ) -> DeviceBuffer:
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
        p = self._ptr
        if p is None or (self._base is not None and self._base._ptr is None):
            raise self._closed_error("ptr")
        return p

    @property
    def closed(self) -> bool:
        """True after :meth:`close` (of this buffer or, for a view, of its parent)."""
        return self._ptr is None or (self._base is not None and self._base._ptr is None)

    @property
    def device(self) -> Device:
        """The device the memory is on."""
        return self.context.device

    def _closed_error(self, what: str) -> ContextClosedError:
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
        (:mod:`ctxkit.memory.blockcache`). Closing a slice view only invalidates the view.
        """
        fin = self._fin
        if self._base is None and fin is not None:
            if isinstance(fin, Block):
                self._fin = None
                s = None
                if stream is not None:
                    s = (
                        stream
                        if isinstance(stream, Stream)
                        else Stream.from_handle(stream, self.context)
                    )
                blockcache.give_back(fin, s)
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

    # --- copies ----------------------------------------------------------------------

    def copy_from_host(self, arr: Any, stream: Any = None) -> None:
        """Copy a host array (C-contiguous, exactly ``nbytes`` bytes) into the buffer.

        With *stream* the copy is enqueued there and the call returns at once, provided
        the host memory is pinned (see the module notes on pageable memory); keep *arr*
        alive and unchanged until the stream has reached the copy.
        """
        what = f"{type(self).__name__}.copy_from_host"
        dst = self.ptr
        a = host_array(arr, what)
        check_same_size(a.nbytes, self.nbytes, what, "host array")
        htod(self.context, dst, a, stream, what)

    def copy_to_host(self, arr: Any = None, stream: Any = None) -> np.ndarray:
        """Copy the buffer into *arr* (a new uint8 array when ``None``) and return it."""
        what = f"{type(self).__name__}.copy_to_host"
        src = self.ptr
        if arr is None:
            out = np.empty(self.nbytes, np.uint8)
        else:
            out = host_array(arr, what, writable=True)
            check_same_size(out.nbytes, self.nbytes, what, "host array")
        dtoh(self.context, out, src, stream, what)
        return out if arr is None or isinstance(arr, np.ndarray) else arr

    def copy_from(self, src: Any, stream: Any = None) -> None:
        """Device-to-device copy from a buffer, array, or any ``__cuda_array_interface__``
        object of the same size; other contexts/devices go through :func:`copy_peer`."""
        what = f"{type(self).__name__}.copy_from"
        dst = self._ctxkit_mem()
        s = device_mem(src, what)
        check_same_size(s.nbytes, self.nbytes, what, "source")
        copy_device(dst, s, self.nbytes, stream, what)

    def copy_to(self, dst: Any, stream: Any = None) -> None:
        """Device-to-device copy into a buffer, array or ``__cuda_array_interface__``
        object of the same size (e.g. a CuPy array or a PyTorch tensor)."""
        what = f"{type(self).__name__}.copy_to"
        src = self._ctxkit_mem()
        d = device_mem(dst, what, write=True)
        check_same_size(d.nbytes, self.nbytes, what, "destination")
        copy_device(d, src, self.nbytes, stream, what)

    def memset(self, value: int, stream: Any = None) -> None:
        """Set every byte to *value* (0..255) (``cuMemsetD8``).

        Without *stream* the bytes are set when the call returns; with *stream* the
        memset is enqueued there.
        """
        what = f"{type(self).__name__}.memset"
        ptr = self.ptr
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{what}: value must be an int byte, got {type(value).__name__}")
        if not 0 <= value <= 255:
            raise ValueError(f"{what}: value must be in 0..255, got {value}")
        if self.nbytes == 0:
            return
        ctx = self.context
        stream, wait = implicit(ctx, stream)
        if stream is None:
            with guard(ctx, what):
                (err,) = drv.cuMemsetD8(ptr, int(value), self.nbytes)
                if not err:
                    finish_default_stream(ctx, what)
        else:
            sh = stream_for(stream, ctx, what)
            with guard(ctx, what):
                (err,) = drv.cuMemsetD8Async(ptr, int(value), self.nbytes, sh)
                if not err and wait:
                    wait_for(ctx, stream, what)
        if err:
            raise ctx.note_error(err, f"{what}: cuMemsetD8 ({self.nbytes} bytes)")

    # --- typed views and interop -----------------------------------------------------

    def view(self, shape: Any = None, dtype: Any = np.uint8) -> DeviceArray:
        """A typed, C-contiguous :class:`DeviceArray` over the whole buffer (no copy).

        ``shape=None`` means 1-D; the shape must cover exactly ``nbytes`` bytes.
        """
        dt = np.dtype(dtype)
        if shape is None:
            if self.nbytes % dt.itemsize:
                raise ValueError(
                    f"view: {self.nbytes} bytes is not a multiple of {dt} ({dt.itemsize} B)"
                )
            shape = (self.nbytes // dt.itemsize,)
        return DeviceArray(self, shape, dt)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The buffer as a 1-D uint8 array (CUDA Array Interface v3)."""
        return self.view().__cuda_array_interface__

    def __dlpack__(self, **kwargs: Any) -> Any:
        """The buffer as a 1-D uint8 DLPack tensor (see ``DeviceArray.__dlpack__``)."""
        return self.view().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, ordinal)``; ``(kDLCUDAManaged, ordinal)`` for managed memory."""
        return (self._dlpack_device_type, self.context.device.ordinal)


def _keep(owner: Any) -> None:
    """Finalizer target that only holds *owner* until the wrapper dies."""


def _alloc_error(ctx: Context, err: Any, n: int, what: str) -> Exception:
    if int(err) != _OUT_OF_MEMORY:
        return ctx.note_error(err, what)
    try:
        free, total = ctx.memory_info()
    except CudaError:
        free, total = -1, -1
    dev = ctx.device.ordinal
    exc = OutOfMemoryError(
        f"{what}: cannot allocate {n} bytes ({gib(n)}) on device {dev}: only {free} bytes "
        f"({gib(free)}) of {total} ({gib(total)}) are free (cuMemGetInfo). Fix: close() "
        "buffers you no longer need, use smaller chunks, or pick a device with more free "
        "memory",
        _OUT_OF_MEMORY,
        "CUDA_ERROR_OUT_OF_MEMORY",
    )
    exc.requested = n  # type: ignore[attr-defined]
    exc.free = free  # type: ignore[attr-defined]
    return exc


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
