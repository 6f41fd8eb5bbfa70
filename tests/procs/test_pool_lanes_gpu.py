"""Lanes on a real GPU: ``DevicePool`` and ``run_per_device`` over green partitions and
owned contexts of device 0, each lane a worker that makes and binds a context of the
same kind (the same SM count, the same flags) and runs kernels in it.

The workers run tests/procs/gpu_tasks.py's ``lane_report``: the lane of the worker's
current context as :func:`~ctxkit.procs.spawn.lane_spec` describes it, compared here
with the parent's context's.
"""

from __future__ import annotations

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.errors import CudaError
from ctxkit.procs import DevicePool, DeviceTaskError, run_per_device
from ctxkit.procs.spawn import LaneSpec, lane_spec
from tests.procs.gpu_tasks import N, expected, lane_report, lane_report_child, scale_in_place
from tests.procs.proctools import alive
from tests.support.helpers import ipc_refused

CU_CTX_SCHED_BLOCKING_SYNC = 4


@pytest.fixture
def parts():
    made = ck.Device(0).partition([16])  # 16 SMs and the rest (a remainder, not a size)
    yield made
    for ctx in made:
        ctx.close()


def test_pool_over_a_partition_runs_kernels_in_green_lanes(parts):
    with DevicePool([*parts, 0]) as pool:
        assert pool.devices == [0, 0, 0] and list(pool.pids) == [*parts, 0]
        for lane in parts:
            spec, same, y, pid = pool.submit_to(lane, lane_report, N, 2.0).result(120)
            assert spec == lane_spec(lane, True) and same
            assert pid == pool.pids[lane]
            np.testing.assert_array_equal(y, expected(N, 2.0, 0))
        assert [lane_spec(p, True).kind for p in parts] == ["green", "green"]
        assert sum(p.sm_count for p in parts) == ck.Device(0).multiprocessor_count
        # an ordinal means the device: six tasks queued at once spread over its three lanes
        by_ordinal = [pool.submit_to(0, lane_report, N, 1.0) for _ in range(6)]
        spec_of = {pid: spec for spec, _, _, pid in (f.result(120) for f in by_ordinal)}
        assert set(spec_of) == set(pool.pids.values())
        assert spec_of[pool.pids[0]] == LaneSpec(0)
        assert [spec_of[pool.pids[p]] for p in parts] == [lane_spec(p, True) for p in parts]
        pids = list(pool.pids.values())
    assert not any(alive(p) for p in pids if p)


def test_pool_over_owned_contexts_keeps_their_flags():
    owned = [ck.Context.create(0), ck.Context.create(0, flags=CU_CTX_SCHED_BLOCKING_SYNC)]
    try:
        specs = [lane_spec(c, True) for c in owned]
        assert specs[1].kind == "owned" and specs[1].flags & 7 == CU_CTX_SCHED_BLOCKING_SYNC
        with DevicePool(owned) as pool:
            for ctx, want in zip(owned, specs, strict=True):
                spec, same, y, pid = pool.submit_to(ctx, lane_report, N, 3.0).result(120)
                assert spec == want and same and pid == pool.pids[ctx]
                np.testing.assert_array_equal(y, expected(N, 3.0, 0))
    finally:
        for ctx in owned:
            ctx.close()


def test_a_green_lane_works_on_the_parents_device_buffer(parts, ctx0):
    x = np.arange(N, dtype=np.float32)
    buf = ck.DeviceBuffer(x.nbytes, context=ctx0)
    buf.copy_from_host(x)
    with DevicePool(parts) as pool:
        try:
            kind, sms = pool.submit_to(parts[0], scale_in_place, buf, N, 2.0).result(120)
        except (CudaError, DeviceTaskError) as exc:
            if ipc_refused(exc):
                pytest.skip(f"the driver refuses CUDA IPC here: {exc}")
            raise
    assert (kind, sms) == ("green", parts[0].sm_count)
    np.testing.assert_array_equal(buf.copy_to_host(np.empty_like(x)), x * 2)


@pytest.mark.parametrize("isolate", [False, True])
def test_run_per_device_over_green_lanes(parts, isolate):
    results = run_per_device(lane_report_child, parts, args=(N, 4.0), isolate=isolate)
    for ctx, (ordinal, spec, same, y) in zip(parts, results, strict=True):
        assert ordinal == 0 and spec == lane_spec(ctx, True) and same
        np.testing.assert_array_equal(y, expected(N, 4.0, 0))


def test_a_green_lane_the_device_cannot_give_is_broken_not_hung(monkeypatch):
    # a parent context whose SM count no worker can have (more than the device's)
    g = ck.Context.green(0, 16)
    try:
        monkeypatch.setattr(g, "_sm_count", ck.Device(0).multiprocessor_count + 8)
        with DevicePool([g]) as pool:
            err = pool.submit(lane_report, 1024, 1.0).exception(120)
        assert isinstance(err, DeviceTaskError) and err.kind == "init"
        assert "green, " in str(err) and "cannot partition device 0" in str(err)
    finally:
        g.close()
    assert lane_spec(0, True) == LaneSpec(0)
