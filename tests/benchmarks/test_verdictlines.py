"""The verdict lines the benchmark programs print (benchmarks/verdictlines.py): targets,
checks, information and skips print their own one-line forms, malformed lines are
refused, and ``ctxkit bench`` reads back what they print. No GPU."""

from __future__ import annotations

import math

import pytest
from verdictlines import Line, check, emit, info, skipped, target

from ctxkit.cli.bench import parse_line


def test_a_target_passes_and_fails_on_its_own_limit():
    assert target("a.b", 46.0, ">=", 45, "GB/s").text() == (
        "SUMMARY a.b 46.00 GB/s (target >= 45.00 GB/s) PASS"
    )
    assert target("a.b", 44.9, ">=", 45, "GB/s").verdict == "FAIL"
    assert target("a.b", 0.85, "<=", 0.85, "x").verdict == "PASS"
    assert target("a.b", 0.86, "<=", 0.85, "x", "medians").text() == (
        "SUMMARY a.b 0.86x (target <= 0.85x; medians) FAIL"
    )


def test_a_target_that_was_not_measured_fails():
    for value in (None, math.nan):
        line = target("a.b", value, ">=", 1, "x")
        assert line.ok is False and line.text().endswith(" FAIL")
    assert target("a.b", None, "<=", 1, "ms").text().startswith("SUMMARY a.b n/a (target")


def test_checks_info_and_skips_print_their_own_forms():
    assert check("a.c", 1, ">=", 1, "", "bytes arrived").text() == (
        "CHECK a.c 1.00 (>= 1.00: bytes arrived) ok"
    )
    assert check("a.c", 0, ">=", 1).text() == "CHECK a.c 0.00 (>= 1.00) FAIL"
    assert info("a.i", 0.0123, "ms", "median of 3").text() == (
        "SUMMARY a.i 0.0123ms (info; median of 3) INFO"
    )
    assert skipped("a.s", "needs\n 2 GPUs").text() == "SUMMARY a.s n/a (needs 2 GPUs) SKIP"


def test_a_line_is_always_one_line_ending_in_its_verdict():
    line = info("a.i", 1.0, "x", "Traceback:\n  File x\n" + "y" * 500)
    text = line.text()
    assert "\n" not in text and text.endswith(") INFO") and len(text) < 400


@pytest.mark.parametrize(
    "make",
    [
        lambda: Line("two words", 1.0),
        lambda: Line("a.b", 1.0, op=">="),
        lambda: Line("a.b", 1.0, op="==", limit=1.0),
        lambda: Line("a.b", 1.0, kind="check"),
        lambda: Line("a.b", 1.0, kind="perf"),
    ],
)
def test_malformed_lines_are_refused(make):
    with pytest.raises(ValueError):
        make()


def test_emit_prints_every_line_and_returns_1_only_for_a_failed_check(capsys):
    good = [target("a.t", 1, ">=", 0), check("a.c", 1, ">=", 1), info("a.i", 2)]
    assert emit([*good, target("a.f", 0, ">=", 1)]) == 0
    assert emit([*good, check("a.bad", 0, ">=", 1)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 8 and out[-1].startswith("CHECK a.bad ")


@pytest.mark.parametrize(
    "line",
    [
        target("a.t", 46.0, ">=", 45, "GB/s in+out", "median of 3; best 50 GB/s"),
        target("a.t", 0.5, "<=", 0.4, "us"),
        check("a.c", 2000, "<=", 1000, "GB/s", "waited"),
        info("a.i", 3.0, "x"),
        skipped("a.s", "CuPy is not installed"),
    ],
)
def test_parse_line_reads_back_what_a_line_prints(line):
    v = parse_line(line.text() + "\n")
    assert v is not None
    assert (v.kind, v.name, v.verdict, v.text) == (
        "CHECK" if line.kind == "check" else "SUMMARY",
        line.name,
        line.verdict,
        line.text(),
    )
    assert v.failed == (line.verdict == "FAIL")
