"""A pool worker rewrites a GPU array in place and hands back a new one, no host copies.

Pattern: sharing device memory with worker processes, as ``torch.multiprocessing`` does
for CUDA tensors (and NVIDIA's ``simpleIPC`` sample by hand). A ``ctxkit.DevicePool``
task that takes a ``DeviceArray`` gets the parent's memory mapped in the worker (CUDA
IPC: a 64-byte handle travels, not the data); the worker scales it in place with a
kernel and the parent sees the result once the future is done. A second task allocates
its output in the worker and returns it: the parent gets a ``DeviceArray`` over a
``WorkerBuffer`` (the worker keeps the memory alive until the parent closes it) and
reads it directly. ``ctxkit.procs.traffic()`` shows what went through pipes and shared
memory (a few KiB of pickles) against the device memory that was shared.

Where the driver refuses CUDA IPC (some containers), the program prints the driver's
error and stops.

    python examples/pool_device_buffers.py [--mb 256]
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from _common import blocks_for, check, example_parser, expect, ok, require_gpus, timed

import ctxkit as ck
from ctxkit.procs import WorkerBuffer, traffic

_scale: list[ck.Kernel] = []


def load_kernel() -> None:
    """Pool initializer: compile ``scale_f32`` once per worker."""
    obj = ck.compile(ck.kernel_source("scale.cu"), name="scale.cu")
    _scale.append(ck.Module.load(obj).function("scale_f32"))


def scale_in_place(x: Any, alpha: float) -> int:
    """``x *= alpha`` on the parent's memory (runs in the worker)."""
    _scale[0].launch(blocks_for(x.size), 256, x, x, x.size, np.float32(alpha))
    return os.getpid()


def scaled_copy(x: Any, alpha: float) -> Any:
    """A new array ``alpha * x``, allocated in the worker and returned to the parent."""
    out = ck.device_array(x.shape, x.dtype)
    _scale[0].launch(blocks_for(x.size), 256, x, out, x.size, np.float32(alpha))
    return out


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--mb", type=int, default=256, help="MiB of float32 to share")
    args = parser.parse_args()
    require_gpus("pool_device_buffers.py")

    n = args.mb * 2**20 // 4
    host = np.arange(n, dtype=np.float32) % 1000
    x = ck.to_device(host, context=0)
    with ck.DevicePool([0], initializer=load_kernel) as pool:
        pool.submit(os.getpid).result(300)  # the worker is up
        before = traffic()
        try:
            with timed() as t:
                pid = pool.submit(scale_in_place, x, 2.0).result(300)
        except ck.CudaError as exc:
            ok(f"not run: the driver refuses CUDA IPC here: {exc}")
            return
        except ck.DeviceTaskError as exc:
            if exc.code and "cuIpc" in str(exc):
                ok(f"not run: the driver refuses CUDA IPC in the worker: {exc.child_exception}")
                return
            raise
        print(f"worker {pid} scaled {x.nbytes:,} bytes of the parent's memory in {t[0]:.3f} s")
        check("the worker's in-place write, seen by the parent", x.to_host(), 2 * host)

        y = pool.submit(scaled_copy, x, 1.5).result(300)
        moved = traffic() - before
        expect("the result lives in the worker", isinstance(y.buffer, WorkerBuffer))
        print(f"the result is {y.nbytes:,} bytes of worker {y.buffer.worker_pid}'s memory")
        check("the worker's result, read by the parent", y.to_host(), 3 * host)
        y.buffer.close()  # unmapped here; the worker frees it
    piped = moved.pipe_bytes_sent + moved.pipe_bytes_received
    shared = moved.shm_bytes_sent + moved.shm_bytes_received
    print(
        f"pipes carried {piped:,} bytes and shared memory {shared:,}; device memory shared "
        f"instead of copied: {moved.device_bytes_sent + moved.device_bytes_received:,} bytes"
    )
    expect("no array went through the host", piped + shared < 1 << 20, f"{moved}")
    ok(f"{args.mb} MiB scaled in place by a pool worker and {args.mb} MiB handed back")


if __name__ == "__main__":
    main()
