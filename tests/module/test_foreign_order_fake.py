"""Launches with foreign arrays wait for their producer stream, and only where CUDA does not
order the streams already (CPU, module fake over the memory fake).

The rules (ctxkit.memory.interop): nothing for the same stream; nothing between the legacy
default stream and a blocking stream of the same context (either direction); otherwise an
event recorded and waited on, busy producer or not (cheaper than ``cuStreamQuery``); one
event wait per distinct producer,
recorded with one reusable event per thread and context. How each type tells its producer
is worked out once per type. The GPU suite (tests/core/test_interop_gpu.py) checks that the
skips are safe on a real device with torch and CuPy.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import pytest

import ctxkit as ck
from ctxkit.memory import interop
from tests.module.fakemodule import ModuleDriver, as_u64, load, mem_fake  # noqa: F401

NOT_READY = 600

EMPTY2 = """
.version 7.0
.target sm_52
.address_size 64
.visible .entry empty2(.param .u64 a, .param .u64 b) { ret; }
"""


class CaiArray:
    """A foreign array (``__cuda_array_interface__`` v3) written on *stream*."""

    def __init__(self, ptr: int, stream: int | None) -> None:
        self._ptr, self._stream = ptr, stream

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": (16,),
            "typestr": "<f4",
            "data": (self._ptr, False),
            "version": 3,
            "stream": self._stream,
        }


class ForeignStream:
    """Another library's stream object (the fakes read ``.handle``)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle


