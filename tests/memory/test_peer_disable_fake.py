"""disable_peer_access against the fake: the driver call in the right context, ctxkit's
record kept true, idempotence, and the cases that need no driver call. The GPU truth:
tests/memory/test_peer_disable_gpu.py."""

from __future__ import annotations

import pytest

import ctxkit as ck
from ctxkit.errors import CudaError
from ctxkit.memory import copies


def test_disable_undoes_enable_and_the_record_follows(vfake, vctx0, vctx1):
    copies.enable_peer_access(0, 1)
    assert copies.peer_access_enabled(0, 1)
    a = ck.DeviceBuffer(64, context=vctx0)
    b = ck.DeviceBuffer(64, context=vctx1)
    assert copies.copy_peer(b, a) is True
    copies.disable_peer_access(0, 1)
    assert vfake.calls("disablepeer") == [
        ("disablepeer", vctx0.handle, (vctx0.handle, vctx1.handle))
    ]
    assert (vctx0.handle, vctx1.handle) not in vfake.peers
    assert not copies.peer_access_enabled(0, 1)
    assert copies.copy_peer(b, a) is False  # the staged path now
    copies.enable_peer_access(vctx0, vctx1)
    assert copies.peer_access_enabled(0, 1)


def test_disable_is_one_direction(vfake, vctx0, vctx1):
    copies.enable_peer_access(0, 1)
    copies.enable_peer_access(1, 0)
    copies.disable_peer_access(1, 0)
    assert copies.peer_access_enabled(0, 1) and not copies.peer_access_enabled(1, 0)


def test_disable_is_idempotent(vfake, vctx0, vctx1):
    copies.disable_peer_access(0, 1)  # never enabled: the driver says so, no error
    copies.enable_peer_access(0, 1)
    copies.disable_peer_access(0, 1)
    copies.disable_peer_access(0, 1)
    assert len(vfake.calls("disablepeer")) == 3
    assert not copies.peer_access_enabled(0, 1)


def test_disable_needs_no_driver_call_on_one_device_or_without_a_peer_path(vfake, vctx0):
    other = ck.Context.create(0)
    try:
        copies.disable_peer_access(vctx0, other)
    finally:
        other.close()
    vfake.no_peer = True
    copies.disable_peer_access(0, 1)
    assert not vfake.calls("disablepeer")


def test_driver_errors_name_both_contexts(vfake, vctx0, vctx1, monkeypatch):
    monkeypatch.setattr(vfake, "cuCtxDisablePeerAccess", lambda peer_ctx: (400,))
    with pytest.raises(CudaError, match="cuCtxDisablePeerAccess") as info:
        copies.disable_peer_access(0, 1)
    assert info.value.name == "CUDA_ERROR_INVALID_HANDLE"
    assert f"{vctx1.handle:#x}" in str(info.value)


def test_closed_contexts_are_refused(vfake, vctx1):
    ctx = ck.Context.create(0)
    ctx.close()
    with pytest.raises(ck.ContextClosedError):
        copies.disable_peer_access(ctx, vctx1)
