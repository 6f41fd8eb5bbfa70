"""Pin on reuse: keep the pages of pageable arrays that pipelines see again registered.

Staging copies every byte twice on the host, registering a chunk just in time costs a
``cuMemHostRegister`` + ``cuMemHostUnregister`` per chunk per call. An application that
calls ``Pipeline.map`` again and again on the same input/output arrays (preallocated
buffers, a training or serving loop) pays neither if the arrays stay page-locked between
calls, the way MPI libraries keep a registration cache. :class:`PinCache` does that:

* the first call that sees a pageable array only notes it (it is staged);
* a later call that sees the same memory again page-locks the array's bytes once
  (``cuMemHostRegister(PORTABLE)``), and from then on its chunks are DMAed directly;
* a registration is undone when the array's memory owner is collected (its weak
  reference fires before numpy frees the memory), when the cache needs room (least
  recently used first), and when no Pipeline keeps it any more
  (``Pipeline.release_pinned`` / ``close``).

There is one cache per process (:func:`process_pins`), shared by every Pipeline: a
registration made for one pipeline serves the others. Its registrations count against the
process's one budget of page-locked memory, that of the pinned pool
(:func:`ctxkit.pinned_pool`, ``CTXKIT_PINNED_POOL_BYTES``), through
:meth:`~ctxkit.memory.pinned.PinnedPool.claim`: a range is held only when the pool can
make room for it (it frees cached blocks for that), so staging buffers, pooled outputs
and held arrays together never exceed the budget. Each Pipeline's claims
(:class:`PinClaims`) are bounded by its ``pin_cache_bytes`` too.

The memory owner is the last ndarray of the array's ``.base`` chain: it owns the memory
or keeps the object that does alive, and numpy refuses to ``resize`` an array that has
weak references, so the held bytes stay the array's own. The driver keeps a registration
as the exact byte range asked for (the pages it locks may be shared with other memory,
and those bytes stay pageable), and it refuses any copy that starts inside a
registration and ends beyond it. So the range held runs from the array's first byte to
the end of its owner's bytes (:func:`hold_range`): a pageable copy by anyone (PyTorch,
CuPy, ctxkit) of the owner, of any view of it, or of a neighbour sharing the array's
first or last page goes through as before. Ranges that overlap a held range, and
memory the driver refuses (registered elsewhere, locked-memory limit), are never held:
those arrays keep the pipeline's other host path.

When the owner dies its pages are unregistered at once, never later: freed memory that
stayed registered would make a new array numpy places there look pinned, and the device
would DMA to pages that are no longer the array's. So the unregister does not wait for an
open stream capture (it runs in relaxed capture mode, :func:`~.staging.relaxed_capture`),
and when the registering context was closed or poisoned it runs in another usable one.

``cuMemHostUnregister`` waits until the device is idle (measured on H200: a call made
while a 200 ms kernel ran returned with it), so dropping the last reference to a held
array can block that thread until the running work ends; ``Pipeline.release_pinned``
picks the moment instead.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _driver, lifetime
from ..context import Context
from ..errors import PinLeakWarning
from ..memory.host import register_conflict_hooks, strand
from ..memory.pinned import PinnedPool, pinned_pool
from .plan import MiB, addr
from .staging import NO_USABLE_CONTEXT, register_pages, unregister_pages

__all__ = [
    "MIN_HOLD_BYTES",
    "PinCache",
    "PinClaims",
    "hold_range",
    "memory_owner",
    "process_pins",
]


MIN_HOLD_BYTES = 16 * MiB


MAX_SIGHTINGS = 64


_NOT_REGISTERED = 713


def memory_owner(arr: np.ndarray) -> np.ndarray:
    """The ndarray whose lifetime bounds *arr*'s memory: the last ndarray of its ``.base``
    chain (the array itself when it owns its data)."""
    owner = arr
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner


def hold_range(arr: np.ndarray, owner: np.ndarray) -> tuple[int, int]:
    """The bytes pin on reuse registers for *arr*: from its first byte to the end of its
    memory *owner*'s bytes (or of its own, when it ends later).

    The driver refuses a copy that starts inside a registration and ends beyond it, so
    a registration ending inside the owner would fail a pageable copy of any view of the
    owner that runs past *arr*'s end (``owner`` whole when *arr* is ``owner[:n]``)."""
    ptr = addr(arr)
    return ptr, max(ptr + arr.nbytes, _last_byte(owner) + 1)


def _last_byte(a: np.ndarray) -> int:
    """The address of the last byte of *a*'s memory, whatever its strides."""
    if not a.size:
        return addr(a) - 1
    reach = sum((n - 1) * st for n, st in zip(a.shape, a.strides, strict=True) if st > 0)
    return addr(a) + reach + a.itemsize - 1


