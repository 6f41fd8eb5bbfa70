"""The one door to ``cuda.bindings.driver``.

Responsibilities:

* import the bindings (absent bindings or driver -> :class:`DriverNotFoundError`);
* ``cuInit`` exactly once per process, lazily and thread-safely;
* turn a non-success ``CUresult`` into the right ctxkit exception;
* hide the differences between cuda-bindings 12.x and 13.x;
* refuse CUDA in a child forked after its parent initialised it (:class:`ForkError`).

Hot paths elsewhere call ``drv.cuXxx`` directly and pass a non-zero status to
:func:`raise_for`; everything else goes through :func:`call`.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import errors
from .errors import CudaError, DriverNotFoundError, ForkError

try:  # pragma: no branch - exercised by both CI (present) and users without bindings
    import cuda.bindings as _bindings_pkg
    from cuda.bindings import driver as _drv_module

    _IMPORT_ERROR: BaseException | None = None
except Exception as exc:  # pragma: no cover - depends on the installation
    _bindings_pkg = None  # type: ignore[assignment]
    _drv_module = None  # type: ignore[assignment]
    _IMPORT_ERROR = exc

#: The ``cuda.bindings.driver`` module (``None`` when cuda-bindings is not installed).
drv: Any = _drv_module


def parse_version(text: str) -> tuple[int, int]:
    """Return ``(major, minor)`` from a version string such as ``"13.3.0"``."""
    nums = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in text.split(".")[:2]]
    nums += [0] * (2 - len(nums))
    return nums[0], nums[1]


BINDINGS_VERSION: tuple[int, int] = (
    parse_version(getattr(_bindings_pkg, "__version__", "0.0")) if _bindings_pkg else (0, 0)
)

_init_lock = threading.Lock()
_init_pid: int | None = None
_parent_initialized_pid: int | None = None
_no_device = False


_renewed_at_fork: list[tuple[Any, str, Callable[[], Any]]] = []
_hooks_in_child: list[Callable[[], None]] = []


def renew_at_fork(owner: Any, name: str, factory: Callable[[], Any] = threading.Lock) -> None:
    """Give ``owner.name`` a new lock (``factory()``) in every forked child.

    For module- and class-level locks (*owner*: the class, or the module's ``__name__``)
    and those of process-wide objects (a dotted *name*, ``"_process_pool._lock"``; skipped
    while the object is ``None``): a thread of the parent may hold one at fork time, and
    it does not exist in the child to release it.
    """
    _renewed_at_fork.append((owner, name, factory))


def on_fork_in_child(fn: Callable[[], None]) -> None:
    """Run *fn* in every forked child, after the fork flag and the locks are renewed."""
    _hooks_in_child.append(fn)


def _mark_forked_child() -> None:
    global _init_pid, _parent_initialized_pid, _init_lock
    if _init_pid is not None or _init_lock.locked():  # initialised, or cuInit under way
        _parent_initialized_pid = _init_pid or os.getppid()
    _init_pid = None
    _init_lock = threading.Lock()
    for owner, name, factory in _renewed_at_fork:  # the locks of renew_at_fork
        obj = sys.modules[owner] if isinstance(owner, str) else owner
        *path, attr = name.split(".")
        for part in path:
            obj = getattr(obj, part, None)
        if obj is not None:
            setattr(obj, attr, factory())
    for fn in _hooks_in_child:
        fn()


os.register_at_fork(after_in_child=_mark_forked_child)


def bindings_available() -> bool:
    """True when cuda-bindings imported (says nothing about a driver)."""
    return drv is not None


def bindings_import_error() -> BaseException | None:
    """Why cuda-bindings failed to import (``None`` when it imported)."""
    return _IMPORT_ERROR


def _fork_error(what: str = "") -> ForkError:
    parent = _parent_initialized_pid
    return ForkError(
        f"{what + ': ' if what else ''}CUDA was initialised in parent process {parent} "
        f"and this process ({os.getpid()}) was forked from it; CUDA cannot be used in "
        "a forked child. Use the 'spawn' start method "
        "(multiprocessing.get_context('spawn') or ctxkit.procs.run_per_device)",
        errors.CUDA_ERROR_NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED",
    )


def in_forked_child() -> bool:
    """True in a process forked after its parent initialised CUDA."""
    return _parent_initialized_pid is not None and _init_pid is None


def check_fork(what: str) -> None:
    """Raise :class:`ForkError` naming *what* in a process forked after its parent
    initialised CUDA: entry points call it before they take a lock of an object the
    child inherited (a parent thread may hold it, and never releases it here)."""
    if in_forked_child():
        raise _fork_error(what)


def init() -> None:
    """Call ``cuInit(0)`` once for this process (cheap after the first call).

    Raises
    ------
    DriverNotFoundError
        cuda-bindings or the driver library is missing, or the driver reports no device.
    ForkError
        This process was forked after its parent initialised CUDA.
    """
    global _init_pid, _no_device
    if _init_pid is not None:
        return
    if _no_device:
        raise _no_device_error()
    if drv is None:
        raise DriverNotFoundError(
            "cuda-bindings is not installed or failed to import "
            f'({_IMPORT_ERROR!r}); install it with `pip install -e ".[cu13]"` in a ctxkit '
            'checkout (".[cu12]" for a CUDA 12 driver), or `pip install "ctxkit-cuda[cu13]"` '
            "from the package index"
        )
    with _init_lock:
        if _init_pid is not None:
            return
        if in_forked_child():
            raise _fork_error()
        try:
            (err,) = drv.cuInit(0)
        except Exception as exc:  # libcuda missing: pathfinder/RuntimeError
            raise DriverNotFoundError(
                "no NVIDIA driver found (libcuda.so.1 could not be loaded: "
                f"{exc}); this machine has no usable GPU driver"
            ) from None
        if err == errors.CUDA_ERROR_NO_DEVICE:
            _no_device = True
            raise _no_device_error()
        if err:
            raise from_result(int(err), "cuInit(0)")
        _init_pid = os.getpid()


def _no_device_error() -> DriverNotFoundError:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible!r} hides them)" if visible is not None else ""
    return DriverNotFoundError(
        f"the NVIDIA driver loaded but reports no CUDA device{hint}; check nvidia-smi "
        "and CUDA_VISIBLE_DEVICES",
        errors.CUDA_ERROR_NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE",
    )


def initialized() -> bool:
    """True once ``cuInit`` has succeeded in this process."""
    return _init_pid is not None


def describe(code: int) -> tuple[str, str]:
    """``(name, explanation)`` of a ``CUresult`` code.

    The name comes from cuda-bindings' enum; the explanation from ``cuGetErrorString``
    once the driver is initialised (before that, and without a driver, it is empty).
    """
    try:
        name = drv.CUresult(code).name  # no bindings (drv None) or an unknown code: raises
    except Exception:
        return f"CUresult {code}", ""
    text = ""
    if _init_pid is not None:
        with contextlib.suppress(Exception):
            err, s = drv.cuGetErrorString(drv.CUresult(code))
            if not err and s:
                text = s.decode() if isinstance(s, bytes) else str(s)
    return name, text


def from_result(code: int, what: str = "", detail: str = "") -> CudaError:
    """Exception for a failed driver call, with fork detection."""
    if code == errors.CUDA_ERROR_NOT_INITIALIZED and _parent_initialized_pid is not None:
        return _fork_error(what)
    name, text = describe(code)
    return errors.from_result(code, what, detail, name=name, text=text)


def raise_for(err: Any, what: str = "", detail: str = "") -> None:
    """Raise the ctxkit exception for a non-zero status *err* (no-op on success)."""
    if err:
        raise from_result(int(err), what, detail)


def call(fn: Callable[..., Any], *args: Any, what: str = "") -> Any:
    """Call a ``cuda.bindings.driver`` function and check its status.

    Returns ``None``, the single result, or a tuple of results, after the status.
    """
    res = fn(*args)
    err = res[0]
    if err:
        raise from_result(int(err), what or getattr(fn, "__name__", "CUDA call"))
    if len(res) == 1:
        return None
    if len(res) == 2:
        return res[1]
    return res[1:]


def enum_member(enum: Any, prefix: str, name: str | Any, what: str) -> Any:
    """Resolve a readable name (``"max_threads_per_block"``, any case, prefix optional) to
    the member ``prefix + NAME`` of a cuda-bindings enum; members pass through.

    Raises ``ValueError`` naming *what* and the closest known names.
    """
    if not isinstance(name, str):
        return name
    key = name.upper().removeprefix(prefix)
    try:
        return getattr(enum, prefix + key)
    except AttributeError:
        members = [m.removeprefix(prefix) for m in dir(enum) if m.startswith(prefix)]
        known = sorted(m.lower() for m in members if m != "MAX")
        short = key.lower()
        close = difflib.get_close_matches(short, known, n=5, cutoff=0.5)
        close += [k for k in known if short in k and k not in close]
        hint = f"did you mean one of {close[:5]}?" if close else f"known: {known}"
        raise ValueError(f"unknown {what} {name!r}; {hint}") from None


def driver_version() -> tuple[int, int] | None:
    """The driver's CUDA version as ``(major, minor)``, or ``None`` without a driver."""
    try:
        err, v = drv.cuDriverGetVersion()  # no bindings (drv None) or no driver: raises
    except Exception:
        return None
    return None if err else (v // 1000, (v % 1000) // 10)


# --- cuda-bindings 12.x / 13.x differences -------------------------------------------


def ctx_create(flags: int, dev: Any) -> Any:
    """Create an owned context (it becomes current; the caller pops it).

    13.x exposes the v4 form ``cuCtxCreate(params, flags, dev)``; 12.x has the classic
    ``cuCtxCreate(flags, dev)`` (the v4 form is ``cuCtxCreate_v4`` there).
    """
    args = (None, flags, dev) if BINDINGS_VERSION[0] >= 13 else (flags, dev)
    return call(drv.cuCtxCreate, *args, what=f"cuCtxCreate(flags={flags}, device={int(dev)})")


CPU_DEVICE_ID = -1  # CU_DEVICE_CPU in the 12.x device-ordinal forms


def context_id(cu: Any) -> int | None:
    """``cuCtxGetId``: the driver's id of context *cu*, unique in the process (None where
    the driver or the bindings lack it)."""
    fn = getattr(drv, "cuCtxGetId", None)
    if fn is None:
        return None
    err, ident = fn(cu)
    return None if err else int(ident)


@contextlib.contextmanager
def live_primary(dev: Any, ident: int | None) -> Iterator[Any]:
    """Device *dev*'s primary context retained for the block when it is the one with
    driver id *ident* (others kept it alive since ctxkit released it), else None: one
    that was reset, destroyed or made anew since holds none of the old one's resources."""
    err, _flags, active = drv.cuDevicePrimaryCtxGetState(dev)
    if err or not active or ident is None:
        yield None
        return
    err, cu = drv.cuDevicePrimaryCtxRetain(dev)
    if err:
        yield None
        return
    try:
        yield cu if context_id(cu) == ident else None
    finally:
        drv.cuDevicePrimaryCtxRelease(dev)


def uses_mem_location(bindings_major: int) -> bool:
    """True when prefetch/advise take a ``CUmemLocation`` (13.x) rather than an ordinal."""
    return bindings_major >= 13


def _location(target: int | str) -> Any:
    """A device ordinal or ``"cpu"`` (the host) in the form prefetch/advise take on this
    bindings major: a ``CUmemLocation`` (13.x) or an ordinal (12.x)."""
    host = isinstance(target, str)
    if not uses_mem_location(BINDINGS_VERSION[0]):
        return CPU_DEVICE_ID if host else int(target)
    kinds = drv.CUmemLocationType
    loc = drv.CUmemLocation()
    loc.type = kinds.CU_MEM_LOCATION_TYPE_HOST if host else kinds.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = 0 if host else int(target)
    return loc


def mem_prefetch(ptr: int, nbytes: int, target: int | str, stream: Any) -> None:
    """``cuMemPrefetchAsync`` to a device ordinal or ``"cpu"``, on either bindings major."""
    flags = (0,) if uses_mem_location(BINDINGS_VERSION[0]) else ()
    call(drv.cuMemPrefetchAsync, ptr, nbytes, _location(target), *flags, stream)


def mem_advise(ptr: int, nbytes: int, advice: Any, target: int | str) -> None:
    """``cuMemAdvise`` for a device ordinal or ``"cpu"``, on either bindings major."""
    call(drv.cuMemAdvise, ptr, nbytes, advice, _location(target))


POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (cuda.h)

#: libcuda's own ``cuPointerGetAttribute`` through ctypes: None until first use, False
#: where libcuda cannot be loaded this way (the bindings are used then)
_raw_pointer_get_attribute: Any = None


_LIBCUDA = "nvcuda.dll" if os.name == "nt" else "libcuda.so.1"


def _load_raw_pointer_get_attribute() -> Any:
    try:
        fn = ctypes.CDLL(_LIBCUDA).cuPointerGetAttribute
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def pointer_device_ordinal(ptr: int) -> tuple[int, int]:
    """``(CUresult, ordinal)``: the device that memory at *ptr* was allocated on.

    Read from libcuda directly: cuda-bindings releases that store this attribute in a
    signed slot but read it back from an unsigned one (13.3 among them,
    NVIDIA/cuda-python#2928) report device 0 for every pointer.
    """
    global _raw_pointer_get_attribute
    fn = _raw_pointer_get_attribute
    if fn is None:
        fn = _raw_pointer_get_attribute = _load_raw_pointer_get_attribute()
    if fn is False:
        attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        err, value = drv.cuPointerGetAttribute(attr, ptr)
        return int(err), int(value or 0)
    out = ctypes.c_int(-1)
    err = fn(ctypes.pointer(out), POINTER_ATTRIBUTE_DEVICE_ORDINAL, int(ptr))
    return int(err), int(out.value)


class _UpdateResultInfo(ctypes.Structure):
    """``CUgraphExecUpdateResultInfo``: why ``cuGraphExecUpdate`` refused, and where."""

    _fields_ = [
        ("result", ctypes.c_int),
        ("errorNode", ctypes.c_void_p),
        ("errorFromNode", ctypes.c_void_p),
    ]


def graph_exec_update_info(exe: Any, graph: Any) -> tuple[int, int, int] | None:
    """``(CUresult, CUgraphExecUpdateResult, error node address)`` of
    ``cuGraphExecUpdate(exe, graph)`` called through libcuda directly, or ``None`` where
    libcuda cannot be reached that way. Call it with the context bound.

    cuda-bindings returns no ``CUgraphExecUpdateResultInfo`` when the update fails, which
    is the one case it is needed for; asking again is safe (a refused update changes
    nothing).
    """
    try:
        fn = ctypes.CDLL(_LIBCUDA).cuGraphExecUpdate_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_UpdateResultInfo)]
    fn.restype = ctypes.c_int
    info = _UpdateResultInfo()
    err = fn(int(exe), int(graph), ctypes.byref(info))
    return int(err), int(info.result), int(info.errorNode or 0)


