"""Host memory: pointer kinds, page-locked allocations and registrations, kernel access.

What a host address is to CUDA: pointer queries for host arrays.

:func:`host_pointer_kind` asks the driver (``cuPointerGetAttribute``) whether an address
is pinned, managed, device or pageable memory; :func:`is_pinned` applies it to both ends
of an array; :func:`host_array` turns a host argument into a C-contiguous numpy array (or
a clear error) without copying; :func:`plain_dtype` refuses dtypes holding Python objects
wherever memory is read or written as bytes. Every host copy, the honest-async check and
the kernel-access functions below build on these; they change no driver state.

Page-locked host allocations: :func:`pinned_empty` and :func:`pinned_zeros`
(``cuMemHostAlloc``) and :class:`HostMemory`, the numpy-visible owner of such memory.

Also the ``CU_MEMHOST*`` flag bits, which ``cuMemHostAlloc`` and ``cuMemHostRegister``
share, and :func:`host_context`, the context a host allocation is made in (used by
:func:`~ctxkit.memory.host.register_host` and the pinned pool too).

New page-locked host memory, made fast: anonymous pages, touched in parallel, registered.

``cuMemHostAlloc`` maps, zeroes and pins every page of a block from one thread: a 1 GiB
block took 470 ms on an H200 host (2.3 GB/s). The same memory taken as anonymous
``mmap`` pages (2 MiB-aligned, transparent huge pages asked for), first touched by
several threads at once and then page-locked by one ``cuMemHostRegister(PORTABLE)``
took 50-60 ms (touch 24-35 ms, register 26-28 ms, same machine). Like ``cuMemHostAlloc``
memory, a registration made with ``PORTABLE`` is pinned for every context and is gone
when the context that made it is destroyed.

Responsibilities:

* :func:`lock_new` -- ``nbytes`` of new page-locked memory in a context, by the fast
  path on Linux, by ``cuMemHostAlloc`` elsewhere, when the environment asks for it
  (``CTXKIT_PINNED_ALLOC=hostalloc``), or once registering was refused in this process.
* :meth:`LockedPages.release` -- free it in its context, never raising (finalizers and
  the pinned pool call it from any thread).
* :class:`LockFailed` -- the driver or the OS refused, with the CUresult code, so the
  caller words the error for its own users.

Host memory: pinning in place and the honest-async check, with the process-wide
state they share.

:func:`register_host` (``cuMemHostRegister``) and its table of registered blocks; strict
async mode (:func:`set_strict_async`) and the warning for async copies from pageable
memory; :func:`host_device_pointer`, the kernel-argument address of a host array, with
the switch for pageable arrays on HMM/ATS devices (:func:`allow_pageable_kernel_args`).
That state is looked up here by name, so it stays in this module.

How devices reach host memory: page-lock flags, device addresses of pinned arrays, and
pageable arrays as kernel arguments on devices that access pageable memory (HMM/ATS).

The public names are exported by :mod:`ctxkit.memory` and documented there.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _driver, lifetime
from .._driver import drv
from .._env import env_flag, pinned_alloc
from ..binding import bind, resolve_context
from ..context import Context, current_context, require_current, thread_state
from ..device import Device
from ..errors import (
    DriverNotFoundError,
    LaunchArgumentError,
    PageableCopyError,
    PageableCopyWarning,
)
from .alloc import OUT_OF_MEMORY, PINNED, oom
from .sizes import require_capability, shape_nbytes

__all__ = [
    "HostMemory",
    "HostMemoryFlags",
    "LockFailed",
    "LockedPages",
    "PageableArg",
    "allow_pageable_kernel_args",
    "device_pointer",
    "host_array",
    "host_device_pointer",
    "host_memory_flags",
    "host_pointer_kind",
    "is_pinned",
    "lock_new",
    "method",
    "pageable_arg",
    "pageable_kernel_args_allowed",
    "pageable_memory_access",
    "pinned_empty",
    "pinned_zeros",
    "plain_dtype",
    "pointer_attribute",
    "register_host",
    "register_pages",
    "set_strict_async",
    "strand",
    "strict_async",
]


_INVALID_VALUE = 1

_INVALID_CONTEXT = 201

_MEMORYTYPE_HOST, _MEMORYTYPE_DEVICE, _MEMORYTYPE_ARRAY, _MEMORYTYPE_UNIFIED = 1, 2, 3, 4


def host_pointer_kind(ptr: int) -> str:
    """What the driver knows about a host-side address.

    Returns ``"pinned"`` (page-locked: ``cuMemHostAlloc`` or ``cuMemHostRegister``),
    ``"managed"`` (unified memory), ``"device"`` or ``"pageable"`` (unknown to CUDA).
    """
    if not ptr:
        return "pageable"
    err, value = _with_any_context(pointer_attribute, "MEMORY_TYPE", ptr)
    if err == _INVALID_VALUE:
        return "pageable"
    _driver.raise_for(err, f"cuPointerGetAttribute(MEMORY_TYPE, {ptr:#x})")
    if kind := {_MEMORYTYPE_HOST: "pinned", _MEMORYTYPE_UNIFIED: "managed"}.get(int(value)):
        return kind
    err, managed = pointer_attribute("IS_MANAGED", ptr)
    return "managed" if not err and managed else "device"


def pointer_attribute(name: str, ptr: int) -> tuple[Any, Any]:
    """``(err, value)`` of ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_<name>, ptr)``."""
    return drv.cuPointerGetAttribute(  # type: ignore[no-any-return]
        getattr(drv.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + name), ptr
    )


def plain_dtype(dtype: Any, what: str) -> np.dtype[Any]:
    """*dtype* as a numpy dtype, refused when its items hold Python objects.

    An object array (``dtype=object``, or a structured dtype with an object field) stores
    references into the interpreter's heap: copied to a device they are meaningless
    addresses, and device bytes copied into one become references that crash the
    interpreter. Every ctxkit path that reads or writes memory as bytes (copies, page
    locking, numpy views of pinned, managed or device memory, the pipeline) asks here.

    Raises
    ------
    TypeError
        ``dtype.hasobject``.
    """
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(
            f"{what}: dtype {dt} holds Python objects (references into the interpreter's "
            "heap), which cannot go to or come from a GPU as bytes; use a numeric, bool or "
            "fixed-width string dtype (e.g. arr.astype(np.float64), arr.astype('U16'))"
        )
    return dt


def host_array(arr: Any, what: str, *, writable: bool = False) -> np.ndarray:
    """*arr* as a C-contiguous numpy array without copying, or a clear error.

    Accepts numpy arrays and objects with the buffer protocol (bytes, bytearray,
    memoryview, array.array).

    Raises
    ------
    TypeError
        *arr* is not an array or buffer, or its dtype holds Python objects
        (:func:`plain_dtype`).
    ValueError
        It is not C-contiguous, or not writable when *writable*.
    """
    if not isinstance(arr, np.ndarray):
        try:  # anything with the buffer protocol
            arr = np.frombuffer(arr, dtype=np.uint8)
        except (TypeError, ValueError):
            raise TypeError(
                f"{what}: expected a numpy array or a buffer (bytes, bytearray, memoryview); "
                "convert with np.asarray(...) first"
            ) from None
    plain_dtype(arr.dtype, what)
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{what}: the host array is not C-contiguous (strides {arr.strides}); pass "
            "np.ascontiguousarray(arr)"
        )
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: the destination host array is read-only")
    return arr


_char_at = ctypes.c_char.from_buffer


def host_address(arr: np.ndarray) -> int:
    """The address of a numpy array's first byte (0 for none).

    Through the buffer protocol where the array exports a writable one (a fifth of the
    cost of ``__array_interface__``, which builds a dict: copies ask on every call);
    read-only, empty and non-contiguous arrays through the interface.
    """
    try:
        return ctypes.addressof(_char_at(arr))  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):
        return int(arr.__array_interface__["data"][0] or 0)


def is_pinned(arr: Any) -> bool:
    """True when the array's memory is page-locked (``pinned_empty``/``register_host``
    or another library's pinned allocator); False for ordinary pageable memory.

    Both its first and its last byte are checked: an array that merely shares its first
    page with a neighbour's registration is not pinned.

    Async copies need pinned memory: from pageable memory the driver blocks the host for
    the whole copy. :func:`ctxkit.memory.host.host_memory_flags` tells how it is
    pinned. Without a driver (or cuda-bindings) no memory is pinned: False.
    """
    a = host_array(arr, "is_pinned") if not isinstance(arr, np.ndarray) else arr
    if a.size == 0:
        return False
    try:
        _driver.init()
    except DriverNotFoundError:  # without a driver no memory is pinned
        return False
    return _end_kinds(a) == {"pinned"}


def _end_kinds(a: np.ndarray) -> set[str]:
    """The :func:`host_pointer_kind` of the first and the last byte of non-empty *a*."""
    first = host_address(a)
    return {host_pointer_kind(first), host_pointer_kind(first + a.nbytes - 1)}


MEMHOST_PORTABLE = 1  # CU_MEMHOSTALLOC_PORTABLE (= CU_MEMHOSTREGISTER_PORTABLE)

MEMHOST_DEVICEMAP = 2  # CU_MEMHOSTALLOC_DEVICEMAP (= CU_MEMHOSTREGISTER_DEVICEMAP)

MEMHOST_WRITECOMBINED = 4  # CU_MEMHOSTALLOC_WRITECOMBINED

MEMHOST_REGISTER_READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY


class HostMemory:
    """Host-addressable memory exposed to numpy (``np.asarray(mem)`` is a uint8 view).

    The numpy arrays built on it keep it (and its *owner*) alive through their ``.base``
    chain; pinned allocations are freed when the last array dies.
    """

    __slots__ = ("__weakref__", "context", "fin", "nbytes", "owner", "ptr")

    def __init__(self, ptr: int, nbytes: int, owner: Any = None, context: Any = None):
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.owner = owner
        self.context = context
        self.fin: Any = None

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


def host_context(context: Any, what: str) -> Context:
    """The context for a host allocation: the one given, the current one, or device 0's."""
    if context is not None:
        return resolve_context(context, what)
    ctx = thread_state().top or current_context() or bind(0)
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
        :func:`~ctxkit.memory.host.device_pointer`.
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
    dt = plain_dtype(dtype, "pinned_empty")
    shp, nbytes = shape_nbytes(shape, dt, "pinned_empty")
    flags = _bits(portable=portable, mapped=mapped, write_combined=write_combined)
    if nbytes == 0:
        return np.empty(shp, dt)
    ctx = host_context(context, "pinned_empty")
    err, ptr = PINNED.allocate(ctx, nbytes, flags)
    if err:
        raise _host_alloc_error(ctx, err, nbytes, flags)
    mem = HostMemory(ptr, nbytes, context=ctx)
    mem.fin = PINNED.deallocate(mem, ctx, ptr)
    return np.asarray(mem).view(dt).reshape(shp)


