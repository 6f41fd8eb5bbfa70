"""Interop with other libraries: foreign arrays, CUDA Array Interface and DLPack.

DLPack capsules built with ctypes (no compiled extension needed).

A capsule owns a ``DLManagedTensor`` (legacy, capsule name ``"dltensor"``) or a
``DLManagedTensorVersioned`` (DLPack >= 1.0, ``"dltensor_versioned"``). The struct, its
shape/strides arrays and the Python object that owns the memory are kept in
``_live`` until the tensor's deleter runs: the consumer calls it when it is done (after
renaming the capsule ``"used_..."``), or the capsule destructor calls it when nobody
consumed the capsule. Both callbacks are module-level ctypes thunks that live for the
whole process and take the GIL themselves, so a consumer may release the tensor from
any thread.

Stream order of foreign arrays: use a PyTorch/CuPy/CAI/DLPack array after its producer.

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

An event is recorded and waited on only where CUDA does not already order the two
streams: not for the same stream; not between the legacy default stream (torch's and
CuPy's default) and a *blocking* stream of the same context (created without
``CU_STREAM_NON_BLOCKING``), which the driver synchronizes implicitly. Elsewhere the
event is recorded whether or not the producer has work left: ``cuEventRecord`` plus
``cuStreamWaitEvent`` cost less than one ``cuStreamQuery`` (measured on an H200 host
between launches: 1.26 vs 1.75 us). Several arguments of one producer stream cost one
wait, and the event is reused (one per thread and context).

Inside a stream capture (asked of the driver only while a ``ck.capture`` is open in the
process) a wait on uncaptured work is illegal (``CUDA_ERROR_STREAM_CAPTURE_ISOLATION``),
and a replayed graph never waits for foreign producers anyway. So a producer stream in
the consumer's capture gets the usual record and wait (a graph edge); an uncaptured
producer's work enqueued so far is *finished* before the launch is recorded (the host
waits for an event recorded on it, with the thread's capture interaction mode relaxed for
that one call), so the capture and every replay come after it. Work the producer
enqueues after the capture is the caller's to order before each replay. The legacy
default stream cannot be touched while a blocking stream of the context is captured:
its work is the caller's to finish before the capture begins.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .._driver import drv
from ..context import Context, context_of_cu
from ..errors import CaptureOrderError
from ..lifetime import captured_streams, finalizer
from ..stream import EVENT_DISABLE_TIMING, Stream, implicit_stream

__all__ = [
    "KDL_CPU",
    "KDL_CUDA",
    "KDL_CUDA_MANAGED",
    "dlpack_dtype",
    "live_count",
    "order_after_producers",
    "order_stream",
    "producer_stream",
    "to_capsule",
]


KDL_CPU = 1

KDL_CUDA = 2

KDL_CUDA_HOST = 3

KDL_CUDA_MANAGED = 13

#: numpy dtype kind -> DLPack type code (kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool)
_KIND_CODE = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}

FLAG_READ_ONLY = 1

DLPACK_VERSION = (1, 0)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_NAME_LEGACY = b"dltensor"

_NAME_VERSIONED = b"dltensor_versioned"

_live: dict[int, tuple[Any, ...]] = {}

_pyapi = ctypes.pythonapi

_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _Destructor)(
    ("PyCapsule_New", _pyapi)
)

_capsule_is_valid = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _pyapi)
)

_capsule_get_pointer = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _pyapi)
)


def _delete(addr: int | None) -> None:
    if addr:
        _live.pop(addr, None)


def _capsule_destructor(capsule: int | None) -> None:
    for name in (_NAME_LEGACY, _NAME_VERSIONED):
        if _capsule_is_valid(capsule, name):
            _delete(_capsule_get_pointer(capsule, name))
            return


_DELETER = _Deleter(_delete)

_DESTRUCTOR = _Destructor(_capsule_destructor)


def live_count() -> int:
    """Number of exported tensors whose deleter has not run yet (for tests/diagnostics)."""
    return len(_live)


def dlpack_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int]:
    """``(code, bits, lanes)`` of a numpy dtype; ``BufferError`` when DLPack has none."""
    dt = np.dtype(dtype)
    code = _KIND_CODE.get(dt.kind)
    if code is None or dt.fields is not None or dt.subdtype is not None:
        raise BufferError(f"dtype {dt} has no DLPack equivalent (numeric and bool only)")
    return code, dt.itemsize * 8, 1


def _int64s(values: tuple[int, ...]) -> Any:
    """*values* as a C ``int64_t`` array (of at least one element)."""
    return (ctypes.c_int64 * max(len(values), 1))(*values)


_INT64_P = ctypes.POINTER(ctypes.c_int64)


def to_capsule(
    ptr: int,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    device: tuple[int, int],
    owner: object,
    *,
    strides: tuple[int, ...] | None = None,
    versioned: bool = False,
    read_only: bool = False,
) -> Any:
    """A DLPack capsule for memory at *ptr* that keeps *owner* alive until released.

    Parameters
    ----------
    ptr : int
        Address of the first element.
    shape : tuple of int
        Extent of each dimension.
    dtype : numpy.dtype
        Element type (numeric or bool).
    device : (int, int)
        ``(DLDeviceType, device_id)``, e.g. ``(KDL_CUDA, 0)``.
    owner : object
        Kept alive until the consumer (or the unconsumed capsule) releases the tensor.
    strides : tuple of int, optional
        Strides in *elements*; ``None`` for C-contiguous.
    versioned : bool
        Build a DLPack 1.0 ``DLManagedTensorVersioned`` (``"dltensor_versioned"``)
        instead of the legacy ``DLManagedTensor`` (``"dltensor"``).
    read_only : bool
        Set the read-only flag (versioned capsules only).
    """
    managed: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = FLAG_READ_ONLY if read_only else 0
        name = _NAME_VERSIONED
    else:
        managed = DLManagedTensor()
        name = _NAME_LEGACY
    c_shape = _int64s(shape)
    c_strides = None if strides is None else _int64s(strides)
    managed.dl_tensor = DLTensor(
        ptr or None,
        DLDevice(*device),
        len(shape),
        DLDataType(*dlpack_dtype(dtype)),
        ctypes.cast(c_shape, _INT64_P),
        None if c_strides is None else ctypes.cast(c_strides, _INT64_P),
        0,
    )
    managed.deleter = _DELETER
    addr = ctypes.addressof(managed)
    managed.manager_ctx = addr
    _live[addr] = (managed, (c_shape, c_strides), owner)  # the arrays live with the struct
    try:
        return _capsule_new(addr, name, _DESTRUCTOR)
    except BaseException:
        _live.pop(addr, None)
        raise


_STREAM_NON_BLOCKING = 1

_LEGACY = 0  # the driver's handle of the legacy default stream; CAI v3 and DLPack say 1

_PER_THREAD = 2  # CU_STREAM_PER_THREAD: a blocking stream of the calling thread

_LEGACY_HANDLE: Any = drv.CUstream(0) if drv is not None else None

_RELAXED_MODE: Any = (
    drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED if drv is not None else None
)

_BOUND = contextlib.nullcontext()  # the producer's context is the current one already

_StreamOf = Callable[[Any], "int | None"]

_Dlpack = Callable[[Any, int], None]

_kinds: dict[type, tuple[_StreamOf | None, _Dlpack | None] | None] = {}


def _torch_stream_getter() -> _StreamOf:
    """``tensor -> torch's current raw stream of its device``, the cheapest way this
    torch offers (``torch._C._cuda_getCurrentRawStream``, else the public API)."""
    torch = sys.modules["torch"]
    raw = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
    if callable(raw):

        def fast(t: Any) -> int | None:
            index = t.get_device()
            return None if index < 0 else int(raw(index))

        return fast

    def public(t: Any) -> int | None:
        return int(torch.cuda.current_stream(t.device).cuda_stream) if t.is_cuda else None

    return public


def _cupy_stream_getter() -> _StreamOf:
    """``array -> CuPy's current stream`` (``get_current_stream_ptr`` where it exists)."""
    cuda = sys.modules["cupy"].cuda
    ptr = getattr(getattr(cuda, "stream", None), "get_current_stream_ptr", None)
    if callable(ptr):
        return lambda a: int(ptr())
    current = cuda.get_current_stream
    return lambda a: int(current().ptr)


