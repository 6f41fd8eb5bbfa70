"""Streams and events on real GPUs: created in their own context, priorities, GIL-free
synchronize, host callbacks with errors, events and timing, the cross-device dependency
(event on device 0, wait on device 1) with a spin kernel proving the race is real, and
destruction in the owning context from another thread."""

from __future__ import annotations

import gc
import sys
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import stream as stream_mod
from ctxkit._driver import drv
from ctxkit.errors import ContextClosedError, NoCurrentContextError
from ctxkit.stream import Event, Stream, stream_handle
from tests.support.helpers import in_thread

SPIN = 400_000_000  # clock64 ticks: ~0.2 s at H200 clocks


@pytest.fixture(scope="module")
def k() -> SimpleNamespace:
    from ctxkit.compiler import kernel_source

    with ck.registry.context(0):
        spin = ck.Module.load(ck.compile(kernel_source("spin.cu")))
        scale = ck.Module.load(ck.compile(kernel_source("scale.cu")))
    return SimpleNamespace(
        spin=spin.function("spin"),
        spin_then_copy=spin.function("spin_then_copy"),
        scale=scale.function("scale_f32"),
    )


def stream_ctx(s: Stream) -> int:
    err, cu = drv.cuStreamGetCtx(s.handle)
    assert not err
    return int(cu)


# --- creation ------------------------------------------------------------------------


def test_stream_is_created_in_its_own_context(ctx0):
    owned = ck.Context.create(0)
    try:
        with ctx0:
            s = Stream(owned)  # another context is current: the stream still goes to owned
            t = Stream()
        assert stream_ctx(s) == owned.handle and s.context is owned
        assert stream_ctx(t) == ctx0.handle and t.context is ctx0
        s.close()
    finally:
        owned.close()


@pytest.mark.multigpu
def test_stream_for_another_device(ctx0, ctx1):
    with ctx0:
        s = Stream(ctx1)
        e = Event(context=1)
    assert stream_ctx(s) == ctx1.handle and s.device.ordinal == 1 and e.context is ctx1


def test_flags_and_priority(ctx0):
    with ctx0:
        err, _least, greatest = drv.cuCtxGetStreamPriorityRange()
        assert not err
        hi = Stream(priority=greatest)
        blocking = Stream(nonblocking=False)
        err, prio = drv.cuStreamGetPriority(hi.handle)
        assert not err and prio == greatest
        assert drv.cuStreamGetFlags(hi.handle)[1] == 1
        assert drv.cuStreamGetFlags(blocking.handle)[1] == 0
        with pytest.raises(ValueError, match="outside the range"):
            Stream(priority=greatest - 1 if greatest < 0 else 1)


def test_no_current_context(ctx0):
    with pytest.raises(NoCurrentContextError):
        in_thread(Stream)
    with pytest.raises(NoCurrentContextError):
        in_thread(Event)


# --- synchronize, query, callbacks -------------------------------------------------------


def test_synchronize_releases_the_gil_and_query(ctx0, k):
    counter = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counter[0] += 1

    with ctx0:
        s = Stream()
        k.spin.launch(1, 1, SPIN, 0, stream=s)
        assert s.query() is False
        t = threading.Thread(target=count)
        t.start()
        before = counter[0]
        s.synchronize()
        during = counter[0] - before
        stop.set()
        t.join()
        assert s.query() is True
    assert during > 10_000  # the other thread ran while the main thread waited


