"""Pinned pool blocks made by mmap + parallel touch + cuMemHostRegister on a real GPU
(ctxkit/memory/host.py): pinned for the driver, exact through async copies in both
directions, freed by trim; the cuMemHostAlloc method gives the same results."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.memory.host import host_pointer_kind
from ctxkit.memory.pinned import PinnedPool

pytestmark = pytest.mark.gpu
MiB = 1 << 20


@pytest.mark.parametrize("method", ["register", "hostalloc"])
@pytest.mark.parametrize("nbytes", [4096, 3 * MiB + 4096, 96 * MiB])
def test_pool_blocks_are_pinned_and_dma_exactly(monkeypatch, method, nbytes):
    monkeypatch.setenv("CTXKIT_PINNED_ALLOC", method)
    ctx = ck.registry.context(0)
    pool = PinnedPool(budget=512 * MiB)
    with ctx:
        src = pool.empty(nbytes, np.uint8)
        dst = pool.empty(nbytes, np.uint8)
        assert host_pointer_kind(int(src.ctypes.data)) == "pinned" and ck.is_pinned(dst)
        src[:] = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
        dst[:] = 0
        s = ck.Stream()
        buf = ck.DeviceBuffer(nbytes)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ck.PageableCopyWarning)  # truly pinned
            buf.copy_from_host(src, stream=s)
            buf.copy_to_host(dst, stream=s)
        s.synchronize()
        assert np.array_equal(src, dst)
        buf.close()
        s.close()
    ptr = int(src.ctypes.data)
    del src, dst
    gc.collect()
    assert pool.trim() >= 2 * nbytes
    if method == "hostalloc":
        assert host_pointer_kind(ptr) != "pinned"
