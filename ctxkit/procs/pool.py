"""``DevicePool``: one long-lived worker process per GPU, a ``concurrent.futures.Executor``.

The class holds what its users call (the constructor, ``submit``, ``submit_to``,
``shutdown``, ``terminate``, the context manager), the scheduling that the threads
calling ``submit`` run (checking, placing, queueing and sending tasks, their large arrays
in shared memory within the pool's budget), and the manager thread
(``ctxkit-devicepool``). That thread waits on every worker's result pipe and process
sentinel, and on a wake-up pipe: it completes futures with their results, stops a worker
whose task ran past its timeout, replaces workers that died or hit a sticky CUDA error,
marks a device whose worker cannot start as broken, and sends idle workers the releases
of the device memory they lent (:class:`~.devmem.LeaseBook`).

The worker process's side (:func:`worker_main`, at the end): set up once, then run tasks
until told to stop. Messages from the parent: ``(task_id, data, parts, releases)`` (a
task, after the leases it releases), ``("release", leases)`` (sent while the worker is
idle) and ``None`` (exit). Replies: ``("ready", pid)``, ``("init_error", desc)`` and
``("result", task_id, out, restart)`` with ``out`` = ``("ok", data, parts, leases)``
(``leases``: the device memory of the result this worker now keeps for the parent) or
``("error", desc)``. A worker that must restart (a sticky CUDA error) while it still
keeps memory for the parent waits for the parent's ``None``: the parent closes its
mappings of that memory first.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import multiprocessing.connection
import multiprocessing.util  # its atexit hook must be registered before ours
import os
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

from ..context import Context
from ..device import Device
from ..errors import DeviceTaskError
from . import devmem, spawn, wire
from .devmem import LeaseBook, WorkerKey
from .wire import SHM_THRESHOLD

__all__ = ["DevicePool", "TaskOptions"]


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    """Where and how long one :class:`DevicePool` task runs (``pool.submit_to(options, ...)``).

    Attributes
    ----------
    device : int, Device or Context, optional
        The pool device to run on (its least-loaded lane where it has several), or the
        lane of a green or owned Context the pool was given; ``None`` picks the
        least-loaded worker.
    timeout : float, optional
        Seconds the task may run once it is sent to its worker, loading its function and
        arguments included (time spent queued does not count; the worker's start-up and
        ``initializer`` do not either); ``None`` uses the pool's ``task_timeout``. A
        task still running then is stopped with its worker, which is replaced; its
        future fails with a :class:`DeviceTaskError` of ``kind == "timeout"``.
    """

    device: Context | Device | int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        spawn.check_timeout(self.timeout, "TaskOptions(timeout=)")


@dataclasses.dataclass(eq=False, slots=True)
class Task:
    """One submitted task: its pickled call, its future, and what it holds once sent."""

    id: int
    label: str
    payload: wire.Payload
    timeout: float | None
    parts: list[wire.Part] = dataclasses.field(default_factory=list)  # buffers once sent
    shm_bytes: int = 0  # bytes of the pool's shared-memory budget it holds
    ready: bool = True  # False while submit() still copies its buffers
    future: Future[Any] = dataclasses.field(default_factory=Future)
    started: bool = False


@dataclasses.dataclass(eq=False, slots=True)
class Slot:
    """One lane's worker: its process, pipes and queue.

    ``state``: starting -> idle <-> busy; restarting (worker exits after a sticky fault,
    or is being stopped for a timeout); stopping (told to exit); dead (exited, not
    replaced); broken (cannot start). ``stop_pending`` (a worker's pid): the manager
    thread closes the parent's mappings of that worker's memory, then sends it ``None``.
    """

    lane: spawn.LaneSpec
    key: spawn.LaneKey  # in pool.pids
    visible: str | None
    proc: Any = None
    task_w: Any = None
    result_r: Any = None
    # one writer on task_w; close it only under this lock
    send_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    prefix: str = ""
    state: str = "dead"
    pending: deque[Task] = dataclasses.field(default_factory=deque)
    current: Task | None = None
    broken: DeviceTaskError | None = None
    deadline: float | None = None  # the current task's timeout
    kill_at: float | None = None  # SIGKILL if still alive then
    timed_out: Task | None = None
    releases: list[int] = dataclasses.field(default_factory=list)  # sent with the next message
    stop_pending: int | None = None  # pid to send None once its memory is unmapped

    @property
    def ordinal(self) -> int:
        return self.lane.ordinal

    @property
    def load(self) -> int:
        return len(self.pending) + (self.current is not None) + (self.state == "starting")


def lost_error(
    slot: Slot, task: Task, pid: int, code: int | None, timed_out: bool
) -> DeviceTaskError:
    """The error of a task whose worker died under it (or was stopped for its timeout)."""
    head = f"task {task.label} on {slot.lane}"
    kind = "timeout" if timed_out else "crash"
    if timed_out:
        msg = (
            f"{head} did not finish within {task.timeout:g} s: worker process {pid} was "
            f"stopped ({spawn.exit_reason(code)}) and replaced"
        )
    else:
        msg = (
            f"{head}: worker process {pid} {spawn.exit_reason(code)} while running it; the "
            f"worker was replaced. {spawn.death_hint(code)}"
        )
    return DeviceTaskError(msg, device=slot.ordinal, kind=kind, pid=pid, exitcode=code)


def terminated_error(slot: Slot | None, task: Task) -> DeviceTaskError:
    """The error of a task the pool was terminated under."""
    where = f" on {slot.lane}" if slot is not None else ""
    return DeviceTaskError(
        f"task {task.label}{where}: the DevicePool was terminated before it finished",
        device=slot.ordinal if slot is not None else -1,
        kind="terminated",
    )


_live_pools: weakref.WeakSet[DevicePool] = weakref.WeakSet()


class DevicePool(Executor):
    """One long-lived worker process per device (or lane): a ``concurrent.futures.Executor``.

    Each worker binds the registry's context of its device once, when it starts, and
    runs tasks one at a time with it current (a lane's worker binds a context of its
    own: see *devices*). A worker whose task crashed the process,
    raised a sticky CUDA error (the context is poisoned) or ran past its timeout is
    replaced by a fresh one; that task's future gets a :class:`DeviceTaskError`, queued
    tasks run on the replacement.

    ``submit(fn, *args, **kwargs)`` passes every argument to ``fn`` and picks the
    least-loaded worker; ``submit_to(device, fn, ...)`` chooses the device (or lane), and
    ``submit_to(TaskOptions(device=..., timeout=...), fn, ...)`` a timeout too. ``map``
    is ``Executor.map``.

    Parameters
    ----------
    devices : sequence of int, Device or Context, optional
        Default: every visible device. An ordinal, a Device, or a primary or foreign
        Context means that device: one worker, which binds the registry's context. A
        green or owned Context is a *lane*: one worker of its own, so distinct contexts
        of one device (``Device(0).partition([16])``, two owned contexts) and ordinals
        mix. A Context lives in the process that made it, so a lane's worker makes its
        own context of the same kind on that device -- a green context of the same
        ``sm_count`` (``Context.green``), or an owned context with the same flags -- and
        binds it for its whole life; ``ck.current_context()`` in a task is that context,
        and ``ck.bind(ordinal)`` there binds it too (it is the worker's registry context
        of the device). Which SMs a green lane gets is up to the split its worker makes:
        it confines that worker's kernels to ``sm_count`` SMs, but processes on one GPU
        take turns on it (time-slicing) unless MPS runs, so partitions in several
        workers do not run concurrently the way partitions in one process do (use a
        :class:`~ctxkit.Pipeline` or :class:`~ctxkit.ContextExecutor` for that). A worker
        whose context cannot be made (no green contexts in the driver, an SM count the
        device cannot give) marks its lane broken with that error, like a failed
        ``initializer``. The same Context or device listed twice is refused
        (``ValueError``). :attr:`devices` lists one ordinal per worker, :attr:`pids` is
        keyed by ordinal for a device and by the Context given for a lane, and error
        messages name a lane as in ``"on device 0 (green, 16 SMs)"``.
    isolate : bool
        As in :func:`run_per_device`: each worker sees only its device (the lanes of
        one device see the same one).
    initializer : callable, optional
        Called as ``initializer(*initargs)`` in each worker after its context is bound
        (e.g. to compile and load kernels once). If it fails, that worker's device (or
        lane) is marked broken: its queued futures fail and ``submit`` to it raises.
    shm_threshold : int or None
        Byte size from which an array goes through shared memory (``None``: never).
    shm_limit : int, optional
        Most bytes of the pool's arguments in ``/dev/shm`` at once (tasks being sent or
        running); an array beyond it goes through the pipe. Default: half the size of
        ``/dev/shm``. Whatever the limit, an array for which ``/dev/shm`` has no room
        goes through the pipe.
    task_timeout : float, optional
        Default timeout of every task, in seconds (see :class:`TaskOptions`).
    mp_context : multiprocessing context, optional
        Must be a ``spawn`` context.

    Notes
    -----
    Functions are sent as in :func:`run_per_device`: by name, or by value with cloudpickle
    (lambdas, closures, functions of a notebook). Arguments are pickled by ``submit``;
    large arrays are copied into shared memory when the task is sent to its worker, and
    an array ``submit`` cannot send at once is copied first, so changing an array after
    ``submit`` returns never changes what the task sees.

    Device memory travels without a copy (:mod:`.devmem`). A ``DeviceBuffer`` or
    ``DeviceArray`` argument is mapped by the worker (CUDA IPC) for the duration of the
    task: ``submit`` synchronizes the memory's context first, the pool keeps the memory
    alive until the task is over, and the worker synchronizes before it reports (the
    task's writes are visible once the future is done). Unlike a host array it is
    shared, not snapshotted: work the parent queues on it while the task runs races
    with the task. ``submit`` without a device sends such a task to the worker of the
    device that holds the memory (the first device argument's); memory a device
    cannot map (no peer access, or ``isolate=True``) is refused with ``ValueError``.
    A task may return device memory it allocated: the parent gets a
    :class:`~ctxkit.procs.WorkerBuffer` (or a ``DeviceArray`` over one) that the worker
    keeps alive until it is closed or collected, or until the worker exits
    (:class:`~.devmem.LeaseBook`): copy what must outlive the pool before it shuts down. A buffer
    closed before ``submit`` is freed by the worker before that task runs. A task that
    returns one of its device arguments gives back the parent's own object.

    Use as a context manager: a normal exit waits for queued work (``shutdown()``); an
    exception (including ``KeyboardInterrupt``) stops the workers at once
    (:meth:`terminate`), and so does interpreter exit for a pool still running. Workers
    also die with the parent process. Only the process that created the pool can use or
    stop it: in a process forked from it, ``submit`` raises and ``shutdown``,
    ``terminate`` and exit leave the workers alone. Inside a task,
    :func:`worker_device` gives the logical ordinal.
    """

    def __init__(
        self,
        devices: Sequence[Device | int] | None = None,
        *,
        isolate: bool = False,
        initializer: Callable[..., Any] | None = None,
        initargs: Sequence[Any] = (),
        shm_threshold: int | None = SHM_THRESHOLD,
        shm_limit: int | None = None,
        task_timeout: float | None = None,
        mp_context: Any = None,
        _bind: bool = True,
    ) -> None:
        self._ctx = spawn.spawn_context(mp_context)
        by_value = False
        if initializer is not None:
            by_value = wire.check_shippable("DevicePool(initializer=)", initializer)
        wire.check_main("DevicePool")
        spawn.check_timeout(task_timeout, "task_timeout")
        if shm_limit is not None and (isinstance(shm_limit, bool) or shm_limit < 0):
            raise ValueError(f"shm_limit must be a byte count >= 0 or None, not {shm_limit!r}")
        self._init_payload = wire.dumps(
            "DevicePool(initializer=)", (initializer, tuple(initargs)), by_value
        )
        lanes = spawn.resolve_lanes(devices, _bind)
        visible = spawn.visible_for([lane.ordinal for lane in lanes.values()], isolate)
        self._slots = [
            Slot(lane, k, v) for (k, lane), v in zip(lanes.items(), visible, strict=True)
        ]
        self._by_key = {s.key: s for s in self._slots}
        self._threshold = shm_threshold
        # default: half of /dev/shm; no limit where there is none to measure
        self._shm_limit = (wire.shm_space()[1] // 2 or 1 << 62) if shm_limit is None else shm_limit
        self._shm_used = 0
        self._shm_lock = threading.Lock()
        self._task_timeout = task_timeout
        self._bind = _bind
        self._isolate = isolate
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._rr = 0
        self._shutdown = self._terminating = False
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        # wakes the manager thread; for the lease book too (finalizers, any thread)
        self._wake = functools.partial(_wake_through, self._wake_w)
        self._book = LeaseBook(self._wake)
        self._manager = threading.Thread(target=self._manage, name="ctxkit-devicepool", daemon=True)
        self._manager.start()
        _live_pools.add(self)

    # --- public API ----------------------------------------------------------------

    @property
    def devices(self) -> list[int]:
        """The device ordinals of the workers, in order (one per worker: a device with
        several lanes is listed once per lane)."""
        return [s.ordinal for s in self._slots]

    @property
    def pids(self) -> dict[int | Context, int | None]:
        """Current worker process id per device (``None`` while none is running): by
        ordinal, and by the Context given for a lane (a green or owned context)."""
        with self._lock:
            return {s.key: s.proc.pid if s.proc is not None else None for s in self._slots}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on the least-loaded device; returns its ``Future``.

        Every keyword argument goes to ``fn``, as with any ``Executor``; to choose the
        device, use :meth:`submit_to`. Ties in load go round robin.
        A failure in the worker sets a :class:`DeviceTaskError` on the future.

        Raises
        ------
        RuntimeError
            The pool was shut down, or this process did not create it (a fork).
        DeviceTaskError
            Every device's worker failed to start (``kind == "init"``).
        TypeError
            ``fn`` or the arguments cannot be pickled (a ``VirtualBuffer`` among them).
        ValueError
            A device argument cannot be shared (managed or stream-ordered pool memory:
            the message says which) or mapped by any pool device.
        ContextClosedError
            A device argument was closed.
        CudaError
            The driver refused to export a device argument (CUDA IPC unavailable).
        """
        return self._submit(TaskOptions(), fn, args, kwargs)

    def submit_to(
        self,
        target: Context | Device | int | TaskOptions | None,
        fn: Callable[..., Any],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on a chosen device; returns its ``Future``.

        *target* is a device (ordinal or ``Device``: its least-loaded lane), a lane (the
        green or owned Context the pool was given for it), ``None`` (the least-loaded
        worker) or a :class:`TaskOptions` with one of those and a timeout. Every keyword
        argument goes to ``fn``.

        Raises
        ------
        ValueError
            The device or lane is not one of the pool's, or cannot map a device
            argument.
        DeviceTaskError
            The chosen device's worker could not start (``kind == "init"``).
        RuntimeError, TypeError
            As for :meth:`submit`.
        """
        options = target if isinstance(target, TaskOptions) else TaskOptions(device=target)
        return self._submit(options, fn, args, kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting work; workers finish their queues and exit.

        ``cancel_futures=True`` cancels queued (not yet running) tasks first. With
        ``wait=True`` returns once every worker has exited. Does nothing in a process
        forked from the one that created the pool.
        """
        if not self._owned():
            return
        cancelled: list[Task] = []
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
            self._drop(t)
            t.future.cancel()
        self._wake()
        if wait and threading.current_thread() is not self._manager:
            self._manager.join()

    def terminate(self) -> None:
        """Stop every worker now (SIGTERM, then SIGKILL); unfinished futures fail.

        Running tasks get a :class:`DeviceTaskError` with ``kind == "terminated"``, queued
        ones are cancelled. Returns once the workers are gone. Does nothing in a process
        forked from the one that created the pool.
        """
        if not self._owned():
            return
        for key in self._book.workers():
            self._book.invalidate(key, "the DevicePool was terminated", False)
        with self._lock:
            self._shutdown = self._terminating = True
            tasks = [t for s in self._slots for t in s.pending]
            running = [(s, s.current) for s in self._slots if s.current is not None]
            kill_at = time.monotonic() + spawn.TERM_GRACE_S
            for s in self._slots:
                s.pending.clear()
                s.current = None
                if s.proc is not None:
                    s.state = "stopping"
                    s.kill_at = kill_at
                    with contextlib.suppress(Exception):
                        s.proc.terminate()
        for t in tasks:
            self._drop(t)
            if t.started:
                t.future.set_exception(terminated_error(None, t))
            else:
                t.future.cancel()
        for s, t in running:
            self._drop(t)
            t.future.set_exception(terminated_error(s, t))
        self._wake()
        if threading.current_thread() is not self._manager:
            self._manager.join()

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.shutdown(wait=True)
        else:
            self.terminate()

    def __repr__(self) -> str:
        state = "shut down" if self._shutdown else "running"
        return f"<DevicePool devices={self.devices} {state}>"

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
            nxt = self._take(slot) if slot.state == "idle" else None  # this thread sends it
        self._send(slot, nxt)
        if not task.ready:
            try:
                payload.snapshot()
            except BaseException:  # e.g. MemoryError: the task never was
                with self._lock, contextlib.suppress(ValueError):
                    slot.pending.remove(task)
                self._feed(slot)
                task.future.cancel()
                raise
            with self._lock:
                task.ready = True
            self._feed(slot)
        return task.future

    def _placement(
        self, options: TaskOptions, devices: devmem.Outgoing | None
    ) -> tuple[list[int] | None, int | None]:
        """Where a task with device arguments may run (``None``: anywhere) and where it
        best runs; checked, and the arguments' contexts synchronized, before it is queued."""
        if devices is None:
            return None, None
        if options.device is not None:
            devices.check_target(spawn.ordinal_of(options.device, False), self._isolate)
            allowed = None
        else:
            allowed = [o for o in self.devices if not devices.problem(o, self._isolate)]
            if not allowed:
                raise ValueError(
                    f"no device of this pool {self.devices} can map the task's device "
                    f"arguments; on device {self.devices[0]}: "
                    f"{devices.problem(self.devices[0], self._isolate)}"
                )
        devices.synchronize()
        return allowed, devices.ordinals[0]  # best run where its first device argument is

    # --- scheduling ----------------------------------------------------------------

    def _pick(
        self,
        device: Context | Device | int | None,
        allowed: list[int] | None = None,
        prefer: int | None = None,
    ) -> Slot:
        """The slot for a task: the lane *device* names, or the least-loaded healthy one
        of the device it names; else the least-loaded healthy one among *allowed*, those
        of device *prefer* first (it holds the task's memory)."""
        n = len(self._slots)
        order = [self._slots[(self._rr + k) % n] for k in range(n)]  # ties go round robin
        if device is not None:
            order = self._lanes_of(device, order)
        healthy = [s for s in order if s.broken is None]
        if not healthy:  # the first one's error, in the pool's order
            raise min(order, key=self._slots.index).broken  # type: ignore[misc]
        if device is not None:
            return min(healthy, key=lambda s: s.load)
        if allowed is not None:
            healthy = [s for s in healthy if s.ordinal in allowed]
            if not healthy:  # every device that can map the arguments is broken
                raise next(s.broken for s in self._slots if s.ordinal in allowed)  # type: ignore[misc]
        same = [s for s in healthy if s.ordinal == prefer]
        slot = min(same or healthy, key=lambda s: s.load)
        self._rr = (self._slots.index(slot) + 1) % n
        return slot

    def _lanes_of(self, device: Context | Device | int, order: list[Slot]) -> list[Slot]:
        """The slots *device* names, in *order*: a lane's, or every one of a device."""
        key = spawn.lane_key(device)
        if isinstance(key, Context):
            if key not in self._by_key:
                lanes = [s.key for s in self._slots if isinstance(s.key, Context)]
                raise ValueError(f"{key!r} is not a lane of this pool (lanes {lanes})")
            return [self._by_key[key]]
        slots = [s for s in order if s.ordinal == key]
        if not slots:
            raise ValueError(f"device {key} is not in this pool (devices {self.devices})")
        return slots

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

    def _feed(self, slot: Slot) -> None:
        """Send an idle worker its next task, if there is one ready (no lock held)."""
        with self._lock:
            task = self._take(slot) if slot.state == "idle" else None
        self._send(slot, task)

    def _send(self, slot: Slot, task: Task | None) -> None:
        """Put *task*'s buffers in shared memory (within the budget) and send it (no lock;
        nothing to do for ``None``, what :meth:`_take` gives when there is no task)."""
        if task is None:
            return
        try:
            parts, used = task.payload.parts(self._reserve, self._unreserve)
        except BaseException as exc:
            with self._lock:
                if slot.current is task:
                    slot.current = None
                    if slot.state == "busy":
                        slot.state = "idle"
            task.future.set_exception(exc)
            self._feed(slot)
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
            wire.count_sent(task.payload.data, parts, task.payload.devices)
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
        wire.discard_blocks(parts)
        if not keep_payload:
            task.payload.release()

    def _stop_worker(self, slot: Slot) -> None:
        """Tell the worker to exit (lock held): the manager thread first closes the
        parent's mappings of the memory it lent (:meth:`_flush`), then sends ``None``."""
        slot.state = "stopping"
        if slot.proc is not None:
            slot.stop_pending = slot.proc.pid
        self._wake()

    def _collect_releases(self) -> None:
        """Move the book's queued releases to their live workers' slots (lock held);
        those of workers that are gone are dropped."""
        live = {s.proc.pid: s for s in self._slots if s.proc is not None}
        for (_ordinal, pid), leases in self._book.drain().items():
            if (s := live.get(pid)) is not None:
                s.releases += leases

    def _spawn(self, slot: Slot) -> None:
        result_r, result_w = self._ctx.Pipe(duplex=False)
        task_r, task_w = self._ctx.Pipe(duplex=False)
        child = spawn.Child(slot.lane, slot.visible, self._bind)
        proc = self._ctx.Process(
            target=worker_main,
            args=(task_r, result_w, child, self._threshold, self._init_payload),
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
        slot.prefix = child.shm_prefix
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
                s.kill_at = now + spawn.TERM_GRACE_S
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
            stops = [s for s in self._slots if s.proc is not None and s.stop_pending == s.proc.pid]
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
            self._book.invalidate((s.ordinal, s.proc.pid), why, synchronize=True)
            with s.send_lock, contextlib.suppress(OSError, ValueError):
                s.task_w.send(None)

    def _receive(self, slot: Slot) -> None:
        try:
            msg = slot.result_r.recv()
        except (EOFError, OSError):
            slot.result_r.close()
            return
        if msg[0] == "ready":
            with self._lock:
                if slot.state == "starting":
                    slot.state = "idle"
            self._feed(slot)
        elif msg[0] == "init_error":
            head = f"DevicePool worker for {slot.lane} failed to start"
            err = wire.error_from(msg[1], slot.ordinal, slot.proc.pid, None, 1, head, "init")
            self._mark_broken(slot, err)
            slot.result_r.close()
        elif msg[0] == "result":
            self._complete(slot, msg[1], msg[2], msg[3])

    def _complete(self, slot: Slot, task_id: int, out: Any, restart: bool) -> None:
        pid = slot.proc.pid
        key: WorkerKey = (slot.ordinal, pid)
        with self._lock:
            task = slot.current if slot.current is not None and slot.current.id == task_id else None
            if task is not None:  # else terminated under it
                slot.current, slot.deadline = None, None
                if restart:
                    slot.state = "restarting"
                    slot.stop_pending = pid  # once its lent memory is unmapped here
                elif slot.state == "busy":
                    slot.state = "idle"
        if task is None:
            self._feed(slot)
            if out[0] == "ok":
                wire.discard_blocks(out[2])
                self._book.enqueue(key, out[3])
            return
        sent, task.payload.devices = task.payload.devices, None  # results may refer to them
        self._drop(task)  # the worker has let go of the arguments' blocks
        self._feed(slot)
        loader = devmem.ResultLoader(sent, self._book, key)
        head = f"task {task.label} on {slot.lane}"
        value, err = wire.outcome(out, loader, head, slot.ordinal, pid)
        if err is None:
            task.future.set_result(value)
            return
        if out[0] == "ok":  # not loadable: the leases it did not map are released
            self._book.enqueue(key, [lease for lease in out[3] if lease not in loader.adopted])
        task.future.set_exception(err)

    def _exited(self, slot: Slot) -> None:
        slot.proc.join()
        while not slot.result_r.closed and slot.result_r.poll():
            self._receive(slot)
        wire.sweep_blocks(slot.prefix)  # blocks of a worker killed while sending a result
        code, pid = slot.proc.exitcode, slot.proc.pid
        why = f"its worker {spawn.exit_reason(code)}"  # the parent's WorkerBuffers of it close
        self._book.invalidate((slot.ordinal, pid), why, synchronize=False)
        with self._lock:
            task, slot.current = slot.current, None
            timed_out = task is not None and slot.timed_out is task
            was = slot.state
            slot.result_r.close()
            old_w = slot.task_w
            slot.proc = slot.deadline = slot.kill_at = slot.timed_out = None
            slot.state = "dead" if was != "broken" else "broken"
            if was == "starting" and not self._terminating:
                broken = DeviceTaskError(
                    f"DevicePool worker for {slot.lane} (pid {pid}) {spawn.exit_reason(code)} "
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


def _wake_through(conn: Any) -> None:
    """Wake the manager thread (its wake-up pipe is *conn*, not the pool: no cycle)."""
    with contextlib.suppress(OSError, ValueError):
        conn.send_bytes(b"r")


@atexit.register
def _terminate_live_pools() -> None:
    for pool in list(_live_pools):
        if pool._owned():  # a forked child must not stop its parent's workers
            with contextlib.suppress(Exception):
                pool.terminate()


# --- the worker process ------------------------------------------------------------


def worker_main(
    task_r: Any, result_w: Any, child: spawn.Child, threshold: int | None, init_payload: bytes
) -> None:
    """Entry point of a ``DevicePool`` worker (spawned)."""
    with contextlib.ExitStack() as stack:
        try:
            ctx = stack.enter_context(child.setup())
            initializer, initargs = pickle.loads(init_payload)
            if initializer is not None:
                initializer(*initargs)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                result_w.send(("init_error", wire.describe_exception(exc)))
            return
        result_w.send(("ready", os.getpid()))
        _serve(task_r, result_w, child.ordinal, ctx, threshold, devmem.WorkerLeases())


def _serve(
    task_r: Any,
    result_w: Any,
    ordinal: int,
    ctx: Any,
    threshold: int | None,
    leases: devmem.WorkerLeases,
) -> None:
    """Run tasks and send their results until told to stop (or a sticky error: then the
    worker exits); what is still lent is freed on the way out (while the context is
    bound)."""
    try:
        while (msg := _next_message(task_r)) is not None:
            if msg[0] == "release":
                leases.release(msg[1])
                continue
            task_id, data, parts, releases = msg
            del msg  # the payload goes as soon as the task is over
            leases.release(releases)
            session = devmem.ChildSession(ctx, leases, ordinal)
            out, restart = spawn.run_task(data, parts, threshold, session)
            del data, parts
            if not spawn.reply(result_w, ("result", task_id, out, restart), out, session):
                return
            del session, out
            if restart:
                _wait_for_stop(task_r, leases)
                return
    finally:
        leases.clear()


def _next_message(task_r: Any) -> Any:
    """The parent's next message; ``None`` when it said stop or the pipe closed."""
    try:
        return task_r.recv()
    except (EOFError, OSError):
        return None


def _wait_for_stop(task_r: Any, leases: devmem.WorkerLeases) -> None:
    """Keep the memory lent to the parent until it has unmapped it: the parent answers a
    restart with releases and then ``None`` (or dies: EOF)."""
    while leases and (msg := _next_message(task_r)) is not None:
        if msg[0] == "release":
            leases.release(msg[1])
        elif len(msg) == 4:
            leases.release(msg[3])
