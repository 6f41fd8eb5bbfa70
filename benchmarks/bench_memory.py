"""Copies and allocation: ctxkit vs raw cuda.bindings (vs CuPy and torch when installed), one run.

    PYTHONPATH=. python3 benchmarks/bench_memory.py [--quick]

* pinned host <-> device bandwidth, synchronous and on a stream (target >= 0.97x raw);
* what an "asynchronous" copy from pageable memory really does: how long the call blocks
  the host, next to the same copy from pinned memory;
* peer copies of 256 MiB between devices 0 and 1 without and with peer access, vs raw
  ``cuMemcpyPeer`` (target >= 0.95x raw), timed only once the copies have completed
  (synchronous copies by wall clock, stream copies by events);
* allocate + free of 1 MiB and 256 MiB, 5,000 times: ctxkit stream-ordered
  (``DeviceBuffer(n, stream=s)`` + ``close()``, served by ctxkit's block cache) vs CuPy's
  memory pool (``cupy.empty``) and PyTorch's caching allocator (``torch.empty``) when
  installed (target <= 1.3x each), with the raw ``cuMemAllocAsync`` + ``cuMemFreeAsync``
  pair and ctxkit's synchronous ``DeviceBuffer(n)`` for reference; once per round the last
  block is memset and read back (a CHECK line);
* freeing while the device is busy (a ~100 ms kernel on another stream): how long
  ``close()`` of a synchronous buffer (``cuMemFree`` waits for the device) and of a
  stream-ordered one (``cuMemFreeAsync``: target <= 1 ms) block the caller.

Every target decides on the median of the rounds (the best round is printed beside it).
The peer bandwidth bound and the arrival of the bytes are CHECK lines: they guard the
measurement, and a violated one makes the program exit 1.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from verdictlines import QUICK, Line, emit, info, median, missing_baseline, skipped, target
from verdictlines import check as check_line

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.memory import PageableCopyWarning, alloc

MiB = 1 << 20


def check(res: tuple[int, ...]) -> None:
    if res[0]:
        raise RuntimeError(f"driver call failed: {res[0]!r}")


def round_seconds(
    fns: dict[str, Callable[[], None]], reps: int, rounds: int
) -> dict[str, list[float]]:
    """Per-call seconds of each function in every round; the functions alternate."""
    t: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm up
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            t[name].append((time.perf_counter() - t0) / reps)
    return t


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_pinned(size: int, reps: int, rounds: int) -> dict[str, list[float]]:
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
        t = round_seconds(fns, reps, rounds)
        cupy_t = _cupy_pinned(host, reps, rounds)
    print(f"pinned copies of {size // MiB} MiB ({rounds} rounds x {reps}; median GB/s):")
    print("direction      |  raw GB/s | ctxkit GB/s | ratio" + (" | CuPy GB/s" if cupy_t else ""))
    for d in DIRECTIONS:
        raw, mine = gbps(size, median(t[f"raw_{d}"])), gbps(size, median(t[f"ck_{d}"]))
        extra = f" | {gbps(size, median(cupy_t[d])):9.1f}" if d in cupy_t else ""
        print(f"{d:14s} | {raw:9.1f} | {mine:11.1f} | {mine / raw:5.3f}{extra}")
    return t


DIRECTIONS = ("h2d", "d2h", "h2d_async", "d2h_async")


def pinned_verdicts(t: Mapping[str, list[float]]) -> list[Line]:
    """``memory.pinned_{h2d,d2h}_vs_raw``: the worse of the synchronous and the stream
    copy, ctxkit bandwidth over raw on the medians of the rounds."""
    lines = []
    for base in ("h2d", "d2h"):
        ratios = {}
        for d in (base, f"{base}_async"):
            raw, mine = t[f"raw_{d}"], t[f"ck_{d}"]
            ratios[d] = (median(raw) / median(mine), min(raw) / min(mine))
        worst = min(ratios, key=lambda d: ratios[d][0])
        med, best = ratios[worst]
        note = f"worse of sync/stream copies: {worst}; medians of {len(t[f'raw_{worst}'])} rounds"
        lines.append(
            target(
                f"memory.pinned_{base}_vs_raw", med, ">=", 0.97, "x", f"{note}; best {best:.3f}x"
            )
        )
    return lines


def _cupy_pinned(host: np.ndarray, reps: int, rounds: int) -> dict[str, list[float]]:
    try:
        import cupy as cp
    except Exception:
        return {}
    with cp.cuda.Device(0):
        arr = cp.empty(host.size, dtype=cp.uint8)
        return round_seconds(
            {"h2d": lambda: arr.set(host), "d2h": lambda: arr.get(out=host)}, reps, rounds
        )


def bench_pageable_async(size: int, tries: int = 3) -> dict[str, Any]:
    """How long ``copy_from_host(..., stream=s)`` blocks the caller, from pageable and
    from pinned memory: ``{"async_<kind>": [(call seconds, total seconds), ...],
    "warned": bool}``."""
    ctx = ck.registry.context(0)
    out: dict[str, Any] = {"warned": False}
    with ctx:
        buf = ck.DeviceBuffer(size)
        s = ck.Stream()
        pageable = np.ones(size, np.uint8)
        pinned = ck.pinned_empty(size, np.uint8)
        pinned[:] = 1
        for name, src in (("pageable", pageable), ("pinned", pinned)):
            buf.copy_from_host(src)  # warm up (and touch the pages)
            times = []
            for _ in range(tries):
                with warnings.catch_warnings(record=True) as got:
                    warnings.simplefilter("always")
                    t0 = time.perf_counter()
                    buf.copy_from_host(src, stream=s)
                    t1 = time.perf_counter()
                    s.synchronize()
                    t2 = time.perf_counter()
                if name == "pageable":
                    out["warned"] |= any(issubclass(w.category, PageableCopyWarning) for w in got)
                times.append((t1 - t0, t2 - t0))
            out[f"async_{name}"] = times
    print(f"copy_from_host({size // MiB} MiB, stream=s): time until the call returns / total")
    for name in ("pageable", "pinned"):
        call, total = (median([x[i] for x in out[f"async_{name}"]]) for i in (0, 1))
        print(
            f"  {name:8s}: call blocked {call * 1e3:8.2f} ms of {total * 1e3:8.2f} ms "
            f"({call / total:6.1%}), {gbps(size, total):6.1f} GB/s (medians of {tries})"
        )
    print(f"  ctxkit warned about the pageable copy: {'yes' if out['warned'] else 'NO'}")
    return out


def _blocked(times: list[tuple[float, float]]) -> list[float]:
    return [call / total for call, total in times if total > 0]


def pageable_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The blocked fraction of a pageable "async" copy is reported (the driver's doing);
    what ctxkit decides - it warns about that copy, and its copy from pinned memory does
    not block - are the targets."""
    page, pin = _blocked(r["async_pageable"]), _blocked(r["async_pinned"])
    return [
        info(
            "memory.pageable_async_blocked_fraction",
            median(page),
            "",
            f"median of {len(page)}; the driver copies pageable memory before returning; "
            f"pinned {median(pin):.3f}",
        ),
        target(
            "memory.pageable_async_warned",
            1.0 if r["warned"] else 0.0,
            ">=",
            1,
            "",
            "1 = ctxkit emitted a PageableCopyWarning for copy_from_host(pageable, stream=s)",
        ),
        target(
            "memory.pinned_async_blocked_fraction",
            median(pin),
            "<=",
            0.1,
            "",
            f"copy_from_host(pinned, stream=s) returns before the copy; median of {len(pin)}",
        ),
    ]