def _cai_stream(a: Any) -> int | None:
    value = a.__cuda_array_interface__.get("stream")
    return None if value is None else int(value)


def _order_dlpack(v: Any, consumer: int) -> None:
    """DLPack >= 1.0: the producer makes *consumer* wait (1 means the legacy stream).

    The device is asked on every call: one type may hold host and device arrays.
    """
    if int(v.__dlpack_device__()[0]) != KDL_CPU:
        v.__dlpack__(stream=consumer or 1)


_PLAIN = frozenset({int, float, bool, complex, str, bytes, bytearray, memoryview, type(None)})


def _classify(v: Any) -> tuple[_StreamOf | None, _Dlpack | None] | None:
    """``(stream_of, None)`` for arrays whose producer stream can be read,
    ``(None, dlpack_orderer)`` for DLPack producers that order the consumer themselves,
    ``None`` for values that need nothing (numbers, host arrays, ctxkit objects)."""
    t = type(v)
    mod = t.__module__ or ""
    if mod == "ctxkit" or mod.startswith("ctxkit.") or t in _PLAIN:
        return None
    if isinstance(v, (np.ndarray, np.generic)):
        return None  # host memory (pinned or managed arrays have no producer stream)
    if mod.startswith("torch") and hasattr(v, "data_ptr") and hasattr(v, "is_cuda"):
        return _torch_stream_getter(), None
    if mod.startswith("cupy") and hasattr(getattr(v, "data", None), "ptr"):
        return _cupy_stream_getter(), None
    if hasattr(v, "__cuda_array_interface__"):
        return _cai_stream, None
    if hasattr(v, "__dlpack__") and hasattr(v, "__dlpack_device__"):
        return None, _order_dlpack
    return None


