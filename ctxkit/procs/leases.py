"""Device memory a ``DevicePool`` task returned: mapped in the parent, kept by the worker.

A task that returns a ``DeviceBuffer`` or ``DeviceArray`` allocated in its worker gives
the parent a :class:`WorkerBuffer` (inside a ``DeviceArray`` of the same shape and dtype
for an array): an :class:`~ctxkit.memory.ImportedBuffer` mapped over the worker's memory
(``cuIpcOpenMemHandle`` in the parent's registry context of that GPU), no copy. The
worker keeps the memory alive until the parent lets go of it:

* when the parent's ``WorkerBuffer`` is closed (``close()``) or collected, the parent
  unmaps it first (``cuIpcCloseMemHandle``), then tells the worker, which frees it. The
  release travels with the worker's next task, or on its own when the worker is idle,
  so a busy worker's pipe never fills with them.
* the memory lives no longer than the worker process. When the pool shuts down
  (``shutdown()``, leaving ``with``), the parent synchronizes each such buffer's context
  and closes the buffer before it tells the worker to exit; when the worker dies (a
  crash, a timeout, ``terminate()``) or is replaced after a sticky CUDA error, the
  parent closes its buffers. A closed ``WorkerBuffer`` raises ``ContextClosedError``
  that says why: copy what must outlive the pool (``copy_to_host``, ``copy_to``, a new
  ``DeviceBuffer``) before it shuts down.

Passing a ``WorkerBuffer`` to another task works: its worker resolves it to its own
object without mapping anything; another worker (of this pool or another, or a
``run_per_device`` child) maps it with the worker's handle while the parent keeps the
buffer (and so the lease) alive for the task.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:  # pragma: no cover
    from ..memory.device import DeviceBuffer
    from ..memory.ipc import IpcBufferHandle
    from .workerbuffer import WorkerBuffer

__all__ = ["LeaseBook", "WorkerKey"]


#: A worker process of a pool: ``(device ordinal, pid)``.
WorkerKey = tuple[int, int]


class LeaseBook:
    """A pool's ``WorkerBuffer``s by worker, and the releases waiting to be sent.

    *wake* tells the pool's manager thread that releases are queued (it must not block
    or take locks: it runs in finalizers, in whatever thread collects a buffer).
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._live: dict[WorkerKey, weakref.WeakSet[WorkerBuffer]] = {}
        self._released: deque[tuple[WorkerKey, int]] = deque()
        self._wake = wake

    def adopt(
        self, key: WorkerKey, handle: IpcBufferHandle, lease: int, owner: str
    ) -> WorkerBuffer:
        """Map the memory of worker *key*'s *lease* (``cuIpcOpenMemHandle``)."""
        from ..memory.ipc import import_buffer
        from .workerbuffer import Info, Lease, WorkerBuffer, release

        imp = cast("DeviceBuffer", import_buffer(handle))
        token = Lease()
        fin = weakref.finalize(token, release, imp, self, key, lease)
        fin.atexit = False
        buf = cast(WorkerBuffer, WorkerBuffer.from_pointer(imp.ptr, imp.nbytes, imp.context, token))
        buf._info = Info(handle, lease, owner)
        with self._lock:
            self._live.setdefault(key, weakref.WeakSet()).add(buf)
        return buf

    def enqueue(self, key: WorkerKey, leases: Iterable[int]) -> None:
        """Queue releases of *key*'s leases for the manager to send."""
        added = False
        for lease in leases:
            self._released.append((key, lease))
            added = True
        if added:
            self._wake()

    def drain(self) -> dict[WorkerKey, list[int]]:
        """The queued releases, by worker (and the queue emptied)."""
        out: dict[WorkerKey, list[int]] = {}
        while True:
            try:
                key, lease = self._released.popleft()
            except IndexError:
                return out
            out.setdefault(key, []).append(lease)

    def live(self, key: WorkerKey | None = None) -> int:
        """Open ``WorkerBuffer``s (of worker *key*, or of every worker)."""
        with self._lock:
            sets = [self._live.get(key, ())] if key is not None else list(self._live.values())
            return sum(1 for s in sets for b in list(s) if not b.closed)

    def workers(self) -> list[WorkerKey]:
        """The workers that have lent buffers (open or not yet forgotten)."""
        with self._lock:
            return list(self._live)

    def invalidate(self, key: WorkerKey, why: str, synchronize: bool) -> int:
        """Close every ``WorkerBuffer`` of worker *key*, which is exiting or gone; using
        one afterwards raises ``ContextClosedError`` saying *why*. With *synchronize*,
        first wait for the work queued in their contexts. Returns how many were open."""
        with self._lock:
            bufs = [b for b in list(self._live.pop(key, ())) if not b.closed]
        if synchronize:
            seen: set[int] = set()
            for b in bufs:
                if id(b.context) not in seen:
                    seen.add(id(b.context))
                    try:
                        b.context.synchronize()
                    except Exception:  # a poisoned context: close anyway
                        pass
        for b in bufs:
            b._info.why = why
            b.close()
        return len(bufs)


def _gone(key: WorkerKey, why: str) -> str:
    ordinal, pid = key
    return (
        f"{why}: the worker of device {ordinal} (pid {pid}) held this memory, which this "
        "process may no longer use. Copy what must outlive the worker (copy_to_host, "
        "copy_to, a new DeviceBuffer) while the pool still runs"
    )
