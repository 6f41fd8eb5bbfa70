"""``DevicePool``: one long-lived worker process per GPU, a ``concurrent.futures.Executor``.

This module holds the class and what its users call: the constructor, ``submit``,
``submit_to``, ``shutdown``, ``terminate`` and the context manager. The rest is in its
base classes: :class:`~.dispatch.Dispatcher` (checking, placing, queueing and sending
tasks) and :class:`~.manager.Manager` (the thread that watches and replaces the workers).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import multiprocessing.util  # noqa: F401 - its atexit hook must be registered before ours
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any

from ..device import Device
from . import child, shm, wire
from .leases import LeaseBook, _gone
from .manager import Manager
from .tasks import (
    Slot,
    Task,
    TaskOptions,
    check_timeout,
    takes_keyword,
    terminated_error,
)
from .wire import SHM_THRESHOLD

__all__ = ["DevicePool"]


_live_pools: weakref.WeakSet[DevicePool] = weakref.WeakSet()


class DevicePool(Manager, Executor):
    """One long-lived worker process per device: a ``concurrent.futures.Executor``.

    Each worker binds the registry's context of its device once, when it starts, and
    runs tasks one at a time with it current. A worker whose task crashed the process,
    raised a sticky CUDA error (the context is poisoned) or ran past its timeout is
    replaced by a fresh one; that task's future gets a :class:`DeviceTaskError`, queued
    tasks run on the replacement.

    ``submit(fn, *args, **kwargs)`` passes every argument to ``fn`` and picks the
    least-loaded device; ``submit_to(device, fn, ...)`` chooses the device, and
    ``submit_to(TaskOptions(device=..., timeout=...), fn, ...)`` a timeout too. ``map``
    is ``Executor.map``.

    Parameters
    ----------
    devices : sequence of int or Device, optional
        Default: every visible device.
    isolate : bool
        As in :func:`run_per_device`: each worker sees only its device.
    initializer : callable, optional
        Called as ``initializer(*initargs)`` in each worker after its context is bound
        (e.g. to compile and load kernels once). If it fails, that device is marked
        broken: its queued futures fail and ``submit`` to it raises.
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
    (:mod:`.leases`): copy what must outlive the pool before it shuts down. A buffer
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
        self._ctx = child.spawn_context(mp_context)
        by_value = False
        if initializer is not None:
            by_value = wire.check_shippable("DevicePool(initializer=)", initializer)
        wire.check_main("DevicePool")
        check_timeout(task_timeout, "task_timeout")
        if shm_limit is not None and (isinstance(shm_limit, bool) or shm_limit < 0):
            raise ValueError(f"shm_limit must be a byte count >= 0 or None, not {shm_limit!r}")
        self._init_payload = wire.dumps(
            "DevicePool(initializer=)", (initializer, tuple(initargs)), by_value
        )
        ordinals = child.resolve_ordinals(devices, _bind)
        visible = child.visible_for(ordinals, isolate)
        self._slots = [
            Slot(o, 0 if isolate else o, v) for o, v in zip(ordinals, visible, strict=True)
        ]
        self._by_ordinal = {s.ordinal: s for s in self._slots}
        self._threshold = shm_threshold
        self._shm_limit = _default_shm_limit() if shm_limit is None else shm_limit
        self._shm_used = 0
        self._shm_lock = threading.Lock()
        self._task_timeout = task_timeout
        self._bind = _bind
        self._isolate = isolate
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._rr = 0
        self._shutdown = False
        self._terminating = False
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._book = LeaseBook(functools.partial(_wake_through, self._wake_w))
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

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on the least-loaded device; returns its ``Future``.

        Every keyword argument goes to ``fn``, as with any ``Executor``. (Compatibility:
        ``device=`` chooses the device, with a ``DeprecationWarning``, only when ``fn``
        takes no ``device`` keyword; use :meth:`submit_to`.) Ties in load go round robin.
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
        target: Device | int | None = None
        if "device" in kwargs and not takes_keyword(fn, "device"):
            warnings.warn(
                "DevicePool.submit(fn, ..., device=N) as a device choice is deprecated: "
                "submit() passes every keyword argument to fn, as concurrent.futures "
                "executors do. Use pool.submit_to(N, fn, ...)",
                DeprecationWarning,
                stacklevel=2,
            )
            target = kwargs.pop("device")
        return self._submit(TaskOptions(device=target), fn, args, kwargs)

    def submit_to(
        self,
        target: Device | int | TaskOptions | None,
        fn: Callable[..., Any],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on a chosen device; returns its ``Future``.

        *target* is a device (ordinal or ``Device``; ``None``: least loaded) or a
        :class:`TaskOptions` with a device and a timeout. Every keyword argument goes
        to ``fn``.

        Raises
        ------
        ValueError
            The device is not one of the pool's devices, or cannot map a device
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
            self._book.invalidate(key, _gone(key, "the DevicePool was terminated"), False)
        with self._lock:
            self._shutdown = True
            self._terminating = True
            tasks = [t for s in self._slots for t in s.pending]
            running = [(s, s.current) for s in self._slots if s.current is not None]
            kill_at = time.monotonic() + child.TERM_GRACE_S
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


def _wake_through(conn: Any) -> None:
    """Wake the manager thread (for the lease book: from finalizers, any thread)."""
    with contextlib.suppress(OSError, ValueError):
        conn.send_bytes(b"r")


def _default_shm_limit() -> int:
    """Half of ``/dev/shm``; no limit where there is no ``/dev/shm`` to measure."""
    total = shm.space()[1]
    return total // 2 if total else 1 << 62


@atexit.register
def _terminate_live_pools() -> None:
    for pool in list(_live_pools):
        if pool._owned():  # a forked child must not stop its parent's workers
            with contextlib.suppress(Exception):
                pool.terminate()
