"""Device, pinned, registered and managed memory on a real GPU: every copy direction,
bit-exact against numpy, with odd sizes and offsets; allocation in the right context;
OOM messages; cross-thread frees; honest async; managed memory host/device access."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.memory as memory
from ctxkit import _driver
from ctxkit._driver import drv
from ctxkit.errors import ContextClosedError, NoCurrentContextError, OutOfMemoryError
from ctxkit.memory import DeviceBuffer, ManagedBuffer, PageableCopyError, PageableCopyWarning
from tests.support.helpers import in_thread

SIZES = [0, 1, 3, 5, 1023, 4097, (1 << 20) + 3]
MiB = 1 << 20
ATTR = drv.CUpointer_attribute


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def pointer_attr(name: str, ptr: int) -> tuple[int, Any]:
    err, value = drv.cuPointerGetAttribute(getattr(ATTR, "CU_POINTER_ATTRIBUTE_" + name), ptr)
    return int(err), value


@contextmanager
def host_memory(kind: str, n: int) -> Iterator[np.ndarray]:
    """A uint8 host array of *n* bytes of the given kind."""
    if kind == "pageable":
        yield np.empty(n, np.uint8)
    elif kind == "pinned":
        yield ck.pinned_empty(n, np.uint8)
    elif kind == "registered":
        arr = np.empty(n, np.uint8)
        with ck.register_host(arr):
            yield arr
    elif kind == "managed":
        m = ManagedBuffer(max(n, 1))
        yield m[:n].as_numpy() if n else np.empty(0, np.uint8)
    else:
        raise AssertionError(kind)


def device_memory(kind: str, n: int) -> DeviceBuffer:
    return ManagedBuffer(n) if kind == "managed" else DeviceBuffer(n)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("host_kind", ["pageable", "pinned", "registered", "managed"])
@pytest.mark.parametrize("dev_kind", ["device", "managed"])
@pytest.mark.parametrize("use_stream", [False, True])
def test_every_direction_is_bit_exact(ctx0, n, host_kind, dev_kind, use_stream):
    data = rand(n, seed=n)
    with ctx0, warnings.catch_warnings():
        warnings.simplefilter("ignore", PageableCopyWarning)
        s = ck.Stream() if use_stream else None
        src_dev = device_memory(dev_kind, n)
        dst_dev = device_memory("managed" if dev_kind == "device" else "device", n)
        with host_memory(host_kind, n) as h_in, host_memory(host_kind, n) as h_out:
            h_in[...] = data
            src_dev.copy_from_host(h_in, stream=s)  # H2D
            dst_dev.copy_from(src_dev, stream=s)  # D2D, across memory kinds
            h_out[...] = 0
            dst_dev.copy_to_host(h_out, stream=s)  # D2H
            if s is not None:
                s.synchronize()
            np.testing.assert_array_equal(h_out, data)
            np.testing.assert_array_equal(src_dev.copy_to_host(), data)


@pytest.mark.parametrize("offset", [0, 1, 3, 5, 4093])
def test_offsets_through_slices(ctx0, offset):
    n = 1001
    data = rand(n, seed=offset)
    with ctx0:
        buf = DeviceBuffer(offset + n + 7)
        buf.memset(0x5A)
        buf[offset : offset + n].copy_from_host(data)
        whole = buf.copy_to_host()
        part = buf[offset : offset + n].copy_to_host()
        other = DeviceBuffer(n)
        other.copy_from(buf[offset : offset + n])
        via = other.copy_to_host()
    assert (whole[:offset] == 0x5A).all() and (whole[offset + n :] == 0x5A).all()
    np.testing.assert_array_equal(whole[offset : offset + n], data)
    np.testing.assert_array_equal(part, data)
    np.testing.assert_array_equal(via, data)


def test_typed_arrays_round_trip(ctx0):
    rng = np.random.default_rng(5)
    with ctx0:
        for dtype in (np.float32, np.float64, np.int32, np.int8, np.complex64, np.uint16):
            host = rng.standard_normal((7, 13)).astype(dtype)
            arr = ck.memory.to_device(host)
            np.testing.assert_array_equal(arr.to_host(), host)
            same = ck.device_array((7, 13), dtype)
            same.copy_from(arr)
            np.testing.assert_array_equal(same.to_host(), host)
            assert arr.__cuda_array_interface__["data"][0] == arr.ptr


def test_zero_size_everything(ctx0):
    with ctx0:
        s = ck.Stream()
        b = DeviceBuffer(0)
        b.copy_from_host(np.empty(0, np.uint8), stream=s)
        assert b.copy_to_host(stream=s).size == 0
        b.copy_from(DeviceBuffer(0))
        b.memset(1)
        a = ck.device_array((0, 3), np.float32)
        assert a.to_host().shape == (0, 3)
        assert ManagedBuffer(0).as_numpy().size == 0
        s.synchronize()


def test_mismatches_raise_value_error(ctx0):
    with ctx0:
        buf = DeviceBuffer(16)
        arr = buf.view((4,), np.float32)
        with pytest.raises(ValueError, match="sizes must match"):
            buf.copy_from_host(np.zeros(15, np.uint8))
        with pytest.raises(ValueError, match="dtype"):
            arr.copy_from_host(np.zeros(4, np.int32))
        with pytest.raises(ValueError, match="shape"):
            arr.copy_from_host(np.zeros((2, 2), np.float32))
        with pytest.raises(ValueError, match="C-contiguous"):
            buf.copy_from_host(np.zeros((4, 8), np.uint8)[:, ::2])
        with pytest.raises(ValueError, match="sizes must match"):
            buf.copy_from(DeviceBuffer(8))


def test_allocation_in_the_given_context(ctx0):
    owned = ck.Context.create(0)
    try:
        with ctx0:
            b = DeviceBuffer(256, context=owned)
            assert ck.current_context() is ctx0
        err, cu = pointer_attr("CONTEXT", b.ptr)
        assert not err and int(cu) == owned.handle
        b.close()
    finally:
        owned.close()


@pytest.mark.multigpu
def test_allocation_on_the_other_device(ctx0, ctx1):
    """Every constructor given another device's context creates the resource there,
    whatever is current. (The first GPU run read CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    through cuda-bindings 13.3, which reports 0 for every pointer, NVIDIA/cuda-python#2928:
    the allocation was right, the probe was wrong. The CONTEXT attribute is exact, and
    ctxkit's pointer_device_ordinal reads the ordinal from libcuda directly.)"""
    with ctx0:
        b = DeviceBuffer(256, context=ctx1)
        m = ManagedBuffer(256, context=1)
        a = ck.device_array((8, 8), np.float32, context=ctx1)
        h = ck.pinned_empty(64, np.uint8, context=ctx1)
        s = ck.Stream(context=ctx1)
        e = ck.Event(context=ctx1)
        assert ck.current_context() is ctx0
        for ptr in (b.ptr, m.ptr, a.ptr, h.ctypes.data):
            err, cu = pointer_attr("CONTEXT", ptr)
            assert not err and int(cu) == ctx1.handle, hex(ptr)
        for ptr in (b.ptr, a.ptr):
            assert _driver.pointer_device_ordinal(ptr) == (0, 1), hex(ptr)
        assert _driver.pointer_device_ordinal(DeviceBuffer(64).ptr) == (0, 0)
        err, cu = drv.cuStreamGetCtx(s.handle)
        assert not err and int(cu) == ctx1.handle
        e.record(s)  # the driver refuses an event of another device's context here
        e.synchronize()
    assert b.device.ordinal == 1 and m.context is ctx1 and a.context is ctx1


def test_out_of_memory_names_requested_and_free(ctx0):
    too_much = ck.Device(0).total_memory * 2
    with ctx0, pytest.raises(OutOfMemoryError) as info:
        DeviceBuffer(too_much)
    exc = info.value
    free, _total = ctx0.memory_info()
    assert exc.requested == too_much  # type: ignore[attr-defined]
    assert 0 < exc.free <= ck.Device(0).total_memory  # type: ignore[attr-defined]
    assert f"{too_much} bytes" in str(exc) and "are free (cuMemGetInfo)" in str(exc)
    assert free > 0 and exc.name == "CUDA_ERROR_OUT_OF_MEMORY"


def test_close_idempotent_and_use_after_close(ctx0):
    with ctx0:
        b = DeviceBuffer(64 * MiB)
        ptr = b.ptr
        view = b[:16]
        b.close()
        b.close()
        err, _ = pointer_attr("RANGE_SIZE", ptr)
        assert err == 1  # CUDA_ERROR_INVALID_VALUE: freed at the first close
        with pytest.raises(ContextClosedError):
            b.copy_to_host()
        with pytest.raises(ContextClosedError):
            view.copy_to_host()


def test_no_current_context_is_a_clear_error(ctx0, monkeypatch):
    with ctx0:
        b = DeviceBuffer(16)
    with pytest.raises(NoCurrentContextError, match=r"ctxkit\.bind"):
        in_thread(lambda: DeviceBuffer(16))  # nothing to infer the context from
    assert in_thread(b.copy_to_host).size == 16  # the buffer binds its own context
    monkeypatch.setattr(ck.registry, "strict", True)
    with pytest.raises(NoCurrentContextError):
        in_thread(b.copy_to_host)

    def bound() -> np.ndarray:
        with ck.bind(0):
            return b.copy_to_host()

    assert in_thread(bound).size == 16


def test_buffer_dropped_in_another_thread_is_freed_in_its_context(ctx0):
    """Created in thread A, last reference dropped in thread B with no context.

    The driver is asked about the allocation itself, not the device's free memory: other
    processes (the test run's other workers) use the same GPU meanwhile."""
    holder: dict[str, Any] = {}
    size = 256 * MiB

    def make() -> None:
        with ctx0:
            holder["buf"] = DeviceBuffer(size)

    in_thread(make)
    ptr = holder["buf"].ptr
    with ctx0:
        err, nbytes = pointer_attr("RANGE_SIZE", ptr)
        assert err == 0 and int(nbytes) >= size
    failed = len(ck.lifetime.failed_frees())
    unraisable: list[Any] = []
    old = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:

        def drop() -> None:
            err, cu = drv.cuCtxGetCurrent()
            assert not err and int(cu) == 0
            holder.clear()
            gc.collect()

        in_thread(drop)
    finally:
        sys.unraisablehook = old
    assert not unraisable
    assert len(ck.lifetime.failed_frees()) == failed
    with ctx0:
        err, _ = pointer_attr("RANGE_SIZE", ptr)
    assert err == 1  # CUDA_ERROR_INVALID_VALUE: no allocation there any more


def test_memset_sync_and_async(ctx0):
    with ctx0:
        s = ck.Stream()
        b = DeviceBuffer(4099)
        b.memset(0x11)
        b[7:4000].memset(0xEE, stream=s)
        s.synchronize()
        out = b.copy_to_host()
    assert (out[:7] == 0x11).all() and (out[7:4000] == 0xEE).all() and (out[4000:] == 0x11).all()


SPIN = 100_000_000  # clock64 ticks: ~50 ms at H200 clocks


@pytest.fixture(scope="module")
def spin_kernel() -> Any:
    from ctxkit.compiler import kernel_source

    with ck.registry.context(0):
        return ck.Module.load(ck.compile(kernel_source("spin.cu"))).function("spin")


@pytest.mark.parametrize(
    "op", ["memset", "htod_pageable", "htod_pinned", "dtod", "dtod_array", "peer"]
)
def test_default_stream_work_is_done_when_the_call_returns(ctx0, spin_kernel, op):
    """stream=None work queued behind a long kernel on the legacy default stream has
    completed when the call returns, so a memset on a non-blocking stream issued right
    after it lands last. Without ctxkit's wait the non-blocking memset runs during the
    kernel and the default-stream work overwrites it afterwards (the first GPU run's
    memset failure)."""
    n = 1 << 20
    if op == "peer":
        if ck.device_count() < 2:
            pytest.skip("needs at least two CUDA devices")
        src = DeviceBuffer(n, context=ck.registry.context(1))
        with ck.registry.context(1):
            src.memset(0x22)
    with ctx0:
        s = ck.Stream()
        dst = DeviceBuffer(n)
        if op in ("dtod", "dtod_array"):
            src = DeviceBuffer(n)
            src.memset(0x22)
        host = ck.pinned_empty(n, np.uint8) if op == "htod_pinned" else np.empty(n, np.uint8)
        host[:] = 0x22
        ops = {
            "memset": lambda: dst.memset(0x22),
            "htod_pageable": lambda: dst.copy_from_host(host),
            "htod_pinned": lambda: dst.copy_from_host(host),
            "dtod": lambda: dst.copy_from(src),
            "dtod_array": lambda: dst.view().copy_from(src.view()),
            "peer": lambda: dst.copy_from(src),
        }
        spin_kernel.launch(1, 1, SPIN, 0)  # the legacy default stream of ctx0
        ops[op]()
        dst.memset(0x33, stream=s)
        s.synchronize()
        ctx0.synchronize()
        out = dst.copy_to_host()
    assert (out == 0x33).all(), np.unique(out)


# --- pinned / registered / honest async ------------------------------------------------


def test_pinned_memory_is_pinned_and_freed_without_a_context(ctx0):
    with ctx0:
        a = ck.pinned_empty((5, 7), np.float32)
        z = ck.pinned_zeros(100, np.int64)
    assert ck.is_pinned(a) and ck.is_pinned(a[2:]) and ck.is_pinned(z) and (z == 0).all()
    assert not ck.is_pinned(np.empty(1000))
    assert not ck.is_pinned(np.empty(0))
    ptr = a.ctypes.data
    with ctx0:
        err, kind = pointer_attr("MEMORY_TYPE", ptr)
    assert not err and int(kind) == int(drv.CUmemorytype.CU_MEMORYTYPE_HOST)

    def drop() -> None:
        nonlocal a
        a = None  # type: ignore[assignment]
        gc.collect()

    in_thread(drop)
    with ctx0:
        assert pointer_attr("MEMORY_TYPE", ptr)[0]  # freed: unknown to CUDA again


def test_pinned_without_a_current_context_uses_device_0():
    arr = in_thread(lambda: ck.pinned_empty(1024, np.uint8))
    assert ck.is_pinned(arr)


def test_register_host_in_place(ctx0):
    arr = np.zeros(3 * MiB + 5, np.uint8)
    with ctx0:
        assert not ck.is_pinned(arr)
        with ck.register_host(arr) as same:
            assert same is arr and ck.is_pinned(arr)
            with ck.register_host(arr[100:]):  # already pinned: no-op
                assert ck.is_pinned(arr)
            assert ck.is_pinned(arr)
        assert not ck.is_pinned(arr)


def test_register_host_neighbours_in_one_page(ctx0):
    """Two arrays in one page: the driver keeps exact byte ranges, so both registrations
    work; an array with bytes of a registered one is refused with ctxkit's message."""
    block = np.zeros(8192, np.uint8)
    first, second = block[64:128], block[128:512]
    with ctx0, ck.register_host(first):
        assert ck.is_pinned(first) and not ck.is_pinned(block[:64])
        with ck.register_host(second):
            assert ck.is_pinned(second)
        with pytest.raises(ValueError, match="partly registered already"):
            with ck.register_host(block[100:200]):  # starts inside first
                pass
        assert ck.is_pinned(first)


def test_register_host_refuses_only_copies_running_out_of_the_array(ctx0):
    """The rule the simulated drivers model (tests/support/fakedriver.py): a pageable
    copy may not start inside a registration and end beyond it; copies of neighbours on
    its pages and copies from before it go through, with correct bytes."""
    raw = np.zeros(8 * 4096, np.uint8)
    s = -int(raw.ctypes.data) % 4096 + 4096 + 100
    arr = raw[s : s + 2 * 4096 + 50]
    e = s + arr.nbytes
    with ctx0:
        buf = DeviceBuffer(4 * 4096)
        with ck.register_host(arr):
            for lo, hi in ((s - 4096, s), (e, e + 4096), (s - 10, s + 10), (s - 10, e + 10)):
                want = np.random.default_rng(lo).integers(0, 255, hi - lo, np.uint8)
                raw[lo:hi] = want
                buf[: hi - lo].copy_from_host(raw[lo:hi])
                raw[lo:hi] = 0
                buf[: hi - lo].copy_to_host(raw[lo:hi])
                np.testing.assert_array_equal(raw[lo:hi], want)
            for lo, hi in ((s + 10, e + 10), (s, e + 1)):
                with pytest.raises(ck.CudaError, match="INVALID_VALUE"):
                    buf[: hi - lo].copy_from_host(raw[lo:hi])
        buf[:4096].copy_from_host(raw[s + 10 : s + 4106])  # unregistered: pageable again
        buf.close()


def test_pageable_async_copy_warns_pinned_does_not(ctx0):
    with ctx0:
        s = ck.Stream()
        b = DeviceBuffer(1024)
        pinned = ck.pinned_empty(1024, np.uint8)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            b.copy_from_host(np.zeros(1024, np.uint8), stream=s)
            b.copy_from_host(pinned, stream=s)
            b.copy_to_host(pinned, stream=s)
            b.copy_from_host(np.zeros(1024, np.uint8))
        s.synchronize()
    assert [w.category for w in got] == [PageableCopyWarning]
    assert got[0].filename == __file__


def test_strict_async_mode_raises(ctx0):
    memory.set_strict_async(True)
    try:
        with ctx0:
            s = ck.Stream()
            b = DeviceBuffer(64)
            with pytest.raises(PageableCopyError, match=r"7\.8 GB/s"):
                b.copy_from_host(np.ones(64, np.uint8), stream=s)
            arr = np.ones(64, np.uint8)
            with ck.register_host(arr):
                b.copy_from_host(arr, stream=s)
                s.synchronize()
    finally:
        memory.set_strict_async(False)


# --- managed memory ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fill_kernel() -> Any:
    from ctxkit.compiler import kernel_source

    with ck.registry.context(0):
        return ck.Module.load(ck.compile(kernel_source("fill.cu"))).function("fill_f32")


def test_managed_host_and_kernel_access(ctx0, fill_kernel):
    n = 4 * MiB // 4  # 4 MiB: managed tests stay small
    with ctx0:
        m = ManagedBuffer(n * 4)
        host = m.as_numpy(np.float32)
        host[:] = np.arange(n, dtype=np.float32)
        np.testing.assert_array_equal(m.view(dtype=np.float32).to_host(), host)
        s = ck.Stream()
        m.prefetch(0, stream=s)
        fill_kernel.launch(256, 256, m, np.float32(2.5), n, stream=s)
        m.prefetch("cpu", stream=s)
        s.synchronize()
        assert (m.as_numpy(np.float32) == 2.5).all()
        m.advise("read_mostly")
        m.advise("preferred_location", "cpu")
        m.advise("accessed_by", 0)
        m.advise("unset_read_mostly")
        del host
        gc.collect()
        m.close()
        assert m.closed


def test_managed_close_refused_while_numpy_views_live(ctx0):
    with ctx0:
        m = ManagedBuffer(4096)
        v = m.as_numpy()
        with pytest.raises(ValueError, match="still alive"):
            m.close()
        del v
        gc.collect()
        m.close()


def test_concurrent_managed_access_reported(ctx0):
    dev = ck.Device(0)
    expect = bool(dev.attribute("concurrent_managed_access"))
    assert memory.managed.concurrent_managed_access(dev) is expect
