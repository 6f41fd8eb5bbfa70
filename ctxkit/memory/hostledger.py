"""The books of a :class:`~ctxkit.memory.hostpool.PinnedPool`: where each block is (in
use by live arrays, cached for reuse, pending on stream work), the bytes they hold against
the budget and the pool's counters; the best-fitting cached block for a request, eviction
of the least recently returned ones, and the driver side of a block: new page-locked
memory for it (:func:`~ctxkit.memory.pagelock.lock_new`) and freeing it, with the
out-of-memory errors that name the budget.

:class:`PinnedLedger` is the base of :class:`~ctxkit.memory.hostreuse.PinnedReuse` and so of
:class:`~ctxkit.memory.hostpool.PinnedPool`, which creates the state declared here; the
methods named ``*_locked`` expect the pool's lock to be held, the others take it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from ..context import Context
from ..errors import OutOfMemoryError
from .hostblocks import POOL_ENV, Block, EventCache, fits, gib
from .pagelock import LockedPages, LockFailed, lock_new

__all__ = ["PinnedLedger"]


_OUT_OF_MEMORY = 2


class PinnedLedger:
    """The bookkeeping part of :class:`~ctxkit.memory.hostpool.PinnedPool` (not used alone)."""

    _budget: int
    _lock: threading.Lock
    _in_use: dict[int, Block]
    _cached: collections.OrderedDict[int, Block]
    _pending: list[Block]
    _events: EventCache
    _bytes: dict[str, int]
    _claimed: int
    _count: dict[str, int]

    # --- handing out ---------------------------------------------------------------

    def _take_cached_locked(self, cls: int) -> Block | None:
        best: Block | None = None
        dead = []
        for block in self._cached.values():
            if not block.usable():
                dead.append(block)
            elif fits(block.nbytes, cls) and (best is None or block.nbytes <= best.nbytes):
                best = block
        for block in dead:  # their context was closed: only our own mapping is left
            self._pop_cached_locked(block.ptr)
            block.pages.release()
        if best is None:
            return None
        self._pop_cached_locked(best.ptr)
        self._add_locked(best, "in_use")
        self._count["hits"] += 1
        return best

    def _over_budget(self, cls: int, what: str) -> OutOfMemoryError:
        b = self._bytes
        return OutOfMemoryError(
            f"{what}: a block of {cls} bytes ({gib(cls)}) does not fit the pinned pool's "
            f"budget of {self._budget} bytes ({gib(self._budget)}): {b['in_use']} bytes are "
            f"in use by live arrays, {b['pending']} wait for stream work, {self._claimed} "
            f"are claimed by registrations, {b['inflight']} are being allocated. Drop "
            "arrays you no longer need, or raise the budget: "
            f"{POOL_ENV}=<bytes> or ctxkit.pinned_pool().set_budget(<bytes>)"
        )

    # --- bookkeeping (callers hold the lock) ---------------------------------------

    def _held_locked(self) -> int:
        b = self._bytes
        return b["in_use"] + b["cached"] + b["pending"] + b["inflight"] + self._claimed

    def _add_locked(self, block: Block, where: str) -> None:
        if where == "in_use":
            self._in_use[block.ptr] = block
        elif where == "cached":
            self._cached[block.ptr] = block
        else:
            self._pending.append(block)
        self._bytes[where] += block.nbytes
        held = self._held_locked() - self._claimed - self._bytes["inflight"]
        self._count["peak"] = max(self._count["peak"], held)

    def _remove_locked(self, block: Block, where: str) -> None:
        if where == "in_use":
            del self._in_use[block.ptr]
        elif where == "cached":
            del self._cached[block.ptr]
        else:
            self._pending.remove(block)
        self._bytes[where] -= block.nbytes

    def _move_locked(self, block: Block, src: str, dst: str) -> None:
        self._remove_locked(block, src)
        self._add_locked(block, dst)

    def _pop_cached_locked(self, ptr: int) -> Block:
        block = self._cached[ptr]
        self._remove_locked(block, "cached")
        return block

    def _evict_locked(self, limit: int) -> list[Block]:
        """Take cached blocks, least recently returned first, until the pool holds at
        most *limit* bytes (or nothing is cached); the caller frees them."""
        victims = []
        while self._cached and self._held_locked() > limit:
            victims.append(self._pop_cached_locked(next(iter(self._cached))))
            self._count["evictions"] += 1
        return victims

    # --- driver work outside the lock ----------------------------------------------

    def _host_alloc(self, nbytes: int, ctx: Context, what: str) -> LockedPages:
        try:
            return lock_new(nbytes, ctx)
        except LockFailed as exc:
            if exc.code != _OUT_OF_MEMORY:
                raise ctx.note_error(exc.code, f"{exc.call}({nbytes}, PORTABLE)") from None
            with self._lock:
                held = self._held_locked()
            raise OutOfMemoryError(
                f"{what}: the OS refused to page-lock {nbytes} bytes ({gib(nbytes)}) of host "
                f"memory ({exc.call}: out of memory) although the pinned pool "
                f"holds only {held} of its {self._budget}-byte budget. "
                "Page-locked memory is limited by physical RAM: lower the budget "
                f"({POOL_ENV} or ctxkit.pinned_pool().set_budget()) or drop arrays you no "
                "longer need",
                _OUT_OF_MEMORY,
                "CUDA_ERROR_OUT_OF_MEMORY",
            ) from None

    def _free(self, blocks: Sequence[Block]) -> int:
        """``cuMemFreeHost`` each block in its context (never raising); the bytes."""
        freed = 0
        for block in blocks:
            for ev, owned in block.events:
                if owned:
                    self._events.give(ev)
            block.events = []
            if block.usable():
                with self._lock:
                    self._count["frees"] += 1
            block.pages.release()
            freed += block.nbytes
        return freed
