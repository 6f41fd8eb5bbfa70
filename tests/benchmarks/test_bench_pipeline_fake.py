"""benchmarks/bench_pipeline.py end to end on the simulated GPU (tiny sizes): every
section runs, every result is verified and the SUMMARY lines come out, so a slip in the
benchmark shows up here rather than on the GPU machine. The numbers mean nothing."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ctxkit.memory import streaming_copy_info
from ctxkit.memory.streamcopy import streaming_pays
from tests.cli.test_demo_fake import FakeScaleKernel
from tests.support.fakedriver import FakeHandle
from tests.support.fakegpu import FakeGPU, launch_scale_f32

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


class ModuleCalls:
    """The module and launch calls of the raw pipeline baseline, on the fake GPU."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu

    def cuModuleLoadData(self, image):
        return (0, FakeHandle(0x7000))

    def cuModuleGetFunction(self, mod, name):
        return (0, FakeHandle(0x7100))

    def cuModuleUnload(self, mod):
        return (0,)

    def cuStreamCreate(self, flags):
        return self.gpu.cuStreamCreateWithPriority(flags, 0)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
        launch_scale_f32(self.gpu, stream, params)
        return (0,)


@pytest.fixture
def bench(gpu, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_pipeline
    import pipeline_baselines

    calls = ModuleCalls(gpu)
    for name in ("cuModuleLoadData", "cuModuleGetFunction", "cuModuleUnload", "cuStreamCreate",
                 "cuLaunchKernel"):  # fmt: skip
        monkeypatch.setattr(gpu, name, getattr(calls, name), raising=False)
    monkeypatch.setattr(pipeline_baselines, "drv", gpu)
    obj = SimpleNamespace(code=b"fake cubin", target="cubin", arch="sm_90", from_cache=True)
    kernel = FakeScaleKernel(gpu)
    monkeypatch.setattr(bench_pipeline, "load_scale_kernel", lambda: (obj, kernel, 0.0))
    yield bench_pipeline
    sys.modules.pop("bench_pipeline", None)
    sys.modules.pop("pipeline_baselines", None)
    sys.modules.pop("pipeline_verdicts", None)


def test_benchmark_runs_every_section_on_the_simulated_gpu(bench, gpu, capsys, monkeypatch):
    gpu.jitter = 0.0
    # pin on reuse must hold the arrays, or the held line measures staging (and its CHECK
    # fails the program, as it should).
    monkeypatch.setattr("ctxkit.pipeline.pincache.MIN_HOLD_BYTES", 1 << 20)
    # 40 MiB: above glibc's largest mmap threshold, so x and out have pages of their own
    # (ck.register_host of both would fail on a page they shared)
    rc = bench.main(["--quick", "--size-gb", "0.04", "--first-call-gb", "0.04", "--repeats", "1"])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    for needle in (
        "host memcpy", "cuMemHostRegister", "naive_1gpu_8chunk", "ctxkit_1gpu_pageable_auto",
        "ctxkit_1gpu_pageable_in-register-out-staged", "ctxkit_2gpu_pageable_register_dynamic",
        "raw_2gpu_pinned_4events", "ctxkit_1gpu_pinned_notrace", "managed_2gpu",
        "new_pipeline_1gpu_io", "new_pipeline_1gpu_split_io", "naive_1gpu_8chunk_fresh_io",
        "fresh_2gpu_io", "ctxkit_1gpu_held", "ctxkit_2gpu_held",
    ):  # fmt: skip
        assert needle in text, needle
    names = {
        line.split()[1] for line in text.splitlines() if line.startswith(("SUMMARY ", "CHECK "))
    }
    assert {
        "pipeline.1gpu_repeated_held_gbps", "pipeline.1gpu_repeated_is_held",
        "pipeline.1gpu_repeated_held_vs_naive_chunked", "pipeline.1gpu_auto_vs_fastest_other_path",
        "pipeline.1gpu_first_call_new_pipeline_gbps", "pipeline.1gpu_first_call_vs_naive_chunked",
        "pipeline.1gpu_first_call_vs_torch_pinned", "pipeline.1gpu_long_lived_fresh_arrays_gbps",
        "pipeline.1gpu_ceiling_gbps", "pipeline.1gpu_vs_ceiling", "pipeline.2gpu_scaling",
        "pipeline.2gpu_fresh_scaling_vs_raw", "pipeline.2gpu_ceiling_gbps",
        "pipeline.2gpu_vs_ceiling", "pipeline.2gpu_repeated_is_held", "pipeline.pinned_vs_raw_1gpu",
        "pipeline.pinned_vs_raw_2gpu", "pipeline.register_unregister_gbps_best",
        "pipeline.register_thread_scaling", "pipeline.host_memcpy_best",
        "pipeline.um_vs_explicit_pinned_2gpu", "pipeline.1gpu_ceiling_rounds_held",
        "pipeline.2gpu_ceiling_rounds_held",
    } <= names  # fmt: skip
    if streaming_copy_info().active:
        assert "pipeline.host_streaming_copy_best" in names
        # --quick runs the first-call section on 256 MiB: plain copies take turns with the
        # streaming ones only where the pipeline would stream that much
        compared = streaming_pays(256 << 20)
        assert ("pipeline.1gpu_long_lived_streaming_vs_plain_copy" in names) == compared
        assert ("fresh_1gpu_plain_copy_io" in text) == compared
    held = next(ln for ln in text.splitlines() if ln.startswith("CHECK pipeline.1gpu_repeated_is"))
    assert held.endswith(" ok"), held
    mine = next(ln for ln in text.splitlines() if "pipeline.1gpu_register_host_is_pinned" in ln)
    assert mine.endswith(" ok"), mine
    # --quick: no fresh processes, and no first-call target passes on 256 MiB arrays
    for name in ("1gpu_cold_first_call_vs_torch_cold", "1gpu_first_call_new_pipeline_gbps"):
        line = next(ln for ln in text.splitlines() if f"pipeline.{name} " in ln)
        assert "NOT MEASURED" in line and line.endswith(" SKIP"), line
    assert "cold first calls" not in text
    assert not gpu.registered


def test_benchmark_sweep_runs(bench, gpu, capsys):
    x = np.random.default_rng(0).random(1 << 16, dtype=np.float32)
    out = np.zeros_like(x)
    results: dict[str, float] = {}
    bench.bench_sweep(FakeScaleKernel(gpu), x, out, 1, results)
    text = capsys.readouterr().out
    assert "best staged" in text and "best register" in text
    assert any(k.startswith("sweep_register_chunk8_") for k in results)


def own_pages(n: int) -> np.ndarray:
    """A float32 array on pages of its own (an anonymous mapping, as numpy gives large
    arrays): registering it cannot touch a neighbour."""
    return np.frombuffer(mmap.mmap(-1, n * 4), np.float32)


def test_no_staged_timing_sees_pages_that_were_locked(bench, gpu, monkeypatch, capsys):
    """The order bench_ctxkit states: every timing of a path that locks no page (staged,
    host threads) comes before the first lock of x or out - also pin on reuse's, which
    "auto" takes on its second call - then auto, the caller's register_host, register."""
    monkeypatch.setattr(bench, "cpus", lambda: 32)
    monkeypatch.setattr("ctxkit.pipeline.pincache.MIN_HOLD_BYTES", 64 << 10)
    x, out = own_pages(1 << 16), own_pages(1 << 16)
    x[:] = np.random.default_rng(0).random(x.shape[0], dtype=np.float32)
    events: list[str] = []
    register, timed = gpu.cuMemHostRegister, bench.timed

    def cuMemHostRegister(ptr, n, flags):
        for a in (x, out):
            lo = a.ctypes.data
            if int(ptr) < lo + a.nbytes and lo < int(ptr) + n:
                events.append("lock")
        return register(ptr, n, flags)

    def timed_in_order(name, *args):
        events.append(name)
        return timed(name, *args)

    monkeypatch.setattr(gpu, "cuMemHostRegister", cuMemHostRegister)
    monkeypatch.setattr(bench, "timed", timed_in_order)
    results: dict[str, float] = {}
    bench.bench_ctxkit(FakeScaleKernel(gpu), x, out, [1, 2], 1, results)
    first_lock = events.index("lock")
    unlocked = [e for e in events if e.endswith("_pageable_staged") or e.startswith("threads_")]
    assert "threads_2gpu_staged_threads16" in unlocked and len(unlocked) >= 4, events
    assert all(events.index(e) < first_lock for e in unlocked), events
    names = list(results)
    for k in (
        "ctxkit_1gpu_pageable_auto",
        "ctxkit_1gpu_register_host",
        "ctxkit_2gpu_pageable_auto",
        "ctxkit_1gpu_pageable_staged_after_register",
    ):
        assert k in names, k
    assert results["path_ctxkit_1gpu_pageable_auto"] == "in=held, out=held"
    assert results["path_ctxkit_1gpu_register_host"] == "pinned"
    assert names.index("ctxkit_1gpu_pageable_auto") < names.index("ctxkit_1gpu_register_host")
    assert not gpu.registered


def test_registration_timing_undoes_a_partial_registration(bench, gpu):
    import pipeline_baselines

    ctx = pipeline_baselines.drv.primary[0]
    arr = np.ones(64 * 4096 + 100, np.uint8)
    n, r, u = pipeline_baselines.time_registration(ctx, arr, 8 * 4096, 2, 2)
    assert n % (8 * 4096) == 0 and 0 < n <= arr.nbytes
    assert r > 0 and u > 0 and not gpu.registered
    gpu.register_error = lambda ptr, size, flags: 2 if len(gpu.registered) >= 3 else 0
    with pytest.raises(RuntimeError, match="cuMemHostRegister"):
        pipeline_baselines.time_registration(ctx, arr, 8 * 4096, 2, 1)
    assert not gpu.registered
