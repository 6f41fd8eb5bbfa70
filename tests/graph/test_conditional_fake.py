"""Conditional nodes on the simulated GPU: a while loop counting down a device counter,
an if node taken and not taken, both cuGraphAddNode forms, and the not-supported error."""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import _driver
from ctxkit.graph import CONDITIONAL_DEVICE_API, ConditionalHandle, Graph
from ctxkit.memory import to_device
from ctxkit.stream import Stream
from tests.support.fakegpu import FakeGPU  # noqa: F401


def _countdown(k, start: int):
    counter = to_device(np.array([start], np.int32))
    trips = to_device(np.zeros(1, np.int32))
    g = Graph()
    node, body, handle = g.conditional("while", default=1)
    body.kernel(k["countdown"], 1, 1, handle, counter, trips)
    return g, node, body, handle, counter, trips


@pytest.mark.parametrize("major", [12, 13])
def test_while_loop_counts_down_a_device_counter(gpu, ctx, k, monkeypatch, major):
    monkeypatch.setattr(_driver, "BINDINGS_VERSION", (major, 9))
    gpu.bindings_major = major
    with ctx:
        s = Stream()
        g, node, body, handle, counter, trips = _countdown(k, 5)
        assert isinstance(handle, ConditionalHandle) and handle.kind == "while"
        assert node.type == "conditional" and g.num_nodes == 1 and body.num_nodes == 1
        assert "Graph body 1 nodes" in repr(body)
        exe = g.instantiate()
        exe.launch(s)
        s.synchronize()
        assert counter.to_host()[0] == 0 and trips.to_host()[0] == 5
        counter.copy_from_host(np.array([3], np.int32))
        exe.launch(s)  # the handle starts from its default again
        s.synchronize()
        assert trips.to_host()[0] == 8


def test_if_node_taken_and_not_taken(gpu, ctx, k):
    with ctx:
        s = Stream()
        y = to_device(np.zeros(8, np.float32))
        for value, want in ((1, 1.0), (0, 1.0), (7, 2.0)):
            g = Graph()
            h = g.conditional_handle(default=0)
            setter = g.kernel(k["set_flag"], 1, 1, h, value)
            _node, body, same = g.conditional("if", handle=h, depends_on=setter)
            assert same is h and h.kind == "if"
            body.kernel(k["affine"], 1, 8, y, 1.0, 1.0, 8)
            g.launch(s)
            s.synchronize()
            assert y.to_host()[0] == want, (value, want)


def test_a_handle_of_another_graph_is_refused(gpu, ctx):
    with ctx:
        a, b = Graph(), Graph()
        h = a.conditional_handle()
        with pytest.raises(ValueError, match="was made for"):
            b.conditional("if", handle=h)
        with pytest.raises(TypeError, match="must be a ConditionalHandle"):
            b.conditional("if", handle=5)  # type: ignore[arg-type]
        assert int(h) == int(h.handle) and "ConditionalHandle" in repr(h)


def test_conditional_argument_errors(gpu, ctx):
    with ctx:
        g = Graph()
        with pytest.raises(ValueError, match="kind must be 'if' or 'while'"):
            g.conditional("switch")
        with pytest.raises(ValueError, match="unsigned 32-bit"):
            g.conditional("if", default=-1)
        _node, body, _handle = g.conditional("while")
        with pytest.raises(ValueError, match="instantiate the graph that holds it"):
            body.instantiate()
        with pytest.raises(ck.CudaError, match="graph is empty"):
            body.launch()
        g.close()
        with pytest.raises(ck.ContextClosedError, match="conditional body was closed"):
            body.empty()


def test_not_supported_names_the_missing_piece(gpu, ctx, monkeypatch):
    with ctx:
        g = Graph()
        monkeypatch.setattr(gpu, "cuDriverGetVersion", lambda: (0, 12030))
        with pytest.raises(
            ck.CudaError, match="CUDA 12.4 driver or newer; this driver is CUDA 12.3"
        ) as info:
            g.conditional("while")
        assert info.value.code == 801 and info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
        monkeypatch.setattr(gpu, "cuGraphConditionalHandleCreate", None)  # older bindings
        with pytest.raises(ck.CudaError, match="cuda-bindings with cuGraphConditionalHandleCreate"):
            g.conditional("if")
        assert g.num_nodes == 0


def test_device_api_declares_the_setter():
    assert "cudaGraphSetConditional" in CONDITIONAL_DEVICE_API
    assert "unsigned long long cudaGraphConditionalHandle" in CONDITIONAL_DEVICE_API


def test_a_graph_with_a_handle_argument_is_freed_without_the_collector(gpu, ctx, k):
    import gc
    import weakref

    with ctx:
        counter = to_device(np.array([1], np.int32))
        g = Graph()
        h = g.conditional_handle()
        g.kernel(k["countdown"], 1, 1, h, counter, counter)
        ref, handle = weakref.ref(g), int(g.handle)
        gc.disable()
        try:
            del g, h
            assert ref() is None and handle not in gpu.graphs
        finally:
            gc.enable()