@dataclass(eq=False)
class Held:
    """One registered range ``[start, end)`` whose memory owner keeps it valid.

    *contexts* may unregister it (the registering one first); *pool* counts its bytes
    against its budget (claimed); *claims* are the pipelines keeping it; *users* the map
    calls using it now (it is not released while they run). *registered* turns False
    once it is unregistered or stranded (see :meth:`PinCache.strand_poisoned`): then it
    is no longer the cache's to undo.
    """

    start: int
    end: int
    contexts: list[Context]
    pool: PinnedPool
    ref: Any = None  # a weak reference to the memory owner (set once registered)
    registered: bool = True
    last_use: int = 0
    users: int = 0
    claims: weakref.WeakSet[PinClaims] = field(default_factory=weakref.WeakSet)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class PinCache:
    """Registrations of reused pageable arrays, counted against the budget of the
    process's pinned pool (:meth:`PinnedPool.claim <ctxkit.memory.PinnedPool.claim>`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held: list[Held] = []
        # (id(owner), start, end) -> the owner, weakly: ranges seen once / refused by the driver
        self._seen: dict[tuple[int, int, int], weakref.ref[Any]] = {}
        self._refused: dict[tuple[int, int, int], weakref.ref[Any]] = {}
        self._clock = 0
        self._warned_stranded = False

    @property
    def nbytes(self) -> int:
        """Bytes page-locked now."""
        return self.claimed_bytes(None)

    def claimed_bytes(self, claims: PinClaims | None) -> int:
        """Bytes of the ranges *claims* keeps (``None``: of every range)."""
        with self._lock:
            return sum(h.nbytes for h in self._held if claims is None or claims in h.claims)

    def acquire(
        self, arr: np.ndarray, contexts: list[Context], read_only: bool, claims: PinClaims
    ) -> Held | None:
        """Use *arr* for one map call: its held range (now registered if this is its
        second sighting and it fits), or None. Pair a range with :meth:`done`."""
        limit = min(pinned_pool().budget, claims.limit)
        if limit <= 0 or arr.nbytes < MIN_HOLD_BYTES:
            return None
        owner = memory_owner(arr)
        start, end = hold_range(arr, owner)
        with self._lock:
            self._clock += 1
            held = next(
                (h for h in self._held if h.ref() is owner and h.start <= start < end <= h.end),
                None,
            )
            if held is None:
                held = self._register(owner, start, end, contexts, read_only, claims, limit)
                if held is None:
                    return None
            elif claims not in held.claims and self._make_room(claims, held.nbytes, limit):
                held.claims.add(claims)
            held.contexts.extend(c for c in contexts if c not in held.contexts)
            held.last_use = self._clock
            held.users += 1
            return held

    def done(self, held: Iterable[Held]) -> None:
        """A map call stopped using the ranges *held*; those nobody keeps are released."""
        with self._lock:
            for h in held:
                h.users -= 1
                if not h.users and not h.claims:
                    self._evict(h)

    def drop(self, claims: PinClaims) -> int:
        """*claims* keeps nothing any more; return the bytes it kept. Ranges nobody else
        keeps (and no map uses) are unregistered."""
        released = 0
        with self._lock:
            for h in list(self._held):
                if claims in h.claims:
                    h.claims.discard(claims)
                    released += h.nbytes
                    if not h.claims and not h.users:
                        self._evict(h)
        return released

    def release_range(self, start: int, end: int) -> int:
        """Let go of the held ranges overlapping ``[start, end)`` that no map uses now
        and return their bytes: the caller is about to page-lock that memory itself
        (``register_host``), and the driver refuses a registration overlapping one of
        pin on reuse's."""
        with self._lock:
            free = [h for h in self._held if h.start < end and start < h.end and not h.users]
            for h in free:
                self._evict(h)
        return sum(h.nbytes for h in free)

    def strand_poisoned(self) -> int:
        """Keep the owners of ranges registered in a poisoned context alive until the
        process exits; return their bytes.

        No context can unregister those pages any more (on current drivers a fault
        poisons every context of the process), so their memory must never be freed:
        numpy would hand registered pages to a new array. Called when a pipeline sees a
        poisoned context; warns once."""
        kept = 0
        with self._lock:
            for h in list(self._held):
                if any(c.poisoned for c in h.contexts):
                    self._held.remove(h)
                    h.registered = False
                    strand(h.ref())
                    kept += h.nbytes
        if kept and not self._warned_stranded:
            self._warned_stranded = True
            warnings.warn(
                f"ctxkit: a fault poisoned the context of {kept} bytes of arrays kept "
                "page-locked by pin on reuse; they can no longer be unregistered, so their "
                "memory stays allocated (and locked) until the process exits",
                PinLeakWarning,
                stacklevel=3,
            )
        return kept

    # --- internals -------------------------------------------------------------------

    @staticmethod
    def _note(table: dict[tuple[int, int, int], weakref.ref[Any]], key: Any, owner: Any) -> None:
        """Put *key* in *table* with a weak reference to *owner* (an entry whose owner
        died matches nothing); the table keeps the :data:`MAX_SIGHTINGS` newest."""
        table[key] = weakref.ref(owner)
        while len(table) > MAX_SIGHTINGS:
            table.pop(next(iter(table)))

    def _register(
        self,
        owner: Any,
        start: int,
        end: int,
        contexts: list[Context],
        read_only: bool,
        claims: PinClaims,
        limit: int,
    ) -> Held | None:
        """Hold the range if it was seen before (the sighting is used up), never refused,
        overlaps no held range and fits; None when it is not held."""
        key = (id(owner), start, end)
        # the first sighting: noted, staged
        if (prev := self._seen.pop(key, None)) is None or prev() is not owner:
            self._note(self._seen, key, owner)
            return None
        if (refused := self._refused.get(key)) is not None and refused() is owner:
            return None
        if any(h.start < end and start < h.end for h in self._held):
            return None
        nbytes, pool = end - start, pinned_pool()
        if not self._make_room(claims, nbytes, limit, pool):
            return None
        with contexts[0]:
            err = register_pages(start, nbytes, read_only)
        if err:
            pool.unclaim(nbytes)
            self._note(self._refused, key, owner)
            return None
        held = Held(start, end, list(contexts), pool)
        held.claims.add(claims)
        held.ref = weakref.ref(owner, self._on_owner_death(held))
        self._held.append(held)
        return held

    def _on_owner_death(self, held: Held) -> Any:
        """Weak-reference callback: numpy runs it before it frees the owner's memory."""
        me = weakref.ref(self)

        def dead(_ref: weakref.ref[Any]) -> None:
            if _driver.in_forked_child():
                return  # the registration is the parent's
            cache = me()
            if cache is None:
                _unregister(held)
                return
            with cache._lock:
                cache._evict(held)

        return dead

    def _make_room(
        self, claims: PinClaims, nbytes: int, limit: int, pool: PinnedPool | None = None
    ) -> bool:
        """Let idle ranges go (least recently used first) until *nbytes* more fit
        *claims*' *limit* and, given a *pool*, are claimed from its budget (the pool frees
        cached blocks for them too). False: do not hold."""
        if nbytes > limit:
            return False
        idle = sorted((h for h in self._held if not h.users), key=lambda h: h.last_use)
        mine = self.claimed_bytes(claims)
        for h in idle:
            if mine + nbytes <= limit:
                break
            if claims in h.claims:
                h.claims.discard(claims)
                mine -= h.nbytes
                if not h.claims:
                    self._evict(h)
        if mine + nbytes > limit:
            return False
        idle = [h for h in idle if h.registered]
        while pool is not None and not pool.claim(nbytes):
            if not idle:
                return False
            self._evict(idle.pop(0))
        return True

    def _evict(self, h: Held) -> None:
        if h in self._held:
            self._held.remove(h)
        _unregister(h)


