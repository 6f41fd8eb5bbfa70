"""disable_peer_access on two real devices: the driver agrees that access is off (and on
again after enable_peer_access), a second disable is a no-op, ctxkit's record follows,
and copies keep working, staged."""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.memory import copies

pytestmark = pytest.mark.multigpu


def test_disable_then_enable_again_on_fresh_contexts():
    if not (ck.Device(0).can_access_peer(1) and ck.Device(1).can_access_peer(0)):
        pytest.skip("devices 0 and 1 have no peer path")
    a, b = ck.Context.create(0), ck.Context.create(1)
    try:
        src, dst = ck.DeviceBuffer(1 << 20, context=a), ck.DeviceBuffer(1 << 20, context=b)
        data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        src.copy_from_host(data)
        copies.enable_peer_access(b, a)
        assert copies.peer_access_enabled(b, a) and ck.copy_peer(dst, src) is True
        copies.disable_peer_access(b, a)
        assert not copies.peer_access_enabled(b, a)
        with b:  # the driver agrees: access is off, so enabling it is not "already enabled"
            (err,) = drv.cuCtxDisablePeerAccess(a.cu)
        assert int(err) == 705  # CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
        copies.disable_peer_access(b, a)  # idempotent
        dst.memset(0)
        assert ck.copy_peer(dst, src) is False  # staged now, still correct
        np.testing.assert_array_equal(dst.copy_to_host(), data)
        copies.enable_peer_access(b, a)
        assert copies.peer_access_enabled(b, a)
        with b:
            (err,) = drv.cuCtxEnablePeerAccess(a.cu, 0)
        assert int(err) == 704  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: it is on again
        copies.disable_peer_access(b, a)
    finally:
        a.close()
        b.close()
