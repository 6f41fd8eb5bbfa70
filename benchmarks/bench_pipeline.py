"""Multi-GPU copy -> kernel -> copy: ctxkit Pipeline vs the naive pattern vs raw driver code.

    PYTHONPATH=. python3 benchmarks/bench_pipeline.py [--devices 1 2] [--size-gb 2] [--quick]

All in one run, on the same float32 arrays (out = 2 * x, every result checked exactly):

* host memcpy bandwidth (np.copyto, one thread and several): the ceiling of the staged
  host path (two host copies per input byte);
* cuMemHostRegister + cuMemHostUnregister of 2 GiB in 32/64 MiB pieces with 1-16
  threads: the ceiling of the registered host path (in and out: two registrations per
  input byte), and whether page-locking scales with threads;
* the source document's naive pattern (one host thread, per-device streams, pageable
  memory, literal async calls) with 1 and 8 chunks per device;
* ctxkit ``Pipeline.map`` on pageable arrays, 1 and 2 GPUs: the default (``"auto"``:
  the first call on new arrays stages them, the second page-locks them - pin on reuse -
  and later calls DMA them directly; each timed), ``host_path="staged"``, then
  ``"register"`` and the two mixed paths (every registering run after every staged
  one), staging again after registration, host threads per GPU on 2 GPUs (staged),
  plus a sweep of chunk size x host threads for both paths on 1 GPU;
* ctxkit on pinned arrays vs a hand-written raw cuda.bindings pinned pipeline (same
  chunking, plain driver calls, one host thread), interleaved run by run; also raw with
  ctxkit's four trace events per chunk and ctxkit without tracing, to show what differs;
* unified memory (``Pipeline.map_managed``) vs the explicit path;
* CuPy's ``asnumpy(asarray(x) * 2)`` on one GPU when CuPy is installed.

Targets (nvidia-h200-x2, 2 GiB): 1 GPU pageable >= 30 GB/s of input and >= 5.5x the
chunked naive pattern; 2 GPUs >= 1.8x 1 GPU; pinned >= 0.95x raw. Prints SUMMARY lines,
and for each throughput target the ceiling that bounds it on this machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pipeline_baselines import RawPinned, parallel_copy, time_registration

import ctxkit as ck
from ctxkit.cli.demo import NaivePattern, best_seconds, load_scale_kernel
from ctxkit.pipeline.plan import PAGE, choose_host_path, make_plan

MiB = 1 << 20
GiB = 1 << 30
ALPHA = 2.0
PATHS: dict[str, Any] = {
    "auto": "auto",
    "staged": "staged",
    "register": "register",
    "in-register-out-staged": ("register", "staged"),
    "in-staged-out-register": ("staged", "register"),
}


def summary(name: str, value: float, unit: str, target: str, ok: bool | None) -> None:
    verdict = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    print(f"SUMMARY {name} {value:.2f}{unit} (target {target}) {verdict}", flush=True)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def verify(name: str, out: np.ndarray, x: np.ndarray) -> None:
    if not np.array_equal(out, x * np.float32(ALPHA)):
        raise SystemExit(f"bench_pipeline: {name} produced a wrong result")


def timed(
    name: str, fn: Callable[[], Any], nbytes: int, repeats: int, results: dict[str, float]
) -> float:
    g = gbps(nbytes, best_seconds(fn, repeats))
    results[name] = max(g, results.get(name, 0.0))
    print(f"  {name:44s} {g:7.1f} GB/s", flush=True)
    return g


# --- host ceilings ---------------------------------------------------------------------


def bench_host(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    pinned = ck.pinned_empty(nbytes, np.uint8, context=ck.registry.context(0))
    dst[:] = 0
    pinned[:] = 0
    print(f"host memcpy, {nbytes // MiB} MiB (np.copyto, best of {repeats}):", flush=True)
    best = 0.0
    counts = sorted({1, 2, 4, 8, 12, 16, cpus()} & set(range(1, cpus() + 1)))
    for t in counts:
        pg = gbps(nbytes, best_seconds(functools.partial(parallel_copy, dst, src, t), repeats))
        pn = gbps(nbytes, best_seconds(functools.partial(parallel_copy, pinned, src, t), repeats))
        best = max(best, pg, pn)
        print(
            f"  {t:3d} thread(s): pageable->pageable {pg:6.1f} GB/s, "
            f"pageable->pinned {pn:6.1f} GB/s",
            flush=True,
        )
    summary("pipeline.host_memcpy_best", best, " GB/s", "report", None)
    print(
        f"  staging needs 2 host copies per input byte: staged ceiling ~{best / 2:.1f} GB/s "
        "of input processed (before the DMA traffic on the same memory)",
        flush=True,
    )
    return best


def bench_register(nbytes: int, repeats: int, quick: bool) -> float:
    """Page-locking rate; returns the best register+unregister rate in GB/s."""
    ctx = ck.registry.context(0)
    arr = np.ones(nbytes, np.uint8)
    threads = sorted({1, 4, 8, 16} & set(range(1, cpus() + 1)))
    print(
        f"cuMemHostRegister + cuMemHostUnregister (PORTABLE) of {nbytes // MiB} MiB of "
        f"populated pageable memory, best of {repeats}:",
        flush=True,
    )
    best = {"reg": (0.0, ""), "unreg": (0.0, ""), "both": (0.0, "")}
    one_thread = 0.0
    for piece_mib in (32,) if quick else (32, 64):
        for t in threads:
            try:
                n, r, u = time_registration(ctx._cu, arr, piece_mib * MiB, t, repeats)
            except RuntimeError as exc:
                print(f"  registration failed, section skipped: {exc}", flush=True)
                return 0.0
            rg, ug, both = gbps(n, r), gbps(n, u), gbps(n, r + u)
            where = f"{t} threads, {piece_mib} MiB pieces"
            for key, g in (("reg", rg), ("unreg", ug), ("both", both)):
                if g > best[key][0]:
                    best[key] = (g, where)
            if t == 1 and piece_mib == 32:
                one_thread = both
            print(
                f"  {piece_mib:3d} MiB pieces, {t:2d} thread(s): register {rg:6.1f} GB/s "
                f"({r / n * GiB * 1e3:5.1f} ms/GiB), unregister {ug:6.1f} GB/s, "
                f"both {both:6.1f} GB/s",
                flush=True,
            )
    fresh = np.empty(nbytes, np.uint8)  # untouched pages, like np.empty_like(x) output
    n, r, u = time_registration(ctx._cu, fresh, 32 * MiB, threads[-1], 1)
    print(
        f"  fresh (never touched) memory, {threads[-1]} threads: register {gbps(n, r):6.1f} "
        f"GB/s (faults the pages in), unregister {gbps(n, u):6.1f} GB/s",
        flush=True,
    )
    del fresh
    summary("pipeline.register_gbps_best", best["reg"][0], " GB/s", "report", None)
    summary("pipeline.unregister_gbps_best", best["unreg"][0], " GB/s", "report", None)
    summary("pipeline.register_unregister_gbps_best", best["both"][0], " GB/s", "report", None)
    if one_thread:
        scale = best["both"][0] / one_thread
        summary("pipeline.register_thread_scaling", scale, "x", "report", None)
    print(
        f"  best register+unregister: {best['both'][1]}; the registered path locks input "
        f"and output: ceiling ~{best['both'][0] / 2:.1f} GB/s of input processed",
        flush=True,
    )
    return best["both"][0]


# --- pipelines -------------------------------------------------------------------------


def bench_naive(
    kernel: Any,
    x: np.ndarray,
    out: np.ndarray,
    counts: Sequence[int],
    repeats: int,
    results: dict[str, float],
) -> None:
    print("the document's naive pattern (one thread, per-device streams, pageable):", flush=True)
    for nd in counts:
        ctxs = [ck.registry.context(i) for i in range(nd)]
        naive = NaivePattern(kernel, ctxs, -(-x.shape[0] // nd), 4)
        try:
            naive.run(x, out, (ALPHA,))
            verify(f"naive on {nd} GPU(s)", out, x)
            for chunks in (1, 8):
                timed(
                    f"naive_{nd}gpu_{chunks}chunk",
                    functools.partial(naive.run, x, out, (ALPHA,), chunks),
                    x.nbytes,
                    repeats,
                    results,
                )
        finally:
            naive.close()


def bench_ctxkit(
    kernel: Any,
    x: np.ndarray,
    out: np.ndarray,
    counts: Sequence[int],
    repeats: int,
    results: dict[str, float],
) -> None:
    """Every path on every device count; the paths that register pages run after all
    the others, so page-locking cannot affect the staged timings. ``..._staged_after_
    register`` times staging again after them (does registration leave the pages slower
    to copy?)."""
    print("ctxkit Pipeline.map, pageable in and out (default options but host_path):", flush=True)
    for registering in (False, True):
        for nd in counts:
            labels = list(PATHS) if nd == 1 else ["auto", "staged", "register"]
            mine = [lb for lb in labels if _registers(PATHS[lb]) == registering]
            with ck.Pipeline(list(range(nd))) as p:
                for label in mine:
                    _time_path(p, kernel, x, out, nd, label, PATHS[label], repeats, results)
                if not registering:
                    if nd > 1:
                        _thread_sweep(kernel, x, out, nd, repeats, results)
                    continue
                _time_path(
                    p, kernel, x, out, nd, "staged_after_register", "staged", repeats, results
                )
                timed(
                    f"ctxkit_{nd}gpu_pageable_register_dynamic",
                    functools.partial(
                        p.map,
                        kernel,
                        x,
                        out,
                        args=(ALPHA,),
                        host_path="register",
                        schedule="dynamic",
                    ),
                    x.nbytes,
                    repeats,
                    results,
                )
                timed(
                    f"ctxkit_{nd}gpu_pageable_auto_new_out",
                    functools.partial(p.map, kernel, x, args=(ALPHA,)),
                    x.nbytes,
                    repeats,
                    results,
                )


def _thread_sweep(
    kernel: Any, x: np.ndarray, out: np.ndarray, nd: int, repeats: int, results: dict[str, float]
) -> None:
    """Staged on *nd* GPUs with 4..12 host threads per GPU (the default is 8 per GPU)."""
    for per_gpu in (4, 6, 8, 12):
        t = per_gpu * nd
        if t > cpus() - 1:
            continue
        with ck.Pipeline(list(range(nd)), host_threads=t) as p:
            run = functools.partial(p.map, kernel, x, out, args=(ALPHA,), host_path="staged")
            run()
            timed(f"threads_{nd}gpu_staged_threads{t}", run, x.nbytes, repeats, results)


def _registers(path: Any) -> bool:
    sides = (path, path) if isinstance(path, str) else path
    return any(choose_host_path(side, MiB << 10) == "register" for side in sides)


def _time_path(
    p: ck.Pipeline,
    kernel: Any,
    x: np.ndarray,
    out: np.ndarray,
    nd: int,
    label: str,
    path: Any,
    repeats: int,
    results: dict[str, float],
) -> None:
    out.fill(0)
    run = functools.partial(p.map, kernel, x, out, args=(ALPHA,), host_path=path)
    if label == "auto":
        _time_pin_on_reuse(p, run, nd, x, out, results)
    run()
    verify(f"ctxkit {label} on {nd} GPU(s)", out, x)
    timed(f"ctxkit_{nd}gpu_pageable_{label}", run, x.nbytes, repeats, results)
    if label in ("auto", "staged_after_register"):
        _breakdown(p)
    if label == "auto":
        p.release_pinned()  # the explicit paths after it must see pageable memory again


def _time_pin_on_reuse(
    p: ck.Pipeline,
    run: Callable[[], Any],
    nd: int,
    x: np.ndarray,
    out: np.ndarray,
    results: dict[str, float],
) -> None:
    """The first two calls of ``"auto"`` on arrays the pipeline has not seen: the first
    stages, the second page-locks both arrays (pin on reuse) and runs directly."""
    p.release_pinned()
    for call in ("first_call", "second_call"):
        t0 = time.perf_counter()
        run()
        g = gbps(x.nbytes, time.perf_counter() - t0)
        results[f"ctxkit_{nd}gpu_auto_{call}"] = g
        print(f"  ctxkit_{nd}gpu_auto_{call:35s} {g:7.1f} GB/s ({p.last_stats.path})", flush=True)
    verify(f"ctxkit auto (pin on reuse) on {nd} GPU(s)", out, x)


def _breakdown(p: ck.Pipeline) -> None:
    stats = p.last_stats
    print(
        f"    path {stats.path}, {stats.fallbacks} fallbacks; per device: "
        + ", ".join(f"GPU {d.device} {d.gbps:.1f} GB/s ({d.chunks} chunks)" for d in stats.devices),
        flush=True,
    )
    busy = {k: {c: round(v, 1) for c, v in b.items()} for k, b in p.trace().breakdown().items()}
    print(f"    busy (ms): {busy}", flush=True)


def bench_sweep(
    kernel: Any, x: np.ndarray, out: np.ndarray, repeats: int, results: dict[str, float]
) -> None:
    print("  sweep on 1 GPU (host path x chunk MiB x host threads, static):", flush=True)
    threads = sorted({4, 8, 12, 16, max(2, cpus() - 3)} & set(range(1, cpus()))) or [2]
    for path in ("staged", "register"):
        for chunk_mib in (8, 16, 32, 64):
            for t in threads:
                with ck.Pipeline([0], chunk_bytes=chunk_mib * MiB, host_threads=t) as p:
                    run = functools.partial(p.map, kernel, x, out, args=(ALPHA,), host_path=path)
                    run()
                    timed(
                        f"sweep_{path}_chunk{chunk_mib}_threads{t}", run, x.nbytes, repeats, results
                    )
    for path in ("staged", "register"):
        mine = {k: v for k, v in results.items() if k.startswith(f"sweep_{path}_")}
        best = max(mine, key=mine.__getitem__)
        print(f"  best {path}: {best} {mine[best]:.1f} GB/s", flush=True)


def _interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each function over *rounds* rounds, the functions taking turns."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def bench_pinned(
    obj: Any,
    kernel: Any,
    x: np.ndarray,
    counts: Sequence[int],
    rounds: int,
    results: dict[str, float],
) -> dict[int, tuple[float, float]]:
    """Returns per device count ``(median ratio, best ratio)`` of ctxkit vs raw."""
    print(
        f"pinned in and out: ctxkit vs raw cuda.bindings pipeline ({rounds} interleaved "
        "rounds; median and best GB/s):",
        flush=True,
    )
    ctx0 = ck.registry.context(0)
    xp = ck.pinned_empty(x.shape, x.dtype, context=ctx0)
    op = ck.pinned_empty(x.shape, x.dtype, context=ctx0)
    xp[...] = x
    ratios: dict[int, tuple[float, float]] = {}
    for nd in counts:
        chunk = make_plan(x.shape[0], 4, nd).rows_per_chunk * 4
        raw = RawPinned(obj.code, list(range(nd)), chunk, ALPHA)
        raw_ev = RawPinned(obj.code, list(range(nd)), chunk, ALPHA, events=True)
        try:
            with ck.Pipeline(list(range(nd))) as p, ck.Pipeline(list(range(nd)), trace=False) as q:
                fns: dict[str, Callable[[], Any]] = {
                    f"raw_{nd}gpu_pinned": functools.partial(raw.run, xp, op),
                    f"ctxkit_{nd}gpu_pinned": functools.partial(
                        p.map, kernel, xp, op, args=(ALPHA,)
                    ),
                    f"raw_{nd}gpu_pinned_4events": functools.partial(raw_ev.run, xp, op),
                    f"ctxkit_{nd}gpu_pinned_notrace": functools.partial(
                        q.map, kernel, xp, op, args=(ALPHA,)
                    ),
                }
                for name, fn in fns.items():
                    op.fill(0)
                    fn()
                    verify(name, op, x)
                times = _interleaved(fns, rounds)
        finally:
            raw.close()
            raw_ev.close()
        for name, ts in times.items():
            med, best = gbps(x.nbytes, statistics.median(ts)), gbps(x.nbytes, min(ts))
            results[name] = best
            results[name + "_median"] = med
            print(f"  {name:44s} {med:7.1f} GB/s median, {best:7.1f} best", flush=True)
        r, c = f"raw_{nd}gpu_pinned", f"ctxkit_{nd}gpu_pinned"
        ratios[nd] = (results[c + "_median"] / results[r + "_median"], results[c] / results[r])
        base = results[r + "_median"]
        events, notrace = results[r + "_4events_median"], results[c + "_notrace_median"]
        print(
            f"  raw with 4 events per chunk: {events / base:.3f}x raw; ctxkit without "
            f"tracing: {notrace / base:.3f}x raw",
            flush=True,
        )
    return ratios


def bench_managed(
    kernel: Any, x: np.ndarray, nd: int, repeats: int, results: dict[str, float]
) -> float:
    print(f"unified memory (map_managed) on {nd} GPU(s):", flush=True)
    ctx0 = ck.registry.context(0)
    xb = ck.ManagedBuffer(x.nbytes, context=ctx0)
    ob = ck.ManagedBuffer(x.nbytes, context=ctx0)
    xm, om = xb.as_numpy(np.float32), ob.as_numpy(np.float32)
    xm[...] = x
    with ck.Pipeline(list(range(nd))) as p:
        p.map_managed(kernel, xm, om, args=(ALPHA,))
        verify("managed", om, x)
        g = timed(
            f"managed_{nd}gpu",
            functools.partial(p.map_managed, kernel, xm, om, args=(ALPHA,)),
            x.nbytes,
            repeats,
            results,
        )
    return g


def bench_cupy(x: np.ndarray, repeats: int, results: dict[str, float]) -> None:
    try:
        import cupy as cp
    except Exception:
        print("CuPy: not installed (skipped)", flush=True)
        return
    with cp.cuda.Device(0):
        out = cp.asnumpy(cp.asarray(x) * np.float32(ALPHA))
        verify("cupy", out, x)
        timed(
            "cupy_1gpu_asarray_asnumpy",
            lambda: cp.asnumpy(cp.asarray(x) * np.float32(ALPHA)),
            x.nbytes,
            repeats,
            results,
        )


# --- verdicts --------------------------------------------------------------------------


def best_pageable(results: dict[str, float], nd: int) -> tuple[str, float]:
    mine = {k: v for k, v in results.items() if k.startswith(f"ctxkit_{nd}gpu_pageable_")}
    name = max(mine, key=mine.__getitem__)
    return name, mine[name]


def report(
    results: dict[str, float],
    counts: Sequence[int],
    host_best: float,
    register_best: float,
    pinned: dict[int, tuple[float, float]],
    um: float,
) -> None:
    one = results["ctxkit_1gpu_pageable_auto"]
    summary("pipeline.1gpu_pageable_gbps", one, " GB/s", ">= 30", one >= 30)
    print(
        "  (repeated calls on the same arrays: pin on reuse DMAs them directly; a call on "
        "arrays the pipeline has not seen stages them:)",
        flush=True,
    )
    first = results["ctxkit_1gpu_auto_first_call"]
    summary("pipeline.1gpu_pageable_first_call_gbps", first, " GB/s", "report", None)
    summary(
        "pipeline.1gpu_pageable_second_call_gbps",
        results["ctxkit_1gpu_auto_second_call"],
        " GB/s",
        "report (locks the pages)",
        None,
    )
    summary(
        "pipeline.1gpu_first_call_vs_staged_ceiling", first / (host_best / 2), "x", "report", None
    )
    chunked = results["naive_1gpu_8chunk"]
    summary("pipeline.1gpu_vs_naive_chunked", one / chunked, "x", ">= 5.5x", one / chunked >= 5.5)
    fastest, g = best_pageable(results, 1)
    summary("pipeline.1gpu_auto_vs_fastest_path", one / g, "x", ">= 0.97x", one / g >= 0.97)
    print(f"  (fastest pageable variant on 1 GPU: {fastest} {g:.1f} GB/s)", flush=True)
    ceilings = {
        "host copy / 2 (staged, first call)": host_best / 2,
        "register+unregister / 2 (registered)": register_best / 2,
        "raw pinned DMA, 1 GPU (held, repeated calls)": results["raw_1gpu_pinned"],
    }
    ceil1 = results["raw_1gpu_pinned"]
    for what, v in ceilings.items():
        print(f"  ceiling: {what:40s} {v:6.1f} GB/s", flush=True)
    summary("pipeline.1gpu_ceiling_gbps", ceil1, " GB/s", "report", None)
    summary("pipeline.1gpu_vs_ceiling", one / ceil1, "x", "report", None)
    if 2 in counts:
        two = results["ctxkit_2gpu_pageable_auto"]
        summary("pipeline.2gpu_pageable_gbps", two, " GB/s", "report", None)
        summary("pipeline.2gpu_scaling", two / one, "x", ">= 1.80x", two / one >= 1.8)
        summary(
            "pipeline.2gpu_vs_naive_2gpu_chunked",
            two / results["naive_2gpu_8chunk"],
            "x",
            "report",
            None,
        )
        ceil2 = results["raw_2gpu_pinned"]
        print(
            f"  2 GPUs share the host memory: a raw cuda.bindings pinned pipeline reaches "
            f"{ceil2:.1f} GB/s on 2 GPUs = {ceil2 / results['raw_1gpu_pinned']:.2f}x its "
            "1-GPU figure (the scaling ceiling)",
            flush=True,
        )
        summary(
            "pipeline.2gpu_pageable_first_call_gbps",
            results["ctxkit_2gpu_auto_first_call"],
            " GB/s",
            "report",
            None,
        )
        summary("pipeline.2gpu_ceiling_gbps", ceil2, " GB/s", "report", None)
        summary("pipeline.2gpu_vs_ceiling", two / ceil2, "x", "report", None)
    else:
        print("SUMMARY pipeline.2gpu_scaling n/a (needs 2 GPUs) SKIP", flush=True)
    for nd in counts:
        med, best = pinned[nd]
        summary(f"pipeline.pinned_vs_raw_{nd}gpu", med, "x", ">= 0.95x (medians)", med >= 0.95)
        summary(f"pipeline.pinned_vs_raw_best_{nd}gpu", best, "x", "report", None)
    explicit = results[f"ctxkit_{counts[-1]}gpu_pinned"]
    summary(f"pipeline.um_vs_explicit_pinned_{counts[-1]}gpu", um / explicit, "x", "report", None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="GPU counts to run")
    ap.add_argument("--size-gb", type=float, default=2.0, help="input size in GiB")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="256 MiB, fewer repeats, no sweep")
    ap.add_argument("--no-sweep", action="store_true", help="skip the chunk/thread sweeps")
    args = ap.parse_args(argv)
    if ck.device_count() == 0:
        print("bench_pipeline: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    avail = ck.device_count()
    counts = sorted({d for d in args.devices if 1 <= d <= avail})
    skipped = sorted(set(args.devices) - set(counts))
    if skipped:
        print(f"bench_pipeline: only {avail} GPU(s): skipping device counts {skipped}")
    if not counts:
        print("bench_pipeline: no runnable device count", file=sys.stderr)
        return 1
    size = int((min(args.size_gb, 0.25) if args.quick else args.size_gb) * GiB) // 4 * 4
    repeats = args.repeats or (2 if args.quick else 3)
    obj, kernel, _ = load_scale_kernel()
    print(
        f"bench_pipeline: {size / GiB:.2f} GiB float32, GPUs {counts}, best of {repeats}, "
        f"{cpus()} CPUs, {PAGE} B pages",
        flush=True,
    )
    results: dict[str, float] = {}

    host_best = bench_host(min(size, GiB), repeats)
    register_best = bench_register(size, repeats, args.quick)
    x = np.random.default_rng(0).random(size // 4, dtype=np.float32)
    out = np.empty_like(x)
    out.fill(0)
    bench_naive(kernel, x, out, counts, repeats, results)
    bench_ctxkit(kernel, x, out, counts, repeats, results)
    if not (args.quick or args.no_sweep):
        bench_sweep(kernel, x, out, max(1, repeats - 1), results)
    pinned = bench_pinned(obj, kernel, x, counts, 3 if args.quick else 7, results)
    um = bench_managed(kernel, x[: min(x.shape[0], 4 * GiB // 4)], counts[-1], repeats, results)
    bench_cupy(x, repeats, results)
    report(results, counts, host_best, register_best, pinned, um)
    return 0


if __name__ == "__main__":
    sys.exit(main())
