"""Kernel signatures from PTX, argument checking and packing (pure Python, no driver).

A kernel's ``.entry`` parameter list says the type, size and alignment of every
parameter. :func:`parse_entries` reads it; :class:`ArgPacker` checks Python arguments
against it and packs them, at the device-side offsets, into one buffer plus the
``void**`` array ``cuLaunchKernel`` takes. PTX does not mark pointers reliably (NVRTC
emits ``.u64`` for both ``float*`` and ``size_t``), so a 64-bit integer parameter
takes a device pointer or an integer, while floats and narrower integers refuse
pointers. The launch-configuration helpers (:func:`normalize_dims`,
:func:`explain_launch_config`) live here too, so all of it is testable without a GPU.
"""

from __future__ import annotations

import ctypes
import operator
import re
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import LaunchArgumentError

__all__ = [
    "ArgPacker",
    "Param",
    "ParamBuffer",
    "Signature",
    "device_pointer",
    "dlpack_pointer",
    "explain_launch_config",
    "normalize_dims",
    "parse_entries",
    "parse_entry",
    "set_host_pointer_resolver",
    "signature_from_layout",
]

# --- PTX types ------------------------------------------------------------------------

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
        True for ``.s`` integer types.
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
        return f"parameter {self.index} '{self.name}' ({self.ptx_type})"

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


# --- PTX parsing ----------------------------------------------------------------------

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


# --- what a value is ------------------------------------------------------------------


class _Refused(Exception):
    """A value does not fit a parameter; the message says why."""


_HostResolver = Callable[[np.ndarray], "int | None"]


def _no_host_pointers(arr: np.ndarray) -> int | None:
    return None


_host_resolver: _HostResolver = _no_host_pointers


def set_host_pointer_resolver(fn: _HostResolver | None) -> None:
    """Install the function that maps a host array to a device-usable pointer.

    It returns the pointer for page-locked or managed memory and ``None`` for pageable
    memory. ``module`` installs a driver-backed one; without it every host array is
    refused.
    """
    global _host_resolver
    _host_resolver = fn or _no_host_pointers


_HOST_ARRAY_FIX = (
    "copy it to the device first (ck.DeviceBuffer / ck.device_array) or allocate it "
    "device-visible (ck.pinned_empty, ck.ManagedBuffer(...).as_numpy())"
)


def _ndarray_pointer(arr: np.ndarray) -> int:
    ptr = _host_resolver(arr)
    if ptr is None:
        raise _Refused(
            f"got a numpy array {arr.shape} {arr.dtype} in pageable host memory, which a "
            f"kernel cannot read; {_HOST_ARRAY_FIX}"
        )
    return int(ptr)


def _torch_pointer(t: Any) -> int:
    if not t.is_cuda:
        raise _Refused(f"got a torch tensor on {t.device} (host memory); move it with .cuda()")
    return int(t.data_ptr())


def _cupy_pointer(a: Any) -> int:
    return int(a.data.ptr)


def _attr_pointer(a: Any) -> int:
    return int(a.ptr)


def _cai_pointer(a: Any) -> int:
    return int(a.__cuda_array_interface__["data"][0] or 0)


_DLPACK_HOST = 1
_DLPACK_DEVICE_TYPES = {2, 3, 13}  # CUDA, CUDA host (pinned), CUDA managed
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_DLTENSOR_BYTE_OFFSET = 40  # data, device, ndim, dtype, shape, strides precede it


def dlpack_pointer(obj: Any) -> int:
    """Address of the first element of a DLPack producer (``__dlpack__``)."""
    capsule = obj.__dlpack__()
    base = _capsule_pointer(capsule, b"dltensor")
    data = ctypes.c_void_p.from_address(base).value or 0
    return data + ctypes.c_uint64.from_address(base + _DLTENSOR_BYTE_OFFSET).value


def _dlpack_device_pointer(obj: Any) -> int:
    dev_type = int(obj.__dlpack_device__()[0])
    if dev_type not in _DLPACK_DEVICE_TYPES:
        where = "host memory" if dev_type == _DLPACK_HOST else f"DLPack device type {dev_type}"
        raise _Refused(f"got a {type(obj).__name__} in {where}; a kernel needs device memory")
    return dlpack_pointer(obj)


_getters: dict[type, Callable[[Any], int] | None] = {}
_getters_lock = threading.Lock()