#: The ``CU_MEMHOST*`` bit of each option and its driver name: allocations and registrations
#: share PORTABLE and DEVICEMAP; WRITECOMBINED is an allocation's, READ_ONLY a registration's.
_FLAGS = {
    "portable": (MEMHOST_PORTABLE, "PORTABLE"),
    "mapped": (MEMHOST_DEVICEMAP, "DEVICEMAP"),
    "write_combined": (MEMHOST_WRITECOMBINED, "WRITECOMBINED"),
    "read_only": (MEMHOST_REGISTER_READ_ONLY, "READ_ONLY"),
}


def _bits(**flags: bool) -> int:
    """``CU_MEMHOST*`` bits of boolean options (refusing non-bools, e.g. a stray int)."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    return sum(_FLAGS[name][0] for name, value in flags.items() if value)  # distinct bits


def _flag_names(flags: int) -> str:
    return "|".join(n for bit, n in _FLAGS.values() if flags & bit) or "0"


def _host_alloc_error(ctx: Context, err: Any, nbytes: int, flags: int) -> Exception:
    if int(err) == OUT_OF_MEMORY:
        return oom(
            f"pinned_empty: cannot page-lock {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of host "
            "memory (cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY). Pinned memory is limited by "
            "physical RAM and the locked-memory limit (ulimit -l); use smaller staging "
            "buffers and reuse them"
        )
    return ctx.note_error(err, f"cuMemHostAlloc({nbytes}, {_flag_names(flags)})")


def pinned_zeros(
    shape: Any, dtype: Any = np.float64, *, context: Any = None, **flags: bool
) -> np.ndarray:
    """:func:`pinned_empty` (same options) filled with zeros."""
    arr = pinned_empty(shape, dtype, context=context, **flags)
    arr[...] = 0
    return arr


_HUGE = 2 << 20

_PAGE = mmap.PAGESIZE

PARALLEL_TOUCH_BYTES = 32 << 20

_TOUCH_PIECE = 16 << 20

_MAX_TOUCH_THREADS = 16

_MADV_HUGEPAGE = 14

_HOST_NOT_REGISTERED = 713

_stranded: list[Any] = []  # see strand()


def strand(memory: Any) -> None:
    """Keep *memory* -- pages, or the owner of pages, whose registration no call can undo
    (its context is poisoned, or the driver refused) -- until the process exits: freed,
    its registered pages would be handed to new memory, and every later host allocation
    there fails (``CUDA_ERROR_ALREADY_MAPPED``)."""
    _stranded.append(memory)


_refused = False  # registering failed once for a reason other than memory: stop trying

_touch_pool: ThreadPoolExecutor | None = None

_touch_lock = threading.Lock()


class LockFailed(Exception):
    """New page-locked memory was refused: ``code`` is the CUresult (2: out of memory)."""

    def __init__(self, code: int, call: str) -> None:
        super().__init__(f"{call} failed with CUresult {code}")
        self.code = code
        self.call = call


@dataclass
class LockedPages:
    """Page-locked memory made by :func:`lock_new`: ``nbytes`` at ``ptr`` in ``ctx``, in
    *mapping* (anonymous pages registered with ``cuMemHostRegister``) or, when that is
    ``None``, from ``cuMemHostAlloc``."""

    ptr: int
    nbytes: int
    ctx: Context
    mapping: mmap.mmap | None

    def release(self) -> None:
        """Free in its context (any thread, never raising). Registered pages are unmapped
        only once no registration covers them: a registration left over unmapped pages
        makes every later host allocation of the process there fail
        (``CUDA_ERROR_ALREADY_MAPPED``, ``cuCtxCreate`` included). So pages of a poisoned
        context, which no call can unregister, stay mapped until the process exits."""
        if self.mapping is None:
            lifetime.free_quietly(self.ctx, drv.cuMemFreeHost, self.ptr)
        elif self.ctx.poisoned:
            strand(self.mapping)
        elif not self.ctx.resources_alive():  # the registration went with the context
            self.mapping.close()
        else:
            lifetime.free_quietly(self.ctx, _unregister_and_unmap, self.ptr, self.mapping)


def method() -> str:
    """``"register"`` or ``"hostalloc"``: how :func:`lock_new` makes memory now."""
    if pinned_alloc() == "hostalloc" or _refused or not sys.platform.startswith("linux"):
        return "hostalloc"
    return "register"


def lock_new(nbytes: int, ctx: Context) -> LockedPages:
    """*nbytes* (> 0) of new page-locked memory, pinned for every context, made in *ctx*.

    Raises
    ------
    LockFailed
        The OS or the driver refused (``code`` 2: out of memory).
    """
    if method() == "register" and (pages := _register_new(nbytes, ctx)) is not None:
        return pages
    err, ptr = PINNED.allocate(ctx, nbytes, MEMHOST_PORTABLE)
    if err:
        raise LockFailed(int(err), "cuMemHostAlloc")
    return LockedPages(int(ptr), nbytes, ctx, None)


def register_pages(ptr: int, nbytes: int, flags: int, context: Context | None = None) -> int:
    """``cuMemHostRegister(ptr, nbytes, flags)``: the one place ctxkit page-locks existing
    host memory. Made in *context* (bound for the call) or, when ``None``, the calling
    thread's current one; returns the CUresult as an int (0: registered), so each caller
    words its own error."""
    with contextlib.nullcontext() if context is None else context:
        (err,) = drv.cuMemHostRegister(ptr, nbytes, flags)
    return int(err)


def _register_new(nbytes: int, ctx: Context) -> LockedPages | None:
    """The fast path; ``None`` when registering is refused for a reason other than
    memory (then ``cuMemHostAlloc`` serves this and every later request)."""
    global _refused
    size = -(-nbytes // _PAGE) * _PAGE
    mapping, ptr = _map_aligned(size)
    _touch(ptr, size)
    err = register_pages(ptr, size, MEMHOST_PORTABLE, ctx)
    if not err:
        return LockedPages(ptr, size, ctx, mapping)
    mapping.close()
    if err == OUT_OF_MEMORY:
        raise LockFailed(OUT_OF_MEMORY, "cuMemHostRegister")
    _refused = True
    return None


def _unregister_and_unmap(ptr: int, mapping: mmap.mmap) -> tuple[Any, ...]:
    res = drv.cuMemHostUnregister(ptr)
    if int(res[0]) in (0, _HOST_NOT_REGISTERED):
        mapping.close()
    else:  # still registered: the pages must stay
        strand(mapping)
    return tuple(res)


def _map_aligned(size: int) -> tuple[mmap.mmap, int]:
    """Anonymous private pages: *size* bytes at a 2 MiB boundary when the block is at
    least that large (so the kernel can back it with huge pages), in a mapping up to
    2 MiB - 4 KiB larger whose slack is never touched (no memory backs it)."""
    align = _HUGE if size >= _HUGE else _PAGE
    try:
        mapping = mmap.mmap(-1, size + align - _PAGE, flags=mmap.MAP_PRIVATE)
    except OSError:
        raise LockFailed(OUT_OF_MEMORY, "mmap") from None
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # no export is kept
    start = -(-base // align) * align
    if align == _HUGE:
        with contextlib.suppress(OSError):  # a hint: refusal changes nothing
            mapping.madvise(_MADV_HUGEPAGE, start - base, size)
    return mapping, start


def _touch(ptr: int, size: int) -> None:
    """Fault every page in, from several threads for big blocks (registering one
    untouched range does the same from the calling thread alone, 4-6x slower)."""
    if size < PARALLEL_TOUCH_BYTES:
        return
    pages = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(ptr))
    pieces = range(0, size, _TOUCH_PIECE)
    list(_touch_threads().map(lambda o: pages[o : o + _TOUCH_PIECE : _PAGE].fill(0), pieces))


def _touch_threads() -> ThreadPoolExecutor:
    global _touch_pool
    with _touch_lock:
        if _touch_pool is None:
            n = max(1, min(_MAX_TOUCH_THREADS, os.cpu_count() or 1))
            _touch_pool = ThreadPoolExecutor(n, thread_name_prefix="ctxkit-pagetouch")
        return _touch_pool


# a forked child has none of the parent's threads: a new pool when it needs one
_driver.renew_at_fork(__name__, "_touch_pool", lambda: None)

_driver.renew_at_fork(__name__, "_touch_lock")


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


_registered: dict[int, tuple[int, int]] = {}  # start -> (end, flags) of register_host


def check_async_host(arr: np.ndarray, what: str, address: int | None = None) -> None:
    """Warn/raise when an async copy with *arr* (at *address*, when the caller knows it)
    would secretly be synchronous. ctxkit's own pinned and managed arrays are known
    without asking the driver (:func:`on_ctxkit_host_memory`)."""
    if not arr.nbytes or on_ctxkit_host_memory(arr):
        return
    if host_pointer_kind(host_address(arr) if address is None else address) == "pageable":
        pageable_async(what)


def on_ctxkit_host_memory(arr: np.ndarray) -> bool:
    """True when *arr* is a view of ctxkit's page-locked or managed host memory
    (:func:`pinned_empty`, a pinned pool block, ``ManagedBuffer.as_numpy``): a
    :class:`HostMemory` ends its ``.base`` chain, and keeps that memory alive."""
    base = arr.base
    for _ in range(4):
        if base is None:
            return False
        if type(base) is HostMemory:
            return True
        base = getattr(base, "base", None)
    return False


#: Called as ``hook(start, end)`` by :func:`register_host` before it looks at the memory:
#: whoever page-locked some of it on its own initiative (pin on reuse) lets go of it
#: there, so the caller's explicit registration wins.
register_conflict_hooks: list[Any] = []


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

    Byte rules (measured on H200, driver 580): the OS locks whole pages, but the driver
    keeps the registration as the array's exact bytes, so heap neighbours sharing its
    first or last page stay pageable and their copies by anyone work. While the block
    runs the driver refuses (``CUDA_ERROR_INVALID_VALUE``) a copy whose host range
    starts inside the array and ends beyond it, such as a copy of the array's owner from
    a byte inside the array on: register the whole owner, or copy the view itself. An
    array some of whose bytes are registered already (by another registration or a
    pinned allocation) is refused: ``ValueError``. Pin on reuse in ``Pipeline.map``,
    which registers on its own initiative, lets go of what it holds here when no map is
    using it: the caller's registration wins. Memory counts as page-locked already only
    when both its first and its last byte are.

    Parameters
    ----------
    arr : numpy array or buffer
        Must be C-contiguous; it must stay alive (it does: the block holds it).
    context : Context, Device or int, optional
        As for :func:`pinned_empty`.
    mapped : bool
        ``CU_MEMHOSTREGISTER_DEVICEMAP``: kernels may access it in place
        (:func:`~ctxkit.memory.host.device_pointer`).
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
    ptr, nbytes = host_address(a), a.nbytes
    for hook in register_conflict_hooks if nbytes else ():
        hook(ptr, ptr + nbytes)
    if "pageable" not in (_end_kinds(a) if nbytes else ()):  # both ends locked already
        yield a
        return
    ctx = host_context(context, "register_host")
    if read_only:
        require_capability(
            ctx.device,
            "read_only_host_register_supported",
            "register_host(read_only=True)",
            "cannot register host memory read-only",
            "register it without read_only=True, or copy it into a pinned_empty() array",
        )
    err = register_pages(ptr, nbytes, flags, ctx)
    if err == _HOST_ALREADY_REGISTERED:
        raise ValueError(
            f"register_host: the array at {ptr:#x} ({nbytes} bytes) is partly registered "
            "already (some of its bytes belong to another registration or a pinned "
            "allocation, and the driver registers a byte only once). Register one "
            "enclosing array instead, or allocate with ctxkit.pinned_empty()"
        )
    if err:
        what = f"cuMemHostRegister({ptr:#x}, {nbytes}, {_flag_names(flags)})"
        if not a.flags.writeable and not read_only:
            what += " of a read-only array (pass read_only=True for read-only pages)"
        raise ctx.note_error(err, what)
    _registered[ptr] = (ptr + nbytes, flags)
    try:
        yield a
    finally:
        _registered.pop(ptr, None)
        ctx.free(drv.cuMemHostUnregister, ptr)


def host_device_pointer(arr: np.ndarray) -> int | None:
    """Device address of a page-locked or managed host array for a kernel argument.

    ``None`` for pageable memory, except where pageable kernel arguments are allowed
    (:func:`allow_pageable_kernel_args`) and the current context's device accesses
    pageable memory directly (:func:`pageable_memory_access`): then the host address.
    """
    ptr = host_address(arr)
    if not ptr or drv is None:
        return None
    try:
        err, dptr = pointer_attribute("DEVICE_POINTER", ptr)
    except Exception:
        return None
    if not err:
        return int(dptr)
    if _pageable_kernel_args and int(err) == _INVALID_VALUE:
        ctx = thread_state().top or current_context()
        if ctx is not None and pageable_memory_access(ctx.device):
            return ptr
    return None


_pageable_kernel_args = env_flag("CTXKIT_PAGEABLE_KERNEL_ARGS")

_pageable_access: dict[int, bool] = {}


def allow_pageable_kernel_args(enabled: bool = True) -> None:
    """Let kernels take pageable numpy arrays on devices that access pageable memory.

    Process-wide; the default comes from ``CTXKIT_PAGEABLE_KERNEL_ARGS=1``. On such a
    device (HMM or ATS: :func:`pageable_memory_access`) the array's host address is passed
    and the kernel reads and writes the array in place; elsewhere such arrays are refused
    as before (``LaunchArgumentError``). For one argument of one launch, wrap it with
    :func:`~ctxkit.memory.host.pageable_arg` instead.
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
    if (known := _pageable_access.get(dev.ordinal)) is None:
        known = _pageable_access[dev.ordinal] = bool(dev.attribute("pageable_memory_access"))
    return known


