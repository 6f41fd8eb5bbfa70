"""scripts/gpu-check.sh and its summary (benchmarks/check_summary.py) on canned logs and
stand-in benchmark programs: the exit status is non-zero exactly when a test run, the demo
or a benchmark failed - a missed target, a violated CHECK, a non-zero exit, a benchmark
that printed nothing - and ``--no-fail-on-bench`` relaxes only the benchmark part. No GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import load_file_module

REPO = Path(__file__).resolve().parents[2]
summary = load_file_module(
    REPO / "benchmarks" / "check_summary.py", "check_summary_under_test", register=True
)

PASS = "SUMMARY launch.prepared_vs_cupy 0.63x (target <= 1.00x; medians of 7) PASS"
INFO = "SUMMARY launch.prepared_vs_raw 1.19x (info; void**) INFO"
FAIL = "SUMMARY pipeline.1gpu_first_call_new_pipeline_gbps 4.50 GB/s in+out (target >= 45) FAIL"
CHECK_OK = "CHECK memory.peer_data_ok 1.00 (>= 1.00: the bytes arrived) ok"
CHECK_BAD = "CHECK memory.peer_p2p_gbps 2684.35 GB/s (<= 1000.00 GB/s: waited) FAIL"
SKIP = "SUMMARY pipeline.2gpu_scaling n/a (needs 2 GPUs) SKIP"
NOT_MADE = (
    "SUMMARY launch.prepared_vs_cupy n/a (CuPy 13 is not installed; comparison not made) SKIP"
)
NOT_MEASURED = (
    "SUMMARY pipeline.1gpu_cold_first_call_vs_torch_cold n/a (NOT MEASURED: a quick run) SKIP"
)


def junit(path: Path, tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> None:
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{tests}" '
        f'failures="{failures}" errors="{errors}" skipped="{skipped}"/></testsuites>'
    )


def bench_log(out: Path, *runs: tuple[str, list[str], int | None]) -> None:
    text = []
    for name, lines, rc in runs:
        text += [f"SUMMARY-BEGIN bench_{name}", f"== {name} output", *lines]
        if rc is not None:
            text.append(f"SUMMARY-RC bench_{name} {rc}")
    (out / "bench.log").write_text("\n".join(text) + "\n")


def run_summary(out: Path, *extra: str, tests: str = "0", demo: str = "0") -> tuple[int, str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = summary.main(["--out", str(out), "--tests-rc", tests, "--demo-rc", demo, *extra])
    return rc, buf.getvalue()


@pytest.fixture
def out(tmp_path: Path) -> Path:
    junit(tmp_path / "junit.xml", 10, skipped=1)
    return tmp_path


def test_everything_passing_exits_0_and_shows_every_line(out):
    bench_log(out, ("launch", [PASS, INFO, SKIP], 0), ("memory", [CHECK_OK], 0))
    rc, text = run_summary(out)
    assert rc == 0, text
    assert "tests      : 9 passed, 0 failed, 1 skipped (rc 0)" in text
    for line in (PASS, INFO, SKIP):
        assert "bench      : " + line[len("SUMMARY ") :] in text
    assert "bench      : " + CHECK_OK in text
    assert "FAILED" not in text and text.rstrip().endswith("passed")


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        ((("pipeline", [PASS, FAIL], 0),), f"FAIL bench_pipeline: {FAIL}"),
        ((("memory", [CHECK_OK, CHECK_BAD], 1),), f"FAIL bench_memory: {CHECK_BAD}"),
        ((("launch", [PASS], 1),), "FAIL bench_launch: exited with status 1"),
        ((("launch", [PASS], 124),), "FAIL bench_launch: exited with status 124"),
        ((("procs", ["Traceback (most recent call last):"], 0),), "printed no SUMMARY line"),
        ((("compile", [PASS], None),), "FAIL bench_compile: did not finish"),
    ],
)
def test_a_benchmark_problem_fails_the_check_and_is_listed(out, runs, expected):
    bench_log(out, ("context", [PASS], 0), *runs)
    rc, text = run_summary(out)
    assert rc == 1, text
    assert expected in text.split("FAILED:", 1)[1]
    rc, text = run_summary(out, "--no-fail-on-bench")
    assert rc == 0, text
    assert expected in text and "not counted" in text


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"tests": "1"}, "tests: pytest exited with status 1"),
        ({"demo": "1"}, "demo: exited with status 1"),
    ],
)
def test_tests_and_demo_fail_the_check_even_without_bench_failures(out, kw, expected):
    bench_log(out, ("launch", [PASS], 0))
    for extra in ((), ("--no-fail-on-bench",)):
        rc, text = run_summary(out, *extra, **kw)
        assert rc == 1 and expected in text, text


def test_the_readme_test_run_is_reported_and_counted(out):
    bench_log(out, ("launch", [PASS], 0))
    junit(out / "full-junit.xml", 600, failures=2, skipped=30)
    rc, text = run_summary(out, "--full-rc", "1")
    assert rc == 1
    assert "full tests : 568 passed, 2 failed, 30 skipped (rc 1)" in text
    assert "full tests: pytest exited with status 1" in text
    rc, text = run_summary(out, "--full-rc", "skipped")
    assert rc == 0 and "full tests : not run" in text


def test_a_full_run_fails_on_a_skip_it_does_not_expect(out):
    """Only hardware skips ("needs 2 GPUs") are expected in a full run; a comparison not
    made (a missing baseline, a target NOT MEASURED) fails it (issue 30 item 2)."""
    bench_log(out, ("launch", [PASS, NOT_MADE], 0), ("pipeline", [SKIP, NOT_MEASURED], 0))
    rc, text = run_summary(out)
    assert rc == 1, text
    problems = text.split("FAILED:", 1)[1]
    assert f"FAIL bench_launch: {NOT_MADE} (a full run expects no such SKIP)" in problems
    assert "pipeline.1gpu_cold_first_call_vs_torch_cold" in problems
    assert "pipeline.2gpu_scaling" not in problems
    assert "skipped    : 1 line(s) that need more GPUs than this machine has" in text


def test_a_quick_run_counts_the_comparisons_it_did_not_make(out):
    bench_log(out, ("launch", [PASS, NOT_MADE], 0), ("pipeline", [SKIP, NOT_MEASURED], 0))
    rc, text = run_summary(out, "--quick")
    assert rc == 0, text
    assert "not made   : 2 comparison(s) or target(s) this quick run did not make" in text
    assert "launch.prepared_vs_cupy, pipeline.1gpu_cold_first_call_vs_torch_cold" in text
    assert "every benchmark target measured passed; 2 not made (quick run)" in text
    bench_log(out, ("launch", [PASS, FAIL], 0))
    rc, text = run_summary(out, "--quick")
    assert rc == 1 and f"FAIL bench_launch: {FAIL}" in text  # a quick run still fails on FAIL


def test_every_benchmark_skip_for_missing_hardware_is_expected():
    """The 2-GPU lines of bench_pipeline and bench_memory on one GPU are the SKIPs a full
    run expects; check_summary recognises their reasons."""
    from tests.benchmarks.test_verdicts import memory_good, pipeline_good, verdict_lines

    r = memory_good()
    for key in ("peer", "peer_size", "peer_ok"):
        del r[key]
    r["peer_note"] = "needs 2 GPUs"
    lines = [
        *verdict_lines("pipeline", pipeline_good(two_gpus=False)).values(),
        *verdict_lines("memory", r).values(),
    ]
    skips = [summary.parse_line(ln.text()) for ln in lines if ln.verdict == "SKIP"]
    assert len(skips) == 4 and all(summary.expected_skip(v) for v in skips), skips


def test_skipped_steps_are_not_problems(tmp_path):
    rc, text = run_summary(tmp_path, tests="skipped", demo="skipped")
    assert rc == 0, text
    assert "tests      : not run" in text and "no benchmark ran" in text


def test_a_missing_junit_report_is_shown_with_the_exit_status(tmp_path):
    bench_log(tmp_path, ("launch", [PASS], 0))
    rc, text = run_summary(tmp_path, tests="2")
    assert rc == 1 and "no junit report (junit.xml); rc 2" in text


# --- the script itself, with stand-in benchmark programs -------------------------------


STAND_IN = """import sys
print("args", sys.argv[1:])
for line in {lines!r}:
    print(line)
