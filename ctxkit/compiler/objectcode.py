"""Compiled code: :class:`ObjectCode` (cubin, PTX or fatbin bytes with their target and
arch) and :func:`detect_target`, which tells the three apart by their first bytes.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import _driver
from ..errors import PtxVersionWarning

__all__ = ["ObjectCode", "detect_target"]


TARGETS = ("auto", "ptx", "cubin", "fatbin")


#: The first bytes of a cubin (ELF) and of a fatbin.
_MAGIC_TARGETS = {b"\x7fELF": "cubin", b"\x50\xed\x55\xba": "fatbin"}


def warn_if_ptx_too_new(nvrtc: tuple[int, int] | None, stacklevel: int) -> None:
    drv = _driver.driver_version()
    if nvrtc is None or drv is None or tuple(nvrtc) <= drv:
        return
    warnings.warn(
        f"PTX from NVRTC {nvrtc[0]}.{nvrtc[1]} will not load on this driver (CUDA "
        f"{drv[0]}.{drv[1]}): it refuses newer PTX with CUDA_ERROR_UNSUPPORTED_PTX_VERSION. "
        "Compile with target='auto' or 'cubin' (no JIT needed), or upgrade the driver.",
        PtxVersionWarning,
        stacklevel=stacklevel + 1,
    )


@dataclass(frozen=True)
class ObjectCode:
    """Compiled device code, ready for ``ctxkit.Module.load``.

    Attributes
    ----------
    code : bytes
        The image: PTX text (NUL-terminated, as ``cuModuleLoadData`` wants), cubin or fatbin.
    target : {"ptx", "cubin", "fatbin"}
    arch : str
        ``"sm_XY"`` for cubin/fatbin, ``"compute_XY"`` for PTX.
    log : str
        NVRTC warnings (and ctxkit notes, e.g. a capped arch); empty when clean.
    ptx : str or None
        The PTX text, also kept next to a cubin so entry signatures can be parsed.
    lowered_names : dict
        Name expression (``"axpy<float>"``) -> mangled kernel name.
    name : str
        The program name (the file name in compiler messages).
    options : tuple of str
        The NVRTC options used.
    nvrtc_version : tuple or None
        ``(major, minor)`` of the NVRTC that compiled it.
    from_cache : bool
        True when the code came from the on-disk or in-memory cache.
    """

    code: bytes
    target: str
    arch: str
    log: str = ""
    ptx: str | None = None
    lowered_names: Mapping[str, str] = field(default_factory=dict, hash=False)
    name: str = "kernel.cu"
    options: tuple[str, ...] = ()
    nvrtc_version: tuple[int, int] | None = None
    from_cache: bool = field(default=False, compare=False)
    #: The CUDA C++ source (``None`` for code not compiled by ctxkit): launches read the
    #: C++ types of ``extern "C"`` parameters from it (PTX says only ``.u64``).
    source: str | None = field(default=None, compare=False, repr=False)

    def __repr__(self) -> str:
        src = " cached" if self.from_cache else ""
        return f"<ObjectCode {self.name!r} {self.target} {self.arch} {len(self.code)} bytes{src}>"

    def lowered_name(self, expression: str) -> str:
        """The mangled name of a name expression given at compile time."""
        try:
            return self.lowered_names[expression]
        except KeyError:
            known = sorted(self.lowered_names) or "none"
            raise KeyError(
                f"{expression!r} was not a name expression of {self.name!r} (given: {known}); "
                "pass it in name_expressions= when compiling"
            ) from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write :attr:`code` to *path* (PTX without its NUL terminator); returns the path."""
        p = Path(path)
        p.write_bytes(self.code.rstrip(b"\0") if self.target == "ptx" else self.code)
        return p

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<bytes>", arch: str = "") -> ObjectCode:
        """Wrap an existing PTX/cubin/fatbin image (kind detected from its contents)."""
        target = detect_target(data)
        ptx = None
        if target == "ptx":
            ptx = bytes(data).rstrip(b"\0").decode("utf-8", "replace")
            data = ptx.encode() + b"\0"
            if not arch:
                m = re.search(r"^\s*\.target\s+(\w+)", ptx, re.MULTILINE)
                arch = m.group(1).replace("sm_", "compute_") if m else ""
        return cls(code=bytes(data), target=target, arch=arch, ptx=ptx, name=name)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ObjectCode:
        """Read a ``.ptx``, ``.cubin`` or ``.fatbin`` file."""
        p = Path(path)
        return cls.from_bytes(p.read_bytes(), name=p.name)


def detect_target(data: bytes) -> str:
    """``"cubin"`` (ELF), ``"fatbin"`` (fatbinary magic) or ``"ptx"`` (text with ``.version``).

    Raises
    ------
    ValueError
        The bytes are none of these.
    """
    target = _MAGIC_TARGETS.get(bytes(data[:4]))
    if target is not None:
        return target
    text = bytes(data[:65536]).decode("utf-8", "replace")
    if re.search(r"^\s*\.version\s+\d+\.\d+", text, re.MULTILINE):
        return "ptx"
    raise ValueError(
        "the data is not PTX (no '.version' directive), a cubin (ELF) or a fatbin; "
        "compile CUDA C++ sources with ctxkit.compile() first"
    )