@dataclass(frozen=True)
class HostMemoryFlags:
    """How a host array's memory is page-locked (:func:`host_memory_flags`).

    Attributes
    ----------
    kind : str
        ``"allocated"`` (``cuMemHostAlloc``: :func:`pinned_empty`), ``"registered"``
        (``cuMemHostRegister``: :func:`register_host`), ``"managed"`` or ``"pageable"``.
    portable, mapped, write_combined, read_only : bool or None
        The ``CU_MEMHOSTALLOC_*`` / ``CU_MEMHOSTREGISTER_*`` flags: for allocations as
        ``cuMemHostGetFlags`` reports them, for :func:`register_host` blocks as ctxkit
        registered them; ``None`` where nobody can tell (memory another library
        registered, managed and pageable memory).
    device_pointer : int or None
        The address kernels use for it (``None``: pageable).
    """

    kind: str
    portable: bool | None = None
    mapped: bool | None = None
    write_combined: bool | None = None
    read_only: bool | None = None
    device_pointer: int | None = None

    @property
    def pinned(self) -> bool:
        """True for page-locked memory (allocated or registered)."""
        return self.kind in ("allocated", "registered")


def host_memory_flags(arr: Any) -> HostMemoryFlags:
    """How *arr*'s memory is page-locked: allocated or registered, and with which flags.

    The whole array counts (first and last byte, as for :func:`is_pinned`). For
    :func:`pinned_empty` memory the flags come from the driver (``cuMemHostGetFlags``); on
    systems with unified addressing the driver may report ``mapped`` even where it was not
    asked for, since all pinned memory is device-accessible there.
    """
    a = host_array(arr, "host_memory_flags") if not isinstance(arr, np.ndarray) else arr
    if a.size == 0:
        return HostMemoryFlags("pageable")
    if (kinds := _end_kinds(a)) == {"managed"}:
        return HostMemoryFlags("managed", device_pointer=host_device_pointer(a))
    if kinds != {"pinned"}:
        return HostMemoryFlags("pageable")
    first, last = host_address(a), host_address(a) + a.nbytes - 1
    dptr = _device_pointer_of(first, "host_memory_flags")
    spans = list(_registered.items())  # a snapshot: no lock needed
    reg = next((flags for start, (end, flags) in spans if start <= first and last < end), None)
    if reg is not None:
        return _flags("registered", reg, dptr)
    # cuMemHostGetFlags refuses memory that is not a cuMemHostAlloc block (registered)
    err, flags = _with_any_context(drv.cuMemHostGetFlags, first)
    if err:
        return HostMemoryFlags("registered", device_pointer=dptr)
    return _flags("allocated", int(flags), dptr)


