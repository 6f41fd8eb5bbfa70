"""Pin on reuse: keep the pages of pageable arrays that pipelines see again registered.

Staging copies every byte twice on the host, registering a chunk just in time costs a
``cuMemHostRegister`` + ``cuMemHostUnregister`` per chunk per call. An application that
calls ``Pipeline.map`` again and again on the same input/output arrays (preallocated
buffers, a training or serving loop) pays neither if the arrays stay page-locked between
calls, the way MPI libraries keep a registration cache. :class:`PinCache` does that:

* the first call that sees a pageable array only notes it (it is staged);
* a later call that sees the same memory again page-locks the whole pages inside the
  array once (``cuMemHostRegister(PORTABLE)``), and from then on its chunks are DMAed
  directly;
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
weak references, so the held pages stay the array's own. Only the whole pages inside the
array are registered, never its partial first and last page: arrays smaller than the
mmap threshold come from the heap, back to back with other memory, and a registration
rounded out to pages would cover a neighbour's bytes. The driver refuses any copy whose
host range spans a registration's edge, so a pageable copy of that neighbour by anyone
(PyTorch, CuPy, ctxkit) would fail. The pipeline moves the bytes on the partial pages
through its pinned bounce buffer (:func:`~.plan.held_pieces`). Ranges that overlap a
held range, and pages the driver refuses (registered elsewhere, locked-memory limit),
are never held: those arrays keep the pipeline's other host path.

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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _driver
from ..context import Context
from ..errors import PinLeakWarning
from ..memory.pinned import PinnedPool, pinned_pool
from .plan import PAGE, MiB, addr
from .staging import NO_USABLE_CONTEXT, register_pages, unregister_pages

__all__ = [
    "MIN_HOLD_BYTES",
    "PinCache",
    "PinClaims",
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


def _whole_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """The whole pages inside ``[ptr, ptr + nbytes)``, as ``(start, end)``."""
    return -(-ptr // PAGE) * PAGE, (ptr + nbytes) // PAGE * PAGE


@dataclass(eq=False)
class Held:
    """One registered range ``[start, end)`` whose memory owner keeps it valid.

    *contexts* may unregister it (the registering one first); *claims* are the
    pipelines keeping it; *users* the map calls using it now (it is not released
    while they run); a *stranded* range can no longer be unregistered (see
    :meth:`PinCache.strand_poisoned`).
    """

    start: int
    end: int
    contexts: list[Context]
    ref: weakref.ref[Any] | None = None
    registered: bool = True
    last_use: int = 0
    users: int = 0
    claims: weakref.WeakSet[PinClaims] = field(default_factory=weakref.WeakSet)
    stranded: bool = False
    pool: PinnedPool | None = None  # whose budget counts the range (claimed)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def covers(self, start: int, end: int) -> bool:
        return self.start <= start and end <= self.end


class PinCache:
    """Registrations of reused pageable arrays, counted against a pinned pool's budget.

    Parameters
    ----------
    cap : int, optional
        Most bytes kept page-locked at once (0 disables holding); default: the pool's
        budget.
    pool : PinnedPool, optional
        The pool whose budget the registrations count against (:meth:`PinnedPool.claim`);
        default: the process's, :func:`ctxkit.pinned_pool`.
    """

    def __init__(self, cap: int | None = None, pool: PinnedPool | None = None) -> None:
        self._cap = cap
        self._pool = pool
        self._lock = threading.RLock()
        self._held: dict[int, list[Held]] = {}
        self._seen: dict[tuple[int, int, int], weakref.ref[Any]] = {}
        self._refused: dict[tuple[int, int, int], weakref.ref[Any]] = {}
        self._stranded: list[tuple[Held, Any]] = []
        self._clock = 0
        self._warned_stranded = False

    @property
    def pool(self) -> PinnedPool:
        """The pinned pool whose budget the registrations count against."""
        return self._pool if self._pool is not None else pinned_pool()

    @property
    def budget(self) -> int:
        """Most bytes the cache may keep page-locked: its cap, at most the pool's budget."""
        budget = self.pool.budget
        return budget if self._cap is None else min(self._cap, budget)

    @property
    def nbytes(self) -> int:
        """Bytes page-locked now."""
        return sum(h.nbytes for h in self._entries() if h.registered)

    def claimed_bytes(self, claims: PinClaims) -> int:
        """Bytes of the ranges *claims* keeps."""
        return sum(h.nbytes for h in self._entries() if h.registered and claims in h.claims)

    def acquire(
        self, arr: np.ndarray, contexts: list[Context], read_only: bool, claims: PinClaims
    ) -> Held | None:
        """Use *arr* for one map call: its held range (now registered if this is its
        second sighting and it fits), or None. Pair a range with :meth:`done`."""
        limit = min(self.budget, claims.limit)
        if limit <= 0 or arr.nbytes < MIN_HOLD_BYTES:
            return None
        start, end = _whole_pages(addr(arr), arr.nbytes)
        if end <= start:
            return None
        owner = memory_owner(arr)
        with self._lock:
            self._clock += 1
            held = self._find(owner, start, end)
            if held is None:
                if not self._seen_before(owner, start, end):
                    return None
                held = self._register(owner, start, end, contexts, read_only, claims, limit)
                if held is None:
                    return None
            elif claims not in held.claims and self._make_room(0, claims, held.nbytes, limit):
                held.claims.add(claims)
            held.contexts.extend(c for c in contexts if c not in held.contexts)
            held.last_use = self._clock
            held.users += 1
            return held

    def done(self, held: Held) -> None:
        """A map call stopped using *held*; nobody keeping it, it is released."""
        with self._lock:
            held.users -= 1
            if not held.users and not held.claims:
                self._evict(held)

    def drop(self, claims: PinClaims) -> int:
        """*claims* keeps nothing any more; return the bytes it kept. Ranges nobody else
        keeps (and no map uses) are unregistered."""
        released = 0
        with self._lock:
            for h in self._entries():
                if claims in h.claims:
                    h.claims.discard(claims)
                    released += h.nbytes if h.registered else 0
                    if not h.claims and not h.users:
                        self._evict(h)
        return released

    def strand_poisoned(self) -> int:
        """Keep the owners of ranges registered in a poisoned context alive until the
        process exits; return their bytes.

        No context can unregister those pages any more (on current drivers a fault
        poisons every context of the process), so their memory must never be freed:
        numpy would hand registered pages to a new array. Called when a pipeline sees a
        poisoned context; warns once."""
        kept = 0
        with self._lock:
            for h in self._entries():
                if h.registered and any(c.poisoned for c in h.contexts):
                    self._forget(h)
                    h.stranded = True
                    self._stranded.append((h, h.ref() if h.ref is not None else None))
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

    def _entries(self) -> list[Held]:
        with self._lock:
            return [h for hs in list(self._held.values()) for h in hs]

    def _find(self, owner: Any, start: int, end: int) -> Held | None:
        for h in self._held.get(id(owner), ()):
            if h.registered and h.ref is not None and h.ref() is owner and h.covers(start, end):
                return h
        return None

    def _seen_before(self, owner: Any, start: int, end: int) -> bool:
        """Record the sighting; True when the same range of the same owner was seen."""
        key = (id(owner), start, end)
        prev = self._seen.pop(key, None)
        if prev is not None and prev() is owner:
            return True
        self._seen[key] = self._note(self._seen, key, owner)
        while len(self._seen) > MAX_SIGHTINGS:
            self._seen.pop(next(iter(self._seen)))
        return False

    def _was_refused(self, owner: Any, start: int, end: int) -> bool:
        ref = self._refused.get((id(owner), start, end))
        return ref is not None and ref() is owner

    def _note(
        self, table: dict[tuple[int, int, int], weakref.ref[Any]], key: Any, owner: Any
    ) -> weakref.ref[Any]:
        """A weak reference to *owner* that removes *key* from *table* when it dies."""
        me = weakref.ref(self)

        def forget(ref: weakref.ref[Any]) -> None:
            cache = me()
            if cache is None:
                return
            with cache._lock:
                if table.get(key) is ref:
                    del table[key]

        return weakref.ref(owner, forget)

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
        if self._was_refused(owner, start, end):
            return None
        nbytes = end - start
        if not self._make_room(nbytes, claims, nbytes, limit):
            return None
        if any(h.start < end and start < h.end for h in self._entries() if h.registered):
            return None
        pool = self.pool
        if not self._claim(pool, nbytes):
            return None
        with contexts[0]:
            err = register_pages(start, nbytes, read_only)
        if err:
            pool.unclaim(nbytes)
            key = (id(owner), start, end)
            self._refused[key] = self._note(self._refused, key, owner)
            return None
        held = Held(start, end, list(contexts), pool=pool)
        held.claims.add(claims)
        held.ref = weakref.ref(owner, self._on_owner_death(held))
        self._held.setdefault(id(owner), []).append(held)
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

    def _make_room(self, nbytes: int, claims: PinClaims, claim_bytes: int, limit: int) -> bool:
        """Evict idle ranges (least recently used first) until *nbytes* more fit the
        budget and *claim_bytes* more fit *claims*' *limit*."""
        if nbytes > self.budget or claim_bytes > limit:
            return False
        idle = sorted(
            (h for h in self._entries() if h.registered and not h.users),
            key=lambda h: h.last_use,
        )
        used = self.nbytes
        for h in idle:
            if used + nbytes <= self.budget:
                break
            self._evict(h)
            used -= h.nbytes
        mine = self.claimed_bytes(claims)
        for h in idle:
            if mine + claim_bytes <= limit:
                break
            if h.registered and claims in h.claims:
                h.claims.discard(claims)
                mine -= h.nbytes
                if not h.claims:
                    self._evict(h)
        return used + nbytes <= self.budget and mine + claim_bytes <= limit

    def _claim(self, pool: PinnedPool, nbytes: int) -> bool:
        """Count *nbytes* against *pool*'s budget; when the pool cannot make room, release
        idle ranges (least recently used first) until it can. False: do not hold."""
        idle = sorted(
            (h for h in self._entries() if h.registered and not h.users),
            key=lambda h: h.last_use,
        )
        while not pool.claim(nbytes):
            if not idle:
                return False
            self._evict(idle.pop(0))
        return True

    def _forget(self, h: Held) -> None:
        for key, hs in list(self._held.items()):
            if h in hs:
                hs.remove(h)
                if not hs:
                    del self._held[key]

    def _evict(self, h: Held) -> None:
        self._forget(h)
        _unregister(h)


