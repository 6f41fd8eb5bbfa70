"""Multi-GPU copy -> kernel -> copy: ctxkit Pipeline vs the naive pattern vs raw driver code.

    PYTHONPATH=. python3 benchmarks/bench_pipeline.py [--devices 1 2] [--size-gb 2] [--quick]

All in one run, on float32 arrays (out = 2 * x, every result checked exactly):

* host memcpy bandwidth (np.copyto, one thread and several): the ceiling of the staged
  host path (two host copies per input byte);
* cuMemHostRegister + cuMemHostUnregister of 2 GiB in 32/64 MiB pieces with 1-16
  threads: the ceiling of the registered host path (in and out: two registrations per
  input byte), and whether page-locking scales with threads;
* the naive multi-GPU pattern as tutorials write it (one host thread, per-device streams, pageable
  memory, literal async calls) with 1 and 8 chunks per device, on arrays it reuses;
* **the cold first call** (not with ``--quick``): ``y = 2 x`` on 1 GiB in a fresh process
  per call, ctxkit beside PyTorch's two cold paths, medians of three rounds or more
  (benchmarks/pipeline_cold.py); it runs last, once this process has let its arrays go, so
  the children's gigabytes of fresh pages do not precede the warm first calls measured here;
* **first calls** (``--first-call-gb``, 1 GiB): arrays never seen, the call a user writes
  first, in this warm process (after an untimed round that fills the pinned pool). Each
  call gets a freshly made input (filled outside the clock) and the default ``out``;
  round by round: ``ck.Pipeline([0]).map(k, x)`` with a new Pipeline per call (also with
  ``out="pageable"``), the naive pattern (8 chunks) on fresh arrays writing a fresh
  ``np.empty_like`` output, and PyTorch's best path (``pin_memory()`` + non-blocking
  copies into a cached pinned output) when torch is installed; then a long-lived Pipeline
  fed fresh arrays (a stream of new batches) on 1 and 2 GPUs. These are reported in
  input + output bytes per second ("GB/s in+out");
* ctxkit ``Pipeline.map`` on pageable arrays it sees again, 1 and 2 GPUs, in this order:
  first the paths that lock no page of them (``host_path="staged"``, and host threads
  per GPU on 2 GPUs), then every path that does: the default (``"auto"``: the first call
  on new arrays stages them, the second page-locks them - pin on reuse - and later calls
  DMA them directly: ``in=held, out=held``; each timed; then released), on 1 GPU the
  caller holding the same arrays (``ck.register_host`` once, then map: auto's advantage
  given to an explicit path), ``"register"`` and the two mixed paths, staging again after
  registration; after them all a sweep of chunk size x host threads for both paths on
  1 GPU;
* ctxkit on pinned arrays vs a hand-written raw cuda.bindings pinned pipeline (same
  chunking, plain driver calls, one host thread), interleaved run by run; also raw with
  ctxkit's four trace events per chunk and ctxkit without tracing, to show what differs;
* unified memory (``Pipeline.map_managed``) vs the explicit path;
* CuPy's ``asnumpy(asarray(x) * 2)`` on one GPU when CuPy is installed.

Every target is decided on medians (the best run is printed beside it) and compares like
with like: first calls with the naive pattern on fresh arrays and fresh pageable outputs,
held pages with the naive pattern reusing its arrays and with the caller holding them.
Throughputs other than the first-call section are GB/s of input; the cold first call is
in ms. The targets and the verdict logic: benchmarks/pipeline_verdicts.py.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pipeline_baselines import RawPinned, parallel_copy, time_registration
from pipeline_cold import bench_cold
from pipeline_verdicts import BESIDE_CALLER, CALLER_HELD, HELD, IO, verdicts
from verdictlines import emit, median

import ctxkit as ck
from ctxkit.cli.demo import NaivePattern, load_scale_kernel
from ctxkit.memory.streamcopy import (
    copy_streaming,
    set_streaming_copy,
    streaming_copy_info,
    streaming_pays,
)
from ctxkit.pipeline.plan import PAGE, choose_host_path, plan_map

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
Results = dict[str, Any]


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


def timed(name: str, fn: Callable[[], Any], nbytes: int, repeats: int, results: Results) -> float:
    """Run *fn* *repeats* times; append each call's GB/s (of *nbytes*) to
    ``results[name]``; return the median."""
    rates = results.setdefault(name, [])
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(gbps(nbytes, time.perf_counter() - t0))
    print(f"  {name:44s} {median(rates):7.1f} GB/s median, {max(rates):7.1f} best", flush=True)
    return median(rates)


# --- host ceilings ---------------------------------------------------------------------


def _rates(fn: Callable[[], Any], nbytes: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(gbps(nbytes, time.perf_counter() - t0))
    return out


def bench_host(nbytes: int, repeats: int, results: Results) -> float:
    """Parallel host copies, np.copyto and ctxkit's streaming copy (non-temporal stores,
    what the pipeline's staging uses when available), for each thread count."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    pinned = ck.pinned_empty(nbytes, np.uint8, context=ck.registry.context(0))
    dst[:] = 0
    pinned[:] = 0
    info = streaming_copy_info()
    results["streaming_copy"] = info.reason
    print(f"host memcpy, {nbytes // MiB} MiB (best of {repeats}):", flush=True)
    best: list[float] = [0.0]
    best_stream: list[float] = [0.0]
    counts = sorted({1, 2, 4, 8, 12, 16, cpus()} & set(range(1, cpus() + 1)))
    for t in counts:
        pg = _rates(functools.partial(parallel_copy, dst, src, t), nbytes, repeats)
        pn = _rates(functools.partial(parallel_copy, pinned, src, t), nbytes, repeats)
        best = max(best, pg, pn, key=max)
        line = (
            f"  {t:3d} thread(s): np.copyto pageable->pageable {max(pg):6.1f} GB/s, "
            f"pageable->pinned {max(pn):6.1f} GB/s"
        )
        if info.active:
            st = _rates(
                functools.partial(parallel_copy, pinned, src, t, copy_streaming), nbytes, repeats
            )
            best_stream = max(best_stream, st, key=max)
            line += f"; streaming pageable->pinned {max(st):6.1f} GB/s"
        print(line, flush=True)
    print(f"  streaming copy: {info.reason}", flush=True)
    results["host_memcpy_best"] = max(best)
    results["host_memcpy_best_median"] = median(best)
    results["host_memcpy_repeats"] = repeats
    if info.active:
        results["host_streaming_best"] = max(best_stream)
        results["host_streaming_best_median"] = median(best_stream)
    top = max(max(best), max(best_stream))
    results["host_copy_best"] = top
    print(
        f"  staging needs 2 host copies per input byte: staged ceiling ~{top / 2:.1f} "
        "GB/s of input processed (before the DMA traffic on the same memory)",
        flush=True,
    )
    return top


