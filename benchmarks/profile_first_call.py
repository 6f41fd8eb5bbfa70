"""Where the time of a ``Pipeline.map`` goes, call by call, for arrays it has never seen:
wall time, the path taken, and per stage the count, summed duration and span of its
trace intervals.

    PYTHONPATH=. python3 benchmarks/profile_first_call.py [--size-mb 1024] [--chunk-mb N]
        [--slots N] [--threads N] [--host-path split] [--no-trace]

Sections, each on float32 ``y = 2 x`` with freshly made pageable inputs (filled outside
the clock) unless said: the first calls of new pipelines (the first ever in the process
included), a long-lived pipeline with fresh inputs and default outputs, fresh inputs into
an output already touched, ``out="pinned"``, and the same input again and again (pin on
reuse). Throughput is input + output bytes per second. Per stage, ``busy`` is the summed
duration over the span: how many threads (host stages) or streams (GPU stages) worked on
it at once on average. With ``--no-trace`` only walls are printed.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from typing import Any

import numpy as np

import ctxkit as ck

MiB = 1 << 20


def reference_fills(n: int) -> None:
    """First-touch fill bandwidth of fresh pages with 1, 8 and 16 threads."""
    for nt in (1, 8, 16):
        a = np.empty(n, np.float32)
        parts = np.array_split(a, nt)
        t = time.perf_counter()
        threads = [threading.Thread(target=p.fill, args=(0.0,)) for p in parts]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        dt = time.perf_counter() - t
        print(f"ref first-touch fill {nt:2d} threads: {a.nbytes / dt / 1e9:5.1f} GB/s")
        del a, parts


def breakdown(pl: ck.Pipeline, label: str, wall: float, nbytes: int) -> None:
    """Print the call's wall, path and per-stage trace summary."""
    st = pl.last_stats
    print(f"-- {label}: wall {wall * 1e3:.1f} ms, {2 * nbytes / wall / 1e9:.1f} GB/s in+out, "
          f"path={st.path}")  # fmt: skip
    if not pl.tracing:
        return
    tl = pl.trace()
    agg: dict[tuple[str, str], list[Any]] = collections.defaultdict(lambda: [0, 0.0, 1e18, -1e18])
    for iv in tl:
        a = agg[(iv.name, "host" if iv.is_host else "gpu")]
        a[0] += 1
        a[1] += iv.end_ms - iv.start_ms
        a[2] = min(a[2], iv.start_ms)
        a[3] = max(a[3], iv.end_ms)
    t0 = min((a[2] for a in agg.values()), default=0.0)
    for (name, where), (c, tot, s, e) in sorted(agg.items(), key=lambda kv: kv[1][2]):
        span = max(e - s, 1e-9)
        print(f"   {name:<14} {where:<5} n={c:<5} sum={tot:8.1f} ms  span {s - t0:7.1f}.."
              f"{e - t0:7.1f} ms  busy {tot / span:4.1f}")  # fmt: skip
    gpu_ms = tl.busy_ms(lambda iv: not iv.is_host)
    print(f"   GPU busy (union of copies and kernels): {gpu_ms:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--chunk-mb", type=int, default=None, help="default: the pipeline's")
    ap.add_argument(
        "--slots", type=int, default=None, help="staging_buffers (default: the pipeline's)"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="host_threads (default: the pipeline's)"
    )
    ap.add_argument(
        "--host-path",
        default=None,
        help='e.g. "staged" or an input,output pair "split,auto" (default: the pipeline\'s)',
    )
    ap.add_argument("--no-trace", action="store_true")
    ap.add_argument("--new", type=int, default=3, help="first calls of new pipelines")
    args = ap.parse_args()

    n = args.size_mb * MiB // 4
    kw: dict[str, Any] = {"trace": not args.no_trace}
    if args.chunk_mb:
        kw["chunk_bytes"] = args.chunk_mb * MiB
    if args.slots:
        kw["staging_buffers"] = args.slots
    if args.threads:
        kw["host_threads"] = args.threads
    if args.host_path:
        kw["host_path"] = (
            tuple(args.host_path.split(",")) if "," in args.host_path else args.host_path
        )
    ctx = ck.registry.context(0)
    with ctx:
        scale = ck.Module.load(ck.compile(ck.kernel_source("scale.cu"))).function("scale_f32")
    two = np.float32(2.0)
    nbytes = n * 4

    def fresh() -> np.ndarray:
        x = np.empty(n, np.float32)
        x.fill(1.5)
        return x

    def check(y: np.ndarray) -> None:
        assert y[0] == 3.0 and y[-1] == 3.0 and y[n // 2] == 3.0, "wrong result"

    reference_fills(n)
    for i in range(args.new):
        x = fresh()
        t = time.perf_counter()
        pl = ck.Pipeline([0], options=ck.PipelineOptions(**kw))
        t1 = time.perf_counter()
        y = pl.map(scale, x, args=(two,))
        t2 = time.perf_counter()
        check(y)
        print(f"new Pipeline() {1e3 * (t1 - t):.1f} ms")
        breakdown(pl, f"first call of new pipeline #{i} (wall incl. Pipeline())", t2 - t, nbytes)
        pl.close()
        del y
    pl = ck.Pipeline([0], options=ck.PipelineOptions(**kw))
    check(pl.map(scale, fresh(), args=(two,)))
    for i in range(2):
        x = fresh()
        t = time.perf_counter()
        y = pl.map(scale, x, args=(two,))
        dt = time.perf_counter() - t
        check(y)
        breakdown(pl, f"long-lived, fresh in+out #{i}", dt, nbytes)
    for i in range(2):
        x = fresh()
        o = np.empty_like(x)
        o.fill(0)
        t = time.perf_counter()
        y = pl.map(scale, x, o, args=(two,))
        dt = time.perf_counter() - t
        check(y)
        breakdown(pl, f"long-lived, fresh in, touched out #{i}", dt, nbytes)
    for i in range(3):
        x = fresh()
        t = time.perf_counter()
        y = pl.map(scale, x, out="pinned", args=(two,))
        dt = time.perf_counter() - t
        check(y)
        breakdown(pl, f"long-lived, fresh in, out=pinned #{i}", dt, nbytes)
        del y
    x = fresh()
    for i in range(4):
        t = time.perf_counter()
        y = pl.map(scale, x, args=(two,))
        dt = time.perf_counter() - t
        check(y)
        breakdown(pl, f"repeated same x #{i}", dt, nbytes)
    pl.close()


if __name__ == "__main__":
    main()
