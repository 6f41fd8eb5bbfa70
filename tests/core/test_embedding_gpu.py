"""Embedding next to PyTorch and CuPy: foreign arrays are used in their producer's stream
order, ``with stream:`` makes a current stream, objects bind their own context in any
thread (strict mode refuses), stream-ordered allocation from memory pools.

Every kernel (ctxkit's and the framework's) is launched once before the timed part: a
first launch can wait for lazy loading, which idles the device and hides a race.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.compiler import kernel_source

N = 1 << 20
SPIN = 200_000_000  # ~0.1 s of clock64() ticks on an H200


@pytest.fixture(scope="module")
def k() -> SimpleNamespace:
    with ck.registry.context(0):
        scale = ck.Module.load(ck.compile(kernel_source("scale.cu"))).function("scale_f32")
        spin = ck.Module.load(ck.compile(kernel_source("spin.cu"))).function("spin")
    return SimpleNamespace(scale=scale, spin=spin)


def grid(n: int) -> int:
    return (n + 255) // 256


def in_thread(fn: Any) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, name="no-context")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


# --- producer stream order ------------------------------------------------------------


def test_torch_tensor_written_on_a_busy_torch_stream(ctx0, k):
    torch = pytest.importorskip("torch")
    x = torch.zeros(N, device="cuda")
    y = torch.empty(N, device="cuda")
    side = torch.cuda.Stream()
    ours = ck.Stream(ctx0)
    k.scale.launch(grid(N), 256, x, y, N, np.float32(1.0), stream=ours)  # warm-up
    k.spin.launch(1, 1, 1, 0, stream=side.cuda_stream)
    x.fill_(0.5)
    torch.cuda.synchronize()
    ours.synchronize()
    with torch.cuda.stream(side):
        k.spin.launch(1, 1, SPIN, 0, stream=side.cuda_stream)  # torch's stream is busy
        x.fill_(3.0)  # ... so the fill runs ~0.1 s from now
        k.scale.launch(grid(N), 256, x, y, N, np.float32(2.0), stream=ours)
    ours.synchronize()
    assert torch.all(y == 6.0).item(), "the ctxkit kernel read the tensor before torch wrote it"


def test_cupy_array_written_on_a_busy_cupy_stream(ctx0, k):
    cp = pytest.importorskip("cupy")
    with ctx0:
        x = cp.zeros(N, dtype=cp.float32)
        y = cp.empty(N, dtype=cp.float32)
        side = cp.cuda.Stream(non_blocking=True)
        ours = ck.Stream(ctx0)
        with side:
            x.fill(0.5)  # loads CuPy's fill kernel now, not in the timed part
            k.spin.launch(1, 1, 1, 0, stream=side.ptr)
        k.scale.launch(grid(N), 256, x, y, N, np.float32(1.0), stream=ours)
        side.synchronize()
        ours.synchronize()
        with side:
            k.spin.launch(1, 1, SPIN, 0, stream=side.ptr)
            x.fill(3.0)
            k.scale.launch(grid(N), 256, x, y, N, np.float32(2.0), stream=ours)
        ours.synchronize()
        assert bool((y == 6.0).all()), "the ctxkit kernel read the array before CuPy wrote it"


class CaiOnly:
    """A CUDA Array Interface v3 producer whose pending writes are on ``stream``."""

    def __init__(self, buf: ck.DeviceArray, stream: ck.Stream) -> None:
        self._buf, self._stream = buf, stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = dict(self._buf.__cuda_array_interface__)
        cai["stream"] = self._stream.ptr
        return cai


def test_cai_object_with_a_stream_entry(ctx0, k):
    with ctx0:
        producer, ours = ck.Stream(), ck.Stream()
        x = ck.memory.to_device(np.zeros(N, np.float32))
        y = ck.device_array(N, np.float32)
        fill = ck.Module.load(ck.compile(kernel_source("fill.cu"))).function("fill_f32")
        fill.launch(grid(N), 256, x, np.float32(0.5), N, stream=producer)
        k.scale.launch(grid(N), 256, CaiOnly(x, producer), y, N, np.float32(1.0), stream=ours)
        producer.synchronize()
        ours.synchronize()
        k.spin.launch(1, 1, SPIN, 0, stream=producer)
        fill.launch(grid(N), 256, x, np.float32(3.0), N, stream=producer)
        k.scale.launch(grid(N), 256, CaiOnly(x, producer), y, N, np.float32(2.0), stream=ours)
        ours.synchronize()
        assert np.all(y.to_host() == 6.0)


def test_copy_from_a_torch_tensor_follows_torch_stream(ctx0, k):
    torch = pytest.importorskip("torch")
    x = torch.zeros(N, device="cuda")
    side = torch.cuda.Stream()
    x.fill_(0.5)
    torch.cuda.synchronize()
    with ctx0:
        dst = ck.device_array(N, np.float32)
        with torch.cuda.stream(side):
            k.spin.launch(1, 1, SPIN, 0, stream=side.cuda_stream)
            x.fill_(3.0)
            dst.copy_from(x)
        assert np.all(dst.to_host() == 3.0)


# --- current stream -------------------------------------------------------------------


def test_with_stream_makes_it_current_and_stream_none_uses_it(ctx0, k):
    with ctx0:
        s = ck.Stream()
        flag = ck.memory.to_device(np.zeros(1, np.int32))
        assert ck.current_stream().ptr == 0  # the legacy default stream
        with s:
            assert ck.current_stream() is s
            k.spin.launch(1, 1, SPIN, flag)  # stream=None: on s, returns at once
            assert not s.query()
            host = flag.to_host()  # a copy with stream=None runs on s and waits for it
        assert host[0] == 1
        assert ck.current_stream().ptr == 0


def test_current_stream_nests_restores_on_error_and_is_per_thread(ctx0):
    with ctx0:
        a, b = ck.Stream(), ck.Stream()
        with a:
            with b:
                assert ck.current_stream() is b
                assert in_thread(lambda: ck.current_stream(ctx0).ptr) == 0
            assert ck.current_stream() is a
            with pytest.raises(RuntimeError), b:
                raise RuntimeError("boom")
            assert ck.current_stream() is a
        assert ck.current_stream().ptr == 0


def test_with_stream_binds_its_context_in_a_fresh_thread(ctx0, k):
    with ctx0:
        s = ck.Stream()
        out = ck.memory.to_device(np.ones(N, np.float32))

    def work() -> float:
        with s:
            assert ck.current_context() is ctx0
            k.scale.launch(grid(N), 256, out, out, N, np.float32(3.0))
            return float(out.to_host()[7])

    assert in_thread(work) == 3.0


def test_wrap_a_torch_stream_runs_in_torch_order(ctx0, k):
    torch = pytest.importorskip("torch")
    x = torch.zeros(N, device="cuda")
    side = torch.cuda.Stream()
    x.fill_(1.0)
    torch.cuda.synchronize()
    with torch.cuda.stream(side), ck.Stream.wrap(torch.cuda.current_stream()) as s:
        assert s.ptr == side.cuda_stream
        k.spin.launch(1, 1, SPIN, 0)
        k.scale.launch(grid(N), 256, x, x, N, np.float32(5.0))
    side.synchronize()
    assert torch.all(x == 5.0).item()


# --- objects bind their own context ---------------------------------------------------


def test_objects_work_from_a_thread_with_no_context(ctx0, k):
    with ctx0:
        buf = ck.memory.to_device(np.arange(N, dtype=np.float32))
        ev = ck.Event()
        s = ck.Stream()
        mod = ck.Module.load(ck.compile(kernel_source("scale.cu")))

    def work() -> np.ndarray:
        assert ck.current_context() is None
        ev.record(s)
        s.synchronize()
        ev.synchronize()
        fn = mod.function("scale_f32")
        fn.launch(grid(N), 256, buf, buf, N, np.float32(2.0), stream=s)
        s.synchronize()
        return buf.to_host()

    np.testing.assert_array_equal(in_thread(work), 2 * np.arange(N, dtype=np.float32))


def test_strict_mode_refuses_implicit_binds(ctx0, monkeypatch):
    with ctx0:
        buf = ck.memory.to_device(np.zeros(8, np.float32))
        ev, s = ck.Event(), ck.Stream()
    monkeypatch.setattr(ck.registry, "strict", True)
    for op in (buf.to_host, lambda: ev.record(s), s.synchronize):
        with pytest.raises(ck.NoCurrentContextError, match="ctxkit.bind"):
            in_thread(op)
    with pytest.raises(ck.NoCurrentContextError):
        in_thread(lambda: ck.DeviceBuffer(16))  # nothing to infer from, strict or not


def test_new_buffer_with_nothing_current_still_raises(ctx0):
    with pytest.raises(ck.NoCurrentContextError, match="DeviceBuffer"):
        in_thread(lambda: ck.DeviceBuffer(16))


# --- stream-ordered allocation --------------------------------------------------------


def test_stream_ordered_buffer_round_trip_and_pool_accounting(ctx0, k):
    with ctx0:
        pool = ck.MemoryPool.default(0)
        s = ck.Stream()
        pool.trim()  # blocks other tests left in ctxkit's cache count as used
        used0 = pool.used_bytes
        x = np.arange(N, dtype=np.float32)
        buf = ck.DeviceBuffer(x.nbytes, stream=s)
        assert buf.stream is s
        assert pool.used_bytes >= used0 + x.nbytes
        arr = buf.view((N,), np.float32)
        host = ck.pinned_empty(N, np.float32)
        host[:] = x
        arr.copy_from_host(host, stream=s)
        k.scale.launch(grid(N), 256, arr, arr, N, np.float32(2.0), stream=s)
        got = arr.copy_to_host(ck.pinned_empty(N, np.float32), stream=s)
        s.synchronize()
        np.testing.assert_array_equal(got, 2 * x)
        buf.close()
        assert pool.cached_bytes >= x.nbytes  # kept for reuse on s, like torch's allocator
        pool.trim()
        assert pool.used_bytes == used0


def test_buffer_inside_with_stream_is_stream_ordered(ctx0):
    with ctx0:
        s = ck.Stream()
        with s:
            buf = ck.DeviceBuffer(1 << 20)
        assert buf.stream is s
        buf.close()


def test_private_pool_threshold_trim_and_close(ctx0):
    with ctx0:
        pool = ck.MemoryPool(0, release_threshold=64 << 20)
        assert pool.release_threshold == 64 << 20
        s = ck.Stream()
        bufs = [pool.allocate(8 << 20, stream=s) for _ in range(4)]
        assert pool.used_bytes == 32 << 20 and pool.reserved_bytes >= 32 << 20
        for b in bufs:
            b.close()
        assert pool.cached_bytes == 32 << 20 and pool.used_bytes == 32 << 20
        ck.memory.alloc.flush(device=0, sync=True)
        assert pool.used_bytes == 0 and pool.reserved_bytes >= 32 << 20  # kept: threshold
        pool.trim(0)
        assert pool.reserved_bytes == 0
        pool.close()
        with pytest.raises(ck.ContextClosedError):
            _ = pool.used_bytes


def test_pool_of_another_library_by_handle(ctx0):
    with ctx0:
        default = ck.MemoryPool.default(0)
        wrapped = ck.MemoryPool.from_handle(int(default.handle), 0)
        assert wrapped.used_bytes == default.used_bytes and not wrapped.owned


def test_stream_ordered_free_from_another_thread_and_by_gc(ctx0):
    import gc

    gc.collect()  # buffers earlier tests dropped would be freed inside the count below
    failed = len(ck.lifetime.failed_frees())
    with ctx0:
        s = ck.Stream()
        pool = ck.MemoryPool.default(0)
        pool.trim()
        used0 = pool.used_bytes
        buf = ck.DeviceBuffer(4 << 20, stream=s)
        in_thread(buf.close)
        other = ck.DeviceBuffer(4 << 20, stream=s)
        del other
        gc.collect()
        assert pool.cached_bytes >= 4 << 20
        pool.trim()
        assert pool.used_bytes == used0
        assert ck.lifetime.failed_frees()[failed:] == []


def test_a_buffer_collected_while_a_worker_thread_starts_is_freed(ctx0, monkeypatch):
    """The collector may free a buffer while a new ctxkit thread (a pipeline's or an
    executor's) builds its context state: the free is made, none fails."""
    from ctxkit import context as context_mod
    from ctxkit._driver import drv

    with ctx0:
        held = [ck.DeviceBuffer(1 << 20)]
    ptr = int(held[0].ptr)

    class CollectingState(context_mod._ThreadState):
        __slots__ = ()

        def __init__(self) -> None:
            held.clear()  # the last reference goes at this allocation, as in a collection
            super().__init__()

    monkeypatch.setattr(context_mod, "_ThreadState", CollectingState)
    failed = len(ck.lifetime.failed_frees())
    with ck.ContextExecutor(ctx0, max_workers=1) as ex:
        ex.submit(int).result()
    assert held == [] and ck.lifetime.failed_frees()[failed:] == []
    with ctx0:
        err, _ = drv.cuPointerGetAttribute(
            drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr
        )
    assert int(err) != 0, "the buffer's memory is still allocated"


def test_stream_ordered_free_returns_while_the_device_is_busy(ctx0, k):
    import time

    with ctx0:
        busy, s = ck.Stream(), ck.Stream()
        k.spin.launch(1, 1, 1, 0, stream=busy)
        busy.synchronize()
        buf = ck.DeviceBuffer(1 << 20, stream=s)
        k.spin.launch(1, 1, SPIN, 0, stream=busy)
        t0 = time.perf_counter()
        buf.close()
        took = time.perf_counter() - t0
        busy.synchronize()
        assert took < 0.05, f"a stream-ordered free waited {took * 1e3:.1f} ms for the device"
