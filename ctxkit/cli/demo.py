"""``python -m ctxkit demo``: copy -> kernel -> copy on every GPU, end to end.

Prints the devices, compiles ``ptx/scale.cu`` (cached), runs ``out = 2 * x`` over a large
pageable float32 array three ways and verifies each against numpy:

1. the naive multi-GPU pattern as tutorials write it (one host thread, one stream per device,
   literal async calls on pageable memory: each copy blocks the host, so the devices
   take turns);
2. :class:`ctxkit.Pipeline` on the same pageable arrays (one worker thread per device):
   as for arrays it sees once (copied through pinned staging buffers by host threads),
   then as for arrays it sees again (pin on reuse: page-locked once, DMAed directly);
3. :class:`ctxkit.Pipeline` on pinned arrays (direct asynchronous copies);

then prints the per-device breakdown and writes the timeline (Chrome-trace JSON).
:class:`NaivePattern` and :func:`load_scale_kernel` are shared with
``benchmarks/bench_pipeline.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__, _driver, registry
from .._driver import drv
from ..compiler.library import kernel_source
from ..compiler.objectcode import ObjectCode
from ..compiler.program import compile
from ..context import Context
from ..device import Device, device_count
from ..memory.device import DeviceBuffer
from ..memory.host import pinned_empty
from ..module.kernel import Kernel
from ..module.module import Module
from ..pipeline.pipeline import Pipeline
from ..pipeline.plan import grid_size, split_rows
from ..stream import Stream
from ..trace import Timeline

__all__ = ["NaivePattern", "best_seconds", "load_scale_kernel", "run_demo"]


MiB = 1 << 20


ALPHA = 2.0


def say(msg: str) -> None:
    """One progress line, flushed at once."""
    print(msg, flush=True)


def load_scale_kernel(entry: str = "scale_f32") -> tuple[ObjectCode, Kernel, float]:
    """Compile ``ptx/scale.cu`` (through the cache) and load *entry* for every context.

    Returns the object code, the kernel and the compile time in seconds.
    """
    t0 = time.perf_counter()
    obj = compile(kernel_source("scale.cu"), name="scale.cu")
    seconds = time.perf_counter() - t0
    return obj, Module.load(obj).function(entry), seconds


def best_seconds(
    fn: Callable[[], Any], repeats: int, label: str = "", progress: bool = False
) -> float:
    """The fastest of *repeats* timed calls of *fn*."""
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        if progress:
            say(f"    {label} run {i + 1}/{repeats}: {dt * 1e3:.1f} ms")
    return best


class NaivePattern:
    """The naive multi-GPU pattern as tutorials write it, literally: one host thread;
    for each device, make its context current and enqueue H2D -> kernel -> D2H on its
    stream (in *chunks* pieces); then synchronize every stream.

    With pageable host memory every "async" copy blocks the calling thread for the whole
    copy, so nothing overlaps across devices. Device buffers and streams are allocated
    once (outside the timed part).
    """

    def __init__(self, kernel: Kernel, contexts: Sequence[Context], max_rows: int, row: int):
        self.kernel = kernel
        self.contexts = list(contexts)
        self.row = row
        self.bufs: list[tuple[DeviceBuffer, DeviceBuffer, Stream, int]] = []
        for ctx in self.contexts:
            dev = ctx.device
            cap = dev.multiprocessor_count * dev.attribute("max_threads_per_multiprocessor")
            nbytes = max(1, max_rows * row)
            self.bufs.append(
                (
                    DeviceBuffer(nbytes, context=ctx),
                    DeviceBuffer(nbytes, context=ctx),
                    Stream(context=ctx),
                    cap,
                )
            )

    def run(self, x: np.ndarray, out: np.ndarray, args: Sequence[Any], chunks: int = 1) -> None:
        """``out = kernel(x)``; *x* and *out* are split evenly over the devices."""
        row, xp, op = self.row, int(x.ctypes.data), int(out.ctypes.data)
        parts = split_rows(x.shape[0], len(self.contexts))
        elems = x.size // max(x.shape[0], 1)
        for ctx, (d_in, d_out, s, cap), (lo, hi) in zip(self.contexts, self.bufs, parts):
            with ctx:
                for a, b in split_rows(hi - lo, chunks):
                    if a == b:
                        continue
                    nb, off = (b - a) * row, a * row
                    (err,) = drv.cuMemcpyHtoDAsync(
                        d_in.ptr + off, xp + lo * row + off, nb, s.handle
                    )
                    _driver.raise_for(err, "cuMemcpyHtoDAsync")
                    n = (b - a) * elems
                    grid = grid_size(n, 256, cap // 256)
                    self.kernel.launch(
                        grid, 256, d_in.ptr + off, d_out.ptr + off, n, *args, stream=s
                    )
                    (err,) = drv.cuMemcpyDtoHAsync(
                        op + lo * row + off, d_out.ptr + off, nb, s.handle
                    )
                    _driver.raise_for(err, "cuMemcpyDtoHAsync")
        for ctx, (_, _, s, _) in zip(self.contexts, self.bufs):
            with ctx:
                s.synchronize()

    def close(self) -> None:
        """Free the device buffers and streams."""
        for d_in, d_out, s, _ in self.bufs:
            d_in.close()
            d_out.close()
            s.close()
        self.bufs = []


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _print_devices(ordinals: Sequence[int]) -> None:
    drv_ver = _driver.driver_version()
    bv = _driver.BINDINGS_VERSION
    say(
        f"ctxkit {__version__}, cuda-bindings {bv[0]}.{bv[1]}, "
        f"driver CUDA {drv_ver[0]}.{drv_ver[1]}"
        if drv_ver
        else f"ctxkit {__version__}"
    )
    for i in range(device_count()):
        d = Device(i)
        mark = "*" if i in ordinals else " "
        say(
            f"  {mark} GPU {i}: {d.name} ({d.arch}), {d.total_memory / 2**30:.0f} GiB, "
            f"{d.multiprocessor_count} SMs, PCI {d.pci_bus_id}"
        )


def _check(name: str, out: np.ndarray, expected: np.ndarray, failures: list[str]) -> None:
    if np.array_equal(out, expected):
        return
    bad = int(np.count_nonzero(out != expected))
    first = int(np.flatnonzero(out != expected)[0])
    failures.append(name)
    say(
        f"  VERIFY FAILED ({name}): {bad} of {out.size} elements differ; first at {first}: "
        f"got {out[first]!r}, expected {expected[first]!r}"
    )


def _write_trace(tl: Timeline, path: str) -> None:
    target = Path(path)
    tl.to_chrome_trace(target)
    say(f"trace: {target} ({len(tl)} intervals; open it in https://ui.perfetto.dev)")
    try:
        png = target.with_suffix(".png")
        tl.to_png(png, title="ctxkit demo: pageable map")
        say(f"trace chart: {png}")
    except ImportError:
        say('trace chart: skipped (for a PNG chart: pip install -e ".[plot]" in a checkout)')


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every result matched numpy, 1 otherwise."""
    quick = bool(getattr(args, "quick", False))
    size_mb = float(getattr(args, "size_mb", 512.0) or 512.0)
    if quick:
        size_mb = min(size_mb, 64.0)
    available = device_count()
    use = available if args.devices is None else int(args.devices)
    if not 1 <= use <= available:
        print(f"ctxkit demo: --devices must be 1..{available}, got {use}", file=sys.stderr)
        return 1
    ordinals = list(range(use))
    repeats = 1 if quick else 3
    _print_devices(ordinals)

    obj, kernel, secs = load_scale_kernel()
    how = "from the cache" if obj.from_cache else "with NVRTC"
    say(f"kernel: scale_f32 from ptx/scale.cu, {obj.target} {obj.arch}, {how} in {secs:.2f} s")

    n = int(size_mb * MiB) // 4
    say(f"input: {n * 4 / MiB:.0f} MiB of pageable float32 on {use} GPU(s); out = 2 * x")
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    expected = x * np.float32(ALPHA)
    out = np.empty_like(x)
    contexts = [registry.default.context(i) for i in ordinals]
    failures: list[str] = []
    results: list[tuple[str, float]] = []
    progress = n * 4 >= 1024 * MiB

    say("[1/3] the naive pattern (one thread, per-device streams, pageable)")
    naive = NaivePattern(kernel, contexts, -(-n // use), 4)
    try:
        naive.run(x, out, (ALPHA,))
        _check("naive", out, expected, failures)
        for chunks in (1, 8):

            def run_naive(c: int = chunks) -> None:
                naive.run(x, out, (ALPHA,), c)

            t = best_seconds(run_naive, repeats, f"naive {chunks} chunk(s)", progress)
            results.append((f"naive pattern, {chunks} chunk(s) per device", _gbps(x.nbytes, t)))
    finally:
        naive.close()

    with Pipeline(ordinals) as p:
        say("[2/3] ctxkit Pipeline.map, pageable in and out")
        out.fill(0)
        p.map(kernel, x, out, args=(ALPHA,))
        _check("ctxkit pageable", out, expected, failures)
        t = best_seconds(
            lambda: p.map(kernel, x, out, args=(ALPHA,), host_path="staged"),
            repeats,
            "pageable, staged",
            progress,
        )
        results.append(("ctxkit pageable, arrays seen once (staged)", _gbps(x.nbytes, t)))
        _check("ctxkit pageable staged", out, expected, failures)
        out.fill(0)
        t = best_seconds(
            lambda: p.map(kernel, x, out, args=(ALPHA,)), repeats, "pageable, reused", progress
        )
        stats, timeline = p.last_stats, p.trace()
        results.append((f"ctxkit pageable, reused arrays ({stats.path})", _gbps(x.nbytes, t)))
        _check("ctxkit pageable (pin on reuse)", out, expected, failures)
        p.release_pinned()

        say("[3/3] ctxkit Pipeline.map, pinned in and out (zero-copy path)")
        xp = pinned_empty(x.shape, x.dtype, context=contexts[0])
        op = pinned_empty(x.shape, x.dtype, context=contexts[0])
        xp[...] = x
        p.map(kernel, xp, op, args=(ALPHA,))
        _check("ctxkit pinned", op, expected, failures)
        t = best_seconds(lambda: p.map(kernel, xp, op, args=(ALPHA,)), repeats, "pinned", progress)
        results.append(("ctxkit pinned", _gbps(x.nbytes, t)))

    say("")
    say(f"results ({x.nbytes / MiB:.0f} MiB float32 in and out, {use} GPU(s), best of {repeats}):")
    base = results[1][1]
    for name, g in results:
        say(f"  {name:48s} {g:7.1f} GB/s   {g / base if base else 0:5.1f}x the chunked naive")
    say(f"per device (ctxkit pageable, {stats.path}):")
    busy = timeline.breakdown()
    for d in stats.devices:
        parts = ", ".join(f"{k} {v:.1f} ms" for k, v in busy.get(d.device, {}).items())
        say(
            f"  GPU {d.device}: {d.rows} rows, {d.nbytes / MiB:.0f} MiB in {d.chunks} chunks, "
            f"{d.seconds * 1e3:.1f} ms, {d.gbps:.1f} GB/s; busy: {parts}"
        )
    trace_path = getattr(args, "trace", None)
    if trace_path:
        _write_trace(timeline, trace_path)
    if failures:
        say(f"FAILED: results differ from numpy for {', '.join(failures)}")
        return 1
    say("OK: every result matches numpy exactly")
    return 0
