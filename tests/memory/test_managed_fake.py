"""Managed memory (ManagedBuffer) on the fake driver."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from cuda.bindings import driver as real

import ctxkit as ck
from ctxkit.memory import (
    ManagedBuffer,
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
from tests.support.helpers import OBJECT_DTYPES, object_dtype_message

# managed memory
# ======================================================================================


def test_managed_buffer_host_and_device_views(fake, ctx0):
    with ctx0:
        m = ManagedBuffer(64)
        host = m.as_numpy(np.float32, (4, 4))
        host[...] = np.arange(16).reshape(4, 4)
        out = m.view((4, 4), np.float32).to_host()
        np.testing.assert_array_equal(out, host)
        m.copy_from_host(np.full(64, 1, np.uint8))
        assert (m.as_numpy() == 1).all()
        assert fake.calls("alloc")[0][2][2] == "managed"
        with pytest.raises(ValueError, match="not a multiple"):
            ManagedBuffer(6).as_numpy(np.float32)
        with pytest.raises(ValueError, match="does not cover"):
            m.as_numpy(np.float32, (3,))
        assert ManagedBuffer(0).as_numpy(np.float32).size == 0
    assert not fake.calls("ctxsync")  # concurrent managed access: no sync


def test_managed_close_refused_while_host_views_live(fake, ctx0):
    with ctx0:
        m = ManagedBuffer(32)
        v = m[8:16].as_numpy()
        with pytest.raises(ValueError, match="still alive"):
            m.close()
        del v
        gc.collect()
        m.close()
    assert m.closed and fake.used == 0


def test_managed_view_keeps_buffer_alive(fake, ctx0):
    with ctx0:
        v = ManagedBuffer(16).as_numpy(np.int32)
    gc.collect()
    assert fake.used == 16
    v[:] = 3
    del v
    gc.collect()
    assert fake.used == 0


def test_managed_synchronizes_without_concurrent_access(fake, ctx0):
    fake.concurrent_managed = 0
    with ctx0:
        ManagedBuffer(8).as_numpy()
    assert len(fake.calls("ctxsync")) == 1


def test_managed_prefetch_on_a_stream_of_another_context(fake, ctx0, ctx1):
    """Managed memory of ctx0 prefetched to device 1 on device 1's stream (the per-device
    prefetch of examples/unified_memory.py): enqueued in the stream's context."""
    with ctx0:
        m = ManagedBuffer(4096)
    s1 = Stream(ctx1)
    with ctx0:
        m[:2048].prefetch(1, stream=s1)
    (call,) = fake.calls("prefetch")
    assert call[1] == ctx1.handle
    assert int(call[2][-1]) == int(s1.handle)


def test_managed_prefetch_and_advise(fake, ctx0, ctx1):
    with ctx0:
        s = Stream()
        m = ManagedBuffer(4096)
        m.prefetch()
        m.prefetch("cpu", stream=s)
        m.prefetch(ctx1)
        m.advise("read_mostly")
        m.advise("unset_read_mostly")
        m.advise("preferred_location", "cpu")
        m.advise(real.CUmem_advise.CU_MEM_ADVISE_SET_ACCESSED_BY, 1)
        with pytest.raises(ValueError, match="unknown memory advice"):
            m.advise("fast_please")
        with pytest.raises(ValueError, match="'cpu'"):
            m.prefetch("gpu")
        ManagedBuffer(0).prefetch()
    pre = [c[2] for c in fake.calls("prefetch")]
    assert len(pre) == 3
    if ck._driver.uses_mem_location(ck._driver.BINDINGS_VERSION[0]):
        locs = [p[2] for p in pre]
        assert [int(loc.type) for loc in locs] == [1, 2, 1]  # device, host, device
        assert [loc.id for loc in locs] == [0, 0, 1]
        assert int(pre[1][4]) == int(s.handle)
    adv = [c[2] for c in fake.calls("advise")]
    names = [a[2].name for a in adv]
    assert names == [
        "CU_MEM_ADVISE_SET_READ_MOSTLY",
        "CU_MEM_ADVISE_UNSET_READ_MOSTLY",
        "CU_MEM_ADVISE_SET_PREFERRED_LOCATION",
        "CU_MEM_ADVISE_SET_ACCESSED_BY",
    ]


# ======================================================================================


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_managed_views_refuse_python_objects(fake, ctx0, dtype):
    with ctx0:
        m = ManagedBuffer(64)
    for call in (lambda: m.as_numpy(dtype), lambda: m.as_numpy(dtype, (4,))):
        with pytest.raises(TypeError, match=object_dtype_message(dtype)):
            call()
    m.close()  # no view was made


# the kind of memory as data
# ======================================================================================


def test_each_buffer_class_allocates_its_kind(fake, ctx0):
    from ctxkit.memory import alloc

    assert sorted(alloc.KINDS) == ["device", "managed", "pinned"]
    assert ManagedBuffer.kind is alloc.MANAGED and not ManagedBuffer.kind.stream_ordered
    with ctx0:
        d, m = ck.DeviceBuffer(64), ManagedBuffer(64)
    assert [c[2][2] for c in fake.calls("alloc")] == ["device", "managed"]
    assert d.__dlpack_device__() == (2, 0) and m.__dlpack_device__() == (13, 0)
    d.close()
    m.close()
    assert len(fake.calls("free")) == 2
