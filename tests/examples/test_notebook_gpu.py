"""The tour notebook (examples/notebooks/tour.ipynb) runs top to bottom on a GPU.

With nbclient, nbformat and an IPython kernel installed it is executed the way Jupyter
does. Without them (the GPU machines have no Jupyter), its code cells are executed in
order with plain ``exec`` in one namespace, in a fresh Python process: the same code, the
same order, no notebook machinery. The notebook has no magics (``%``/``!`` lines;
tests/examples/test_examples.py checks that), so both runs execute the same Python.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "notebooks" / "tour.ipynb"

#: Runs every code cell of the notebook named in argv[1], in order, in one namespace.
EXEC_CELLS = """
import json, sys
cells = json.load(open(sys.argv[1], encoding="utf-8"))["cells"]
ns = {"__name__": "__main__"}
for i, cell in enumerate(cells):
    if cell["cell_type"] != "code":
        continue
    source = "".join(cell["source"])
    print(f"--- cell {i}", flush=True)
    exec(compile(source, f"<tour.ipynb cell {i}>", "exec"), ns)
print("--- all cells ran", flush=True)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _have_jupyter() -> bool:
    return all(importlib.util.find_spec(m) for m in ("nbclient", "nbformat", "ipykernel"))


def test_tour_notebook_runs(tmp_path: Path) -> None:
    if _have_jupyter():
        _run_with_nbclient(tmp_path)
    else:
        _run_cells_with_exec(tmp_path)


def _run_cells_with_exec(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", EXEC_CELLS, str(NOTEBOOK)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    print(out)
    assert proc.returncode == 0, f"the notebook failed (exit {proc.returncode}):\n{out[-6000:]}"
    assert "Traceback" not in out
    assert "tour done" in proc.stdout and proc.stdout.rstrip().endswith("--- all cells ran")


def _run_with_nbclient(tmp_path: Path) -> None:
    import nbclient
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail(f"the notebook failed:\n{exc}")
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    text = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream"
    )
    assert "tour done" in text, text[-3000:]
