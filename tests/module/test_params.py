"""Argument checking and packing against PTX signatures: no GPU needed."""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any

import numpy as np
import pytest

from ctxkit import LaunchArgumentError
from ctxkit.module import params as P
from ctxkit.module import params as _devptr
from ctxkit.module import params as pointers
from ctxkit.module.ptxsig import CType
from tests.module.ptx_samples import (
    HAND_PTX,
    FakeBuffer,
    FakeCai,
    FakeCpuTensor,
    FakeCudaTensor,
    FakeDlpackHost,
    entries,
    packer,
)
from tests.support.helpers import OBJECT_DTYPES, object_array, object_dtype_message

# --- packing ----------------------------------------------------------------------------


def test_pack_pointers_and_ints_exactly():
    pk = packer("empty")
    data = pk.pack((FakeBuffer(0xDEAD_BEEF_0000), 7))
    assert len(data) == 12
    assert struct.unpack("<QI", data) == (0xDEAD_BEEF_0000, 7)
    assert struct.unpack("<QI", pk.pack((FakeCai(0x1000), -1))) == (0x1000, 0xFFFF_FFFF)
    assert struct.unpack("<QI", pk.pack((None, np.uint32(5)))) == (0, 5)
    assert struct.unpack("<QI", pk.pack((2**63, True))) == (2**63, 1)
    assert struct.unpack("<QI", pk.pack((FakeCudaTensor(), 0))) == (1234, 0)


def test_pack_float_with_padding():
    pk = packer("_Z2tkIfEvPT_S0_")
    data = pk.pack((FakeBuffer(8), 2.5))
    assert struct.unpack("<Qf", data) == (8, 2.5)
    assert struct.unpack("<Qf", pk.pack((8, 3))) == (8, 3.0)  # int -> float param is fine
    assert struct.unpack("<Qf", pk.pack((8, np.float64(0.5))))[1] == 0.5
    assert struct.unpack("<Qf", pk.pack((8, float("inf"))))[1] == float("inf")


def test_pack_every_kind_at_its_offset():
    class S(ctypes.Structure):
        _fields_ = [("a", ctypes.c_double), ("b", ctypes.c_int), ("c", ctypes.c_char * 12)]

    s = S(1.5, -2, b"hello")
    v = np.array([1, 2, 3, 4], dtype=np.float32)
    f4 = np.zeros((), dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("w", "<f4")])[()]
    args = (-1, 2**32 - 1, -3, 40000, -(2**63), 1.25, -2.5, 2**64 - 1, FakeBuffer(0x7000),
            True, s, v, 255, None, np.float16(1.5), f4, np.int64(-9), np.int8(-128))  # fmt: skip
    data = P.ArgPacker(entries()["k"]).pack(args)
    assert len(data) == 169

    def at(fmt: str, off: int):
        return struct.unpack_from("<" + fmt, data, off)[0]

    assert at("i", 0) == -1 and at("I", 4) == 2**32 - 1
    assert at("b", 8) == -3 and at("H", 10) == 40000
    assert at("q", 16) == -(2**63)
    assert at("f", 24) == 1.25 and at("d", 32) == -2.5
    assert at("Q", 40) == 2**64 - 1 and at("Q", 48) == 0x7000
    assert at("B", 56) == 1
    assert data[64:88] == bytes(s)
    assert data[96:112] == v.tobytes()
    assert at("B", 112) == 255 and at("Q", 120) == 0
    assert data[128:130] == np.float16(1.5).tobytes()
    assert data[144:160] == bytes(16)
    assert at("q", 160) == -9 and at("b", 168) == -128
    padding = [range(9, 10), range(60, 64), range(88, 96), range(113, 120), range(130, 144)]
    assert all(data[i] == 0 for r in padding for i in r)


def test_pack_hand_written_types():
    pk = packer("typed", HAND_PTX)
    args = (FakeBuffer(0x10), -5, -(2**40), 0.5, np.float32(1.0), FakeBuffer(0x20), -128,
            np.array([1, 2, 3], dtype=np.int32), b"abcde", 2.0)  # fmt: skip
    data = pk.pack(args)
    assert len(data) == 72

    def at(fmt: str, off: int):
        return struct.unpack_from("<" + fmt, data, off)[0]

    assert (at("Q", 0), at("i", 8), at("q", 16)) == (0x10, -5, -(2**40))
    assert at("e", 24) == 0.5
    assert data[28:32] == np.float32(1.0).tobytes()  # .b32 keeps the float's bits
    assert (at("Q", 32), at("b", 40)) == (0x20, -128)
    assert data[44:56] == np.array([1, 2, 3], dtype=np.int32).tobytes()
    assert data[56:61] == b"abcde"
    assert at("d", 64) == 2.0


