"""What every benchmark program prints for a comparison it could not make (used by
benchmarks/bench_*.py; not a benchmark).

A full run (no ``--quick``) is the evidence: the GPU machine has every baseline (CuPy,
PyTorch, cuda.core), so a comparison whose baseline is missing is a FAIL there, never a
SKIP that reads as a pass. A quick run may leave comparisons out; they print SKIP, and
``scripts/gpu-check.sh`` counts them. The only SKIPs a full run expects are those whose
reason starts with ``needs <N> GPUs`` (this machine has fewer): see
benchmarks/check_summary.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ctxkit.cli.bench import Line, skipped, target

#: The key of a benchmark's measurements that says the run was ``--quick``.
QUICK = "quick"


def missing_baseline(
    r: Mapping[str, Any], name: str, op: str, limit: float, unit: str, reason: str
) -> Line:
    """The target line *name* (``value <op> limit``) when its baseline could not be
    measured (*reason*): a SKIP in a quick run, a FAIL in a full one."""
    if r.get(QUICK):
        return skipped(name, f"{reason}; comparison not made (quick run)")
    return target(name, None, op, limit, unit, f"baseline missing in a full run: {reason}")


def not_measured(name: str, why: str) -> Line:
    """A target this run did not measure as it is set (a quick run's smaller arrays,
    a section only a full run makes): a SKIP reading ``NOT MEASURED``, never a PASS."""
    return skipped(name, f"NOT MEASURED: {why}")
