"""``ctxkit info`` on a machine without a GPU or without cuda-bindings: it reports what it
can, ends with a ``no GPU`` line and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ctxkit.cli.info import DISTRIBUTION, compatibility_line, install_hint
from tests.conftest import GPU_COUNT

REPO = Path(__file__).resolve().parents[2]
no_gpu_only = pytest.mark.skipif(GPU_COUNT > 0, reason="checks the behaviour without a GPU")


def info(
    env: dict[str, str] | None = None, path: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    e = {**os.environ, **(env or {})}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [*path, str(REPO), e.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "ctxkit", "info"],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def fields(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition(" : ")
        if sep and not line.startswith(" "):
            out[key.strip()] = value.strip()
    return out


@no_gpu_only
def test_without_a_gpu_it_reports_and_exits_0() -> None:
    from ctxkit.compiler import nvrtc_version, supported_archs

    r = info()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    f = fields(r.stdout)
    assert f["ctxkit"].startswith("0.") and DISTRIBUTION in f["ctxkit"]
    assert f["cuda-bindings"][0].isdigit(), f
    assert f["NVRTC"] == "{}.{}".format(*nvrtc_version())
    assert f["NVRTC targets"].split() == [f"sm_{a}" for a in supported_archs()]
    assert "--arch" in f["compatibility"]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("no GPU") and "compile" in last, r.stdout


def test_without_cuda_bindings_it_says_so_not_no_driver(tmp_path: Path) -> None:
    # A plain package named `cuda` shadows the installed namespace: `cuda.bindings` is gone.
    (tmp_path / "cuda").mkdir()
    (tmp_path / "cuda" / "__init__.py").write_text("")
    r = info(path=(str(tmp_path),))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    f = fields(r.stdout)
    assert f["cuda-bindings"].startswith("not installed"), r.stdout
    assert 'pip install -e ".[cu13]"' in f["cuda-bindings"]
    assert f"{DISTRIBUTION}[cu13]" in f["cuda-bindings"]
    assert "no NVIDIA driver" not in r.stdout and "libcuda" not in r.stdout
    assert f["driver"].startswith("not checked")
    assert f["no GPU"].startswith("cuda-bindings is not installed"), r.stdout


def test_kernel_cache_line_names_the_directory_and_its_size(tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    cache.mkdir()
    (cache / "a.ctxobj").write_bytes(b"x" * (3 << 20))
    f = fields(info({"CTXKIT_CACHE_DIR": str(cache), "CTXKIT_CACHE_MAX_BYTES": "64M"}).stdout)
    assert f["kernel cache"] == f"{cache} (1 files, 3.0 MiB; at most 64 MiB)"
    f = fields(info({"CTXKIT_CACHE_DIR": str(cache), "CTXKIT_CACHE_MAX_BYTES": "lots"}).stdout)
    assert f["kernel cache"].startswith(f"{cache} (1 files, 3.0 MiB; CTXKIT_CACHE_MAX_BYTES")
    f = fields(info({"CTXKIT_CACHE_DIR": "off"}).stdout)
    assert f["kernel cache"].startswith("off")


def test_install_hint_works_from_a_checkout_and_names_the_distribution() -> None:
    hint = install_hint()
    assert 'pip install -e ".[cu13]"' in hint and '".[cu12]"' in hint
    assert f'pip install "{DISTRIBUTION}[cu13]"' in hint
    assert "pip install ctxkit[" not in hint
    plot = install_hint("plot")
    assert 'pip install -e ".[plot]"' in plot and "cu12" not in plot


def test_compatibility_line() -> None:
    assert "will NOT load" in compatibility_line((13, 5), (13, 0))
    assert "both load" in compatibility_line((13, 0), (13, 0))
    assert "older" in compatibility_line((12, 9), (13, 0))
    assert "--arch" in compatibility_line((13, 0), None)
    missing = compatibility_line(None, (13, 0))
    assert "NVRTC not found" in missing and install_hint() in missing


def test_host_copies_line_says_how_staging_copies_are_made() -> None:
    f = fields(info({"CTXKIT_STREAMING_COPY": "0"}).stdout)
    assert f["host copies"] == "np.copyto (switched off)"
    f = fields(info({"CTXKIT_STREAMING_COPY": "1"}).stdout)
    assert f["host copies"].startswith(("non-temporal stores", "np.copyto ("))


def test_without_nvrtc_it_says_what_is_missing_and_which_extra_adds_it(monkeypatch) -> None:
    import io

    from ctxkit.cli import info as info_mod
    from ctxkit.compiler import nvrtc
    from ctxkit.errors import CompileError

    def no_nvrtc() -> None:
        raise CompileError("the NVRTC library could not be loaded (libnvrtc.so.13: not found)")

    monkeypatch.setattr(nvrtc, "load_nvrtc", no_nvrtc)
    nvrtc.nvrtc_version.cache_clear()
    nvrtc.supported_archs.cache_clear()
    try:
        out = io.StringIO()
        assert info_mod.print_info(out) == 0
    finally:
        nvrtc.nvrtc_version.cache_clear()
        nvrtc.supported_archs.cache_clear()
    text = out.getvalue()
    f = fields(text)
    assert f["NVRTC"].startswith("not found") and "cu13" in f["NVRTC"], text
    assert install_hint() in f["NVRTC"]
    assert f["NVRTC targets"] == "not available (no NVRTC)"
    assert "can be compiled" not in text, text
    if "no GPU" in f:
        assert "neither compiled" in f["no GPU"], text
    else:
        assert f["compatibility"].startswith("NVRTC not found"), text
