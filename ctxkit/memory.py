"""Device, managed and page-locked host memory; copies; peer access.

Every allocation is made inside its context (the one passed in, or the caller's current
one), remembers it in ``.context`` and is freed inside it from whatever thread drops the
last reference, or by ``close()``. Copies check sizes, dtypes and contiguity before the
driver is called and raise ``ValueError`` on a mismatch; zero-size copies do nothing.

Synchronous unless a stream is given
------------------------------------
Without ``stream=`` a copy, memset or peer copy has completed when the call returns,
so the next operation may use the memory from any stream or context. (The driver runs
memsets, device-to-device and peer copies asynchronously to the host on the context's
legacy default stream, which ``ctxkit.Stream()``, non-blocking by default, does not wait
for; ctxkit waits for that stream before returning.) With ``stream=`` the operation is
enqueued on that stream and the call returns at once; order it against other streams
with events (``Stream.wait``), and keep the memory alive until the stream has reached
it: memory freed while a copy into it is still queued in *another* context (a peer copy
on a stream) faults that context.

Honest async
------------
An asynchronous copy (``stream=`` given) from or to *pageable* host memory is not
asynchronous: the driver blocks the calling thread for the whole copy (measured on an
H200: 1 GiB pageable ``cuMemcpyHtoDAsync`` blocked the host for the whole copy at
~7.8 GB/s; from pinned memory it returned at once and ran at ~55 GB/s). ctxkit therefore
emits a :class:`PageableCopyWarning` (once per call site) for such a copy, or raises
:class:`PageableCopyError` in strict mode (:func:`set_strict_async` or the environment
variable ``CTXKIT_STRICT_ASYNC=1``). Use :func:`pinned_empty` or :func:`register_host`;
:func:`is_pinned` tells which memory you have.

Interoperability
----------------
:class:`DeviceArray` (and :class:`DeviceBuffer`, as bytes) export
``__cuda_array_interface__`` v3 and DLPack, so CuPy, PyTorch and Numba use ctxkit memory
without a copy; copies accept their arrays (anything with ``__cuda_array_interface__``)
as sources and targets. ``DeviceArray.stream`` names the stream with pending writes
(set by ctxkit's async copies, or by you after launching a kernel); it is exported as the
interface's ``"stream"`` entry and honoured by ``__dlpack__(stream=...)``.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from . import _driver
from ._array import DeviceArray
from ._copies import (
    Mem,
    check_same_size,
    copy_device,
    copy_peer,
    device_mem,
    dtoh,
    enable_peer_access,
    finish_default_stream,
    gib,
    htod,
    nbytes_arg,
    peer_access_enabled,
    shape_arg,
    stream_for,
)
from ._dlpack import KDL_CUDA
from ._driver import drv
from ._hostmem import (
    HostMemory,
    PageableCopyError,
    PageableCopyWarning,
    device_of,
    host_array,
    is_pinned,
    pinned_empty,
    pinned_zeros,
    register_host,
    set_strict_async,
    strict_async,
)
from .context import Context, finalizer
from .device import Device
from .errors import ContextClosedError, CudaError, OutOfMemoryError
from .registry import guard
from .stream import Stream, context_for

__all__ = [
    "DeviceArray",
    "DeviceBuffer",
    "ManagedBuffer",
    "PageableCopyError",
    "PageableCopyWarning",
    "copy_peer",
    "device_array",
    "enable_peer_access",
    "is_pinned",
    "peer_access_enabled",
    "pinned_empty",
    "pinned_zeros",
    "register_host",
    "set_strict_async",
    "strict_async",
    "to_device",
]

_OUT_OF_MEMORY = 2
MEM_ATTACH_GLOBAL = 1


# --- device buffers --------------------------------------------------------------------


class DeviceBuffer:
    """Linear device memory (``cuMemAlloc``) in one context.

    Parameters
    ----------
    nbytes : int
        Size in bytes (0 allocates nothing).
    context : Context, Device, int or None
        Where to allocate. ``None``: the calling thread's current context
        (``NoCurrentContextError`` when it has none); a Context is bound for the
        allocation, whatever else is current.

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

    __slots__ = ("__weakref__", "_base", "_fin", "_ptr", "context", "nbytes")

    _ptr: int | None
    _base: DeviceBuffer | None
    _fin: weakref.finalize | None
    context: Context
    nbytes: int

    def __init__(self, nbytes: int, context: Any = None) -> None:
        what = f"{type(self).__name__}({nbytes})"
        n = nbytes_arg(nbytes, what)
        ctx = context_for(context, what)
        self.context = ctx
        self.nbytes = n
        self._base = None
        self._fin = None
        self._ptr = 0
        if n == 0:
            return
        with ctx:
            err, ptr = self._alloc(n)
        if err:
            raise _alloc_error(ctx, err, n, what)
        self._ptr = int(ptr)
        self._fin = finalizer(self, ctx, drv.cuMemFree, ptr)

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
        ctx = context_for(context, "DeviceBuffer.from_pointer")
        buf = cls.__new__(cls)
        buf._setup_view(int(ptr), n, ctx, None)
        buf._fin = weakref.finalize(buf, _keep, owner) if owner is not None else None
        return buf

    def _setup_view(self, ptr: int, n: int, ctx: Context, base: DeviceBuffer | None) -> None:
        self._ptr = ptr
        self.nbytes = n
        self.context = ctx
        self._base = base
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

    def close(self) -> None:
        """Free the memory now (inside its context, from any thread). Idempotent.

        Closing a slice view only invalidates the view.
        """
        if self._base is None and self._fin is not None:
            self._fin()
        self._ptr = None

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
        if stream is None:
            with guard(ctx, what):
                (err,) = drv.cuMemsetD8(ptr, int(value), self.nbytes)
                if not err:
                    finish_default_stream(ctx, what)
        else:
            sh = stream_for(ctx, stream, what)
            with guard(ctx, what):
                (err,) = drv.cuMemsetD8Async(ptr, int(value), self.nbytes, sh)
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
        return (KDL_CUDA, self.context.device.ordinal)


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
    dt = np.dtype(dtype)
    shp = shape_arg(shape)
    return DeviceBuffer(math.prod(shp) * dt.itemsize, context).view(shp, dt)