def _kind(v: Any) -> tuple[_StreamOf | None, _Dlpack | None] | None:
    t = type(v)
    if t not in _kinds:
        _kinds[t] = _classify(v)  # threads racing here store the same answer
    return _kinds[t]


def producer_stream(v: Any) -> int | None:
    """The stream (int handle; 0 or 1 = legacy default) a foreign array is ready on.

    ``None`` when nothing has to be ordered: ctxkit objects, numbers, host arrays, CAI
    objects without a ``stream`` entry, and DLPack producers (they order themselves
    through ``__dlpack__(stream=)``).
    """
    kind = _kind(v)
    return None if kind is None or kind[0] is None else kind[0](v)


def order_after_producers(
    values: Iterable[Any], consumer: Any, ctx: Context | None, consumer_stream: Any = None
) -> None:
    """Make stream *consumer* wait until each of *values* is ready: one wait per distinct
    producer stream.

    On a capturing *consumer* a replayed graph never waits for foreign producers again,
    so a producer outside the capture has its work so far finished on the host before
    the caller records its work; order what it enqueues later before each replay (see
    the module docstring).

    Parameters
    ----------
    values : iterable
        Kernel arguments or copy ends; numbers, host arrays and ctxkit objects need nothing.
    consumer : CUstream, int or None
        The consumer stream's handle, in *ctx* (``None`` or 0: the legacy default stream).
    ctx : Context
        The calling thread's current context (``None``: nothing is ordered).
    consumer_stream : Stream or another library's stream, optional
        The stream object *consumer* came from (``None``: the thread's current stream);
        its flags decide whether the legacy default stream is ordered before it anyway.

    Raises
    ------
    CaptureOrderError
        *consumer* is capturing and no order with the producer exists: it captures into
        another graph, or the capture was begun outside ctxkit.
    """
    kinds = _kinds
    producers: list[int] | None = None  # made only when there is one: the launch hot path
    for v in values:
        try:
            kind = kinds[type(v)]
        except KeyError:
            kind = _kind(v)
        if kind is None:
            continue
        stream_of, dlpack = kind
        if stream_of is None:
            if ctx is not None:
                dlpack(v, 0 if consumer is None else int(consumer))  # type: ignore[misc]
            continue
        p = stream_of(v)
        if p is None:
            continue
        p = _LEGACY if p == 1 else p
        if producers is None:
            producers = [p]
        elif p not in producers:
            producers.append(p)
    if producers is None or ctx is None:
        return
    c = 0 if consumer is None else int(consumer)
    for p in producers:
        order_stream(ctx, p, c, consumer_stream)


