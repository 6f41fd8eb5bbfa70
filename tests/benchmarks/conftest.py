"""Benchmarks under test run on fakes or canned inputs: the real frameworks (CuPy, PyTorch,
cuda.core, Numba) stay out, also on a machine where they are installed, so a benchmark's
optional comparison rows take their "not installed" branch instead of reaching a GPU."""

from __future__ import annotations

import sys

import pytest

FRAMEWORKS = ("cupy", "torch", "cuda.core", "cuda.core.experimental", "numba")


@pytest.fixture(autouse=True)
def _no_frameworks(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FRAMEWORKS:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