def _classify(v: Any) -> Callable[[Any], int] | None:
    t = type(v)
    if isinstance(v, np.ndarray):
        return _ndarray_pointer
    if isinstance(v, np.generic) or hasattr(t, "__cuda_stream__"):
        return None  # numbers, and streams (which carry .ptr too) are not memory
    mod = t.__module__ or ""
    if mod.startswith("torch") and hasattr(v, "data_ptr") and hasattr(v, "is_cuda"):
        return _torch_pointer
    if mod.startswith("cupy") and hasattr(getattr(v, "data", None), "ptr"):
        return _cupy_pointer
    if hasattr(t, "ptr") or "ptr" in getattr(v, "__dict__", ()):
        return _attr_pointer
    if hasattr(v, "__cuda_array_interface__"):
        return _cai_pointer
    if hasattr(v, "__dlpack__") and hasattr(v, "__dlpack_device__"):
        return _dlpack_device_pointer
    return None


def _pointer_getter(v: Any) -> Callable[[Any], int] | None:
    t = type(v)
    try:
        return _getters[t]
    except KeyError:
        pass
    g = _classify(v)
    with _getters_lock:
        _getters[t] = g
    return g


def device_pointer(v: Any) -> int | None:
    """The device address *v* carries, or ``None`` when *v* is not a memory object.

    Understands ctxkit buffers and arrays (``.ptr``), ``__cuda_array_interface__``
    (CuPy, Numba, PyTorch), DLPack producers and page-locked/managed numpy arrays.

    Raises
    ------
    LaunchArgumentError
        *v* is memory a kernel cannot use (pageable numpy array, CPU tensor).
    """
    g = _pointer_getter(v)
    if g is None:
        return None
    try:
        return g(v)
    except _Refused as exc:
        raise LaunchArgumentError(str(exc)) from None


def _short(v: Any) -> str:
    r = repr(v)
    if len(r) > 60:
        r = r[:57] + "..."
    return f"{type(v).__name__} {r}"


# --- converters: value -> what struct packs -------------------------------------------


def _int_range(p: Param) -> tuple[int, int]:
    bits = p.size * 8
    if p.signed:
        return -(1 << (bits - 1)), 1 << (bits - 1)
    return -(1 << (bits - 1)), 1 << bits


def _as_int(p: Param, v: Any) -> int:
    t = type(v)
    if t is int or t is bool or isinstance(v, (np.integer, np.bool_)):
        return int(v)
    if t is float or isinstance(v, np.floating):
        raise _Refused(
            f"got {_short(v)}: a float for an integer parameter; convert it explicitly "
            "(int(x)) if truncation is intended"
        )
    if v is None and p.accepts_pointer:
        return 0
    g = _pointer_getter(v)
    if g is not None:
        if p.accepts_pointer:
            return g(v)
        if isinstance(v, np.ndarray):
            raise _Refused(
                f"got a numpy array {v.shape} {v.dtype}; the parameter takes one integer "
                "(use arr.item() or a numpy scalar)"
            )
        raise _Refused(
            f"got {type(v).__name__} (device memory), but a {p.size * 8}-bit integer cannot "
            "hold a pointer; the kernel expects a number here (check the argument order)"
        )
    expected = "an integer or a device pointer" if p.accepts_pointer else "an integer"
    raise _Refused(f"got {_short(v)}; expected {expected}")


_MISSING: Any = object()


def _int_converter(p: Param) -> Callable[[Any], int]:
    lo, hi = _int_range(p)
    mask = (1 << (p.size * 8)) - 1
    signed = p.signed
    getters = _getters if p.accepts_pointer else {}

    def conv(v: Any) -> int:
        if type(v) is int:
            x = v
        else:
            g = getters.get(type(v), _MISSING)
            if g is not None and g is not _MISSING:
                return g(v)
            x = _as_int(p, v)
        if not lo <= x < hi:
            raise _Refused(f"got {x}, out of range for .{p.type} (valid: {lo}..{hi - 1})")
        return x if signed else x & mask

    return conv


_FLOAT_MAX = {2: 65504.0, 4: 3.4028234663852886e38, 8: float("inf")}
_INF = float("inf")


