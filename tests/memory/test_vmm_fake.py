"""VirtualBuffer against the VMM fake (tests/support/fakevmm.py): striping, access, growth
in place and by remapping, the free order, cleanup after failures, and the
DeviceBuffer-like surface. tests/memory/test_vmm_gpu.py checks the real driver."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import ContextClosedError, CudaError, OutOfMemoryError
from ctxkit.memory.vmm import VirtualBuffer, allocation_granularity
from ctxkit.module.params import device_pointer
from tests.support.fakevmm import GRANULARITY, A
from tests.support.helpers import OBJECT_DTYPES, object_array, object_dtype_message

G = GRANULARITY


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def calls(fake, *names: str) -> list[str]:
    return [c for c, _ctx, _d in fake.log if c in names]


def test_striped_over_two_devices_round_trips_across_chunks(vfake, vctx0):
    n = 3 * G + 123
    with vctx0:
        vb = VirtualBuffer(n, devices=[0, 1])
    assert vb.stripe == 2 * G  # n split over two devices, rounded up to the granularity
    assert [(c.offset, c.nbytes, c.device) for c in vb.chunks] == [(0, 2 * G, 0), (2 * G, 2 * G, 1)]
    assert vb.nbytes == n and vb.mapped == 4 * G and vb.reserved >= 4 * G
    assert vfake.physical_device_at(vb.ptr) == 0
    assert vfake.physical_device_at(vb.ptr + 2 * G) == 1
    data = rand(n)
    vb.copy_from_host(data)  # no context current: the buffer binds its own
    np.testing.assert_array_equal(vb.copy_to_host(), data)
    assert vb.context is vctx0 and vb.device.ordinal == 0


def test_every_chunk_is_accessible_from_every_device_by_default(vfake, vctx1):
    vb = VirtualBuffer(2 * G, devices=[0], context=vctx1)
    assert [d.ordinal for d in vb.access] == [0, 1]
    for entry in vfake.calls("setaccess"):
        assert entry[2][2] == (0, 1)
    vb.copy_from_host(rand(2 * G))  # runs in device 1's context: needs access there


def test_access_restricted_to_listed_devices(vfake, vctx0):
    vb = VirtualBuffer(G, context=vctx0, access=[0])
    assert [e[2][2] for e in vfake.calls("setaccess")] == [(0,)]
    assert [d.ordinal for d in vb.access] == [0]


def test_stripe_option_interleaves_round_robin(vfake, vctx0):
    vb = VirtualBuffer(5 * G, devices=[0, 1], context=vctx0, stripe=G + 1)
    assert vb.stripe == 2 * G
    assert [c.device for c in vb.chunks] == [0, 1, 0]


def test_no_peer_path_is_refused_before_anything_is_reserved(vfake, vctx0):
    vfake.no_peer = True
    with pytest.raises(ValueError, match="device 0 cannot access memory of device 1"):
        VirtualBuffer(G, devices=[0, 1], context=vctx0)
    assert not vfake.calls("reserve") and not vfake.calls("memcreate")


def test_devices_without_vmm_are_refused(vfake, vctx0):
    vfake.attrs[A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED] = 0
    with pytest.raises(CudaError, match="virtual memory management") as info:
        VirtualBuffer(G, context=vctx0)
    assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED"


def test_shareable_needs_posix_fd_support(vfake, vctx0):
    vfake.attrs[A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED] = 0
    with pytest.raises(CudaError, match="POSIX file descriptors"):
        VirtualBuffer(G, context=vctx0, shareable=True)
    VirtualBuffer(G, context=vctx0)


def test_bad_arguments(vfake, vctx0):
    with pytest.raises(TypeError):
        VirtualBuffer(1.5, context=vctx0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        VirtualBuffer(-1, context=vctx0)
    with pytest.raises(TypeError, match="sequence"):
        VirtualBuffer(G, devices=0, context=vctx0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="twice"):
        VirtualBuffer(G, devices=[1, 1], context=vctx0)
    with pytest.raises(ck.NoCurrentContextError):
        VirtualBuffer(G)


def test_close_frees_in_order_in_the_context_and_is_idempotent(vfake, vctx0):
    vb = VirtualBuffer(3 * G, devices=[0, 1], context=vctx0)
    vfake.log.clear()
    vb.close()
    vb.close()
    assert calls(vfake, "unmap", "memrelease", "addressfree") == [
        "unmap",
        "unmap",
        "memrelease",
        "memrelease",
        "addressfree",
    ]
    assert {ctx for c, ctx, _d in vfake.log} == {vctx0.handle}
    assert not vfake.mappings and not vfake.handles and not vfake.reservations
    assert vb.closed
    with pytest.raises(ContextClosedError, match="closed"):
        vb.ptr  # noqa: B018
    with pytest.raises(ContextClosedError):
        vb.copy_to_host()
    assert "closed" in repr(vb)


def test_garbage_collection_in_another_thread_frees_in_the_owning_context(vfake, vctx0):
    holder = [VirtualBuffer(G, context=vctx0)]

    def drop() -> None:
        holder.clear()
        gc.collect()

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    assert [ctx for c, ctx, _d in vfake.log if c == "addressfree"] == [vctx0.handle]
    assert not vfake.handles and not vfake.reservations


def test_memory_of_a_closed_owned_context_is_still_freed(vfake):
    ctx = ck.Context.create(0)
    vb = VirtualBuffer(G, context=ctx)
    ctx.close()
    del vb
    gc.collect()
    assert not vfake.handles and not vfake.reservations and not vfake.mappings


def test_out_of_memory_on_a_later_chunk_releases_the_earlier_ones(vfake, vctx0):
    vfake.vmm_oom_after = 1
    with pytest.raises(OutOfMemoryError, match="device 1") as info:
        VirtualBuffer(2 * G, devices=[0, 1], context=vctx0)
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    gc.collect()
    assert not vfake.handles and not vfake.mappings and not vfake.reservations


def test_grow_inside_the_reservation_keeps_address_views_and_data(vfake, vctx0):
    vb = VirtualBuffer(G, context=vctx0, reserve=8 * G)
    data = rand(G, 1)
    vb.copy_from_host(data)
    view = vb.as_buffer()
    ptr = vb.ptr
    assert vb.grow(3 * G) is False
    assert vb.ptr == ptr and vb.nbytes == 3 * G and vb.reserved == 8 * G
    assert len(vfake.calls("reserve")) == 1
    np.testing.assert_array_equal(view.copy_to_host(), data)  # the old view still works
    np.testing.assert_array_equal(vb.copy_to_host()[:G], data)


def test_grow_past_the_reservation_extends_in_place_when_the_driver_allows(vfake, vctx0):
    vb = VirtualBuffer(G, devices=[0, 1], context=vctx0, stripe=G)
    data = rand(G, 2)
    vb.copy_from_host(data)
    ptr = vb.ptr
    assert vb.grow(3 * G) is False
    assert vb.ptr == ptr
    assert [c.device for c in vb.chunks] == [0, 1, 0]
    bigger = rand(3 * G, 3)
    vb.copy_from_host(bigger)  # one copy across both reservations
    np.testing.assert_array_equal(vb.copy_to_host(), bigger)
    vb.close()
    assert not vfake.reservations


def test_grow_remaps_the_chunks_when_the_address_space_after_is_taken(vfake, vctx0):
    vfake.honour_hint = False
    vb = VirtualBuffer(2 * G, devices=[0, 1], context=vctx0, stripe=G)
    data = rand(2 * G, 4)
    vb.copy_from_host(data)
    old_ptr, view, arr = vb.ptr, vb[16:32], vb.view(dtype=np.uint32)
    creates = len(vfake.calls("memcreate"))
    assert vb.grow(5 * G + 7) is True
    assert vb.ptr != old_ptr and vb.nbytes == 5 * G + 7
    assert len(vfake.calls("memcreate")) == creates + 4  # old chunks remapped, not copied
    np.testing.assert_array_equal(vb.copy_to_host()[: 2 * G], data)
    assert [vfake.physical_device_at(vb.ptr + c.offset) for c in vb.chunks] == [0, 1, 0, 1, 0, 1]
    with pytest.raises(ContextClosedError):
        view.copy_to_host()
    with pytest.raises(ContextClosedError):
        arr.to_host()
    assert len(vfake.reservations) == 1  # the old range is gone
    vb.close()
    assert not vfake.reservations and not vfake.handles


def test_grow_refuses_to_shrink_and_works_from_zero(vfake, vctx0):
    vb = VirtualBuffer(0, context=vctx0)
    assert vb.ptr == 0 and vb.mapped == 0 and not vfake.calls("reserve")
    assert vb.grow(10) is False
    assert vb.ptr and vb.nbytes == 10
    assert vb.grow(10) is False and vb.grow(G) is False  # fits the mapped chunk
    with pytest.raises(ValueError, match="smaller"):
        vb.grow(5)
    vb.close()
    with pytest.raises(ContextClosedError):
        vb.grow(100)


def test_device_buffer_surface(vfake, vctx0):
    vb = VirtualBuffer(4096, context=vctx0)
    vb.memset(7)
    assert (vb.copy_to_host() == 7).all()
    cai = vb.__cuda_array_interface__
    assert cai["data"] == (vb.ptr, False) and cai["shape"] == (4096,) and cai["version"] == 3
    assert vb.__dlpack_device__() == (2, 0)
    assert device_pointer(vb) == vb.ptr  # what a kernel launch passes
    arr = vb.view((32, 32), np.float32)
    assert arr.ptr == vb.ptr and arr.shape == (32, 32)
    assert vb[100:200].nbytes == 100 and vb[100:200].ptr == vb.ptr + 100
    src = ck.DeviceBuffer(4096, context=vctx0)
    src.copy_from_host(rand(4096, 5))
    vb.copy_from(src)
    np.testing.assert_array_equal(vb.copy_to_host(), rand(4096, 5))
    dst = ck.DeviceBuffer(4096, context=vctx0)
    vb.copy_to(dst)
    np.testing.assert_array_equal(dst.copy_to_host(), rand(4096, 5))
    out = np.empty(4096, np.uint8)
    assert vb.copy_to_host(out) is out
    with pytest.raises(ValueError, match="sizes must match"):
        vb.copy_from_host(np.zeros(10, np.uint8))
    with VirtualBuffer(G, context=vctx0) as tmp:
        assert "VirtualBuffer" in repr(tmp)
    assert tmp.closed


def test_allocation_granularity(vfake, vctx0):
    assert allocation_granularity(0) == G
    assert allocation_granularity(vctx0, shareable=True) == G


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_host_copies_and_views_refuse_python_objects(vfake, vctx0, dtype):
    with vctx0:
        vb = VirtualBuffer(G)
    arr = object_array(dtype, G)
    for call in (
        lambda: vb.copy_from_host(arr),
        lambda: vb.copy_to_host(arr),
        lambda: vb.view((G // 16,), dtype),
    ):
        with pytest.raises(TypeError, match=object_dtype_message(dtype)):
            call()
    assert not vfake.calls("HtoD") and not vfake.calls("DtoH")
