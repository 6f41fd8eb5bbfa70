"""The summary and exit status of ``scripts/gpu-check.sh`` (run by it; not a benchmark).

    python3 benchmarks/check_summary.py --out DIR --tests-rc RC --demo-rc RC [--full-rc RC]
                                        [--quick] [--no-fail-on-bench]

Reads what the check left in ``DIR``: ``junit.xml`` (the GPU test selection),
``full-junit.xml`` (the README's test command, ``FULL=1``) and ``bench.log`` (every
benchmark's output between ``SUMMARY-BEGIN bench_<name>`` and ``SUMMARY-RC bench_<name>
<status>`` lines). Prints the summary table, then every problem, and exits 1 when there is
one: a test run that failed, a demo that failed, a benchmark that exited non-zero or
printed no verdict line, a target that FAILed or a CHECK that was violated, and in a full
run (no ``--quick``) a SKIP it does not expect. A full run expects only the SKIPs of
hardware this machine lacks: their reason starts with ``needs <N> GPUs`` (the 2-GPU
scaling and peer-copy lines on one GPU). Every other SKIP (a missing CuPy, torch or
cuda.core, a target NOT MEASURED) is a comparison the run did not make: allowed in a
quick run, which prints how many. ``--no-fail-on-bench`` lists the benchmark problems
without counting them (exploration). An rc of ``skipped`` means the step did not run.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from ctxkit.cli.bench import Verdict, parse_line

#: The SKIPs a full run expects: hardware this machine lacks.
EXPECTED_SKIP = re.compile(r" n/a \(needs \d+ GPUs\b")


def expected_skip(v: Verdict) -> bool:
    """Whether the SKIP line *v* is one a full run expects (:data:`EXPECTED_SKIP`)."""
    return bool(EXPECTED_SKIP.search(v.text))


@dataclass
class BenchRun:
    """One benchmark program's part of ``bench.log``."""

    name: str
    verdicts: list[Verdict] = field(default_factory=list)
    rc: str | None = None

    def not_made(self) -> list[Verdict]:
        """The SKIP lines a full run does not expect: comparisons not made."""
        return [v for v in self.verdicts if v.verdict == "SKIP" and not expected_skip(v)]

    def problems(self, quick: bool = False) -> list[str]:
        out = [f"{self.name}: {v.text}" for v in self.verdicts if v.failed]
        if not quick:
            out += [
                f"{self.name}: {v.text} (a full run expects no such SKIP)" for v in self.not_made()
            ]
        if self.rc is None:
            out.append(f"{self.name}: did not finish (no exit status in the log)")
        elif self.rc != "0":
            out.append(f"{self.name}: exited with status {self.rc}")
        elif not self.verdicts:
            out.append(f"{self.name}: printed no SUMMARY line")
        return out


def read_bench_log(text: str) -> list[BenchRun]:
    """The benchmark runs of a ``bench.log``, in order."""
    runs: list[BenchRun] = []
    current: BenchRun | None = None
    for line in text.splitlines():
        if line.startswith("SUMMARY-BEGIN "):
            current = BenchRun(line.split()[1])
            runs.append(current)
        elif line.startswith("SUMMARY-RC "):
            parts = line.split()
            name = parts[1] if len(parts) > 1 else "?"
            if current is None or current.name != name:
                current = BenchRun(name)
                runs.append(current)
            current.rc = parts[2] if len(parts) > 2 else "?"
            current = None
        else:
            v = parse_line(line)
            if v is None:
                continue
            if current is None:
                current = BenchRun("bench_?")
                runs.append(current)
            current.verdicts.append(v)
    return runs


def junit_counts(path: Path) -> tuple[int, int, int, int] | None:
    """``(passed, failed, errors, skipped)`` of a JUnit XML report, or None if unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = fail = err = skip = 0
    for s in suites:
        total += int(s.get("tests", 0))
        fail += int(s.get("failures", 0))
        err += int(s.get("errors", 0))
        skip += int(s.get("skipped", 0))
    return total - fail - err - skip, fail, err, skip


def pytest_row(label: str, rc: str, report: Path) -> tuple[str, list[str]]:
    """The summary row of a pytest run and its problems."""
    if rc == "skipped":
        return f"{label}: not run", []
    counts = junit_counts(report)
    if counts is None:
        row = f"{label}: no junit report ({report.name}); rc {rc}"
    else:
        passed, fail, err, skip = counts
        row = f"{label}: {passed} passed, {fail + err} failed, {skip} skipped (rc {rc})"
    return row, ([] if rc == "0" else [f"{label.strip()}: pytest exited with status {rc}"])


def summarize(
    out: Path, tests_rc: str, demo_rc: str, full_rc: str, fail_on_bench: bool, quick: bool = False
) -> int:
    """Print the summary of the check in *out*; return the exit status (0 or 1)."""
    problems: list[str] = []
    print("================ ctxkit GPU check summary ================")
    for label, rc, report in (
        ("tests      ", tests_rc, out / "junit.xml"),
        ("full tests ", full_rc, out / "full-junit.xml"),
    ):
        row, found = pytest_row(label, rc, report)
        print(row)
        problems += found
    print(f"demo       : {'not run' if demo_rc == 'skipped' else f'rc {demo_rc}'}")
    if demo_rc not in ("0", "skipped"):
        problems.append(f"demo: exited with status {demo_rc}")
    log = out / "bench.log"
    runs = read_bench_log(log.read_text(errors="replace")) if log.exists() else []
    bench_problems: list[str] = []
    for run in runs:
        for v in run.verdicts:
            print(
                f"bench      : {v.text[len(v.kind) + 1 :]}"
                if v.kind == "SUMMARY"
                else f"bench      : {v.text}"
            )
        bench_problems += run.problems(quick)
    if not runs:
        print("bench      : no benchmark ran")
    expected = [v for run in runs for v in run.verdicts if v.verdict == "SKIP" and expected_skip(v)]
    if expected:
        print(f"skipped    : {len(expected)} line(s) that need more GPUs than this machine has")
    not_made = [v.name for run in runs for v in run.not_made()]
    if not_made and quick:
        print(
            f"not made   : {len(not_made)} comparison(s) or target(s) this quick run did not "
            f"make (SKIP or NOT MEASURED; a full run must): {', '.join(not_made)}"
        )
    counted = problems + (bench_problems if fail_on_bench else [])
    if problems or bench_problems:
        print(f"\nFAILED: {len(problems) + len(bench_problems)} problem(s)")
        for p in problems + bench_problems:
            print(f"  FAIL {p}")
        if bench_problems and not fail_on_bench:
            print(
                f"  ({len(bench_problems)} benchmark problem(s) not counted: "
                "--no-fail-on-bench / NO_FAIL_ON_BENCH=1)"
            )
    elif not_made:
        print(
            "\nOK: every test run, the demo and every benchmark target measured passed; "
            f"{len(not_made)} not made (quick run)"
        )
    else:
        print("\nOK: every test run, the demo and every benchmark target passed")
    return 1 if counted else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="the check's log folder")
    ap.add_argument("--tests-rc", default="skipped")
    ap.add_argument("--demo-rc", default="skipped")
    ap.add_argument("--full-rc", default="skipped")
    ap.add_argument("--quick", action="store_true", help="the benchmarks ran with --quick")
    ap.add_argument("--no-fail-on-bench", action="store_true")
    args = ap.parse_args(argv)
    return summarize(
        args.out, args.tests_rc, args.demo_rc, args.full_rc, not args.no_fail_on_bench, args.quick
    )


if __name__ == "__main__":
    sys.exit(main())
