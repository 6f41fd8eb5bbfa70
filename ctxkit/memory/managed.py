"""Unified (managed) memory: :class:`ManagedBuffer` (``cuMemAllocManaged``), visible to
the host as a numpy array and to every device, with prefetch and advice.

On devices without concurrent managed access the host must not touch the memory while
kernels run: host views synchronize first (:func:`concurrent_managed_access`).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from .. import _driver
from .._driver import drv
from ..binding import guard
from ..context import Context
from ..device import Device
from ..stream import Stream, call_stream
from . import alloc
from .device import DeviceBuffer
from .host import (
    HostMemory,
    plain_dtype,
)
from .sizes import covering_shape

__all__ = ["ManagedBuffer"]


_concurrent_managed: dict[int, bool] = {}


_ADVICE = {
    "read_mostly": "SET_READ_MOSTLY",
    "preferred_location": "SET_PREFERRED_LOCATION",
    "accessed_by": "SET_ACCESSED_BY",
}


def _advice(advice: Any) -> Any:
    if not isinstance(advice, str):
        return advice
    key = advice.lower().removeprefix("cu_mem_advise_")
    name = "CU_MEM_ADVISE_" + _ADVICE.get(key, key).upper()
    try:
        return getattr(drv.CUmem_advise, name)
    except AttributeError:
        valid = sorted([*_ADVICE, *(f"{p}_{k}" for k in _ADVICE for p in ("set", "unset"))])
        raise ValueError(f"unknown memory advice {advice!r}; use one of {valid}") from None


def concurrent_managed_access(device: Device) -> bool:
    """Whether the host may touch managed memory while kernels run on *device*."""
    if (known := _concurrent_managed.get(device.ordinal)) is None:
        known = bool(device.attribute("concurrent_managed_access"))
        _concurrent_managed[device.ordinal] = known
    return known


class ManagedBuffer(DeviceBuffer):
    """Unified (managed) memory (``cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)``).

    A :class:`DeviceBuffer` (copies, views, interop) that the host can also read and
    write through :meth:`as_numpy`.

    Host-access safety: on a device without ``concurrentManagedAccess`` (Windows,
    some embedded GPUs) the host must not touch managed memory while any kernel runs in
    the context, or the process gets a segmentation fault. :meth:`as_numpy`
    synchronizes the context before returning the view on such devices; launching work
    while you still use the view stays your responsibility there. Devices with
    concurrent access (Linux, Pascal and newer, e.g. H200) need no synchronization, but
    reading data a running kernel writes is still a race: synchronize its stream first.
    """

    kind = alloc.MANAGED

    __slots__ = ("_views",)

    _views: weakref.WeakSet[HostMemory]

    def __init__(self, nbytes: int, context: Any = None) -> None:
        super().__init__(nbytes, context)  # no stream-ordered managed memory

    def _alike(self, nbytes: int) -> ManagedBuffer:
        return ManagedBuffer(nbytes, self.context)

    def _setup_view(self, ptr: int, n: int, ctx: Context, base: DeviceBuffer | None) -> None:
        super()._setup_view(ptr, n, ctx, base)
        self._views = weakref.WeakSet()

    def as_numpy(self, dtype: Any = np.uint8, shape: Any = None) -> np.ndarray:
        """A numpy array over the managed memory (no copy); keeps the buffer alive.

        Synchronizes the context first on devices without ``concurrentManagedAccess``.
        """
        ptr = self.ptr
        dt = plain_dtype(dtype, "ManagedBuffer.as_numpy")
        shp = covering_shape(self.nbytes, dt, shape, "ManagedBuffer.as_numpy")
        if self.nbytes == 0:
            return np.empty(shp, dt)
        if not concurrent_managed_access(self.context.device):
            self.context.synchronize()
        mem = HostMemory(ptr, self.nbytes, owner=self)
        (self._base if isinstance(self._base, ManagedBuffer) else self)._views.add(mem)
        return np.asarray(mem).view(dt).reshape(shp)

    def close(self, stream: Any = None) -> None:
        """Free the memory now; refused while numpy views from :meth:`as_numpy` live.

        Raises
        ------
        ValueError
            Host views are still alive (freeing would leave them dangling).
        """
        if self._base is None and not self.closed and len(self._views):
            raise ValueError(
                f"cannot close {self!r}: {len(self._views)} numpy view(s) from as_numpy() "
                "are still alive; delete them first (the memory is freed with the last one)"
            )
        super().close()

    def prefetch(self, target: Any = None, stream: Any = None) -> None:
        """Migrate the pages to a device (Device/ordinal/Context; default: its own) or to
        the host (``"cpu"``), enqueued on *stream* (needs ``concurrentManagedAccess``).

        Managed memory is shared by every context, so *stream* may be a ctxkit Stream of
        any context, e.g. the stream of the device that will use the pages next (the
        prefetch is enqueued there, in that stream's context)."""
        what = "ManagedBuffer.prefetch"
        ptr = self.ptr
        tgt = self._target(target)
        if self.nbytes == 0:
            return
        ctx = stream.context if isinstance(stream, Stream) else self.context
        _, sh, _ = call_stream(stream, ctx, what)
        with guard(ctx, what):
            _driver.mem_prefetch(ptr, self.nbytes, tgt, sh)

    def _target(self, target: Any) -> int | str:
        """A device ordinal for a Device/int/Context (``None``: its own), or ``"cpu"``."""
        if target is None:
            return self.context.device.ordinal
        if isinstance(target, str):
            if target.lower() not in ("cpu", "host"):
                raise ValueError(f"target must be a device or 'cpu', got {target!r}")
            return "cpu"
        return target.device.ordinal if isinstance(target, Context) else Device(target).ordinal

    def advise(self, advice: Any, target: Any = None) -> None:
        """``cuMemAdvise``: *advice* is ``"read_mostly"``, ``"preferred_location"``,
        ``"accessed_by"`` (optionally prefixed ``"set_"``/``"unset_"``) or a
        ``CUmem_advise`` member; *target* a device (default: its own) or ``"cpu"``."""
        ptr = self.ptr
        adv = _advice(advice)
        tgt = self._target(target)
        if self.nbytes == 0:
            return
        with guard(self.context, "ManagedBuffer.advise"):
            _driver.mem_advise(ptr, self.nbytes, adv, tgt)
