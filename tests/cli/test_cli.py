"""The ``ctxkit`` command itself: usage, help, --version; and how the package installs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import ctxkit
from ctxkit.cli import build_parser, main, prog_name

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("info", "compile", "demo", "bench")
#: reST that must not reach a terminal: inline literals, roles, emphasis markers.
REST = re.compile(r"``|:(?:class|func|meth|mod|attr|data|exc|obj):`")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, **(env or {})}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "ctxkit", *args],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_help_says_usage_ctxkit_not_python_m() -> None:
    r = run("--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ctxkit "), r.stdout
    assert "python -m" not in r.stdout and "__main__" not in r.stdout
    for cmd in SUBCOMMANDS:
        assert re.search(rf"^\s+{cmd}\s+\S", r.stdout, re.M), f"{cmd} missing:\n{r.stdout}"


@pytest.mark.parametrize("cmd", [None, *SUBCOMMANDS])
def test_help_has_no_rest_markup(cmd: str | None) -> None:
    r = run(*([cmd] if cmd else []), "--help")
    assert r.returncode == 0, r.stderr
    assert not REST.search(r.stdout), f"reST markup in `ctxkit {cmd or ''} --help`:\n{r.stdout}"
    if cmd:
        assert r.stdout.startswith(f"usage: ctxkit {cmd}"), r.stdout


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ctxkit {ctxkit.__version__}"


def test_version_from_python_m() -> None:
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ctxkit {ctxkit.__version__}"


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "COMMAND" in err


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv0", "want"),
    [
        ("/venv/bin/ctxkit", "ctxkit"),
        ("/repo/ctxkit/__main__.py", "ctxkit"),
        ("/repo/ctxkit/cli/__init__.py", "ctxkit"),
        ("-c", "ctxkit"),
        ("", "ctxkit"),
        ("/usr/local/bin/ctxkit-dev", "ctxkit-dev"),
    ],
)
def test_prog_name(argv0: str, want: str) -> None:
    assert prog_name(argv0) == want
    assert build_parser(prog_name(argv0)).prog == want


# --- installing ---------------------------------------------------------------------------


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def project() -> dict:
    return pyproject()["project"]


def test_distribution_is_not_the_unrelated_ctxkit(project: dict) -> None:
    from ctxkit.cli.info import DISTRIBUTION

    # "ctxkit" on the package index is someone else's prompt tool.
    assert project["name"] == DISTRIBUTION != "ctxkit"
    assert project["version"] == ctxkit.__version__


def test_license_is_an_spdx_string_with_the_file(project: dict) -> None:
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert not any(c.startswith("License ::") for c in project["classifiers"])


def test_console_script_is_the_cli(project: dict) -> None:
    import importlib

    module, _, attr = project["scripts"]["ctxkit"].partition(":")
    assert getattr(importlib.import_module(module), attr) is main


def test_every_subpackage_is_packaged() -> None:
    setuptools = pyproject()["tool"]["setuptools"]
    folders = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "ctxkit").rglob("__init__.py")
    }
    missing = folders - set(setuptools["packages"])
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_extras_the_readme_uses_exist(project: dict) -> None:
    extras = set(project["optional-dependencies"])
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    used = {x for group in re.findall(r'"\.\[([a-z0-9,]+)\]"', readme) for x in group.split(",")}
    assert used, "the README shows no install command"
    assert used <= extras, f"README names extras pyproject lacks: {sorted(used - extras)}"


def test_wheel_ships_every_subpackage_the_license_and_kernels(tmp_path: Path) -> None:
    src, dist = tmp_path / "src", tmp_path / "dist"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.cubin")
    for name in ("ctxkit", "ptx"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    log = r.stdout + r.stderr
    if r.returncode and ("No matching distribution found" in log or "name resolution" in log):
        pytest.skip("pip cannot fetch the build backend here (no package index reachable)")
    assert r.returncode == 0, log
    assert "deprecated" not in log.lower(), f"the build printed a deprecation warning:\n{log}"
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for init in (REPO / "ctxkit").rglob("__init__.py"):
        assert init.relative_to(REPO).as_posix() in names, f"{init} is not in the wheel"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "ctxkit/ptx/saxpy.cu" in names and "ctxkit/py.typed" in names
