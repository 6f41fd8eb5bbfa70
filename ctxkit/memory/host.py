"""Host memory: page-locked allocations, in-place pinning, and the honest-async check.

Re-exported by :mod:`ctxkit.memory`; documented there.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import _driver
from .._driver import drv
from .._env import env_flag
from ..context import Context, current_context, require_current, thread_state
from ..device import Device
from ..errors import (
    CudaError,
    OutOfMemoryError,
    PageableCopyError,
    PageableCopyWarning,
)
from ..lifetime import finalizer
from ..registry import bind, resolve_context

__all__ = [
    "HostMemory",
    "allow_pageable_kernel_args",
    "host_array",
    "host_device_pointer",
    "host_pointer_kind",
    "is_pinned",
    "pageable_kernel_args_allowed",
    "pageable_memory_access",
    "pinned_empty",
    "pinned_zeros",
    "register_host",
    "set_strict_async",
    "strict_async",
]


MEMHOST_PORTABLE = 1  # CU_MEMHOSTALLOC_PORTABLE (= CU_MEMHOSTREGISTER_PORTABLE)


MEMHOST_DEVICEMAP = 2  # CU_MEMHOSTALLOC_DEVICEMAP (= CU_MEMHOSTREGISTER_DEVICEMAP)


MEMHOST_WRITECOMBINED = 4  # CU_MEMHOSTALLOC_WRITECOMBINED


MEMHOST_REGISTER_READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY


_NOT_SUPPORTED = 801


_INVALID_VALUE = 1


_OUT_OF_MEMORY = 2


_INVALID_CONTEXT = 201


_HOST_ALREADY_REGISTERED = 712


_MEMORYTYPE_HOST, _MEMORYTYPE_DEVICE, _MEMORYTYPE_ARRAY, _MEMORYTYPE_UNIFIED = 1, 2, 3, 4


PAGEABLE_NOTE = (
    "the driver blocks the calling thread for the whole copy from/to pageable memory "
    "(measured on an H200: ~7.8 GB/s, host blocked, vs ~55 GB/s asynchronous from pinned "
    "memory)"
)


_strict = env_flag("CTXKIT_STRICT_ASYNC")


def set_strict_async(enabled: bool = True) -> None:
    """Raise :class:`PageableCopyError` instead of warning on async copies from pageable
    memory. The default comes from the ``CTXKIT_STRICT_ASYNC`` environment variable."""
    global _strict
    _strict = bool(enabled)


def strict_async() -> bool:
    """True when strict async mode is on (see :func:`set_strict_async`)."""
    return _strict


def _stacklevel() -> int:
    """``warnings.warn`` stacklevel of the first caller outside ctxkit (for the caller of
    this function)."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name != "ctxkit" and not name.startswith("ctxkit."):
            break
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def pageable_async(what: str) -> None:
    """Warn (once per call site) or raise in strict mode: *what* asked for an async copy
    with pageable host memory."""
    msg = (
        f"{what}: stream= was given but the host array is in pageable memory, so the copy "
        f"is NOT asynchronous: {PAGEABLE_NOTE}. Allocate it with ctxkit.pinned_empty() or "
        "pin it with `with ctxkit.register_host(arr):`"
    )
    if _strict:
        raise PageableCopyError(msg + " (strict async mode: ctxkit.memory.set_strict_async)")
    warnings.warn(msg, PageableCopyWarning, stacklevel=_stacklevel())


def host_pointer_kind(ptr: int) -> str:
    """What the driver knows about a host-side address.

    Returns ``"pinned"`` (page-locked: ``cuMemHostAlloc`` or ``cuMemHostRegister``),
    ``"managed"`` (unified memory), ``"device"`` or ``"pageable"`` (unknown to CUDA).
    """
    if not ptr:
        return "pageable"
    _driver.init()
    err, value = drv.cuPointerGetAttribute(_attr("MEMORY_TYPE"), ptr)
    if err == _INVALID_CONTEXT:
        with bind(0):
            err, value = drv.cuPointerGetAttribute(_attr("MEMORY_TYPE"), ptr)
    if err == _INVALID_VALUE:
        return "pageable"
    _driver.raise_for(err, f"cuPointerGetAttribute(MEMORY_TYPE, {ptr:#x})")
    kind = int(value)
    if kind == _MEMORYTYPE_HOST:
        return "pinned"
    if kind == _MEMORYTYPE_UNIFIED:
        return "managed"
    err, managed = drv.cuPointerGetAttribute(_attr("IS_MANAGED"), ptr)
    return "managed" if not err and managed else "device"


def _attr(name: str) -> Any:
    return getattr(drv.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + name)


