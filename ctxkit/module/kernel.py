"""Kernels and launches: per-context functions, checked and prepared launches, launch options.

A :class:`Kernel` of a context-independent library fetches its ``CUfunction`` once per
context (``cuKernelGetFunction``) and launches in whichever context is current; one of
a context-bound module refuses other contexts with a message naming both. Arguments are
checked and packed by :mod:`ctxkit.module.params` before anything reaches the driver.

Launch configuration: :func:`normalize_dims` checks grid/block shapes. :class:`LaunchConfig`
holds the options that need ``cuLaunchKernelEx`` (cooperative grids, thread-block clusters,
programmatic dependent launch, per-launch priority), frozen and hashable, so their driver
form is built once. Before a launch with them, the kernel refuses what the device or the
kernel cannot run, with the occupancy numbers in the message, instead of the driver's bare
``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`` or ``CUDA_ERROR_INVALID_CLUSTER_SIZE``. A launch
without them keeps ``cuLaunchKernel``.
:func:`explain_launch_config` says why a grid/block/shared-memory setting exceeds the
device's or kernel's limits.

Prepared launches: :meth:`Kernel.prepare` makes a :class:`PreparedLaunch`; calling it is one
thread-local check and one driver call (``cuLaunchKernel``, or ``cuLaunchKernelEx`` with its
launch attributes prebuilt).
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

from .. import _driver, lifetime
from .._driver import call, drv
from ..binding import guard, registry, resolve_context
from ..context import Context, current_handle, per_thread, thread_state
from ..errors import STICKY_CODES, CudaError, LaunchArgumentError
from ..memory.interop import order_after_producers
from ..stream import Stream, call_stream, implicit_stream
from .params import ArgPacker, foreign_arrays, short_repr
from .ptxsig import Param, Signature

if TYPE_CHECKING:
    from .module import Module

__all__ = [
    "JIT_CODES",
    "Kernel",
    "LaunchConfig",
    "PreparedLaunch",
    "config_for",
    "explain_launch_config",
    "function_attribute",
    "load_function",
    "native_config",
    "normalize_dims",
    "shared_mem_arg",
]


#: Load failures that are the JIT's: invalid image/PTX, no JIT, PTX newer than the driver.
JIT_CODES = frozenset({200, 218, 221, 222, 223})


# The CUresult codes of the launch failures ctxkit refuses or explains itself.
_INVALID_VALUE = 1


_INVALID_CONTEXT = 201


_INVALID_HANDLE = 400


_OUT_OF_RESOURCES = 701


_COOPERATIVE_TOO_LARGE = 720


_NOT_SUPPORTED = 801


_INVALID_CLUSTER_SIZE = 912


_PORTABLE_CLUSTER_MAX = 8


Dims = tuple[int, int, int]


DIM_MAX = (1 << 32) - 1


def normalize_dims(value: Any, what: str) -> Dims:
    """``grid``/``block`` as an int or 1-3 ints -> ``(x, y, z)``, each at least 1."""
    if type(value) is int and 0 < value <= DIM_MAX:
        return value, 1, 1
    try:
        items = list(value) if isinstance(value, (tuple, list)) else [value]
        dims = [operator.index(d) for d in items]
    except TypeError:
        raise TypeError(
            f"{what} must be an int or a tuple of 1-3 ints, got {short_repr(value)}"
        ) from None
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {len(dims)}: {tuple(dims)}")
    if any(not 0 < d <= DIM_MAX for d in dims):
        raise ValueError(f"{what} dimensions must be positive ints, got {tuple(dims)}")
    dims += [1] * (3 - len(dims))
    return dims[0], dims[1], dims[2]


def explain_launch_config(
    grid: Dims, block: Dims, shared_mem: int, limits: dict[str, int]
) -> list[str]:
    """Reasons a launch configuration exceeds the device/kernel *limits*.

    *limits* keys (all optional): ``max_threads_per_block`` (the kernel's own limit),
    ``max_block_dim_x/y/z``, ``max_grid_dim_x/y/z``, ``max_dynamic_shared``
    (the kernel's current dynamic shared-memory limit), ``max_shared_optin``
    (the device's opt-in maximum), ``static_shared``, ``num_regs``,
    ``regs_per_block``, ``reqntid`` (product, from the PTX).
    """
    out = []
    threads = block[0] * block[1] * block[2]
    if (mtpb := limits.get("max_threads_per_block")) is not None and threads > mtpb:
        why = f"block {block} has {threads} threads, more than this kernel's limit of {mtpb}"
        if (regs := limits.get("num_regs")) and limits.get("regs_per_block"):
            why += (
                f" (it uses {regs} registers per thread; the SM has "
                f"{limits['regs_per_block']} per block)"
            )
        out.append(why + f"; use a block of at most {mtpb} threads")
    if (req := limits.get("reqntid")) is not None and threads != req:
        out.append(f"the kernel requires exactly {req} threads per block (.reqntid)")
    for kind, dims in (("block", block), ("grid", grid)):
        for axis, n in zip("xyz", dims):
            if (lim := limits.get(f"max_{kind}_dim_{axis}")) is not None and n > lim:
                out.append(f"{kind}.{axis} = {n} exceeds the device maximum {lim}")
    if (dyn := limits.get("max_dynamic_shared")) is not None and shared_mem > dyn:
        why = f"shared_mem={shared_mem} bytes exceeds this kernel's dynamic shared limit ({dyn})"
        optin = limits.get("max_shared_optin")
        static = limits.get("static_shared", 0)
        if optin and shared_mem + static <= optin:
            why += (
                f"; the device allows up to {optin - static} after opting in: "
                "kernel.set_attribute('max_dynamic_shared_size_bytes', n)"
            )
        elif optin:
            why += f"; even opted in the device allows at most {optin} bytes per block"
        out.append(why)
    return out


@dataclass(frozen=True)
class LaunchConfig:
    """Launch attributes that travel together (``cuLaunchKernelEx``).

    Parameters
    ----------
    cooperative : bool
        A cooperative launch (``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``): every block of the
        grid is resident at once, so ``cooperative_groups::this_grid().sync()`` works. The
        grid may have at most (blocks per SM at this block size) x (SM count) blocks.
    cluster : int or tuple of 1-3 ints, optional
        Thread-block cluster shape in blocks (``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``,
        compute capability 9.0+); each grid dimension must be a multiple of it.
    programmatic_stream_serialization : bool
        Let this kernel start before the previous kernel in the stream has finished
        (programmatic dependent launch, compute capability 9.0+): it must wait with
        ``cudaGridDependencySynchronize()`` (PTX ``griddepcontrol.wait``) before reading
        what that kernel writes; the previous kernel may let it start early with
        ``cudaTriggerProgrammaticLaunchCompletion()`` (``griddepcontrol.launch_dependents``).
    priority : int, optional
        Priority of this launch (``CU_LAUNCH_ATTRIBUTE_PRIORITY``), in the range of
        stream priorities (lower is more urgent); ``None``: the stream's.
    """

    cooperative: bool = False
    cluster: Dims | None = None
    programmatic_stream_serialization: bool = False
    priority: int | None = None

    def __post_init__(self) -> None:
        for name in ("cooperative", "programmatic_stream_serialization"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LaunchConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.cluster is not None:
            object.__setattr__(self, "cluster", normalize_dims(self.cluster, "cluster"))
        if self.priority is not None and (
            isinstance(self.priority, bool) or not isinstance(self.priority, int)
        ):
            raise TypeError(f"LaunchConfig.priority must be an int or None, got {self.priority!r}")

    @property
    def empty(self) -> bool:
        """True when no attribute is set (a plain ``cuLaunchKernel`` launch)."""
        return self == _PLAIN

    def describe(self) -> str:
        """The set options, as keyword arguments (for messages)."""
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        return ", ".join(f"{k}={v}" for k, v in values if v is not False and v is not None)

    def attributes(self) -> list[Any]:
        """The ``CUlaunchAttribute`` list (built once per distinct config)."""
        return _build_attributes(self)


_PLAIN = LaunchConfig()


@lru_cache(maxsize=256)
def _keyword_config(cooperative: bool, cluster: Any) -> LaunchConfig:
    return LaunchConfig(cooperative=cooperative, cluster=cluster)


def config_for(config: LaunchConfig | None, cooperative: bool, cluster: Any) -> LaunchConfig:
    """The :class:`LaunchConfig` of a launch's ``config=``, ``cooperative=`` and ``cluster=``."""
    if config is not None:
        if cooperative or cluster is not None:
            raise TypeError(
                "pass the launch options either as config=LaunchConfig(...) or as "
                "cooperative=/cluster=, not both"
            )
        if not isinstance(config, LaunchConfig):
            raise TypeError(f"config must be a ctxkit LaunchConfig, got {type(config).__name__}")
        return config
    if type(cooperative) is bool:
        with contextlib.suppress(TypeError):  # an unhashable cluster (a list), or a bad one
            return _keyword_config(cooperative, cluster)
    return LaunchConfig(cooperative=cooperative, cluster=cluster)


def _refusal(message: str, code: int) -> CudaError:
    """ctxkit's own refusal of what the driver would fail with *code* (named as CUDA does)."""
    return CudaError(message, code, _driver.describe(code)[0])


def _attribute(name: str, field: str = "", value: int = 0) -> Any:
    """A ``CU_LAUNCH_ATTRIBUTE_<name>``, with *value* in its ``value.<field>``."""
    member = getattr(drv.CUlaunchAttributeID, f"CU_LAUNCH_ATTRIBUTE_{name}", None)
    if member is None:
        raise _refusal(
            f"cuda-bindings {_driver.BINDINGS_VERSION} has no CU_LAUNCH_ATTRIBUTE_{name}; "
            "install cuda-bindings 12.8 or newer",
            _NOT_SUPPORTED,
        )
    attr = drv.CUlaunchAttribute()
    attr.id = member
    if field:
        setattr(attr.value, field, value)
    return attr


@cache
def _build_attributes(cfg: LaunchConfig) -> list[Any]:
    out = []
    if cfg.cooperative:
        out.append(_attribute("COOPERATIVE", "cooperative", 1))
    if cfg.cluster is not None:
        out.append(_cluster_attribute(cfg.cluster))
    if cfg.programmatic_stream_serialization:
        field = "programmaticStreamSerializationAllowed"
        out.append(_attribute("PROGRAMMATIC_STREAM_SERIALIZATION", field, 1))
    if cfg.priority is not None:
        out.append(_attribute("PRIORITY", "priority", cfg.priority))
    return out


def _cluster_attribute(cluster: Dims) -> Any:
    a = _attribute("CLUSTER_DIMENSION")
    a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = cluster
    return a


def shared_mem_arg(shared_mem: Any, kernel: str) -> int:
    """*shared_mem* checked: a non-negative int (``ValueError`` naming *kernel* otherwise)."""
    if isinstance(shared_mem, bool) or not isinstance(shared_mem, int) or shared_mem < 0:
        raise ValueError(
            f"launch of {kernel!r}: shared_mem must be a non-negative int, got {shared_mem!r}"
        )
    return shared_mem


def native_config(grid: Dims, block: Dims, shared_mem: int, stream: Any, attrs: list[Any]) -> Any:
    """A ``CUlaunchConfig`` for ``cuLaunchKernelEx`` (*stream* ``None``: the default stream)."""
    c = drv.CUlaunchConfig()
    c.gridDimX, c.gridDimY, c.gridDimZ = grid
    c.blockDimX, c.blockDimY, c.blockDimZ = block
    c.sharedMemBytes = shared_mem
    if stream is not None:
        c.hStream = stream
    c.attrs = attrs
    c.numAttrs = len(attrs)
    return c


def _non_portable_hint(func: Any, size: int) -> str:
    """The fix for a cluster above the portable size, unless the kernel already allows it."""
    if size <= _PORTABLE_CLUSTER_MAX:
        return ""
    err, allowed = drv.cuFuncGetAttribute(
        function_attribute("non_portable_cluster_size_allowed"), func
    )
    if not err and allowed:
        return ""
    return (
        f"; {size} blocks is above the portable cluster size {_PORTABLE_CLUSTER_MAX}: allow "
        "it first with kernel.set_attribute('non_portable_cluster_size_allowed', 1) "
        "(Hopper takes up to 16)"
    )


def function_attribute(name: str | Any) -> Any:
    """The ``CUfunction_attribute`` member for a readable name (``"num_regs"``)."""
    return _driver.enum_member(
        drv.CUfunction_attribute, "CU_FUNC_ATTRIBUTE_", name, "kernel attribute"
    )


def launch_limits(ctx: Context, func: Any, reqntid: tuple[int, ...] | None) -> dict[str, int]:
    """The device's and the kernel's limits that :func:`explain_launch_config` reads."""
    out: dict[str, int] = {}
    dev = ctx.device
    names = {f"max_{k}_dim_{a}": f"max_{k}_dim_{a}" for k in ("block", "grid") for a in "xyz"}
    names["max_shared_optin"] = "max_shared_memory_per_block_optin"
    names["regs_per_block"] = "max_registers_per_block"
    for key, attr in names.items():
        with contextlib.suppress(Exception):
            out[key] = dev.attribute(attr)
    fattrs = {
        "max_threads_per_block": "max_threads_per_block",
        "max_dynamic_shared": "max_dynamic_shared_size_bytes",
        "static_shared": "shared_size_bytes",
        "num_regs": "num_regs",
    }
    for key, attr in fattrs.items():
        err, v = drv.cuFuncGetAttribute(function_attribute(attr), func)
        if not err:
            out[key] = int(v)
    if reqntid:
        out["reqntid"] = math.prod(reqntid)
    return out


#: What the message of a launch the driver refused with one of these codes adds.
_LAUNCH_HINTS = {
    _COOPERATIVE_TOO_LARGE: "a cooperative grid may hold at most occupancy x SM count blocks",
    _INVALID_CLUSTER_SIZE: (
        "the cluster does not fit this kernel (compile-time __cluster_dims__, more "
        "than 8 blocks without 'non_portable_cluster_size_allowed', or resources)"
    ),
}


class PreparedLaunch:
    """A launch with its arguments packed once; ``pl()`` launches it again.

    Made by :meth:`Kernel.prepare`. It belongs to one context; calling it from a thread
    where another context is current binds that context for the call. It keeps
    references to its arguments, so buffers stay alive as long as it does.

    Attributes
    ----------
    grid, block : tuple of 3 ints
    shared_mem : int
    config : LaunchConfig
        Its launch attributes (empty: a plain ``cuLaunchKernel``).
    context : Context
    """

    __slots__ = (
        "_args",
        "_buf",
        "_call",
        "_consumer",
        "_func",
        "_kernel",
        "_launch",
        "_module",
        "_stream",
        "block",
        "config",
        "context",
        "grid",
        "shared_mem",
    )

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
        cfg: LaunchConfig,
    ) -> None:
        self._kernel = kernel
        self._module = kernel.module
        self.context = ctx
        self.grid = normalize_dims(grid, "grid")
        self.block = normalize_dims(block, "block")
        self.shared_mem = shared_mem_arg(shared_mem, kernel.name)
        self.config = cfg
        self._func = func
        self._buf = kernel.packer.packed(args, ctx)
        self._args = list(args)
        self._consumer, self._stream, _ = call_stream(stream, ctx, "launch")
        dims = (self.grid, self.block, self.shared_mem)
        if cfg.empty:
            self._call: tuple[Any, ...] = (func, *dims[0], *dims[1], dims[2], self._stream)
        else:
            kernel._check_options(ctx, func, *dims, cfg)
            self._call = (native_config(*dims, self._stream, cfg.attributes()), func)
        self._call += (self._buf.address, 0)
        self._wire()

    def _wire(self) -> None:
        """The launch call: ordered after the producers of foreign arguments at each call,
        only if there are any."""
        raw = drv.cuLaunchKernel if self.config.empty else drv.cuLaunchKernelEx
        foreign = foreign_arrays(self._args)
        if not foreign:
            self._launch = raw
            return
        ctx, consumer = self.context, self._consumer
        hs = int(self._stream)

        def ordered_launch(*call: Any) -> Any:
            order_after_producers(foreign, hs, ctx, consumer)
            return raw(*call)

        self._launch = ordered_launch

    def __call__(self) -> None:
        """Launch (no argument packing; the context is checked in thread-local state)."""
        try:
            top = per_thread.s.top
        except AttributeError:  # this thread never used ctxkit: nothing is current
            top = None
        if top is not self.context or self._module.closed:
            self._module.check_open()
            with guard(self.context, f"PreparedLaunch of {self._kernel.name!r}"):
                return self()  # now current: the plain path
        (err,) = self._launch(*self._call)
        if err:
            dims = (self.grid, self.block, self.shared_mem, self.config)
            raise self._kernel._launch_error(int(err), self.context, self._func, *dims)

    def set_arg(self, key: int | str, value: Any) -> None:
        """Replace one argument (by index or PTX parameter name), checked like a launch."""
        packer = self._kernel.packer
        i = packer.index_of(key)
        packer.pack_one(self._buf, i, value, self.context)
        self._args[i] = value
        self._wire()

    @property
    def args(self) -> tuple[Any, ...]:
        """The current arguments."""
        return tuple(self._args)

    __reduce__ = lifetime.process_local("send its ObjectCode and ck.Module.load it there")

    def __repr__(self) -> str:
        options = f" {self.config.describe()}" if not self.config.empty else ""
        return (
            f"<PreparedLaunch {self._kernel.name} grid={self.grid} block={self.block}"
            f"{options} in {self.context!r}>"
        )


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
    signature : Signature or None
        The parsed parameter list (``None`` when neither PTX nor the driver told it).
    """

    __slots__ = (
        "__weakref__",
        "_address",
        "_fits",
        "_funcs",
        "_handle",
        "_last",
        "_packer",
        "_unknown_reason",
        "module",
        "name",
        "signature",
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
        self.signature = sig
        self._unknown_reason = unknown_reason
        self._packer = ArgPacker(sig, name) if sig is not None else None
        self._address = self._packer.address if self._packer is not None else None
        self._funcs: dict[int, tuple[Context, Any]] = {}
        self._last: tuple[Any, Any] = _NO_LAUNCH  # (context, CUfunction) of the last launch
        self._fits: dict[Any, Any] = {}  # occupancy limits of cooperative and cluster launches

    __reduce__ = lifetime.process_local("send its ObjectCode and ck.Module.load it there")

    def __repr__(self) -> str:
        return f"<Kernel {self.signature or self.name} from {self.module.name}>"

    # -- signature -------------------------------------------------------------------

    @property
    def params(self) -> tuple[Param, ...]:
        """The parameters: PTX type, size, alignment and offset of each."""
        return self.packer.sig.params

    @property
    def packer(self) -> ArgPacker:
        """What checks and packs this kernel's arguments (launches, prepared launches and
        graph kernel nodes share it).

        Raises
        ------
        LaunchArgumentError
            The parameter list is unknown (a cubin without PTX whose layout the driver
            did not report).
        """
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
        self.module.check_open()
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
        with self._function_here(f"{self.name}.function_handle", context) as (_, func):
            return func

    # -- per-context function ----------------------------------------------------------

    def _function(self, ctx: Context) -> Any:
        if (hit := self._funcs.get(ctx.handle)) is not None and hit[0] is ctx:
            return hit[1]
        return self._resolve(ctx)

    def _resolve(self, ctx: Context) -> Any:
        mod = self.module
        mod.check_open()
        ctx.check_usable()
        if mod.context is not None:
            if mod.context.handle != ctx.handle:
                raise _refusal(
                    f"kernel {self.name!r} comes from a module bound to {mod.context!r} "
                    f"(Module.load(..., context=...)), but the current context in thread "
                    f"{threading.current_thread().name!r} is {ctx!r}. Launch it inside "
                    f"`with ctxkit.bind(module.context):`, or load the module without context= "
                    "so one kernel runs in every context.",
                    _INVALID_HANDLE,
                )
            func = self._handle
        else:
            err, func = drv.cuKernelGetFunction(self._handle)
            if err:
                raise self._function_error(int(err), ctx, "cuKernelGetFunction")
        if err := load_function(func):
            raise self._function_error(err, ctx, "cuFuncLoad")
        self._funcs[ctx.handle] = (ctx, func)
        return func

    def forget_functions(self) -> None:
        """The module was closed: no launch may reuse a function of it."""
        self._last = _NO_LAUNCH
        self._funcs.clear()

    def _function_error(self, code: int, ctx: Context, call: str) -> CudaError:
        what = f"{call}({self.name!r}) in {ctx!r}"
        if code in JIT_CODES:
            return self.module.jit_error(code, what)
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
        with self._function_here(f"{self.name}.preload", context):
            pass

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
        try:
            ctx = per_thread.s.top
        except AttributeError:  # this thread never used ctxkit: nothing is current
            ctx = None
        last = self._last
        bound = None
        try:
            if last[0] is ctx:
                func = last[1]
            else:
                ctx, bound = self._launch_context(ctx, stream, args)
                func = self._function(ctx)
                self._last = (ctx, func)
            if type(grid) is int and 0 < grid <= DIM_MAX:
                gx, gy, gz = grid, 1, 1
            else:
                gx, gy, gz = normalize_dims(grid, "grid")
            if type(block) is int and 0 < block <= DIM_MAX:
                bx, by, bz = block, 1, 1
            else:
                bx, by, bz = normalize_dims(block, "block")
            if cooperative or cluster is not None or config is not None:
                cfg = config_for(config, cooperative, cluster)
                if not cfg.empty:  # cuLaunchKernelEx with its options checked, as prepared
                    dims = (gx, gy, gz), (bx, by, bz)
                    return PreparedLaunch(self, ctx, func, *dims, args, stream, shared_mem, cfg)()
            if type(stream) is Stream and stream.context is ctx and stream.handle is not None:
                hs = stream.handle
            elif stream is None and (cur := implicit_stream(ctx)) and cur.handle is not None:
                hs = cur.handle  # `with s:` open; a closed one is refused by the resolver
            else:
                _, hs, _ = call_stream(stream, ctx, "launch")
            addr = (self._address or self.packer.address)(args, ctx, hs, stream)
            try:
                (err,) = drv.cuLaunchKernel(func, gx, gy, gz, bx, by, bz, shared_mem, hs, addr, 0)
            except (OverflowError, TypeError) as exc:
                raise ValueError(
                    f"launch of {self.name!r}: bad shared_mem={shared_mem!r}: {exc}"
                ) from None
            if err:
                dims = (gx, gy, gz), (bx, by, bz)
                raise self._launch_error(int(err), ctx, func, *dims, shared_mem)
        finally:
            if bound is not None:
                bound.__exit__(None, None, None)

    def _launch_context(
        self, top: Context | None, stream: Any, args: tuple[Any, ...]
    ) -> tuple[Context, Context | None]:
        """The context of a launch, twice when it was bound for the launch: the one ctxkit
        made current; else (not in strict mode) a ctxkit stream's, entered here even over a
        context another library left current, since the caller chose that stream; in a
        thread with nothing current the module's or the first ctxkit buffer argument's."""
        if top is not None:
            return top, None
        if (sc := _chosen_stream_context(stream, top)) is not None:
            return sc.__enter__(), sc
        if not current_handle() and not registry.strict:
            for owner in (self.module, *args):
                ctx = getattr(owner, "context", None)
                if isinstance(ctx, Context):
                    return ctx.__enter__(), ctx
        self.module.check_open()
        return resolve_context(None, f"launching kernel {self.name!r}"), None

    def _check_options(
        self, ctx: Context, func: Any, grid: Dims, block: Dims, shared_mem: int, cfg: LaunchConfig
    ) -> None:
        """Refuse what the device or the kernel cannot run with the options *cfg*, with the
        occupancy numbers in the message (before the driver's bare error)."""
        if cfg.cooperative:
            self._check_cooperative(ctx, func, grid, block, shared_mem)
        if cfg.cluster is not None:
            self._check_cluster(ctx, func, grid, block, shared_mem, cfg.cluster)

    def _check_cooperative(
        self, ctx: Context, func: Any, grid: Dims, block: Dims, shared_mem: int
    ) -> None:
        """Refuse a cooperative grid the device cannot hold resident all at once.

        The limit is ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` x the SM count, cached
        per context, block size and shared memory. A block the kernel cannot run at all
        (occupancy 0) is left to the driver, whose error ctxkit explains.
        """
        threads = block[0] * block[1] * block[2]
        key = ("cooperative", ctx.handle, threads, shared_mem)
        if (limit := self._fits.get(key)) is None:
            dev = ctx.device
            if not dev.attribute("cooperative_launch"):
                raise _refusal(
                    f"launch of {self.name!r} with cooperative=True: device {dev.ordinal} "
                    f"({dev.name}) does not support cooperative launches "
                    "(CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH is 0)",
                    _NOT_SUPPORTED,
                )
            with ctx:
                err, per_sm = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    func, threads, shared_mem
                )
            if err:
                raise ctx.note_error(
                    int(err),
                    f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name!r}, {threads})",
                )
            limit = self._fits[key] = (int(per_sm), dev.multiprocessor_count)
        per_sm, sms = limit
        blocks = grid[0] * grid[1] * grid[2]
        if per_sm and blocks > per_sm * sms:
            raise _refusal(
                f"cooperative launch of {self.name!r}: grid {grid} has {blocks} blocks, but at "
                f"most {per_sm * sms} can be resident at once on device {ctx.device.ordinal}: "
                f"{per_sm} blocks of {threads} threads (shared_mem={shared_mem}) per SM "
                f"(cuOccupancyMaxActiveBlocksPerMultiprocessor) x {sms} SMs. Use a grid of at "
                f"most {per_sm * sms} blocks with a grid-stride loop, or smaller blocks",
                _COOPERATIVE_TOO_LARGE,
            )

    def _check_cluster(
        self, ctx: Context, func: Any, grid: Dims, block: Dims, shared_mem: int, cluster: Dims
    ) -> None:
        """Refuse a cluster shape the device or the kernel cannot take.

        Clusters need compute capability 9.0; the grid must be a multiple of the cluster;
        ``cuOccupancyMaxActiveClusters`` (cached per context, block, shared memory and
        cluster) must place at least one cluster.
        """
        dev = ctx.device
        what = f"launch of {self.name!r} with cluster={cluster}"
        major, minor = dev.compute_capability
        if major < 9:
            raise _refusal(
                f"{what}: thread-block clusters need compute capability 9.0 or newer; device "
                f"{dev.ordinal} ({dev.name}) is {major}.{minor}. Launch without cluster=",
                _NOT_SUPPORTED,
            )
        for axis, g, c in zip("xyz", grid, cluster):
            if g % c:
                raise _refusal(
                    f"{what}: the grid {grid} is not a whole number of clusters (grid.{axis} = "
                    f"{g} is not a multiple of {c}); round the grid up to "
                    f"{tuple(-(-gi // ci) * ci for gi, ci in zip(grid, cluster))}",
                    _INVALID_CLUSTER_SIZE,
                )
        key = ("cluster", ctx.handle, block, shared_mem, cluster)
        size = math.prod(cluster)
        if (fits := self._fits.get(key)) is None:
            cfg = native_config(grid, block, shared_mem, None, [_cluster_attribute(cluster)])
            with ctx:
                err, n = drv.cuOccupancyMaxActiveClusters(func, cfg)
                if err:
                    raise _driver.from_result(
                        int(err),
                        f"cuOccupancyMaxActiveClusters({self.name!r}, cluster={cluster})",
                        _non_portable_hint(func, size),
                    )
            fits = self._fits[key] = int(n)
        if fits == 0:
            threads = block[0] * block[1] * block[2]
            with ctx:
                hint = _non_portable_hint(func, size)
            raise _refusal(
                f"{what}: device {dev.ordinal} cannot place a single cluster of {size} blocks "
                f"x {threads} threads with shared_mem={shared_mem} "
                "(cuOccupancyMaxActiveClusters is 0): use a smaller cluster, smaller blocks or "
                f"less shared memory{hint}",
                _INVALID_CLUSTER_SIZE,
            )

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
        now (the given ctxkit stream's when ctxkit made none current; the module's for a
        bound module), and ``stream=None`` means the current stream now.
        Cooperative and cluster limits are checked here.
        """
        what, top = f"preparing a launch of {self.name!r}", thread_state().top
        with self._function_here(what, _chosen_stream_context(stream, top)) as (ctx, func):
            cfg = config_for(config, cooperative, cluster)
            return PreparedLaunch(self, ctx, func, grid, block, args, stream, shared_mem, cfg)

    def _launch_error(
        self,
        code: int,
        ctx: Context,
        func: Any,
        grid: Dims,
        block: Dims,
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
            return self.module.jit_error(code, what)
        detail = _LAUNCH_HINTS.get(code, "")
        if code in (_INVALID_VALUE, _OUT_OF_RESOURCES):
            reqntid = self.signature.reqntid if self.signature is not None else None
            limits = launch_limits(ctx, func, reqntid)
            reasons = explain_launch_config(grid, block, shared_mem, limits)
            detail = "\n".join(f"- {r}" for r in reasons)
        elif code in (_INVALID_HANDLE, _INVALID_CONTEXT):
            detail = (
                f"ctxkit launched in {ctx!r}; if other code pushed a different context "
                "without ctxkit knowing, the kernel handle does not belong to it"
            )
        return _driver.from_result(code, what, detail)

    # -- attributes and occupancy ------------------------------------------------------

    @contextmanager
    def _function_here(
        self, what: str, context: Context | None = None
    ) -> Iterator[tuple[Context, Any]]:
        """``(context, CUfunction)`` of a use of this kernel other than a launch, the
        function loaded, with the context current while the block runs: *context*, by
        default the current one (the module's own for a bound module)."""
        if context is None:
            self.module.check_open()
            bound = self.module.context
            context = resolve_context(None, what) if bound is None else guard(bound, what)
        with context:
            yield context, self._function(context)

    @property
    def attributes(self) -> dict[str, int]:
        """All ``CUfunction_attribute`` values in the current context, by readable name."""
        out = {}
        with self._function_here(f"{self.name}.attributes") as (_, func):
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
        with self._function_here(f"{self.name}.attribute({name!r})") as (_, func):
            return int(call(drv.cuFuncGetAttribute, function_attribute(name), func))

    def set_attribute(self, name: str | Any, value: int) -> None:
        """Set an attribute in the current context (e.g. ``"max_dynamic_shared_size_bytes"``)."""
        with self._function_here(f"{self.name}.set_attribute({name!r})") as (_, func):
            self._fits.clear()  # occupancy limits depend on the attributes
            call(
                drv.cuFuncSetAttribute,
                func,
                function_attribute(name),
                int(value),
                what=f"cuFuncSetAttribute({self.name!r}, {name}, {value})",
            )

    def max_block_size(self, shared_mem: int = 0, block_size_limit: int = 0) -> int:
        """Block size with the highest occupancy (``cuOccupancyMaxPotentialBlockSize``)."""
        with self._function_here(f"{self.name}.max_block_size") as (_, func):
            _grid, block = call(
                drv.cuOccupancyMaxPotentialBlockSize,
                func,
                None,
                int(shared_mem),
                int(block_size_limit),
            )
        return int(block)

    def occupancy(self, block_size: int, shared_mem: int = 0) -> int:
        """Resident blocks per SM at *block_size* (occupancy calculator)."""
        with self._function_here(f"{self.name}.occupancy") as (_, func):
            blocks = call(
                drv.cuOccupancyMaxActiveBlocksPerMultiprocessor,
                func,
                int(block_size),
                int(shared_mem),
            )
        return int(blocks)

    def launch_config(self, n: int, shared_mem: int = 0) -> tuple[int, int]:
        """``(grid, block)`` covering *n* threads with the occupancy-optimal block size."""
        block = self.max_block_size(shared_mem)
        return max(1, -(-int(n) // block)), block


def _chosen_stream_context(stream: Any, top: Context | None) -> Context | None:
    """The context of a ctxkit *stream* the caller chose, when ctxkit made no context
    current in this thread (*top* is None) and registry is not strict: a launch then runs
    in it, even over a context another library (torch, CuPy) left current."""
    sc = getattr(stream, "context", None)
    return sc if isinstance(sc, Context) and top is None and not registry.strict else None