def order_stream(ctx: Context, producer: int, consumer: int, consumer_stream: Any = None) -> None:
    """Order stream *consumer* after the work enqueued on stream *producer* so far, unless
    CUDA already does (same stream; legacy default vs a blocking stream). Both are handle
    values, 0 or 1 (as in CAI v3 and DLPack) the legacy default stream; *ctx* is current."""
    producer = _LEGACY if producer == 1 else producer
    consumer = _LEGACY if consumer == 1 else consumer
    if producer == consumer:
        return
    if producer in (_LEGACY, _PER_THREAD):
        if consumer == _LEGACY:
            return
        if producer == _LEGACY and (
            not consumer_stream.nonblocking
            if type(consumer_stream) is Stream
            else _consumer_blocking(consumer, consumer_stream, ctx)
        ):
            return
        owner = ctx
        handle = _LEGACY_HANDLE if producer == _LEGACY else drv.CUstream(producer)
    else:
        handle = drv.CUstream(producer)
        owner = _stream_context(handle, ctx)
        if consumer == _LEGACY and owner is ctx and _blocking(handle):
            return
    if captured_streams and consumer != _LEGACY and _capturing(consumer):
        _order_in_capture(ctx, owner, handle, producer, consumer)
        return
    if owner is ctx:  # the launch hot path: no `with` around the record
        event = _record(owner, handle, producer)
    else:
        with owner:
            event = _record(owner, handle, producer)
    _wait_event(ctx, event, producer, consumer, consumer_stream)


_CAPTURE_NONE = 0

_CAPTURE_ACTIVE = 1

_CAPTURE_ISOLATION = 905  # CUDA_ERROR_STREAM_CAPTURE_ISOLATION


def _capture_info(handle: Any) -> tuple[int, int]:
    """``(capture status, capture id)`` of a stream (``(0, 0)`` if the driver refuses)."""
    res = drv.cuStreamGetCaptureInfo(handle)
    return (_CAPTURE_NONE, 0) if res[0] else (int(res[1]), int(res[2]))


def _capturing(consumer: int) -> bool:
    """Whether the (non-legacy) consumer stream is capturing; asked only while ctxkit has a
    capture open, so launches outside captures pay nothing."""
    err, status = drv.cuStreamIsCapturing(_stream_object(consumer))
    return not err and int(status) != _CAPTURE_NONE


def _order_in_capture(
    ctx: Context, owner: Context, handle: Any, producer: int, consumer: int
) -> None:
    """Order a capturing *consumer* after *producer* the ways the driver allows.

    The same capture: record and wait, a graph edge. An uncaptured producer: its work so
    far is finished now, so the graph is made (and every replay runs) after it. Another
    capture: no order is possible, a :class:`CaptureOrderError`.
    """
    status, cid = _capture_info(_stream_object(consumer))
    if status != _CAPTURE_ACTIVE:
        return  # invalidated already: cuStreamEndCapture reports why
    p_status, p_cid = (_CAPTURE_NONE, 0) if producer == _LEGACY else _capture_info(handle)
    if p_status == _CAPTURE_ACTIVE and p_cid == cid:
        _wait_event(ctx, _record(ctx, handle, producer), producer, consumer)
        return
    if p_status != _CAPTURE_NONE:
        raise CaptureOrderError(
            f"a foreign array's producer stream {producer:#x} is capturing into another "
            f"graph than the consumer stream {consumer:#x}: no order between two captures "
            "exists; finish the producer's capture first, or capture both on one stream"
        )
    with _BOUND if owner is ctx else owner:
        _finish(owner, _record(owner, handle, producer), producer)


def _finish(owner: Context, event: Any, producer: int) -> None:
    """Wait on the host for *event* (recorded on an uncaptured stream of *owner*, current).

    A capture in ``global`` or ``thread_local`` mode forbids ``cuEventSynchronize`` in
    this thread; it is safe here (the event depends on no captured work), so the thread's
    capture interaction mode is relaxed for this one call.
    """
    err, mode = drv.cuThreadExchangeStreamCaptureMode(_RELAXED_MODE)
    if err:
        raise owner.note_error(err, "cuThreadExchangeStreamCaptureMode")
    try:
        (err,) = drv.cuEventSynchronize(event)
    finally:
        drv.cuThreadExchangeStreamCaptureMode(mode)
    if err:
        raise owner.note_error(
            err, f"cuEventSynchronize on the producer stream {producer:#x} during a capture"
        )


