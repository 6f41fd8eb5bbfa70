"""One spawned process per GPU: split an array, scale it on every GPU, check the result.

Pattern: "one process per GPU" (fork, then ``cudaSetDevice`` in each child, as multi-GPU
CUDA tutorials write it), done safely: ``ctxkit.procs.run_per_device`` *spawns* (a child
forked after CUDA was
initialised cannot use CUDA) one process per GPU, makes the registry's context of that
GPU current in it, and calls ``scale_slice(ordinal, ...)`` there. The input and output
arrays live in POSIX shared memory, so every child reads its slice and writes its result
in place, without pickling the data. It is the ``run_per_device`` twin of
``mpi_pipeline.py`` and prints the same lines: each child's device and PCI bus id, the
device phase (H2D + kernel + D2H from pinned memory, slowest child, best of
``--repeat``) in GB/s of input + output bytes, and the start-up cost of the processes.

A fault in one child (say an illegal address) would poison only that child's context:
``run_per_device`` reports it as a ``DeviceTaskError`` for that device, with the
child's traceback, and returns the other devices' results on the error (``retries=``
reruns the failed device in a fresh process).

    python examples/process_per_gpu.py [--mb 256] [--repeat 5] [--quick] [--json]
"""

from __future__ import annotations

import json
import time
from multiprocessing import shared_memory

import numpy as np
from _common import blocks_for, check, example_parser, expect, gbps, ok, require_gpus

import ctxkit as ck
from ctxkit.procs import run_per_device

ALPHA = np.float32(2.5)


def scale_slice(
    ordinal: int, in_name: str, out_name: str, n: int, devices: list[int], repeat: int
) -> dict[str, object]:
    """Runs in the child of device *ordinal*, with that device's context current."""
    part = devices.index(ordinal)
    lo, hi = n * part // len(devices), n * (part + 1) // len(devices)
    h_in, h_out = ck.pinned_empty(hi - lo, np.float32), ck.pinned_empty(hi - lo, np.float32)
    shm = shared_memory.SharedMemory(name=in_name)
    try:
        np.copyto(h_in, np.ndarray((n,), np.float32, buffer=shm.buf)[lo:hi])
    finally:
        shm.close()
    best = device_phase(h_in, h_out, repeat)
    shm = shared_memory.SharedMemory(name=out_name)
    try:
        np.ndarray((n,), np.float32, buffer=shm.buf)[lo:hi] = h_out
    finally:
        shm.close()
    dev = ck.Device(ordinal)
    return {"ordinal": ordinal, "bus": dev.pci_bus_id, "count": hi - lo, "device_s": best}


def device_phase(h_in: np.ndarray, h_out: np.ndarray, repeat: int) -> float:
    """H2D -> scale_f32 -> D2H from pinned memory; best of *repeat* timed runs."""
    mod = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"), name="scale.cu"))
    kernel = mod.function("scale_f32")
    d_in, d_out = ck.DeviceBuffer(h_in.nbytes), ck.DeviceBuffer(h_out.nbytes)
    best = float("inf")
    for run in range(repeat + 1):  # run 0 warms up (module load, first touch)
        t0 = time.perf_counter()
        d_in.copy_from_host(h_in)
        kernel.launch(blocks_for(h_in.size), 256, d_in, d_out, h_in.size, ALPHA)
        d_out.copy_to_host(h_out)
        if run > 0:
            best = min(best, time.perf_counter() - t0)
    return best


def run_children(x: np.ndarray, devices: list[int], repeat: int) -> tuple[np.ndarray, list, float]:
    """Put *x* in shared memory, run one child per device, return (result, reports, s)."""
    n = x.size
    shm_in = shared_memory.SharedMemory(create=True, size=x.nbytes)
    shm_out = shared_memory.SharedMemory(create=True, size=x.nbytes)
    try:
        np.ndarray((n,), np.float32, buffer=shm_in.buf)[:] = x
        t0 = time.perf_counter()
        reports = run_per_device(
            scale_slice, devices, args=(shm_in.name, shm_out.name, n, devices, repeat)
        )
        wall = time.perf_counter() - t0
        y = np.ndarray((n,), np.float32, buffer=shm_out.buf).copy()
    finally:
        for shm in (shm_in, shm_out):
            shm.close()
            shm.unlink()
    return y, reports, wall


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--mb", type=float, default=256, help="MiB of float32 input in total")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs (best is reported)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 runs")
    parser.add_argument("--json", action="store_true", help="also print a RESULT json line")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.repeat = 16, 2
    n_dev = require_gpus("process_per_gpu.py")

    devices = list(range(n_dev))
    n = int(args.mb * (1 << 20)) // 4
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    y, reports, wall = run_children(x, devices, args.repeat)
    print(f"process_per_gpu: {n_dev} process(es), {n} float32 ({n * 4 / 2**20:.0f} MiB)")
    for r in reports:
        print(f"  device {r['ordinal']} ({r['bus']}), {r['count']} elements")
    expect("a different GPU for every child", len({r["bus"] for r in reports}) == n_dev)
    check("result", y, x * ALPHA)

    moved = 2 * n * 4
    best_dev = max(float(r["device_s"]) for r in reports)  # type: ignore[arg-type]
    print(f"device phase (H2D + kernel + D2H, slowest child): {gbps(moved, best_dev)}")
    print(f"run_per_device wall time (spawn + import + context + compile + work): {wall:.2f} s")
    if args.json:
        result = {"processes": n_dev, "nbytes": moved, "device_s": best_dev, "wall_s": wall}
        print("RESULT " + json.dumps(result))
    ok(f"process_per_gpu: {n_dev} process(es) scaled {n} floats, device {gbps(moved, best_dev)}")


if __name__ == "__main__":
    main()
