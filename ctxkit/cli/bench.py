"""``python -m ctxkit bench``: run the benchmark programs of a source checkout.

Every benchmark program (``benchmarks/bench_<name>.py``) prints its results as verdict
lines, each decided in the program from numbers measured in the same run::

    SUMMARY <name> <value> (target <op> <limit>; <how it was measured>) PASS|FAIL
    SUMMARY <name> <value> (info; <how it was measured>) INFO
    SUMMARY <name> n/a (<why it was not measured>) SKIP
    CHECK <name> <value> (<op> <limit>: <what it guards>) ok|FAIL

A SUMMARY line with a target is a performance goal. A CHECK line guards the measurement
itself (a result was verified, a bandwidth is physically possible, a line measured the
case its name says): a failed check makes the program exit 1, because its numbers cannot
be trusted. The last word of a line is always its verdict, so a log reader needs nothing
more than :func:`parse_line`.

:class:`Line` and its constructors (:func:`target`, :func:`info`, :func:`check`,
:func:`skipped`, :func:`median_target`, :func:`median_info`) are what the benchmark
programs print with; :func:`stat_note` makes their "median of N; best X" notes.
"""

from __future__ import annotations

import argparse
import ast
import math
import operator
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "Line",
    "Verdict",
    "available_benchmarks",
    "benchmark_dir",
    "check",
    "cli_bench",
    "emit",
    "info",
    "median",
    "median_info",
    "median_target",
    "parse_line",
    "run_programs",
    "skipped",
    "stat_note",
    "target",
]

_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}
_TIGHT_UNITS = frozenset({"", "x", "us", "ms", "s"})
VERDICTS = frozenset({"PASS", "FAIL", "INFO", "SKIP", "ok"})


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


# --- reading verdict lines -------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """A verdict line read back from a log: ``kind`` is ``SUMMARY`` or ``CHECK``."""

    kind: str
    name: str
    verdict: str
    text: str

    @property
    def failed(self) -> bool:
        """A target missed or a check violated."""
        return self.verdict == "FAIL"


def parse_line(line: str) -> Verdict | None:
    """The verdict of one log line, or None when it is not a verdict line."""
    parts = line.split()
    if len(parts) < 3 or parts[0] not in ("SUMMARY", "CHECK"):
        return None
    word = parts[-1]
    return Verdict(parts[0], parts[1], word if word in VERDICTS else "INFO", line.rstrip())


# --- the command -------------------------------------------------------------------------


def benchmark_dir() -> Path | None:
    """The ``benchmarks/`` folder of the source checkout this package runs from, or None
    (a wheel install: site-packages has no ``pyproject.toml`` beside the package)."""
    root = Path(__file__).resolve().parents[2]
    d = root / "benchmarks"
    return d if d.is_dir() and (root / "pyproject.toml").is_file() else None


def available_benchmarks(directory: Path | None = None) -> dict[str, Path]:
    """``{name: path}`` of ``bench_<name>.py`` in *directory* (default: the checkout's)."""
    d = directory if directory is not None else benchmark_dir()
    if d is None:
        return {}
    return {p.stem[len("bench_") :]: p for p in sorted(d.glob("bench_*.py"))}


def describe(path: Path) -> str:
    """The first line of a benchmark's docstring (read without importing it)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError, ValueError):
        return ""
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""


_NO_CHECKOUT = (
    "ctxkit bench: the benchmarks need a source checkout (they are not in the wheel): "
    "git clone the ctxkit repository and run `python -m ctxkit bench` from it"
)


def cli_bench(args: argparse.Namespace, gpu_problem: Callable[[], str | None]) -> int:
    """``python -m ctxkit bench [--list] [--quick] [names]``.

    The request is checked before the GPU: ``--list``, an unknown name and a wheel
    install (no ``benchmarks/``) are answered on any machine. *gpu_problem* returns a
    one-line reason when no GPU can be used (then exit 2).
    """
    found = available_benchmarks()
    if not found:
        print(_NO_CHECKOUT, file=sys.stderr)
        return 1
    if getattr(args, "list", False):
        width = max(map(len, found))
        for name, path in found.items():
            print(f"{name:{width}s}  {describe(path)}".rstrip())
        return 0
    names = list(getattr(args, "names", None) or found)
    unknown = [n for n in names if n not in found]
    if unknown:
        print(
            f"ctxkit bench: unknown benchmark(s) {', '.join(unknown)}; "
            f"available: {', '.join(found)} (see --list)",
            file=sys.stderr,
        )
        return 1
    reason = gpu_problem()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    return run_programs({n: found[n] for n in names}, quick=bool(getattr(args, "quick", False)))


def run_one(path: Path, quick: bool) -> tuple[int, list[Verdict]]:
    """Run one benchmark program, echoing its output; its exit status and verdicts."""
    env = dict(os.environ)
    root = str(path.resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, str(path), *(["--quick"] if quick else [])]
    verdicts: list[Verdict] = []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            v = parse_line(line)
            if v is not None:
                verdicts.append(v)
        rc = proc.wait()
    return rc, verdicts


def run_programs(programs: dict[str, Path], quick: bool = False) -> int:
    """Run each program; 1 when one exited non-zero or printed a FAIL line, else 0."""
    problems: list[str] = []
    for name, path in programs.items():
        print(f"== {name}", flush=True)
        rc, verdicts = run_one(path, quick)
        problems += [f"{name}: {v.text}" for v in verdicts if v.failed]
        if rc:
            problems.append(f"{name}: exited with status {rc}")
        elif not verdicts:
            problems.append(f"{name}: printed no SUMMARY line")
    if problems:
        print(f"\nctxkit bench: {len(problems)} problem(s):")
        for p in problems:
            print(f"  {p}")
        return 1
    print(f"\nctxkit bench: {len(programs)} benchmark(s), no FAIL line")
    return 0
