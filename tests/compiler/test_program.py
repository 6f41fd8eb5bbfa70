"""Program and compile(): targets, errors, program features, how arch is chosen, PTX
warnings. NVRTC really compiles here (no GPU needed)."""

from __future__ import annotations

import re
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

import ctxkit
import ctxkit.compiler as C
from ctxkit import _driver
from ctxkit.errors import CompileError, DriverNotFoundError
from tests.compiler._helpers import SAXPY, unique

BAD = 'extern "C" __global__ void k(float* x)\n{\n    x[0] = undefined_name;\n}\n'


# --- targets --------------------------------------------------------------------------


def test_auto_target_is_cubin_with_ptx_kept() -> None:
    obj = ctxkit.compile(SAXPY, arch="sm_90", cache=False)
    assert obj.target == "cubin" and obj.arch == "sm_90"
    assert obj.code[:4] == b"\x7fELF"
    assert obj.ptx is not None and ".entry saxpy(" in obj.ptx
    assert obj.nvrtc_version == C.nvrtc_version()
    assert "-arch=sm_90" in obj.options
    assert not obj.from_cache


def test_ptx_target() -> None:
    obj = ctxkit.compile(SAXPY, arch="sm_90", target="ptx", cache=False)
    assert obj.target == "ptx" and obj.arch == "compute_90"
    assert obj.code.endswith(b"\0") and b".entry saxpy(" in obj.code
    assert obj.ptx == obj.code[:-1].decode()
    assert re.search(r"^\.target sm_90", obj.ptx, re.MULTILINE)


def test_cubin_target_explicit() -> None:
    obj = ctxkit.Program(SAXPY).compile(target="cubin", arch=(9, 0))
    assert obj.target == "cubin" and obj.code[:4] == b"\x7fELF"


