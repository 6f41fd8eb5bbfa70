"""Launch configuration: grid/block dimensions, the options that need ``cuLaunchKernelEx``
(cooperative grids, thread-block clusters, programmatic dependent launch, per-launch
priority), and the explanations of launches the driver refused.

:func:`normalize_dims` checks grid/block shapes. :class:`LaunchConfig` holds the launch
attributes (frozen and hashable, so their driver form is built once). Before a launch with
them, :func:`check_cooperative` and :func:`check_cluster` refuse what the device or kernel
cannot run, with the occupancy numbers in the message, instead of the driver's bare
``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`` or ``CUDA_ERROR_INVALID_CLUSTER_SIZE``. A
launch without them keeps ``cuLaunchKernel``. :func:`explain_launch_config` says why a
grid/block/shared-memory setting exceeds the device's or kernel's limits.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _driver
from .._driver import drv
from ..errors import CudaError
from .pointers import short_repr

if TYPE_CHECKING:
    from ..context import Context

__all__ = [
    "LaunchConfig",
    "check_cluster",
    "check_cooperative",
    "config_for",
    "explain_launch_config",
    "failure_detail",
    "function_attribute",
    "native_config",
    "normalize_dims",
    "shared_mem_arg",
]


_NOT_SUPPORTED = 801


_COOPERATIVE_TOO_LARGE = 720


_INVALID_CLUSTER_SIZE = 912


_PORTABLE_CLUSTER_MAX = 8


Dims = tuple[int, int, int]


#: the legacy default stream, prebuilt: the bindings convert it as cheaply as ``None``
LEGACY_STREAM: Any = drv.CUstream(0) if drv is not None else None


DIM_MAX = (1 << 32) - 1


def normalize_dims(value: Any, what: str) -> tuple[int, int, int]:
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
    while len(dims) < 3:
        dims.append(1)
    return dims[0], dims[1], dims[2]


def explain_launch_config(
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_mem: int,
    limits: dict[str, int],
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
    mtpb = limits.get("max_threads_per_block")
    if mtpb is not None and threads > mtpb:
        why = f"block {block} has {threads} threads, more than this kernel's limit of {mtpb}"
        regs = limits.get("num_regs")
        if regs and limits.get("regs_per_block"):
            why += (
                f" (it uses {regs} registers per thread; the SM has "
                f"{limits['regs_per_block']} per block)"
            )
        out.append(why + f"; use a block of at most {mtpb} threads")
    req = limits.get("reqntid")
    if req is not None and threads != req:
        out.append(f"the kernel requires exactly {req} threads per block (.reqntid)")
    for axis, n, key in zip(
        "xyz", block, ("max_block_dim_x", "max_block_dim_y", "max_block_dim_z")
    ):
        lim = limits.get(key)
        if lim is not None and n > lim:
            out.append(f"block.{axis} = {n} exceeds the device maximum {lim}")
    for axis, n in zip("xyz", grid):
        lim = limits.get(f"max_grid_dim_{axis}")
        if lim is not None and n > lim:
            out.append(f"grid.{axis} = {n} exceeds the device maximum {lim}")
    dyn = limits.get("max_dynamic_shared")
    if dyn is not None and shared_mem > dyn:
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
        parts = []
        if self.cooperative:
            parts.append("cooperative=True")
        if self.cluster is not None:
            parts.append(f"cluster={self.cluster}")
        if self.programmatic_stream_serialization:
            parts.append("programmatic_stream_serialization=True")
        if self.priority is not None:
            parts.append(f"priority={self.priority}")
        return ", ".join(parts)

    def attributes(self) -> list[Any]:
        """The ``CUlaunchAttribute`` list (built once per distinct config)."""
        hit = _attributes.get(self)
        if hit is None:
            hit = _attributes[self] = _build_attributes(self)
        return hit


_PLAIN = LaunchConfig()


_attributes: dict[LaunchConfig, list[Any]] = {}


_from_keywords: dict[tuple[bool, Any], LaunchConfig] = {}


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
    key: tuple[bool, Any] | None
    try:
        key = (cooperative, cluster) if type(cooperative) is bool else None
        hit = _from_keywords.get(key) if key is not None else None
    except TypeError:  # an unhashable cluster, e.g. a list
        key = hit = None
    if hit is None:
        hit = LaunchConfig(cooperative=cooperative, cluster=cluster)
        if key is not None and len(_from_keywords) < 256:
            _from_keywords[key] = hit
    return hit


def _attribute_id(name: str) -> Any:
    member = getattr(drv.CUlaunchAttributeID, f"CU_LAUNCH_ATTRIBUTE_{name}", None)
    if member is None:
        raise CudaError(
            f"cuda-bindings {_driver.BINDINGS_VERSION} has no CU_LAUNCH_ATTRIBUTE_{name}; "
            "install cuda-bindings 12.8 or newer",
            _NOT_SUPPORTED,
            "CUDA_ERROR_NOT_SUPPORTED",
        )
    return member


def _attribute(name: str) -> Any:
    attr = drv.CUlaunchAttribute()
    attr.id = _attribute_id(name)
    return attr


def _build_attributes(cfg: LaunchConfig) -> list[Any]:
    out = []
    if cfg.cooperative:
        a = _attribute("COOPERATIVE")
        a.value.cooperative = 1
        out.append(a)
    if cfg.cluster is not None:
        out.append(_cluster_attribute(cfg.cluster))
    if cfg.programmatic_stream_serialization:
        a = _attribute("PROGRAMMATIC_STREAM_SERIALIZATION")
        a.value.programmaticStreamSerializationAllowed = 1
        out.append(a)
    if cfg.priority is not None:
        a = _attribute("PRIORITY")
        a.value.priority = cfg.priority
        out.append(a)
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


def _refusal(message: str, code: int, name: str) -> CudaError:
    return CudaError(message, code, name)


def check_cooperative(
    kernel: str,
    cache: dict[Any, Any],
    ctx: Context,
    func: Any,
    grid: Dims,
    block: Dims,
    shared_mem: int,
) -> None:
    """Refuse a cooperative grid the device cannot hold resident all at once.

    The limit is ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` x the SM count, cached
    in *cache* per context, block size and shared memory. A block the kernel cannot run
    at all (occupancy 0) is left to the driver, whose error ctxkit explains.
    """
    threads = block[0] * block[1] * block[2]
    key = ("cooperative", ctx.handle, threads, shared_mem)
    limit = cache.get(key)
    if limit is None:
        dev = ctx.device
        if not dev.attribute("cooperative_launch"):
            raise _refusal(
                f"launch of {kernel!r} with cooperative=True: device {dev.ordinal} "
                f"({dev.name}) does not support cooperative launches "
                "(CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH is 0)",
                _NOT_SUPPORTED,
                "CUDA_ERROR_NOT_SUPPORTED",
            )
        with ctx:
            err, per_sm = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, threads, shared_mem)
        if err:
            raise ctx.note_error(
                int(err), f"cuOccupancyMaxActiveBlocksPerMultiprocessor({kernel!r}, {threads})"
            )
        limit = cache[key] = (int(per_sm), dev.multiprocessor_count)
    per_sm, sms = limit
    blocks = grid[0] * grid[1] * grid[2]
    if per_sm and blocks > per_sm * sms:
        raise _refusal(
            f"cooperative launch of {kernel!r}: grid {grid} has {blocks} blocks, but at most "
            f"{per_sm * sms} can be resident at once on device {ctx.device.ordinal}: "
            f"{per_sm} blocks of {threads} threads (shared_mem={shared_mem}) per SM "
            f"(cuOccupancyMaxActiveBlocksPerMultiprocessor) x {sms} SMs. Use a grid of at "
            f"most {per_sm * sms} blocks with a grid-stride loop, or smaller blocks",
            _COOPERATIVE_TOO_LARGE,
            "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        )


def check_cluster(
    kernel: str,
    cache: dict[Any, Any],
    ctx: Context,
    func: Any,
    grid: Dims,
    block: Dims,
    shared_mem: int,
    cluster: Dims,
) -> None:
    """Refuse a cluster shape the device or the kernel cannot take.

    Clusters need compute capability 9.0; the grid must be a multiple of the cluster;
    ``cuOccupancyMaxActiveClusters`` (cached per context, block, shared memory and
    cluster) must place at least one cluster.
    """
    dev = ctx.device
    what = f"launch of {kernel!r} with cluster={cluster}"
    major, minor = dev.compute_capability
    if major < 9:
        raise _refusal(
            f"{what}: thread-block clusters need compute capability 9.0 or newer; device "
            f"{dev.ordinal} ({dev.name}) is {major}.{minor}. Launch without cluster=",
            _NOT_SUPPORTED,
            "CUDA_ERROR_NOT_SUPPORTED",
        )
    for axis, g, c in zip("xyz", grid, cluster):
        if g % c:
            raise _refusal(
                f"{what}: the grid {grid} is not a whole number of clusters (grid.{axis} = "
                f"{g} is not a multiple of {c}); round the grid up to "
                f"{tuple(-(-gi // ci) * ci for gi, ci in zip(grid, cluster))}",
                _INVALID_CLUSTER_SIZE,
                "CUDA_ERROR_INVALID_CLUSTER_SIZE",
            )
    key = ("cluster", ctx.handle, block, shared_mem, cluster)
    fits = cache.get(key)
    size = math.prod(cluster)
    if fits is None:
        cfg = native_config(grid, block, shared_mem, None, [_cluster_attribute(cluster)])
        with ctx:
            err, n = drv.cuOccupancyMaxActiveClusters(func, cfg)
            if err:
                raise _driver.from_result(
                    int(err),
                    f"cuOccupancyMaxActiveClusters({kernel!r}, cluster={cluster})",
                    _non_portable_hint(func, size),
                )
        fits = cache[key] = int(n)
    if fits == 0:
        threads = block[0] * block[1] * block[2]
        with ctx:
            hint = _non_portable_hint(func, size)
        raise _refusal(
            f"{what}: device {dev.ordinal} cannot place a single cluster of {size} blocks "
            f"x {threads} threads with shared_mem={shared_mem} (cuOccupancyMaxActiveClusters "
            f"is 0): use a smaller cluster, smaller blocks or less shared memory{hint}",
            _INVALID_CLUSTER_SIZE,
            "CUDA_ERROR_INVALID_CLUSTER_SIZE",
        )


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


_INVALID_VALUE = 1


_OUT_OF_RESOURCES = 701


_INVALID_HANDLE = 400


_INVALID_CONTEXT = 201


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
        err, v = drv.cuFuncGetAttribute(function_attribute(attr), func)
        if not err:
            out[key] = int(v)
    if reqntid:
        out["reqntid"] = math.prod(reqntid)
    return out


def failure_detail(
    code: int,
    ctx: Context,
    func: Any,
    grid: Dims,
    block: Dims,
    shared_mem: int,
    reqntid: tuple[int, ...] | None,
) -> str:
    """What to add to the message of a launch the driver refused with *code*."""
    if code in (_INVALID_VALUE, _OUT_OF_RESOURCES):
        limits = launch_limits(ctx, func, reqntid)
        return "\n".join(f"- {r}" for r in explain_launch_config(grid, block, shared_mem, limits))
    if code in (_INVALID_HANDLE, _INVALID_CONTEXT):
        return (
            f"ctxkit launched in {ctx!r}; if other code pushed a different context "
            "without ctxkit knowing, the kernel handle does not belong to it"
        )
    if code == _COOPERATIVE_TOO_LARGE:
        return "a cooperative grid may hold at most occupancy x SM count blocks"
    if code == _INVALID_CLUSTER_SIZE:
        return (
            "the cluster does not fit this kernel (compile-time __cluster_dims__, more "
            "than 8 blocks without 'non_portable_cluster_size_allowed', or resources)"
        )
    return ""
