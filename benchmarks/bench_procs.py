"""Process-per-GPU costs, measured in one run.

* start-up of ``run_per_device`` on every GPU: spawn + import, then + binding the context;
* ``DevicePool`` per-task overhead (sequential round trips) vs ``ProcessPoolExecutor``
  (spawn) on the same number of processes, and pipelined throughput;
* arrays through the pool: pipe (pickle) vs shared memory, per size (the crossover that
  sets ``SHM_THRESHOLD``);
* ``examples/mpi_pipeline.py`` under ``mpiexec -n <GPUs>`` (end to end: scatter, H2D,
  kernel, D2H, gather) vs the single-process ``ctxkit.Pipeline.map`` on the same data.

    PYTHONPATH=. python3 benchmarks/bench_procs.py [--quick]

Prints tables and ``SUMMARY`` lines; exits 2 with one line when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

import ctxkit as ck
from ctxkit.procs import SHM_THRESHOLD, DevicePool, run_per_device

REPO = Path(__file__).resolve().parents[1]
ALPHA = np.float32(2.5)


def noop(*_args: Any) -> None:
    return None


def echo(x: Any) -> Any:
    return x


def bound_device(ordinal: int) -> str:
    ctx = ck.current_context()
    assert ctx is not None and ctx.device.ordinal == ordinal
    return ctx.device.pci_bus_id


def summary(name: str, value: str, target: str, ok: bool | None) -> None:
    verdict = "" if ok is None else (" PASS" if ok else " FAIL")
    print(f"SUMMARY {name} {value} ({target}){verdict}")


def best_s(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_startup(devices: list[int], repeats: int) -> None:
    plain = best_s(lambda: run_per_device(noop, devices, _bind=False), repeats)
    full = best_s(lambda: run_per_device(bound_device, devices), repeats)
    buses = run_per_device(bound_device, devices)
    print(f"\nrun_per_device start-up on {len(devices)} GPU(s), best of {repeats}:")
    print(f"  spawn + import ctxkit:            {plain:6.2f} s")
    print(f"  spawn + import + bind context:    {full:6.2f} s   (children saw {buses})")
    summary(
        "procs.startup_all_gpus",
        f"{full:.2f}s",
        f"{len(devices)} GPUs, spawn+import alone {plain:.2f}s; target <= 3.00s",
        full <= 3.0,
    )


def round_trips(submit: Callable[..., Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        submit(noop).result()
    return (time.perf_counter() - t0) / n


def pipelined(submit: Callable[..., Any], n: int) -> float:
    t0 = time.perf_counter()
    futures = [submit(noop) for _ in range(n)]
    for f in futures:
        f.result()
    return n / (time.perf_counter() - t0)


def bench_pool(devices: list[int], n: int) -> None:
    ctx = get_context("spawn")
    with DevicePool(devices) as pool, ProcessPoolExecutor(len(devices), mp_context=ctx) as ppe:
        for submit in (pool.submit, ppe.submit):
            for f in [submit(noop) for _ in range(4 * len(devices))]:
                f.result()  # every worker started
        ours = min(round_trips(pool.submit, n) for _ in range(3))
        base = min(round_trips(ppe.submit, n) for _ in range(3))
        ours_tp = max(pipelined(pool.submit, n) for _ in range(3))
        base_tp = max(pipelined(ppe.submit, n) for _ in range(3))
    ratio = ours / base
    print(f"\nper-task overhead ({len(devices)} worker(s), {n} sequential no-op tasks):")
    print(f"  DevicePool           {ours * 1e6:8.0f} us/task   {ours_tp:8.0f} tasks/s pipelined")
    print(f"  ProcessPoolExecutor  {base * 1e6:8.0f} us/task   {base_tp:8.0f} tasks/s pipelined")
    summary(
        "procs.pool_task_overhead",
        f"{ours * 1e6:.0f}us",
        f"{ratio:.2f}x ProcessPoolExecutor; target <= 1.50x",
        ratio <= 1.5,
    )


def round_trip(pool: DevicePool, a: np.ndarray) -> Any:
    return pool.submit(echo, a).result()


def bench_transport(sizes_kib: list[int], repeats: int) -> None:
    print(f"\narray round trip through a pool worker (best of {repeats}):")
    print(f"  {'size':>10} {'pipe':>10} {'shm':>10} {'shm/pipe':>9}")
    speedups = {}
    crossover = None
    with DevicePool([0], shm_threshold=None) as pipe, DevicePool([0], shm_threshold=1) as shm:
        warm = np.ones(1 << 18, np.float32)
        for pool in (pipe, shm):
            best_s(partial(round_trip, pool, warm), 3)
        for kib in sizes_kib:
            a = np.ones(kib * 256, np.float32)
            t_pipe = best_s(partial(round_trip, pipe, a), repeats)
            t_shm = best_s(partial(round_trip, shm, a), repeats)
            speedups[kib] = t_pipe / t_shm
            if crossover is None and t_shm < t_pipe:
                crossover = kib
            print(
                f"  {kib:>7} KiB {t_pipe * 1e3:8.2f}ms {t_shm * 1e3:8.2f}ms {t_pipe / t_shm:8.2f}x"
            )
    big = max(sizes_kib)
    cross = f"{crossover} KiB" if crossover is not None else "none measured"
    threshold = SHM_THRESHOLD >> 10
    summary(
        f"procs.shm_vs_pipe_{big // 1024}MiB",
        f"{speedups[big]:.2f}x",
        f"crossover {cross}, SHM_THRESHOLD {threshold} KiB; info",
        None,
    )


def mpi_result(n_dev: int, mb: float, repeat: int) -> dict[str, Any] | str:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return "no mpiexec on PATH (pip install mpich)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'ctxkit[mpi]')"
    cmd = [mpiexec, "-n", str(n_dev), sys.executable, str(REPO / "examples/mpi_pipeline.py")]
    cmd += ["--mb", str(mb), "--repeat", str(repeat), "--json"]
    env = {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",  # Open MPI refuses to run as root without both
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return f"mpi_pipeline.py failed (rc {res.returncode}): {(res.stderr or res.stdout)[-500:]}"


def pipeline_seconds(n_dev: int, mb: float, repeat: int) -> float | str:
    try:
        pipeline_cls = ck.Pipeline
    except (ImportError, AttributeError) as exc:
        return f"ctxkit.Pipeline is unavailable ({exc})"
    n = int(mb * (1 << 20)) // 4
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    out = np.empty_like(x)
    with ck.bind(0):
        obj = ck.compile(ck.compiler.kernel_source("scale.cu"), name="scale.cu")
        kernel = ck.Module.load(obj).function("scale_f32")
    with pipeline_cls(list(range(n_dev))) as p:
        p.map(kernel, x, out=out, args=(ALPHA,))
        best = best_s(lambda: p.map(kernel, x, out=out, args=(ALPHA,)), repeat)
    if not np.array_equal(out, x * ALPHA):
        return "Pipeline.map returned a wrong result"
    return best


def bench_mpi_vs_pipeline(n_dev: int, mb: float, repeat: int) -> None:
    mpi = mpi_result(n_dev, mb, repeat)
    single = pipeline_seconds(n_dev, mb, repeat)
    nbytes = 2 * (int(mb * (1 << 20)) // 4) * 4
    print(f"\n{mb:g} MiB float32 scaled on {n_dev} GPU(s), input + output bytes per second:")
    if isinstance(mpi, str):
        print(f"  MPI example: not run: {mpi}")
    else:
        print(f"  MPI, {n_dev} ranks, end to end:    {nbytes / mpi['e2e_s'] / 1e9:7.1f} GB/s")
        print(f"  MPI, device phase (slowest rank): {nbytes / mpi['device_s'] / 1e9:7.1f} GB/s")
    if isinstance(single, str):
        print(f"  Pipeline: not run: {single}")
    else:
        print(f"  single-process Pipeline.map:      {nbytes / single / 1e9:7.1f} GB/s")
    if isinstance(mpi, dict) and isinstance(single, float):
        ratio = single / mpi["e2e_s"]
        summary(
            "procs.mpi_vs_pipeline",
            f"{ratio:.2f}x",
            f"MPI {nbytes / mpi['e2e_s'] / 1e9:.1f} GB/s vs Pipeline "
            f"{nbytes / single / 1e9:.1f} GB/s end to end; info",
            None,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller sizes")
    args = parser.parse_args()
    n_dev = ck.device_count()
    if n_dev == 0:
        print(
            "no GPU: bench_procs.py needs an NVIDIA GPU (ctxkit.device_count() == 0)",
            file=sys.stderr,
        )
        return 2
    devices = list(range(n_dev))
    print(f"{n_dev} GPU(s): {', '.join(d.name for d in ck.devices())}")
    bench_startup(devices, 2 if args.quick else 3)
    bench_pool(devices, 100 if args.quick else 400)
    sizes = [64, 256, 1024, 4096, 16384] + ([] if args.quick else [65536, 262144])
    bench_transport(sizes, 3 if args.quick else 5)
    bench_mpi_vs_pipeline(n_dev, 64 if args.quick else 512, 2 if args.quick else 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
