"""Explicitly built graphs on the simulated GPU (tests/support/fakegraph.py): node
builders, dependency wiring, host nodes, child graphs, clones, lifetime and the errors a
user can hit. The fake runs unordered nodes last-added first, so a missing edge shows."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.graph import Graph, GraphExec, GraphNode
from ctxkit.graph import graph as graph_module
from ctxkit.memory import to_device
from ctxkit.stream import Event, Stream
from tests.support.fakegpu import FakeGPU  # noqa: F401
from tests.support.helpers import OBJECT_DTYPES, in_thread, object_array, object_dtype_message

N = 64


def test_h2d_memset_kernel_d2h_graph_computes_saxpy(gpu, ctx, k):
    with ctx:
        s = Stream()
        x_host = ck.pinned_empty(N, np.float32)
        out = ck.pinned_zeros(N, np.float32)
        x, y = ck.device_array(N, np.float32), ck.device_array(N, np.float32)
        g = Graph()
        up = g.memcpy(x, x_host)
        clear = g.memset(y, 0x3F800000, element_size=4)  # y = 1.0f
        run = g.kernel(k["saxpy"], 1, 64, 2.0, x, y, N, depends_on=[up, clear])
        down = g.memcpy(out, y, depends_on=run)
        assert [n.type for n in (up, clear, run, down)] == ["memcpy", "memset", "kernel", "memcpy"]
        assert g.num_nodes == 4 and g.nodes() == [up, clear, run, down]
        exe = g.instantiate()
        for step in range(3):
            x_host[:] = np.arange(N, dtype=np.float32) + step
            exe.launch(s)
            s.synchronize()
            np.testing.assert_array_equal(out, 2.0 * x_host + 1.0)


def test_dependencies_order_the_nodes(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.arange(N, dtype=np.float32))
        g = Graph()
        double = g.kernel(k["affine"], 1, 64, y, 2.0, 0.0, N)
        g.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N, depends_on=double)
        g.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(y.to_host(), np.arange(N) * 2.0 + 1.0)
        unordered = Graph()
        unordered.kernel(k["affine"], 1, 64, y, 2.0, 0.0, N)
        unordered.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        unordered.launch(s)
        s.synchronize()
        # without the edge the fake ran the later node first: (y + 1) * 2
        np.testing.assert_array_equal(y.to_host(), (np.arange(N) * 2.0 + 2.0) * 2.0)


def test_empty_and_event_nodes(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.zeros(N, np.float32))
        ev = Event()
        g = Graph()
        a = g.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        b = g.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        join = g.empty(depends_on=[a, b])
        rec = g.event_record(ev, depends_on=join)
        other = Event()
        other.record(s)
        wait = g.event_wait(other)
        assert (join.type, rec.type, wait.type) == ("empty", "event_record", "event_wait")
        assert gpu.node_kinds(g.handle) == [
            "KERNEL", "KERNEL", "EMPTY", "EVENT_RECORD", "WAIT_EVENT"
        ]  # fmt: skip
        g.launch(s)
        ev.synchronize()
        assert ev.query()
        np.testing.assert_array_equal(y.to_host(), np.full(N, 2.0))


def test_host_node_runs_at_every_launch_after_its_dependencies(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.zeros(N, np.float32))
        seen: list[str] = []
        g = Graph()
        add = g.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        g.host(lambda tag: seen.append(tag), "ran", depends_on=add)
        exe = g.instantiate()
        del g, add
        gc.collect()  # the exec keeps the callback alive
        for _ in range(3):
            exe.launch(s)
        s.synchronize()
        assert seen == ["ran"] * 3
        keys = [cb.key for cb in exe._callbacks]
        assert all(key in graph_module._callbacks for key in keys)
        exe.close()
        del exe
        gc.collect()
        assert not [key for key in keys if key in graph_module._callbacks]


def test_host_node_sees_the_kernel_before_it(gpu, ctx, k):
    with ctx:
        s = Stream()
        out = ck.pinned_zeros(N, np.float32)
        y = to_device(np.zeros(N, np.float32))
        got: list[float] = []
        g = Graph()
        add = g.kernel(k["affine"], 1, 64, y, 1.0, 5.0, N)
        down = g.memcpy(out, y, depends_on=add)
        g.host(lambda: got.append(float(out[0])), depends_on=down)
        g.launch(s)
        g.launch(s)
        s.synchronize()
        assert got == [5.0, 10.0]


def test_host_node_exception_is_raised_by_the_streams_synchronize(gpu, ctx):
    def boom() -> None:
        raise KeyError("from the host node")

    with ctx:
        s = Stream()
        g = Graph()
        g.host(boom)
        g.launch(s)
        with pytest.raises(KeyError, match="from the host node"):
            s.synchronize()
        s.synchronize()  # reported once


def test_child_graph_node_is_a_copy(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.zeros(N, np.float32))
        inner = Graph()
        inner.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        g = Graph()
        c = g.child(inner)
        g.kernel(k["affine"], 1, 64, y, 10.0, 0.0, N, depends_on=c)
        inner.kernel(k["affine"], 1, 64, y, 0.0, 0.0, N)  # not in g's copy
        assert c.type == "child" and g.num_nodes == 2
        g.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(y.to_host(), np.full(N, 10.0))
        with pytest.raises(ValueError, match="cannot contain itself"):
            g.child(g)


def test_clone_find_and_node_types(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.zeros(N, np.float32))
        g = Graph()
        first = g.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        g.memset(y, 0, depends_on=first)
        copy = g.clone()
        assert copy.num_nodes == 2 and [n.type for n in copy.nodes()] == ["kernel", "memset"]
        mine = copy.find(first)
        assert mine.graph is copy and mine is not first and mine.args == first.args
        assert copy.find(mine) is mine
        with pytest.raises(ValueError, match="not a node of the graph this one was cloned"):
            g.find(mine)
        mine.set_params(y, 1.0, 7.0, N)
        exe = g.instantiate()
        exe.launch(s)
        s.synchronize()
        assert y.to_host()[0] == 0.0  # g ends with the memset
        one = Graph()
        only = one.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        two = one.clone()
        two.find(only).set_params(y, 1.0, 7.0, N)
        exe = one.instantiate()
        exe.update(two)
        exe.launch(s)
        s.synchronize()
        assert y.to_host()[0] == 7.0


def test_node_set_params_changes_the_graph_not_its_executables(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.zeros(N, np.float32))
        g = Graph()
        node = g.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        old = g.instantiate()
        node.set_params(y, 1.0, 100.0, N)
        assert node.args == (y, 1.0, 100.0, N)
        old.launch(s)
        s.synchronize()
        assert y.to_host()[0] == 1.0
        g.launch(s)  # the graph's own executable is instantiated again after the change
        s.synchronize()
        assert y.to_host()[0] == 101.0
        node.set_params(grid=2)  # the arguments are kept
        assert node.args == (y, 1.0, 100.0, N) and "grid=(2, 1, 1)" in repr(node)


def test_graph_binds_its_context_in_any_thread(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.zeros(N, np.float32))
        g = Graph()
    assert gpu.graphs[int(g.handle)].ctx == ctx.handle
    in_thread(lambda: g.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N))
    with ck.registry.context(1):
        exe = g.instantiate()
        exe.launch(s)
    in_thread(lambda: exe.launch(s))
    with ctx:
        s.synchronize()
    assert y.to_host()[0] == 2.0
    g.upload(s)  # instantiates the graph's own executable graph, binding its context
    strict, ck.registry.strict = ck.registry.strict, True
    try:
        with pytest.raises(ck.NoCurrentContextError, match="GraphExec.launch"):
            in_thread(lambda: exe.launch(s))
        with pytest.raises(ck.NoCurrentContextError, match="Graph.launch"):
            in_thread(lambda: g.launch(s))
        with pytest.raises(ck.NoCurrentContextError, match="Graph.upload"):
            in_thread(lambda: g.upload(s))
        with pytest.raises(ck.NoCurrentContextError, match=r"Graph\(\)"):
            in_thread(Graph)
    finally:
        ck.registry.strict = strict


def test_graph_keeps_kernel_arguments_alive_and_frees_in_its_context(gpu, ctx, k):
    with ctx:
        y = ck.DeviceBuffer(N * 4)
        ref = weakref.ref(y)
        g = Graph()
        g.kernel(k["affine"], 1, 64, y, 1.0, 1.0, N)
        exe = g.instantiate()
        handle, exec_handle = int(g.handle), int(exe.handle)
        del y, g
        gc.collect()
        assert ref() is not None, "the executable graph needs the buffer"
        del exe
        gc.collect()
    assert ref() is None
    assert handle not in gpu.graphs and exec_handle not in gpu.graphs


def test_close_and_repr(gpu, ctx, k):
    with ctx:
        g = Graph()
        g.empty()
        exe = g.instantiate()
        assert "1 nodes not instantiated" in repr(g) and "GraphExec" in repr(exe)
        g.close()
        g.close()
        assert g.closed and "Graph 1 nodes empty" in repr(g)
        with pytest.raises(ck.ContextClosedError, match="Graph.empty: the graph cannot be used"):
            g.empty()
        with pytest.raises(ck.CudaError, match="graph is empty"):
            g.launch()
        exe.launch()  # an executable graph lives on its own
        exe.close()
        assert exe.closed
        with pytest.raises(ck.ContextClosedError, match="executable graph was closed"):
            exe.set_kernel_params(GraphNode(g, 0, "kernel"))


def test_debug_dot_writes_the_graph(gpu, ctx, tmp_path: Path):
    with ctx:
        g = Graph()
        a = g.empty()
        g.empty(depends_on=a)
        g.debug_dot(tmp_path / "g.dot")
    text = (tmp_path / "g.dot").read_text()
    assert "EMPTY" in text and "n0 -> n1" in text


# --- bad input -------------------------------------------------------------------------


def test_depends_on_must_be_nodes_of_the_same_graph(gpu, ctx):
    with ctx:
        a, b = Graph(), Graph()
        na = a.empty()
        with pytest.raises(ValueError, match="belongs to another graph"):
            b.empty(depends_on=na)
        with pytest.raises(TypeError, match="not a GraphNode"):
            b.empty(depends_on=[object()])
        with pytest.raises(TypeError, match="depends_on must be a GraphNode"):
            b.empty(depends_on=3)
        assert b.num_nodes == 0


def test_kernel_argument_mismatch_is_refused_before_the_driver(gpu, ctx, k):
    with ctx:
        y = to_device(np.zeros(N, np.float32))
        g = Graph()
        with pytest.raises(ck.LaunchArgumentError, match="takes 4 arguments but 3"):
            g.kernel(k["affine"], 1, 64, y, 1.0, 1.0)
        with pytest.raises(ck.LaunchArgumentError, match="argument 1"):
            g.kernel(k["affine"], 1, 64, y, y, 1.0, N)
        with pytest.raises(TypeError, match="ctxkit Kernel"):
            g.kernel("affine", 1, 64)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="grid dimensions"):
            g.kernel(k["affine"], 0, 64, y, 1.0, 1.0, N)
        assert g.num_nodes == 0


def test_memcpy_refuses_pageable_host_memory_and_bad_sizes(gpu, ctx):
    with ctx:
        d = ck.device_array(N, np.float32)
        g = Graph()
        with pytest.raises(ck.PageableCopyError, match="pinned_empty"):
            g.memcpy(d, np.zeros(N, np.float32))
        with pytest.raises(ValueError, match="pass nbytes="):
            g.memcpy(d, ck.pinned_empty(N // 2, np.float32))
        with pytest.raises(ValueError, match="exceeds the source"):
            g.memcpy(d, ck.pinned_empty(N // 2, np.float32), nbytes=N * 4)
        with pytest.raises(ValueError, match="nothing to copy"):
            g.memcpy(d, d, nbytes=0)
        with pytest.raises(ValueError, match="both sides are host memory"):
            g.memcpy(ck.pinned_empty(4, np.uint8), ck.pinned_empty(4, np.uint8))
        ro = ck.pinned_empty(N, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            g.memcpy(ro, d)
        assert g.memcpy(d, d, nbytes=8).type == "memcpy"


def test_memset_checks_value_count_and_element_size(gpu, ctx):
    with ctx:
        d = ck.DeviceBuffer(16)
        g = Graph()
        with pytest.raises(ValueError, match="element_size must be 1, 2 or 4"):
            g.memset(d, 0, element_size=8)
        with pytest.raises(ValueError, match="does not fit 1 byte"):
            g.memset(d, 256)
        with pytest.raises(ValueError, match="exceed the destination"):
            g.memset(d, 0, count=5, element_size=4)
        with pytest.raises(TypeError, match="dst must be device memory"):
            g.memset(np.zeros(4, np.uint8), 0)
        with pytest.raises(ValueError, match="not a whole number"):
            g.memset(ck.DeviceBuffer(6), 0, element_size=4)


def test_objects_of_another_context_are_refused(gpu, ctx):
    other = ck.registry.context(1)
    with other:
        foreign_buf = ck.DeviceBuffer(64)
        foreign_ev = Event()
        foreign_graph = Graph()
    with ctx:
        g = Graph()
        with pytest.raises(ck.WrongContextError, match="belongs to"):
            g.memcpy(ck.DeviceBuffer(64), foreign_buf)
        with pytest.raises(ck.WrongContextError, match="create the event in the graph"):
            g.event_record(foreign_ev)
        g.event_wait(foreign_ev)  # waiting for another context's event is allowed
        with pytest.raises(ck.WrongContextError, match="build both in one context"):
            g.child(foreign_graph)
        with pytest.raises(TypeError, match="ctxkit.Event"):
            g.event_record(object())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="must be callable"):
            g.host(3)


def test_instantiate_failure_is_a_cuda_error(gpu, ctx, monkeypatch):
    with ctx:
        g = Graph()
        monkeypatch.setattr(gpu, "cuGraphInstantiate", lambda h, f: (1, None))
        with pytest.raises(ck.CudaError, match="cuGraphInstantiate"):
            g.instantiate()


def test_host_callbacks_of_another_thread_are_independent(gpu, ctx):
    """Two graphs' host nodes have their own keys: each runs its own callback."""
    with ctx:
        s = Stream()
        hits: list[str] = []
        lock = threading.Lock()

        def note(tag: str) -> None:
            with lock:
                hits.append(tag)

        a, b = Graph(), Graph()
        a.host(note, "a")
        b.host(note, "b")
        b.launch(s)
        a.launch(s)
        s.synchronize()
    assert hits == ["b", "a"]
    assert isinstance(a.instantiate(), GraphExec)


@pytest.mark.parametrize("dtype", OBJECT_DTYPES)
def test_memcpy_nodes_refuse_python_objects(gpu, ctx, dtype):
    arr = object_array(dtype, 4 * N)
    with ctx:
        d = ck.device_array(N, np.float32)
        g = Graph()
        for call in (lambda: g.memcpy(d, arr), lambda: g.memcpy(arr, d)):
            with pytest.raises(TypeError, match=object_dtype_message(dtype)):
                call()
        assert g.num_nodes == 0
