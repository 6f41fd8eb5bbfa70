"""``python -m ctxkit demo``: copy -> kernel -> copy, ctxkit beside its peers.

Prints the devices, compiles ``ptx/scale.cu`` (cached), and runs ``y = 2 * x`` over a
large pageable float32 array (``--size-mb``; 1024 MiB where the GPUs and the host have
the memory for it) in the ways users write it, every result checked against numpy:

* the naive multi-GPU pattern as tutorials write it (:class:`NaivePattern`: one host
  thread, one stream per device, literal async calls on pageable memory, 8 chunks per
  device; each copy blocks the host, so the devices take turns);
* CuPy ``cp.asnumpy(cp.asarray(x) * 2)``, PyTorch ``(torch.from_numpy(x).to("cuda") *
  2).cpu()`` and PyTorch's best path for numpy data (``pin_memory()`` + non-blocking
  copies into a cached pinned output), on one GPU, when they are installed (skipped
  with a line when not);
* ctxkit's first call: a new :class:`~ctxkit.Pipeline` per call on an array it has never
  seen, default ``out`` (``ck.Pipeline().map(k, x)``, the call a user writes first);
* a long-lived Pipeline fed a fresh array every call (a stream of new batches);
* the same arrays again (pin on reuse: page-locked once, then DMAed directly);
* pinned arrays (``ctxkit.pinned_empty``: direct asynchronous copies);

then prints the side-by-side table -- GB/s counting input and output bytes, each
variant against PyTorch's pinned path (or the naive pattern without PyTorch) -- the
per-device breakdown, and writes the timelines of the repeated and first calls
(Chrome-trace JSON). It exits 1 when any result differs from numpy (2 without a GPU).
The table is built by pure functions (:class:`Row`, :func:`format_table`).
:class:`NaivePattern` and :func:`load_scale_kernel` are shared with
``benchmarks/bench_pipeline.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__, _driver
from .._driver import call, drv
from ..binding import registry
from ..compiler.objectcode import ObjectCode
from ..compiler.program import compile, kernel_source
from ..context import Context
from ..device import Device, device_count, devices
from ..memory.device import DeviceBuffer
from ..memory.host import pinned_empty
from ..memory.pinned import pinned_pool
from ..module.kernel import Kernel
from ..module.module import Module
from ..pipeline.pipeline import Pipeline
from ..pipeline.plan import grid_size, split_rows
from ..stream import Stream
from ..trace import Timeline

#: what other modules use: ``cli`` runs the demo, ``benchmarks/bench_pipeline.py`` shares
#: the naive pattern and the kernel
__all__ = ["NaivePattern", "load_scale_kernel", "run_demo"]


MiB = 1 << 20


ALPHA = 2.0


# --- the table (pure functions, tested on canned numbers) ------------------------------


GiB = 1 << 30


#: Row keys and the variants' names in the table, in the order the table lists them.
LABELS = {
    "naive": "naive pattern, 8 chunks per device",
    "cupy": "CuPy cp.asnumpy(cp.asarray(x) * 2)",
    "torch": 'torch (from_numpy(x).to("cuda") * 2).cpu()',
    "torch_pinned": "torch pin_memory() + non-blocking, cached pinned out",
    "first_call": "ctxkit first call: new Pipeline, fresh x, default out",
    "fresh": "ctxkit long-lived Pipeline, fresh x, default out",
    "repeated": "ctxkit repeated (same arrays)",
    "pinned": "ctxkit pinned arrays",
}
ROW_ORDER = tuple(LABELS)


@dataclass(frozen=True)
class Row:
    """One variant of the table: GB/s (input + output bytes) of each timed call."""

    key: str
    gpus: int
    gbps: tuple[float, ...]
    note: str = ""

    @property
    def label(self) -> str:
        """The variant's name in the table."""
        return LABELS.get(self.key, self.key)

    @property
    def best(self) -> float:
        """The fastest call's GB/s (0.0 without calls)."""
        return max(self.gbps, default=0.0)

    @property
    def median(self) -> float:
        """The median call's GB/s (0.0 without calls)."""
        return statistics.median(self.gbps) if self.gbps else 0.0


