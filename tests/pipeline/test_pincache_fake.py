"""Pin on reuse (``PipelineOptions(pin_cache_bytes=...)``, ``ctxkit.pipeline.pincache``) on a
simulated GPU.

The simulated GPU (tests/support/fakegpu.py) refuses overlapping registrations and records
every DMA from memory that is not page-locked, so these tests fail if a held range is used
after it was released or registered twice.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.pipeline import Pipeline, PipelineError
from ctxkit.pipeline import pincache as _pincache
from ctxkit.pipeline.pincache import PinCache, PinClaims, hold_range, memory_owner
from tests.support import fakegpu
from tests.support.fakegpu import (
    CAPTURE_GLOBAL,
    CAPTURE_RELAXED,
    FakeGPU,
    Fault,
    scale_body,
)

PAGE = 4096
N = 40_000  # 160 KB of float32: above the lowered MIN_HOLD_BYTES below


@pytest.fixture(autouse=True)
def _small_min(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pincache, "MIN_HOLD_BYTES", 16 * PAGE)


def own_pages(a: np.ndarray) -> np.ndarray:
    """A copy of *a* that is its own memory owner, on pages it shares with nothing (as
    big numpy arrays are: glibc maps them), not starting on a page."""
    raw = np.zeros(a.nbytes + 3 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + PAGE + 16
    out = np.frombuffer(raw.data, a.dtype, count=a.size, offset=start)
    out[...] = a
    return out


def data(n: int = N, seed: int = 0) -> np.ndarray:
    return own_pages(np.random.default_rng(seed).random(n, dtype=np.float32))


def zeros(n: int = N) -> np.ndarray:
    return own_pages(np.zeros(n, np.float32))


def registered_bytes(gpu) -> int:
    return sum(n for n, _flags in gpu.registered.values())


def test_second_call_pins_and_later_calls_reuse_the_registration(gpu):
    x, out = data(), zeros()
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=8 * PAGE, host_threads=2)) as p:
        paths = []
        for _ in range(4):
            out[:] = 0
            p.map(scale_body(gpu, 2.0), x, out)
            np.testing.assert_array_equal(out, x * 2)
            paths.append(p.last_stats.path)
            if len(paths) == 2:
                calls = len(gpu.register_calls)
        assert paths[0] == "in=staged, out=staged"
        assert paths[1:] == ["in=held, out=held"] * 3
        assert len(gpu.register_calls) == calls == 2  # x and out, once each
        assert p.pinned_bytes == registered_bytes(gpu) == x.nbytes + out.nbytes
        assert not gpu.pageable_dma
    assert not gpu.registered  # close() unlocked everything


def test_held_input_is_registered_read_only_capable_and_output_writable(gpu):
    x, out = data(), zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        p.map(scale_body(gpu, 2.0), x, out)
        p.map(scale_body(gpu, 2.0), x, out)
        starts = {ptr: (n, flags) for ptr, n, flags in gpu.register_calls}
        assert starts[x.ctypes.data][0] == x.nbytes
        assert starts[out.ctypes.data][0] == out.nbytes


def test_registration_is_released_when_the_array_dies(gpu):
    out = zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        x = data()
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        start = x.ctypes.data
        assert start in gpu.registered
        del x
        gc.collect()
        assert start not in gpu.registered
        assert p.pinned_bytes == registered_bytes(gpu) > 0  # out is still held


def test_views_of_one_buffer_are_recognised_by_their_owner(gpu):
    base = data(2 * N)
    out = zeros()
    assert memory_owner(base[:N].reshape(-1)) is memory_owner(base)
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), base[:N], out)  # a new view object every call
        assert p.last_stats.path == "in=held, out=held"
    np.testing.assert_array_equal(out, base[:N] * 2)


def test_in_place_map_registers_once(gpu):
    x = data()
    want = x.copy()
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=8 * PAGE, host_threads=2)) as p:
        p.map(scale_body(gpu, 2.0), x, out=x)
        assert p.last_stats.path == "in=staged, out=staged"
        p.map(scale_body(gpu, 2.0), x, out=x)
        assert p.last_stats.path == "in=held, out=held"
        assert len(gpu.register_calls) == 1
    np.testing.assert_array_equal(x, want * 4)
    assert not gpu.registered


def test_budget_evicts_least_recently_used(gpu):
    arrays = [data(seed=i) for i in range(3)]
    out = zeros()
    budget = 2 * (N * 4 + 2 * PAGE)  # room for two arrays
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2, pin_cache_bytes=budget)) as p:
        for _ in range(3):
            for a in arrays:
                p.map(scale_body(gpu, 3.0), a, out)
                np.testing.assert_array_equal(out, a * 3)
                assert registered_bytes(gpu) <= budget
                assert p.pinned_bytes == registered_bytes(gpu)
        assert not gpu.pageable_dma


def test_array_larger_than_the_budget_is_never_held(gpu):
    x, out = data(), zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2, pin_cache_bytes=4 * PAGE)) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=staged, out=staged"
    assert not gpu.register_calls


@pytest.mark.parametrize("kw", [{"pin_cache_bytes": 0}, {"host_path": "staged"}])
def test_off_or_explicit_path_never_holds(gpu, kw):
    x, out = data(), zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2, **kw)) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=staged, out=staged"
        assert p.pinned_bytes == 0
    assert not gpu.register_calls


def test_small_arrays_are_not_held(gpu):
    x = data(100)
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        for _ in range(3):
            np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), x), x * 2)
    assert not gpu.register_calls


def test_refused_registration_stays_staged_and_is_not_retried(gpu):
    gpu.register_error = lambda p, n, flags: 2  # CUDA_ERROR_OUT_OF_MEMORY
    x, out = data(), zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        tries = len(gpu.register_calls)
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x, out)
            np.testing.assert_array_equal(out, x * 2)
        assert p.last_stats.path == "in=staged, out=staged"
    assert tries == len(gpu.register_calls) > 0
    assert not gpu.registered


def test_array_over_a_foreign_buffer_is_held_while_the_array_lives(gpu):
    raw = bytearray(np.arange(N + 2 * PAGE, dtype=np.float32).tobytes())
    x = np.frombuffer(raw, np.float32)
    assert memory_owner(x[5:]) is x
    out = zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x[PAGE : PAGE + N], out)
            np.testing.assert_array_equal(out, x[PAGE : PAGE + N] * 2)
        assert p.last_stats.path == "in=held, out=held"
        start = x[PAGE:].ctypes.data
        assert start in gpu.registered
        del x
        gc.collect()
        assert start not in gpu.registered  # released with the array; raw lives on
    assert len(raw) == (N + 2 * PAGE) * 4


def _row() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``raw`` and three arrays of N back to back in it, each its own memory owner, at
    offsets that are no multiple of a page (heap neighbours): ``before`` shares its
    last page with ``x``, ``x`` its last page with ``after``."""
    raw = np.zeros(3 * N + 2 * PAGE, np.float32)
    s = (-raw.ctypes.data % PAGE) + 16
    before, x, after = (
        np.frombuffer(raw.data, np.float32, count=N, offset=s + i * 4 * N) for i in range(3)
    )
    assert all(a.ctypes.data % PAGE and memory_owner(a) is a for a in (before, x, after))
    x[:] = np.arange(N)
    return raw, before, x, after


