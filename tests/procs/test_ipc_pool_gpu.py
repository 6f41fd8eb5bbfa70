"""Device buffers through ``ctxkit.procs`` on a real GPU, without host copies: a 1 GiB
buffer handed to a pool worker on the same GPU and rewritten there in place (no byte of
it through a pipe or shared memory, by the wire's counters), memory a worker allocates
used by the parent and freed once the parent lets go, a worker's buffer passed on to
another worker, ``run_per_device`` children writing the parent's buffer, and the
refusals. Where the driver refuses CUDA IPC (some containers), the tests skip with the
driver's error. What the workers run lives in tests/procs/ipc_tasks.py.
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
from tests.procs.ipc_tasks import (
    BLOCK,
    GIB,
    GRID,
    MIB,
    TIMEOUT,
    allocate_in_child,
    allocated_here,
    bad_count,
    check_lent,
    check_then_bump,
    fill,
    fill_and_return,
    kernels,
    lend_iota,
    stream_ordered_result,
)
from tests.support.helpers import ipc_refused

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
