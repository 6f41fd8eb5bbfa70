"""Interoperability with CuPy and PyTorch (each skipped when not installed): ctxkit memory
viewed by them without a copy (CUDA Array Interface and DLPack), their arrays passed to
ctxkit kernels and copies, and their streams accepted by ctxkit."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.stream import Stream, stream_handle

N = 10_007


@pytest.fixture(scope="module")
def k() -> SimpleNamespace:
    from ctxkit.compiler import kernel_source

    with ck.registry.context(0):
        scale = ck.Module.load(ck.compile(kernel_source("scale.cu")))
        fill = ck.Module.load(ck.compile(kernel_source("fill.cu")))
    return SimpleNamespace(scale=scale.function("scale_f32"), fill=fill.function("fill_f32"))


def grid(n: int) -> int:
    return (n + 255) // 256


# --- CuPy ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cp() -> Any:
    return pytest.importorskip("cupy")


def test_cupy_views_ctxkit_memory_without_copy(ctx0, cp):
    x = np.arange(N, dtype=np.float32)
    with ctx0:
        arr = ck.memory.to_device(x)
        via_cai = cp.asarray(arr)
        via_dlpack = cp.from_dlpack(arr)
        assert via_cai.data.ptr == arr.ptr and via_dlpack.data.ptr == arr.ptr
        assert via_cai.shape == (N,) and via_cai.dtype == cp.float32
        via_cai *= 2
        cp.cuda.runtime.deviceSynchronize()
        np.testing.assert_array_equal(arr.to_host(), 2 * x)
        buf_view = cp.asarray(arr.buffer)  # a buffer is exported as bytes
        assert buf_view.dtype == cp.uint8 and buf_view.size == arr.nbytes


def test_cupy_arrays_in_ctxkit_kernels_and_copies(ctx0, cp, k):
    with ctx0:
        src = cp.arange(N, dtype=cp.float32)
        dst = cp.zeros(N, dtype=cp.float32)
        k.scale.launch(grid(N), 256, src, dst, N, np.float32(4.0))
        ctx0.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(dst), 4 * np.arange(N, dtype=np.float32))
        mine = ck.device_array(N, np.float32)
        mine.copy_from(dst)  # CuPy array as a copy source
        np.testing.assert_array_equal(mine.to_host(), cp.asnumpy(dst))
        out = cp.empty(N, dtype=cp.float32)
        mine.copy_to(out)  # and as a copy target
        assert bool((out == dst).all())
        with pytest.raises(ValueError, match="shape"):
            mine.copy_to(cp.empty(N - 1, dtype=cp.float32))


def test_cupy_streams(ctx0, cp, k):
    with ctx0:
        cs = cp.cuda.Stream(non_blocking=True)
        assert int(stream_handle(cs)) == cs.ptr
        wrapped = Stream.from_handle(cs)
        assert wrapped.context is ctx0 and not wrapped.owned
        buf = ck.device_array(N, np.float32)
        host = ck.pinned_empty(N, np.float32)
        host[:] = 1.5
        buf.copy_from_host(host, stream=cs)  # a foreign stream, as is
        k.scale.launch(grid(N), 256, buf, buf, N, np.float32(2.0), stream=wrapped)
        buf.stream = cs
        assert buf.__cuda_array_interface__["stream"] == cs.ptr
        view = cp.from_dlpack(buf)  # CuPy's current stream is ordered after cs
        assert bool((view == 3.0).all())
        cs.synchronize()


def test_ctxkit_stream_to_cupy(ctx0, cp):
    with ctx0:
        s = ck.Stream()
        ext = cp.cuda.ExternalStream(s.ptr)
        with ext:
            a = cp.ones(1000, dtype=cp.float64) * 3
        s.synchronize()
        assert float(a.sum()) == 3000.0


# --- PyTorch --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch() -> Any:
    t = pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip("torch without CUDA")
    return t


def test_torch_views_ctxkit_memory_without_copy(ctx0, torch):
    x = np.arange(N, dtype=np.float32)
    with ctx0:
        arr = ck.memory.to_device(x)
        t = torch.from_dlpack(arr)
        assert t.data_ptr() == arr.ptr and t.device == torch.device("cuda", 0)
        t.mul_(3)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(arr.to_host(), 3 * x)
        t2 = torch.as_tensor(arr, device="cuda:0")  # CUDA Array Interface
        assert t2.data_ptr() == arr.ptr
        two_d = ck.memory.to_device(np.ones((97, 103), np.float32))
        t3 = torch.from_dlpack(two_d)
        assert tuple(t3.shape) == (97, 103) and t3.is_contiguous()
        assert t3.data_ptr() == two_d.ptr and float(t3.sum()) == 97 * 103


def test_torch_tensors_in_ctxkit_kernels_and_copies(ctx0, torch, k):
    with ctx0:
        src = torch.arange(N, dtype=torch.float32, device="cuda:0")
        dst = torch.empty_like(src)
        k.scale.launch(grid(N), 256, src, dst, N, np.float32(0.5))
        ctx0.synchronize()
        np.testing.assert_array_equal(dst.cpu().numpy(), 0.5 * np.arange(N, dtype=np.float32))
        mine = ck.device_array(N, np.float32)
        mine.copy_from(dst)
        out = torch.zeros_like(dst)
        mine.copy_to(out)
        torch.cuda.synchronize()
        assert torch.equal(out, dst)
        small = ck.device_array((6, 4), np.float32)
        with pytest.raises(ValueError, match="not C-contiguous"):
            small.copy_to(torch.zeros(4, 6, device="cuda:0").t())


def test_torch_streams(ctx0, torch, k):
    with ctx0:
        ts = torch.cuda.Stream(device=0)
        assert int(stream_handle(ts)) == ts.cuda_stream
        wrapped = Stream.from_handle(ts)
        assert wrapped.context is ctx0
        out = torch.empty(N, device="cuda:0")
        k.fill.launch(grid(N), 256, out, np.float32(7.0), N, stream=ts)
        ts.synchronize()
        assert float(out.sum()) == 7.0 * N


# --- stream order shortcuts: what CUDA orders by itself needs no event ---------------------

SPIN = 200_000_000  # ~0.1 s of clock64() ticks on an H200


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(producer, consumer)`` of every event wait ctxkit enqueues for a foreign array
    (none where CUDA orders the streams itself)."""
    from ctxkit.memory import interop

    seen: list[tuple[int, int]] = []
    real = interop._wait_event

    def spy(ctx: Any, event: Any, producer: int, consumer: int, stream: Any = None) -> None:
        seen.append((producer, consumer))
        real(ctx, event, producer, consumer, stream)

    monkeypatch.setattr(interop, "_wait_event", spy)
    return seen


