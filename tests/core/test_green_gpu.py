"""Green contexts on a real device: partitions, and that work in one stays on its SMs.

A kernel writes the SM id (``%smid``) of each of its blocks; in a green context the
blocks of a launch -- on ``stream=None``, on a ``Stream`` of the context, prepared, from a
graph -- land on at most ``sm_count`` distinct SMs, while the primary context spreads the
same launch over more.
"""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit._driver import drv
from ctxkit.errors import ContextClosedError
from ctxkit.module import Module
from ctxkit.stream import current_stream

SMID_SOURCE = r"""
extern "C" __global__ void smids(unsigned int* out, unsigned long long cycles)
{
    unsigned int id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    const long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) {
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = id;
    }
}
"""
BLOCKS = 1024
CYCLES = 20_000  # ~10 us a block: blocks spread over every SM they may use


@pytest.fixture(scope="module")
def kern() -> dict[str, ck.Kernel]:
    arch = ck.Device(0).arch
    mod = Module.load(ck.compile(C.kernel_source("spin.cu"), name="spin.cu", arch=arch))
    return {"spin": mod.function("spin")}


@pytest.fixture
def parts() -> list[ck.Context]:
    made = ck.Device(0).partition([16])
    yield made
    for p in made:
        p.close()


def distinct_sms(ids: np.ndarray) -> int:
    return len(set(ids.tolist()))


def run_smids(fn, ctx: ck.Context) -> int:
    """Distinct SMs of the 1024 blocks ``fn(kernel, buffer)`` launches in *ctx*."""
    buf = ck.DeviceBuffer(BLOCKS * 4, context=ctx)
    with ctx:
        code = ck.compile(SMID_SOURCE, name="smids.cu", arch=ctx.device.arch)
        k = Module.load(code).function("smids")
        fn(k, buf)
        ctx.synchronize()
        ids = buf.copy_to_host(np.empty(BLOCKS, np.uint32))
    return distinct_sms(ids)


def test_partition_kinds_counts_and_remainder(parts):
    dev = ck.Device(0)
    low, step = dev.sm_granularity
    assert low >= 1 and step >= 1
    g, rest = parts
    assert g.kind == rest.kind == "green"
    assert g.sm_count >= 16 and g.sm_count % step == 0
    assert g.sm_count + rest.sm_count == dev.multiprocessor_count
    assert len({g.handle, rest.handle, ck.Context.primary(0).handle}) == 3
    assert ck.Context.primary(0).sm_count == dev.multiprocessor_count


def test_with_push_pop_and_current_context(parts):
    g = parts[0]
    with g:
        assert ck.current_context() is g
        with ck.Context.primary(0):
            assert ck.current_context() is ck.Context.primary(0)
        assert ck.current_context() is g
    g.push()
    try:
        assert ck.current_context() is g
    finally:
        g.pop()


def test_launches_stay_in_the_partition(parts):
    g = parts[0]

    def default_stream(k, buf):
        k.launch(BLOCKS, 128, buf.ptr, CYCLES)

    def own_stream(k, buf):
        s = ck.Stream(context=g)
        k.launch(BLOCKS, 128, buf.ptr, CYCLES, stream=s)
        s.synchronize()

    def prepared(k, buf):
        pl = k.prepare(BLOCKS, 128, buf.ptr, CYCLES)
        pl()
        pl()

    for fn in (default_stream, own_stream, prepared):
        assert run_smids(fn, g) <= g.sm_count, fn.__name__
    assert run_smids(default_stream, ck.Context.primary(0)) > g.sm_count


def test_streams_of_a_green_context_are_green(parts):
    g = parts[0]
    s = ck.Stream(context=g)
    err, green = drv.cuStreamGetGreenCtx(s.handle)
    assert not err and int(green) == int(g.cu_green)
    err, green = drv.cuStreamGetGreenCtx(current_stream(g).handle)
    assert not err and int(green) == int(g.cu_green)
    with pytest.raises(ValueError, match="non-blocking"):
        ck.Stream(context=g, nonblocking=False)
    assert ck.Stream.from_handle(int(s.handle)).context is g


