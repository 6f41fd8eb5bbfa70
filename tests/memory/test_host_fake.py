"""Host memory: the pageable-copy warning, strict mode, host-array validation, errors
without a driver, pinned and registered memory (fake driver)."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.memory as memory
from ctxkit.errors import (
    DriverNotFoundError,
    OutOfMemoryError,
)
from ctxkit.memory import (
    DeviceBuffer,
    ManagedBuffer,
    PageableCopyError,
    PageableCopyWarning,
)
from ctxkit.memory import host as _hostmem
from ctxkit.stream import Stream
from tests.conftest import GPU_COUNT
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


def test_pageable_warning_points_at_the_caller_once_per_call_site():
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        for _ in range(3):
            _hostmem.pageable_async("DeviceBuffer.copy_from_host")  # one call site
        _hostmem.pageable_async("DeviceBuffer.copy_to_host")  # another one
    assert [w.category for w in got] == [PageableCopyWarning, PageableCopyWarning]
    assert all(w.filename == __file__ for w in got)
    msg = str(got[0].message)
    assert "7.8 GB/s" in msg and "pinned_empty" in msg and "register_host" in msg
    assert issubclass(PageableCopyWarning, UserWarning)


def test_strict_async_raises(monkeypatch):
    monkeypatch.setattr(_hostmem, "_strict", False)
    memory.set_strict_async(True)
    assert memory.strict_async()
    with pytest.raises(PageableCopyError, match="strict async mode"):
        _hostmem.pageable_async("copy")
    memory.set_strict_async(False)
    assert not memory.strict_async()
    assert issubclass(PageableCopyError, ValueError)


@pytest.mark.parametrize(("value", "expected"), [("1", "True"), ("0", "False"), ("", "False")])
def test_strict_async_from_environment(value, expected):
    code = "import ctxkit.memory as m; print(m.strict_async())"
    env = {"CTXKIT_STRICT_ASYNC": value, "PATH": "", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == expected, out.stderr


def test_host_array_validation():
    assert _hostmem.host_array(b"abc", "w").tolist() == [97, 98, 99]
    with pytest.raises(TypeError, match="numpy array or a buffer"):
        _hostmem.host_array([1, 2, 3], "w")
    with pytest.raises(ValueError, match="C-contiguous"):
        _hostmem.host_array(np.zeros((4, 4))[:, 1], "w")
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _hostmem.host_array(ro, "w", writable=True)


@pytest.mark.skipif(GPU_COUNT > 0, reason="checks the behaviour without a driver")
def test_without_a_driver_the_errors_say_so():
    with pytest.raises(DriverNotFoundError):
        DeviceBuffer(16)
    with pytest.raises(DriverNotFoundError):
        ck.pinned_empty(4, np.float32)
    with pytest.raises(DriverNotFoundError):
        Stream()


def test_validation_happens_before_the_driver_is_needed():
    with pytest.raises(ValueError, match="negative"):
        ck.pinned_empty((2, -1))
    with pytest.raises(TypeError, match="ints"):
        ck.pinned_empty((2.5,))
    with pytest.raises(TypeError, match="nbytes must be an int"):
        DeviceBuffer(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        DeviceBuffer(-1)
    with pytest.raises(ValueError, match="C-contiguous"), ck.register_host(np.zeros((4, 4)).T):
        pass


# ======================================================================================
# pinned and registered host memory
# ======================================================================================


def test_pinned_empty_and_is_pinned(fake, ctx0):
    with ctx0:
        a = ck.pinned_empty((3, 5), np.float32)
        z = ck.pinned_zeros(7, np.int64)
    assert a.shape == (3, 5) and a.dtype == np.float32 and a.flags.c_contiguous
    assert (z == 0).all() and z.dtype == np.int64
    assert ck.is_pinned(a) and ck.is_pinned(a[1:]) and ck.is_pinned(z)
    with ctx0:
        assert not ck.is_pinned(np.zeros(10))
        assert not ck.is_pinned(np.zeros(0))
        assert not ck.is_pinned(bytearray(8))
    assert fake.calls("hostalloc")[0][2] == (60, 1)  # PORTABLE
    assert ck.pinned_empty(0, np.float32).size == 0


def test_pinned_memory_freed_with_the_last_view_without_a_context(fake, ctx0, ctx1):
    with ctx1:
        a = ck.pinned_empty(1000, np.uint8)
    view = a[10:20].reshape(2, 5)
    del a
    gc.collect()
    assert len(fake.host_allocs) == 1  # the view keeps it alive

    def drop() -> None:
        nonlocal view
        assert fake.cur() == 0
        view = None
        gc.collect()

    in_thread(drop)
    assert not fake.host_allocs
    assert fake.calls("freehost")[0][1] == ctx1.handle


def test_pinned_without_current_context_uses_device_0(fake):
    arr = in_thread(lambda: ck.pinned_empty(4, np.float32))
    assert fake.calls("hostalloc")[0][1] == ck.registry.context(0).handle
    assert ck.is_pinned(arr)
    arr2 = ck.pinned_empty(4, np.float32, context=1)
    assert fake.calls("hostalloc")[1][1] == ck.registry.context(1).handle and arr2.size == 4


def test_pinned_out_of_memory(fake, ctx0):
    fake.host_oom = True
    with ctx0, pytest.raises(OutOfMemoryError, match="page-lock"):
        ck.pinned_empty(1 << 20, np.uint8)


def test_register_host_pins_in_place_and_unregisters(fake, ctx0):
    arr = np.zeros(3 * PAGE, np.uint8)
    with ctx0:
        assert not ck.is_pinned(arr)
        with ck.register_host(arr) as same:
            assert same is arr and ck.is_pinned(arr)
            with ck.register_host(arr[10:]):  # already pinned: left alone
                pass
            assert ck.is_pinned(arr)
            across = np.frombuffer(
                (ctypes.c_uint8 * 16).from_address(arr.ctypes.data + arr.nbytes - 8), np.uint8
            )
            with pytest.raises(ValueError, match="partly registered already"):
                with ck.register_host(across):  # its first 8 bytes are arr's
                    pass
        assert not ck.is_pinned(arr)
    assert len(fake.calls("register")) == 1 and len(fake.calls("unregister")) == 1
    assert fake.calls("register")[0][2][2] == 1  # PORTABLE


def test_register_host_refuses_only_copies_running_out_of_the_array(fake, ctx0):
    """The driver's rule: a copy may not start inside a registration and end beyond it;
    neighbours that share the array's pages, and copies ending inside it, go through."""
    raw = np.zeros(8 * PAGE, np.uint8)
    s = -raw.ctypes.data % PAGE + PAGE + 100  # not on a page boundary
    before, arr = raw[s - PAGE : s], raw[s : s + 2 * PAGE]
    after = raw[s + 2 * PAGE :][:PAGE]
    with ctx0:
        buf = DeviceBuffer(4 * PAGE)
        with ck.register_host(arr):
            DeviceBuffer(arr.nbytes).copy_from_host(arr)
            for fine in (before, after, raw[s - 10 : s + 10], raw[s - 10 : s + 2 * PAGE + 10]):
                buf[: fine.nbytes].copy_from_host(fine)
                buf[: fine.nbytes].copy_to_host(fine)
            across = raw[s + PAGE : s + 3 * PAGE]  # from inside arr past its end
            with pytest.raises(ck.CudaError, match="INVALID_VALUE"):
                buf[: across.nbytes].copy_from_host(across)
            with pytest.raises(ck.CudaError, match="INVALID_VALUE"):
                buf[: across.nbytes].copy_to_host(across)
        buf[: across.nbytes].copy_from_host(across)  # unregistered: pageable again
        assert not fake.registered


