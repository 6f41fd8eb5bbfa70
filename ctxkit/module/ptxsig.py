"""Kernel signatures: PTX ``.entry`` parameters, and the C++ parameter types PTX leaves out.

:func:`parse_entries` reads every ``.entry`` of a PTX module (type, size, alignment and
offset of each parameter); :func:`signature_from_layout` builds a signature from the driver's
parameter offsets and sizes when there is no PTX (a bare cubin).

PTX has no signedness: NVRTC declares ``int``, ``unsigned`` and ``size_t`` parameters all
as ``.u32``/``.u64``. The C++ types come from two places: the mangled name of a C++
kernel (Itanium ABI, e.g. ``_Z4axpyIfEvT_PKS0_PS0_m`` ends in ``m``, ``unsigned long``),
read by the C++ runtime's demangler through the optional extra ``.[demangle]``
(without it, C++ kernels keep the sign PTX gives), and, for an ``extern "C"`` kernel, its
declaration in the CUDA source.
:func:`mangled_param_types` and :func:`source_param_types` return one :class:`CType` per
parameter, or ``None`` when they cannot tell (then nothing is assumed);
:func:`cpp_param_types` asks the one that applies to a kernel.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

__all__ = [
    "CType",
    "Param",
    "Signature",
    "classify_spelling",
    "cpp_param_types",
    "mangled_param_types",
    "parse_entries",
    "signature_from_layout",
    "source_param_types",
]


SIGNED = "signed"


UNSIGNED = "unsigned"


class CType(NamedTuple):
    """One parameter's C++ type: how it is spelled and the sign of an integer.

    ``sign`` is ``"signed"``, ``"unsigned"`` (also pointers and ``bool``, which never
    take a negative value) or ``""`` (not an integer, or a sign we cannot know, such as
    plain ``char`` or an unknown typedef).
    """

    spelling: str
    sign: str


# --- Itanium C++ ABI mangled names ---------------------------------------------------------


def demangle(symbol: str) -> str | None:
    """The C++ declaration an Itanium-mangled name stands for; ``None`` when unknown.

    Read by the C++ runtime's own ``__cxa_demangle`` through the optional ``cxxfilt``
    package (``pip install -e ".[demangle]"``). Without it (or without a C++ runtime
    library, or for a name the runtime cannot read) C++ kernels keep the sign PTX gives:
    both signed and unsigned values of a ``.u`` parameter's width are taken.
    """
    try:
        import cxxfilt
    except ImportError:
        return None
    try:
        return str(cxxfilt.demangle(symbol))
    except cxxfilt.Error:
        return None


def mangled_param_types(symbol: str) -> list[CType] | None:
    """Parameter types from an Itanium-mangled kernel name; ``None`` if it cannot be read.

    The demangled declaration's parameter list (see :func:`demangle`), each type
    classified as a declared one (:func:`classify_spelling`).
    """
    text = demangle(symbol) if symbol.startswith("_Z") else None
    start = _matching(text, len(text) - 1, -1) if text and text.endswith(")") else -1
    if text is None or start < 0:
        return None
    inner = text[start + 1 : -1].strip()
    return [classify_spelling(d) for d in _split_top_level(inner)] if inner else []


# --- extern "C" declarations in the CUDA source --------------------------------------------

_COMMENTS_AND_STRINGS = re.compile(
    r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S
)


_QUALIFIERS = frozenset(
    {
        "const",
        "volatile",
        "__restrict__",
        "__restrict",
        "restrict",
        "register",
        "struct",
        "enum",
        "class",
        "typename",
        "__grid_constant__",
        "__align__",
    }
)


_BUILTIN_WORDS = frozenset({"signed", "unsigned", "int", "short", "long", "char", "__int128"})


_SIGNED_NAMES = frozenset(
    {
        "int8_t",
        "int16_t",
        "int32_t",
        "int64_t",
        "intptr_t",
        "intmax_t",
        "ptrdiff_t",
        "ssize_t",
        "longlong",
    }
)


#: Unsigned besides ``u`` + a signed name (``uint32_t``, ``uint``, ``ulonglong``) and
#: CUDA's ``cuu`` + one (``cuuint64_t``): ``bool`` and ``charN_t`` never take a negative value.
_UNSIGNED_NAMES = frozenset({"size_t", "bool", "char8_t", "char16_t", "char32_t"})


def _unsigned_name(word: str) -> bool:
    base = word[3:] if word.startswith("cuu") else word[1:] if word.startswith("u") else ""
    return (
        word in _UNSIGNED_NAMES or base in _SIGNED_NAMES or base in ("int", "short", "char", "long")
    )


def classify_spelling(text: str) -> CType:
    """The :class:`CType` of a declared parameter type such as ``const size_t``."""
    spelled = " ".join(text.split())
    if any(ch in spelled for ch in "*&["):
        return CType(spelled, UNSIGNED)
    words = [
        w for w in re.findall(r"[A-Za-z_]\w*(?:::[A-Za-z_]\w*)*", spelled) if w not in _QUALIFIERS
    ]
    words = [w.rsplit("::", 1)[-1] if w.startswith(("std::", "cuda::")) else w for w in words]
    if not words:
        return CType(spelled, "")
    name = " ".join(words)
    if len(words) == 1 and _unsigned_name(words[0]):
        return CType(name, UNSIGNED)
    if len(words) == 1 and words[0] in _SIGNED_NAMES:
        return CType(name, SIGNED)
    if set(words) <= _BUILTIN_WORDS:
        if "unsigned" in words:
            return CType(name, UNSIGNED)
        if "char" in words and "signed" not in words:
            return CType(name, "")  # plain char: the sign is the platform's choice
        return CType(name, SIGNED)
    return CType(name, "")


def _matching(text: str, start: int, step: int = 1) -> int:
    """Index of the parenthesis that matches the one at *start*, looking forward from a
    ``(`` (or backward from a ``)``, *step* -1); -1 when unbalanced."""
    depth = 0
    for i in range(start, len(text) if step > 0 else -1, step):
        depth += {"(": step, ")": -step}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


def _split_top_level(text: str) -> list[str]:
    """*text* split at the commas outside any bracket."""
    parts = [""]
    depth = 0
    for ch in text:
        depth += (ch in "(<[{") - (ch in ")>]}")
        if ch == "," and depth == 0:
            parts.append("")
        else:
            parts[-1] += ch
    return parts


def _param_type_text(decl: str) -> str:
    """``const size_t n = 4`` -> ``const size_t``: drop the default value and the name."""
    decl = decl.split("=", 1)[0].strip()
    decl = re.sub(r"__align__\s*\([^)]*\)", " ", decl)
    if (m := re.match(r"^(.*?)([A-Za-z_]\w*)\s*((?:\[[^\]]*\])*)$", decl, re.S)) is None:
        return decl
    head, name, arrays = m.group(1), m.group(2), m.group(3)
    words = re.findall(r"[A-Za-z_]\w*", head)
    if not [w for w in words if w not in _QUALIFIERS]:
        return decl  # no name given: `size_t`, `const size_t`
    if name in _BUILTIN_WORDS and all(w in _BUILTIN_WORDS | _QUALIFIERS for w in words):
        return decl  # `unsigned int`: every word is part of the type
    return head + ("*" if arrays else "")


def source_param_types(source: str, name: str, count: int) -> list[CType] | None:
    """Parameter types of ``__global__`` function *name* as declared in *source*.

    Only declarations with exactly *count* parameters are read (the PTX's count), and
    they must agree (a C++ overload with as many parameters but other types gives
    ``None``); ``None`` also when there is none, or when the parameter list uses a macro
    or template this reader cannot see through.
    """
    if name not in source:
        return None
    text = _COMMENTS_AND_STRINGS.sub(" ", source)
    text = re.sub(r"^\s*#.*$", " ", text, flags=re.M)
    found: list[list[CType]] = []
    for m in re.finditer(r"\b" + re.escape(name) + r"\s*\(", text):
        head = text[: m.start()]
        cut = max(head.rfind(";"), head.rfind("}"), head.rfind("{"))
        if "__global__" not in head[cut + 1 :]:
            continue
        if (end := _matching(text, m.end() - 1)) < 0:
            return None
        inner = text[m.end() : end].strip()
        decls = [] if inner in ("", "void") else _split_top_level(inner)
        if len(decls) == count:
            found.append([classify_spelling(_param_type_text(d)) for d in decls])
    return found[0] if found and all(f == found[0] for f in found) else None


def cpp_param_types(symbol: str, source: str | None, count: int) -> list[CType] | None:
    """The C++ types of the *count* parameters of kernel *symbol*: from its mangled name
    (C++ kernels, with the optional demangler), else from its declaration in *source*
    (kernels of a program ctxkit compiled: ``extern "C"`` ones, and C++ ones at namespace
    scope without template arguments, whose name the mangled symbol spells out);
    ``None`` when neither tells."""
    name: str | None = symbol
    if symbol.startswith("_Z"):
        types = mangled_param_types(symbol)
        name = _plain_name(symbol) if types is None else None
        if name is None:
            return types
    return source_param_types(source, name, count) if source and name else None


def _plain_name(symbol: str) -> str | None:
    """The identifier of a C++ function mangled at namespace scope with no template
    arguments (``_Z6widthshsiyxPfm`` -> ``widths``); ``None`` for anything else."""
    if (m := re.match(r"_Z(\d+)", symbol)) is None:
        return None
    end = m.end() + int(m.group(1))
    name = symbol[m.end() : end]
    return name if name.isidentifier() and symbol[end : end + 1] not in ("I", "") else None


_UNSIGNED_CODE = {1: "B", 2: "H", 4: "I", 8: "Q"}


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
    if head in ("s", "u", "b") and bits in ("8", "16", "32", "64"):
        return (BITS if head == "b" else INT), int(bits) // 8
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
        sign = ctype.sign
        return replace(self, ctype=ctype.spelling, signed=sign == SIGNED, unsigned=sign == UNSIGNED)

    @property
    def code(self) -> str:
        """The :mod:`struct` code that packs it."""
        if self.kind == FLOAT:
            return _FLOAT_CODE[self.type]
        if self.kind == BYTES:
            return f"{self.size}s"
        code = _UNSIGNED_CODE[self.size]
        return code.lower() if self.signed else code  # struct: "b" signed, "B" unsigned


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
        return replace(self, params=tuple(p.with_ctype(t) for p, t in zip(self.params, ctypes)))


_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$%][\w$]*)\s*(?:\((.*?)\))?([^{;]*)[{;]", re.S)


_DIRECTIVE = re.compile(r"\.(maxntid|reqntid)\s+([\d\s,]+)")


_STATE_SPACES = {"global", "shared", "const", "local"}


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
    if (m := re.fullmatch(r"([A-Za-z_$%][\w$]*)(?:\[(\d+)\])?", tokens[-1])) is None:
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
    """``.maxntid``/``.reqntid`` values in an entry's directives, by name (the last wins)."""
    return {m[1]: tuple(map(int, re.findall(r"\d+", m[2]))) for m in _DIRECTIVE.finditer(text)}


def parse_entries(ptx: str | bytes) -> dict[str, Signature]:
    """All ``.entry`` signatures in a PTX text, by entry name, in file order.

    Raises
    ------
    ValueError
        A parameter declaration cannot be read.
    """
    if isinstance(ptx, (bytes, bytearray, memoryview)):
        ptx = bytes(ptx).rstrip(b"\0").decode("utf-8", errors="replace")
    text = _COMMENT.sub(" ", ptx)
    out: dict[str, Signature] = {}
    for m in _ENTRY.finditer(text):
        name, plist, tail = m.group(1), m.group(2), m.group(3)
        params: list[Param] = []
        end = 0
        for i, decl in enumerate(d for d in (plist or "").split(",") if d.strip()):
            params.append(p := _parse_param(decl, i, end))
            end = p.offset + p.size
        d = _directives(tail)
        out[name] = Signature(name, tuple(params), end, d.get("maxntid"), d.get("reqntid"))
    return out


def signature_from_layout(name: str, layout: Sequence[tuple[int, int]]) -> Signature:
    """A signature from the driver's ``(offset, size)`` per parameter (types unknown)."""
    params = []
    end = 0
    for i, (offset, size) in enumerate(layout):
        kind, align = (BITS, size) if size in _UNSIGNED_CODE else (BYTES, 1)
        params.append(Param(i, f"param_{i}", "raw", size, align, offset, kind=kind))
        end = max(end, offset + size)
    return Signature(name, tuple(params), end)