def _float_converter(p: Param) -> Callable[[Any], float]:
    limit = _FLOAT_MAX[p.size]

    def conv(v: Any) -> float:
        t = type(v)
        if t is float or t is int or t is bool or isinstance(v, (np.floating, np.integer)):
            try:
                x = float(v)
            except OverflowError:
                raise _Refused(f"got {_short(v)}, too large for .{p.type}") from None
        elif isinstance(v, np.ndarray):
            raise _Refused(
                f"got a numpy array {v.shape} {v.dtype}; a float parameter takes one number "
                "(use arr.item() or a numpy scalar)"
            )
        elif v is None or _pointer_getter(v) is not None:
            raise _Refused(
                f"got {type(v).__name__}, a pointer, but the kernel expects a floating-point "
                "number here (check the argument order)"
            )
        else:
            raise _Refused(f"got {_short(v)}; expected a real number")
        if limit < abs(x) < _INF:
            raise _Refused(f"got {x!r}, out of range for .{p.type} (max {limit:g})")
        return x

    return conv


def _to_bytes(p: Param, v: Any) -> bytes:
    if isinstance(v, (bytes, bytearray, memoryview)):
        data = bytes(v)
    elif isinstance(v, (np.generic, np.ndarray)):
        if isinstance(v, np.ndarray) and not (v.flags.c_contiguous or v.flags.f_contiguous):
            raise _Refused(f"got a non-contiguous array {v.shape} {v.dtype}")
        data = v.tobytes()
    elif isinstance(v, (ctypes.Structure, ctypes.Union, ctypes.Array, ctypes._SimpleCData)):
        data = bytes(memoryview(v).cast("B"))
    else:
        hint = ""
        if p.size == 2 and isinstance(v, float):
            hint = " (for a __half parameter pass np.float16(x))"
        elif p.count or p.kind == BYTES:
            hint = (
                " (a struct/array by value: pass a numpy structured scalar, "
                "np.array([...], dtype), a ctypes.Structure or bytes)"
            )
        raise _Refused(f"got {_short(v)}; expected exactly {p.size} bytes{hint}")
    if len(data) != p.size:
        raise _Refused(f"got {len(data)} bytes ({type(v).__name__}); it takes {p.size} bytes")
    return data


def _bytes_converter(p: Param) -> Callable[[Any], bytes]:
    return lambda v: _to_bytes(p, v)


def _bits_converter(p: Param) -> Callable[[Any], int]:
    as_int = _int_converter(p)

    def conv(v: Any) -> int:
        t = type(v)
        if t is int:
            return as_int(v)
        if isinstance(v, np.generic) and not isinstance(v, (np.integer, np.bool_)):
            return int.from_bytes(_to_bytes(p, v), "little")
        if t is float:
            raise _Refused(
                f"got {_short(v)}, but the parameter type is {p.ptx_type}, which does not "
                f"say int or float; pass a numpy scalar of {p.size} bytes "
                f"(np.float{p.size * 8}(x) or np.int{p.size * 8}(x))"
            )
        if isinstance(v, (bytes, bytearray, memoryview, ctypes._SimpleCData)):
            return int.from_bytes(_to_bytes(p, v), "little")
        return as_int(v)

    return conv


def _converter(p: Param) -> Callable[[Any], Any]:
    if p.kind == INT:
        return _int_converter(p)
    if p.kind == FLOAT:
        return _float_converter(p)
    if p.kind == BITS:
        return _bits_converter(p)
    return _bytes_converter(p)


# --- packing --------------------------------------------------------------------------


def _compile_fill(convs: Sequence[Callable[[Any], Any]], pack_into: Any) -> Any:
    """``fill(data, args)``: convert and pack all arguments with one unrolled call.

    Generated so the hot path has no per-argument loop (about half the cost of a
    comprehension); the source contains only generated names, never user input.
    """
    calls = ", ".join(f"c{i}(a[{i}])" for i in range(len(convs)))
    namespace: dict[str, Any] = {f"c{i}": c for i, c in enumerate(convs)}
    namespace["pack_into"] = pack_into
    exec(f"def fill(d, a):\n    pack_into(d, 0, {calls})\n", namespace)
    return namespace["fill"]


def _layout_format(params: Sequence[Param], total: int) -> str:
    fmt = ["<"]
    pos = 0
    for p in params:
        if p.offset > pos:
            fmt.append(f"{p.offset - pos}x")
        fmt.append(p.code)
        pos = p.offset + p.size
    if total > pos:
        fmt.append(f"{total - pos}x")
    return "".join(fmt)


