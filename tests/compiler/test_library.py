"""The ptx/ kernel library: every .cu compiles with NVRTC and every .ptx links with nvJitLink
for sm_90, with the entry points and parameter lists the other modules rely on."""

from __future__ import annotations

import re

import pytest

import ctxkit
import ctxkit.compiler as C

U64, U32, U8, F32, F64 = ".u64", ".u32", ".u8", ".f32", ".f64"

#: file -> {entry: PTX parameter types}; pointers and size_t are .u64.
CONTRACT: dict[str, dict[str, list[str]]] = {
    "vector_add.cu": {"vector_add": [U64, U64, U64, U64]},
    "saxpy.cu": {"saxpy": [F32, U64, U64, U64]},
    "scale.cu": {
        "scale_f32": [U64, U64, U64, F32],
        "scale_f64": [U64, U64, U64, F64],
        "scale_i32": [U64, U64, U64, U32],
    },
    "reduce.cu": {"reduce_sum_f32": [U64, U64, U64]},
    "fill.cu": {"fill_f32": [U64, F32, U64], "fill_u8": [U64, U8, U64]},
    "spin.cu": {"spin": [U64, U64], "spin_then_copy": [U64, U64, U64, U64]},
    "fault.cu": {"fault": [U64]},
    "empty.cu": {"empty": [U64, U32]},
    "vector_add_lowisa.ptx": {"vector_add_ptx": [U64, U64, U64, U32]},
    "fill_lowisa.ptx": {"fill_f32_ptx": [U64, F32, U32], "fill_u8_ptx": [U64, ".u16", U32]},
}
TEMPLATE_EXPRESSIONS = ("axpy<float>", "axpy<double>", "fill_const<int, 7>", "fill_const<float, 1>")

CU_FILES = [n for n in C.kernel_names() if n.endswith(".cu")]
PTX_FILES = [n for n in C.kernel_names() if n.endswith(".ptx")]


def entries(ptx: str) -> dict[str, list[str]]:
    """``{entry name: [param type, ...]}`` parsed from PTX text."""
    out = {}
    for m in re.finditer(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", ptx):
        params = [p for p in m.group(2).split(",") if p.strip()]
        out[m.group(1)] = [re.search(r"\.param\s+(\.\w+)", p).group(1) for p in params]  # type: ignore[union-attr]
    return out


def test_library_has_every_contract_file() -> None:
    assert set(CONTRACT) | {"templates.cu"} <= set(C.kernel_names())


@pytest.mark.parametrize("name", CU_FILES)
@pytest.mark.parametrize("target", ["ptx", "cubin"])
def test_every_cu_compiles_for_sm90(name: str, target: str) -> None:
    exprs = TEMPLATE_EXPRESSIONS if name == "templates.cu" else ()
    obj = ctxkit.compile(
        C.kernel_source(name),
        name=name,
        arch="sm_90",
        target=target,
        name_expressions=exprs,
        cache=False,
    )
    assert obj.log == "", f"{name} compiles with warnings:\n{obj.log}"
    assert obj.target == target
    if target == "cubin":
        assert obj.code[:4] == b"\x7fELF"
    found = entries(obj.ptx or "")
    for entry, params in CONTRACT.get(name, {}).items():
        assert found.get(entry) == params, f"{name}: {entry} has {found.get(entry)}"
    if name == "templates.cu":
        assert set(obj.lowered_names.values()) <= set(found)


@pytest.mark.parametrize("name", PTX_FILES)
def test_every_ptx_links_for_sm90(name: str) -> None:
    text = C.kernel_source(name)
    cubin = C.link_ptx(text, "sm_90", name=name)
    assert cubin[:4] == b"\x7fELF"
    found = entries(text)
    assert found == CONTRACT[name]
    for entry in found:
        assert entry.encode() in cubin


@pytest.mark.parametrize("name", PTX_FILES)
def test_hand_written_ptx_is_low_isa(name: str) -> None:
    text = C.kernel_source(name)
    assert re.search(r"^\.version 7\.0$", text, re.MULTILINE)
    assert re.search(r"^\.target sm_52$", text, re.MULTILINE)
    assert ctxkit.ObjectCode.from_bytes(text.encode()).target == "ptx"


def test_kernel_source_names() -> None:
    assert C.kernel_source("saxpy") == C.kernel_source("saxpy.cu")
    assert 'extern "C" __global__ void saxpy(' in C.kernel_source("saxpy")
    assert C.kernel_path("vector_add_lowisa.ptx").suffix == ".ptx"
    assert C.kernel_path("../ptx/saxpy.cu").name == "saxpy.cu"


def test_kernel_source_missing_lists_available() -> None:
    with pytest.raises(FileNotFoundError, match=r"available: .*saxpy\.cu"):
        C.kernel_source("no_such_kernel.cu")


def test_kernel_library_found_from_source_checkout() -> None:
    d = C.kernel_path("saxpy.cu").parent
    assert (d / "vector_add.cu").is_file()
    assert d.name == "ptx"