def _inside(gpu, *arrays: np.ndarray) -> None:
    """Every registration made so far lies within the bytes of one of *arrays*."""
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays]
    for p, n, _flags in gpu.register_calls:
        assert any(lo <= p and p + n <= hi for lo, hi in spans), (hex(p), n, spans)


@pytest.mark.parametrize("path", ["auto", "register", "split"])
def test_a_registration_covers_only_bytes_of_the_arrays(gpu, path):
    _raw, _before, x, after = _row()
    with Pipeline(
        [0], options=ck.PipelineOptions(chunk_bytes=8 * PAGE, host_threads=2, host_path=path)
    ) as p:
        for _ in range(3):
            after[:] = 0
            p.map(scale_body(gpu, 2.0), x, after)
            np.testing.assert_array_equal(after, np.arange(N, dtype=np.float32) * 2)
        assert gpu.register_calls and (path != "auto" or p.last_stats.path == "in=held, out=held")
        _inside(gpu, x, after)
        if path == "auto":  # held: each array registered byte-exactly, once
            want = sorted((a.ctypes.data, a.nbytes) for a in (x, after))
            assert sorted((q, n) for q, n, _f in gpu.register_calls) == want
        assert not gpu.pageable_dma
    assert not gpu.registered


def _round_trip(p: Pipeline, a: np.ndarray) -> None:
    """A pageable copy of *a* to the device and back by ctxkit, as any library does."""
    want = np.random.default_rng(5).random(a.size, dtype=np.float32).reshape(a.shape)
    a[...] = want
    buf = ck.DeviceBuffer(a.nbytes, context=p.contexts[0])
    buf.copy_from_host(a)
    a[...] = 0
    buf.copy_to_host(a)
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(buf.copy_to_host().view(np.float32).reshape(a.shape), want)
    buf.close()