class ParamBuffer:
    """Stable memory for one launch's parameters: ``data`` plus the ``void**`` array.

    ``address`` is what ``cuLaunchKernel`` takes as ``kernelParams`` (0 for a kernel
    with no parameters).
    """

    __slots__ = ("address", "data", "pointers")

    def __init__(self, sig: Signature) -> None:
        self.data = (ctypes.c_char * max(sig.size, 1))()
        base = ctypes.addressof(self.data)
        n = len(sig.params)
        self.pointers = (ctypes.c_void_p * max(n, 1))(*(base + p.offset for p in sig.params))
        self.address = ctypes.addressof(self.pointers) if n else 0

    def __bytes__(self) -> bytes:
        return bytes(self.data)


class ArgPacker:
    """Checks and packs arguments for one kernel signature.

    Parameters
    ----------
    sig : Signature
    kernel : str
        Name used in error messages.
    """

    __slots__ = ("_convs", "_fill", "_local", "_n", "_one", "_struct", "kernel", "sig")

    def __init__(self, sig: Signature, kernel: str | None = None) -> None:
        self.sig = sig
        self.kernel = kernel or sig.name
        self._n = len(sig.params)
        self._convs = tuple(_converter(p) for p in sig.params)
        self._struct = struct.Struct(_layout_format(sig.params, sig.size))
        self._one = tuple(struct.Struct("<" + p.code) for p in sig.params)
        self._fill = _compile_fill(self._convs, self._struct.pack_into)
        self._local = threading.local()

    # -- checking --------------------------------------------------------------------

    def values(self, args: Sequence[Any]) -> list[Any]:
        """Check *args* and convert each to the value that gets packed.

        Raises
        ------
        LaunchArgumentError
            Wrong count, or an argument that does not fit its parameter (the message
            names the parameter: index, PTX name and type).
        """
        if len(args) != self._n:
            raise self._count_error(args)
        return [self._check_one(i, v) for i, v in enumerate(args)]

    def _check_one(self, i: int, v: Any) -> Any:
        p = self.sig.params[i]
        try:
            x = self._convs[i](v)
            self._one[i].pack(x)
        except _Refused as exc:
            raise self._arg_error(p, str(exc)) from None
        except LaunchArgumentError as exc:
            raise self._arg_error(p, str(exc)) from None
        except (struct.error, OverflowError, TypeError, ValueError) as exc:
            raise self._arg_error(p, f"got {_short(v)}: {exc}") from None
        return x

    def _arg_error(self, p: Param, why: str) -> LaunchArgumentError:
        return LaunchArgumentError(
            f"{self.kernel}: argument {p.index} does not fit {p.describe()}: {why}. "
            f"Signature: {self._signature_text()}"
        )

    def _signature_text(self) -> str:
        inner = ", ".join(f"{p.ptx_type} {p.name}" for p in self.sig.params)
        return f"{self.kernel}({inner})"

    def _count_error(self, args: Sequence[Any]) -> LaunchArgumentError:
        given = ", ".join(type(a).__name__ for a in args) or "none"
        return LaunchArgumentError(
            f"{self.kernel} takes {self._n} argument{'s' if self._n != 1 else ''} but "
            f"{len(args)} were given ({given}). Signature: {self._signature_text()}"
        )

    def _explain(self, args: Sequence[Any], exc: BaseException) -> LaunchArgumentError:
        if len(args) != self._n:
            return self._count_error(args)
        for i, v in enumerate(args):
            try:
                self._check_one(i, v)
            except LaunchArgumentError as err:
                return err
        return LaunchArgumentError(f"{self.kernel}: cannot pack the arguments: {exc}")

    # -- packing ---------------------------------------------------------------------

    def pack(self, args: Sequence[Any]) -> bytes:
        """The device-side parameter buffer for *args* (padding bytes are zero)."""
        buf = ParamBuffer(self.sig)
        self.pack_into(buf, args)
        return bytes(buf)

    def pack_into(self, buf: ParamBuffer, args: Sequence[Any]) -> None:
        """Check *args* and write them into *buf*."""
        if len(args) != self._n:
            raise self._count_error(args)
        try:
            self._fill(buf.data, args)
        except Exception as exc:
            raise self._explain(args, exc) from None

    def pack_one(self, buf: ParamBuffer, index: int, value: Any) -> None:
        """Check and write the argument of parameter *index* only."""
        x = self._check_one(index, value)
        self._one[index].pack_into(buf.data, self.sig.params[index].offset, x)

    def address_for(self, args: Sequence[Any]) -> int:
        """Pack *args* into this thread's reusable buffer; return its ``void**`` address.

        The buffer is reused by the next call in the same thread, which is safe because
        ``cuLaunchKernel`` copies the parameters before it returns.
        """
        if len(args) != self._n:
            raise self._count_error(args)
        if not self._n:
            return 0
        try:
            buf = self._local.buf
        except AttributeError:
            buf = self._local.buf = ParamBuffer(self.sig)
        try:
            self._fill(buf.data, args)
        except Exception as exc:
            raise self._explain(args, exc) from None
        return buf.address

    def index_of(self, key: int | str) -> int:
        """Parameter index for an index or a PTX parameter name."""
        if isinstance(key, str):
            for p in self.sig.params:
                if p.name == key:
                    return p.index
            names = [p.name for p in self.sig.params]
            raise KeyError(f"{self.kernel} has no parameter {key!r} (parameters: {names})")
        i = operator.index(key)
        if not -self._n <= i < self._n:
            raise IndexError(f"{self.kernel} has {self._n} parameters; index {i} is out of range")
        return i % self._n