def io_gbps(in_bytes: int, out_bytes: int, seconds: float) -> float:
    """Gigabytes (1e9) of input plus output per second."""
    return (in_bytes + out_bytes) / seconds / 1e9 if seconds > 0 else 0.0


def baseline_row(rows: Sequence[Row]) -> Row | None:
    """What the table compares with: PyTorch's pinned path, else the naive pattern."""
    by_key = {r.key: r for r in rows if r.gbps}
    return by_key.get("torch_pinned") or by_key.get("naive")


def format_table(rows: Sequence[Row], skipped: Sequence[str] = (), title: str = "") -> list[str]:
    """The side-by-side table as lines: variant, GPUs, best and median GB/s (input +
    output bytes), every call, and the best against :func:`baseline_row`'s best."""
    base = baseline_row(rows)
    vs = f"vs {'torch pinned' if base and base.key == 'torch_pinned' else 'naive'}"
    width = max([len(r.label) for r in rows] + [len("variant")])
    lines = [title] if title else []
    lines.append(f"  {'variant':{width}s}  GPUs  best GB/s  median  {vs:>15s}  calls (GB/s)")
    rank = {k: i for i, k in enumerate(ROW_ORDER)}
    for r in sorted(rows, key=lambda r: rank.get(r.key, len(rank))):
        ratio = f"{r.best / base.best:.2f}x" if base and base.best else "-"
        calls = " ".join(f"{g:.1f}" for g in r.gbps)
        note = f"  ({r.note})" if r.note else ""
        lines.append(
            f"  {r.label:{width}s}  {r.gpus:4d}  {r.best:9.1f}  {r.median:6.1f}  "
            f"{ratio:>15s}  {calls}{note}"
        )
    lines.extend(f"  skipped: {s}" for s in skipped)
    return lines


def choose_size_mb(
    requested: float | None, quick: bool, gpu_bytes: Sequence[int], host_bytes: int | None
) -> float:
    """The input size in MiB: *requested*, else 1024 where every GPU has 8 GiB and the
    host 16 GiB (the variants hold several copies of the input), else 256; ``--quick``
    caps it at 64.

    Raises
    ------
    ValueError
        *requested* is not a positive number.
    """
    roomy = min(gpu_bytes, default=0) >= 8 * GiB and (host_bytes or 0) >= 16 * GiB
    size = (1024.0 if roomy else 256.0) if requested is None else float(requested)
    if not size > 0:
        raise ValueError(f"--size-mb must be a positive number of MiB, got {requested!r}")
    return min(size, 64.0) if quick else size


def trace_paths(path: str) -> tuple[Path, Path]:
    """Where the timelines go: the repeated call's at *path*, the first call's beside it
    (``NAME-first-call.json``)."""
    main = Path(path)
    return main, main.with_name(f"{main.stem}-first-call{main.suffix or '.json'}")


