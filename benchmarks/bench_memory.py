"""Copy bandwidth: ctxkit vs raw cuda.bindings (vs CuPy when installed), in one run.

    PYTHONPATH=. python3 benchmarks/bench_memory.py [--quick]

* pinned host <-> device bandwidth, synchronous and on a stream (target >= 0.97x raw);
* what an "asynchronous" copy from pageable memory really does: how long the call blocks
  the host, next to the same copy from pinned memory;
* peer copies of 256 MiB between devices 0 and 1 without and with peer access, vs raw
  ``cuMemcpyPeer`` (target >= 0.95x raw), timed only once the copies have completed
  (synchronous copies by wall clock, stream copies by events).

Prints SUMMARY lines for scripts/gpu-check.sh.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable

import numpy as np

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.memory import PageableCopyWarning

MiB = 1 << 20


def summary(name: str, value: float, unit: str, target: str, ok: bool) -> None:
    print(f"SUMMARY {name} {value:.2f}{unit} (target {target}) {'PASS' if ok else 'FAIL'}")


def check(res: tuple[int, ...]) -> None:
    if res[0]:
        raise RuntimeError(f"driver call failed: {res[0]!r}")


def best_seconds(fns: dict[str, Callable[[], None]], reps: int, rounds: int) -> dict[str, float]:
    """Best per-call time of each function; the functions alternate round by round."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # warm up
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / reps)
    return best


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_pinned(size: int, reps: int, rounds: int) -> None:
    ctx = ck.registry.context(0)
    with ctx:
        host = ck.pinned_empty(size, np.uint8)
        host[:] = 1
        buf = ck.DeviceBuffer(size)
        s = ck.Stream()
        hptr, dptr, sh = host.ctypes.data, buf.ptr, s.handle

        def raw_h2d() -> None:
            check(drv.cuMemcpyHtoD(dptr, hptr, size))

        def raw_d2h() -> None:
            check(drv.cuMemcpyDtoH(hptr, dptr, size))

        def raw_h2d_async() -> None:
            check(drv.cuMemcpyHtoDAsync(dptr, hptr, size, sh))
            check(drv.cuStreamSynchronize(sh))

        def raw_d2h_async() -> None:
            check(drv.cuMemcpyDtoHAsync(hptr, dptr, size, sh))
            check(drv.cuStreamSynchronize(sh))

        def ck_h2d_async() -> None:
            buf.copy_from_host(host, stream=s)
            s.synchronize()

        def ck_d2h() -> None:
            buf.copy_to_host(host)

        def ck_d2h_async() -> None:
            buf.copy_to_host(host, stream=s)
            s.synchronize()

        fns: dict[str, Callable[[], None]] = {
            "raw_h2d": raw_h2d,
            "ck_h2d": lambda: buf.copy_from_host(host),
            "raw_d2h": raw_d2h,
            "ck_d2h": ck_d2h,
            "raw_h2d_async": raw_h2d_async,
            "ck_h2d_async": ck_h2d_async,
            "raw_d2h_async": raw_d2h_async,
            "ck_d2h_async": ck_d2h_async,
        }
        t = best_seconds(fns, reps, rounds)
        cupy_t = _cupy_pinned(host, reps, rounds)
    print(f"pinned copies of {size // MiB} MiB (best of {rounds} rounds x {reps}):")
    print("direction      |  raw GB/s | ctxkit GB/s | ratio" + (" | CuPy GB/s" if cupy_t else ""))
    worst: dict[str, float] = {}
    for d in ("h2d", "d2h", "h2d_async", "d2h_async"):
        raw, mine = gbps(size, t[f"raw_{d}"]), gbps(size, t[f"ck_{d}"])
        ratio = mine / raw
        base = d.split("_")[0]
        worst[base] = min(worst.get(base, float("inf")), ratio)
        extra = f" | {gbps(size, cupy_t[d]):9.1f}" if cupy_t and d in cupy_t else ""
        print(f"{d:14s} | {raw:9.1f} | {mine:11.1f} | {ratio:5.3f}{extra}")
    for base, ratio in worst.items():
        summary(f"memory.pinned_{base}_vs_raw", ratio, "x", ">= 0.97x", ratio >= 0.97)


def _cupy_pinned(host: np.ndarray, reps: int, rounds: int) -> dict[str, float]:
    try:
        import cupy as cp
    except Exception:
        return {}
    with cp.cuda.Device(0):
        arr = cp.empty(host.size, dtype=cp.uint8)
        return best_seconds(
            {"h2d": lambda: arr.set(host), "d2h": lambda: arr.get(out=host)}, reps, rounds
        )


def bench_pageable_async(size: int) -> None:
    ctx = ck.registry.context(0)
    with ctx:
        buf = ck.DeviceBuffer(size)
        s = ck.Stream()
        pageable = np.ones(size, np.uint8)
        pinned = ck.pinned_empty(size, np.uint8)
        pinned[:] = 1
        results = {}
        warned = False
        for name, src in (("pageable", pageable), ("pinned", pinned)):
            buf.copy_from_host(src)  # warm up (and touch the pages)
            best_call, best_total = float("inf"), float("inf")
            for _ in range(3):
                with warnings.catch_warnings(record=True) as got:
                    warnings.simplefilter("always")
                    t0 = time.perf_counter()
                    buf.copy_from_host(src, stream=s)
                    t1 = time.perf_counter()
                    s.synchronize()
                    t2 = time.perf_counter()
                warned |= any(issubclass(w.category, PageableCopyWarning) for w in got)
                best_call, best_total = min(best_call, t1 - t0), min(best_total, t2 - t0)
            results[name] = (best_call, best_total)
    print(f"copy_from_host({size // MiB} MiB, stream=s): time until the call returns / total")
    for name, (call, total) in results.items():
        print(
            f"  {name:8s}: call blocked {call * 1e3:8.2f} ms of {total * 1e3:8.2f} ms "
            f"({call / total:6.1%}), {gbps(size, total):6.1f} GB/s"
        )
    frac = results["pageable"][0] / results["pageable"][1]
    print(
        "  -> from pageable memory the 'async' copy blocks the host; ctxkit warned: "
        f"{'yes' if warned else 'NO'}"
    )
    summary(
        "memory.pageable_async_blocked_fraction",
        frac,
        "",
        f"documented and warned; pinned {results['pinned'][0] / results['pinned'][1]:.2f}",
        warned,
    )


