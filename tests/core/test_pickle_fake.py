"""Pickling and copying ctxkit objects on the simulated GPU.

Objects that own driver handles refuse ``pickle``, ``copy.copy`` and ``copy.deepcopy``
with a ``TypeError`` naming what to do instead (the fake's handles refuse pickling as
cuda.bindings' do, so nothing here passes by way of a lenient fake). Device memory is
copied on the device by ``copy.copy`` / ``copy.deepcopy``, as CuPy and numpy copy arrays.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.graph import Graph
from tests.graph.fakekernels import install
from tests.support.fakegpu import FakeGPU

N = 64
COPIERS: dict[str, Callable[[Any], Any]] = {
    "pickle": pickle.dumps,
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
}


def _graph(k: dict[str, ck.Kernel]) -> tuple[Graph, Any]:
    y = ck.device_array(N, np.float32)
    g = Graph()
    return g, g.kernel(k["affine"], 1, N, y, 2.0, 0.0, N)


MAKERS: dict[str, tuple[Callable[[dict[str, ck.Kernel]], Any], str]] = {
    "Context": (lambda k: ck.Context.create(0), "ck.registry.context(n) there"),
    "primary Context": (lambda k: ck.registry.context(0), "send the device ordinal"),
    "green Context": (lambda k: ck.Device(0).partition([16])[0], "ck.registry.context(n)"),
    "Stream": (lambda k: ck.Stream(), "make one there"),
    "Event": (lambda k: ck.Event(), "ck.export_event shares an event"),
    "Module": (lambda k: k["affine"].module, "ck.Module.load it there"),
    "Kernel": (lambda k: k["affine"], "send its ObjectCode"),
    "PreparedLaunch": (
        lambda k: k["affine"].prepare(1, N, ck.device_array(N, np.float32), 1.0, 0.0, N),
        "ck.Module.load it there",
    ),
    "Graph": (lambda k: _graph(k)[0], "build or capture the graph there"),
    "GraphNode": (lambda k: _graph(k)[1], "build or capture the graph there"),
    "GraphExec": (lambda k: _graph(k)[0].instantiate(), "build or capture the graph there"),
}


@pytest.fixture
def k(gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(gpu, "cuLaunchKernel", lambda *call: (0,), raising=False)
    with ck.registry.context(0):
        yield install(gpu)


@pytest.mark.parametrize("how", COPIERS)
@pytest.mark.parametrize("what", MAKERS)
def test_objects_owning_handles_refuse_pickling_and_copying(k, what, how):
    make, fix = MAKERS[what]
    obj = make(k)
    name = type(obj).__name__
    with pytest.raises(TypeError, match=f"a ctxkit {name} cannot be pickled or copied") as info:
        COPIERS[how](obj)
    assert "valid only in this process" in str(info.value) and fix in str(info.value)
    if what in ("Context", "green Context"):
        assert not obj.closed  # no copy exists that could close it behind the user's back
        obj.close()


def _memory(kind: str) -> Any:
    host = np.arange(N, dtype=np.float32)
    if kind == "DeviceArray":
        return ck.to_device(host)
    buf = ck.ManagedBuffer(host.nbytes) if kind == "ManagedBuffer" else ck.DeviceBuffer(host.nbytes)
    buf.copy_from_host(host)
    return buf[: host.nbytes // 2] if kind == "view" else buf


MEMORY = ("DeviceArray", "DeviceBuffer", "view", "ManagedBuffer")
CLASS = {k: k for k in MEMORY} | {"view": "DeviceBuffer"}


@pytest.mark.parametrize("kind", MEMORY)
def test_device_memory_refuses_pickling_naming_a_host_copy_and_procs(k, kind):
    with pytest.raises(TypeError, match=f"a ctxkit {CLASS[kind]} cannot be pickled: ") as info:
        pickle.dumps(_memory(kind))
    assert "copy_to_host()" in str(info.value) and "ck.procs" in str(info.value)


@pytest.mark.parametrize("how", ["copy", "deepcopy"])
@pytest.mark.parametrize("kind", MEMORY)
def test_copying_device_memory_copies_it_on_the_device(k, kind, how):
    src = _memory(kind)
    dup = COPIERS[how](src)
    assert type(dup) is type(src) and dup.context is src.context and dup.ptr != src.ptr
    assert dup.nbytes == src.nbytes
    before = src.copy_to_host()
    src.memset(0)
    np.testing.assert_array_equal(dup.copy_to_host(), before)
    if kind == "DeviceArray":
        assert dup.shape == src.shape and dup.dtype == src.dtype
    if kind == "view":
        assert dup.base is None  # a buffer of the view's bytes, not a view of the owner


def test_a_copy_inside_a_structure_is_a_copy_of_the_memory(k):
    state = {"weights": ck.to_device(np.ones(N, np.float32)), "step": 3}
    dup = copy.deepcopy(state)
    state["weights"].memset(0)
    assert dup["step"] == 3 and dup["weights"].to_host().sum() == N


def test_copy_of_a_closed_buffer_says_it_is_closed(k):
    buf = ck.DeviceBuffer(N)
    buf.close()
    with pytest.raises(ck.ContextClosedError):
        copy.deepcopy(buf)


def test_device_task_error_of_lanes_pickles_with_the_contexts_named(k):
    lane = ck.Context.create(0)
    try:
        err = ck.DeviceTaskError("lane failed", device=0, kind="exception")
        other = ck.DeviceTaskError("device 1 failed", device=1, kind="crash")
        err.failures.update({lane: err, 1: other})
        dup = pickle.loads(pickle.dumps(err))
        assert set(dup.failures) == {str(lane), 1}
        assert dup.failures[str(lane)] is dup and dup.failures[1].kind == "crash"
        assert lane in err.failures  # the original keeps its Context keys
    finally:
        lane.close()


def test_what_the_refusals_name_does_pickle(gpu):
    assert pickle.loads(pickle.dumps(ck.Device(1))) is ck.Device(1)
    obj = ck.compile(ck.kernel_source("fill.cu"), arch="sm_90", target="cubin", cache=False)
    assert pickle.loads(pickle.dumps(obj)) == obj