def host_array(arr: Any, what: str, *, writable: bool = False) -> np.ndarray:
    """*arr* as a C-contiguous numpy array without copying, or a clear error.

    Accepts numpy arrays and objects with the buffer protocol (bytes, bytearray,
    memoryview, array.array).

    Raises
    ------
    TypeError
        *arr* is not an array or buffer.
    ValueError
        It is not C-contiguous, or not writable when *writable*.
    """
    if not isinstance(arr, np.ndarray):
        try:
            arr = np.frombuffer(arr, dtype=np.uint8) if _is_buffer(arr) else None
        except (TypeError, ValueError):
            arr = None
        if arr is None:
            raise TypeError(
                f"{what}: expected a numpy array or a buffer (bytes, bytearray, memoryview); "
                "convert with np.asarray(...) first"
            )
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{what}: the host array is not C-contiguous (strides {arr.strides}); pass "
            "np.ascontiguousarray(arr)"
        )
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: the destination host array is read-only")
    return arr


def _is_buffer(obj: Any) -> bool:
    try:
        memoryview(obj)
    except TypeError:
        return False
    return True


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def is_pinned(arr: Any) -> bool:
    """True when the array's memory is page-locked (``pinned_empty``/``register_host``
    or another library's pinned allocator); False for ordinary pageable memory.

    Both its first and its last byte are checked: an array that merely shares its first
    page with a neighbour's registration is not pinned.

    Async copies need pinned memory: from pageable memory the driver blocks the host for
    the whole copy. :func:`ctxkit.memory.hostaccess.host_memory_flags` tells how it is
    pinned.
    """
    a = host_array(arr, "is_pinned") if not isinstance(arr, np.ndarray) else arr
    if a.size == 0:
        return False
    first = _address(a)
    last = first + a.nbytes - 1
    return host_pointer_kind(first) == "pinned" and host_pointer_kind(last) == "pinned"


#: ctxkit's live register_host blocks, start address -> (end address, flags passed); read
#: by hostaccess.host_memory_flags
_registered: dict[int, tuple[int, int]] = {}


_registered_lock = threading.Lock()


def check_async_host(arr: np.ndarray, what: str) -> None:
    """Warn/raise when an async copy with *arr* would secretly be synchronous."""
    if arr.nbytes and host_pointer_kind(_address(arr)) == "pageable":
        pageable_async(what)


class HostMemory:
    """Host-addressable memory exposed to numpy (``np.asarray(mem)`` is a uint8 view).

    The numpy arrays built on it keep it (and its *owner*) alive through their ``.base``
    chain; pinned allocations are freed when the last array dies.
    """

    __slots__ = ("__weakref__", "_fin", "context", "nbytes", "owner", "ptr")

    def __init__(self, ptr: int, nbytes: int, owner: Any = None, context: Any = None):
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.owner = owner
        self.context = context
        self._fin: Any = None

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
        }

    def __repr__(self) -> str:
        return f"<HostMemory {self.ptr:#x} nbytes={self.nbytes}>"


def _shape_of(shape: Any) -> tuple[int, ...]:
    shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    out = []
    for s in shp:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"shape entries must be ints, got {shape!r}")
        if s < 0:
            raise ValueError(f"negative dimension in shape {shape!r}")
        out.append(int(s))
    return tuple(out)


def host_context(context: Any, what: str) -> Context:
    """The context for a host allocation: the one given, the current one, or device 0's."""
    if context is not None:
        return resolve_context(context, what)
    ctx = thread_state().top or current_context()
    if ctx is None:
        ctx = bind(0)
    ctx.check_usable()
    return ctx


def pinned_empty(
    shape: Any,
    dtype: Any = np.float64,
    *,
    context: Any = None,
    mapped: bool = False,
    write_combined: bool = False,
    portable: bool = True,
) -> np.ndarray:
    """A numpy array in page-locked host memory (``cuMemHostAlloc``).

    Copies from/to it are truly asynchronous and run at full bus speed. The memory is
    freed (``cuMemFreeHost``, inside the allocating context, from any thread) when the
    array and every view of it are gone.

    Parameters
    ----------
    shape : int or tuple of int
    dtype : numpy dtype
    context : Context, Device or int, optional
        The context to allocate in. Default: the calling thread's current context, or,
        when the thread has none, the registry's context of device 0.
    mapped : bool
        ``CU_MEMHOSTALLOC_DEVICEMAP``: map it into the device address space, so kernels
        read and write it in place (zero-copy); the address is
        :func:`~ctxkit.memory.hostaccess.device_pointer`.
    write_combined : bool
        ``CU_MEMHOSTALLOC_WRITECOMBINED``: not cached by the CPU, so transfers to the
        device can be faster, but CPU *reads* from it are very slow: for buffers the host
        only writes.
    portable : bool
        ``CU_MEMHOSTALLOC_PORTABLE`` (default): pinned for every context, not only the
        allocating one.

    Raises
    ------
    OutOfMemoryError
        The OS refused to page-lock that much memory.

    Notes
    -----
    A zero-size request returns an ordinary empty numpy array.
    """
    dt = np.dtype(dtype)
    shp = _shape_of(shape)
    nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
    flags = _bits(portable=portable, mapped=mapped, write_combined=write_combined)
    if nbytes == 0:
        return np.empty(shp, dt)
    ctx = host_context(context, "pinned_empty")
    with ctx:
        err, ptr = drv.cuMemHostAlloc(nbytes, flags)
    if err:
        raise _host_alloc_error(ctx, err, nbytes, flags)
    mem = HostMemory(ptr, nbytes, context=ctx)
    mem._fin = finalizer(mem, ctx, drv.cuMemFreeHost, ptr)
    return np.asarray(mem).view(dt).reshape(shp)