def _unregister(h: Held) -> None:
    """Undo *h*'s registration now (see the module notes); never raises (each failure is
    a :class:`~ctxkit.errors.PinLeakWarning` naming its range)."""
    if not h.registered or h.stranded:
        return
    h.registered = False
    try:
        err = unregister_pages(h.start, h.contexts)
    except Exception as exc:  # a finalizer must not raise
        err, why = NO_USABLE_CONTEXT, repr(exc)
    else:
        why = "every context that could unregister them is closed or poisoned"
    if err in (0, _NOT_REGISTERED):
        if h.pool is not None:
            h.pool.unclaim(h.nbytes)
        return
    if err != NO_USABLE_CONTEXT:  # still page-locked: it stays counted against the budget
        why = f"cuMemHostUnregister failed with CUresult {err}"
    try:
        warnings.warn(
            f"ctxkit: pin on reuse could not unregister {h.nbytes} bytes at {h.start:#x} "
            f"({why}); those pages stay page-locked until the process exits",
            PinLeakWarning,
            stacklevel=2,
        )
    except Exception:  # runs in finalizers: never raise
        pass


class PinClaims:
    """One Pipeline's share of the process's :class:`PinCache`, at most *limit* bytes
    (``None``: the cache's budget; 0: hold nothing)."""

    def __init__(self, cache: PinCache, limit: int | None) -> None:
        bad = isinstance(limit, bool) or not isinstance(limit, int) or limit < 0
        if limit is not None and bad:
            raise ValueError(
                "pin_cache_bytes must be a byte count >= 0 (0 turns pin on reuse off), "
                f"not {limit!r}"
            )
        self.cache = cache
        self._limit = limit

    @property
    def limit(self) -> int:
        """Most bytes this share may keep page-locked."""
        return self.cache.budget if self._limit is None else self._limit

    @property
    def nbytes(self) -> int:
        """Bytes kept page-locked for this share."""
        return self.cache.claimed_bytes(self)

    def acquire(self, arr: np.ndarray, contexts: list[Context], read_only: bool) -> Held | None:
        """See :meth:`PinCache.acquire`."""
        return self.cache.acquire(arr, contexts, read_only, self)

    def done(self, held: Iterable[Held]) -> None:
        """The map call that acquired *held* is over."""
        for h in held:
            self.cache.done(h)

    def release(self) -> int:
        """Keep nothing page-locked any more; return the bytes released."""
        return self.cache.drop(self)


_process: PinCache | None = None


_process_lock = threading.Lock()
_driver.renew_at_fork(__name__, "_process_lock")
_driver.renew_at_fork(__name__, "_process._lock", threading.RLock)


def process_pins() -> PinCache:
    """The process's pin cache (created at first use), counted against the budget of
    the process's pinned pool."""
    global _process
    with _process_lock:
        if _process is None:
            _process = PinCache()
        return _process
