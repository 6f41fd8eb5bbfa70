"""Pin on reuse: keep the pages of pageable arrays that a pipeline sees again registered.

Staging copies every byte twice on the host, registering a chunk just in time costs a
``cuMemHostRegister`` + ``cuMemHostUnregister`` per chunk per call. An application that
calls ``Pipeline.map`` again and again on the same input/output arrays (preallocated
buffers, a training or serving loop) pays neither if the arrays stay page-locked between
calls, the way MPI libraries keep a registration cache. :class:`PinCache` does that:

* the first call that sees a pageable array only notes it (it is staged);
* a later call that sees the same memory again page-locks the array's whole pages once
  (``cuMemHostRegister(PORTABLE)``), and from then on its chunks are DMAed directly;
* a registration is undone when the array's memory owner is collected (its weak
  reference fires before numpy frees the memory), when the cache needs room (least
  recently used first), and by :meth:`PinCache.clear` (``Pipeline.release_pinned`` /
  ``close``).

The memory owner is the last ndarray of the array's ``.base`` chain: it owns the memory
or keeps the object that does alive, and numpy refuses to ``resize`` an array that has
weak references, so the held pages stay the array's own. Ranges that share a page with a
range held already, and pages the driver refuses (registered elsewhere, locked-memory
limit), are never held: those arrays keep the pipeline's other host path.

``cuMemHostUnregister`` waits until the device is idle (measured on H200: a call made
while a 200 ms kernel ran returned with it), so dropping the last reference to a held
array can block that thread until the running work ends; ``Pipeline.release_pinned``
picks the moment instead.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._driver import drv
from ..context import Context
from ..lifetime import free_quietly
from .hostreg import register_pages
from .plan import PAGE, MiB, addr

__all__ = ["MIN_HOLD_BYTES", "PinCache", "default_budget", "memory_owner"]


MIN_HOLD_BYTES = 16 * MiB


MAX_SIGHTINGS = 64


def default_budget() -> int:
    """A quarter of physical memory (at least 4 GiB, at most half of it)."""
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 4 << 30
    return int(min(max(phys // 4, 4 << 30), phys // 2))


def memory_owner(arr: np.ndarray) -> np.ndarray:
    """The ndarray whose lifetime bounds *arr*'s memory: the last ndarray of its ``.base``
    chain (the array itself when it owns its data)."""
    owner = arr
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    return owner


def _page_range(ptr: int, nbytes: int) -> tuple[int, int]:
    return ptr // PAGE * PAGE, -(-(ptr + nbytes) // PAGE) * PAGE


@dataclass(eq=False)
class _Held:
    """One registered range ``[start, end)`` whose memory *owner* keeps it valid."""

    start: int
    end: int
    ctx: Context
    ref: weakref.ref[Any] | None = None
    registered: bool = True
    last_use: int = 0
    users: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def covers(self, start: int, end: int) -> bool:
        return self.start <= start and end <= self.end


class PinCache:
    """Registrations of reused pageable arrays, bounded by *budget* bytes.

    Parameters
    ----------
    budget : int
        Most bytes kept page-locked at once; 0 disables holding.
    """

    def __init__(self, budget: int) -> None:
        self.budget = int(budget)
        self._lock = threading.RLock()
        self._held: dict[int, list[_Held]] = {}
        self._seen: dict[tuple[int, int, int], weakref.ref[Any]] = {}
        self._refused: set[tuple[int, int]] = set()
        self._clock = 0

    @property
    def nbytes(self) -> int:
        """Bytes page-locked now."""
        with self._lock:
            return sum(h.nbytes for hs in self._held.values() for h in hs if h.registered)

    def acquire(self, arr: np.ndarray, ctx: Context, read_only: bool) -> bool:
        """Use *arr* for one map call: True when its pages are (now) held page-locked.

        The first sighting of a memory range only records it; the next one registers it
        (within the budget). A True answer also marks the range in use until
        :meth:`release_users` (it cannot be evicted meanwhile).
        """
        if self.budget <= 0 or arr.nbytes < MIN_HOLD_BYTES:
            return False
        start, end = _page_range(addr(arr), arr.nbytes)
        owner = memory_owner(arr)
        with self._lock:
            self._clock += 1
            held = self._find(owner, start, end)
            if held is None and self._seen_before(owner, start, end):
                held = self._register(owner, start, end, ctx, read_only)
            if held is None:
                return False
            held.last_use = self._clock
            held.users += 1
            return True

    def release_users(self) -> None:
        """The map call is over: every range may be evicted again."""
        with self._lock:
            for hs in self._held.values():
                for h in hs:
                    h.users = 0

    def clear(self) -> int:
        """Unregister every held range; return the bytes released."""
        with self._lock:
            entries = [h for hs in self._held.values() for h in hs]
            self._held.clear()
            self._seen.clear()
            self._refused.clear()
        released = 0
        for h in entries:
            released += h.nbytes if h.registered else 0
            self._unregister(h)
        return released

    # --- internals -------------------------------------------------------------------

    def _find(self, owner: Any, start: int, end: int) -> _Held | None:
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
        self._seen[key] = weakref.ref(owner, self._forget_sighting(key))
        while len(self._seen) > MAX_SIGHTINGS:
            self._seen.pop(next(iter(self._seen)))
        return False

    def _forget_sighting(self, key: tuple[int, int, int]) -> Any:
        me = weakref.ref(self)

        def forget(ref: weakref.ref[Any]) -> None:
            cache = me()
            if cache is None:
                return
            with cache._lock:
                if cache._seen.get(key) is ref:
                    del cache._seen[key]

        return forget

    def _register(
        self, owner: Any, start: int, end: int, ctx: Context, read_only: bool
    ) -> _Held | None:
        if (start, end) in self._refused or not self._make_room(end - start):
            return None
        if any(h.start < end and start < h.end for hs in self._held.values() for h in hs):
            return None
        with ctx:
            err = register_pages(start, end - start, read_only)
        if err:
            self._refused.add((start, end))
            return None
        held = _Held(start, end, ctx)
        key = id(owner)
        held.ref = weakref.ref(owner, self._on_owner_death(key, held))
        self._held.setdefault(key, []).append(held)
        return held

    def _on_owner_death(self, key: int, held: _Held) -> Any:
        """Weak-reference callback: numpy runs it before it frees the owner's memory."""
        me = weakref.ref(self)

        def dead(_ref: weakref.ref[Any]) -> None:
            cache = me()
            if cache is not None:
                with cache._lock:
                    hs = cache._held.get(key, [])
                    if held in hs:
                        hs.remove(held)
                    if not hs:
                        cache._held.pop(key, None)
            PinCache._unregister(held)

        return dead

    def _make_room(self, nbytes: int) -> bool:
        if nbytes > self.budget:
            return False
        used = self.nbytes
        idle = sorted(
            (h for hs in self._held.values() for h in hs if h.registered and not h.users),
            key=lambda h: h.last_use,
        )
        for h in idle:
            if used + nbytes <= self.budget:
                break
            self._evict(h)
            used -= h.nbytes
        return used + nbytes <= self.budget

    def _evict(self, h: _Held) -> None:
        for key, hs in list(self._held.items()):
            if h in hs:
                hs.remove(h)
                if not hs:
                    del self._held[key]
        self._unregister(h)

    @staticmethod
    def _unregister(h: _Held) -> None:
        if h.registered:
            h.registered = False
            free_quietly(h.ctx, drv.cuMemHostUnregister, h.start)