def bench_register(nbytes: int, repeats: int, quick: bool, results: Results) -> float:
    """Page-locking rate; returns the best register+unregister rate in GB/s (and puts
    ``register_best`` in *results*)."""
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
                n, r, u = time_registration(ctx.cu, arr, piece_mib * MiB, t, repeats)
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
    n, r, u = time_registration(ctx.cu, fresh, 32 * MiB, threads[-1], 1)
    print(
        f"  fresh (never touched) memory, {threads[-1]} threads: register {gbps(n, r):6.1f} "
        f"GB/s (faults the pages in), unregister {gbps(n, u):6.1f} GB/s",
        flush=True,
    )
    del fresh
    results["register_best"] = {k: v[0] for k, v in best.items()}
    results["register_best"]["one_thread"] = one_thread
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
    results: Results,
) -> None:
    print("the naive pattern (one thread, per-device streams, pageable):", flush=True)
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


# --- first calls: arrays never seen ------------------------------------------------------


def fresh_copy(base: np.ndarray) -> np.ndarray:
    """A new array (new pages, populated) holding *base*: input a call has never seen."""
    x = np.empty_like(base)
    np.copyto(x, base)
    return x


def torch_pinned_variant(
    base: np.ndarray,
) -> tuple[Callable[[np.ndarray], np.ndarray] | None, str]:
    """PyTorch's best path for a fresh numpy array: ``pin_memory()`` (its caching host
    allocator), non-blocking H2D, the kernel, a non-blocking D2H into a cached pinned
    output; ``(None, reason)`` without torch."""
    try:
        import torch
    except Exception as exc:
        return None, f"torch is not installed ({type(exc).__name__})"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    dev = torch.device("cuda", 0)
    out_t = torch.empty(base.shape, dtype=torch.float32, pin_memory=True)

    def run(x: np.ndarray) -> np.ndarray:
        d = torch.from_numpy(x).pin_memory().to(dev, non_blocking=True)
        d.mul_(ALPHA)
        out_t.copy_(d, non_blocking=True)
        torch.cuda.synchronize(dev)
        return out_t.numpy()

    return run, f"torch {torch.__version__}: pin_memory() + non-blocking copies, cached output"