def test_address_points_into_a_thread_local_buffer():
    pk = packer("empty")
    addr = pk.address((FakeBuffer(0xABC), 42))
    p0, p1 = (int(p or 0) for p in (ctypes.c_void_p * 2).from_address(addr))
    assert ctypes.c_uint64.from_address(p0).value == 0xABC
    assert ctypes.c_uint32.from_address(p1).value == 42
    assert p1 - p0 == 8
    assert pk.address((1, 2)) == addr  # reused in this thread
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(pk.address((1, 2))))
    t.start()
    t.join()
    assert other[0] != addr
    assert packer("noargs").address(()) == 0


def test_pack_one_and_index_of():
    pk = packer("empty")
    buf = P.ParamBuffer(pk.sig)
    pk.pack_into(buf, (FakeBuffer(1), 2))
    pk.pack_one(buf, pk.index_of("empty_param_1"), 99)
    pk.pack_one(buf, -2, FakeBuffer(5))
    assert struct.unpack("<QI", bytes(buf)) == (5, 99)
    with pytest.raises(KeyError, match="no parameter 'n'"):
        pk.index_of("n")
    with pytest.raises(IndexError):
        pk.index_of(2)
    with pytest.raises(LaunchArgumentError, match="parameter 1"):
        pk.pack_one(buf, 1, 1.5)
    assert struct.unpack("<QI", bytes(buf)) == (5, 99)  # a refused value changes nothing


# --- argument errors --------------------------------------------------------------------

FLOAT_P = (FakeBuffer(1), 1.0)  # _Z2tk: (.u64, .f32)


@pytest.mark.parametrize(
    ("name", "args", "where", "why"),
    [
        ("empty", (FakeBuffer(1),), "takes 2 arguments but 1 were given", "FakeBuffer"),
        ("empty", (1, 2, 3), "takes 2 arguments but 3 were given", "int, int, int"),
        ("empty", (FakeBuffer(1), 1.5), "parameter 1 'empty_param_1' (.u32)", "a float"),
        ("empty", (FakeBuffer(1), np.float32(2)), "parameter 1", "a float for an integer"),
        ("empty", (1.0, 1), "parameter 0 'empty_param_0' (.u64)", "a float"),
        ("empty", (FakeBuffer(1), 2**32), "parameter 1", "out of range for .u32"),
        ("empty", (FakeBuffer(1), -(2**31) - 1), "parameter 1", "out of range"),
        ("empty", (2**64, 1), "parameter 0", "out of range for .u64"),
        ("empty", (FakeBuffer(1), FakeBuffer(2)), "parameter 1", "cannot hold a pointer"),
        ("empty", (np.zeros(4, np.float32), 1), "parameter 0", "pageable host memory"),
        ("empty", (FakeBuffer(1), np.zeros(1, np.int32)), "parameter 1", "arr.item()"),
        ("empty", ("0x10", 1), "parameter 0", "expected an integer or a device pointer"),
        ("empty", (FakeBuffer(1), 1 + 2j), "parameter 1", "complex"),
        ("empty", (FakeCpuTensor(), 1), "parameter 0", "torch tensor on cpu"),
        ("empty", (FakeDlpackHost(), 1), "parameter 0", "host memory"),
        ("_Z2tkIfEvPT_S0_", (FakeBuffer(1), FakeBuffer(2)), "parameter 1 (.f32)", "a pointer"),
        ("_Z2tkIfEvPT_S0_", (FakeBuffer(1), None), "parameter 1", "a pointer"),
        ("_Z2tkIfEvPT_S0_", (FakeBuffer(1), 1e39), "parameter 1", "out of range for .f32"),
        ("_Z2tkIfEvPT_S0_", (FakeBuffer(1), 10**400), "parameter 1", "too large for .f32"),
        ("_Z2tkIfEvPT_S0_", (FakeBuffer(1), "1.0"), "parameter 1", "expected a real number"),
        ("_Z2tkIfEvPT_S0_", (FakeBuffer(1), np.ones(2)), "parameter 1", "takes one number"),
    ],
)
def test_argument_errors_name_the_parameter(name, args, where, why):
    pk = packer(name)
    for attempt in (pk.pack, pk.address):
        with pytest.raises(LaunchArgumentError) as info:
            attempt(args)
        msg = str(info.value)
        assert where.replace(" (.f32)", "") in msg
        assert why in msg
        assert "Signature:" in msg


