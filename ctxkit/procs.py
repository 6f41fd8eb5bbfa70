"""One process per GPU: spawned children, a long-lived device pool, and MPI binding.

Why processes: a fault that poisons a context (illegal address, trap) takes down every
later call in that process; with one process per GPU it costs one device's work, which
is reported and can be retried, while the other devices carry on. It is also the model
that scales past one machine: the same per-device function runs under MPI.

Why **spawn** only: a child created with ``fork`` inherits a copy of the parent's CUDA
state that the driver cannot use (``cuInit`` in the parent makes every CUDA call in a
forked child fail), and forking a multithreaded parent can deadlock on locks held by
other threads. ``spawn`` starts a fresh interpreter that initialises CUDA itself. The
cost is start-up time (interpreter + imports + context), which is why :class:`DevicePool`
exists for repeated work. Functions and arguments are pickled, so ``fn`` must be defined
at module level (not a lambda or nested function) and programs that use these APIs need
the usual ``if __name__ == "__main__":`` guard.

Large numpy arrays (arguments and results) travel through POSIX shared memory instead
of the pipe when they reach ``shm_threshold`` bytes (default 1 MiB). Measured on a
2-core development VM (pool round trip of one float32 array there and back, pipe vs
shared memory): 64 KiB 0.28 vs 0.56 ms, 512 KiB 0.74 vs 1.5 ms, 1 MiB 3.4 vs 2.6 ms,
16 MiB 58 vs 34 ms, 256 MiB 2.9 s vs 0.49 s. Below ~1 MiB the fixed cost of creating,
mapping and unlinking a block outweighs the copies it saves; ``benchmarks/bench_procs.py``
measures the crossover on the machine at hand.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # its atexit hook must be registered before ours
import os
import pickle
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from . import _procwire
from . import device as _device
from ._procwire import SHM_THRESHOLD
from .device import Device, device_count
from .errors import CudaError, from_result

__all__ = [
    "SHM_THRESHOLD",
    "DevicePool",
    "DeviceTaskError",
    "local_device_for",
    "mpi_local_device",
    "mpi_local_rank",
    "run_per_device",
    "worker_device",
]

#: Seconds between SIGTERM and SIGKILL when a child must be stopped.
TERM_GRACE_S = 2.0
#: Seconds a child may take to exit after it sent its result (e.g. teardown after a fault).
EXIT_GRACE_S = 10.0

_worker_device: int | None = None


class DeviceTaskError(CudaError):
    """Work for one device failed in its child process.

    A subclass of :class:`~ctxkit.errors.CudaError` (itself a ``RuntimeError``) so that
    ``except ctxkit.CudaError`` around multi-GPU work also sees a failed device; when the
    child's exception was a ``CudaError`` its ``code`` and ``name`` are carried over
    (e.g. ``CUDA_ERROR_ILLEGAL_ADDRESS``).

    Attributes
    ----------
    device : int
        Logical device ordinal (as the parent numbers devices).
    kind : str
        ``"exception"`` (the function raised), ``"crash"`` (the process died without a
        result: signal, ``os._exit``, native crash), ``"timeout"``, ``"init"`` (a pool
        worker could not start) or ``"terminated"`` (the pool was stopped under the task).
    pid, exitcode : int or None
        The child process and how it ended (negative exit code: killed by that signal).
    traceback : str
        The child's formatted traceback (empty when the child sent none).
    exception_type : str
        Qualified name of the child's exception class (empty when there was none).
    child_exception : BaseException or None
        The child's exception object, when it could be pickled.
    attempts : int
        Processes started for this device's work (``retries + 1`` when all failed).
    results : list
        ``run_per_device`` only: every device's result in device order, ``None`` for the
        devices that failed.
    failures : dict[int, DeviceTaskError]
        ``run_per_device`` only: the error of every failed device, by ordinal.
    """

    def __init__(
        self,
        message: str,
        *,
        device: int,
        kind: str,
        pid: int | None = None,
        exitcode: int | None = None,
        traceback: str = "",
        exception_type: str = "",
        child_exception: BaseException | None = None,
        attempts: int = 1,
        code: int = 0,
        name: str = "",
    ) -> None:
        super().__init__(message, code, name)
        self.device = device
        self.kind = kind
        self.pid = pid
        self.exitcode = exitcode
        self.traceback = traceback
        self.exception_type = exception_type
        self.child_exception = child_exception
        self.attempts = attempts
        self.results: list[Any] = []
        self.failures: dict[int, DeviceTaskError] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_task_error, (str(self),), dict(self.__dict__))


def _rebuild_task_error(message: str) -> DeviceTaskError:
    err = DeviceTaskError.__new__(DeviceTaskError)
    Exception.__init__(err, message)
    return err


def worker_device() -> int | None:
    """The logical device ordinal this process serves, inside a ``run_per_device`` child
    or a ``DevicePool`` worker; ``None`` elsewhere."""
    return _worker_device


# --- shared checks --------------------------------------------------------------------


def _spawn_context(mp_context: Any) -> Any:
    if mp_context is None:
        return multiprocessing.get_context("spawn")
    method = mp_context.get_start_method()
    if method != "spawn":
        raise ValueError(
            f"ctxkit.procs needs the 'spawn' start method, got a {method!r} context: a "
            "process forked after CUDA was initialised cannot use CUDA (every driver call "
            "fails), and forking a multithreaded process can deadlock. Pass "
            "multiprocessing.get_context('spawn') or leave mp_context=None"
        )
    return mp_context


def _check_shippable(what: str, fn: Any) -> None:
    """Refuse, before any process starts, a function a spawned child cannot import."""
    if not callable(fn):
        raise TypeError(f"{what}: expected a callable, got {type(fn).__name__}")
    qual = getattr(fn, "__qualname__", "")
    if "<lambda>" in qual or "<locals>" in qual:
        raise TypeError(
            f"{what}: {fn!r} is a lambda or a nested function, which a spawned process "
            "cannot import; define it at module level (def name(...): at the top of a "
            "module) and pass that"
        )
    if getattr(fn, "__module__", None) == "__main__":
        main = sys.modules.get("__main__")
        if getattr(main, "__file__", None) is None and getattr(main, "__spec__", None) is None:
            raise TypeError(
                f"{what}: {fn!r} was defined in an interactive session (python -c, REPL, "
                "notebook) and a spawned process cannot import it; put it in a module "
                "file and import it from there"
            )


def _pickled(what: str, obj: Any, threshold: int | None) -> tuple[bytes, _procwire.Blocks]:
    try:
        return _procwire.encode(obj, threshold)
    except Exception as exc:
        raise TypeError(
            f"{what}: the function and its arguments must be picklable to reach a spawned "
            f"process, but pickling failed: {exc}"
        ) from exc


def _resolve_ordinals(devices: Sequence[Device | int] | None, bind: bool) -> list[int]:
    if devices is None:
        if not bind:
            raise ValueError("_bind=False needs an explicit list of device ordinals")
        n = device_count()
        if n == 0:
            Device(0)  # raises the precise reason (no driver / no device)
        ordinals = list(range(n))
    else:
        ordinals = [_ordinal(d, bind) for d in devices]
    if not ordinals:
        raise ValueError("devices is empty: give at least one device")
    dupes = sorted({o for o in ordinals if ordinals.count(o) > 1})
    if dupes:
        raise ValueError(f"device(s) {dupes} listed more than once: one process per device")
    return ordinals


def _ordinal(d: Device | int, bind: bool) -> int:
    if bind:
        return Device(d).ordinal
    if isinstance(d, bool) or not isinstance(d, (int, Device)):
        raise TypeError(f"device must be an int ordinal or a ctxkit.Device, got {d!r}")
    return int(d)


def _visible(ordinals: list[int], isolate: bool) -> list[str | None]:
    if not isolate:
        return [None] * len(ordinals)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [_procwire.visible_entry(o, env) for o in ordinals]


@contextlib.contextmanager
def _bound_context(ordinal: int, bind: bool) -> Iterator[Any]:
    if not bind:
        yield None
        return
    from .registry import registry

    ctx = registry.context(ordinal)
    with ctx:
        yield ctx


def _error_from(
    desc: dict[str, Any],
    device: int,
    pid: int | None,
    exitcode: int | None,
    attempts: int,
    head: str,
    kind: str = "exception",
) -> DeviceTaskError:
    tb = desc["traceback"]
    return DeviceTaskError(
        f"{head}: {desc['type']}: {desc['message']}\n--- traceback in child process {pid} ---\n"
        f"{tb.rstrip()}",
        device=device,
        kind=kind,
        pid=pid,
        exitcode=exitcode,
        traceback=tb,
        exception_type=desc["type"],
        child_exception=_procwire.unpickle_exception(desc),
        attempts=attempts,
        code=desc["code"],
        name=desc["name"],
    )


# --- run_per_device -------------------------------------------------------------------


def run_per_device(
    fn: Callable[..., Any],
    devices: Sequence[Device | int] | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
    retries: int = 0,
    isolate: bool = False,
    *,
    mp_context: Any = None,
    _bind: bool = True,
) -> list[Any]:
    """Run ``fn(ordinal, *args, **kwargs)`` in one spawned process per device.

    Each child makes the registry's context of its device current for the duration of
    ``fn`` (``ctxkit.registry.context(ordinal)``), so ``fn`` can allocate, compile and
    launch right away. Results come back in the order of *devices*.

    Parameters
    ----------
    fn : callable
        A module-level function (picklable; lambdas and nested functions are refused
        before anything starts). Its return value must be picklable host data; numpy
        arrays of ``SHM_THRESHOLD`` bytes or more come back through shared memory.
    devices : sequence of int or Device, optional
        Default: every visible device. Each may appear once.
    args, kwargs
        Extra arguments for ``fn`` (pickled once, sent to every child).
    timeout : float, optional
        Seconds each attempt may run; a child still running then is stopped (SIGTERM,
        then SIGKILL after ``TERM_GRACE_S``) and reported as a ``"timeout"``.
    retries : int
        How many times a failed device's work is rerun in a fresh process (on an
        exception, a crash or a timeout alike).
    isolate : bool
        Start each child with ``CUDA_VISIBLE_DEVICES`` showing only its device (set
        before CUDA initialises in the child; derived from the parent's own
        ``CUDA_VISIBLE_DEVICES`` when it has one). The child binds ordinal 0 there, but
        ``fn`` still receives the logical ordinal as the parent numbers devices.
    mp_context : multiprocessing context, optional
        Must be a ``spawn`` context (a ``fork``/``forkserver`` one raises ``ValueError``).

    Returns
    -------
    list
        ``fn``'s result per device, in the order of *devices*.

    Raises
    ------
    DeviceTaskError
        At least one device failed after its retries. The error is the first failed
        device's (``.device``, ``.kind``, the child's ``.traceback``); its message also
        names the others; ``.results`` holds every device's result (``None`` where it
        failed) and ``.failures`` every failed device's error by ordinal.
    TypeError
        ``fn`` or the arguments cannot be sent to a spawned process.

    Notes
    -----
    No process outlives the call: on an interrupt (``KeyboardInterrupt``) or any other
    exception in the parent every child is stopped before it propagates; on Linux a
    child is also killed if the parent dies. Children ignore SIGINT, so Ctrl-C in a
    terminal is handled once, by the parent.
    """
    ctx = _spawn_context(mp_context)
    _check_shippable("run_per_device", fn)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, not {retries!r}")
    ordinals = _resolve_ordinals(devices, _bind)
    visible = _visible(ordinals, isolate)
    payload, _ = _pickled("run_per_device", (fn, tuple(args), dict(kwargs or {})), None)
    runner = _Runner(ctx, payload, ordinals, visible, isolate, timeout, retries, _bind)
    return runner.run()


class _Child:
    __slots__ = ("attempt", "conn", "deadline", "index", "message", "proc")

    def __init__(self, index: int, attempt: int, proc: Any, conn: Any, deadline: float | None):
        self.index = index
        self.attempt = attempt
        self.proc = proc
        self.conn = conn
        self.deadline = deadline
        self.message: Any = None


class _Runner:
    """Starts, watches, retries and reaps the children of one ``run_per_device`` call."""

    def __init__(
        self,
        ctx: Any,
        payload: bytes,
        ordinals: list[int],
        visible: list[str | None],
        isolate: bool,
        timeout: float | None,
        retries: int,
        bind: bool,
    ) -> None:
        self.ctx = ctx
        self.payload = payload
        self.ordinals = ordinals
        self.visible = visible
        self.isolate = isolate
        self.timeout = timeout
        self.retries = retries
        self.bind = bind
        self.running: dict[int, _Child] = {}
        self.started: list[Any] = []  # every Process, registered before its start()
        self.results: list[Any] = [None] * len(ordinals)
        self.failures: dict[int, DeviceTaskError] = {}

    def run(self) -> list[Any]:
        try:
            for i in range(len(self.ordinals)):
                self._start(i, 1)
            while self.running:
                self._step()
        except BaseException:
            _procwire.stop_processes(self.started, TERM_GRACE_S)
            raise
        finally:
            for c in self.running.values():
                c.conn.close()
        if self.failures:
            raise self._summary()
        return self.results

    def _start(self, index: int, attempt: int) -> None:
        ordinal = self.ordinals[index]
        reader, writer = self.ctx.Pipe(duplex=False)
        try:
            proc = self.ctx.Process(
                target=_child_main,
                args=(
                    writer,
                    self.payload,
                    ordinal,
                    0 if self.isolate else ordinal,
                    self.visible[index],
                    self.bind,
                    os.getpid(),
                ),
                name=f"ctxkit-device-{ordinal}",
            )
            self.started.append(proc)
            proc.start()
        except BaseException:
            reader.close()
            raise
        finally:
            writer.close()
        deadline = time.monotonic() + self.timeout if self.timeout is not None else None
        self.running[index] = _Child(index, attempt, proc, reader, deadline)

    def _step(self) -> None:
        children = list(self.running.values())
        waits: list[Any] = [c.conn for c in children if not c.conn.closed]
        waits += [c.proc.sentinel for c in children]
        deadlines = [c.deadline for c in children if c.deadline is not None]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready = multiprocessing.connection.wait(waits, wait_s)
        for c in children:
            if not c.conn.closed and c.conn in ready:
                self._receive(c)
        now = time.monotonic()
        for c in children:
            if c.proc.sentinel in ready:
                c.proc.join()
                if not c.conn.closed and c.conn.poll():
                    self._receive(c)
                self._settle(c, timed_out=False)
            elif c.deadline is not None and now >= c.deadline:
                _procwire.stop_processes([c.proc], TERM_GRACE_S)
                self._settle(c, timed_out=c.message is None)

    def _receive(self, c: _Child) -> None:
        try:
            c.message = c.conn.recv()
        except (EOFError, OSError):
            pass
        else:
            c.deadline = time.monotonic() + EXIT_GRACE_S
        c.conn.close()

    def _settle(self, c: _Child, timed_out: bool) -> None:
        del self.running[c.index]
        c.conn.close()
        failure = self._outcome(c, timed_out)
        if failure is None:
            return
        if c.attempt <= self.retries:
            self._start(c.index, c.attempt + 1)
        else:
            self.failures[self.ordinals[c.index]] = failure

    def _outcome(self, c: _Child, timed_out: bool) -> DeviceTaskError | None:
        ordinal = self.ordinals[c.index]
        pid, code = c.proc.pid, c.proc.exitcode
        tries = f"attempt {c.attempt} of {self.retries + 1}"
        msg = c.message
        if msg is not None and msg[0] == "ok":
            try:
                self.results[c.index] = _procwire.decode(msg[1], msg[2])
                return None
            except Exception as exc:
                desc = _procwire.describe_exception(exc)
                return _error_from(
                    desc, ordinal, pid, code, c.attempt, f"device {ordinal}: result not loadable"
                )
        if msg is not None:
            return _error_from(msg[1], ordinal, pid, code, c.attempt, f"device {ordinal} ({tries})")
        if timed_out:
            return DeviceTaskError(
                f"device {ordinal}: child process {pid} did not finish within "
                f"{self.timeout:g} s and was stopped ({tries})",
                device=ordinal,
                kind="timeout",
                pid=pid,
                exitcode=code,
                attempts=c.attempt,
            )
        return DeviceTaskError(
            f"device {ordinal}: child process {pid} {_procwire.exit_reason(code)} before "
            f"sending a result ({tries}). A native crash, os._exit(), the OOM killer or "
            "a fatal GPU fault look like this; check the child's stderr and `dmesg`",
            device=ordinal,
            kind="crash",
            pid=pid,
            exitcode=code,
            attempts=c.attempt,
        )

    def _summary(self) -> DeviceTaskError:
        order = [o for o in self.ordinals if o in self.failures]
        first = self.failures[order[0]]
        if len(order) > 1:
            others = "; ".join(
                f"device {o}: {self.failures[o].kind}" for o in order[1:] if o != first.device
            )
            err = DeviceTaskError(
                f"{len(order)} of {len(self.ordinals)} devices failed (also {others}). "
                f"First failure:\n{first}",
                device=first.device,
                kind=first.kind,
                pid=first.pid,
                exitcode=first.exitcode,
                traceback=first.traceback,
                exception_type=first.exception_type,
                child_exception=first.child_exception,
                attempts=first.attempts,
                code=first.code,
                name=first.name,
            )
        else:
            err = first
        err.results = self.results
        err.failures = dict(self.failures)
        return err


def _child_main(
    conn: Any,
    payload: bytes,
    ordinal: int,
    bind_ordinal: int,
    visible: str | None,
    bind: bool,
    parent_pid: int,
) -> None:
    """Entry point of a ``run_per_device`` child (spawned)."""
    global _worker_device
    _worker_device = ordinal
    blocks: _procwire.Blocks = []
    try:
        _procwire.child_setup(parent_pid, visible)
        fn, args, kwargs = pickle.loads(payload)
        with _bound_context(bind_ordinal, bind):
            value = fn(ordinal, *args, **kwargs)
        data, blocks = _result_bytes(fn, ordinal, value)
        msg: tuple[Any, ...] = ("ok", data, blocks)
    except BaseException as exc:
        msg = ("error", _procwire.describe_exception(exc))
    try:
        conn.send(msg)
    except Exception:
        _procwire.discard(blocks)
    conn.close()


def _result_bytes(fn: Any, ordinal: int, value: Any, threshold: int | None = SHM_THRESHOLD) -> Any:
    try:
        return _procwire.encode(value, threshold)
    except Exception as exc:
        raise TypeError(
            f"the result of {getattr(fn, '__qualname__', fn)!r} on device {ordinal} cannot be "
            f"pickled back to the parent ({exc}); return host data (numpy arrays, numbers), "
            "not device objects"
        ) from exc


# --- DevicePool -----------------------------------------------------------------------

_live_pools: weakref.WeakSet[DevicePool] = weakref.WeakSet()


class _Task:
    __slots__ = ("blocks", "data", "future", "id", "label", "started")

    def __init__(self, tid: int, label: str, data: bytes, blocks: _procwire.Blocks):
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
        self._ctx = _spawn_context(mp_context)
        if initializer is not None:
            _check_shippable("DevicePool(initializer=)", initializer)
        self._init_payload, _ = _pickled("DevicePool", (initializer, tuple(initargs)), None)
        ordinals = _resolve_ordinals(devices, _bind)
        visible = _visible(ordinals, isolate)
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
        _check_shippable("DevicePool.submit", fn)
        if self._shutdown:
            raise RuntimeError("cannot submit to a DevicePool after shutdown()")
        data, blocks = _pickled("DevicePool.submit", (fn, args, kwargs), self._threshold)
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
            _procwire.discard(blocks)
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
            _procwire.discard(t.blocks)
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
            _procwire.discard(t.blocks)
            if t.started:
                t.future.set_exception(self._terminated_error(None, t))
            else:
                t.future.cancel()
        for s, t in running:
            _procwire.discard(t.blocks)
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
            ordinal = _ordinal(device, False)
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
                    _procwire.discard(task.blocks)
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
                wait_s = TERM_GRACE_S if self._terminating else None
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
            err = _error_from(msg[1], slot.ordinal, slot.proc.pid, None, 1, head, "init")
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
                _procwire.discard(out[2])
            return
        pid = slot.proc.pid
        head = f"task {task.label} on device {slot.ordinal}"
        if out[0] == "ok":
            try:
                value = _procwire.decode(out[1], out[2])
            except Exception as exc:
                desc = _procwire.describe_exception(exc)
                task.future.set_exception(
                    _error_from(desc, slot.ordinal, pid, None, 1, head + ": result not loadable")
                )
            else:
                task.future.set_result(value)
        else:
            task.future.set_exception(_error_from(out[1], slot.ordinal, pid, None, 1, head))

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
                reason = _procwire.exit_reason(code)
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
            _procwire.discard(task.blocks)
            task.future.set_exception(
                DeviceTaskError(
                    f"task {task.label} on device {slot.ordinal}: worker process {pid} "
                    f"{_procwire.exit_reason(code)} while running it; the worker was replaced. "
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
            _procwire.discard(t.blocks)
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
    global _worker_device
    _worker_device = ordinal
    with contextlib.ExitStack() as stack:
        try:
            _procwire.child_setup(parent_pid, visible)
            ctx = stack.enter_context(_bound_context(bind_ordinal, bind))
            initializer, initargs = pickle.loads(init_payload)
            if initializer is not None:
                initializer(*initargs)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                result_w.send(("init_error", _procwire.describe_exception(exc)))
            return
        result_w.send(("ready", os.getpid()))
        _serve(task_r, result_w, ordinal, ctx, threshold)


def _serve(task_r: Any, result_w: Any, ordinal: int, ctx: Any, threshold: int | None) -> None:
    from .errors import STICKY_CODES, ContextPoisonedError

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
            fn, args, kwargs = _procwire.decode(data, blocks)
            value = fn(*args, **kwargs)
            out: tuple[Any, ...] = ("ok", *_result_bytes(fn, ordinal, value, threshold))
        except BaseException as exc:
            out = ("error", _procwire.describe_exception(exc))
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
                _procwire.discard(out[2])
            return
        if restart:
            return


@atexit.register
def _terminate_live_pools() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.terminate()


# --- MPI ------------------------------------------------------------------------------


def _import_mpi(what: str) -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"ctxkit.procs.{what} needs mpi4py, which is not installed ({exc}). Install the "
            "`mpi` extra: pip install 'ctxkit[mpi]', plus an MPI runtime (your cluster's MPI, "
            "or `pip install mpich` on a workstation)"
        ) from exc
    return MPI


def mpi_local_rank(comm: Any = None) -> tuple[int, int]:
    """``(local_rank, local_size)`` of this process among the ranks of *comm* on its node.

    Uses ``comm.Split_type(MPI.COMM_TYPE_SHARED)``; local ranks follow the order of the
    ranks in *comm* (default ``MPI.COMM_WORLD``).
    """
    MPI = _import_mpi("mpi_local_rank")
    comm = MPI.COMM_WORLD if comm is None else comm
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return int(local.Get_rank()), int(local.Get_size())
    finally:
        local.Free()


def local_device_for(
    local_rank: int, local_size: int, device_count: int, oversubscribe: bool = False, host: str = ""
) -> int:
    """The device ordinal for node-local rank *local_rank* of *local_size* ranks.

    ``local_rank`` itself when there are at least as many devices as local ranks;
    ``local_rank % device_count`` when *oversubscribe* allows sharing devices.

    Raises
    ------
    ValueError
        More local ranks than devices without *oversubscribe* (the message names both
        counts), or an inconsistent rank/size.
    CudaError
        No device is visible (``CUDA_ERROR_NO_DEVICE``).
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not in range(local_size={local_size})")
    where = f" on {host}" if host else " on this node"
    if device_count <= 0:
        raise from_result(
            100, "mpi_local_device", f"{local_size} MPI rank(s){where} found no CUDA device"
        )
    if local_size > device_count and not oversubscribe:
        raise ValueError(
            f"{local_size} MPI ranks run{where} but only {device_count} CUDA device(s) are "
            f"visible there (this is local rank {local_rank}): start at most {device_count} "
            "rank(s) per node (e.g. mpiexec -ppn N), or pass oversubscribe=True to share "
            "devices (device = local_rank % device_count)"
        )
    return local_rank % device_count