PEER_SIZE = 256 * MiB
PLAUSIBLE_PEER_GBPS = 1000.0  # above any NVLink/PCIe path of one direction (H200: ~450)


def bench_peer(reps: int, rounds: int) -> dict[str, Any]:
    """Device 0 -> 1 copies of 256 MiB, without and with peer access.

    Every timed copy has completed when the clock stops: ``copy_peer`` without a stream
    waits for the copy, the raw variant does the same by hand (``cuMemcpyPeer`` returns
    before the copy has run when peer access is on), and the async variants are timed
    with events on a stream of the destination context. Both contexts are synchronized
    before peer access is enabled and before the buffers are freed: freeing device 1's
    buffer while device 0 still has a copy into it queued faults device 0's context.

    Returns ``{"peer_size", "peer": {label: {variant: [seconds per round]}}, "peer_ok",
    "peer_note"}`` (``peer_note`` alone when there is only one device).
    """
    if ck.device_count() < 2:
        print("peer copies skipped: needs 2 GPUs")
        return {"peer_note": "needs 2 GPUs"}
    size = PEER_SIZE
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    src = ck.DeviceBuffer(size, context=c0)
    dst = ck.DeviceBuffer(size, context=c1)
    note = ""
    try:
        with c0:
            src.memset(3)
        results = {"no peer access": _peer_round(c0, c1, src, dst, reps, rounds)}
        p2p = ck.Device(0).can_access_peer(1) and ck.Device(1).can_access_peer(0)
        if p2p:
            ck.enable_peer_access(c0, c1)
            ck.enable_peer_access(c1, c0)
            results["peer access"] = _peer_round(c0, c1, src, dst, reps, rounds)
        else:
            note = "needs 2 GPUs with peer access (devices 0 and 1 cannot access each other)"
        with c1:
            ok = bool((dst[:MiB].copy_to_host() == 3).all())
            ok &= bool((dst[size - MiB :].copy_to_host() == 3).all())
    finally:
        c0.synchronize()
        c1.synchronize()
        dst.close()
        src.close()
    print(f"peer copies of {size // MiB} MiB, device 0 -> 1 ({rounds} rounds x {reps}; medians):")
    print("path            | sync raw | sync ctxkit | ratio | async raw | async ctxkit  (GB/s)")
    for label, t in results.items():
        r, m, ar, am = (
            gbps(size, median(t[k])) for k in ("raw", "ctxkit", "raw_async", "ctxkit_async")
        )
        print(f"{label:15s} | {r:8.1f} | {m:11.1f} | {m / r:5.3f} | {ar:9.1f} | {am:12.1f}")
    if note:
        print(f"  peer access: {note}")
    print(f"  destination holds the source bytes: {'yes' if ok else 'NO'}")
    return {"peer_size": size, "peer": results, "peer_ok": ok, "peer_note": note}


