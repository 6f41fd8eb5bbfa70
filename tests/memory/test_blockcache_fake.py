"""The block cache of stream-ordered buffers on the fake driver: hits and misses per
stream and size class, no cross-stream reuse, the bound, trim, out-of-memory retry,
closed and collected streams, context close, threads, garbage collection, capture
hold-back and the environment switch."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

import ctxkit as ck
from ctxkit import lifetime
from ctxkit.errors import OutOfMemoryError
from ctxkit.memory import DeviceBuffer, alloc
from tests.memory.fakepool import _reset_cache, ctx0, ctx1, pfake  # noqa: F401

MIB = 1 << 20


@pytest.fixture
def big_bound(monkeypatch):
    monkeypatch.setenv("CTXKIT_ALLOC_CACHE", str(1 << 30))
    _reset_cache()


def test_same_stream_same_size_reuses_the_block_without_a_driver_call(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        a = DeviceBuffer(1000, stream=s)
        ptr = a.ptr
        a.close()
        b = DeviceBuffer(1000, stream=s)
        c = DeviceBuffer(1010, stream=s)  # the same 512-byte class, but a is taken
    assert b.ptr == ptr and c.ptr != ptr and b.stream is s and b.nbytes == 1000
    assert len(pfake.async_allocs()) == 2 and pfake.async_frees() == []
    b.close()
    d = DeviceBuffer(1010, stream=s)  # 1010 rounds to 1024 like 1000: a hit
    assert d.ptr == ptr and len(pfake.async_allocs()) == 2
    assert d.nbytes == 1010


def test_other_size_class_misses(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        DeviceBuffer(1024, stream=s).close()
        DeviceBuffer(1025, stream=s).close()
    assert [n for _a, n, _s in pfake.async_allocs()] == [1024, 1536]


def test_a_block_is_never_handed_to_another_stream(pfake, ctx0):
    with ctx0:
        s1, s2 = ck.Stream(), ck.Stream()
        a = DeviceBuffer(4096, stream=s1)
        ptr = a.ptr
        a.close()
        b = DeviceBuffer(4096, stream=s2)
    assert b.ptr != ptr and len(pfake.async_allocs()) == 2
    assert [s for _a, _n, s in pfake.async_allocs()] == [int(s1.handle), int(s2.handle)]


def test_close_on_another_stream_caches_there(pfake, ctx0):
    with ctx0:
        s1, s2 = ck.Stream(), ck.Stream()
        a = DeviceBuffer(4096, stream=s1)
        ptr = a.ptr
        a.close(stream=s2)
        on_s1 = DeviceBuffer(4096, stream=s1)
        on_s2 = DeviceBuffer(4096, stream=s2)
    assert on_s2.ptr == ptr and on_s1.ptr != ptr
    assert pfake.async_frees() == []


def test_inside_with_stream_the_current_stream_is_used(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        with s:
            a = DeviceBuffer(4096)
            ptr = a.ptr
            a.close()
            b = DeviceBuffer(4096)
    assert b.stream is s and b.ptr == ptr and len(pfake.async_allocs()) == 1


def test_garbage_collected_buffer_returns_to_the_cache_every_time(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        ptrs = []
        for _ in range(4):
            buf = DeviceBuffer(8192, stream=s)
            ptrs.append(buf.ptr)
            del buf
            gc.collect()
    assert len(set(ptrs)) == 1 and len(pfake.async_allocs()) == 1
    assert pfake.async_frees() == [] and ck.MemoryPool.default(0).cached_bytes == 8192


def test_double_close_and_views(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        a = DeviceBuffer(4096, stream=s)
        view = a[0:16]
        view.close()  # only the view
        assert not a.closed
        a.close()
        a.close()
        assert view.closed
        b = DeviceBuffer(4096, stream=s)
        c = DeviceBuffer(4096, stream=s)
    assert b.ptr != c.ptr  # the block went into the cache once
    assert ck.MemoryPool.default(0).cached_bytes == 0


def test_synchronous_and_wrapped_buffers_do_not_touch_the_cache(pfake, ctx0):
    with ctx0:
        sync = DeviceBuffer(4096)
        sync.close()
        wrapped = DeviceBuffer.from_pointer(0x1234, 64)
        wrapped.close()
    assert len(pfake.calls("free")) == 1 and pfake.async_allocs() == []
    assert alloc.cached_bytes(0) == 0


def _failed_cache_frees() -> list[lifetime.FailedFree]:
    return [f for f in lifetime.failed_frees() if f.function == "free_async"]


def test_trim_flushes_the_cache_and_returns_the_memory(pfake, ctx0, big_bound):
    with ctx0:
        pool = ck.MemoryPool.default(0)
        s = ck.Stream()
        for b in [DeviceBuffer(MIB // 8, stream=s) for _ in range(3)]:
            b.close()
        assert pool.cached_bytes == 3 * MIB // 8 and pool.used_bytes == 3 * MIB // 8
        pool.trim()
        assert pool.cached_bytes == 0 and pool.used_bytes == 0 and pool.reserved_bytes == 0
    assert [st for _p, st in pfake.async_frees()] == [int(s.handle)] * 3


def test_the_bound_empties_the_device_cache(pfake, ctx0, monkeypatch):
    monkeypatch.setenv("CTXKIT_ALLOC_CACHE", "8192")
    _reset_cache()
    with ctx0:
        s = ck.Stream()
        bufs = [DeviceBuffer(4096, stream=s) for _ in range(3)]
        bufs[0].close()
        bufs[1].close()
        assert alloc.cached_bytes(0) == 8192 and pfake.async_frees() == []
        bufs[2].close()  # 12 KiB > 8 KiB: everything is given back
    assert alloc.cached_bytes(0) == 0 and len(pfake.async_frees()) == 3


def test_default_bound_is_a_quarter_of_the_device(pfake, ctx0):
    assert alloc.limit_bytes(ctx0) == pfake.total // 4


def test_out_of_memory_flushes_the_cache_and_retries_once(pfake, ctx0, big_bound):
    with ctx0:
        s, other = ck.Stream(), ck.Stream()
        for b in [DeviceBuffer(MIB // 4, stream=other) for _ in range(3)]:
            b.close()
        big = DeviceBuffer(MIB // 2, stream=s)  # fits only once the cache is given back
        assert alloc.cached_bytes(0) == 0 and len(pfake.async_frees()) == 3
        with pytest.raises(OutOfMemoryError, match="cannot allocate"):
            DeviceBuffer(MIB, stream=s)
        big.close()


def test_out_of_memory_retry_is_single(pfake, ctx0, big_bound):
    with ctx0:
        s = ck.Stream()
        DeviceBuffer(4096, stream=s).close()
        pfake.fail_next_async_oom = 2
        with pytest.raises(OutOfMemoryError):
            DeviceBuffer(8192, stream=s)
    assert pfake.fail_next_async_oom == 0  # tried twice, then the typed error


def test_blocks_of_a_closed_stream_are_freed_after_a_context_synchronize(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        DeviceBuffer(4096, stream=s).close()
        s.close()
        with pytest.raises(ck.ContextClosedError):
            DeviceBuffer(4096, stream=s)
        ck.MemoryPool.default(0).trim()
    names = [e[0] for e in pfake.log]
    assert names.index("ctxsync") < names.index("freeasync")
    assert pfake.async_frees()[-1][1] == 0 and _failed_cache_frees() == []
    assert pfake.live_async() == 0


def test_blocks_of_a_collected_stream_are_freed_on_it_before_it_is_destroyed(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        handle = int(s.handle)
        DeviceBuffer(4096, stream=s).close()
        del s
        gc.collect()
    names = [(e[0], e[2]) for e in pfake.log if e[0] in ("freeasync", "streamdestroy")]
    assert names[0][0] == "freeasync" and names[0][1][1] == handle
    assert names[1] == ("streamdestroy", handle)
    assert alloc.cached_bytes(0) == 0 and not pfake.calls("ctxsync")


def test_closing_the_context_frees_its_blocks_first(pfake, ctx0, ctx1):
    with ctx1:
        s1 = ck.Stream()
        DeviceBuffer(4096, stream=s1).close()
    with ctx0:
        s0 = ck.Stream()
        DeviceBuffer(4096, stream=s0).close()
    lifetime.context_closing(ctx1)  # what Context.close() runs before the driver call
    assert [st for _p, st in pfake.async_frees()] == [int(s1.handle)]
    assert alloc.cached_bytes(1) == 0 and alloc.cached_bytes(0) == 4096


def test_a_closed_context_hands_out_nothing(pfake, ctx0, monkeypatch):
    with ctx0:
        s = ck.Stream()
        DeviceBuffer(4096, stream=s).close()
    monkeypatch.setattr(ctx0, "closed", True)
    monkeypatch.setattr(ctx0, "_unusable", True)  # what Context._release sets with closed
    assert alloc.take(s, 4096) is None
    with pytest.raises(ck.ContextClosedError):
        DeviceBuffer(4096, stream=s)


def test_threads_allocate_and_free_concurrently(pfake, ctx0, big_bound):
    with ctx0:
        shared = ck.Stream()
        own = [ck.Stream() for _ in range(4)]
    live: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def freed() -> set[int]:
        return {p for ps in list(pfake.pending.values()) for p in list(ps)}

    def work(i: int) -> None:
        try:
            for k in range(300):
                s = shared if k % 2 else own[i]
                buf = DeviceBuffer(512 * (1 + k % 3), stream=s)
                with lock:
                    assert buf.ptr not in live, "a block handed out twice"
                    assert buf.ptr not in freed(), "a block handed out after its free"
                    live[buf.ptr] = i
                with lock:
                    del live[buf.ptr]
                if k % 5 == 0:
                    del buf  # garbage collection path
                else:
                    buf.close()
        except BaseException as exc:
            errors.append(exc)

    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            alloc.flush()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as much as possible
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        side = threading.Thread(target=flusher)
        side.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        side.join()
    finally:
        sys.setswitchinterval(switch)
    gc.collect()
    assert errors == [], errors
    cached = [b for sc in alloc._caches.values() for lst in sc.blocks.values() for b in lst]
    # every block is either in a cache or was given back, and only once
    assert len(pfake.async_allocs()) == len(pfake.async_frees()) + len(cached)
    assert len({b.ptr for b in cached}) == len(cached)
    assert alloc.cached_bytes(0) == sum(b.size for b in cached)
    # The held-bytes counter is updated without the lock (a finalizer may give a block back
    # inside it) and recounted by every flush: a give-back racing the flusher's last recount
    # may leave it off until the next flush, which recounts it exactly.
    alloc.flush()
    assert alloc._held[0] == alloc.cached_bytes(0) == 0
    assert len(pfake.async_allocs()) == len(pfake.async_frees())
    assert _failed_cache_frees() == []


def test_capture_bypasses_the_cache_and_holds_back_flushes(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        DeviceBuffer(4096, stream=s).close()
        lifetime.capture_begins(False)
        try:
            inside = DeviceBuffer(4096, stream=s)  # the cached block is not handed out
            assert len(pfake.async_allocs()) == 2
            inside.close()  # allocated during capture: never cached, the free waits
            alloc.flush()
            assert pfake.async_frees() == [] and lifetime.held_back_frees() == 2
        finally:
            lifetime.capture_ends(False)
    assert len(pfake.async_frees()) == 2 and lifetime.held_back_frees() == 0
    assert alloc.cached_bytes(0) == 0


def test_a_relaxed_capture_of_the_stream_bypasses_the_cache(pfake, ctx0):
    # relaxed mode holds no frees back, but a block handed out on the captured stream
    # would be baked into the graph and later reused under it
    with ctx0:
        s, other = ck.Stream(), ck.Stream()
        DeviceBuffer(4096, stream=s).close()
        DeviceBuffer(4096, stream=other).close()
        lifetime.stream_capture_begins(int(s.handle))
        try:
            inside = DeviceBuffer(4096, stream=s)
            assert len(pfake.async_allocs()) == 3  # from the driver, not the cache
            beside = DeviceBuffer(4096, stream=other)  # another stream: still cached
            assert len(pfake.async_allocs()) == 3
            inside.close()
            assert alloc.cached_bytes(0) == 4096  # s's old block only: never cached
        finally:
            lifetime.stream_capture_ends(int(s.handle))
        beside.close()
        again = DeviceBuffer(4096, stream=s)
    assert len(pfake.async_allocs()) == 3 and again.stream is s  # the cache serves s again


def test_a_foreign_stream_being_captured_bypasses_the_cache(pfake, ctx0, monkeypatch):
    capturing = {"now": False}
    monkeypatch.setattr(
        pfake, "cuStreamIsCapturing", lambda h: (0, int(capturing["now"])), raising=False
    )
    with ctx0:
        mine = ck.Stream()
        theirs = ck.Stream.from_handle(int(mine.handle), ctx0)  # as torch's would come
        DeviceBuffer(4096, stream=theirs).close()
        capturing["now"] = True
        DeviceBuffer(4096, stream=theirs).close()  # from the driver, freed: not cached
        assert len(pfake.async_allocs()) == 2 and len(pfake.async_frees()) == 1
        capturing["now"] = False
        DeviceBuffer(4096, stream=theirs)
    assert len(pfake.async_allocs()) == 2  # the block cached before the capture


def test_environment_switch_disables_the_cache(pfake, ctx0, monkeypatch):
    monkeypatch.setenv("CTXKIT_ALLOC_CACHE", "0")
    _reset_cache()
    assert not alloc.enabled()
    with ctx0:
        s = ck.Stream()
        a = DeviceBuffer(1000, stream=s)
        a.close()
        assert len(pfake.async_frees()) == 1
        DeviceBuffer(1000, stream=s).close()
    assert [n for _a, n, _s in pfake.async_allocs()] == [1000, 1000]
    assert alloc.cached_bytes(0) == 0


def test_bad_environment_value_is_raised_by_the_first_allocation(pfake, ctx0, monkeypatch):
    monkeypatch.setenv("CTXKIT_ALLOC_CACHE", "lots")
    _reset_cache()  # what `import ctxkit` does: no error yet
    with ctx0:
        s = ck.Stream()
        with pytest.raises(ValueError, match="CTXKIT_ALLOC_CACHE='lots': expected 0/off"):
            DeviceBuffer(4096, stream=s)
        DeviceBuffer(4096).close()  # synchronous memory does not care
        monkeypatch.setenv("CTXKIT_ALLOC_CACHE", "-5")
        _reset_cache()
        with pytest.raises(ValueError, match="must not be negative"):
            DeviceBuffer(4096, stream=s)
    assert pfake.async_allocs() == []


def test_pool_blocks_are_cached_per_pool(pfake, ctx0):
    with ctx0:
        pool = ck.MemoryPool(0)
        s = ck.Stream()
        a = pool.allocate(4096, stream=s)
        ptr = a.ptr
        a.close()
        from_default = DeviceBuffer(4096, stream=s)
        again = pool.allocate(4096, stream=s)
        assert from_default.ptr != ptr and again.ptr == ptr
        again.close()
        assert pool.cached_bytes == 4096 and ck.MemoryPool.default(0).cached_bytes == 0
        pool.close()  # the owned pool's cached blocks are freed before it is destroyed
    names = [e[0] for e in pfake.log]
    assert names.index("freeasync") < names.index("pooldestroy")


def test_exit_drops_the_cache_without_driver_calls(pfake, ctx0):
    with ctx0:
        s = ck.Stream()
        DeviceBuffer(4096, stream=s).close()
        alloc._at_exit()
        DeviceBuffer(4096, stream=s).close()
    assert alloc.cached_bytes(0) == 0 and not alloc.enabled()
    assert len(pfake.async_frees()) == 1  # only the buffer closed after the exit hook
