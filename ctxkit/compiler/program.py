"""Run-time compilation: NVRTC programs, the on-disk kernel cache, nvJitLink, ``ptx/``.

``compile(source)`` turns CUDA C++ into an :class:`ObjectCode` for the device of the
current context: a cubin by default (loads with no JIT, whatever the NVRTC/driver
versions), PTX when asked for. Results are cached on disk (see
:mod:`ctxkit.compiler.cache`) and in memory, so a second process gets the compiled
kernel without loading NVRTC at all.

The kernel library: CUDA C++ sources and hand-written PTX shipped in ``ptx/``
(:func:`kernel_source`). In a wheel the files live in ``ctxkit/ptx/`` (see
``[tool.setuptools]`` in pyproject.toml); in a source checkout (``PYTHONPATH=.``) they
are ``../ptx/``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from .. import _driver
from ..errors import DriverNotFoundError
from . import cache as _cache
from . import includes as _includes
from . import nvrtc as _nvrtc
from .cache import count
from .nvrtc import cuda_include_dirs, normalize_arch, nvrtc_version
from .objectcode import TARGETS, ObjectCode, warn_if_ptx_too_new

__all__ = ["Program", "compile", "device_arch", "kernel_names", "kernel_path", "kernel_source"]


def _default_arch() -> str:
    """The arch of the current context's device, else device 0's."""
    try:
        return device_arch()
    except ValueError as exc:
        raise ValueError(
            f"arch=None means 'the current device', but there is no GPU here ({exc}). "
            "Pass the target architecture explicitly, e.g. compile(src, arch='sm_90') "
            "(python -m ctxkit compile --arch sm_90)"
        ) from None


def device_arch() -> str:
    """The arch of the current context's device, else device 0's.

    Raises
    ------
    ValueError
        There is no GPU; the message says why (no driver, no device).
    """
    from ..context import current_context
    from ..device import Device, device_count

    try:
        ctx = current_context()
    except DriverNotFoundError as exc:
        raise ValueError(str(exc)) from None
    if ctx is not None:
        return ctx.device.arch
    if device_count() == 0:
        raise ValueError("the driver reports no CUDA device")
    return Device(0).arch


_ARCH_OPT_RE = re.compile(r"^(?:-arch|--gpu-architecture)(?:=|$)(.*)$")


def _as_str_tuple(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"{what} must be a sequence of strings, e.g. ({value!r},), not a single string"
        )
    items = tuple(value)
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"{what} must contain strings, got {type(item).__name__}: {item!r}")
    return tuple(os.fspath(i) for i in items)


def _define_options(defines: Mapping[str, Any] | Iterable[str] | None) -> list[str]:
    if isinstance(defines, Mapping):
        return [f"-D{k}" if v is None or v is True else f"-D{k}={v}" for k, v in defines.items()]
    return [f"-D{d}" for d in _as_str_tuple(defines, "defines")]


def _split_arch_option(options: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """Remove ``-arch``/``--gpu-architecture`` from *options*; return it separately."""
    rest: list[str] = []
    arch = None
    it = iter(options)
    for opt in it:
        if m := _ARCH_OPT_RE.match(opt):
            arch = m.group(1) or next(it, "")
        else:
            rest.append(opt)
    return tuple(rest), arch


class Program:
    """A CUDA C++ program for NVRTC.

    Parameters
    ----------
    source : str or bytes
        CUDA C++ source; kernels meant to be looked up by name need ``extern "C"``
        (or a name expression, for templates).
    name : str
        File name used in compiler messages.
    options : sequence of str
        Raw NVRTC options (e.g. ``("-lineinfo", "--use_fast_math")``). An ``-arch``
        option here is used when ``compile(arch=None)``.
    headers : dict, optional
        ``{include name: source}`` for ``#include "name"`` without files.
    name_expressions : sequence of str
        Expressions such as ``"axpy<float>"`` whose mangled names are wanted
        (:attr:`ObjectCode.lowered_names`).
    std : str, optional
        C++ standard, ``"c++17"`` or ``"17"``.
    defines : dict or sequence of str, optional
        ``{"N": 4, "FAST": None}`` or ``("N=4", "FAST")``.
    include_dirs : sequence of path
        Extra include directories. The cache key covers every header NVRTC can read
        for the program (:mod:`ctxkit.compiler.includes`): ``#include "x.h"`` is looked
        up first next to the program's ``name`` (the working directory when the name
        has no directory part), then in these directories.

    The CUDA headers (``cuda_fp16.h``, ``cuda_bf16.h``, ``cuda/std/...``) are found
    automatically (:func:`cuda_include_dirs`).
    """

    def __init__(
        self,
        source: str | bytes,
        name: str = "kernel.cu",
        options: Sequence[str] = (),
        *,
        headers: Mapping[str, str | bytes] | None = None,
        name_expressions: Sequence[str] = (),
        std: str | None = None,
        defines: Mapping[str, Any] | Iterable[str] | None = None,
        include_dirs: Sequence[str | os.PathLike[str]] = (),
    ) -> None:
        if isinstance(source, bytes):
            source = source.decode("utf-8")
        if not isinstance(source, str):
            raise TypeError(f"source must be str or bytes, got {type(source).__name__}")
        self.source = source
        self.name = str(name)
        self.headers = {str(k): _text(v) for k, v in (headers or {}).items()}
        self.name_expressions = _as_str_tuple(name_expressions, "name_expressions")
        user, self._arch_option = _split_arch_option(_as_str_tuple(options, "options"))
        self.include_dirs = _as_str_tuple(include_dirs, "include_dirs")
        extra = [f"-I{d}" for d in self.include_dirs] + _define_options(defines)
        if std is not None:
            extra.append(f"--std={std if str(std).startswith('c++') else 'c++' + str(std)}")
        self.options: tuple[str, ...] = (*user, *extra)

    def __repr__(self) -> str:
        return f"<Program {self.name!r} options={list(self.options)}>"

    def _needs_cuda_headers(self) -> bool:
        """True when the program includes anything (then CUDA include dirs are added)."""
        texts = [self.source, *self.headers.values()]
        return any(any(_includes.directives(t)) for t in texts) or any(
            o.startswith(("-include", "--pre-include")) for o in self.options
        )

    def compile(self, target: str = "auto", arch: Any = None, *, cache: bool = False) -> ObjectCode:
        """Compile with NVRTC.

        Parameters
        ----------
        target : {"auto", "ptx", "cubin", "fatbin"}
            ``"auto"``: cubin for the exact device (no JIT at load time, so it loads on
            any driver), or PTX when this NVRTC is too old for the device (noted in the
            log). ``"ptx"`` warns (:class:`PtxVersionWarning`) if NVRTC is newer than the
            driver. ``"fatbin"`` packs cubin + PTX (needs ``nvidia-nvfatbin``).
        arch : str, tuple, Device or None
            ``None``: the current context's device, else device 0. Archs newer than this
            NVRTC supports are capped (said in the log).
        cache : bool
            Use the on-disk/in-memory cache (``ctxkit.compile`` defaults to True).

        Raises
        ------
        CompileError
            NVRTC rejected the program; ``.log`` has the full log.
        ValueError
            Bad target/arch, or ``arch=None`` on a machine without a GPU.
        """
        return self._compile(target, arch, cache, stacklevel=2)

    def _compile(self, target: str, arch: Any, cache: bool, stacklevel: int) -> ObjectCode:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, not {target!r}")
        arch = self._resolve_arch(arch)
        directory = _cache.cache_dir() if cache else None
        if directory is None:
            obj = self._build(arch, target)
        else:
            key = self._cache_key(arch, target)
            obj = _cache.cached(directory, key, lambda: self._build(arch, target))
        if obj.target == "ptx":
            warn_if_ptx_too_new(obj.nvrtc_version, stacklevel + 1)
        return obj

    def _resolve_arch(self, arch: Any) -> str:
        if arch is None:
            return normalize_arch(self._arch_option) if self._arch_option else _default_arch()
        chosen = normalize_arch(arch)
        if self._arch_option and normalize_arch(self._arch_option) != chosen:
            raise ValueError(f"arch={arch!r} conflicts with the option -arch={self._arch_option}")
        return chosen

    def _cache_key(self, arch: str, target: str) -> str:
        key = _static_key(
            source=self.source,
            name=self.name,
            headers=tuple(sorted(self.headers.items())),
            options=self.options,
            name_expressions=self.name_expressions,
            arch=arch,
            target=target,
            toolchain=_cache.toolchain_fingerprint(nvrtc_version, _driver.BINDINGS_VERSION[0]),
        )
        cuda_dirs = cuda_include_dirs() if self._needs_cuda_headers() else ()
        files = _includes.fingerprint(self.source, self.name, self.headers, self.options, cuda_dirs)
        if not cuda_dirs and not files:
            return key
        return _cache.make_key(
            {
                "program": key,
                "cuda_headers": _nvrtc.cuda_dirs_fingerprint(cuda_dirs),
                "files": files,
            }
        )

    def _build(self, arch: str, target: str) -> ObjectCode:
        built, target, note = _nvrtc.plan(arch, target)
        nvrtc_arch = built.replace("sm_", "compute_") if target == "ptx" else built
        options = [f"-arch={nvrtc_arch}", *self.options]
        if self._needs_cuda_headers():
            options += [f"-I{d}" for d in cuda_include_dirs()]
        ptx, cubin, log, lowered = _nvrtc.run_nvrtc(self, options, want_cubin=target != "ptx")
        count("compiled")
        code = ptx.encode() + b"\0" if target == "ptx" else cubin
        if target == "fatbin":
            code = _nvrtc.make_fatbin(cubin, ptx, built, self.name)
        return ObjectCode(
            code=code,
            target=target,
            arch=nvrtc_arch,
            log="\n".join(x for x in (note, log) if x),
            ptx=ptx or None,
            lowered_names=lowered,
            name=self.name,
            options=tuple(options),
            nvrtc_version=nvrtc_version(),
            source=self.source,
        )


@lru_cache(maxsize=1024)
def _static_key(**parts: Any) -> str:
    """The part of a cache key that does not depend on files (memoised: a warm hit is cheap).

    The values are hashable (tuples); they go into the key as JSON lists.
    """
    return _cache.make_key(parts)


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def compile(
    source: str | bytes,
    name: str = "kernel.cu",
    options: Sequence[str] = (),
    *,
    arch: Any = None,
    target: str = "auto",
    headers: Mapping[str, str | bytes] | None = None,
    name_expressions: Sequence[str] = (),
    std: str | None = None,
    defines: Mapping[str, Any] | Iterable[str] | None = None,
    include_dirs: Sequence[str | os.PathLike[str]] = (),
    cache: bool = True,
) -> ObjectCode:
    """Compile CUDA C++ with NVRTC, through the on-disk cache.

    Parameters are those of :class:`Program` and :meth:`Program.compile`. With the
    cache (default) an identical request, in this process or any later one, returns
    the stored code without touching NVRTC. ``CTXKIT_CACHE_DIR`` moves the cache,
    ``CTXKIT_CACHE_DIR=off`` disables it, ``CTXKIT_CACHE_MAX_BYTES`` caps its size
    (default 1 GiB; least recently used entries go first). A directory that another
    user could write is not used (one :class:`UserWarning`). The key covers every
    header NVRTC can read for the program. See :mod:`ctxkit.compiler.cache`.

    Examples
    --------
    >>> obj = ctxkit.compile(kernel_source("saxpy.cu"), arch="sm_90")   # doctest: +SKIP
    >>> obj.target, obj.arch
    ('cubin', 'sm_90')
    """
    prog = Program(
        source,
        name,
        options,
        headers=headers,
        name_expressions=name_expressions,
        std=std,
        defines=defines,
        include_dirs=include_dirs,
    )
    return prog._compile(target, arch, cache, stacklevel=2)


def _ptx_dir() -> Path:
    here = Path(__file__).resolve().parent.parent  # the ctxkit package
    for candidate in (here / "ptx", here.parent / "ptx"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"the ctxkit kernel library (ptx/) is missing next to {here}; reinstall ctxkit"
    )


def kernel_names() -> list[str]:
    """File names in the kernel library (``*.cu`` sources and hand-written ``*.ptx``)."""
    return sorted(p.name for p in _ptx_dir().iterdir() if p.suffix in (".cu", ".cuh", ".ptx"))


def kernel_path(name: str) -> Path:
    """Path of a kernel library file; ``"saxpy"`` means ``"saxpy.cu"``.

    Raises
    ------
    FileNotFoundError
        No such file; the message lists the files there are.
    """
    directory = _ptx_dir()
    base = Path(name).name
    for p in (directory / base, directory / f"{base}.cu"):
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"no kernel {name!r} in the ctxkit kernel library ({directory}); available: "
        f"{', '.join(kernel_names())}"
    )


def kernel_source(name: str) -> str:
    """Text of a kernel library file (``ptx/<name>``), e.g. ``kernel_source("saxpy.cu")``."""
    return kernel_path(name).read_text(encoding="utf-8")