def _flags(kind: str, flags: int, dptr: int) -> HostMemoryFlags:
    """*flags* as options (WRITECOMBINED is only an allocation's, READ_ONLY only a
    registration's flag)."""
    bits = {name: bool(flags & bit) for name, (bit, _n) in _FLAGS.items()}
    return HostMemoryFlags(kind, device_pointer=dptr, **bits)


def _with_any_context(fn: Any, *args: Any) -> tuple[Any, Any]:
    """``fn(*args)`` in the current context, or in device 0's when the thread has none."""
    _driver.init()
    err, value = fn(*args)
    if err == _INVALID_CONTEXT:
        with bind(0):
            err, value = fn(*args)
    return err, value


def _device_pointer_of(ptr: int, what: str) -> int:
    err, dptr = _with_any_context(pointer_attribute, "DEVICE_POINTER", ptr)
    _driver.raise_for(err, f"{what}: cuPointerGetAttribute(DEVICE_POINTER, {ptr:#x})")
    return int(dptr)


def device_pointer(arr: Any) -> int:
    """The device address of page-locked (or managed) host memory, for kernels.

    Kernels read and write the host memory through it directly, over the bus (zero-copy),
    e.g. memory from ``pinned_empty(..., mapped=True)`` or ``register_host(arr,
    mapped=True)``. ctxkit's kernels also take such arrays as arguments directly.

    Raises
    ------
    ValueError
        The array is in pageable memory (or empty): allocate it with :func:`pinned_empty`
        or pin it with :func:`register_host` first.
    """
    a = host_array(arr, "device_pointer") if not isinstance(arr, np.ndarray) else arr
    kind = host_pointer_kind(host_address(a)) if a.size else "pageable"
    if kind not in ("pinned", "managed"):
        raise ValueError(
            f"device_pointer: the array ({a.nbytes} bytes at {host_address(a):#x}) is in "
            "pageable memory, which has no device address; allocate it with "
            "ctxkit.pinned_empty(..., mapped=True) or pin it with "
            "`with ctxkit.register_host(arr, mapped=True):`"
        )
    return _device_pointer_of(host_address(a), "device_pointer")