PEER_SIZE = 256 * MiB
PLAUSIBLE_PEER_GBPS = 1000.0  # above any NVLink/PCIe path of one direction (H200: ~450)


def bench_peer(reps: int, rounds: int) -> None:
    """Device 0 -> 1 copies of 256 MiB, without and with peer access.

    Every timed copy has completed when the clock stops: ``copy_peer`` without a stream
    waits for the copy, the raw variant does the same by hand (``cuMemcpyPeer`` returns
    before the copy has run when peer access is on), and the async variants are timed
    with events on a stream of the destination context. Both contexts are synchronized
    before peer access is enabled and before the buffers are freed: freeing device 1's
    buffer while device 0 still has a copy into it queued faults device 0's context.
    """
    if ck.device_count() < 2:
        print("peer copies skipped: needs two devices")
        return
    size = PEER_SIZE
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    src = ck.DeviceBuffer(size, context=c0)
    dst = ck.DeviceBuffer(size, context=c1)
    try:
        with c0:
            src.memset(3)
        results = {"no peer access": _peer_round(c0, c1, src, dst, reps, rounds)}
        p2p = ck.Device(0).can_access_peer(1) and ck.Device(1).can_access_peer(0)
        if p2p:
            ck.enable_peer_access(c0, c1)
            ck.enable_peer_access(c1, c0)
            results["peer access"] = _peer_round(c0, c1, src, dst, reps, rounds)
        with c1:
            ok = bool((dst[:MiB].copy_to_host() == 3).all())
            ok &= bool((dst[size - MiB :].copy_to_host() == 3).all())
    finally:
        c0.synchronize()
        c1.synchronize()
        dst.close()
        src.close()
    print(f"peer copies of {size // MiB} MiB, device 0 -> 1 (best of {rounds} rounds x {reps}):")
    print("path            | sync raw | sync ctxkit | ratio | async raw | async ctxkit  (GB/s)")
    for label, t in results.items():
        r, m = gbps(size, t["raw"]), gbps(size, t["ctxkit"])
        ar, am = gbps(size, t["raw_async"]), gbps(size, t["ctxkit_async"])
        print(f"{label:15s} | {r:8.1f} | {m:11.1f} | {m / r:5.3f} | {ar:9.1f} | {am:12.1f}")
        key = "p2p" if label == "peer access" else "staged"
        summary(f"memory.peer_{key}_vs_raw", m / r, "x", ">= 0.95x", m / r >= 0.95)
        fastest = max(r, m, ar, am)
        summary(
            f"memory.peer_{key}_gbps",
            fastest,
            "GB/s",
            f"<= {PLAUSIBLE_PEER_GBPS:.0f}GB/s: the timing waited for the copies",
            fastest <= PLAUSIBLE_PEER_GBPS,
        )
    if "peer access" not in results:
        print("  peer access: devices 0 and 1 cannot access each other")
    print(f"  destination holds the source bytes: {'yes' if ok else 'NO'}")
    summary("memory.peer_data_ok", float(ok), "", "1 (bytes arrived)", ok)


def _peer_round(
    c0: ck.Context,
    c1: ck.Context,
    src: ck.DeviceBuffer,
    dst: ck.DeviceBuffer,
    reps: int,
    rounds: int,
) -> dict[str, float]:
    """Best seconds per copy: synchronous (wall clock) and on a stream (events)."""
    size = src.nbytes
    sptr, dptr = src.ptr, dst.ptr
    c0.synchronize()
    c1.synchronize()
    with c1:
        s = ck.Stream()
        sh, null = s.handle, drv.CUstream(0)

        def raw() -> None:
            check(drv.cuMemcpyPeer(dptr, c1._cu, sptr, c0._cu, size))
            check(drv.cuStreamSynchronize(null))

        def mine() -> None:
            ck.copy_peer(dst, src)

        def raw_async() -> None:
            check(drv.cuMemcpyPeerAsync(dptr, c1._cu, sptr, c0._cu, size, sh))

        def mine_async() -> None:
            ck.copy_peer(dst, src, stream=s)

        t = best_seconds({"raw": raw, "ctxkit": mine}, reps, rounds)
        for name, fn in (("raw_async", raw_async), ("ctxkit_async", mine_async)):
            t[name] = _event_seconds(fn, s, reps, rounds)
        s.synchronize()
    return t


def _event_seconds(fn: Callable[[], None], s: ck.Stream, reps: int, rounds: int) -> float:
    """Best GPU time per call of *fn* (which enqueues on *s*), from events around reps."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = s.record()
        for _ in range(reps):
            fn()
        end = s.record()
        best = min(best, start.elapsed_ms(end) / 1e3 / reps)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if ck.device_count() == 0:
        print("bench_memory: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    size = (64 if args.quick else 256) * MiB
    reps, rounds = (3, 3) if args.quick else (5, 5)
    bench_peer(reps, rounds)  # first: nothing has enabled peer access yet
    bench_pinned(size, reps, rounds)
    bench_pageable_async(size if args.quick else 1024 * MiB)
    return 0


if __name__ == "__main__":
    sys.exit(main())
