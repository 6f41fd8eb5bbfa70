"""``Module``: code loaded as a context-independent library (``cuLibraryLoadData``) or
into one context, and its kernels by name (the family's overview is in :mod:`ctxkit.module`).

Also what ``Module.load`` is given (ObjectCode, bytes, PTX text, path): reading and
classifying images, the JIT log buffers passed to ``cuLibraryLoadData``/``cuModuleLoadDataEx``,
and the texts of load and lookup errors.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import _driver, lifetime
from .. import context as _context
from .._driver import call, describe, drv
from ..binding import bind, guard, registry
from ..compiler.objectcode import detect_target
from ..context import Context, current_handle
from ..errors import STICKY_CODES, CompileError, CudaError, KernelNotFoundError
from ..lifetime import finalizer
from .kernel import _INVALID_VALUE, JIT_CODES, Kernel
from .ptxsig import Signature, cpp_param_types, parse_entries, signature_from_layout

__all__ = [
    "Image",
    "Module",
    "jit_detail",
    "missing_kernel_message",
    "read_image",
]


_LOG_BYTES = 1 << 15


@dataclass
class Image:
    """What ``Module.load`` was given, normalised (PTX NUL-terminated once, its text kept).

    ``source`` is the CUDA C++ source when an ``ObjectCode`` carries it: the declared
    parameter types of ``extern "C"`` kernels are read from it.
    """

    code: bytes
    format: str
    label: str
    ptx: str | None = None
    lowered: dict[str, str] = field(default_factory=dict)
    source: str | None = None

    def __post_init__(self) -> None:
        if self.format == "ptx":
            self.ptx = self.code.rstrip(b"\0").decode()
            self.code = self.ptx.encode() + b"\0"


def _looks_like_ptx_text(text: str) -> bool:
    return "\n" in text and any(k in text for k in (".version", ".entry", ".target"))


def read_image(source: Any, name: str | None = None) -> Image:
    """Normalise a ``Module.load`` argument: ObjectCode, bytes, PTX text or a path."""
    if hasattr(source, "code") and hasattr(source, "target"):
        fmt = str(source.target)
        if fmt not in ("ptx", "cubin", "fatbin"):
            raise ValueError(f"ObjectCode.target must be ptx, cubin or fatbin, not {fmt!r}")
        label = name or getattr(source, "name", None) or "<ObjectCode>"
        text = getattr(source, "source", None)
        return Image(
            bytes(source.code),
            fmt,
            str(label),
            getattr(source, "ptx", None),
            dict(getattr(source, "lowered_names", None) or {}),
            text if isinstance(text, str) else None,
        )
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return Image(data, detect_target(data), name or f"<{len(data)} bytes>")
    if isinstance(source, str) and _looks_like_ptx_text(source):
        return Image(source.encode(), "ptx", name or "<PTX text>")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(
                f"Module.load: {str(source)[:200]!r} is neither a file nor PTX text "
                "(PTX text must contain .version/.entry lines)"
            )
        data = path.read_bytes()
        return Image(data, detect_target(data), name or str(path))
    raise TypeError(
        f"Module.load takes a ck.ObjectCode, bytes, PTX text or a path, not {type(source).__name__}"
    )


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
    if mangled := [e for e in entries or () if e.startswith("_Z") and f"{len(name)}{name}" in e]:
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
        if close := difflib.get_close_matches(name, [*(entries or ()), *lowered], n=3):
            msg += f" Did you mean {', '.join(repr(c) for c in close)}?"
        msg += ' Kernels must be __global__ and extern "C" (or named via name_expressions).'
    return msg


_PTX_VERSION = re.compile(r"^\s*\.version\s+(\d+)\.(\d+)", re.M)


def jit_detail(code: int, ptx: str | None, error_log: str, info_log: str) -> str:
    """The part of a JIT failure message after the driver's error text."""
    logs = (("error", error_log), ("info", info_log))
    parts = [f"JIT {kind} log:\n{log}" for kind, log in logs if log]
    if code == 222 and ptx and (m := _PTX_VERSION.search(ptx)):
        drv_ver = _driver.driver_version()
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
        if not _context.current_handle():
            return None
    except Exception:
        return None
    keys, vals, _info, err_log = jit_options()
    res = drv.cuModuleLoadDataEx(image.code, len(keys), keys, vals)
    if not res[0]:
        drv.cuModuleUnload(res[1])
    return decode_log(err_log) or None


_NOT_FOUND = 500


def _unload_library(unload: Any, lib: Any) -> Any:
    """Free of a library (through ctxkit.lifetime.finalizer, which holds it back while a
    stream capture is open); at interpreter exit the process teardown unloads."""
    return None if _context.shutting_down() else unload(lib)


