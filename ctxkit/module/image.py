"""What ``Module.load`` is given (ObjectCode, bytes, PTX text, path), JIT logs and messages.

No driver state lives here: reading and classifying images, the JIT log buffers passed
to ``cuLibraryLoadData``/``cuModuleLoadDataEx``, and the texts of load and lookup errors.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import _driver
from .. import context as _context
from .._driver import drv
from ..compiler.objectcode import detect_target
from ..errors import CompileError

__all__ = [
    "JIT_CODES",
    "Image",
    "decode_log",
    "jit_detail",
    "jit_error",
    "jit_options",
    "missing_kernel_message",
    "read_image",
]


#: Load failures that are the JIT's: invalid image/PTX, no JIT, PTX newer than the driver.
JIT_CODES = frozenset({200, 218, 221, 222, 223})


_LOG_BYTES = 1 << 15


class Image:
    """What ``Module.load`` was given, normalised.

    ``source`` is the CUDA C++ source when an ``ObjectCode`` carries it: the declared
    parameter types of ``extern "C"`` kernels are read from it.
    """

    __slots__ = ("code", "format", "label", "lowered", "ptx", "source")

    def __init__(
        self,
        code: bytes,
        fmt: str,
        label: str,
        ptx: str | None,
        lowered: Mapping[str, str],
        source: str | None = None,
    ) -> None:
        self.code = code
        self.format = fmt
        self.label = label
        self.ptx = ptx
        self.lowered = dict(lowered)
        self.source = source


def _looks_like_ptx_text(text: str) -> bool:
    return "\n" in text and any(k in text for k in (".version", ".entry", ".target"))


def _ptx_image(text: str) -> bytes:
    return text.rstrip("\0").encode() + b"\0"


def read_image(source: Any, name: str | None = None) -> Image:
    """Normalise a ``Module.load`` argument: ObjectCode, bytes, PTX text or a path."""
    if hasattr(source, "code") and hasattr(source, "target"):
        fmt = str(source.target)
        if fmt not in ("ptx", "cubin", "fatbin"):
            raise ValueError(f"ObjectCode.target must be ptx, cubin or fatbin, not {fmt!r}")
        code = bytes(source.code)
        ptx = getattr(source, "ptx", None)
        if fmt == "ptx":
            ptx = code.rstrip(b"\0").decode()
            code = _ptx_image(ptx)
        label = name or getattr(source, "name", None) or "<ObjectCode>"
        text = getattr(source, "source", None)
        return Image(
            code,
            fmt,
            str(label),
            ptx,
            getattr(source, "lowered_names", None) or {},
            text if isinstance(text, str) else None,
        )
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return _from_bytes(data, name or f"<{len(data)} bytes>")
    if isinstance(source, str) and _looks_like_ptx_text(source):
        return Image(_ptx_image(source), "ptx", name or "<PTX text>", source, {})
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(
                f"Module.load: {str(source)[:200]!r} is neither a file nor PTX text "
                "(PTX text must contain .version/.entry lines)"
            )
        return _from_bytes(path.read_bytes(), name or str(path))
    raise TypeError(
        f"Module.load takes a ck.ObjectCode, bytes, PTX text or a path, not {type(source).__name__}"
    )


def _from_bytes(data: bytes, label: str) -> Image:
    fmt = detect_target(data)
    if fmt == "ptx":
        text = data.rstrip(b"\0").decode()
        return Image(_ptx_image(text), fmt, label, text, {})
    return Image(data, fmt, label, None, {})


def missing_kernel_message(
    name: str, label: str, entries: list[str] | None, lowered: Mapping[str, str]
) -> str:
    """The text of :class:`KernelNotFoundError`: what exists and how to fix the name."""
    by_symbol = {v: k for k, v in lowered.items()}
    if entries is None:
        listing = "unknown (no PTX, and this driver cannot enumerate kernels)"
    else:
        shown = [f"{by_symbol[e]} ({e})" if e in by_symbol else e for e in entries]
        listing = ", ".join(shown) or "none"
    msg = f"no kernel {name!r} in module {label}. Kernels present: {listing}."
    mangled = [e for e in entries or () if e.startswith("_Z") and f"{len(name)}{name}" in e]
    if mangled:
        msg += (
            f" {name!r} was compiled as C++ and its name is mangled ({mangled[0]}): declare "
            'it extern "C", or compile with name_expressions=("'
            f'{name}<...>",) and look it up by that expression.'
        )
    elif "<" in name and name not in lowered:
        msg += (
            " A template instantiation is found through name_expressions: compile with "
            f"name_expressions=({name!r},) so its lowered name is recorded."
        )
    else:
        close = difflib.get_close_matches(name, [*(entries or ()), *lowered], n=3)
        if close:
            msg += f" Did you mean {', '.join(repr(c) for c in close)}?"
        msg += ' Kernels must be __global__ and extern "C" (or named via name_expressions).'
    return msg


_PTX_VERSION = re.compile(r"^\s*\.version\s+(\d+)\.(\d+)", re.M)


def jit_detail(code: int, ptx: str | None, error_log: str, info_log: str) -> str:
    """The part of a JIT failure message after the driver's error text."""
    parts = []
    if error_log:
        parts.append(f"JIT error log:\n{error_log}")
    if info_log:
        parts.append(f"JIT info log:\n{info_log}")
    if code == 222 and ptx:
        m = _PTX_VERSION.search(ptx)
        drv_ver = _driver.driver_version()
        if m:
            have = f"{drv_ver[0]}.{drv_ver[1]}" if drv_ver else "unknown"
            parts.append(
                f"The PTX is ISA version {m.group(1)}.{m.group(2)}; the driver (CUDA {have}) "
                "is older than the NVRTC that wrote it."
            )
    return "\n".join(parts)


def decode_log(buf: bytearray) -> str:
    """The text a JIT log buffer holds (up to its NUL)."""
    return bytes(buf).split(b"\0", 1)[0].decode(errors="replace").strip()


def jit_options() -> tuple[list[Any], list[Any], bytearray, bytearray]:
    """JIT option keys and values with fresh info and error log buffers (also returned)."""
    info, err = bytearray(_LOG_BYTES), bytearray(_LOG_BYTES)
    opt = drv.CUjit_option
    keys = [
        opt.CU_JIT_INFO_LOG_BUFFER,
        opt.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        opt.CU_JIT_ERROR_LOG_BUFFER,
        opt.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        opt.CU_JIT_LOG_VERBOSE,
    ]
    return keys, [info, _LOG_BYTES, err, _LOG_BYTES, 1], info, err


def jit_error(
    code: int, call_text: str, image: Image, error_log: str = "", info_log: str = ""
) -> CompileError:
    """A JIT failure with the JIT's log (re-read in the current context if lost)."""
    if not error_log and image.format == "ptx":
        error_log = diagnose_jit(image) or ""
    exc = _driver.from_result(code, call_text, jit_detail(code, image.ptx, error_log, info_log))
    return CompileError(str(exc), error_log, code, exc.name)


def diagnose_jit(image: Image) -> str | None:
    """JIT the PTX in the current context just to read the error log (lazy loading
    can defer a library's JIT until a kernel is first used)."""
    try:
        cur = _context.current_handle()
    except Exception:
        return None
    if not cur:
        return None
    keys, vals, _info, err_log = jit_options()
    res = drv.cuModuleLoadDataEx(image.code, len(keys), keys, vals)
    if not res[0]:
        drv.cuModuleUnload(res[1])
    return decode_log(err_log) or None
