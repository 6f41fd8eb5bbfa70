"""``python -m ctxkit bench`` (ctxkit/cli/bench.py) and its reading of verdict lines:
listing and unknown names need no GPU, a wheel install says the benchmarks need a source
checkout, a run fails on a FAIL line or a non-zero exit. No GPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ctxkit.cli import bench
from ctxkit.cli.bench import parse_line

REPO = Path(__file__).resolve().parents[2]


def args(*names: str, listing: bool = False, quick: bool = False) -> argparse.Namespace:
    return argparse.Namespace(names=[*names], list=listing, quick=quick)


def no_gpu_check() -> str | None:
    raise AssertionError("the GPU was checked before the request was")


# --- the command -----------------------------------------------------------------------


def test_list_names_every_benchmark_of_the_checkout_without_a_gpu(capsys):
    assert bench.cli_bench(args(listing=True), no_gpu_check) == 0
    out = capsys.readouterr().out.splitlines()
    expected = sorted(p.stem[len("bench_") :] for p in (REPO / "benchmarks").glob("bench_*.py"))
    assert [line.split()[0] for line in out] == expected
    launch = next(line for line in out if line.startswith("launch "))
    assert "Kernel launch overhead" in launch  # the first line of its docstring


def test_unknown_name_is_reported_before_the_gpu_check(capsys):
    assert bench.cli_bench(args("launch", "nosuch"), no_gpu_check) == 1
    err = capsys.readouterr().err
    assert "unknown benchmark(s) nosuch" in err
    assert "available:" in err and "pipeline" in err and "--list" in err


def test_wheel_install_says_the_benchmarks_need_a_source_checkout(monkeypatch, capsys):
    monkeypatch.setattr(bench, "benchmark_dir", lambda: None)
    for request in (args(listing=True), args(), args("launch")):
        assert bench.cli_bench(request, no_gpu_check) == 1
        assert "need a source checkout" in capsys.readouterr().err


def test_a_benchmarks_folder_in_site_packages_is_not_a_checkout(tmp_path, monkeypatch):
    """Some other wheel may install a top-level ``benchmarks/``: without the checkout's
    pyproject.toml beside the package it is not ours."""
    site = tmp_path / "site-packages"
    (site / "ctxkit" / "cli").mkdir(parents=True)
    (site / "benchmarks").mkdir()
    (site / "benchmarks" / "bench_other.py").write_text("")
    monkeypatch.setattr(bench, "__file__", str(site / "ctxkit" / "cli" / "bench.py"))
    assert bench.benchmark_dir() is None
    (site / "pyproject.toml").write_text("")
    assert bench.benchmark_dir() == site / "benchmarks"


def test_no_gpu_exits_2_with_the_reason(capsys):
    reason = "ctxkit: no GPU: the NVIDIA driver loaded but reports no CUDA device"
    assert bench.cli_bench(args("launch"), lambda: reason) == 2
    assert capsys.readouterr().err.strip() == reason


STAND_IN = """import sys
print("quick" if "--quick" in sys.argv else "full")
for line in {lines!r}:
    print(line)
sys.exit({rc})
"""


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    d = tmp_path / "benchmarks"
    d.mkdir()

    def add(name: str, lines: list[str], rc: int = 0, doc: str = "") -> None:
        head = f'"""{doc}"""\n' if doc else ""
        (d / f"bench_{name}.py").write_text(head + STAND_IN.format(lines=lines, rc=rc))

    monkeypatch.setattr(bench, "benchmark_dir", lambda: d)
    return add


PASS = "SUMMARY x.ok 1.00x (target <= 2.00x) PASS"
FAIL = "SUMMARY x.slow 3.00x (target <= 2.00x) FAIL"
BAD_CHECK = "CHECK x.sane 2000.00 GB/s (<= 1000.00 GB/s: waited) FAIL"


def test_a_run_passes_when_every_program_passes(checkout, capsys):
    checkout("a", [PASS], doc="First benchmark.\n\nMore text.")
    checkout("b", [PASS, "SUMMARY x.info 2.00x (info) INFO"])
    assert bench.cli_bench(args(quick=True), lambda: None) == 0
    out = capsys.readouterr().out
    assert out.count("quick") == 2 and PASS in out
    assert "2 benchmark(s), no FAIL line" in out
    assert bench.cli_bench(args(listing=True), no_gpu_check) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["a", "First", "benchmark."]


@pytest.mark.parametrize(
    ("lines", "rc", "problem"),
    [
        ([PASS, FAIL], 0, f"slow: {FAIL}"),
        ([PASS, BAD_CHECK], 1, f"slow: {BAD_CHECK}"),
        ([PASS], 3, "slow: exited with status 3"),
        (["no verdicts at all"], 0, "slow: printed no SUMMARY line"),
    ],
)
def test_a_run_fails_on_a_fail_line_or_a_bad_exit(checkout, capsys, lines, rc, problem):
    checkout("fine", [PASS])
    checkout("slow", lines, rc)
    assert bench.cli_bench(args(), lambda: None) == 1
    out = capsys.readouterr().out
    assert problem in out.split("problem(s):", 1)[1]
    assert bench.cli_bench(args("fine"), lambda: None) == 0


def test_main_bench_list_needs_no_gpu(capsys):
    """Needs ``--list`` in the ``bench`` parser and ``cmd_bench`` calling ``cli_bench``."""
    from ctxkit.cli import main

    assert main(["bench", "--list"]) == 0
    assert "pipeline" in capsys.readouterr().out.split()


def test_main_bench_unknown_name_is_reported_before_the_gpu_check(capsys):
    from ctxkit.cli import main

    assert main(["bench", "nosuch"]) == 1
    assert "unknown benchmark(s) nosuch" in capsys.readouterr().err


# --- reading verdict lines ---------------------------------------------------------


def test_parse_line_ignores_other_output():
    for text in ("", "SUMMARY", "SUMMARY-RC bench_x 0", "  ctxkit_1gpu 41 GB/s", "CHECKED x y"):
        assert parse_line(text) is None
    assert parse_line("SUMMARY old.line 1.2x (info)").verdict == "INFO"
