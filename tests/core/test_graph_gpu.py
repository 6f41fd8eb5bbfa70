"""CUDA graphs on a real device: capture launches on a stream, replay them; frees made
while a capture is open (garbage collection, close(), another thread) wait for its end."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit import lifetime
from ctxkit.graph import Graph, capture
from ctxkit.memory import DeviceBuffer, to_device
from ctxkit.module import Module
from ctxkit.stream import Event, Stream
from tests.support.helpers import in_thread, is_allocated

N = 4096


@pytest.fixture
def saxpy(ctx0) -> ck.Kernel:
    obj = ck.compile(C.kernel_source("saxpy.cu"), arch=ctx0.device.arch)
    return Module.load(obj).function("saxpy")


def test_capture_and_replay_100_kernels(ctx0, saxpy):
    with ctx0:
        s = ck.Stream()
        x = to_device(np.ones(N, np.float32))
        y = to_device(np.zeros(N, np.float32))
        pl = saxpy.prepare(16, 256, 1.0, x, y, N, stream=s)
        with capture(s) as g:
            for _ in range(50):
                pl()
            for _ in range(50):
                saxpy.launch(16, 256, 1.0, x, y, N, stream=s)
        assert isinstance(g, Graph) and g.num_nodes == 100
        s.synchronize()
        assert not y.to_host().any(), "capturing must not execute the work"
        pl.set_arg(0, 5.0)  # the graph holds the arguments it captured
        for _ in range(3):
            g.launch(s)
        s.synchronize()
        assert (y.to_host() == 300.0).all()
        g.launch()  # the context's default stream
        ctx0.synchronize()
        assert (y.to_host() == 400.0).all()
        g.close()
        g.close()
        with pytest.raises(ck.CudaError, match="graph is empty"):
            g.launch(s)


def test_stream_capture_method_with_a_memset_node(ctx0, saxpy):
    with ctx0:
        s = ck.Stream()
        x = to_device(np.full(N, 2, np.float32))
        y = to_device(np.full(N, 7, np.float32))
        with ck.capture(s) as g:
            y.buffer.memset(0, stream=s)
            for _ in range(10):
                saxpy.launch(16, 256, 0.5, x, y, N, stream=s)
        assert g.num_nodes == 11
        g.launch(s)
        g.launch(s)
        s.synchronize()
        assert (y.to_host() == 10.0).all()  # reset by the memset node, then 10 x (+1)


def test_failed_capture_leaves_the_stream_usable(ctx0, saxpy):
    with ctx0:
        s = ck.Stream()
        x = to_device(np.ones(N, np.float32))
        y = to_device(np.zeros(N, np.float32))
        with pytest.raises(ck.CudaError), capture(s) as bad:
            saxpy.launch(16, 256, 1.0, x, y, N, stream=s)
            s.synchronize()  # not capturable: the capture is invalidated
        with pytest.raises(ck.CudaError, match="graph is empty"):
            bad.launch(s)
        with capture(s) as g:
            saxpy.launch(16, 256, 1.0, x, y, N, stream=s)
        g.launch(s)
        s.synchronize()
        assert (y.to_host() == 1.0).all()


def test_default_stream_cannot_be_captured(ctx0):
    with ctx0:
        with pytest.raises(ValueError, match="created stream"), capture(None):
            pass
        with pytest.raises(ValueError, match="default stream cannot be captured"), capture(0):
            pass


def test_graph_launch_binds_its_context(ctx0, saxpy):
    with ctx0:
        s = ck.Stream()
        x = to_device(np.ones(N, np.float32))
        y = to_device(np.zeros(N, np.float32))
        with capture(s) as g:
            saxpy.launch(16, 256, 3.0, x, y, N, stream=s)
    other = ck.Context.create(0)
    try:
        with other:
            g.launch()  # runs in ctx0 (the graph's context), on its default stream
        with ctx0:
            ctx0.synchronize()
            assert (y.to_host() == 3.0).all()
    finally:
        other.close()
    in_thread(g.launch, name="graph-no-ctx")  # a fresh thread: the graph binds ctx0
    with ctx0:
        ctx0.synchronize()
        assert (y.to_host() == 6.0).all()
    strict, ck.registry.strict = ck.registry.strict, True
    try:
        with pytest.raises(ck.NoCurrentContextError) as info:
            in_thread(g.launch, name="graph-no-ctx")
    finally:
        ck.registry.strict = strict
    assert "Graph.launch" in str(info.value) and "graph-no-ctx" in str(info.value)


def test_upload_before_the_first_launch(ctx0, saxpy):
    with ctx0:
        s = ck.Stream()
        x = to_device(np.ones(N, np.float32))
        y = to_device(np.zeros(N, np.float32))
        with capture(s) as g:
            saxpy.launch(16, 256, 2.0, x, y, N, stream=s)
        g.upload(s)
        s.synchronize()
        assert not y.to_host().any(), "an upload must not execute the graph"
        g.launch(s)
        g.launch(s)
        s.synchronize()
        assert (y.to_host() == 4.0).all()
        g.upload()  # the default stream
        ctx0.synchronize()


JUNK_BYTES = 64 << 20


def _cyclic_junk(ctx: ck.Context, saxpy: ck.Kernel) -> tuple[list[weakref.ref[Any]], list[int]]:
    """One object of every kind ctxkit frees, in a reference cycle: only the garbage
    collector frees them, and it runs at any allocation -- also inside a capture. Returns
    weak references to them and the device addresses of the buffers among them."""
    s = Stream()
    a, b = to_device(np.ones(32, np.float32)), to_device(np.zeros(32, np.float32))
    with capture(s) as graph:
        saxpy.launch(1, 32, 1.0, a, b, 32, stream=s)
    obj = ck.compile(C.kernel_source("saxpy.cu"), arch=ctx.device.arch)
    library, bound = Module.load(obj), Module.load(obj, context=ctx)
    library.function("saxpy")  # a Module and its Kernel refer to each other
    bound.function("saxpy")
    objects: list[Any] = [
        *(DeviceBuffer(JUNK_BYTES) for _ in range(4)),
        ck.pinned_empty(1 << 20, np.uint8),
        s,
        Event(),
        a,
        b,
        graph,
        library,
        bound,
    ]
    ptrs = [o.ptr for o in objects[:4]]
    objects.append(objects)
    return [weakref.ref(o) for o in objects[:-1]], ptrs


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_garbage_collected_inside_a_capture_is_freed_after_it(ctx0, saxpy, mode):
    """A cuMemFree (or any other free) inside the block would invalidate the capture:
    the finalizers of the objects collected there wait for its end, then free. The driver
    is asked about the buffers themselves, not the device's free memory (other processes
    of the test run use the GPU meanwhile)."""
    failed_before = len(lifetime.failed_frees())
    with ctx0:
        s = ck.Stream()
        x = to_device(np.ones(N, np.float32))
        y = to_device(np.zeros(N, np.float32))
        gc.collect()  # earlier tests' garbage: what is collected inside is known
        refs, ptrs = _cyclic_junk(ctx0, saxpy)
        assert all(is_allocated(p) for p in ptrs)
        with capture(s, mode=mode) as g:
            saxpy.launch(16, 256, 2.0, x, y, N, stream=s)
            gc.collect()
            assert all(r() is None for r in refs)
            assert lifetime.held_back_frees() >= len(refs)
            assert all(is_allocated(p) for p in ptrs), "a free ran inside the capture"
        assert lifetime.held_back_frees() == 0
        assert not any(is_allocated(p) for p in ptrs), "the frees did not run"
        g.launch(s)
        s.synchronize()
        assert (y.to_host() == 2.0).all()
    assert len(lifetime.failed_frees()) == failed_before


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_frees_in_another_thread_during_a_capture(ctx0, saxpy, mode):
    """Another thread's frees are forbidden only by a global capture: ctxkit holds them
    back then, and lets them run at once during a thread_local one."""
    failed_before = len(lifetime.failed_frees())
    with ctx0:
        s = ck.Stream()
        x = to_device(np.ones(N, np.float32))
        y = to_device(np.zeros(N, np.float32))
        holder = {"junk": [DeviceBuffer(JUNK_BYTES), Stream(), Event()]}
        gc.collect()
        with capture(s, mode=mode) as g:
            saxpy.launch(16, 256, 2.0, x, y, N, stream=s)
            before = lifetime.held_back_frees()
            t = threading.Thread(target=holder.clear, name="dropper")
            t.start()
            t.join()
            held = lifetime.held_back_frees() - before
        assert held == (3 if mode == "global" else 0)
        assert lifetime.held_back_frees() == 0
        g.launch(s)
        s.synchronize()
        assert (y.to_host() == 2.0).all()
    assert len(lifetime.failed_frees()) == failed_before
