"""Device buffers through ``ctxkit.procs`` on a real GPU, without host copies: a 1 GiB
buffer handed to a pool worker on the same GPU and rewritten there in place (no byte of
it through a pipe or shared memory, by the wire's counters), memory a worker allocates
used by the parent and freed once the parent lets go, a worker's buffer passed on to
another worker, ``run_per_device`` children writing the parent's buffer, and the
refusals. Where the driver refuses CUDA IPC (some containers), the tests skip with the
driver's error. The functions the workers run are at module level and touch CUDA only
when run.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import ContextClosedError, CudaError
from ctxkit.memory import ImportedBuffer, VirtualBuffer
from ctxkit.procs import DevicePool, DeviceTaskError, WorkerBuffer, run_per_device, traffic
from tests.support.helpers import ipc_refused, is_allocated

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


# --- helpers ----------------------------------------------------------------------------


def submit(pool: DevicePool, target: Any, fn: Any, *args: Any) -> Any:
    """``submit_to``, skipping the test where the driver refuses to export (IPC off)."""
    try:
        return pool.submit_to(target, fn, *args)
    except CudaError as exc:
        if ipc_refused(exc):
            pytest.skip(f"the driver refuses CUDA IPC here: {exc}")
        raise


def result(future: Any) -> Any:
    """The task's result, skipping where the driver refuses to map IPC memory."""
    try:
        return future.result(TIMEOUT)
    except DeviceTaskError as err:
        if ipc_refused(err):
            pytest.skip(f"the driver refuses CUDA IPC here: {err.child_exception or err}")
        raise


# --- tests ------------------------------------------------------------------------------


def test_a_gib_buffer_is_rewritten_in_place_by_a_worker_without_host_copies(ctx0):
    n = GIB // 4
    with DevicePool([0], initializer=kernels) as pool:
        worker_pid = pool.submit(os.getpid).result(TIMEOUT)
        with ctx0:
            buf = ck.DeviceBuffer(GIB)
            kernels().function("iota_u32").launch(GRID, BLOCK, buf, n)  # not synchronized
        before = traffic()
        info = result(submit(pool, 0, check_then_bump, buf))
        moved = traffic() - before
    assert info["type"] == "ImportedBuffer" and info["bound"] and info["pid"] == worker_pid
    assert info["bad"] == 0  # submit() ordered the parent's kernel before the worker's
    with ctx0:
        assert bad_count(buf, 3, 1) == 0  # the worker's write, done when the future was
    # zero host copies: what went through pipes and shared memory is a few KiB of pickle
    assert moved.pipe_bytes_sent + moved.shm_bytes_sent < 64 * 1024, moved
    assert moved.pipe_bytes_received + moved.shm_bytes_received < 64 * 1024, moved
    assert (moved.device_buffers_sent, moved.device_bytes_sent) == (1, GIB)
    seen = info["traffic"]  # the worker's counters, its lifetime so far
    assert seen.pipe_bytes_received + seen.shm_bytes_received < 64 * 1024, seen
    assert (seen.device_buffers_received, seen.device_bytes_received) == (1, GIB)


