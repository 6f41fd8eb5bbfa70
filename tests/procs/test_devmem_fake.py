"""Device buffers in ``ctxkit.procs`` messages, on the fake driver, in one process that
plays parent and workers in turn (each with its own process tags): what travels (IPC
handles, never the bytes), ordering, which objects come back, what a worker keeps for
the parent and when it lets go, and the refusals. Real processes on a GPU:
tests/procs/test_ipc_pool_gpu.py."""

from __future__ import annotations

import contextlib
import gc
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import ContextClosedError, CudaError
from ctxkit.memory import ImportedBuffer, VirtualBuffer
from ctxkit.memory import ipc as _ipc
from ctxkit.procs import WorkerBuffer, devmem, spawn, wire
from ctxkit.procs.devmem import LeaseBook

MAP_FAILED = 205


class Process:
    """A simulated process: the tags ctxkit.memory.ipc and procs.devmem name it by."""

    def __init__(self, name: str) -> None:
        self.name = name

    @contextlib.contextmanager
    def acting(self) -> Iterator[None]:
        saved = (_ipc._PROCESS_TAG, devmem._TAG)
        _ipc._PROCESS_TAG = devmem._TAG = self.name
        try:
            yield
        finally:
            _ipc._PROCESS_TAG, devmem._TAG = saved


class Worker(Process):
    """A pool worker of device *ordinal*: runs tasks with the real ``run_task``."""

    def __init__(self, name: str, ctx: Any, ordinal: int = 0) -> None:
        super().__init__(name)
        self.ctx = ctx
        self.ordinal = ordinal
        self.leases = devmem.WorkerLeases()

    def run(self, payload: wire.Payload) -> tuple[Any, ...]:
        with self.acting(), self.ctx:
            session = devmem.ChildSession(self.ctx, self.leases, self.ordinal)
            out, restart = spawn.run_task(payload.data, [], None, session)
        assert not restart
        return out


@pytest.fixture
def tags(monkeypatch):
    """Undo every tag change whatever a test does."""
    monkeypatch.setattr(_ipc, "_PROCESS_TAG", _ipc._PROCESS_TAG)
    monkeypatch.setattr(devmem, "_TAG", devmem._TAG)


def task(fn: Any, *args: Any) -> wire.Payload:
    return wire.Payload.build("DevicePool.submit", (fn, args, {}), None, False)


def receive(out: tuple[Any, ...], payload: wire.Payload, book: LeaseBook | None = None) -> Any:
    """The parent loading a worker's reply (as DevicePool._complete does)."""
    assert out[0] == "ok", out[1]["traceback"] if out[0] == "error" else out
    loader = devmem.ResultLoader(payload.devices, book, (0, 4242))
    return wire.decode(out[1], out[2], loader)


def the_error(out: tuple[Any, ...]) -> str:
    assert out[0] == "error"
    return f"{out[1]['type']}: {out[1]['message']}"


# --- functions the "workers" run ----------------------------------------------------


def write_in_place(buf: Any, arr: Any) -> tuple[Any, ...]:
    seen = bytes(buf.copy_to_host()[:4])
    buf.memset(3)
    arr.copy_from_host(np.full(arr.shape, 7.5, arr.dtype))
    kinds = (type(buf).__name__, type(arr).__name__, type(arr.buffer).__name__)
    return seen, kinds, arr.shape, str(arr.dtype), buf.context is ck.current_context()


def return_arguments(buf: Any, arr: Any) -> tuple[Any, ...]:
    return buf, arr, buf[16:32], arr.reshape(-1), arr.buffer, buf.view(dtype=np.int32)


def allocate(n: int, value: int) -> tuple[Any, Any]:
    buf = ck.DeviceBuffer(n)
    buf.memset(value)
    arr = ck.to_device(np.arange(6, dtype=np.float32).reshape(2, 3))
    return buf, arr


def identify(buf: Any) -> tuple[int, str, Any]:
    return buf.ptr, type(buf).__name__, buf


def fail_after_mapping(buf: Any) -> None:
    raise RuntimeError("the task failed")


#: The fake driver's set of stream-ordered (pool) allocations, set by the test using it.
POOLED: set[int] = set()


def allocate_from_pool(n: int) -> Any:
    buf = ck.DeviceBuffer(n)
    POOLED.add(buf.ptr)  # what cuMemAllocAsync would have made: not legacy-IPC shareable
    return buf


# --- arguments -------------------------------------------------------------------------


