"""What travels between processes: pickles with out-of-band buffers, payloads sent later,
functions by name or by value, exceptions as plain data, main modules a child can re-run."""

from __future__ import annotations

import os
import sys
import threading
import types

import numpy as np
import pytest

from ctxkit.procs import wire
from tests.procs.proctools import SHM, own_blocks
from tests.support.helpers import OBJECT_DTYPES

MiB = 1 << 20


def module_level(x):
    return x


def make_closure():
    y = 2

    def inner(x):
        return x * y

    return inner


# --- encode / decode ------------------------------------------------------------------


def test_encode_keeps_small_buffers_in_band_and_moves_large_ones():
    small, large = np.arange(100), np.arange(1 << 18, dtype=np.float32)
    data, parts = wire.encode({"s": small, "l": large}, threshold=2 << 20)
    assert parts == []
    data, parts = wire.encode({"s": small, "l": large}, threshold=1 << 10)
    assert [size for _, size, _ in parts] == [large.nbytes]  # type: ignore[misc]
    assert {name for name, _, _ in parts} <= own_blocks()  # type: ignore[misc]
    out = wire.decode(data, parts)
    assert np.array_equal(out["s"], small) and np.array_equal(out["l"], large)
    out["l"][0] = 7.0  # writable, owns its memory after the name is gone
    assert own_blocks() == set()
    assert wire.encode(large, threshold=None)[1] == []


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_arrays_of_python_objects_travel_by_value_never_as_bytes(dtype):
    arr = np.empty(1 << 16, dtype)
    arr[...] = (1.5, "x") if arr.dtype.names else "x"
    data, parts = wire.encode(arr, threshold=1)
    assert parts == [] and own_blocks() == set()  # no shared-memory block of references
    out = wire.decode(data, parts)
    assert out.dtype == arr.dtype and out.tolist() == arr.tolist()


