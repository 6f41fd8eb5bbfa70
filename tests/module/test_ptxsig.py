"""PTX ``.entry`` signature parsing: types, sizes, alignments, offsets (no GPU needed)."""

from __future__ import annotations

import pytest

from ctxkit.module import ptxsig
from tests.module.ptx_samples import HAND_PTX, NVRTC_PTX, entries

# --- parsing ----------------------------------------------------------------------------


def test_entries_in_file_order_with_mangled_and_empty_entries():
    e = entries()
    assert list(e) == ["k", "_Z2tkIfEvPT_S0_", "empty", "noargs"]
    assert e["noargs"].params == ()
    assert e["noargs"].size == 0
    assert e["noargs"].maxntid == (128, 1, 1)
    assert str(e["empty"]) == "empty(.u64 empty_param_0, .u32 empty_param_1)"


def test_nvrtc_types_sizes_alignments_offsets():
    k = entries()["k"]
    got = [(p.type, p.size, p.align, p.offset, p.count, p.kind) for p in k.params]
    assert got == [
        ("u32", 4, 4, 0, 0, "int"),
        ("u32", 4, 4, 4, 0, "int"),
        ("u8", 1, 1, 8, 0, "int"),
        ("u16", 2, 2, 10, 0, "int"),
        ("u64", 8, 8, 16, 0, "int"),
        ("f32", 4, 4, 24, 0, "float"),
        ("f64", 8, 8, 32, 0, "float"),
        ("u64", 8, 8, 40, 0, "int"),
        ("u64", 8, 8, 48, 0, "int"),
        ("u8", 1, 1, 56, 0, "int"),
        ("b8", 24, 8, 64, 24, "bytes"),
        ("b8", 16, 16, 96, 16, "bytes"),
        ("u8", 1, 1, 112, 0, "int"),
        ("u64", 8, 8, 120, 0, "int"),
        ("b8", 2, 2, 128, 2, "bytes"),
        ("b8", 16, 16, 144, 16, "bytes"),
        ("u64", 8, 8, 160, 0, "int"),
        ("u8", 1, 1, 168, 0, "int"),
    ]
    assert k.size == 169
    assert [p.name for p in k.params][:2] == ["k_param_0", "k_param_1"]
    assert k.params[10].ptx_type == ".align 8 .b8[24]"
    assert k.params[4].accepts_pointer and not k.params[0].accepts_pointer


def test_hand_written_ptx_pointer_attribute_signed_bits_arrays_and_comments():
    e = entries(HAND_PTX)
    assert list(e) == ["typed"]  # commented-out entries and .func are not kernels
    t = e["typed"]
    by_name = {p.name: p for p in t.params}
    out = by_name["out"]
    assert out.pointer and out.size == 8 and out.align == 8  # .align 16 is the pointee's
    assert out.ptx_type == ".u64 .ptr"
    assert (by_name["count"].signed, by_name["count"].code) == (True, "i")
    assert (by_name["offset"].signed, by_name["offset"].code) == (True, "q")
    assert (by_name["h"].kind, by_name["h"].code, by_name["h"].offset) == ("float", "e", 24)
    assert (by_name["bits"].kind, by_name["bits"].code) == ("bits", "I")
    assert by_name["bits64"].accepts_pointer
    assert by_name["tiny"].code == "b"
    arr = by_name["arr"]
    assert (arr.size, arr.align, arr.count, arr.kind, arr.offset) == (12, 4, 3, "bytes", 44)
    raw = by_name["raw"]
    assert (raw.size, raw.align, raw.offset) == (5, 1, 56)
    assert (by_name["scale"].offset, t.size) == (64, 72)
    assert t.reqntid == (256,)


def test_parse_accepts_bytes_with_nul_terminator():
    e = ptxsig.parse_entries(NVRTC_PTX.encode() + b"\0")
    assert "empty" in e


def test_parse_errors():
    with pytest.raises(ValueError, match="unsupported PTX parameter type .pred"):
        ptxsig.parse_entries(".entry f(.param .pred p) { ret; }")
    with pytest.raises(ValueError, match="not a .param declaration"):
        ptxsig.parse_entries(".entry f(.reg .u32 p) { ret; }")


def test_signature_from_driver_layout():
    sig = ptxsig.signature_from_layout("f", [(0, 8), (8, 4), (16, 24)])
    assert [(p.kind, p.size, p.offset) for p in sig.params] == [
        ("bits", 8, 0),
        ("bits", 4, 8),
        ("bytes", 24, 16),
    ]
    assert sig.size == 40
    assert "type unknown" in sig.params[0].ptx_type


def test_every_kernel_library_file_parses():
    """The ptx/ kernels compile (NVRTC runs on CPU) and their signatures are as documented."""
    from ctxkit.compiler import compile, kernel_names, kernel_source

    expected = {
        "vector_add": ["u64", "u64", "u64", "u64"],
        "saxpy": ["f32", "u64", "u64", "u64"],
        "scale_f32": ["u64", "u64", "u64", "f32"],
        "scale_f64": ["u64", "u64", "u64", "f64"],
        "scale_i32": ["u64", "u64", "u64", "u32"],
        "reduce_sum_f32": ["u64", "u64", "u64"],
        "fill_f32": ["u64", "f32", "u64"],
        "fill_u8": ["u64", "u8", "u64"],
        "spin": ["u64", "u64"],
        "spin_then_copy": ["u64", "u64", "u64", "u64"],
        "fault": ["u64"],
        "empty": ["u64", "u32"],
        "vector_add_ptx": ["u64", "u64", "u64", "u32"],
        "fill_f32_ptx": ["u64", "f32", "u32"],
        "fill_u8_ptx": ["u64", "u16", "u32"],
    }
    found: dict[str, list[str]] = {}
    for name in kernel_names():
        if name.endswith(".ptx"):
            text = kernel_source(name)
        elif name.endswith(".cu"):
            obj = compile(kernel_source(name), name=name, arch="sm_90", target="ptx", cache=False)
            assert obj.ptx
            text = obj.ptx
        else:
            continue
        for entry, sig in ptxsig.parse_entries(text).items():
            found[entry] = [p.type for p in sig.params]
    for entry, types in expected.items():
        assert found.get(entry) == types, entry
