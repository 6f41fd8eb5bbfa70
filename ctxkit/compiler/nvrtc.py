"""The compiler toolchain behind :mod:`ctxkit.compiler`: NVRTC, nvJitLink and nvFatbin.

Only :mod:`ctxkit.compiler.program` uses this module. The libraries are loaded lazily, on the first
compile that actually needs them, so a warm cache hit never loads NVRTC (~10 ms).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Sequence
from functools import lru_cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .. import _driver
from ..errors import CompileError

if TYPE_CHECKING:
    from .program import Program

__all__ = [
    "cuda_include_dirs",
    "link_ptx",
    "load_nvrtc",
    "make_fatbin",
    "normalize_arch",
    "nvrtc_version",
    "plan",
    "run_nvrtc",
    "supported_archs",
]


INSTALL_HINT = (
    'install it with `pip install -e ".[cu13]"` in a ctxkit checkout (".[cu12]" for a '
    'CUDA 12 driver), or `pip install "ctxkit-cuda[cu13]"` from the package index'
)


def _bindings(module: str, library: str) -> ModuleType:
    """``cuda.bindings.<module>``, or a :class:`CompileError` saying how to install it."""
    try:
        return importlib.import_module(f"cuda.bindings.{module}")
    except Exception as exc:
        raise CompileError(
            f"{library} bindings are not available ({exc!r}); {INSTALL_HINT}"
        ) from None


def load_nvrtc() -> ModuleType:
    return _bindings("nvrtc", "NVRTC")


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """The NVRTC version as ``(major, minor)`` (loads the NVRTC library).

    Raises
    ------
    CompileError
        NVRTC is not installed.
    """
    nvrtc = load_nvrtc()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:
        raise CompileError(
            f"the NVRTC library could not be loaded ({exc}); {INSTALL_HINT}"
        ) from None
    check(err, "nvrtcVersion")
    return int(major), int(minor)


@lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """The real architectures this NVRTC compiles for, e.g. ``(75, 80, ..., 90, 100, 120)``."""
    nvrtc = load_nvrtc()
    nvrtc_version()
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    check(err, "nvrtcGetSupportedArchs")
    return tuple(sorted(int(a) for a in archs))


def result_name(err: Any) -> str:
    return getattr(err, "name", None) or f"nvrtcResult {int(err)}"


def check(err: Any, what: str) -> None:
    if err:
        name = result_name(err)
        raise CompileError(f"{what} failed: {name}", code=int(err), name=name)


def versions_line() -> str:
    drv = _driver.driver_version()
    drv_text = f"driver CUDA {drv[0]}.{drv[1]}" if drv else "no driver"
    try:
        nv_text = "NVRTC {}.{}".format(*nvrtc_version())
    except CompileError:
        nv_text = "NVRTC unavailable"
    return f"{nv_text}, {drv_text}, cuda-bindings {'.'.join(map(str, _driver.BINDINGS_VERSION))}"


_ARCH_RE = re.compile(r"^(?:sm_|compute_|lto_)?(\d{2,3})([af]?)$")


ARCH_FORMS = (
    "'sm_90' (cubin), 'compute_90' (PTX), 'sm_90a', '9.0', 90, (9, 0) or a ctxkit.Device "
    "(compile(): None for the current device)"
)


def normalize_arch(arch: Any) -> str:
    """``"sm_XY"`` for an arch given as ``"sm_90"``, ``"compute_90"``, ``"90"``, ``"9.0"``,
    ``(9, 0)``, ``90`` or a :class:`~ctxkit.Device`; arch-specific suffixes stay (``"sm_90a"``).

    Raises
    ------
    TypeError
        *arch* is none of those types.
    ValueError
        The value does not name an architecture (e.g. ``1000`` or ``(100, 0)``).
    """
    if hasattr(arch, "compute_capability"):
        arch = arch.compute_capability
    m = _ARCH_RE.match(_arch_text(arch))
    if m is None:
        raise ValueError(f"cannot understand arch={arch!r}: not an architecture; use {ARCH_FORMS}")
    return f"sm_{m.group(1)}{m.group(2)}"


def _arch_text(arch: Any) -> str:
    """*arch* as the text ``_ARCH_RE`` reads ('' for a number that names no arch)."""
    if isinstance(arch, str):
        text = arch.strip().lower()
        return text.replace(".", "") if re.fullmatch(r"\d+\.\d", text) else text
    if isinstance(arch, tuple) and len(arch) == 2 and all(_is_int(v) for v in arch):
        major, minor = arch
        return f"{major}{minor}" if major > 0 and 0 <= minor <= 9 else ""
    if _is_int(arch):
        return str(arch)
    if isinstance(arch, tuple):
        return ""
    raise TypeError(f"cannot understand arch={arch!r} ({type(arch).__name__}); use {ARCH_FORMS}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def arch_number(arch: str) -> int:
    """``90`` for ``"sm_90"`` / ``"sm_90a"`` (a normalised arch).

    Raises
    ------
    ValueError
        *arch* is not a normalised arch.
    """
    if (m := _ARCH_RE.match(arch)) is None:
        raise ValueError(f"{arch!r} is not an architecture; use {ARCH_FORMS}")
    return int(m.group(1))


def plan(arch: str, target: str) -> tuple[str, str, str]:
    """Resolve ``target="auto"`` and cap *arch* to what this NVRTC supports.

    Returns ``(build_arch, target, note)``: the ``sm_XY`` NVRTC compiles for (capped to
    what it supports), ``"ptx"``, ``"cubin"`` or ``"fatbin"``, and what explains a capped
    arch or a PTX fallback in the log (``""`` when nothing needs it).

    Raises
    ------
    ValueError
        The arch is older than NVRTC supports, or a cubin/fatbin was asked for an arch
        this NVRTC can only reach through PTX.
    """
    supported = supported_archs()
    num = arch_number(arch)
    if num in supported:
        return arch, "cubin" if target == "auto" else target, ""
    lower = [a for a in supported if a < num]
    nv = "{}.{}".format(*nvrtc_version())
    span = f"sm_{supported[0]}..sm_{supported[-1]}"
    if not lower:
        raise ValueError(
            f"NVRTC {nv} cannot compile for {arch} (it supports {span}); use an NVRTC that "
            "still supports this GPU (e.g. the cu12 extra of ctxkit)"
        )
    capped = f"sm_{lower[-1]}"
    same_major = lower[-1] // 10 == num // 10
    if target == "auto":
        target = "cubin" if same_major else "ptx"
    elif target in ("cubin", "fatbin") and not same_major:
        raise ValueError(
            f"NVRTC {nv} cannot make a {target} for {arch} (it supports {span}), and a "
            f"{capped} cubin does not run on {arch}; use target='ptx' or 'auto' (PTX for "
            f"{capped.replace('sm_', 'compute_')}, JIT-compiled by the driver)"
        )
    built = capped if target != "ptx" else capped.replace("sm_", "compute_")
    note = (
        f"ctxkit: {arch} is newer than NVRTC {nv} supports ({span}); compiled "
        f"{target} for {built} instead"
        + (" (the driver JIT-compiles the PTX for the device)" if target == "ptx" else "")
    )
    return capped, target, note


@lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding the CUDA headers (``cuda_fp16.h``, ``cuda/std/...``).

    Found with cuda-pathfinder: the ``nvidia-cuda-runtime`` and ``nvidia-cuda-cccl``
    wheels (installed by the ``cu13``/``cu12`` extras), conda, or a CUDA toolkit
    (``CUDA_HOME``).
    Added to every compile whose source includes anything.
    """
    dirs: list[str] = []
    for lib in ("cudart", "cccl"):
        with contextlib.suppress(Exception):  # no cuda-pathfinder, or it does not find lib
            from cuda.pathfinder import find_nvidia_header_directory

            found = find_nvidia_header_directory(lib)
            if found and found not in dirs:
                dirs.append(found)
    if not dirs:  # the first toolkit with an include directory
        roots = [os.environ.get(var) for var in ("CUDA_PATH", "CUDA_HOME")]
        toolkits = [os.path.join(root, "include") for root in roots if root]
        dirs = [d for d in toolkits if os.path.isdir(d)][:1]
    return tuple(dirs)


