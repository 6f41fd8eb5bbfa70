"""Process-per-GPU costs, measured in one run.

* start-up of ``run_per_device`` on every GPU: spawn + import, then + binding the context;
* ``DevicePool`` per-task overhead (sequential round trips) vs ``ProcessPoolExecutor``
  (spawn) on the same number of processes, and pipelined throughput;
* arrays through the pool: pipe (pickle) vs shared memory, per size (the crossover that
  sets ``SHM_THRESHOLD``);
* ``examples/mpi_pipeline.py`` under ``mpiexec -n <GPUs>`` (end to end: scatter, H2D,
  kernel, D2H, gather) vs the single-process ``ctxkit.Pipeline.map`` on the same data.

    PYTHONPATH=. python3 benchmarks/bench_procs.py [--quick]

Prints tables and ``SUMMARY`` lines (targets decided on the median of the repeats, the
best printed beside it); exits 2 with one line when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from verdictlines import Line, check, emit, info, median, skipped, stat_note, target

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


def times_s(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def best_s(fn: Callable[[], Any], repeats: int) -> float:
    return min(times_s(fn, repeats))


def bench_startup(devices: list[int], repeats: int) -> dict[str, Any]:
    plain = times_s(lambda: run_per_device(noop, devices, _bind=False), repeats)
    full = times_s(lambda: run_per_device(bound_device, devices), repeats)
    buses = run_per_device(bound_device, devices)
    print(f"\nrun_per_device start-up on {len(devices)} GPU(s), median of {repeats}:")
    print(f"  spawn + import ctxkit:            {median(plain):6.2f} s")
    print(f"  spawn + import + bind context:    {median(full):6.2f} s   (children saw {buses})")
    return {"startup_plain_s": plain, "startup_full_s": full, "gpus": len(devices)}


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


def bench_pool(devices: list[int], n: int, rounds: int = 3) -> dict[str, list[float]]:
    """Seconds per sequential no-op task and pipelined tasks/s, DevicePool and
    ProcessPoolExecutor alternating round by round."""
    ctx = get_context("spawn")
    r: dict[str, list[float]] = {k: [] for k in ("pool_s", "ppe_s", "pool_tps", "ppe_tps")}
    with DevicePool(devices) as pool, ProcessPoolExecutor(len(devices), mp_context=ctx) as ppe:
        for submit in (pool.submit, ppe.submit):
            for f in [submit(noop) for _ in range(4 * len(devices))]:
                f.result()  # every worker started
        for _ in range(rounds):
            r["pool_s"].append(round_trips(pool.submit, n))
            r["ppe_s"].append(round_trips(ppe.submit, n))
        for _ in range(rounds):
            r["pool_tps"].append(pipelined(pool.submit, n))
            r["ppe_tps"].append(pipelined(ppe.submit, n))
    print(f"\nper-task overhead ({len(devices)} worker(s), {n} sequential no-op tasks, medians):")
    for label, key in (("DevicePool", "pool"), ("ProcessPoolExecutor", "ppe")):
        us, tps = median(r[f"{key}_s"]) * 1e6, median(r[f"{key}_tps"])
        print(f"  {label:20s} {us:8.0f} us/task   {tps:8.0f} tasks/s pipelined")
    return r


def round_trip(pool: DevicePool, a: np.ndarray) -> Any:
    return pool.submit(echo, a).result()


def bench_transport(sizes_kib: list[int], repeats: int) -> dict[str, Any]:
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
    return {"shm_speedups": speedups, "shm_crossover_kib": crossover, "repeats": repeats}


MPI_FAILED = "mpi_pipeline.py failed"


def mpi_result(n_dev: int, mb: float, repeat: int) -> dict[str, Any] | str:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return "no mpiexec on PATH (pip install mpich)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 'mpi4py is not installed (pip install -e ".[mpi]" in a ctxkit checkout)'
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
    return f"{MPI_FAILED} (rc {res.returncode}): {(res.stderr or res.stdout)[-500:]}"


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


def bench_mpi_vs_pipeline(n_dev: int, mb: float, repeat: int) -> dict[str, Any]:
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
    return {"mpi": mpi, "pipeline_s": single, "mpi_nbytes": nbytes}


def verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The SUMMARY lines of this benchmark from its measurements (pure: no GPU)."""
    full, plain = r["startup_full_s"], r["startup_plain_s"]
    lines = [
        target(
            "procs.startup_all_gpus",
            median(full),
            "<=",
            3.0,
            "s",
            f"{r['gpus']} GPUs, spawn+import+bind; {stat_note(full, 's', False)}; "
            f"spawn+import alone {median(plain):.2f}s",
        ),
    ]
    ours, base = median(r["pool_s"]), median(r["ppe_s"])
    lines.append(
        target(
            "procs.pool_task_overhead",
            ours / base,
            "<=",
            1.5,
            "x",
            f"DevicePool {ours * 1e6:.0f}us/task vs ProcessPoolExecutor {base * 1e6:.0f}us, "
            f"sequential no-op tasks, medians of {len(r['pool_s'])}",
        )
    )
    speedups = r["shm_speedups"]
    big = max(speedups)
    cross = r["shm_crossover_kib"]
    lines.append(
        info(
            f"procs.shm_vs_pipe_{big // 1024}MiB",
            speedups[big],
            "x",
            f"best of {r['repeats']}; crossover "
            f"{f'{cross} KiB' if cross is not None else 'none measured'}, "
            f"SHM_THRESHOLD {SHM_THRESHOLD >> 10} KiB",
        )
    )
    mpi, single, nbytes = r["mpi"], r["pipeline_s"], r["mpi_nbytes"]
    if isinstance(single, str):
        lines.append(check("procs.pipeline_result_ok", 0.0, ">=", 1, "", f"1 = it ran: {single}"))
    if isinstance(mpi, dict) and isinstance(single, float):
        lines.append(
            info(
                "procs.mpi_vs_pipeline",
                single / mpi["e2e_s"],
                "x",
                f"MPI {nbytes / mpi['e2e_s'] / 1e9:.1f} GB/s vs Pipeline "
                f"{nbytes / single / 1e9:.1f} GB/s end to end",
            )
        )
    elif isinstance(mpi, str) and not mpi.startswith(MPI_FAILED):
        lines.append(skipped("procs.mpi_vs_pipeline", mpi))
    elif isinstance(mpi, str):
        lines.append(check("procs.mpi_example_ok", 0.0, ">=", 1, "", f"1 = it ran: {mpi}"))
    return lines


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
    r: dict[str, Any] = {}
    r.update(bench_startup(devices, 3))
    r.update(bench_pool(devices, 100 if args.quick else 400))
    sizes = [64, 256, 1024, 4096, 16384] + ([] if args.quick else [65536, 262144])
    r.update(bench_transport(sizes, 3 if args.quick else 5))
    r.update(bench_mpi_vs_pipeline(n_dev, 64 if args.quick else 512, 2 if args.quick else 5))
    return emit(verdicts(r))


if __name__ == "__main__":
    sys.exit(main())
