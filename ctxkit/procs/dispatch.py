"""Handing ``DevicePool`` tasks to their workers: checks, placement, queues and sends.

:class:`Dispatcher` is the half of :class:`~ctxkit.procs.DevicePool` that the threads
calling ``submit`` run (and the manager thread, when a worker becomes idle): it checks a
task and picks its device, queues it on that device's :class:`~.tasks.Slot`, takes the
next task of an idle worker and sends it, its large arrays in shared memory within the
pool's budget. The manager thread is :mod:`.manager`; the public methods are
:mod:`.pool`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ..device import Device
from . import child, devmem, shm, wire
from .leases import LeaseBook
from .tasks import Slot, Task, TaskOptions

__all__ = ["Dispatcher"]


class Dispatcher:
    """Submitting and scheduling of a :class:`~ctxkit.procs.DevicePool` (its base class).

    The state below is set by ``DevicePool.__init__``; ``devices`` is ``DevicePool``'s.
    """

    _owner: int
    _shutdown: bool
    _isolate: bool
    _threshold: int | None
    _task_timeout: float | None
    _ids: itertools.count[int]
    _rr: int
    _slots: list[Slot]
    _by_ordinal: dict[int, Slot]
    _lock: threading.Lock
    _shm_lock: threading.Lock
    _shm_used: int
    _shm_limit: int
    _book: LeaseBook
    _manager: threading.Thread
    _wake_w: Any

    if TYPE_CHECKING:

        @property
        def devices(self) -> list[int]: ...

    # --- submitting ----------------------------------------------------------------

    def _owned(self) -> bool:
        return os.getpid() == self._owner

    def _submit(
        self, options: TaskOptions, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Any
    ) -> Future[Any]:
        if not self._owned():
            raise RuntimeError(
                f"this DevicePool belongs to process {self._owner}; a process forked from it "
                "cannot submit work (its workers serve the parent). Create a pool in this "
                "process"
            )
        by_value = wire.check_shippable("DevicePool.submit", fn)
        if self._shutdown:
            raise RuntimeError("cannot submit to a DevicePool after shutdown()")
        payload = wire.Payload.build(
            "DevicePool.submit", (fn, args, kwargs), self._threshold, by_value
        )
        allowed, prefer = self._placement(options, payload.devices)
        timeout = options.timeout if options.timeout is not None else self._task_timeout
        task = Task(next(self._ids), getattr(fn, "__qualname__", repr(fn)), payload, timeout)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to a DevicePool after shutdown()")
            slot = self._pick(options.device, allowed, prefer)
            # sent before submit() returns, or copied first: the caller may reuse its arrays
            task.ready = (slot.state == "idle" and not slot.pending) or not payload.buffers
            slot.pending.append(task)
            nxt = self._take(slot) if slot.state == "idle" else None
        if nxt is not None:
            self._send(slot, nxt)
        if not task.ready:
            try:
                payload.snapshot()
            except BaseException:  # e.g. MemoryError: the task never was
                with self._lock:
                    with contextlib.suppress(ValueError):
                        slot.pending.remove(task)
                    nxt = self._take(slot) if slot.state == "idle" else None
                if nxt is not None:
                    self._send(slot, nxt)
                task.future.cancel()
                raise
            with self._lock:
                task.ready = True
                nxt = self._take(slot) if slot.state == "idle" else None
            if nxt is not None:
                self._send(slot, nxt)
        return task.future

    def _placement(
        self, options: TaskOptions, devices: devmem.Outgoing | None
    ) -> tuple[list[int] | None, int | None]:
        """Where a task with device arguments may run (``None``: anywhere) and where it
        best runs; checked, and the arguments' contexts synchronized, before it is queued."""
        if devices is None:
            return None, None
        if options.device is not None:
            devices.check_target(child.ordinal_of(options.device, False), self._isolate)
            allowed = None
        else:
            allowed = devices.mappable_on(self.devices, self._isolate)
            if not allowed:
                try:
                    devices.check_target(self.devices[0], self._isolate)
                except ValueError as exc:
                    raise ValueError(
                        f"no device of this pool {self.devices} can map the task's device "
                        f"arguments; on device {self.devices[0]}: {exc}"
                    ) from None
        devices.synchronize()
        return allowed, devices.affinity

    # --- scheduling ----------------------------------------------------------------

    def _pick(
        self,
        device: Device | int | None,
        allowed: list[int] | None = None,
        prefer: int | None = None,
    ) -> Slot:
        """The slot for a task: *device*, else the least-loaded healthy one among
        *allowed*, the one of device *prefer* first (it holds the task's memory)."""
        if device is not None:
            ordinal = child.ordinal_of(device, False)
            slot = self._by_ordinal.get(ordinal)
            if slot is None:
                raise ValueError(f"device {ordinal} is not in this pool (devices {self.devices})")
            if slot.broken is not None:
                raise slot.broken
            return slot
        n = len(self._slots)
        healthy = [self._slots[(self._rr + k) % n] for k in range(n)]
        healthy = [s for s in healthy if s.broken is None]
        if not healthy:
            raise self._slots[0].broken  # type: ignore[misc]
        if allowed is not None:
            healthy = [s for s in healthy if s.ordinal in allowed]
            if not healthy:  # every device that can map the arguments is broken
                raise next(s.broken for s in self._slots if s.ordinal in allowed)  # type: ignore[misc]
        same = [s for s in healthy if s.ordinal == prefer]
        slot = same[0] if same else min(healthy, key=lambda s: s.load)
        self._rr = (self._slots.index(slot) + 1) % n
        return slot

    def _take(self, slot: Slot) -> Task | None:
        """The next task for an idle worker, now its current one (lock held); the caller
        sends it with :meth:`_send` after releasing the lock."""
        while slot.pending:
            task = slot.pending[0]
            if not task.ready:
                return None
            slot.pending.popleft()
            if not task.started:
                if not task.future.set_running_or_notify_cancel():
                    self._drop(task)
                    continue
                task.started = True
            slot.current, slot.state = task, "busy"  # before the send: the reply may be quick
            return task
        if self._shutdown:
            self._stop_worker(slot)
        return None

    def _send(self, slot: Slot, task: Task) -> None:
        """Put *task*'s buffers in shared memory (within the budget) and send it (no lock)."""
        try:
            parts, used = task.payload.parts(self._reserve, self._unreserve)
        except BaseException as exc:
            with self._lock:
                mine = slot.current is task
                if mine:
                    slot.current = None
                    if slot.state == "busy":
                        slot.state = "idle"
                nxt = self._take(slot) if mine and slot.state == "idle" else None
            task.future.set_exception(exc)
            if nxt is not None:
                self._send(slot, nxt)
            return
        with self._lock, self._shm_lock:
            mine = slot.current is task
            task.parts, task.shm_bytes = parts, used
            conn = slot.task_w
            releases: list[int] = []
            if mine:  # closed before submit() returned: freed before the task runs
                self._collect_releases()
                releases, slot.releases = slot.releases, []
            if mine and task.timeout is not None:
                slot.deadline = time.monotonic() + task.timeout
        if not mine:  # terminated or failed while its buffers were copied
            self._drop(task)
            return
        if task.timeout is not None and threading.current_thread() is not self._manager:
            self._wake()
        try:
            with slot.send_lock:
                conn.send((task.id, task.payload.data, parts, releases))
            devices = task.payload.devices
            n, nbytes = (len(devices), devices.nbytes) if devices is not None else (0, 0)
            wire.count_sent(task.payload.data, parts, n, nbytes)
        except (OSError, ValueError):  # the worker is gone: run it on the replacement
            self._drop(task, keep_payload=True)
            task.payload.snapshot()  # submit() may have returned by the time it is resent
            with self._lock:
                if slot.current is task:
                    slot.pending.appendleft(task)
                    slot.current, slot.deadline, slot.state = None, None, "restarting"

    def _reserve(self, nbytes: int) -> bool:
        with self._shm_lock:
            if self._shm_used + nbytes > self._shm_limit:
                return False
            self._shm_used += nbytes
            return True

    def _unreserve(self, nbytes: int) -> None:
        with self._shm_lock:
            self._shm_used -= nbytes

    def _drop(self, task: Task, keep_payload: bool = False) -> None:
        """Release what a finished or abandoned task holds: its blocks and budget (and,
        unless *keep_payload*, its pickled arguments)."""
        with self._shm_lock:
            parts, task.parts = task.parts, []
            nbytes, task.shm_bytes = task.shm_bytes, 0
            self._shm_used -= nbytes
        shm.discard(parts)
        if not keep_payload:
            task.payload.release()

    def _stop_worker(self, slot: Slot) -> None:
        """Tell the worker to exit (lock held): the manager thread first closes the
        parent's mappings of the memory it lent (:meth:`_flush`), then sends ``None``."""
        slot.state = "stopping"
        if slot.proc is not None:
            slot.stop_pending = slot.proc.pid
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._wake_w.send_bytes(b"w")

    def _collect_releases(self) -> None:
        """Move the book's queued releases to their live workers' slots (lock held);
        those of workers that are gone are dropped."""
        for (ordinal, pid), leases in self._book.drain().items():
            s = self._by_ordinal.get(ordinal)
            if s is not None and s.proc is not None and s.proc.pid == pid:
                s.releases += leases