def to_device(arr: Any, context: Any = None, stream: Any = None) -> DeviceArray:
    """Copy a host array to a new :class:`DeviceArray` of the same shape and dtype."""
    a = np.ascontiguousarray(arr) if stream is None else host_array(arr, "to_device")
    out = device_array(a.shape, a.dtype, context)
    out.copy_from_host(a, stream)
    return out


# --- managed memory ---------------------------------------------------------------------

_concurrent_managed: dict[int, bool] = {}

_ADVICE = {
    "read_mostly": "SET_READ_MOSTLY",
    "preferred_location": "SET_PREFERRED_LOCATION",
    "accessed_by": "SET_ACCESSED_BY",
}


def _advice(advice: Any) -> Any:
    if not isinstance(advice, str):
        return advice
    key = advice.lower().removeprefix("cu_mem_advise_")
    if key in _ADVICE:
        key = _ADVICE[key]
    name = "CU_MEM_ADVISE_" + key.upper()
    try:
        return getattr(drv.CUmem_advise, name)
    except AttributeError:
        valid = sorted([*_ADVICE, *(f"{p}_{k}" for k in _ADVICE for p in ("set", "unset"))])
        raise ValueError(f"unknown memory advice {advice!r}; use one of {valid}") from None


def concurrent_managed_access(device: Device) -> bool:
    """Whether the host may touch managed memory while kernels run on *device*."""
    v = _concurrent_managed.get(device.ordinal)
    if v is None:
        v = bool(device.attribute("concurrent_managed_access"))
        _concurrent_managed[device.ordinal] = v
    return v


