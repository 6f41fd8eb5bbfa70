"""Peer copies between devices, without and with peer access, both directions, with GB/s.

Pattern: ``cudaMemcpyPeer`` in a single process that drives several devices.
``ctxkit.copy_peer`` copies between memory of two
contexts; the driver copies directly over NVLink/PCIe once peer access is enabled
(``ctxkit.enable_peer_access``, idempotent) and stages through host memory otherwise. The
program measures both paths in both directions and checks the data after every copy.

Peer copies need two GPUs. With one GPU the program says so and prints no bandwidth (a
copy between two contexts of one device is an ordinary device copy); it still checks that
``copy_peer`` moves the data correctly between two contexts of device 0.

The raw Driver-API version needs ``cuDeviceCanAccessPeer``, ``cuCtxEnablePeerAccess`` in
each direction with its context pushed (and ``CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED``
handled, since a second call fails), ``cuMemcpyPeerAsync`` with both ``CUcontext`` handles,
and events created, recorded and timed in the right context.

    python examples/peer_copy.py [--mb 256] [--reps 10]
"""

from __future__ import annotations

import numpy as np
from _common import check, example_parser, expect, ok, require_gpus

import ctxkit as ck


def copy_rate(
    dst: ck.DeviceBuffer, src: ck.DeviceBuffer, stream: ck.Stream, reps: int
) -> tuple[float, bool]:
    """GB/s of ``reps`` peer copies on *stream* (timed with its events), and the path flag."""
    direct = ck.copy_peer(dst, src, stream=stream)  # warm-up
    start = stream.record()
    for _ in range(reps):
        ck.copy_peer(dst, src, stream=stream)
    end = stream.record()
    ms = start.elapsed_ms(end)
    return src.nbytes * reps / (ms / 1e3) / 1e9, direct


def both_ways(
    label: str,
    a: ck.DeviceBuffer,
    b: ck.DeviceBuffer,
    sa: ck.Stream,
    sb: ck.Stream,
    reps: int,
    report: bool = True,
) -> None:
    """Copy a -> b and b -> a, check the data each time, print GB/s when *report*."""
    x = np.random.default_rng(len(label)).integers(0, 256, a.nbytes, dtype=np.uint8)
    a.copy_from_host(x)
    b.memset(0)
    rate_ab, direct_ab = copy_rate(b, a, sb, reps)
    check(f"{label}: copy a -> b", b.copy_to_host(), x)
    a.memset(0)
    rate_ba, direct_ba = copy_rate(a, b, sa, reps)
    check(f"{label}: copy b -> a", a.copy_to_host(), x)
    if not report:
        return
    for name, rate, direct in (("a -> b", rate_ab, direct_ab), ("b -> a", rate_ba, direct_ba)):
        path = "direct" if direct else "staged"
        print(f"{label:<24} {name}: {rate:7.1f} GB/s ({path})")


def one_gpu(nbytes: int) -> None:
    """Only a correctness check: two contexts of device 0, no bandwidth figure."""
    print(
        "peer copy needs two GPUs and this machine has one: no peer bandwidth to measure. "
        "Checking copy_peer between two contexts of device 0 instead."
    )
    ctx_a, ctx_b = ck.registry.context(0), ck.Context.create(0)
    a, b = ck.DeviceBuffer(nbytes, ctx_a), ck.DeviceBuffer(nbytes, ctx_b)
    sa, sb = ck.Stream(ctx_a), ck.Stream(ctx_b)
    both_ways("two contexts of device 0", a, b, sa, sb, reps=1, report=False)
    for obj in (b, sb):  # everything in the owned context goes before the context
        obj.close()
    ctx_b.close()
    ok("copy_peer between two contexts of one GPU (peer copy itself needs two GPUs)")


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--mb", type=int, default=256, help="MiB per copy")
    parser.add_argument("--reps", type=int, default=10, help="timed copies per direction")
    args = parser.parse_args()
    n = require_gpus("peer_copy.py")
    nbytes = args.mb << 20

    with ck.bind(0):  # the main thread works with device 0's context current
        if n == 1:
            one_gpu(nbytes)
            return
        ctx_a, ctx_b = ck.registry.context(0), ck.registry.context(1)
        a, b = ck.DeviceBuffer(nbytes, ctx_a), ck.DeviceBuffer(nbytes, ctx_b)
        sa, sb = ck.Stream(ctx_a), ck.Stream(ctx_b)
        print(f"a: {ctx_a!r}\nb: {ctx_b!r}\n{args.mb} MiB x {args.reps} copies per direction")

        both_ways("without peer access", a, b, sa, sb, args.reps)
        can = ctx_a.device.can_access_peer(ctx_b.device)
        if can:
            for _ in range(2):  # the second round shows enable_peer_access is idempotent
                ck.enable_peer_access(ctx_a, ctx_b)
                ck.enable_peer_access(ctx_b, ctx_a)
            expect("peer access enabled both ways", ck.memory.peer_access_enabled(ctx_a, ctx_b))
            both_ways("with peer access", a, b, sa, sb, args.reps)
        else:
            print("devices 0 and 1 cannot access each other directly: only the staged path")
    ok("copy_peer both ways" + (", without and with peer access" if can else ""))


if __name__ == "__main__":
    main()
