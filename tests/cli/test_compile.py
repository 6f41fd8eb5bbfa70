"""``python -m ctxkit compile``: works without a GPU given --arch; errors exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ctxkit.compiler as C
import ctxkit.context
from ctxkit.cli import main
from ctxkit.errors import DriverNotFoundError
from tests.conftest import GPU_COUNT

REPO = Path(__file__).resolve().parents[2]
BAD = 'extern "C" __global__ void k(float* x)\n{\n    x[0] = nope;\n}\n'


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {**os.environ, "CTXKIT_CACHE_DIR": str(tmp_path / "cache")}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return e


def cli(env: dict[str, str], *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ctxkit", "compile", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture
def saxpy(tmp_path: Path) -> Path:
    p = tmp_path / "saxpy.cu"
    p.write_text(C.kernel_source("saxpy.cu"))
    return p


def test_cubin_default_output(env: dict[str, str], saxpy: Path) -> None:
    r = cli(env, saxpy, "--arch", "sm_90")
    assert r.returncode == 0, r.stderr
    out = saxpy.with_suffix(".cubin")
    assert out.read_bytes()[:4] == b"\x7fELF"
    assert "wrote" in r.stdout and "cubin" in r.stdout and "sm_90" in r.stdout


def test_ptx_target_and_output(env: dict[str, str], saxpy: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "k.ptx"
    out.parent.mkdir()
    r = cli(env, saxpy, "--arch", "sm_90", "--target", "ptx", "-o", out)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert ".entry saxpy(" in text and "\0" not in text


def test_cached_second_run(env: dict[str, str], saxpy: Path) -> None:
    assert cli(env, saxpy, "--arch", "sm_90").returncode == 0
    r = cli(env, saxpy, "--arch", "sm_90")
    assert r.returncode == 0 and "(from cache)" in r.stdout
    assert list(Path(env["CTXKIT_CACHE_DIR"]).glob("*.ctxobj"))


def test_no_cache(env: dict[str, str], saxpy: Path) -> None:
    r = cli(env, saxpy, "--arch", "sm_90", "--no-cache")
    assert r.returncode == 0, r.stderr
    assert not Path(env["CTXKIT_CACHE_DIR"]).exists()


def test_defines_includes_std_and_neighbour_headers(env: dict[str, str], tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "extra.h").write_text("#define EXTRA 3\n")
    (tmp_path / "local.h").write_text("#define LOCAL 4\n")
    src = tmp_path / "k.cu"
    src.write_text(
        '#include "local.h"\n#include "extra.h"\n'
        "#if __cplusplus < 202002L\n#error needs C++20\n#endif\n"
        '#ifndef N\n#error N missing\n#endif\nextern "C" __global__ void k(int* x) '
        "{ x[0] = N + EXTRA + LOCAL; }\n"
    )
    r = cli(
        env, src, "--arch", "sm_90", "-D", "N=5", "-I", inc, "--std", "c++20", "--target", "ptx"
    )
    assert r.returncode == 0, r.stderr
    assert "12" in src.with_suffix(".ptx").read_text()
    r = cli(env, src, "--arch", "sm_90", "-I", inc, "--std", "c++20")
    assert r.returncode == 1 and "N missing" in r.stderr


def test_compile_error_prints_log_exit_1(env: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "bad.cu"
    src.write_text(BAD)
    r = cli(env, src, "--arch", "sm_90")
    assert r.returncode == 1
    assert 'bad.cu(3): error: identifier "nope" is undefined' in r.stderr
    assert "failed to compile" in r.stderr
    assert not src.with_suffix(".cubin").exists()


def test_missing_file_exit_1(env: dict[str, str], tmp_path: Path) -> None:
    r = cli(env, tmp_path / "nope.cu", "--arch", "sm_90")
    assert r.returncode == 1 and "cannot read" in r.stderr


def test_bad_arch_exit_1(env: dict[str, str], saxpy: Path) -> None:
    r = cli(env, saxpy, "--arch", "hopper")
    assert r.returncode == 1 and "cannot understand arch" in r.stderr


def test_unwritable_output_exit_1(env: dict[str, str], saxpy: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = cli(env, saxpy, "--arch", "sm_90", "-o", blocker / "k.cubin")
    assert r.returncode == 1 and "cannot write" in r.stderr


@pytest.mark.skipif(GPU_COUNT > 0, reason="this machine has a GPU: no --arch is fine here")
def test_no_arch_without_gpu_exit_1_subprocess(env: dict[str, str], saxpy: Path) -> None:
    r = cli(env, saxpy)
    assert r.returncode == 1
    assert "--arch" in r.stderr and "no GPU" in r.stderr


def test_no_arch_without_gpu_exit_1(
    monkeypatch: pytest.MonkeyPatch, saxpy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_driver() -> None:
        raise DriverNotFoundError("no NVIDIA driver found")

    monkeypatch.setattr(ctxkit.context, "current_context", no_driver)
    assert main(["compile", str(saxpy), "--no-cache"]) == 1
    err = capsys.readouterr().err
    assert "pass --arch" in err and "no GPU" in err


def test_ptx_version_warning_is_printed(
    monkeypatch: pytest.MonkeyPatch, saxpy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ctxkit import _driver

    monkeypatch.setattr(_driver, "driver_version", lambda: (12, 0))
    assert main(["compile", str(saxpy), "--arch", "sm_90", "--target", "ptx", "--no-cache"]) == 0
    assert "warning: PTX from NVRTC" in capsys.readouterr().err
