"""Peer copies between devices, without and with peer access, both directions, with GB/s.

Pattern: the ``cudaMemcpyPeer`` row of the API table in 003_06465f0f39171761.txt section
3.1 (single process, many devices). ``ctxkit.copy_peer`` copies between memory of two
contexts; the driver copies directly over NVLink/PCIe once peer access is enabled
(``ctxkit.enable_peer_access``, idempotent) and stages through host memory otherwise. The
program measures both paths in both directions and checks the data after every copy.

With one GPU it copies between two contexts of device 0 (peer access does not apply).

The raw Driver-API version needs ``cuDeviceCanAccessPeer``, ``cuCtxEnablePeerAccess`` in
each direction with its context pushed (and ``CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED``
handled, since a second call fails), ``cuMemcpyPeerAsync`` with both ``CUcontext`` handles,
and events created, recorded and timed in the right context.

    python examples/peer_copy.py [--mb 256] [--reps 10]
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import check, ck, expect, ok, require_gpus


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
    label: str, a: ck.DeviceBuffer, b: ck.DeviceBuffer, sa: ck.Stream, sb: ck.Stream, reps: int
) -> None:
    x = np.random.default_rng(len(label)).integers(0, 256, a.nbytes, dtype=np.uint8)
    a.copy_from_host(x)
    b.memset(0)
    rate_ab, direct_ab = copy_rate(b, a, sb, reps)
    check(f"{label}: copy a -> b", b.copy_to_host(), x)
    a.memset(0)
    rate_ba, direct_ba = copy_rate(a, b, sa, reps)
    check(f"{label}: copy b -> a", a.copy_to_host(), x)
    for name, rate, direct in (("a -> b", rate_ab, direct_ab), ("b -> a", rate_ba, direct_ba)):
        path = "direct" if direct else "staged"
        print(f"{label:<24} {name}: {rate:7.1f} GB/s ({path})")


def main() -> None:
    n = require_gpus("peer_copy.py")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB per copy")
    parser.add_argument("--reps", type=int, default=10, help="timed copies per direction")
    args = parser.parse_args()
    nbytes = args.mb << 20

    with ck.bind(0):  # the main thread works with device 0's context current
        ctx_a = ck.registry.context(0)
        if n > 1:
            ctx_b = ck.registry.context(1)
        else:
            print("one GPU: copying between two contexts of device 0")
            ctx_b = ck.Context.create(0)
        a, b = ck.DeviceBuffer(nbytes, ctx_a), ck.DeviceBuffer(nbytes, ctx_b)
        sa, sb = ck.Stream(ctx_a), ck.Stream(ctx_b)
        print(f"a: {ctx_a!r}\nb: {ctx_b!r}\n{args.mb} MiB x {args.reps} copies per direction")

        both_ways("without peer access", a, b, sa, sb, args.reps)
        can = n > 1 and ctx_a.device.can_access_peer(ctx_b.device)
        if can:
            for _ in range(2):  # the second round shows enable_peer_access is idempotent
                ck.enable_peer_access(ctx_a, ctx_b)
                ck.enable_peer_access(ctx_b, ctx_a)
            expect("peer access enabled both ways", ck.memory.peer_access_enabled(ctx_a, ctx_b))
            both_ways("with peer access", a, b, sa, sb, args.reps)
        elif n > 1:
            print("devices 0 and 1 cannot access each other directly: only the staged path")
        if n == 1:
            for obj in (b, sb):
                obj.close()
            ctx_b.close()
    ok("copy_peer both ways" + (", without and with peer access" if can else ""))


if __name__ == "__main__":
    main()
