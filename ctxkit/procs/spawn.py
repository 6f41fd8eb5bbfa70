"""Child processes of ``ctxkit.procs`` and ``run_per_device``: one spawned process per GPU.

How a child is started, set up, stopped and described (shared with :mod:`.pool`'s
workers): spawn only (see ``procs``); a child ignores SIGINT (the parent turns Ctrl-C
into stopping its children), dies with its parent on Linux, and sees only its device
when isolated. :func:`run_per_device` starts one child per device and returns their
results in order (the family's overview is in :mod:`ctxkit.procs`).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .. import _driver
from .._driver import call, drv
from ..binding import check_devices, registry
from ..context import Context
from ..device import Device, device_count
from ..errors import STICKY_CODES, ContextPoisonedError, CudaError, DeviceTaskError
from . import devmem, wire

__all__ = ["run_per_device", "worker_device"]


#: Seconds between SIGTERM and SIGKILL when a child must be stopped.
TERM_GRACE_S = 2.0


#: Seconds a child may take to exit after it sent its result (e.g. teardown after a fault).
EXIT_GRACE_S = 10.0


#: The lane a ctxkit child process serves (its ordinal: ``procs.worker_device``).
current_lane: LaneSpec | None = None


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def exit_reason(exitcode: int | None) -> str:
    """Human words for a process exit code (negative: killed by that signal)."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        return f"was killed by {sig} ({-exitcode})"
    return f"exited with code {exitcode}"


def death_hint(exitcode: int | None) -> str:
    """What a child's death without a result most likely means, for the error message."""
    if exitcode == -signal.SIGBUS:
        free, total = wire.shm_space()
        room = f"{free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB" if total else "absent"
        return (
            "out of shared memory: a process gets SIGBUS when it writes to a shared-memory "
            f"mapping that /dev/shm cannot back (/dev/shm now: {room}). Docker's default "
            "/dev/shm is 64 MiB: start the container with --shm-size=<size> or --ipc=host, "
            "or free /dev/shm"
        )
    return (
        "a native crash, os._exit(), the OOM killer or a fatal GPU fault look like this; "
        "check the child's stderr and `dmesg`"
    )


def visible_entry(ordinal: int, env: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows a child only logical device *ordinal*.

    *env* is the parent's value: its ordinal-th entry is picked (ids, UUIDs and MIG
    names alike), or ``str(ordinal)`` when the parent sets none.
    """
    if env is None:
        return str(ordinal)
    entries = [e.strip() for e in env.split(",") if e.strip()]
    if ordinal >= len(entries):
        raise ValueError(
            f"isolate=True: device {ordinal} is not in this process's "
            f"CUDA_VISIBLE_DEVICES={env!r} ({len(entries)} entries)"
        )
    return entries[ordinal]


def visible_for(ordinals: list[int], isolate: bool) -> list[str | None]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [visible_entry(o, env) if isolate else None for o in ordinals]


def stop_processes(procs: Iterable[Any], grace: float) -> None:
    """SIGTERM every live process, wait up to *grace* seconds in total, then SIGKILL."""
    live = [p for p in procs if p.is_alive()]
    for p in live:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + grace
    for p in live:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in [p for p in live if p.is_alive()]:
        with contextlib.suppress(Exception):
            p.kill()
        p.join()


def spawn_context(mp_context: Any) -> Any:
    if mp_context is None:
        return multiprocessing.get_context("spawn")
    if (method := mp_context.get_start_method()) != "spawn":
        raise ValueError(
            f"ctxkit.procs needs the 'spawn' start method, got a {method!r} context: a "
            "process forked after CUDA was initialised cannot use CUDA (every driver call "
            "fails), and forking a multithreaded process can deadlock. Pass "
            "multiprocessing.get_context('spawn') or leave mp_context=None"
        )
    return mp_context


#: A lane's key in ``DevicePool.pids`` and ``DeviceTaskError.failures``: the ordinal of a
#: device entry, the Context given for a lane entry (a green or owned context).
LaneKey = int | Context


#: ``CU_CTX_FLAGS_MASK``: the flags ``cuCtxCreate`` takes (``cuCtxGetFlags`` may say more).
_CTX_FLAGS_MASK = 0xFF


@dataclasses.dataclass(frozen=True)
class LaneSpec:
    """What a child process needs to make the context it works in (picklable).

    ``kind``: ``"device"`` (the registry's context of the device), ``"green"`` (a green
    context of ``sm_count`` SMs) or ``"owned"`` (an owned context made with ``flags``).
    *ordinal* is the logical ordinal, as the parent numbers devices. Made in the parent
    by :func:`lane_spec`; the child makes its own context of that kind with
    :func:`lane_context`.
    """

    ordinal: int
    kind: str = "device"
    sm_count: int = 0
    flags: int = 0

    def __str__(self) -> str:
        """``device 0``, ``device 0 (green, 16 SMs)`` or ``device 0 (owned context)``."""
        if self.kind == "green":
            return f"device {self.ordinal} (green, {self.sm_count} SMs)"
        if self.kind == "owned":
            return f"device {self.ordinal} (owned context)"
        return f"device {self.ordinal}"


def lane_key(entry: Context | Device | int) -> LaneKey:
    """The key of a ``devices=`` entry (or a ``submit_to`` target): a green or owned
    Context is a lane of its own; a primary or foreign one, a Device and an ordinal mean
    the device."""
    if isinstance(entry, Context):
        return entry if entry.kind in ("green", "owned") else entry.device.ordinal
    return ordinal_of(entry, False)


def lane_spec(entry: Context | Device | int, bind: bool) -> LaneSpec:
    """The :class:`LaneSpec` of a ``devices=`` entry (in the parent): a green Context's
    SM count, an owned one's flags (``cuCtxGetFlags``), the device of any other entry."""
    if not isinstance(entry, Context):
        return LaneSpec(ordinal_of(entry, bind))
    entry.check_usable()
    ordinal = entry.device.ordinal
    if entry.kind == "green":
        return LaneSpec(ordinal, "green", sm_count=entry.sm_count)
    if entry.kind == "owned":
        with entry:
            flags = int(call(drv.cuCtxGetFlags, what=f"cuCtxGetFlags of {entry!r}"))
        return LaneSpec(ordinal, "owned", flags=flags & _CTX_FLAGS_MASK)
    return LaneSpec(ordinal)