def test_register_host_unregisters_on_error_and_accepts_pinned(fake, ctx0):
    arr = np.zeros(100, np.float64)
    with ctx0:
        with pytest.raises(KeyError), ck.register_host(arr):
            raise KeyError("x")
        assert not fake.registered
        pinned = ck.pinned_empty(8, np.float64)
        with ck.register_host(pinned):
            pass
        with ck.register_host(np.zeros(0)):
            pass
        managed_view = ManagedBuffer(64).as_numpy()
        with ck.register_host(managed_view) as same:
            assert same is managed_view
    assert len(fake.calls("register")) == 1


def test_async_copy_inside_register_host_does_not_warn(fake, ctx0):
    arr = np.ones(256, np.uint8)
    with ctx0:
        s = Stream()
        buf = DeviceBuffer(256)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with ck.register_host(arr):
                buf.copy_from_host(arr, stream=s)


def test_async_copies_of_ctxkit_pinned_arrays_ask_the_driver_nothing(fake, ctx0, monkeypatch):
    """ctxkit's own pinned arrays and their views are known page-locked: an async copy
    asks no cuPointerGetAttribute; another library's array is still asked about."""
    with ctx0:
        s = Stream()
        a = ck.pinned_empty((4, 64), np.float32)
        buf = DeviceBuffer(a[1].nbytes)
        asked: list[int] = []
        real = fake.cuPointerGetAttribute

        def counting(attr: Any, ptr: int) -> Any:
            asked.append(int(ptr))
            return real(attr, ptr)

        monkeypatch.setattr(fake, "cuPointerGetAttribute", counting)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            buf.copy_from_host(a[1], stream=s)  # a view of a view of the pinned block
            buf.copy_to_host(a[2], stream=s)
            assert asked == [] and _hostmem.on_ctxkit_host_memory(a[1:].reshape(-1))
            with pytest.warns(PageableCopyWarning):
                buf.copy_from_host(np.ones(64, np.float32), stream=s)
        assert len(asked) == 1
        s.synchronize()
    assert not _hostmem.on_ctxkit_host_memory(np.ones(4))


def test_host_address_of_every_kind_of_array():
    """The buffer-protocol fast path and the interface agree; read-only, empty and
    non-contiguous arrays take the interface."""
    a = np.arange(64, dtype=np.float64)
    ro = np.frombuffer(bytes(64), np.uint8)
    for arr in (a, a[3:], ro, a[::2], a.reshape(8, 8).T, np.zeros(0), a[5:5]):
        assert _hostmem.host_address(arr) == (arr.__array_interface__["data"][0] or 0)


# ======================================================================================


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_pinning_and_pinned_allocation_refuse_python_objects(fake, ctx0, dtype):
    arr = object_array(dtype, 2 * PAGE)
    with pytest.raises(TypeError, match=object_dtype_message(dtype)), ck.register_host(arr):
        pass
    for call in (
        lambda: ck.pinned_empty(8, dtype, context=ctx0),
        lambda: ck.pinned_zeros((2, 4), dtype, context=ctx0),
        lambda: memory.pageable_arg(arr),
    ):
        with pytest.raises(TypeError, match=object_dtype_message(dtype)):
            call()
    assert not fake.calls("register") and not fake.calls("hostalloc")
