"""The demo's table on canned numbers (pure functions of ctxkit/cli/demo.py), its
size choice and trace names, and ``ctxkit demo`` on a machine without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

import ctxkit as ck
from ctxkit.cli.demo import (
    LABELS,
    ROW_ORDER,
    Row,
    baseline_row,
    choose_size_mb,
    format_table,
    io_gbps,
    trace_paths,
)
from tests.support.helpers import run_python

GiB = 1 << 30

# One H200, 1 GiB float32 (issue 16's numbers, GB/s in+out).
CANNED = [
    Row("pinned", 1, (91.0, 92.0, 90.5)),
    Row("first_call", 1, (9.3, 13.0, 11.9), "in=staged, out=staged"),
    Row("naive", 1, (10.0, 10.5, 10.2)),
    Row("torch_pinned", 1, (31.6, 30.0, 31.0), "torch 2.5"),
    Row("repeated", 1, (92.0, 91.0, 92.0), "in=held, out=held"),
    Row("cupy", 1, (5.1, 5.0, 4.9)),
    Row("torch", 1, (2.6, 2.5, 2.6)),
    Row("fresh", 1, (24.7, 27.3, 26.0)),
]


def _line(lines: list[str], key: str) -> str:
    (line,) = [ln for ln in lines if LABELS[key] in ln]
    return line


def test_io_gbps_counts_input_and_output_bytes():
    assert io_gbps(GiB, GiB, 2 * GiB / 50e9) == pytest.approx(50.0)
    assert io_gbps(10, 10, 0.0) == 0.0


def test_a_row_reports_its_best_and_median_call():
    r = Row("first_call", 2, (9.3, 13.0, 11.9))
    assert (r.best, r.median) == (13.0, 11.9)
    assert r.label == LABELS["first_call"]
    assert Row("naive", 1, ()).best == 0.0 == Row("naive", 1, ()).median
    assert Row("mine", 1, (1.0,)).label == "mine"


def test_the_baseline_is_torchs_pinned_path_else_the_naive_pattern():
    assert baseline_row(CANNED).key == "torch_pinned"
    without_torch = [r for r in CANNED if not r.key.startswith("torch")]
    assert baseline_row(without_torch).key == "naive"
    assert baseline_row([Row("torch_pinned", 1, ()), *without_torch]).key == "naive"
    assert baseline_row([Row("pinned", 1, (5.0,))]) is None


def test_table_lists_variants_in_order_with_ratios_against_torch_pinned():
    lines = format_table(CANNED, ["CuPy (not installed)"], title="results:")
    assert lines[0] == "results:"
    assert "vs torch pinned" in lines[1] and "best GB/s" in lines[1]
    body = lines[2:-1]
    assert [next(k for k in ROW_ORDER if LABELS[k] in ln) for ln in body] == list(ROW_ORDER)
    first = _line(lines, "first_call")
    assert "13.0" in first and "0.41x" in first  # 13.0 / 31.6
    assert "9.3 13.0 11.9" in first and "(in=staged, out=staged)" in first
    assert "1.00x" in _line(lines, "torch_pinned")
    assert "2.91x" in _line(lines, "repeated")  # 92.0 / 31.6
    assert lines[-1] == "  skipped: CuPy (not installed)"


def test_table_columns_line_up():
    lines = format_table(CANNED)
    header, rows = lines[0], lines[1:]
    col = header.index("GPUs") + len("GPUs")
    assert all(ln[col - 1] == "1" for ln in rows)


def test_table_without_torch_compares_with_the_naive_pattern():
    rows = [r for r in CANNED if not r.key.startswith("torch")]
    lines = format_table(rows)
    assert "vs naive" in lines[0] and "vs torch" not in lines[0]
    assert "8.76x" in _line(lines, "pinned")  # best / best: 92.0 / 10.5
    assert "1.00x" in _line(lines, "naive")


def test_table_without_any_baseline_shows_dashes():
    lines = format_table([Row("pinned", 2, (40.0,))])
    assert lines[1].rstrip().endswith("-  40.0")


@pytest.mark.parametrize(
    ("requested", "quick", "gpu", "host", "want"),
    [
        (None, False, [80 * GiB, 80 * GiB], 128 * GiB, 1024.0),
        (None, False, [80 * GiB, 4 * GiB], 128 * GiB, 256.0),  # one small GPU
        (None, False, [80 * GiB], 8 * GiB, 256.0),  # a small host
        (None, False, [80 * GiB], None, 256.0),  # host memory unknown
        (None, True, [80 * GiB], 128 * GiB, 64.0),
        (512.0, False, [4 * GiB], 8 * GiB, 512.0),  # asked for: taken as given
        (32.0, True, [80 * GiB], 128 * GiB, 32.0),
        (4096.0, True, [80 * GiB], 128 * GiB, 64.0),
    ],
)
def test_size_choice(requested, quick, gpu, host, want):
    assert choose_size_mb(requested, quick, gpu, host) == want


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="--size-mb must be a positive number"):
        choose_size_mb(bad, False, [80 * GiB], 128 * GiB)


def test_trace_paths_put_the_first_call_beside_the_main_trace(tmp_path):
    main, first = trace_paths(str(tmp_path / "t.json"))
    assert main == tmp_path / "t.json" and first == tmp_path / "t-first-call.json"
    assert trace_paths("trace")[1] == Path("trace-first-call.json")


def test_demo_exits_2_without_a_gpu():
    if ck.device_count() > 0:
        pytest.skip("checks the machine-without-GPU path")
    res = run_python("-m", "ctxkit", "demo", "--quick")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("ctxkit: no GPU")
