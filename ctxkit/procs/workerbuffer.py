"""The parent's handle on device memory a ``DevicePool`` worker lent it (rules: :mod:`.devmem`).

Its own module because it subclasses ``ImportedBuffer``: importing it loads
``ctxkit.memory``, which a process that sends only host data never needs.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, cast

from ..errors import ContextClosedError
from ..memory.device import DeviceBuffer
from ..memory.ipc import ImportedBuffer, IpcBufferHandle, import_buffer

__all__ = ["WorkerBuffer", "adopt", "lease_of", "revoke"]


class Lease:
    """What a ``WorkerBuffer`` holds: when it goes, the memory is released."""

    __slots__ = ("__weakref__",)


@dataclasses.dataclass
class Info:
    """A ``WorkerBuffer``'s lease: the worker's handle of the whole buffer and its
    address in this process, the lease, the worker's token, and why the pool closed it
    (``""`` while open). Its views share it."""

    handle: IpcBufferHandle
    ptr: int
    lease: int
    owner: str
    why: str = ""


class WorkerBuffer(ImportedBuffer):
    """Device memory a :class:`~ctxkit.procs.DevicePool` task returned, mapped from the
    worker that keeps it alive.

    A :class:`~ctxkit.memory.DeviceBuffer` in every respect (an ``ImportedBuffer``);
    :meth:`close` or garbage collection unmaps it and lets the worker free the memory.
    It is closed by the pool when its worker exits (shutdown, crash, timeout, replacement
    after a sticky error); using it then raises ``ContextClosedError`` with the reason.
    Made by ``DevicePool`` only.
    """

    __slots__ = ("_info",)

    _info: Info

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("WorkerBuffer is made by DevicePool when a task returns device memory")

    @property
    def worker_pid(self) -> int:
        """The worker process that holds the memory."""
        return self._info.handle.pid

    def __getitem__(self, key: slice) -> WorkerBuffer:
        """``buf[a:b]``: a view of bytes ``a..b``, a ``WorkerBuffer`` of the same lease."""
        view = cast(WorkerBuffer, super().__getitem__(key))
        view._info = self._info
        return view

    def _closed_error(self, what: str) -> ContextClosedError:
        if self._info.why:
            return ContextClosedError(f"WorkerBuffer.{what}: {self._info.why}")
        return ContextClosedError(
            f"WorkerBuffer.{what}: the buffer was closed, so its worker may have freed the "
            "memory; keep a WorkerBuffer open while you use it"
        )


def lease_of(buf: DeviceBuffer) -> tuple[IpcBufferHandle, int, str] | None:
    """For memory a pool worker lent (a ``WorkerBuffer`` or a view of one): the handle
    of exactly *buf*'s bytes, the lease and the worker's process token."""
    if not isinstance(buf, WorkerBuffer):
        return None
    info = buf._info
    offset = info.handle.offset + (buf.ptr - info.ptr)
    handle = dataclasses.replace(info.handle, offset=offset, nbytes=buf.nbytes)
    return handle, info.lease, info.owner


def adopt(
    handle: IpcBufferHandle, lease: int, owner: str, on_release: Callable[[], None]
) -> WorkerBuffer:
    """Map a worker's *lease* (``cuIpcOpenMemHandle``); when the buffer goes, it is
    unmapped, then ``on_release()`` queues the release for the worker."""
    imp = cast(DeviceBuffer, import_buffer(handle))
    token = Lease()
    weakref.finalize(token, _release, imp, on_release).atexit = False
    buf = cast(WorkerBuffer, WorkerBuffer.from_pointer(imp.ptr, imp.nbytes, imp.context, token))
    buf._info = Info(handle, imp.ptr, lease, owner)
    return buf


def revoke(buf: WorkerBuffer, why: str) -> None:
    """Close *buf* because its worker is exiting or gone; using it then raises
    ``ContextClosedError`` saying *why*."""
    buf._info.why = why
    buf.close()


def _release(imp: DeviceBuffer, on_release: Callable[[], None]) -> None:
    """Finalizer of a ``WorkerBuffer``'s lease: unmap, then queue the release."""
    imp.close()  # unmapped here before the worker may free it
    on_release()
