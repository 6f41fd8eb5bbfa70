"""``DevicePool``: one long-lived worker process per GPU (re-exported by ``ctxkit.procs``)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing.connection
import multiprocessing.util  # its atexit hook must be registered before ours
import os
import pickle
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from ..device import Device
from ..errors import CudaError, DeviceTaskError
from . import wire
from .wire import SHM_THRESHOLD

__all__ = ["DevicePool"]


_live_pools: weakref.WeakSet[DevicePool] = weakref.WeakSet()


class _Task:
    __slots__ = ("blocks", "data", "future", "id", "label", "started")

    def __init__(self, tid: int, label: str, data: bytes, blocks: wire.Blocks):
        self.id = tid
        self.label = label
        self.data = data
        self.blocks = blocks
        self.future: Future[Any] = Future()
        self.started = False


class _Slot:
    """One device's worker: its process, pipes and queue.

    ``state``: starting -> idle <-> busy; restarting (worker exits after a sticky fault);
    stopping (told to exit); dead (exited, not replaced); broken (cannot start).
    """

    __slots__ = (
        "bind_ordinal",
        "broken",
        "current",
        "ordinal",
        "pending",
        "proc",
        "result_r",
        "state",
        "task_w",
        "visible",
    )

    def __init__(self, ordinal: int, bind_ordinal: int, visible: str | None) -> None:
        self.ordinal = ordinal
        self.bind_ordinal = bind_ordinal
        self.visible = visible
        self.proc: Any = None
        self.task_w: Any = None
        self.result_r: Any = None
        self.state = "dead"
        self.pending: deque[_Task] = deque()
        self.current: _Task | None = None
        self.broken: DeviceTaskError | None = None

    @property
    def load(self) -> int:
        return len(self.pending) + (self.current is not None) + (self.state == "starting")


class DevicePool:
    """One long-lived worker process per device; ``submit`` returns a ``Future``.

    Each worker binds the registry's context of its device once, when it starts, and
    runs tasks one at a time with it current. A worker whose task crashed the process,
    or raised a sticky CUDA error (the context is poisoned), is replaced by a fresh one;
    that task's future gets a :class:`DeviceTaskError`, queued tasks run on the
    replacement. Arrays of ``shm_threshold`` bytes or more travel through shared memory.

    Parameters
    ----------
    devices : sequence of int or Device, optional
        Default: every visible device.
    isolate : bool
        As in :func:`run_per_device`: each worker sees only its device.
    initializer : callable, optional
        Module-level function called as ``initializer(*initargs)`` in each worker after
        its context is bound (e.g. to compile and load kernels once). If it fails, that
        device is marked broken: its queued futures fail and ``submit`` to it raises.
    shm_threshold : int or None
        Byte size from which an array goes through shared memory (``None``: never).
    mp_context : multiprocessing context, optional
        Must be a ``spawn`` context.

    Notes
    -----
    Use as a context manager: a normal exit waits for queued work (``shutdown()``); an
    exception (including ``KeyboardInterrupt``) stops the workers at once
    (:meth:`terminate`), and so does interpreter exit for a pool still running. Workers
    also die with the parent process. Inside a task, :func:`worker_device` gives the
    logical ordinal.
    """

    def __init__(
        self,
        devices: Sequence[Device | int] | None = None,
        *,
        isolate: bool = False,
        initializer: Callable[..., Any] | None = None,
        initargs: Sequence[Any] = (),
        shm_threshold: int | None = SHM_THRESHOLD,
        mp_context: Any = None,
        _bind: bool = True,
    ) -> None:
        self._ctx = wire.spawn_context(mp_context)
        if initializer is not None:
            wire.check_shippable("DevicePool(initializer=)", initializer)
        self._init_payload, _ = wire.pickled("DevicePool", (initializer, tuple(initargs)), None)
        ordinals = wire.resolve_ordinals(devices, _bind)
        visible = wire.visible_for(ordinals, isolate)
        self._slots = [
            _Slot(o, 0 if isolate else o, v) for o, v in zip(ordinals, visible, strict=True)
        ]
        self._by_ordinal = {s.ordinal: s for s in self._slots}
        self._threshold = shm_threshold
        self._bind = _bind
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._rr = 0
        self._shutdown = False
        self._terminating = False
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._manager = threading.Thread(target=self._manage, name="ctxkit-devicepool", daemon=True)
        self._manager.start()
        _live_pools.add(self)

    # --- public API ----------------------------------------------------------------

    @property
    def devices(self) -> list[int]:
        """The device ordinals of the workers, in order."""
        return [s.ordinal for s in self._slots]

    @property
    def pids(self) -> dict[int, int | None]:
        """Current worker process id per device (``None`` while none is running)."""
        with self._lock:
            return {s.ordinal: s.proc.pid if s.proc is not None else None for s in self._slots}

    def submit(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        device: Device | int | None = None,
        **kwargs: Any,
    ) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on a worker; returns its ``Future``.

        ``device=None`` picks the least-loaded device (queued + running tasks; ties go
        round-robin). A failure in the worker sets a :class:`DeviceTaskError` on the
        future.

        Raises
        ------
        RuntimeError
            The pool was shut down.
        DeviceTaskError
            The chosen device's worker could not start (``kind == "init"``).
        TypeError
            ``fn`` or the arguments cannot be pickled.
        ValueError
            *device* is not one of the pool's devices.
        """
        wire.check_shippable("DevicePool.submit", fn)
        if self._shutdown:
            raise RuntimeError("cannot submit to a DevicePool after shutdown()")
        data, blocks = wire.pickled("DevicePool.submit", (fn, args, kwargs), self._threshold)
        task = _Task(next(self._ids), getattr(fn, "__qualname__", repr(fn)), data, blocks)
        try:
            with self._lock:
                if self._shutdown:
                    raise RuntimeError("cannot submit to a DevicePool after shutdown()")
                slot = self._pick(device)
                slot.pending.append(task)
                if slot.state == "idle":
                    self._dispatch(slot)
        except BaseException:
            wire.discard(blocks)
            raise
        return task.future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; workers finish their queues and exit.

        ``cancel_futures=True`` cancels queued (not yet running) tasks first. With
        ``wait=True`` returns once every worker has exited.
        """
        cancelled: list[_Task] = []
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                for s in self._slots:
                    cancelled += [t for t in s.pending if not t.started]
                    s.pending = deque(t for t in s.pending if t.started)
            for s in self._slots:
                if s.state == "idle" and not s.pending:
                    self._stop_worker(s)
        for t in cancelled:
            wire.discard(t.blocks)
            t.future.cancel()
        self._wake()
        if wait and threading.current_thread() is not self._manager:
            self._manager.join()

    def terminate(self) -> None:
        """Stop every worker now (SIGTERM, then SIGKILL); unfinished futures fail.

        Running tasks get a :class:`DeviceTaskError` with ``kind == "terminated"``, queued
        ones are cancelled. Returns once the workers are gone.
        """
        with self._lock:
            self._shutdown = True
            self._terminating = True
            tasks = [t for s in self._slots for t in s.pending]
            running = [(s, s.current) for s in self._slots if s.current is not None]
            for s in self._slots:
                s.pending.clear()
                s.current = None
                if s.proc is not None:
                    s.state = "stopping"
                    with contextlib.suppress(Exception):
                        s.proc.terminate()
        for t in tasks:
            wire.discard(t.blocks)
            if t.started:
                t.future.set_exception(self._terminated_error(None, t))
            else:
                t.future.cancel()
        for s, t in running:
            wire.discard(t.blocks)
            t.future.set_exception(self._terminated_error(s, t))
        self._wake()
        if threading.current_thread() is not self._manager:
            self._manager.join()

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.shutdown(wait=True)
        else:
            self.terminate()

    def __repr__(self) -> str:
        state = "shut down" if self._shutdown else "running"
        return f"<DevicePool devices={self.devices} {state}>"

    # --- scheduling (lock held) ----------------------------------------------------

    def _pick(self, device: Device | int | None) -> _Slot:
        if device is not None:
            ordinal = wire.ordinal_of(device, False)
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
        slot = min(healthy, key=lambda s: s.load)
        self._rr = (self._slots.index(slot) + 1) % n
        return slot

    def _dispatch(self, slot: _Slot) -> None:
        while slot.pending:
            task = slot.pending.popleft()
            if not task.started:
                if not task.future.set_running_or_notify_cancel():
                    wire.discard(task.blocks)
                    continue
                task.started = True
            slot.current, slot.state = task, "busy"  # before the send: the reply may be quick
            try:
                slot.task_w.send((task.id, task.data, task.blocks))
            except (OSError, ValueError):
                slot.pending.appendleft(task)
                slot.current, slot.state = None, "restarting"
            return
        if self._shutdown:
            self._stop_worker(slot)

    def _stop_worker(self, slot: _Slot) -> None:
        slot.state = "stopping"
        with contextlib.suppress(OSError, ValueError):
            slot.task_w.send(None)

    def _spawn(self, slot: _Slot) -> None:
        result_r, result_w = self._ctx.Pipe(duplex=False)
        task_r, task_w = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_worker_main,
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
        slot.proc, slot.result_r, slot.task_w = proc, result_r, task_w
        slot.state = "starting"

    # --- the manager thread --------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._wake_w.send_bytes(b"w")

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
                    waits: list[Any] = [self._wake_r]
                    waits += [s.result_r for s in live if not s.result_r.closed]
                    waits += [s.proc.sentinel for s in live]
                wait_s = wire.TERM_GRACE_S if self._terminating else None
                ready = multiprocessing.connection.wait(waits, wait_s)
                if self._wake_r in ready:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                if self._terminating and not ready:
                    for s in live:
                        with contextlib.suppress(Exception):
                            s.proc.kill()
                for s in live:
                    if not s.result_r.closed and s.result_r in ready:
                        self._receive(s)
                for s in live:
                    if s.proc.sentinel in ready:
                        self._exited(s)
        except BaseException as exc:  # pragma: no cover - a bug here must not hang callers
            self._fail_all(exc)
        finally:
            for conn in (self._wake_r, self._wake_w):
                conn.close()

    def _receive(self, slot: _Slot) -> None:
        try:
            msg = slot.result_r.recv()
        except (EOFError, OSError):
            slot.result_r.close()
            return
        kind = msg[0]
        if kind == "ready":
            with self._lock:
                if slot.state == "starting":
                    slot.state = "idle"
                    self._dispatch(slot)
        elif kind == "init_error":
            head = f"DevicePool worker for device {slot.ordinal} failed to start"
            err = wire.error_from(msg[1], slot.ordinal, slot.proc.pid, None, 1, head, "init")
            self._mark_broken(slot, err)
            slot.result_r.close()
        elif kind == "result":
            self._complete(slot, msg[1], msg[2], msg[3])

    def _complete(self, slot: _Slot, task_id: int, out: Any, restart: bool) -> None:
        with self._lock:
            task = slot.current
            if task is None or task.id != task_id:  # terminated under it
                task = None
            else:
                slot.current = None
                if restart:
                    slot.state = "restarting"
                elif slot.state == "busy":
                    slot.state = "idle"
                    self._dispatch(slot)
        if task is None:
            if out[0] == "ok":
                wire.discard(out[2])
            return
        pid = slot.proc.pid
        head = f"task {task.label} on device {slot.ordinal}"
        if out[0] == "ok":
            try:
                value = wire.decode(out[1], out[2])
            except Exception as exc:
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

    def _exited(self, slot: _Slot) -> None:
        slot.proc.join()
        while not slot.result_r.closed and slot.result_r.poll():
            self._receive(slot)
        code = slot.proc.exitcode
        pid = slot.proc.pid
        with self._lock:
            task, slot.current = slot.current, None
            was = slot.state
            slot.result_r.close()
            slot.task_w.close()
            slot.proc = None
            slot.state = "dead" if was != "broken" else "broken"
            if was == "starting" and not self._terminating:
                reason = wire.exit_reason(code)
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
        if broken is not None:
            self._mark_broken(slot, broken)
        if task is not None:
            wire.discard(task.blocks)
            task.future.set_exception(
                DeviceTaskError(
                    f"task {task.label} on device {slot.ordinal}: worker process {pid} "
                    f"{wire.exit_reason(code)} while running it; the worker was replaced. "
                    "A native crash, os._exit(), the OOM killer or a fatal GPU fault look "
                    "like this",
                    device=slot.ordinal,
                    kind="crash",
                    pid=pid,
                    exitcode=code,
                )
            )

    def _mark_broken(self, slot: _Slot, err: DeviceTaskError) -> None:
        with self._lock:
            slot.broken = err
            if slot.proc is not None:
                slot.state = "broken"
            tasks = list(slot.pending)
            slot.pending.clear()
        for t in tasks:
            wire.discard(t.blocks)
            if t.started or t.future.set_running_or_notify_cancel():
                t.future.set_exception(err)

    def _terminated_error(self, slot: _Slot | None, task: _Task) -> DeviceTaskError:
        where = f" on device {slot.ordinal}" if slot is not None else ""
        return DeviceTaskError(
            f"task {task.label}{where}: the DevicePool was terminated before it finished",
            device=slot.ordinal if slot is not None else -1,
            kind="terminated",
        )

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


def _worker_main(
    task_r: Any,
    result_w: Any,
    ordinal: int,
    bind_ordinal: int,
    visible: str | None,
    bind: bool,
    parent_pid: int,
    threshold: int | None,
    init_payload: bytes,
) -> None:
    """Entry point of a ``DevicePool`` worker (spawned)."""
    wire.current_device = ordinal
    with contextlib.ExitStack() as stack:
        try:
            wire.child_setup(parent_pid, visible)
            ctx = stack.enter_context(wire.bound_context(bind_ordinal, bind))
            initializer, initargs = pickle.loads(init_payload)
            if initializer is not None:
                initializer(*initargs)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                result_w.send(("init_error", wire.describe_exception(exc)))
            return
        result_w.send(("ready", os.getpid()))
        _serve(task_r, result_w, ordinal, ctx, threshold)


def _serve(task_r: Any, result_w: Any, ordinal: int, ctx: Any, threshold: int | None) -> None:
    from ..errors import STICKY_CODES, ContextPoisonedError

    while True:
        try:
            msg = task_r.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, data, blocks = msg
        restart = False
        try:
            fn, args, kwargs = wire.decode(data, blocks)
            value = fn(*args, **kwargs)
            out: tuple[Any, ...] = ("ok", *wire.result_bytes(fn, ordinal, value, threshold))
        except BaseException as exc:
            out = ("error", wire.describe_exception(exc))
            restart = isinstance(exc, ContextPoisonedError) or (
                isinstance(exc, CudaError) and exc.code in STICKY_CODES
            )
        fn = args = kwargs = value = None
        if ctx is not None and ctx.poisoned:
            restart = True
        try:
            result_w.send(("result", task_id, out, restart))
        except (OSError, ValueError):
            if out[0] == "ok":
                wire.discard(out[2])
            return
        if restart:
            return


@atexit.register
def _terminate_live_pools() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.terminate()