@pytest.fixture(scope="module")
def spin() -> Any:
    from ctxkit.compiler import kernel_source

    with ck.registry.context(0):
        return ck.Module.load(ck.compile(kernel_source("spin.cu"))).function("spin")


def _assert_torch_runs_in(ctx0: ck.Context) -> None:
    """torch's legacy-stream work goes to the context current on this thread (the primary
    one if none is): a context an earlier test left current would take it out of ctx0's
    stream order, and the ordering checks below would fail for a reason not theirs."""
    from ctxkit._driver import drv

    err, cur = drv.cuCtxGetCurrent()
    assert not err and int(cur) in (0, ctx0.handle), (
        f"context {int(cur):#x} is current on this thread, not {ctx0!r}: an earlier test "
        "left it there"
    )


def _torch_default_stream_case(ctx0: ck.Context, torch: Any, k: Any, ours: ck.Stream) -> Any:
    """A tensor filled on torch's default (legacy) stream behind ~0.1 s of torch work,
    then read by a ctxkit kernel on *ours*; returns what the kernel wrote."""
    assert torch.cuda.current_stream(0).cuda_stream == 0, "torch's default is the legacy stream"
    _assert_torch_runs_in(ctx0)
    x = torch.zeros(N, device="cuda:0")
    y = torch.empty(N, device="cuda:0")
    torch.cuda._sleep(1000)  # warm-up: torch's sleep and fill kernels, ctxkit's scale
    x.fill_(0.5)
    with ctx0:
        k.scale.launch(grid(N), 256, x, y, N, np.float32(1.0), stream=ours)
    torch.cuda.synchronize()
    ours.synchronize()
    torch.cuda._sleep(SPIN)  # the device is busy; the fill below waits behind it
    x.fill_(3.0)
    with ctx0:
        k.scale.launch(grid(N), 256, x, y, N, np.float32(2.0), stream=ours)
    ours.synchronize()
    return y


