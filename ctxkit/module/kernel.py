"""Kernels and launches: per-context functions, checked launches, prepared launches.

A :class:`Kernel` of a context-independent library fetches its ``CUfunction`` once per
context (``cuKernelGetFunction``) and launches in whichever context is current; one of
a context-bound module refuses other contexts with a message naming both. Arguments are
checked and packed by :mod:`ctxkit.module.params` before anything reaches the driver.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .. import _driver
from .._driver import call, drv
from ..binding import guard, registry
from ..context import Context, current_handle, require_current
from ..context import _tls as _thread_local
from ..errors import STICKY_CODES, CudaError, LaunchArgumentError
from ..stream import Stream, stream_for
from ..stream import _current as _current_streams
from .image import JIT_CODES
from .launch import (
    DIM_MAX,
    LEGACY_STREAM,
    LaunchConfig,
    check_cluster,
    check_cooperative,
    config_for,
    failure_detail,
    function_attribute,
    native_config,
    normalize_dims,
    shared_mem_arg,
)
from .params import ArgPacker
from .prepared import PreparedLaunch
from .ptxsig import Param, Signature

if TYPE_CHECKING:
    from .module import Module

__all__ = ["Kernel", "PreparedLaunch", "load_function"]


_INVALID_HANDLE = 400


#: ``Kernel._last`` before any launch and after the module is closed: never a context
_NO_LAUNCH: tuple[Any, Any] = (object(), None)


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
        "_address",
        "_fits",
        "_funcs",
        "_handle",
        "_last",
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
        self._address = self._packer.address if self._packer is not None else None
        self._funcs: dict[int, tuple[Context, Any]] = {}
        self._last: tuple[Any, Any] = _NO_LAUNCH  # (context, CUfunction) of the last launch
        self._fits: dict[Any, Any] = {}  # occupancy limits of cooperative and cluster launches

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

    # -- handles -----------------------------------------------------------------------

    @property
    def handle(self) -> Any:
        """The driver handle, for code that calls the driver directly.

        A ``CUkernel`` for a kernel of a context-independent library (the default
        ``Module.load``), which ``cuLaunchKernel`` accepts in any context; a ``CUfunction``
        for a kernel of a module loaded with ``context=``. See :meth:`function_handle`
        for the ``CUfunction`` of one context.
        """
        self.module._check_open()
        return self._handle

    def function_handle(self, context: Context | None = None) -> Any:
        """The ``CUfunction`` of this kernel in *context*, loaded (``cuFuncLoad``).

        Parameters
        ----------
        context : Context, optional
            Default: the calling thread's current context (the module's own context for
            a module loaded with ``context=``).

        Raises
        ------
        NoCurrentContextError
            No *context* was given and the thread has none.
        """
        ctx = context if context is not None else self._current(f"{self.name}.function_handle")
        with ctx:
            return self._function(ctx)

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

    def _forget_functions(self) -> None:
        """The module was closed: no launch may reuse a function of it."""
        self._last = _NO_LAUNCH
        self._funcs.clear()

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
        cooperative: bool = False,
        cluster: int | tuple[int, ...] | None = None,
        config: LaunchConfig | None = None,
    ) -> None:
        """Launch on the current context's device.

        Parameters
        ----------
        grid, block : int or tuple of 1-3 ints
        *args
            One per kernel parameter: ctxkit buffers/arrays, CuPy/PyTorch/Numba arrays,
            DLPack producers, Python or numpy numbers, bytes for structs by value.
        stream : Stream, CuPy/PyTorch stream, int or None
            ``None``: the thread's current stream of the context (``with stream:``), by
            default the legacy default stream. Foreign arrays among *args* are used
            after their producer stream (CAI v3 ``stream``, DLPack, PyTorch/CuPy).
        shared_mem : int
            Dynamic shared memory per block, in bytes.
        cooperative : bool
            A cooperative launch: all blocks resident at once, for grid-wide
            synchronisation (``cooperative_groups::this_grid().sync()``).
        cluster : int or tuple of 1-3 ints, optional
            Thread-block cluster shape (compute capability 9.0+).
        config : LaunchConfig, optional
            These and the other launch attributes in one object (instead of
            ``cooperative=``/``cluster=``).

        Raises
        ------
        LaunchArgumentError
            Arguments do not match the parameters, or a ctxkit buffer lives on another
            device without peer access (checked before launching).
        CudaError
            The module is closed; a cooperative grid larger than the device holds at once
            (``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE``), or a cluster the device or
            kernel cannot take (``CUDA_ERROR_INVALID_CLUSTER_SIZE``), refused before
            launching with the occupancy numbers.
        NoCurrentContextError
            The calling thread has no current context.
        ContextPoisonedError
            An earlier kernel faulted in this context.
        """
        ctx = _thread_local.s.top
        last = self._last
        if last[0] is ctx:
            func = last[1]
        else:
            owner = self._implied_context(ctx, stream, args)
            if owner is not None:  # nothing current here: bind what the launch uses
                with owner:
                    self.launch(
                        grid,
                        block,
                        *args,
                        stream=stream,
                        shared_mem=shared_mem,
                        cooperative=cooperative,
                        cluster=cluster,
                        config=config,
                    )
                return
            ctx, func = self._launch_function(ctx)
        if type(grid) is int and 0 < grid <= DIM_MAX:
            gx, gy, gz = grid, 1, 1
        else:
            gx, gy, gz = normalize_dims(grid, "grid")
        if type(block) is int and 0 < block <= DIM_MAX:
            bx, by, bz = block, 1, 1
        else:
            bx, by, bz = normalize_dims(block, "block")
        if stream is None:
            current = _current_streams.by_context
            cur = current.get(ctx.handle) if current else None
            if cur is None:
                hs = LEGACY_STREAM
            elif (hs := cur.handle) is None:
                hs = stream_for(None, ctx, "launch")  # closed: says so
        elif type(stream) is Stream and stream.context is ctx and stream.handle is not None:
            hs = stream.handle
        else:
            hs = stream_for(stream, ctx, "launch")
        addr = (self._address or self._require_packer().address)(args, ctx, hs, stream)
        if cooperative or cluster is not None or config is not None:
            cfg = config_for(config, cooperative, cluster)
            if not cfg.empty:
                self._launch_ex(ctx, func, (gx, gy, gz), (bx, by, bz), shared_mem, hs, addr, cfg)
                return
        try:
            (err,) = drv.cuLaunchKernel(func, gx, gy, gz, bx, by, bz, shared_mem, hs, addr, 0)
        except (OverflowError, TypeError) as exc:
            raise ValueError(
                f"launch of {self.name!r}: bad shared_mem={shared_mem!r}: {exc}"
            ) from None
        if err:
            raise self._launch_error(int(err), ctx, func, (gx, gy, gz), (bx, by, bz), shared_mem)

    def _implied_context(self, top: Context | None, stream: Any, args: tuple[Any, ...]) -> Any:
        """The context to bind for a launch from a thread with nothing current: the
        stream's, the module's, or the first ctxkit buffer argument's (``None`` when a
        context is current, or in strict mode: the launch then needs one)."""
        if top is not None or current_handle() or registry.strict:
            return None
        sc = getattr(stream, "context", None)
        if isinstance(sc, Context):
            return sc
        if isinstance(self.module.context, Context):
            return self.module.context
        for a in args:
            ac = getattr(a, "context", None)
            if isinstance(ac, Context):
                return ac
        return None

    def _launch_function(self, ctx: Context | None) -> tuple[Context, Any]:
        """The launch's context and function when the last launch's do not apply."""
        if ctx is None:
            self.module._check_open()
            ctx = require_current(f"launching kernel {self.name!r}")
        hit = self._funcs.get(ctx.handle)
        func = hit[1] if hit is not None and hit[0] is ctx else self._resolve(ctx)
        self._last = (ctx, func)
        return ctx, func

    def _launch_ex(
        self,
        ctx: Context,
        func: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        hs: Any,
        addr: int,
        cfg: LaunchConfig,
    ) -> None:
        shared_mem = shared_mem_arg(shared_mem, self.name)
        self._check_config(ctx, func, grid, block, shared_mem, cfg)
        native = native_config(grid, block, shared_mem, hs, cfg.attributes())
        (err,) = drv.cuLaunchKernelEx(native, func, addr, 0)
        if err:
            raise self._launch_error(int(err), ctx, func, grid, block, shared_mem, cfg)

    def _check_config(
        self,
        ctx: Context,
        func: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        cfg: LaunchConfig,
    ) -> None:
        if cfg.cooperative:
            check_cooperative(self.name, self._fits, ctx, func, grid, block, shared_mem)
        if cfg.cluster is not None:
            check_cluster(self.name, self._fits, ctx, func, grid, block, shared_mem, cfg.cluster)

    def prepare(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        *args: Any,
        stream: Any = None,
        shared_mem: int = 0,
        cooperative: bool = False,
        cluster: int | tuple[int, ...] | None = None,
        config: LaunchConfig | None = None,
    ) -> PreparedLaunch:
        """Check and pack everything once; calling the result launches.

        Takes the arguments of :meth:`launch`; the launch belongs to the context current
        now (or the module's context), and ``stream=None`` means the current stream now.
        Cooperative and cluster limits are checked here.
        """
        ctx = self._current(f"preparing a launch of {self.name!r}")
        cfg = config_for(config, cooperative, cluster)
        with ctx:
            func = self._function(ctx)
            return PreparedLaunch(self, ctx, func, grid, block, args, stream, shared_mem, cfg)

    def _launch_error(
        self,
        code: int,
        ctx: Context,
        func: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        cfg: LaunchConfig | None = None,
    ) -> CudaError:
        options = f", {cfg.describe()}" if cfg is not None and not cfg.empty else ""
        call_name = "cuLaunchKernelEx" if options else "cuLaunchKernel"
        what = (
            f"{call_name}({self.name!r}, grid={grid}, block={block}, "
            f"shared_mem={shared_mem}{options})"
        )
        if code in STICKY_CODES:
            return ctx.note_error(code, what)
        if code in JIT_CODES:
            return self.module._jit_error(code, what)
        reqntid = self._sig.reqntid if self._sig is not None else None
        detail = failure_detail(code, ctx, func, grid, block, shared_mem, reqntid)
        return _driver.from_result(code, what, detail)

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
            return int(call(drv.cuFuncGetAttribute, function_attribute(name), func))

    def set_attribute(self, name: str | Any, value: int) -> None:
        """Set an attribute in the current context (e.g. ``"max_dynamic_shared_size_bytes"``)."""
        ctx, func = self._func_here(f"{self.name}.set_attribute({name!r})")
        self._fits.clear()  # occupancy limits depend on the attributes
        with ctx:
            call(
                drv.cuFuncSetAttribute,
                func,
                function_attribute(name),
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
