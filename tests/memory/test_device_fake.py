"""DeviceBuffer on the fake driver: allocation in the owning context, copies, memsets,
streams of other contexts, the pageable-copy warning."""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.memory as memory
from ctxkit.errors import (
    ContextClosedError,
    ContextPoisonedError,
    NoCurrentContextError,
    OutOfMemoryError,
)
from ctxkit.memory import (
    DeviceBuffer,
    PageableCopyError,
    PageableCopyWarning,
)
from ctxkit.stream import Stream
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
    ctx0,
    ctx1,
    fake,
    in_thread,
    rand_bytes,
)
from tests.support.helpers import OBJECT_DTYPES, object_array, object_dtype_message

# ======================================================================================
# DeviceBuffer against the fake driver
# ======================================================================================


def test_buffer_allocates_in_the_current_context(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(100)
    assert buf.context is ctx0 and buf.nbytes == 100 and buf.device.ordinal == 0
    assert fake.calls("alloc")[-1][1] == ctx0.handle
    assert "nbytes=100" in repr(buf)


def test_buffer_context_argument_is_bound_for_the_allocation(fake, ctx0, ctx1):
    with ctx0:
        buf = DeviceBuffer(64, context=ctx1)
        other = DeviceBuffer(64, context=1)
        assert fake.cur() == ctx0.handle
    assert buf.context is ctx1 and other.context is ctx1
    assert [c[1] for c in fake.calls("alloc")] == [ctx1.handle, ctx1.handle]


def test_buffer_without_a_current_context_names_the_fix(fake, ctx0):
    with pytest.raises(NoCurrentContextError, match=r"ctxkit.bind"):
        in_thread(lambda: DeviceBuffer(16))


def test_zero_size_buffer_allocates_nothing(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(0)
        buf.copy_from_host(np.zeros(0, np.uint8))
        assert buf.copy_to_host().size == 0
        buf.memset(3)
    assert not fake.calls("alloc") and not fake.calls("HtoD") and not fake.calls("memset")
    buf.close()
    assert buf.closed


def test_out_of_memory_reports_requested_and_free_bytes(fake, ctx0):
    with ctx0:
        keep = DeviceBuffer(1000)
        with pytest.raises(OutOfMemoryError) as info:
            DeviceBuffer(fake.total)
    exc = info.value
    assert exc.requested == fake.total and exc.free == fake.total - 1000  # type: ignore[attr-defined]
    assert f"{fake.total} bytes" in str(exc) and f"{fake.total - 1000} bytes" in str(exc)
    assert exc.name == "CUDA_ERROR_OUT_OF_MEMORY" and isinstance(exc, MemoryError)
    keep.close()


def test_close_is_idempotent_and_use_after_close_is_clear(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(32)
        view = buf[8:16]
        buf.close()
        buf.close()
        assert fake.used == 0 and buf.closed and view.closed
        for op in (
            lambda: buf.ptr,
            lambda: buf.copy_from_host(np.zeros(32, np.uint8)),
            lambda: buf.copy_to_host(),
            lambda: buf.memset(0),
            lambda: view.copy_to_host(),
            lambda: buf.view(),
            lambda: buf[0:4],
        ):
            with pytest.raises(ContextClosedError, match="closed"):
                op()
    assert "closed" in repr(buf)
    assert len(fake.calls("free")) == 1


def test_from_pointer_wraps_without_owning(fake, ctx0):
    class Owner:
        pass

    with ctx0:
        real_buf = DeviceBuffer(32)
        owner = Owner()
        alive = weakref.ref(owner)
        wrapped = DeviceBuffer.from_pointer(real_buf.ptr + 8, 16, owner=owner)
        del owner
        gc.collect()
        assert alive() is not None and wrapped.context is ctx0
        wrapped.copy_from_host(np.arange(16, dtype=np.uint8))
        assert real_buf.copy_to_host()[8:24].tolist() == list(range(16))
        assert wrapped.view((4,), np.float32).ptr == real_buf.ptr + 8
        wrapped.close()  # forgets the memory and the owner; frees nothing
        gc.collect()
        assert alive() is None and fake.used == 32 and not fake.calls("free")
        with pytest.raises(ContextClosedError):
            wrapped.copy_to_host()
        bare = DeviceBuffer.from_pointer(real_buf.ptr, 32, context=0)
        assert bare.context is ctx0 and bare.nbytes == 32


def test_context_manager_closes(fake, ctx0):
    with ctx0, DeviceBuffer(8) as buf:
        assert not buf.closed
    assert buf.closed and fake.used == 0


def test_buffer_dropped_in_another_thread_is_freed_in_its_context(fake, ctx0, ctx1):
    holder: dict[str, Any] = {}

    def make() -> None:
        with ctx1:
            holder["buf"] = DeviceBuffer(4096)

    in_thread(make)
    assert fake.used == 4096
    hooks: list[Any] = []
    old = sys.unraisablehook
    sys.unraisablehook = hooks.append
    try:

        def drop() -> None:
            assert fake.cur() == 0
            holder.clear()
            gc.collect()

        in_thread(drop)
    finally:
        sys.unraisablehook = old
    assert fake.used == 0 and not hooks
    assert fake.calls("free")[-1][1] == ctx1.handle


@pytest.mark.parametrize("n", [1, 3, 5, 255, 1023, 4097])
@pytest.mark.parametrize("use_stream", [False, True])
def test_host_device_round_trip_is_bit_exact(fake, ctx0, n, use_stream):
    data = rand_bytes(n, seed=n)
    with ctx0:
        s = Stream() if use_stream else None
        buf = DeviceBuffer(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PageableCopyWarning)
            buf.copy_from_host(data, stream=s)
            out = buf.copy_to_host(stream=s)
            other = DeviceBuffer(n)
            other.copy_from(buf, stream=s)
            back = np.empty(n, np.uint8)
            assert other.copy_to_host(back, stream=s) is back
    np.testing.assert_array_equal(out, data)
    np.testing.assert_array_equal(back, data)
    kinds = {c[0] for c in fake.log}
    assert ("HtoDAsync" in kinds) == use_stream and ("DtoD" in kinds) != use_stream


def test_slices_copy_at_odd_offsets(fake, ctx0):
    data = rand_bytes(37, seed=1)
    with ctx0:
        buf = DeviceBuffer(64)
        buf.memset(0xAB)
        buf[3:40].copy_from_host(data)
        got = buf.copy_to_host()
        tail = buf[-5:].copy_to_host()
        with pytest.raises(TypeError, match="byte slice"):
            buf[3]  # type: ignore[index]
        with pytest.raises(ValueError, match="step 1"):
            buf[::2]
    assert (got[:3] == 0xAB).all() and (got[40:] == 0xAB).all()
    np.testing.assert_array_equal(got[3:40], data)
    assert (tail == 0xAB).all() and buf[3:40].nbytes == 37 and "view" in repr(buf[1:2])


def test_copy_mismatches_raise_before_any_driver_call(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(16)
        other = DeviceBuffer(8)
        fake.log.clear()
        with pytest.raises(ValueError, match="17 bytes but the device memory has 16"):
            buf.copy_from_host(np.zeros(17, np.uint8))
        with pytest.raises(ValueError, match="sizes must match"):
            buf.copy_to_host(np.zeros(4, np.float64))
        with pytest.raises(ValueError, match="C-contiguous"):
            buf.copy_from_host(np.zeros((4, 4), np.uint8)[:, :1])
        with pytest.raises(ValueError, match="read-only"):
            ro = np.zeros(16, np.uint8)
            ro.flags.writeable = False
            buf.copy_to_host(ro)
        with pytest.raises(ValueError, match="sizes must match"):
            buf.copy_from(other)
        with pytest.raises(TypeError, match="__cuda_array_interface__"):
            buf.copy_from(np.zeros(16, np.uint8))
        with pytest.raises(TypeError, match="int byte"):
            buf.memset(1.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="0..255"):
            buf.memset(256)
    assert fake.log == []


def test_memset_sync_and_async(fake, ctx0):
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(10)
        buf.memset(7)
        assert (buf.copy_to_host() == 7).all()
        buf[2:4].memset(np.uint8(9), stream=s)
    with ctx0:
        assert buf.copy_to_host().tolist() == [7, 7, 9, 9, 7, 7, 7, 7, 7, 7]
    assert fake.calls("memsetAsync")[0][2] == (9, 2, int(s.handle))


def test_memset_without_stream_is_done_before_a_stream_memset_runs(fake, ctx0):
    """The first GPU run's failure: the legacy-stream memset landed after the slice's
    memset on a non-blocking stream, overwriting it. The fake queues legacy work."""
    with ctx0:
        s = Stream()
        b = DeviceBuffer(4099)
        b.memset(0x11)
        assert not fake.legacy.get(ctx0.handle)
        b[7:4000].memset(0xEE, stream=s)
        s.synchronize()
        out = b.copy_to_host()
    assert (out[:7] == 0x11).all() and (out[7:4000] == 0xEE).all() and (out[4000:] == 0x11).all()
    assert fake.calls("memsetAsync")[0][2] == (0xEE, 3993, int(s.handle))


def test_default_stream_operations_complete_before_returning(fake, ctx0, ctx1):
    """stream=None: H2D, D2D, peer copies and memsets wait for the default stream of the
    context they ran in; stream=s: nothing waits."""
    data = np.arange(16, dtype=np.uint8)
    a = DeviceBuffer(16, context=ctx0)
    b = DeviceBuffer(16, context=ctx0)
    c = DeviceBuffer(16, context=ctx1)
    steps = [
        (lambda: a.copy_from_host(data), ctx0),
        (lambda: b.copy_from(a), ctx0),
        (lambda: a.view().copy_to(b.view()), ctx0),
        (lambda: ck.copy_peer(c, a), ctx1),
        (lambda: c.copy_from(b), ctx1),
        (lambda: c.memset(5), ctx1),
        (lambda: ck.memory.to_device(data, context=ctx1), ctx1),
    ]
    with ctx0:
        for step, where in steps:
            fake.log.clear()
            step()
            assert not any(fake.legacy.values()), step
            assert ("streamsync", where.handle, 0) in fake.log, step
        s = Stream()
        fake.log.clear()
        a.copy_from_host(ck.pinned_empty(16, np.uint8), stream=s)
        b.copy_from(a, stream=s)
        b.memset(1, stream=s)
        assert not fake.calls("streamsync")
    with ctx1:
        np.testing.assert_array_equal(c.copy_to_host(), np.full(16, 5, np.uint8))


def test_default_stream_wait_reports_a_fault(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(8)
        fake.sticky[ctx0.handle] = ILLEGAL_ADDRESS
        with pytest.raises(ContextPoisonedError, match="cuStreamSynchronize"):
            buf.memset(0)
    assert ctx0.poisoned


def test_stream_of_another_context_is_refused(fake, ctx0, ctx1):
    s1 = Stream(ctx1)
    with ctx0:
        buf = DeviceBuffer(8)
        fake.log.clear()
        with pytest.raises(ValueError, match="belongs to"):
            buf.copy_from_host(ck.pinned_empty(8, np.uint8), stream=s1)
        with pytest.raises(ValueError, match="belongs to"):
            buf.memset(0, stream=s1)
    assert not [c for c in fake.log if "HtoD" in c[0] or "memset" in c[0]]


def test_operations_bind_the_buffer_context(fake, ctx0, ctx1):
    with ctx1:
        buf = DeviceBuffer(8)
    with ctx0:
        buf.memset(1)
        assert fake.cur() == ctx0.handle
    assert fake.calls("memset")[-1][1] == ctx1.handle
    in_thread(lambda: buf.memset(2))  # a thread with no context: the buffer binds its own
    assert fake.calls("memset")[-1][1] == ctx1.handle


def test_strict_mode_refuses_implicit_binds(fake, ctx0, ctx1, monkeypatch):
    with ctx1:
        buf = DeviceBuffer(8)
        s = Stream()
    monkeypatch.setattr(ck.registry, "strict", True)
    for op in (lambda: buf.memset(2), s.synchronize, lambda: buf.copy_to_host()):
        with pytest.raises(NoCurrentContextError, match="ctxkit.bind"):
            in_thread(op)
    with ctx0:  # another context current: the object still binds its own
        buf.memset(3)
    assert fake.calls("memset")[-1][1] == ctx1.handle


def test_strict_mode_from_the_environment(monkeypatch):
    from ctxkit.binding import ContextRegistry

    monkeypatch.setenv("CTXKIT_STRICT_CONTEXT", "1")
    assert ContextRegistry().strict is True
    monkeypatch.setenv("CTXKIT_STRICT_CONTEXT", "0")
    assert ContextRegistry().strict is False
    monkeypatch.setenv("CTXKIT_STRICT_CONTEXT", "1")
    assert ContextRegistry(strict=False).strict is False


def test_ck_registry_is_the_process_wide_registry(monkeypatch):
    from ctxkit import binding

    assert isinstance(ck.registry, ck.ContextRegistry) and ck.registry is binding.registry
    monkeypatch.setattr(ck.registry, "strict", False)
    ck.registry.strict = True
    assert binding.registry.strict is True


def test_pageable_async_copy_warns_and_pinned_does_not(fake, ctx0):
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(64)
        pinned = ck.pinned_empty(64, np.uint8)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            buf.copy_from_host(np.zeros(64, np.uint8), stream=s)
            buf.copy_from_host(pinned, stream=s)
            buf.copy_to_host(pinned, stream=s)
            buf.copy_from_host(np.zeros(64, np.uint8))  # synchronous: nothing to warn about
            buf.copy_to_host(stream=s)
    assert [w.category for w in got] == [PageableCopyWarning, PageableCopyWarning]
    assert all(w.filename == __file__ for w in got)
    assert "copy_from_host" in str(got[0].message) and "copy_to_host" in str(got[1].message)


def test_strict_mode_refuses_before_copying(fake, ctx0):
    memory.set_strict_async(True)
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(8)
        with pytest.raises(PageableCopyError):
            buf.copy_from_host(np.ones(8, np.uint8), stream=s)
        buf.copy_from_host(ck.pinned_zeros(8, np.uint8), stream=s)
    assert len(fake.calls("HtoDAsync")) == 1


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_host_copies_refuse_arrays_of_python_objects(fake, ctx0, dtype):
    """Object references are heap addresses: they never go to a device or come back."""
    arr = object_array(dtype, 64)
    objects = list(arr["f1"] if arr.dtype.names else arr)
    with ctx0:
        buf = DeviceBuffer(64)
        buf.copy_from_host(np.zeros(64, np.uint8))
        s = Stream()
    for call in (
        lambda: buf.copy_from_host(arr),
        lambda: buf.copy_from_host(arr, stream=s),
        lambda: buf.copy_to_host(arr),
        lambda: buf.copy_to_host(arr, stream=s),
        lambda: ck.to_device(arr, context=ctx0),
        lambda: ck.to_device(arr, context=ctx0, stream=s),
    ):
        with pytest.raises(TypeError, match=object_dtype_message(dtype)):
            call()
    assert len(fake.calls("HtoD")) == 1 and not fake.calls("HtoDAsync")
    assert not fake.calls("DtoH") and not fake.calls("DtoHAsync")
    assert all(a is b for a, b in zip(arr["f1"] if arr.dtype.names else arr, objects))


# ======================================================================================


def test_a_view_names_its_base_and_closes_with_it(fake, ctx0):
    with ctx0:
        b = DeviceBuffer(4096)
        view = b[16:32]
        assert b.base is None and view.base is b
        assert view.ptr == b.ptr + 16 and view.nbytes == 16
        b.close()
    assert view.closed
