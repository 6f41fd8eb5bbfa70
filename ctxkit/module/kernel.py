"""Kernels and launches: per-context functions, checked launches, prepared launches.

A :class:`Kernel` of a context-independent library fetches its ``CUfunction`` once per
context (``cuKernelGetFunction``) and launches in whichever context is current; one of
a context-bound module refuses other contexts with a message naming both. Arguments are
checked and packed by :mod:`ctxkit.module.params` before anything reaches the driver.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _driver
from .._driver import call, drv
from ..context import Context, require_current, thread_state
from ..errors import STICKY_CODES, CudaError, LaunchArgumentError
from ..registry import guard
from ..stream import stream_for
from . import params as _params
from .image import JIT_CODES
from .params import ArgPacker, ParamBuffer, normalize_dims
from .ptxsig import Param, Signature

if TYPE_CHECKING:
    from .module import Module

__all__ = ["Kernel", "PreparedLaunch", "load_function"]


_INVALID_VALUE = 1


_OUT_OF_RESOURCES = 701


_INVALID_HANDLE = 400


_INVALID_CONTEXT = 201


_DIM_MAX = 0xFFFFFFFF


def load_function(func: Any) -> int:
    """``cuFuncLoad(func)``: finish loading a lazily loaded function now; the CUresult.

    ``0`` also where the driver or the bindings predate ``cuFuncLoad`` (CUDA 12.4):
    there the function loads at its first launch, as before.
    """
    fn = getattr(drv, "cuFuncLoad", None)
    if fn is None:
        return 0
    try:
        (err,) = fn(func)
    except RuntimeError:  # bindings newer than the driver: the symbol is missing
        return 0
    return int(err)


def _function_attribute(name: str | Any) -> Any:
    return _driver.enum_member(
        drv.CUfunction_attribute, "CU_FUNC_ATTRIBUTE_", name, "kernel attribute"
    )


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

    __slots__ = (
        "__weakref__",
        "_funcs",
        "_handle",
        "_packer",
        "_sig",
        "_unknown_reason",
        "module",
        "name",
        "symbol",
    )

    def __init__(
        self,
        module: Module,
        name: str,
        symbol: str,
        handle: Any,
        sig: Signature | None,
        *,
        unknown_reason: str = "",
    ) -> None:
        self.module = module
        self.name = name
        self.symbol = symbol
        self._handle = handle
        self._sig = sig
        self._unknown_reason = unknown_reason
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
            why = self._unknown_reason or "the driver did not report it"
            raise LaunchArgumentError(
                f"the parameter list of kernel {self.name!r} is unknown: the module has no "
                f"PTX and the driver's layout query failed ({why}); load ck.compile output "
                "(it keeps the PTX) or PTX text"
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
                raise self._function_error(int(err), ctx, "cuKernelGetFunction")
        err = load_function(func)
        if err:
            raise self._function_error(err, ctx, "cuFuncLoad")
        self._funcs[ctx.handle] = (ctx, func)
        return func

    def _function_error(self, code: int, ctx: Context, call: str) -> CudaError:
        what = f"{call}({self.name!r}) in {ctx!r}"
        if code in JIT_CODES:
            return self.module._jit_error(code, what)
        return ctx.note_error(code, what)

    def preload(self, context: Context | None = None) -> None:
        """Load the kernel into *context* now rather than at its first launch.

        Under CUDA's lazy loading (the default since CUDA 12.2) a kernel is loaded into
        a context at its first launch, and loading may wait until the context is idle:
        the first launch of a kernel while another kernel runs can block the host until
        that kernel finishes. Preloading (``cuKernelGetFunction`` + ``cuFuncLoad``, once
        per context) moves that cost to a moment of your choice. ``Pipeline.map`` does
        it on every device before the first chunk.

        Parameters
        ----------
        context : Context, optional
            Default: the calling thread's current context (the module's own context for
            a module loaded with ``context=``).

        Raises
        ------
        NoCurrentContextError
            No *context* was given and the thread has none.
        CompileError
            The driver could not load the kernel's code for the device.
        """
        ctx = context if context is not None else self._current(f"{self.name}.preload")
        with ctx:
            self._function(ctx)

    def _wrong_context(self, ctx: Context) -> CudaError:
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
        self.module._check_open()
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
        CudaError
            The kernel's module is closed.
        """
        if self.module.closed:
            self.module._check_open()
        ctx = thread_state().top
        if ctx is None:
            ctx = require_current(f"launching kernel {self.name!r}")
        hit = self._funcs.get(ctx.handle)
        func = hit[1] if hit is not None and hit[0] is ctx else self._resolve(ctx)
        if type(grid) is int and 0 < grid <= _DIM_MAX:
            gx, gy, gz = grid, 1, 1
        else:
            gx, gy, gz = normalize_dims(grid, "grid")
        if type(block) is int and 0 < block <= _DIM_MAX:
            bx, by, bz = block, 1, 1
        else:
            bx, by, bz = normalize_dims(block, "block")
        hs = 0 if stream is None else stream_for(stream, ctx, "launch")
        addr = (self._packer or self._require_packer()).address_for(args)
        try:
            (err,) = drv.cuLaunchKernel(func, gx, gy, gz, bx, by, bz, shared_mem, hs, addr, 0)
        except (OverflowError, TypeError) as exc:
            raise ValueError(
                f"launch of {self.name!r}: bad shared_mem={shared_mem!r}: {exc}"
            ) from None
        if err:
            raise self._launch_error(int(err), ctx, func, (gx, gy, gz), (bx, by, bz), shared_mem)

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
        if code in JIT_CODES:
            return self.module._jit_error(code, what)
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
        names = {f"max_{k}_dim_{a}": f"max_{k}_dim_{a}" for k in ("block", "grid") for a in "xyz"}
        names["max_shared_optin"] = "max_shared_memory_per_block_optin"
        names["regs_per_block"] = "max_registers_per_block"
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
        hs = 0 if stream is None else stream_for(stream, ctx, "launch")
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
