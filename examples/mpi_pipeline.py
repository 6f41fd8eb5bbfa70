"""One MPI rank per GPU: scatter an array, scale it on every GPU, gather and check it.

Pattern: "one process per GPU via MPI", the multi-process twin of the single-process
``ctxkit.Pipeline``. Each rank binds the GPU of its **node-local** rank
(``ctxkit.procs.mpi_local_device``: a ``COMM_TYPE_SHARED`` split, so it also works across
nodes, where the usual ``rank % deviceCount`` on the global rank would not), receives its
slice with ``Scatterv``, runs H2D -> ``scale_f32`` -> D2H from pinned memory, and rank 0
gathers the result with ``Gatherv`` and checks it against numpy.

Printed: each rank's device and PCI bus id, then the device phase (H2D + kernel + D2H,
slowest rank) and the end-to-end rate (scatter + device phase + gather, from rank 0's
array back to rank 0's array) in GB/s of input + output bytes, best of ``--repeat``.

    mpiexec -n <GPUs> python examples/mpi_pipeline.py [--mb 256] [--repeat 5] [--quick]
    mpiexec -n 4 python examples/mpi_pipeline.py --share-gpus   # more ranks than GPUs

Without ``--share-gpus`` a node may run at most one rank per GPU (more exit 2 with one
line saying so); with it, ranks share GPUs round robin (device = local rank % GPUs), and
the check is that every GPU of the node is used. Shared GPUs split their time between
the ranks, so the rates printed then are per node, not per GPU.

Needs mpi4py and an MPI runtime (``pip install -e ".[mpi]" mpich`` from a checkout).
Open MPI's ``mpiexec`` refuses to run as root (containers often do) unless started with
``--allow-run-as-root`` or with ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``
in the environment, and refuses more ranks than cores without ``--oversubscribe``. On a
machine without a GPU it exits 2 with one line (printed by rank 0 only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections import Counter
from typing import Any, NoReturn

import numpy as np
from _common import EXIT_NO_GPU, blocks_for, check, example_parser, expect, gbps, ok

import ctxkit as ck

ALPHA = np.float32(2.5)


def launcher_rank() -> int:
    """This process's rank as the MPI launcher tells it, before MPI is initialised."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def leave(reason: str) -> NoReturn:
    """Exit 2 with *reason* as the one line (printed by rank 0 only)."""
    if launcher_rank() == 0:
        print(reason, file=sys.stderr)
    sys.exit(EXIT_NO_GPU)


def require_gpu_and_mpi() -> None:
    """Exit 2 with one line (from rank 0) when this machine cannot run the example."""
    reason = ""
    if ck.device_count() == 0:
        reason = (
            "no GPU: mpi_pipeline.py needs an NVIDIA GPU and driver "
            "(ctxkit.device_count() == 0); run it on a GPU machine"
        )
    else:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            reason = 'mpi_pipeline.py needs mpi4py: pip install -e ".[mpi]" mpich'
    if reason:
        leave(reason)