def _unregister(h: Held) -> None:
    """Undo *h*'s registration now (see the module notes); never raises (each failure is
    a :class:`~ctxkit.errors.PinLeakWarning` naming its range)."""
    if not h.registered:
        return
    h.registered = False
    try:
        err = unregister_pages(h.start, h.contexts)
    except Exception as exc:  # a finalizer must not raise
        err, why = NO_USABLE_CONTEXT, repr(exc)
    else:
        why = "every context that could unregister them is closed or poisoned"
    if err in (0, _NOT_REGISTERED):
        h.pool.unclaim(h.nbytes)
        return
    if err != NO_USABLE_CONTEXT:  # still page-locked: it stays counted against the budget
        why = f"cuMemHostUnregister failed with CUresult {err}"
    with suppress(Exception):  # runs in finalizers: never raise
        warnings.warn(
            f"ctxkit: pin on reuse could not unregister {h.nbytes} bytes at {h.start:#x} "
            f"({why}); those pages stay page-locked until the process exits",
            PinLeakWarning,
            stacklevel=2,
        )


class PinClaims:
    """One Pipeline's share of the process's :class:`PinCache` (the *claims* its methods
    take), at most *limit* bytes (``None``: the pool's budget; 0: hold nothing; checked
    by :class:`~ctxkit.pipeline.PipelineOptions`)."""

    def __init__(self, cache: PinCache, limit: int | None) -> None:
        self.cache = cache
        self._limit = limit

    @property
    def limit(self) -> int:
        """Most bytes this share may keep page-locked."""
        return pinned_pool().budget if self._limit is None else self._limit

    def release(self) -> int:
        """Keep nothing page-locked any more; return the bytes released."""
        return self.cache.drop(self)


_process: PinCache | None = None


_process_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_process_lock")
_driver.renew_at_fork(__name__, "_process._lock", threading.RLock)


register_conflict_hooks.append(lambda start, end: _process and _process.release_range(start, end))


def _context_closing(ctx: Context) -> None:
    """Undo the idle ranges *ctx* registered while it exists: destroying a context drops
    its registrations (a ``PORTABLE`` one too), so another pipeline keeping them would
    take pageable pages for page-locked ones. A later sighting holds them again."""
    cache = _process
    if cache is None:
        return
    with cache._lock:
        for h in [h for h in cache._held if h.contexts[0] is ctx and not h.users]:
            cache._evict(h)


lifetime.on_context_close(_context_closing)


def process_pins() -> PinCache:
    """The process's pin cache (created at first use), counted against the budget of
    the process's pinned pool."""
    global _process
    with _process_lock:
        if _process is None:
            _process = PinCache()
        return _process