class Module:
    """Loaded device code; get kernels with :meth:`function`.

    Build it with :meth:`load`. ``context`` is ``None`` for a context-independent
    library (the default), or the context a bound module lives in.

    Attributes
    ----------
    name : str
        Where the code came from (file, ObjectCode name).
    format : str
        ``"ptx"``, ``"cubin"`` or ``"fatbin"``.
    context : Context or None
    ptx : str or None
        PTX text (given, or kept alongside a cubin by ``ck.compile``).
    jit_log : str
        The driver JIT's info log (PTX only).
    """

    def __init__(
        self, image: Image, handle: Any, context: Context | None, logs: tuple[bytearray, ...]
    ) -> None:
        self.name = image.label
        self.format = image.format
        self.context = context
        self.ptx = image.ptx
        self._logs = logs  # the driver may JIT lazily, later, into these buffers
        self.jit_log = decode_log(logs[0])
        self.lowered_names = image.lowered
        self.closed = False
        self._image = image
        self._handle = handle
        self._kernels: dict[str, Kernel] = {}
        self._signatures: dict[str, Signature] | None = None
        with contextlib.suppress(ValueError):  # PTX this parser cannot read: ask the driver
            self._signatures = parse_entries(self.ptx) if self.ptx else None
        if context is None:
            self._fin = finalizer(self, None, _unload_library, drv.cuLibraryUnload, handle)
        else:
            self._fin = finalizer(self, context, drv.cuModuleUnload, handle)

    @classmethod
    def load(
        cls, source: Any, context: Context | Any | None = None, *, name: str | None = None
    ) -> Module:
        """Load PTX, cubin or fatbin.

        Parameters
        ----------
        source : ObjectCode, bytes, str or path
            ``ck.compile`` output, an image's bytes, PTX text, or a file.
        context : Context, Device or int, optional
            Load a module bound to this context. By default the code is loaded as a
            context-independent library usable from every context and device.
        name : str, optional
            Label used in messages.

        Raises
        ------
        CompileError
            The driver JIT rejected PTX; ``.log`` holds the JIT error log.
        CudaError
            Any other load failure (no code for this GPU, bad image...).
        """
        image = read_image(source, name)
        _driver.init()
        ctx = None if context is None else registry.resolve(context)
        keys, vals, info, err_log = jit_options()
        if ctx is None:
            call_name = "cuLibraryLoadData"
            res = drv.cuLibraryLoadData(image.code, keys, vals, len(keys), [], [], 0)
        else:
            call_name = "cuModuleLoadDataEx"
            with ctx:
                res = drv.cuModuleLoadDataEx(image.code, len(keys), keys, vals)
        code = int(res[0])
        if not code:
            return cls(image, res[1], ctx, (info, err_log))
        call_text = f"{call_name}({image.label}, {image.format})"
        if code in JIT_CODES:
            raise jit_error(code, call_text, image, decode_log(err_log), decode_log(info))
        if ctx is not None and code in STICKY_CODES:
            raise ctx.note_error(code, call_text)
        raise _driver.from_result(code, call_text)

    # -- kernels ---------------------------------------------------------------------

    def function(self, name: str) -> Kernel:
        """The kernel *name* (an ``extern "C"`` name or a name expression).

        A module without PTX (a bare cubin) asks the driver for the parameter layout,
        in the current context or else the registry's context of device 0.

        Raises
        ------
        KernelNotFoundError
            No such kernel; the message lists the kernels present.
        CudaError
            The module is closed.
        """
        self.check_open()
        if (k := self._kernels.get(name)) is not None:
            return k
        symbol = self.lowered_names.get(name, name)
        get = drv.cuLibraryGetKernel if self.context is None else drv.cuModuleGetFunction
        with self._here(f"Module.function({name!r})"):
            err, handle = get(self._handle, symbol.encode())
        if err == _NOT_FOUND:
            raise KernelNotFoundError(
                missing_kernel_message(name, self.name, self.entries, self.lowered_names),
                _NOT_FOUND,
                "CUDA_ERROR_NOT_FOUND",
            )
        if err:
            what = f"looking up kernel {name!r} in {self.name}"
            if int(err) in JIT_CODES:
                raise self.jit_error(int(err), what)
            raise _driver.from_result(int(err), what)
        sig, why = self._signature_for(symbol, handle)
        k = self._kernels[name] = Kernel(self, name, symbol, handle, sig, unknown_reason=why)
        return k

    def _signature_for(self, symbol: str, handle: Any) -> tuple[Signature | None, str]:
        """The PTX signature, else the driver's layout; with the reason when neither.

        The C++ parameter types (from the mangled name, or from the declaration in the
        source an ``ObjectCode`` carries) add what PTX does not say: the sign.
        """
        sig = (self._signatures or {}).get(symbol)
        if sig is None:
            if self.context is None:
                layout, why = library_layout(handle)
            else:
                with self.context:
                    layout, why = driver_layout(drv, "cuFuncGetParamInfo", handle)
            if layout is None:
                return None, why
            sig = signature_from_layout(symbol, layout)
        return sig.with_ctypes(cpp_param_types(symbol, self._image.source, len(sig.params))), ""

    def _here(self, what: str) -> Any:
        """What a use of this module's handle runs in (``with``): the module's own context
        for a bound module (:func:`~ctxkit.binding.guard`), none for a library."""
        return contextlib.nullcontext() if self.context is None else guard(self.context, what)

    def jit_error(self, code: int, what: str) -> CompileError:
        """The :class:`CompileError` for JIT failure *code* of this module's code (*what*:
        the call that failed), with the JIT's log: what a launch raises when the driver
        compiles PTX lazily and fails."""
        return jit_error(code, what, self._image, decode_log(self._logs[1]))

    @property
    def entries(self) -> list[str] | None:
        """Kernel names in the module (from the PTX, else from the driver)."""
        if self._signatures is not None:
            return list(self._signatures)
        if self.context is None:
            calls = drv.cuLibraryGetKernelCount, drv.cuLibraryEnumerateKernels, drv.cuKernelGetName
        else:
            calls = drv.cuModuleGetFunctionCount, drv.cuModuleEnumerateFunctions, drv.cuFuncGetName
        count, enumerate_, name_of = calls
        try:
            with self._here("Module.entries"):
                items = call(enumerate_, call(count, self._handle), self._handle)
                names = [call(name_of, k) for k in items]
        except Exception:
            return None
        return [n.decode() if isinstance(n, bytes) else str(n) for n in names]

    def check_open(self) -> None:
        """Raise :class:`CudaError` when the module is closed (its kernels can no longer
        run): called before every use of its code."""
        if self.closed:
            raise CudaError(f"module {self.name} is closed; load it again")

    def close(self) -> None:
        """Unload the code; its kernels and prepared launches stop working. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for k in self._kernels.values():
            k.forget_functions()
        self._fin()

    __reduce__ = lifetime.process_local("send its ObjectCode and ck.Module.load it there")

    def __repr__(self) -> str:
        where = "library" if self.context is None else f"bound to {self.context!r}"
        return f"<Module {self.name} ({self.format}, {where})>"


Layout = list[tuple[int, int]]


def driver_layout(d: Any, fn_name: str, handle: Any) -> tuple[Layout | None, str]:
    """``(offset, size)`` of each parameter from ``d.<fn_name>`` (CUDA 12.4+).

    Returns ``(layout, "")``, or ``(None, reason)`` naming the call and its ``CUresult``.
    """
    fn: Callable[..., Any] | None = getattr(d, fn_name, None)
    if fn is None:
        return None, f"cuda-bindings {_driver.BINDINGS_VERSION} has no {fn_name} (CUDA 12.4+)"
    layout: Layout = []
    while True:
        try:
            res = fn(handle, len(layout))
        except Exception as exc:  # a driver without the entry point
            return None, f"{fn_name} is not available in this driver (CUDA 12.4+): {exc}"
        if res[0] == _INVALID_VALUE:
            return layout, ""
        if res[0]:
            return None, f"{fn_name}(param {len(layout)}) returned {describe(int(res[0]))[0]}"
        layout.append((int(res[1]), int(res[2])))


def library_layout(kernel: Any) -> tuple[Layout | None, str]:
    """Parameter layout of a library kernel, queried under a current context.

    The driver answers layout queries only in a context: the current one is used, else
    the registry's context of device 0 is bound for the query. When
    ``cuKernelGetParamInfo`` fails, the kernel's ``CUfunction`` in that context is asked
    (``cuFuncGetParamInfo``). The reason names every failed call and its ``CUresult``.
    """
    try:
        with contextlib.nullcontext() if current_handle() else bind(0):
            layout, why = driver_layout(drv, "cuKernelGetParamInfo", kernel)
            if layout is not None:
                return layout, ""
            err, func = drv.cuKernelGetFunction(kernel)
            if err:
                return None, f"{why}; cuKernelGetFunction returned {describe(int(err))[0]}"
            layout, why2 = driver_layout(drv, "cuFuncGetParamInfo", func)
    except CudaError as exc:
        return None, f"no usable context to query it in: {exc}"
    return layout, "" if layout is not None else f"{why}; {why2}"
