"""Modules, kernels, launches and CUDA graphs.

``Module.load`` takes PTX, cubin or fatbin (a ``ck.ObjectCode``, bytes, PTX text or a
path). By default it loads a context-independent *library* (``cuLibraryLoadData``):
one :class:`Kernel` then launches in whichever context is current, on any device,
with the per-context ``CUfunction`` fetched once per context. ``context=`` loads a
classic module bound to that context instead.

``Kernel.launch`` checks arguments against the PTX ``.entry`` signature before
anything runs (:class:`~ctxkit.errors.LaunchArgumentError` names the parameter);
``Kernel.prepare`` packs them once for the cheapest repeated launch; :func:`capture`
records launches on a stream into a replayable :class:`Graph`.
"""

from __future__ import annotations

import difflib
import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from . import _driver, _params
from . import context as _context
from ._driver import call, drv
from ._params import ArgPacker, Param, ParamBuffer, Signature, normalize_dims
from .compiler import detect_target
from .context import Context, finalizer, require_current, thread_state
from .errors import STICKY_CODES, CompileError, CudaError, LaunchArgumentError
from .registry import guard, registry

__all__ = [
    "Graph",
    "Kernel",
    "KernelNotFoundError",
    "Module",
    "PreparedLaunch",
    "capture",
]

_NOT_FOUND = 500
_INVALID_VALUE = 1
_OUT_OF_RESOURCES = 701
_INVALID_HANDLE = 400
_INVALID_CONTEXT = 201
_JIT_CODES = frozenset({200, 218, 221, 222, 223})  # invalid image/PTX, no JIT, PTX too new
_LOG_BYTES = 1 << 16
_DIM_MAX = 0xFFFFFFFF


class KernelNotFoundError(CudaError, LookupError):
    """The module has no kernel of that name (the message lists those it has)."""


# --- reading an image -----------------------------------------------------------------


class _Image:
    """What ``Module.load`` was given, normalised."""

    __slots__ = ("code", "format", "label", "lowered", "ptx")

    def __init__(
        self, code: bytes, fmt: str, label: str, ptx: str | None, lowered: Mapping[str, str]
    ) -> None:
        self.code = code
        self.format = fmt
        self.label = label
        self.ptx = ptx
        self.lowered = dict(lowered)


def _looks_like_ptx_text(text: str) -> bool:
    return "\n" in text and any(k in text for k in (".version", ".entry", ".target"))


def _ptx_image(text: str) -> bytes:
    return text.rstrip("\0").encode() + b"\0"


def read_image(source: Any, name: str | None = None) -> _Image:
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
        return _Image(code, fmt, str(label), ptx, getattr(source, "lowered_names", None) or {})
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return _from_bytes(data, name or f"<{len(data)} bytes>")
    if isinstance(source, str) and _looks_like_ptx_text(source):
        return _Image(_ptx_image(source), "ptx", name or "<PTX text>", source, {})
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


def _from_bytes(data: bytes, label: str) -> _Image:
    fmt = detect_target(data)
    if fmt == "ptx":
        text = data.rstrip(b"\0").decode()
        return _Image(_ptx_image(text), fmt, label, text, {})
    return _Image(data, fmt, label, None, {})


# --- messages -------------------------------------------------------------------------


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


def _decode_log(buf: bytearray) -> str:
    return bytes(buf).split(b"\0", 1)[0].decode(errors="replace").strip()


def _jit_options() -> tuple[list[Any], list[Any], bytearray, bytearray]:
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


def _host_array_pointer(arr: np.ndarray) -> int | None:
    """Device address of a page-locked or managed host array (None when pageable)."""
    ptr = int(arr.__array_interface__["data"][0] or 0)
    if not ptr or drv is None:
        return None
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    try:
        err, dptr = drv.cuPointerGetAttribute(attr, ptr)
    except Exception:
        return None
    return None if err else int(dptr)


_params.set_host_pointer_resolver(_host_array_pointer)


# --- Module ---------------------------------------------------------------------------


