"""Cross-device dependency: device 1 waits on an event of device 0, then consumes its output.

Pattern: "event dependency control", as multi-GPU CUDA tutorials write it. Device 0 records
an event on its stream after producing ``b0 = 2 * x``; device 1's stream waits on that event
(``cudaStreamWaitEvent``), copies ``b0`` over with a peer copy and computes
``y = 3 * b0``. The host never blocks in between: the ordering happens on the GPUs. Device 0
spins first, so without the wait device 1 would read ``b0`` too early; the program shows
that too, for contrast, and checks the real result against numpy.

With one GPU a second context on device 0 stands in for device 1 (the event and the peer
copy still cross contexts).

The raw Driver-API version needs per device a context push/pop around every call,
``cuEventCreate`` in device 0's context, ``cuEventRecord`` on device 0's stream,
``cuStreamWaitEvent`` on device 1's stream, ``cuCtxEnablePeerAccess`` (and ignoring
``CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED``), ``cuMemcpyPeerAsync`` with both contexts, two
module loads (one per context) and hand-packed launch arguments.

    python examples/cross_device_dependency.py
"""

from __future__ import annotations

import numpy as np
from _common import blocks_for, check, example_parser, ok, require_gpus

import ctxkit as ck

COUNT = 1 << 22
SPIN_CYCLES = 50_000_000  # ~25 ms on an H200: device 0 is slow on purpose
TWO, THREE = np.float32(2.0), np.float32(3.0)


def main() -> None:
    example_parser(__doc__).parse_args()
    n = require_gpus("cross_device_dependency.py")
    with ck.bind(0):  # the main thread works with device 0's context current
        run(n)


def run(n: int) -> None:
    ctx0 = ck.registry.context(0)
    if n > 1:
        ctx1 = ck.registry.context(1)
    else:
        print("one GPU: a second context on device 0 plays device 1")
        ctx1 = ck.Context.create(0)
    # Kernels from ctxkit's library, compiled once (cached on disk) and loaded for every
    # context: one Kernel launches on whichever context is current.
    scale = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"))).function("scale_f32")
    spin = ck.Module.load(ck.compile(ck.kernel_source("spin.cu"))).function("spin")
    nbytes = COUNT * 4
    x = ck.pinned_empty(COUNT, np.float32)
    x[:] = np.random.default_rng(1).random(COUNT, dtype=np.float32)
    y = ck.pinned_zeros(COUNT, np.float32)

    s0, s1 = ck.Stream(ctx0), ck.Stream(ctx1)
    a0, b0 = ck.DeviceBuffer(nbytes, ctx0), ck.DeviceBuffer(nbytes, ctx0)
    a1, b1 = ck.DeviceBuffer(nbytes, ctx1), ck.DeviceBuffer(nbytes, ctx1)
    if n > 1 and ctx1.device.can_access_peer(ctx0.device):
        ck.enable_peer_access(ctx1, ctx0)  # device 1 reads device 0's memory directly
    grid = blocks_for(COUNT)

    def produce_on_device0() -> None:
        with ctx0:
            b0.memset(0, stream=s0)
            a0.copy_from_host(x, stream=s0)
            spin.launch(1, 1, SPIN_CYCLES, 0, stream=s0)
            scale.launch(grid, 256, a0, b0, COUNT, TWO, stream=s0)

    def consume_on_device1() -> bool:
        with ctx1:
            direct = ck.copy_peer(a1, b0, nbytes, stream=s1)
            scale.launch(grid, 256, a1, b1, COUNT, THREE, stream=s1)
            b1.copy_to_host(y, stream=s1)
        return direct

    produce_on_device0()
    done0 = s0.record(timing=False)  # cudaEventRecord(device0_done, streams[0])
    s1.wait(done0)  # cudaStreamWaitEvent(streams[1], device0_done, 0)
    direct = consume_on_device1()
    s1.synchronize()
    path = "direct peer access" if direct else "staged by the driver"
    print(f"device {ctx1.device.ordinal} consumed device 0's output ({path})")
    check("y == 3 * (2 * x) with the event wait", y, x * TWO * THREE)

    y[:] = -1
    produce_on_device0()
    consume_on_device1()  # no wait this time: the copy races device 0's spin
    s1.synchronize()
    s0.synchronize()
    stale = int(np.count_nonzero(y != x * TWO * THREE))
    print(f"for contrast, without the wait {stale} of {COUNT} values were stale (the race)")

    if n == 1:
        for obj in (s1, a1, b1):
            obj.close()
        ctx1.close()
    ok("event on device 0's stream -> stream wait on device 1 -> peer copy -> kernel")


if __name__ == "__main__":
    main()
