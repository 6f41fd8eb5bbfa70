"""Unified (managed) memory over every GPU: one allocation, one launch per device, one sync.

Pattern: "unified memory simplified implementation", as multi-GPU CUDA tutorials write it.
One managed allocation holds the whole input and one the output; the host writes the input
straight into it (no copy calls), each device prefetches its slice and runs the kernel on
it, every device is synchronized once, and the host reads the results in place.

The managed allocations stay at or below 64 MiB together: managed memory must never be
oversubscribed on a shared GPU machine. With one GPU the single device takes the whole
array.

The raw Driver-API version needs ``cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)``, a numpy view
built by hand over the raw pointer (and kept from outliving it), per device a
``cuCtxPushCurrent``, a stream, ``cuMemPrefetchAsync`` (whose signature differs between
cuda-bindings 12.x and 13.x: device ordinal vs ``CUmemLocation``), the launch, a pop;
then ``cuCtxSynchronize`` per device and ``cuMemFree`` in the allocating context.

    python examples/unified_memory.py [--mb 16]
"""

from __future__ import annotations

import numpy as np
from _common import blocks_for, check, example_parser, ok, require_gpus, timed

import ctxkit as ck

ALPHA = np.float32(0.5)
MAX_MB = 32  # per buffer: input + output stay <= 64 MiB of managed memory


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--mb", type=int, default=16, help=f"MiB per buffer (max {MAX_MB})")
    args = parser.parse_args()
    n = require_gpus("unified_memory.py")
    mb = max(1, min(args.mb, MAX_MB))
    count = (mb << 20) // 4

    ctxs = [ck.registry.context(i) for i in range(n)]
    scale = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"))).function("scale_f32")
    x = ck.ManagedBuffer(count * 4, context=ctxs[0])  # cudaMallocManaged
    y = ck.ManagedBuffer(count * 4, context=ctxs[0])
    xs = x.as_numpy(np.float32)
    ys = y.as_numpy(np.float32)
    xs[:] = np.random.default_rng(0).random(count, dtype=np.float32)  # the host writes it

    bounds = [(i * count // n, (i + 1) * count // n) for i in range(n)]
    streams = [ck.Stream(ctx) for ctx in ctxs]
    with timed() as t:
        for i, (ctx, stream, (lo, hi)) in enumerate(zip(ctxs, streams, bounds)):
            part_x, part_y = x[lo * 4 : hi * 4], y[lo * 4 : hi * 4]
            with ctx:  # cudaSetDevice(i)
                if ctx.device.attribute("concurrent_managed_access"):
                    part_x.prefetch(i, stream=stream)
                    part_y.prefetch(i, stream=stream)
                scale.launch(
                    blocks_for(hi - lo), 256, part_x, part_y, hi - lo, ALPHA, stream=stream
                )
                if ctx.device.attribute("concurrent_managed_access"):
                    part_y.prefetch("cpu", stream=stream)
        for ctx in ctxs:  # the tutorials' cudaDeviceSynchronize, once per device
            ctx.synchronize()
    for i, (lo, hi) in enumerate(bounds):
        print(f"device {i}: elements {lo}..{hi} ({(hi - lo) * 4 / 2**20:.1f} MiB in, same out)")
    print(f"{2 * mb} MiB of managed memory, prefetch + kernel + prefetch back: {t[0] * 1e3:.1f} ms")

    check("y == alpha * x, read in place from managed memory", ys, xs * ALPHA)
    del xs, ys  # numpy views keep managed memory alive; drop them before close()
    x.close()
    y.close()
    ok(f"one managed allocation, one launch per device on its slice, {n} device(s)")


if __name__ == "__main__":
    main()
