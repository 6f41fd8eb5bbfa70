"""ctxkit.memory.ipc against the fake (tests/support/fakevmm.py): handles are small
picklable values, imports map the exporter's memory in the right context and unmap it on
close, what cannot be shared is refused with the reason, events, and VMM memory through
POSIX file descriptors. Two real processes on a GPU: tests/memory/test_ipc_gpu.py."""

from __future__ import annotations

import gc
import os
import pickle
import threading
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import ContextClosedError, CudaError
from ctxkit.memory import ipc
from ctxkit.memory.vmm import VirtualBuffer
from tests.support.fakevmm import GRANULARITY, A, other_process
from tests.support.helpers import OBJECT_DTYPES, object_array, object_dtype_message


def rand(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class Foreign:
    """A CuPy-like array: only ``__cuda_array_interface__``."""

    def __init__(self, buf: ck.DeviceBuffer) -> None:
        self.buf = buf
        self.__cuda_array_interface__ = buf.__cuda_array_interface__


def test_a_handle_is_a_small_picklable_value(vfake, vctx0):
    buf = ck.DeviceBuffer(1 << 20, context=vctx0)
    h = ipc.export_buffer(buf)
    raw = pickle.dumps(h)
    assert len(raw) < 1024  # no data travels with it
    back = pickle.loads(raw)
    assert back == h and back.nbytes == 1 << 20 and back.offset == 0
    assert back.pid == os.getpid()
    assert "handle=" not in repr(h)
    assert vfake.calls("ipcget")[0][1] == vctx0.handle  # exported inside its context


def test_import_maps_the_same_memory_and_close_unmaps_it(vfake, vctx0, monkeypatch):
    buf = ck.DeviceBuffer(4096, context=vctx0)
    data = rand(4096)
    buf.copy_from_host(data)
    h = pickle.loads(pickle.dumps(ipc.export_buffer(buf)))
    other_process(monkeypatch)
    imported = ipc.import_buffer(h)
    assert isinstance(imported, ipc.ImportedBuffer) and isinstance(imported, ck.DeviceBuffer)
    assert imported.context is vctx0  # found by the exporting device's UUID
    np.testing.assert_array_equal(imported.copy_to_host(), data)
    imported[:16].memset(9)
    assert (buf.copy_to_host()[:16] == 9).all()
    assert not vfake.calls("ipcclose")  # mapped until closed
    imported.close()
    imported.close()
    assert [(c, ctx) for c, ctx, _d in vfake.log if c == "ipcclose"] == [("ipcclose", vctx0.handle)]
    assert buf.ptr in vfake.allocs  # the exporter's memory was not freed
    with pytest.raises(ContextClosedError):
        imported.copy_to_host()


def test_a_slice_exports_only_its_bytes(vfake, vctx0, monkeypatch):
    buf = ck.DeviceBuffer(8192, context=vctx0)
    data = rand(8192, 1)
    buf.copy_from_host(data)
    h = ipc.export_buffer(buf[1000:3000])
    assert (h.offset, h.nbytes) == (1000, 2000)
    other_process(monkeypatch)
    part = h.open()
    assert part.ptr == buf.ptr + 1000 and part.nbytes == 2000
    np.testing.assert_array_equal(part.copy_to_host(), data[1000:3000])
    assert vfake.calls("ipcget")[0][2] == buf.ptr  # the handle is of the whole allocation


def test_every_import_is_closed_once_also_from_another_thread(vfake, vctx0, monkeypatch):
    buf = ck.DeviceBuffer(4096, context=vctx0)
    h = ipc.export_buffer(buf)
    other_process(monkeypatch)
    first, second = ipc.import_buffer(h), ipc.import_buffer(h)
    assert vfake.ipc_opens[(buf.ptr, vctx0.handle)] == 2
    view = first[10:20]
    holder = [first, second]
    del first, second

    def drop() -> None:
        holder.clear()
        gc.collect()

    t = threading.Thread(target=drop)
    t.start()
    t.join()
    assert vfake.ipc_opens[(buf.ptr, vctx0.handle)] == 1  # the view keeps its buffer open
    del view
    gc.collect()
    assert vfake.ipc_opens[(buf.ptr, vctx0.handle)] == 0
    assert {ctx for c, ctx, _d in vfake.log if c == "ipcclose"} == {vctx0.handle}


def test_import_in_the_exporting_process_is_refused(vfake, vctx0):
    buf = ck.DeviceBuffer(64, context=vctx0)
    h = ipc.export_buffer(buf)
    with pytest.raises(ValueError, match="exported by this process"):
        ipc.import_buffer(h)
    assert not vfake.calls("ipcopen")


def test_import_picks_the_device_by_uuid_or_the_given_context(vfake, vctx0, vctx1, monkeypatch):
    buf = ck.DeviceBuffer(64, context=vctx1)
    h = ipc.export_buffer(buf)
    other_process(monkeypatch)
    assert ipc.import_buffer(h).context is vctx1
    assert ipc.import_buffer(h, context=vctx0).context is vctx0  # through peer access


def test_a_gpu_this_process_does_not_see_is_named(vfake, vctx0, monkeypatch):
    buf = ck.DeviceBuffer(64, context=vctx0)
    h = ipc.export_buffer(buf)
    other_process(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(ipc, "_device_with_uuid", lambda uuid: None)
    with pytest.raises(CudaError, match="0000:40:00.0") as info:
        ipc.import_buffer(h)
    assert info.value.name == "CUDA_ERROR_INVALID_DEVICE"
    assert "CUDA_VISIBLE_DEVICES='1'" in str(info.value)


def test_a_driver_refusal_keeps_the_driver_error_and_says_why(vfake, vctx0, monkeypatch):
    buf = ck.DeviceBuffer(64, context=vctx0)
    h = ipc.export_buffer(buf)
    other_process(monkeypatch)
    vfake.refuse_ipc_open = 205
    with pytest.raises(CudaError, match="containers") as info:
        ipc.import_buffer(h)
    assert info.value.name == "CUDA_ERROR_MAP_FAILED" and info.value.code == 205
    assert "cuIpcOpenMemHandle" in str(info.value)


def test_memory_that_legacy_ipc_cannot_share_is_refused_with_the_reason(vfake, vctx0):
    managed = ck.ManagedBuffer(4096, context=vctx0)
    with pytest.raises(ValueError, match="managed"):
        ipc.export_buffer(managed)
    pool = ck.DeviceBuffer(4096, context=vctx0)
    vfake.mempool_allocs.add(pool.ptr)
    with pytest.raises(ValueError, match="stream-ordered pool allocation"):
        ipc.export_buffer(pool)
    vb = VirtualBuffer(4096, context=vctx0)
    with pytest.raises(ValueError, match="not created shareable"):
        ipc.export_buffer(vb)
    with pytest.raises(ValueError, match="cannot be exported"):
        ipc.export_buffer(vb.as_buffer())
    with pytest.raises(ValueError, match="nothing to share"):
        ipc.export_buffer(ck.DeviceBuffer(0, context=vctx0))
    closed = ck.DeviceBuffer(64, context=vctx0)
    closed.close()
    with pytest.raises(ContextClosedError):
        ipc.export_buffer(closed)
    with pytest.raises(TypeError, match="DeviceBuffer"):
        ipc.export_buffer(np.zeros(4))
    assert not vfake.calls("ipcget")


def test_foreign_arrays_are_exported_from_their_context(vfake, vctx0, vctx1):
    buf = ck.DeviceBuffer(256, context=vctx1)
    with vctx0:
        h = ipc.export_buffer(Foreign(buf))
    assert h.nbytes == 256 and vfake.calls("ipcget")[0][1] == vctx1.handle
    with pytest.raises(ValueError, match="run past the end"):
        ipc.export_pointer(buf.ptr + 200, 100, vctx1)
    with pytest.raises(ValueError, match="nothing to share"):
        ipc.export_pointer(buf.ptr, 0, vctx1)


def test_wrong_handle_types(vfake, vctx0):
    with pytest.raises(TypeError, match="IpcBufferHandle"):
        ipc.import_buffer(b"x" * 64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="IpcEventHandle"):
        ipc.import_event(b"x" * 64)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="import_buffer"):
        ipc.ImportedBuffer(64)


# --- events -----------------------------------------------------------------------------


def test_ipc_events_are_interprocess_and_untimed(vfake, vctx0, monkeypatch):
    ev = ipc.ipc_event(vctx0)
    assert vfake.events[int(ev.handle)][1] == 4 | 2
    assert not ev.timing and ev.context is vctx0
    blocking = ipc.ipc_event(vctx0, blocking=True)
    assert vfake.events[int(blocking.handle)][1] == 4 | 2 | 1
    h = pickle.loads(pickle.dumps(ipc.export_event(ev)))
    with pytest.raises(ValueError, match="exported by this process"):
        ipc.import_event(h)
    other_process(monkeypatch)
    theirs = h.open()
    assert theirs.context is vctx0 and not theirs.timing
    s = ck.Stream(context=vctx0)
    theirs.record(s)
    s.wait(theirs)
    theirs.synchronize()
    handle = int(theirs.handle)
    theirs.close()
    assert ("eventdestroy", vctx0.handle, handle) in vfake.log
    assert int(ev.handle) in vfake.events  # the exporter's event lives on


def test_events_that_cannot_be_shared(vfake, vctx0):
    with pytest.raises(ValueError, match="records timestamps"):
        ipc.export_event(ck.Event(context=vctx0))
    with pytest.raises(CudaError, match="ipc_event") as info:
        ipc.export_event(ck.Event(timing=False, context=vctx0))
    assert info.value.name == "CUDA_ERROR_INVALID_VALUE"
    with pytest.raises(TypeError, match="ctxkit.Event"):
        ipc.export_event("event")  # type: ignore[arg-type]
    closed = ipc.ipc_event(vctx0)
    closed.close()
    with pytest.raises(ContextClosedError):
        ipc.export_event(closed)
    vfake.attrs[A.CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED] = 0
    with pytest.raises(CudaError, match="cannot share events") as info:
        ipc.ipc_event(vctx0)
    assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED"


# --- VMM memory through POSIX file descriptors ------------------------------------------


def test_a_shareable_virtual_buffer_travels_as_file_descriptors(vfake, vctx0):
    n = 3 * GRANULARITY + 5
    vb = VirtualBuffer(n, devices=[0, 1], context=vctx0, shareable=True)
    data = rand(n, 7)
    vb.copy_from_host(data)
    h = ipc.export_buffer(vb)
    assert isinstance(h, ipc.IpcVirtualBufferHandle) and h.nbytes == n
    assert [c[:2] for c in h.chunks] == [(c.offset, c.nbytes) for c in vb.chunks]
    # multiprocessing's pickler hands the descriptors over (SCM_RIGHTS); then they open
    received = pickle.loads(ForkingPickler.dumps(h))
    assert [s.fd for s in received.fds] != [s.fd for s in h.fds]
    theirs = received.open()
    assert isinstance(theirs, VirtualBuffer) and theirs.ptr != vb.ptr
    assert theirs.nbytes == n and [d.ordinal for d in theirs.access] == [0]
    assert [c.device for c in theirs.chunks] == [0, 1]
    np.testing.assert_array_equal(theirs.copy_to_host(), data)
    with pytest.raises(ValueError, match="cannot grow"):
        theirs.grow(2 * n)
    imports = [d for c, _ctx, d in vfake.log if c == "import"]
    theirs.close()
    released = [d for c, _ctx, d in vfake.log if c == "memrelease"]
    assert sorted(released) == sorted(imports)  # only this side's handles
    np.testing.assert_array_equal(vb.copy_to_host(), data)  # the exporter's copy lives on
    vb.close()
    assert not vfake.handles and not vfake.reservations


def test_a_failed_import_releases_what_it_imported(vfake, vctx0, monkeypatch):
    vb = VirtualBuffer(2 * GRANULARITY, devices=[0, 1], context=vctx0, shareable=True)
    h = ipc.export_buffer(vb)
    original = vfake.cuMemImportFromShareableHandle
    calls = []

    def second_fails(fd, kind):
        calls.append(fd)
        return original(fd, kind) if len(calls) == 1 else (1, None)

    monkeypatch.setattr(vfake, "cuMemImportFromShareableHandle", second_fails)
    with pytest.raises(CudaError, match="cuMemImportFromShareableHandle"):
        h.open()
    vb.close()
    assert not vfake.handles  # the one imported handle was released too


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_imported_memory_refuses_python_objects(vfake, vctx0, monkeypatch, dtype):
    buf = ck.DeviceBuffer(4096, context=vctx0)
    h = pickle.loads(pickle.dumps(ipc.export_buffer(buf)))
    other_process(monkeypatch)
    imported = ipc.import_buffer(h)
    arr = object_array(dtype, 4096)
    for call in (
        lambda: imported.copy_from_host(arr),
        lambda: imported.copy_to_host(arr),
        lambda: imported.view((256,), dtype),
    ):
        with pytest.raises(TypeError, match=object_dtype_message(dtype)):
            call()
    imported.close()
