"""DLPack capsules consumed by numpy and DLPack export of ctxkit memory (fake driver)."""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.memory import interop as _dlpack
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

# ======================================================================================
# DLPack capsules (no driver needed: numpy consumes host-memory capsules)
# ======================================================================================


class HostProducer:
    """Exports a numpy array through ctxkit's capsule builder (as kDLCPU)."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_dlpack.KDL_CPU, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        versioned = max_version is not None and max_version[0] >= 1
        return _dlpack.to_capsule(
            self.arr.ctypes.data,
            self.arr.shape,
            self.arr.dtype,
            (_dlpack.KDL_CPU, 0),
            self.arr,
            versioned=versioned,
        )


class LegacyConsumerView(HostProducer):
    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return super().__dlpack__(stream)


@pytest.mark.parametrize("producer", [HostProducer, LegacyConsumerView])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.complex64, np.bool_])
def test_dlpack_capsule_is_consumed_without_copy(producer, dtype):
    src = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
    before = _dlpack.live_count()
    out = np.from_dlpack(producer(src))
    assert out.ctypes.data == src.ctypes.data and out.dtype == src.dtype
    np.testing.assert_array_equal(out, src)
    assert _dlpack.live_count() == before + 1
    del out
    gc.collect()
    assert _dlpack.live_count() == before


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_unconsumed_capsule_releases_its_tensor(versioned):
    arr = np.zeros(5, np.float64)
    before = _dlpack.live_count()
    cap = _dlpack.to_capsule(
        arr.ctypes.data, arr.shape, arr.dtype, (2, 1), arr, versioned=versioned
    )
    assert _dlpack.live_count() == before + 1
    del cap
    gc.collect()
    assert _dlpack.live_count() == before


def read_capsule(cap: Any) -> tuple[Any, str]:
    """The DLTensor of a capsule (either kind) and the capsule name."""
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    name = get_name(cap).decode()
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    addr = get_ptr(cap, name.encode())
    cls = _dlpack.DLManagedTensorVersioned if "versioned" in name else _dlpack.DLManagedTensor
    return cls.from_address(addr), name


def test_dlpack_capsule_fields():
    arr = np.zeros((3, 5), np.float32)
    cap = _dlpack.to_capsule(0x7000, (3, 5), arr.dtype, (2, 1), arr, versioned=True, read_only=True)
    m, name = read_capsule(cap)
    assert name == "dltensor_versioned"
    assert (m.version.major, m.version.minor) == _dlpack.DLPACK_VERSION
    assert m.flags == _dlpack.FLAG_READ_ONLY
    t = m.dl_tensor
    assert t.data == 0x7000 and (t.device.device_type, t.device.device_id) == (2, 1)
    assert t.ndim == 2 and [t.shape[0], t.shape[1]] == [3, 5] and not t.strides
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)


def test_dlpack_strides_are_in_elements():
    arr = np.zeros((4, 4), np.int16)[:, ::2]
    strides = tuple(s // arr.itemsize for s in arr.strides)
    cap = _dlpack.to_capsule(arr.ctypes.data, arr.shape, arr.dtype, (1, 0), arr, strides=strides)
    m, name = read_capsule(cap)
    assert name == "dltensor"
    assert [m.dl_tensor.strides[0], m.dl_tensor.strides[1]] == [4, 2]


@pytest.mark.parametrize("dtype", [object, np.dtype([("a", "i4"), ("b", "f4")]), "U3"])
def test_dlpack_rejects_non_numeric_dtypes(dtype):
    with pytest.raises(BufferError, match="no DLPack equivalent"):
        _dlpack.dlpack_dtype(np.dtype(dtype))


# ======================================================================================


def test_dlpack_export(fake, ctx0, ctx1):
    with ctx1:
        arr = ck.device_array((2, 5), np.float64)
    assert arr.__dlpack_device__() == (2, 1)
    cap = arr.__dlpack__()
    m, name = read_capsule(cap)
    assert name == "dltensor"
    t = m.dl_tensor
    assert t.data == arr.ptr and (t.device.device_type, t.device.device_id) == (2, 1)
    assert [t.shape[i] for i in range(t.ndim)] == [2, 5] and (t.dtype.code, t.dtype.bits) == (2, 64)
    _, vname = read_capsule(arr.__dlpack__(max_version=(1, 2)))
    assert vname == "dltensor_versioned"
    with pytest.raises(BufferError, match="copy=True"):
        arr.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="not on the requested"):
        arr.__dlpack__(dl_device=(2, 0))
    assert arr.buffer.__dlpack_device__() == (2, 1)
    _, bname = read_capsule(arr.buffer.__dlpack__())
    assert bname == "dltensor"


def test_dlpack_keeps_the_memory_alive(fake, ctx0):
    with ctx0:
        arr = ck.device_array(4, np.float32)
    cap = arr.__dlpack__()
    del arr
    gc.collect()
    assert fake.used == 16
    del cap
    gc.collect()
    assert fake.used == 0


def test_dlpack_orders_the_consumer_stream_after_pending_writes(fake, ctx0):
    with ctx0:
        s = Stream()
        arr = ck.device_array(4, np.float32)
        arr.__dlpack__(stream=5)
        assert not fake.waits  # nothing pending
        arr.copy_from_host(ck.pinned_zeros(4, np.float32), stream=s)
        arr.__dlpack__(stream=-1)
        arr.__dlpack__(stream=int(s.handle))
        assert not fake.waits  # no sync asked / same stream
        arr.__dlpack__(stream=0x77)
        arr.__dlpack__()  # None: the legacy default stream (1)
        with pytest.raises(BufferError, match="ambiguous"):
            arr.__dlpack__(stream=0)
    assert [w[0] for w in fake.waits] == [0x77, 0]  # DLPack's 1: the legacy stream, handle 0
    recorded = [c[2] for c in fake.calls("record")]
    assert all(r[1] == int(s.handle) for r in recorded) and len(recorded) == 2


# ======================================================================================
