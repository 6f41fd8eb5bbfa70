"""Modules: load PTX, cubin or fatbin and look up kernels.

``Module.load`` takes a ``ck.ObjectCode``, bytes, PTX text or a path. By default it
loads a context-independent *library* (``cuLibraryLoadData``): one :class:`Kernel`
then launches in whichever context is current, on any device, with the per-context
``CUfunction`` fetched once per context. ``context=`` loads a classic module bound to
that context instead.

``Kernel.launch`` checks arguments against the PTX ``.entry`` signature before
anything runs (:class:`~ctxkit.errors.LaunchArgumentError` names the parameter);
``Kernel.prepare`` packs them once for the cheapest repeated launch; :func:`capture`
records launches on a stream into a replayable :class:`Graph`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from . import _driver, _params
from . import context as _context
from ._driver import call, drv
from ._graph import Graph, capture
from ._image import (
    JIT_CODES,
    Image,
    decode_log,
    jit_detail,
    jit_error,
    jit_options,
    missing_kernel_message,
    read_image,
)
from ._kernel import Kernel, PreparedLaunch
from ._params import Signature
from .context import Context, finalizer
from .errors import STICKY_CODES, CompileError, CudaError
from .registry import guard, registry

__all__ = [
    "Graph",
    "Kernel",
    "KernelNotFoundError",
    "Module",
    "PreparedLaunch",
    "capture",
    "jit_detail",
    "missing_kernel_message",
    "read_image",
]

_NOT_FOUND = 500
_INVALID_VALUE = 1


class KernelNotFoundError(CudaError, LookupError):
    """The module has no kernel of that name (the message lists those it has)."""


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
            if int(err) in JIT_CODES:
                raise self._jit_error(int(err), what)
            raise _driver.from_result(int(err), what)
        k = Kernel(self, name, symbol, handle, self._signature_for(symbol, handle))
        self._kernels[name] = k
        return k

    def _signature_for(self, symbol: str, handle: Any) -> Signature | None:
        if self._signatures is not None and symbol in self._signatures:
            return self._signatures[symbol]
        if self.context is None:
            layout = _driver_layout(getattr(drv, "cuKernelGetParamInfo", None), handle)
        else:
            with guard(self.context, f"Module.function({symbol!r})"):
                layout = _driver_layout(getattr(drv, "cuFuncGetParamInfo", None), handle)
        return None if layout is None else _params.signature_from_layout(symbol, layout)

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
            k._funcs.clear()
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


def _driver_layout(fn: Callable[..., Any] | None, handle: Any) -> list[tuple[int, int]] | None:
    """``(offset, size)`` of each parameter from the driver (CUDA 12.4+), or None."""
    if fn is None:
        return None
    layout: list[tuple[int, int]] = []
    while True:
        try:
            res = fn(handle, len(layout))
        except Exception:  # an old driver without the entry point
            return None
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
