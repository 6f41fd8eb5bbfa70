"""scripts/run_notebook.py on a small notebook: outputs, results and counts, saved as
nbformat 4; a failing cell writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "run_notebook.py"


def _cell(kind: str, source: str, i: int) -> dict[str, Any]:
    cell: dict[str, Any] = {
        "cell_type": kind,
        "id": f"c{i}",
        "metadata": {},
        "source": source.splitlines(keepends=True),
    }
    if kind == "code":
        cell.update(execution_count=None, outputs=[])
    return cell


def _notebook(path: Path, cells: list[tuple[str, str]]) -> None:
    nb = {
        "cells": [_cell(kind, src, i) for i, (kind, src) in enumerate(cells)],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1), encoding="utf-8")


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": "."}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--plain"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


CELLS = [
    ("markdown", "# A test notebook"),
    ("code", "import os, sys\nx = 40\nprint('hello')\nprint('two\\nlines')"),
    ("code", "x + 2"),
    ("code", "print('to stderr', file=sys.stderr)\nNone"),
    ("code", "for i in range(2):\n    print(i)"),
    ("code", "open('made-here.txt', 'w').write('x')\nos.path.basename(os.getcwd())"),
]


def test_cells_run_in_order_in_one_namespace_and_outputs_are_saved(tmp_path: Path) -> None:
    folder = tmp_path / "nbdir"
    folder.mkdir()
    path = folder / "t.ipynb"
    _notebook(path, CELLS)
    proc = _run(str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4 and [c["id"] for c in nb["cells"]] == [f"c{i}" for i in range(6)]
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == [1, 2, 3, 4, 5]
    assert code[0]["outputs"] == [
        {"output_type": "stream", "name": "stdout", "text": ["hello\n", "two\n", "lines\n"]}
    ]
    assert code[1]["outputs"] == [
        {
            "output_type": "execute_result",
            "execution_count": 2,
            "data": {"text/plain": ["42"]},
            "metadata": {},
        }
    ]
    assert code[2]["outputs"] == [
        {"output_type": "stream", "name": "stderr", "text": ["to stderr\n"]}
    ]
    assert code[3]["outputs"][0]["text"] == ["0\n", "1\n"]
    assert code[4]["outputs"][0]["data"]["text/plain"] == ["'nbdir'"], "cwd: the notebook's"
    assert (folder / "made-here.txt").exists()
    assert nb["cells"][0]["cell_type"] == "markdown" and "outputs" not in nb["cells"][0]


def test_out_writes_elsewhere_and_leaves_the_notebook(tmp_path: Path) -> None:
    path = tmp_path / "t.ipynb"
    _notebook(path, CELLS[:3])
    before = path.read_text(encoding="utf-8")
    proc = _run(str(path), "--out", str(tmp_path / "ran.ipynb"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert path.read_text(encoding="utf-8") == before
    ran = json.loads((tmp_path / "ran.ipynb").read_text(encoding="utf-8"))
    assert ran["cells"][2]["outputs"][0]["data"]["text/plain"] == ["42"]


def test_a_failing_cell_stops_the_run_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t.ipynb"
    _notebook(path, [("code", "print('before')"), ("code", "1 / 0"), ("code", "print('after')")])
    before = path.read_text(encoding="utf-8")
    proc = _run(str(path), cwd=tmp_path)
    assert proc.returncode == 1
    assert "ZeroDivisionError" in proc.stderr and "was not written" in proc.stderr
    assert "after" not in proc.stderr + proc.stdout
    assert path.read_text(encoding="utf-8") == before