def test_encode_without_room_in_dev_shm_sends_the_buffer_through_the_pipe(monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    large = np.arange(MiB, dtype=np.float64)
    data, parts = wire.encode(large, threshold=1)
    assert [type(p) for p in parts] == [bytearray] and len(parts[0]) == large.nbytes
    assert np.array_equal(wire.decode(data, parts), large)
    assert own_blocks() == set()


def test_encode_failure_leaves_no_blocks():
    with pytest.raises(TypeError):
        wire.encode([np.zeros(4096), threading.Lock()], threshold=1)
    assert own_blocks() == set()


def test_decode_failure_consumes_the_remaining_blocks():
    data, parts = wire.encode([np.zeros(4096), np.ones(4096)], threshold=1)
    missing = parts[0][0]  # type: ignore[index]
    os.unlink(SHM / missing)
    with pytest.raises(FileNotFoundError):
        wire.decode(data, parts)
    assert own_blocks() == set()


# --- payloads: pickled at submit, blocks when sent ------------------------------------


def _room(limit):
    used = [0]

    def reserve(n):
        if used[0] + n > limit:
            return False
        used[0] += n
        return True

    def unreserve(n):
        used[0] -= n

    return reserve, unreserve, used


def test_payload_creates_blocks_only_when_asked_and_within_the_budget():
    a, b = np.ones(MiB), np.full(MiB, 2.0)  # 8 MiB each
    payload = wire.Payload.build("test", (a, b, np.arange(3)), MiB, by_value=False)
    assert [memoryview(b).nbytes for b in payload.buffers] == [8 * MiB, 8 * MiB]
    assert own_blocks() == set()  # nothing in /dev/shm until it is sent
    reserve, unreserve, used = _room(10 * MiB)
    parts, in_shm = payload.parts(reserve, unreserve)
    assert in_shm == 8 * MiB and used == [8 * MiB]
    assert isinstance(parts[0], tuple) and isinstance(parts[1], bytearray)
    x, y, z = wire.decode(payload.data, parts)
    assert float(x.sum()) == MiB and float(y.sum()) == 2 * MiB and list(z) == [0, 1, 2]
    y[0] = 5.0  # the part sent through the pipe is writable too
    assert own_blocks() == set()


def test_payload_snapshot_copies_the_callers_arrays():
    a = np.zeros(MiB)
    payload = wire.Payload.build("test", a, MiB, by_value=False)
    payload.snapshot()
    a[:] = 1.0
    reserve, unreserve, _ = _room(1 << 40)
    out = wire.decode(payload.data, payload.parts(reserve, unreserve)[0])
    assert float(out.sum()) == 0.0


def test_payload_without_room_in_dev_shm_gives_the_budget_back(monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    payload = wire.Payload.build("test", np.ones(MiB), MiB, by_value=False)
    reserve, unreserve, used = _room(1 << 40)
    parts, in_shm = payload.parts(reserve, unreserve)
    assert in_shm == 0 and used == [0] and isinstance(parts[0], bytearray)


def test_payload_of_something_unpicklable_names_the_caller():
    with pytest.raises(TypeError, match="DevicePool.submit: .* must be picklable"):
        wire.Payload.build("DevicePool.submit", threading.Lock(), MiB, by_value=False)


# --- functions by name or by value ----------------------------------------------------


def test_by_value_reason():
    assert wire.by_value_reason(module_level) == ""
    assert wire.by_value_reason(lambda: 0) == "a lambda"
    assert "nested function" in wire.by_value_reason(make_closure())
    assert wire.by_value_reason(print) == ""


def test_check_shippable_with_and_without_cloudpickle(monkeypatch):
    pytest.importorskip("cloudpickle")
    assert wire.check_shippable("x", module_level) is False
    assert wire.check_shippable("x", make_closure()) is True
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    with pytest.raises(TypeError, match="x: .* nested function .* install cloudpickle"):
        wire.check_shippable("x", make_closure())
    with pytest.raises(TypeError, match="expected a callable, got int"):
        wire.check_shippable("x", 3)


def test_closure_round_trips_by_value():
    pytest.importorskip("cloudpickle")
    fn = wire.decode(wire.dumps("x", make_closure(), by_value=True), [])
    assert fn(21) == 42


def test_check_main_accepts_files_modules_and_interactive_sessions(monkeypatch, tmp_path):
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    wire.check_main("x")  # python -c / REPL: no file to re-run, fine
    script = tmp_path / "prog.py"
    script.write_text("")
    main.__file__ = str(script)
    wire.check_main("x")
    main.__file__ = "<stdin>"
    with pytest.raises(RuntimeError, match="x: the main module '<stdin>' is not a file"):
        wire.check_main("x")
    main.__spec__ = types.SimpleNamespace(name="pkg.mod")  # type: ignore[assignment]
    wire.check_main("x")  # python -m: re-imported by name


# --- exceptions -----------------------------------------------------------------------


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling")


class StrRaises(Exception):
    def __str__(self):
        raise RuntimeError("str is broken")


def _described(exc_type, *args):
    try:
        raise exc_type(*args)
    except exc_type as exc:
        return wire.describe_exception(exc)


def test_describe_exception_survives_unpicklable_exceptions():
    desc = _described(Unpicklable, "odd")
    assert desc["pickled"] is None and desc["message"] == "odd"
    assert desc["type"].endswith("Unpicklable") and "raise exc_type" in desc["traceback"]
    assert wire.error_from(desc, 0, 1, None, 1, "t").child_exception is None
    err = wire.error_from(_described(KeyError, 1), 0, 1, None, 1, "t")
    assert isinstance(err.child_exception, KeyError)


def test_describe_exception_survives_a_str_that_raises():
    desc = _described(StrRaises)
    assert desc["message"] == "<str() of this StrRaises raised RuntimeError: str is broken>"
    assert desc["type"].endswith("StrRaises") and "Traceback" in desc["traceback"]
    err = wire.error_from(desc, 0, 123, None, 1, "task t on device 0")
    assert "task t on device 0: " in str(err) and "str is broken" in str(err)


# --- traffic counters -------------------------------------------------------------------


def test_traffic_counts_pipe_and_shared_memory_bytes_both_ways():
    large, small = np.arange(MiB // 4, dtype=np.float32), np.arange(10)
    data, parts = wire.encode((large, small), threshold=1024)
    before = wire.traffic()
    wire.count_sent(data, parts)
    out = wire.decode(data, parts)
    got = wire.traffic() - before
    assert np.array_equal(out[0], large)
    assert got.shm_bytes_sent == got.shm_bytes_received == large.nbytes
    assert got.pipe_bytes_sent == got.pipe_bytes_received == len(data) < large.nbytes
    assert got.device_buffers_sent == got.device_bytes_received == 0


def test_without_device_objects_the_plain_pickler_is_used(monkeypatch):
    def no_custom(*args, **kwargs):
        raise AssertionError("the device-aware pickler was used")

    monkeypatch.setattr(wire, "_session_pickler", no_custom)
    monkeypatch.setattr(wire.devmem, "device_types", lambda: ())
    payload = wire.Payload.build("test", (module_level, (np.arange(4),), {}), MiB, False)
    assert payload.devices is None
    fn, args, _kw = wire.decode(payload.data, [])
    assert fn is module_level and np.array_equal(args[0], np.arange(4))
