"""Run a notebook's code cells in order and save it with their outputs (nbformat 4).

    PYTHONPATH=. python3 scripts/run_notebook.py examples/notebooks/tour.ipynb

With nbclient, nbformat and ipykernel installed, the notebook runs in a Jupyter kernel.
Without them (the GPU machines have no Jupyter), its code cells run here, in order, in one
namespace, with the notebook's folder as the working directory, as Jupyter would run them:
each cell's stdout and stderr are captured, and the repr of a value its last line computes
is its result (``None`` shows nothing). The notebook is written back (or to ``--out``) with
the outputs and execution counts 1, 2, ...; cell ids, sources and metadata are kept. A
cell that raises stops the run: its traceback is printed and nothing is written (exit 1).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any


def _lines(text: str) -> list[str]:
    """nbformat's multi-line string: a list of lines that keep their newlines."""
    return text.splitlines(keepends=True)


def _stream(name: str, text: str) -> dict[str, Any]:
    return {"output_type": "stream", "name": name, "text": _lines(text)}


def _result(count: int, value: Any) -> dict[str, Any]:
    return {
        "output_type": "execute_result",
        "execution_count": count,
        "data": {"text/plain": _lines(repr(value))},
        "metadata": {},
    }


def run_cell(source: str, ns: dict[str, Any], count: int, name: str) -> list[dict[str, Any]]:
    """Execute one cell's *source* in *ns*; return its outputs (nbformat 4 dicts).

    Raises whatever the cell raises; its output so far is on the exception's
    ``cell_outputs`` attribute.
    """
    tree = ast.parse(source, filename=name)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    out, err = io.StringIO(), io.StringIO()
    value = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(tree, name, "exec"), ns)
            if last is not None:
                value = eval(compile(last, name, "eval"), ns)
    except BaseException as exc:
        exc.cell_outputs = _outputs(out.getvalue(), err.getvalue())  # type: ignore[attr-defined]
        raise
    outputs = _outputs(out.getvalue(), err.getvalue())
    if value is not None:
        outputs.append(_result(count, value))
    return outputs


def _outputs(stdout: str, stderr: str) -> list[dict[str, Any]]:
    return [_stream(n, t) for n, t in (("stdout", stdout), ("stderr", stderr)) if t]


def execute_plain(nb: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run *nb*'s code cells in order in one namespace; return it with outputs."""
    ns: dict[str, Any] = {"__name__": "__main__"}
    count = 0
    old = Path.cwd()
    os.chdir(workdir)
    try:
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            count += 1
            source = "".join(cell["source"])
            print(f"--- cell {i} [{count}]", file=sys.stderr, flush=True)
            cell["outputs"] = run_cell(source, ns, count, f"<cell {i}>")
            cell["execution_count"] = count
            for o in cell["outputs"]:
                text = o.get("text") or o.get("data", {}).get("text/plain", [])
                sys.stderr.write("".join(text))
    finally:
        os.chdir(old)
    return nb


def execute_with_jupyter(path: Path, timeout: int) -> dict[str, Any]:
    """Run the notebook in a Jupyter kernel (nbclient); return it with outputs."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return json.loads(nbformat.writes(nb))


def have_jupyter() -> bool:
    return all(importlib.util.find_spec(m) for m in ("nbclient", "nbformat", "ipykernel"))


def write(nb: dict[str, Any], path: Path) -> None:
    text = json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True)
    path.write_text(text + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("notebook", type=Path)
    p.add_argument("--out", type=Path, help="where to write it (default: over the notebook)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell (Jupyter only)")
    p.add_argument(
        "--plain", action="store_true", help="run the cells here even where Jupyter is installed"
    )
    args = p.parse_args(argv)
    path = args.notebook.resolve()
    # The cells import ctxkit from PYTHONPATH=. after the working directory changed.
    sys.path[:] = [os.path.abspath(e) if e else e for e in sys.path]
    if os.environ.get("PYTHONPATH"):
        parts = os.environ["PYTHONPATH"].split(os.pathsep)
        os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(e) for e in parts if e)
    try:
        if have_jupyter() and not args.plain:
            nb = execute_with_jupyter(path, args.timeout)
        else:
            nb = execute_plain(json.loads(path.read_text(encoding="utf-8")), path.parent)
    except Exception as exc:
        for o in getattr(exc, "cell_outputs", []):
            sys.stderr.write("".join(o["text"]))
        traceback.print_exc()
        print(f"{path.name}: a cell failed; the notebook was not written", file=sys.stderr)
        return 1
    write(nb, args.out or path)
    cells = sum(c["cell_type"] == "code" for c in nb["cells"])
    print(f"{path.name}: {cells} code cells ran; written to {args.out or path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