def test_torch_default_stream_then_blocking_stream_needs_no_event(ctx0, torch, k, events):
    with ctx0:
        ours = ck.Stream(nonblocking=False)
    y = _torch_default_stream_case(ctx0, torch, k, ours)
    assert torch.all(y == 6.0).item(), "the kernel read the tensor before torch wrote it"
    assert events == []  # CUDA orders a blocking stream after the legacy stream itself


def test_torch_default_stream_then_non_blocking_stream_waits(ctx0, torch, k, events):
    with ctx0:
        ours = ck.Stream()  # CU_STREAM_NON_BLOCKING: no implicit order, an event is needed
    y = _torch_default_stream_case(ctx0, torch, k, ours)
    assert torch.all(y == 6.0).item(), "the kernel read the tensor before torch wrote it"
    assert (0, int(ours.handle)) in events


@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "non_blocking"])
def test_cupy_default_stream_array(ctx0, cp, k, spin, events, nonblocking):
    with ctx0:
        assert cp.cuda.get_current_stream().ptr == 0, "CuPy's default is the legacy stream"
        ours = ck.Stream(nonblocking=nonblocking)
        x = cp.zeros(N, dtype=cp.float32)
        y = cp.empty(N, dtype=cp.float32)
        x.fill(0.5)  # warm-up: CuPy's fill, ctxkit's spin and scale
        spin.launch(1, 1, 1, 0)
        k.scale.launch(grid(N), 256, x, y, N, np.float32(1.0), stream=ours)
        ctx0.synchronize()
        spin.launch(1, 1, SPIN, 0)  # the legacy default stream is busy for ~0.1 s
        x.fill(3.0)  # CuPy's default stream: after the spin
        k.scale.launch(grid(N), 256, x, y, N, np.float32(2.0), stream=ours)
        ours.synchronize()
        assert bool((y == 6.0).all()), "the kernel read the array before CuPy wrote it"
    if nonblocking:
        assert (0, int(ours.handle)) in events
    else:
        assert events == []


@pytest.mark.parametrize("non_blocking", [False, True], ids=["blocking", "non_blocking"])
def test_busy_cupy_stream_then_legacy_consumer(ctx0, cp, k, spin, events, non_blocking):
    """A CuPy array written on a busy side stream, read on the legacy default stream: a
    blocking side stream is waited for by the legacy stream itself (no event); a
    non-blocking one gets an event wait."""
    with ctx0:
        side = cp.cuda.Stream(non_blocking=non_blocking)
        x = cp.zeros(N, dtype=cp.float32)
        y = cp.empty(N, dtype=cp.float32)
        with side:
            x.fill(0.5)
            spin.launch(1, 1, 1, 0, stream=side.ptr)
            k.scale.launch(grid(N), 256, x, y, N, np.float32(1.0))
        ctx0.synchronize()
        with side:
            spin.launch(1, 1, SPIN, 0, stream=side.ptr)
            x.fill(3.0)
            k.scale.launch(grid(N), 256, x, y, N, np.float32(2.0))  # legacy default stream
        ctx0.synchronize()
        assert bool((y == 6.0).all()), "the kernel read the array before CuPy wrote it"
    if non_blocking:
        assert (side.ptr, 0) in events
    else:
        assert events == []


# --- foreign arrays in a stream capture: every mode, the producer's order kept -------------

CAPTURE_MODES = ["global", "thread_local", "relaxed"]


