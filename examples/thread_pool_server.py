"""A thread pool serving requests on one shared context: a small HTTP-less inference server.

Pattern: the multithreaded host application of Driver-API tutorials, done right. Client
threads put requests on a queue; a ``ContextExecutor`` runs one serving loop per worker
thread, each with the shared context of device 0 current for its whole life (no
``CUDA_ERROR_INVALID_CONTEXT``, no per-request binding cost). Each worker owns a stream and
pinned staging buffers; a request is H2D copy -> kernel -> D2H copy on the worker's stream.
Every response is checked against numpy; latency percentiles and throughput are printed.

The raw Driver-API version needs ``cuCtxPushCurrent`` at the start of every worker thread and
``cuCtxPopCurrent`` at its end (on every exit path), a stream and ``cuMemHostAlloc`` staging
per worker, the launch arguments packed per request, and frees in the right context when
the pool shuts down.

    python examples/thread_pool_server.py [--workers 8] [--clients 16] [--requests 50]
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from _common import blocks_for, example_parser, expect, ok, require_gpus

import ctxkit as ck

MAX_ELEMENTS = 1 << 18


@dataclass
class Request:
    x: np.ndarray
    alpha: np.float32
    sent: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    y: np.ndarray | None = None
    error: BaseException | None = None
    latency: float = 0.0


class Lane:
    """A worker's own stream, pinned staging and device buffers (in the current context)."""

    def __init__(self) -> None:
        self.stream = ck.Stream()
        self.pin_in = ck.pinned_empty(MAX_ELEMENTS, np.float32)
        self.pin_out = ck.pinned_empty(MAX_ELEMENTS, np.float32)
        self.d_in = ck.DeviceBuffer(MAX_ELEMENTS * 4)
        self.d_out = ck.DeviceBuffer(MAX_ELEMENTS * 4)

    def run(self, req: Request, scale: ck.Kernel) -> np.ndarray:
        """H2D -> kernel -> D2H on the lane's stream; returns the response."""
        n, s = req.x.size, self.stream
        np.copyto(self.pin_in[:n], req.x)
        self.d_in[: n * 4].copy_from_host(self.pin_in[:n], stream=s)
        scale.launch(blocks_for(n), 256, self.d_in, self.d_out, n, req.alpha, stream=s)
        self.d_out[: n * 4].copy_to_host(self.pin_out[:n], stream=s)
        s.synchronize()
        return self.pin_out[:n].copy()

    def close(self) -> None:
        for obj in (self.stream, self.d_in, self.d_out):
            obj.close()


def serve(requests: queue.Queue[Request | None], scale: ck.Kernel) -> int:
    """One worker's loop; runs on a ContextExecutor thread (the context is current)."""
    lane: Lane | None = None
    failure: BaseException | None = None
    try:
        lane = Lane()
    except BaseException as exc:  # answer every request with the reason; never hang a client
        failure = exc
    served = 0
    while (req := requests.get()) is not None:
        try:
            if lane is None:
                raise RuntimeError(f"this worker could not start: {failure!r}")
            req.y = lane.run(req, scale)
        except BaseException as exc:
            req.error = exc
        req.latency = time.perf_counter() - req.sent
        req.done.set()
        served += 1
    if lane is not None:
        lane.close()
    return served


def client(
    seed: int, count: int, requests: queue.Queue[Request | None], done: list[Request]
) -> None:
    """Sends *count* requests one after another (no CUDA in this thread)."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, MAX_ELEMENTS + 1))
        req = Request(rng.random(n, dtype=np.float32), np.float32(rng.integers(1, 8)))
        requests.put(req)
        if not req.done.wait(timeout=120):
            req.error = TimeoutError("no response within 120 s (did a serving loop die?)")
        done.append(req)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50, help="per client")
    args = parser.parse_args()
    require_gpus("thread_pool_server.py")

    scale = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"))).function("scale_f32")
    ctx = ck.registry.context(0)
    requests: queue.Queue[Request | None] = queue.Queue()
    done: list[Request] = []
    t0 = time.perf_counter()
    with ck.ContextExecutor(ctx, max_workers=args.workers) as pool:
        loops = [pool.submit(serve, requests, scale) for _ in range(args.workers)]
        clients = [
            threading.Thread(target=client, args=(i, args.requests, requests, done))
            for i in range(args.clients)
        ]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        for _ in loops:
            requests.put(None)
        per_worker = [f.result() for f in loops]
    wall = time.perf_counter() - t0

    errors = [r.error for r in done if r.error is not None]
    expect("no request failed", not errors, repr(errors[:3]))
    wrong = sum(r.y is None or not np.array_equal(r.y, r.x * r.alpha) for r in done)
    expect(f"{len(done)} responses equal alpha * x", wrong == 0, f"{wrong} wrong responses")
    lat = np.array([r.latency for r in done]) * 1e3
    p50, p90, p99 = np.percentile(lat, [50, 90, 99])
    mb = sum(r.x.nbytes for r in done) * 2 / 1e6
    print(
        f"{len(done)} requests from {args.clients} clients on {args.workers} workers "
        f"in {wall:.2f} s: {len(done) / wall:.0f} req/s, {mb / wall:.0f} MB/s moved"
    )
    print(f"latency ms: p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}  max {lat.max():.2f}")
    print(f"requests per worker: {per_worker}")
    expect(
        "every request served once", sum(per_worker) == len(done) == args.clients * args.requests
    )
    ok(f"thread-pool server on {ctx!r}")


if __name__ == "__main__":
    main()
