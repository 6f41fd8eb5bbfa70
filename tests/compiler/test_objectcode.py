"""ObjectCode: save/load, equality, wrapping existing images, telling them apart."""

from __future__ import annotations

from pathlib import Path

import pytest

import ctxkit
import ctxkit.compiler as C
from tests.compiler._helpers import SAXPY


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
