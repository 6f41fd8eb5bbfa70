"""Stream-ordered memory pools (``cuMemAllocAsync`` / ``cuMemFreeAsync``).

A :class:`MemoryPool` is a device's default pool (``cuDeviceGetDefaultMemPool``, what
``DeviceBuffer(n, stream=s)`` draws from), a pool ctxkit creates (``cuMemPoolCreate``),
or one another library made (:meth:`MemoryPool.from_handle`, e.g. a pool CuPy or PyTorch
uses). Freed memory returns to the pool in stream order and is reused without a driver
allocation, which is what makes allocating per iteration cheap; the release threshold
says how much unused memory the pool keeps across synchronizations. On top of it, ctxkit
caches freed blocks per stream for reuse without a driver call, like PyTorch's caching
allocator (:mod:`ctxkit.memory.blockcache`): they count as used in the driver's statistics
and in :attr:`MemoryPool.cached_bytes`; :meth:`MemoryPool.trim` gives them back.
"""

from __future__ import annotations

import weakref
from typing import Any

from .._driver import drv
from ..binding import ContextLike, resolve_context
from ..context import Context
from ..device import Device
from ..errors import ContextClosedError
from ..lifetime import finalizer
from . import blockcache
from .device import DeviceBuffer
from .sizes import nbytes_arg

__all__ = ["MemoryPool"]


def _pool_attr(name: str) -> Any:
    return getattr(drv.CUmemPool_attribute, f"CU_MEMPOOL_ATTR_{name}")