def split(n: int, parts: int) -> tuple[list[int], list[int]]:
    """Counts and offsets of *parts* nearly equal contiguous slices of *n* elements."""
    bounds = [n * r // parts for r in range(parts + 1)]
    return [b - a for a, b in itertools.pairwise(bounds)], bounds[:-1]


def parse_args() -> argparse.Namespace:
    parser = example_parser(__doc__)
    parser.add_argument("--mb", type=float, default=256, help="MiB of float32 input in total")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs (best is reported)")
    parser.add_argument("--quick", action="store_true", help="16 MiB, 2 runs")
    parser.add_argument(
        "--share-gpus",
        action="store_true",
        help="allow more ranks per node than GPUs (ranks share GPUs round robin)",
    )
    parser.add_argument("--json", action="store_true", help="also print a RESULT json line")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.repeat = 16, 2
    return args


def check_gpu_use(ranks: list[tuple[Any, ...]], shared: bool) -> None:
    """Every rank has a GPU of its own; with sharing, every GPU of every node is used."""
    per_host = Counter(host for *_, host, _n in ranks)
    gpus = {host: n for *_, host, n in ranks}
    used = {(host, bus) for _r, _o, bus, _c, host, _n in ranks}
    if not shared:
        expect("a different GPU for every rank", len(used) == len(ranks), f"{sorted(used)}")
        return
    want = sum(min(per_host[h], gpus[h]) for h in per_host)
    print(f"ranks share GPUs: {len(ranks)} rank(s) on {want} GPU(s)")
    expect("every GPU of every node in use", len(used) == want, f"{sorted(used)}")


def main() -> None:
    args = parse_args()
    require_gpu_and_mpi()
    from mpi4py import MPI

    from ctxkit.procs import mpi_local_device

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:  # binds this rank's GPU for the main thread
        dev = mpi_local_device(comm, oversubscribe=args.share_gpus)
    except ValueError as exc:  # more ranks on this node than GPUs
        leave(f"mpi_pipeline.py: {exc}".replace("oversubscribe=True", "--share-gpus"))
    scale = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"), name="scale.cu"))
    kernel = scale.function("scale_f32")

    n = int(args.mb * (1 << 20)) // 4
    counts, offsets = split(n, size)
    mine = counts[rank]
    x = np.random.default_rng(0).random(n, dtype=np.float32) if rank == 0 else None
    y = np.empty(n, np.float32) if rank == 0 else None
    h_in, h_out = ck.pinned_empty(mine, np.float32), ck.pinned_empty(mine, np.float32)
    d_in, d_out = ck.DeviceBuffer(h_in.nbytes), ck.DeviceBuffer(h_out.nbytes)

    def device_phase() -> float:
        t0 = MPI.Wtime()
        d_in.copy_from_host(h_in)
        kernel.launch(blocks_for(mine), 256, d_in, d_out, mine, ALPHA)
        d_out.copy_to_host(h_out)
        return MPI.Wtime() - t0

    best_e2e = best_dev = float("inf")
    send = [x, counts, offsets, MPI.FLOAT] if rank == 0 else None
    recv = [y, counts, offsets, MPI.FLOAT] if rank == 0 else None
    for run in range(args.repeat + 1):  # run 0 warms up (module load, first touch)
        comm.Barrier()
        t0 = MPI.Wtime()
        comm.Scatterv(send, h_in, root=0)
        dev_s = device_phase()
        comm.Gatherv(h_out, recv, root=0)
        e2e = MPI.Wtime() - t0
        dev_s = comm.allreduce(dev_s, op=MPI.MAX)
        e2e = comm.allreduce(e2e, op=MPI.MAX)
        if run > 0:
            best_e2e, best_dev = min(best_e2e, e2e), min(best_dev, dev_s)

    host = MPI.Get_processor_name()
    ranks = comm.gather((rank, dev.ordinal, dev.pci_bus_id, mine, host, ck.device_count()))
    if rank != 0:
        return
    assert x is not None and y is not None and ranks is not None
    print(f"mpi_pipeline: {size} rank(s), {n} float32 ({n * 4 / 2**20:.0f} MiB), alpha={ALPHA}")
    for r, ordinal, bus, count, host, _n in ranks:
        print(f"  rank {r}: {host} device {ordinal} ({bus}), {count} elements")
    check_gpu_use(ranks, args.share_gpus)
    check("gathered result", y, x * ALPHA)
    moved = 2 * n * 4
    print(f"device phase (H2D + kernel + D2H, slowest rank): {gbps(moved, best_dev)}")
    print(f"end to end (scatter + device + gather): {gbps(moved, best_e2e)}")
    if args.json:
        result = {"ranks": size, "nbytes": moved, "device_s": best_dev, "e2e_s": best_e2e}
        print("RESULT " + json.dumps(result))
    ok(f"mpi_pipeline: {size} rank(s) scaled {n} floats, {gbps(moved, best_e2e)} end to end")


if __name__ == "__main__":
    main()