def test_host_callback_runs_in_order_and_errors_are_raised(ctx0, k):
    order: list[str] = []
    with ctx0:
        s = Stream()
        flag = ck.pinned_zeros(1, np.int32)
        k.spin.launch(1, 1, SPIN // 4, flag, stream=s)  # pinned memory is device-visible
        s.launch_host_func(lambda: order.append(f"cb1 flag={int(flag[0])}"))
        s.launch_host_func(lambda: 1 / 0)
        s.launch_host_func(lambda: order.append("cb3"))
        gc.collect()  # the callables live only in ctxkit's pending table
        with pytest.raises(ZeroDivisionError):
            s.synchronize()
        s.synchronize()
    assert order == ["cb1 flag=1", "cb3"]
    assert not stream_mod._pending


def test_closed_stream_and_event(ctx0):
    with ctx0:
        s = Stream()
        e = Event()
        s.close()
        e.close()
        s.close()
        with pytest.raises(ContextClosedError):
            s.synchronize()
        with pytest.raises(ContextClosedError):
            e.record()


# --- events ------------------------------------------------------------------------------


def test_event_timing(ctx0, k):
    with ctx0:
        s = Stream()
        start = s.record()
        k.spin.launch(1, 1, SPIN // 4, 0, stream=s)
        end = s.record()
        ms = start.elapsed_ms(end)
        assert end.query() is True
        assert 1.0 < ms < 10_000
        plain = s.record(timing=False)
        with pytest.raises(ValueError, match="timing=False"):
            start.elapsed_ms(plain)
        with pytest.raises(ValueError, match="never recorded"):
            start.elapsed_ms(Event())
        blocking = Event(blocking=True).record(s)
        blocking.synchronize()


@pytest.mark.multigpu
def test_elapsed_across_devices_is_refused(ctx0, ctx1):
    with ctx0:
        a = Event().record()
        b = Event(context=ctx1).record()
        with pytest.raises(ValueError, match="different devices"):
            a.elapsed_ms(b)
        with pytest.raises(ValueError, match="stream's context"):
            Event().record(Stream(ctx1))


# --- cross-device dependency ---------------------------------------------------------------


def _producer_consumer(ctx0: Any, ctx1: Any, k: Any, wait: bool) -> np.ndarray:
    """Device 0: spin, then b0 = a0. Device 1: (wait for device 0,) copy b0 -> b1, then
    out1 = 2 * b1. Returns out1."""
    n = 1 << 16
    x = np.arange(n, dtype=np.float32) + 1
    s0, s1 = Stream(ctx0), Stream(ctx1)
    a0 = ck.device_array(n, np.float32, ctx0)
    b0 = ck.device_array(n, np.float32, ctx0)
    b1 = ck.device_array(n, np.float32, ctx1)
    out1 = ck.device_array(n, np.float32, ctx1)
    with ctx0:
        a0.copy_from_host(x)
        b0.buffer.memset(0)
        ctx0.synchronize()  # the legacy-stream memset is not ordered with s0/s1
        k.spin_then_copy.launch(64, 256, SPIN, a0, b0, n, stream=s0)
        e0 = s0.record(timing=False)
    with ctx1:
        if wait:
            s1.wait(e0)
        ck.copy_peer(b1, b0, stream=s1)
        k.scale.launch(64, 256, b1, out1, n, np.float32(2.0), stream=s1)
        s1.synchronize()
        result = out1.to_host()
    s0.synchronize()
    return result


@pytest.mark.multigpu
def test_cross_device_wait_orders_the_consumer(ctx0, ctx1, k):
    out = _producer_consumer(ctx0, ctx1, k, wait=True)
    n = out.size
    np.testing.assert_array_equal(out, 2 * (np.arange(n, dtype=np.float32) + 1))


@pytest.mark.multigpu
def test_without_the_wait_the_race_is_real(ctx0, ctx1, k):
    out = _producer_consumer(ctx0, ctx1, k, wait=False)
    assert (out == 0).all()  # device 1 copied b0 before device 0's kernel filled it


def test_wait_on_another_stream_same_device(ctx0, k):
    n = 4096
    x = np.arange(n, dtype=np.float32)
    with ctx0:
        s_a, s_b = Stream(), Stream()
        a = ck.memory.to_device(x)
        b = ck.device_array(n, np.float32)
        out = ck.device_array(n, np.float32)
        b.buffer.memset(0)
        ctx0.synchronize()
        k.spin_then_copy.launch(16, 256, SPIN // 2, a, b, n, stream=s_a)
        s_b.wait(s_a)
        k.scale.launch(16, 256, b, out, n, np.float32(3.0), stream=s_b)
        s_b.synchronize()
        np.testing.assert_array_equal(out.to_host(), 3 * x)


# --- foreign handles, protocol --------------------------------------------------------------


def test_cuda_stream_protocol_and_foreign_handles(ctx0):
    with ctx0:
        s = Stream()
        assert s.__cuda_stream__() == (0, int(s.handle))
        err, raw = drv.cuStreamCreate(1)
        assert not err
        try:
            wrapped = Stream.from_handle(int(raw))
            assert wrapped.context is ctx0 and not wrapped.owned
            assert int(stream_handle(wrapped)) == int(raw)
            wrapped.synchronize()
            wrapped.close()  # borrowed: not destroyed
            assert drv.cuStreamQuery(raw)[0] == 0
            legacy = Stream.from_handle(0)
            legacy.synchronize()
        finally:
            drv.cuStreamDestroy(raw)


def test_stream_and_event_dropped_in_another_thread_are_destroyed_in_their_context(
    ctx0, monkeypatch
):
    seen: list[tuple[str, int, int]] = []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(drv, name)

        def cuStreamDestroy(self, h: Any) -> Any:
            seen.append(("stream", int(drv.cuCtxGetCurrent()[1]), int(drv.cuStreamDestroy(h)[0])))
            return (0,)

        def cuEventDestroy(self, h: Any) -> Any:
            seen.append(("event", int(drv.cuCtxGetCurrent()[1]), int(drv.cuEventDestroy(h)[0])))
            return (0,)

    spy = Spy()
    monkeypatch.setattr(stream_mod, "drv", spy)
    owned = ck.Context.create(0)
    holder: dict[str, Any] = {}
    try:

        def make() -> None:
            with owned:
                holder["s"] = Stream()
                holder["e"] = Event()

        in_thread(make)
        unraisable: list[Any] = []
        old = sys.unraisablehook
        sys.unraisablehook = unraisable.append
        try:
            in_thread(lambda: (holder.clear(), gc.collect()))
        finally:
            sys.unraisablehook = old
        assert not unraisable
        assert sorted(seen) == [("event", owned.handle, 0), ("stream", owned.handle, 0)]
    finally:
        owned.close()
