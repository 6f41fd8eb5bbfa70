"""What a ``Pipeline.map`` run calls per chunk: the kernel (or body) launcher, and the
step tags that let a failure name the step it happened in."""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..errors import LaunchArgumentError
from ..module.kernel import Kernel
from ..stream import Stream
from .plan import Chunk, grid_size
from .staging import DeviceState
from .types import ChunkView

__all__ = ["Stopped", "check_param_count", "make_launcher", "tagged", "unblock_if_not_run"]


def make_launcher(
    kernel: Any, x: np.ndarray, out: np.ndarray, args: tuple[Any, ...], block: int
) -> Callable[..., None]:
    """``launch(dev, stream, d_in, d_out, n, chunk)`` for a Kernel or a callable body."""
    if isinstance(kernel, Kernel):
        check_param_count(kernel, args)

        def launch_kernel(
            dev: DeviceState, s: Stream, d_in: int, d_out: int, n: int, c: Chunk
        ) -> None:
            grid = grid_size(n, block, dev.max_blocks(block))
            kernel.launch(grid, block, d_in, d_out, n, *args, stream=s)

        return launch_kernel
    if callable(kernel):
        body = kernel
        in_tail, out_tail = x.shape[1:], out.shape[1:]
        in_dtype, out_dtype = x.dtype, out.dtype  # not the arrays: keep them collectable

        def launch_body(
            dev: DeviceState, s: Stream, d_in: int, d_out: int, n: int, c: Chunk
        ) -> None:
            body(
                dev.ctx,
                s,
                ChunkView(d_in, (c.rows, *in_tail), in_dtype),
                ChunkView(d_out, (c.rows, *out_tail), out_dtype),
                n,
                *args,
            )

        return launch_body
    raise TypeError(
        "kernel must be a ctxkit Kernel, an (ObjectCode, 'entry') pair or a callable "
        f"body(ctx, stream, d_in, d_out, n); got {type(kernel).__name__}"
    )


class Stopped(Exception):
    """Internal: the run was stopped while a worker waited."""


def tagged(fn: Callable[..., Any], step: str, *args: Any) -> Any:
    """Call *fn*; tag an exception with the pipeline step it happened in."""
    try:
        return fn(*args)
    except BaseException as exc:
        if not hasattr(exc, "_ctxkit_step"):
            try:
                exc._ctxkit_step = step  # type: ignore[attr-defined]
            except AttributeError:
                pass
        raise


def unblock_if_not_run(q: queue.SimpleQueue[Any], feeder: Future[Any]) -> None:
    """A feeder task that never ran (its worker could not start) still ends the drainer."""
    if feeder.cancelled() or feeder.exception() is not None:
        q.put(None)


def check_param_count(kernel: Kernel, args: tuple[Any, ...]) -> None:
    try:
        want = len(kernel.params)
    except Exception:  # no PTX signature to check against (e.g. a bare cubin)
        return
    if want != 3 + len(args):
        name = getattr(kernel, "name", "kernel")
        raise LaunchArgumentError(
            f"Pipeline.map calls {name}(d_in, d_out, n, *args) with {3 + len(args)} "
            f"arguments but {name} takes {want}: pass its extra parameters with "
            f"args=(...) (got args={args!r})"
        )
