"""Stream capture on the simulated GPU, which enforces the driver's capture rules
(tests/support/fakegpu.py): work on the capturing stream becomes graph nodes, an unsafe
call by a thread the mode forbids invalidates the capture. ctxkit's frees -- finalizers,
``close()``, libraries -- must wait for the end of a capture they would invalidate."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import lifetime
from ctxkit.graph import Graph, capture
from ctxkit.memory import DeviceBuffer
from ctxkit.module import Module
from ctxkit.stream import Event, Stream
from tests.support.fakegpu import FakeGPU
from tests.support.helpers import in_thread

PTX = """.version 8.0
.target sm_90
.address_size 64

.visible .entry noop()
{
    ret;
}
"""

MODES = ["thread_local", "global"]


def _counter(gpu: FakeGPU, s: Stream) -> tuple[list[int], Callable[[], None]]:
    """A fake kernel that appends to a list when it runs, and a launcher for it."""
    ran: list[int] = []
    return ran, lambda: gpu.launch(s, lambda: ran.append(1))


class Junk:
    """One ctxkit object of each kind that frees something, kept in a reference cycle
    (only the collector frees it, at any allocation), and where to see the free."""

    def __init__(self, gpu: FakeGPU, ctx: ck.Context) -> None:
        with ctx:
            buf = DeviceBuffer(256)
            host = ck.pinned_empty(64, np.uint8)
            stream = Stream()
            event = Event()
            other = Stream()
            with capture(other) as graph:
                gpu.launch(other, lambda: None)
            mod = Module.load(PTX)
            mod.function("noop")  # Module <-> Kernel: a cycle of its own
        self.gpu = gpu
        self.where = {
            "cuMemFree": (gpu.mem, buf.ptr),
            "cuMemFreeHost": (gpu.mem, host.ctypes.data),
            "cuStreamDestroy": (gpu.streams, int(stream.handle)),
            "cuEventDestroy": (gpu.events, int(event.handle)),
            "cuGraphExecDestroy": (gpu.graphs, int(graph._exec.handle)),
            "cuGraphDestroy": (gpu.graphs, int(graph.handle)),
            "cuLibraryUnload": (gpu.libraries, int(mod._handle)),
        }
        cycle: list[Any] = [buf, host, stream, event, graph, mod]
        cycle.append(cycle)
        self.refs = [weakref.ref(o) for o in (buf, host, stream, event, graph, mod)]

    def collected(self) -> bool:
        return all(r() is None for r in self.refs)

    def alive(self) -> list[str]:
        """The resources the driver still holds."""
        return [name for name, (table, key) in self.where.items() if key in table]


@pytest.fixture
def ctx(gpu: FakeGPU) -> ck.Context:
    return ck.registry.context(0)


def test_capture_records_the_work_and_replays_it(gpu, ctx):
    with ctx:
        s = Stream()
        ran, kernel = _counter(gpu, s)
        with capture(s) as g:
            kernel()
            kernel()
            assert not ran, "inside the capture the work is recorded, not run"
        s.synchronize()
        assert ran == [] and isinstance(g, Graph) and g.num_nodes == 2
        g.upload(s)
        for _ in range(3):
            g.launch(s)
        s.synchronize()
        assert len(ran) == 6
        g.launch()  # the context's legacy default stream
        ctx.synchronize()
        assert len(ran) == 8
        g.close()
        with pytest.raises(ck.CudaError, match="graph is empty"):
            g.launch(s)


def test_graph_launch_binds_its_context_in_any_thread(gpu, ctx):
    with ctx:
        s = Stream()
        ran, kernel = _counter(gpu, s)
        with capture(s) as g:
            kernel()
    with ck.registry.context(1):
        g.launch(s)
    in_thread(lambda: g.launch(s))
    with ctx:
        s.synchronize()
    assert len(ran) == 2


@pytest.mark.parametrize(
    ("unsafe", "call"),
    [
        (lambda s, ctx: s.synchronize(), "cuStreamSynchronize of the capturing stream"),
        (lambda s, ctx: s.query(), "cuStreamQuery of the capturing stream"),
        (lambda s, ctx: ctx.synchronize(), "cuCtxSynchronize"),
        (lambda s, ctx: DeviceBuffer(64), "cuMemAlloc"),
        (lambda s, ctx: s.record().synchronize(), "cuEventSynchronize of an event"),
        (lambda s, ctx: Module.load(PTX), "cuLibraryLoadData"),
    ],
    ids=["stream-sync", "stream-query", "ctx-sync", "alloc", "event-sync", "load"],
)
def test_an_unsafe_call_inside_fails_and_the_stream_stays_usable(gpu, ctx, unsafe, call):
    with ctx:
        s = Stream()
        ran, kernel = _counter(gpu, s)
        with pytest.raises(ck.CudaError, match="STREAM_CAPTURE"), capture(s) as bad:
            kernel()
            unsafe(s, ctx)
        assert any(call in why for why in gpu.invalidations), gpu.invalidations
        with pytest.raises(ck.CudaError, match="graph is empty"):
            bad.launch(s)
        with capture(s) as good:
            kernel()
        good.launch(s)
        s.synchronize()
    assert ran == [1]


def test_a_synchronous_copy_inside_invalidates(gpu, ctx):
    with ctx:
        s = Stream()
        buf = DeviceBuffer(64)
        with pytest.raises(ck.CudaError, match="STREAM_CAPTURE"), capture(s):
            buf.copy_from_host(np.ones(64, np.uint8))  # no stream: the legacy default one
    assert any("legacy default stream" in why for why in gpu.invalidations), gpu.invalidations


@pytest.mark.parametrize("mode", [*MODES, "relaxed"])
def test_an_unsafe_call_in_another_thread_invalidates_only_a_global_capture(gpu, ctx, mode):
    with ctx:
        s = Stream()
        ran, kernel = _counter(gpu, s)
        results: list[str] = []

        def other() -> None:
            try:
                ctx.synchronize()
                results.append("ok")
            except ck.CudaError as exc:
                results.append(exc.name)

        if mode == "global":
            with pytest.raises(ck.CudaError, match="STREAM_CAPTURE_INVALIDATED") as info:
                with capture(s, mode=mode):
                    kernel()
                    in_thread(other)
            assert "another thread" in str(info.value)
            assert results == ["CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"]
        else:
            with capture(s, mode=mode) as g:
                kernel()
                in_thread(other)
            assert results == ["ok"] and g.num_nodes == 1
            g.launch(s)
            s.synchronize()
            assert ran == [1]


# --- frees wait for the end of a capture they would invalidate ------------------------


@pytest.mark.parametrize("mode", MODES)
def test_objects_collected_inside_a_capture_are_freed_after_it(gpu, ctx, mode):
    before = len(lifetime.failed_frees())
    with ctx:
        s = Stream()
        ran, kernel = _counter(gpu, s)
        gc.disable()  # only the collect inside the capture may free the junk
        try:
            junk = Junk(gpu, ctx)
            assert junk.alive() == list(junk.where)
            with capture(s, mode=mode) as g:
                kernel()
                gc.collect()
                assert junk.collected()
                assert lifetime.held_back_frees() >= len(junk.where)
                assert junk.alive() == list(junk.where), "freed inside the capture"
        finally:
            gc.enable()
        assert not gpu.invalidations, gpu.invalidations
        assert junk.alive() == [] and lifetime.held_back_frees() == 0
        g.launch(s)
        s.synchronize()
    assert ran == [1] and g.num_nodes == 1
    assert len(lifetime.failed_frees()) == before


@pytest.mark.parametrize("mode", MODES)
def test_close_inside_a_capture_frees_after_it(gpu, ctx, mode):
    gc.collect()  # no garbage of earlier tests is collected inside the capture
    with ctx:
        s = Stream()
        buf, ev, other = DeviceBuffer(64), Event(), Stream()
        ptr, ev_handle, other_handle = buf.ptr, int(ev.handle), int(other.handle)
        with capture(s, mode=mode) as g:
            gpu.launch(s, lambda: None)
            buf.close()
            ev.close()
            other.close()
            assert lifetime.held_back_frees() == 3
            assert gpu.allocation(ptr) is not None
            assert ev_handle in gpu.events and other_handle in gpu.streams
        assert not gpu.invalidations and g.num_nodes == 1
        assert lifetime.held_back_frees() == 0 and gpu.allocation(ptr) is None
        assert ev_handle not in gpu.events and other_handle not in gpu.streams


@pytest.mark.parametrize("mode", MODES)
def test_context_free_inside_a_capture_waits_for_its_end(gpu, ctx, mode):
    """``Context.free`` (what close() and register_host's exit use) is held back too,
    not only the finalizers' ``free_quietly``."""
    with ctx:
        s = Stream()
        err, ptr = gpu.cuMemAlloc(64)
        assert not err
        with capture(s, mode=mode) as g:
            gpu.launch(s, lambda: None)
            ctx.free(gpu.cuMemFree, ptr)
            assert gpu.allocation(ptr) is not None
        assert not gpu.invalidations, gpu.invalidations
        assert gpu.allocation(ptr) is None and g.num_nodes == 1


@pytest.mark.parametrize("mode", MODES)
def test_frees_in_another_thread_during_a_capture(gpu, ctx, mode):
    """Another thread's free is forbidden only while a global capture is open."""
    with ctx:
        s = Stream()
        holder = {"buf": DeviceBuffer(64, context=ctx)}
        ptr = holder["buf"].ptr
        with capture(s, mode=mode) as g:
            gpu.launch(s, lambda: None)
            in_thread(lambda: holder.clear(), name="dropper")
            freed_during = gpu.allocation(ptr) is None
        assert not gpu.invalidations, gpu.invalidations
        assert freed_during == (mode == "thread_local")
        assert gpu.allocation(ptr) is None and g.num_nodes == 1


def test_a_relaxed_capture_holds_no_free_back(gpu, ctx):
    with ctx:
        s = Stream()
        buf = DeviceBuffer(64)
        ptr = buf.ptr
        with capture(s, mode="relaxed") as g:
            gpu.launch(s, lambda: None)
            del buf
            assert gpu.allocation(ptr) is None and lifetime.held_back_frees() == 0
        assert not gpu.invalidations and g.num_nodes == 1


def test_nested_captures_in_one_thread_free_at_the_outer_end(gpu, ctx):
    with ctx:
        outer, inner = Stream(), Stream()
        buf = DeviceBuffer(64)
        ptr = buf.ptr
        with capture(outer):
            gpu.launch(outer, lambda: None)
            with capture(inner):
                gpu.launch(inner, lambda: None)
                del buf
            assert gpu.allocation(ptr) is not None, "the outer capture is still open"
        assert gpu.allocation(ptr) is None and not gpu.invalidations


def test_a_free_run_by_the_collector_right_after_begin_capture_waits(gpu, ctx):
    """The garbage collector can run between ``cuStreamBeginCapture`` and the next
    Python line: the capture is marked open before it begins."""
    with ctx:
        s = Stream()
        holder = {"buf": DeviceBuffer(64)}
        ptr = holder["buf"].ptr
        gpu.after_begin_capture = holder.clear  # the last reference dies right there
        with capture(s) as g:
            gpu.launch(s, lambda: None)
            assert gpu.allocation(ptr) is not None
        assert not gpu.invalidations, gpu.invalidations
        assert gpu.allocation(ptr) is None and g.num_nodes == 1


def test_a_global_capture_waits_for_a_free_another_thread_has_begun(gpu, ctx, monkeypatch):
    """A free already inside the driver when a global capture begins would invalidate
    it: the capture begins after that free returns."""
    entered, release = threading.Event(), threading.Event()
    real_free = gpu.cuMemFree

    def slow_free(ptr: Any) -> tuple[int]:
        entered.set()
        assert release.wait(10)
        return real_free(ptr)  # the capture rules are checked as the free completes

    monkeypatch.setattr(gpu, "cuMemFree", slow_free)
    with ctx:
        s = Stream()
        buf = DeviceBuffer(64)
        ptr = buf.ptr
    freer = threading.Thread(target=buf.close, name="freer")
    freer.start()
    assert entered.wait(10)
    out: dict[str, Any] = {}

    def capturer() -> None:
        with capture(s, mode="global") as g:
            gpu.launch(s, lambda: None)
        out["graph"] = g

    t = threading.Thread(target=capturer, name="capturer")
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not lifetime._global_captures and time.monotonic() < deadline:
            time.sleep(0.001)
        assert lifetime._global_captures == 1, "the capturer never marked its capture"
        assert not gpu.captures, "cuStreamBeginCapture ran while a free was in the driver"
    finally:
        release.set()
        freer.join(10)
        t.join(10)
    assert not gpu.invalidations, gpu.invalidations
    assert out["graph"].num_nodes == 1 and gpu.allocation(ptr) is None


def test_a_capture_that_cannot_begin_holds_nothing_back(gpu, ctx):
    with ctx:
        s = Stream()
        with capture(s):
            gpu.launch(s, lambda: None)
            with pytest.raises(ck.CudaError, match="cuStreamBeginCapture"), capture(s):
                pass  # the stream is capturing already: CUDA_ERROR_ILLEGAL_STATE
        buf = DeviceBuffer(64)
        ptr = buf.ptr
        del buf
        assert gpu.allocation(ptr) is None and lifetime.held_back_frees() == 0


def test_capture_argument_errors(gpu, ctx):
    with ctx:
        with pytest.raises(ValueError, match="created stream"), capture(None):
            pass
        with pytest.raises(ValueError, match="default stream cannot be captured"), capture(0):
            pass
        with pytest.raises(ValueError, match="mode must be one of"), capture(Stream(), mode="x"):
            pass
    assert not gpu.captures
