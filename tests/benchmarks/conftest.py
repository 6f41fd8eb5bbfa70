"""Benchmarks under test run on fakes or canned inputs: the real frameworks (CuPy, PyTorch,
cuda.core, Numba) stay out, also on a machine where they are installed, so a benchmark's
optional comparison rows take their "not installed" branch instead of reaching a GPU.
benchmarks/ is on ``sys.path``, as for a benchmark run as a script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

#: A benchmark imports its sibling modules (verdictlines, pipeline_verdicts) as a script
#: run from benchmarks/ does.
BENCH = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
FRAMEWORKS = ("cupy", "torch", "cuda.core", "cuda.core.experimental", "numba")


@pytest.fixture(autouse=True)
def _no_frameworks(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FRAMEWORKS:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
