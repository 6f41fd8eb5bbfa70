"""The blocks of the pinned pool (:mod:`ctxkit.memory.hostpool`): size classes, the
process budget, the pool's statistics, and the stream work a block waits for before it is
reused (events recorded when its last array dies, kept for reuse in an
:class:`EventCache`)."""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass
from typing import Any

from .. import context as _context
from .. import lifetime
from .._driver import drv
from ..context import Context
from ..stream import Event, Stream
from .pagelock import LockedPages
from .sizes import nbytes_arg

__all__ = [
    "DEFAULT_CAP",
    "GRANULE",
    "POOL_ENV",
    "Block",
    "EventCache",
    "PinnedPoolStats",
    "as_streams",
    "check_bytes",
    "default_budget",
    "event_done",
    "fits",
    "free_left",
    "gib",
    "human",
    "size_class",
    "sync_quietly",
]


KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


PAGE = 4 * KiB


#: Requests up to this size round up to a power of two; larger ones to a multiple of it.
GRANULE = 2 * MiB


#: The default budget is a quarter of physical memory, at most this much.
DEFAULT_CAP = 64 * GiB


POOL_ENV = "CTXKIT_PINNED_POOL_BYTES"


def size_class(nbytes: int) -> int:
    """The block size the pool uses for a request of *nbytes* bytes.

    Up to 2 MiB: the next power of two, at least 4 KiB (one page). Above: the next
    multiple of 2 MiB (at most 2 MiB - 1 byte of slack per block). 0 for 0.
    """
    n = int(nbytes)
    if n < 0:
        raise ValueError(f"size_class: nbytes must be >= 0, got {n}")
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
    try:  # a container's memory limit (cgroup v2) when it is lower
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            text = f.read().strip()
        if text.isdigit():
            phys = min(phys, int(text))
    except OSError:
        pass
    return phys


def default_budget() -> int:
    """The process budget: ``CTXKIT_PINNED_POOL_BYTES`` when set, else a quarter of the
    physical memory (or of a container's lower memory limit), at most 64 GiB; 4 GiB where
    the memory size is unknown.

    Each process has its own pool: with several processes per node (MPI ranks,
    ``run_per_device`` workers) set ``CTXKIT_PINNED_POOL_BYTES`` to about a quarter of the
    node's memory divided by the processes per node.
    """
    value = os.environ.get(POOL_ENV, "").strip()
    if value:
        try:
            budget = int(value)
        except ValueError:
            budget = -1
        if budget < 0:
            raise ValueError(
                f"{POOL_ENV}={value!r}: give the most bytes of page-locked host memory the "
                "pinned pool may hold in this process, as an integer >= 0"
            )
        return budget
    phys = _physical_memory()
    if phys is None:
        return 4 * GiB
    return min(phys // 4, DEFAULT_CAP)


def check_bytes(value: Any, what: str) -> int:
    return nbytes_arg(value, what, "")


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


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

    __slots__ = ("ctx", "events", "nbytes", "pages", "ptr", "streams")

    def __init__(self, pages: LockedPages, nbytes: int) -> None:
        self.pages = pages
        self.ptr = pages.ptr
        self.nbytes = nbytes  # the size class; the pages may be a little more
        self.ctx = pages.ctx
        self.streams: list[Stream] = []
        #: ``(event, owned)``: owned events are the pool's (recorded at return time)
        self.events: list[tuple[Event, bool]] = []

    def usable(self) -> bool:
        """False once its context was closed (the memory is gone) or poisoned."""
        return not (self.ctx.closed or self.ctx.poisoned)

    def __repr__(self) -> str:
        return f"<pinned block {self.ptr:#x} nbytes={self.nbytes}>"


def as_streams(stream: Any, what: str) -> list[Stream]:
    """``stream=`` of the pool: None, a stream, or a sequence of streams."""
    if stream is None:
        return []
    items = list(stream) if isinstance(stream, (list, tuple)) else [stream]
    out = []
    for s in items:
        if s is None:
            raise TypeError(f"{what}: stream sequences may not contain None")
        out.append(s if isinstance(s, Stream) else Stream.from_handle(s))
    return out


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
        try:
            ev = self._take(ctx)
        except Exception:
            sync_quietly(ctx)
            return None
        try:
            with ctx:  # bound explicitly: finalizers run in threads with no context
                ev.record(stream)
            return ev
        except Exception:
            self.give(ev)
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

    def give(self, ev: Event) -> None:
        """Keep *ev* for a later :meth:`record` (dropped when its context is gone)."""
        ctx = ev.context
        if ev.handle is None or ctx.closed or ctx.poisoned:
            return
        with self._lock:
            self._spare.setdefault(id(ctx), []).append(ev)


def sync_quietly(ctx: Context) -> None:
    """Wait for all work of *ctx*, never raising."""
    try:
        ctx.synchronize()
    except Exception:
        pass  # poisoned: no work of it will run any more


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


def free_left(
    cached: dict[int, Block], pending: list[Block], returned: collections.deque[Block]
) -> None:
    """Finalizer of a collected pool: free its blocks once their stream work is done."""
    if _context._shutting_down:
        return
    for block in returned:
        for s in block.streams:
            try:
                with s.context:
                    s.synchronize()
            except Exception:
                sync_quietly(s.context)
    for block in [*returned, *pending]:
        for ev, _ in block.events:
            if not event_done(ev):
                try:
                    with ev.context:
                        ev.synchronize()
                except Exception:
                    pass
    for block in [*cached.values(), *pending, *returned]:
        if block.usable():
            lifetime.free_quietly(block.ctx, drv.cuMemFreeHost, block.ptr)
