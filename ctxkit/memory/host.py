"""Host memory: pinning in place and the honest-async check, with the process-wide
state they share.

:func:`register_host` (``cuMemHostRegister``) and its table of registered blocks; strict
async mode (:func:`set_strict_async`) and the warning for async copies from pageable
memory; :func:`host_device_pointer`, the kernel-argument address of a host array, with
the switch for pageable arrays on HMM/ATS devices (:func:`allow_pageable_kernel_args`).
That state is looked up here by name, so it stays in this module.

Allocations (:func:`pinned_empty`, :class:`HostMemory`) are in
:mod:`ctxkit.memory.hostalloc` and pointer queries (:func:`host_pointer_kind`,
:func:`is_pinned`, :func:`host_array`) in :mod:`ctxkit.memory.hostptr`; both are
importable from here. Re-exported by :mod:`ctxkit.memory`; documented there.
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
    PageableCopyError,
    PageableCopyWarning,
)
from .hostalloc import MEMHOST_DEVICEMAP as MEMHOST_DEVICEMAP
from .hostalloc import MEMHOST_PORTABLE as MEMHOST_PORTABLE
from .hostalloc import MEMHOST_REGISTER_READ_ONLY as MEMHOST_REGISTER_READ_ONLY
from .hostalloc import MEMHOST_WRITECOMBINED as MEMHOST_WRITECOMBINED
from .hostalloc import (
    HostMemory,
    _bits,
    _flag_names,
    host_context,
    pinned_empty,
    pinned_zeros,
)
from .hostptr import _INVALID_VALUE, _address, host_array, host_pointer_kind, is_pinned

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


_NOT_SUPPORTED = 801


_HOST_ALREADY_REGISTERED = 712


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


#: ctxkit's live register_host blocks, start address -> (end address, flags passed); read
#: by hostaccess.host_memory_flags
_registered: dict[int, tuple[int, int]] = {}


_registered_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_registered_lock")


def check_async_host(arr: np.ndarray, what: str) -> None:
    """Warn/raise when an async copy with *arr* would secretly be synchronous."""
    if arr.nbytes and host_pointer_kind(_address(arr)) == "pageable":
        pageable_async(what)


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

    Page rules: the driver locks whole pages, so the registration also covers whatever
    shares the array's partial first and last page, such as the ends of its heap
    neighbours (arrays below glibc's mmap threshold sit back to back). While the block
    runs, the driver refuses (``CUDA_ERROR_INVALID_VALUE``) every copy whose host range
    spans the registration's edge: a pageable copy of such a neighbour, by ctxkit,
    PyTorch or CuPy, fails. Where it refuses an array that shares a page with memory
    already registered elsewhere, ctxkit raises ``ValueError`` (the CUDA 13.0 driver
    accepts such arrays). So give an array you register pages of its own: allocate with
    :func:`pinned_empty`, or register one big array and use slices of it. (Pin on reuse
    in ``Pipeline.map``, which registers on its own initiative, locks only the whole
    pages inside an array.)

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