def resolve_lanes(
    devices: Sequence[Context | Device | int] | None, bind: bool
) -> dict[LaneKey, LaneSpec]:
    """The lanes of a ``devices=`` argument, by key (:func:`lane_key`), in order.

    Raises
    ------
    ValueError
        No device, or one device (ordinal, Device, primary Context) or one Context listed
        twice; ``None`` with *bind* false.
    """
    if devices is None:
        if not bind:
            raise ValueError("_bind=False needs an explicit list of device ordinals")
        if (n := device_count()) == 0:
            Device(0)  # raises the precise reason (no driver / no device)
        return {o: LaneSpec(o) for o in range(n)}
    lanes: dict[LaneKey, LaneSpec] = {}
    for entry in check_devices(devices, "run_per_device/DevicePool", lanes=True) or ():
        key = lane_key(entry)
        if key in lanes:
            name = f"context {entry!r}" if isinstance(key, Context) else f"device {key}"
            raise ValueError(
                f"run_per_device/DevicePool: {name} is listed twice in devices={list(devices)!r}"
            )
        lanes[key] = lane_spec(entry, bind)
    return lanes


def ordinal_of(d: Context | Device | int, bind: bool) -> int:
    """The logical ordinal of a device entry (checked against the driver with *bind*)."""
    if isinstance(d, Context):
        return d.device.ordinal
    if bind:
        return Device(d).ordinal
    if isinstance(d, bool) or not isinstance(d, (int, Device)):
        raise TypeError(
            f"device must be an int ordinal, a ctxkit.Device or a ctxkit.Context, got {d!r}"
        )
    return int(d)


@contextlib.contextmanager
def lane_context(lane: LaneSpec, ordinal: int) -> Iterator[Context]:
    """In a child: make *lane*'s context on device *ordinal* (the child's numbering) and
    keep it current for the block.

    A device lane binds the registry's context. A green or owned lane makes its own
    context of that kind and registers it (``registry.set``): ``ck.bind(ordinal)`` and
    everything else that resolves the device in this process use it. It is closed after
    the block (unless a fault poisoned it: the process exit frees it then).
    """
    if lane.kind == "device":
        with registry.context(ordinal) as ctx:
            yield ctx
        return
    if lane.kind == "owned":
        ctx = Context.create(ordinal, flags=lane.flags)
    else:
        ctx = _green(Device(ordinal), lane.sm_count)
    try:
        registry.set(ordinal, ctx)
        with ctx:
            yield ctx
    finally:
        if not ctx.poisoned:
            with contextlib.suppress(Exception):
                ctx.close()


