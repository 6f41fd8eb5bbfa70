"""``Module``: code loaded as a context-independent library (``cuLibraryLoadData``) or
into one context, and its kernels by name (the family's overview is in
:mod:`ctxkit.module`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from .. import _driver
from .. import context as _context
from .._driver import call, describe, drv
from ..binding import bind, guard, registry
from ..context import Context, current_handle
from ..errors import STICKY_CODES, CompileError, CudaError, KernelNotFoundError
from ..lifetime import finalizer
from .cdecl import CType, mangled_param_types, source_param_types
from .image import (
    JIT_CODES,
    Image,
    decode_log,
    jit_error,
    jit_options,
    missing_kernel_message,
    read_image,
)
from .kernel import Kernel
from .ptxsig import Signature, parse_entries, signature_from_layout

__all__ = ["Module"]


_NOT_FOUND = 500


_INVALID_VALUE = 1


def _unload_library(unload: Any, lib: Any) -> Any:
    """Free of a library (through ctxkit.lifetime.finalizer, which holds it back while a
    stream capture is open); at interpreter exit the process teardown unloads."""
    if _context._shutting_down:
        return None
    return unload(lib)


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
        self._signatures = self._parse_signatures()
        if context is None:
            self._fin = finalizer(self, None, _unload_library, drv.cuLibraryUnload, handle)
        else:
            self._fin = finalizer(self, context, drv.cuModuleUnload, handle)

    def _parse_signatures(self) -> dict[str, Signature] | None:
        if not self.ptx:
            return None
        try:
            return parse_entries(self.ptx)
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
    def _load_library(cls, image: Image) -> Module:
        keys, vals, info, err_log = jit_options()
        res = drv.cuLibraryLoadData(image.code, keys, vals, len(keys), [], [], 0)
        if res[0]:
            raise _load_error(int(res[0]), image, "cuLibraryLoadData", info, err_log)
        return cls(image, res[1], None, (info, err_log))

    @classmethod
    def _load_bound(cls, image: Image, ctx: Context) -> Module:
        keys, vals, info, err_log = jit_options()
        with ctx:
            res = drv.cuModuleLoadDataEx(image.code, len(keys), keys, vals)
        if res[0]:
            raise _load_error(int(res[0]), image, "cuModuleLoadDataEx", info, err_log, ctx)
        return cls(image, res[1], ctx, (info, err_log))

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
        self._check_open()
        k = self._kernels.get(name)
        if k is not None:
            return k
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
            if int(err) in JIT_CODES:
                raise self._jit_error(int(err), what)
            raise _driver.from_result(int(err), what)
        sig, why = self._signature_for(symbol, handle)
        k = Kernel(self, name, symbol, handle, sig, unknown_reason=why)
        self._kernels[name] = k
        return k

    def _signature_for(self, symbol: str, handle: Any) -> tuple[Signature | None, str]:
        """The PTX signature, else the driver's layout; with the reason when neither.

        The C++ parameter types (from the mangled name, or from the declaration in the
        source an ``ObjectCode`` carries) add what PTX does not say: the sign.
        """
        if self._signatures is not None and symbol in self._signatures:
            sig = self._signatures[symbol]
        else:
            if self.context is None:
                layout, why = library_layout(handle)
            else:
                with self.context:
                    layout, why = driver_layout(drv, "cuFuncGetParamInfo", handle)
            if layout is None:
                return None, why
            sig = signature_from_layout(symbol, layout)
        return sig.with_ctypes(self._param_types(symbol, len(sig.params))), ""

    def _param_types(self, symbol: str, count: int) -> list[CType] | None:
        if symbol.startswith("_Z"):
            return mangled_param_types(symbol)
        if self._image.source:
            return source_param_types(self._image.source, symbol, count)
        return None

    def _jit_error(self, code: int, what: str) -> CompileError:
        return jit_error(code, what, self._image, decode_log(self._logs[1]))

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
            k._forget_functions()
        self._fin()

    def __repr__(self) -> str:
        where = "library" if self.context is None else f"bound to {self.context!r}"
        return f"<Module {self.name} ({self.format}, {where})>"


def _load_error(
    code: int,
    image: Image,
    what: str,
    info: bytearray,
    err_log: bytearray,
    ctx: Context | None = None,
) -> CudaError:
    call_text = f"{what}({image.label}, {image.format})"
    if code in JIT_CODES:
        return jit_error(code, call_text, image, decode_log(err_log), decode_log(info))
    if ctx is not None and code in STICKY_CODES:
        return ctx.note_error(code, call_text)
    return _driver.from_result(code, call_text)


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
        ctx = None if current_handle() else bind(0)
        with ctx if ctx is not None else nullcontext():
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
