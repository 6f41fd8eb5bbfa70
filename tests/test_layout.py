"""The package layout the architecture notes promise (docs/architecture.md): no import
cycles, lazy families, one door to the driver, all public exceptions in errors.py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "ctxkit"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every ctxkit module *name* imports, lazily or not (TYPE_CHECKING blocks aside)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
        else:
            continue
        for t in targets:
            if t in mods and t != name and not name.startswith(t + "."):
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, mods) for m, f in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if n.startswith(m + "."):
                continue  # a package importing its own submodules
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles_lazy_imports_included():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_driver_module_imports_the_driver_bindings():
    offenders = []
    for name, path in _modules().items():
        text = path.read_text()
        if name != "ctxkit._driver" and (
            "cuda.bindings import driver" in text or "cuda.bindings.driver" in text
        ):
            offenders.append(name)
    assert offenders == []


def test_public_exceptions_live_in_errors():
    import ctxkit as ck

    for name in ck.__all__:
        obj = getattr(ck, name)
        if isinstance(obj, type) and issubclass(obj, (Exception, Warning)):
            assert obj.__module__ == "ctxkit.errors", f"{name} is defined in {obj.__module__}"


def test_import_ctxkit_loads_no_family_and_no_driver_call():
    code = (
        "import sys, ctxkit\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('ctxkit.'))\n"
        "print(' '.join(loaded))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    families = ("memory", "compiler", "module", "pipeline", "procs", "cli", "graph", "trace")
    assert not [m for m in out if m.split(".")[1] in families], out


@pytest.mark.parametrize("family", ["memory", "compiler", "module", "pipeline", "procs"])
def test_family_faces_export_what_they_list(family):
    import importlib

    mod = importlib.import_module(f"ctxkit.{family}")
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert missing == []
