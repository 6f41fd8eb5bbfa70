"""The allocation protocol and the stream-ordered block cache.

Every kind of memory ctxkit allocates is one :class:`MemoryKind`, data rather than a
subclass hook: the driver call that allocates it (with its fixed arguments), the one that
frees it, how DLPack names it and whether it may come stream-ordered from a pool.
:meth:`MemoryKind.allocate` makes an allocation in the bound context and
:meth:`MemoryKind.deallocate` ties its free to its owner; :data:`KINDS` lists them
(device, managed, pinned host). Stream-ordered (pooled) device memory comes from the
block cache below (:func:`allocate`, :func:`give_back`).

The cache of freed stream-ordered device blocks (what PyTorch's caching allocator does).

``close()`` (or garbage collection) of a stream-ordered :class:`~ctxkit.DeviceBuffer`
puts its block in the cache of the stream it is freed on, with no driver call; a new
``DeviceBuffer(n, stream=s)`` takes a block of that size class from the cache of *s*,
again with no driver call. Reuse on the same stream is safe by stream order: every use
of the old buffer was enqueued on *s* before the new one's. A block is never handed to
another stream.

Caches are per (context, pool, stream). Size classes are multiples of 512 bytes (at most
511 bytes of slack per buffer, like PyTorch's small-size rounding): a loop that allocates
the same shapes every iteration hits; other sizes go to the driver's pool, which reuses
memory itself, only slower (a driver call).

The driver is called on a miss (``cuMemAllocAsync`` / ``cuMemAllocFromPoolAsync``) and
when blocks are given back (``cuMemFreeAsync`` on the block's stream): by
:meth:`MemoryPool.trim <ctxkit.MemoryPool.trim>`, by an allocation that fails with
out-of-memory (the device's blocks are freed, the device synchronized, the allocation
retried once), when a device's cached bytes exceed the bound (``CTXKIT_ALLOC_CACHE``:
bytes per device, default a quarter of the device's memory; ``0`` disables the cache;
over the bound the device's cache is emptied), when the stream is garbage collected (its
blocks are freed on it before it is destroyed) and when the context is closed. A stream
closed with ``close()`` keeps its blocks until one of those; they are then freed after a
``cuCtxSynchronize`` (the stream handle is gone). At interpreter exit cached blocks are
dropped without driver calls (the process teardown frees them, as for every other
resource). While a ctxkit stream capture is open the cache hands out nothing (captured
allocations become graph allocations, as without the cache) and blocks allocated then are
never cached; gives back during a capture are held back by :mod:`ctxkit.lifetime`.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _driver, lifetime
from .._driver import drv
from .._env import alloc_cache
from ..errors import CudaError, OutOfMemoryError
from ..lifetime import finalizer, free_quietly
from ..stream import Stream
from .interop import KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED
from .sizes import SIZE_MAX, gib

if TYPE_CHECKING:
    from ..context import Context

__all__ = [
    "DEVICE",
    "KINDS",
    "MANAGED",
    "OUT_OF_MEMORY",
    "PINNED",
    "Block",
    "MemoryKind",
    "cached_bytes",
    "enabled",
    "flush",
    "limit_bytes",
    "oom",
    "out_of_memory",
]


@dataclass(frozen=True)
class MemoryKind:
    """One kind of memory as data: its driver allocation and free, its DLPack device
    type, and whether it may be allocated stream-ordered from a pool."""

    name: str
    alloc: str
    free: str
    alloc_args: tuple[int, ...] = ()
    dlpack_device: int = KDL_CUDA
    stream_ordered: bool = False

    def allocate(self, ctx: Context, size: int, *args: int) -> tuple[Any, Any]:
        """``(err, ptr)`` of the driver allocation of *size* bytes in *ctx*, bound for the
        call (*args*: per-call arguments after the kind's own, e.g. host-allocation flags)."""
        with ctx:
            return getattr(drv, self.alloc)(size, *self.alloc_args, *args)  # type: ignore[no-any-return]

    def deallocate(self, owner: object, ctx: Context, ptr: Any) -> weakref.finalize:
        """Free *ptr* in *ctx* once, when *owner* dies or the returned finalizer is called
        (from any thread, never raising: :func:`ctxkit.lifetime.finalizer`)."""
        return finalizer(owner, ctx, getattr(drv, self.free), ptr)


#: ``CUDA_ERROR_OUT_OF_MEMORY``
OUT_OF_MEMORY = 2

_FIX = (
    "close() buffers you no longer need, use smaller chunks, or pick a device with more free memory"
)


def oom(message: str) -> OutOfMemoryError:
    """An :class:`~ctxkit.errors.OutOfMemoryError` for ``CUDA_ERROR_OUT_OF_MEMORY`` that
    says *message*."""
    return OutOfMemoryError(message, OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY")


def out_of_memory(ctx: Context, err: Any, n: int, what: str, fix: str = _FIX) -> Exception:
    """The error of a failed device allocation of *n* bytes on *ctx*'s device: for
    out-of-memory an :class:`~ctxkit.errors.OutOfMemoryError` with the requested and the
    free bytes (``cuMemGetInfo``; also as ``.requested`` and ``.free``) and *fix*, else
    the driver's error as *ctx* words it."""
    if int(err) != OUT_OF_MEMORY:
        return ctx.note_error(err, what)
    try:
        free, total = ctx.memory_info()
    except CudaError:
        free, total = -1, -1
    exc = oom(
        f"{what}: cannot allocate {n} bytes ({gib(n)}) on device {ctx.device.ordinal}: only "
        f"{free} bytes ({gib(free)}) of {total} ({gib(total)}) are free (cuMemGetInfo). "
        f"Fix: {fix}"
    )
    exc.requested = n  # type: ignore[attr-defined]
    exc.free = free  # type: ignore[attr-defined]
    return exc


MEM_ATTACH_GLOBAL = 1

#: ``cuMemAlloc`` device memory (stream-ordered: the block cache and memory pools).
DEVICE = MemoryKind("device", "cuMemAlloc", "cuMemFree", stream_ordered=True)
#: ``cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)`` unified memory.
MANAGED = MemoryKind(
    "managed", "cuMemAllocManaged", "cuMemFree", (MEM_ATTACH_GLOBAL,), KDL_CUDA_MANAGED
)
#: ``cuMemHostAlloc`` page-locked host memory (flags per allocation).
PINNED = MemoryKind("pinned", "cuMemHostAlloc", "cuMemFreeHost", dlpack_device=KDL_CUDA_HOST)
#: Every kind, by name.
KINDS = {k.name: k for k in (DEVICE, MANAGED, PINNED)}


_GRAIN = 512

_PER_THREAD_STREAM = 2

_lock = threading.RLock()

_driver.renew_at_fork(__name__, "_lock", threading.RLock)

_capturing = lifetime.capturing_threads  # the dict itself: lifetime mutates it in place

_captured = lifetime.captured_streams  # likewise: streams ctxkit captures, in any mode

_caches: dict[Any, StreamCache] = {}  # key -> cache (see _key)

_held: dict[int, int] = {}  # device ordinal -> cached bytes

_limits: dict[int, int] = {}  # device ordinal -> bound (default: a quarter of its memory)


def _env_settings() -> tuple[bool, int | None, ValueError | None]:
    """The settings, or (off, the error): a bad value is raised by the first stream-ordered
    allocation, not by ``import ctxkit``."""
    try:
        on, bound = alloc_cache()
    except ValueError as exc:
        return False, None, exc
    return on, bound, None


_enabled, _bound, _env_error = _env_settings()


def enabled() -> bool:
    """True when freed stream-ordered blocks are cached (``CTXKIT_ALLOC_CACHE`` not 0)."""
    return _enabled


def configure() -> None:
    """Re-read ``CTXKIT_ALLOC_CACHE`` (the cache is flushed first)."""
    global _enabled, _bound, _env_error
    flush()
    _enabled, _bound, _env_error = _env_settings()
    _limits.clear()


def size_class(n: int) -> int:
    """The block size cached for an *n*-byte buffer (a multiple of 512)."""
    return (n + _GRAIN - 1) & -_GRAIN


def limit_bytes(ctx: Context) -> int:
    """The most bytes the cache keeps for *ctx*'s device."""
    dev = ctx.device.ordinal
    if (limit := _limits.get(dev)) is None:
        try:
            limit = _bound if _bound is not None else ctx.memory_info()[1] // 4
        except Exception:
            limit = 0
        _limits[dev] = limit
    return limit


class StreamCache:
    """The freed blocks of one (context, pool, stream): size class -> blocks."""

    __slots__ = ("blocks", "context", "device", "fin", "handle", "key", "pool", "ref", "strong")

    def __init__(self, key: Any, stream: Stream, pool: Any, strong: bool) -> None:
        self.key = key
        self.context = stream.context
        self.device = stream.context.device.ordinal
        self.pool = pool
        self.handle = stream.handle
        self.fin = stream.fin  # the stream's destroy; alive while the handle is valid
        self.blocks: dict[int, list[Block]] = {}
        self.strong: Stream | None = stream if strong else None
        # a collected stream's blocks are freed and its cache forgotten (_drain)
        self.ref: Any = None if strong else weakref.ref(stream, lambda _r: _drain([key], drop=True))

    def target(self) -> Any:
        """What its blocks are freed on (:func:`free_async`): the stream; once it was
        garbage collected, its handle while the stream is not destroyed yet (the weak
        reference's callback runs before the stream's own finalizer, a newer one), else
        ``None``."""
        stream = self.strong if self.strong is not None else self.ref()
        if stream is not None:
            return stream
        return self.handle if self.fin is not None and self.fin.alive else None


class Block:
    """A stream-ordered allocation owned by one buffer (or waiting in a cache).

    ``stream`` holds the buffer's stream while the block is in use, so a buffer dropped
    without ``close()`` can still give the block back on it (``__del__``).
    """

    __slots__ = ("home", "ptr", "size", "stream", "token")

    def __init__(self, ptr: int, size: int, home: StreamCache | None, stream: Stream) -> None:
        self.ptr = ptr
        self.size = size
        self.home = home
        self.stream: Stream | None = stream
        # Non-empty while a buffer owns the block; giving it back pops it (atomically, so
        # two threads closing one buffer give it back once).
        self.token = [True]

    def __del__(self) -> None:
        # The buffer was dropped without close(). A finalizer runs once per object, so
        # the cache gets a fresh Block, never this one.
        if self.token:
            with contextlib.suppress(Exception):  # interpreter teardown
                self.token.clear()
                give_back(Block(self.ptr, self.size, self.home, self.stream), None)  # type: ignore[arg-type]


def _key(stream: Stream, pool: Any) -> tuple[Any, bool] | None:
    """The cache key of *stream* and whether the cache holds the stream strongly;
    ``None``: not cacheable."""
    h = int(stream.handle)
    p = 0 if pool is None else int(pool)
    if stream.owned:
        return (id(stream) if not p else (id(stream), p)), False
    if h == _PER_THREAD_STREAM:
        return None  # one handle, a different stream in every thread
    # Borrowed (another library's stream, the legacy stream): one cache per handle, which
    # holds the first wrapper (and so the foreign stream) until its context is closed.
    return ("borrowed", stream.context.handle, h, p), True


def _cache_for(stream: Stream, pool: Any) -> StreamCache | None:
    if (found := _key(stream, pool)) is None:
        return None
    key, strong = found
    sc = _caches.get(key)
    if sc is None or (sc.strong is None and sc.ref() is not stream):
        with _lock:
            sc = _caches.get(key)
            if sc is None or (sc.strong is None and sc.ref() is not stream):
                sc = _caches[key] = StreamCache(key, stream, pool, strong)
    return sc


def _in_capture(stream: Stream) -> bool:
    """True while *stream* is being captured into a graph (which keeps the address of
    any memory allocated on it, so it must come from the driver): by ctxkit in any mode,
    or -- for another library's stream -- by anyone (``cuStreamIsCapturing``)."""
    if _captured and int(stream.handle) in _captured:
        return True
    if stream.owned:
        return False
    err, status = drv.cuStreamIsCapturing(stream.handle)
    return bool(err) or int(status) != 0


def take(stream: Stream, n: int, pool: Any = None) -> Block | None:
    """A cached block for an *n*-byte buffer on *stream* from the pool with handle *pool*
    (``None``: the device's pool), or ``None``."""
    if not _enabled or _capturing or stream.handle is None or _in_capture(stream):
        return None
    ctx = stream.context
    if ctx.closed or ctx.poisoned:
        return None
    # the hot path (an owned stream, the device's pool) builds no key
    sc = _caches.get(id(stream)) if pool is None and stream.owned else _cache_for(stream, pool)
    return None if sc is None else _pop(sc, size_class(n), stream)


def _pop(sc: StreamCache, size: int, stream: Stream) -> Block | None:
    blocks = sc.blocks.get(size)
    if not blocks:
        return None
    try:
        blk = blocks.pop()
    except IndexError:  # another thread took the last one
        return None
    blk.token.append(True)
    blk.stream = stream
    _held[sc.device] = _held.get(sc.device, 0) - size  # not atomic: a flush recounts
    return blk


def allocate(ctx: Context, n: int, stream: Stream, sh: Any, pool: Any, what: str) -> Block:
    """A new block for an *n*-byte buffer on *stream* (handle *sh*), allocated with *ctx*
    bound; on out-of-memory the device's cached blocks are freed and it is retried once.

    Raises
    ------
    OutOfMemoryError
        It does not fit (:func:`out_of_memory`); other driver errors as
        :meth:`Context.note_error <ctxkit.context.Context.note_error>` words them.
    """
    if _env_error is not None:
        raise _env_error
    capturing = bool(_capturing) or (_enabled and stream.handle is not None and _in_capture(stream))
    size = min(size_class(n), SIZE_MAX) if _enabled else n  # the driver refuses SIZE_MAX
    with ctx:
        err, ptr = _driver_alloc(size, sh, pool)
        if int(err) == OUT_OF_MEMORY and not capturing and _held.get(ctx.device.ordinal):
            flush(device=ctx.device.ordinal, sync=True)
            err, ptr = _driver_alloc(size, sh, pool)
    if err:
        raise out_of_memory(ctx, err, n, f"{what} (stream-ordered)")
    home = None if capturing or not _enabled else _cache_for(stream, pool)
    return Block(int(ptr), size, home, stream)


def _driver_alloc(size: int, sh: Any, pool: Any) -> tuple[Any, Any]:
    if pool is None:
        return drv.cuMemAllocAsync(size, sh)  # type: ignore[no-any-return]
    return drv.cuMemAllocFromPoolAsync(size, pool, sh)  # type: ignore[no-any-return]


def give_back(blk: Block, stream: Stream | None) -> None:
    """The buffer of *blk* was closed (freed on *stream*; ``None``: its own stream)."""
    try:
        blk.token.pop()
    except IndexError:  # given back already (a second close, or another thread's)
        return
    own, blk.stream = blk.stream, None
    target = stream if stream is not None else own
    home = blk.home
    if home is not None and (target is not own or _caches.get(home.key) is not home):
        # freed on another stream, or its cache was dropped meanwhile: the target's cache
        ctx = home.context
        usable = target is not None and target.handle is not None and target.context is ctx
        home = _cache_for(target, home.pool) if usable and not ctx.closed else None  # type: ignore[arg-type]
    if home is None or not _enabled:
        if target is not None:
            free_quietly(target.context, free_async, blk.ptr, target)
        return
    blocks = home.blocks.get(blk.size)  # the common case: a list for its size is there
    if blocks is None:
        fresh: list[Block] = []  # made outside the lock: creating it may run the GC
        with _lock:
            blocks = home.blocks.setdefault(blk.size, fresh)
    blk.home = home
    blocks.append(blk)
    dev = home.device
    held = _held[dev] = _held.get(dev, 0) + blk.size  # not atomic: a flush recounts
    limit = _limits.get(dev)
    if held > (limit if limit is not None else limit_bytes(home.context)):
        flush(device=dev)


def free_async(ptr: int, stream: Any) -> Any:
    """``cuMemFreeAsync`` on *stream* (call with the context bound): a Stream (its handle
    is read now: the free may have been held back by a capture), a ``CUstream``, or
    ``None`` -- the stream is gone, so wait for the whole context first and free on the
    legacy stream."""
    handle = stream.handle if isinstance(stream, Stream) else stream
    if handle is None:
        (err,) = drv.cuCtxSynchronize()
        if err:
            return (err,)
        handle = drv.CUstream(0)
    return drv.cuMemFreeAsync(ptr, handle)


def _take_all(sc: StreamCache) -> list[Block]:
    """Take every block out of *sc* (call with the lock held). The garbage collector may
    run in between and put a block back re-entrantly: nothing is iterated that it could
    change, and nothing it adds is lost (it stays cached)."""
    out: list[Block] = []
    for lst in list(sc.blocks.values()):
        while lst:
            try:
                out.append(lst.pop())  # one at a time: a concurrent take gets the others
            except IndexError:
                break
    return out


def _cached(match: Any) -> int:
    """Bytes of the cached blocks in the caches *match* accepts."""
    return sum(
        b.size
        for sc in list(_caches.values())
        if match(sc)
        for lst in list(sc.blocks.values())
        for b in list(lst)
    )


def _drain(keys: list[Any], drop: bool = False, sync: bool = False) -> int:
    """Free the blocks of the caches with *keys* on their streams (with *drop*, forget
    the caches too; with *sync*, wait for the frees); the bytes given back."""
    taken = []
    with _lock:
        for key in keys:
            sc = _caches.pop(key, None) if drop else _caches.get(key)
            if sc is not None:
                taken.append((sc, _take_all(sc)))
        for dev in {sc.device for sc, _b in taken}:  # their held bytes, from the caches
            _held[dev] = _cached(lambda sc, dev=dev: sc.device == dev)
    contexts: dict[int, Context] = {}
    for sc, blocks in taken:
        target = sc.target()
        for b in blocks:
            b.home = None
            free_quietly(sc.context, free_async, b.ptr, target)
            contexts[id(sc.context)] = sc.context
    for ctx in contexts.values() if sync else ():
        if not ctx.closed and not ctx.poisoned:
            ctx.synchronize()
    return sum(b.size for _sc, blocks in taken for b in blocks)


def _keys(device: int | None = None, context: Any = None) -> list[Any]:
    """The keys of the caches of *device* and of *context* (``None``: any)."""
    return [
        key
        for key, sc in list(_caches.items())
        if (device is None or sc.device == device) and (context is None or sc.context is context)
    ]


def flush(*, device: int | None = None, context: Any = None, sync: bool = False) -> int:
    """Free the cached blocks (of one device or context; all when neither is given) on
    their streams; with *sync* wait for those frees. Returns the bytes given back."""
    return _drain(_keys(device, context), sync=sync)


def cached_bytes(device: int, pool: Any = 0) -> int:
    """Bytes the cache holds on *device* for the pool with handle *pool* (0: the device's
    pool ``cuMemAllocAsync`` uses)."""
    p = int(pool)
    with _lock:
        return _cached(
            lambda sc: sc.device == device and (0 if sc.pool is None else int(sc.pool)) == p
        )


def context_closing(ctx: Context) -> None:
    """*ctx* is about to be closed: free its cached blocks while it still exists."""
    _drain(_keys(context=ctx), drop=True)


def _at_exit() -> None:
    """Interpreter exit: stop caching and drop the blocks (the teardown frees them)."""
    global _enabled
    _enabled = False
    with _lock:
        _caches.clear()
        _held.clear()


atexit.register(_at_exit)

lifetime.on_context_close(context_closing)