def test_device_arguments_travel_as_handles_and_are_written_in_place(vfake, vctx0, tags):
    buf = ck.DeviceBuffer(1 << 20, context=vctx0)
    buf.memset(1)
    arr = ck.to_device(np.zeros((4, 8), np.float64), context=vctx0)
    payload = task(write_in_place, buf, arr)
    assert len(payload.data) < 4096 and payload.buffers == []  # 1 MiB buffer, no bytes
    assert payload.devices is not None and payload.devices.objects == [buf, arr]
    assert payload.devices.sent_bytes == buf.nbytes + arr.nbytes
    assert [ctx for c, ctx, _d in vfake.log if c == "ipcget"] == [vctx0.handle] * 2

    before = wire.traffic()
    out = Worker("w0", vctx0).run(payload)
    seen, kinds, shape, dtype, in_bound_context = receive(out, payload)
    got = wire.traffic() - before
    assert kinds == ("ImportedBuffer", "DeviceArray", "ImportedBuffer")
    assert (shape, dtype, in_bound_context) == ((4, 8), "float64", True)
    assert seen == b"\x01" * 4
    assert (buf.copy_to_host() == 3).all()  # the parent's memory, written by the worker
    np.testing.assert_array_equal(arr.to_host(), np.full((4, 8), 7.5))
    assert got.device_buffers_received == 2 and got.device_bytes_received == (1 << 20) + 256
    assert got.pipe_bytes_received < 4096 + len(out[1]) and got.shm_bytes_received == 0
    assert not any(vfake.ipc_opens.values())  # the worker unmapped them when the task ended
    assert buf.ptr in vfake.allocs  # and freed nothing of the parent's


def test_the_parent_synchronizes_before_the_child_may_read(vfake, vctx0, tags):
    buf = ck.DeviceBuffer(4096, context=vctx0)
    buf.memset(0)
    with vctx0:
        vfake.cuMemsetD8(buf.ptr, 9, 4096)  # queued on the legacy stream, not done yet
    payload = task(write_in_place, buf, ck.to_device(np.zeros(2), context=vctx0))
    assert payload.devices is not None
    payload.devices.synchronize()  # what submit() and run_per_device do before sending
    assert vfake.calls("ctxsync")[-1][1] == vctx0.handle
    seen = receive(Worker("w0", vctx0).run(payload), payload)[0]
    assert seen == b"\x09" * 4


def test_a_worker_synchronizes_before_it_reports_and_unmaps(vfake, vctx0, tags):
    buf = ck.DeviceBuffer(4096, context=vctx0)
    payload = task(write_in_place, buf, ck.to_device(np.zeros(2), context=vctx0))
    Worker("w0", vctx0).run(payload)
    names = [c for c, _ctx, _d in vfake.log if c in ("ctxsync", "ipcclose")]
    assert names[-3:] == ["ctxsync", "ipcclose", "ipcclose"]


def test_memory_on_another_device_is_mapped_in_the_tasks_context(vfake, vctx0, vctx1, tags):
    buf = ck.DeviceBuffer(4096, context=vctx1)
    arr = ck.to_device(np.zeros(3), context=vctx1)
    payload = task(write_in_place, buf, arr)
    assert payload.devices is not None
    payload.devices.check_target(0, isolate=False)  # peer access: allowed
    assert not any(payload.devices.problem(o, isolate=False) for o in (0, 1))
    *_, in_bound_context = receive(Worker("w0", vctx0).run(payload), payload)
    assert in_bound_context  # device 0's context maps device 1's memory
    assert (buf.copy_to_host() == 3).all()


def test_memory_a_task_device_cannot_map_is_refused_before_sending(vfake, vctx0, vctx1, tags):
    buf = ck.DeviceBuffer(4096, context=vctx1)
    devices = task(identify, buf).devices
    assert devices is not None
    with pytest.raises(ValueError, match=r"isolate=True.*copy it to device 0 first"):
        devices.check_target(0, isolate=True)
    vfake.no_peer = True
    with pytest.raises(ValueError, match=r"cuDeviceCanAccessPeer\(0, 1\) is 0"):
        devices.check_target(0, isolate=False)
    assert [o for o in (0, 1) if not devices.problem(o, isolate=False)] == [1]
    assert devices.ordinals[0] == 1  # where the pool runs it best
    devices.check_target(1, isolate=True)  # its own device: fine