# --- launch configuration -------------------------------------------------------------

_DIM_MAX = (1 << 32) - 1


def normalize_dims(value: Any, what: str) -> tuple[int, int, int]:
    """``grid``/``block`` as an int or 1-3 ints -> ``(x, y, z)``, each at least 1."""
    if type(value) is int and 0 < value <= _DIM_MAX:
        return value, 1, 1
    try:
        items = list(value) if isinstance(value, (tuple, list)) else [value]
        dims = [operator.index(d) for d in items]
    except TypeError:
        raise TypeError(
            f"{what} must be an int or a tuple of 1-3 ints, got {_short(value)}"
        ) from None
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {len(dims)}: {tuple(dims)}")
    if any(not 0 < d <= _DIM_MAX for d in dims):
        raise ValueError(f"{what} dimensions must be positive ints, got {tuple(dims)}")
    while len(dims) < 3:
        dims.append(1)
    return dims[0], dims[1], dims[2]


def explain_launch_config(
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_mem: int,
    limits: dict[str, int],
) -> list[str]:
    """Reasons a launch configuration exceeds the device/kernel *limits*.

    *limits* keys (all optional): ``max_threads_per_block`` (the kernel's own limit),
    ``max_block_dim_x/y/z``, ``max_grid_dim_x/y/z``, ``max_dynamic_shared``
    (the kernel's current dynamic shared-memory limit), ``max_shared_optin``
    (the device's opt-in maximum), ``static_shared``, ``num_regs``,
    ``regs_per_block``, ``reqntid`` (product, from the PTX).
    """
    out = []
    threads = block[0] * block[1] * block[2]
    mtpb = limits.get("max_threads_per_block")
    if mtpb is not None and threads > mtpb:
        why = f"block {block} has {threads} threads, more than this kernel's limit of {mtpb}"
        regs = limits.get("num_regs")
        if regs and limits.get("regs_per_block"):
            why += (
                f" (it uses {regs} registers per thread; the SM has "
                f"{limits['regs_per_block']} per block)"
            )
        out.append(why + f"; use a block of at most {mtpb} threads")
    req = limits.get("reqntid")
    if req is not None and threads != req:
        out.append(f"the kernel requires exactly {req} threads per block (.reqntid)")
    for axis, n, key in zip(
        "xyz", block, ("max_block_dim_x", "max_block_dim_y", "max_block_dim_z")
    ):
        lim = limits.get(key)
        if lim is not None and n > lim:
            out.append(f"block.{axis} = {n} exceeds the device maximum {lim}")
    for axis, n in zip("xyz", grid):
        lim = limits.get(f"max_grid_dim_{axis}")
        if lim is not None and n > lim:
            out.append(f"grid.{axis} = {n} exceeds the device maximum {lim}")
    dyn = limits.get("max_dynamic_shared")
    if dyn is not None and shared_mem > dyn:
        why = f"shared_mem={shared_mem} bytes exceeds this kernel's dynamic shared limit ({dyn})"
        optin = limits.get("max_shared_optin")
        static = limits.get("static_shared", 0)
        if optin and shared_mem + static <= optin:
            why += (
                f"; the device allows up to {optin - static} after opting in: "
                "kernel.set_attribute('max_dynamic_shared_size_bytes', n)"
            )
        elif optin:
            why += f"; even opted in the device allows at most {optin} bytes per block"
        out.append(why)
    return out