def test_memory_a_worker_allocates_is_used_by_the_parent_and_freed_after(ctx0):
    size = 256 * MIB
    with DevicePool([0], initializer=kernels) as pool:
        arr, worker_ptr, worker_pid = result(pool.submit(lend_iota, size))
        assert isinstance(arr, ck.DeviceArray) and isinstance(arr.buffer, WorkerBuffer)
        assert isinstance(arr.buffer, ImportedBuffer) and arr.buffer.worker_pid == worker_pid
        assert arr.shape == (size // 4,) and arr.dtype == np.uint32
        assert arr.context is ctx0
        with ctx0:
            assert bad_count(arr, 1, 0) == 0  # the parent reads the worker's memory
            kernels().function("bump_u32").launch(GRID, BLOCK, arr, arr.size)
            ctx0.synchronize()
        kind, ptr, nbad = result(pool.submit(check_lent, arr, 3, 1))
        assert (kind, ptr, nbad) == ("DeviceBuffer", worker_ptr, 0)  # its own, not mapped
        assert result(pool.submit(allocated_here, worker_ptr))
        arr.buffer.close()  # unmapped here; the worker frees it with its next message
        result(pool.submit(allocated_here, worker_ptr))  # that message
        assert not result(pool.submit(allocated_here, worker_ptr))
        with pytest.raises(ContextClosedError, match="keep a WorkerBuffer open"):
            arr.to_host()


def test_a_workers_buffer_is_mapped_by_another_worker(ctx0):
    with DevicePool([0], initializer=kernels) as a, DevicePool([0], initializer=kernels) as b:
        arr, _ptr, pid_a = result(a.submit(lend_iota, 16 * MIB))
        kind, _ptr, nbad = result(submit(b, 0, check_lent, arr, 1, 0))
        assert (kind, nbad) == ("ImportedBuffer", 0)
        assert b.pids[0] != pid_a
        part = arr.buffer[: 4 * MIB].view(dtype=np.uint32)
        kind, _ptr, nbad = result(a.submit(check_lent, part, 1, 0))
        assert (kind, nbad) == ("DeviceBuffer", 0)


def test_buffers_of_a_pool_that_shut_down_are_closed_with_the_reason(ctx0):
    with DevicePool([0], initializer=kernels) as pool:
        arr, _ptr, _pid = result(pool.submit(lend_iota, MIB))
    with pytest.raises(ContextClosedError, match="shut down"):
        arr.to_host()


def test_run_per_device_children_write_the_parents_buffer(ctx0):
    buf = ck.DeviceBuffer(64 * MIB, context=ctx0)
    buf.memset(0)
    try:
        ((same, part, kind),) = run_per_device(
            fill_and_return, devices=[0], args=(buf, 7), isolate=True, timeout=TIMEOUT
        )
    except CudaError as exc:
        if ipc_refused(exc):
            pytest.skip(f"the driver refuses CUDA IPC here: {exc}")
        raise
    except DeviceTaskError as err:
        if ipc_refused(err):
            pytest.skip(f"the driver refuses CUDA IPC here: {err.child_exception or err}")
        raise
    assert kind == "ImportedBuffer" and same is buf
    assert (part.ptr, part.nbytes) == (buf.ptr + 4096, 4096)
    assert (buf.copy_to_host() == 7).all()


def test_run_per_device_refuses_to_return_memory_of_a_child(ctx0):
    with pytest.raises(DeviceTaskError, match="freed when the child exits") as info:
        run_per_device(allocate_in_child, devices=[0], timeout=TIMEOUT)
    assert info.value.exception_type == "builtins.TypeError"


def test_memory_ipc_cannot_share_is_refused(ctx0):
    with DevicePool([0]) as pool:
        with pytest.raises(ValueError, match="managed"):
            pool.submit(len, ck.ManagedBuffer(4096, context=ctx0))
        with ctx0:
            pooled = ck.DeviceBuffer(4096, stream=ck.Stream())
        with pytest.raises(ValueError, match="stream-ordered pool allocation"):
            pool.submit(len, pooled)
        with pytest.raises(TypeError, match="VirtualBuffer"):
            pool.submit(len, VirtualBuffer(2 * MIB, context=ctx0))
        err = pool.submit(stream_ordered_result).exception(TIMEOUT)
        assert isinstance(err, DeviceTaskError) and "stream-ordered pool allocation" in str(err)


@pytest.mark.multigpu
def test_memory_of_another_device_is_mapped_through_peer_access_or_refused(ctx0, ctx1):
    buf = ck.DeviceBuffer(64 * MIB, context=ctx1)
    buf.memset(0)
    with DevicePool([0, 1]) as pool:
        # submit() sends it to the worker of the device that holds it
        assert result(submit(pool, None, fill, buf, 5)) == (1, "ImportedBuffer")
        assert (buf.copy_to_host() == 5).all()
        if not ck.Device(0).can_access_peer(1):
            with pytest.raises(ValueError, match="cuDeviceCanAccessPeer"):
                pool.submit_to(0, fill, buf, 9)
            return
        assert result(submit(pool, 0, fill, buf, 9)) == (0, "ImportedBuffer")
    assert (buf.copy_to_host() == 9).all()