@pytest.mark.parametrize("side", ["before", "after"])
def test_neighbour_of_a_held_array_is_copied_by_anyone(gpu, side):
    _raw, before, x, after = _row()
    out = zeros()
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=8 * PAGE, host_threads=2)) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=held, out=held"
        _round_trip(p, before if side == "before" else after)  # shares a page with x
        p.map(scale_body(gpu, 3.0), x, out)
        np.testing.assert_array_equal(out, np.arange(N, dtype=np.float32) * 3)


@pytest.mark.parametrize(
    "part", ["whole", "head", "tail", "middle"], ids=lambda part: f"{part}-slice"
)
def test_slices_of_a_held_array_are_copied_by_anyone(gpu, part):
    x, out = data(), zeros()
    piece = {"whole": x, "head": x[:5000], "tail": x[-5000:], "middle": x[3000:-3000]}[part]
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=8 * PAGE, host_threads=2)) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=held, out=held"
        _round_trip(p, piece)  # starts inside the registration: must not run past its end
        p.map(scale_body(gpu, 2.0), x, out)
        np.testing.assert_array_equal(out, x * 2)
        assert not gpu.pageable_dma


def test_a_held_view_keeps_the_rest_of_its_owner_copyable(gpu):
    """A map of ``buf[:N]``: copies of ``buf`` and of views running past the map's
    rows (they start inside what is held) work as before."""
    buf = own_pages(np.arange(2 * N, dtype=np.float32))
    out = zeros()
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=8 * PAGE, host_threads=2)) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), buf[:N], out)
        assert p.last_stats.path == "in=held, out=held"
        assert gpu.register_calls[0][:2] == (buf.ctypes.data, buf.nbytes)
        for view in (buf, buf[N // 2 :], buf[N // 2 : N + 10], buf[N - 1 :]):
            _round_trip(p, view)
        buf[:] = np.arange(2 * N)
        p.map(scale_body(gpu, 2.0), buf[N // 2 : N + N // 2], out)  # inside: still held
        assert p.last_stats.path == "in=held, out=held"
        np.testing.assert_array_equal(out, np.arange(N // 2, N + N // 2, dtype=np.float32) * 2)
        assert not gpu.pageable_dma


def test_neighbours_sharing_pages_are_all_held(gpu):
    _raw, before, x, after = _row()
    with Pipeline([0], options=ck.PipelineOptions(chunk_bytes=8 * PAGE, host_threads=2)) as p:
        for _ in range(3):
            before[:] = after[:] = 0
            p.map(scale_body(gpu, 2.0), x, before)
            p.map(scale_body(gpu, 3.0), x, after)
            np.testing.assert_array_equal(before, np.arange(N, dtype=np.float32) * 2)
            np.testing.assert_array_equal(after, np.arange(N, dtype=np.float32) * 3)
        assert p.last_stats.path == "in=held, out=held"
        spans = sorted((b, b + n) for b, (n, _f) in gpu.registered.items())
        assert spans == [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in (before, x, after)]
        assert not gpu.pageable_dma
    assert not gpu.registered


def test_range_overlapping_a_held_one_further_in_is_staged(gpu):
    raw, _before, x, _after = _row()
    inner = raw[x.ctypes.data // 4 - raw.ctypes.data // 4 + N // 2 :][:N]  # x's second half on
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, zeros())
        assert p.last_stats.path == "in=held, out=staged"
        src = data()
        for _ in range(2):
            inner[:] = 0
            p.map(scale_body(gpu, 2.0), src, inner)
        assert p.last_stats.path == "in=held, out=staged"  # inner is x's pages: not held
        np.testing.assert_array_equal(inner, src * 2)
        assert not gpu.pageable_dma


def test_held_owner_cannot_be_resized(gpu):
    x, out = data(), zeros()
    owner = memory_owner(x)
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=held, out=held"
        with pytest.raises(ValueError, match="resize"):
            owner.resize(2 * owner.size, refcheck=False)  # numpy refuses: weakly referenced


def test_release_pinned_and_finalizer(gpu):
    x, out = data(), zeros()
    p = Pipeline([0], options=ck.PipelineOptions(host_threads=2))
    for _ in range(2):
        p.map(scale_body(gpu, 2.0), x, out)
    held = p.pinned_bytes
    assert held and p.release_pinned() == held and p.pinned_bytes == 0
    assert not gpu.registered
    p.map(scale_body(gpu, 2.0), x, out)
    assert p.last_stats.path == "in=staged, out=staged"  # starts over
    p.map(scale_body(gpu, 2.0), x, out)
    assert gpu.registered
    del p
    gc.collect()
    assert not gpu.registered  # a pipeline never closed unlocks on collection


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1G"])
def test_bad_budget(bad):
    with pytest.raises(ValueError, match="pin_cache_bytes"):
        Pipeline([0], options=ck.PipelineOptions(pin_cache_bytes=bad))


def test_hold_range_runs_from_the_array_to_the_end_of_its_owner():
    buf = np.zeros((100, 10), np.float32)
    p = buf.ctypes.data
    assert hold_range(buf, buf) == (p, p + buf.nbytes)
    assert hold_range(buf[5:20], buf) == (p + 5 * 40, p + buf.nbytes)  # the owner's rest too
    col = buf[:, 3]  # strided: up to the owner's last byte
    assert hold_range(col, buf) == (p + 12, p + buf.nbytes)
    flipped = buf[::-1]  # its first element is the owner's last row
    assert hold_range(flipped[:1], flipped) == (p + 99 * 40, p + buf.nbytes)
    alone = np.frombuffer(bytearray(64), np.uint8, count=16, offset=8)  # owns its view
    assert memory_owner(alone) is alone
    assert hold_range(alone, alone) == (alone.ctypes.data, alone.ctypes.data + 16)


def test_disabled_cache_answers_without_the_driver():
    cache = PinCache()
    assert cache.acquire(data(), [], True, PinClaims(cache, 0)) is None


# --- one budget per process -------------------------------------------------------------------


ONE = N * 4  # the bytes of one array


def leave_room(pipes: list[Pipeline], gpu: Any, nbytes: int) -> int:
    """Stage a first call on each pipeline (its buffers come from the pool), then set
    the process budget to the pool's blocks in use plus *nbytes*; return the budget."""
    for pipe in pipes:
        pipe.map(scale_body(gpu, 1.0), zeros(), zeros())
    pool = ck.pinned_pool()
    budget = pool.stats().in_use_bytes + nbytes
    pool.set_budget(budget)
    return budget


def test_pipelines_share_one_process_budget(gpu):
    arrays = [data(seed=i) for i in range(4)]
    out = zeros()
    pool = ck.pinned_pool()
    with (
        Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p,
        Pipeline([1], options=ck.PipelineOptions(host_threads=2)) as q,
    ):
        budget = leave_room([p, q], gpu, 2 * ONE)  # staging plus two held arrays
        base = gpu.max_registered
        for _ in range(3):
            for i, a in enumerate(arrays):
                pipe = (p, q)[i % 2]
                pipe.map(scale_body(gpu, 2.0), a, out)
                np.testing.assert_array_equal(out, a * 2)
                assert registered_bytes(gpu) <= 2 * ONE  # not 2 x the budget
                stats = pool.stats()
                assert stats.held_bytes <= budget
                assert stats.claimed_bytes == registered_bytes(gpu)
        assert 0 < max(p.pinned_bytes, q.pinned_bytes) <= registered_bytes(gpu)
    assert max(base, gpu.max_registered) <= 2 * ONE
    assert not gpu.registered and not gpu.pageable_dma
    assert pool.stats().claimed_bytes == 0  # unregistering gave the bytes back


def test_a_registration_serves_every_pipeline_until_the_last_lets_go(gpu):
    x, out = data(), zeros()
    p = Pipeline([0], options=ck.PipelineOptions(host_threads=2))
    q = Pipeline([1], options=ck.PipelineOptions(host_threads=2))
    try:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=held, out=held"
        calls = len(gpu.register_calls)
        q.map(scale_body(gpu, 3.0), x, out)
        assert q.last_stats.path == "in=held, out=held"  # no staging, no second register
        np.testing.assert_array_equal(out, x * 3)
        assert len(gpu.register_calls) == calls
        p.close()
        assert registered_bytes(gpu) == q.pinned_bytes > 0  # q still keeps them
        q.map(scale_body(gpu, 2.0), x, out)
        assert q.last_stats.path == "in=held, out=held" and not gpu.pageable_dma
    finally:
        p.close()
        q.close()
    assert not gpu.registered


def test_pin_cache_bytes_caps_one_pipeline_within_the_process_budget(gpu):
    arrays = [data(seed=i) for i in range(3)]
    one = N * 4
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2, pin_cache_bytes=one)) as p:
        for _ in range(3):
            for a in arrays:
                p.map(scale_body(gpu, 2.0), a, a)  # in place: one range per array
                assert p.pinned_bytes <= one
        assert p.pinned_bytes == registered_bytes(gpu) > 0


def test_registrations_are_claimed_from_the_pinned_pool_and_given_back(gpu):
    x, out = data(), zeros()
    pool = ck.pinned_pool()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=held, out=held"
        assert pool.stats().claimed_bytes == p.pinned_bytes == registered_bytes(gpu) > 0
        p.release_pinned()
        assert pool.stats().claimed_bytes == 0
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        del x
        gc.collect()  # the owner's death unregisters its range and unclaims it
        assert pool.stats().claimed_bytes == registered_bytes(gpu) == p.pinned_bytes > 0
    assert pool.stats().claimed_bytes == 0 and not gpu.registered


def test_a_full_pool_stages_instead_of_holding(gpu):
    x, out = data(), zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        leave_room([p], gpu, 0)
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x, out)
            np.testing.assert_array_equal(out, x * 2)
        assert p.last_stats.path == "in=staged, out=staged"
    assert not gpu.register_calls and ck.pinned_pool().stats().claimed_bytes == 0


def test_room_in_the_pool_is_made_by_releasing_idle_ranges(gpu):
    arrays = [data(seed=i) for i in range(2)]
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        leave_room([p], gpu, ONE)  # one held array
        for _ in range(3):
            for a in arrays:
                p.map(scale_body(gpu, 2.0), a, a)  # in place: one range per array
                assert registered_bytes(gpu) <= ONE
        assert p.last_stats.path == "in=held, out=held"  # the other one was let go
        assert ck.pinned_pool().stats().claimed_bytes == registered_bytes(gpu) > 0


# --- freed memory never stays registered -------------------------------------------------------


class RelaxingGPU(FakeGPU):
    """The simulated GPU plus ``cuThreadExchangeStreamCaptureMode``: as on the driver, a
    thread in relaxed mode may make unsafe calls (``cuMemHostUnregister``) while any
    capture is open, without invalidating it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mode = threading.local()

    def cuThreadExchangeStreamCaptureMode(self, mode: Any) -> tuple[int, Any]:
        previous = getattr(self._mode, "value", CAPTURE_GLOBAL)
        self._mode.value = int(mode)
        return (0, self.CUstreamCaptureMode(previous))

    def unsafe(self, what: str) -> int:
        if getattr(self._mode, "value", CAPTURE_GLOBAL) == CAPTURE_RELAXED:
            return 0
        return super().unsafe(what)


@pytest.fixture
def _relaxing_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fakegpu, "FakeGPU", RelaxingGPU)


@pytest.fixture
def rgpu(_relaxing_gpu: None, gpu: RelaxingGPU) -> RelaxingGPU:
    assert isinstance(gpu, RelaxingGPU)
    return gpu


class ForeignBuffer:
    """Memory that outlives the arrays over it, so a new array lands at the very address
    of a dead one (as numpy's allocator reuses freed memory)."""

    def __init__(self) -> None:
        self.raw = bytearray((N + 2 * PAGE) * 4)
        self.raw[:] = np.arange(N + 2 * PAGE, dtype=np.float32).tobytes()

    def array(self) -> np.ndarray:
        return np.frombuffer(self.raw, np.float32)

    def start(self) -> int:
        return self.array()[PAGE:].ctypes.data


def _hold(gpu, p: Pipeline, owner: np.ndarray, out: np.ndarray) -> None:
    for _ in range(2):
        p.map(scale_body(gpu, 2.0), owner[PAGE : PAGE + N], out)
    assert p.last_stats.path == "in=held, out=held"


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_array_dying_inside_a_capture_is_unregistered_at_once(rgpu, mode):
    mem, out = ForeignBuffer(), zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        x = mem.array()
        _hold(rgpu, p, x, out)
        start = mem.start()
        s = ck.Stream(context=p.contexts[0])
        with ck.capture(s, mode=mode) as graph:
            rgpu.launch(s, lambda: None)
            del x
            gc.collect()
            assert start not in rgpu.registered  # now, not when the capture ends
        assert not rgpu.invalidations, rgpu.invalidations
        assert graph.num_nodes == 1
        assert not ck.is_pinned(mem.array()[PAGE : PAGE + N])  # a new array at that address


def test_array_dying_while_another_thread_captures_globally(rgpu):
    mem, out = ForeignBuffer(), zeros()
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        holder = {"x": mem.array()}
        _hold(rgpu, p, holder["x"], out)
        start = mem.start()
        s = ck.Stream(context=p.contexts[0])
        inside, dropped = threading.Event(), threading.Event()

        def capture() -> None:
            with ck.capture(s, mode="global"):
                rgpu.launch(s, lambda: None)
                inside.set()
                dropped.wait(5)

        t = threading.Thread(target=capture)
        t.start()
        assert inside.wait(5)
        del holder["x"]
        gc.collect()
        registered_during = start in rgpu.registered
        dropped.set()
        t.join()
        assert not registered_during and not rgpu.invalidations, rgpu.invalidations
        assert not ck.is_pinned(mem.array()[PAGE : PAGE + N])


def test_poisoned_context_keeps_the_memory_of_pages_it_cannot_unregister(gpu):
    mem, out = ForeignBuffer(), zeros()
    with Pipeline([0, 1], options=ck.PipelineOptions(host_threads=2, chunk_bytes=8 * PAGE)) as p:
        x = mem.array()
        _hold(gpu, p, x, out)
        owner = weakref.ref(x)

        def body(ctx, stream, d_in, d_out, n):
            def bad():
                raise Fault

            gpu.launch(stream, bad)

        with pytest.warns(ck.PinLeakWarning, match="poisoned"):
            with pytest.raises(PipelineError) as info:
                p.map(body, x[PAGE : PAGE + N], out)
        assert info.value.poisoned
        del x
        gc.collect()
        # The pages stay registered, so their memory must never go back to numpy.
        assert owner() is not None and mem.start() in gpu.registered
    assert owner() is not None


def test_every_registration_left_behind_is_warned_about(gpu, monkeypatch):
    monkeypatch.setattr(_pincache, "unregister_pages", lambda start, contexts: 1)
    out = zeros()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own filter: repeats of one line hidden
        with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
            xs = [data(seed=i) for i in range(2)]
            for x in xs:
                for _ in range(2):
                    p.map(scale_body(gpu, 2.0), x, out)
            starts = {f"{a.ctypes.data:#x}" for a in (*xs, out)}
            del x
            xs.clear()
            gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ck.PinLeakWarning)]
    assert len(leaks) == 3, leaks  # both inputs when they died, the output at close
    assert starts == {m.split(" at ")[1].split(" ")[0] for m in leaks}
    assert all("CUresult 1" in m for m in leaks)


def test_a_pipeline_context_cannot_close_under_held_pages(gpu):
    own = ck.Context.create(0)
    x, out = data(), zeros()
    try:
        p = Pipeline([own], options=ck.PipelineOptions(host_threads=2))
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        assert gpu.registered
        with pytest.raises(ck.ContextInUseError):
            own.close()  # the pipeline's threads use it: held pages stay undoable
        p.close()
        assert not gpu.registered  # unregistered before the context may go
    finally:
        own.close()


def test_registering_context_closed_later_unregisters_in_another(gpu):
    own = ck.Context.create(0)
    x, out = data(), zeros()
    p = Pipeline([own], options=ck.PipelineOptions(host_threads=2))
    q = Pipeline([1], options=ck.PipelineOptions(host_threads=2))
    try:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        q.map(scale_body(gpu, 2.0), x, out)  # q keeps the ranges p registered
        p.close()
        assert gpu.registered and q.pinned_bytes
        own.close()  # its registrations go with it: undone first, q lets go
        assert not gpu.registered and not q.pinned_bytes
        for _ in range(2):
            q.map(scale_body(gpu, 2.0), x, out)  # held again, in q's context
        assert gpu.registered and q.pinned_bytes
        start = x.ctypes.data
        del x
        gc.collect()
        assert start not in gpu.registered
    finally:
        p.close()
        q.close()
        own.close()
    assert not gpu.registered


def test_register_host_of_a_held_array_takes_its_pages_over(gpu):
    """The caller's ck.register_host of a view inside a range pin on reuse holds (the
    view's first byte looks page-locked, its last too) registers the view itself: the
    hold lets go first."""
    x = data(10 * PAGE)
    raw = np.zeros(41 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE
    out = raw[start : start + 40 * PAGE].view(np.float32)
    with Pipeline([0], options=ck.PipelineOptions(host_threads=2)) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path.endswith("out=held")
        with ck.register_host(out):
            assert ck.is_pinned(out)
            staged = ck.PipelineOptions(host_path="staged")
            p.map(scale_body(gpu, 3.0), x, out, options=staged)
            assert p.last_stats.path == "pinned"  # x: still held, so page-locked
            np.testing.assert_array_equal(out, x * 3)
        assert not ck.is_pinned(out)
        assert not gpu.pageable_dma
