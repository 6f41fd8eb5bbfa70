"""Examples and reliability scripts on a machine without a GPU: exit 2, one line, no traceback.

Also: every example answers ``--help`` anywhere, imports ctxkit itself and uses public names
only; the helpers of ``examples/_common.py`` (result checks exit 1 on a wrong result); the
shell scripts' syntax.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import GPU_COUNT
from tests.support.helpers import load_file_module

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.py") if not p.name.startswith("_"))

no_gpu_only = pytest.mark.skipif(GPU_COUNT > 0, reason="checks the behaviour without a GPU")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def _assert_no_gpu_exit(proc: subprocess.CompletedProcess[str], what: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"{what}: exit {proc.returncode}\n{out}"
    assert "Traceback" not in out, f"{what} printed a traceback:\n{out}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"{what}: expected one line on stderr, got:\n{proc.stderr}"
    assert "no GPU" in lines[0], lines[0]


def test_every_pattern_has_an_example() -> None:
    names = {p.name for p in EXAMPLES}
    mine = {
        "multi_device_streams.py",
        "unified_memory.py",
        "cross_device_dependency.py",
        "explicit_contexts.py",
        "thread_pool_server.py",
        "peer_copy.py",
        "framework_interop.py",
    }
    assert mine <= names, f"missing examples: {sorted(mine - names)}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_has_a_pattern_header(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.startswith('"""'), f"{path.name} has no header docstring"
    assert 'if __name__ == "__main__":' in text


@no_gpu_only
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_exits_2_without_gpu(path: Path) -> None:
    _assert_no_gpu_exit(_run([sys.executable, str(path)]), path.name)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_answers_help_on_any_machine(path: Path) -> None:
    proc = _run([sys.executable, str(path), "--help"])
    assert proc.returncode == 0, f"{path.name} --help: exit {proc.returncode}\n{proc.stderr}"
    assert proc.stdout.startswith("usage: "), proc.stdout
    assert "no GPU" not in proc.stderr and "Traceback" not in proc.stderr


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_imports_ctxkit_itself(path: Path) -> None:
    tree = _tree(path)
    direct = [
        a.asname or a.name
        for node in tree.body
        if isinstance(node, ast.Import)
        for a in node.names
        if a.name == "ctxkit"
    ]
    assert direct, f"{path.name}: no top-level `import ctxkit as ck`"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "_common":
            got = {a.name for a in node.names} & {"ck", "ctxkit"}
            assert not got, f"{path.name} takes ctxkit from _common ({got}): import it itself"