def _green(dev: Device, sm_count: int) -> Context:
    """A green context of *sm_count* SMs of *dev*: ``Context.green`` where that is a
    partition size of the device; else (the remainder of a partition, which no request
    gives) what is left of a split of the other SMs."""
    _driver.require_green(f"a green lane of {sm_count} SMs on device {dev.ordinal}")
    low, step = dev.sm_granularity
    total = int(_driver.sm_resource(dev.handle).sm.smCount)
    if (sm_count >= low and sm_count % step == 0) or not 0 < sm_count < total:
        return Context.green(dev, sm_count)
    *others, rest = dev.partition([total - sm_count])
    for ctx in others:
        ctx.close()
    return rest


@dataclasses.dataclass(frozen=True)
class Child:
    """What a spawned child needs to set itself up, chosen by its parent: the lane it
    serves (its device and kind of context), its ``CUDA_VISIBLE_DEVICES`` (``None`` unless
    isolated; then its device is 0 there), whether it binds a context at all, and (filled
    in by the parent) the parent's pid and the child's shared-memory prefix."""

    lane: LaneSpec
    visible: str | None
    bind: bool
    parent_pid: int = dataclasses.field(default_factory=os.getpid)
    shm_prefix: str = dataclasses.field(default_factory=wire.child_shm_prefix)

    @property
    def ordinal(self) -> int:
        """The logical device ordinal, as the parent numbers devices."""
        return self.lane.ordinal

    @contextlib.contextmanager
    def setup(self) -> Iterator[Any]:
        """First thing a spawned child does, before it unpickles any user code.

        Ignores SIGINT, asks Linux to kill this process when the parent thread that
        started it dies, applies ``CUDA_VISIBLE_DEVICES`` isolation while CUDA is still
        uninitialised, names its shared-memory blocks with the prefix its parent chose
        (so the parent can remove them if this process dies while sending); then makes
        its lane's context current for the block (:func:`lane_context`; ``None`` without
        *bind*).
        """
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _die_with_parent(self.parent_pid)
        if self.visible is not None:
            if _driver.initialized():
                raise RuntimeError(
                    "isolate=True: CUDA was already initialised in the child before "
                    "CUDA_VISIBLE_DEVICES could be set (the main module touched CUDA at "
                    "import); guard the program's top-level code with "
                    "`if __name__ == '__main__':`"
                )
            os.environ["CUDA_VISIBLE_DEVICES"] = self.visible
        wire.set_shm_prefix(self.shm_prefix)
        global current_lane
        current_lane = self.lane
        ordinal = 0 if self.visible is not None else self.ordinal
        with lane_context(self.lane, ordinal) if self.bind else contextlib.nullcontext() as ctx:
            yield ctx


def worker_device() -> int | None:
    """The logical device ordinal this process serves, inside a ``run_per_device`` child
    or a ``DevicePool`` worker; ``None`` elsewhere."""
    return current_lane.ordinal if current_lane is not None else None


