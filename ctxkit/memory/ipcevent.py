"""Events other processes can wait for: :func:`ipc_event` creates one
(``CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING``), and ``_wrap_event`` makes an
:class:`~ctxkit.Event` of a driver handle, one created here or opened from another
process's handle, destroyed in its context when dropped.

Their handles are exchanged by :func:`~ctxkit.memory.ipc.export_event` and
:func:`~ctxkit.memory.ipc.import_event`; :mod:`ctxkit.memory.ipc` re-exports
:func:`ipc_event`.
"""

from __future__ import annotations

from typing import Any

from .._driver import drv
from ..binding import resolve_context
from ..context import Context
from ..errors import CudaError
from ..lifetime import finalizer
from ..stream import EVENT_BLOCKING_SYNC, EVENT_DISABLE_TIMING, Event

__all__ = ["ipc_event"]


EVENT_INTERPROCESS = 4  # CU_EVENT_INTERPROCESS


_NOT_SUPPORTED = 801


def _wrap_event(ctx: Context, handle: Any) -> Event:
    """An :class:`Event` for a handle made here (destroyed in *ctx* when dropped)."""
    ev = Event.__new__(Event)
    ev.context = ctx
    ev.handle = handle
    ev.timing = False
    ev._recorded = False
    ev._fin = finalizer(ev, ctx, drv.cuEventDestroy, handle)
    return ev


def ipc_event(context: Any = None, *, blocking: bool = False) -> Event:
    """An event other processes can wait for (``CU_EVENT_INTERPROCESS |
    CU_EVENT_DISABLE_TIMING``); share it with :func:`export_event`.

    Parameters
    ----------
    context : Context, Device, int or None
        As for :class:`~ctxkit.Event`.
    blocking : bool
        ``CU_EVENT_BLOCKING_SYNC``: ``synchronize()`` sleeps instead of spinning.

    Raises
    ------
    CudaError
        ``CUDA_ERROR_NOT_SUPPORTED``: the device cannot share events
        (``ipc_event_supported`` is 0).
    """
    ctx = resolve_context(context, "ipc_event")
    if not ctx.device.attribute("ipc_event_supported"):
        raise CudaError(
            f"ipc_event: device {ctx.device.ordinal} cannot share events between processes "
            "(ipc_event_supported is 0); order the processes through the host instead "
            "(synchronize, then send a message)",
            _NOT_SUPPORTED,
            "CUDA_ERROR_NOT_SUPPORTED",
        )
    flags = EVENT_INTERPROCESS | EVENT_DISABLE_TIMING | (EVENT_BLOCKING_SYNC if blocking else 0)
    with ctx:
        err, handle = drv.cuEventCreate(flags)
    if err:
        raise ctx.note_error(err, f"cuEventCreate(INTERPROCESS|DISABLE_TIMING, flags={flags})")
    return _wrap_event(ctx, handle)
