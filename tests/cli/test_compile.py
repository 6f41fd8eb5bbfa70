"""``ctxkit compile``: works without a GPU given --arch; output in the current directory;
compute_XY means PTX; unknown archs and other mistakes exit 1 with what to do."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ctxkit.compiler as C
import ctxkit.context
from ctxkit.cli import build_parser, main
from ctxkit.cli.compile import add_arguments, run
from ctxkit.errors import DriverNotFoundError
from tests.conftest import GPU_COUNT

REPO = Path(__file__).resolve().parents[2]
BAD = 'extern "C" __global__ void k(float* x)\n{\n    x[0] = nope;\n}\n'


@pytest.fixture(autouse=True)
def private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    d = tmp_path_factory.mktemp("cli-cache") / "cache"
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(d))
    return d


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty current directory, apart from the sources."""
    d = tmp_path / "work"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


@pytest.fixture
def srcdir(tmp_path: Path) -> Path:
    d = tmp_path / "src"
    d.mkdir()
    (d / "saxpy.cu").write_text(C.kernel_source("saxpy.cu"))
    (d / "templates.cu").write_text(C.kernel_source("templates.cu"))
    return d


def compile_cli(*argv: str | Path) -> int:
    """``ctxkit compile ARGV`` in this process, through the subcommand's own arguments."""
    p = argparse.ArgumentParser(prog="ctxkit compile")
    add_arguments(p)
    return run(p.parse_args([str(a) for a in argv]))


def cli(
    env_cache: Path, *args: str | Path, cwd: Path, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CTXKIT_CACHE_DIR": str(env_cache)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "ctxkit", "compile", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        preexec_fn=_limit_memory if sys.platform.startswith("linux") else None,
    )


