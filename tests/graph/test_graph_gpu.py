"""Explicitly built CUDA graphs on a real device: every node kind, dependency order, clones
and node types, updates (whole graph and per kernel node), capture-then-update, the error
naming what cannot be updated, and conditional while/if nodes (skipped with the reason
where the driver or bindings predate them)."""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit.graph import CONDITIONAL_DEVICE_API, Graph, GraphUpdateError, capture
from ctxkit.memory import to_device
from ctxkit.module import Module

N = 4096
BLOCK = 256
GRID = N // BLOCK

AFFINE = r"""
extern "C" __global__ void affine(float* y, float mul, float add, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = y[i] * mul + add;
    }
}
"""

CONDITIONAL = (
    CONDITIONAL_DEVICE_API
    + r"""
extern "C" __global__ void countdown(unsigned long long handle, int* counter, int* trips)
{
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const int left = --counter[0];
        trips[0] += 1;
        cudaGraphSetConditional(handle, left > 0 ? 1u : 0u);
    }
}

extern "C" __global__ void set_flag(unsigned long long handle, unsigned int value)
{
    if (threadIdx.x == 0 && blockIdx.x == 0) cudaGraphSetConditional(handle, value);
}
"""
)


@pytest.fixture
def k(ctx0) -> dict[str, ck.Kernel]:
    arch = ctx0.device.arch
    saxpy = Module.load(ck.compile(C.kernel_source("saxpy.cu"), arch=arch)).function("saxpy")
    affine = Module.load(ck.compile(AFFINE, arch=arch)).function("affine")
    return {"saxpy": saxpy, "affine": affine}


@pytest.fixture
def cond(ctx0) -> dict[str, ck.Kernel]:
    probe = Graph(context=ctx0)
    try:
        probe.conditional_handle()
    except ck.CudaError as exc:
        if exc.code == 801:
            pytest.skip(str(exc))
        raise
    finally:
        probe.close()
    mod = Module.load(ck.compile(CONDITIONAL, arch=ctx0.device.arch))
    return {name: mod.function(name) for name in ("countdown", "set_flag")}


def test_copy_memset_kernel_host_and_event_nodes(ctx0, k):
    with ctx0:
        s = ck.Stream()
        x_host = ck.pinned_empty(N, np.float32)
        out = ck.pinned_zeros(N, np.float32)
        x, y = ck.device_array(N, np.float32), ck.device_array(N, np.float32)
        done = ck.Event()
        seen: list[np.ndarray] = []
        g = Graph()
        up = g.memcpy(x, x_host)
        clear = g.memset(y, 0x3F800000, element_size=4)  # 1.0f
        run = g.kernel(k["saxpy"], GRID, BLOCK, 2.0, x, y, N, depends_on=[up, clear])
        down = g.memcpy(out, y, depends_on=run)
        note = g.host(lambda: seen.append(out.copy()), depends_on=down)
        g.event_record(done, depends_on=note)
        exe = g.instantiate()
        for step in range(3):
            x_host[:] = np.arange(N, dtype=np.float32) * (step + 1)
            exe.launch(s)
            s.synchronize()
            assert done.query()
            np.testing.assert_array_equal(out, 2.0 * x_host + 1.0)
            np.testing.assert_array_equal(seen[-1], out)
        assert len(seen) == 3


def test_a_dependency_chain_runs_in_order(ctx0, k):
    with ctx0:
        s = ck.Stream()
        base = np.arange(N, dtype=np.float32)
        y = to_device(base)
        g = Graph()
        a = g.kernel(k["affine"], GRID, BLOCK, y, 2.0, 0.0, N)
        b = g.kernel(k["affine"], GRID, BLOCK, y, 1.0, 1.0, N, depends_on=a)
        g.kernel(k["affine"], GRID, BLOCK, y, 3.0, 0.0, N, depends_on=b)
        g.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(y.to_host(), (base * 2.0 + 1.0) * 3.0)


def test_host_nodes_run_in_dependency_order(ctx0):
    with ctx0:
        s = ck.Stream()
        order: list[int] = []
        g = Graph()
        prev = None
        for i in range(5):
            prev = g.host(order.append, i, depends_on=prev)
        g.launch(s)
        g.launch(s)
        s.synchronize()
        assert order == [0, 1, 2, 3, 4] * 2


def test_clone_num_nodes_and_node_types(ctx0, k):
    with ctx0:
        y, z = to_device(np.zeros(N, np.float32)), to_device(np.zeros(N, np.float32))
        ev, earlier = ck.Event(), ck.Event()
        earlier.record()
        inner = Graph()
        inner.kernel(k["affine"], GRID, BLOCK, y, 1.0, 1.0, N)
        g = Graph()
        a = g.kernel(k["affine"], GRID, BLOCK, y, 1.0, 1.0, N)
        b = g.memset(y, 0, depends_on=a)
        c = g.memcpy(z, y, nbytes=16, depends_on=b)
        d = g.host(lambda: None, depends_on=c)
        e = g.empty(depends_on=d)
        f = g.event_record(ev, depends_on=e)
        h = g.event_wait(earlier, depends_on=f)
        g.child(inner, depends_on=h)
        want = ["kernel", "memset", "memcpy", "host", "empty", "event_record", "event_wait",
                "child"]  # fmt: skip
        assert g.num_nodes == 8 and sorted(n.type for n in g.nodes()) == sorted(want)
        copy = g.clone()
        assert copy.num_nodes == 8 and sorted(n.type for n in copy.nodes()) == sorted(want)
        assert copy.find(a).type == "kernel" and copy.find(a).handle != a.handle
        copy.instantiate().close()


