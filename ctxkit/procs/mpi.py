"""MPI scale-out: bind each rank to its node-local GPU.

:func:`mpi_local_rank` splits the communicator by shared-memory node;
:func:`local_device_for` maps a local rank to a device ordinal (round robin, or a
list); :func:`mpi_local_device` does both and binds that device's registry context
in the calling thread. mpi4py is imported only when these are called.
"""

from __future__ import annotations

from typing import Any

from .. import device as _device
from .._driver import from_result
from ..device import Device

__all__ = ["local_device_for", "mpi_local_device", "mpi_local_rank"]


def _import_mpi(what: str) -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"ctxkit.procs.{what} needs mpi4py, which is not installed ({exc}). Install the "
            '`mpi` extra (in a ctxkit checkout: pip install -e ".[mpi]"; from the package '
            'index: pip install "ctxkit-cuda[mpi]") or `pip install mpi4py`, plus an MPI '
            "runtime (your cluster's MPI, or `pip install mpich` on a workstation)"
        ) from exc
    return MPI


def mpi_local_rank(comm: Any = None) -> tuple[int, int]:
    """``(local_rank, local_size)`` of this process among the ranks of *comm* on its node.

    Uses ``comm.Split_type(MPI.COMM_TYPE_SHARED)``; local ranks follow the order of the
    ranks in *comm* (default ``MPI.COMM_WORLD``).
    """
    MPI = _import_mpi("mpi_local_rank")
    comm = MPI.COMM_WORLD if comm is None else comm
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return int(local.Get_rank()), int(local.Get_size())
    finally:
        local.Free()


def local_device_for(
    local_rank: int, local_size: int, device_count: int, oversubscribe: bool = False, host: str = ""
) -> int:
    """The device ordinal for node-local rank *local_rank* of *local_size* ranks.

    ``local_rank`` itself when there are at least as many devices as local ranks;
    ``local_rank % device_count`` when *oversubscribe* allows sharing devices.

    Raises
    ------
    ValueError
        More local ranks than devices without *oversubscribe* (the message names both
        counts), or an inconsistent rank/size.
    CudaError
        No device is visible (``CUDA_ERROR_NO_DEVICE``).
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not in range(local_size={local_size})")
    where = f" on {host}" if host else " on this node"
    if device_count <= 0:
        raise from_result(
            100, "mpi_local_device", f"{local_size} MPI rank(s){where} found no CUDA device"
        )
    if local_size > device_count and not oversubscribe:
        raise ValueError(
            f"{local_size} MPI ranks run{where} but only {device_count} CUDA device(s) are "
            f"visible there (this is local rank {local_rank}): start at most {device_count} "
            "rank(s) per node (e.g. mpiexec -ppn N), or pass oversubscribe=True to share "
            "devices (device = local_rank % device_count)"
        )
    return local_rank % device_count


def mpi_local_device(
    comm: Any = None, oversubscribe: bool = False, *, device_count: int | None = None
) -> Device:
    """Bind this MPI rank to its node-local GPU and return the Device.

    The device is chosen from the **node-local** rank (``MPI.COMM_TYPE_SHARED`` split of
    *comm*), not the global rank, so the same program works on one node and across many.
    The registry's context of that device is pushed in the calling thread and stays
    current there (the rank's main thread) for the rest of the program; worker threads
    bind it themselves (``ctxkit.bind(dev)``). Calling it again is cheap.

    Parameters
    ----------
    comm : mpi4py communicator, optional
        Default ``MPI.COMM_WORLD``.
    oversubscribe : bool
        Allow more local ranks than devices (device = ``local_rank % device_count``).
    device_count : int, optional
        Devices to spread the ranks over (default: all visible). Tests pass a fake count
        to exercise the rank logic without GPUs.

    Raises
    ------
    ImportError
        mpi4py is not installed (install the ``mpi`` extra).
    ValueError
        More local ranks than devices and not *oversubscribe*.
    """
    MPI = _import_mpi("mpi_local_device")
    local_rank, local_size = mpi_local_rank(comm)
    n = _device.device_count() if device_count is None else device_count
    ordinal = local_device_for(local_rank, local_size, n, oversubscribe, MPI.Get_processor_name())
    dev = Device(ordinal)
    from ..binding import registry
    from ..context import thread_state

    ctx = registry.context(dev)
    if thread_state().top is not ctx:
        ctx.push()
    return dev
