"""ctxkit.lifetime without a driver: a free a finalizer makes never raises, a refused one
is recorded and warned about once, and a finalizer frees once. (The capture hold-back is
tested with real captures on the simulated GPU: tests/core/test_graph_fake.py.)"""

from __future__ import annotations

import gc
import warnings

import pytest

from ctxkit import lifetime

INVALID_VALUE = 1


@pytest.fixture(autouse=True)
def _fresh_record(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.collect()  # earlier tests' garbage is freed into the real record, not this one
    monkeypatch.setattr(lifetime, "_failed_frees", [])
    monkeypatch.setattr(lifetime, "_warned_failed_free", False)


def cuLibraryUnload(handle: int) -> tuple[int]:  # a context-free driver free that refuses
    return (INVALID_VALUE,)


def test_a_refused_free_is_recorded_and_warned_about_once() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lifetime.free_quietly(None, cuLibraryUnload, 0x10)
        lifetime.free_quietly(None, cuLibraryUnload, 0x20)
    assert [w.category for w in seen] == [ResourceWarning]
    assert "cuLibraryUnload" in str(seen[0].message)
    assert "failed_frees()" in str(seen[0].message)
    failed = lifetime.failed_frees()
    assert [f.function for f in failed] == ["cuLibraryUnload", "cuLibraryUnload"]
    assert all(f.thread == "MainThread" and f.context == 0 for f in failed)
    assert "CUDA_ERROR_INVALID_VALUE" in failed[0].error


def test_any_exception_of_a_free_is_recorded_not_raised() -> None:
    def broken(handle: int) -> None:
        raise RuntimeError("the free itself has a bug")

    with pytest.warns(ResourceWarning):
        lifetime.free_quietly(None, broken, 1)
    assert lifetime.failed_frees()[0].error == "the free itself has a bug"


def test_the_record_keeps_the_first_failures_only() -> None:
    with pytest.warns(ResourceWarning):
        for handle in range(250):
            lifetime.free_quietly(None, cuLibraryUnload, handle)
    failed = lifetime.failed_frees()
    assert 0 < len(failed) < 250
    failed.clear()  # a copy: the record itself is unchanged
    assert lifetime.failed_frees()


def test_a_finalizer_frees_once_when_called_or_collected() -> None:
    freed: list[int] = []

    def free(handle: int) -> tuple[int]:
        freed.append(handle)
        return (0,)

    class Owner:
        pass

    a, b = Owner(), Owner()
    fa = lifetime.finalizer(a, None, free, 1)
    lifetime.finalizer(b, None, free, 2)
    fa()
    fa()
    del a, b
    gc.collect()
    assert freed == [1, 2]
    assert not fa.atexit  # at interpreter exit the process teardown frees
    assert lifetime.failed_frees() == []


def test_without_an_open_capture_nothing_is_held_back() -> None:
    freed: list[int] = []
    lifetime.free_quietly(None, lambda h: freed.append(h), 5)
    assert freed == [5] and lifetime.held_back_frees() == 0