PEER_KEYS = {"no peer access": "staged", "peer access": "p2p"}


def peer_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """Per path: the synchronous copy vs raw (target, medians); the fastest copy of any
    variant and round below a physical bound (check: the clock waited for the copies);
    and the bytes arrived (check)."""
    if "peer" not in r:
        reason = r.get("peer_note", "not measured")
        return [skipped(f"memory.peer_{key}_vs_raw", reason) for key in PEER_KEYS.values()]
    size, lines = r["peer_size"], []
    for label, key in PEER_KEYS.items():
        t = r["peer"].get(label)
        if t is None:
            lines.append(skipped(f"memory.peer_{key}_vs_raw", r.get("peer_note") or "not run"))
            continue
        med = median(t["raw"]) / median(t["ctxkit"])
        best = min(t["raw"]) / min(t["ctxkit"])
        lines.append(
            target(
                f"memory.peer_{key}_vs_raw",
                med,
                ">=",
                0.95,
                "x",
                f"copy_peer vs cuMemcpyPeer, synchronous; medians of {len(t['raw'])} rounds; "
                f"best {best:.3f}x",
            )
        )
        fastest = max(gbps(size, min(v)) for v in t.values())
        lines.append(
            check_line(
                f"memory.peer_{key}_gbps",
                fastest,
                "<=",
                PLAUSIBLE_PEER_GBPS,
                "GB/s",
                "fastest copy of any variant: the timing waited for the copies",
            )
        )
    lines.append(
        check_line(
            "memory.peer_data_ok",
            1.0 if r["peer_ok"] else 0.0,
            ">=",
            1,
            "",
            "1 = the destination holds the source bytes",
        )
    )
    return lines


