"""The pinned host pool on real GPUs: blocks are really page-locked and reused, DMA from
them runs at pinned speed and asynchronously, a block is reused only after the stream
work that used it (a spin kernel proves the race is real), blocks outlive an owned
context, trim really frees, and a process exits cleanly with blocks in use and cached."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import lifetime
from ctxkit.memory.device import DeviceBuffer
from ctxkit.memory.host import host_pointer_kind, is_pinned
from ctxkit.memory.pinned import PinnedPool
from tests.support.helpers import run_python

MiB = 1 << 20
SPIN = 400_000_000  # clock64 ticks: ~0.2 s at H200 clocks


def ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.fixture(scope="module")
def spin_kernel() -> Any:
    from ctxkit.compiler import kernel_source

    with ck.registry.context(0):
        return ck.Module.load(ck.compile(kernel_source("spin.cu"))).function("spin")


@pytest.fixture
def strict_async():
    """Async copies from pageable memory raise: a copy that passes came from pinned memory."""
    ck.memory.set_strict_async(True)
    yield
    ck.memory.set_strict_async(False)


def test_blocks_are_page_locked_and_reused(ctx0):
    failed = len(lifetime.failed_frees())
    pool = PinnedPool(budget=1 << 30)
    a = pool.empty((64, MiB // 4), np.float32)
    first = ptr(a)
    assert is_pinned(a) and pool.owns(a)
    a[...] = 1.5
    del a
    b = pool.empty(64 * MiB, np.uint8)
    assert ptr(b) == first and is_pinned(b)
    s = pool.stats()
    assert (s.allocations, s.hits, s.in_use_bytes) == (1, 1, 64 * MiB)
    del b
    assert pool.trim() == 64 * MiB
    assert host_pointer_kind(first) == "pageable"  # trim really freed the block
    assert len(lifetime.failed_frees()) == failed


def _copy_gbps(
    ctx: ck.Context, s: ck.Stream, dev: DeviceBuffer, host: np.ndarray, to_device: bool
) -> tuple[float, float]:
    """Best GB/s of 5 async copies (event-timed) and the slowest enqueue in seconds."""
    best, enqueue = 0.0, 0.0
    for _ in range(5):
        e0 = ck.Event(context=ctx).record(s)
        t0 = time.perf_counter()
        if to_device:
            dev.copy_from_host(host, stream=s)
        else:
            dev.copy_to_host(host, stream=s)
        enqueue = max(enqueue, time.perf_counter() - t0)
        e1 = ck.Event(context=ctx).record(s)
        e1.synchronize()
        best = max(best, host.nbytes / (e0.elapsed_ms(e1) / 1e3) / 1e9)
    return best, enqueue


def test_dma_from_pooled_blocks_runs_at_pinned_speed(ctx0, strict_async):
    n = 256 * MiB
    pool = PinnedPool(budget=1 << 30)
    s = ck.Stream(context=ctx0)
    dev = DeviceBuffer(n, context=ctx0)
    pooled = pool.empty(n, np.uint8, stream=s)
    pinned = ck.pinned_empty(n, np.uint8, context=ctx0)
    pooled[...] = 3
    pinned[...] = 3
    pageable = np.full(n, 3, np.uint8)
    t0 = time.perf_counter()
    dev.copy_from_host(pageable)  # synchronous: the driver stages pageable memory
    pageable_gbps = n / (time.perf_counter() - t0) / 1e9
    for to_device in (True, False):
        got, enqueue = _copy_gbps(ctx0, s, dev, pooled, to_device)
        want, _ = _copy_gbps(ctx0, s, dev, pinned, to_device)
        seconds = n / (got * 1e9)
        print(
            f"{'H2D' if to_device else 'D2H'}: pooled {got:.1f} GB/s, pinned_empty "
            f"{want:.1f} GB/s, pageable (sync H2D) {pageable_gbps:.1f} GB/s; "
            f"enqueue {enqueue * 1e6:.0f} us of a {seconds * 1e3:.1f} ms copy"
        )
        assert got >= 0.85 * want
        assert got >= 1.5 * pageable_gbps
        assert enqueue < 0.5 * seconds  # asynchronous: the call returned before the copy


def test_a_block_is_reused_only_after_the_stream_work_that_used_it(ctx0, spin_kernel):
    """A D2H copy into a pooled array queued behind a 0.2 s kernel: the array is
    dropped at once, yet the next request gets another block; once the stream is done
    the old block comes back holding the copied bytes (nothing overwrote it)."""
    n = 16 * MiB
    pool = PinnedPool(budget=1 << 30)
    s = ck.Stream(context=ctx0)
    src = DeviceBuffer(n, context=ctx0)
    src.memset(0x5A)
    a = pool.empty(n, np.uint8, stream=s)
    a[...] = 0
    first = ptr(a)
    spin_kernel.launch(1, 1, SPIN, 0, stream=s)
    src.copy_to_host(a, stream=s)
    del a
    b = pool.empty(n, np.uint8)
    busy = not s.query()
    assert ptr(b) != first and busy, "the spin kernel ended before the pool was asked"
    assert pool.stats().pending_blocks == 1
    b[...] = 0
    s.synchronize()
    c = pool.empty(n, np.uint8)
    assert ptr(c) == first and (c == 0x5A).all()
    del b, c
    assert pool.release() == 2 * n


def test_blocks_outlive_an_owned_context_that_was_current(ctx0, strict_async):
    """Blocks are allocated in the registry's context: closing the caller's own context
    (which frees its cuMemHostAlloc memory) leaves the pool's arrays valid and pinned."""
    pool = PinnedPool(budget=1 << 30)
    own = ck.Context.create(0)
    with own:
        a = pool.empty(MiB, np.uint8)
    own.close()
    a[...] = 9
    assert is_pinned(a)
    s = ck.Stream(context=ctx0)
    dev = DeviceBuffer(MiB, context=ctx0)
    dev.copy_from_host(a, stream=s)
    s.synchronize()
    assert (dev.copy_to_host() == 9).all()
    del a
    pool.release()