sys.exit({rc})
"""


def stand_ins(root: Path, **programs: tuple[list[str], int]) -> Path:
    d = root / "benches"
    d.mkdir()
    for name, (lines, rc) in programs.items():
        (d / f"bench_{name}.py").write_text(STAND_IN.format(lines=lines, rc=rc))
    return d


def gpu_check(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    mine = ("ONLY", "BENCH", "QUICK", "FULL", "DEMO", "NO_FAIL_ON_BENCH", "BENCH_DIR")
    e = {k: v for k, v in os.environ.items() if k not in mine and not k.startswith("BENCH_")}
    e.update(OUT=str(root / "out"), ONLY="none", CTXKIT_CACHE_DIR=str(root / "cache"))
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")])
    e.update(env)
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh"), *args],
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )


needs_bash = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash"
)


@needs_bash
def test_script_exits_non_zero_on_a_failed_target_and_lists_it(tmp_path):
    d = stand_ins(tmp_path, good=([PASS], 0), bad=([PASS, FAIL], 0))
    res = gpu_check(tmp_path, BENCH_DIR=str(d))
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"FAIL bench_bad: {FAIL}" in res.stdout
    log = (tmp_path / "out" / "bench.log").read_text()
    assert "SUMMARY-RC bench_good 0" in log and "SUMMARY-RC bench_bad 0" in log
    for relax in ({"NO_FAIL_ON_BENCH": "1"}, {}):
        args = () if relax else ("--no-fail-on-bench",)
        res = gpu_check(tmp_path, *args, BENCH_DIR=str(d), **relax)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "not counted" in res.stdout


@needs_bash
def test_script_passes_when_the_selected_benchmarks_pass(tmp_path):
    d = stand_ins(tmp_path, good=([PASS, INFO], 0), bad=([FAIL], 0))
    res = gpu_check(
        tmp_path, BENCH_DIR=str(d), BENCH="good", QUICK="1", BENCH_ARGS_good="--size-gb 1"
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "args ['--quick', '--size-gb', '1']" in res.stdout
    assert "bench_bad" not in (tmp_path / "out" / "bench.log").read_text()


@needs_bash
def test_script_fails_a_full_run_on_a_comparison_not_made_and_counts_it_in_a_quick_one(tmp_path):
    d = stand_ins(tmp_path, launch=([PASS, NOT_MADE, SKIP], 0))
    res = gpu_check(tmp_path, BENCH_DIR=str(d))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "a full run expects no such SKIP" in res.stdout
    res = gpu_check(tmp_path, BENCH_DIR=str(d), QUICK="1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "not made   : 1 comparison(s)" in res.stdout


@needs_bash
def test_script_exits_non_zero_when_a_benchmark_exits_non_zero(tmp_path):
    d = stand_ins(tmp_path, crash=([PASS], 3))
    res = gpu_check(tmp_path, BENCH_DIR=str(d))
    assert res.returncode == 1
    assert "FAIL bench_crash: exited with status 3" in res.stdout


@needs_bash
def test_script_rejects_unknown_arguments_and_prints_help(tmp_path):
    res = gpu_check(tmp_path, "--bogus")
    assert res.returncode == 2 and "unknown argument" in res.stderr
    res = gpu_check(tmp_path, "--help")
    assert res.returncode == 0 and "--no-fail-on-bench" in res.stdout and "FULL=1" in res.stdout


@needs_bash
def test_a_mistyped_benchmark_name_exits_2_naming_the_valid_ones(tmp_path):
    d = stand_ins(tmp_path, good=([PASS], 0), other=([PASS], 0))
    res = gpu_check(tmp_path, BENCH_DIR=str(d), BENCH="good piepline")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "'piepline'" in res.stderr and "good" in res.stderr and "other" in res.stderr
    assert not (tmp_path / "out" / "bench.log").exists()  # nothing ran
    res = gpu_check(tmp_path, BENCH_DIR=str(d), BENCH="none")
    assert res.returncode == 0, res.stdout + res.stderr
