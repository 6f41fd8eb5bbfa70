"""The process side of a ``DevicePool`` worker: set up once, then run tasks until told to stop.

Messages from the parent: ``(task_id, data, parts, releases)`` (a task, after the
leases it releases), ``("release", leases)`` (sent while the worker is idle) and
``None`` (exit). Replies: ``("ready", pid)``, ``("init_error", desc)`` and
``("result", task_id, out, restart)`` with ``out`` = ``("ok", data, parts, leases)``
(``leases``: the device memory of the result this worker now keeps for the parent) or
``("error", desc)``.

A worker that must restart (a sticky CUDA error) while it still keeps memory for the
parent waits for the parent's ``None``: the parent closes its mappings of that memory
first (:class:`~.devmem.LeaseBook`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
from typing import Any

from . import devmem, spawn, wire

__all__ = ["worker_main"]


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
        while (msg := _receive(task_r)) is not None:
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


def _receive(task_r: Any) -> Any:
    """The parent's next message; ``None`` when it said stop or the pipe closed."""
    try:
        return task_r.recv()
    except (EOFError, OSError):
        return None


def _wait_for_stop(task_r: Any, leases: devmem.WorkerLeases) -> None:
    """Keep the memory lent to the parent until it has unmapped it: the parent answers a
    restart with releases and then ``None`` (or dies: EOF)."""
    while len(leases):
        msg = _receive(task_r)
        if msg is None:
            return
        if msg[0] == "release":
            leases.release(msg[1])
        elif len(msg) == 4:
            leases.release(msg[3])