def _peer_round(
    c0: ck.Context,
    c1: ck.Context,
    src: ck.DeviceBuffer,
    dst: ck.DeviceBuffer,
    reps: int,
    rounds: int,
) -> dict[str, list[float]]:
    """Seconds per copy in every round: synchronous (wall clock) and on a stream (events)."""
    size = src.nbytes
    sptr, dptr = src.ptr, dst.ptr
    c0.synchronize()
    c1.synchronize()
    with c1:
        s = ck.Stream()
        sh, null = s.handle, drv.CUstream(0)

        def raw() -> None:
            check(drv.cuMemcpyPeer(dptr, c1.cu, sptr, c0.cu, size))
            check(drv.cuStreamSynchronize(null))

        def mine() -> None:
            ck.copy_peer(dst, src)

        def raw_async() -> None:
            check(drv.cuMemcpyPeerAsync(dptr, c1.cu, sptr, c0.cu, size, sh))

        def mine_async() -> None:
            ck.copy_peer(dst, src, stream=s)

        t = round_seconds({"raw": raw, "ctxkit": mine}, reps, rounds)
        for name, fn in (("raw_async", raw_async), ("ctxkit_async", mine_async)):
            t[name] = _event_seconds(fn, s, reps, rounds)
        s.synchronize()
    return t


def _event_seconds(fn: Callable[[], None], s: ck.Stream, reps: int, rounds: int) -> list[float]:
    """GPU seconds per call of *fn* (which enqueues on *s*) in every round, from events."""
    fn()
    out = []
    for _ in range(rounds):
        start = s.record()
        for _ in range(reps):
            fn()
        end = s.record()
        out.append(start.elapsed_ms(end) / 1e3 / reps)
    return out


# --- allocation --------------------------------------------------------------------------

ALLOC_SIZES = (1 * MiB, 256 * MiB)
ALLOC_TARGET = 1.3
FREE_BUSY_MS = 100.0
FREE_TARGET_MS = 1.0


def size_label(size: int) -> str:
    """``1mib``, ``256mib`` (``64kib`` below a MiB): the size part of the line names."""
    return f"{size >> 20}mib" if size >= MiB else f"{size >> 10}kib"


def _block_usable(buf: ck.DeviceBuffer, s: ck.Stream, value: int) -> bool:
    """Memset the buffer on *s* and copy its last 4 KiB back: is the block real memory?"""
    buf.memset(value, stream=s)
    s.synchronize()
    tail = buf[max(0, buf.nbytes - 4096) : buf.nbytes].copy_to_host()
    return bool((tail == value).all())


