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

The programs print these lines with ``benchmarks/verdictlines.py`` of the checkout (the
benchmarks are not part of the installed package); this module reads them back.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: what other modules use: ``cli`` runs the command, ``benchmarks/check_summary.py``
#: reads verdict lines back
__all__ = ["Verdict", "cli_bench", "parse_line"]

VERDICTS = frozenset({"PASS", "FAIL", "INFO", "SKIP", "ok"})


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
    return {} if d is None else {p.stem[len("bench_") :]: p for p in sorted(d.glob("bench_*.py"))}


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
    if not (found := available_benchmarks()):
        print(_NO_CHECKOUT, file=sys.stderr)
        return 1
    if getattr(args, "list", False):
        width = max(map(len, found))
        for name, path in found.items():
            print(f"{name:{width}s}  {describe(path)}".rstrip())
        return 0
    names = list(getattr(args, "names", None) or found)
    if unknown := [n for n in names if n not in found]:
        print(
            f"ctxkit bench: unknown benchmark(s) {', '.join(unknown)}; "
            f"available: {', '.join(found)} (see --list)",
            file=sys.stderr,
        )
        return 1
    if reason := gpu_problem():
        print(reason, file=sys.stderr)
        return 2
    return run_programs({n: found[n] for n in names}, quick=bool(getattr(args, "quick", False)))


def run_one(path: Path, quick: bool) -> tuple[int, list[Verdict]]:
    """Run one benchmark program, echoing its output; its exit status and verdicts."""
    root = str(path.resolve().parents[1])
    pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(path), *(["--quick"] if quick else [])]
    verdicts: list[Verdict] = []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            if (v := parse_line(line)) is not None:
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
        print("\n".join(f"  {p}" for p in problems))
        return 1
    print(f"\nctxkit bench: {len(programs)} benchmark(s), no FAIL line")
    return 0