def bench_first_calls(kernel: Any, base: np.ndarray, calls: int, results: Results) -> None:
    """GB/s in+out of calls on arrays never seen, variants taking turns call by call:
    a new 1-GPU Pipeline per call (default ``out``, ``out="pageable"``, and
    ``host_path="split"`` for the input), the naive pattern (8 chunks) on fresh arrays
    into a fresh ``np.empty_like`` output (what ``out="pageable"`` makes, so the two
    compare like with like), torch's pinned path. One untimed warm-up round first."""
    print(
        f"first calls on arrays never seen ({base.nbytes / GiB:.2f} GiB, fresh input each "
        f"call, default out; median of {calls}, GB/s in+out):",
        flush=True,
    )
    ctx0 = ck.registry.context(0)
    naive = NaivePattern(kernel, [ctx0], base.shape[0], 4)

    def new_pipeline(x: np.ndarray) -> np.ndarray:
        with ck.Pipeline([0]) as p:
            out = p.map(kernel, x, args=(ALPHA,))
            results["path_new_pipeline_1gpu"] = p.last_stats.path
        return out

    def new_pipeline_pageable(x: np.ndarray) -> np.ndarray:
        with ck.Pipeline([0]) as p:
            return p.map(kernel, x, args=(ALPHA,), out="pageable")

    def new_pipeline_split(x: np.ndarray) -> np.ndarray:
        with ck.Pipeline([0], options=ck.PipelineOptions(host_path=("split", "auto"))) as p:
            return p.map(kernel, x, args=(ALPHA,))

    def naive_fresh(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        naive.run(x, out, (ALPHA,), 8)
        return out

    variants: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "new_pipeline_1gpu_io": new_pipeline,
        # the output in fresh pageable pages (drained through staging): the naive side's kind
        "new_pipeline_1gpu_pageable_out_io": new_pipeline_pageable,
        # informational: input registered from the far end while staged from the near
        # one (host_path="split"), to decide whether "auto" should take it
        "new_pipeline_1gpu_split_io": new_pipeline_split,
        "naive_1gpu_8chunk_fresh_io": naive_fresh,
    }
    torch_run, results["torch_note"] = torch_pinned_variant(base)
    if torch_run is not None:
        variants["torch_pinned_1gpu_io"] = torch_run
    try:
        for i in range(calls + 1):
            for name, fn in variants.items():
                x = fresh_copy(base)
                t0 = time.perf_counter()
                out = fn(x)
                seconds = time.perf_counter() - t0
                verify(name, out, x)
                rate = gbps(x.nbytes + out.nbytes, seconds)
                if i:
                    results.setdefault(name, []).append(rate)
                else:
                    results.setdefault("warmup_round_io", {})[name] = rate
                del x, out
    finally:
        naive.close()
    for name in variants:
        v = results[name]
        print(f"  {name:44s} {median(v):7.1f} {IO} median, {max(v):7.1f} best", flush=True)
    print(f"  ({results['torch_note']})", flush=True)


