"""Page-locked host allocations: :func:`pinned_empty` and :func:`pinned_zeros`
(``cuMemHostAlloc``) and :class:`HostMemory`, the numpy-visible owner of such memory.

Also the ``CU_MEMHOST*`` flag bits, which ``cuMemHostAlloc`` and ``cuMemHostRegister``
share, and :func:`host_context`, the context a host allocation is made in (used by
:func:`~ctxkit.memory.host.register_host` and the pinned pool too).

Re-exported by :mod:`ctxkit.memory.host` and :mod:`ctxkit.memory`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._driver import drv
from ..binding import bind, resolve_context
from ..context import Context, current_context, thread_state
from ..errors import OutOfMemoryError
from ..lifetime import finalizer
from .hostptr import plain_dtype
from .sizes import shape_nbytes

__all__ = ["HostMemory", "pinned_empty", "pinned_zeros"]


MEMHOST_PORTABLE = 1  # CU_MEMHOSTALLOC_PORTABLE (= CU_MEMHOSTREGISTER_PORTABLE)


MEMHOST_DEVICEMAP = 2  # CU_MEMHOSTALLOC_DEVICEMAP (= CU_MEMHOSTREGISTER_DEVICEMAP)


MEMHOST_WRITECOMBINED = 4  # CU_MEMHOSTALLOC_WRITECOMBINED


MEMHOST_REGISTER_READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY


_OUT_OF_MEMORY = 2


class HostMemory:
    """Host-addressable memory exposed to numpy (``np.asarray(mem)`` is a uint8 view).

    The numpy arrays built on it keep it (and its *owner*) alive through their ``.base``
    chain; pinned allocations are freed when the last array dies.
    """

    __slots__ = ("__weakref__", "_fin", "context", "nbytes", "owner", "ptr")

    def __init__(self, ptr: int, nbytes: int, owner: Any = None, context: Any = None):
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.owner = owner
        self.context = context
        self._fin: Any = None

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
        }

    def __repr__(self) -> str:
        return f"<HostMemory {self.ptr:#x} nbytes={self.nbytes}>"


def host_context(context: Any, what: str) -> Context:
    """The context for a host allocation: the one given, the current one, or device 0's."""
    if context is not None:
        return resolve_context(context, what)
    ctx = thread_state().top or current_context()
    if ctx is None:
        ctx = bind(0)
    ctx.check_usable()
    return ctx


def pinned_empty(
    shape: Any,
    dtype: Any = np.float64,
    *,
    context: Any = None,
    mapped: bool = False,
    write_combined: bool = False,
    portable: bool = True,
) -> np.ndarray:
    """A numpy array in page-locked host memory (``cuMemHostAlloc``).

    Copies from/to it are truly asynchronous and run at full bus speed. The memory is
    freed (``cuMemFreeHost``, inside the allocating context, from any thread) when the
    array and every view of it are gone.

    Parameters
    ----------
    shape : int or tuple of int
    dtype : numpy dtype
    context : Context, Device or int, optional
        The context to allocate in. Default: the calling thread's current context, or,
        when the thread has none, the registry's context of device 0.
    mapped : bool
        ``CU_MEMHOSTALLOC_DEVICEMAP``: map it into the device address space, so kernels
        read and write it in place (zero-copy); the address is
        :func:`~ctxkit.memory.hostaccess.device_pointer`.
    write_combined : bool
        ``CU_MEMHOSTALLOC_WRITECOMBINED``: not cached by the CPU, so transfers to the
        device can be faster, but CPU *reads* from it are very slow: for buffers the host
        only writes.
    portable : bool
        ``CU_MEMHOSTALLOC_PORTABLE`` (default): pinned for every context, not only the
        allocating one.

    Raises
    ------
    OutOfMemoryError
        The OS refused to page-lock that much memory.

    Notes
    -----
    A zero-size request returns an ordinary empty numpy array.
    """
    dt = plain_dtype(dtype, "pinned_empty")
    shp, nbytes = shape_nbytes(shape, dt, "pinned_empty")
    flags = _bits(portable=portable, mapped=mapped, write_combined=write_combined)
    if nbytes == 0:
        return np.empty(shp, dt)
    ctx = host_context(context, "pinned_empty")
    with ctx:
        err, ptr = drv.cuMemHostAlloc(nbytes, flags)
    if err:
        raise _host_alloc_error(ctx, err, nbytes, flags)
    mem = HostMemory(ptr, nbytes, context=ctx)
    mem._fin = finalizer(mem, ctx, drv.cuMemFreeHost, ptr)
    return np.asarray(mem).view(dt).reshape(shp)


def _bits(**flags: bool) -> int:
    """``CU_MEMHOST*`` bits of boolean options (refusing non-bools, e.g. a stray int)."""
    bits = {
        "portable": MEMHOST_PORTABLE,
        "mapped": MEMHOST_DEVICEMAP,
        "write_combined": MEMHOST_WRITECOMBINED,
        "read_only": MEMHOST_REGISTER_READ_ONLY,
    }
    out = 0
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {value!r}")
        out |= bits[name] if value else 0
    return out


def _flag_names(flags: int, register: bool = False) -> str:
    names = [
        (MEMHOST_PORTABLE, "PORTABLE"),
        (MEMHOST_DEVICEMAP, "DEVICEMAP"),
        (
            MEMHOST_REGISTER_READ_ONLY if register else MEMHOST_WRITECOMBINED,
            "READ_ONLY" if register else "WRITECOMBINED",
        ),
    ]
    return "|".join(n for bit, n in names if flags & bit) or "0"


def _host_alloc_error(ctx: Context, err: Any, nbytes: int, flags: int) -> Exception:
    if int(err) == _OUT_OF_MEMORY:
        return OutOfMemoryError(
            f"pinned_empty: cannot page-lock {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of host "
            "memory (cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY). Pinned memory is limited by "
            "physical RAM and the locked-memory limit (ulimit -l); use smaller staging "
            "buffers and reuse them",
            _OUT_OF_MEMORY,
            "CUDA_ERROR_OUT_OF_MEMORY",
        )
    return ctx.note_error(err, f"cuMemHostAlloc({nbytes}, {_flag_names(flags)})")


def pinned_zeros(
    shape: Any, dtype: Any = np.float64, *, context: Any = None, **flags: bool
) -> np.ndarray:
    """:func:`pinned_empty` (same options) filled with zeros."""
    arr = pinned_empty(shape, dtype, context=context, **flags)
    arr[...] = 0
    return arr
