"""Many host threads launching small kernels: each for itself, then through one LaunchQueue.

Pattern: a multithreaded host application where every thread drives its own stream with
many tiny kernels (a simulation step, a small request). Every driver call releases the GIL
and the thread queues for it again afterwards, so threads that launch for themselves lose
throughput as they are added. Handing the launches to one ``ck.LaunchQueue`` keeps the
rate near what one thread reaches: the threads only append to a queue, one launching
thread makes the driver calls. Each thread adds 1 to its own array *steps* times through a
prepared launch, both ways; every array is checked against numpy and both launch rates
are printed.

The raw Driver-API version needs a launching thread with the context pushed, a queue, a
way to hand each failure back to the thread that submitted the launch, and a flush so a
thread knows its launches were issued before it synchronizes its stream.

    python examples/launch_queue.py [--threads 8] [--steps 2000] [--elements 4096]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from _common import blocks_for, check, example_parser, ok, require_gpus

import ctxkit as ck

SOURCE = r"""
extern "C" __global__ void add_one(float* x, unsigned n)
{
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
"""


def run_threads(nthreads: int, body: Callable[[int, threading.Barrier], float]) -> float:
    """Run ``body(i, barrier)`` in *nthreads* threads; the slowest one's seconds."""
    barrier = threading.Barrier(nthreads)
    seconds: list[float] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            seconds.append(body(i, barrier))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(seconds)


def one_way(
    way: str, ctx: ck.Context, kernel: ck.Kernel, nthreads: int, steps: int, n: int
) -> tuple[float, list[np.ndarray]]:
    """Launches per second of *nthreads* threads launching *steps* times *way*, and each
    thread's array afterwards."""
    arrays: list[np.ndarray] = [np.empty(0)] * nthreads
    with ck.LaunchQueue(ctx) as q:

        def body(i: int, barrier: threading.Barrier) -> float:
            with ck.bind(ctx):
                stream = ck.Stream()
                x = ck.to_device(np.zeros(n, np.float32))
                launch = kernel.prepare(blocks_for(n), 256, x, n, stream=stream)
                barrier.wait()
                t0 = time.perf_counter()
                if way == "one LaunchQueue":
                    for _ in range(steps):
                        q.submit(launch)
                    q.flush()  # issued: from here the stream's own order holds
                else:
                    for _ in range(steps):
                        launch()
                stream.synchronize()
                seconds = time.perf_counter() - t0
                arrays[i] = x.to_host()
                stream.close()
                return seconds

        seconds = run_threads(nthreads, body)
    return nthreads * steps / seconds, arrays


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000, help="launches per thread")
    parser.add_argument("--elements", type=int, default=4096, help="floats per thread")
    args = parser.parse_args()
    require_gpus("launch_queue.py")

    ctx = ck.registry.context(0)
    with ctx:
        add_one = ck.Module.load(ck.compile(SOURCE, name="add_one.cu")).function("add_one")
    rates: dict[str, float] = {}
    want = np.full(args.elements, args.steps, np.float32)
    for way in ("each thread launches", "one LaunchQueue"):
        rates[way], arrays = one_way(way, ctx, add_one, args.threads, args.steps, args.elements)
        print(f"{way:>22s}: {rates[way]:12,.0f} launches/s from {args.threads} threads")
        for i, got in enumerate(arrays):
            check(f"{way}, thread {i}: {args.steps} increments", got, want)
    ratio = rates["one LaunchQueue"] / rates["each thread launches"]
    ok(
        f"{args.threads} threads x {args.steps} launches, every array right; "
        f"LaunchQueue {ratio:.2f}x the threads launching for themselves"
    )


if __name__ == "__main__":
    main()