@pytest.fixture
def busy(mem_fake: ModuleDriver, monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Stream handles with pending work: ``cuStreamQuery`` answers NOT_READY for them."""
    pending: set[int] = set()
    mem = mem_fake.mem

    def query(h: Any) -> tuple[int]:
        mem.note("query", int(h))
        return (NOT_READY,) if int(h) in pending else (0,)

    monkeypatch.setattr(mem, "cuStreamQuery", query)
    return pending


def _log(mem_fake: ModuleDriver, call: str) -> list[Any]:
    return [d for c, _ctx, d in mem_fake.mem.log if c == call]


def _driver_stream(mem_fake: ModuleDriver, flags: int) -> int:
    """A stream made by "another library" (straight through the driver), in the current
    context: flags 0 = blocking, 1 = CU_STREAM_NON_BLOCKING."""
    err, h = mem_fake.mem.cuStreamCreateWithPriority(flags, 0)
    assert not err
    return int(h)


@pytest.fixture
def setup(mem_fake: ModuleDriver, busy: set[int]) -> Any:
    """Context 0 current; the 2-pointer kernel; two ctxkit buffers."""
    k = load(EMPTY2).function("empty2")
    ctx = ck.registry.context(0)
    with ctx:
        a, b = ck.DeviceBuffer(64), ck.DeviceBuffer(64)
        yield types.SimpleNamespace(k=k, ctx=ctx, a=a, b=b)


def test_busy_producer_stream_is_recorded_and_waited_on(mem_fake, busy, setup):
    producer, consumer = ck.Stream(), ck.Stream()
    busy.add(int(producer.handle))
    written = CaiArray(setup.a.ptr, int(producer.handle))
    setup.k.launch(1, 32, written, setup.b, stream=consumer)
    (event, recorded_on), waits = _log(mem_fake, "record")[-1], _log(mem_fake, "wait")
    assert recorded_on == int(producer.handle)
    assert waits == [(int(consumer.handle), event)]
    assert as_u64(mem_fake.launches[-1]["values"][0]) == setup.a.ptr
    setup.k.launch(1, 32, setup.a, setup.b, stream=consumer)  # ctxkit's own: nothing
    setup.k.launch(1, 32, CaiArray(setup.a.ptr, None), setup.b, stream=consumer)  # no stream
    assert len(_log(mem_fake, "wait")) == 1


def test_idle_producer_is_ordered_without_asking(mem_fake, busy, setup):
    """No ``cuStreamQuery``: recording and waiting costs less than asking first."""
    producer, consumer = ck.Stream(), ck.Stream()
    for _ in range(2):
        arr = CaiArray(setup.a.ptr, int(producer.handle))
        setup.k.launch(1, 32, arr, setup.b, stream=consumer)
    assert _log(mem_fake, "query") == []
    assert [on for _ev, on in _log(mem_fake, "record")] == [int(producer.handle)] * 2
    assert [h for h, _ev in _log(mem_fake, "wait")] == [int(consumer.handle)] * 2


def test_same_stream_needs_nothing(mem_fake, busy, setup):
    s = ck.Stream()
    busy.add(int(s.handle))
    setup.k.launch(1, 32, CaiArray(setup.a.ptr, int(s.handle)), setup.b, stream=s)
    busy.add(0)
    setup.k.launch(1, 32, CaiArray(setup.a.ptr, 1), setup.b)  # legacy on legacy (CAI says 1)
    assert _log(mem_fake, "query") == [] and _log(mem_fake, "wait") == []
    assert len(mem_fake.launches) == 2


def test_legacy_producer_and_blocking_consumer_need_nothing(mem_fake, busy, setup):
    busy.add(0)  # torch's / CuPy's default stream is busy
    blocking = ck.Stream(nonblocking=False)
    legacy_arrays = (CaiArray(setup.a.ptr, 1), CaiArray(setup.b.ptr, 0))
    setup.k.launch(1, 32, *legacy_arrays, stream=blocking)
    with blocking:  # stream=None: the current stream, blocking too
        setup.k.launch(1, 32, *legacy_arrays)
    raw = _driver_stream(mem_fake, 0)  # another library's blocking stream: flags asked
    setup.k.launch(1, 32, *legacy_arrays, stream=ForeignStream(raw))
    assert _log(mem_fake, "query") == [] and _log(mem_fake, "wait") == []
    assert [x["stream"] for x in mem_fake.launches] == [int(blocking.handle)] * 2 + [raw]


def test_non_blocking_consumer_waits_for_a_busy_legacy_producer(mem_fake, busy, setup):
    busy.add(0)
    s = ck.Stream()  # CU_STREAM_NON_BLOCKING: no implicit order with the legacy stream
    setup.k.launch(1, 32, CaiArray(setup.a.ptr, 1), setup.b, stream=s)
    raw = _driver_stream(mem_fake, 1)
    setup.k.launch(1, 32, CaiArray(setup.a.ptr, 1), setup.b, stream=ForeignStream(raw))
    with s:
        setup.k.launch(1, 32, CaiArray(setup.a.ptr, 1), setup.b)
    assert [on for _ev, on in _log(mem_fake, "record")] == [0, 0, 0]
    assert [h for h, _ev in _log(mem_fake, "wait")] == [int(s.handle), raw, int(s.handle)]


def test_legacy_consumer_and_blocking_producer_need_nothing(mem_fake, busy, setup):
    blocking, nonblocking = ck.Stream(nonblocking=False), ck.Stream()
    busy.update({int(blocking.handle), int(nonblocking.handle)})
    setup.k.launch(1, 32, CaiArray(setup.a.ptr, int(blocking.handle)), setup.b)
    assert _log(mem_fake, "wait") == []
    setup.k.launch(1, 32, CaiArray(setup.a.ptr, int(nonblocking.handle)), setup.b)
    assert [
        (h, on) for (h, _e), (_e2, on) in zip(_log(mem_fake, "wait"), _log(mem_fake, "record"))
    ] == [(0, int(nonblocking.handle))]


def test_arguments_of_one_producer_wait_once(mem_fake, busy, setup):
    p1, p2, consumer = ck.Stream(), ck.Stream(), ck.Stream()
    busy.update({int(p1.handle), int(p2.handle)})
    same = (CaiArray(setup.a.ptr, int(p1.handle)), CaiArray(setup.b.ptr, int(p1.handle)))
    setup.k.launch(1, 32, *same, stream=consumer)
    assert [on for _ev, on in _log(mem_fake, "record")] == [int(p1.handle)]
    two = (CaiArray(setup.a.ptr, int(p1.handle)), CaiArray(setup.b.ptr, int(p2.handle)))
    setup.k.launch(1, 32, *two, stream=consumer)
    assert [on for _ev, on in _log(mem_fake, "record")][1:] == [int(p1.handle), int(p2.handle)]
    assert len(_log(mem_fake, "wait")) == 3


def test_one_reusable_event_per_thread(mem_fake, busy, setup, monkeypatch):
    created: list[tuple[str, int]] = []
    mem = mem_fake.mem
    real_create = mem.cuEventCreate

    def create(flags: int) -> Any:
        created.append((threading.current_thread().name, flags))
        return real_create(flags)

    monkeypatch.setattr(mem, "cuEventCreate", create)
    producer, consumer = ck.Stream(), ck.Stream()
    busy.add(int(producer.handle))
    arr = CaiArray(setup.a.ptr, int(producer.handle))
    for _ in range(5):
        setup.k.launch(1, 32, arr, setup.b, stream=consumer)

    def other() -> None:
        with setup.ctx:
            setup.k.launch(1, 32, arr, setup.b, stream=consumer)

    t = threading.Thread(target=other, name="other")
    t.start()
    t.join()
    assert len(_log(mem_fake, "wait")) == 6
    assert len({ev for ev, _on in _log(mem_fake, "record")}) == 2
    assert [name for name, _ in created] == [threading.current_thread().name, "other"]
    assert all(flags == 2 for _, flags in created)  # CU_EVENT_DISABLE_TIMING


def test_prepared_launch_orders_at_every_call_until_the_argument_is_replaced(mem_fake, busy, setup):
    producer, consumer = ck.Stream(), ck.Stream()
    busy.add(int(producer.handle))
    pl = setup.k.prepare(
        1, 32, CaiArray(setup.a.ptr, int(producer.handle)), setup.b, stream=consumer
    )
    pl()
    pl()
    assert len(_log(mem_fake, "wait")) == 2
    pl.set_arg(0, setup.a)
    pl()
    assert len(_log(mem_fake, "wait")) == 2
    blocking = ck.Stream(nonblocking=False)
    busy.add(0)
    with blocking:  # prepared on the current stream: a blocking one, legacy producer skipped
        pl2 = setup.k.prepare(1, 32, CaiArray(setup.a.ptr, 1), setup.b)
    pl2()
    assert len(_log(mem_fake, "wait")) == 2
    assert mem_fake.launches[-1]["stream"] == int(blocking.handle)


def test_how_a_type_tells_its_producer_is_worked_out_once(mem_fake, busy, setup, monkeypatch):
    seen: list[type] = []
    real = interop._classify

    def counting(v: Any) -> Any:
        seen.append(type(v))
        return real(v)

    monkeypatch.setattr(interop, "_classify", counting)

    class Fresh(CaiArray):
        pass

    s = ck.Stream()
    for _ in range(3):
        setup.k.launch(1, 32, Fresh(setup.a.ptr, 1), setup.b, stream=s)
        setup.k.launch(1, 32, Fresh(setup.a.ptr, 1), 0, stream=s)
    assert seen.count(Fresh) == 1
    assert all(seen.count(t) == 1 for t in seen)  # numbers too: once per type at most


def test_dlpack_producer_is_asked_with_the_consumer_stream(mem_fake, busy, setup):
    buf = setup.a

    class Capsuled:
        """A DLPack-only producer: device memory, no CAI."""

        def __init__(self, device_type: int) -> None:
            self.device_type = device_type
            self.streams: list[Any] = []

        def __dlpack_device__(self) -> tuple[int, int]:
            return (self.device_type, 0)

        def __dlpack__(self, stream: Any = None) -> Any:
            self.streams.append(stream)
            return buf.__dlpack__(stream=-1)

    s = ck.Stream()
    dev = Capsuled(2)
    setup.k.launch(1, 32, dev, setup.b, stream=s)
    setup.k.launch(1, 32, dev, setup.b)  # legacy default: DLPack says 1
    assert [x for x in dev.streams if x is not None] == [int(s.handle), 1]
    assert as_u64(mem_fake.launches[0]["values"][0]) == buf.ptr


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def _torch_like(monkeypatch, raw_stream: Any, current: Any) -> type:
    """A tensor type whose module is "torch", and a fake torch in sys.modules."""
    cuda = types.SimpleNamespace(current_stream=current)
    c_api = types.SimpleNamespace()
    if raw_stream is not None:
        c_api._cuda_getCurrentRawStream = raw_stream
    _fake_module(monkeypatch, "torch", cuda=cuda, _C=c_api)

    class Tensor:
        is_cuda = True

        def __init__(self, ptr: int) -> None:
            self.ptr_value = ptr
            self.device = "cuda:0"

        def data_ptr(self) -> int:
            return self.ptr_value

        def get_device(self) -> int:
            return 0

    Tensor.__module__ = "torch"
    return Tensor


def test_torch_tensor_waits_for_torch_current_raw_stream(mem_fake, busy, setup, monkeypatch):
    torch_stream = ck.Stream()
    busy.add(int(torch_stream.handle))
    asked: list[int] = []

    def raw(index: int) -> int:
        asked.append(index)
        return int(torch_stream.handle)

    def public(device: Any) -> Any:
        raise AssertionError("the raw-stream query is cheaper and present")

    tensor = _torch_like(monkeypatch, raw, public)
    s = ck.Stream()
    setup.k.launch(1, 32, tensor(setup.a.ptr), setup.b, stream=s)
    assert asked == [0]
    assert _log(mem_fake, "record")[-1][1] == int(torch_stream.handle)
    assert _log(mem_fake, "wait")[-1][0] == int(s.handle)
    assert as_u64(mem_fake.launches[-1]["values"][0]) == setup.a.ptr


def test_torch_without_the_raw_query_uses_current_stream(mem_fake, busy, setup, monkeypatch):
    torch_stream = ck.Stream()
    busy.add(int(torch_stream.handle))
    devices: list[Any] = []

    def public(device: Any) -> Any:
        devices.append(device)
        return types.SimpleNamespace(cuda_stream=int(torch_stream.handle))

    tensor = _torch_like(monkeypatch, None, public)
    setup.k.launch(1, 32, tensor(setup.a.ptr), setup.b, stream=ck.Stream())
    assert devices == ["cuda:0"]
    assert _log(mem_fake, "record")[-1][1] == int(torch_stream.handle)


def test_cupy_array_waits_for_cupy_current_stream(mem_fake, busy, setup, monkeypatch):
    cupy_stream = ck.Stream()
    busy.add(int(cupy_stream.handle))
    stream_mod = types.SimpleNamespace(get_current_stream_ptr=lambda: int(cupy_stream.handle))
    cuda = types.SimpleNamespace(stream=stream_mod, get_current_stream=None)
    _fake_module(monkeypatch, "cupy", cuda=cuda)

    class ndarray:
        def __init__(self, ptr: int) -> None:
            self.data = types.SimpleNamespace(ptr=ptr, device_id=0, mem=None)

    ndarray.__module__ = "cupy"
    s = ck.Stream()
    setup.k.launch(1, 32, ndarray(setup.a.ptr), ndarray(setup.b.ptr), stream=s)
    assert [on for _ev, on in _log(mem_fake, "record")] == [int(cupy_stream.handle)]
    assert [h for h, _ev in _log(mem_fake, "wait")] == [int(s.handle)]
    assert [as_u64(v) for v in mem_fake.launches[-1]["values"]] == [setup.a.ptr, setup.b.ptr]


def test_producer_stream_reports_the_stream_of_each_kind(mem_fake, setup, monkeypatch):
    assert interop.producer_stream(CaiArray(1, 7)) == 7
    assert interop.producer_stream(CaiArray(1, None)) is None
    assert interop.producer_stream(setup.a) is None
    assert interop.producer_stream(3) is None
    tensor = _torch_like(monkeypatch, lambda index: 0x99, None)
    assert interop.producer_stream(tensor(1)) == 0x99


def test_producer_of_another_context_records_there_and_waits_here(mem_fake, busy, setup):
    c1 = ck.registry.context(1)
    with c1:
        there = ck.Stream()
    busy.add(int(there.handle))
    setup.k.launch(1, 32, CaiArray(setup.a.ptr, int(there.handle)), setup.b)  # legacy of ctx 0
    log = [(call, cur, d) for call, cur, d in mem_fake.mem.log if call in ("record", "wait")]
    (_, rec_ctx, (event, on)), (_, wait_ctx, (waiter, waited)) = log
    assert (rec_ctx, on) == (c1.handle, int(there.handle))
    assert (wait_ctx, waiter, waited) == (setup.ctx.handle, 0, event)


def test_torch_and_cupy_arrays_of_another_device_are_refused_without_peer_access(
    mem_fake, setup, monkeypatch
):
    """A kernel reading another device's memory without peer access would fault (and poison
    every context): PyTorch and CuPy arrays are checked like ctxkit buffers."""
    tensor = _torch_like(monkeypatch, lambda index: 0, None)

    class FarTensor(tensor):  # type: ignore[misc, valid-type]
        def get_device(self) -> int:
            return 1

    FarTensor.__module__ = "torch"
    stream_mod = types.SimpleNamespace(get_current_stream_ptr=lambda: 0)
    _fake_module(monkeypatch, "cupy", cuda=types.SimpleNamespace(stream=stream_mod))

    class ndarray:
        def __init__(self, ptr: int, device: int, mem: Any = None) -> None:
            self.data = types.SimpleNamespace(ptr=ptr, device_id=device, mem=mem)

    class ManagedMemory:
        pass

    ndarray.__module__ = "cupy"
    k, a, b = setup.k, setup.a, setup.b
    with pytest.raises(ck.LaunchArgumentError) as info:
        k.launch(1, 32, FarTensor(a.ptr), b)
    msg = str(info.value)
    assert "argument 0" in msg and "torch FarTensor on device 1" in msg
    assert "launches on device 0" in msg and "ck.enable_peer_access" in msg
    with pytest.raises(ck.LaunchArgumentError, match="argument 1 .* cupy ndarray on device 1"):
        k.launch(1, 32, a, ndarray(b.ptr, 1))
    with pytest.raises(ck.LaunchArgumentError, match="on device 1"):
        k.prepare(1, 32, FarTensor(a.ptr), b)
    assert mem_fake.launches == []
    k.launch(1, 32, tensor(a.ptr), ndarray(b.ptr, 0))  # the launch's own device
    k.launch(1, 32, a, ndarray(b.ptr, 1, ManagedMemory()))  # managed memory passes
    ck.enable_peer_access(setup.ctx, 1)
    k.launch(1, 32, FarTensor(a.ptr), ndarray(b.ptr, 1))  # peer access enabled: passes
    assert len(mem_fake.launches) == 3