def test_device_buffers_copies_and_pools_in_a_green_context(parts):
    g = parts[0]
    x = np.arange(1 << 20, dtype=np.float32)
    with g:
        a = ck.DeviceBuffer(x.nbytes)
        a.copy_from_host(x)
        b = ck.DeviceBuffer(x.nbytes)
        b.copy_from(a)
        np.testing.assert_array_equal(b.copy_to_host(np.empty_like(x)), x)
        s = ck.Stream()
        c = ck.DeviceBuffer(x.nbytes, stream=s)  # stream-ordered, from the device's pool
        c.copy_from(a, stream=s)
        d = ck.MemoryPool.default(0).allocate(x.nbytes, stream=s)  # the device's pool
        assert d.context is g
        d.copy_from(c, stream=s)
        s.synchronize()
        np.testing.assert_array_equal(d.copy_to_host(np.empty_like(x)), x)
        arr = ck.to_device(x)
        np.testing.assert_array_equal(arr.copy_to_host(), x)


def test_copy_peer_between_a_green_and_the_primary_context(parts):
    x = np.arange(4096, dtype=np.uint8)
    a = ck.DeviceBuffer(x.nbytes, context=parts[0])
    b = ck.DeviceBuffer(x.nbytes, context=ck.Context.primary(0))
    a.copy_from_host(x)
    ck.copy_peer(b, a, x.nbytes)
    np.testing.assert_array_equal(b.copy_to_host(), x)


def test_event_waits_across_the_primary_and_a_green_context(parts, kern):
    g, prim = parts[0], ck.Context.primary(0)
    cycles = 20_000_000  # ~10 ms
    for first, second in ((prim, g), (g, prim)):
        s1, s2 = ck.Stream(context=first), ck.Stream(context=second)
        kern["spin"].launch(1, 32, cycles, 0, stream=s1)
        s2.wait(s1.record(timing=False))
        after = s2.record(timing=False)
        assert not after.query(), "the wait did not hold the other context's stream"
        after.synchronize()
        assert s1.query()


def test_capture_into_a_graph_in_a_green_context(parts):
    g = parts[0]

    def captured(k, buf):
        s = ck.Stream(context=g)
        with ck.capture(s) as graph:
            k.launch(BLOCKS, 128, buf.ptr, CYCLES, stream=s)
        graph.launch(s)
        s.synchronize()

    assert run_smids(captured, g) <= g.sm_count


def test_executor_bind_and_bound(parts):
    g = parts[0]
    with ck.ContextExecutor(g, max_workers=2) as ex:
        got = list(ex.map(lambda _: ck.current_context(), range(4)))
        nbytes = ex.submit(lambda: ck.DeviceBuffer(256).nbytes).result()
    assert got == [g] * 4 and nbytes == 256
    with ck.bind(g):
        assert ck.current_context() is g

    @ck.bound(g)
    def where():
        return ck.current_context()

    assert where() is g


def test_context_green_one_partition():
    g = ck.Context.green(0, sm_count=9)
    try:
        assert g.kind == "green" and g.sm_count >= 9
        assert g.sm_count % ck.Device(0).sm_granularity[1] == 0
    finally:
        g.close()


def test_unequal_partitions():
    made = ck.Device(0).partition([16, 40], remainder=False)
    try:
        assert [p.sm_count >= c for p, c in zip(made, [16, 40], strict=True)] == [True, True]
        x = np.arange(1000, dtype=np.float32)
        for p in made:
            with p:
                np.testing.assert_array_equal(ck.to_device(x).copy_to_host(), x)
    finally:
        for p in made:
            p.close()


def test_impossible_request_is_a_value_error():
    dev = ck.Device(0)
    n = dev.multiprocessor_count
    with pytest.raises(ValueError, match=rf"{n} SMs.*multiples of"):
        dev.partition([n + 8])
    with pytest.raises(ValueError, match=rf"{n} SMs"):
        dev.partition([n // 2 + 8, n // 2 + 8])


def test_close_destroys():
    g = ck.Context.green(0, 16)
    s = current_stream(g)
    g.close()
    assert g.closed and s.closed
    with pytest.raises(ContextClosedError), g:
        pass
    g.close()  # idempotent


@pytest.mark.parametrize("counts", [[64], [40, 40]])
def test_pipeline_over_green_lanes_is_exact(counts):
    made = ck.Device(0).partition(counts)
    arch = ck.Device(0).arch
    mod = Module.load(ck.compile(C.kernel_source("scale.cu"), name="scale.cu", arch=arch))
    x = np.random.default_rng(3).standard_normal(3_000_001).astype(np.float32)
    try:
        opts = ck.PipelineOptions(chunk_bytes=1 << 20)
        with ck.Pipeline(made, options=opts) as p:
            out = p.map(mod.function("scale_f32"), x, args=(2.0,))
            assert len(p.last_stats.devices) == len(made)
        np.testing.assert_array_equal(out, x * np.float32(2))
    finally:
        for c in made:
            c.close()
