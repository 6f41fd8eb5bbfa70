"""One process per GPU: spawned children, a long-lived device pool, and MPI binding.

Why processes: a fault that poisons a context (illegal address, trap) takes down every
later call in that process; with one process per GPU it costs one device's work, which
is reported and can be retried, while the other devices carry on. It is also the model
that scales past one machine: the same per-device function runs under MPI.

Why **spawn** only: a child created with ``fork`` inherits a copy of the parent's CUDA
state that the driver cannot use (``cuInit`` in the parent makes every CUDA call in a
forked child fail), and forking a multithreaded parent can deadlock on locks held by
other threads. ``spawn`` starts a fresh interpreter that initialises CUDA itself. The
cost is start-up time (interpreter + imports + context), which is why :class:`DevicePool`
exists for repeated work. Programs that use these APIs need the usual
``if __name__ == "__main__":`` guard.

Functions and arguments are pickled. A module-level function travels by name; a lambda,
a closure or a function defined in a notebook, a REPL or ``python -c`` travels by value
with cloudpickle when it is installed (``pip install cloudpickle``, the ``cloudpickle``
extra), and is refused with a clear error otherwise.

Large numpy arrays (arguments and results) travel through POSIX shared memory instead
of the pipe when they reach ``shm_threshold`` bytes (default 1 MiB). Measured on a
2-core development VM (pool round trip of one float32 array there and back, pipe vs
shared memory): 64 KiB 0.28 vs 0.56 ms, 512 KiB 0.74 vs 1.5 ms, 1 MiB 3.4 vs 2.6 ms,
16 MiB 58 vs 34 ms, 256 MiB 2.9 s vs 0.49 s. Below ~1 MiB the fixed cost of creating,
mapping and unlinking a block outweighs the copies it saves; ``benchmarks/bench_procs.py``
measures the crossover on the machine at hand. Every block is reserved before it is
written (a write that a full ``/dev/shm`` cannot back would kill the writer with
SIGBUS); an array for which there is no room goes through the pipe instead.

Device memory is never copied through the host. A ctxkit ``DeviceBuffer`` or
``DeviceArray`` among a task's arguments travels as a CUDA IPC handle (64 bytes): the
child maps the parent's memory in its context and the task gets a buffer (an array of
the same shape and dtype) over it. The parent synchronizes the memory's context before
the task is sent, keeps the memory alive until the task is over, and the child
synchronizes before it reports, so the task's writes are visible when its future is
done. A ``DevicePool`` task may also return device memory it allocated: its worker keeps
that memory alive and the parent gets a :class:`WorkerBuffer` mapped over it, until the
parent closes or drops it, or the worker exits. Details: :mod:`.devmem` (the rules),
the same module (returned memory). :func:`traffic` counts what went through pipes and
shared memory, and what was shared instead.
"""

from __future__ import annotations

from typing import Any

from ..errors import DeviceTaskError
from .mpi import local_device_for, mpi_local_device, mpi_local_rank
from .pool import DevicePool, TaskOptions
from .spawn import run_per_device, worker_device
from .wire import SHM_THRESHOLD, Traffic, traffic

__all__ = [
    "SHM_THRESHOLD",
    "DevicePool",
    "DeviceTaskError",
    "TaskOptions",
    "Traffic",
    "WorkerBuffer",
    "local_device_for",
    "mpi_local_device",
    "mpi_local_rank",
    "run_per_device",
    "traffic",
    "worker_device",
]


def __getattr__(name: str) -> Any:
    """``WorkerBuffer`` is imported on first use: it loads ``ctxkit.memory`` (and numpy),
    which a process that sends only host data, such as every spawned child, never needs."""
    if name == "WorkerBuffer":
        from .workerbuffer import WorkerBuffer

        return WorkerBuffer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