def bench_fresh_long_lived(
    kernel: Any, base: np.ndarray, counts: Sequence[int], calls: int, results: Results
) -> None:
    """A long-lived Pipeline fed a fresh array every call (default ``out``): GB/s in+out
    of *calls* calls after one untimed warm-up call, on each device count. On 1 GPU,
    calls with the staging copies made by np.copyto take turns with them (the same
    pipeline, :func:`ctxkit.memory.set_streaming_copy` off), when streaming copies are
    available and the arrays are big enough for the pipeline to use them."""
    print("long-lived Pipeline, fresh arrays every call (GB/s in+out):", flush=True)
    for nd in counts:
        name = f"fresh_{nd}gpu_io"
        variants = [(name, True)]
        if nd == 1 and streaming_copy_info().active and streaming_pays(base.nbytes):
            variants.append(("fresh_1gpu_plain_copy_io", False))
        with ck.Pipeline(list(range(nd))) as p:
            for i in range(calls + 1):
                for key, streaming in variants:
                    x = fresh_copy(base)
                    previous = set_streaming_copy(streaming)
                    try:
                        t0 = time.perf_counter()
                        out = p.map(kernel, x, args=(ALPHA,))
                        seconds = time.perf_counter() - t0
                    finally:
                        set_streaming_copy(previous)
                    verify(key, out, x)
                    if i:
                        results.setdefault(key, []).append(gbps(x.nbytes + out.nbytes, seconds))
                    del x, out
            results[f"path_{name}"] = p.last_stats.path
        for key, _ in variants:
            v = results[key]
            print(
                f"  {key:44s} {median(v):7.1f} {IO} median, {max(v):7.1f} best "
                f"({results[f'path_{name}']})",
                flush=True,
            )


# --- arrays seen again -------------------------------------------------------------------


def bench_ctxkit(
    kernel: Any,
    x: np.ndarray,
    out: np.ndarray,
    counts: Sequence[int],
    repeats: int,
    results: Results,
) -> None:
    """Every path on every device count. The paths that lock no page of *x* or *out*
    (staged, and the host-thread counts on 2 GPUs) run first, on every device count, and
    every path that locks them after: ``"auto"`` (pin on reuse locks them on its second
    call and releases them when timed), on 1 GPU the caller holding them
    (``ck.register_host``), ``"register"`` and the mixed paths. So no staged timing sees
    pages that were locked. ``..._staged_after_register`` times staging again after them
    (does registration leave the pages slower to copy?)."""
    print("ctxkit Pipeline.map, pageable in and out (default options but host_path):", flush=True)
    for locking in (False, True):
        for nd in counts:
            labels = list(PATHS) if nd == 1 else ["auto", "staged", "register"]
            mine = [lb for lb in labels if _locks_pages(lb) == locking]
            with ck.Pipeline(list(range(nd))) as p:
                for label in mine:
                    _time_path(p, kernel, x, out, nd, label, PATHS[label], repeats, results)
                    if label == "auto" and nd == 1:
                        _time_caller_held(p, kernel, x, out, repeats, results)
                if not locking:
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
                        options=ck.PipelineOptions(host_path="register", schedule="dynamic"),
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


def _time_caller_held(
    p: ck.Pipeline, kernel: Any, x: np.ndarray, out: np.ndarray, repeats: int, results: Results
) -> None:
    """Auto's advantage given to an explicit path: the caller page-locks a copy of *x* and
    *out* once (``ck.register_host``) and maps it again and again, timed after one untimed
    call as auto's held calls are, in rounds that take turns with auto's held calls on *x*
    and *out* (``..._auto_beside_register_host``), so both see the same state of the
    host. Locked memory moves directly whatever the host path: ``host_path="staged"``
    only keeps pin on reuse away from the caller's pages. The copy lies on pages of its
    own, so registering it cannot touch a page auto holds."""
    x2, out2 = own_pages_like(x), own_pages_like(out)
    np.copyto(x2, x)
    with ck.register_host(x2), ck.register_host(out2):
        caller = functools.partial(
            p.map, kernel, x2, out2, args=(ALPHA,), options=ck.PipelineOptions(host_path="staged")
        )
        auto = functools.partial(p.map, kernel, x, out, args=(ALPHA,))
        caller()
        verify("ctxkit on arrays the caller registered", out2, x2)
        name = f"ctxkit_1gpu_{CALLER_HELD}"
        results[f"path_{name}"] = p.last_stats.path
        auto()
        paths = set()
        for i in range(max(3, repeats)):
            sides = [(name, caller), (BESIDE_CALLER, auto)]
            for key, fn in sides if i % 2 else sides[::-1]:
                t0 = time.perf_counter()
                fn()
                results.setdefault(key, []).append(gbps(x.nbytes, time.perf_counter() - t0))
                if key == BESIDE_CALLER:
                    paths.add(p.last_stats.path)
    # a timed auto call that was not held is the one the check reports
    results[f"path_{BESIDE_CALLER}"] = min(paths, key=lambda path: path == HELD)
    for key in (name, BESIDE_CALLER):
        v = results[key]
        print(f"  {key:44s} {median(v):7.1f} GB/s median, {max(v):7.1f} best", flush=True)