def _alloc_variants(
    size: int, count: int, s: ck.Stream
) -> tuple[dict[str, Callable[[], None]], dict[str, Any]]:
    """Allocate+free pairs of *size* bytes, *count* per call (a tenth of that for the
    synchronous reference), for every allocator here: ctxkit's ``DeviceBuffer(n,
    stream=s)`` + ``close()`` (the user's call; once per call the last buffer is memset and
    read back), the raw ``cuMemAllocAsync`` + ``cuMemFreeAsync`` pair, CuPy, torch; why an
    allocator is missing; ``usable``: the read-back results."""

    def ck_ordered() -> None:
        for _ in range(count - 1):
            ck.DeviceBuffer(size, stream=s).close()
        last = ck.DeviceBuffer(size, stream=s)
        usable.append(_block_usable(last, s, len(usable) % 200 + 1))
        last.close()
        s.synchronize()

    sh = s.handle

    def raw_ordered() -> None:
        for _ in range(count):
            err, ptr = drv.cuMemAllocAsync(size, sh)
            check((err,))
            check(drv.cuMemFreeAsync(ptr, sh))
        s.synchronize()

    def ck_sync() -> None:
        for _ in range(sync_count):
            ck.DeviceBuffer(size).close()

    sync_count = max(1, count // 10)  # cuMemAlloc/cuMemFree: a reference, and slow
    usable: list[bool] = []
    fns: dict[str, Callable[[], None]] = {
        "ctxkit": ck_ordered,
        "raw": raw_ordered,
        "ctxkit_sync": ck_sync,
    }
    notes: dict[str, Any] = {"ctxkit_sync_count": str(sync_count), "usable": usable}
    try:
        import cupy as cp

        dev = cp.cuda.Device(0)

        def cupy_pool() -> None:
            with dev:
                for _ in range(count):
                    a = cp.empty(size, dtype=cp.uint8)
                    del a
                dev.synchronize()

        fns["cupy"] = cupy_pool
    except Exception as exc:
        notes["cupy"] = f"CuPy is not installed ({type(exc).__name__})"
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        tdev = torch.device("cuda", 0)

        def torch_cache() -> None:
            for _ in range(count):
                t = torch.empty(size, dtype=torch.uint8, device=tdev)
                del t
            torch.cuda.synchronize(tdev)

        fns["torch"] = torch_cache
    except Exception as exc:
        notes["torch"] = f"torch is not available ({type(exc).__name__}: {exc})"
    return fns, notes


def bench_alloc(count: int, rounds: int) -> dict[str, Any]:
    """``alloc_<MiB>_<who>``: microseconds per allocate+free pair in every round, the
    allocators taking turns; ``alloc_<who>_note`` says why one is missing."""
    ctx = ck.registry.context(0)
    r: dict[str, Any] = {}
    with ctx:
        s = ck.Stream()
        for size in ALLOC_SIZES:
            fns, notes = _alloc_variants(size, count, s)
            for who, note in notes.items():
                if who in ("cupy", "torch"):
                    r[f"alloc_{who}_note"] = note
            times = round_seconds(fns, 1, rounds)
            for who, t in times.items():
                pairs = int(notes["ctxkit_sync_count"]) if who == "ctxkit_sync" else count
                r[f"alloc_{size_label(size)}_{who}"] = [x / pairs * 1e6 for x in t]
            usable = notes["usable"]
            r["alloc_usable"] = r.get("alloc_usable", True) and bool(usable) and all(usable)
    print(f"allocate + free, {count} times (us per pair, median of {rounds} rounds):")
    for size in ALLOC_SIZES:
        row = ", ".join(
            f"{who} {median(r[k]):.2f}"
            for who in ("ctxkit", "raw", "ctxkit_sync", "cupy", "torch")
            if (k := f"alloc_{size_label(size)}_{who}") in r
        )
        print(f"  {size_label(size):>7s}: {row}")
    return r


def bench_free_busy(size: int = 64 * MiB) -> dict[str, Any]:
    """Milliseconds ``close()`` blocks while a ~100 ms kernel runs on another stream: a
    synchronous buffer (``cuMemFree``) and a stream-ordered one (``cuMemFreeAsync``)."""
    from ctxkit.compiler import kernel_source

    ctx = ck.registry.context(0)
    with ctx:
        spin = ck.Module.load(ck.compile(kernel_source("spin.cu"), name="spin.cu")).function("spin")
        busy, s = ck.Stream(), ck.Stream()
        probe = 10_000_000
        spin.launch(1, 1, probe, 0, stream=busy)  # load outside the timing
        busy.synchronize()
        start = busy.record()
        spin.launch(1, 1, probe, 0, stream=busy)
        probe_ms = start.elapsed_ms(busy.record())
        cycles = int(probe * FREE_BUSY_MS / max(probe_ms, 1e-3))
        out: dict[str, Any] = {"free_busy_kernel_ms": 0.0}
        for kind in ("sync", "ordered"):
            buf = ck.DeviceBuffer(size) if kind == "sync" else ck.DeviceBuffer(size, stream=s)
            s.synchronize()
            begin = busy.record()
            spin.launch(1, 1, cycles, 0, stream=busy)
            t0 = time.perf_counter()
            buf.close()
            out[f"free_busy_{kind}_ms"] = (time.perf_counter() - t0) * 1e3
            if kind == "ordered":  # close() cached the block; giving it back to the pool:
                t0 = time.perf_counter()
                alloc.flush(device=0)
                out["free_busy_flush_ms"] = (time.perf_counter() - t0) * 1e3
            end = busy.record()
            end.synchronize()
            s.synchronize()
            out["free_busy_kernel_ms"] = max(out["free_busy_kernel_ms"], begin.elapsed_ms(end))
    print(
        f"close() while a {out['free_busy_kernel_ms']:.0f} ms kernel runs on another stream: "
        f"synchronous buffer {out['free_busy_sync_ms']:.2f} ms, stream-ordered "
        f"{out['free_busy_ordered_ms']:.3f} ms (into the block cache; giving the block "
        f"back with cuMemFreeAsync {out.get('free_busy_flush_ms', 0.0):.3f} ms)"
    )
    return out


def alloc_verdicts(r: Mapping[str, Any]) -> list[Line]:
    """Stream-ordered allocate+free vs CuPy's pool and torch's caching allocator (targets,
    medians); the synchronous allocation for reference; freeing while busy."""
    lines: list[Line] = []
    for size in ALLOC_SIZES:
        label = size_label(size)
        mine = r.get(f"alloc_{label}_ctxkit")
        if not mine:
            lines.append(skipped(f"memory.alloc_{label}_vs_cupy", "allocation not measured"))
            continue
        lines.append(
            info(
                f"memory.alloc_{label}_us",
                median(mine),
                "us",
                f"stream-ordered allocate+free pair; median of {len(mine)}",
            )
        )
        raw = r.get(f"alloc_{label}_raw")
        if raw:
            lines.append(
                info(
                    f"memory.alloc_raw_{label}_us",
                    median(raw),
                    "us",
                    "raw cuMemAllocAsync + cuMemFreeAsync pair (reference)",
                )
            )
        sync = r[f"alloc_{label}_ctxkit_sync"]
        lines.append(
            info(
                f"memory.alloc_sync_{label}_us",
                median(sync),
                "us",
                "DeviceBuffer(n) + close(): cuMemAlloc/cuMemFree",
            )
        )
        for who, desc in (("cupy", "CuPy's memory pool"), ("torch", "torch.empty")):
            theirs = r.get(f"alloc_{label}_{who}")
            name = f"memory.alloc_{label}_vs_{who}"
            if not theirs:
                why = r.get(f"alloc_{who}_note", f"{who} not measured")
                lines.append(missing_baseline(r, name, "<=", ALLOC_TARGET, "x", why))
                continue
            value = median(mine) / median(theirs)
            note = f"vs {desc} {median(theirs):.2f}us; medians of {len(mine)} rounds"
            lines.append(target(name, value, "<=", ALLOC_TARGET, "x", note))
    if "alloc_usable" in r:
        what = "1 = the last block of every round held the memset bytes when read back"
        lines.append(
            check_line("memory.alloc_block_usable", float(r["alloc_usable"]), ">=", 1, "", what)
        )
    if "free_busy_ordered_ms" in r:
        kernel = r["free_busy_kernel_ms"]
        lines.append(
            target(
                "memory.free_while_busy_ordered_ms",
                r["free_busy_ordered_ms"],
                "<=",
                FREE_TARGET_MS,
                "ms",
                f"stream-ordered close() while a {kernel:.0f} ms kernel runs on another stream",
            )
        )
        if "free_busy_flush_ms" in r:
            lines.append(
                info(
                    "memory.free_while_busy_flush_ms",
                    r["free_busy_flush_ms"],
                    "ms",
                    "the cached block given back (cuMemFreeAsync) while the kernel runs",
                )
            )
        lines.append(
            info(
                "memory.free_while_busy_sync_ms",
                r["free_busy_sync_ms"],
                "ms",
                f"synchronous close() (cuMemFree) while the {kernel:.0f} ms kernel runs",
            )
        )
    return lines


def guarded_section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a section; an exception becomes ``section_errors`` (a failed CHECK line) so the
    other sections' results still print."""
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        return {"section_errors": [f"{name}: {type(exc).__name__}: {exc}"]}


def verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The SUMMARY and CHECK lines of this benchmark from its measurements (pure)."""
    lines = pinned_verdicts(r["pinned"]) + pageable_verdicts(r) + peer_verdicts(r)
    lines += alloc_verdicts(r)
    errors = r.get("section_errors", [])
    what = "1 = every section ran" + (": " + "; ".join(errors) if errors else "")
    lines.append(check_line("memory.sections_ok", 0.0 if errors else 1.0, ">=", 1, "", what))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if ck.device_count() == 0:
        print("bench_memory: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    size = (64 if args.quick else 256) * MiB
    reps, rounds = (3, 3) if args.quick else (5, 5)
    r: dict[str, Any] = {QUICK: args.quick}
    r.update(bench_peer(reps, rounds))  # first: nothing has enabled peer access yet
    r["pinned"] = bench_pinned(size, reps, rounds)
    r.update(bench_pageable_async(size if args.quick else 1024 * MiB))
    errors: list[str] = []
    for name, fn in (
        ("allocation", lambda: bench_alloc(500 if args.quick else 5_000, rounds)),
        ("free while busy", bench_free_busy),
    ):
        part = guarded_section(name, fn)
        errors += part.pop("section_errors", [])
        r.update(part)
    r["section_errors"] = errors
    return emit(verdicts(r))


if __name__ == "__main__":
    sys.exit(main())