def _unload_library(lib: Any) -> None:
    if _context._shutting_down:
        return
    try:
        drv.cuLibraryUnload(lib)
    except Exception:
        pass


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

    def __init__(self, image: _Image, handle: Any, context: Context | None, jit_log: str):
        self.name = image.label
        self.format = image.format
        self.context = context
        self.ptx = image.ptx
        self.jit_log = jit_log
        self.lowered_names = image.lowered
        self.closed = False
        self._image = image
        self._handle = handle
        self._kernels: dict[str, Kernel] = {}
        self._signatures = self._parse_signatures()
        if context is None:
            self._fin = weakref.finalize(self, _unload_library, handle)
            self._fin.atexit = False
        else:
            self._fin = finalizer(self, context, drv.cuModuleUnload, handle)

    def _parse_signatures(self) -> dict[str, Signature] | None:
        if not self.ptx:
            return None
        try:
            return _params.parse_entries(self.ptx)
        except ValueError:
            return None

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
        if context is None:
            return cls._load_library(image)
        return cls._load_bound(image, registry.resolve(context))

    @classmethod
    def _load_library(cls, image: _Image) -> Module:
        keys, vals, info, err_log = _jit_options()
        res = drv.cuLibraryLoadData(image.code, keys, vals, len(keys), [], [], 0)
        if res[0]:
            raise _load_error(int(res[0]), image, "cuLibraryLoadData", info, err_log)
        return cls(image, res[1], None, _decode_log(info))

    @classmethod
    def _load_bound(cls, image: _Image, ctx: Context) -> Module:
        keys, vals, info, err_log = _jit_options()
        with ctx:
            res = drv.cuModuleLoadDataEx(image.code, len(keys), keys, vals)
        if res[0]:
            raise _load_error(int(res[0]), image, "cuModuleLoadDataEx", info, err_log, ctx)
        return cls(image, res[1], ctx, _decode_log(info))

    # -- kernels ---------------------------------------------------------------------

    def function(self, name: str) -> Kernel:
        """The kernel *name* (an ``extern "C"`` name or a name expression).

        Raises
        ------
        KernelNotFoundError
            No such kernel; the message lists the kernels present.
        """
        k = self._kernels.get(name)
        if k is not None:
            return k
        self._check_open()
        symbol = self.lowered_names.get(name, name)
        if self.context is None:
            err, handle = drv.cuLibraryGetKernel(self._handle, symbol.encode())
        else:
            with guard(self.context, f"Module.function({name!r})"):
                err, handle = drv.cuModuleGetFunction(self._handle, symbol.encode())
        if err == _NOT_FOUND:
            raise KernelNotFoundError(
                missing_kernel_message(name, self.name, self.entries, self.lowered_names),
                _NOT_FOUND,
                "CUDA_ERROR_NOT_FOUND",
            )
        if err:
            what = f"looking up kernel {name!r} in {self.name}"
            if int(err) in _JIT_CODES:
                raise _jit_error(int(err), what, self._image)
            raise _driver.from_result(int(err), what)
        k = Kernel(self, name, symbol, handle, self._signature_for(symbol, handle))
        self._kernels[name] = k
        return k

    def _signature_for(self, symbol: str, handle: Any) -> Signature | None:
        if self._signatures is not None and symbol in self._signatures:
            return self._signatures[symbol]
        layout = _driver_layout(handle, self.context is None, self.context)
        return None if layout is None else _params.signature_from_layout(symbol, layout)

    @property
    def entries(self) -> list[str] | None:
        """Kernel names in the module (from the PTX, else from the driver)."""
        if self._signatures is not None:
            return list(self._signatures)
        return _enumerate_kernels(self._handle, self.context)

    def _check_open(self) -> None:
        if self.closed:
            raise CudaError(f"module {self.name} is closed; load it again")

    def close(self) -> None:
        """Unload the code; its kernels and prepared launches stop working. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for k in self._kernels.values():
            k._funcs.clear()
        self._fin()

    def __repr__(self) -> str:
        where = "library" if self.context is None else f"bound to {self.context!r}"
        return f"<Module {self.name} ({self.format}, {where})>"


def _load_error(
    code: int,
    image: _Image,
    what: str,
    info: bytearray,
    err_log: bytearray,
    ctx: Context | None = None,
) -> CudaError:
    call_text = f"{what}({image.label}, {image.format})"
    if code in _JIT_CODES:
        return _jit_error(code, call_text, image, _decode_log(err_log), _decode_log(info))
    if ctx is not None and code in STICKY_CODES:
        return ctx.note_error(code, call_text)
    return _driver.from_result(code, call_text)


def _jit_error(
    code: int, call_text: str, image: _Image, error_log: str = "", info_log: str = ""
) -> CompileError:
    """A JIT failure with the JIT's log (re-read in the current context if lost)."""
    if not error_log and image.format == "ptx":
        error_log = _diagnose_jit(image) or ""
    exc = _driver.from_result(code, call_text, jit_detail(code, image.ptx, error_log, info_log))
    return CompileError(str(exc), error_log, code, exc.name)


