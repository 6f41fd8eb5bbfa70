"""Examples and reliability scripts on a machine without a GPU: exit 2, one line, no traceback.

Also the helpers of ``examples/_common.py`` (result checks exit 1 on a wrong result) and
the shell scripts' syntax.
"""

from __future__ import annotations

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
