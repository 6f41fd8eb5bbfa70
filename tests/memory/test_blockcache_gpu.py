"""The block cache of stream-ordered buffers on a real GPU: reuse in stream order gives
correct values, a reused block has the same address on its stream and never goes to
another stream, trim() returns the memory, frees from other threads and by garbage
collection, a collected stream, process exit with cached blocks."""

from __future__ import annotations

import gc
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import lifetime
from tests.support.helpers import in_thread

MiB = 1 << 20


@pytest.fixture(scope="module")
def fill_kernel() -> Any:
    from ctxkit.compiler import kernel_source

    with ck.registry.context(0):
        return ck.Module.load(ck.compile(kernel_source("fill.cu"))).function("fill_f32")


def _cache_frees_failed() -> list[lifetime.FailedFree]:
    return [f for f in lifetime.failed_frees() if f.function == "free_async"]


def trimmed_default_pool() -> tuple[ck.MemoryPool, int]:
    """Device 0's default pool with nothing cached, and its used bytes then (the level
    every test returns to)."""
    pool = ck.MemoryPool.default(0)
    pool.trim()
    return pool, pool.used_bytes


def test_reuse_in_stream_order_gives_correct_values_every_time(ctx0, fill_kernel):
    n, rounds = 1024, 1000
    with ctx0:
        s = ck.Stream()
        host = ck.pinned_zeros((rounds, n), np.float32)
        ptrs = set()
        for i in range(rounds):
            buf = ck.DeviceBuffer(n * 4, stream=s)
            ptrs.add(buf.ptr)
            fill_kernel.launch(4, 256, buf, np.float32(i), n, stream=s)
            buf.view((n,), np.float32).copy_to_host(host[i], stream=s)
            buf.close()  # no synchronize: the next round's block is reused in stream order
        s.synchronize()
    want = np.repeat(np.arange(rounds, dtype=np.float32), n).reshape(rounds, n)
    np.testing.assert_array_equal(host, want)
    assert len(ptrs) == 1  # one block, reused 999 times


def test_same_stream_same_address_other_stream_another(ctx0):
    with ctx0:
        s1, s2 = ck.Stream(), ck.Stream()
        a = ck.DeviceBuffer(MiB, stream=s1)
        ptr = a.ptr
        a.close()
        b = ck.DeviceBuffer(MiB, stream=s2)
        c = ck.DeviceBuffer(MiB, stream=s1)
        assert b.ptr != ptr and c.ptr == ptr
        b.close()
        c.close()
        s1.synchronize()
        s2.synchronize()


def test_trim_returns_cached_memory_to_the_driver(ctx0):
    with ctx0:
        pool, used0 = trimmed_default_pool()
        s = ck.Stream()
        bufs = [ck.DeviceBuffer(8 * MiB, stream=s) for _ in range(8)]
        for b in bufs:
            b.close()
        s.synchronize()
        assert pool.cached_bytes >= 64 * MiB
        assert pool.used_bytes >= used0 + 64 * MiB  # cached blocks count as used
        reserved = pool.reserved_bytes
        pool.trim()
        assert pool.cached_bytes == 0 and pool.used_bytes == used0
        assert pool.reserved_bytes < reserved


def test_free_from_another_thread_and_by_gc_goes_to_the_cache(ctx0):
    with ctx0:
        pool, used0 = trimmed_default_pool()
        s = ck.Stream()
        buf = ck.DeviceBuffer(4 * MiB, stream=s)
        ptr = buf.ptr
        in_thread(buf.close)
        again = ck.DeviceBuffer(4 * MiB, stream=s)
        assert again.ptr == ptr
        del again
        gc.collect()
        third = ck.DeviceBuffer(4 * MiB, stream=s)
        assert third.ptr == ptr
        third.close()
        pool.trim()
        assert pool.used_bytes == used0
    assert _cache_frees_failed() == []


def test_collected_stream_gives_its_blocks_back(ctx0):
    with ctx0:
        pool, used0 = trimmed_default_pool()
        s = ck.Stream()
        ck.DeviceBuffer(16 * MiB, stream=s).close()
        assert pool.cached_bytes >= 16 * MiB
        del s
        gc.collect()
        ctx0.synchronize()
        assert pool.cached_bytes == 0 and pool.used_bytes == used0
    assert _cache_frees_failed() == []


def test_closed_stream_blocks_are_given_back_by_trim(ctx0):
    with ctx0:
        pool, used0 = trimmed_default_pool()
        s = ck.Stream()
        ck.DeviceBuffer(16 * MiB, stream=s).close()
        s.close()
        pool.trim()
        assert pool.cached_bytes == 0 and pool.used_bytes == used0
    assert _cache_frees_failed() == []


EXIT_SCRIPT = """
import ctxkit as ck
ctx = ck.registry.context(0)
with ctx:
    s = ck.Stream()
    for _ in range(10):
        ck.DeviceBuffer(1 << 20, stream=s).close()
    keep = ck.DeviceBuffer(2 << 20, stream=s)
    other = ck.Stream()
    ck.DeviceBuffer(3 << 20, stream=other).close()
    print("cached", ck.MemoryPool.default(0).cached_bytes)
"""


def test_process_exit_with_cached_blocks_is_clean():
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.split() == ["cached", str(4 << 20)]
