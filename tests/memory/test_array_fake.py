"""DeviceArray, the CUDA Array Interface and foreign device memory (fake driver)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from cuda.bindings import driver as real

import ctxkit as ck
from ctxkit.memory import (
    DeviceArray,
    DeviceBuffer,
)
from ctxkit.stream import Stream
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
    ctx0,
    ctx1,
    fake,
    in_thread,
    rand_bytes,
)
from tests.support.helpers import OBJECT_DTYPES, object_array, object_dtype_message

# DeviceArray, CUDA Array Interface, DLPack
# ======================================================================================


class ForeignArray:
    """A CuPy-like object: device memory described by __cuda_array_interface__."""

    def __init__(
        self, buf: DeviceBuffer, shape, typestr, strides=None, readonly=False, stream=None
    ):
        self.buf = buf
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (buf.ptr, readonly),
            "version": 3,
            "strides": strides,
            "stream": stream,
        }


def test_device_array_round_trip_and_attributes(fake, ctx0):
    host = np.random.default_rng(2).standard_normal((3, 7)).astype(np.float32)
    with ctx0:
        arr = ck.memory.to_device(host)
        assert isinstance(arr, DeviceArray)
        assert (arr.shape, arr.dtype, arr.size, arr.nbytes, arr.ndim) == (
            (3, 7),
            host.dtype,
            21,
            84,
            2,
        )
        assert arr.strides == host.strides and len(arr) == 3 and arr.itemsize == 4
        assert arr.context is ctx0 and arr.device.ordinal == 0 and arr.ptr == arr.buffer.ptr
        np.testing.assert_array_equal(arr.to_host(), host)
        flat = arr.reshape(-1)
        assert flat.shape == (21,) and arr.reshape(7, 3).shape == (7, 3)
        out = np.empty((3, 7), np.float32)
        assert arr.copy_to_host(out) is out
        np.testing.assert_array_equal(out, host)
        again = ck.device_array((3, 7), np.float32)
        again.copy_from(arr)
        np.testing.assert_array_equal(again.to_host(), host)
        dst = ck.device_array((3, 7), np.float32)
        arr.copy_to(dst)
        np.testing.assert_array_equal(dst.to_host(), host)
    assert "shape=(3, 7)" in repr(arr)


def test_device_array_checks(fake, ctx0):
    with ctx0:
        buf = DeviceBuffer(24)
        with pytest.raises(ValueError, match="needs 16 bytes"):
            buf.view((4,), np.float32)
        with pytest.raises(ValueError, match="not a multiple"):
            DeviceBuffer(20).view(dtype=np.float64)
        with pytest.raises(ValueError, match="not aligned"):
            buf[1:9].view((2,), np.float32)
        with pytest.raises(TypeError, match="Python objects"):
            DeviceArray(buf, (3,), object)
        with pytest.raises(TypeError, match="DeviceBuffer"):
            DeviceArray(np.zeros(3), (3,), np.float64)  # type: ignore[arg-type]
        arr = buf.view((6,), np.float32)
        with pytest.raises(ValueError, match="dtype float64"):
            arr.copy_from_host(np.zeros(6, np.float64))
        with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
            arr.copy_from_host(np.zeros((3, 2), np.float32))
        with pytest.raises(ValueError, match="dtype"):
            arr.copy_to_host(np.zeros(6, np.int32))
        with pytest.raises(ValueError, match="cannot reshape"):
            arr.reshape(4, -1)
        with pytest.raises(ValueError, match="only one"):
            arr.reshape(-1, -1)
        with pytest.raises(ValueError, match="has dtype int32"):
            arr.copy_from(buf.view((6,), np.int32))
        with pytest.raises(TypeError, match="0-d"):
            len(DeviceBuffer(4).view((), np.float32))


def test_cuda_array_interface(fake, ctx0):
    with ctx0:
        s = Stream()
        arr = ck.device_array((2, 3), np.int16)
        cai = arr.__cuda_array_interface__
        assert cai == {
            "shape": (2, 3),
            "typestr": "<i2",
            "data": (arr.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
        arr.copy_from_host(ck.pinned_zeros((2, 3), np.int16), stream=s)
        assert arr.stream is s and arr.__cuda_array_interface__["stream"] == int(s.handle)
        arr.stream = 0  # legacy default stream is exported as 1 (0 is disallowed by v3)
        assert arr.__cuda_array_interface__["stream"] == 1
        buf_cai = arr.buffer.__cuda_array_interface__
        assert buf_cai["shape"] == (12,) and buf_cai["typestr"] == "|u1"
        empty = ck.device_array((0,), np.float32)
        assert empty.__cuda_array_interface__["data"] == (0, False)
        s.close()
        arr.stream = s
        assert arr.__cuda_array_interface__["stream"] is None


def test_foreign_arrays_as_copy_source_and_target(fake, ctx0):
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    with ctx0:
        theirs = ForeignArray(DeviceBuffer(48), (3, 4), "<f4")
        mine = ck.memory.to_device(data)
        mine.copy_to(theirs)
        back = ck.device_array((3, 4), np.float32)
        back.copy_from(theirs)
        np.testing.assert_array_equal(back.to_host(), data)
        raw = DeviceBuffer(48)
        raw.copy_from(theirs)
        np.testing.assert_array_equal(raw.view((3, 4), np.float32).to_host(), data)
        with pytest.raises(ValueError, match="not C-contiguous"):
            back.copy_from(ForeignArray(theirs.buf, (3, 4), "<f4", strides=(4, 12)))
        column = ck.device_array((3, 1), np.float32)
        column.copy_from(ForeignArray(theirs.buf[:12], (3, 1), "<f4", strides=(4, 99)))
        np.testing.assert_array_equal(column.to_host().ravel(), data.ravel()[:3])
        with pytest.raises(ValueError, match="read-only"):
            mine.copy_to(ForeignArray(theirs.buf, (3, 4), "<f4", readonly=True))
        with pytest.raises(ValueError, match="shape"):
            mine.copy_to(ForeignArray(theirs.buf, (4, 3), "<f4"))


def test_foreign_source_stream_is_synchronized_v3(fake, ctx0):
    with ctx0:
        s = Stream()
        theirs = ForeignArray(DeviceBuffer(16), (4,), "<f4", stream=int(s.handle))
        mine = ck.device_array((4,), np.float32)
        mine.copy_from(theirs)
        # the producer's stream first, then the default stream the copy ran on
        assert [c[2] for c in fake.calls("streamsync")][-2:] == [int(s.handle), 0]
        n = len(fake.calls("streamsync"))
        mine.copy_from(theirs, stream=s)  # same stream: stream order suffices
        assert len(fake.calls("streamsync")) == n


def test_foreign_memory_of_another_context_goes_peer(fake, ctx0, ctx1):
    with ctx1:
        theirs = ForeignArray(DeviceBuffer(16), (4,), "<f4")
    with ctx0:
        mine = ck.memory.to_device(np.arange(4, dtype=np.float32))
        mine.copy_to(theirs)
    assert fake.calls("Peer")[-1][2] == (ctx1.handle, ctx0.handle)
    with ctx1:
        np.testing.assert_array_equal(theirs.buf.view((4,), np.float32).to_host(), np.arange(4))


def test_memory_without_a_context_attribute_is_placed_by_device_ordinal(
    fake, ctx0, ctx1, monkeypatch
):
    """Pool/VMM allocations report no context: the device ordinal picks the primary one."""
    with ctx1:
        theirs = DeviceBuffer(16)
    plain = fake.cuPointerGetAttribute

    def no_context(attr: Any, ptr: int) -> tuple[int, Any]:
        if attr == real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT:
            return (OK, FakeHandle(0))
        return plain(attr, ptr)

    monkeypatch.setattr(fake, "cuPointerGetAttribute", no_context)
    from ctxkit.memory import copies as _copies

    with ctx0:
        assert _copies.context_of_pointer(theirs.ptr, "t") is ck.Context.primary(1)
        with pytest.raises(ValueError, match="not device memory known to CUDA"):
            _copies.context_of_pointer(12345, "t")


def test_pointer_device_ordinal_reads_libcuda_directly(monkeypatch):
    from ctxkit import _driver

    seen: list[tuple[int, int]] = []

    def raw(out: Any, attr: int, ptr: int) -> int:
        seen.append((attr, ptr))
        if ptr == 0xBAD:
            return INVALID_VALUE
        out.contents.value = 3
        return OK

    monkeypatch.setattr(_driver, "_raw_pointer_get_attribute", raw)
    assert _driver.pointer_device_ordinal(0x7000) == (OK, 3)
    assert _driver.pointer_device_ordinal(0xBAD)[0] == INVALID_VALUE
    assert seen == [(9, 0x7000), (9, 0xBAD)]
    assert int(real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) == 9


def test_pointer_device_ordinal_loader(monkeypatch):
    from ctxkit import _driver

    class Lib:
        def __init__(self, name: str) -> None:
            if name == "missing":
                raise OSError(name)
            self.cuPointerGetAttribute = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)

    monkeypatch.setattr(_driver.ctypes, "CDLL", lambda name: Lib(name))
    fn = _driver._load_raw_pointer_get_attribute()
    assert fn.restype is ctypes.c_int and fn.argtypes[2] is ctypes.c_uint64
    monkeypatch.setattr(_driver.ctypes, "CDLL", lambda name: Lib("missing"))
    assert _driver._load_raw_pointer_get_attribute() is False
    monkeypatch.setattr(_driver, "_raw_pointer_get_attribute", None)
    monkeypatch.setattr(_driver, "drv", FakeOrdinalBindings())
    assert _driver.pointer_device_ordinal(0x10) == (OK, 1)  # falls back to the bindings
    assert _driver._raw_pointer_get_attribute is False


class FakeOrdinalBindings:
    CUpointer_attribute = real.CUpointer_attribute

    def cuPointerGetAttribute(self, attr: Any, ptr: int) -> tuple[int, int]:
        assert attr == real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        return (OK, 1)


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_device_arrays_and_their_host_copies_refuse_python_objects(fake, ctx0, dtype):
    arr = object_array(dtype, 64)
    with ctx0:
        a = ck.device_array(8, np.float64)
        s = Stream()
    allocs = len(fake.calls("alloc"))
    for call in (
        lambda: a.copy_from_host(arr),
        lambda: a.copy_to_host(arr, stream=s),
        lambda: a.buffer.view((4,), dtype),
        lambda: DeviceArray(a.buffer, (4,), dtype),
        lambda: ck.device_array(4, dtype, context=ctx0),
    ):
        with pytest.raises(TypeError, match=object_dtype_message(dtype)):
            call()
    assert len(fake.calls("alloc")) == allocs
    assert not fake.calls("HtoD") and not fake.calls("DtoHAsync")