def own_pages_like(a: np.ndarray) -> np.ndarray:
    """An array like *a* on an anonymous mapping of its own (no page shared with any
    other array), zero-filled."""
    buf = mmap.mmap(-1, max(a.nbytes, 1))
    return np.frombuffer(buf, a.dtype, count=a.size).reshape(a.shape)


def _thread_sweep(
    kernel: Any, x: np.ndarray, out: np.ndarray, nd: int, repeats: int, results: Results
) -> None:
    """Staged on *nd* GPUs with 4..12 host threads per GPU (the default is 8 per GPU)."""
    for per_gpu in (4, 6, 8, 12):
        t = per_gpu * nd
        if t > cpus() - 1:
            continue
        with ck.Pipeline(list(range(nd)), options=ck.PipelineOptions(host_threads=t)) as p:
            run = functools.partial(
                p.map, kernel, x, out, args=(ALPHA,), options=ck.PipelineOptions(host_path="staged")
            )
            run()
            timed(f"threads_{nd}gpu_staged_threads{t}", run, x.nbytes, repeats, results)


def _locks_pages(label: str) -> bool:
    """Whether path *label* page-locks the arrays: ``"auto"`` (pin on reuse) and every
    path that registers a side."""
    path = PATHS[label]
    sides = (path, path) if isinstance(path, str) else path
    return label == "auto" or any(choose_host_path(s, MiB << 10) == "register" for s in sides)


