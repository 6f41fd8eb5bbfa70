"""Device memory in ``ctxkit.procs`` messages: CUDA IPC handles instead of bytes.

A :class:`~ctxkit.memory.DeviceBuffer` or :class:`~ctxkit.memory.DeviceArray` among the
arguments of ``run_per_device`` or ``DevicePool.submit``/``submit_to`` is never pickled.
The message carries a :class:`DeviceRef` instead: a ``cuIpcGetMemHandle`` handle (64
bytes) with the size, shape and dtype; the child maps the parent's memory into its own
context (``cuIpcOpenMemHandle``) and the task gets an ``ImportedBuffer`` (an array of
the same shape and dtype for a ``DeviceArray``). No byte of the memory goes through a
pipe or shared memory (``ctxkit.procs.traffic()`` counts what does).

Rules a task can rely on:

* **Ordering.** ``submit``/``run_per_device`` synchronize the context of every device
  argument (``cuCtxSynchronize``) before the task is sent: whatever the parent queued
  on that memory before the call, on any stream, is complete when the child sees it.
  (ctxkit cannot know every stream that writes a buffer; one host wait covers them
  all.) Work the parent queues on it *after* the call races with the task.
* **Lifetime of arguments.** The parent keeps every device argument alive until the
  task has finished. The child maps it for the duration of the task: when the function
  returns, the child synchronizes its contexts (so the task's kernels are done and the
  parent sees their writes once the future is done) and unmaps the memory. A task that
  keeps an argument buffer past its return finds it closed.
* **Which context.** The memory is mapped into the child's bound context (the task's
  device). Memory on another device is mapped through peer access, which is allowed
  only when the task's device can access that device (``cuDeviceCanAccessPeer``) and
  the child can see it (not ``isolate=True``); otherwise the call raises
  ``ValueError`` before anything is sent.
* **Results.** A task that returns one of its device arguments, or a view of one, gives
  the parent its own object back (or the same view of it). Device memory *allocated in
  the child* can come back only from a ``DevicePool``: the worker exports it and keeps it
  alive, and the parent gets a :class:`~ctxkit.procs.WorkerBuffer` mapped over it
  (see :class:`LeaseBook` for when the worker lets it go). ``run_per_device`` children exit
  when they return, so such a result is refused there with a ``TypeError`` naming the
  fixes.
* **What cannot travel.** Memory legacy CUDA IPC cannot share (managed memory,
  stream-ordered pool allocations, VMM) is refused with ``export_buffer``'s reason;
  a ``VirtualBuffer`` is refused with a ``TypeError``.

``ctxkit.memory`` is imported only when device objects are involved, so a process that
sends only host data starts as fast as before (a spawned child does not load numpy
or the memory family for it).

Returned memory (a :class:`~ctxkit.procs.WorkerBuffer`):

A task that returns a ``DeviceBuffer`` or ``DeviceArray`` allocated in its worker gives
the parent a :class:`WorkerBuffer` (inside a ``DeviceArray`` of the same shape and dtype
for an array): an :class:`~ctxkit.memory.ImportedBuffer` mapped over the worker's memory
(``cuIpcOpenMemHandle`` in the parent's registry context of that GPU), no copy. The
worker keeps the memory alive until the parent lets go of it:

* when the parent's ``WorkerBuffer`` is closed (``close()``) or collected, the parent
  unmaps it first (``cuIpcCloseMemHandle``), then tells the worker, which frees it. The
  release travels with the worker's next task, or on its own when the worker is idle,
  so a busy worker's pipe never fills with them.
* the memory lives no longer than the worker process. When the pool shuts down
  (``shutdown()``, leaving ``with``), the parent synchronizes each such buffer's context
  and closes the buffer before it tells the worker to exit; when the worker dies (a
  crash, a timeout, ``terminate()``) or is replaced after a sticky CUDA error, the
  parent closes its buffers. A closed ``WorkerBuffer`` raises ``ContextClosedError``
  that says why: copy what must outlive the pool (``copy_to_host``, ``copy_to``, a new
  ``DeviceBuffer``) before it shuts down.

Passing a ``WorkerBuffer`` to another task works: its worker resolves it to its own
object without mapping anything; another worker (of this pool or another, or a
``run_per_device`` child) maps it with the worker's handle while the parent keeps the
buffer (and so the lease) alive for the task.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..device import Device
from ..errors import ContextClosedError

if TYPE_CHECKING:  # pragma: no cover
    from ..memory.device import DeviceBuffer
    from ..memory.ipc import IpcBufferHandle
    from .workerbuffer import WorkerBuffer

__all__ = [
    "ChildSession",
    "DeviceRef",
    "Outgoing",
    "ResultLoader",
    "WorkerLeases",
    "device_types",
    "load_ref",
    "process_token",
]


_types: tuple[type, ...] = ()


def device_types() -> tuple[type, ...]:
    """The classes a message carries as a :class:`DeviceRef` (``VirtualBuffer`` to
    refuse it); ``()`` while ``ctxkit.memory`` is not loaded, when none can exist."""
    global _types
    if not _types and "ctxkit.memory.device" in sys.modules:
        from ..memory.device import DeviceArray, DeviceBuffer
        from ..memory.vmm import VirtualBuffer

        _types = (DeviceBuffer, DeviceArray, VirtualBuffer)
    return _types


_TAG = uuid.uuid4().hex


def process_token() -> str:
    """Names this process in the references it sends (a pid alone repeats across
    PID namespaces)."""
    return f"{os.getpid()}:{_TAG}"


@dataclass(frozen=True)
class DeviceRef:
    """A device buffer or array in a message: where its memory is, never its bytes.

    Attributes
    ----------
    index : int
        Its number among the message's device objects (argument ``k``).
    nbytes, device : int
        Its size, and the sender's ordinal of the device that holds it.
    shape, dtype
        A ``DeviceArray``'s shape and dtype (``None`` for a ``DeviceBuffer``).
    handle : IpcBufferHandle or None
        Memory to map; ``None`` for an empty buffer or an ``arg`` reference.
    arg, offset : int
        A result that lies in the task's device argument ``arg``, at ``offset`` bytes.
    lease, owner
        Memory a pool worker keeps for the parent: its number there, and that worker's
        :func:`process_token` (the worker itself resolves it without mapping).
    """

    index: int
    nbytes: int
    device: int
    shape: tuple[int, ...] | None = None
    dtype: Any = None
    handle: IpcBufferHandle | None = None
    arg: int | None = None
    offset: int = 0
    lease: int | None = None
    owner: str = ""


def load_ref(ref: DeviceRef) -> Any:
    """The loader a pickled :class:`DeviceRef` names; only ``ctxkit.procs`` decoding
    (``wire.decode``, which substitutes the receiving side's) can resolve one."""
    raise TypeError(
        f"{ref!r} is device memory sent by ctxkit.procs; it can only be received through "
        "ctxkit.procs (wire.decode in a task's process), not by plain pickle.loads"
    )


def _split(obj: Any, what: str = "") -> tuple[DeviceBuffer, tuple[int, ...] | None, Any]:
    """A device object's buffer, shape and dtype; a ``VirtualBuffer`` (which cannot
    travel) is refused, naming *what* sends it."""
    from ..memory.device import DeviceArray
    from ..memory.vmm import VirtualBuffer

    if isinstance(obj, DeviceArray):
        return obj.buffer, obj.shape, obj.dtype
    if isinstance(obj, VirtualBuffer):
        raise TypeError(
            f"{what}: {obj!r} cannot travel to another process as an argument or result; "
            "pass a DeviceBuffer (cuMemAlloc memory), or share it yourself with "
            "ctxkit.memory.export_buffer(vb) (a VirtualBuffer(..., shareable=True))"
        )
    return obj, None, None


def _wrap(buf: DeviceBuffer, ref: DeviceRef) -> Any:
    from ..memory.device import DeviceArray

    return buf if ref.shape is None else DeviceArray(buf, ref.shape, ref.dtype)


def _part(buf: DeviceBuffer, offset: int, nbytes: int) -> DeviceBuffer:
    """*buf* itself when the bytes at *offset* are all of it, else a view of them."""
    return buf if offset == 0 and nbytes == buf.nbytes else buf[offset : offset + nbytes]


def _empty(context: Any) -> DeviceBuffer:
    from ..memory.device import DeviceBuffer

    return DeviceBuffer(0, context=context)


def _export(obj: Any, what: str) -> IpcBufferHandle:
    from ..memory.ipc import IpcBufferHandle, export_buffer

    try:
        handle = export_buffer(obj)
    except ValueError as exc:
        raise ValueError(
            f"{what}: {obj!r} cannot be handed to another process without a copy: {exc}"
        ) from exc
    assert isinstance(handle, IpcBufferHandle)
    return handle


def _unique_contexts(bufs: Iterable[DeviceBuffer]) -> list[Any]:
    return list({id(b.context): b.context for b in bufs}.values())  # in first-seen order


class Session:
    """One side of the device memory in a message (``wire``'s picklers call it).

    :meth:`reduce` puts a :class:`DeviceRef` in a device object's place when pickling
    (a refusal is kept in ``error``, which the caller raises as is); :meth:`load`
    resolves one when unpickling. Both count what they handled.
    """

    def __init__(self, what: str = "") -> None:
        self.what = what
        self.error: BaseException | None = None
        self.sent = self.sent_bytes = 0
        self.received = self.received_bytes = 0

    def reduce(self, obj: Any) -> tuple[Any, tuple[DeviceRef]]:
        """``reducer_override`` of a device object: a reference in its place."""
        try:
            ref = self.ref(obj)
        except BaseException as exc:
            self.error = exc
            raise
        self.sent += 1
        self.sent_bytes += ref.nbytes
        return (load_ref, (ref,))

    def load(self, ref: DeviceRef) -> Any:
        """This process's object for a reference in a message it received."""
        self.received += 1
        self.received_bytes += ref.nbytes
        return self.resolve(ref)

    def ref(self, obj: Any) -> DeviceRef:  # pragma: no cover - a side that only loads
        """The reference that stands for *obj* in a message this side sends."""
        raise TypeError(f"{type(self).__name__} sends no device memory")

    def resolve(self, ref: DeviceRef) -> Any:
        """The object *ref* stands for on this side (here: a side that only sends, or a
        message decoded without a session, refuses it)."""
        return load_ref(ref)


# --- the parent's arguments -----------------------------------------------------------


class Outgoing(Session):
    """The device memory among one task's arguments, found while they are pickled.

    :attr:`objects` holds each such object (argument ``k`` at index ``k``) until
    :meth:`release`: the parent keeps the memory alive while the task may use it.
    """

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.objects: list[Any] = []
        self.ordinals: list[int] = []

    def ref(self, obj: Any) -> DeviceRef:
        buf, shape, dtype = _split(obj, self.what)
        if buf.closed:
            try:
                buf.ptr  # noqa: B018 - raises the buffer's own reason
            except ContextClosedError as exc:
                raise ContextClosedError(
                    f"{self.what}: a device argument is closed: {exc}"
                ) from exc
        from .workerbuffer import lease_of

        lent = lease_of(buf) if buf.nbytes else None
        handle, lease, owner = lent or (_export(obj, self.what) if buf.nbytes else None, None, "")
        ordinal = buf.context.device.ordinal
        self.objects.append(obj)
        self.ordinals.append(ordinal)
        return DeviceRef(
            self.sent, buf.nbytes, ordinal, shape, dtype, handle, lease=lease, owner=owner
        )

    def problem(self, ordinal: int, isolate: bool) -> str:
        """Why a child on device *ordinal* cannot map every argument (``""``: it can)."""
        for obj, where in zip(self.objects, self.ordinals, strict=True):
            if where == ordinal:
                continue
            head = (
                f"{self.what}: {obj!r} is on device {where}, but the task runs on device {ordinal}"
            )
            fix = (
                f"copy it to device {ordinal} first (e.g. ck.DeviceBuffer(n, context={ordinal})"
                f".copy_from(buf)), or run the task on device {where}"
            )
            if isolate:
                return (
                    f"{head} in a process that sees only its own device (isolate=True), "
                    f"which cannot map another device's memory: {fix}, or run without isolate"
                )
            if not Device(ordinal).can_access_peer(where):
                return (
                    f"{head}, which cannot access device {where}'s memory "
                    f"(cuDeviceCanAccessPeer({ordinal}, {where}) is 0), so the child could not "
                    f"map it: {fix}"
                )
        return ""

    def check_target(self, ordinal: int, isolate: bool) -> None:
        """Raise ``ValueError`` unless a child on device *ordinal* can map every argument."""
        if why := self.problem(ordinal, isolate):
            raise ValueError(why)

    def synchronize(self) -> None:
        """Wait for the work queued in each argument's context (the ordering rule)."""
        for ctx in _unique_contexts(_split(obj)[0] for obj in self.objects):
            ctx.synchronize()

    def rebuild(self, ref: DeviceRef) -> Any:
        """The parent's object for a result that lies in device argument ``ref.arg``."""
        if ref.arg is None or not 0 <= ref.arg < len(self.objects):
            raise RuntimeError(f"a result refers to device argument {ref.arg}, which was not sent")
        base = self.objects[ref.arg]
        buf, shape, dtype = _split(base)
        part = _part(buf, ref.offset, ref.nbytes)
        same = part is buf and (ref.shape, ref.dtype) == (shape, dtype)
        return base if same else _wrap(part, ref)

    def release(self) -> None:
        """The task is over: stop holding the memory."""
        self.objects = []


# --- the child's side of one task -----------------------------------------------------


class WorkerLeases(dict[int, tuple[Any, Any]]):
    """Device memory a pool worker returned, kept alive until the parent releases it:
    ``{lease: (object, its IpcBufferHandle)}``."""

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count(1)

    def keep(self, obj: Any, handle: IpcBufferHandle) -> int:
        lease = next(self._ids)
        self[lease] = (obj, handle)
        return lease

    def view(self, lease: int, handle: IpcBufferHandle, nbytes: int) -> DeviceBuffer:
        """This worker's own memory, sent back to it: the bytes *handle* names."""
        try:
            obj, mine = self[lease]
        except KeyError:
            raise RuntimeError(
                f"the parent sent memory of lease {lease}, which this worker has already released"
            ) from None
        return _part(_split(obj)[0], handle.offset - mine.offset, nbytes)

    def release(self, leases: list[int] | tuple[int, ...]) -> None:
        for lease in leases:
            self.pop(lease, None)


class ChildSession(Session):
    """Device memory of one task in its child: the arguments it maps, the results it
    exports (pool workers) or refuses (``run_per_device``, *leases* ``None``).

    *context* is where arguments are mapped (``None``: the registry's context of the
    memory's device); *ordinal* the task's device as the parent numbers it (what result
    references name).
    """

    def __init__(self, context: Any, leases: WorkerLeases | None, ordinal: int) -> None:
        super().__init__("the task's result")
        self.context = context
        self.leases = leases
        self.ordinal = ordinal
        self.args: dict[int, tuple[Any, DeviceBuffer]] = {}
        self.imports: list[DeviceBuffer] = []
        self.exported: list[DeviceBuffer] = []
        self.new_leases: list[int] = []

    # receiving the arguments
    def resolve(self, ref: DeviceRef) -> Any:
        buf = self._map(ref)
        obj = _wrap(buf, ref)
        self.args[ref.index] = (obj, buf)
        return obj

    def _map(self, ref: DeviceRef) -> DeviceBuffer:
        if ref.handle is None:
            return _empty(self.context)
        if ref.lease is not None and ref.owner == process_token() and self.leases is not None:
            return self.leases.view(ref.lease, ref.handle, ref.nbytes)
        from ..memory.ipc import import_buffer

        buf = cast("DeviceBuffer", import_buffer(ref.handle, self.context))
        self.imports.append(buf)
        return buf

    # sending the result
    def ref(self, obj: Any) -> DeviceRef:
        buf, shape, dtype = _split(obj, self.what)
        ptr, n = buf.ptr, buf.nbytes
        make = functools.partial(DeviceRef, self.sent, n, self.ordinal, shape, dtype)
        for k, (arg, abuf) in self.args.items():
            if arg is obj or abuf is buf:
                return make(arg=k)
        if n == 0:
            return make()
        for k, (_arg, abuf) in self.args.items():
            if not abuf.closed and abuf.nbytes and abuf.ptr <= ptr <= abuf.ptr + abuf.nbytes - n:
                return make(arg=k, offset=ptr - abuf.ptr)
        if self.leases is None:
            raise TypeError(
                f"run_per_device: {self.what} holds {obj!r}, device memory allocated in the "
                "child, which is freed when the child exits. Return host data (.to_host(), "
                ".copy_to_host()), write into a buffer passed as an argument (its memory is "
                "the parent's), or use a DevicePool, whose workers keep returned device memory "
                "alive for the parent"
            )
        handle = _export(obj, self.what)
        lease = self.leases.keep(obj, handle)
        self.new_leases.append(lease)
        self.exported.append(buf)
        return make(handle=handle, lease=lease, owner=process_token())

    # the end of the task
    def finish(self) -> None:
        """The task returned: wait for the work it queued on device memory in every
        context involved (``cuCtxSynchronize``), then unmap the arguments (also when
        that fails)."""
        imports, self.imports = self.imports, []
        try:
            if self.args or self.exported:
                ctxs = _unique_contexts([b for _o, b in self.args.values()] + self.exported)
                if self.context is not None and all(c is not self.context for c in ctxs):
                    ctxs.append(self.context)
                for ctx in ctxs:
                    ctx.synchronize()
        finally:
            self.args = {}
            for buf in imports:
                buf.close()

    def abandon(self) -> None:
        """The task failed: best-effort :meth:`finish`, and forget what it exported."""
        with contextlib.suppress(Exception):
            self.finish()
        if self.leases is not None:
            self.leases.release(self.new_leases)
        self.new_leases, self.exported = [], []


# --- memory a pool worker lent the parent -------------------------------------------


#: A worker process of a pool: ``(device ordinal, pid)``.
WorkerKey = tuple[int, int]


class LeaseBook:
    """A pool's ``WorkerBuffer``s by worker, and the releases waiting to be sent.

    *wake* tells the pool's manager thread that releases are queued (it must not block
    or take locks: it runs in finalizers, in whatever thread collects a buffer).
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._live: dict[WorkerKey, weakref.WeakSet[WorkerBuffer]] = {}
        self._released: deque[tuple[WorkerKey, int]] = deque()
        self._wake = wake

    def adopt(
        self, key: WorkerKey, handle: IpcBufferHandle, lease: int, owner: str
    ) -> WorkerBuffer:
        """Map the memory of worker *key*'s *lease* (``cuIpcOpenMemHandle``)."""
        from .workerbuffer import adopt

        buf = adopt(handle, lease, owner, functools.partial(self.enqueue, key, [lease]))
        with self._lock:
            self._live.setdefault(key, weakref.WeakSet()).add(buf)
        return buf

    def enqueue(self, key: WorkerKey, leases: Iterable[int]) -> None:
        """Queue releases of *key*'s leases for the manager to send."""
        if queued := [(key, lease) for lease in leases]:
            self._released.extend(queued)
            self._wake()

    def drain(self) -> dict[WorkerKey, list[int]]:
        """The queued releases, by worker (and the queue emptied)."""
        out: dict[WorkerKey, list[int]] = {}
        while self._released:  # one consumer at a time: the pool drains under its lock
            key, lease = self._released.popleft()
            out.setdefault(key, []).append(lease)
        return out

    def workers(self) -> list[WorkerKey]:
        """The workers that have lent buffers (open or not yet forgotten)."""
        with self._lock:
            return list(self._live)

    def invalidate(self, key: WorkerKey, why: str, synchronize: bool) -> int:
        """Close every ``WorkerBuffer`` of worker *key*, which is exiting or gone; using
        one afterwards raises ``ContextClosedError`` saying *why* and what to do instead.
        With *synchronize*, first wait for the work queued in their contexts. Returns how
        many were open."""
        with self._lock:
            bufs = [b for b in list(self._live.pop(key, ())) if not b.closed]
        if synchronize:
            for ctx in _unique_contexts(bufs):
                with contextlib.suppress(Exception):  # a poisoned context: close anyway
                    ctx.synchronize()
        if bufs:
            from .workerbuffer import revoke

            ordinal, pid = key
            for b in bufs:
                revoke(
                    b,
                    f"{why}: the worker of device {ordinal} (pid {pid}) held this memory, "
                    "which this process may no longer use. Copy what must outlive the worker "
                    "(copy_to_host, copy_to, a new DeviceBuffer) while the pool still runs",
                )
        return len(bufs)


# --- the parent receiving a result ----------------------------------------------------


class ResultLoader(Session):
    """Device memory in a task's result, as objects of the parent.

    An argument reference gives the parent's own object among *args*
    (:meth:`Outgoing.rebuild`); a
    pool worker's memory a :class:`~ctxkit.procs.WorkerBuffer` from *book*.
    ``adopted`` lists the leases that became buffers (the others must be released when
    loading fails).
    """

    def __init__(
        self, args: Outgoing | None, book: LeaseBook | None, key: WorkerKey | None
    ) -> None:
        super().__init__()
        self.args = args
        self.book = book
        self.key = key
        self.adopted: set[int] = set()

    def resolve(self, ref: DeviceRef) -> Any:
        if ref.arg is not None:
            if self.args is None:
                raise RuntimeError("a result refers to a device argument, but none was sent")
            return self.args.rebuild(ref)
        if ref.handle is None:
            return _wrap(_empty(ref.device), ref)
        if self.book is None or self.key is None or ref.lease is None:
            raise RuntimeError(
                "a result holds device memory of the child, which only a DevicePool can receive"
            )
        buf = self.book.adopt(self.key, ref.handle, ref.lease, ref.owner)
        self.adopted.add(ref.lease)
        return _wrap(buf, ref)
