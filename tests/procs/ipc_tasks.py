"""What the CUDA IPC pool tests' workers and children run (tests/procs/test_ipc_pool_gpu.py):
module level, touching CUDA only when run, and importing no test machinery (a child
imports this module by name)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import ctxkit as ck
from ctxkit.procs import traffic
from tests.support.helpers import is_allocated

SOURCE = r"""
extern "C" __global__ void iota_u32(unsigned int* x, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = (unsigned int)i;
}

extern "C" __global__ void bump_u32(unsigned int* x, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = x[i] * 3u + 1u;
}

// Count the elements with x[i] != i * mul + add.
extern "C" __global__ void count_bad(const unsigned int* x, size_t n, unsigned int mul,
                                     unsigned int add, unsigned long long* bad)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    unsigned long long mine = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        mine += x[i] != (unsigned int)i * mul + add;
    if (mine) atomicAdd(bad, mine);
}
"""
GIB = 1 << 30
MIB = 1 << 20
TIMEOUT = 180
GRID, BLOCK = 65535, 256

_mod: list[ck.Module] = []


def kernels() -> ck.Module:
    """The test kernels, compiled once per process (in the current context)."""
    if not _mod:
        _mod.append(ck.Module.load(ck.compile(SOURCE, name="ipc_pool_test.cu")))
    return _mod[0]


def bad_count(x: Any, mul: int, add: int) -> int:
    """Elements of the uint32 memory *x* that are not ``i * mul + add`` (on the GPU)."""
    n = x.nbytes // 4
    bad = ck.DeviceBuffer(8)
    bad.memset(0)
    kernels().function("count_bad").launch(GRID, BLOCK, x, n, np.uint32(mul), np.uint32(add), bad)
    return int(bad.copy_to_host().view(np.uint64)[0])


# --- what the workers and children run -----------------------------------------------


def check_then_bump(buf: Any) -> dict[str, Any]:
    """Count x[i] != i (the parent's unsynchronized kernel must be done), then queue
    x = 3x + 1 on a stream and return without waiting (the worker waits for it)."""
    seen = traffic()
    nbad = bad_count(buf, 1, 0)
    s = ck.Stream()
    kernels().function("bump_u32").launch(GRID, BLOCK, buf, buf.nbytes // 4, stream=s)
    return {
        "type": type(buf).__name__,
        "bound": buf.context is ck.current_context(),
        "bad": nbad,
        "traffic": seen,
        "pid": os.getpid(),
    }


def lend_iota(nbytes: int) -> tuple[Any, int, int]:
    """A uint32 array allocated here and returned (the worker keeps it for the parent)."""
    arr = ck.DeviceBuffer(nbytes).view(dtype=np.uint32)
    kernels().function("iota_u32").launch(GRID, BLOCK, arr, arr.size)
    return arr, arr.ptr, os.getpid()


def check_lent(arr: Any, mul: int, add: int) -> tuple[str, int, int]:
    return type(arr.buffer).__name__, arr.ptr, bad_count(arr, mul, add)


def allocated_here(ptr: int) -> bool:
    """Whether the calling worker's context still has an allocation at *ptr* (asked of the
    allocation, not of the device's free memory, which other processes change)."""
    assert ck.current_context() is not None
    return is_allocated(ptr)


def fill_and_return(ordinal: int, buf: Any, value: int) -> tuple[Any, Any, str]:
    buf.memset(value)
    return buf, buf[4096:8192], type(buf).__name__


def fill(buf: Any, value: int) -> tuple[int | None, str]:
    buf.memset(value)
    return ck.procs.worker_device(), type(buf).__name__


def allocate_in_child(ordinal: int) -> Any:
    return ck.DeviceBuffer(4096)


def stream_ordered_result() -> Any:
    return ck.DeviceBuffer(4096, stream=ck.Stream())
