"""New page-locked host memory, made fast: anonymous pages, touched in parallel, registered.

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
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import lifetime
from .._driver import drv
from ..context import Context

__all__ = ["ALLOC_ENV", "LockFailed", "LockedPages", "lock_new", "method"]

#: ``register`` (default on Linux) or ``hostalloc``: how new pinned pool blocks are made.
ALLOC_ENV = "CTXKIT_PINNED_ALLOC"

_PORTABLE = 1  # CU_MEMHOSTALLOC_PORTABLE == CU_MEMHOSTREGISTER_PORTABLE
_OUT_OF_MEMORY = 2
_HUGE = 2 << 20
_PAGE = mmap.PAGESIZE
#: Blocks at least this large are touched by several threads before registering.
PARALLEL_TOUCH_BYTES = 32 << 20
_TOUCH_PIECE = 16 << 20
_MAX_TOUCH_THREADS = 16
_MADV_HUGEPAGE = 14
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)

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
    """Page-locked memory made by :func:`lock_new`: ``nbytes`` at ``ptr`` in ``ctx``."""

    ptr: int
    nbytes: int
    ctx: Context
    registered: bool  # mmap + cuMemHostRegister; else cuMemHostAlloc

    def release(self) -> None:
        """Free in its context (any thread, never raising; a closed context already
        dropped the registration or the allocation)."""
        if not self.registered:
            if not (self.ctx.closed or self.ctx.poisoned):
                lifetime.free_quietly(self.ctx, drv.cuMemFreeHost, self.ptr)
            return
        if self.ctx.closed or self.ctx.poisoned:
            _munmap(self.ptr, self.nbytes)
        else:
            lifetime.free_quietly(self.ctx, _unregister_and_unmap, self.ptr, self.nbytes)


def method() -> str:
    """``"register"`` or ``"hostalloc"``: how :func:`lock_new` makes memory now."""
    want = os.environ.get(ALLOC_ENV, "").strip().lower()
    if want not in ("", "register", "hostalloc"):
        raise ValueError(f"{ALLOC_ENV}={want!r}: use 'register' (default on Linux) or 'hostalloc'")
    if want == "hostalloc" or _refused or _libc() is None:
        return "hostalloc"
    return "register"


def lock_new(nbytes: int, ctx: Context) -> LockedPages:
    """*nbytes* (> 0) of new page-locked memory, pinned for every context, made in *ctx*.

    Raises
    ------
    LockFailed
        The OS or the driver refused (``code`` 2: out of memory).
    """
    if method() == "register":
        pages = _register_new(nbytes, ctx)
        if pages is not None:
            return pages
    with ctx:
        err, ptr = drv.cuMemHostAlloc(nbytes, _PORTABLE)
    if err:
        raise LockFailed(int(err), "cuMemHostAlloc")
    return LockedPages(int(ptr), nbytes, ctx, registered=False)


def _register_new(nbytes: int, ctx: Context) -> LockedPages | None:
    """The fast path; ``None`` when registering is refused for a reason other than
    memory (then ``cuMemHostAlloc`` serves this and every later request)."""
    global _refused
    size = -(-nbytes // _PAGE) * _PAGE
    ptr = _map_aligned(size)
    _touch(ptr, size)
    with ctx:
        (err,) = drv.cuMemHostRegister(ptr, size, _PORTABLE)
    if not err:
        return LockedPages(ptr, size, ctx, registered=True)
    _munmap(ptr, size)
    if int(err) == _OUT_OF_MEMORY:
        raise LockFailed(_OUT_OF_MEMORY, "cuMemHostRegister")
    _refused = True
    return None


def _unregister_and_unmap(ptr: int, nbytes: int) -> tuple[Any, ...]:
    res = drv.cuMemHostUnregister(ptr)
    _munmap(ptr, nbytes)
    return tuple(res)


# --- the OS side ---------------------------------------------------------------------


_libc_handle: Any = None


def _libc() -> Any:
    """libc with ``mmap``/``munmap``/``madvise`` typed, or ``None`` off Linux."""
    global _libc_handle
    if _libc_handle is None:
        if not sys.platform.startswith("linux"):
            _libc_handle = False
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc_handle = libc
    return _libc_handle or None


def _map_aligned(size: int) -> int:
    """Anonymous private pages: *size* bytes at a 2 MiB boundary when the block is at
    least that large (so the kernel can back it with huge pages)."""
    libc = _libc()
    align = _HUGE if size >= _HUGE else _PAGE
    span = size + align - _PAGE
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_ANONYMOUS
    base = libc.mmap(None, span, prot, flags, -1, 0)
    if base is None or base == ctypes.c_void_p(-1).value:
        raise LockFailed(_OUT_OF_MEMORY, "mmap")
    start = -(-base // align) * align
    if start > base:
        libc.munmap(base, start - base)
    end = start + size
    if base + span > end:
        libc.munmap(end, base + span - end)
    if align == _HUGE:
        libc.madvise(start, size, _MADV_HUGEPAGE)  # a hint: refusal changes nothing
    return int(start)


def _munmap(ptr: int, nbytes: int) -> None:
    libc = _libc()
    if libc is not None:
        libc.munmap(ptr, nbytes)


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


def _forget_threads_in_child() -> None:
    """A forked child has none of the parent's threads: a new pool when it needs one."""
    global _touch_pool, _touch_lock
    _touch_pool = None
    _touch_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_in_child)
