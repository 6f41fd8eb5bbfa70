"""Executable graphs on the simulated GPU: update from another graph, per-node kernel
parameters, capture-then-update, and the errors naming what cannot be updated."""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import _driver
from ctxkit.graph import Graph, GraphUpdateError, capture
from ctxkit.memory import to_device
from ctxkit.stream import Stream
from tests.graph.fakekernels import f32
from tests.support.fakegpu import FakeGPU

N = 32


@pytest.fixture
def ctx(gpu: FakeGPU, monkeypatch: pytest.MonkeyPatch) -> ck.Context:
    # cuda-bindings gives no result info for a refused update: ctxkit asks libcuda
    monkeypatch.setattr(_driver, "graph_exec_update_info", gpu.graph_exec_update_info)
    return ck.registry.context(0)


def _affine_graph(k, y, mul, add):
    g = Graph()
    node = g.kernel(k["affine"], 1, 32, y, mul, add, N)
    return g, node


def test_update_from_a_graph_of_the_same_shape(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.ones(N, np.float32))
        g1, _ = _affine_graph(k, y, 2.0, 0.0)
        exe = g1.instantiate()
        g2, _ = _affine_graph(k, y, 1.0, 5.0)
        exe.update(g2)
        exe.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(y.to_host(), np.full(N, 6.0))
        assert exe.graph is g1


def test_set_kernel_params_in_a_loop(gpu, ctx, k):
    with ctx:
        s = Stream()
        x = to_device(np.arange(N, dtype=np.float32))
        ys = [to_device(np.zeros(N, np.float32)) for _ in range(2)]
        g = Graph()
        node = g.kernel(k["saxpy"], 1, 32, 0.0, x, ys[0], N)
        exe = g.instantiate()
        for i in range(10):
            y = ys[i % 2]
            y.copy_from_host(np.zeros(N, np.float32))
            exe.set_kernel_params(node, float(i), x, y, N)
            exe.launch(s)
            s.synchronize()
            np.testing.assert_array_equal(y.to_host(), i * np.arange(N, dtype=np.float32))
        assert node.args == (0.0, x, ys[0], N), "the graph itself is unchanged"
        exe.set_kernel_params(node, grid=4)  # keeps the arguments of the last call
        exe.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(ys[1].to_host(), 18 * np.arange(N, dtype=np.float32))


def test_set_kernel_params_checks_arguments_and_nodes(gpu, ctx, k):
    with ctx:
        y = to_device(np.zeros(N, np.float32))
        g, node = _affine_graph(k, y, 1.0, 1.0)
        other, foreign = _affine_graph(k, y, 1.0, 1.0)
        gap = g.empty()
        exe = g.instantiate()
        with pytest.raises(ck.LaunchArgumentError, match="takes 4 arguments but 2"):
            exe.set_kernel_params(node, y, 1.0)
        with pytest.raises(ck.LaunchArgumentError, match="argument 1"):
            exe.set_kernel_params(node, y, "x", 1.0, N)
        with pytest.raises(ValueError, match="not to the graph this executable graph"):
            exe.set_kernel_params(foreign, y, 1.0, 1.0, N)
        with pytest.raises(TypeError, match="it is a empty node"):
            exe.set_kernel_params(gap)
        with pytest.raises(TypeError, match="expected a GraphNode"):
            exe.set_kernel_params("node")  # type: ignore[arg-type]
        exe.close()
        with pytest.raises(ck.ContextClosedError):
            exe.update(other)


def test_update_with_another_topology_names_the_node(gpu, ctx, k):
    with ctx:
        y = to_device(np.zeros(N, np.float32))
        g1, _ = _affine_graph(k, y, 1.0, 1.0)
        exe = g1.instantiate()
        g2, _ = _affine_graph(k, y, 1.0, 1.0)
        extra = g2.empty()
        with pytest.raises(GraphUpdateError, match="topology differs") as info:
            exe.update(g2)
        err = info.value
        assert isinstance(err, ck.CudaError) and err.reason == "topology_changed"
        assert err.node is extra and "empty" in str(err) and "graph.instantiate()" in str(err)
        assert err.code == 910
        g3 = Graph()
        mem = g3.memset(y, 0)
        with pytest.raises(GraphUpdateError, match="type differs") as info:
            exe.update(g3)
        assert info.value.reason == "node_type_changed" and info.value.node is mem
        g4 = Graph()
        g4.kernel(k["saxpy"], 1, 32, 1.0, y, y, N)
        with pytest.raises(GraphUpdateError) as info:
            exe.update(g4)
        assert info.value.reason == "function_changed"
        with pytest.raises(TypeError, match="expected a ctxkit.Graph"):
            exe.update(object())  # type: ignore[arg-type]


def test_update_without_libcuda_still_raises_a_typed_error(gpu, ctx, k, monkeypatch):
    monkeypatch.setattr(_driver, "graph_exec_update_info", lambda exe, g: None)
    with ctx:
        y = to_device(np.zeros(N, np.float32))
        g1, _ = _affine_graph(k, y, 1.0, 1.0)
        exe = g1.instantiate()
        g2, _ = _affine_graph(k, y, 1.0, 1.0)
        g2.empty()
        with pytest.raises(GraphUpdateError, match="gave no reason") as info:
            exe.update(g2)
        assert info.value.reason == "error" and info.value.node is None
        assert info.value.code == 910 and "graph.instantiate()" in str(info.value)


def test_update_refuses_a_graph_of_another_context(gpu, ctx, k):
    with ctx:
        exe = Graph().instantiate()
    with ck.registry.context(1):
        other = Graph()
    with pytest.raises(ck.WrongContextError, match="belongs to"):
        exe.update(other)


def test_capture_twice_then_update(gpu, ctx):
    """The captured CUgraph is kept: capture the same work with other pointers and
    update the executable graph of the first capture."""
    with ctx:
        s = Stream()
        a, b = to_device(np.zeros(4, np.float32)), to_device(np.zeros(4, np.float32))

        def work(buf, value):
            ptr = buf.ptr
            gpu.launch(s, lambda: f32(ptr, 4).__setitem__(slice(None), value))

        with capture(s) as g1:
            work(a, 1.0)
        with capture(s) as g2:
            work(b, 2.0)
        assert g1.num_nodes == g2.num_nodes == 1 and g1.nodes()[0].type == "kernel"
        exe = g1.instantiate()
        exe.update(g2)
        exe.launch(s)
        s.synchronize()
        assert a.to_host().tolist() == [0.0] * 4 and b.to_host().tolist() == [2.0] * 4
        with capture(s) as g3:
            work(a, 3.0)
            work(b, 3.0)
        with pytest.raises(GraphUpdateError) as info:
            exe.update(g3)
        assert info.value.reason == "topology_changed"
        twin = g1.clone()
        assert twin.num_nodes == 1
        g1.launch(s)  # the graph made at the end of the block is still there
        s.synchronize()
        assert a.to_host().tolist() == [1.0] * 4


def test_upload_and_launch_on_the_current_stream(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.zeros(N, np.float32))
        g, _ = _affine_graph(k, y, 1.0, 1.0)
        exe = g.instantiate()
        exe.upload(s)
        with s:
            exe.launch()  # None: the current stream
        s.synchronize()
        assert y.to_host()[0] == 1.0
