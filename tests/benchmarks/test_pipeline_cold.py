"""benchmarks/pipeline_cold.py's parent side on the CPU: each cold call runs in a process of
its own, a missing torch is a missing baseline (not an error), a failed or silent child is
an error the CHECK line reports, and only the rounds after the untimed one count. The
children here are stand-ins: the real ones need a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.helpers import load_file_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
cold = load_file_module(BENCH / "pipeline_cold.py", "pipeline_cold_under_test")

STAND_IN = """import json, sys
side, calls = sys.argv[1], {calls!r}
with open(calls, "a") as f:
    f.write(side + "\\n")
n = sum(1 for line in open(calls) if line.strip() == side)
if side.startswith("torch"):
    print(json.dumps({{"missing": "torch is not installed (ModuleNotFoundError)"}}))
    sys.exit(3)
if side == "ctxkit_default_out":
    print("Traceback: boom", file=sys.stderr)
    sys.exit(1)
print(json.dumps({{"side": side, "ms": 100.0 * n, "cached": n != 3, "path": "in=staged"}}))
"""


@pytest.fixture
def command(tmp_path: Path) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(STAND_IN.format(calls=str(tmp_path / "calls.log")))
    return [sys.executable, str(script)]


def test_bench_cold_runs_each_call_in_a_fresh_process_and_sorts_the_answers(
    command, tmp_path, capsys
):
    r: dict = {}
    cold.bench_cold(1 << 20, 3, r, command)
    calls = (tmp_path / "calls.log").read_text().split()
    assert calls.count("ctxkit") == 4  # one untimed round, then 3
    assert calls.count("torch") == 1 and calls.count("torch_pinned") == 1  # asked once
    assert r["cold_ms"] == {"ctxkit": [200.0, 300.0, 400.0]}  # the untimed 100 ms left out
    assert r["cold_missing"] == {
        "torch": "torch is not installed (ModuleNotFoundError)",
        "torch_pinned": "torch is not installed (ModuleNotFoundError)",
    }
    assert (
        len(r["cold_errors"]) == 4
        and "exited with status 1: Traceback: boom" in (r["cold_errors"][0])
    )
    assert r["cold_cached"] is False  # the third ctxkit call compiled
    assert r["cold_gib"] == pytest.approx(1 / 1024)
    assert "300.0 median" in capsys.readouterr().out


def test_a_child_that_answers_nothing_or_hangs_is_an_error(tmp_path):
    script = tmp_path / "silent.py"
    script.write_text("import time, sys\nif sys.argv[1] == 'torch': time.sleep(30)\n")
    answer = cold.run_child("ctxkit", 4096, [sys.executable, str(script)])
    assert "exited with status 0" in answer["error"]
    answer = cold.run_child("torch", 4096, [sys.executable, str(script)], timeout=1)
    assert answer == {"error": "torch: no answer in 1 s"}