# --- green contexts (SM partitions) ---------------------------------------------------

#: The driver that introduced green contexts (``cuGreenCtxCreate``).
GREEN_MIN_DRIVER = (12, 4)  # the message of require_green names it


def require_green(what: str) -> None:
    """Raise :class:`CudaError` (``CUDA_ERROR_NOT_SUPPORTED``) naming the minimum versions
    where the bindings or the driver have no green contexts."""
    have = driver_version()
    if drv is not None and hasattr(drv, "cuGreenCtxCreate") and have and have >= GREEN_MIN_DRIVER:
        return
    raise CudaError(
        f"{what}: green contexts need a driver of CUDA 12.4+ and cuda-bindings 12.8+ (this "
        f"process has driver CUDA {have} and cuda-bindings "
        f"{BINDINGS_VERSION}); update the NVIDIA driver",
        801,
        "CUDA_ERROR_NOT_SUPPORTED",
    )


def sm_resource(dev: Any) -> Any:
    """The ``CUdevResource`` of all SMs of the device *dev* (``cuDeviceGetDevResource``)."""
    kind = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    return call(drv.cuDeviceGetDevResource, dev, kind, what="cuDeviceGetDevResource(SM)")


def _split_equal(res: Any, n: int, count: int) -> tuple[list[Any], Any]:
    what = f"cuDevSmResourceSplitByCount({n} groups of {count} SMs)"
    groups, made, rest = call(drv.cuDevSmResourceSplitByCount, n, res, 0, count, what=what)
    return list(groups)[: int(made)], rest


