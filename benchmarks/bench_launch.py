"""Kernel launch overhead: ctxkit vs raw cuda.bindings vs CuPy, and CUDA graph replay.

    PYTHONPATH=. python3 benchmarks/bench_launch.py [--quick]

An empty kernel with a pointer and an int argument (``ptx/empty.cu``) is launched N
times on a non-blocking stream, then the stream is synchronized; the per-launch time
includes the final wait. Variants, interleaved round by round (best round kept):

* ``Kernel.launch``   -- checks and packs the arguments on every call
* ``PreparedLaunch``  -- arguments packed once
* raw cuda.bindings   -- ``cuLaunchKernel`` with a pre-built ``void**`` address (the
  cheapest raw form) and with the ``(values, types)`` tuple form
* CuPy ``RawKernel``  -- when CuPy is installed

Graph replay: 100 and 1000 empty kernels captured into one graph (ctxkit ``capture`` vs
raw ``cuStreamBeginCapture``), replayed R times after a warm-up; the steady-state time per
kernel node is reported for both, so the raw floor of the same run is always next to
ctxkit's. The first replay of a freshly instantiated graph is timed too, with and without
``cuGraphUpload`` (``Graph.upload``) beforehand: uploading moves work out of the first
launch, it cannot change the steady state.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.compiler import kernel_source
from ctxkit.module import capture

GRAPH_SIZES = (100, 1000)


def summary(name: str, value: float, unit: str, target: str, ok: bool) -> None:
    print(f"SUMMARY {name} {value:.2f}{unit} (target {target}) {'PASS' if ok else 'FAIL'}")


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

    def steady_us(self, nodes: int, replays: int, rounds: int) -> dict[str, float]:
        """Per-node microseconds of warm replays, ctxkit and raw interleaved."""
        graph = self.ck_graph(nodes)
        exe = self.raw.graph(nodes)
        try:
            t = best_round(
                {"ctxkit": ck_graph(graph, self.stream), "raw": self.raw.graph_replays(exe)},
                replays,
                rounds,
            )
        finally:
            drv.cuGraphExecDestroy(exe)
            graph.close()
        return {k: v / nodes for k, v in t.items()}


def bench_graphs(maker: GraphMaker, replays: int, rounds: int) -> dict[str, dict[str, float]]:
    """Steady-state and first-replay per-node times for every graph size."""
    out: dict[str, dict[str, float]] = {}
    for nodes in GRAPH_SIZES:
        reps = max(10, replays * GRAPH_SIZES[0] // nodes)
        out[f"{nodes} steady"] = maker.steady_us(nodes, reps, rounds)
        for upload in (False, True):
            label = f"{nodes} first{' after upload' if upload else ''}"
            out[label] = {k: maker.first_replay_us(k, nodes, upload) for k in ("ctxkit", "raw")}
    return out


def report_graphs(g: dict[str, dict[str, float]], rounds: int) -> None:
    print(
        "graphs of N empty kernels, us per node, ctxkit | raw (steady: best of "
        f"{rounds} rounds after a warm-up; first: median first replay of 3 fresh graphs):"
    )
    for label, v in g.items():
        print(f"  {label:24s} {v['ctxkit']:7.3f} | {v['raw']:7.3f}")
    steady = {k: v for k, v in g.items() if k.endswith("steady")}
    label = min(steady, key=lambda k: steady[k]["ctxkit"])
    best = steady[label]
    ok = best["ctxkit"] <= 0.6
    print(
        f"SUMMARY launch.graph_node_us {best['ctxkit']:.2f}us (target <= 0.60us; raw graph "
        f"{best['raw']:.2f}us; {label.split()[0]} nodes) {'PASS' if ok else 'FAIL'}"
    )
    print(f"SUMMARY launch.graph_node_vs_raw {best['ctxkit'] / best['raw']:.2f}x (info)")
    for nodes in GRAPH_SIZES:
        cold, up = g[f"{nodes} first"], g[f"{nodes} first after upload"]
        print(
            f"SUMMARY launch.graph_first_replay_{nodes}_us {cold['ctxkit']:.2f}us "
            f"(info; after upload {up['ctxkit']:.2f}us; raw {cold['raw']:.2f}us, "
            f"after upload {up['raw']:.2f}us)"
        )


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


def best_round(variants: dict[str, Callable[[int], None]], n: int, rounds: int) -> dict[str, float]:
    """Per-call microseconds, best of *rounds*, variants interleaved within each round."""
    best = dict.fromkeys(variants, float("inf"))
    for fn in variants.values():
        fn(min(n, 1000))  # warm-up
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(n)
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    return best


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
    ctx = ck.registry.context(0)
    with ctx:
        obj = ck.compile(kernel_source("empty.cu"), name="empty.cu", target="cubin")
        kernel = ck.Module.load(obj).function("empty")
        buf = ck.DeviceBuffer(256)
        stream = ck.Stream()
        pl = kernel.prepare(1, 32, buf, 1, stream=stream)
        raw = Raw(obj.code, buf.ptr)
        cupy_run, cupy_note = cupy_variant()
        variants: dict[str, Callable[[int], None]] = {
            "kernel_launch": ck_launches(kernel, buf, stream),
            "prepared": ck_prepared(pl, stream),
            "raw_address": raw.launches,
            "raw_tuple": raw.tuple_launches,
        }
        if cupy_run is not None:
            variants["cupy"] = cupy_run
        t = best_round(variants, n, rounds)
        g = bench_graphs(GraphMaker(pl, stream, raw), replays, rounds)
        raw.close()

    print(f"empty(void*, int) launch, {n} launches + sync, best of {rounds} rounds:")
    for name, us in t.items():
        print(f"  {name:14s} {us:6.2f} us/launch")
    print(f"  ({cupy_note})")

    if "cupy" in t:
        r = t["prepared"] / t["cupy"]
        summary("launch.prepared_vs_cupy", r, "x", "<= 1.00x", r <= 1.0)
        r = t["kernel_launch"] / t["cupy"]
        summary("launch.kernel_launch_vs_cupy", r, "x", "<= 1.50x", r <= 1.5)
    else:
        print(f"SUMMARY launch.prepared_vs_cupy n/a ({cupy_note})")
        print(f"SUMMARY launch.kernel_launch_vs_cupy n/a ({cupy_note})")
    print(f"SUMMARY launch.prepared_vs_raw {t['prepared'] / t['raw_address']:.2f}x (info)")
    report_graphs(g, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