class PageableArg:
    """A host array passed to a kernel by its host address (see :func:`pageable_arg`)."""

    __slots__ = ("array",)

    def __init__(self, arr: Any) -> None:
        self.array = host_array(arr, "pageable_arg")

    @property
    def ptr(self) -> int:
        """The address for the current context's device.

        Raises
        ------
        LaunchArgumentError
            That device cannot access pageable memory.
        """
        if (pinned := host_device_pointer(self.array)) is not None:
            return pinned
        dev = require_current("pageable_arg").device
        if not pageable_memory_access(dev):
            raise LaunchArgumentError(
                f"pageable_arg: device {dev.ordinal} cannot access pageable host memory "
                "(CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0: no HMM or ATS on this "
                "system); copy the array to the device (ctxkit.to_device) or pin it "
                "(ctxkit.pinned_empty / ctxkit.register_host)"
            )
        return host_address(self.array)

    def __repr__(self) -> str:
        return (
            f"<PageableArg {self.array.shape} {self.array.dtype} at {host_address(self.array):#x}>"
        )


def pageable_arg(arr: Any) -> PageableArg:
    """Opt in for one kernel argument: pass pageable *arr* by its host address.

    ``k.launch(grid, block, ctxkit.memory.host.pageable_arg(x), n)`` lets the kernel read
    and write *x* in place on a device that accesses pageable memory (HMM/ATS); on other
    devices the launch raises ``LaunchArgumentError``. Keep *x* alive and do not touch it
    from the host until the kernel has finished.
    """
    return PageableArg(arr)
