"""The verdict lines the benchmark programs print (the format: ``ctxkit/cli/bench.py``).

:class:`Line` and its constructors (:func:`target`, :func:`info`, :func:`check`,
:func:`skipped`, :func:`median_target`, :func:`median_info`) are what the programs print
with; :func:`stat_note` makes their "median of N; best X" notes; :func:`emit` prints them
and gives the program's exit status. ``ctxkit bench`` and ``check_summary.py`` read the
lines back with :func:`ctxkit.cli.bench.parse_line`.

A full run (no ``--quick``) is the evidence: the GPU machine has every baseline (CuPy,
PyTorch, cuda.core), so a comparison whose baseline is missing is a FAIL there
(:func:`missing_baseline`), never a SKIP that reads as a pass. A quick run may leave
comparisons out; they print SKIP, and ``scripts/gpu-check.sh`` counts them. The only SKIPs
a full run expects are those whose reason starts with ``needs <N> GPUs``
(benchmarks/check_summary.py). A target not measured as it is set prints ``NOT MEASURED``
(:func:`not_measured`).
"""

from __future__ import annotations

import math
import operator
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

__all__ = [
    "QUICK",
    "Line",
    "check",
    "emit",
    "fmt_value",
    "info",
    "median",
    "median_info",
    "median_target",
    "missing_baseline",
    "not_measured",
    "skipped",
    "stat_note",
    "target",
]

_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}
_TIGHT_UNITS = frozenset({"", "x", "us", "ms", "s"})


def fmt_value(value: float, unit: str = "") -> str:
    """``40.80 GB/s``, ``1.43x``, ``0.0123ms``: two decimals, or three significant
    digits below 1 (so 0.012 ms does not print as 0.01)."""
    text = f"{value:.2f}" if value == 0 or abs(value) >= 1 else f"{value:.3g}"
    return f"{text}{unit}" if unit in _TIGHT_UNITS else f"{text} {unit}"


@dataclass(frozen=True)
class Line:
    """One verdict line of a benchmark program; see the module docstring for the forms.

    ``op``/``limit`` make it a target (or, with ``kind="check"``, a sanity check);
    without them it is information. A target whose value is ``None`` or NaN (it could not
    be measured) fails. ``reason`` makes it a SKIP line (an optional library or a second
    GPU is missing).
    """

    name: str
    value: float | None
    unit: str = ""
    op: str | None = None
    limit: float | None = None
    note: str = ""
    kind: str = "summary"
    reason: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("summary", "check"):
            raise ValueError(f"kind must be 'summary' or 'check', not {self.kind!r}")
        if (self.op is None) != (self.limit is None):
            raise ValueError("op and limit go together")
        if self.op is not None and self.op not in _OPS:
            raise ValueError(f"op must be one of {sorted(_OPS)}, not {self.op!r}")
        if self.kind == "check" and self.op is None and not self.reason:
            raise ValueError("a check needs op and limit")
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"a line name is one word, not {self.name!r}")

    @property
    def ok(self) -> bool | None:
        """True/False for a target or check, None for information and skips."""
        if self.reason or self.op is None or self.limit is None:
            return None
        if self.value is None or math.isnan(self.value):
            return False
        return _OPS[self.op](self.value, self.limit)

    @property
    def verdict(self) -> str:
        """``PASS``/``FAIL`` (targets), ``ok``/``FAIL`` (checks), ``INFO`` or ``SKIP``."""
        if self.reason:
            return "SKIP"
        ok = self.ok
        if ok is None:
            return "INFO"
        if not ok:
            return "FAIL"
        return "ok" if self.kind == "check" else "PASS"

    def text(self) -> str:
        """The line as printed (always one line: whitespace in notes is collapsed)."""
        head = "CHECK" if self.kind == "check" else "SUMMARY"
        if self.reason:
            return f"{head} {self.name} n/a ({_one_line(self.reason)}) SKIP"
        value = "n/a" if self.value is None else fmt_value(self.value, self.unit)
        if self.op is None or self.limit is None:
            inside = "info" + (f"; {self.note}" if self.note else "")
        elif self.kind == "check":
            inside = f"{self.op} {fmt_value(self.limit, self.unit)}"
            inside += f": {self.note}" if self.note else ""
        else:
            inside = f"target {self.op} {fmt_value(self.limit, self.unit)}"
            inside += f"; {self.note}" if self.note else ""
        return f"{head} {self.name} {value} ({_one_line(inside)}) {self.verdict}"


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def target(
    name: str, value: float | None, op: str, limit: float, unit: str = "", note: str = ""
) -> Line:
    """A performance target: PASS when ``value <op> limit``."""
    return Line(name, value, unit, op, limit, note)


def info(name: str, value: float | None, unit: str = "", note: str = "") -> Line:
    """A reported number without a target."""
    return Line(name, value, unit, note=note)


def check(
    name: str, value: float | None, op: str, limit: float, unit: str = "", what: str = ""
) -> Line:
    """A sanity or correctness check of the measurement: a failure fails the program."""
    return Line(name, value, unit, op, limit, what, kind="check")


def median_target(
    name: str, values: Sequence[float], op: str, limit: float, unit: str = "", what: str = ""
) -> Line:
    """A target decided on the median of *values*, the best of them printed beside
    (best = highest for ``>=`` targets, lowest for ``<=``)."""
    note = stat_note(values, unit, higher_is_better=op == ">=")
    return target(name, median(values), op, limit, unit, f"{what}; {note}" if what else note)


def median_info(
    name: str, values: Sequence[float], unit: str = "", what: str = "", higher: bool = True
) -> Line:
    """Information: the median of *values*, the best of them beside."""
    note = stat_note(values, unit, higher_is_better=higher)
    return info(name, median(values), unit, f"{what}; {note}" if what else note)


def skipped(name: str, reason: str) -> Line:
    """A line that could not be measured here, with the reason."""
    return Line(name, None, reason=reason or "not measured")


def emit(lines: Iterable[Line], file: IO[str] | None = None) -> int:
    """Print *lines*; return 1 when a check failed (the program's exit status), else 0."""
    status = 0
    for line in lines:
        print(line.text(), file=file or sys.stdout, flush=True)
        if line.kind == "check" and line.verdict == "FAIL":
            status = 1
    return status


def median(values: Sequence[float]) -> float:
    """The median of *values* (NaN when there are none)."""
    return statistics.median(values) if values else math.nan


def stat_note(values: Sequence[float], unit: str = "", higher_is_better: bool = True) -> str:
    """``"median of 3; best 41.20 GB/s"``: what a median-decided line prints beside it."""
    if not values:
        return "not measured"
    best = max(values) if higher_is_better else min(values)
    return f"median of {len(values)}; best {fmt_value(best, unit)}"


# --- comparisons a run could not make --------------------------------------------------

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
