"""The process side of a ``DevicePool`` worker: set up once, then run tasks until told to stop."""

from __future__ import annotations

import contextlib
import os
import pickle
from typing import Any

from ..errors import CudaError
from . import child, shm, wire

__all__ = ["worker_main"]


def worker_main(
    task_r: Any,
    result_w: Any,
    ordinal: int,
    bind_ordinal: int,
    visible: str | None,
    bind: bool,
    parent_pid: int,
    threshold: int | None,
    init_payload: bytes,
    shm_prefix: str,
) -> None:
    """Entry point of a ``DevicePool`` worker (spawned)."""
    child.current_device = ordinal
    with contextlib.ExitStack() as stack:
        try:
            child.child_setup(parent_pid, visible, shm_prefix)
            ctx = stack.enter_context(child.bound_context(bind_ordinal, bind))
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
        task_id, data, parts = msg
        restart = False
        try:
            fn, args, kwargs = wire.decode(data, parts)
            value = fn(*args, **kwargs)
            out: tuple[Any, ...] = ("ok", *wire.result_bytes(fn, ordinal, value, threshold))
        except BaseException as exc:
            out = ("error", wire.describe_exception(exc))
            restart = isinstance(exc, ContextPoisonedError) or (
                isinstance(exc, CudaError) and exc.code in STICKY_CODES
            )
        fn = args = kwargs = value = msg = data = parts = None
        if ctx is not None and ctx.poisoned:
            restart = True
        try:
            result_w.send(("result", task_id, out, restart))
        except (OSError, ValueError):
            if out[0] == "ok":
                shm.discard(out[2])
            return
        if restart:
            return
