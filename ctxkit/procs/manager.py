"""The manager thread of a ``DevicePool``: starts, watches and replaces its workers.

Each pool has one such thread (``ctxkit-devicepool``). It waits on every worker's result
pipe and process sentinel, and on a wake-up pipe: it completes futures with their
results, stops a worker whose task ran past its timeout, replaces workers that died or
hit a sticky CUDA error, marks a device whose worker cannot start as broken, and sends
idle workers the releases of the device memory they lent (:mod:`.leases`). Submitting
and sending are :mod:`.dispatch`'s.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import time
from typing import Any

from ..errors import DeviceTaskError
from . import child, devmem, shm, wire
from .dispatch import Dispatcher
from .leases import WorkerKey, _gone
from .tasks import Slot, lost_error
from .worker import worker_main

__all__ = ["Manager"]


class Manager(Dispatcher):
    """The manager thread of a :class:`~ctxkit.procs.DevicePool` (its base class).

    The state below is set by ``DevicePool.__init__``.
    """

    _ctx: Any
    _bind: bool
    _init_payload: bytes
    _terminating: bool
    _wake_r: Any

    def _spawn(self, slot: Slot) -> None:
        result_r, result_w = self._ctx.Pipe(duplex=False)
        task_r, task_w = self._ctx.Pipe(duplex=False)
        prefix = shm.child_prefix()
        proc = self._ctx.Process(
            target=worker_main,
            args=(
                task_r,
                result_w,
                slot.ordinal,
                slot.bind_ordinal,
                slot.visible,
                self._bind,
                os.getpid(),
                self._threshold,
                self._init_payload,
                prefix,
            ),
            name=f"ctxkit-pool-device-{slot.ordinal}",
        )
        try:
            proc.start()
        except BaseException:
            result_r.close()
            task_w.close()
            raise
        finally:
            result_w.close()
            task_r.close()
        slot.proc, slot.result_r, slot.task_w, slot.prefix = proc, result_r, task_w, prefix
        slot.state = "starting"
        slot.deadline = slot.kill_at = slot.timed_out = slot.stop_pending = None
        slot.releases = []

    def _manage(self) -> None:
        try:
            with self._lock:
                for s in self._slots:
                    if not self._terminating:
                        self._spawn(s)
            while True:
                with self._lock:
                    live = [s for s in self._slots if s.proc is not None]
                    if self._shutdown and not live:
                        return
                    wait_s = self._enforce_deadlines(live, time.monotonic())
                    waits: list[Any] = [self._wake_r]
                    waits += [s.result_r for s in live if not s.result_r.closed]
                    waits += [s.proc.sentinel for s in live]
                ready = multiprocessing.connection.wait(waits, wait_s)
                if self._wake_r in ready:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                for s in live:
                    if not s.result_r.closed and s.result_r in ready:
                        self._receive(s)
                for s in live:
                    if s.proc.sentinel in ready:
                        self._exited(s)
                self._flush()
        except BaseException as exc:  # pragma: no cover - a bug here must not hang callers
            self._fail_all(exc)
        finally:
            for conn in (self._wake_r, self._wake_w):
                conn.close()

    def _enforce_deadlines(self, live: list[Slot], now: float) -> float | None:
        """Stop workers past their task's timeout, SIGKILL those past their grace (lock
        held); returns the seconds until the next such moment (``None``: none)."""
        moments = []
        for s in live:
            if s.deadline is not None and now >= s.deadline and s.current is not None:
                s.timed_out, s.deadline, s.state = s.current, None, "restarting"
                s.kill_at = now + child.TERM_GRACE_S
                with contextlib.suppress(Exception):
                    s.proc.terminate()
            if s.kill_at is not None and now >= s.kill_at:
                s.kill_at = None
                with contextlib.suppress(Exception):
                    s.proc.kill()
            moments += [t for t in (s.deadline, s.kill_at) if t is not None]
        return max(0.0, min(moments) - now) if moments else None

    def _flush(self) -> None:
        """Send the releases of the parent's ``WorkerBuffer``s to idle workers (busy ones
        get theirs with the next task), and stop the workers waiting for it once their
        memory is unmapped here (manager thread, no lock across the sends)."""
        with self._lock:
            self._collect_releases()
            idle = []
            for s in self._slots:
                if s.releases and s.state == "idle" and s.current is None:
                    # taken with the lock held: a task sent after this waits for the release
                    s.send_lock.acquire()
                    idle.append((s, s.releases))
                    s.releases = []
                elif s.releases and s.state in ("stopping", "dead", "broken"):
                    s.releases = []
            stops = [
                s
                for s in self._slots
                if s.proc is not None
                and s.stop_pending is not None
                and s.stop_pending == s.proc.pid
            ]
            for s in self._slots:
                s.stop_pending = None
        for s, leases in idle:
            try:
                with contextlib.suppress(OSError, ValueError):
                    s.task_w.send(("release", leases))
            finally:
                s.send_lock.release()
        for s in stops:
            why = (
                "its worker was replaced after a sticky CUDA error"
                if s.state == "restarting"
                else "the DevicePool that returned it was shut down"
            )
            self._close_lent(s, why, synchronize=True)
            with s.send_lock, contextlib.suppress(OSError, ValueError):
                s.task_w.send(None)

    def _close_lent(self, slot: Slot, why: str, synchronize: bool) -> None:
        """Close the parent's ``WorkerBuffer``s of *slot*'s worker (exiting or gone)."""
        if slot.proc is None:
            return
        key = (slot.ordinal, slot.proc.pid)
        self._book.invalidate(key, _gone(key, why), synchronize)

    def _receive(self, slot: Slot) -> None:
        try:
            msg = slot.result_r.recv()
        except (EOFError, OSError):
            slot.result_r.close()
            return
        kind = msg[0]
        if kind == "ready":
            with self._lock:
                nxt = None
                if slot.state == "starting":
                    slot.state = "idle"
                    nxt = self._take(slot)
            if nxt is not None:
                self._send(slot, nxt)
        elif kind == "init_error":
            head = f"DevicePool worker for device {slot.ordinal} failed to start"
            err = wire.error_from(msg[1], slot.ordinal, slot.proc.pid, None, 1, head, "init")
            self._mark_broken(slot, err)
            slot.result_r.close()
        elif kind == "result":
            self._complete(slot, msg[1], msg[2], msg[3])

    def _complete(self, slot: Slot, task_id: int, out: Any, restart: bool) -> None:
        nxt = None
        pid = slot.proc.pid
        key: WorkerKey = (slot.ordinal, pid)
        with self._lock:
            task = slot.current
            if task is None or task.id != task_id:  # terminated under it
                task = None
            else:
                slot.current, slot.deadline = None, None
                if restart:
                    slot.state = "restarting"
                    slot.stop_pending = pid  # once its lent memory is unmapped here
                elif slot.state == "busy":
                    slot.state = "idle"
                    nxt = self._take(slot)
        sent = None
        if task is not None:
            sent, task.payload.devices = task.payload.devices, None  # results may refer to them
            self._drop(task)  # the worker has let go of the arguments' blocks
        if nxt is not None:
            self._send(slot, nxt)
        if task is None:
            if out[0] == "ok":
                shm.discard(out[2])
                self._book.enqueue(key, out[3])
            return
        head = f"task {task.label} on device {slot.ordinal}"
        if out[0] == "ok":
            loader = devmem.ResultLoader(sent, self._book, key)
            try:
                value = wire.decode(out[1], out[2], loader)
            except Exception as exc:
                self._book.enqueue(key, [lease for lease in out[3] if lease not in loader.adopted])
                desc = wire.describe_exception(exc)
                task.future.set_exception(
                    wire.error_from(
                        desc, slot.ordinal, pid, None, 1, head + ": result not loadable"
                    )
                )
            else:
                task.future.set_result(value)
        else:
            task.future.set_exception(wire.error_from(out[1], slot.ordinal, pid, None, 1, head))

    def _exited(self, slot: Slot) -> None:
        slot.proc.join()
        while not slot.result_r.closed and slot.result_r.poll():
            self._receive(slot)
        shm.sweep(slot.prefix)  # blocks of a worker killed while sending a result
        code = slot.proc.exitcode
        pid = slot.proc.pid
        self._close_lent(slot, f"its worker {child.exit_reason(code)}", synchronize=False)
        with self._lock:
            task, slot.current = slot.current, None
            timed_out = task is not None and slot.timed_out is task
            was = slot.state
            slot.result_r.close()
            old_w = slot.task_w
            slot.proc = None
            slot.deadline = slot.kill_at = slot.timed_out = None
            slot.state = "dead" if was != "broken" else "broken"
            if was == "starting" and not self._terminating:
                reason = child.exit_reason(code)
                broken = DeviceTaskError(
                    f"DevicePool worker for device {slot.ordinal} (pid {pid}) {reason} "
                    "while starting (importing ctxkit, binding the context or running the "
                    "initializer)",
                    device=slot.ordinal,
                    kind="init",
                    pid=pid,
                    exitcode=code,
                )
            else:
                broken = None
                if was not in ("stopping", "broken") and not (self._shutdown and not slot.pending):
                    self._spawn(slot)
        with slot.send_lock:
            old_w.close()
        if broken is not None:
            self._mark_broken(slot, broken)
        if task is not None:
            self._drop(task)
            task.future.set_exception(lost_error(slot, task, pid, code, timed_out))

    def _mark_broken(self, slot: Slot, err: DeviceTaskError) -> None:
        with self._lock:
            slot.broken = err
            if slot.proc is not None:
                slot.state = "broken"
            tasks = list(slot.pending)
            slot.pending.clear()
        for t in tasks:
            self._drop(t)
            if t.started or t.future.set_running_or_notify_cancel():
                t.future.set_exception(err)

    def _fail_all(self, exc: BaseException) -> None:  # pragma: no cover - see _manage
        with self._lock:
            self._shutdown = True
            tasks = [t for s in self._slots for t in (*s.pending, s.current) if t is not None]
            procs = [s.proc for s in self._slots if s.proc is not None]
        for p in procs:
            with contextlib.suppress(Exception):
                p.kill()
        for t in tasks:
            with contextlib.suppress(Exception):
                t.future.set_exception(exc)