def test_memory_ipc_cannot_share_is_refused_with_the_reason(vfake, vctx0, tags):
    with pytest.raises(ValueError, match=r"DevicePool.submit: .*without a copy: .*managed"):
        task(identify, ck.ManagedBuffer(4096, context=vctx0))
    vb = VirtualBuffer(1 << 16, context=vctx0)
    with pytest.raises(TypeError, match="VirtualBuffer.*cannot travel"):
        task(identify, [1, {"x": vb}])
    closed = ck.DeviceBuffer(64, context=vctx0)
    closed.close()
    with pytest.raises(ContextClosedError, match="a device argument is closed"):
        task(identify, closed)
    assert not vfake.calls("ipcget")


def test_a_device_reference_cannot_be_loaded_by_plain_pickle(vfake, vctx0, tags):
    payload = task(identify, ck.DeviceBuffer(64, context=vctx0))
    with pytest.raises(TypeError, match="only be received through ctxkit.procs"):
        pickle.loads(payload.data)


def test_one_object_twice_is_sent_once(vfake, vctx0, tags):
    buf = ck.DeviceBuffer(64, context=vctx0)
    payload = task(return_arguments, buf, buf.view(dtype=np.float32))
    again = task(identify, [buf, buf, (buf,)])
    assert payload.devices is not None and again.devices is not None
    assert payload.devices.sent == 2 and again.devices.sent == 1


# --- results ---------------------------------------------------------------------------


def test_arguments_returned_are_the_parents_own_objects(vfake, vctx0, tags):
    buf = ck.DeviceBuffer(256, context=vctx0)
    arr = ck.to_device(np.arange(12, dtype=np.float32).reshape(3, 4), context=vctx0)
    payload = task(return_arguments, buf, arr)
    w = Worker("w0", vctx0)
    out = w.run(payload)
    assert out[3] == [] and len(w.leases) == 0  # nothing lent: it is the parent's memory
    b, a, part, flat, a_buf, as_int = receive(out, payload)
    assert b is buf and a is arr and a_buf is arr.buffer
    assert (part.ptr, part.nbytes) == (buf.ptr + 16, 16)
    assert isinstance(flat, ck.DeviceArray) and flat.shape == (12,) and flat.ptr == arr.ptr
    assert as_int.dtype == np.int32 and as_int.shape == (64,) and as_int.buffer is buf


def test_memory_a_worker_allocates_is_lent_until_the_parent_closes_it(vfake, vctx0, tags):
    wakes: list[int] = []
    book = LeaseBook(lambda: wakes.append(1))
    w = Worker("w0", vctx0)
    payload = task(allocate, 8192, 5)
    out = w.run(payload)
    assert len(out[3]) == 2 and len(w.leases) == 2
    buf, arr = receive(out, payload, book)
    assert isinstance(buf, WorkerBuffer) and isinstance(buf, ImportedBuffer)
    assert isinstance(arr, ck.DeviceArray) and isinstance(arr.buffer, WorkerBuffer)
    assert (buf.copy_to_host() == 5).all()
    np.testing.assert_array_equal(arr.to_host(), np.arange(6, dtype=np.float32).reshape(2, 3))
    worker_ptr = buf.ptr  # the same process here: the mapping is the worker's address

    buf.close()
    assert book.drain() == {(0, 4242): [out[3][0]]} and wakes == [1]
    assert vfake.ipc_opens[(worker_ptr, vctx0.handle)] == 0  # unmapped before release
    w.leases.release([out[3][0]])
    gc.collect()
    assert worker_ptr not in vfake.allocs  # the worker freed it once released
    with pytest.raises(ContextClosedError, match="keep a WorkerBuffer open"):
        buf.copy_to_host()

    del arr
    gc.collect()
    assert book.drain() == {(0, 4242): [out[3][1]]}  # collected: released too


def test_a_lent_buffer_goes_back_to_its_worker_as_its_own_object(vfake, vctx0, tags):
    book = LeaseBook(lambda: None)
    w0, w1 = Worker("w0", vctx0), Worker("w1", vctx0)
    first = task(allocate, 4096, 1)
    buf, _arr = receive(w0.run(first), first, book)
    opens = len(vfake.calls("ipcopen"))

    back = task(identify, buf[1024:2048])
    out = w0.run(back)
    ptr, kind, same = receive(out, back, book)
    assert len(vfake.calls("ipcopen")) == opens  # its own memory: nothing mapped
    assert kind == "DeviceBuffer" and ptr == buf.ptr + 1024
    assert same.ptr == buf.ptr + 1024 and out[3] == []  # an argument: no new lease

    other = task(identify, buf)
    ptr, kind, same = receive(w1.run(other), other, book)
    assert kind == "ImportedBuffer" and same is buf  # another worker maps w0's memory
    assert len(vfake.calls("ipcopen")) == opens + 1