def _diagnose_jit(image: _Image) -> str | None:
    """JIT the PTX in the current context just to read the error log (lazy loading
    can defer a library's JIT until a kernel is first used)."""
    try:
        cur = _context.current_handle()
    except Exception:
        return None
    if not cur:
        return None
    keys, vals, _info, err_log = _jit_options()
    res = drv.cuModuleLoadDataEx(image.code, len(keys), keys, vals)
    if not res[0]:
        drv.cuModuleUnload(res[1])
    return _decode_log(err_log) or None


def _driver_layout(handle: Any, library: bool, ctx: Context | None) -> list[tuple[int, int]] | None:
    fn = getattr(drv, "cuKernelGetParamInfo" if library else "cuFuncGetParamInfo", None)
    if fn is None:
        return None
    layout: list[tuple[int, int]] = []
    while True:
        res = fn(handle, len(layout))
        if res[0] == _INVALID_VALUE:
            return layout
        if res[0]:
            return None
        layout.append((int(res[1]), int(res[2])))


def _enumerate_kernels(handle: Any, ctx: Context | None) -> list[str] | None:
    try:
        if ctx is None:
            n = call(drv.cuLibraryGetKernelCount, handle)
            items = call(drv.cuLibraryEnumerateKernels, n, handle)
            names = [call(drv.cuKernelGetName, k) for k in items]
        else:
            with guard(ctx, "Module.entries"):
                n = call(drv.cuModuleGetFunctionCount, handle)
                items = call(drv.cuModuleEnumerateFunctions, n, handle)
                names = [call(drv.cuFuncGetName, f) for f in items]
    except Exception:
        return None
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


# --- streams --------------------------------------------------------------------------

_stream_handle_fn: Callable[[Any], Any] | None = None


def _stream_for(stream: Any, ctx: Context) -> Any:
    """Driver handle of *stream*, refusing a ctxkit stream of another context."""
    global _stream_handle_fn
    sc = getattr(stream, "context", None)
    if isinstance(sc, Context) and sc.handle != ctx.handle:
        raise CudaError(
            f"stream {stream!r} belongs to {sc!r}, but the launch runs in {ctx!r}; use a "
            "stream of the current context, or run the launch inside `with stream.context:`",
            _INVALID_HANDLE,
            "CUDA_ERROR_INVALID_HANDLE",
        )
    fn = _stream_handle_fn
    if fn is None:
        from .stream import stream_handle

        fn = _stream_handle_fn = stream_handle
    return fn(stream)


# --- Kernel ---------------------------------------------------------------------------


def _function_attribute(name: str | Any) -> Any:
    if not isinstance(name, str):
        return name
    key = name.upper()
    if not key.startswith("CU_FUNC_ATTRIBUTE_"):
        key = "CU_FUNC_ATTRIBUTE_" + key
    try:
        return getattr(drv.CUfunction_attribute, key)
    except AttributeError:
        known = [m.name[18:].lower() for m in drv.CUfunction_attribute if m.name[18:] != "MAX"]
        raise ValueError(f"unknown kernel attribute {name!r}; known: {known}") from None


