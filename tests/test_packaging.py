"""What a user installs: the sdist's contents, the extras, and a downstream ``mypy --strict``
that sees ctxkit's API the way an installed package shows it."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
#: What the sdist holds besides ctxkit/ and ptx/ (setuptools adds the egg-info files).
SDIST_TOP = {"CHANGELOG.md", "LICENSE", "MANIFEST.in", "PKG-INFO", "README.md", "pyproject.toml"}
SDIST_TOP |= {"setup.cfg"}


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] for r in requirements}


def test_cu12_and_cu13_extras_install_the_same_components() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    cu13 = _names(extras["cu13"])
    cu12 = {n.removesuffix("-cu12") for n in _names(extras["cu12"])}
    assert cu12 == cu13, f"cu12 lacks {cu13 - cu12}, has extra {cu12 - cu13}"


def test_test_extra_has_what_the_documented_commands_use() -> None:
    test = _names(_pyproject()["project"]["optional-dependencies"]["test"])
    assert {"pytest", "pytest-xdist", "pytest-timeout", "build"} <= test


def test_all_is_a_literal_list_of_every_export() -> None:
    import ast

    import ctxkit

    tree = ast.parse((REPO / "ctxkit" / "__init__.py").read_text(encoding="utf-8"))
    (node,) = [
        n
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
    ]
    assert isinstance(node.value, ast.List), "type checkers read only a literal __all__"
    names = [ast.literal_eval(e) for e in node.value.elts]
    assert names == sorted(set(names))
    eager = {
        a.asname or a.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.level == 1
        for a in n.names
    }
    assert set(names) == {*ctxkit._EXPORTS, *eager, "procs", "__version__"}


def _build_sdist(tmp_path: Path) -> Path:
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` package is not installed (it is in the test extra)")
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} is older than pyproject.toml needs")
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git", "*.egg-info", "build", "dist", "__pycache__", ".*cache", "_build", ".venv*"
        ),
    )
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), "."],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    return sdist


def test_sdist_ships_the_package_and_no_stray_files(tmp_path: Path) -> None:
    sdist = _build_sdist(tmp_path)
    with tarfile.open(sdist) as tar:
        names = [m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()]
    top = {n for n in names if "/" not in n}
    folders = {n.split("/", 1)[0] for n in names if "/" in n}
    assert top == SDIST_TOP, f"unexpected: {top ^ SDIST_TOP}"
    assert folders == {"ctxkit", "ptx", "ctxkit_cuda.egg-info"}, folders
    package = {str(p.relative_to(REPO)) for p in (REPO / "ctxkit").rglob("*.py")}
    assert package <= set(names), f"missing: {sorted(package - set(names))}"
    assert "ctxkit/py.typed" in names
    kernels = {f"ptx/{p.name}" for p in (REPO / "ptx").iterdir() if p.suffix in {".cu", ".ptx"}}
    assert kernels <= set(names)


#: The README tour as a downstream program: every name it uses must type-check.
def _readme_tour() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, re.S)[0]


def test_downstream_mypy_strict_sees_the_api(tmp_path: Path) -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it is in the test and dev extras)")
    (tmp_path / "tour.py").write_text(_readme_tour(), encoding="utf-8")
    env = dict(os.environ)
    # A path on sys.path is how a wheel, or `pip install -e . --config-settings
    # editable_mode=strict`, shows ctxkit; mypy reads the package (and py.typed) there.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("MYPYPATH", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            os.devnull,
            "tour.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