def mpi_local_device(
    comm: Any = None, oversubscribe: bool = False, *, device_count: int | None = None
) -> Device:
    """Bind this MPI rank to its node-local GPU and return the Device.

    The device is chosen from the **node-local** rank (``MPI.COMM_TYPE_SHARED`` split of
    *comm*), not the global rank, so the same program works on one node and across many.
    The registry's context of that device is pushed in the calling thread and stays
    current there (the rank's main thread) for the rest of the program; worker threads
    bind it themselves (``ctxkit.bind(dev)``). Calling it again is cheap.

    Parameters
    ----------
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``.
    oversubscribe : bool
        Allow more local ranks than devices (device = ``local_rank % device_count``).
    device_count : int, optional
        Devices to spread the ranks over (default: all visible). Tests pass a fake count
        to exercise the rank logic without GPUs.

    Raises
    ------
    ImportError
        mpi4py is not installed (install the ``mpi`` extra).
    ValueError
        More local ranks than devices and not *oversubscribe*.
    """
    MPI = _import_mpi("mpi_local_device")
    local_rank, local_size = mpi_local_rank(comm)
    n = _device.device_count() if device_count is None else device_count
    ordinal = local_device_for(local_rank, local_size, n, oversubscribe, MPI.Get_processor_name())
    dev = Device(ordinal)
    from .context import thread_state
    from .registry import registry

    ctx = registry.context(dev)
    if thread_state().top is not ctx:
        ctx.push()
    return dev
