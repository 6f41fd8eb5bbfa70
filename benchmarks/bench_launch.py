"""Kernel launch overhead: ctxkit vs raw cuda.bindings, CuPy and cuda.core; CUDA graph replay.

    PYTHONPATH=. python3 benchmarks/bench_launch.py [--quick]

An empty kernel with a pointer and an int argument (``ptx/empty.cu``) is launched N
times on a non-blocking stream, then the stream is synchronized; the per-launch time
includes the final wait. Variants, interleaved round by round (best round kept):

* ``Kernel.launch``   -- checks and packs the arguments on every call
* ``PreparedLaunch``  -- arguments packed once
* raw cuda.bindings   -- ``cuLaunchKernel`` with a pre-built ``void**`` address (the
  cheapest raw form) and with the ``(values, types)`` tuple form
* CuPy ``RawKernel``  -- when CuPy is installed
* cuda.core ``launch(stream, LaunchConfig, kernel, ptr, np.int32)`` -- when cuda.core is
  installed (``cuda.core`` 1.x or ``cuda.core.experimental`` 0.x, whichever exists); it
  converts its arguments on every call, like ``Kernel.launch``
* ``Kernel.launch`` inside ``with stream:`` (``stream=None``: the current stream), when
  this ctxkit has a current stream
* a 2-pointer empty kernel launched with a torch tensor and a CuPy array (ctxkit orders
  the launch after their producer streams) vs the same launch with two ctxkit buffers,
  when both libraries are installed; the target is on the non-blocking stream above
  (the legacy default stream torch and CuPy use is not ordered before it, so ctxkit
  asks whether it has pending work). The same pair on a *blocking* ctxkit stream,
  which CUDA orders after the legacy default stream itself, is printed for reference

Graph replay: 100 and 1000 empty kernels captured into one graph (ctxkit ``capture`` vs
raw ``cuStreamBeginCapture``), replayed R times after a warm-up; the steady-state time per
kernel node is reported for both, so the raw floor of the same run is always next to
ctxkit's. The target is decided on the 1000-node graph (fixed in advance: the size where
a node's cost is least dominated by the launch of the graph itself). The first replay of
a freshly instantiated graph is timed too, with and without ``cuGraphUpload``
(``Graph.upload``) beforehand: uploading moves work out of the first launch, it cannot
change the steady state.

Every target decides on the median of the rounds; the best round is printed beside it.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from hostprofile import profile_text
from verdictlines import (
    QUICK,
    Line,
    emit,
    info,
    median,
    median_info,
    missing_baseline,
    target,
)

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.compiler import kernel_source
from ctxkit.graph import capture

GRAPH_SIZES = (100, 1000)
#: The graph size the graph target is decided on (fixed before measuring).
GRAPH_TARGET_NODES = 1000


def _check(res: Any, what: str) -> Any:
    if int(res[0]):
        raise RuntimeError(f"{what} failed: {res[0]!r}")
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


class Raw:
    """The same kernel through raw cuda.bindings: its own module, function and stream."""

    def __init__(self, cubin: bytes, ptr: int) -> None:
        self.mod = _check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.fn = _check(drv.cuModuleGetFunction(self.mod, b"empty"), "cuModuleGetFunction")
        self.stream = _check(drv.cuStreamCreate(1), "cuStreamCreate")
        self.a = ctypes.c_void_p(ptr)
        self.b = ctypes.c_int(1)
        self.ptrs = (ctypes.c_void_p * 2)(ctypes.addressof(self.a), ctypes.addressof(self.b))
        self.addr = ctypes.addressof(self.ptrs)
        self.tuple_args = ((ptr, 1), (ctypes.c_void_p, ctypes.c_int))

    def launches(self, n: int) -> None:
        launch, fn, s, addr = drv.cuLaunchKernel, self.fn, self.stream, self.addr
        for _ in range(n):
            (err,) = launch(fn, 1, 1, 1, 32, 1, 1, 0, s, addr, 0)
            if err:
                raise RuntimeError(err)
        drv.cuStreamSynchronize(s)

    def tuple_launches(self, n: int) -> None:
        launch, fn, s, args = drv.cuLaunchKernel, self.fn, self.stream, self.tuple_args
        for _ in range(n):
            (err,) = launch(fn, 1, 1, 1, 32, 1, 1, 0, s, args, 0)
            if err:
                raise RuntimeError(err)
        drv.cuStreamSynchronize(s)

    def graph(self, nodes: int) -> Any:
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(drv.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        for _ in range(nodes):
            _check(
                drv.cuLaunchKernel(self.fn, 1, 1, 1, 32, 1, 1, 0, self.stream, self.addr, 0),
                "cuLaunchKernel",
            )
        g = _check(drv.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        exe = _check(drv.cuGraphInstantiate(g, 0), "cuGraphInstantiate")
        drv.cuGraphDestroy(g)
        return exe

    def graph_replays(self, exe: Any) -> Callable[[int], None]:
        def run(n: int) -> None:
            launch, s = drv.cuGraphLaunch, self.stream
            for _ in range(n):
                (err,) = launch(exe, s)
                if err:
                    raise RuntimeError(err)
            drv.cuStreamSynchronize(s)

        return run

    def close(self) -> None:
        drv.cuStreamDestroy(self.stream)
        drv.cuModuleUnload(self.mod)


def ck_launches(
    kernel: ck.Kernel, buf: ck.DeviceBuffer, stream: ck.Stream
) -> Callable[[int], None]:
    def run(n: int) -> None:
        launch = kernel.launch
        for _ in range(n):
            launch(1, 32, buf, 1, stream=stream)
        stream.synchronize()

    return run


def ck_prepared(pl: ck.PreparedLaunch, stream: ck.Stream) -> Callable[[int], None]:
    def run(n: int) -> None:
        for _ in range(n):
            pl()
        stream.synchronize()

    return run


def ck_graph(graph: Any, stream: ck.Stream) -> Callable[[int], None]:
    def run(n: int) -> None:
        launch = graph.launch
        for _ in range(n):
            launch(stream)
        stream.synchronize()

    return run


class GraphMaker:
    """Fresh ctxkit and raw graphs of *nodes* empty kernels, and their replay functions."""

    def __init__(self, pl: ck.PreparedLaunch, stream: ck.Stream, raw: Raw) -> None:
        self.pl = pl
        self.stream = stream
        self.raw = raw

    def ck_graph(self, nodes: int) -> ck.Graph:
        with capture(self.stream) as graph:
            for _ in range(nodes):
                self.pl()
        assert graph.num_nodes == nodes, graph.num_nodes
        return graph

    def first_replay_us(self, kind: str, nodes: int, upload: bool, tries: int = 3) -> float:
        """Median time of the first launch + sync of a fresh graph, per node."""
        first = self._ck_first if kind == "ctxkit" else self._raw_first
        return float(np.median([first(nodes, upload) for _ in range(tries)])) / nodes * 1e6

    def _ck_first(self, nodes: int, upload: bool) -> float:
        g = self.ck_graph(nodes)
        if upload:
            g.upload(self.stream)
        self.stream.synchronize()
        t0 = time.perf_counter()
        g.launch(self.stream)
        self.stream.synchronize()
        elapsed = time.perf_counter() - t0
        g.close()
        return elapsed

    def _raw_first(self, nodes: int, upload: bool) -> float:
        exe, s = self.raw.graph(nodes), self.raw.stream
        if upload:
            _check(drv.cuGraphUpload(exe, s), "cuGraphUpload")
        _check(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        t0 = time.perf_counter()
        _check(drv.cuGraphLaunch(exe, s), "cuGraphLaunch")
        _check(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        elapsed = time.perf_counter() - t0
        drv.cuGraphExecDestroy(exe)
        return elapsed

    def steady_us(self, nodes: int, replays: int, rounds: int) -> dict[str, list[float]]:
        """Per-node microseconds of warm replays, per round, ctxkit and raw interleaved."""
        graph = self.ck_graph(nodes)
        exe = self.raw.graph(nodes)
        try:
            t = rounds_us(
                {"ctxkit": ck_graph(graph, self.stream), "raw": self.raw.graph_replays(exe)},
                replays,
                rounds,
            )
        finally:
            drv.cuGraphExecDestroy(exe)
            graph.close()
        return {k: [v / nodes for v in vs] for k, vs in t.items()}


def bench_graphs(maker: GraphMaker, replays: int, rounds: int) -> dict[str, Any]:
    """``graph<N>_steady_<who>`` (per-round us per node) and ``graph<N>_first[_upload]_<who>``
    (median first replay, us per node) for every graph size."""
    out: dict[str, Any] = {}
    for nodes in GRAPH_SIZES:
        reps = max(10, replays * GRAPH_SIZES[0] // nodes)
        for who, values in maker.steady_us(nodes, reps, rounds).items():
            out[f"graph{nodes}_steady_{who}"] = values
        for upload in (False, True):
            label = f"graph{nodes}_first{'_upload' if upload else ''}"
            for who in ("ctxkit", "raw"):
                out[f"{label}_{who}"] = maker.first_replay_us(who, nodes, upload)
    return out


def cupy_variant() -> tuple[Callable[[int], None] | None, str]:
    try:
        import cupy as cp
    except Exception as exc:
        return None, f"CuPy not available ({type(exc).__name__})"
    cp.cuda.Device(0).use()
    kern = cp.RawKernel(kernel_source("empty.cu"), "empty")
    arr = cp.empty(256, dtype=cp.uint8)
    args = (arr, np.int32(1))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        kern((1,), (32,), args)  # compile and load outside the timing
    stream.synchronize()

    def run(n: int) -> None:
        with stream:
            for _ in range(n):
                kern((1,), (32,), args)
        stream.synchronize()

    return run, f"CuPy {cp.__version__}"


def import_cuda_core() -> tuple[Any, str]:
    """``(module, name)`` of cuda.core's launch API: ``cuda.core`` (1.x, and 0.x releases
    that export it at the top) or ``cuda.core.experimental``; ``(None, reason)`` if absent."""
    need = ("Device", "LaunchConfig", "ObjectCode", "launch")
    reasons = []
    for name in ("cuda.core", "cuda.core.experimental"):
        try:
            mod = importlib.import_module(name)
        except Exception as exc:
            reasons.append(f"{name}: {type(exc).__name__}")
            continue
        if all(hasattr(mod, n) for n in need):
            return mod, name
        reasons.append(f"{name}: no {'/'.join(n for n in need if not hasattr(mod, n))}")
    return None, "cuda.core is not installed (" + "; ".join(reasons) + ")"


def cuda_core_variant(
    cubin: bytes, ptr: int, ctx: ck.Context
) -> tuple[Callable[[int], None] | None, str]:
    """cuda.core's ``launch`` of the same cubin, on its own stream of device 0's primary
    context (the context ctxkit's registry uses, so both share it)."""
    cc, name = import_cuda_core()
    if cc is None:
        return None, name
    if not ctx.is_primary:
        return None, "cuda.core uses the primary context; the registry's context is not it"
    version = getattr(importlib.import_module("cuda.core"), "__version__", "?")
    dev = cc.Device(0)
    dev.set_current()
    stream = dev.create_stream()
    kern = cc.ObjectCode.from_cubin(cubin).get_kernel("empty")
    config = cc.LaunchConfig(grid=1, block=32)
    launch, one = cc.launch, np.int32(1)
    launch(stream, config, kern, ptr, one)  # load outside the timing
    stream.sync()

    def run(n: int) -> None:
        for _ in range(n):
            launch(stream, config, kern, ptr, one)
        stream.sync()

    return run, f"cuda.core {version} ({name})"


def current_stream_variant(
    kernel: ck.Kernel, buf: ck.DeviceBuffer, stream: ck.Stream
) -> tuple[Callable[[int], None] | None, str]:
    """``Kernel.launch`` with ``stream=None`` inside ``with stream:``."""
    if not (callable(getattr(ck, "current_stream", None)) and hasattr(ck.Stream, "__enter__")):
        return None, "this ctxkit has no current stream (with stream:)"

    def run(n: int) -> None:
        launch = kernel.launch
        with stream:
            for _ in range(n):
                launch(1, 32, buf, 1)
        stream.synchronize()

    return run, "with stream: + Kernel.launch(stream=None)"


EMPTY2_SOURCE = 'extern "C" __global__ void empty2(void* a, void* b) {}\n'


def foreign_args_variants(
    stream: ck.Stream,
) -> tuple[dict[str, Callable[[int], None]], str]:
    """``two_buffers`` and ``torch_cupy``: ``Kernel.launch`` of a 2-pointer kernel with two
    ctxkit buffers, and with a torch tensor and a CuPy array (each launch imports them
    and orders itself after their streams), on *stream*; ``two_buffers_blocking`` and
    ``torch_cupy_blocking`` the same on a blocking stream; ``({}, reason)`` without torch
    or CuPy."""
    try:
        import cupy as cp
        import torch
    except Exception as exc:
        return {}, f"needs torch and CuPy ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return {}, "torch sees no CUDA device"
    kernel = ck.Module.load(ck.compile(EMPTY2_SOURCE, name="empty2.cu")).function("empty2")
    a, b = ck.DeviceBuffer(256), ck.DeviceBuffer(256)
    t = torch.empty(256, dtype=torch.uint8, device=torch.device("cuda", 0))
    with cp.cuda.Device(0):
        c = cp.empty(256, dtype=cp.uint8)
    torch.cuda.synchronize()

    def run(x: Any, y: Any, s: ck.Stream) -> Callable[[int], None]:
        def go(n: int) -> None:
            launch = kernel.launch
            for _ in range(n):
                launch(1, 32, x, y, stream=s)
            s.synchronize()

        return go

    def floor(n: int) -> None:
        """Two ctxkit buffers plus the least any event-based ordering costs: one raw
        cuEventRecord on the legacy stream and one cuStreamWaitEvent."""
        launch, record, wait = kernel.launch, drv.cuEventRecord, drv.cuStreamWaitEvent
        legacy, target = drv.CUstream(0), stream.handle
        for _ in range(n):
            launch(1, 32, a, b, stream=stream)
            record(event, legacy)
            wait(target, event, 0)
        stream.synchronize()

    torch_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    cupy_stream = getattr(cp.cuda.stream, "get_current_stream_ptr", None)

    def reads_floor(n: int) -> None:
        """The event floor plus the least torch and CuPy answer per launch: each array's
        pointer and device, and its library's current stream (what ordering needs)."""
        launch, record, wait = kernel.launch, drv.cuEventRecord, drv.cuStreamWaitEvent
        legacy, target = drv.CUstream(0), stream.handle
        for _ in range(n):
            torch_stream(t.get_device()), t.data_ptr(), t.is_cuda
            cupy_stream(), c.data.ptr, c.data.device_id
            launch(1, 32, a, b, stream=stream)
            record(event, legacy)
            wait(target, event, 0)
        stream.synchronize()

    err, event = drv.cuEventCreate(2)  # CU_EVENT_DISABLE_TIMING
    if err:
        raise RuntimeError(f"cuEventCreate: {err}")
    blocking = ck.Stream(nonblocking=False)
    note = f"torch {torch.__version__} tensor + CuPy {cp.__version__} array"
    variants = {
        "two_buffers": run(a, b, stream),
        "torch_cupy": run(t, c, stream),
        "two_buffers_event_floor": floor,
        **({"foreign_reads_floor": reads_floor} if torch_stream and cupy_stream else {}),
        "two_buffers_blocking": run(a, b, blocking),
        "torch_cupy_blocking": run(t, c, blocking),
    }
    return variants, note


def rounds_us(
    variants: dict[str, Callable[[int], None]], n: int, rounds: int
) -> dict[str, list[float]]:
    """Per-call microseconds of every round, variants interleaved within each round."""
    t: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn(min(n, 1000))  # warm-up
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(n)
            t[name].append((time.perf_counter() - t0) / n * 1e6)
    return t


def _ratio(
    r: Mapping[str, Any], name: str, num: str, den: str, limit: float | None, what: str
) -> Line:
    """``num / den`` on the medians of the rounds (lower is better); best rounds beside."""
    a, b = r[num], r[den]
    value = median(a) / median(b)
    note = f"{what}; medians of {len(a)} rounds; best {min(a) / min(b):.2f}x"
    return (
        info(name, value, "x", note)
        if limit is None
        else target(name, value, "<=", limit, "x", note)
    )


def verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The SUMMARY lines of this benchmark from its measurements (pure: no GPU).

    *r*: per-round us per launch of ``kernel_launch``, ``prepared``, ``raw_address``,
    ``raw_tuple`` and, when measured, ``cupy``, ``cuda_core``, ``current_stream``; the
    ``*_note`` of each optional variant; the graph numbers of :func:`bench_graphs`.
    """
    lines = [
        median_info("launch.kernel_launch_us", r["kernel_launch"], "us", higher=False),
        median_info("launch.prepared_us", r["prepared"], "us", higher=False),
    ]
    if r.get("cupy"):
        lines.append(_ratio(r, "launch.prepared_vs_cupy", "prepared", "cupy", 1.0, r["cupy_note"]))
        lines.append(
            _ratio(r, "launch.kernel_launch_vs_cupy", "kernel_launch", "cupy", 1.5, r["cupy_note"])
        )
    else:
        for name, limit in (
            ("launch.prepared_vs_cupy", 1.0),
            ("launch.kernel_launch_vs_cupy", 1.5),
        ):
            why = r.get("cupy_note", "CuPy not measured")
            lines.append(missing_baseline(r, name, "<=", limit, "x", why))
    if r.get("cuda_core"):
        note = f"{r['cuda_core_note']} launch"
        lines.append(
            _ratio(r, "launch.kernel_launch_vs_cuda_core", "kernel_launch", "cuda_core", 1.15, note)
        )
        lines.append(_ratio(r, "launch.prepared_vs_cuda_core", "prepared", "cuda_core", 1.0, note))
        lines.append(
            _ratio(
                r,
                "launch.raw_bindings_vs_cuda_core",
                "raw_address",
                "cuda_core",
                None,
                f"the floor through cuda.bindings: cuLaunchKernel with a pre-built void** vs "
                f"{note} (compiled, calls the driver directly)",
            )
        )
    else:
        for name, limit in (
            ("launch.kernel_launch_vs_cuda_core", 1.15),
            ("launch.prepared_vs_cuda_core", 1.0),
        ):
            why = r.get("cuda_core_note", "cuda.core not measured")
            lines.append(missing_baseline(r, name, "<=", limit, "x", why))
    if r.get("current_stream"):
        lines.append(
            _ratio(
                r,
                "launch.current_stream_vs_explicit",
                "current_stream",
                "kernel_launch",
                1.05,
                "stream=None inside with stream: vs stream=s (no slower; 5% noise allowance)",
            )
        )
    else:
        why = r.get("current_stream_note", "not measured")
        lines.append(missing_baseline(r, "launch.current_stream_vs_explicit", "<=", 1.05, "x", why))
    if r.get("torch_cupy"):
        lines.append(
            _ratio(
                r,
                "launch.foreign_args_vs_ctxkit_buffers",
                "torch_cupy",
                "two_buffers",
                1.3,
                f"Kernel.launch with a {r['foreign_note']} vs two ctxkit buffers",
            )
        )
    else:
        why = r.get("foreign_note") or "torch and CuPy not measured"
        name = "launch.foreign_args_vs_ctxkit_buffers"
        lines.append(missing_baseline(r, name, "<=", 1.3, "x", why))
    if r.get("two_buffers_event_floor") and r.get("two_buffers"):
        lines.append(
            _ratio(
                r,
                "launch.event_order_floor_vs_ctxkit_buffers",
                "two_buffers_event_floor",
                "two_buffers",
                None,
                "the floor of ordering after the legacy stream with an event: the same "
                "launch plus one raw cuEventRecord + cuStreamWaitEvent",
            )
        )
    if r.get("foreign_reads_floor") and r.get("two_buffers"):
        lines.append(
            _ratio(
                r,
                "launch.foreign_reads_floor_vs_ctxkit_buffers",
                "foreign_reads_floor",
                "two_buffers",
                None,
                "the event floor plus what torch and CuPy take to give each array's pointer, "
                "device and current stream (their own Python, before ctxkit does anything)",
            )
        )
    if r.get("torch_cupy_blocking"):
        lines.append(
            _ratio(
                r,
                "launch.foreign_args_blocking_stream_vs_ctxkit_buffers",
                "torch_cupy_blocking",
                "two_buffers_blocking",
                None,
                "the same on a blocking ctxkit stream (ordered after torch's and CuPy's "
                "legacy default stream by CUDA itself: no stream query)",
            )
        )
    lines.append(_ratio(r, "launch.prepared_vs_raw", "prepared", "raw_address", None, "void**"))
    n = GRAPH_TARGET_NODES
    mine, raw = r[f"graph{n}_steady_ctxkit"], r[f"graph{n}_steady_raw"]
    # A replayed node costs what the driver's cuGraphLaunch costs: ctxkit is judged on the
    # ratio to the raw graph of the same run, the time per node is the driver's figure.
    lines.append(
        median_info(
            "launch.graph_node_us",
            mine,
            "us",
            higher=False,
            what=f"{n}-node graph, fixed in advance; raw graph {median(raw):.2f}us",
        )
    )
    lines.append(
        _ratio(
            r,
            "launch.graph_node_vs_raw",
            f"graph{n}_steady_ctxkit",
            f"graph{n}_steady_raw",
            1.05,
            f"{n}-node graph, fixed in advance (5% noise allowance)",
        )
    )
    for nodes in GRAPH_SIZES:
        g = {k: r[f"graph{nodes}_{k}"] for k in ("first_ctxkit", "first_upload_ctxkit")}
        g.update({k: r[f"graph{nodes}_{k}"] for k in ("first_raw", "first_upload_raw")})
        note = (
            f"median of 3 fresh graphs, per node; after upload {g['first_upload_ctxkit']:.2f}us; "
            f"raw {g['first_raw']:.2f}us, after upload {g['first_upload_raw']:.2f}us"
        )
        lines.append(info(f"launch.graph_first_replay_{nodes}_us", g["first_ctxkit"], "us", note))
    return lines


def print_table(r: Mapping[str, Any], n: int, rounds: int, names: Sequence[str]) -> None:
    print(f"empty(void*, int) launch, {n} launches + sync, {rounds} rounds (median | best):")
    for name in names:
        print(f"  {name:15s} {median(r[name]):6.2f} | {min(r[name]):6.2f} us/launch")
    for key in ("cupy_note", "cuda_core_note", "current_stream_note", "foreign_note"):
        print(f"  ({r[key]})")
    print("graphs of N empty kernels, us per node, ctxkit | raw (steady: median of rounds;")
    print("first: median first replay of 3 fresh graphs):")
    for nodes in GRAPH_SIZES:
        for label in ("steady", "first", "first_upload"):
            a, b = r[f"graph{nodes}_{label}_ctxkit"], r[f"graph{nodes}_{label}_raw"]
            a, b = (median(a), median(b)) if label == "steady" else (a, b)
            print(f"  {nodes:5d} {label:14s} {a:7.3f} | {b:7.3f}")


def measure(n: int, replays: int, rounds: int) -> tuple[dict[str, Any], list[str]]:
    """Every variant's per-round us per launch and the graph numbers; the variant names."""
    ctx = ck.registry.context(0)
    r: dict[str, Any] = {}
    with ctx:
        obj = ck.compile(kernel_source("empty.cu"), name="empty.cu", target="cubin")
        kernel = ck.Module.load(obj).function("empty")
        buf = ck.DeviceBuffer(256)
        stream = ck.Stream()
        pl = kernel.prepare(1, 32, buf, 1, stream=stream)
        raw = Raw(obj.code, buf.ptr)
        variants: dict[str, Callable[[int], None]] = {
            "kernel_launch": ck_launches(kernel, buf, stream),
            "prepared": ck_prepared(pl, stream),
            "raw_address": raw.launches,
            "raw_tuple": raw.tuple_launches,
        }
        optional = {
            "cupy": cupy_variant,
            "cuda_core": lambda: cuda_core_variant(obj.code, buf.ptr, ctx),
            "current_stream": lambda: current_stream_variant(kernel, buf, stream),
        }
        for name, make in optional.items():
            run, r[f"{name}_note"] = make()
            if run is not None:
                variants[name] = run
        pair, r["foreign_note"] = foreign_args_variants(stream)
        variants.update(pair)
        try:
            r.update(rounds_us(variants, n, rounds))
            if "torch_cupy" in variants:  # where the host time of foreign arguments goes
                r["foreign_profile"] = profile_text(lambda: variants["torch_cupy"](n // 4))
            r.update(bench_graphs(GraphMaker(pl, stream, raw), replays, rounds))
        finally:
            raw.close()
    return r, list(variants)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer launches and rounds")
    args = ap.parse_args(argv)
    if ck.device_count() == 0:
        print("bench_launch: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    n = 5_000 if args.quick else 20_000
    replays = 200 if args.quick else 1_000
    rounds = 3 if args.quick else 7
    r, names = measure(n, replays, rounds)
    r[QUICK] = args.quick
    print_table(r, n, rounds, names)
    if r.get("foreign_profile"):
        print(f"a launch with a torch tensor and a CuPy array (cProfile, {n // 4:,} launches):")
        print(r["foreign_profile"])
    return emit(verdicts(r))


if __name__ == "__main__":
    sys.exit(main())
