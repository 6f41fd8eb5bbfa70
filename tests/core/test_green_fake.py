"""Green contexts (SM partitions) on the simulated GPU: planning, the split, their streams,
``stream=None`` inside one, the registry, executors and pipelines over green lanes.

The fake (tests/support/fakegreen.py) refuses what the driver refuses (blocking green
streams, a split output split again) and records work that leaves the partition.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import _driver
from ctxkit.device import plan_partition, sm_granularity
from ctxkit.errors import ContextInUseError, CudaError
from ctxkit.pipeline import Pipeline, PipelineOptions
from ctxkit.stream import current_stream
from tests.support.fakegpu import scale_body
from tests.support.fakegreen import GreenRules

# --- planning (pure) -----------------------------------------------------------------


def test_granularity_by_compute_capability():
    assert sm_granularity(9) == (8, 8) and sm_granularity(10) == (8, 8)
    assert sm_granularity(8) == (4, 2)
    assert sm_granularity(7) == sm_granularity(6) == (2, 2)


@pytest.mark.parametrize(
    "counts,minimum,multiple,plan",
    [
        ([16], 8, 8, [16]),
        ([1], 8, 8, [8]),
        ([9, 17], 8, 8, [16, 24]),
        ([3], 4, 2, [4]),
        ([5, 1], 2, 2, [6, 2]),
        ([132], 8, 8, None),  # 136 > 132
        ([64, 64], 8, 8, [64, 64]),
    ],
)
def test_plan_rounds_to_the_granularity(counts, minimum, multiple, plan):
    if plan is None:
        with pytest.raises(ValueError, match=r"132 SMs.*at least 8 SMs in multiples of 8"):
            plan_partition(counts, 132, minimum, multiple)
    else:
        assert plan_partition(counts, 132, minimum, multiple) == plan


@pytest.mark.parametrize("bad", [[], [0], [-8], [True], [8.0], "16"])
def test_plan_refuses_bad_counts(bad):
    with pytest.raises(ValueError, match="positive ints"):
        plan_partition(bad, 132, 8, 8)


# --- partitions ----------------------------------------------------------------------


def test_partition_gives_disjoint_green_contexts_and_the_remainder(gpu):
    parts = ck.Device(0).partition([16])
    try:
        assert [p.kind for p in parts] == ["green", "green"]
        assert [p.sm_count for p in parts] == [16, 116]
        assert all(p.device is ck.Device(0) and not p.is_primary for p in parts)
        a, b = (set(g.ids) for g in gpu.live_greens())
        assert not a & b and len(a | b) == 132
        assert len({p.handle for p in parts} | {ck.Context.primary(0).handle}) == 3
        assert "green" in repr(parts[0]) and "sm_count=16" in repr(parts[0])
        assert ck.Context.primary(0).sm_count == 4  # the device's (the fake's attribute)
    finally:
        for p in parts:
            p.close()
    assert gpu.live_greens() == []
    assert all(p.closed for p in parts)
    parts[0].close()  # idempotent


def test_context_green_and_remainder_false(gpu):
    g = ck.Context.green(0, sm_count=10)  # rounded up to 16
    try:
        assert g.kind == "green" and g.sm_count == 16
        assert len(gpu.live_greens()) == 1
    finally:
        g.close()


def test_unequal_counts_split_through_a_green_context_on_a_13_0_driver(gpu):
    parts = ck.Device(0).partition([16, 40, 16], remainder=False)
    try:
        assert [p.sm_count for p in parts] == [16, 40, 16]
        ids = [set(g.ids) for g in gpu.live_greens()]
        assert len(ids) == 3 and sum(map(len, ids)) == len(set().union(*ids)) == 72
        assert gpu.splits == ["ByCount(2, 16) -> 2 x 16", "ByCount(1, 40) -> 1 x 40"]
    finally:
        for p in parts:
            p.close()
    assert gpu.live_greens() == []  # the scratch context of the second split too


def test_a_13_1_driver_splits_in_one_call(gpu):
    gpu.driver_code = 13010
    parts = ck.Device(0).partition([16, 40])
    try:
        assert [p.sm_count for p in parts] == [16, 40, 76]
        assert gpu.splits == ["Split([16, 40])"]
    finally:
        for p in parts:
            p.close()


def test_granularity_from_compute_capability_where_the_resource_has_none(gpu):
    gpu.report_granularity = False  # 12.x bindings: smCount only
    gpu.attrs["CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"] = 9
    assert ck.Device(0).sm_granularity == (8, 8)
    gpu.report_granularity = True
    gpu.granularity = (4, 2)
    assert ck.Device(1).sm_granularity == (4, 2)  # the driver's word first


def test_impossible_request_names_sm_count_and_granularity(gpu):
    with pytest.raises(ValueError, match=r"device 0.*132 SMs.*at least 8 SMs in multiples of 8"):
        ck.Device(0).partition([64, 72])
    with pytest.raises(ValueError, match="positive ints"):
        ck.Device(0).partition([0])
    assert gpu.live_greens() == []


def test_driver_without_green_contexts_names_the_minimum_versions(gpu):
    gpu.driver_code = 12030
    with pytest.raises(CudaError, match=r"CUDA 12\.4\+.*cuda-bindings 12\.8\+") as info:
        ck.Device(0).partition([16])
    assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED"


def test_bindings_without_green_contexts_are_refused(gpu, monkeypatch):
    monkeypatch.delattr(GreenRules, "cuGreenCtxCreate")
    with pytest.raises(CudaError, match=r"CUDA 12\.4\+"):
        ck.Context.green(0, 16)


def test_close_of_a_current_green_context_is_refused(gpu):
    g = ck.Context.green(0, 16)
    with g, pytest.raises(ContextInUseError):
        g.close()
    g.close()
    assert g.closed and gpu.live_greens() == []


# --- a green context works like any context -----------------------------------------------


@pytest.fixture
def green(gpu):
    parts = ck.Device(0).partition([16])
    yield parts[0]
    for p in parts:
        p.close()


def test_with_push_pop_and_current_context(gpu, green):
    assert ck.current_context() is None
    with green:
        assert ck.current_context() is green
        with ck.Context.primary(0):
            assert ck.current_context() is ck.Context.primary(0)
        assert ck.current_context() is green
    green.push()
    assert ck.current_context() is green
    green.pop()
    assert ck.current_context() is None


def test_bind_bound_registry_and_executor(gpu, green):
    @ck.bound(green)
    def where() -> ck.Context | None:
        return ck.current_context()

    assert where() is green
    with ck.bind(green):
        assert ck.current_context() is green
    reg = ck.ContextRegistry()
    reg.set(0, green)
    assert reg.context(0) is green
    with ck.ContextExecutor(green, max_workers=2) as ex:
        got = list(ex.map(lambda _: ck.current_context(), range(4)))
    assert got == [green] * 4


def test_streams_of_a_green_context_are_green_and_non_blocking(gpu, green):
    s = ck.Stream(context=green)
    assert gpu.sms_of(s) == tuple(range(16))
    assert s.nonblocking and s.context is green
    with pytest.raises(ValueError, match="non-blocking"):
        ck.Stream(context=green, nonblocking=False)
    assert ck.Stream.from_handle(int(s.handle)).context is green  # cuStreamGetCtx maps back
    plain = ck.Stream(context=ck.Context.primary(0))
    assert len(gpu.sms_of(plain)) == 132


def test_the_fake_refuses_a_blocking_green_stream_like_the_driver(gpu, green):
    err, _ = gpu.cuGreenCtxStreamCreate(green.cu_green, 0, 0)
    assert err == 1


def test_stream_none_in_a_green_context_runs_on_its_own_green_stream(gpu, green):
    x = np.arange(1000, dtype=np.float32)
    with green:
        s = current_stream()
        assert gpu.sms_of(s) == tuple(range(16)) and s.context is green
        buf = ck.DeviceBuffer(x.nbytes)  # cuMemAlloc (not stream-ordered) there too
        buf.copy_from_host(x)
        dev = np.frombuffer((ctypes.c_char * x.nbytes).from_address(buf.ptr), np.float32)
        gpu.launch(s, lambda: dev.__imul__(2))  # a kernel on the stream stream=None means
        out = buf.copy_to_host(np.empty_like(x))  # ordered after it, and waited for
        ck.Event().record().synchronize()
        buf.memset(0)
        zeros = buf.copy_to_host()
        green.synchronize()
    np.testing.assert_array_equal(out, x * 2)
    assert not zeros.any()
    assert gpu.legacy_in_green == []
    assert current_stream(green) is s  # one per context


def test_the_green_default_stream_goes_with_the_context(gpu):
    g = ck.Context.green(0, 16)
    s = current_stream(g)
    h = int(s.handle)
    g.close()
    assert s.closed and h not in gpu.streams


def test_with_stream_in_a_green_context_wins_over_its_default(gpu, green):
    s = ck.Stream(context=green)
    buf = ck.DeviceBuffer(64, context=green)
    with s:
        assert current_stream() is s
        buf.copy_from_host(np.ones(64, np.uint8))  # on s
        assert buf.copy_to_host().all()
    assert gpu.legacy_in_green == []


def test_events_and_waits_across_a_green_and_the_primary_context(gpu, green):
    prim = ck.Context.primary(0)
    sp, sg = ck.Stream(context=prim), ck.Stream(context=green)
    order: list[str] = []
    gate = threading.Event()
    gpu.launch(sp, lambda: (gate.wait(5), order.append("primary")))
    ev = sp.record(timing=False)
    sg.wait(ev)
    gpu.launch(sg, lambda: order.append("green"))
    gate.set()
    sg.synchronize()
    assert order == ["primary", "green"]


def test_capture_on_a_green_stream(gpu, green):
    s = ck.Stream(context=green)
    with ck.capture(s) as g:
        gpu.launch(s, lambda: None)
    exe = g.instantiate()
    exe.launch(s)
    s.synchronize()


# --- lanes ---------------------------------------------------------------------------


def test_pipeline_accepts_distinct_contexts_of_one_device(gpu):
    parts = ck.Device(0).partition([40, 40])
    x = np.arange(200_003, dtype=np.float32)
    try:
        with Pipeline(parts, options=PipelineOptions(chunk_bytes=1 << 16)) as p:
            assert p.contexts == parts
            out = p.map(scale_body(gpu, 2.0), x)
            np.testing.assert_array_equal(out, x * 2)
            assert len(p.last_stats.devices) == 3
            assert [d.lane for d in p._devices] == [0, 1, 2]
            for d, ctx in zip(p._devices, parts, strict=True):
                assert all(gpu.sms_of(s) == gpu.sms_of(ck.Stream(context=ctx)) for s in d.streams())
                assert d.sm_threads == ctx.sm_count * 2048
        assert gpu.legacy_in_green == []
    finally:
        for c in parts:
            c.close()


def test_pipeline_mixing_a_green_lane_and_the_primary_context(gpu):
    g = ck.Context.green(0, 16)
    x = np.arange(50_000, dtype=np.int32)
    try:
        with Pipeline([g, ck.Context.primary(0)]) as p:
            np.testing.assert_array_equal(p.map(scale_body(gpu, 3), x), x * 3)
    finally:
        g.close()


def test_pipeline_over_two_owned_contexts_of_one_device(gpu):
    a, b = ck.Context.create(0), ck.Context.create(0)
    x = np.arange(80_000, dtype=np.float32)
    try:
        with Pipeline([a, b], options=PipelineOptions(chunk_bytes=1 << 16)) as p:
            np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), x), x * 2)
            assert [d.lane for d in p._devices] == [0, 1]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "devices",
    [
        lambda g: [g, g],
        lambda g: [0, 0],
        lambda g: [ck.Device(0), 0],
        lambda g: [0, ck.Context.primary(0)],  # the registry's context of device 0, twice
    ],
)
def test_the_same_context_or_device_twice_stays_refused(gpu, devices):
    g = ck.Context.green(0, 16)
    try:
        with pytest.raises(ValueError, match="listed twice"):
            Pipeline(devices(g))
    finally:
        g.close()


def test_pipeline_trace_over_green_lanes(gpu):
    parts = ck.Device(0).partition([64])
    try:
        with Pipeline(parts, options=PipelineOptions(trace=True, chunk_bytes=1 << 16)) as p:
            x = np.arange(100_000, dtype=np.float32)
            p.map(scale_body(gpu, 2.0), x)
            assert set(p.trace().devices()) == {0, 1}
    finally:
        for c in parts:
            c.close()


def test_require_green_passes_on_a_13_0_fake(gpu):
    _driver.require_green("here")


PTX = b"""
.version 7.0
.target sm_90
.address_size 64
.visible .entry empty(.param .u64 a)
{ ret; }
"""


def test_launches_with_stream_none_go_to_the_green_default_stream(gpu, green, monkeypatch):
    launched: list[int] = []

    def cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shm, hs, params, extra):
        launched.append(int(hs))
        gpu.launch(hs, lambda: None)
        return (0,)

    monkeypatch.setattr(gpu, "cuLaunchKernel", cuLaunchKernel, raising=False)
    k = ck.Module.load(PTX).function("empty")
    with green:
        k.launch(1, 32, 0)
        k.prepare(1, 32, 0)()
        s = ck.Stream()  # Stream() in a green context: a green stream
        k.launch(1, 32, 0, stream=s)
    k.launch(1, 32, 0, stream=s)  # nothing current: the stream's context is bound
    default = int(current_stream(green).handle)
    assert launched == [default, default, int(s.handle), int(s.handle)]
    assert gpu.sms_of(s) == gpu.sms_of(default) == tuple(range(16))
    with ck.Context.primary(0):
        k.launch(1, 32, 0)
    assert launched[-1] == 0  # elsewhere stream=None is the legacy default stream
    assert gpu.legacy_in_green == []
