"""A latency-critical request loop keeps its latency beside a batch job: SM partitions.

Pattern: one GPU serves small, latency-critical requests while a batch ``Pipeline.map``
saturates it. In one context the requests' kernels wait behind the batch's blocks (each
block of the batch kernel runs for ~2 ms); with green contexts, ``ck.Device(0).partition
([16])`` gives the requests 16 SMs of their own and the batch the rest, so the requests
keep their latency. The example runs the same loop three times -- idle, beside the batch
in the same context, and in a 16-SM partition beside the batch in the remaining SMs --
prints the latency percentiles and the batch throughput of each, and checks every
response and every batch result against numpy.

The raw Driver-API version needs ``cuDeviceGetDevResource``,
``cuDevSmResourceSplitByCount``, ``cuDevResourceGenerateDesc``, ``cuGreenCtxCreate`` and
``cuCtxFromGreenCtx`` for each partition, ``cuGreenCtxStreamCreate`` for every stream
(``cuStreamCreate`` would make a stream that runs on every SM), and the pipeline's
streams, staging and events per partition by hand.

    python examples/green_contexts.py [--requests 200] [--mb 64]
"""

from __future__ import annotations

import threading
import time

import numpy as np
from _common import blocks_for, check, example_parser, expect, ok, require_gpus

import ctxkit as ck

N = 4096  # elements of a request
SPIN_SECONDS = 2e-3  # how long each block of the batch kernel runs
RTOL = 2.0**-22  # a float32 result within 2 ulp (fused multiply-add vs numpy's a * x + y)


class Server:
    """Requests served on one stream of *ctx*: H2D -> saxpy -> D2H, then wait."""

    def __init__(self, ctx: ck.Context, saxpy: ck.Kernel) -> None:
        with ctx:
            self.stream = ck.Stream()
            self.x = ck.pinned_empty(N, np.float32)
            self.y = ck.pinned_empty(N, np.float32)
            self.d_x, self.d_y = ck.DeviceBuffer(N * 4), ck.DeviceBuffer(N * 4)
        saxpy.preload(ctx)  # loaded now: a lazy load at the first request could wait
        self.ctx, self.saxpy = ctx, saxpy

    def serve(self, requests: int, seed: int) -> list[float]:
        """Latencies in microseconds; every response is checked."""
        rng = np.random.default_rng(seed)
        out = []
        s = self.stream
        with self.ctx:
            for _ in range(requests):
                a = np.float32(rng.integers(1, 8))
                self.x[...] = rng.random(N, dtype=np.float32)
                self.y[...] = rng.random(N, dtype=np.float32)
                want = a * self.x + self.y
                t0 = time.perf_counter()
                self.d_x.copy_from_host(self.x, stream=s)
                self.d_y.copy_from_host(self.y, stream=s)
                self.saxpy.launch(blocks_for(N), 256, a, self.d_x, self.d_y, N, stream=s)
                self.d_y.copy_to_host(self.y, stream=s)
                s.synchronize()
                out.append((time.perf_counter() - t0) * 1e6)
                # the kernel's a*x+y is one fused multiply-add, numpy's two roundings
                if not np.allclose(self.y, want, rtol=RTOL, atol=0.0):
                    check("request result", self.y, want, RTOL)  # prints it, exits 1
        return out


class Batch:
    """``Pipeline.map`` over *lanes* in a background thread, again and again, until told
    to stop; each chunk runs a kernel whose blocks fill the lane's SMs for ~2 ms."""

    def __init__(self, lanes: list[ck.Context], spin: ck.Kernel, nbytes: int) -> None:
        try:  # kHz; deprecated in CUDA 13: assume 2 GHz where a driver no longer says
            khz = ck.Device(0).attribute("clock_rate") or 2_000_000
        except (ValueError, ck.CudaError):
            khz = 2_000_000
        cycles = int(SPIN_SECONDS * khz * 1e3)

        def body(ctx, stream, d_in, d_out, n):
            blocks = 8 * ctx.sm_count  # 8 blocks of 256 threads fill an SM
            spin.launch(blocks, 256, cycles, d_in.ptr, d_out.ptr, n, stream=stream)

        self.body = body
        self.pipeline = ck.Pipeline(lanes, options=ck.PipelineOptions(chunk_bytes=4 << 20))
        self.x = np.random.default_rng(1).random(nbytes // 4, dtype=np.float32)
        self.stop = threading.Event()
        self.runs = 0
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._loop, name="batch")

    def _loop(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            out = self.pipeline.map(self.body, self.x)
            self.seconds += time.perf_counter() - t0
            self.runs += 1
            if not np.array_equal(out, self.x):
                self.failed = True
                return

    def __enter__(self) -> Batch:
        self.failed = False
        self.thread.start()
        time.sleep(0.05)  # the batch is running when the first request comes
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.pipeline.close()
        expect("batch results", not self.failed and self.runs > 0, f"{self.runs} runs")

    def gbps(self) -> float:
        return self.runs * self.x.nbytes / max(self.seconds, 1e-9) / 1e9


def report(label: str, us: list[float], batch: Batch | None) -> float:
    p50, p99 = np.percentile(us, [50, 99])
    extra = f"; batch {batch.gbps():.1f} GB/s over {batch.runs} maps" if batch else ""
    print(f"{label:40s} p50 {p50:9.1f} us  p99 {p99:9.1f} us{extra}")
    return float(p50)


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--mb", type=int, default=64, help="size of the batch array")
    args = parser.parse_args()
    require_gpus("green_contexts.py")

    saxpy = ck.Module.load(ck.compile(ck.kernel_source("saxpy.cu"))).function("saxpy")
    spin = ck.Module.load(ck.compile(ck.kernel_source("spin.cu"))).function("spin_then_copy")
    prim = ck.Context.primary(0)
    nbytes = args.mb << 20

    idle = report("idle (primary context)", Server(prim, saxpy).serve(args.requests, 0), None)
    with Batch([prim], spin, nbytes) as batch:
        shared = report(
            "beside the batch, same context", Server(prim, saxpy).serve(args.requests, 1), batch
        )
    small, rest = ck.Device(0).partition([16])
    try:
        print(f"partitions: {small.sm_count} SMs for the requests, {rest.sm_count} for the batch")
        with Batch([rest], spin, nbytes) as batch:
            part = report(
                f"in a {small.sm_count}-SM partition beside it",
                Server(small, saxpy).serve(args.requests, 2),
                batch,
            )
    finally:
        small.close()
        rest.close()
    print(
        f"median latency: {part / idle:.1f}x idle with partitions, {shared / idle:.1f}x "
        f"idle without ({shared / part:.0f}x better with)"
    )
    ok(f"{3 * args.requests} requests and every batch result checked")


if __name__ == "__main__":
    main()
