"""What a ``DevicePool`` keeps per task and per device, and the errors of lost tasks."""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from ..device import Device
from ..errors import DeviceTaskError
from . import child, shm, wire

__all__ = [
    "Slot",
    "Task",
    "TaskOptions",
    "check_timeout",
    "lost_error",
    "takes_keyword",
    "terminated_error",
]


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    """Where and how long one :class:`DevicePool` task runs (``pool.submit_to(options, ...)``).

    Attributes
    ----------
    device : int or Device, optional
        The pool device to run on; ``None`` picks the least-loaded one.
    timeout : float, optional
        Seconds the task may run once it is sent to its worker, loading its function and
        arguments included (time spent queued does not count; the worker's start-up and
        ``initializer`` do not either); ``None`` uses the pool's ``task_timeout``. A
        task still running then is stopped with its worker, which is replaced; its
        future fails with a :class:`DeviceTaskError` of ``kind == "timeout"``.
    """

    device: Device | int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        check_timeout(self.timeout, "TaskOptions(timeout=)")


def check_timeout(timeout: float | None, what: str) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{what} must be a positive number of seconds or None, not {timeout!r}")


class Task:
    __slots__ = (
        "future",
        "id",
        "label",
        "parts",
        "payload",
        "ready",
        "shm_bytes",
        "started",
        "timeout",
    )

    def __init__(self, tid: int, label: str, payload: wire.Payload, timeout: float | None):
        self.id = tid
        self.label = label
        self.payload = payload
        self.timeout = timeout
        self.parts: list[shm.Part] = []  # the message's buffers once sent
        self.shm_bytes = 0  # bytes of the pool's shared-memory budget it holds
        self.ready = True  # False while submit() still copies its buffers
        self.future: Future[Any] = Future()
        self.started = False


class Slot:
    """One device's worker: its process, pipes and queue.

    ``state``: starting -> idle <-> busy; restarting (worker exits after a sticky fault,
    or is being stopped for a timeout); stopping (told to exit); dead (exited, not
    replaced); broken (cannot start). ``stop_pending`` (a worker's pid): the manager
    thread closes the parent's mappings of that worker's memory, then sends it ``None``.
    """

    __slots__ = (
        "bind_ordinal",
        "broken",
        "current",
        "deadline",
        "kill_at",
        "ordinal",
        "pending",
        "prefix",
        "proc",
        "releases",
        "result_r",
        "send_lock",
        "state",
        "stop_pending",
        "task_w",
        "timed_out",
        "visible",
    )

    def __init__(self, ordinal: int, bind_ordinal: int, visible: str | None) -> None:
        self.ordinal = ordinal
        self.bind_ordinal = bind_ordinal
        self.visible = visible
        self.proc: Any = None
        self.task_w: Any = None
        self.result_r: Any = None
        self.send_lock = threading.Lock()  # one writer on task_w; close only under it
        self.prefix = ""
        self.state = "dead"
        self.pending: deque[Task] = deque()
        self.current: Task | None = None
        self.broken: DeviceTaskError | None = None
        self.deadline: float | None = None  # the current task's timeout
        self.kill_at: float | None = None  # SIGKILL if still alive then
        self.timed_out: Task | None = None
        self.releases: list[int] = []  # leases to release, sent with the next message
        self.stop_pending: int | None = None  # pid to send None once its memory is unmapped

    @property
    def load(self) -> int:
        return len(self.pending) + (self.current is not None) + (self.state == "starting")


def lost_error(
    slot: Slot, task: Task, pid: int, code: int | None, timed_out: bool
) -> DeviceTaskError:
    """The error of a task whose worker died under it (or was stopped for its timeout)."""
    head = f"task {task.label} on device {slot.ordinal}"
    if timed_out:
        return DeviceTaskError(
            f"{head} did not finish within {task.timeout:g} s: worker process {pid} was "
            f"stopped ({child.exit_reason(code)}) and replaced",
            device=slot.ordinal,
            kind="timeout",
            pid=pid,
            exitcode=code,
        )
    return DeviceTaskError(
        f"{head}: worker process {pid} {child.exit_reason(code)} while running it; the "
        f"worker was replaced. {child.death_hint(code)}",
        device=slot.ordinal,
        kind="crash",
        pid=pid,
        exitcode=code,
    )


def terminated_error(slot: Slot | None, task: Task) -> DeviceTaskError:
    """The error of a task the pool was terminated under."""
    where = f" on device {slot.ordinal}" if slot is not None else ""
    return DeviceTaskError(
        f"task {task.label}{where}: the DevicePool was terminated before it finished",
        device=slot.ordinal if slot is not None else -1,
        kind="terminated",
    )


def takes_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn(name=...)`` is a valid call as far as its signature tells (``True``
    when it cannot be inspected)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind in keyword)
        for p in params
    )