class ManagedBuffer(DeviceBuffer):
    """Unified (managed) memory (``cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)``).

    A :class:`DeviceBuffer` (copies, views, interop) that the host can also read and
    write through :meth:`as_numpy`.

    Host-access safety: on a device without ``concurrentManagedAccess`` (Windows,
    some embedded GPUs) the host must not touch managed memory while any kernel runs in
    the context, or the process gets a segmentation fault. :meth:`as_numpy`
    synchronizes the context before returning the view on such devices; launching work
    while you still use the view stays your responsibility there. Devices with
    concurrent access (Linux, Pascal and newer, e.g. H200) need no synchronization, but
    reading data a running kernel writes is still a race: synchronize its stream first.
    """

    __slots__ = ("_views",)

    _views: weakref.WeakSet[HostMemory]

    def __init__(self, nbytes: int, context: Any = None) -> None:
        self._views = weakref.WeakSet()
        super().__init__(nbytes, context)

    @staticmethod
    def _alloc(n: int) -> tuple[Any, Any]:
        return drv.cuMemAllocManaged(n, MEM_ATTACH_GLOBAL)  # type: ignore[no-any-return]

    def _setup_view(self, ptr: int, n: int, ctx: Context, base: DeviceBuffer | None) -> None:
        super()._setup_view(ptr, n, ctx, base)
        self._views = weakref.WeakSet()

    def _root(self) -> ManagedBuffer:
        base = self._base
        return base if isinstance(base, ManagedBuffer) else self

    def as_numpy(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        """A numpy array over the managed memory (no copy); keeps the buffer alive.

        Synchronizes the context first on devices without ``concurrentManagedAccess``.
        """
        ptr = self.ptr
        dt = np.dtype(dtype)
        if shape is None:
            if self.nbytes % dt.itemsize:
                raise ValueError(f"as_numpy: {self.nbytes} bytes is not a multiple of {dt}")
            shape = (self.nbytes // dt.itemsize,)
        shp = shape_arg(shape)
        if math.prod(shp) * dt.itemsize != self.nbytes:
            raise ValueError(f"as_numpy: shape {shp} of {dt} does not cover {self.nbytes} bytes")
        if self.nbytes == 0:
            return np.empty(shp, dt)
        if not concurrent_managed_access(self.context.device):
            self.context.synchronize()
        mem = HostMemory(ptr, self.nbytes, owner=self)
        self._root()._views.add(mem)
        return np.asarray(mem).view(dt).reshape(shp)

    def close(self) -> None:
        """Free the memory now; refused while numpy views from :meth:`as_numpy` live.

        Raises
        ------
        ValueError
            Host views are still alive (freeing would leave them dangling).
        """
        if self._base is None and not self.closed and len(self._views):
            raise ValueError(
                f"cannot close {self!r}: {len(self._views)} numpy view(s) from as_numpy() "
                "are still alive; delete them first (the memory is freed with the last one)"
            )
        super().close()

    def prefetch(self, target: Any = None, stream: Any = None) -> None:
        """Migrate the pages to a device (Device/ordinal/Context; default: its own) or to
        the host (``"cpu"``), enqueued on *stream* (needs ``concurrentManagedAccess``).

        Managed memory is shared by every context, so *stream* may be a ctxkit Stream of
        any context, e.g. the stream of the device that will use the pages next (the
        prefetch is enqueued there, in that stream's context)."""
        what = "ManagedBuffer.prefetch"
        ptr = self.ptr
        tgt = device_of(target) if target is not None else self.context.device.ordinal
        if self.nbytes == 0:
            return
        ctx = stream.context if isinstance(stream, Stream) else self.context
        sh = stream_for(ctx, stream, what)
        with guard(ctx, what):
            _driver.mem_prefetch(ptr, self.nbytes, tgt, sh)

    def advise(self, advice: Any, target: Any = None) -> None:
        """``cuMemAdvise``: *advice* is ``"read_mostly"``, ``"preferred_location"``,
        ``"accessed_by"`` (optionally prefixed ``"set_"``/``"unset_"``) or a
        ``CUmem_advise`` member; *target* a device (default: its own) or ``"cpu"``."""
        what = "ManagedBuffer.advise"
        ptr = self.ptr
        adv = _advice(advice)
        tgt = device_of(target) if target is not None else self.context.device.ordinal
        if self.nbytes == 0:
            return
        with guard(self.context, what):
            _driver.mem_advise(ptr, self.nbytes, adv, tgt)
