"""``python -m ctxkit demo --quick`` on a real GPU: every variant verified against numpy,
the table printed (peers or a skip line for each), both traces written."""

from __future__ import annotations

from ctxkit.cli.demo import LABELS
from tests.support.helpers import run_python


def test_quick_demo_prints_the_table_and_writes_both_traces(tmp_path):
    trace = tmp_path / "demo.json"
    res = run_python(
        "-m", "ctxkit", "demo", "--quick", "--devices", "1", "--trace", str(trace), timeout=600
    )
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "OK: every result matches numpy exactly" in out and "VERIFY FAILED" not in out
    for key in ("naive", "first_call", "fresh", "repeated", "pinned"):
        assert LABELS[key] in out, key
    for key, skip in (("cupy", "skipped: CuPy"), ("torch_pinned", "skipped: torch rows")):
        assert LABELS[key] in out or skip in out, key
    assert trace.exists() and (tmp_path / "demo-first-call.json").exists()
    print(out)
