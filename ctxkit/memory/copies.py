"""Copies: host-to-device, device-to-host, device-to-device and peer.

Copy machinery shared by :mod:`ctxkit.memory`: validation, host/device/peer copies,
foreign (``__cuda_array_interface__``) memory, and peer access.

Peer access between contexts of different devices.

:func:`enable_peer_access` (``cuCtxEnablePeerAccess``), :func:`disable_peer_access`
(``cuCtxDisablePeerAccess``; both idempotent, one direction per call) and
:func:`peer_access_enabled` keep ctxkit's record of enabled pairs, keyed by the Context
objects so a handle reused by a new context is not mistaken for an enabled pair;
:func:`copy_peer` copies between two contexts' memory, directly when access is enabled
and staged by the driver otherwise.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import numpy as np

from .. import _driver, lifetime
from .._driver import drv
from ..binding import bind, guard
from ..context import Context, require_current
from ..device import Device
from ..errors import CudaError
from ..stream import Stream, call_stream, context_of_cu, stream_handle
from .host import check_async_host, host_address, host_array, pointer_attribute
from .interop import producer_stream
from .sizes import nbytes_arg

__all__ = [
    "Copyable",
    "Mem",
    "copy_peer",
    "device_mem",
    "disable_peer_access",
    "enable_peer_access",
    "enqueue",
    "peer_access_enabled",
]


class Mem(NamedTuple):
    """Device memory taking part in a copy."""

    ptr: int
    nbytes: int
    context: Context | None
    stream: int | None
    dtype: np.dtype[Any] | None
    shape: tuple[int, ...] | None


def device_mem(obj: Any, what: str, *, write: bool = False) -> Mem:
    """The device memory of a ctxkit buffer/array or a ``__cuda_array_interface__`` object.

    A foreign array's pending writes are on the interface's ``stream`` or, without one,
    on its producer's current stream (PyTorch, CuPy: :func:`producer_stream`).
    """
    if (own := getattr(obj, "_ctxkit_mem", None)) is not None:
        return own()  # type: ignore[no-any-return]
    cai = getattr(obj, "__cuda_array_interface__", None)
    if not isinstance(cai, dict):
        raise TypeError(
            f"{what}: expected a ctxkit DeviceBuffer/DeviceArray or an object with "
            f"__cuda_array_interface__ (CuPy, PyTorch, Numba), got {type(obj).__name__}"
        )
    shape = tuple(int(s) for s in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    ptr, readonly = cai["data"]
    strides = cai.get("strides")
    if strides is not None and not is_c_contiguous(shape, tuple(strides), dtype.itemsize):
        raise ValueError(
            f"{what}: the device array is not C-contiguous (strides {tuple(strides)}); "
            "make it contiguous first (e.g. .copy() / .contiguous())"
        )
    if write and readonly:
        raise ValueError(f"{what}: the destination device array is read-only")
    stream = cai.get("stream")
    if stream is None:
        producer = producer_stream(obj)
        stream = None if producer is None else producer or 1
    return Mem(int(ptr or 0), math.prod(shape) * dtype.itemsize, None, stream, dtype, shape)


def is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """True when every dimension of *shape* other than 1 has its C stride (the last
    dimensions of *shape* and *strides* paired); always for an empty array."""
    if 0 in shape:
        return True
    want = reversed(c_strides(shape, itemsize))
    return all(d == 1 or s == w for d, s, w in zip(reversed(shape), reversed(strides), want))


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """C-contiguous strides in bytes of *shape* with *itemsize*-byte items."""
    return tuple(itemsize * math.prod(shape[i + 1 :]) for i in range(len(shape)))


def context_of_pointer(ptr: int, what: str) -> Context:
    """The context owning foreign device memory (its device's primary one for pool/VMM
    allocations, which report no context)."""
    err, cu = pointer_attribute("CONTEXT", ptr)
    if not err and cu is not None and int(cu):
        return context_of_cu(cu)
    err, ordinal = _driver.pointer_device_ordinal(ptr)
    if err:
        raise ValueError(
            f"{what}: {ptr:#x} is not device memory known to CUDA "
            f"({_driver.from_result(int(err), 'cuPointerGetAttribute').name})"
        )
    return Context.primary(int(ordinal))


def cai_stream(stream: Any) -> int | None:
    """*stream* as a CUDA Array Interface v3 ``"stream"`` value: ``None`` for none (or a
    closed stream), 1 for the legacy default stream (0 is disallowed)."""
    if stream is None or (isinstance(stream, Stream) and stream.closed):
        return None
    return int(stream_handle(stream)) or 1


def enqueue(
    ctx: Context, call: tuple[Any, Any, bool], what: str, fn: str, *args: Any, finish: bool = True
) -> None:
    """The one way a copy or memset of memory in *ctx* runs, on the stream *call* that
    :func:`~ctxkit.stream.call_stream` resolved for it: ``fn(*args)`` on the legacy
    default stream, else ``fnAsync(*args, stream)``. The last of *args* is the byte count;
    a driver error is raised with it.

    ``stream=None`` operations complete before they return: on the thread's current
    stream the stream is waited for; on the legacy default stream it
    is too with *finish*, as the driver runs device-side work (memset, device-to-device
    and peer copies, the DMA of a copy from pageable memory) asynchronously to the host
    there, unordered with non-blocking streams (``ctxkit.Stream()``'s default): without
    the wait, work enqueued next on such a stream could overtake it.
    """
    stream, sh, wait = call
    with guard(ctx, what):
        if stream is None:
            (err,) = getattr(drv, fn)(*args)
        else:
            (err,) = getattr(drv, fn + "Async")(*args, sh)
            finish = wait
        if err:
            raise ctx.note_error(err, f"{what}: {fn} ({args[-1]} bytes)")
        if finish:
            (err,) = drv.cuStreamSynchronize(sh)
            if err:
                which = "default" if stream is None else "current"
                raise ctx.note_error(err, f"{what}: cuStreamSynchronize({which} stream)")


def copy_device(dst: Mem, src: Mem, n: int, stream: Any, what: str) -> bool:
    """Device-to-device copy of *n* bytes; peer copy across contexts. Returns the
    :func:`copy_peer` flag (False for same-context copies)."""
    if n == 0:
        return False
    dctx, sctx = resolve_contexts(dst, src, stream, what)
    call = call_stream(stream, dctx, what)
    ours = cai_stream(call[0]) or 1  # None: the legacy default stream
    for m, c in ((src, sctx), (dst, dctx)):
        if m.stream is not None and int(m.stream) != ours:
            # CUDA Array Interface v3: the consumer synchronizes the producer's stream
            with guard(c, what):
                (err,) = drv.cuStreamSynchronize(drv.CUstream(int(m.stream)))
            if err:
                raise c.note_error(err, f"cuStreamSynchronize({int(m.stream):#x}) for {what}")
    if dctx != sctx:
        return memcpy_peer(dst.ptr, dctx, src.ptr, sctx, n, stream, what)
    enqueue(dctx, call, what, "cuMemcpyDtoD", dst.ptr, src.ptr, n)
    return False


def check_match(got: Any, want: Mem, what: str, name: str) -> None:
    """The other end *got* of a copy (a host array or a device :class:`Mem`) fits the
    device memory *want*: the same dtype and shape where both are typed, else the same
    number of bytes."""
    if want.dtype is None or got.dtype is None:
        if got.nbytes != want.nbytes:
            raise ValueError(
                f"{what}: the {name} has {got.nbytes} bytes but the device memory has "
                f"{want.nbytes}; sizes must match (copy into a slice buf[off:off+n] for a "
                "partial copy)"
            )
        return
    for attr in ("dtype", "shape"):
        if getattr(got, attr) != getattr(want, attr):
            raise ValueError(
                f"{what}: the {name} has {attr} {getattr(got, attr)}, the array "
                f"{getattr(want, attr)}"
            )


def _host_copy(mem: Mem, host: np.ndarray, kind: str, stream: Any, what: str) -> None:
    """``cuMemcpy<kind>`` between the device memory *mem* and the host array *host*: an
    explicit *stream* with a pageable host array is refused or warned about
    (:func:`~ctxkit.memory.host.check_async_host`); sync DtoH needs no finish."""
    if host.nbytes == 0:
        return
    addr = host_address(host)
    if stream is not None:
        check_async_host(host, what, addr)
    ends = (mem.ptr, addr) if kind == "HtoD" else (addr, mem.ptr)
    ctx: Context = mem.context  # type: ignore[assignment]
    call = call_stream(stream, ctx, what)
    enqueue(ctx, call, what, f"cuMemcpy{kind}", *ends, host.nbytes, finish=kind == "HtoD")


class Copyable:
    """The copies and the memset of every kind of ctxkit device memory (buffers, typed
    arrays, virtual buffers), run on the :class:`Mem` that its ``_ctxkit_mem`` gives.

    Sizes, dtypes and contiguity are checked before the driver is called (``ValueError``
    on a mismatch): a typed array takes arrays of its shape and dtype, a buffer any
    C-contiguous memory of exactly ``nbytes`` bytes (copy into a slice ``buf[a:b]`` for
    a partial copy). Without *stream* the copy has completed when the call returns; with
    *stream* it is enqueued there and the call returns at once (see
    :mod:`ctxkit.memory` on pageable host memory and stream order).
    """

    __slots__ = ()

    context: Context

    __reduce__ = lifetime.process_local(
        "send its copy_to_host(), or pass it to ck.procs, which maps it there by CUDA IPC"
    )

    @property
    def device(self) -> Device:
        """The device the memory is on (its context's: where copies run)."""
        return self.context.device

    def _ctxkit_mem(self) -> Mem:
        raise NotImplementedError

    def _written(self, stream: Any) -> None:
        """A write into the memory was enqueued on *stream* (a typed array notes it)."""

    def copy_from_host(self, arr: Any, stream: Any = None) -> None:
        """Copy a host array (C-contiguous; of the array's shape and dtype, or exactly
        ``nbytes`` bytes for a buffer) into the device memory.

        With *stream* the copy is enqueued there and the call returns at once, provided
        the host memory is pinned (see the module notes on pageable memory); keep *arr*
        alive and unchanged until the stream has reached the copy.
        """
        what = f"{type(self).__name__}.copy_from_host"
        dst = self._ctxkit_mem()
        a = host_array(arr, what)
        check_match(a, dst, what, "host array")
        _host_copy(dst, a, "HtoD", stream, what)
        self._written(stream)

    def copy_to_host(self, arr: Any = None, stream: Any = None) -> np.ndarray:
        """Copy the device memory into *arr* (same shape and dtype, or as many bytes; a
        new array when ``None``: of the array's shape and dtype, or ``nbytes`` uint8)
        and return it."""
        what = f"{type(self).__name__}.copy_to_host"
        src = self._ctxkit_mem()
        out: np.ndarray
        if arr is None:
            shape = src.nbytes if src.shape is None else src.shape
            out = np.empty(shape, np.uint8 if src.dtype is None else src.dtype)
        else:
            out = host_array(arr, what, writable=True)
            check_match(out, src, what, "host array")
        _host_copy(src, out, "DtoH", stream, what)
        return out if arr is None or isinstance(arr, np.ndarray) else arr

    def copy_from(self, src: Any, stream: Any = None) -> None:
        """Device-to-device copy from a buffer, array, or any ``__cuda_array_interface__``
        object (ctxkit, CuPy, PyTorch, ...) that fits (same shape and dtype for a typed
        array, else the same size); other contexts/devices go through :func:`copy_peer`."""
        what = f"{type(self).__name__}.copy_from"
        dst = self._ctxkit_mem()
        s = device_mem(src, what)
        check_match(s, dst, what, "source")
        copy_device(dst, s, dst.nbytes, stream, what)
        self._written(stream)

    def copy_to(self, dst: Any, stream: Any = None) -> None:
        """Device-to-device copy into a buffer, array or ``__cuda_array_interface__``
        object that fits (e.g. a CuPy array or a PyTorch tensor; same shape and dtype for
        a typed array, else the same size), in any context or device."""
        what = f"{type(self).__name__}.copy_to"
        src = self._ctxkit_mem()
        d = device_mem(dst, what, write=True)
        check_match(d, src, what, "destination")
        copy_device(d, src, src.nbytes, stream, what)

    def memset(self, value: int, stream: Any = None) -> None:
        """Set every byte to *value* (0..255) (``cuMemsetD8``).

        Without *stream* the bytes are set when the call returns; with *stream* the
        memset is enqueued there.
        """
        what = f"{type(self).__name__}.memset"
        m = self._ctxkit_mem()
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{what}: value must be an int byte, got {type(value).__name__}")
        if not 0 <= value <= 255:
            raise ValueError(f"{what}: value must be in 0..255, got {value}")
        if m.nbytes:
            ctx: Context = m.context  # type: ignore[assignment]
            call = call_stream(stream, ctx, what)
            enqueue(ctx, call, what, "cuMemsetD8", m.ptr, int(value), m.nbytes)
        self._written(stream)


def resolve_contexts(dst: Mem, src: Mem, stream: Any, what: str) -> tuple[Context, Context]:
    """The contexts of both sides; foreign memory is looked up by pointer."""
    if dst.context is not None and src.context is not None:
        return dst.context, src.context
    anchor = dst.context or src.context
    if anchor is None:
        anchor = stream.context if isinstance(stream, Stream) else require_current(what)
    with guard(anchor, what):
        dctx = dst.context or context_of_pointer(dst.ptr, what)
        sctx = src.context or context_of_pointer(src.ptr, what)
    return dctx, sctx


_peer_pairs: dict[tuple[int, int], tuple[weakref.ref[Context], weakref.ref[Context]]] = {}


def _enabled(a: Context, b: Context) -> bool:
    refs = _peer_pairs.get((a.handle, b.handle))
    return refs is not None and refs[0]() is a and refs[1]() is b and not (a.closed or b.closed)


def memcpy_peer(
    dptr: int, dctx: Context, sptr: int, sctx: Context, n: int, stream: Any, what: str
) -> bool:
    """``cuMemcpyPeer`` of *n* bytes as :func:`enqueue` runs it, on a stream of either
    context (bound for the call); returns whether peer access makes it direct."""
    bind = stream.context if isinstance(stream, Stream) else dctx
    call = call_stream(stream, bind, what)
    enqueue(bind, call, what, "cuMemcpyPeer", dptr, dctx.cu, sptr, sctx.cu, n)
    return _direct(dctx, sctx)


def _direct(a: Context, b: Context) -> bool:
    return _enabled(a, b) or _enabled(b, a)


_PEER_ACCESS_UNSUPPORTED = 217

_PEER_ACCESS_ALREADY_ENABLED = 704

_PEER_ACCESS_NOT_ENABLED = 705


def _peer_ctx(x: Any) -> Context:
    ctx = x if isinstance(x, Context) else bind(x)
    ctx.check_usable()
    return ctx


def enable_peer_access(a: Any, b: Any) -> None:
    """Let context *a* access memory of context *b* (``cuCtxEnablePeerAccess``).

    *a* and *b* are Contexts, Devices or ordinals (the registry's contexts). One
    direction per call: call ``enable_peer_access(b, a)`` too for the other. Idempotent:
    a second call is not an error, and being the Driver API it leaves no pending error
    behind (the runtime's ``cudaGetLastError`` is not touched). Contexts on the same
    device need nothing.

    Raises
    ------
    CudaError
        ``CUDA_ERROR_PEER_ACCESS_UNSUPPORTED``: the devices cannot access each other
        (``Device.can_access_peer`` is False); copies still work, staged by the driver.
    """
    ca, cb = _peer_ctx(a), _peer_ctx(b)
    if ca.device.ordinal == cb.device.ordinal:
        return
    if not ca.device.can_access_peer(cb.device):
        raise CudaError(
            f"enable_peer_access: device {ca.device.ordinal} cannot access device "
            f"{cb.device.ordinal} directly (cuDeviceCanAccessPeer is 0: no NVLink/PCIe P2P "
            "path, or IOMMU/virtualization blocks it). copy_peer still works through the "
            "driver's staged path",
            _PEER_ACCESS_UNSUPPORTED,
            "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        )
    with ca:
        (err,) = drv.cuCtxEnablePeerAccess(cb.cu, 0)
    if err and int(err) != _PEER_ACCESS_ALREADY_ENABLED:
        raise ca.note_error(err, f"cuCtxEnablePeerAccess({ca!r} -> {cb!r})")
    _peer_pairs[(ca.handle, cb.handle)] = (weakref.ref(ca), weakref.ref(cb))


def disable_peer_access(a: Any, b: Any) -> None:
    """Stop context *a* from accessing memory of context *b* (``cuCtxDisablePeerAccess``).

    The reverse of :func:`enable_peer_access`, one direction per call; idempotent (access
    that is not enabled, contexts on the same device and devices without a peer path need
    nothing). Afterwards :func:`peer_access_enabled` is False and :func:`copy_peer` takes
    the staged path. Finish kernels and copies of *a* that use *b*'s memory first: their
    accesses fault once the mapping is gone.
    """
    ca, cb = _peer_ctx(a), _peer_ctx(b)
    if ca.device.ordinal == cb.device.ordinal:
        return
    if ca.device.can_access_peer(cb.device):
        with ca:
            (err,) = drv.cuCtxDisablePeerAccess(cb.cu)
        if err and int(err) != _PEER_ACCESS_NOT_ENABLED:
            raise ca.note_error(err, f"cuCtxDisablePeerAccess({ca!r} -> {cb!r})")
    _peer_pairs.pop((ca.handle, cb.handle), None)


def peer_access_enabled(a: Any, b: Any) -> bool:
    """True when :func:`enable_peer_access` (a, b) has succeeded in this process and
    :func:`disable_peer_access` (a, b) has not been called since."""
    return _enabled(_peer_ctx(a), _peer_ctx(b))


def copy_peer(dst: Any, src: Any, nbytes: int | None = None, stream: Any = None) -> bool:
    """Copy *nbytes* (default: all of *src*) between memory of two contexts/devices.

    Uses ``cuMemcpyPeer`` (``cuMemcpyPeerAsync`` on *stream*): the driver copies
    directly over NVLink/PCIe when peer access is enabled between the two contexts and
    stages through host memory otherwise. Without *stream* the copy has completed when
    the call returns; with *stream* it is enqueued there, and neither side may be freed
    before that stream is synchronized.

    Returns
    -------
    bool
        True when peer access was enabled between the two contexts (either direction,
        by :func:`enable_peer_access`) so the direct path ran; False for the staged path.
    """
    what = "copy_peer"
    d = device_mem(dst, what, write=True)
    s = device_mem(src, what)
    n = s.nbytes if nbytes is None else nbytes_arg(nbytes, what)
    if n > s.nbytes or n > d.nbytes:
        raise ValueError(
            f"{what}: {n} bytes do not fit (source {s.nbytes} bytes, destination {d.nbytes})"
        )
    dctx, sctx = resolve_contexts(d, s, stream, what)
    if n == 0:
        return _direct(dctx, sctx)
    return memcpy_peer(d.ptr, dctx, s.ptr, sctx, n, stream, what)