@pytest.mark.parametrize(
    ("index", "value", "why"),
    [
        (1, 2**31, "out of range for .s32"),
        (6, 200, "out of range for .s8"),
        (6, -129, "out of range for .s8"),
        (3, 70000.0, "out of range for .f16"),
        (4, 1.5, "does not say int or float"),
        (4, np.float64(1.5), "it takes 4 bytes"),
        (7, b"12345678", "got 8 bytes"),
        (7, 3, "struct/array by value"),
        (8, np.arange(2, dtype=np.int8), "got 2 bytes"),
    ],
)
def test_hand_written_type_errors(index, value, why):
    pk = packer("typed", HAND_PTX)
    good = [FakeBuffer(1), 1, 1, 1.0, 1, 1, 1, bytes(12), bytes(5), 1.0]
    pk.pack(good)
    good[index] = value
    with pytest.raises(LaunchArgumentError, match=f"argument {index} does not fit") as info:
        pk.pack(good)
    assert why in str(info.value)


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_arrays_of_python_objects_are_not_passed_by_value(dtype):
    pk = packer("typed", HAND_PTX)
    args = [FakeBuffer(1), 1, 1, 1.0, 1, 1, 1, object_array(dtype, 16), bytes(5), 1.0]
    with pytest.raises(LaunchArgumentError, match=object_dtype_message(dtype)):
        pk.pack(args)


def test_half_struct_hint_and_non_contiguous_array():
    pk = packer("k")
    args: list[Any] = [1] * 18
    args[10], args[11], args[14], args[15] = bytes(24), bytes(16), np.float16(1), bytes(16)
    args[8] = args[13] = FakeBuffer(1)
    args[5] = args[6] = 1.0
    pk.pack(args)
    args[14] = 1.5
    with pytest.raises(LaunchArgumentError, match=r"np\.float16\(x\)"):
        pk.pack(args)
    args[14] = np.float16(1)
    args[11] = np.arange(8, dtype=np.float32)[::2]
    with pytest.raises(LaunchArgumentError, match="non-contiguous"):
        pk.pack(args)


def test_host_pointer_resolver_accepts_device_visible_host_memory(monkeypatch):
    pinned = np.zeros(4, np.float32)
    seen = []

    def resolver(arr: np.ndarray) -> int | None:
        seen.append(arr)
        return 0x5000 if arr is pinned else None

    monkeypatch.setattr(_devptr, "host_device_pointer", resolver)
    assert struct.unpack("<QI", packer("empty").pack((pinned, 1))) == (0x5000, 1)
    with pytest.raises(LaunchArgumentError, match="pageable"):
        packer("empty").pack((np.zeros(4), 1))
    assert seen[0] is pinned


def test_device_pointer_and_dlpack_pointer():
    assert pointers.device_pointer(FakeBuffer(77)) == 77
    assert pointers.device_pointer(FakeCai(88)) == 88
    assert pointers.device_pointer(3) is None
    assert pointers.device_pointer(np.float32(1)) is None
    with pytest.raises(LaunchArgumentError, match="pageable"):
        pointers.device_pointer(np.zeros(3))
    arr = np.arange(10, dtype=np.int64)[3:]
    assert pointers.dlpack_pointer(arr) == arr.__array_interface__["data"][0]


# --- integer ranges and signs -----------------------------------------------------------

WIDTHS = """
.version 7.0
.target sm_52
.address_size 64
.visible .entry widths(.param .u8 a, .param .u16 b, .param .u32 c, .param .u64 d)
{ ret; }
"""

UNSIGNED_C = [
    CType("unsigned char", "unsigned"),
    CType("unsigned short", "unsigned"),
    CType("unsigned", "unsigned"),
    CType("size_t", "unsigned"),
]

SIGNED_C = [
    CType("signed char", "signed"),
    CType("short", "signed"),
    CType("int", "signed"),
    CType("long long", "signed"),
]


def widths(ctypes_: list[CType] | None) -> P.ArgPacker:
    return P.ArgPacker(entries(WIDTHS)["widths"].with_ctypes(ctypes_))


def with_one(i: int, value: Any) -> tuple[Any, ...]:
    args: list[Any] = [0, 0, 0, 0]
    args[i] = value
    return tuple(args)


