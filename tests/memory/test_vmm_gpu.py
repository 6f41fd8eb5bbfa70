"""VirtualBuffer on the real driver: the vectorAddMMAP computation on striped buffers, the
physical placement of every chunk (asked of the driver), growth in place and by
remapping with the data kept, memory returned on close from another thread, and two GPUs
(striped, and used from the second device's context)."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

import numpy as np
import pytest

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.compiler import kernel_source
from ctxkit.errors import ContextClosedError
from ctxkit.memory.vmm import VirtualBuffer, allocation_granularity
from tests.support.mpi_launch import child_env

LEFT_OPEN = """
import ctxkit as ck
from ctxkit.memory.vmm import VirtualBuffer

two = ck.device_count() > 1 and ck.Device(0).can_access_peer(1) and ck.Device(1).can_access_peer(0)
with ck.bind(0):
    kept = VirtualBuffer(64 << 20, devices=[0, 1] if two else [0])
    kept.memset(3)
    kept.grow(256 << 20)
    view = kept.view(dtype="float32")
print("left open")
"""


@pytest.fixture(scope="module")
def vector_add():
    with ck.registry.context(0):
        return ck.Module.load(ck.compile(kernel_source("vector_add.cu"))).function("vector_add")


def physical_device(ptr: int) -> int:
    """The device whose memory backs the VMM address *ptr* (the driver's answer)."""
    err, handle = drv.cuMemRetainAllocationHandle(ptr)
    assert not err, err
    try:
        err, prop = drv.cuMemGetAllocationPropertiesFromHandle(handle)
        assert not err, err
        return int(prop.location.id)
    finally:
        drv.cuMemRelease(handle)


def test_vector_add_on_buffers_striped_over_every_gpu(ctx0, vector_add):
    devices = [
        d
        for d in range(ck.device_count())
        if d == 0 or (ck.Device(0).can_access_peer(d) and ck.Device(d).can_access_peer(0))
    ]
    n = 3_000_001
    rng = np.random.default_rng(0)
    a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
    with ctx0:
        bufs = [VirtualBuffer(n * 4, devices=devices) for _ in range(3)]
        bufs[0].copy_from_host(a)
        bufs[1].copy_from_host(b)
        vector_add.launch(4096, 256, bufs[0], bufs[1], bufs[2], n)
        c = bufs[2].copy_to_host().view(np.float32)
        np.testing.assert_array_equal(c, a + b)
        for vb in bufs:
            assert [c.device for c in vb.chunks] == devices
            for chunk in vb.chunks:
                assert physical_device(vb.ptr + chunk.offset) == chunk.device
            assert vb.mapped % allocation_granularity(0) == 0 and vb.mapped >= vb.nbytes
            vb.close()


def test_grow_keeps_the_data_in_place_and_when_it_moves(ctx0):
    gran = allocation_granularity(0)
    with ctx0:
        vb = VirtualBuffer(gran, reserve=4 * gran)
        data = np.random.default_rng(1).integers(0, 256, gran, dtype=np.uint8)
        vb.copy_from_host(data)
        ptr = vb.ptr
        view = vb[:16]
        assert vb.grow(3 * gran) is False and vb.ptr == ptr
        np.testing.assert_array_equal(view.copy_to_host(), data[:16])
        moved = vb.grow(64 * gran)
        assert vb.nbytes == 64 * gran and len(vb.chunks) == 64
        out = vb.copy_to_host()
        np.testing.assert_array_equal(out[:gran], data)
        if moved:
            assert vb.ptr != ptr
            with pytest.raises(ContextClosedError):
                view.copy_to_host()
        else:
            assert vb.ptr == ptr
        tail = np.full(gran, 0xAB, np.uint8)
        vb[63 * gran :].copy_from_host(tail)
        np.testing.assert_array_equal(vb.copy_to_host()[63 * gran :], tail)
        vb.close()


def test_close_from_another_thread_returns_the_memory(ctx0):
    """Asked of the range itself, not the device's free memory, which other processes
    (the test run's other workers) change meanwhile."""
    size = 512 << 20
    failed = len(ck.lifetime.failed_frees())
    with ctx0:
        holder = [VirtualBuffer(size)]
        holder[0].memset(1)
        ptr = holder[0].ptr
        err, base, _ = drv.cuMemGetAddressRange(ptr)
        assert not err and int(base) == ptr

    def drop() -> None:
        holder.clear()
        gc.collect()

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    assert len(ck.lifetime.failed_frees()) == failed
    with ctx0:
        err, _, _ = drv.cuMemGetAddressRange(ptr)
    assert int(err) != 0  # nothing mapped there any more


def test_device_buffer_interop(ctx0):
    with ctx0:
        vb = VirtualBuffer(1 << 20)
        src = ck.to_device(np.arange(1 << 18, dtype=np.float32))
        vb.copy_from(src)
        arr = vb.view(dtype=np.float32)
        np.testing.assert_array_equal(arr.to_host(), np.arange(1 << 18, dtype=np.float32))
        assert vb.__cuda_array_interface__["data"][0] == vb.ptr
        back = ck.DeviceBuffer(1 << 20)
        vb.copy_to(back)
        assert np.array_equal(back.copy_to_host(), vb.copy_to_host())
        vb.close()


def test_buffers_left_open_at_exit_end_the_process_quietly():
    proc = subprocess.run(
        [sys.executable, "-c", LEFT_OPEN],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "left open" and proc.stderr == ""


@pytest.mark.multigpu
def test_two_gpus_stripe_and_both_use_the_buffer(ctx0, ctx1, vector_add):
    if not (ck.Device(0).can_access_peer(1) and ck.Device(1).can_access_peer(0)):
        pytest.skip("devices 0 and 1 have no peer path")
    n = 1 << 22
    a = np.random.default_rng(2).random(n, dtype=np.float32)
    with ctx0:
        x = VirtualBuffer(n * 4, devices=[0, 1])
        y = VirtualBuffer(n * 4, devices=[1, 0])
        x.copy_from_host(a)
        assert [physical_device(x.ptr + c.offset) for c in x.chunks] == [0, 1]
        assert [physical_device(y.ptr + c.offset) for c in y.chunks] == [1, 0]
    with ctx1:  # the second device reads and writes both buffers directly
        vector_add.launch(1024, 256, x, x, y, n)
        ctx1.synchronize()
    np.testing.assert_array_equal(y.copy_to_host().view(np.float32), a + a)
    x.close()
    y.close()
