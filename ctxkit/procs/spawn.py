"""``run_per_device``: one spawned process per GPU, results in order (the family's
overview is in :mod:`ctxkit.procs`)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..device import Device
from ..errors import DeviceTaskError
from . import child, devmem, shm, wire

__all__ = ["run_per_device", "worker_device"]


def worker_device() -> int | None:
    """The logical device ordinal this process serves, inside a ``run_per_device`` child
    or a ``DevicePool`` worker; ``None`` elsewhere."""
    return child.current_device


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
        A module-level function, imported by name in each child. A lambda, a closure or
        a function defined in a notebook, REPL or ``python -c`` is sent by value with
        cloudpickle when it is installed (else refused before anything starts). Its
        return value must be picklable host data; numpy arrays of ``SHM_THRESHOLD``
        bytes or more come back through shared memory (through the pipe when
        ``/dev/shm`` has no room for them). It may return a device argument (or a view
        of one): the parent gets its own object back. Device memory allocated in the
        child cannot be returned (the child exits): that result fails with a
        ``TypeError`` naming the fixes (or use a :class:`DevicePool`).
    devices : sequence of int or Device, optional
        Default: every visible device. Each may appear once.
    args, kwargs
        Extra arguments for ``fn`` (pickled once, sent to every child). A ctxkit
        ``DeviceBuffer`` or ``DeviceArray`` among them is not copied: each child maps
        the parent's memory (CUDA IPC) and gets a buffer or array of the same size,
        shape and dtype in its context. The parent's context is synchronized first;
        the memory stays alive until the call returns; each child synchronizes before
        it reports, so its writes are visible to the parent on return. Memory on
        another device than a child's must be mappable there (peer access, no
        ``isolate``), else ``ValueError`` before any process starts.
    timeout : float, optional
        Seconds each attempt may run; a child still running then is stopped (SIGTERM,
        then SIGKILL 2 s later) and reported as a ``"timeout"``.
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
    ValueError
        A device argument cannot be shared (managed or pool memory: the reason) or
        mapped on one of the devices.
    RuntimeError
        The main module cannot be re-run by a spawned process (read from ``python -``).

    Notes
    -----
    No process outlives the call: on an interrupt (``KeyboardInterrupt``) or any other
    exception in the parent every child is stopped before it propagates; on Linux a
    child is also killed if the parent dies. Children ignore SIGINT, so Ctrl-C in a
    terminal is handled once, by the parent. ``_bind=False`` (internal, for tests of the
    process plumbing without a GPU) takes explicit ordinals and binds no context.
    """
    ctx = child.spawn_context(mp_context)
    by_value = wire.check_shippable("run_per_device", fn)
    wire.check_main("run_per_device")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, not {retries!r}")
    ordinals = child.resolve_ordinals(devices, _bind)
    visible = child.visible_for(ordinals, isolate)
    sent = devmem.Outgoing("run_per_device")
    payload = wire.dumps("run_per_device", (fn, tuple(args), dict(kwargs or {})), by_value, sent)
    for o in ordinals if len(sent) else ():
        sent.check_target(o, isolate)
    sent.synchronize()
    runner = _Runner(ctx, payload, ordinals, visible, isolate, timeout, retries, _bind, sent)
    try:
        return runner.run()
    finally:
        sent.release()  # every child has exited: nothing maps the memory any more


