"""Memory arguments of a launch: which device they live on, and their producer streams.

A ctxkit buffer or array knows its context: one of another device is refused unless the
launch's context has peer access to it (a kernel reading it would fault, and a fault
poisons every context of the process); managed memory passes everywhere. Foreign arrays
(CuPy, PyTorch, ``__cuda_array_interface__``, DLPack) are used after their producer
stream (:mod:`ctxkit.memory.interop`). The argument packer
(:mod:`ctxkit.module.params`) calls these only off its inline fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..context import Context
from ..memory.copies import peer_access_enabled
from ..memory.device import DeviceArray, DeviceBuffer
from ..memory.interop import order_after_producers
from ..memory.managed import ManagedBuffer
from .pointers import Refused

__all__ = ["OWN_TYPES", "foreign_arrays", "order_foreign", "pointer_of", "remember_pointer_type"]


#: type -> ``pointer(value, launch context)`` for the memory types seen as pointer arguments
pointer_of: dict[type, Callable[[Any, Any], int]] = {}


def remember_pointer_type(t: type, g: Callable[..., int]) -> Callable[[Any, Any], int]:
    """Record how a pointer of type *t* is read (*g*: its :mod:`~ctxkit.module.pointers`
    getter, which takes ``(value, ctx)``); ctxkit buffers and arrays also get the device
    check."""
    if issubclass(t, DeviceBuffer):
        two: Callable[[Any, Any], int] = _buffer_pointer
    elif issubclass(t, DeviceArray):
        two = _array_pointer
    else:
        two = g
    pointer_of[t] = two
    return two


def _buffer_pointer(v: DeviceBuffer, ctx: Context | None) -> int:
    if v.context is not ctx and ctx is not None:
        _check_reachable(v, v, ctx)
    return v.ptr


def _array_pointer(v: DeviceArray, ctx: Context | None) -> int:
    b = v.buffer
    if b.context is not ctx and ctx is not None:
        _check_reachable(v, b, ctx)
    return b.ptr


def _check_reachable(v: Any, buf: DeviceBuffer, ctx: Context) -> None:
    """Refuse memory of another device the launch's context cannot access.

    A kernel reading it would fault, and a fault poisons every context of the process.
    Managed memory, memory of the launch's own device and peer-enabled pairs pass.
    """
    owner = buf.context
    there, here = owner.device.ordinal, ctx.device.ordinal
    if there == here or isinstance(buf, ManagedBuffer) or peer_access_enabled(ctx, owner):
        return
    base = buf._base if buf._base is not None else buf
    what = "" if base is buf else " (a view)"
    raise Refused(
        f"got a {type(v).__name__}{what} on device {there} ({owner!r}), but the kernel "
        f"launches on device {here} ({ctx!r}) without peer access to it; the kernel "
        f"would fault. Enable it first (ck.enable_peer_access(<device {here} context>, "
        f"<device {there} context>), once; see ck.Device({here}).can_access_peer), or "
        f"copy the data to device {here} (ck.copy_peer), or use managed memory "
        "(ck.ManagedBuffer)"
    )


#: argument types that never need ordering after a producer stream
OWN_TYPES = frozenset({int, bool, float, type(None), DeviceBuffer, DeviceArray, ManagedBuffer})


def foreign_arrays(args: Sequence[Any]) -> list[Any]:
    """The arguments that may have a producer stream: not numbers, bytes, host arrays or
    ctxkit buffers."""
    return [
        v
        for v in args
        if type(v) not in OWN_TYPES
        and not isinstance(v, (np.ndarray, np.generic, bytes, bytearray, memoryview))
    ]


def order_foreign(
    args: Sequence[Any], stream: Any, ctx: Context | None, consumer: Any = None
) -> None:
    """Make *stream* (a handle; ``None``: the legacy default) wait for the producers of the
    foreign arrays among *args* (``__cuda_array_interface__`` streams, DLPack, PyTorch,
    CuPy; see :mod:`ctxkit.memory.interop`). *consumer* is the stream object the launch
    was given (``None``: the current stream), whose flags spare waits CUDA makes anyway.
    Numbers, host arrays and ctxkit buffers cost one dictionary lookup each."""
    order_after_producers(args, stream, ctx, consumer)
