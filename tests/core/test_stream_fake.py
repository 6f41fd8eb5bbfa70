"""Stream handles, host callbacks, streams and events on the fake driver."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as real

import ctxkit as ck
from ctxkit import stream
from ctxkit.errors import (
    ContextClosedError,
    NoCurrentContextError,
)
from ctxkit.stream import Event, Stream, stream_handle
from tests.support.fakedriver import FakeHandle
from tests.support.fakemem import (  # noqa: F401
    HOST_ALREADY_REGISTERED,
    HOST_NOT_REGISTERED,
    ILLEGAL_ADDRESS,
    INVALID_CONTEXT,
    INVALID_HANDLE,
    INVALID_VALUE,
    NOT_READY,
    OK,
    OUT_OF_MEMORY,
    PAGE,
    PEER_ALREADY,
    _HostFn,
    ctx0,
    ctx1,
    fake,
    in_thread,
    rand_bytes,
)

# stream handles, pageable warnings, strict mode, host-array validation
# ======================================================================================


class CudaStreamProto:
    def __cuda_stream__(self):
        return (0, 0x1234)


class CupyLike:
    ptr = 0x2345


class TorchLike:
    cuda_stream = 0x3456


@pytest.mark.parametrize(
    ("obj", "value"),
    [
        (None, 0),
        (7, 7),
        (real.CUstream(0x55), 0x55),
        (CudaStreamProto(), 0x1234),
        (CupyLike(), 0x2345),
        (TorchLike(), 0x3456),
    ],
)
def test_stream_handle_conversions(obj, value):
    h = stream_handle(obj)
    assert isinstance(h, real.CUstream) and int(h) == value


@pytest.mark.parametrize("bad", [True, 1.5, "s", object()])
def test_stream_handle_rejects_other_objects(bad):
    with pytest.raises(TypeError, match="stream"):
        stream_handle(bad)


def test_host_callback_trampoline_from_a_foreign_thread(caplog):
    """The ctypes thunk the driver calls runs the callable and keeps its exception."""
    holder = Stream.__new__(Stream)
    holder._setup(None, FakeHandle(1), True, 0, owned=False, owner=None)  # type: ignore[arg-type]
    seen = []
    key_ok, key_bad = next(stream._keys), next(stream._keys)
    stream._pending[key_ok] = (
        lambda: seen.append(threading.current_thread().name),
        holder_ref(holder),
    )
    stream._pending[key_bad] = (lambda: 1 / 0, holder_ref(holder))
    fn = _HostFn(stream._HOST_FN_ADDR)
    t = threading.Thread(target=lambda: (fn(key_ok), fn(key_bad), fn(99999)), name="driver")
    t.start()
    t.join()
    assert seen == ["driver"]
    assert len(holder._callback_errors) == 1
    assert isinstance(holder._callback_errors[0], ZeroDivisionError)
    assert key_ok not in stream._pending and key_bad not in stream._pending
    with pytest.raises(ZeroDivisionError):
        holder._raise_callback_error()
    assert holder._callback_errors == []
    # the stream is gone before its callback fails: the error is logged, not lost
    key = next(stream._keys)
    gone = Stream.__new__(Stream)
    gone._setup(None, FakeHandle(2), True, 0, owned=False, owner=None)  # type: ignore[arg-type]
    stream._pending[key] = (lambda: 1 / 0, holder_ref(gone))
    del gone
    gc.collect()
    with caplog.at_level(logging.ERROR, logger="ctxkit.stream"):
        fn(key)
    assert "after its stream was dropped" in caplog.text


def holder_ref(s: Stream) -> Any:
    return weakref.ref(s)


# ======================================================================================
# streams and events
# ======================================================================================


def test_stream_created_in_its_own_context(fake, ctx0, ctx1):
    with ctx0:
        s = Stream(ctx1, priority=-2)
        d = Stream(nonblocking=False)
    assert s.context is ctx1 and s.device.ordinal == 1 and s.owned and s.priority == -2
    assert fake.calls("streamcreate")[0][1] == ctx1.handle
    assert fake.calls("streamcreate")[0][2][1:] == (1, -2)
    assert fake.calls("streamcreate")[1][2][1:] == (0, 0) and d.context is ctx0
    assert s.__cuda_stream__() == (0, int(s.handle)) and s.ptr == int(s.handle)
    assert stream_handle(s) is s.handle and int(stream_handle(CudaStreamProto())) == 0x1234
    assert (
        s == Stream.from_handle(s)
        and s != d
        and hash(s) == hash(Stream.from_handle(int(s.handle), ctx1))
    )
    assert "priority=-2" in repr(s)


def test_stream_priority_and_context_errors(fake, ctx0):
    with pytest.raises(ValueError, match=r"-5 \(highest\) .. 0 \(lowest\)"):
        Stream(ctx0, priority=3)
    with pytest.raises(TypeError, match="priority"):
        Stream(ctx0, priority=1.0)  # type: ignore[arg-type]
    with pytest.raises(NoCurrentContextError):
        in_thread(Stream)


def test_stream_sync_query_and_host_callback_errors(fake, ctx0):
    ran = []
    with ctx0:
        s = Stream()
        s.launch_host_func(lambda: ran.append(threading.current_thread().name))
        s.launch_host_func(lambda: {}["missing"])
        s.launch_host_func(lambda: 1 / 0)
        assert s.query() is False
        with pytest.raises(KeyError, match="missing"):
            s.synchronize()
        assert ran and ran[0] != threading.current_thread().name
        s.synchronize()  # reported once, then clean
        assert s.query() is True
        with pytest.raises(TypeError, match="callable"):
            s.launch_host_func(42)  # type: ignore[arg-type]
    assert not stream._pending


def test_stream_wait_event_and_stream_across_devices(fake, ctx0, ctx1):
    s0 = Stream(ctx0)
    s1 = Stream(ctx1)
    with ctx0:
        e0 = s0.record()
        s1.wait(e0)
        s1.wait(s0)
    assert fake.waits[0] == (int(s1.handle), int(e0.handle))
    rec = fake.calls("record")
    assert rec[0][1] == ctx0.handle and rec[1][2][1] == int(s0.handle)
    assert fake.calls("wait")[1][1] == ctx1.handle
    assert isinstance(e0, Event) and e0.timing and e0.context is ctx0


def test_stream_from_foreign_handles(fake, ctx0, ctx1):
    s1 = Stream(ctx1)

    class TorchStream:
        cuda_stream = int(s1.handle)

    t = TorchStream()
    w = Stream.from_handle(t)
    assert w.context is ctx1 and not w.owned and w._owner is t
    assert w.nonblocking and w.priority == 0
    assert Stream.from_handle(np.int64(int(s1.handle))).context is ctx1
    with pytest.raises(NoCurrentContextError):
        in_thread(lambda: Stream.from_handle(0))
    with ctx0:
        legacy = Stream.from_handle(0)
    assert legacy.context is ctx0 and int(legacy.handle) == 0
    w.close()
    assert w.closed and not fake.calls("streamdestroy")
    with pytest.raises(ContextClosedError, match="stream was closed"):
        w.synchronize()
    assert repr(w) == "<Stream closed>"


def test_stream_closed_and_cross_thread_destroy(fake, ctx0, ctx1):
    holder = {}

    def make() -> None:
        with ctx1:
            holder["s"] = Stream()
            holder["e"] = Event()

    in_thread(make)
    in_thread(lambda: (holder.clear(), gc.collect()))
    assert fake.calls("streamdestroy")[0][1] == ctx1.handle
    assert fake.calls("eventdestroy")[0][1] == ctx1.handle
    with ctx0:
        s = Stream()
        s.close()
        s.close()
        with pytest.raises(ContextClosedError, match="stream was closed"):
            stream_handle(s)
        for op in (
            s.synchronize,
            s.query,
            lambda: s.wait(Event()),
            lambda: s.launch_host_func(print),
        ):
            with pytest.raises(ContextClosedError):
                op()


def test_event_record_query_sync_and_timing(fake, ctx0, ctx1):
    with ctx0:
        s = Stream()
        start, end = Event(), Event(blocking=True)
        assert start.record(s) is start
        s.record(end)
        assert start.query() and end.query()
        end.synchronize()
        assert start.elapsed_ms(end) == 1.5
        assert fake.calls("eventsync")
        with pytest.raises(ValueError, match="stream's context"):
            Event().record(Stream(ctx1))
        assert "timing=True" in repr(start) and start.device.ordinal == 0
        start.close()
        start.close()
        assert repr(start) == "<Event closed>"
        with pytest.raises(ContextClosedError, match="event was closed"):
            start.query()


def test_elapsed_ms_errors(fake, ctx0, ctx1):
    with ctx0:
        plain = Event(timing=False).record()
        a, b, never = Event().record(), Event().record(), Event()
        owned = ck.Context.create(0)
        other_ctx = Event(context=owned).record()
        other_dev = Event(context=ctx1).record()
    with pytest.raises(ValueError, match="timing=False"):
        plain.elapsed_ms(b)
    with pytest.raises(ValueError, match="timing=False"):
        a.elapsed_ms(plain)
    with pytest.raises(ValueError, match="never recorded"):
        a.elapsed_ms(never)
    with pytest.raises(ValueError, match="different devices"):
        a.elapsed_ms(other_dev)
    with pytest.raises(ValueError, match="different contexts"):
        a.elapsed_ms(other_ctx)
    with pytest.raises(TypeError, match="ctxkit.Event"):
        a.elapsed_ms(3)  # type: ignore[arg-type]
    with ctx0:
        assert a.elapsed_ms(b) == 1.5


# ======================================================================================
