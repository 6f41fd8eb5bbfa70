"""How a block of a :class:`~ctxkit.memory.hostpool.PinnedPool` comes back for reuse: the
numpy array over it, the finalizer that returns the block when the array's last view dies
(recording an event on each stream that used it), and the settling of returned blocks,
which wait as *pending* until those events completed and are then cached.

:class:`PinnedReuse` is the base of :class:`~ctxkit.memory.hostpool.PinnedPool`; the
bookkeeping it uses is :class:`~ctxkit.memory.hostledger.PinnedLedger`'s.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import context as _context
from .. import lifetime
from .host import HostMemory
from .hostblocks import Block, event_done
from .hostledger import PinnedLedger

__all__ = ["PinnedReuse"]


class PinnedReuse(PinnedLedger):
    """The return path of :class:`~ctxkit.memory.hostpool.PinnedPool` (not used alone)."""

    _returned: collections.deque[Block]

    # --- arrays over blocks --------------------------------------------------------

    def _wrap(self, block: Block, nbytes: int) -> np.ndarray:
        mem = HostMemory(block.ptr, nbytes, owner=block, context=block.ctx)
        mem._fin = lifetime.finalizer(mem, None, self._give_back, block)
        return np.asarray(mem)

    def _give_back(self, block: Block) -> int:
        """Finalizer of an array's memory (any thread, also inside the collector, even
        while this thread holds the pool's lock, so it takes none of it): record an event
        on each of the block's streams now, then queue the block for :meth:`_settle`. An
        open stream capture holds it back until it ends (:func:`lifetime.free_quietly`)."""
        try:
            if not _context._shutting_down:
                streams, block.streams = block.streams, []  # no array is left to add more
                for s in streams:
                    if s.handle is None:  # closed: waiting for its context blocks, and
                        block.streams.append(s)  # this thread may hold a lock; later
                        continue
                    ev = self._events.record(s)
                    if ev is not None:
                        block.events.append((ev, True))
        finally:
            self._returned.append(block)
        return 0

    def _block_of(self, arr: Any, what: str) -> Block:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"PinnedPool.{what}: expected a numpy array, got {type(arr).__name__}")
        base: Any = arr
        while base is not None:
            if isinstance(base, HostMemory) and isinstance(base.owner, Block):
                block = base.owner
                with self._lock:
                    if self._in_use.get(block.ptr) is block:
                        return block
                break
            base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
        ptr = int(arr.__array_interface__["data"][0] or 0)
        with self._lock:
            for block in self._in_use.values():
                if block.ptr <= ptr < block.ptr + block.nbytes:
                    return block
        raise ValueError(
            f"PinnedPool.{what}: the array at {ptr:#x} is not in a block of this pool "
            "(allocate it with ctxkit.pinned_pool().empty())"
        )

    # --- driver work outside the lock ----------------------------------------------

    def _settle(self) -> None:
        """Wait-list the returned blocks; cache those whose stream work completed."""
        if not (self._returned or self._pending) or _context._shutting_down:
            return
        if not lifetime.begin_free(None, self._settle_after_capture, ()):
            return  # a capture forbids driver calls here; this runs when it ends
        try:
            while self._returned:
                try:
                    block = self._returned.popleft()
                except IndexError:
                    break
                self._return(block)
            self._collect()
        finally:
            lifetime.end_free()

    def _settle_after_capture(self) -> int:
        self._settle()
        return 0

    def _return(self, block: Block) -> None:
        """The last array of *block* died (its events are recorded): wait-list it."""
        for s in block.streams:  # closed before the array died: wait for its context
            self._events.record(s)
        block.streams = []
        with self._lock:
            if not block.usable():
                self._remove_locked(block, "in_use")
                dead = True
            else:
                self._move_locked(block, "in_use", "pending" if block.events else "cached")
                dead = False
        if dead:
            self._free([block])

    def _collect(self) -> None:
        """Cache the pending blocks whose events have all completed (cuEventQuery)."""
        with self._lock:
            pending = list(self._pending)
        done = []
        for block in pending:
            with self._lock:
                events = list(block.events)
            if all(event_done(ev) for ev, _ in events):
                done.append(block)
        dead, spent_all = [], []
        with self._lock:
            for block in done:
                if block not in self._pending:
                    continue
                spent, block.events = block.events, []
                spent_all.extend(spent)
                if block.usable():
                    self._move_locked(block, "pending", "cached")
                else:
                    self._remove_locked(block, "pending")
                    dead.append(block)
        for ev, owned in spent_all:
            if owned:
                self._events.give(ev)
        self._free(dead)

    def _wait(self, blocks: Sequence[Block]) -> None:
        """Wait for the events of *blocks* (GIL released), then collect them."""
        if not blocks:
            return
        if not lifetime.begin_free(None, self._settle_after_capture, ()):
            return
        try:
            for block in blocks:
                with self._lock:
                    events = list(block.events)
                for ev, _ in events:
                    try:
                        with ev.context:  # bound explicitly (strict mode)
                            ev.synchronize()
                    except Exception:
                        pass  # a closed event or a poisoned context: _collect decides
            self._collect()
        finally:
            lifetime.end_free()