# --- the variants ----------------------------------------------------------------------


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
        nbytes = max(1, max_rows * row)
        for ctx in self.contexts:
            dev = ctx.device
            cap = dev.multiprocessor_count * dev.attribute("max_threads_per_multiprocessor")
            d_in, d_out = DeviceBuffer(nbytes, context=ctx), DeviceBuffer(nbytes, context=ctx)
            self.bufs.append((d_in, d_out, Stream(context=ctx), cap))

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
                    call(drv.cuMemcpyHtoDAsync, d_in.ptr + off, xp + lo * row + off, nb, s.handle)
                    n = (b - a) * elems
                    grid = grid_size(n, 256, cap // 256)
                    self.kernel.launch(
                        grid, 256, d_in.ptr + off, d_out.ptr + off, n, *args, stream=s
                    )
                    call(drv.cuMemcpyDtoHAsync, op + lo * row + off, d_out.ptr + off, nb, s.handle)
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


# --- running -----------------------------------------------------------------------------


def _host_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _print_devices(ordinals: Sequence[int]) -> None:
    bv, dv = _driver.BINDINGS_VERSION, _driver.driver_version()
    versions = f", cuda-bindings {bv[0]}.{bv[1]}, driver CUDA {dv[0]}.{dv[1]}" if dv else ""
    say(f"ctxkit {__version__}{versions}")
    for d in devices():
        mark = "*" if d.ordinal in ordinals else " "
        say(
            f"  {mark} GPU {d.ordinal}: {d.name} ({d.arch}), {d.total_memory / 2**30:.0f} GiB, "
            f"{d.multiprocessor_count} SMs, PCI {d.pci_bus_id}"
        )


def _write_trace(tl: Timeline, target: Path, title: str) -> None:
    tl.to_chrome_trace(target)
    say(f"trace ({title}): {target} ({len(tl)} intervals; open it in https://ui.perfetto.dev)")
    try:
        png = target.with_suffix(".png")
        tl.to_png(png, title=f"ctxkit demo: {title}")
        say(f"trace chart: {png}")
    except ImportError:
        say('trace chart: skipped (for a PNG chart: pip install -e ".[plot]" in a checkout)')


#: A peer's runner: ``run(x) -> y`` (a numpy array), and what it is.
Peer = tuple[Callable[[np.ndarray], np.ndarray], str]


def cupy_peer() -> tuple[Peer | None, str]:
    """CuPy's ``asnumpy(asarray(x) * 2)`` on device 0, or ``(None, why not)``."""
    try:
        import cupy as cp
    except Exception as exc:
        return None, f"CuPy (not installed: {type(exc).__name__}; pip install cupy-cuda13x)"

    def run(x: np.ndarray) -> np.ndarray:
        with cp.cuda.Device(0):
            return cp.asnumpy(cp.asarray(x) * 2)

    return (run, f"CuPy {cp.__version__}"), ""


def torch_peers(template: np.ndarray) -> tuple[dict[str, Peer], str]:
    """PyTorch's plain path and its pinned path (``pin_memory()``, non-blocking copies,
    a cached pinned output shaped like *template*) on device 0, or ``({}, why not)``."""
    try:
        import torch
    except Exception as exc:
        return {}, f"torch rows (not installed: {type(exc).__name__}; pip install torch)"
    if not torch.cuda.is_available():
        return {}, "torch rows (torch sees no CUDA device)"
    dev = torch.device("cuda", 0)
    out_t = torch.empty(template.shape, dtype=torch.float32, pin_memory=True)

    def plain(x: np.ndarray) -> np.ndarray:
        return (torch.from_numpy(x).to(dev) * 2).cpu().numpy()

    def pinned(x: np.ndarray) -> np.ndarray:
        d = torch.from_numpy(x).pin_memory().to(dev, non_blocking=True)
        d.mul_(ALPHA)
        out_t.copy_(d, non_blocking=True)
        torch.cuda.synchronize(dev)
        return out_t.numpy()

    note = f"torch {torch.__version__}"
    return {"torch": (plain, note), "torch_pinned": (pinned, note)}, ""


def _release_peers() -> None:
    """Give back the device memory CuPy's and PyTorch's caching allocators kept."""
    with suppress(Exception):
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
    with suppress(Exception):
        import torch

        torch.cuda.empty_cache()


class _Demo:
    """The variants of one demo run and what they measured."""

    def __init__(
        self, kernel: Any, x: np.ndarray, ordinals: list[int], repeats: int, trace: bool
    ) -> None:
        self.kernel = kernel
        self.x = x
        self.expected = x * np.float32(ALPHA)
        self.ordinals = ordinals
        self.repeats = repeats
        self.trace = trace
        self.rows: list[Row] = []
        self.skipped: list[str] = []
        self.failures: list[str] = []
        self.first_timeline: Timeline | None = None
        self.repeated: tuple[Any, Timeline] | None = None
        self.progress = x.nbytes >= 1024 * MiB
        self._first_path = ""
        self._untimed = 0.0  # seconds of the current call not to count (taking its trace)

    def check(self, key: str, out: np.ndarray) -> None:
        """Compare *out* with numpy's result; a mismatch is reported and remembered."""
        expected = self.expected
        if out.shape == expected.shape and np.array_equal(out, expected):
            return
        if key not in self.failures:
            self.failures.append(key)
        if out.shape != expected.shape:
            say(f"  VERIFY FAILED ({key}): shape {out.shape}, expected {expected.shape}")
            return
        bad = out != expected
        first = int(np.flatnonzero(bad)[0])
        say(
            f"  VERIFY FAILED ({key}): {int(np.count_nonzero(bad))} of {out.size} elements "
            f"differ; first at {first}: got {out[first]!r}, expected {expected[first]!r}"
        )

    def timed(
        self,
        key: str,
        call: Callable[[np.ndarray], np.ndarray],
        fresh: bool,
        warmup: int = 0,
        note: str | Callable[[], str] = "",
        gpus: int | None = None,
    ) -> None:
        """Time ``call(x) -> out`` *repeats* times after *warmup* untimed calls, on a
        fresh copy of x each call when *fresh*; check every result. *note* is the row's
        note, or a function that tells it after the calls (the host path they took);
        *gpus* defaults to every device of the run."""
        values = []
        for i in range(warmup + self.repeats):
            x = self.x.copy() if fresh else self.x  # new pages: input ctxkit never saw
            self._untimed = 0.0
            t0 = time.perf_counter()
            out = call(x)
            seconds = time.perf_counter() - t0 - self._untimed
            self.check(key, out)
            if i >= warmup:
                values.append(io_gbps(x.nbytes, out.nbytes, seconds))
                if self.progress:
                    say(f"    {LABELS[key]}: call {i + 1 - warmup}: {values[-1]:.1f} GB/s")
            del x, out
        gpus = len(self.ordinals) if gpus is None else gpus
        self.rows.append(Row(key, gpus, tuple(values), note() if callable(note) else note))

    def naive(self, contexts: list[Context]) -> None:
        say("[1/6] the naive pattern (one thread, per-device streams, pageable, 8 chunks)")
        naive = NaivePattern(self.kernel, contexts, -(-self.x.shape[0] // len(contexts)), 4)
        out = np.empty_like(self.x)
        try:

            def run(x: np.ndarray) -> np.ndarray:
                naive.run(x, out, (ALPHA,), 8)
                return out

            self.timed("naive", run, fresh=False, warmup=1)
        finally:
            naive.close()

    def peers(self) -> None:
        say("[2/6] CuPy and PyTorch on one GPU (when installed)")
        cupy, why = cupy_peer()
        try:
            torch, why_not = torch_peers(self.x)
        except Exception as exc:  # installed but unusable here (another CUDA, no memory)
            torch, why_not = {}, f"torch rows (failed: {exc!r})"
        peers: dict[str, Peer] = torch if cupy is None else {"cupy": cupy, **torch}
        self.skipped += [w for w in (why, why_not) if w]
        for key, (fn, note) in peers.items():
            try:
                self.timed(key, fn, fresh=False, warmup=1, note=note, gpus=1)
            except Exception as exc:
                self.skipped.append(f"{LABELS[key]} (failed: {exc!r})")
        _release_peers()

    def first_call(self) -> None:
        say("[3/6] ctxkit first call: a new Pipeline per call, arrays never seen, default out")

        def run(x: np.ndarray) -> np.ndarray:
            with Pipeline(self.ordinals) as p:
                out = p.map(self.kernel, x, args=(ALPHA,))
                t_map = time.perf_counter()
                if self.trace:
                    self.first_timeline = p.trace()
                self._untimed = time.perf_counter() - t_map
                self._first_path = p.last_stats.path
            return out

        self.timed("first_call", run, fresh=True, note=lambda: self._first_path)

    def long_lived(self, p: Pipeline) -> None:
        say("[4/6] ctxkit long-lived Pipeline, a fresh array every call, default out")

        def run(x: np.ndarray) -> np.ndarray:
            return p.map(self.kernel, x, args=(ALPHA,))

        self.timed("fresh", run, fresh=True, warmup=1, note=lambda: p.last_stats.path)

    def same_arrays(self, p: Pipeline) -> None:
        say("[5/6] ctxkit, the same arrays again (pin on reuse)")
        out = np.empty_like(self.x)

        def run(x: np.ndarray) -> np.ndarray:
            p.map(self.kernel, x, out, args=(ALPHA,))
            return out

        self.timed("repeated", run, fresh=False, warmup=2, note=lambda: p.last_stats.path)
        self.repeated = (p.last_stats, p.trace())
        p.release_pinned()

    def pinned(self, p: Pipeline, ctx: Context) -> None:
        say("[6/6] ctxkit, pinned arrays (ctxkit.pinned_empty: direct asynchronous copies)")
        xp = pinned_empty(self.x.shape, self.x.dtype, context=ctx)
        op = pinned_empty(self.x.shape, self.x.dtype, context=ctx)
        xp[...] = self.x

        def run(x: np.ndarray) -> np.ndarray:
            p.map(self.kernel, xp, op, args=(ALPHA,))
            return op

        self.timed("pinned", run, fresh=False, warmup=1)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every result matched numpy, 1 otherwise."""
    quick = bool(getattr(args, "quick", False))
    available = device_count()
    use = available if getattr(args, "devices", None) is None else int(args.devices)
    ordinals = list(range(use))
    try:
        if not 1 <= use <= available:
            raise ValueError(f"--devices must be 1..{available}, got {use}")
        gpu_bytes = [Device(i).total_memory for i in ordinals]
        size_mb = choose_size_mb(getattr(args, "size_mb", None), quick, gpu_bytes, _host_memory())
    except ValueError as exc:
        print(f"ctxkit demo: {exc}", file=sys.stderr)
        return 1
    repeats = 1 if quick else 3
    _print_devices(ordinals)

    obj, kernel, secs = load_scale_kernel()
    how = "from the cache" if obj.from_cache else "with NVRTC"
    say(f"kernel: scale_f32 from ptx/scale.cu, {obj.target} {obj.arch}, {how} in {secs:.2f} s")

    n = int(size_mb * MiB) // 4
    say(f"input: {n * 4 / MiB:.0f} MiB of pageable float32 on {use} GPU(s); y = 2 * x")
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    trace_path = getattr(args, "trace", None)
    demo = _Demo(kernel, x, ordinals, repeats, trace=bool(trace_path))
    contexts = [registry.context(i) for i in ordinals]

    demo.naive(contexts)
    demo.peers()
    demo.first_call()
    with Pipeline(ordinals) as p:
        demo.long_lived(p)
        demo.same_arrays(p)
        demo.pinned(p, contexts[0])

    say("")
    title = (
        f"results: {x.nbytes / MiB:.0f} MiB float32 in and out, y = 2 * x; GB/s count input "
        f"+ output bytes; {repeats} call(s) per variant:"
    )
    say("\n".join(format_table(demo.rows, demo.skipped, title)))
    if (pool := pinned_pool().stats()).requests:
        say(
            f"pinned pool: {pool.hits} of {pool.requests} requests served from the cache, "
            f"{pool.allocations} blocks page-locked, peak {pool.peak_bytes / MiB:.0f} MiB "
            f"(budget {pool.budget / MiB:.0f} MiB)"
        )
    if demo.repeated is not None:
        stats, timeline = demo.repeated
        say(f"per device (ctxkit repeated, {stats.path}):")
        busy = timeline.breakdown()
        for d in stats.devices:
            parts = ", ".join(f"{k} {v:.1f} ms" for k, v in busy.get(d.device, {}).items())
            say(
                f"  GPU {d.device}: {d.rows} rows, {d.nbytes / MiB:.0f} MiB in {d.chunks} chunks, "
                f"{d.seconds * 1e3:.1f} ms, {d.gbps:.1f} GB/s; busy: {parts}"
            )
        if trace_path:
            main_path, first_path = trace_paths(trace_path)
            _write_trace(timeline, main_path, "repeated call")
            if demo.first_timeline is not None:
                _write_trace(demo.first_timeline, first_path, "first call")
    if demo.failures:
        say(f"FAILED: results differ from numpy for {', '.join(demo.failures)}")
        return 1
    say("OK: every result matches numpy exactly")
    return 0
