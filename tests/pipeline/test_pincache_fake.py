"""Pin on reuse (``Pipeline(pin_cache_bytes=...)``, ``ctxkit.pipeline.pincache``) on a
simulated GPU.

The simulated GPU (tests/support/fakegpu.py) refuses overlapping registrations and records
every DMA from memory that is not page-locked, so these tests fail if a held range is used
after it was released or registered twice.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from ctxkit.pipeline import Pipeline
from ctxkit.pipeline import pincache as _pincache
from ctxkit.pipeline.pincache import PinCache, default_budget, memory_owner
from tests.support.fakegpu import gpu_fixture, scale_body  # noqa: F401

PAGE = 4096
N = 40_000  # 160 KB of float32: above the lowered MIN_HOLD_BYTES below


@pytest.fixture(autouse=True)
def _small_min(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_pincache, "MIN_HOLD_BYTES", 16 * PAGE)


def own_pages(a: np.ndarray) -> np.ndarray:
    """A copy of *a* on pages of its own (a view into a padded buffer), as big numpy
    arrays are (glibc maps them); small heap blocks may share pages with neighbours."""
    raw = np.zeros(a.nbytes + 3 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + PAGE + 16
    out = raw[start : start + a.nbytes].view(a.dtype)
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
    with Pipeline([0, 1], chunk_bytes=8 * PAGE, host_threads=2) as p:
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
        assert p.pinned_bytes == registered_bytes(gpu) >= 2 * x.nbytes
        assert not gpu.pageable_dma
    assert not gpu.registered  # close() unlocked everything


def test_held_input_is_registered_read_only_capable_and_output_writable(gpu):
    x, out = data(), zeros()
    with Pipeline([0], host_threads=2) as p:
        p.map(scale_body(gpu, 2.0), x, out)
        p.map(scale_body(gpu, 2.0), x, out)
        starts = {ptr: (n, flags) for ptr, n, flags in gpu.register_calls}
        assert x.ctypes.data // PAGE * PAGE in starts
        assert out.ctypes.data // PAGE * PAGE in starts


def test_registration_is_released_when_the_array_dies(gpu):
    out = zeros()
    with Pipeline([0], host_threads=2) as p:
        x = data()
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        start = x.ctypes.data // PAGE * PAGE
        assert start in gpu.registered
        del x
        gc.collect()
        assert start not in gpu.registered
        assert p.pinned_bytes == registered_bytes(gpu) > 0  # out is still held


def test_views_of_one_buffer_are_recognised_by_their_owner(gpu):
    base = data(2 * N)
    out = zeros()
    assert memory_owner(base[:N].reshape(-1)) is memory_owner(base)
    with Pipeline([0], host_threads=2) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), base[:N], out)  # a new view object every call
        assert p.last_stats.path == "in=held, out=held"
    np.testing.assert_array_equal(out, base[:N] * 2)


def test_in_place_map_registers_once(gpu):
    x = data()
    want = x.copy()
    with Pipeline([0, 1], chunk_bytes=8 * PAGE, host_threads=2) as p:
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
    with Pipeline([0], host_threads=2, pin_cache_bytes=budget) as p:
        for _ in range(3):
            for a in arrays:
                p.map(scale_body(gpu, 3.0), a, out)
                np.testing.assert_array_equal(out, a * 3)
                assert registered_bytes(gpu) <= budget
                assert p.pinned_bytes == registered_bytes(gpu)
        assert not gpu.pageable_dma


def test_array_larger_than_the_budget_is_never_held(gpu):
    x, out = data(), zeros()
    with Pipeline([0], host_threads=2, pin_cache_bytes=4 * PAGE) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=staged, out=staged"
    assert not gpu.register_calls


@pytest.mark.parametrize("kw", [{"pin_cache_bytes": 0}, {"host_path": "staged"}])
def test_off_or_explicit_path_never_holds(gpu, kw):
    x, out = data(), zeros()
    with Pipeline([0], host_threads=2, **kw) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=staged, out=staged"
        assert p.pinned_bytes == 0
    assert not gpu.register_calls


def test_small_arrays_are_not_held(gpu):
    x = data(100)
    with Pipeline([0], host_threads=2) as p:
        for _ in range(3):
            np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), x), x * 2)
    assert not gpu.register_calls


def test_refused_registration_stays_staged_and_is_not_retried(gpu):
    gpu.register_error = lambda p, n, flags: 2  # CUDA_ERROR_OUT_OF_MEMORY
    x, out = data(), zeros()
    with Pipeline([0], host_threads=2) as p:
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
    with Pipeline([0], host_threads=2) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x[PAGE : PAGE + N], out)
            np.testing.assert_array_equal(out, x[PAGE : PAGE + N] * 2)
        assert p.last_stats.path == "in=held, out=held"
        start = x[PAGE:].ctypes.data // PAGE * PAGE
        assert start in gpu.registered
        del x
        gc.collect()
        assert start not in gpu.registered  # released with the array; raw lives on
    assert len(raw) == (N + 2 * PAGE) * 4


def test_neighbour_sharing_a_page_with_a_held_array_is_staged(gpu):
    raw = np.zeros(3 * N + 4 * PAGE, np.float32)
    start = (-raw.ctypes.data % PAGE) // 4
    x = raw[start + 16 : start + 16 + N]  # x and out share the page at x's end
    out = raw[start + 16 + N : start + 16 + 2 * N]
    x[:] = np.arange(N)
    with Pipeline([0], host_threads=2) as p:
        for _ in range(3):
            p.map(scale_body(gpu, 2.0), x, out)
            np.testing.assert_array_equal(out, np.arange(N, dtype=np.float32) * 2)
        assert p.last_stats.path == "in=held, out=staged"
        assert not gpu.pageable_dma


def test_held_owner_cannot_be_resized(gpu):
    x, out = data(), zeros()
    owner = memory_owner(x)
    with Pipeline([0], host_threads=2) as p:
        for _ in range(2):
            p.map(scale_body(gpu, 2.0), x, out)
        assert p.last_stats.path == "in=held, out=held"
        with pytest.raises(ValueError, match="resize"):
            owner.resize(2 * owner.size, refcheck=False)  # numpy refuses: weakly referenced


def test_release_pinned_and_finalizer(gpu):
    x, out = data(), zeros()
    p = Pipeline([0], host_threads=2)
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
        Pipeline([0], pin_cache_bytes=bad)


@pytest.mark.parametrize(("phys_gib", "want_gib"), [(64, 16), (8, 4), (4, 2), (None, 4)], ids=str)
def test_default_budget(monkeypatch, phys_gib, want_gib):
    def sysconf(name: str) -> int:
        if phys_gib is None:
            raise ValueError(name)
        return (phys_gib << 30) // PAGE if name == "SC_PHYS_PAGES" else PAGE

    monkeypatch.setattr(_pincache.os, "sysconf", sysconf)
    assert default_budget() == want_gib << 30


def test_disabled_cache_answers_without_the_driver():
    assert PinCache(0).acquire(data(), None, True) is False  # type: ignore[arg-type]