def _bits(**flags: bool) -> int:
    """``CU_MEMHOST*`` bits of boolean options (refusing non-bools, e.g. a stray int)."""
    bits = {
        "portable": MEMHOST_PORTABLE,
        "mapped": MEMHOST_DEVICEMAP,
        "write_combined": MEMHOST_WRITECOMBINED,
        "read_only": MEMHOST_REGISTER_READ_ONLY,
    }
    out = 0
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {value!r}")
        out |= bits[name] if value else 0
    return out


def _flag_names(flags: int, register: bool = False) -> str:
    names = [
        (MEMHOST_PORTABLE, "PORTABLE"),
        (MEMHOST_DEVICEMAP, "DEVICEMAP"),
        (
            MEMHOST_REGISTER_READ_ONLY if register else MEMHOST_WRITECOMBINED,
            "READ_ONLY" if register else "WRITECOMBINED",
        ),
    ]
    return "|".join(n for bit, n in names if flags & bit) or "0"


def _host_alloc_error(ctx: Context, err: Any, nbytes: int, flags: int) -> Exception:
    if int(err) == _OUT_OF_MEMORY:
        return OutOfMemoryError(
            f"pinned_empty: cannot page-lock {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of host "
            "memory (cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY). Pinned memory is limited by "
            "physical RAM and the locked-memory limit (ulimit -l); use smaller staging "
            "buffers and reuse them",
            _OUT_OF_MEMORY,
            "CUDA_ERROR_OUT_OF_MEMORY",
        )
    return ctx.note_error(err, f"cuMemHostAlloc({nbytes}, {_flag_names(flags)})")


def pinned_zeros(
    shape: Any, dtype: Any = np.float64, *, context: Any = None, **flags: bool
) -> np.ndarray:
    """:func:`pinned_empty` (same options) filled with zeros."""
    arr = pinned_empty(shape, dtype, context=context, **flags)
    arr[...] = 0
    return arr


@contextlib.contextmanager
def register_host(
    arr: Any,
    *,
    context: Any = None,
    mapped: bool = False,
    read_only: bool = False,
    portable: bool = True,
) -> Iterator[np.ndarray]:
    """Page-lock an existing array in place for the ``with`` block (``cuMemHostRegister``).

    Yields the array (as numpy). Async copies from/to it are truly asynchronous inside
    the block; it is unregistered on exit (inside the registering context). Memory that
    is already page-locked (a :func:`pinned_empty` array, an enclosing ``register_host``)
    and memory CUDA already manages (a ``ManagedBuffer.as_numpy()`` view) are yielded
    unchanged (the flags do not apply) and left alone on exit.

    Page rules: the driver locks whole pages. Where it refuses an array that shares a page
    with memory already registered elsewhere, ctxkit raises ``ValueError`` (the CUDA 13.0
    driver accepts such arrays); to be portable, give each array its own pages, e.g.
    register one big array and use slices of it.

    Parameters
    ----------
    arr : numpy array or buffer
        Must be C-contiguous; it must stay alive (it does: the block holds it).
    context : Context, Device or int, optional
        As for :func:`pinned_empty`.
    mapped : bool
        ``CU_MEMHOSTREGISTER_DEVICEMAP``: kernels may access it in place
        (:func:`~ctxkit.memory.hostaccess.device_pointer`).
    read_only : bool
        ``CU_MEMHOSTREGISTER_READ_ONLY``: the device only reads it; needed for memory the
        OS maps read-only (a read-only ``mmap``). Needs a device with
        ``read_only_host_register_supported``.
    portable : bool
        ``CU_MEMHOSTREGISTER_PORTABLE`` (default): pinned for every context.

    Raises
    ------
    CudaError
        ``CUDA_ERROR_NOT_SUPPORTED``: ``read_only=True`` on a device that cannot do it.
    """
    flags = _bits(portable=portable, mapped=mapped, read_only=read_only)
    a = host_array(arr, "register_host")
    ptr, nbytes = _address(a), a.nbytes
    if nbytes == 0 or host_pointer_kind(ptr) != "pageable":
        yield a
        return
    ctx = host_context(context, "register_host")
    if read_only:
        _check_read_only_register(ctx)
    with ctx:
        (err,) = drv.cuMemHostRegister(ptr, nbytes, flags)
    if err == _HOST_ALREADY_REGISTERED:
        raise ValueError(
            f"register_host: the array at {ptr:#x} ({nbytes} bytes) shares a page with host "
            "memory that is already registered; the driver pins whole pages. Register one "
            "enclosing array instead, or allocate with ctxkit.pinned_empty()"
        )
    if err:
        what = f"cuMemHostRegister({ptr:#x}, {nbytes}, {_flag_names(flags, register=True)})"
        if not a.flags.writeable and not read_only:
            what += " of a read-only array (pass read_only=True for read-only pages)"
        raise ctx.note_error(err, what)
    with _registered_lock:
        _registered[ptr] = (ptr + nbytes, flags)
    try:
        yield a
    finally:
        with _registered_lock:
            _registered.pop(ptr, None)
        ctx.free(drv.cuMemHostUnregister, ptr)


