"""Lanes of ``DevicePool`` and ``run_per_device`` on the fake GPU: green and owned contexts
of one device, each a worker of its own.

The parent's side runs on the fake driver: the :class:`LaneSpec` of each kind of Context,
keys, duplicates, and (real worker processes without CUDA, ``_bind=False``) which worker
a task lands on, what lane it was sent, ``isolate``, and how errors name a lane. The
child's side (:func:`lane_context`: the green or owned context a lane's process makes and
binds) runs in this process on the fake. tests/procs/test_pool_lanes_gpu.py runs lanes on
a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ctxkit as ck
from ctxkit.context import context_of_cu
from ctxkit.errors import ContextClosedError, CudaError
from ctxkit.procs import DevicePool, DeviceTaskError, TaskOptions, run_per_device, spawn
from ctxkit.procs.spawn import LaneSpec, lane_context, lane_key, lane_spec, resolve_lanes
from tests.procs.lane_tasks import lane_and_pid, lane_env_or_fail, lane_fails
from tests.procs.proctools import wait_dead


@pytest.fixture
def fake(gpu, monkeypatch):
    """The fake GPU, answering ``cuCtxGetFlags`` with the current context's creation flags
    (the driver's answer for an owned context)."""

    def cuCtxGetFlags() -> tuple[int, int]:
        err = gpu.context_error()
        return (err, 0 if err else gpu.ctx_flags.get(gpu.current(), 0))

    monkeypatch.setattr(gpu, "cuCtxGetFlags", cuCtxGetFlags, raising=False)
    return gpu


@pytest.fixture
def parts(fake):
    """``Device(0).partition([16])``: 16 SMs and the remainder (116 of the fake's 132)."""
    made = ck.Device(0).partition([16])
    yield made
    for ctx in made:
        ctx.close()


@pytest.fixture
def owned(fake):
    made = [ck.Context.create(0, flags=4), ck.Context.create(0)]
    yield made
    for ctx in made:
        ctx.close()


def foreign_context(gpu: Any) -> ck.Context:
    """A context of device 1 made outside ctxkit (``kind == "foreign"``)."""
    args = (None, 0, 1) if gpu.bindings_major >= 13 else (0, 1)
    _err, cu = gpu.cuCtxCreate(*args)
    gpu.cuCtxPopCurrent()
    return context_of_cu(cu)


# --- the parent's side ----------------------------------------------------------------


def test_lane_spec_of_each_kind_of_context(fake, parts, owned):
    small, rest = parts
    assert lane_spec(small, True) == LaneSpec(0, "green", sm_count=16)
    assert lane_spec(rest, True) == LaneSpec(0, "green", sm_count=116)
    assert lane_spec(owned[0], True) == LaneSpec(0, "owned", flags=4)
    assert lane_spec(owned[1], True) == LaneSpec(0, "owned", flags=0)
    assert lane_spec(ck.Context.primary(1), True) == LaneSpec(1)
    foreign = foreign_context(fake)
    assert foreign.kind == "foreign" and lane_spec(foreign, True) == LaneSpec(1)
    assert lane_spec(1, True) == lane_spec(ck.Device(1), False) == LaneSpec(1)
    assert [lane_key(c) for c in (small, owned[0], ck.Context.primary(1), foreign, 1)] == [
        small,
        owned[0],
        1,
        1,
        1,
    ]
    assert [str(lane_spec(c, True)) for c in (small, owned[0], 1)] == [
        "device 0 (green, 16 SMs)",
        "device 0 (owned context)",
        "device 1",
    ]
    closed = ck.Context.create(1)
    closed.close()
    with pytest.raises(ContextClosedError):
        lane_spec(closed, True)


def test_resolve_lanes_keys_and_duplicates(fake, parts, owned):
    small, rest = parts
    lanes = resolve_lanes([small, rest, *owned, 1], True)
    assert list(lanes) == [small, rest, *owned, 1]
    assert [lane.ordinal for lane in lanes.values()] == [0, 0, 0, 0, 1]
    assert list(resolve_lanes([small, 0], True)) == [small, 0]  # a lane beside its device
    for twice, name in [
        ([small, rest, small], "context <Context green"),
        ([0, 1, 0], "device 0"),
        ([0, ck.Context.primary(0)], "device 0"),  # a primary Context means its device
        ([ck.Device(1), foreign_context(fake)], "device 1"),
    ]:
        with pytest.raises(ValueError, match=f"{name}.* is listed twice"):
            resolve_lanes(twice, True)
    with pytest.raises(TypeError, match="devices must hold ints, Devices or Contexts"):
        resolve_lanes([small, "0"], True)


# --- lanes in worker processes (no CUDA in them: _bind=False) ---------------------------


def test_pool_places_tasks_on_lanes(fake, parts, tmp_path):
    small, rest = parts
    gate = str(tmp_path / "gate")
    with DevicePool([small, rest, 1], _bind=False) as pool:
        assert pool.devices == [0, 0, 1] and list(pool.pids) == [small, rest, 1]
        assert "devices=[0, 0, 1]" in repr(pool)
        got = {c: pool.submit_to(c, lane_and_pid).result(60) for c in (small, rest, 1)}
        assert got[small][0] == LaneSpec(0, "green", sm_count=16)
        assert got[rest][0] == LaneSpec(0, "green", sm_count=116)
        assert got[1][0] == LaneSpec(1) and got[1][2] == 1
        assert got[small][2] == got[rest][2] == 0  # worker_device(): the logical ordinal
        assert {c: g[1] for c, g in got.items()} == pool.pids  # each lane its own worker
        spec = pool.submit_to(TaskOptions(device=rest), lane_and_pid).result(60)[0]
        assert spec.sm_count == 116
        assert pool.submit_to(ck.Context.primary(1), lane_and_pid).result(60)[0] == LaneSpec(1)
        # an ordinal picks the least-loaded lane of its device: both, while they wait
        first, second = (pool.submit_to(0, lane_and_pid, gate) for _ in range(2))
        Path(gate).touch()
        assert {first.result(60)[0].sm_count, second.result(60)[0].sm_count} == {16, 116}
        assert {pool.submit(lane_and_pid).result(60)[1] for _ in range(6)} == set(
            pool.pids.values()
        )
        other = ck.Context.green(1, 16)
        try:
            with pytest.raises(ValueError, match=r"is not a lane of this pool \(lanes \["):
                pool.submit_to(other, lane_and_pid)
        finally:
            other.close()
        with pytest.raises(ValueError, match=r"device 2 is not in this pool \(devices \[0, 0, 1\]"):
            pool.submit_to(2, lane_and_pid)
        err = pool.submit_to(small, lane_fails).exception(60)
        assert isinstance(err, DeviceTaskError) and err.device == 0 and err.kind == "exception"
        assert "task lane_fails on device 0 (green, 16 SMs): builtins.ValueError" in str(err)
        pids = [p for p in pool.pids.values() if p]
    assert wait_dead(pids, 10) == []


def test_pool_lane_whose_context_cannot_be_made_is_broken(fake, parts):
    # the worker binds (no GPU in it here): making its green context fails at start-up
    with DevicePool([parts[0]]) as pool:
        err = pool.submit(lane_and_pid).exception(120)
        assert isinstance(err, DeviceTaskError) and err.kind == "init" and err.device == 0
        assert "DevicePool worker for device 0 (green, 16 SMs) failed to start" in str(err)
        with pytest.raises(DeviceTaskError, match=r"device 0 \(green, 16 SMs\) failed to start"):
            pool.submit_to(parts[0], lane_and_pid)


def test_run_per_device_over_lanes(fake, parts, monkeypatch):
    small, rest = parts
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(lane_env_or_fail, [small, rest, 1], args=(16,), isolate=True, _bind=False)
    err = info.value
    assert err.device == 0 and list(err.failures) == [small]
    assert "device 0 (green, 16 SMs) (attempt 1 of 1): builtins.ValueError: no room" in str(err)
    assert err.results[0] is None
    assert err.results[1:] == [
        (LaneSpec(0, "green", sm_count=116), 0, "3"),  # the lanes of one device see one GPU
        (LaneSpec(1), 1, "5"),
    ]
    assert run_per_device(lane_env_or_fail, [rest, small], args=(0,), _bind=False) == [
        (LaneSpec(0, "green", sm_count=116), 0, "3,5"),
        (LaneSpec(0, "green", sm_count=16), 0, "3,5"),
    ]


# --- the lane's process: its context ----------------------------------------------------


def test_a_green_lane_makes_and_binds_its_own_green_context(fake):
    with lane_context(LaneSpec(0, "green", sm_count=16), 0) as ctx:
        assert ctx.kind == "green" and ctx.sm_count == 16
        assert ck.current_context() is ctx
        assert ck.registry.context(0) is ctx  # the device's registry context here
        with ck.bind(0) as bound:
            assert bound is ctx
        assert len(fake.live_greens()) == 1
    assert ctx.closed and fake.live_greens() == []
    assert ck.current_context() is None


def test_a_remainder_lane_gets_the_same_sm_count(fake):
    # 116 SMs is no partition size (multiples of 8): the rest of splitting off 16
    with lane_context(LaneSpec(0, "green", sm_count=116), 0) as ctx:
        assert ctx.kind == "green" and ctx.sm_count == 116
        assert [len(g.ids) for g in fake.live_greens()] == [116]
    assert fake.live_greens() == []


def test_an_owned_lane_has_the_flags_of_the_parents_context(fake):
    with lane_context(LaneSpec(1, "owned", flags=4), 1) as ctx:
        assert ctx.kind == "owned" and ctx.device.ordinal == 1
        assert fake.ctx_flags[ctx.handle] == 4
        assert ck.current_context() is ctx and ck.registry.context(1) is ctx
    assert ctx.closed


def test_a_device_lane_binds_the_registry_context(fake):
    with lane_context(LaneSpec(1), 1) as ctx:
        assert ctx is ck.registry.context(1) and ctx.is_primary
        assert ck.current_context() is ctx
    assert not ctx.closed


def test_a_green_lane_that_cannot_be_made_raises_the_clear_error(fake):
    with pytest.raises(ValueError, match="cannot partition device 0 into"):
        with lane_context(LaneSpec(0, "green", sm_count=200), 0):
            pass
    fake.driver_code = 12030
    with pytest.raises(CudaError, match="green contexts need a driver of CUDA 12.4") as info:
        with lane_context(LaneSpec(0, "green", sm_count=16), 0):
            pass
    assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
    assert ck.current_context() is None and spawn.current_lane is None
