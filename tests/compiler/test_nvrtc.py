"""The toolchain (ctxkit.compiler.nvrtc): architectures, NVRTC/nvJitLink presence, CUDA
headers. NVRTC really runs here (no GPU needed)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

import ctxkit
import ctxkit.compiler as C
import ctxkit.compiler.program
from ctxkit.compiler import nvrtc as _nvrtc
from ctxkit.errors import CompileError
from tests.compiler._helpers import SAXPY

# --- architectures --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("sm_90", "sm_90"),
        ("compute_90", "sm_90"),
        ("90", "sm_90"),
        ("9.0", "sm_90"),
        ((9, 0), "sm_90"),
        (90, "sm_90"),
        ("SM_90a", "sm_90a"),
        ("sm_100f", "sm_100f"),
        (" sm_120 ", "sm_120"),
    ],
)
def test_normalize_arch(value: Any, expected: str) -> None:
    assert C.normalize_arch(value) == expected


@pytest.mark.parametrize(
    "value", ["hopper", "sm_9", "", (9,), -1, 5, 1000, (100, 0), (9, 10), (-1, 0), (9, "0")]
)
def test_normalize_arch_rejects(value: Any) -> None:
    with pytest.raises(ValueError, match=r"cannot understand arch=.*'sm_90'.*\(9, 0\)"):
        C.normalize_arch(value)


@pytest.mark.parametrize("value", [True, 3.5, None, b"sm_90", [9, 0]])
def test_normalize_arch_rejects_other_types(value: Any) -> None:
    with pytest.raises(TypeError, match=r"cannot understand arch=.*'sm_90'.*\(9, 0\)"):
        C.normalize_arch(value)


def test_normalize_arch_of_a_device_like() -> None:
    class FakeDevice:
        compute_capability = (8, 6)

    assert C.normalize_arch(FakeDevice()) == "sm_86"


def test_supported_archs_and_version() -> None:
    archs = C.supported_archs()
    assert 90 in archs and list(archs) == sorted(archs)
    major, minor = C.nvrtc_version()
    assert major >= 12 and minor >= 0


# --- nvJitLink ------------------------------------------------------------------------


def test_link_ptx_makes_cubin() -> None:
    ptx = ctxkit.compile(SAXPY, arch="sm_90", target="ptx", cache=False).ptx
    assert ptx is not None
    cubin = C.link_ptx(ptx, "sm_90")
    assert cubin[:4] == b"\x7fELF"


def test_link_ptx_reports_ptxas_log() -> None:
    bad = (
        ".version 7.0\n.target sm_52\n.address_size 64\n"
        ".visible .entry k()\n{\n bogus.op;\n ret;\n}\n"
    )
    with pytest.raises(CompileError, match="nvJitLink failed") as info:
        C.link_ptx(bad, "sm_90", name="bad.ptx")
    assert "bogus" in info.value.log and "line 6" in info.value.log


def test_link_ptx_unsupported_arch() -> None:
    with pytest.raises(CompileError, match="cannot link for sm_35"):
        C.link_ptx(C.kernel_source("vector_add_lowisa.ptx"), "sm_35")


# --- NVRTC missing --------------------------------------------------------------------


def test_missing_nvrtc_bindings_explain_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)
    with pytest.raises(CompileError, match=r'pip install -e "\.\[cu13\]".*"ctxkit-cuda\[cu13\]"'):
        _nvrtc.load_nvrtc()


def test_missing_nvjitlink_explains_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvjitlink", None)
    with pytest.raises(CompileError, match=r'pip install -e "\.\[cu13\]".*"ctxkit-cuda\[cu13\]"'):
        C.link_ptx(C.kernel_source("vector_add_lowisa.ptx"), "sm_90")


# --- CUDA headers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    ["cuda_fp16.h", "cuda_bf16.h", "vector_types.h", "cuda/std/cstdint", "cooperative_groups.h"],
)
def test_cuda_headers_resolve_pip_only(header: str) -> None:
    src = f'#include <{header}>\nextern "C" __global__ void k(float* x) {{ x[0] = 1.0f; }}\n'
    obj = ctxkit.compile(src, arch="sm_90", cache=False)
    assert obj.target == "cubin"
    assert any(f"-I{d}" in obj.options for d in C.cuda_include_dirs())


def test_cuda_headers_come_from_the_wheels_when_installed() -> None:
    from importlib import metadata

    try:
        metadata.version("nvidia-cuda-runtime")
    except metadata.PackageNotFoundError:
        pytest.skip("nvidia-cuda-runtime wheel not installed (headers come from a toolkit)")
    dirs = C.cuda_include_dirs()
    assert any(
        "site-packages" in d and os.path.isfile(os.path.join(d, "cuda_fp16.h")) for d in dirs
    )


def test_missing_cuda_headers_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "cuda_include_dirs", lambda: ())
    monkeypatch.setattr(_nvrtc, "cuda_include_dirs", lambda: ())
    monkeypatch.setattr(ctxkit.compiler.program, "cuda_include_dirs", lambda: ())
    src = '#include <cuda_fp16.h>\nextern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n'
    with pytest.raises(CompileError, match="nvidia-cuda-runtime") as info:
        ctxkit.compile(src, arch="sm_90", cache=False)
    assert "'cuda_fp16.h' was not found" in str(info.value)
    assert "CUDA include dirs found: none" in str(info.value)