class MemoryPool:
    """A device memory pool for stream-ordered allocations.

    Parameters
    ----------
    device : Context, Device, int or None
        The device (its registry context is used for driver calls); ``None``: the
        calling thread's current context.
    release_threshold : int, optional
        Bytes of unused memory the pool keeps reserved across synchronizations (default
        0: everything unused is released at the next synchronization). ``None`` keeps
        the driver's value.
    max_size : int, optional
        Upper bound of the pool's reserved memory (0: no bound; new pools only).

    Notes
    -----
    ``MemoryPool(0)`` creates a new, private pool; ``MemoryPool.default(0)`` is the
    device's default pool, shared with every ``cuMemAllocAsync`` user of the process.
    Freed stream-ordered buffers keep their block in ctxkit's cache of their stream for
    the next allocation of that size there (no driver call): those blocks count in
    :attr:`used_bytes` and :attr:`cached_bytes` until :meth:`trim` (or
    ``CTXKIT_ALLOC_CACHE=0``, which disables the cache) gives them back.
    """

    __slots__ = ("__weakref__", "_fin", "context", "handle", "owned")

    _fin: weakref.finalize | None

    def __init__(
        self,
        device: ContextLike | None = 0,
        *,
        release_threshold: int | None = 0,
        max_size: int = 0,
    ) -> None:
        ctx = resolve_context(device, "MemoryPool()")
        props = drv.CUmemPoolProps()
        props.allocType = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = ctx.device.ordinal
        if max_size:
            props.maxSize = nbytes_arg(max_size, "MemoryPool", "max_size")
        with ctx:
            err, handle = drv.cuMemPoolCreate(props)
        if err:
            raise ctx.note_error(err, f"cuMemPoolCreate(device {ctx.device.ordinal})")
        self._setup(ctx, handle, owned=True)
        self._fin = finalizer(self, ctx, drv.cuMemPoolDestroy, handle)
        if release_threshold is not None:
            self.release_threshold = release_threshold

    def _setup(self, ctx: Context, handle: Any, owned: bool) -> None:
        self.context = ctx
        self.handle = handle
        self.owned = owned
        self._fin = None

    @classmethod
    def default(cls, device: ContextLike | None = 0) -> MemoryPool:
        """The device's default pool (``cuDeviceGetDefaultMemPool``); never destroyed."""
        ctx = resolve_context(device, "MemoryPool.default()")
        with ctx:
            err, handle = drv.cuDeviceGetDefaultMemPool(ctx.device.handle)
        if err:
            raise ctx.note_error(err, f"cuDeviceGetDefaultMemPool(device {ctx.device.ordinal})")
        return cls._wrap(ctx, handle)

    @classmethod
    def from_handle(cls, handle: Any, device: ContextLike | None = None) -> MemoryPool:
        """Wrap a pool made elsewhere (a ``CUmemoryPool`` or its int value); not owned."""
        ctx = resolve_context(device, "MemoryPool.from_handle()")
        value = handle if isinstance(handle, drv.CUmemoryPool) else drv.CUmemoryPool(int(handle))
        return cls._wrap(ctx, value)

    @classmethod
    def _wrap(cls, ctx: Context, handle: Any) -> MemoryPool:
        pool = cls.__new__(cls)
        pool._setup(ctx, handle, owned=False)
        return pool

    # --- attributes ------------------------------------------------------------------

    def _get(self, name: str) -> int:
        self._check_open()
        err, value = drv.cuMemPoolGetAttribute(self.handle, _pool_attr(name))
        if err:
            raise self.context.note_error(err, f"cuMemPoolGetAttribute({name})")
        return int(value)

    def _set(self, name: str, value: int) -> None:
        self._check_open()
        (err,) = drv.cuMemPoolSetAttribute(self.handle, _pool_attr(name), drv.cuuint64_t(value))
        if err:
            raise self.context.note_error(err, f"cuMemPoolSetAttribute({name}, {value})")

    @property
    def release_threshold(self) -> int:
        """Unused bytes the pool keeps reserved across synchronizations."""
        return self._get("RELEASE_THRESHOLD")

    @release_threshold.setter
    def release_threshold(self, nbytes: int) -> None:
        self._set("RELEASE_THRESHOLD", nbytes_arg(nbytes, "MemoryPool", "release_threshold"))

    @property
    def reserved_bytes(self) -> int:
        """Device memory the pool holds now (in use or cached)."""
        return self._get("RESERVED_MEM_CURRENT")

    @property
    def used_bytes(self) -> int:
        """Memory handed out to allocations that are not freed yet (the driver's count:
        blocks in ctxkit's cache, :attr:`cached_bytes`, are included)."""
        return self._get("USED_MEM_CURRENT")

    @property
    def cached_bytes(self) -> int:
        """Bytes of freed buffers ctxkit's block cache holds for reuse from this pool."""
        self._check_open()
        dev = self.context.device
        total = blockcache.cached_bytes(dev.ordinal, int(self.handle))
        with self.context:
            err, default = drv.cuDeviceGetDefaultMemPool(dev.handle)
        if not err and int(default) == int(self.handle):
            total += blockcache.cached_bytes(dev.ordinal, 0)
        return total

    @property
    def reserved_high(self) -> int:
        """High-water mark of :attr:`reserved_bytes`."""
        return self._get("RESERVED_MEM_HIGH")

    @property
    def used_high(self) -> int:
        """High-water mark of :attr:`used_bytes`."""
        return self._get("USED_MEM_HIGH")

    @property
    def device(self) -> Device:
        """The device whose memory the pool holds."""
        return self.context.device

    # --- operations ------------------------------------------------------------------

    def trim(self, keep: int = 0) -> None:
        """Release unused memory, keeping at least *keep* bytes reserved (``cuMemPoolTrimTo``).

        The blocks ctxkit's cache holds on the device are freed first, on their
        streams, and the device's contexts with cached blocks are synchronized so those
        frees complete: afterwards :attr:`used_bytes` and :attr:`reserved_bytes` have
        dropped. Other memory freed in stream order counts as in use until that free
        has completed: synchronize the freeing stream first to release it.
        """
        self._check_open()
        blockcache.flush(device=self.context.device.ordinal, sync=True)
        (err,) = drv.cuMemPoolTrimTo(self.handle, nbytes_arg(keep, "MemoryPool.trim", "keep"))
        if err:
            raise self.context.note_error(err, f"cuMemPoolTrimTo({keep})")

    def allocate(self, nbytes: int, stream: Any = None) -> DeviceBuffer:
        """A :class:`~ctxkit.DeviceBuffer` from this pool, ordered on *stream*."""
        return DeviceBuffer(nbytes, context=self.context, stream=stream, pool=self)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self.handle is None

    def _check_open(self) -> None:
        if self.handle is None:
            raise ContextClosedError("the memory pool was closed")

    def close(self) -> None:
        """Destroy an owned pool (its allocations must be freed first); idempotent.
        A borrowed or default pool is only forgotten. Blocks of an owned pool in
        ctxkit's cache are freed first."""
        fin = self._fin
        if fin is not None:
            if fin.alive:
                blockcache.flush(device=self.context.device.ordinal, sync=True)
            fin()
        self.handle = None

    def __repr__(self) -> str:
        if self.handle is None:
            return "<MemoryPool closed>"
        kind = "owned" if self.owned else "borrowed"
        return f"<MemoryPool {int(self.handle):#x} {kind} device={self.device.ordinal}>"