class Kernel:
    """One ``__global__`` function of a :class:`Module`.

    Attributes
    ----------
    name : str
        The name it was looked up by.
    symbol : str
        The name in the binary (mangled for C++ name expressions).
    module : Module
    """

    __slots__ = ("__weakref__", "_funcs", "_handle", "_packer", "_sig", "module", "name", "symbol")

    def __init__(
        self, module: Module, name: str, symbol: str, handle: Any, sig: Signature | None
    ) -> None:
        self.module = module
        self.name = name
        self.symbol = symbol
        self._handle = handle
        self._sig = sig
        self._packer = ArgPacker(sig, name) if sig is not None else None
        self._funcs: dict[int, tuple[Context, Any]] = {}

    def __repr__(self) -> str:
        return f"<Kernel {self._sig or self.name} from {self.module.name}>"

    # -- signature -------------------------------------------------------------------

    @property
    def signature(self) -> Signature | None:
        """The parsed parameter list (``None`` when neither PTX nor the driver told it)."""
        return self._sig

    @property
    def params(self) -> tuple[Param, ...]:
        """The parameters: PTX type, size, alignment and offset of each."""
        return self._require_packer().sig.params

    def _require_packer(self) -> ArgPacker:
        if self._packer is None:
            raise LaunchArgumentError(
                f"the parameter list of kernel {self.name!r} is unknown: the module has no "
                "PTX and this driver cannot report parameter layouts (CUDA 12.4+ can); "
                "load ck.compile output (it keeps the PTX) or PTX text"
            )
        return self._packer

    # -- per-context function ----------------------------------------------------------

    def _function(self, ctx: Context) -> Any:
        hit = self._funcs.get(ctx.handle)
        if hit is not None and hit[0] is ctx:
            return hit[1]
        return self._resolve(ctx)

    def _resolve(self, ctx: Context) -> Any:
        mod = self.module
        mod._check_open()
        ctx.check_usable()
        if mod.context is not None:
            if mod.context.handle != ctx.handle:
                raise self._wrong_context(ctx)
            func = self._handle
        else:
            err, func = drv.cuKernelGetFunction(self._handle)
            if err:
                raise self._function_error(int(err), ctx)
        self._funcs[ctx.handle] = (ctx, func)
        return func

    def _function_error(self, code: int, ctx: Context) -> CudaError:
        what = f"cuKernelGetFunction({self.name!r}) in {ctx!r}"
        if code in _JIT_CODES:
            return _jit_error(code, what, self.module._image)
        return ctx.note_error(code, what)

    def _wrong_context(self, ctx: Context) -> CudaError:
        import threading

        return CudaError(
            f"kernel {self.name!r} comes from a module bound to {self.module.context!r} "
            f"(Module.load(..., context=...)), but the current context in thread "
            f"{threading.current_thread().name!r} is {ctx!r}. Launch it inside "
            f"`with ctxkit.bind(module.context):`, or load the module without context= "
            "so one kernel runs in every context.",
            _INVALID_HANDLE,
            "CUDA_ERROR_INVALID_HANDLE",
        )

    def _current(self, what: str) -> Context:
        bound = self.module.context
        if bound is not None:
            return guard(bound, what)
        return require_current(what)

    # -- launching -------------------------------------------------------------------

    def launch(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        *args: Any,
        stream: Any = None,
        shared_mem: int = 0,
    ) -> None:
        """Launch on the current context's device.

        Parameters
        ----------
        grid, block : int or tuple of 1-3 ints
        *args
            One per kernel parameter: ctxkit buffers/arrays, CuPy/PyTorch/Numba arrays,
            DLPack producers, Python or numpy numbers, bytes for structs by value.
        stream : Stream, CuPy/PyTorch stream, int or None
            ``None`` is the context's legacy default stream.
        shared_mem : int
            Dynamic shared memory per block, in bytes.

        Raises
        ------
        LaunchArgumentError
            Arguments do not match the parameters (checked before launching).
        NoCurrentContextError
            The calling thread has no current context.
        ContextPoisonedError
            An earlier kernel faulted in this context.
        """
        ctx = thread_state().top
        if ctx is None:
            ctx = require_current(f"launching kernel {self.name!r}")
        hit = self._funcs.get(ctx.handle)
        func = hit[1] if hit is not None and hit[0] is ctx else self._resolve(ctx)
        g = (
            (grid, 1, 1)
            if type(grid) is int and 0 < grid <= _DIM_MAX
            else normalize_dims(grid, "grid")
        )
        b = (
            (block, 1, 1)
            if type(block) is int and 0 < block <= _DIM_MAX
            else normalize_dims(block, "block")
        )
        hs = 0 if stream is None else _stream_for(stream, ctx)
        packer = self._packer or self._require_packer()
        addr = packer.address_for(args)
        try:
            (err,) = drv.cuLaunchKernel(func, *g, *b, shared_mem, hs, addr, 0)
        except (OverflowError, TypeError) as exc:
            raise ValueError(
                f"launch of {self.name!r}: bad shared_mem={shared_mem!r}: {exc}"
            ) from None
        if err:
            raise self._launch_error(int(err), ctx, func, g, b, shared_mem)

    def prepare(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        *args: Any,
        stream: Any = None,
        shared_mem: int = 0,
    ) -> PreparedLaunch:
        """Check and pack everything once; calling the result launches.

        The launch belongs to the context current now (or the module's context).
        """
        ctx = self._current(f"preparing a launch of {self.name!r}")
        with ctx:
            func = self._function(ctx)
        return PreparedLaunch(self, ctx, func, grid, block, args, stream, shared_mem)

    def _launch_error(
        self,
        code: int,
        ctx: Context,
        func: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
    ) -> CudaError:
        what = f"cuLaunchKernel({self.name!r}, grid={grid}, block={block}, shared_mem={shared_mem})"
        if code in STICKY_CODES:
            return ctx.note_error(code, what)
        if code in _JIT_CODES:
            return _jit_error(code, what, self.module._image)
        detail = ""
        if code in (_INVALID_VALUE, _OUT_OF_RESOURCES):
            reasons = _params.explain_launch_config(
                grid, block, shared_mem, self._limits(ctx, func)
            )
            detail = "\n".join(f"- {r}" for r in reasons)
        elif code in (_INVALID_HANDLE, _INVALID_CONTEXT):
            detail = (
                f"ctxkit launched in {ctx!r}; if other code pushed a different context "
                "without ctxkit knowing, the kernel handle does not belong to it"
            )
        return _driver.from_result(code, what, detail)

    def _limits(self, ctx: Context, func: Any) -> dict[str, int]:
        out: dict[str, int] = {}
        dev = ctx.device
        names = {
            "max_block_dim_x": "max_block_dim_x",
            "max_block_dim_y": "max_block_dim_y",
            "max_block_dim_z": "max_block_dim_z",
            "max_grid_dim_x": "max_grid_dim_x",
            "max_grid_dim_y": "max_grid_dim_y",
            "max_grid_dim_z": "max_grid_dim_z",
            "max_shared_optin": "max_shared_memory_per_block_optin",
            "regs_per_block": "max_registers_per_block",
        }
        for key, attr in names.items():
            try:
                out[key] = dev.attribute(attr)
            except Exception:
                pass
        fattrs = {
            "max_threads_per_block": "max_threads_per_block",
            "max_dynamic_shared": "max_dynamic_shared_size_bytes",
            "static_shared": "shared_size_bytes",
            "num_regs": "num_regs",
        }
        for key, attr in fattrs.items():
            err, v = drv.cuFuncGetAttribute(_function_attribute(attr), func)
            if not err:
                out[key] = int(v)
        if self._sig is not None and self._sig.reqntid:
            out["reqntid"] = int(np.prod(self._sig.reqntid))
        return out

    # -- attributes and occupancy ------------------------------------------------------

    def _func_here(self, what: str) -> tuple[Context, Any]:
        ctx = self._current(what)
        with ctx:
            return ctx, self._function(ctx)

    @property
    def attributes(self) -> dict[str, int]:
        """All ``CUfunction_attribute`` values in the current context, by readable name."""
        ctx, func = self._func_here(f"{self.name}.attributes")
        out = {}
        with ctx:
            for member in drv.CUfunction_attribute:
                key = member.name[len("CU_FUNC_ATTRIBUTE_") :]
                if key == "MAX":
                    continue
                err, v = drv.cuFuncGetAttribute(member, func)
                if not err:
                    out[key.lower()] = int(v)
        return out

    def attribute(self, name: str | Any) -> int:
        """One attribute, e.g. ``"num_regs"`` or ``"max_threads_per_block"``."""
        ctx, func = self._func_here(f"{self.name}.attribute({name!r})")
        with ctx:
            return int(call(drv.cuFuncGetAttribute, _function_attribute(name), func))

    def set_attribute(self, name: str | Any, value: int) -> None:
        """Set an attribute in the current context (e.g. ``"max_dynamic_shared_size_bytes"``)."""
        ctx, func = self._func_here(f"{self.name}.set_attribute({name!r})")
        with ctx:
            call(
                drv.cuFuncSetAttribute,
                func,
                _function_attribute(name),
                int(value),
                what=f"cuFuncSetAttribute({self.name!r}, {name}, {value})",
            )

    def max_block_size(self, shared_mem: int = 0, block_size_limit: int = 0) -> int:
        """Block size with the highest occupancy (``cuOccupancyMaxPotentialBlockSize``)."""
        return self._potential(shared_mem, block_size_limit)[1]

    def _potential(self, shared_mem: int, limit: int) -> tuple[int, int]:
        ctx, func = self._func_here(f"{self.name}.max_block_size")
        with ctx:
            grid, block = call(
                drv.cuOccupancyMaxPotentialBlockSize, func, None, int(shared_mem), int(limit)
            )
        return int(grid), int(block)

    def occupancy(self, block_size: int, shared_mem: int = 0) -> int:
        """Resident blocks per SM at *block_size* (occupancy calculator)."""
        ctx, func = self._func_here(f"{self.name}.occupancy")
        with ctx:
            return int(
                call(
                    drv.cuOccupancyMaxActiveBlocksPerMultiprocessor,
                    func,
                    int(block_size),
                    int(shared_mem),
                )
            )

    def launch_config(self, n: int, shared_mem: int = 0) -> tuple[int, int]:
        """``(grid, block)`` covering *n* threads with the occupancy-optimal block size."""
        block = self.max_block_size(shared_mem)
        return max(1, -(-int(n) // block)), block


# --- PreparedLaunch -------------------------------------------------------------------


class PreparedLaunch:
    """A launch with its arguments packed once; ``pl()`` launches it again.

    Made by :meth:`Kernel.prepare`. It belongs to one context; calling it from a thread
    where another context is current binds that context for the call. It keeps
    references to its arguments, so buffers stay alive as long as it does.
    """

    __slots__ = ("_args", "_buf", "_call", "_kernel", "block", "context", "grid", "shared_mem")

    def __init__(
        self,
        kernel: Kernel,
        ctx: Context,
        func: Any,
        grid: Any,
        block: Any,
        args: tuple[Any, ...],
        stream: Any,
        shared_mem: int,
    ) -> None:
        packer = kernel._require_packer()
        self._kernel = kernel
        self.context = ctx
        self.grid = normalize_dims(grid, "grid")
        self.block = normalize_dims(block, "block")
        if isinstance(shared_mem, bool) or not isinstance(shared_mem, int) or shared_mem < 0:
            raise ValueError(f"shared_mem must be a non-negative int, got {shared_mem!r}")
        self.shared_mem = shared_mem
        self._buf = ParamBuffer(packer.sig)
        packer.pack_into(self._buf, args)
        self._args = list(args)
        hs = 0 if stream is None else _stream_for(stream, ctx)
        self._call = (func, *self.grid, *self.block, shared_mem, hs, self._buf.address, 0)

    def __call__(self) -> None:
        """Launch (no argument packing; the context is checked in thread-local state)."""
        if thread_state().top is not self.context or self._kernel.module.closed:
            return self._call_slow()
        (err,) = drv.cuLaunchKernel(*self._call)
        if err:
            raise self._error(int(err))

    def _call_slow(self) -> None:
        self._kernel.module._check_open()
        with guard(self.context, f"PreparedLaunch of {self._kernel.name!r}"):
            (err,) = drv.cuLaunchKernel(*self._call)
        if err:
            raise self._error(int(err))

    def _error(self, code: int) -> CudaError:
        return self._kernel._launch_error(
            code, self.context, self._call[0], self.grid, self.block, self.shared_mem
        )

    def set_arg(self, key: int | str, value: Any) -> None:
        """Replace one argument (by index or PTX parameter name), checked like a launch."""
        packer = self._kernel._require_packer()
        i = packer.index_of(key)
        packer.pack_one(self._buf, i, value)
        self._args[i] = value

    @property
    def args(self) -> tuple[Any, ...]:
        """The current arguments."""
        return tuple(self._args)

    def __repr__(self) -> str:
        return (
            f"<PreparedLaunch {self._kernel.name} grid={self.grid} block={self.block} "
            f"in {self.context!r}>"
        )


# --- graphs ---------------------------------------------------------------------------

_CAPTURE_MODES = {
    "global": "CU_STREAM_CAPTURE_MODE_GLOBAL",
    "thread_local": "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL",
    "relaxed": "CU_STREAM_CAPTURE_MODE_RELAXED",
}
_SPECIAL_STREAMS = (0, 1, 2)  # legacy default, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD


class Graph:
    """An instantiated CUDA graph from :func:`capture`; replay with :meth:`launch`.

    Attributes
    ----------
    context : Context
    num_nodes : int
        Nodes captured (one per kernel launch or copy).
    """

    def __init__(self, context: Context) -> None:
        self.context = context
        self.num_nodes = 0
        self._exec: Any = None
        self._fin: weakref.finalize | None = None

    def _instantiate(self, graph: Any) -> None:
        res = drv.cuGraphGetNodes(graph, 0)
        if not res[0]:
            self.num_nodes = int(res[-1])
        self._exec = call(drv.cuGraphInstantiate, graph, 0, what="cuGraphInstantiate")
        self._fin = finalizer(self, self.context, drv.cuGraphExecDestroy, self._exec)

    def launch(self, stream: Any = None) -> None:
        """Replay the graph on *stream* (``None``: the context's legacy default stream)."""
        if self._exec is None:
            raise CudaError(
                "the graph is empty: its capture block has not finished, or it was closed"
            )
        ctx = self.context
        hs = 0 if stream is None else _stream_for(stream, ctx)
        if thread_state().top is ctx:
            (err,) = drv.cuGraphLaunch(self._exec, hs)
        else:
            with guard(ctx, "Graph.launch"):
                (err,) = drv.cuGraphLaunch(self._exec, hs)
        if err:
            raise ctx.note_error(int(err), "cuGraphLaunch")

    def close(self) -> None:
        """Free the executable graph (in its context). Idempotent."""
        if self._fin is not None:
            self._fin()
        self._exec = None

    def __repr__(self) -> str:
        state = "ready" if self._exec is not None else "empty"
        return f"<Graph {self.num_nodes} nodes {state} in {self.context!r}>"


@contextmanager
def capture(stream: Any, *, mode: str = "thread_local") -> Iterator[Graph]:
    """Record the work enqueued on *stream* inside the block into a :class:`Graph`.

    ``with capture(s) as g: k.launch(..., stream=s)`` -- after the block ``g.launch()``
    replays it. The stream's context is bound for the block. Work inside must be
    asynchronous and on *stream* (no synchronize, no pageable copies).

    Parameters
    ----------
    stream : Stream or foreign stream
        A created stream; the legacy default stream cannot be captured.
    mode : {"thread_local", "global", "relaxed"}
        ``cuStreamBeginCapture`` mode: which other threads' unsafe calls are refused.
    """
    if stream is None:
        raise ValueError(
            "capture needs a created stream (ck.Stream()); the default stream cannot be captured"
        )
    try:
        mode_enum = getattr(drv.CUstreamCaptureMode, _CAPTURE_MODES[mode])
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(_CAPTURE_MODES)}, not {mode!r}") from None
    sc = getattr(stream, "context", None)
    ctx = sc if isinstance(sc, Context) else require_current("graph capture")
    hs = _stream_for(stream, ctx)
    if int(hs) in _SPECIAL_STREAMS:
        raise ValueError("the default stream cannot be captured; capture a ck.Stream()")
    graph = Graph(ctx)
    with guard(ctx, "graph capture"):
        (err,) = drv.cuStreamBeginCapture(hs, mode_enum)
        if err:
            raise _driver.from_result(int(err), "cuStreamBeginCapture")
        try:
            yield graph
        except BaseException:
            res = drv.cuStreamEndCapture(hs)
            if not res[0] and res[1] is not None and int(res[1]):
                drv.cuGraphDestroy(res[1])
            raise
        err, cu_graph = drv.cuStreamEndCapture(hs)
        if err:
            raise _driver.from_result(
                int(err),
                "cuStreamEndCapture",
                "something in the capture block could not be captured (a synchronize, a "
                "synchronous or pageable copy, or work forked to another stream and not "
                "joined back); enqueue everything asynchronously on the captured stream",
            )
        try:
            graph._instantiate(cu_graph)
        finally:
            drv.cuGraphDestroy(cu_graph)
