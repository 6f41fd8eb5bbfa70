"""PTX ``.entry`` signatures: the type, size, alignment and offset of each kernel parameter.

Pure text processing (no driver): :func:`parse_entries` reads every ``.entry`` of a PTX
module; :func:`signature_from_layout` builds a signature from the driver's parameter
offsets and sizes when there is no PTX (a bare cubin).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .cdecl import SIGNED, UNSIGNED, CType

__all__ = ["Param", "Signature", "parse_entries", "parse_entry", "signature_from_layout"]


_INT_BITS = {"8": 8, "16": 16, "32": 32, "64": 64}


_UNSIGNED_CODE = {1: "B", 2: "H", 4: "I", 8: "Q"}


_SIGNED_CODE = {1: "b", 2: "h", 4: "i", 8: "q"}


_FLOAT_CODE = {"f16": "e", "f32": "f", "f64": "d"}


_RAW_TYPES = {"f16x2": 4, "bf16": 2, "bf16x2": 4, "b128": 16}


INT = "int"


FLOAT = "float"


BITS = "bits"


BYTES = "bytes"


def _type_info(ptx_type: str) -> tuple[str, int]:
    """``(kind, size)`` of a PTX scalar type name without the dot."""
    if ptx_type in _FLOAT_CODE:
        return FLOAT, int(ptx_type[1:]) // 8
    if ptx_type in _RAW_TYPES:
        return BYTES, _RAW_TYPES[ptx_type]
    head, bits = ptx_type[:1], ptx_type[1:]
    if head in ("s", "u") and bits in _INT_BITS:
        return INT, _INT_BITS[bits] // 8
    if head == "b" and bits in _INT_BITS:
        return BITS, _INT_BITS[bits] // 8
    raise ValueError(f"unsupported PTX parameter type .{ptx_type}")


@dataclass(frozen=True)
class Param:
    """One kernel parameter.

    Attributes
    ----------
    index : int
        Position in the parameter list.
    name : str
        PTX name (NVRTC writes ``<kernel>_param_<i>``).
    type : str
        PTX type without the dot (``"u64"``, ``"f32"``, ``"b8"``), or ``"raw"`` when
        only the size is known (cubin without PTX).
    size : int
        Bytes the parameter occupies.
    align : int
        Alignment in bytes.
    offset : int
        Offset in the device-side parameter buffer.
    count : int
        Array length for ``.b8 name[24]``-style parameters, 0 for scalars.
    pointer : bool
        True when the PTX marks it ``.ptr``.
    signed : bool
        True for ``.s`` integer types, and for ``.u``/``.b`` ones whose C++ type is a
        signed integer (NVRTC writes ``int`` as ``.u32``).
    unsigned : bool
        True when the C++ type is known to be unsigned (``size_t``, ``unsigned``, a
        pointer): negative values are refused. Neither flag: the sign is unknown and
        both signed and unsigned values of the width are taken.
    ctype : str
        The C++ type, when known (from the mangled name or the source).
    kind : str
        ``"int"``, ``"float"``, ``"bits"`` (untyped bits) or ``"bytes"`` (by-value
        aggregate).
    """

    index: int
    name: str
    type: str
    size: int
    align: int
    offset: int
    count: int = 0
    pointer: bool = False
    signed: bool = False
    kind: str = INT
    unsigned: bool = False
    ctype: str = ""

    @property
    def ptx_type(self) -> str:
        """The declaration as PTX spells it, e.g. ``.u64`` or ``.align 8 .b8[24]``."""
        if self.type == "raw":
            return f"{self.size} bytes, type unknown (no PTX)"
        if self.count:
            return f".align {self.align} .{self.type}[{self.count}]"
        return f".{self.type}" + (" .ptr" if self.pointer else "")

    @property
    def accepts_pointer(self) -> bool:
        """A 64-bit integer or untyped parameter can carry a device pointer."""
        return self.size == 8 and self.kind in (INT, BITS) and not self.count

    def describe(self) -> str:
        ctype = f", {self.ctype}" if self.ctype else ""
        return f"parameter {self.index} '{self.name}' ({self.ptx_type}{ctype})"

    def with_ctype(self, ctype: CType) -> Param:
        """This parameter with its C++ type: the sign applies to integer parameters."""
        if self.kind not in (INT, BITS) or self.count or self.type.startswith("s"):
            return replace(self, ctype=ctype.spelling)
        return replace(
            self,
            ctype=ctype.spelling,
            signed=ctype.sign == SIGNED,
            unsigned=ctype.sign == UNSIGNED,
        )

    @property
    def code(self) -> str:
        """The :mod:`struct` code that packs it."""
        if self.kind == FLOAT:
            return _FLOAT_CODE[self.type]
        if self.kind == BYTES:
            return f"{self.size}s"
        table = _SIGNED_CODE if self.signed else _UNSIGNED_CODE
        return table[self.size]


@dataclass(frozen=True)
class Signature:
    """A kernel's parameter list and launch-bound directives.

    Attributes
    ----------
    name : str
        Entry name as in the PTX (mangled for C++ kernels).
    params : tuple of Param
    size : int
        Total bytes of the device-side parameter buffer.
    maxntid, reqntid : tuple of int or None
        ``.maxntid`` / ``.reqntid`` block-size directives, when present.
    """

    name: str
    params: tuple[Param, ...]
    size: int
    maxntid: tuple[int, ...] | None = None
    reqntid: tuple[int, ...] | None = None

    def __str__(self) -> str:
        inner = ", ".join(f"{p.ptx_type} {p.name}" for p in self.params)
        return f"{self.name}({inner})"

    def with_ctypes(self, ctypes: Sequence[CType] | None) -> Signature:
        """This signature with the C++ type of each parameter (unchanged on a count mismatch)."""
        if ctypes is None or len(ctypes) != len(self.params):
            return self
        params = tuple(p.with_ctype(t) for p, t in zip(self.params, ctypes))
        return replace(self, params=params)


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$%][\w$]*)\s*(?:\((.*?)\))?([^{;]*)[{;]", re.S)


_DIRECTIVE = re.compile(r"\.(maxntid|reqntid)\s+([\d\s,]+)")


_STATE_SPACES = {"global", "shared", "const", "local"}


def _strip_comments(ptx: str) -> str:
    return _COMMENT.sub(" ", ptx)


def _parse_param(decl: str, index: int, offset: int) -> Param:
    text = re.sub(r"\s*\[\s*", "[", decl.strip())
    text = re.sub(r"\s*\]", "]", text)
    tokens = text.split()
    if len(tokens) < 3 or tokens[0] != ".param":
        raise ValueError(f"not a .param declaration: {decl.strip()!r}")
    align = 0
    ptype = ""
    vec = 1
    pointer = False
    it = iter(tokens[1:-1])
    for tok in it:
        word = tok.lstrip(".")
        if word == "align":
            value = int(next(it, "0"))
            if not pointer:  # after .ptr, .align is the pointee's alignment
                align = value
        elif word == "ptr":
            pointer = True
        elif word in _STATE_SPACES:
            continue
        elif word in ("v2", "v4"):
            vec = int(word[1])
        else:
            ptype = word
    if not ptype:
        raise ValueError(f"no type in parameter declaration {decl.strip()!r}")
    kind, elem = _type_info(ptype)
    m = re.fullmatch(r"([A-Za-z_$%][\w$]*)(?:\[(\d+)\])?", tokens[-1])
    if m is None:
        raise ValueError(f"cannot read the parameter name in {decl.strip()!r}")
    count = int(m.group(2)) if m.group(2) else 0
    size = elem * vec * (count or 1)
    align = align or elem * vec
    if count or vec > 1:
        kind = BYTES
    offset = (offset + align - 1) // align * align
    return Param(
        index=index,
        name=m.group(1),
        type=ptype,
        size=size,
        align=align,
        offset=offset,
        count=count,
        pointer=pointer,
        signed=ptype.startswith("s"),
        kind=kind,
    )


def _directives(text: str) -> dict[str, tuple[int, ...]]:
    out = {}
    for m in _DIRECTIVE.finditer(text or ""):
        out[m.group(1)] = tuple(int(x) for x in m.group(2).replace(",", " ").split())
    return out


def parse_entries(ptx: str | bytes) -> dict[str, Signature]:
    """All ``.entry`` signatures in a PTX text, by entry name, in file order.

    Raises
    ------
    ValueError
        A parameter declaration cannot be read.
    """
    if isinstance(ptx, (bytes, bytearray, memoryview)):
        ptx = bytes(ptx).rstrip(b"\0").decode("utf-8", errors="replace")
    text = _strip_comments(ptx)
    out: dict[str, Signature] = {}
    for m in _ENTRY.finditer(text):
        name, plist, tail = m.group(1), m.group(2), m.group(3)
        params: list[Param] = []
        end = 0
        decls = [d for d in (plist or "").split(",") if d.strip()]
        for i, decl in enumerate(decls):
            p = _parse_param(decl, i, end)
            params.append(p)
            end = p.offset + p.size
        d = _directives(tail)
        out[name] = Signature(name, tuple(params), end, d.get("maxntid"), d.get("reqntid"))
    return out


def parse_entry(ptx: str | bytes, name: str) -> Signature:
    """The signature of entry *name*; ``KeyError`` listing the entries present."""
    entries = parse_entries(ptx)
    try:
        return entries[name]
    except KeyError:
        raise KeyError(f"no .entry {name!r} in the PTX (entries: {sorted(entries)})") from None


def signature_from_layout(name: str, layout: Sequence[tuple[int, int]]) -> Signature:
    """A signature from the driver's ``(offset, size)`` per parameter (types unknown)."""
    params = []
    end = 0
    for i, (offset, size) in enumerate(layout):
        kind = BITS if size in _UNSIGNED_CODE else BYTES
        align = size if size in _UNSIGNED_CODE else 1
        params.append(Param(i, f"param_{i}", "raw", size, align, offset, kind=kind))
        end = max(end, offset + size)
    return Signature(name, tuple(params), end)