def _nvfatbin_usable() -> bool:
    try:
        from cuda.bindings import nvfatbin

        nvfatbin.destroy(nvfatbin.create([], 0))
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _nvfatbin_usable(), reason="nvidia-nvfatbin is not installed")
def test_fatbin_target_links_with_nvjitlink() -> None:
    from cuda.bindings import nvjitlink

    obj = ctxkit.compile(SAXPY, arch="sm_90", target="fatbin", cache=False)
    assert obj.target == "fatbin" and C.detect_target(obj.code) == "fatbin"
    handle = nvjitlink.create(1, ["-arch=sm_90"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.FATBIN, obj.code, len(obj.code), "k")
        nvjitlink.complete(handle)
        assert nvjitlink.get_linked_cubin_size(handle) > 0
    finally:
        nvjitlink.destroy(handle)


def test_fatbin_without_nvfatbin_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvfatbin", None)
    with pytest.raises(CompileError, match="nvidia-nvfatbin"):
        ctxkit.compile(SAXPY, arch="sm_90", target="fatbin", cache=False)


def test_bad_target_and_types() -> None:
    with pytest.raises(ValueError, match="target must be one of"):
        ctxkit.compile(SAXPY, arch="sm_90", target="sass", cache=False)
    with pytest.raises(TypeError, match="sequence of strings"):
        ctxkit.Program(SAXPY, options="-lineinfo")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must contain strings"):
        ctxkit.Program(SAXPY, options=("-lineinfo", 3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source must be"):
        ctxkit.Program(123)  # type: ignore[arg-type]


def test_bytes_source_and_repr() -> None:
    prog = ctxkit.Program(SAXPY.encode(), name="s.cu", options=("-lineinfo",))
    assert "s.cu" in repr(prog) and "-lineinfo" in repr(prog)
    obj = prog.compile(arch="sm_90")
    assert "s.cu" in repr(obj) and "cubin" in repr(obj)
    assert obj.name == "s.cu"


# --- errors ---------------------------------------------------------------------------


def test_compile_error_has_log_line_options_versions() -> None:
    with pytest.raises(CompileError) as info:
        ctxkit.compile(BAD, name="bad.cu", arch="sm_90", options=("-lineinfo",), cache=False)
    exc = info.value
    assert 'bad.cu(3): error: identifier "undefined_name" is undefined' in exc.log
    msg = str(exc)
    assert "bad.cu line 3" in msg and exc.log in msg
    assert "-arch=sm_90 -lineinfo" in msg
    nv = C.nvrtc_version()
    assert f"NVRTC {nv[0]}.{nv[1]}" in msg and "cuda-bindings" in msg
    assert exc.name == "NVRTC_ERROR_COMPILATION" and exc.code == 6
    assert isinstance(exc, ctxkit.CudaError)


def test_invalid_option_is_compile_error() -> None:
    with pytest.raises(CompileError) as info:
        ctxkit.compile(SAXPY, arch="sm_90", options=("--no-such-option",), cache=False)
    assert info.value.name == "NVRTC_ERROR_INVALID_OPTION"
    assert "--no-such-option" in info.value.log


def test_warnings_are_kept_on_log() -> None:
    src = 'extern "C" __global__ void k(float* x)\n{\n    int unused = 3;\n    x[0] = 1.0f;\n}\n'
    obj = ctxkit.compile(src, arch="sm_90", cache=False)
    assert "warning" in obj.log and "unused" in obj.log
    clean = ctxkit.compile(SAXPY, arch="sm_90", cache=False)
    assert clean.log == ""


# --- program features -----------------------------------------------------------------


def test_name_expressions_give_lowered_names() -> None:
    obj = ctxkit.compile(
        C.kernel_source("templates.cu"),
        arch="sm_90",
        name_expressions=("axpy<float>", "axpy<double>", "fill_const<int, 7>"),
        cache=False,
    )
    assert set(obj.lowered_names) == {"axpy<float>", "axpy<double>", "fill_const<int, 7>"}
    for mangled in obj.lowered_names.values():
        assert mangled.startswith("_Z") and f".entry {mangled}(" in (obj.ptx or "")
    assert obj.lowered_name("axpy<float>") == obj.lowered_names["axpy<float>"]
    with pytest.raises(KeyError, match="name_expressions"):
        obj.lowered_name("axpy<int>")


def test_headers_dict() -> None:
    src = '#include "params.h"\nextern "C" __global__ void k(int* x) { x[0] = SCALE; }\n'
    obj = ctxkit.compile(
        src, arch="sm_90", headers={"params.h": "#define SCALE 12345\n"}, cache=False
    )
    assert "12345" in (obj.ptx or "")
    with pytest.raises(CompileError, match="params.h"):
        ctxkit.compile(src, arch="sm_90", cache=False)


def test_half_precision_kernel_compiles() -> None:
    src = textwrap.dedent(
        """
        #include <cuda_fp16.h>
        extern "C" __global__ void half_axpy(__half a, const __half* x, __half* y, size_t n)
        {
            size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
            if (i < n) y[i] = __hfma(a, x[i], y[i]);
        }
        """
    )
    obj = ctxkit.compile(src, arch="sm_90", cache=False)
    assert ".entry half_axpy(" in (obj.ptx or "")


def test_std_defines_include_dirs(tmp_path: Path) -> None:
    (tmp_path / "extra.h").write_text("#define EXTRA 7\n")
    src = textwrap.dedent(
        """
        #include "extra.h"
        #if __cplusplus < 201703L
        #error needs C++17
        #endif
        #ifndef FLAG
        #error FLAG missing
        #endif
        extern "C" __global__ void k(int* x) { if constexpr (N == 4) x[0] = EXTRA; }
        """
    )
    obj = ctxkit.compile(
        src,
        arch="sm_90",
        std="17",
        defines={"N": 4, "FLAG": None},
        include_dirs=[tmp_path],
        cache=False,
    )
    assert "--std=c++17" in obj.options and "-DN=4" in obj.options and "-DFLAG" in obj.options
    assert f"-I{tmp_path}" in obj.options
    obj2 = ctxkit.compile(
        src,
        arch="sm_90",
        std="c++17",
        defines=["N=4", "FLAG"],
        include_dirs=[tmp_path],
        cache=False,
    )
    assert obj2.code == obj.code
    with pytest.raises(CompileError, match="FLAG missing"):
        ctxkit.compile(src, arch="sm_90", std="17", defines={"N": 4}, include_dirs=[tmp_path])


# --- how arch is chosen ---------------------------------------------------------------


def test_arch_specific_variant_compiles() -> None:
    obj = ctxkit.compile(SAXPY, arch="sm_90a", cache=False)
    assert obj.arch == "sm_90a" and obj.target == "cubin"


def test_arch_capped_within_major_keeps_cubin() -> None:
    obj = ctxkit.compile(SAXPY, arch="sm_91", cache=False)
    assert obj.target == "cubin" and obj.arch == "sm_90"
    assert "sm_91 is newer than NVRTC" in obj.log and "sm_90" in obj.log


def test_arch_capped_across_major_falls_back_to_ptx() -> None:
    newest = C.supported_archs()[-1]
    future = f"sm_{(newest // 10 + 1) * 10}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", C.PtxVersionWarning)
        obj = ctxkit.compile(SAXPY, arch=future, cache=False)
    assert obj.target == "ptx" and obj.arch == f"compute_{newest}"
    assert f"{future} is newer than NVRTC" in obj.log and "JIT" in obj.log
    with pytest.raises(ValueError, match="target='ptx' or 'auto'"):
        ctxkit.compile(SAXPY, arch=future, target="cubin", cache=False)


def test_arch_older_than_nvrtc_supports() -> None:
    oldest = C.supported_archs()[0]
    too_old = "sm_35" if oldest > 35 else None
    if too_old is None:
        pytest.skip("this NVRTC still supports sm_35")
    with pytest.raises(ValueError, match="cannot compile for sm_35"):
        ctxkit.compile(SAXPY, arch=too_old, cache=False)


@pytest.mark.parametrize("arch", [1000, (100, 0), (9, 10), 5, "sm_9000"])
def test_arch_that_names_no_architecture_is_a_value_error(arch: Any) -> None:
    with pytest.raises(
        ValueError, match=r"cannot understand arch=.*'sm_90'.*'compute_90'.*\(9, 0\)"
    ):
        ctxkit.compile(SAXPY, arch=arch, cache=False)


@pytest.mark.parametrize("arch", [9.0, [9, 0], b"sm_90"])
def test_arch_of_another_type_is_a_type_error(arch: Any) -> None:
    with pytest.raises(TypeError, match=r"cannot understand arch=.*\(9, 0\).*None"):
        ctxkit.compile(SAXPY, arch=arch, cache=False)


def test_arch_option_in_options_is_used() -> None:
    obj = ctxkit.compile(SAXPY, options=("-arch=sm_80",), cache=False)
    assert obj.arch == "sm_80" and obj.options.count("-arch=sm_80") == 1
    obj2 = ctxkit.compile(SAXPY, options=("--gpu-architecture", "sm_80"), cache=False)
    assert obj2.arch == "sm_80"
    with pytest.raises(ValueError, match="conflicts"):
        ctxkit.compile(SAXPY, arch="sm_90", options=("-arch=sm_80",), cache=False)


def test_arch_none_without_gpu_says_pass_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctxkit.context

    def no_driver() -> None:
        raise DriverNotFoundError("no NVIDIA driver found")

    monkeypatch.setattr(ctxkit.context, "current_context", no_driver)
    with pytest.raises(ValueError, match=r"arch='sm_90'") as info:
        ctxkit.compile(SAXPY, cache=False)
    assert "no GPU" in str(info.value)


def test_arch_none_with_driver_but_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctxkit.context
    import ctxkit.device

    monkeypatch.setattr(ctxkit.context, "current_context", lambda: None)
    monkeypatch.setattr(ctxkit.device, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="reports no CUDA device"):
        ctxkit.compile(SAXPY, cache=False)


def test_arch_none_uses_current_context_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctxkit.context

    class FakeDevice:
        arch = "sm_80"

    class FakeCtx:
        device = FakeDevice()

    monkeypatch.setattr(ctxkit.context, "current_context", lambda: FakeCtx())
    obj = ctxkit.compile(SAXPY, cache=False)
    assert obj.arch == "sm_80" and obj.target == "cubin"


def test_arch_none_without_context_uses_device_0(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctxkit.context
    import ctxkit.device

    class FakeDevice:
        arch = "sm_89"

    monkeypatch.setattr(ctxkit.context, "current_context", lambda: None)
    monkeypatch.setattr(ctxkit.device, "device_count", lambda: 1)
    monkeypatch.setattr(ctxkit.device, "Device", lambda i: FakeDevice())
    obj = ctxkit.compile(SAXPY, cache=False)
    assert obj.arch == "sm_89"


# --- PTX vs driver version ------------------------------------------------------------


def test_ptx_newer_than_driver_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_driver, "driver_version", lambda: (12, 0))
    with pytest.warns(C.PtxVersionWarning, match="CUDA_ERROR_UNSUPPORTED_PTX_VERSION"):
        ctxkit.compile(SAXPY, arch="sm_90", target="ptx", cache=False)


def test_ptx_not_newer_than_driver_is_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_driver, "driver_version", lambda: (99, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctxkit.compile(SAXPY, arch="sm_90", target="ptx", cache=False)


def test_cubin_never_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_driver, "driver_version", lambda: (12, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctxkit.compile(SAXPY, arch="sm_90", cache=False)


def test_ptx_warning_also_on_cache_hit(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = unique("warn")
    monkeypatch.setattr(_driver, "driver_version", lambda: (99, 0))
    ctxkit.compile(src, arch="sm_90", target="ptx")
    monkeypatch.setattr(_driver, "driver_version", lambda: (12, 0))
    with pytest.warns(C.PtxVersionWarning):
        obj = ctxkit.compile(src, arch="sm_90", target="ptx")
    assert obj.from_cache
