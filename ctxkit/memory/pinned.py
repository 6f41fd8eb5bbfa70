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

Layout: the blocks (:class:`Block`), size classes, the process budget, the pool's
statistics and the stream work a block waits for before it is reused (events recorded
when its last array dies, kept for reuse in an :class:`EventCache`); then
:class:`PinnedPool` itself: its interface and how it hands blocks out; its books (where
each block is -- in use by live arrays, cached for reuse, pending on stream work -- the
bytes they hold against the budget and the pool's counters, the best-fitting cached block
for a request, eviction of the least recently returned ones, and the driver side of a
block: new page-locked memory for it (:func:`~ctxkit.memory.host.lock_new`) and freeing
it, with the out-of-memory errors that name the budget; the methods named ``*_locked``
expect the pool's lock to be held, the others take it); and how a block comes back for
reuse (the numpy array over it, the finalizer that returns the block when the array's
last view dies, recording an event on each stream that used it, and the settling of
returned blocks, which wait as *pending* until those events completed and are then
cached). Last, :func:`pinned_pool`, the process-wide instance.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _driver, lifetime
from .._env import pinned_pool_bytes
from ..binding import registry as _registry
from ..context import Context, shutting_down
from ..errors import OutOfMemoryError
from ..stream import Event, Stream
from .alloc import OUT_OF_MEMORY, oom
from .host import (
    HostMemory,
    LockedPages,
    LockFailed,
    host_address,
    host_context,
    lock_new,
    plain_dtype,
)
from .sizes import gib, nbytes_arg, shape_nbytes

__all__ = [
    "Block",
    "PinnedPool",
    "PinnedPoolStats",
    "default_budget",
    "fits",
    "pinned_pool",
    "size_class",
]


KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

PAGE = 4 * KiB

GRANULE = 2 * MiB

DEFAULT_CAP = 64 * GiB


def size_class(nbytes: int) -> int:
    """The block size the pool uses for a request of *nbytes* bytes.

    Up to 2 MiB: the next power of two, at least 4 KiB (one page). Above: the next
    multiple of 2 MiB (at most 2 MiB - 1 byte of slack per block). 0 for 0.
    """
    n = nbytes_arg(nbytes, "size_class")
    if n == 0:
        return 0
    if n <= GRANULE:
        return max(PAGE, 1 << (n - 1).bit_length())
    return -(-n // GRANULE) * GRANULE


def fits(block_bytes: int, cls: int) -> bool:
    """A cached block of *block_bytes* may serve a request of class *cls*."""
    return cls <= block_bytes <= cls + cls // 4


def _physical_memory() -> int | None:
    try:
        phys = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None
    with contextlib.suppress(OSError):  # a container's memory limit (cgroup v2) when lower
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            text = f.read().strip()
        if text.isdigit():
            phys = min(phys, int(text))
    return phys


def default_budget() -> int:
    """The process budget: ``CTXKIT_PINNED_POOL_BYTES`` when set, else a quarter of the
    physical memory (or of a container's lower memory limit), at most 64 GiB; 4 GiB where
    the memory size is unknown.

    Each process has its own pool: with several processes per node (MPI ranks,
    ``run_per_device`` workers) set ``CTXKIT_PINNED_POOL_BYTES`` to about a quarter of the
    node's memory divided by the processes per node.
    """
    if (budget := pinned_pool_bytes()) is not None:
        return budget
    phys = _physical_memory()
    return 4 * GiB if phys is None else min(phys // 4, DEFAULT_CAP)


def human(n: int) -> str:
    return gib(n) if n >= GiB else f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class PinnedPoolStats:
    """A snapshot of :meth:`PinnedPool.stats` (bytes are block sizes, see
    :func:`size_class`).

    Attributes
    ----------
    budget : int
        The most bytes the pool may hold page-locked (with *claimed_bytes*).
    in_use_bytes, in_use_blocks
        Blocks under live arrays.
    cached_bytes, cached_blocks
        Blocks ready for reuse.
    pending_bytes, pending_blocks
        Blocks whose arrays died but whose stream work has not completed yet.
    claimed_bytes
        Page-locked memory made elsewhere and counted against the budget
        (:meth:`PinnedPool.claim`).
    requests, hits
        Calls that needed a block; those served from the cache.
    allocations, frees, evictions
        ``cuMemHostAlloc`` and ``cuMemFreeHost`` calls; cached blocks freed to make room.
    peak_bytes
        The most bytes the pool held at once (in use + cached + pending).
    """

    budget: int
    in_use_bytes: int
    in_use_blocks: int
    cached_bytes: int
    cached_blocks: int
    pending_bytes: int
    pending_blocks: int
    claimed_bytes: int
    requests: int
    hits: int
    allocations: int
    frees: int
    evictions: int
    peak_bytes: int

    @property
    def held_bytes(self) -> int:
        """Page-locked bytes the pool holds: in use + cached + pending."""
        return self.in_use_bytes + self.cached_bytes + self.pending_bytes

    @property
    def hit_rate(self) -> float:
        """Share of requests served from the cache (0.0 before the first)."""
        return self.hits / self.requests if self.requests else 0.0


class Block:
    """One page-locked block and what must complete before it is reused."""

    __slots__ = ("ctx", "events", "nbytes", "pages", "ptr", "streams", "where")

    def __init__(self, pages: LockedPages, nbytes: int) -> None:
        self.pages = pages
        self.ptr = pages.ptr
        self.nbytes = nbytes  # the size class; the pages may be a little more
        self.ctx = pages.ctx
        self.streams: list[Stream] = []
        #: ``(event, owned)``: owned events are the pool's (recorded at return time)
        self.events: list[tuple[Event, bool]] = []
        #: where the pool's books have it (:meth:`PinnedPool._put_locked`)
        self.where: str | None = None

    def usable(self) -> bool:
        """False once its context was closed (the memory is gone) or poisoned."""
        return not (self.ctx.closed or self.ctx.poisoned)

    def __repr__(self) -> str:
        return f"<pinned block {self.ptr:#x} nbytes={self.nbytes}>"


def as_streams(stream: Any, what: str) -> list[Stream]:
    """``stream=`` of the pool: None, a stream, or a sequence of streams."""
    items = list(stream) if isinstance(stream, (list, tuple)) else [stream]
    if stream is None:
        return []
    if any(s is None for s in items):
        raise TypeError(f"{what}: stream sequences may not contain None")
    return [s if isinstance(s, Stream) else Stream.from_handle(s) for s in items]


class EventCache:
    """Events of the pool, recorded on a block's streams when its last array dies and
    reused once the block is reusable (one list per context)."""

    def __init__(self) -> None:
        # re-entrant: a finalizer (the collector runs at any allocation) may record an
        # event while this thread is inside the cache
        self._lock = threading.RLock()
        self._spare: dict[int, list[Event]] = {}  # id(context) -> events

    def record(self, stream: Stream) -> Event | None:
        """An event recorded on *stream* now; None when there is nothing to wait for:
        its context is gone, or the stream was closed (no event can be recorded there,
        but its queued work may still run, so the context was waited for)."""
        ctx = stream.context
        if ctx.closed or ctx.poisoned:
            return None
        ev = None
        try:
            ev = self._take(ctx)
            with ctx:  # bound explicitly: finalizers run in threads with no context
                ev.record(stream)
            return ev
        except Exception:
            if ev is not None:
                self.give([(ev, True)])
        sync_quietly(ctx)
        return None

    def _take(self, ctx: Context) -> Event:
        with self._lock:
            spare = self._spare.get(id(ctx))
            while spare:
                ev = spare.pop()
                if ev.context is ctx and ev.handle is not None:
                    return ev
        return Event(timing=False, context=ctx)

    def give(self, events: Sequence[tuple[Event, bool]]) -> None:
        """Keep the pool's own of *events* (``(event, owned)`` pairs) for a later
        :meth:`record` (dropped when their context is gone)."""
        for ev, owned in events:
            ctx = ev.context
            if owned and ev.handle is not None and not (ctx.closed or ctx.poisoned):
                with self._lock:
                    self._spare.setdefault(id(ctx), []).append(ev)


def sync_quietly(ctx: Context) -> None:
    """Wait for all work of *ctx*, never raising."""
    with contextlib.suppress(Exception):  # poisoned: no work of it will run any more
        ctx.synchronize()


def event_done(ev: Event) -> bool:
    """True when the work before *ev* completed (or can no longer run)."""
    ctx = ev.context
    if ctx.closed or ctx.poisoned:
        return True
    if ev.handle is None:  # closed by its owner: wait for everything of its context
        sync_quietly(ctx)
        return True
    try:
        with ctx:  # bound explicitly: strict mode refuses implicit binds
            return ev.query()
    except Exception:
        return ctx.closed or ctx.poisoned


def work_done(block: Block, wait: bool = False) -> bool:
    """True when the stream work *block* waits for completed (``cuEventQuery``), never
    raising; with *wait*, after waiting on the host for it (GIL released). The contexts
    of streams closed before its array died are waited for either way."""
    for s in block.streams:
        sync_quietly(s.context)
    block.streams = []
    for ev, _ in list(block.events):  # a copy: record_event may append
        if not event_done(ev):
            if not wait:
                return False
            # bound explicitly (strict mode refuses implicit binds); never raising: a
            # context poisoned meanwhile has no work left to wait for
            with contextlib.suppress(Exception), ev.context:
                ev.synchronize()
    return True


def free_left(blocks: dict[str, dict[int, Block]], returned: collections.deque[Block]) -> None:
    """Finalizer of a collected pool: free its blocks once their stream work is done."""
    if shutting_down():
        return
    left = [*returned, *blocks["pending"].values()]
    for block in left:
        work_done(block, wait=True)
    for block in [*blocks["cached"].values(), *left]:
        block.pages.release()


class PinnedPool:
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
        self._budget = default_budget() if budget is None else nbytes_arg(budget, "budget", "")
        self._lock = threading.Lock()
        #: the blocks by address, where they are: under live arrays ("in_use"), ready for
        #: reuse ("cached", least recently returned first), waiting for stream work
        self._blocks: dict[str, dict[int, Block]] = {"in_use": {}, "cached": {}, "pending": {}}
        #: blocks whose last array died, appended by finalizers in any thread (no lock)
        self._returned: collections.deque[Block] = collections.deque()
        self._events = EventCache()
        #: bytes of the blocks in each place, of blocks being allocated and of claim()
        self._bytes = dict.fromkeys(("in_use", "cached", "pending", "inflight", "claimed"), 0)
        self._count = dict.fromkeys(
            ("requests", "hits", "allocations", "frees", "evictions", "peak_bytes"), 0
        )
        # A private pool that is collected frees what it caches (arrays keep it alive).
        self._fin = weakref.finalize(self, free_left, self._blocks, self._returned)
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
        self._budget = nbytes_arg(nbytes, "set_budget(nbytes)", "")
        return self._free_cached(self._budget)

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
        if context is not None:  # a wrong context= fails even when the cache serves it
            host_context(context, what)
        cls = size_class(nbytes)
        self._settle()
        with self._lock:
            self._count["requests"] += 1
            block = self._take_cached_locked(cls)
        if block is None:
            block = self._allocate(
                cls, context, what, wait=headroom is None, headroom=headroom or 0
            )
        block.streams = streams
        mem = HostMemory(block.ptr, nbytes, owner=block, context=block.ctx)
        mem.fin = lifetime.finalizer(mem, None, self._give_back, block)
        return np.asarray(mem).view(dt).reshape(shp)

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
            return PinnedPoolStats(
                budget=self._budget,
                **{f"{key}_bytes": n for key, n in self._bytes.items() if key != "inflight"},
                **{f"{where}_blocks": len(blocks) for where, blocks in self._blocks.items()},
                **self._count,
            )

    def trim(self, keep_bytes: int = 0) -> int:
        """Free cached blocks (least recently returned first) until at most *keep_bytes*
        stay cached; return the bytes freed. Blocks in use or waiting for their streams
        are kept."""
        return self._free_cached(nbytes_arg(keep_bytes, "trim(keep_bytes)", ""), trim=True)

    def release(self) -> int:
        """Wait for the stream work of returned blocks, then free every block not in use;
        return the bytes freed. Arrays still alive keep their blocks."""
        self._settle(wait=True)
        return self.trim(0)

    def claim(self, nbytes: int) -> bool:
        """Count *nbytes* of page-locked memory made elsewhere (``cuMemHostRegister`` of
        the caller's arrays) against the budget, freeing cached blocks to make room.
        False, and nothing counted, when it does not fit. Undo with :meth:`unclaim`."""
        n = nbytes_arg(nbytes, "claim(nbytes)", "")
        self._free_cached(self._budget - n)
        with self._lock:
            ok = self._held_locked() + n <= self._budget
            if ok:
                self._bytes["claimed"] += n
        return ok

    def unclaim(self, nbytes: int) -> None:
        """Give back bytes counted by :meth:`claim`."""
        n = nbytes_arg(nbytes, "unclaim(nbytes)", "")
        with self._lock:
            claimed = self._bytes["claimed"]
            if n > claimed:
                raise ValueError(f"unclaim({n}): only {claimed} bytes are claimed")
            self._bytes["claimed"] -= n

    def prefill(self, nbytes: int, count: int = 1, *, context: Any = None) -> int:
        """Make sure *count* cached blocks can serve requests of *nbytes* (allocating the
        missing ones now, e.g. before a first call that needs them); return how many were
        allocated.

        Raises
        ------
        OutOfMemoryError
            As for :meth:`empty`.
        """
        n = nbytes_arg(nbytes, "prefill(nbytes)", "")
        want = nbytes_arg(count, "prefill(count)", "")
        cls = size_class(n)
        if not cls:
            return 0
        self._settle()
        with self._lock:
            have = sum(1 for b in self._blocks["cached"].values() if fits(b.nbytes, cls))
        made = []
        try:
            for _ in range(max(0, want - have)):
                made.append(self._allocate(cls, context, "PinnedPool.prefill", reuse=False))
        finally:
            with self._lock:
                for block in made:
                    self._put_locked(block, "cached")
        return len(made)

    def __repr__(self) -> str:
        b = self._bytes
        return (
            f"<PinnedPool in_use={human(b['in_use'])} cached={human(b['cached'])} "
            f"pending={human(b['pending'])} budget={human(self._budget)}>"
        )

    # --- handing out ---------------------------------------------------------------

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
        waiting without *wait*: OutOfMemoryError instead). New blocks live in the
        registry's shared context of the device."""
        ctx = _registry.context(host_context(context, what).device.ordinal)
        ctx.check_usable()
        need = cls + headroom
        if need > self._budget - self._bytes["claimed"]:
            raise self._over_budget(cls, what)
        # count cls bytes as being allocated: free cached blocks, then wait for pending ones
        for waited in (False, True):
            with self._lock:
                block = self._take_cached_locked(cls) if waited and reuse else None
                if block is not None:
                    return block  # waiting made a cached one that fits available
                victims = self._evict_locked(self._budget - need)
                ok = self._held_locked() + need <= self._budget
                if ok:
                    self._bytes["inflight"] += cls
                pending = bool(self._blocks["pending"])
            self._free(victims)
            if ok:
                break
            if waited or not pending or not wait:
                raise self._over_budget(cls, what)
            self._settle(wait=True)
        try:
            pages = self._lock_new(cls, ctx, what)
        except BaseException:
            with self._lock:
                self._bytes["inflight"] -= cls
            raise
        block = Block(pages, cls)
        with self._lock:
            self._bytes["inflight"] -= cls
            self._put_locked(block, "in_use")
            self._count["allocations"] += 1
        return block

    def _take_cached_locked(self, cls: int) -> Block | None:
        cached = self._blocks["cached"].values()
        for block in [b for b in cached if not b.usable()]:  # their context was closed:
            self._put_locked(block, None)  # only our own mapping is left
            block.pages.release()
        fitting = [b for b in cached if fits(b.nbytes, cls)]
        if not fitting:
            return None
        best = min(reversed(fitting), key=lambda b: b.nbytes)  # the last returned of equal ones
        self._put_locked(best, "in_use")
        self._count["hits"] += 1
        return best

    def _over_budget(self, cls: int, what: str) -> OutOfMemoryError:
        b = self._bytes
        return OutOfMemoryError(
            f"{what}: a block of {cls} bytes ({gib(cls)}) does not fit the pinned pool's "
            f"budget of {self._budget} bytes ({gib(self._budget)}): {b['in_use']} bytes are "
            f"in use by live arrays, {b['pending']} wait for stream work, {b['claimed']} "
            f"are claimed by registrations, {b['inflight']} are being allocated. Drop "
            "arrays you no longer need, or raise the budget: "
            "CTXKIT_PINNED_POOL_BYTES=<bytes> or ctxkit.pinned_pool().set_budget(<bytes>)"
        )

    # --- bookkeeping (callers hold the lock) ---------------------------------------

    def _held_locked(self) -> int:
        return sum(self._bytes.values())

    def _put_locked(self, block: Block, where: str | None) -> None:
        """Move *block* to *where* in the books (``None``: out of them)."""
        if block.where is not None:
            del self._blocks[block.where][block.ptr]
            self._bytes[block.where] -= block.nbytes
        block.where = where
        if where is not None:
            self._blocks[where][block.ptr] = block
            self._bytes[where] += block.nbytes
            held = sum(self._bytes[place] for place in self._blocks)  # in use, cached, pending
            self._count["peak_bytes"] = max(self._count["peak_bytes"], held)

    def _evict_locked(self, limit: int, trim: bool = False) -> list[Block]:
        """Take cached blocks, least recently returned first, until the pool holds at
        most *limit* bytes (with *trim*: caches at most *limit* bytes) or nothing is
        cached; the caller frees them."""
        victims = []
        cached = self._blocks["cached"]
        while cached and (self._bytes["cached"] if trim else self._held_locked()) > limit:
            victim = next(iter(cached.values()))
            self._put_locked(victim, None)
            victims.append(victim)
            self._count["evictions"] += not trim
        return victims

    # --- driver work outside the lock ----------------------------------------------

    def _lock_new(self, nbytes: int, ctx: Context, what: str) -> LockedPages:
        """New page-locked memory (:func:`~ctxkit.memory.host.lock_new`); when the OS
        refuses, every cached block is freed and it is tried once more."""
        for attempt in (1, 2):
            try:
                return lock_new(nbytes, ctx)
            except LockFailed as exc:
                failed = exc
            if failed.code != OUT_OF_MEMORY:
                raise ctx.note_error(failed.code, f"{failed.call}({nbytes}, PORTABLE)") from None
            if attempt == 2 or not self.trim(0):
                break
        with self._lock:
            held = self._held_locked()
        raise oom(
            f"{what}: the OS refused to page-lock {nbytes} bytes ({gib(nbytes)}) of host "
            f"memory ({failed.call}: out of memory) although the pinned pool "
            f"holds only {held} of its {self._budget}-byte budget. "
            "Page-locked memory is limited by physical RAM: lower the budget "
            "(CTXKIT_PINNED_POOL_BYTES or ctxkit.pinned_pool().set_budget()) or drop arrays "
            "you no longer need"
        )

    def _free_cached(self, limit: int, trim: bool = False) -> int:
        """Settle returned blocks, then free cached ones as :meth:`_evict_locked` picks
        them for *limit* and *trim*; the bytes freed."""
        self._settle()
        with self._lock:
            victims = self._evict_locked(limit, trim)
        return self._free(victims)

    def _free(self, blocks: Sequence[Block]) -> int:
        """``cuMemFreeHost`` each block in its context (never raising); the bytes."""
        with self._lock:
            self._count["frees"] += sum(block.usable() for block in blocks)
        for block in blocks:
            self._events.give(block.events)
            block.events = []
            block.pages.release()
        return sum(block.nbytes for block in blocks)

    # --- arrays over blocks --------------------------------------------------------

    def _give_back(self, block: Block) -> int:
        """Finalizer of an array's memory (any thread, also inside the collector, even
        while this thread holds the pool's lock, so it takes none of it): record an event
        on each of the block's streams now, then queue the block for :meth:`_settle`. An
        open stream capture holds it back until it ends (:func:`lifetime.free_quietly`)."""
        try:
            if not shutting_down():
                streams, block.streams = block.streams, []  # no array is left to add more
                for s in streams:
                    ev = None if s.handle is None else self._events.record(s)
                    if ev is not None:
                        block.events.append((ev, True))
                    elif s.handle is None:  # closed: waiting for its context blocks, and
                        block.streams.append(s)  # this thread may hold a lock; later
        finally:
            self._returned.append(block)
        return 0

    def _block_of(self, arr: Any, what: str) -> Block:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"PinnedPool.{what}: expected a numpy array, got {type(arr).__name__}")
        ptr = host_address(arr)
        with self._lock:
            for block in self._blocks["in_use"].values():
                if block.ptr <= ptr < block.ptr + block.nbytes:
                    return block
        raise ValueError(
            f"PinnedPool.{what}: the array at {ptr:#x} is not in a block of this pool "
            "(allocate it with ctxkit.pinned_pool().empty())"
        )

    # --- driver work outside the lock ----------------------------------------------

    def _settle(self, wait: bool = False) -> None:
        """Wait-list the returned blocks, then cache those waiting whose stream work
        completed (:func:`work_done`; with *wait*, after waiting for it) and free those
        whose context is gone."""
        if not (self._returned or self._blocks["pending"]) or shutting_down():
            return
        if not lifetime.begin_free(None, self._settle_after_capture, ()):
            return  # a capture forbids driver calls here; this runs when it ends
        try:
            with self._lock:
                while self._returned:  # finalizers append without the lock, never pop
                    self._put_locked(self._returned.popleft(), "pending")
                # those with no events first: cached in the order they came back
                pending = sorted(self._blocks["pending"].values(), key=lambda b: bool(b.events))
            done = [block for block in pending if work_done(block, wait)]
            dead: list[Block] = []
            spent: list[tuple[Event, bool]] = []
            with self._lock:
                for block in done:
                    if block.where == "pending":  # not settled by another thread meanwhile
                        spent.extend(block.events)
                        block.events = []
                        self._put_locked(block, "cached" if block.usable() else None)
                        if block.where is None:
                            dead.append(block)
            self._events.give(spent)
            self._free(dead)
        finally:
            lifetime.end_free()

    def _settle_after_capture(self) -> int:
        self._settle()
        return 0


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