class _Child:
    __slots__ = ("attempt", "conn", "deadline", "index", "message", "prefix", "proc")

    def __init__(
        self, index: int, attempt: int, proc: Any, conn: Any, deadline: float | None, prefix: str
    ):
        self.index = index
        self.attempt = attempt
        self.proc = proc
        self.conn = conn
        self.deadline = deadline
        self.prefix = prefix
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
        sent: devmem.Outgoing,
    ) -> None:
        self.ctx = ctx
        self.payload = payload
        self.sent = sent
        self.ordinals = ordinals
        self.visible = visible
        self.isolate = isolate
        self.timeout = timeout
        self.retries = retries
        self.bind = bind
        self.running: dict[int, _Child] = {}
        self.started: list[Any] = []  # every Process, registered before its start()
        self.prefixes: list[str] = []  # and the shared-memory prefix of each
        self.results: list[Any] = [None] * len(ordinals)
        self.failures: dict[int, DeviceTaskError] = {}

    def run(self) -> list[Any]:
        try:
            for i in range(len(self.ordinals)):
                self._start(i, 1)
            while self.running:
                self._step()
        except BaseException:
            child.stop_processes(self.started, child.TERM_GRACE_S)
            for prefix in self.prefixes:
                shm.sweep(prefix)
            raise
        finally:
            for c in self.running.values():
                c.conn.close()
        if self.failures:
            raise self._summary()
        return self.results

    def _start(self, index: int, attempt: int) -> None:
        ordinal = self.ordinals[index]
        prefix = shm.child_prefix()
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
                    prefix,
                ),
                name=f"ctxkit-device-{ordinal}",
            )
            self.started.append(proc)
            self.prefixes.append(prefix)
            proc.start()
            wire.count_sent(self.payload, (), len(self.sent), self.sent.nbytes)
        except BaseException:
            reader.close()
            raise
        finally:
            writer.close()
        deadline = time.monotonic() + self.timeout if self.timeout is not None else None
        self.running[index] = _Child(index, attempt, proc, reader, deadline, prefix)

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
                child.stop_processes([c.proc], child.TERM_GRACE_S)
                self._settle(c, timed_out=c.message is None)

    def _receive(self, c: _Child) -> None:
        try:
            c.message = c.conn.recv()
        except (EOFError, OSError):
            pass
        else:
            c.deadline = time.monotonic() + child.EXIT_GRACE_S
        c.conn.close()

    def _settle(self, c: _Child, timed_out: bool) -> None:
        del self.running[c.index]
        c.conn.close()
        try:
            failure = self._outcome(c, timed_out)
        finally:
            shm.sweep(c.prefix)  # blocks of a child killed while sending its result
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
                loader = devmem.ResultLoader(self.sent, None, None)
                self.results[c.index] = wire.decode(msg[1], msg[2], loader)
                return None
            except Exception as exc:
                desc = wire.describe_exception(exc)
                return wire.error_from(
                    desc, ordinal, pid, code, c.attempt, f"device {ordinal}: result not loadable"
                )
        if msg is not None:
            return wire.error_from(
                msg[1], ordinal, pid, code, c.attempt, f"device {ordinal} ({tries})"
            )
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
            f"device {ordinal}: child process {pid} {child.exit_reason(code)} before "
            f"sending a result ({tries}): {child.death_hint(code)}",
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
    shm_prefix: str,
) -> None:
    """Entry point of a ``run_per_device`` child (spawned)."""
    child.current_device = ordinal
    parts: list[shm.Part] = []
    session: devmem.ChildSession | None = None
    try:
        child.child_setup(parent_pid, visible, shm_prefix)
        with child.bound_context(bind_ordinal, bind) as ctx:
            session = devmem.ChildSession(ctx, None, ordinal)
            fn, args, kwargs = wire.decode(payload, [], session)
            value = fn(ordinal, *args, **kwargs)
            data, parts = wire.result_bytes(fn, ordinal, value, wire.SHM_THRESHOLD, session)
            fn = args = kwargs = value = None
            session.finish()  # the parent sees the child's writes once it has the result
        msg: tuple[Any, ...] = ("ok", data, parts)
    except BaseException as exc:
        shm.discard(parts)
        parts = []
        if session is not None:
            session.abandon()
        msg = ("error", wire.describe_exception(exc))
    try:
        conn.send(msg)
    except Exception:
        shm.discard(parts)
    else:
        if msg[0] == "ok" and session is not None:
            wire.count_sent(msg[1], parts, session.sent, session.sent_bytes)
    conn.close()