def run_per_device(
    fn: Callable[..., Any],
    devices: Sequence[Context | Device | int] | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float | None = None,
    retries: int = 0,
    isolate: bool = False,
    *,
    mp_context: Any = None,
    _bind: bool = True,
) -> list[Any]:
    """Run ``fn(ordinal, *args, **kwargs)`` in one spawned process per device (or lane).

    Each child makes the registry's context of its device current for the duration of
    ``fn`` (``ctxkit.registry.context(ordinal)``), so ``fn`` can allocate, compile and
    launch right away; a lane's child makes its own context of the lane's kind instead
    (see *devices*). Results come back in the order of *devices*.

    Parameters
    ----------
    fn : callable
        A module-level function, imported by name in each  A lambda, a closure or
        a function defined in a notebook, REPL or ``python -c`` is sent by value with
        cloudpickle when it is installed (else refused before anything starts). Its
        return value must be picklable host data; numpy arrays of ``SHM_THRESHOLD``
        bytes or more come back through shared memory (through the pipe when
        ``/dev/shm`` has no room for them). It may return a device argument (or a view
        of one): the parent gets its own object back. Device memory allocated in the
        child cannot be returned (the child exits): that result fails with a
        ``TypeError`` naming the fixes (or use a :class:`DevicePool`).
    devices : sequence of int, Device or Context, optional
        Default: every visible device. Each may appear once. A green or owned Context
        is a lane: its child runs in a context of its own of the same kind on that
        device, as a :class:`DevicePool` lane's worker does (the same SM count, or the
        same flags; the parent's context never leaves the parent), so distinct contexts
        of one device each get a child. A primary or foreign Context means its device.
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
        failed) and ``.failures`` every failed device's error by ordinal (by the
        Context given, for a lane).
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
    ctx = spawn_context(mp_context)
    by_value = wire.check_shippable("run_per_device", fn)
    wire.check_main("run_per_device")
    check_timeout(timeout, "timeout")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, not {retries!r}")
    lanes = resolve_lanes(devices, _bind)
    visible = visible_for([lane.ordinal for lane in lanes.values()], isolate)
    sent = devmem.Outgoing("run_per_device")
    payload = wire.dumps("run_per_device", (fn, tuple(args), dict(kwargs or {})), by_value, sent)
    for lane in lanes.values() if sent.sent else ():
        sent.check_target(lane.ordinal, isolate)
    sent.synchronize()
    runner = _Runner(ctx, payload, lanes, visible, timeout, retries, _bind, sent)
    try:
        return runner.run()
    finally:
        sent.release()  # every child has exited: nothing maps the memory any more


def check_timeout(timeout: float | None, what: str) -> None:
    """``ValueError`` unless *timeout* is a positive number of seconds or ``None``."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{what} must be a positive number of seconds or None, not {timeout!r}")


@dataclasses.dataclass(slots=True)
class _Running:
    index: int
    attempt: int
    proc: Any
    conn: Any
    deadline: float | None
    prefix: str
    message: Any = None


@dataclasses.dataclass
class _Runner:
    """Starts, watches, retries and reaps the children of one ``run_per_device`` call."""

    ctx: Any
    payload: bytes
    lanes: dict[LaneKey, LaneSpec]
    visible: list[str | None]
    timeout: float | None
    retries: int
    bind: bool
    sent: devmem.Outgoing
    running: dict[int, _Running] = dataclasses.field(default_factory=dict)  # from before start()
    failures: dict[LaneKey, DeviceTaskError] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys, self.specs = list(self.lanes), list(self.lanes.values())

    def run(self) -> list[Any]:
        self.results: list[Any] = [None] * len(self.specs)
        try:
            for i in range(len(self.specs)):
                self._start(i, 1)
            while self.running:
                self._step()
        except BaseException:
            stop_processes([c.proc for c in self.running.values()], TERM_GRACE_S)
            for c in self.running.values():
                wire.sweep_blocks(c.prefix)
            raise
        finally:
            for c in self.running.values():
                c.conn.close()
        if self.failures:
            raise self._summary()
        return self.results

    def _start(self, index: int, attempt: int) -> None:
        child = Child(self.specs[index], self.visible[index], self.bind)
        reader, writer = self.ctx.Pipe(duplex=False)
        name = f"ctxkit-device-{child.ordinal}"
        proc = self.ctx.Process(target=_child_main, args=(writer, self.payload, child), name=name)
        c = self.running[index] = _Running(index, attempt, proc, reader, None, child.shm_prefix)
        try:
            proc.start()
            wire.count_sent(self.payload, (), self.sent)
        finally:
            writer.close()
        c.deadline = time.monotonic() + self.timeout if self.timeout is not None else None

    def _step(self) -> None:
        children = list(self.running.values())
        waits: list[Any] = [c.conn for c in children if not c.conn.closed]
        waits += [c.proc.sentinel for c in children]
        deadlines = [c.deadline for c in children if c.deadline is not None]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready = multiprocessing.connection.wait(waits, wait_s)
        for c in children:  # an exited child's last message may not be among those ready
            exited = c.proc.sentinel in ready
            if not c.conn.closed and (c.conn in ready or (exited and c.conn.poll())):
                self._receive(c)
        now = time.monotonic()
        for c in children:
            if c.proc.sentinel in ready:
                c.proc.join()
                self._settle(c, timed_out=False)
            elif c.deadline is not None and now >= c.deadline:
                stop_processes([c.proc], TERM_GRACE_S)
                self._settle(c, timed_out=c.message is None)

    def _receive(self, c: _Running) -> None:
        with contextlib.suppress(EOFError, OSError):
            c.message = c.conn.recv()
            c.deadline = time.monotonic() + EXIT_GRACE_S
        c.conn.close()

    def _settle(self, c: _Running, timed_out: bool) -> None:
        del self.running[c.index]
        c.conn.close()
        try:
            failure = self._outcome(c, timed_out)
        finally:
            wire.sweep_blocks(c.prefix)  # blocks of a child killed while sending its result
        if failure is not None and c.attempt <= self.retries:
            self._start(c.index, c.attempt + 1)
        elif failure is not None:
            self.failures[self.keys[c.index]] = failure

    def _outcome(self, c: _Running, timed_out: bool) -> DeviceTaskError | None:
        lane = self.specs[c.index]
        pid, code = c.proc.pid, c.proc.exitcode
        tries = f"attempt {c.attempt} of {self.retries + 1}"
        if c.message is not None:
            loader = devmem.ResultLoader(self.sent, None, None)
            head = f"{lane} ({tries})"
            value, err = wire.outcome(c.message, loader, head, lane.ordinal, pid, code, c.attempt)
            self.results[c.index] = value
            return err
        kind = "timeout" if timed_out else "crash"
        if timed_out:
            what = f"did not finish within {self.timeout:g} s and was stopped ({tries})"
        else:
            what = f"{exit_reason(code)} before sending a result ({tries}): {death_hint(code)}"
        return DeviceTaskError(
            f"{lane}: child process {pid} {what}",
            device=lane.ordinal,
            kind=kind,
            pid=pid,
            exitcode=code,
            attempts=c.attempt,
        )

    def _summary(self) -> DeviceTaskError:
        order = [i for i, k in enumerate(self.keys) if k in self.failures]
        err = first = self.failures[self.keys[order[0]]]
        if len(order) > 1:
            others = "; ".join(
                f"{self.specs[i]}: {self.failures[self.keys[i]].kind}" for i in order[1:]
            )
            err = copy.copy(first)  # every attribute of the first failure, a new message
            err.args = (
                f"{len(order)} of {len(self.specs)} devices failed (also {others}). "
                f"First failure:\n{first}",
            )
        err.results = self.results
        err.failures = dict(self.failures)
        return err


