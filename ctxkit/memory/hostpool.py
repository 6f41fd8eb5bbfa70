"""One process-wide pool of page-locked host blocks (a caching host allocator).

Page-locking memory is slow (``cuMemHostAlloc`` maps, zeroes and pins every page: a
1 GiB block costs tens to hundreds of milliseconds) and freeing it synchronizes, so code
that needs pinned buffers again and again -- staging buffers, pinned outputs of a stream
of batches -- should not pay for it every time. :class:`PinnedPool` keeps the blocks it
hands out and reuses them, the way PyTorch's ``CachingHostAllocator`` does:

* :meth:`PinnedPool.empty` returns a numpy array in a page-locked block
  (``cuMemHostAlloc(PORTABLE)``: every context may DMA it). The block goes back to the
  pool when the array and every view of it are gone.
* A block is reused only after the stream work that used it has completed: name the
  streams (``empty(..., stream=s)`` or :meth:`~PinnedPool.record_stream`); when the last
  view dies the pool records an event on each and reuses the block once
  ``cuEventQuery`` says they all completed (or take an event you record yourself:
  :meth:`~PinnedPool.record_event`). Without a stream the caller promises that no work
  still queued reads or writes the array when it drops it.
* One budget for the process (:func:`default_budget`, ``CTXKIT_PINNED_POOL_BYTES``):
  blocks in use, cached, and waiting for their streams never exceed it together. A
  request that does not fit frees cached blocks, least recently returned first, then
  waits for blocks whose stream work is still running, and only then raises
  :class:`~ctxkit.errors.OutOfMemoryError` naming the budget and the fix. Page-locked
  memory that other code makes (registrations of the caller's arrays) can count against
  the same budget: :meth:`~PinnedPool.claim`.

Size classes (:func:`size_class`): requests up to 2 MiB round up to a power of two (at
least a 4 KiB page), larger ones to a multiple of 2 MiB, so a 1 GiB + 3 bytes array takes
1 GiB + 2 MiB, not 2 GiB. A cached block serves a request of class *c* when it is at most
a quarter larger than *c* (the smallest such block, the most recently returned of equal
ones); small classes therefore match exactly.

Blocks are allocated in the registry's shared context of the caller's device (its current
context's device, else device 0), not in a context the caller may close: memory from
``cuMemHostAlloc`` dies with the context that allocated it. They are freed in that
context from whatever thread frees them, never raising (:mod:`ctxkit.lifetime`). At
interpreter exit the pool frees nothing: the process teardown releases the memory.

Thread safety: every method may be called from any thread, and arrays may die in any
thread (the collector's included). The pool's lock guards only its bookkeeping; no
driver call is made while it is held. Work that needs the driver while a stream capture
forbids it (recording the events of returned blocks, querying them) waits for the
capture to end (:func:`ctxkit.lifetime.begin_free`).

This module holds the pool's interface, how it hands blocks out, and :func:`pinned_pool`.
Its base classes hold the rest: :class:`~ctxkit.memory.hostledger.PinnedLedger` the
books (where each block is, bytes against the budget, eviction, new pages and frees),
:class:`~ctxkit.memory.hostreuse.PinnedReuse` the way a block comes back for reuse;
:mod:`ctxkit.memory.hostblocks` the blocks, size classes, budget default and events.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import numpy as np

from .. import _driver
from ..binding import registry as _registry
from ..context import Context
from ..errors import OutOfMemoryError
from ..stream import Event
from .host import host_context
from .hostblocks import (
    POOL_ENV,
    Block,
    EventCache,
    PinnedPoolStats,
    as_streams,
    check_bytes,
    default_budget,
    fits,
    free_left,
    human,
    size_class,
)
from .hostptr import plain_dtype
from .hostreuse import PinnedReuse
from .pagelock import LockedPages
from .sizes import shape_nbytes

__all__ = [
    "POOL_ENV",
    "PinnedPool",
    "PinnedPoolStats",
    "default_budget",
    "pinned_pool",
    "size_class",
]


class PinnedPool(PinnedReuse):
    """A cache of page-locked host blocks handed out as numpy arrays.

    Use the process-wide pool, :func:`pinned_pool`; a separate instance has its own
    budget and cache (tests, or an application that wants a private limit).

    Parameters
    ----------
    budget : int, optional
        The most bytes of page-locked memory it may hold (in use, cached and waiting
        for stream work, plus :meth:`claim`). Default: :func:`default_budget`.
    """

    def __init__(self, budget: int | None = None) -> None:
        self._budget = default_budget() if budget is None else check_bytes(budget, "budget")
        self._lock = threading.Lock()
        self._in_use: dict[int, Block] = {}
        self._cached: collections.OrderedDict[int, Block] = collections.OrderedDict()
        self._pending: list[Block] = []
        #: blocks whose last array died, appended by finalizers in any thread (no lock)
        self._returned: collections.deque[Block] = collections.deque()
        self._events = EventCache()
        self._bytes = {"in_use": 0, "cached": 0, "pending": 0, "inflight": 0}
        self._claimed = 0
        self._count = dict.fromkeys(
            ("requests", "hits", "allocations", "frees", "evictions", "peak"), 0
        )
        # A private pool that is collected frees what it caches (arrays keep it alive).
        self._fin = weakref.finalize(self, free_left, self._cached, self._pending, self._returned)
        self._fin.atexit = False

    # --- public --------------------------------------------------------------------

    @property
    def budget(self) -> int:
        """The most bytes the pool may hold page-locked (see :meth:`set_budget`)."""
        return self._budget

    def set_budget(self, nbytes: int) -> int:
        """Change the budget; cached blocks beyond it are freed (least recently returned
        first). Returns the bytes freed. Blocks in use are never taken away: until they
        return, the pool may hold more than a lowered budget."""
        self._budget = check_bytes(nbytes, "set_budget(nbytes)")
        self._settle()
        with self._lock:
            victims = self._evict_locked(self._budget)
        return self._free(victims)

    def empty(
        self,
        shape: Any,
        dtype: Any = np.float64,
        *,
        stream: Any = None,
        context: Any = None,
    ) -> np.ndarray:
        """A numpy array in a page-locked block of the pool.

        The contents are undefined (a reused block holds what its last user left). The
        block returns to the pool when the array and every view of it are gone.

        Parameters
        ----------
        shape : int or tuple of int
        dtype : numpy dtype
        stream : Stream or sequence of Streams, optional
            Streams that will read or write the array (also foreign streams: anything
            :meth:`Stream.from_handle <ctxkit.Stream.from_handle>` takes). When the
            last view dies an event is recorded on each, and the block is reused only
            after they all completed. More can be added later: :meth:`record_stream`.
            Without streams, no work may still use the array when it is dropped.
        context : Context, Device or int, optional
            Picks the device whose shared context allocates a new block (default: the
            calling thread's current context's device, else device 0). The block is
            PORTABLE, so every context may DMA it.

        Raises
        ------
        OutOfMemoryError
            The request does not fit the pool's budget even after freeing every cached
            block and waiting for blocks still used by streams, or the OS refused to
            page-lock more memory.

        Notes
        -----
        A zero-size request returns an ordinary empty numpy array.
        """
        return self._array(shape, dtype, stream, context, "PinnedPool.empty")

    def try_empty(
        self,
        shape: Any,
        dtype: Any = np.float64,
        *,
        stream: Any = None,
        context: Any = None,
        headroom: int = 0,
    ) -> np.ndarray | None:
        """:meth:`empty`, or ``None`` where it would wait or raise: the block fits the
        budget only after stream work completes, does not fit at all, or the OS refuses
        to page-lock more. Cached blocks are still freed to make room. For callers with
        a pageable fallback (a pipeline's default output). A new block must leave
        *headroom* bytes of the budget free (what the fallback itself would allocate:
        a pipeline's staging buffers)."""
        try:
            return self._array(shape, dtype, stream, context, "PinnedPool.try_empty", headroom)
        except OutOfMemoryError:
            return None

    def _array(
        self,
        shape: Any,
        dtype: Any,
        stream: Any,
        context: Any,
        what: str,
        headroom: int | None = None,
    ) -> np.ndarray:
        """An array in a block: waiting for stream work when needed, or (with a
        *headroom*) never waiting and leaving that much of the budget free."""
        dt = plain_dtype(dtype, what)
        shp, nbytes = shape_nbytes(shape, dt, what)
        streams = as_streams(stream, what)
        if nbytes == 0:
            return np.empty(shp, dt)
        wait = headroom is None
        block = self._acquire(nbytes, context, what, wait=wait, headroom=headroom or 0)
        block.streams = streams
        return self._wrap(block, nbytes).view(dt).reshape(shp)

    def zeros(
        self, shape: Any, dtype: Any = np.float64, *, stream: Any = None, context: Any = None
    ) -> np.ndarray:
        """:meth:`empty` filled with zeros."""
        arr = self.empty(shape, dtype, stream=stream, context=context)
        arr[...] = 0
        return arr

    def record_stream(self, arr: np.ndarray, stream: Any) -> None:
        """Note that *stream* uses the pool array *arr* (like ``Tensor.record_stream``):
        when its last view dies, the block waits for the work queued on *stream* by then.

        Raises
        ------
        ValueError
            *arr* is not an array of this pool (or its block was returned already).
        """
        streams = as_streams(stream, "PinnedPool.record_stream")
        block = self._block_of(arr, "record_stream")
        with self._lock:
            block.streams.extend(s for s in streams if s not in block.streams)

    def record_event(self, arr: np.ndarray, event: Event) -> None:
        """Reuse *arr*'s block only after *event* completed, an event you record after the
        last work that uses the array. Keep it open and do not record it again before the
        array is gone (a later recording only delays the reuse).

        Raises
        ------
        TypeError
            *event* is not a :class:`ctxkit.Event`.
        ValueError
            *arr* is not an array of this pool.
        """
        if not isinstance(event, Event):
            raise TypeError(f"record_event needs a ctxkit.Event, got {type(event).__name__}")
        block = self._block_of(arr, "record_event")
        with self._lock:
            block.events.append((event, False))

    def owns(self, arr: Any) -> bool:
        """True when *arr* (or the array it views) lies in a block this pool handed out."""
        try:
            self._block_of(arr, "owns")
        except (TypeError, ValueError):
            return False
        return True

    def stats(self) -> PinnedPoolStats:
        """The pool's bytes, blocks and counters now (after settling returned blocks)."""
        self._settle()
        with self._lock:
            b, c = self._bytes, self._count
            return PinnedPoolStats(
                budget=self._budget,
                in_use_bytes=b["in_use"],
                in_use_blocks=len(self._in_use),
                cached_bytes=b["cached"],
                cached_blocks=len(self._cached),
                pending_bytes=b["pending"],
                pending_blocks=len(self._pending),
                claimed_bytes=self._claimed,
                requests=c["requests"],
                hits=c["hits"],
                allocations=c["allocations"],
                frees=c["frees"],
                evictions=c["evictions"],
                peak_bytes=c["peak"],
            )

    def trim(self, keep_bytes: int = 0) -> int:
        """Free cached blocks (least recently returned first) until at most *keep_bytes*
        stay cached; return the bytes freed. Blocks in use or waiting for their streams
        are kept."""
        keep = check_bytes(keep_bytes, "trim(keep_bytes)")
        self._settle()
        with self._lock:
            victims = []
            while self._cached and self._bytes["cached"] > keep:
                victims.append(self._pop_cached_locked(next(iter(self._cached))))
        return self._free(victims)

    def release(self) -> int:
        """Wait for the stream work of returned blocks, then free every block not in use;
        return the bytes freed. Arrays still alive keep their blocks."""
        self._settle()
        with self._lock:
            waiting = list(self._pending)
        self._wait(waiting)
        return self.trim(0)

    def claim(self, nbytes: int) -> bool:
        """Count *nbytes* of page-locked memory made elsewhere (``cuMemHostRegister`` of
        the caller's arrays) against the budget, freeing cached blocks to make room.
        False, and nothing counted, when it does not fit. Undo with :meth:`unclaim`."""
        n = check_bytes(nbytes, "claim(nbytes)")
        self._settle()
        with self._lock:
            victims = self._evict_locked(self._budget - n)
            ok = self._held_locked() + n <= self._budget
            if ok:
                self._claimed += n
        self._free(victims)
        return ok

    def unclaim(self, nbytes: int) -> None:
        """Give back bytes counted by :meth:`claim`."""
        n = check_bytes(nbytes, "unclaim(nbytes)")
        with self._lock:
            if n > self._claimed:
                raise ValueError(f"unclaim({n}): only {self._claimed} bytes are claimed")
            self._claimed -= n

    def prefill(self, nbytes: int, count: int = 1, *, context: Any = None) -> int:
        """Make sure *count* cached blocks can serve requests of *nbytes* (allocating the
        missing ones now, e.g. before a first call that needs them); return how many were
        allocated.

        Raises
        ------
        OutOfMemoryError
            As for :meth:`empty`.
        """
        n = check_bytes(nbytes, "prefill(nbytes)")
        want = check_bytes(count, "prefill(count)")
        cls = size_class(n)
        if not cls:
            return 0
        self._settle()
        with self._lock:
            have = sum(1 for b in self._cached.values() if fits(b.nbytes, cls))
        made = []
        try:
            for _ in range(max(0, want - have)):
                made.append(self._allocate(cls, context, "PinnedPool.prefill", reuse=False))
        finally:
            with self._lock:
                for block in made:
                    self._move_locked(block, "in_use", "cached")
        return len(made)

    def __repr__(self) -> str:
        b = self._bytes
        return (
            f"<PinnedPool in_use={human(b['in_use'])} cached={human(b['cached'])} "
            f"pending={human(b['pending'])} budget={human(self._budget)}>"
        )

    # --- handing out ---------------------------------------------------------------

    def _acquire(
        self, nbytes: int, context: Any, what: str, wait: bool = True, headroom: int = 0
    ) -> Block:
        cls = size_class(nbytes)
        if context is not None:  # a wrong context= fails even when the cache serves it
            host_context(context, what)
        self._settle()
        with self._lock:
            self._count["requests"] += 1
            block = self._take_cached_locked(cls)
        if block is not None:
            return block
        return self._allocate(cls, context, what, wait=wait, headroom=headroom)

    def _allocate(
        self,
        cls: int,
        context: Any,
        what: str,
        reuse: bool = True,
        wait: bool = True,
        headroom: int = 0,
    ) -> Block:
        """A new block of *cls* bytes, in use, within the budget less *headroom* (or,
        with *reuse*, a cached one that waiting for stream work made available; no
        waiting without *wait*: OutOfMemoryError instead)."""
        ctx = self._alloc_context(context, what)
        cached = self._reserve(cls, what, reuse, wait, headroom)
        if cached is not None:
            return cached
        try:
            pages = self._host_alloc_retrying(cls, ctx, what)
        except BaseException:
            with self._lock:
                self._bytes["inflight"] -= cls
            raise
        block = Block(pages, cls)
        with self._lock:
            self._bytes["inflight"] -= cls
            self._add_locked(block, "in_use")
            self._count["allocations"] += 1
        return block

    def _reserve(
        self, cls: int, what: str, reuse: bool, wait: bool = True, headroom: int = 0
    ) -> Block | None:
        """Count *cls* bytes as being allocated, freeing cached blocks and then waiting
        for pending ones to make room; OutOfMemoryError when they cannot fit. Returns a
        cached block instead when waiting made one that fits available (*reuse*)."""
        need = cls + headroom
        if need > self._budget - self._claimed:
            raise self._over_budget(cls, what)
        waited = False
        while True:
            with self._lock:
                block = self._take_cached_locked(cls) if waited and reuse else None
                if block is not None:
                    return block
                victims = self._evict_locked(self._budget - need)
                ok = self._held_locked() + need <= self._budget
                if ok:
                    self._bytes["inflight"] += cls
                pending = list(self._pending)
            self._free(victims)
            if ok:
                return None
            if waited or not pending or not wait:
                raise self._over_budget(cls, what)
            self._wait(pending)
            waited = True

    def _alloc_context(self, context: Any, what: str) -> Context:
        ctx = host_context(context, what)
        shared = _registry.context(ctx.device.ordinal)
        shared.check_usable()
        return shared

    def _host_alloc_retrying(self, nbytes: int, ctx: Context, what: str) -> LockedPages:
        """New page-locked memory (:func:`~ctxkit.memory.pagelock.lock_new`); when the OS
        refuses, free every cached block and try once more."""
        try:
            return self._host_alloc(nbytes, ctx, what)
        except OutOfMemoryError:
            if not self.trim(0):
                raise
        return self._host_alloc(nbytes, ctx, what)


_process_pool: PinnedPool | None = None


_process_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_process_lock")
_driver.renew_at_fork(__name__, "_process_pool._lock")


def pinned_pool() -> PinnedPool:
    """The process-wide :class:`PinnedPool` (created at first use with
    :func:`default_budget`), which ctxkit's pipelines draw staging buffers and pinned
    outputs from.

    ``ck.pinned_pool().stats()`` reports it, ``.trim()`` frees what it caches.
    """
    global _process_pool
    pool = _process_pool
    if pool is None:
        with _process_lock:
            if _process_pool is None:
                _process_pool = PinnedPool()
            pool = _process_pool
    return pool