def _time_path(
    p: ck.Pipeline,
    kernel: Any,
    x: np.ndarray,
    out: np.ndarray,
    nd: int,
    label: str,
    path: Any,
    repeats: int,
    results: Results,
) -> None:
    out.fill(0)
    run = functools.partial(
        p.map, kernel, x, out, args=(ALPHA,), options=ck.PipelineOptions(host_path=path)
    )
    if label == "auto":
        _time_pin_on_reuse(p, run, nd, x, out, results)
    run()
    verify(f"ctxkit {label} on {nd} GPU(s)", out, x)
    name = f"ctxkit_{nd}gpu_pageable_{label}"
    timed(name, run, x.nbytes, repeats, results)
    results[f"path_{name}"] = p.last_stats.path
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
    results: Results,
) -> None:
    """The first two calls of ``"auto"`` on arrays the pipeline has not seen: the first
    stages, the second page-locks both arrays (pin on reuse) and runs directly."""
    p.release_pinned()
    for call in ("first_call", "second_call"):
        t0 = time.perf_counter()
        run()
        g = gbps(x.nbytes, time.perf_counter() - t0)
        name = f"ctxkit_{nd}gpu_auto_{call}"
        results[name] = [g]
        results[f"path_{name}"] = p.last_stats.path
        print(f"  {name:44s} {g:7.1f} GB/s ({p.last_stats.path})", flush=True)
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
    kernel: Any, x: np.ndarray, out: np.ndarray, repeats: int, results: Results
) -> None:
    print("  sweep on 1 GPU (host path x chunk MiB x host threads, static):", flush=True)
    threads = sorted({4, 8, 12, 16, max(2, cpus() - 3)} & set(range(1, cpus()))) or [2]
    for path in ("staged", "register"):
        for chunk_mib in (8, 16, 32, 64):
            for t in threads:
                with ck.Pipeline(
                    [0], options=ck.PipelineOptions(chunk_bytes=chunk_mib * MiB, host_threads=t)
                ) as p:
                    run = functools.partial(
                        p.map,
                        kernel,
                        x,
                        out,
                        args=(ALPHA,),
                        options=ck.PipelineOptions(host_path=path),
                    )
                    run()
                    timed(
                        f"sweep_{path}_chunk{chunk_mib}_threads{t}", run, x.nbytes, repeats, results
                    )
    for path in ("staged", "register"):
        mine = {k: median(v) for k, v in results.items() if k.startswith(f"sweep_{path}_")}
        best = max(mine, key=mine.__getitem__)
        print(f"  best {path}: {best} {mine[best]:.1f} GB/s (median)", flush=True)


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
    obj: Any, kernel: Any, x: np.ndarray, counts: Sequence[int], rounds: int, results: Results
) -> None:
    """ctxkit vs raw on pinned arrays, interleaved: GB/s of every round in *results*.

    The rounds also take turns with ``ctxkit_<n>gpu_held``: the pageable *x* mapped
    again by a Pipeline that holds its pages (pin on reuse), so the held path is
    compared with the raw pinned pipeline under the same conditions."""
    print(
        f"pinned in and out: ctxkit vs raw cuda.bindings pipeline ({rounds} interleaved "
        "rounds; median and best GB/s):",
        flush=True,
    )
    ctx0 = ck.registry.context(0)
    xp = ck.pinned_empty(x.shape, x.dtype, context=ctx0)
    op = ck.pinned_empty(x.shape, x.dtype, context=ctx0)
    xp[...] = x
    held_out = np.zeros_like(x)
    for nd in counts:
        chunk = plan_map(x.shape[0], (4, 4), nd).rows_per_chunk * 4
        raw = RawPinned(obj.code, list(range(nd)), chunk, ALPHA)
        raw_ev = RawPinned(obj.code, list(range(nd)), chunk, ALPHA, events=True)
        devices = list(range(nd))
        try:
            with (
                ck.Pipeline(devices) as p,
                ck.Pipeline(devices, options=ck.PipelineOptions(trace=False)) as q,
                ck.Pipeline(devices) as h,
            ):
                fns: dict[str, Callable[[], Any]] = {
                    f"raw_{nd}gpu_pinned": functools.partial(raw.run, xp, op),
                    f"ctxkit_{nd}gpu_pinned": functools.partial(
                        p.map, kernel, xp, op, args=(ALPHA,)
                    ),
                    f"raw_{nd}gpu_pinned_4events": functools.partial(raw_ev.run, xp, op),
                    f"ctxkit_{nd}gpu_pinned_notrace": functools.partial(
                        q.map, kernel, xp, op, args=(ALPHA,)
                    ),
                    f"ctxkit_{nd}gpu_held": functools.partial(
                        h.map, kernel, x, held_out, args=(ALPHA,)
                    ),
                }
                for _ in range(2):  # the calls that stage, then lock the pages
                    h.map(kernel, x, held_out, args=(ALPHA,))
                for name, fn in fns.items():
                    dst = held_out if name.endswith("_held") else op
                    dst.fill(0)
                    fn()
                    verify(name, dst, x)
                results[f"path_ctxkit_{nd}gpu_held"] = h.last_stats.path
                times = _interleaved(fns, rounds)
        finally:
            raw.close()
            raw_ev.close()
        for name, ts in times.items():
            results[name] = [gbps(x.nbytes, t) for t in ts]
            v = results[name]
            print(f"  {name:44s} {median(v):7.1f} GB/s median, {max(v):7.1f} best", flush=True)
        base = median(results[f"raw_{nd}gpu_pinned"])
        events = median(results[f"raw_{nd}gpu_pinned_4events"])
        notrace = median(results[f"ctxkit_{nd}gpu_pinned_notrace"])
        print(
            f"  raw with 4 events per chunk: {events / base:.3f}x raw; ctxkit without "
            f"tracing: {notrace / base:.3f}x raw",
            flush=True,
        )


