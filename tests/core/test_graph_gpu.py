"""CUDA graphs on a real device: capture launches on a stream, replay them."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit import lifetime
from ctxkit.memory import to_device
from ctxkit.module import Graph, Module, capture

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
    errors: list[BaseException] = []

    def worker() -> None:  # a fresh thread truly has no current context
        try:
            g.launch()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker, name="graph-no-ctx")
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ck.NoCurrentContextError), errors
    assert "Graph.launch" in str(errors[0]) and "graph-no-ctx" in str(errors[0])


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


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_garbage_collected_inside_a_capture_is_freed_after_it(ctx0, saxpy, mode):
    """A cuMemFree inside the block would invalidate the capture; the finalizers of
    buffers collected there (cyclic garbage here, as gc can run at any allocation) wait."""
    import gc
    import weakref

    with ctx0:
        s = ck.Stream()
        x = to_device(np.ones(N, np.float32))
        y = to_device(np.zeros(N, np.float32))
        junk = [ck.DeviceBuffer(1 << 20) for _ in range(4)]
        junk.append(junk)  # a reference cycle: only the collector frees it
        ref = weakref.ref(junk[0])
        del junk
        with capture(s, mode=mode) as g:
            saxpy.launch(16, 256, 2.0, x, y, N, stream=s)
            gc.collect()
            assert ref() is None
        g.launch(s)
        s.synchronize()
        assert (y.to_host() == 2.0).all()
    assert lifetime.failed_frees() == []