def cuda_dirs_fingerprint(dirs: Sequence[str]) -> list[Any]:
    """``[dir, size, mtime]`` of a canary header per CUDA include dir (for cache keys)."""
    out = []
    for d in dirs:
        try:
            st = os.stat(_canary(d))
        except OSError:
            _canary.cache_clear()
            st = os.stat(_canary(d))
        out.append([d, st.st_size, st.st_mtime_ns])
    return out


@lru_cache(maxsize=64)
def _canary(d: str) -> str:
    paths = (os.path.join(d, f) for f in ("cuda_runtime.h", "cuda/std/version"))
    return next((path for path in paths if os.path.isfile(path)), d)


def _get_blob(nvrtc: ModuleType, prog: Any, size_fn: str, get_fn: str) -> bytes:
    err, size = getattr(nvrtc, size_fn)(prog)
    check(err, size_fn)
    if size <= 1:
        return b""
    buf = b" " * size
    check(getattr(nvrtc, get_fn)(prog, buf)[0], get_fn)
    return buf


def run_nvrtc(
    prog: Program, options: Sequence[str], want_cubin: bool
) -> tuple[str, bytes, str, dict[str, str]]:
    """Compile *prog* with *options*; return (PTX text, cubin or b"", log, lowered names).

    Raises
    ------
    CompileError
        NVRTC rejected the program (full log, options and versions in the message).
    """
    nvrtc = load_nvrtc()
    nvrtc_version()
    names = list(prog.headers)
    err, handle = nvrtc.nvrtcCreateProgram(
        prog.source.encode(),
        prog.name.encode(),
        len(names),
        [prog.headers[n].encode() for n in names],
        [n.encode() for n in names],
    )
    check(err, "nvrtcCreateProgram")
    try:
        for expr in prog.name_expressions:
            check(nvrtc.nvrtcAddNameExpression(handle, expr.encode())[0], "nvrtcAddNameExpression")
        (err,) = nvrtc.nvrtcCompileProgram(handle, len(options), [o.encode() for o in options])
        log = ""
        with contextlib.suppress(CompileError):  # no log: the error, if any, still says why
            blob = _get_blob(nvrtc, handle, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog")
            log = blob.rstrip(b"\0").decode("utf-8", "replace").strip()
        if err:
            raise compile_error(prog.name, options, err, log)
        ptx = _get_blob(nvrtc, handle, "nvrtcGetPTXSize", "nvrtcGetPTX")
        cubin = (
            _get_blob(nvrtc, handle, "nvrtcGetCUBINSize", "nvrtcGetCUBIN") if want_cubin else b""
        )
        if want_cubin and not cubin:
            raise CompileError(f"NVRTC produced no cubin for {prog.name!r} ({list(options)})")
        lowered = {}
        for expr in prog.name_expressions:
            err, mangled = nvrtc.nvrtcGetLoweredName(handle, expr.encode())
            check(err, f"nvrtcGetLoweredName({expr!r})")
            lowered[expr] = mangled.decode() if isinstance(mangled, bytes) else str(mangled)
    finally:
        nvrtc.nvrtcDestroyProgram(handle)
    return ptx.rstrip(b"\0").decode("utf-8", "replace"), bytes(cubin), log, lowered


_ERROR_LINE_RE = re.compile(r"^(.+?)\((\d+)\): (?:catastrophic )?error: (.*)$", re.MULTILINE)


_MISSING_HEADER_RE = re.compile(r"(?:cannot|could not) open source file \"([^\"]+)\"")


def compile_error(name: str, options: Sequence[str], err: Any, log: str) -> CompileError:
    """The :class:`CompileError` for a failed ``nvrtcCompileProgram``."""
    m = _ERROR_LINE_RE.search(log)
    first = f" (first error: {m.group(1)} line {m.group(2)}: {m.group(3)})" if m else ""
    message = (
        f"NVRTC failed to compile {name!r}: {result_name(err)}{first}\n"
        f"--- NVRTC log ---\n{log or '(empty)'}\n--- end of log ---\n"
        f"options: {' '.join(options)}\n"
        f"versions: {versions_line()}"
    )
    if missing := _MISSING_HEADER_RE.search(log):
        found = ", ".join(cuda_include_dirs()) or "none"
        message += (
            f"\nHint: {missing.group(1)!r} was not found. CUDA headers come from the "
            "nvidia-cuda-runtime and nvidia-cuda-cccl wheels (the cu13/cu12 extras) or a "
            f"CUDA toolkit (CUDA_HOME); CUDA include dirs found: {found}. Your own headers: "
            "pass include_dirs= or headers={name: source}."
        )
    return CompileError(message, log=log, code=int(err), name=result_name(err))


def link_ptx(ptx: str | bytes, arch: Any = "sm_90", *, name: str = "input.ptx") -> bytes:
    """Assemble/link PTX into a cubin for *arch* with nvJitLink (verifies hand-written PTX).

    Raises
    ------
    CompileError
        nvJitLink rejected the PTX (``.log`` has ptxas' messages) or is not installed.
    """
    nvjitlink = _bindings("nvjitlink", "nvJitLink")
    data = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
    target = normalize_arch(arch)
    try:
        handle = nvjitlink.create(1, [f"-arch={target}"])
    except Exception as exc:
        raise CompileError(f"nvJitLink cannot link for {target}: {exc}") from None
    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), name)
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            log = _jitlink_log(nvjitlink, handle)
            raise CompileError(
                f"nvJitLink failed to link {name!r} for {target}: {exc}\n{log}", log=log
            ) from None
        buf = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, buf)
    finally:
        nvjitlink.destroy(handle)
    return bytes(buf)