def _capture_scale(ctx0: ck.Context, k: Any, x: Any, y: Any, mode: str) -> None:
    """Capture ``y = 2 * x`` on a ctxkit (non-blocking) stream right after *x*'s producer
    enqueued a slow write, then replay the graph at once: the replay is ordered after the
    write only if the capture kept the producer's order."""
    with ctx0:
        s = ck.Stream()
        with ck.capture(s, mode=mode) as g:
            k.scale.launch(grid(N), 256, x, y, N, np.float32(2.0), stream=s)
        g.launch(s)
        s.synchronize()


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_torch_default_stream_tensor_into_a_capture(ctx0, torch, k, mode):
    assert torch.cuda.current_stream(0).cuda_stream == 0, "torch's default is the legacy stream"
    _assert_torch_runs_in(ctx0)
    x = torch.zeros(N, device="cuda:0")
    y = torch.zeros(N, device="cuda:0")
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)  # the legacy default stream is busy for ~0.1 s
    x.fill_(3.0)
    _capture_scale(ctx0, k, x, y, mode)
    assert torch.all(y == 6.0).item(), "the graph read the tensor before torch wrote it"


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_torch_side_stream_tensor_into_a_capture(ctx0, torch, k, mode):
    x = torch.zeros(N, device="cuda:0")
    y = torch.zeros(N, device="cuda:0")
    side = torch.cuda.Stream(device=0)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):  # torch's current stream: the producer ctxkit orders after
        torch.cuda._sleep(SPIN)
        x.fill_(3.0)
        _capture_scale(ctx0, k, x, y, mode)
    torch.cuda.synchronize()
    assert torch.all(y == 6.0).item(), "the graph read the tensor before torch wrote it"


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_cupy_default_stream_array_into_a_capture(ctx0, cp, k, spin, mode):
    with ctx0:
        assert cp.cuda.get_current_stream().ptr == 0, "CuPy's default is the legacy stream"
        x = cp.zeros(N, dtype=cp.float32)
        y = cp.zeros(N, dtype=cp.float32)
        spin.launch(1, 1, 1, 0)  # warm-up
        ctx0.synchronize()
        spin.launch(1, 1, SPIN, 0)  # the legacy default stream is busy for ~0.1 s
        x.fill(3.0)
    _capture_scale(ctx0, k, x, y, mode)
    with ctx0:  # CuPy's comparison may load a kernel: its driver calls need a context
        assert bool((y == 6.0).all()), "the graph read the array before CuPy wrote it"


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_cupy_side_stream_array_into_a_capture(ctx0, cp, k, spin, mode):
    with ctx0:
        side = cp.cuda.Stream(non_blocking=True)
        x = cp.zeros(N, dtype=cp.float32)
        y = cp.zeros(N, dtype=cp.float32)
        spin.launch(1, 1, 1, 0)  # warm-up
        ctx0.synchronize()
        with side:  # CuPy's current stream: the producer ctxkit orders after
            spin.launch(1, 1, SPIN, 0, stream=side.ptr)
            x.fill(3.0)
            _capture_scale(ctx0, k, x, y, mode)
        side.synchronize()
        assert bool((y == 6.0).all()), "the graph read the array before CuPy wrote it"


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_producer_joined_into_the_capture_is_an_edge(ctx0, cp, k, mode, events):
    """A CuPy stream forked from the capturing stream writes the input inside the capture:
    the order is a graph edge (an event wait), and the replay computes from the write."""
    with ctx0:
        side = cp.cuda.Stream(non_blocking=True)
        x = cp.zeros(N, dtype=cp.float32)
        y = cp.zeros(N, dtype=cp.float32)
        with side:
            x.fill(0.0)  # warm-up: CuPy loads its fill kernel outside the capture
        ctx0.synchronize()
        s = ck.Stream()
        fork, join = ck.Event(), ck.Event()
        with ck.capture(s, mode=mode) as g:
            fork.record(s)
            cp.cuda.runtime.streamWaitEvent(side.ptr, int(fork.handle))  # side joins
            with side:
                x.fill(3.0)
                k.scale.launch(grid(N), 256, x, y, N, np.float32(2.0), stream=s)
            join.record(side.ptr)
            s.wait(join)  # side's work is joined back before the capture ends
        g.launch(s)
        s.synchronize()
        assert bool((y == 6.0).all())
    assert (side.ptr, int(s.handle)) in events