@pytest.mark.parametrize("i", range(4), ids=["u8", "u16", "u32", "u64"])
@pytest.mark.parametrize("bad", [-1, np.int64(-5), np.int8(-1), -(2**70)])
def test_unsigned_parameters_refuse_negative_values_on_every_path(i: int, bad: Any) -> None:
    pk = widths(UNSIGNED_C)
    param = pk.sig.params[i]
    assert param.unsigned and not param.signed
    args = with_one(i, bad)
    for attempt in (
        lambda: pk.pack(args),
        lambda: pk.address(args),
        lambda: pk.pack_one(P.ParamBuffer(pk.sig), i, bad),
    ):
        with pytest.raises(LaunchArgumentError) as info:
            attempt()
        msg = str(info.value)
        assert f"argument {i}" in msg and UNSIGNED_C[i].spelling in msg
        if int(bad) >= -(2**63):
            assert "negative value for an unsigned parameter" in msg
            assert f"would read it as {int(bad) & (2 ** (param.size * 8) - 1)}" in msg


@pytest.mark.parametrize("i", range(4), ids=["u8", "u16", "u32", "u64"])
def test_unsigned_range_ends(i: int) -> None:
    pk = widths(UNSIGNED_C)
    top = 2 ** (8 << i) - 1
    assert struct.unpack("<BxHIQ", pk.pack(with_one(i, top)))[i] == top
    assert struct.unpack("<BxHIQ", pk.pack(with_one(i, np.uint64(0))))[i] == 0
    with pytest.raises(LaunchArgumentError, match=rf"got {top + 1}, out of range .*valid: 0\.\."):
        pk.pack(with_one(i, top + 1))


@pytest.mark.parametrize("i", range(4), ids=["s8", "s16", "s32", "s64"])
def test_signed_parameters_take_their_signed_range(i: int) -> None:
    pk = widths(SIGNED_C)
    bits = 8 << i
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    fmt = "<bxhiq"
    assert struct.unpack(fmt, pk.pack(with_one(i, lo)))[i] == lo
    assert struct.unpack(fmt, pk.pack(with_one(i, np.int64(-1))))[i] == -1
    assert struct.unpack(fmt, pk.pack(with_one(i, hi)))[i] == hi
    for bad in (hi + 1, lo - 1, 2**bits - 1):
        with pytest.raises(LaunchArgumentError, match=rf"got {bad}, out of range"):
            pk.pack(with_one(i, bad))
        with pytest.raises(LaunchArgumentError, match=rf"got {bad}, out of range"):
            pk.address(with_one(i, bad))


@pytest.mark.parametrize("i", range(4), ids=["8", "16", "32", "64"])
def test_unknown_sign_takes_both_ranges_and_nothing_more(i: int) -> None:
    """PTX alone (``Module.load`` of PTX text): ``.u32`` may be ``int`` or ``unsigned``."""
    pk = widths(None)
    bits = 8 << i
    assert struct.unpack("<BxHIQ", pk.pack(with_one(i, -1)))[i] == 2**bits - 1
    assert struct.unpack("<BxHIQ", pk.pack(with_one(i, 2**bits - 1)))[i] == 2**bits - 1
    assert struct.unpack("<BxHIQ", pk.pack(with_one(i, -(2 ** (bits - 1)))))[i] == 2 ** (bits - 1)
    for bad in (2**bits, -(2 ** (bits - 1)) - 1):
        with pytest.raises(LaunchArgumentError, match=rf"got {bad}, out of range for \.u{bits}"):
            pk.pack(with_one(i, bad))


def test_pointer_parameters_refuse_negative_integers() -> None:
    sig = entries()["empty"].with_ctypes([CType("void*", "unsigned"), CType("int", "signed")])
    pk = P.ArgPacker(sig)
    assert struct.unpack("<Qi", pk.pack((0x1000, -4))) == (0x1000, -4)
    with pytest.raises(LaunchArgumentError, match=r"argument 0 .*\(\.u64, void\*\).*negative"):
        pk.address((-1, 0))
    assert "empty_param_0 (void*)" in pk._signature_text()


def test_c_types_are_shown_in_messages_and_the_ptx_sign_wins() -> None:
    sig = entries(HAND_PTX)["typed"]
    typed = sig.with_ctypes([CType(f"t{i}", "unsigned") for i in range(len(sig.params))])
    count = typed.params[1]  # .s32: the PTX says signed, a C++ claim cannot change it
    assert count.signed and not count.unsigned and count.ctype == "t1"
    assert typed.params[5].unsigned and "(.b64, t5)" in typed.params[5].describe()
    assert sig.with_ctypes([CType("int", "signed")]) is sig  # wrong count: unchanged