def test_update_with_new_kernel_arguments_changes_the_result(ctx0, k):
    with ctx0:
        s = ck.Stream()
        y = to_device(np.ones(N, np.float32))
        g1 = Graph()
        g1.kernel(k["affine"], GRID, BLOCK, y, 2.0, 0.0, N)
        exe = g1.instantiate()
        g2 = Graph()
        g2.kernel(k["affine"], GRID, BLOCK, y, 1.0, 5.0, N)
        exe.update(g2)
        exe.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(y.to_host(), np.full(N, 6.0))


def test_set_kernel_params_in_a_loop_of_10(ctx0, k):
    with ctx0:
        s = ck.Stream()
        x = to_device(np.arange(N, dtype=np.float32))
        y = to_device(np.zeros(N, np.float32))
        g = Graph()
        node = g.kernel(k["saxpy"], GRID, BLOCK, 0.0, x, y, N)
        exe = g.instantiate()
        for i in range(10):
            y.copy_from_host(np.zeros(N, np.float32))
            exe.set_kernel_params(node, float(i + 1), x, y, N)
            exe.launch(s)
            s.synchronize()
            np.testing.assert_array_equal(y.to_host(), (i + 1) * np.arange(N, dtype=np.float32))


def test_update_with_another_topology_raises(ctx0, k):
    with ctx0:
        y = to_device(np.zeros(N, np.float32))
        g1 = Graph()
        g1.kernel(k["affine"], GRID, BLOCK, y, 1.0, 1.0, N)
        exe = g1.instantiate()
        g2 = Graph()
        a = g2.kernel(k["affine"], GRID, BLOCK, y, 1.0, 1.0, N)
        g2.kernel(k["affine"], GRID, BLOCK, y, 1.0, 1.0, N, depends_on=a)
        with pytest.raises(GraphUpdateError) as info:
            exe.update(g2)
        assert info.value.reason == "topology_changed", str(info.value)
        assert "graph.instantiate()" in str(info.value)
        exe.launch()  # still the first graph
        ctx0.synchronize()
        assert y.to_host()[0] == 1.0


def test_capture_twice_with_other_pointers_then_update(ctx0, k):
    with ctx0:
        s = ck.Stream()
        x = to_device(np.arange(N, dtype=np.float32))
        a, b = to_device(np.zeros(N, np.float32)), to_device(np.zeros(N, np.float32))
        with capture(s) as g1:
            k["saxpy"].launch(GRID, BLOCK, 1.0, x, a, N, stream=s)
        with capture(s) as g2:
            k["saxpy"].launch(GRID, BLOCK, 1.0, x, b, N, stream=s)
        assert [n.type for n in g1.nodes()] == ["kernel"]
        exe = g1.instantiate()
        exe.update(g2)
        exe.launch(s)
        s.synchronize()
        assert not a.to_host().any()
        np.testing.assert_array_equal(b.to_host(), np.arange(N, dtype=np.float32))
        g1.launch(s)  # the captured graph's own executable still writes a
        s.synchronize()
        np.testing.assert_array_equal(a.to_host(), np.arange(N, dtype=np.float32))


def test_conditional_while_counts_down_a_device_counter(ctx0, cond):
    with ctx0:
        s = ck.Stream()
        counter = to_device(np.array([6], np.int32))
        trips = to_device(np.zeros(1, np.int32))
        g = Graph()
        node, body, handle = g.conditional("while", default=1)
        body.kernel(cond["countdown"], 1, 32, handle, counter, trips)
        assert node.type == "conditional" and body.num_nodes == 1
        exe = g.instantiate()
        exe.launch(s)
        s.synchronize()
        assert counter.to_host()[0] == 0 and trips.to_host()[0] == 6
        counter.copy_from_host(np.array([3], np.int32))
        exe.launch(s)  # every launch starts from the default (1) again
        s.synchronize()
        assert counter.to_host()[0] == 0 and trips.to_host()[0] == 9


@pytest.mark.parametrize(("value", "taken"), [(1, True), (0, False), (5, True)])
def test_conditional_if_taken_and_not_taken(ctx0, k, cond, value, taken):
    with ctx0:
        s = ck.Stream()
        y = to_device(np.zeros(N, np.float32))
        g = Graph()
        h = g.conditional_handle(default=0)
        setter = g.kernel(cond["set_flag"], 1, 32, h, value)
        _node, body, _ = g.conditional("if", handle=h, depends_on=setter)
        body.kernel(k["affine"], GRID, BLOCK, y, 1.0, 1.0, N)
        g.launch(s)
        s.synchronize()
        assert y.to_host()[0] == (1.0 if taken else 0.0)