def test_closing_a_workers_buffers_names_the_reason(vfake, vctx0, tags):
    book = LeaseBook(lambda: None)
    payload = task(allocate, 4096, 2)
    w = Worker("w0", vctx0)  # keeps what it lent while it lives
    out = w.run(payload)
    buf, arr = receive(out, payload, book)
    view = buf[:100]
    assert book.invalidate((0, 4242), "the pool was shut down", synchronize=True) == 2
    assert vfake.calls("ctxsync")[-1][1] == vctx0.handle
    for obj in (buf, view, arr):
        with pytest.raises(ContextClosedError, match="the pool was shut down"):
            obj.copy_to_host()
    assert sorted(book.drain()[(0, 4242)]) == sorted(out[3])  # each lease released once
    assert book.invalidate((0, 4242), "again", synchronize=False) == 0


def test_run_per_device_refuses_memory_allocated_in_the_child(vfake, vctx0, tags):
    payload = task(allocate, 4096, 1)
    with Process("child").acting(), vctx0:
        session = devmem.ChildSession(vctx0, None, 0)
        out, _restart = spawn.run_task(payload.data, [], None, session)
    assert "TypeError: run_per_device: the result of 'allocate' on device 0" in the_error(out)
    assert "freed when the child exits" in the_error(out) and "DevicePool" in the_error(out)
    assert not vfake.calls("ipcget")


def test_a_result_ipc_cannot_share_fails_the_task_and_lends_nothing(
    vfake, vctx0, tags, monkeypatch
):
    monkeypatch.setitem(globals(), "POOLED", vfake.mempool_allocs)
    w = Worker("w0", vctx0)
    out = w.run(task(allocate_from_pool, 4096))
    assert "stream-ordered pool allocation" in the_error(out)
    assert len(w.leases) == 0


def test_a_failing_task_unmaps_its_arguments(vfake, vctx0, tags):
    buf = ck.DeviceBuffer(4096, context=vctx0)
    out = Worker("w0", vctx0).run(task(fail_after_mapping, buf))
    assert "RuntimeError: the task failed" in the_error(out)
    assert vfake.calls("ipcopen") and not any(vfake.ipc_opens.values())


def test_a_result_the_parent_cannot_map_adopts_nothing(vfake, vctx0, tags):
    book = LeaseBook(lambda: None)
    payload = task(allocate, 4096, 1)
    out = Worker("w0", vctx0).run(payload)
    vfake.refuse_ipc_open = MAP_FAILED
    loader = devmem.ResultLoader(payload.devices, book, (0, 4242))
    with pytest.raises(CudaError, match="CUDA_ERROR_MAP_FAILED"):
        wire.decode(out[1], out[2], loader)
    assert loader.adopted == set()  # the pool releases every lease of the reply


def test_traffic_readings_subtract():
    a = wire.Traffic(pipe_bytes_sent=10, device_bytes_sent=1 << 30)
    b = wire.Traffic(pipe_bytes_sent=4)
    assert (a - b) == wire.Traffic(pipe_bytes_sent=6, device_bytes_sent=1 << 30)
    assert isinstance(wire.traffic(), wire.Traffic)


def test_device_arguments_of_a_task_sent_by_value(vfake, vctx0, tags):
    pytest.importorskip("cloudpickle")
    buf = ck.DeviceBuffer(4096, context=vctx0)
    payload = wire.Payload.build(
        "DevicePool.submit", (lambda b: (b.memset(6), b)[1], (buf,), {}), None, True
    )
    assert payload.devices is not None and payload.devices.objects == [buf]
    assert receive(Worker("w0", vctx0).run(payload), payload) is buf
    assert (buf.copy_to_host() == 6).all()


def echo_and_make_empty(buf: Any) -> tuple[Any, int, Any]:
    return buf, buf.nbytes, ck.DeviceBuffer(0)


def test_empty_buffers_travel_without_handles(vfake, vctx0, tags):
    empty = ck.DeviceBuffer(0, context=vctx0)
    payload = task(echo_and_make_empty, empty)
    out = Worker("w0", vctx0).run(payload)
    same, n, made = receive(out, payload)
    assert same is empty and n == 0 and out[3] == []
    assert isinstance(made, ck.DeviceBuffer) and made.nbytes == 0 and made.context is vctx0
    assert not vfake.calls("ipcget") and not vfake.calls("ipcopen")