def bench_managed(kernel: Any, x: np.ndarray, nd: int, repeats: int, results: Results) -> None:
    print(f"unified memory (map_managed) on {nd} GPU(s):", flush=True)
    ctx0 = ck.registry.context(0)
    xb = ck.ManagedBuffer(x.nbytes, context=ctx0)
    ob = ck.ManagedBuffer(x.nbytes, context=ctx0)
    xm, om = xb.as_numpy(np.float32), ob.as_numpy(np.float32)
    xm[...] = x
    with ck.Pipeline(list(range(nd))) as p:
        p.map_managed(kernel, xm, om, args=(ALPHA,))
        verify("managed", om, x)
        timed(
            f"managed_{nd}gpu",
            functools.partial(p.map_managed, kernel, xm, om, args=(ALPHA,)),
            x.nbytes,
            repeats,
            results,
        )


def bench_cupy(x: np.ndarray, repeats: int, results: Results) -> None:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="GPU counts to run")
    ap.add_argument("--size-gb", type=float, default=2.0, help="input size in GiB")
    ap.add_argument(
        "--first-call-gb", type=float, default=1.0, help="input size of the first-call section"
    )
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="256 MiB, fewer repeats, no sweep")
    ap.add_argument("--no-sweep", action="store_true", help="skip the chunk/thread sweeps")
    args = ap.parse_args(argv)
    if ck.device_count() == 0:
        print("bench_pipeline: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    avail = ck.device_count()
    counts = sorted({d for d in args.devices if 1 <= d <= avail})
    skipped_counts = sorted(set(args.devices) - set(counts))
    if skipped_counts:
        print(f"bench_pipeline: only {avail} GPU(s): skipping device counts {skipped_counts}")
    if not counts or counts[0] != 1:
        print("bench_pipeline: the device counts must include 1", file=sys.stderr)
        return 1
    size = int((min(args.size_gb, 0.25) if args.quick else args.size_gb) * GiB) // 4 * 4
    first_size = int((min(args.first_call_gb, 0.25) if args.quick else args.first_call_gb) * GiB)
    first_size = first_size // 4 * 4
    repeats = args.repeats or (2 if args.quick else 3)
    obj, kernel, _ = load_scale_kernel()
    print(
        f"bench_pipeline: {size / GiB:.2f} GiB float32, GPUs {counts}, {repeats} repeats, "
        f"{cpus()} CPUs, {PAGE} B pages",
        flush=True,
    )
    results: Results = {
        "counts": counts,
        "size_gib": size / GiB,
        "first_call_gib": first_size / GiB,
        "quick": args.quick,
    }
    host_best = bench_host(min(size, GiB), repeats, results)
    bench_register(size, repeats, args.quick, results)
    x = np.random.default_rng(0).random(size // 4, dtype=np.float32)
    out = np.empty_like(x)
    out.fill(0)
    bench_naive(kernel, x, out, counts, repeats, results)
    base = np.random.default_rng(1).random(first_size // 4, dtype=np.float32)
    bench_first_calls(kernel, base, max(3, repeats), results)
    bench_fresh_long_lived(kernel, base, counts, max(3, repeats), results)
    del base
    bench_ctxkit(kernel, x, out, counts, repeats, results)
    if not (args.quick or args.no_sweep):
        bench_sweep(kernel, x, out, max(1, repeats - 1), results)
    bench_pinned(obj, kernel, x, counts, 3 if args.quick else 7, results)
    bench_managed(kernel, x[: min(x.shape[0], 4 * GiB // 4)], counts[-1], repeats, results)
    bench_cupy(x, repeats, results)
    del x, out
    if not args.quick:
        bench_cold(GiB, max(3, repeats), results)
    print(f"  (staged ceiling ~{host_best / 2:.1f} GB/s of input: best host copy / 2)")
    return emit(verdicts(r=results))


if __name__ == "__main__":
    sys.exit(main())