def _record(owner: Context, handle: Any, producer: int) -> Any:
    """This thread's event of *owner* (current), recorded on the producer stream."""
    hit = _events.by_context.get(owner.handle)
    event = hit[1] if hit is not None and hit[0] is owner else _new_event(owner)
    (err,) = drv.cuEventRecord(event, handle)
    if err:
        raise owner.note_error(err, f"cuEventRecord on the producer stream {producer:#x}")
    return event


def _wait_event(
    ctx: Context, event: Any, producer: int, consumer: int, consumer_stream: Any = None
) -> None:
    """Make *consumer* (a stream of *ctx*, the current context; *consumer_stream* its
    object when the caller has it) wait for *event*."""
    if type(consumer_stream) is Stream and consumer_stream.handle is not None:
        target = consumer_stream.handle
    else:
        target = _LEGACY_HANDLE if consumer == _LEGACY else _stream_object(consumer)
    (err,) = drv.cuStreamWaitEvent(target, event, 0)
    if err == _CAPTURE_ISOLATION:
        raise CaptureOrderError(
            f"the consumer stream {consumer:#x} is capturing (a capture begun outside "
            f"ctxkit) and a foreign array's producer stream {producer:#x} is not in it: "
            "the wait made the capture invalid. Finish the producer's work before the "
            "capture begins, or capture with ck.capture, which orders it",
            int(err),
            "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        )
    if err:
        raise ctx.note_error(err, f"cuStreamWaitEvent({consumer:#x}) after producer {producer:#x}")


_stream_objects: dict[int, Any] = {}


def _stream_object(value: int) -> Any:
    """A ``CUstream`` of *value*, made once (a handle object only wraps the value)."""
    h = _stream_objects.get(value)
    if h is None:
        if len(_stream_objects) > 256:
            _stream_objects.clear()
        h = _stream_objects[value] = drv.CUstream(value)
    return h


def _consumer_blocking(consumer: int, stream: Any, ctx: Context) -> bool:
    """Whether the (non-legacy) consumer stream synchronizes with the legacy default stream.

    A ctxkit stream knows its flags; ``None`` stands for the thread's current stream;
    another library's stream is asked (``cuStreamGetFlags``) on every call, because the
    driver reuses the handles of destroyed streams.
    """
    if isinstance(stream, Stream):
        return not stream.nonblocking
    if stream is None:
        cur = implicit_stream(ctx)
        if cur is not None and int(cur.handle or 0) == consumer:
            return not cur.nonblocking
    if consumer == _PER_THREAD:
        return True
    return _blocking(drv.CUstream(consumer))


def _blocking(handle: Any) -> bool:
    """True for a stream created without ``CU_STREAM_NON_BLOCKING`` (False if unknown)."""
    err, flags = drv.cuStreamGetFlags(handle)
    return not err and not int(flags) & _STREAM_NON_BLOCKING


def _stream_context(handle: Any, fallback: Context) -> Context:
    err, cu = drv.cuStreamGetCtx(handle)
    return fallback if err or int(cu) in (0, fallback.handle) else context_of_cu(cu)


class _Holder:
    """Lives as long as its thread's state: the events die with it."""


class _Events(threading.local):
    """One reusable event per context and thread, for recording producer streams.

    One is enough: ``cuStreamWaitEvent`` waits for the event's state when it is called,
    so recording the same event again later does not change an earlier wait.
    """

    def __init__(self) -> None:
        self.by_context: dict[int, tuple[Context, Any]] = {}
        self.holder = _Holder()


_events = _Events()


def _new_event(ctx: Context) -> Any:
    """This thread's event of *ctx* (current), made at its first use (:func:`_record`
    looks it up). Kept with its context object: a later context that gets the same
    handle gets its own."""
    err, ev = drv.cuEventCreate(EVENT_DISABLE_TIMING)
    if err:
        raise ctx.note_error(err, "cuEventCreate for producer-stream ordering")
    _events.by_context[ctx.handle] = (ctx, ev)
    finalizer(_events.holder, ctx, drv.cuEventDestroy, ev)
    return ev