def _limit_memory() -> None:
    """In the child: at most 2 GiB of address space, so an unbounded read fails fast."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


# --- where the output goes --------------------------------------------------------------


def test_default_output_is_in_the_current_directory(
    workdir: Path, srcdir: Path, private_cache: Path
) -> None:
    r = cli(private_cache, srcdir / "saxpy.cu", "--arch", "sm_90", "--target", "ptx", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert (workdir / "saxpy.ptx").read_text().count(".entry saxpy(") == 1
    assert sorted(p.name for p in srcdir.iterdir()) == ["saxpy.cu", "templates.cu"]
    assert "wrote saxpy.ptx" in r.stdout


def test_cubin_default_output(workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture) -> None:
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "sm_90") == 0
    assert (workdir / "saxpy.cubin").read_bytes()[:4] == b"\x7fELF"
    out = capsys.readouterr().out
    assert "wrote saxpy.cubin" in out and "cubin" in out and "sm_90" in out


def test_explicit_output(workdir: Path, srcdir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "k.ptx"
    out.parent.mkdir()
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "sm_90", "--target", "ptx", "-o", out) == 0
    text = out.read_text()
    assert ".entry saxpy(" in text and "\0" not in text
    assert not list(workdir.iterdir())


def test_output_never_overwrites_the_source(workdir: Path, capsys: pytest.CaptureFixture) -> None:
    (workdir / "k.ptx").write_text(C.kernel_source("saxpy.cu"))  # a .cu with an odd name
    assert compile_cli("k.ptx", "--arch", "sm_90", "--target", "ptx") == 1
    assert "would overwrite" in capsys.readouterr().err
    assert (workdir / "k.ptx").read_text() == C.kernel_source("saxpy.cu")


@pytest.mark.parametrize("how", ["same", "dotted", "hard_link", "symlink"])
def test_output_naming_the_source_is_refused(
    workdir: Path, capsys: pytest.CaptureFixture, how: str
) -> None:
    source = C.kernel_source("saxpy.cu")
    (workdir / "k.cu").write_text(source)
    out = {"same": "k.cu", "dotted": f"../{workdir.name}/./k.cu"}.get(how, "out.cubin")
    if how == "hard_link":
        os.link(workdir / "k.cu", workdir / out)
    elif how == "symlink":
        (workdir / out).symlink_to(workdir / "k.cu")
    assert compile_cli("k.cu", "--arch", "sm_90", "-o", out) == 1
    err = capsys.readouterr().err
    assert f"-o {out} would overwrite the source file k.cu" in err
    assert (workdir / "k.cu").read_text() == source


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_source_is_refused_at_once(workdir: Path, private_cache: Path) -> None:
    os.mkfifo(workdir / "k.cu")
    r = cli(private_cache, "k.cu", "--arch", "sm_90", cwd=workdir, timeout=60)
    assert r.returncode == 1
    assert "k.cu is a FIFO, not a source file" in r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_device_source_is_refused_without_reading_it(workdir: Path, private_cache: Path) -> None:
    r = cli(private_cache, "/dev/zero", "--arch", "sm_90", cwd=workdir, timeout=60)
    assert r.returncode == 1
    assert "/dev/zero is a character device, not a source file" in r.stderr


def test_directory_source_is_refused(workdir: Path, capsys: pytest.CaptureFixture) -> None:
    (workdir / "k.cu").mkdir()
    assert compile_cli("k.cu", "--arch", "sm_90") == 1
    assert "k.cu is a directory, not a source file" in capsys.readouterr().err


def test_source_larger_than_the_limit_is_refused(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import ctxkit.cli.compile

    (workdir / "k.cu").write_text(C.kernel_source("saxpy.cu"))
    monkeypatch.setattr(ctxkit.cli.compile, "MAX_SOURCE_BYTES", 100)
    assert compile_cli("k.cu", "--arch", "sm_90") == 1
    assert "k.cu is larger than 100 bytes, the most ctxkit compile reads" in (
        capsys.readouterr().err
    )
    assert not (workdir / "k.cubin").exists()


def test_unwritable_output_exit_1(
    workdir: Path, srcdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "sm_90", "-o", blocker / "k.cubin") == 1
    assert "cannot write" in capsys.readouterr().err


# --- architectures ----------------------------------------------------------------------


def test_compute_arch_means_ptx(workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture) -> None:
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "compute_90") == 0
    text = (workdir / "saxpy.ptx").read_text()
    assert re.search(r"^\.target sm_90", text, re.MULTILINE) and ".entry saxpy(" in text
    assert "(ptx, compute_90," in capsys.readouterr().out
    assert not (workdir / "saxpy.cubin").exists()


def test_compute_arch_with_cubin_target_is_an_error(
    workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture
) -> None:
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "compute_90", "--target", "cubin") == 1
    assert "--arch sm_90" in capsys.readouterr().err
    assert not list(workdir.iterdir())


@pytest.mark.parametrize("arch", ["sm_999", "compute_999", "sm_91", "sm_35"])
def test_unknown_arch_is_an_error_not_a_fallback(
    workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture, arch: str
) -> None:
    if int(arch.split("_")[1]) in C.supported_archs():
        pytest.skip(f"this NVRTC knows {arch}")
    assert compile_cli(srcdir / "saxpy.cu", "--arch", arch) == 1
    err = capsys.readouterr().err
    assert f"does not know the architecture '{arch}'" in err
    assert f"sm_{C.supported_archs()[-1]}" in err and "sm_90" in err
    assert not list(workdir.iterdir())


def test_unreadable_arch_exit_1(workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture) -> None:
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "hopper") == 1
    err = capsys.readouterr().err
    assert "--arch hopper is not an architecture" in err and "--arch sm_90" in err
    assert "arch=" not in err  # the Python API's wording


@pytest.mark.skipif(GPU_COUNT > 0, reason="this machine has a GPU: no --arch is fine here")
def test_no_arch_without_gpu_exit_1_subprocess(
    workdir: Path, srcdir: Path, private_cache: Path
) -> None:
    r = cli(private_cache, srcdir / "saxpy.cu", cwd=workdir)
    assert r.returncode == 1
    assert "--arch" in r.stderr and "no GPU" in r.stderr


def test_no_arch_without_gpu_exit_1(
    monkeypatch: pytest.MonkeyPatch, workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture
) -> None:
    def no_driver() -> None:
        raise DriverNotFoundError("no NVIDIA driver found")

    monkeypatch.setattr(ctxkit.context, "current_context", no_driver)
    assert compile_cli(srcdir / "saxpy.cu", "--no-cache") == 1
    err = capsys.readouterr().err
    assert "no --arch given and no GPU here (no NVIDIA driver found); pass --arch" in err
    assert "arch=" not in err and "compile(" not in err  # the Python API's wording


# --- templates and entry points ---------------------------------------------------------


def test_name_expressions_instantiate_templates(
    workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture
) -> None:
    rc = compile_cli(
        srcdir / "templates.cu",
        "--arch",
        "sm_90",
        "--target",
        "ptx",
        "--name-expression",
        "axpy<float>",
        "--name-expression",
        "fill_const<int, 7>",
    )
    assert rc == 0
    captured = capsys.readouterr()
    ptx = (workdir / "templates.ptx").read_text()
    lines = dict(m.groups() for m in re.finditer(r"^  (.+?) -> (\S+)$", captured.out, re.MULTILINE))
    assert set(lines) == {"axpy<float>", "fill_const<int, 7>"}
    for mangled in lines.values():
        assert f".entry {mangled}(" in ptx
    assert "no kernels" not in captured.err


def test_template_without_name_expression_warns_no_kernels(
    workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture
) -> None:
    assert compile_cli(srcdir / "templates.cu", "--arch", "sm_90") == 0
    err = capsys.readouterr().err
    assert "no kernels" in err and "--name-expression 'axpy<float>'" in err


def test_source_without_kernels_warns(workdir: Path, capsys: pytest.CaptureFixture) -> None:
    (workdir / "dev.cu").write_text("__device__ float twice(float x) { return 2 * x; }\n")
    assert compile_cli("dev.cu", "--arch", "sm_90") == 0
    err = capsys.readouterr().err
    assert "no kernels" in err and "__global__" in err


def test_kernels_do_not_warn(workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture) -> None:
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "sm_90") == 0
    assert "warning" not in capsys.readouterr().err


# --- options, cache, errors -------------------------------------------------------------


def test_help_explains_every_option() -> None:
    from ctxkit.cli.compile import DESCRIPTION

    assert "``" not in DESCRIPTION and "current directory" in DESCRIPTION
    p = argparse.ArgumentParser(prog="ctxkit compile")
    add_arguments(p)
    text = " ".join(p.format_help().split())
    for expected in (
        "-D NAME[=VALUE] define a preprocessor macro",
        "-I DIR add DIR to the header search path",
        "--name-expression EXPR instantiate a template kernel",
        "compute_XY for PTX",
        "in the current directory",
    ):
        assert expected in text, expected


def test_defines_includes_std_and_neighbour_headers(
    workdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "extra.h").write_text("#define EXTRA 3\n")
    src_dir = tmp_path / "k"
    src_dir.mkdir()
    (src_dir / "local.h").write_text("#define LOCAL 4\n")
    src = src_dir / "k.cu"
    src.write_text(
        '#include "local.h"\n#include "extra.h"\n'
        "#if __cplusplus < 202002L\n#error needs C++20\n#endif\n"
        '#ifndef N\n#error N missing\n#endif\nextern "C" __global__ void k(int* x) '
        "{ x[0] = N + EXTRA + LOCAL; }\n"
    )
    args = ["--arch", "sm_90", "-I", inc, "--std", "c++20", "--target", "ptx"]
    assert compile_cli(src, "-D", "N=5", *args) == 0
    assert "12" in (workdir / "k.ptx").read_text()
    assert compile_cli(src, *args) == 1
    assert "N missing" in capsys.readouterr().err


def test_cached_second_run(
    workdir: Path, srcdir: Path, private_cache: Path, capsys: pytest.CaptureFixture
) -> None:
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "sm_90") == 0
    C.cache._memo.clear()
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "sm_90") == 0
    assert "(from cache)" in capsys.readouterr().out.splitlines()[-1]
    assert list(private_cache.glob("*.ctxobj"))


def test_no_cache(workdir: Path, srcdir: Path, private_cache: Path) -> None:
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "sm_90", "--no-cache") == 0
    assert not private_cache.exists()


def test_compile_error_prints_log_exit_1(workdir: Path, capsys: pytest.CaptureFixture) -> None:
    (workdir / "bad.cu").write_text(BAD)
    assert compile_cli("bad.cu", "--arch", "sm_90") == 1
    err = capsys.readouterr().err
    assert 'bad.cu(3): error: identifier "nope" is undefined' in err
    assert "bad.cu failed to compile (NVRTC_ERROR_COMPILATION)" in err
    assert not (workdir / "bad.cubin").exists()


def test_missing_file_exit_1(workdir: Path, capsys: pytest.CaptureFixture) -> None:
    assert compile_cli("nope.cu", "--arch", "sm_90") == 1
    assert "cannot read nope.cu" in capsys.readouterr().err


def test_missing_nvrtc_exit_1(
    workdir: Path, srcdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from ctxkit.compiler import nvrtc

    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)
    nvrtc.supported_archs.cache_clear()
    nvrtc.nvrtc_version.cache_clear()
    try:
        assert compile_cli(srcdir / "saxpy.cu", "--arch", "sm_90", "--no-cache") == 1
    finally:
        nvrtc.supported_archs.cache_clear()
        nvrtc.nvrtc_version.cache_clear()
    err = capsys.readouterr().err
    assert "NVRTC bindings are not available" in err and "failed to compile" not in err


def test_ptx_version_warning_is_printed(
    monkeypatch: pytest.MonkeyPatch, workdir: Path, srcdir: Path, capsys: pytest.CaptureFixture
) -> None:
    from ctxkit import _driver

    monkeypatch.setattr(_driver, "driver_version", lambda: (12, 0))
    assert compile_cli(srcdir / "saxpy.cu", "--arch", "compute_90", "--no-cache") == 0
    assert "warning: PTX from NVRTC" in capsys.readouterr().err


def test_ctxkit_command_has_the_compile_arguments(workdir: Path, srcdir: Path) -> None:
    args = build_parser().parse_args(
        ["compile", str(srcdir / "templates.cu"), "--name-expression", "axpy<float>"]
    )
    assert args.name_expressions == ["axpy<float>"]
    assert main(["compile", str(srcdir / "saxpy.cu"), "--arch", "compute_90"]) == 0
    assert (workdir / "saxpy.ptx").is_file()
