"""CPU tests of ctxkit.compiler: NVRTC really compiles here (no GPU needed)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

import ctxkit
import ctxkit.compiler as C
from ctxkit import _driver
from ctxkit.compiler import cache as _compile_cache
from ctxkit.compiler import nvrtc as _nvrtc
from ctxkit.errors import CompileError, DriverNotFoundError

REPO = Path(__file__).resolve().parents[2]
SAXPY = C.kernel_source("saxpy.cu")
BAD = 'extern "C" __global__ void k(float* x)\n{\n    x[0] = undefined_name;\n}\n'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "kcache"
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(d))
    return d


def _unique(tag: str = "") -> str:
    """SAXPY with a unique comment: a source no earlier test or run has cached."""
    return SAXPY + f"\n// {tag} {time.time_ns()} {os.getpid()}\n"


def _entries(d: Path) -> list[Path]:
    return sorted(d.glob("*.ctxobj")) if d.is_dir() else []


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: C.cache.stats[k] - before[k] for k in before}


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


@pytest.mark.parametrize("value", ["hopper", "sm_9", "", (9,), True, -1, 3.5, None])
def test_normalize_arch_rejects(value: Any) -> None:
    with pytest.raises(ValueError, match="cannot understand arch"):
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
    src = _unique("warn")
    monkeypatch.setattr(_driver, "driver_version", lambda: (99, 0))
    ctxkit.compile(src, arch="sm_90", target="ptx")
    monkeypatch.setattr(_driver, "driver_version", lambda: (12, 0))
    with pytest.warns(C.PtxVersionWarning):
        obj = ctxkit.compile(src, arch="sm_90", target="ptx")
    assert obj.from_cache


# --- object code ----------------------------------------------------------------------


def test_save_and_from_file_roundtrip(tmp_path: Path) -> None:
    cubin = ctxkit.compile(SAXPY, arch="sm_90", cache=False)
    ptx = ctxkit.compile(SAXPY, arch="sm_90", target="ptx", cache=False)
    cpath = cubin.save(tmp_path / "k.cubin")
    ppath = ptx.save(tmp_path / "k.ptx")
    assert not ppath.read_bytes().endswith(b"\0")
    c2 = ctxkit.ObjectCode.from_file(cpath)
    p2 = ctxkit.ObjectCode.from_file(ppath)
    assert (c2.target, c2.code, c2.name) == ("cubin", cubin.code, "k.cubin")
    assert (p2.target, p2.arch) == ("ptx", "compute_90")
    assert p2.code == ptx.code and p2.ptx == ptx.ptx


def test_object_code_is_hashable_and_comparable() -> None:
    a = ctxkit.compile(SAXPY, arch="sm_90", name_expressions=("saxpy",), cache=False)
    b = ctxkit.compile(SAXPY, arch="sm_90", name_expressions=("saxpy",), cache=False)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


def test_from_bytes_of_hand_written_ptx() -> None:
    obj = ctxkit.ObjectCode.from_bytes(C.kernel_source("vector_add_lowisa.ptx").encode())
    assert obj.target == "ptx" and obj.arch == "compute_52" and obj.code.endswith(b"\0")


def test_detect_target_rejects_other_bytes() -> None:
    with pytest.raises(ValueError, match="not PTX"):
        C.detect_target(b"int main() { return 0; }")
    assert C.detect_target(b"\x50\xed\x55\xba\x01\x00") == "fatbin"


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
    with pytest.raises(CompileError, match=r"ctxkit\[cu13\]"):
        _nvrtc.load_nvrtc()


def test_missing_nvjitlink_explains_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvjitlink", None)
    with pytest.raises(CompileError, match=r"ctxkit\[cu13\]"):
        C.link_ptx(C.kernel_source("vector_add_lowisa.ptx"), "sm_90")


# --- cache ----------------------------------------------------------------------------


def test_cache_dir_env_and_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(tmp_path / "x"))
    assert C.cache_dir() == tmp_path / "x"
    for off in ("off", "OFF", "0", "none", "false", "disabled"):
        monkeypatch.setenv("CTXKIT_CACHE_DIR", off)
        assert C.cache_dir() is None
    monkeypatch.delenv("CTXKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert C.cache_dir() == tmp_path / "xdg" / "ctxkit" / "kernels"


def test_default_cache_dir_created_private(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("XDG layout is Linux-only")
    monkeypatch.delenv("CTXKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ctxkit.compile(_unique("default-dir"), arch="sm_90")
    d = tmp_path / "xdg" / "ctxkit" / "kernels"
    assert len(_entries(d)) == 1
    assert (d.stat().st_mode & 0o777) == 0o700
    assert (_entries(d)[0].stat().st_mode & 0o777) == 0o600


def test_cache_hit_in_process(cache: Path) -> None:
    src = _unique("memo")
    before = dict(C.cache.stats)
    a = ctxkit.compile(src, arch="sm_90")
    b = ctxkit.compile(src, arch="sm_90")
    assert not a.from_cache and b.from_cache and a.code == b.code
    assert _delta(before) == {"compiled": 1, "disk_hits": 0, "memory_hits": 1}
    assert len(_entries(cache)) == 1
    assert (cache.stat().st_mode & 0o777) == 0o700


def test_cache_entry_is_json_header_plus_raw_bytes(cache: Path) -> None:
    obj = ctxkit.compile(_unique("format"), arch="sm_90", name_expressions=())
    data = _entries(cache)[0].read_bytes()
    first, rest = data.split(b"\n", 1)
    assert first.startswith(b"CTXKIT1 ") and hashlib.sha256(rest).hexdigest() == first[8:].decode()
    header_line, payload = rest.split(b"\n", 1)
    header = json.loads(header_line)
    assert header["target"] == "cubin" and header["arch"] == "sm_90"
    assert payload.startswith(obj.code)
    assert b"\x80\x04" not in data[:2]  # never a pickle


def test_cache_key_covers_every_input(cache: Path, tmp_path: Path) -> None:
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 1\n")
    src = '#include "v.h"\n' + _unique("key")
    base: dict[str, Any] = {"arch": "sm_90", "include_dirs": [inc]}
    variants: list[dict[str, Any]] = [
        {},
        {"arch": "sm_80"},
        {"target": "ptx"},
        {"options": ("-lineinfo",)},
        {"defines": {"X": 1}},
        {"std": "c++20"},
        {"name": "other.cu"},
        {"headers": {"unused.h": "// x"}},
        {"name_expressions": ("saxpy",)},
    ]
    before = dict(C.cache.stats)
    for v in variants:
        ctxkit.compile(src, **{**base, **v})
    assert _delta(before)["compiled"] == len(variants)
    for v in variants:
        assert ctxkit.compile(src, **{**base, **v}).from_cache
    (inc / "v.h").write_text("#define V 2  /* edited */\n")
    assert not ctxkit.compile(src, **base).from_cache


def test_cache_hit_in_new_process_without_nvrtc(cache: Path) -> None:
    src = C.kernel_source("templates.cu") + _unique("subprocess")
    exprs = ("axpy<float>", "fill_const<int, 7>")
    first = ctxkit.compile(src, arch="sm_90", name_expressions=exprs)
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["cuda.bindings.nvrtc"] = None   # any NVRTC use now raises ImportError
        import ctxkit
        from ctxkit import compiler
        obj = ctxkit.compile({src!r}, arch="sm_90", name_expressions={exprs!r})
        print(json.dumps({{
            "from_cache": obj.from_cache,
            "sha": __import__("hashlib").sha256(obj.code).hexdigest(),
            "lowered": dict(obj.lowered_names),
            "ptx_kept": obj.ptx is not None and ".entry" in obj.ptx,
            "stats": compiler.cache.stats,
        }}))
        """
    )
    out = _run_py(script, cache)
    result = json.loads(out.splitlines()[-1])
    assert result["from_cache"] is True
    assert result["sha"] == hashlib.sha256(first.code).hexdigest()
    assert result["lowered"] == dict(first.lowered_names)
    assert result["ptx_kept"] is True
    assert result["stats"] == {"compiled": 0, "disk_hits": 1, "memory_hits": 0}


