"""One host thread, one stream per device: H2D -> kernel -> D2H on every GPU, then sync all.

Pattern: "single thread + CUDA streams + device context switching", as multi-GPU CUDA
tutorials write it. The host thread enqueues, for each device in turn, an async H2D copy, a kernel
and an async D2H copy on that device's stream, then synchronizes every stream.

The tutorials' version copies from *pageable* host memory. The driver cannot copy pageable
memory asynchronously: ``cuMemcpyHtoDAsync`` blocks the host thread for the whole copy, so
the devices run one after the other. This program runs the literal pattern first, then the
same code with page-locked (pinned) staging arrays, where every enqueue returns at once and
the devices overlap; it prints GB/s for both and checks every result against numpy.

With one GPU it runs the same loop over that one device.

The raw Driver-API version needs, per device: ``cuDeviceGet``, ``cuDevicePrimaryCtxRetain``,
``cuCtxPushCurrent``/``cuCtxPopCurrent`` around every call (the tutorials'
``cudaSetDevice``), ``cuStreamCreate``, ``cuMemAlloc``, ``cuMemHostAlloc`` for pinned staging,
``cuModuleLoadData`` + ``cuModuleGetFunction``, a hand-packed ``void**`` argument array for
``cuLaunchKernel``, ``cuMemcpyHtoDAsync``/``cuMemcpyDtoHAsync``, ``cuStreamSynchronize``,
then every free and destroy in the right context, each call's ``CUresult`` checked.

    python examples/multi_device_streams.py [--mb 256]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from _common import blocks_for, check, example_parser, gbps, ok, require_gpus, timed

import ctxkit as ck

ALPHA = np.float32(3.0)


@dataclass
class Lane:
    """What one device needs: its context, its stream and its device buffers."""

    ctx: ck.Context
    stream: ck.Stream
    d_in: ck.DeviceBuffer
    d_out: ck.DeviceBuffer


def make_lanes(n_devices: int, nbytes: int) -> list[Lane]:
    lanes = []
    for i in range(n_devices):
        ctx = ck.registry.context(i)
        with ctx:
            lanes.append(Lane(ctx, ck.Stream(), ck.DeviceBuffer(nbytes), ck.DeviceBuffer(nbytes)))
    return lanes


def enqueue_and_wait(
    lanes: list[Lane], scale: ck.Kernel, xs: list[np.ndarray], ys: list[np.ndarray]
) -> float:
    """The pattern itself; returns the seconds the host spent enqueueing."""
    with timed() as enqueue:
        for lane, x, y in zip(lanes, xs, ys):
            with lane.ctx:  # the tutorials' cudaSetDevice(i)
                lane.d_in.copy_from_host(x, stream=lane.stream)
                scale.launch(
                    blocks_for(x.size),
                    256,
                    lane.d_in,
                    lane.d_out,
                    x.size,
                    ALPHA,
                    stream=lane.stream,
                )
                lane.d_out.copy_to_host(y, stream=lane.stream)
    for lane in lanes:
        with lane.ctx:
            lane.stream.synchronize()
    return enqueue[0]


def run(
    label: str, lanes: list[Lane], scale: ck.Kernel, xs: list[np.ndarray], ys: list[np.ndarray]
) -> float:
    enqueue_and_wait(lanes, scale, xs, ys)  # warm-up: lazy module load, first-touch costs
    for y in ys:
        y.fill(0)
    with timed() as total:
        enqueue_s = enqueue_and_wait(lanes, scale, xs, ys)
    moved = 2 * sum(x.nbytes for x in xs)
    print(
        f"{label:<28} {gbps(moved, total[0]):>11}  (host busy enqueueing "
        f"{enqueue_s * 1e3:.1f} ms of {total[0] * 1e3:.1f} ms)"
    )
    for i, (x, y) in enumerate(zip(xs, ys)):
        check(f"{label}, device {i}", y, x * ALPHA)
    return moved / total[0]


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--mb", type=int, default=256, help="MiB of float32 input per device")
    args = parser.parse_args()
    n = require_gpus("multi_device_streams.py")
    count = (args.mb << 20) // 4
    print(f"{n} device(s): {', '.join(d.name for d in ck.devices())}; {args.mb} MiB per device")

    scale = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"))).function("scale_f32")
    lanes = make_lanes(n, count * 4)
    rng = np.random.default_rng(0)
    pageable_in = [rng.random(count, dtype=np.float32) for _ in range(n)]
    pageable_out = [np.empty(count, np.float32) for _ in range(n)]

    with warnings.catch_warnings():
        # ctxkit warns that these async copies from pageable memory block the host: that
        # blocking is exactly what this first run shows.
        warnings.simplefilter("ignore")
        slow = run("pageable (tutorial as is)", lanes, scale, pageable_in, pageable_out)

    pinned_in = [ck.pinned_empty(count, np.float32) for _ in range(n)]
    pinned_out = [ck.pinned_empty(count, np.float32) for _ in range(n)]
    for src, dst in zip(pageable_in, pinned_in):
        np.copyto(dst, src)
    fast = run("pinned staging", lanes, scale, pinned_in, pinned_out)

    print(f"pinned / pageable: {fast / slow:.2f}x")
    ok(f"H2D -> scale_f32 -> D2H on {n} device(s), one host thread, one stream per device")


if __name__ == "__main__":
    main()