def _chain(node: ast.Attribute) -> list[str] | None:
    """``ck.a.b`` -> ``["ck", "a", "b"]``; ``None`` when it does not start at a name."""
    parts: list[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    if not isinstance(cur, ast.Name):
        return None
    return [cur.id, *reversed(parts)]


def _private_uses(path: Path) -> list[str]:
    """Private or roundabout ctxkit names *path* uses, each as a short explanation."""
    import ctxkit

    tree = _tree(path)
    alias = {
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for a in node.names
        if a.name == "ctxkit"
    }
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            mods = [module] if module else [a.name for a in node.names]
            for mod in mods:
                if mod.split(".")[0] == "ctxkit" and any(p.startswith("_") for p in mod.split(".")):
                    bad.append(f"imports the private module {mod}")
            if module and module.split(".")[0] == "ctxkit":
                public = set(getattr(importlib.import_module(module), "__all__", ()))
                bad += [
                    f"from {module} import {a.name} (not in {module}.__all__)"
                    for a in node.names
                    if a.name not in public
                ]
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            chain = _chain(node)
            if chain is None or chain[0] not in alias:
                continue
            obj: object = ctxkit
            for i, attr in enumerate(chain[1:], 1):
                spelled = ".".join(["ck", *chain[1 : i + 1]])
                if attr.startswith("_") and attr != "__version__":
                    bad.append(f"{spelled} is private")
                    break
                if not hasattr(obj, attr):
                    bad.append(f"{spelled} does not exist")
                    break
                value = getattr(obj, attr)
                top = getattr(ctxkit, attr, None) if attr in ctxkit.__all__ else None
                if obj is not ctxkit and top is value and not isinstance(value, type(ctxkit)):
                    bad.append(f"{spelled}: write ck.{attr}")
                obj = value
                if not isinstance(obj, type(ctxkit)):
                    break
        elif isinstance(node, ast.Constant) and node.value in ("ptx", "ptx/"):
            bad.append("reads the ptx/ folder: use ck.kernel_source(name)")
    return sorted(set(bad))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_uses_public_names_only(path: Path) -> None:
    bad = _private_uses(path)
    assert not bad, f"{path.name}: " + "; ".join(bad)


def test_public_name_check_catches_what_it_should(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import ctxkit as ck\n"
        "from ctxkit._driver import drv\n"
        "from ctxkit.memory import c_strides\n"
        "ck._driver.init()\n"
        "ck.compiler.kernel_source('x.cu')\n"
        "ck.no_such_name\n"
        "ck.memory.peer_access_enabled\n"
        "ck.registry.context(0)\n"
        "REPO / 'ptx' / 'x.cu'\n"
    )
    bad = _private_uses(probe)
    assert "imports the private module ctxkit._driver" in bad
    assert "from ctxkit.memory import c_strides (not in ctxkit.memory.__all__)" in bad
    assert "ck._driver is private" in bad
    assert "ck.compiler.kernel_source: write ck.kernel_source" in bad
    assert "ck.no_such_name does not exist" in bad
    assert "reads the ptx/ folder: use ck.kernel_source(name)" in bad
    assert not [b for b in bad if "peer_access_enabled" in b or "registry" in b], bad


@no_gpu_only
def test_exit_safety_script_exits_2_without_gpu() -> None:
    _assert_no_gpu_exit(
        _run([sys.executable, "scripts/exit_safety.py", "--runs", "1"]), "exit_safety"
    )


def test_exit_safety_lists_its_scenarios() -> None:
    proc = _run([sys.executable, "scripts/exit_safety.py", "--list"])
    assert proc.returncode == 0, proc.stderr
    names = proc.stdout.split()
    for want in ("pushed_threads", "resources", "executor", "pipeline", "wrong_thread_free"):
        assert want in names


def test_exit_safety_rejects_unknown_scenario() -> None:
    proc = _run([sys.executable, "scripts/exit_safety.py", "--only", "nope"])
    assert proc.returncode == 2
    assert "unknown scenario" in proc.stderr and "pushed_threads" in proc.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", ["sanitizer.sh", "version-matrix.sh"])
def test_shell_scripts_parse(script: str) -> None:
    proc = _run(["bash", "-n", f"scripts/{script}"])
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_version_matrix_needs_a_config() -> None:
    proc = _run(["bash", "scripts/version-matrix.sh"])
    assert proc.returncode == 2
    assert "usage" in proc.stderr.lower()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_version_matrix_refuses_missing_wheel_folder() -> None:
    proc = _run(["bash", "scripts/version-matrix.sh", "cu12", "/nonexistent/wheels"])
    assert proc.returncode == 2
    assert "no wheels" in proc.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_version_matrix_slims_wheels(tmp_path: Path) -> None:
    whl = tmp_path / "nvidia_fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("nvidia/fake/lib/libfake.so.1", b"\x7fELF" + b"1" * 4096)
        z.writestr("nvidia/fake/lib/libfake.alt.so.1", b"\x7fELF" + b"2" * 4096)
        z.writestr("cuda/fake/__init__.py", "")
        z.writestr("cuda/fake/driver.pyx", "# cython source")
        z.writestr("nvidia_fake-1.0.dist-info/METADATA", "Name: nvidia-fake")
    out = tmp_path / "slim"
    proc = _run(["bash", "scripts/version-matrix.sh", "slim", str(out), str(whl)])
    assert proc.returncode == 0, proc.stderr
    assert "MiB" in proc.stdout
    with tarfile.open(out / "nvidia_fake-1.0-py3-none-any.tar.xz") as t:
        names = set(t.getnames())
        mode = t.getmember("nvidia/fake/lib/libfake.so.1").mode
    assert names == {
        "nvidia/fake/lib/libfake.so.1",
        "cuda/fake/__init__.py",
        "nvidia_fake-1.0.dist-info/METADATA",
    }
    assert mode & 0o111


@no_gpu_only
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sanitizer_script_exits_2_without_gpu(tmp_path: Path) -> None:
    env = _env()
    env["OUT"] = str(tmp_path)
    proc = subprocess.run(
        ["bash", "scripts/sanitizer.sh"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no GPU" in proc.stderr or "compute-sanitizer" in proc.stderr


# --- examples/_common.py ----------------------------------------------------------------


@pytest.fixture(scope="module")
def common() -> ModuleType:
    return load_file_module(REPO / "examples/_common.py", "examples_common")


def test_check_passes_on_equal_arrays(common: ModuleType, capsys: pytest.CaptureFixture) -> None:
    common.check("same", np.arange(5.0), np.arange(5.0))
    assert "check same: ok (5 values)" in capsys.readouterr().out


def test_check_exits_1_on_a_wrong_value(common: ModuleType, capsys: pytest.CaptureFixture) -> None:
    got = np.arange(5.0)
    got[3] = 99
    with pytest.raises(SystemExit) as info:
        common.check("scaled", got, np.arange(5.0))
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "FAILED scaled" in err and "index 3" in err and "1 of 5" in err


def test_check_exits_1_on_a_wrong_shape(common: ModuleType, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        common.check("shape", np.zeros(3), np.zeros(4))
    assert info.value.code == 1
    assert "shape (3,) != (4,)" in capsys.readouterr().err


def test_check_tolerance(common: ModuleType) -> None:
    common.check(
        "close", np.array([1.0 + 1e-7], np.float32), np.array([1.0], np.float32), rtol=1e-6
    )
    with pytest.raises(SystemExit):
        common.check("exact", np.array([1.0 + 1e-6], np.float32), np.array([1.0], np.float32))


def test_expect(common: ModuleType, capsys: pytest.CaptureFixture) -> None:
    common.expect("fine", True)
    assert "check fine: ok" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        common.expect("broken", False, "because")
    assert info.value.code == 1
    assert "FAILED broken: because" in capsys.readouterr().err


def test_blocks_for(common: ModuleType) -> None:
    assert common.blocks_for(0) == 1
    assert common.blocks_for(1) == 1
    assert common.blocks_for(256) == 1
    assert common.blocks_for(257) == 2
    assert common.blocks_for(10**9) == 65535
    assert common.blocks_for(1000, block=100, cap=5) == 5


def test_gbps_and_timed(common: ModuleType) -> None:
    assert common.gbps(2_000_000_000, 1.0) == "2.0 GB/s"
    assert common.gbps(10, 0.0).endswith("GB/s")
    with common.timed() as t:
        pass
    assert 0.0 <= t[0] < 1.0


def test_example_parser(common: ModuleType, capsys: pytest.CaptureFixture) -> None:
    parser = common.example_parser("Scale an array on every GPU.\n\nMore text.")
    parser.add_argument("--mb", type=int, default=4)
    assert parser.parse_args(["--mb", "8"]).mb == 8
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "Scale an array on every GPU." in out and "More text" not in out
    assert "exits 2" in out and "OK" in out


def test_ok_line(common: ModuleType, capsys: pytest.CaptureFixture) -> None:
    common.ok("done")
    assert capsys.readouterr().out == "OK done\n"


@no_gpu_only
def test_require_gpus_exits_2(common: ModuleType, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        common.require_gpus("x.py")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("no GPU: x.py")


# --- examples/notebooks/ ------------------------------------------------------------------

NOTEBOOKS = sorted((REPO / "examples" / "notebooks").glob("*.ipynb"))


def _code_cells(path: Path) -> list[str]:
    import json

    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_the_tour_notebook_exists() -> None:
    assert [p.name for p in NOTEBOOKS] == ["tour.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_nbformat4_saved_with_the_outputs_of_a_run(path: Path) -> None:
    """Saved by ``PYTHONPATH=. python3 scripts/run_notebook.py <notebook>`` on a GPU
    machine: every code cell ran, in order, and shows what it printed."""
    import json

    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4 and nb["metadata"]["kernelspec"]["language"] == "python"
    kinds = [c["cell_type"] for c in nb["cells"]]
    assert kinds[0] == "markdown" and kinds.count("code") >= 5
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for cell in nb["cells"]:
        assert isinstance(cell["source"], list) and cell.get("id"), cell
    run = "run it with scripts/run_notebook.py on a GPU machine and commit it"
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), run
    for cell in code:
        assert cell["outputs"], f"code cell {cell['id']} has no output: {run}"
        assert all(o["output_type"] != "error" for o in cell["outputs"]), cell["id"]
    printed = "".join(
        "".join(o["text"]) for c in code for o in c["outputs"] if o.get("name") == "stdout"
    )
    assert "tour done" in printed, "the saved run did not reach the end"
    headings = [c["source"][0] for c in nb["cells"] if c["cell_type"] == "markdown"]
    for topic in ("## Contexts", "## Threads", "## The pipeline"):
        assert any(h.startswith(topic) for h in headings), f"no {topic!r} section"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_code_is_plain_python_with_public_names(path: Path, tmp_path: Path) -> None:
    cells = _code_cells(path)
    for i, source in enumerate(cells):
        ast.parse(source, filename=f"{path.name} code cell {i}")
        magics = [ln for ln in source.splitlines() if ln.lstrip().startswith(("%", "!"))]
        assert not magics, f"code cell {i} uses IPython syntax, plain exec cannot run it"
    script = tmp_path / "cells.py"
    script.write_text("\n\n".join(cells), encoding="utf-8")
    bad = _private_uses(script)
    assert not bad, f"{path.name}: " + "; ".join(bad)
    assert any(ln.strip() == "import ctxkit as ck" for ln in cells[0].splitlines())


@no_gpu_only
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_says_it_needs_a_gpu(path: Path, tmp_path: Path) -> None:
    first = _code_cells(path)[0]
    proc = subprocess.run(
        [sys.executable, "-c", first],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    assert "AssertionError: this notebook needs an NVIDIA GPU" in proc.stderr