def sm_split(dev: Any, res: Any, counts: list[int]) -> tuple[list[Any], Any, list[Any]]:
    """Split the SM resource *res* of *dev* into groups of *counts* SMs (valid counts).

    Returns ``(groups, remainder, scratch)``: *scratch* are green contexts made to split a
    remainder again (``cuDevSmResourceSplitByCount`` splits into equal groups only, and
    its outputs split again only through a green context); destroy them once the groups'
    contexts exist. ``cuDevSmResourceSplit`` (CUDA 13.1+ drivers) does it in one call.
    """
    if hasattr(drv, "cuDevSmResourceSplit") and (driver_version() or (0, 0)) >= (13, 1):
        params = []
        for n in counts:
            p = drv.CU_DEV_SM_RESOURCE_GROUP_PARAMS()
            p.smCount = n
            params.append(p)
        what = f"cuDevSmResourceSplit({counts})"
        groups, rest = call(drv.cuDevSmResourceSplit, len(counts), res, 0, params, what=what)
        return list(groups), rest, []
    by_count: dict[int, list[Any]] = {}
    scratch: list[Any] = []
    for count in dict.fromkeys(counts):  # each distinct size once, in the order asked
        if by_count:  # split what is left: through a green context made of it
            green = green_create(dev, res)
            scratch.append(green)
            kind = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
            res = call(drv.cuGreenCtxGetDevResource, green, kind, what="cuGreenCtxGetDevResource")
        by_count[count], res = _split_equal(res, counts.count(count), count)
    groups = [by_count[c].pop(0) for c in counts if by_count[c]]
    return groups, res, scratch


def green_create(dev: Any, res: Any) -> Any:
    """A green context (``CUgreenCtx``) over the SM resource *res* of *dev*."""
    desc = call(drv.cuDevResourceGenerateDesc, [res], 1, what="cuDevResourceGenerateDesc")
    flags = int(drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
    return call(drv.cuGreenCtxCreate, desc, dev, flags, what="cuGreenCtxCreate")