def _jitlink_log(nvjitlink: ModuleType, handle: int) -> str:
    size = nvjitlink.get_error_log_size(handle)
    if size <= 1:
        return ""
    buf = bytearray(size)
    nvjitlink.get_error_log(handle, buf)
    return bytes(buf).rstrip(b"\0").decode("utf-8", "replace").strip()


def make_fatbin(cubin: bytes, ptx: str, arch: str, name: str) -> bytes:
    """Pack a cubin and its PTX into a fatbin with nvFatbin."""
    try:
        nvfatbin = importlib.import_module("cuda.bindings.nvfatbin")
        handle = nvfatbin.create([], 0)
    except Exception as exc:
        raise CompileError(
            f"target='fatbin' needs the nvFatbin library ({exc}); install it with "
            "`pip install nvidia-nvfatbin` (cu12: nvidia-nvfatbin-cu12), or use target='cubin'"
        ) from None
    digits = arch.removeprefix("sm_")
    try:
        nvfatbin.add_cubin(handle, cubin, len(cubin), digits, name)
        if ptx:
            data = ptx.encode() + b"\0"
            nvfatbin.add_ptx(handle, data, len(data), digits, name, "")
        buf = bytearray(nvfatbin.size(handle))
        nvfatbin.get(handle, buf)
    except Exception as exc:
        raise CompileError(f"nvFatbin failed to build a fatbin for {name!r}: {exc}") from None
    finally:
        nvfatbin.destroy(handle)
    return bytes(buf)
