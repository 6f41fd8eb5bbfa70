"""``host_path="split"`` on the simulated GPU: the input's chunks are registered from the
far end by one host thread while the feeder stages them from the near end; each chunk
goes exactly one way, results are exact, and no page stays registered (the simulated
GPU records any DMA from pageable memory and refuses to register a page twice)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ctxkit.pipeline import Pipeline, PipelineError, PipelineOptions, plan_map
from tests.support.fakegpu import scale_body

PAGE = 4096
OUT_OF_MEMORY = 2


def at_offset(arr: np.ndarray, offset: int) -> np.ndarray:
    """A copy of *arr* whose data starts *offset* bytes past a page boundary."""
    raw = np.empty(arr.nbytes + offset + 2 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + offset
    out = raw[start : start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    return out


def assert_clean(gpu) -> None:
    assert not gpu.pageable_dma, gpu.pageable_dma[:5]
    assert not gpu.registered, gpu.registered
    assert not gpu.kernel_errors


def slow_registrations(gpu, monkeypatch, delay: float) -> list[int]:
    """Registrations take *delay* seconds each; returns the registered addresses."""
    real = gpu.cuMemHostRegister
    seen: list[int] = []

    def register(ptr, n, flags):
        time.sleep(delay)
        seen.append(int(ptr))
        return real(ptr, n, flags)

    monkeypatch.setattr(gpu, "cuMemHostRegister", register)
    return seen


def fills_and_registers(p: Pipeline) -> tuple[set[int], set[int]]:
    tl = p.trace()
    return {i.chunk for i in tl.select(name="fill")}, {i.chunk for i in tl.select(name="register")}


def test_plan_split_is_for_the_input_of_a_static_map():
    plan = plan_map(1 << 20, (4, 4), 2, PipelineOptions(host_path="split"))
    assert (plan.in_mode, plan.out_mode) == ("split", "staged")
    assert plan.path == "in=split, out=staged"
    assert plan.stage_in and plan.registers and plan.needs_pool
    dynamic = plan_map(1 << 20, (4, 4), 2, PipelineOptions(host_path="split", schedule="dynamic"))
    assert (dynamic.in_mode, dynamic.out_mode) == ("staged", "staged")
    pinned = plan_map(
        1 << 20, (4, 4), 1, PipelineOptions(host_path="split"), ("pinned", "pageable")
    )
    assert pinned.in_mode == "pinned"


@pytest.mark.parametrize("offset", [0, 40, 4000])
@pytest.mark.parametrize("devices", [[0], [0, 1]])
def test_split_meets_in_the_middle_and_is_exact(gpu, monkeypatch, offset, devices):
    slow_registrations(gpu, monkeypatch, 0.004)
    x = at_offset(np.random.default_rng(offset).random(96_000), offset)  # 48 chunks
    with Pipeline(
        devices, options=PipelineOptions(chunk_bytes=4 * PAGE, staging_buffers=3, host_threads=3)
    ) as p:
        out = p.map(scale_body(gpu, 2.0), x, options=PipelineOptions(host_path="split"))
        assert p.last_stats.path == "in=split, out=staged"
        staged, registered = fills_and_registers(p)
        plan = p._run.plan
    np.testing.assert_array_equal(out, x * 2)
    assert staged and registered and not staged & registered
    assert staged | registered == set(range(len(plan.chunks)))
    for d in range(len(devices)):  # the device's front staged, its back registered
        mine = [c.index for c in plan.for_part(d)]
        assert mine[0] in staged and mine[-1] in registered
    assert_clean(gpu)


@pytest.mark.parametrize("n", [0, 1, 1000, 50_001])
def test_split_small_and_odd_sizes(gpu, n):
    x = at_offset(np.arange(n, dtype=np.float32), 12)
    with Pipeline([0], options=PipelineOptions(chunk_bytes=3 * PAGE, host_threads=2)) as p:
        np.testing.assert_array_equal(
            p.map(scale_body(gpu, 3.0), x, options=PipelineOptions(host_path="split")), x * 3
        )
    assert_clean(gpu)


def test_split_in_place(gpu, monkeypatch):
    slow_registrations(gpu, monkeypatch, 0.002)
    x = at_offset(np.arange(40_000, dtype=np.float32), 0)
    want = x * 2
    with Pipeline([0], options=PipelineOptions(chunk_bytes=4 * PAGE, host_threads=3)) as p:
        assert p.map(scale_body(gpu, 2.0), x, x, options=PipelineOptions(host_path="split")) is x
    np.testing.assert_array_equal(x, want)
    assert_clean(gpu)


def test_split_chunks_the_driver_refuses_are_staged(gpu):
    gpu.register_error = lambda ptr, n, flags: OUT_OF_MEMORY
    x = at_offset(np.arange(60_000, dtype=np.float32), 40)
    with Pipeline([0, 1], options=PipelineOptions(chunk_bytes=5 * PAGE, host_threads=3)) as p:
        out = p.map(scale_body(gpu, 2.0), x, options=PipelineOptions(host_path="split"))
        assert p.last_stats.fallbacks >= 1
    np.testing.assert_array_equal(out, x * 2)
    assert_clean(gpu)


def test_split_error_mid_run_unregisters_everything(gpu, monkeypatch):
    slow_registrations(gpu, monkeypatch, 0.002)
    x = at_offset(np.arange(80_000, dtype=np.float32), 0)
    calls = {"n": 0}
    lock = threading.Lock()

    def body(ctx, stream, d_in, d_out, n):
        with lock:
            calls["n"] += 1
            if calls["n"] == 6:
                raise ValueError("bad chunk")
        scale_body(gpu, 2.0)(ctx, stream, d_in, d_out, n)

    with Pipeline([0], options=PipelineOptions(chunk_bytes=4 * PAGE, host_threads=3)) as p:
        with pytest.raises(PipelineError, match="bad chunk"):
            p.map(body, x, options=PipelineOptions(host_path="split"))
        np.testing.assert_array_equal(
            p.map(scale_body(gpu, 2.0), x, options=PipelineOptions(host_path="split")), x * 2
        )
    assert_clean(gpu)
