"""Peer access and peer copies on the fake driver."""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.memory as memory
from ctxkit.context import Context
from ctxkit.errors import (
    CudaError,
)
from ctxkit.memory import (
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

# peer access
# ======================================================================================


def test_enable_peer_access_is_idempotent(fake, ctx0, ctx1):
    assert not memory.peer_access_enabled(0, 1)
    ck.enable_peer_access(0, 1)
    ck.enable_peer_access(ctx0, ctx1)  # driver says ALREADY_ENABLED: fine
    assert memory.peer_access_enabled(0, 1) and not memory.peer_access_enabled(1, 0)
    assert [c[2] for c in fake.calls("enablepeer")] == [(ctx0.handle, ctx1.handle)] * 2
    ck.enable_peer_access(0, ck.Context.create(0))  # same device: nothing to do
    assert len(fake.calls("enablepeer")) == 2


def test_peer_state_does_not_survive_a_closed_context(fake, ctx0):
    other = ck.Context.create(1)
    ck.enable_peer_access(ctx0, other)
    assert memory.peer_access_enabled(ctx0, other)
    other.close()
    reborn = Context(FakeHandle(other.handle), ck.Device(1), "owned")  # same handle, new context
    assert not memory.peer_access_enabled(ctx0, reborn)


def test_enable_peer_access_unsupported(fake, ctx0, ctx1):
    fake.no_peer = True
    with pytest.raises(CudaError, match="cannot access device 1") as info:
        ck.enable_peer_access(0, 1)
    assert info.value.name == "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"


def test_copy_peer_both_directions_with_and_without_access(fake, ctx0, ctx1):
    data = rand_bytes(301, seed=3)
    a = DeviceBuffer(301, context=ctx0)
    b = DeviceBuffer(301, context=ctx1)
    with ctx0:
        a.copy_from_host(data)
        assert ck.copy_peer(b, a) is False
        ck.enable_peer_access(1, 0)
        assert ck.copy_peer(a, b) is True  # either direction counts
        s1 = Stream(ctx1)
        assert ck.copy_peer(b[:10], a, 10, stream=s1) is True
    with ctx1:
        np.testing.assert_array_equal(b.copy_to_host(), data)
    peer_async = fake.calls("PeerAsync")[-1]
    assert peer_async[1] == ctx1.handle and peer_async[2] == (
        ctx1.handle,
        ctx0.handle,
        int(s1.handle),
    )
    with ctx0:
        with pytest.raises(ValueError, match="do not fit"):
            ck.copy_peer(b[:10], a)
        assert ck.copy_peer(b, a, 0) is True
        with pytest.raises(ValueError, match=">= 0"):
            ck.copy_peer(b, a, -1)


def test_copy_from_another_device_uses_peer_copy(fake, ctx0, ctx1):
    data = rand_bytes(50, seed=4)
    with ctx1:
        src = DeviceBuffer(50)
        src.copy_from_host(data)
    with ctx0:
        dst = DeviceBuffer(50)
        dst.copy_from(src)
        np.testing.assert_array_equal(dst.copy_to_host(), data)
    assert fake.calls("Peer")[-1][2] == (ctx0.handle, ctx1.handle)
