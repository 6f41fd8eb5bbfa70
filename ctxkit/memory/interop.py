"""Stream order of foreign arrays: use a PyTorch/CuPy/CAI/DLPack array after its producer.

Another library writes an array on *its* stream (``with torch.cuda.stream(s): x.fill_(1)``)
and returns at once; a ctxkit kernel or copy on a ctxkit stream that only takes the
pointer can read the memory before the write has happened. The interchange protocols
say how the consumer orders itself after the producer:

* ``__cuda_array_interface__`` v3 carries the producer's ``stream``: the consumer makes
  its stream wait for the work enqueued there so far (an event recorded on it);
* DLPack: the consumer passes its stream to ``__dlpack__(stream=...)`` and the producer
  makes that stream wait;
* PyTorch's interface has no stream entry; its semantics (DLPack's) are that the
  tensor is ready on torch's current stream of its device, which is what
  :func:`producer_stream` reports for a tensor; CuPy's likewise is its current stream.

ctxkit's own objects need nothing: their users order them. Each type's way is worked
out once and cached, so the launch hot path pays one dictionary lookup per argument.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from .._driver import drv
from ..context import Context
from ..lifetime import finalizer
from ..stream import _context_of_cu

__all__ = ["order_after_producer", "order_after_producers", "producer_stream"]

_EVENT_DISABLE_TIMING = 2
_DLPACK_CPU = 1
_LEGACY = (0, 1)  # CAI v3 says 1 for the legacy default stream; the driver handle is 0

#: per type: None (nothing to order) or a function (value, consumer int, ctx) -> None
_orderers: dict[type, Callable[[Any, int, Context], None] | None] = {}
_lock = threading.Lock()


def _torch_stream(t: Any) -> int | None:
    if not getattr(t, "is_cuda", False):
        return None
    torch = sys.modules["torch"]
    return int(torch.cuda.current_stream(t.device).cuda_stream)


def _cupy_stream(a: Any) -> int | None:
    cupy = sys.modules["cupy"]
    return int(cupy.cuda.get_current_stream().ptr)


def _cai_stream(a: Any) -> int | None:
    value = a.__cuda_array_interface__.get("stream")
    return None if value is None else int(value)


def producer_stream(v: Any) -> int | None:
    """The stream (int handle; 1 = legacy default) a foreign array is ready on.

    ``None`` when nothing has to be ordered: ctxkit objects, numbers, host arrays, CAI
    objects without a ``stream`` entry, and DLPack producers (they order themselves
    through ``__dlpack__(stream=)``).
    """
    getter = _stream_getter(type(v), v)
    return None if getter is None else getter(v)


def _stream_getter(t: type, v: Any) -> Callable[[Any], int | None] | None:
    mod = t.__module__ or ""
    if mod == "ctxkit" or mod.startswith("ctxkit."):
        return None
    if mod.startswith("torch") and hasattr(v, "data_ptr") and hasattr(v, "is_cuda"):
        return _torch_stream
    if mod.startswith("cupy") and hasattr(getattr(v, "data", None), "ptr"):
        return _cupy_stream
    if hasattr(v, "__cuda_array_interface__"):
        return _cai_stream
    return None


def _classify(v: Any) -> Callable[[Any, int, Context], None] | None:
    t = type(v)
    getter = _stream_getter(t, v)
    if getter is not None:

        def order(value: Any, consumer: int, ctx: Context) -> None:
            producer = getter(value)
            if producer is not None:
                _wait(ctx, producer, consumer)

        return order
    mod = t.__module__ or ""
    if mod == "ctxkit" or mod.startswith("ctxkit."):
        return None
    if hasattr(v, "__dlpack__") and hasattr(v, "__dlpack_device__"):
        try:
            on_host = int(v.__dlpack_device__()[0]) == _DLPACK_CPU
        except Exception:
            return None
        return None if on_host else _order_dlpack
    return None


def _order_dlpack(v: Any, consumer: int, ctx: Context) -> None:
    # DLPack >= 1.0: the producer makes *consumer* wait; 1 means the legacy stream.
    v.__dlpack__(stream=consumer or 1)


def order_after_producer(v: Any, consumer: int, ctx: Context) -> None:
    """Make stream *consumer* (int handle, in *ctx*) wait until *v* is ready."""
    t = type(v)
    try:
        order = _orderers[t]
    except KeyError:
        order = _classify(v)
        with _lock:
            _orderers[t] = order
    if order is not None:
        order(v, consumer, ctx)


def order_after_producers(values: Iterable[Any], consumer: int, ctx: Context) -> None:
    """:func:`order_after_producer` for each of *values* (kernel arguments, copy ends)."""
    orderers = _orderers
    for v in values:
        order = orderers.get(type(v), _MISSING)
        if order is None:
            continue
        order_after_producer(v, consumer, ctx)


_MISSING: Any = object()


class _Holder:
    """Lives as long as its thread's state: the events die with it."""


class _Events(threading.local):
    """One reusable event per context and thread, for recording producer streams."""

    def __init__(self) -> None:
        self.by_context: dict[int, Any] = {}
        self.holder = _Holder()


_events = _Events()


def _wait(ctx: Context, producer: int, consumer: int) -> None:
    """Order *consumer* after the work enqueued on *producer* so far (event record/wait)."""
    if producer == consumer or (producer in _LEGACY and consumer in _LEGACY):
        return
    handle = drv.CUstream(0 if producer in _LEGACY else producer)
    owner = ctx if producer in _LEGACY else _stream_context(handle, ctx)
    with owner:
        event = _event(owner)
        (err,) = drv.cuEventRecord(event, handle)
        if err:
            raise owner.note_error(err, f"cuEventRecord on the producer stream {producer:#x}")
    with ctx:
        (err,) = drv.cuStreamWaitEvent(drv.CUstream(consumer), event, 0)
    if err:
        raise ctx.note_error(err, f"cuStreamWaitEvent({consumer:#x}) after producer {producer:#x}")


def _stream_context(handle: Any, fallback: Context) -> Context:
    err, cu = drv.cuStreamGetCtx(handle)
    if err or not int(cu):
        return fallback
    if int(cu) == fallback.handle:
        return fallback
    return _context_of_cu(cu)


def _event(ctx: Context) -> Any:
    events = _events.by_context
    ev = events.get(ctx.handle)
    if ev is None:
        err, ev = drv.cuEventCreate(_EVENT_DISABLE_TIMING)
        if err:
            raise ctx.note_error(err, "cuEventCreate for producer-stream ordering")
        events[ctx.handle] = ev
        finalizer(_events.holder, ctx, drv.cuEventDestroy, ev)
    return ev