def _check_read_only_register(ctx: Context) -> None:
    if not ctx.device.attribute("read_only_host_register_supported"):
        raise CudaError(
            f"register_host(read_only=True): device {ctx.device.ordinal} cannot register "
            "host memory read-only (read_only_host_register_supported is 0); register it "
            "without read_only=True, or copy it into a pinned_empty() array",
            _NOT_SUPPORTED,
            "CUDA_ERROR_NOT_SUPPORTED",
        )


def device_of(target: Any) -> int | str:
    """A device ordinal for a Device/int/Context, or ``"cpu"``."""
    if isinstance(target, str):
        if target.lower() not in ("cpu", "host"):
            raise ValueError(f"target must be a device or 'cpu', got {target!r}")
        return "cpu"
    if isinstance(target, Context):
        return target.device.ordinal
    return Device(target).ordinal


def host_device_pointer(arr: np.ndarray) -> int | None:
    """Device address of a page-locked or managed host array for a kernel argument.

    ``None`` for pageable memory, except where pageable kernel arguments are allowed
    (:func:`allow_pageable_kernel_args`) and the current context's device accesses
    pageable memory directly (:func:`pageable_memory_access`): then the host address.
    """
    ptr = int(arr.__array_interface__["data"][0] or 0)
    if not ptr or drv is None:
        return None
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    try:
        err, dptr = drv.cuPointerGetAttribute(attr, ptr)
    except Exception:
        return None
    if not err:
        return int(dptr)
    if _pageable_kernel_args and int(err) == _INVALID_VALUE:
        ctx = thread_state().top or current_context()
        if ctx is not None and pageable_memory_access(ctx.device):
            return ptr
    return None


# --- pageable host memory as kernel arguments (HMM / ATS) ------------------------------

_pageable_kernel_args = env_flag("CTXKIT_PAGEABLE_KERNEL_ARGS")


_pageable_access: dict[int, bool] = {}


def allow_pageable_kernel_args(enabled: bool = True) -> None:
    """Let kernels take pageable numpy arrays on devices that access pageable memory.

    Process-wide; the default comes from ``CTXKIT_PAGEABLE_KERNEL_ARGS=1``. On such a
    device (HMM or ATS: :func:`pageable_memory_access`) the array's host address is passed
    and the kernel reads and writes the array in place; elsewhere such arrays are refused
    as before (``LaunchArgumentError``). For one argument of one launch, wrap it with
    :func:`~ctxkit.memory.hostaccess.pageable_arg` instead.
    """
    global _pageable_kernel_args
    _pageable_kernel_args = bool(enabled)


def pageable_kernel_args_allowed() -> bool:
    """True when :func:`allow_pageable_kernel_args` is on."""
    return _pageable_kernel_args


def pageable_memory_access(device: Any = None) -> bool:
    """True when *device* (default: the current context's) accesses pageable host memory
    coherently (``CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS``: HMM or ATS)."""
    if device is None:
        dev = require_current("pageable_memory_access").device
    else:
        dev = device.device if isinstance(device, Context) else Device(device)
    known = _pageable_access.get(dev.ordinal)
    if known is None:
        known = _pageable_access[dev.ordinal] = bool(dev.attribute("pageable_memory_access"))
    return known
