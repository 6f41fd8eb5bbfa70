"""benchmarks/bench_green.py --quick end to end on the simulated GPU: both sides (ctxkit
and raw cuda.bindings green contexts) make their partitions, streams and launches, the
pipeline section checks its results over green lanes, and the verdict lines come out.
The numbers mean nothing (the fake's kernels take no SMs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ctxkit as ck
from ctxkit.compiler.objectcode import ObjectCode
from tests.support.fakedriver import FakeHandle
from tests.support.fakegpu import FakeGPU, install_raw_calls, launch_scale_f32

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
PTX = b"""
.version 7.0
.target sm_90
.address_size 64
.visible .entry tiny(.param .u64 flag)
{ ret; }
.visible .entry heavy(.param .u64 cycles, .param .u64 flag)
{ ret; }
.visible .entry scale_f32(.param .u64 in, .param .u64 out, .param .u64 n, .param .f32 alpha)
{ ret; }
"""


class LaunchCalls:
    """Modules and launches on the fake GPU: ``scale_f32`` computes, the rest are empty."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.launched: list[tuple[str, int, int]] = []  # (kernel, grid, stream)

    def cuModuleLoadData(self, image):
        return (0, FakeHandle(0x7000))

    def cuModuleGetFunction(self, mod, name):
        f = FakeHandle(0x7100 + len(self.gpu.kernel_names))
        self.gpu.kernel_names[int(f)] = name.decode()
        return (0, f)

    def cuModuleUnload(self, mod):
        return (0,)

    def cuStreamCreate(self, flags):
        return self.gpu.cuStreamCreateWithPriority(flags, 0)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
        name = self.gpu.kernel_names[int(f)]
        self.launched.append((name, gx, int(stream)))
        if name != "scale_f32":
            self.gpu.launch(stream, lambda: None)
            return (0,)
        launch_scale_f32(self.gpu, stream, params)
        return (0,)


@pytest.fixture
def bench(gpu, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_green

    calls = LaunchCalls(gpu)
    install_raw_calls(monkeypatch, gpu, calls)
    monkeypatch.setattr(bench_green, "drv", gpu)
    monkeypatch.setattr(ck, "compile", lambda *a, **kw: ObjectCode(PTX, "ptx", "sm_90"))
    gpu.attrs["CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"] = 132
    gpu.jitter = 0.0
    bench_green.calls = calls  # for the test
    yield bench_green
    sys.modules.pop("bench_green", None)


def test_bench_green_quick_runs_both_sides(bench, gpu, capsys):
    assert bench.main(["--quick", "--pipeline-mib", "2"]) == 0
    text = capsys.readouterr().out
    print(text)
    names = {ln.split()[1] for ln in text.splitlines() if ln.startswith("SUMMARY ")}
    assert {
        "green.ctxkit_idle_us", "green.raw_partitioned_us", "green.partitioned_vs_idle",
        "green.unpartitioned_vs_partitioned", "green.partitioned_ctxkit_vs_raw",
        "green.pipeline_green2_vs_primary",
    } <= names  # fmt: skip
    assert "reference (raw, H200): 31 us" in text
    launched = bench.calls.launched
    heavy = {grid for name, grid, _ in launched if name == "heavy"}
    assert heavy == {8 * 132, 8 * 116}  # 8 blocks per SM of the context it runs in
    # every partitioned launch went to a stream of its partition, none to the legacy one
    green_streams = set(gpu.stream_green)
    assert any(s in green_streams for _, _, s in launched)
    assert all(s != 0 for _, _, s in launched)
    assert gpu.legacy_in_green == [] and gpu.live_greens() == []