def _run_py(script: str, cache: Path | str, check: bool = True) -> str:
    env = {**os.environ, "CTXKIT_CACHE_DIR": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout


def _reload_entry(src: str) -> tuple[C.ObjectCode, dict[str, int]]:
    _compile_cache._memo.clear()
    before = dict(C.cache.stats)
    obj = ctxkit.compile(src, arch="sm_90")
    return obj, _delta(before)


@pytest.mark.parametrize(
    "damage", ["flip_payload", "truncate", "tamper_header", "garbage", "empty"]
)
def test_corrupted_entry_is_discarded_and_recompiled(cache: Path, damage: str) -> None:
    src = _unique(damage)
    good = ctxkit.compile(src, arch="sm_90")
    (entry,) = _entries(cache)
    data = bytearray(entry.read_bytes())
    if damage == "flip_payload":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "tamper_header":
        data = data.replace(b'"arch": "sm_90"', b'"arch": "sm_80"', 1)
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    obj, delta = _reload_entry(src)
    assert delta["compiled"] == 1 and delta["disk_hits"] == 0
    assert not obj.from_cache and obj.code == good.code and obj.arch == "sm_90"
    again, delta = _reload_entry(src)
    assert again.from_cache and delta == {"compiled": 0, "disk_hits": 1, "memory_hits": 0}


def test_entry_under_another_key_is_rejected(cache: Path) -> None:
    a, b = _unique("a"), _unique("b")
    ctxkit.compile(a, arch="sm_90")
    (entry_a,) = _entries(cache)
    obj_b = ctxkit.compile(b, arch="sm_90")
    entry_b = next(p for p in _entries(cache) if p != entry_a)
    entry_b.write_bytes(entry_a.read_bytes())  # valid digest, wrong key
    obj, delta = _reload_entry(b)
    assert delta["compiled"] == 1 and obj.code == obj_b.code


def test_concurrent_writers_several_processes(cache: Path, tmp_path: Path) -> None:
    src = _unique("concurrent")
    go = tmp_path / "go"
    script = textwrap.dedent(
        f"""
        import hashlib, os, time
        import ctxkit
        from ctxkit import compiler
        while not os.path.exists({str(go)!r}):
            time.sleep(0.001)
        obj = ctxkit.compile({src!r}, arch="sm_90")
        print(hashlib.sha256(obj.code).hexdigest(), compiler.cache.stats["compiled"])
        """
    )
    env = {**os.environ, "CTXKIT_CACHE_DIR": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    time.sleep(0.5)
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        outs.append(out.split())
    assert len({sha for sha, _n in outs}) == 1
    assert not list(cache.glob("*.tmp"))
    assert len(_entries(cache)) == 1
    obj, delta = _reload_entry(src)
    assert obj.from_cache and delta["compiled"] == 0
    assert hashlib.sha256(obj.code).hexdigest() == outs[0][0]


def test_disabled_cache_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CTXKIT_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    src = _unique("off")
    before = dict(C.cache.stats)
    a = ctxkit.compile(src, arch="sm_90")
    b = ctxkit.compile(src, arch="sm_90")
    assert not a.from_cache and not b.from_cache
    assert _delta(before)["compiled"] == 2
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def test_cache_false_bypasses_cache(cache: Path) -> None:
    src = _unique("nocache")
    ctxkit.compile(src, arch="sm_90", cache=False)
    assert not _entries(cache)


def test_unwritable_cache_warns_and_still_compiles(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(blocker / "sub"))
    monkeypatch.setattr(_compile_cache, "_warned_unwritable", False)
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache"):
        obj = ctxkit.compile(_unique("unwritable"), arch="sm_90")
    assert obj.code[:4] == b"\x7fELF"


def test_clear_cache(cache: Path) -> None:
    ctxkit.compile(_unique("clear1"), arch="sm_90")
    ctxkit.compile(_unique("clear2"), arch="sm_90")
    (cache / ".leftover.tmp").write_bytes(b"x")
    assert C.clear_cache() == 3
    assert not list(cache.iterdir())


def test_toolchain_fingerprint_falls_back_to_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compile_cache, "_candidate_dirs", lambda: [])
    calls = []

    def version() -> tuple[int, int]:
        calls.append(1)
        return (13, 0)

    fp = _compile_cache.toolchain_fingerprint.__wrapped__(version, 13)
    assert calls == [1]
    other = _compile_cache.toolchain_fingerprint.__wrapped__(lambda: (13, 1), 13)
    assert fp != other


def test_toolchain_fingerprint_tracks_library_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lib = tmp_path / "libnvrtc.so.13"
    lib.write_bytes(b"v1")
    monkeypatch.setattr(_compile_cache, "_candidate_dirs", lambda: [str(tmp_path)])

    def no_version() -> tuple[int, int]:
        raise AssertionError("must not load NVRTC when a library file is found")

    fp1 = _compile_cache.toolchain_fingerprint.__wrapped__(no_version, 13)
    lib.write_bytes(b"v2-upgraded")
    fp2 = _compile_cache.toolchain_fingerprint.__wrapped__(no_version, 13)
    assert fp1 != fp2


def test_file_fingerprint_is_bounded(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"h{i:02}.h").write_text(str(i))
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "objects").write_text("x")
    ((_dir, files),) = _compile_cache.file_fingerprint([str(tmp_path)], limit=10)
    assert len(files) == 10 and all(not f[0].startswith(".git") for f in files)
