"""MemoryPool on the fake driver: attributes, the statistics with ctxkit's block cache,
trim, close, borrowed pools and the errors a user can hit."""

from __future__ import annotations

import pytest

import ctxkit as ck
from ctxkit.errors import ContextClosedError
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
        with pytest.raises(ValueError, match="non-negative"):
            ck.MemoryPool(0, release_threshold=-1)
        pool = ck.MemoryPool(0)
        with pytest.raises(ValueError, match="non-negative"):
            pool.trim(-5)


def test_pool_of_the_other_device(pfake, ctx0, ctx1):
    with ctx0:
        pool = ck.MemoryPool.default(1)
        s = ck.Stream(context=1)
        buf = pool.allocate(4096, stream=s)
    assert buf.context is ctx1 and pool.device.ordinal == 1
    buf.close()
    assert pool.cached_bytes == 4096 and ck.MemoryPool.default(0).cached_bytes == 0