def run_task(
    data: bytes,
    parts: list[wire.Part],
    threshold: int | None,
    session: devmem.ChildSession,
    lead: tuple[Any, ...] = (),
) -> tuple[tuple[Any, ...], bool]:
    """Run one task, ``fn(*lead, *args, **kwargs)`` (in a pool worker or a
    ``run_per_device`` child, on the device and in the context of *session*); returns
    the reply's ``out`` and whether the process must restart (a sticky CUDA error)."""
    restart = False
    out_parts: list[wire.Part] = []
    try:
        fn, args, kwargs = wire.decode(data, parts, session)
        value = fn(*lead, *args, **kwargs)
        out_data, out_parts = wire.result_bytes(fn, value, threshold, session)
        fn = args = kwargs = value = None
        session.finish()
        out: tuple[Any, ...] = ("ok", out_data, out_parts, list(session.new_leases))
    except BaseException as exc:
        wire.discard_blocks(out_parts)
        fn = args = kwargs = value = None
        session.abandon()
        out = ("error", wire.describe_exception(exc))
        restart = isinstance(exc, ContextPoisonedError) or (
            isinstance(exc, CudaError) and exc.code in STICKY_CODES
        )
    return out, restart or bool(session.context is not None and session.context.poisoned)


def reply(conn: Any, msg: Any, out: tuple[Any, ...], session: devmem.ChildSession | None) -> bool:
    """Send *msg*, which holds a task's *out*, and count it; ``False`` when the parent is
    gone (the result's blocks are removed then)."""
    try:
        conn.send(msg)
    except Exception:
        if out[0] == "ok":
            wire.discard_blocks(out[2])
        return False
    if out[0] == "ok":
        wire.count_sent(out[1], out[2], session)
    return True


def _child_main(conn: Any, payload: bytes, child: Child) -> None:
    """Entry point of a ``run_per_device`` child (spawned)."""
    msg: tuple[Any, ...] = ("none",)
    session: devmem.ChildSession | None = None
    try:
        with child.setup() as ctx:
            session = devmem.ChildSession(ctx, None, child.ordinal)
            msg = run_task(payload, [], wire.SHM_THRESHOLD, session, (child.ordinal,))[0]
    except BaseException as exc:
        if msg[0] == "ok":
            wire.discard_blocks(msg[2])
        msg = ("error", wire.describe_exception(exc))
    reply(conn, msg, msg, session)
    conn.close()
