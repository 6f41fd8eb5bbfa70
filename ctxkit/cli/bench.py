"""``python -m ctxkit bench``: run the benchmark programs of a source checkout."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def benchmark_dir() -> Path | None:
    """The ``benchmarks/`` folder next to the package (source checkouts only)."""
    d = Path(__file__).resolve().parents[2] / "benchmarks"
    return d if d.is_dir() else None


def run_benchmarks(args: argparse.Namespace) -> int:
    """Run ``benchmarks/bench_<name>.py`` for each requested name (all by default)."""
    d = benchmark_dir()
    if d is None:
        print(
            "ctxkit bench: the benchmarks ship with the source checkout, not the wheel",
            file=sys.stderr,
        )
        return 1
    available = {p.stem[len("bench_") :]: p for p in sorted(d.glob("bench_*.py"))}
    names = args.names or list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        print(
            f"ctxkit bench: unknown benchmark(s) {unknown}; available: {sorted(available)}",
            file=sys.stderr,
        )
        return 1
    worst = 0
    for name in names:
        cmd = [sys.executable, str(available[name]), *(["--quick"] if args.quick else [])]
        print(f"== {name}", flush=True)
        worst = max(worst, subprocess.call(cmd))
    return worst
