"""MemoryPool on the fake driver: attributes, the statistics with ctxkit's block cache,
trim, close, borrowed pools and the errors a user can hit."""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import ContextClosedError, OutOfMemoryError
from ctxkit.memory.ipc import export_pointer
from tests.memory.fakepool import DEFAULT_POOL, ctx0, ctx1, pfake  # noqa: F401


def test_new_pool_threshold_and_allocation_statistics(pfake, ctx0):
    with ctx0:
        pool = ck.MemoryPool(0, release_threshold=1 << 16)
        assert pool.release_threshold == 1 << 16 and pool.owned
        s = ck.Stream()
        bufs = [pool.allocate(4096, stream=s) for _ in range(3)]
        assert pool.used_bytes == 3 * 4096 and pool.reserved_bytes >= 3 * 4096
        for b in bufs:
            b.close()
        s.synchronize()
        # the blocks wait in ctxkit's cache of s: still used in the driver's count
        assert pool.cached_bytes == 3 * 4096 and pool.used_bytes == 3 * 4096
        pool.trim()
        assert pool.cached_bytes == 0 and pool.used_bytes == 0 and pool.reserved_bytes == 0
        pool.close()
        pool.close()
    assert pool.closed and "closed" in repr(pool)


def test_closed_pool_refuses_use(pfake, ctx0):
    with ctx0:
        pool = ck.MemoryPool(0)
        pool.close()
        for op in (lambda: pool.used_bytes, lambda: pool.cached_bytes, pool.trim):
            with pytest.raises(ContextClosedError, match="pool was closed"):
                op()


def test_default_and_borrowed_pools_share_the_cache_statistics(pfake, ctx0):
    with ctx0:
        default = ck.MemoryPool.default(0)
        borrowed = ck.MemoryPool.from_handle(DEFAULT_POOL, 0)
        s = ck.Stream()
        ck.DeviceBuffer(2048, stream=s).close()
        assert default.cached_bytes == borrowed.cached_bytes == 2048
        assert not default.owned and not borrowed.owned
        other = ck.MemoryPool(0)
        assert other.cached_bytes == 0
        borrowed.close()  # only forgotten
        assert default.cached_bytes == 2048 and "borrowed" in repr(default)


def test_bad_arguments_name_the_fix(pfake, ctx0):
    with ctx0:
        with pytest.raises(ValueError, match="must be >= 0"):
            ck.MemoryPool(0, release_threshold=-1)
        pool = ck.MemoryPool(0)
        with pytest.raises(ValueError, match="must be >= 0"):
            pool.trim(-5)


def test_pool_of_the_other_device(pfake, ctx0, ctx1):
    with ctx0:
        pool = ck.MemoryPool.default(1)
        s = ck.Stream(context=1)
        buf = pool.allocate(4096, stream=s)
    assert buf.context is ctx1 and pool.device.ordinal == 1
    buf.close()
    assert pool.cached_bytes == 4096 and ck.MemoryPool.default(0).cached_bytes == 0


def test_sizes_past_what_cuda_addresses_are_refused_at_every_allocation(pfake, ctx0):
    too_big = 2**64
    with ctx0:
        s = ck.Stream()
        pool = ck.MemoryPool(0)
        makers = {
            "DeviceBuffer": lambda: ck.DeviceBuffer(too_big),
            "DeviceBuffer(stream=)": lambda: ck.DeviceBuffer(too_big, stream=s),
            "MemoryPool.allocate": lambda: pool.allocate(too_big, stream=s),
            "ManagedBuffer": lambda: ck.ManagedBuffer(too_big),
            "device_array": lambda: ck.device_array((2**32, 2**32), np.float32),
            "pinned_empty": lambda: ck.pinned_empty((2**40, 2**40), np.uint8),
            "PinnedPool.empty": lambda: ck.pinned_pool().empty((2**62, 8), np.float64),
            "VirtualBuffer": lambda: ck.VirtualBuffer(too_big),
            "export_pointer": lambda: export_pointer(0, too_big, ctx0),
        }
        for make in makers.values():
            with pytest.raises(ValueError, match=r"above 2\*\*64 - 1"):
                make()
        with pytest.raises(OutOfMemoryError):
            ck.DeviceBuffer(too_big - 1, stream=s)  # no rounding up past size_t
        with pytest.raises(ValueError, match="max_size .* above 2"):
            ck.MemoryPool(0, max_size=too_big)
        with pytest.raises(TypeError, match="release_threshold must be an int number of bytes"):
            pool.release_threshold = 1.5
        with pytest.raises(ValueError, match="nbytes must be >= 0"):
            pool.allocate(-1)
        pool.close()
