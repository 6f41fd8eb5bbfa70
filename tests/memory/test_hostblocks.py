"""The pinned pool's size classes and default budget (ctxkit/memory/pinned.py; pure,
no driver)."""

from __future__ import annotations

import pytest

from ctxkit.memory import pinned
from ctxkit.memory.pinned import default_budget, size_class

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("nbytes", "cls"),
    [
        (0, 0),
        (1, 4 * KiB),
        (4 * KiB, 4 * KiB),
        (4 * KiB + 1, 8 * KiB),
        (1 * MiB + 1, 2 * MiB),
        (2 * MiB, 2 * MiB),
        (2 * MiB + 1, 4 * MiB),
        (5 * MiB, 6 * MiB),
        (GiB + 3, GiB + 2 * MiB),  # not 2 GiB: large blocks waste under 2 MiB
    ],
)
def test_size_classes(nbytes, cls):
    assert size_class(nbytes) == cls


def test_size_class_refuses_negative_sizes():
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        size_class(-1)


def test_reuse_accepts_blocks_at_most_a_quarter_larger():
    assert pinned.fits(10 * MiB, 10 * MiB)
    assert pinned.fits(12 * MiB, 10 * MiB)  # 12 <= 12.5
    assert not pinned.fits(14 * MiB, 10 * MiB)
    assert not pinned.fits(8 * MiB, 10 * MiB)
    assert not pinned.fits(8 * KiB, 4 * KiB)  # small classes match exactly


def test_default_budget_is_a_quarter_of_memory_capped(monkeypatch):
    monkeypatch.delenv("CTXKIT_PINNED_POOL_BYTES", raising=False)
    monkeypatch.setattr(pinned, "_physical_memory", lambda: 128 * GiB)
    assert default_budget() == 32 * GiB
    monkeypatch.setattr(pinned, "_physical_memory", lambda: 2048 * GiB)
    assert default_budget() == 64 * GiB
    monkeypatch.setattr(pinned, "_physical_memory", lambda: None)
    assert default_budget() == 4 * GiB


def test_the_environment_sets_the_budget(monkeypatch):
    monkeypatch.setenv("CTXKIT_PINNED_POOL_BYTES", " 123456 ")
    assert default_budget() == 123456
    monkeypatch.setenv("CTXKIT_PINNED_POOL_BYTES", "0")
    assert default_budget() == 0


@pytest.mark.parametrize("bad", ["lots", "-5", "1.5e9"])
def test_a_bad_environment_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv("CTXKIT_PINNED_POOL_BYTES", bad)
    with pytest.raises(ValueError, match=r"CTXKIT_PINNED_POOL_BYTES=.*integer >= 0"):
        default_budget()


def test_physical_memory_is_known_here():
    phys = pinned._physical_memory()
    assert phys is None or phys > 64 * MiB