def test_blocks_are_portable_to_another_device(ctx0, ctx1, strict_async):
    pool = PinnedPool(budget=1 << 30)
    a = pool.empty(8 * MiB, np.uint8, context=ctx0)
    a[...] = 4
    s1 = ck.Stream(context=ctx1)
    pool.record_stream(a, s1)
    dev1 = DeviceBuffer(8 * MiB, context=ctx1)
    dev1.copy_from_host(a, stream=s1)  # DMA in device 1's context, asynchronously
    s1.synchronize()
    assert (dev1.copy_to_host() == 4).all()
    del a
    assert pool.release() == 8 * MiB


def test_arrays_dropped_in_other_threads_are_freed_cleanly(ctx0):
    failed = len(lifetime.failed_frees())
    pool = PinnedPool(budget=1 << 30)
    box = [pool.empty(4 * MiB, np.uint8) for _ in range(8)]
    pointers = [ptr(a) for a in box]
    threads = [threading.Thread(target=box.pop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = pool.stats()
    assert (s.in_use_blocks, s.cached_blocks) == (0, 8)
    t = threading.Thread(target=pool.trim)
    t.start()
    t.join()
    assert all(host_pointer_kind(p) == "pageable" for p in pointers)
    assert len(lifetime.failed_frees()) == failed


def test_the_process_pool_exits_cleanly_with_blocks_in_use_and_cached():
    res = run_python(
        timeout=180,
        code="""
        import threading
        import numpy as np
        import ctxkit as ck
        from ctxkit.memory.pinned import pinned_pool

        pool = pinned_pool()
        s = ck.Stream(context=ck.registry.context(0))
        keep = pool.empty(8 << 20, np.uint8)
        box = [pool.empty(8 << 20, np.uint8, stream=s)]
        b = pool.empty(4 << 20, np.uint8)
        del b
        t = threading.Thread(target=box.clear)
        t.start()
        t.join()
        st = pool.stats()
        print("ok", st.allocations, st.in_use_blocks, st.cached_blocks + st.pending_blocks)
        """,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok", "3", "1", "2"] and res.stderr == ""


def test_the_budget_comes_from_the_environment():
    res = run_python(
        timeout=180,
        code="""
        import numpy as np
        import ctxkit as ck
        from ctxkit.memory.pinned import pinned_pool

        pool = pinned_pool()
        a = pool.empty(12 << 20, np.uint8)
        try:
            pool.empty(8 << 20, np.uint8)
        except ck.OutOfMemoryError as exc:
            print("refused", "CTXKIT_PINNED_POOL_BYTES" in str(exc), pool.budget)
        """,
        CTXKIT_PINNED_POOL_BYTES=str(16 * MiB),
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["refused", "True", str(16 * MiB)] and res.stderr == ""
