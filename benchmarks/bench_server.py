"""A many-threaded server: requests per second through ctxkit, raw cuda.bindings and CuPy.

    PYTHONPATH=. python3 benchmarks/bench_server.py [--quick] [--threads 8] [--requests N]
                                                    [--bytes 65536] [--rounds N]

A request is what a small inference server does per call: a float32 array (``--bytes``,
64 KiB by default) in pinned host memory is copied host-to-device on the serving thread's
own stream, a kernel computes ``y = 2*x + 1``, the result is copied device-to-host into
pinned memory, and the thread synchronizes its stream. Before each request the thread
writes the request number into ``x[0]`` (the request's new data). Each of ``--threads``
threads (8) serves ``--requests`` requests (2,000; 200 with ``--quick``) one after another;
requests/s = threads x requests / wall time, from a barrier all threads pass after their
set-up until the last thread has finished. Each side does the same work with its own
library's idiomatic calls, everything but the requests made before the barrier:

* ctxkit: ``ContextExecutor`` workers (the context current for their life), per worker a
  ``ck.Stream``, ``ck.pinned_empty`` arrays, ``ck.DeviceBuffer`` s and
  ``Kernel.prepare``; a request is ``copy_from_host(x, stream=s)``, the prepared launch,
  ``copy_to_host(y, stream=s)``, ``s.synchronize()``; the kernel from ``ck.compile``;
* raw cuda.bindings: threads that push the primary context once, ``cuStreamCreate``,
  ``cuMemHostAlloc``, ``cuMemAlloc``, kernel arguments packed once; a request is
  ``cuMemcpyHtoDAsync``, ``cuLaunchKernel``, ``cuMemcpyDtoHAsync``,
  ``cuStreamSynchronize``, every CUresult checked; the kernel compiled with NVRTC
  (``cuda.bindings.nvrtc``, a cubin for the device) and loaded with ``cuModuleLoadData``;
* ctxkit, graph: the same workers, each capturing its request (the two copies and the
  launch) once with ``ck.capture`` and replaying it per request (``graph.launch(s)``,
  ``s.synchronize()``): INFO lines against raw and CuPy;
* CuPy: threads with ``cp.cuda.Stream(non_blocking=True)`` current, ``cupyx.empty_pinned``
  arrays, ``cp.empty`` device arrays; a request is ``d.set(x, stream=s)``, the
  ``cp.RawKernel`` call, ``d.get(out=y, stream=s, blocking=False)``, ``s.synchronize()``.

The 1-thread rate of each side is measured too (how far 8 threads scale). All six
measurements are interleaved round by round (the order of the sides rotates each round),
after a warm-up round that is not kept. Every thread checks its last response against
``2*x + 1`` (numpy) before the numbers are used: a wrong response fails the side's CHECK
line and leaves its rate out (``n/a``). Targets: ctxkit's 8-thread rate at least 1.0x
CuPy's, decided on the median of the per-round ratios (each round's ctxkit rate over the
same round's CuPy rate), the best round beside it; the rates and ctxkit/raw are
information.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np
from bench_context import Gate
from verdictlines import (
    QUICK,
    Line,
    check,
    emit,
    info,
    median,
    median_info,
    median_target,
    missing_baseline,
    skipped,
    target,
)

import ctxkit as ck
from ctxkit._driver import drv

SOURCE = r"""
extern "C" __global__ void affine(const float* x, float* y, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = 2.0f * x[i] + 1.0f;
    }
}
"""
KERNEL = "affine"
BLOCK = 256
SIDES = ("ctxkit", "ctxkit_graph", "raw", "cupy")
STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING
HOST_ALLOC_PORTABLE = 1  # CU_MEMHOSTALLOC_PORTABLE, as ck.pinned_empty allocates
WARMUP_REQUESTS = 50


class Side(Protocol):
    """One library's server: :meth:`spawn` starts a serving thread, :meth:`serve` is its
    body (set-up, the timed requests between the gate's start and finish, tear-down);
    it returns whether the last response was right."""

    name: str

    def spawn(self, fn: Callable[[], bool]) -> Future[bool]: ...

    def serve(self, gate: Gate, requests: int) -> bool: ...

    def close(self) -> None: ...


def in_thread(fn: Callable[[], bool]) -> Future[bool]:
    """Run *fn* in a new thread; its result or exception in the returned future."""
    fut: Future[bool] = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=run, name="bench-server", daemon=True).start()
    return fut


def request_input(n: int) -> np.ndarray:
    """The input every thread starts from (small integers: ``2x + 1`` is exact)."""
    return (np.arange(n, dtype=np.float32) % 1000).astype(np.float32)


def fill(x: np.ndarray, y: np.ndarray) -> None:
    """Set up a thread's pinned arrays: the input, and an output no request produces."""
    x[...] = request_input(x.size)
    y[...] = np.nan


def response_ok(y: np.ndarray, requests: int) -> bool:
    """Whether *y* is the response to the last of *requests* requests (``x[0]`` was its
    request number)."""
    want = request_input(y.size)
    want[0] = requests - 1
    return bool(np.array_equal(y, 2 * want + 1))


def grid_for(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


# --- ctxkit ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Worker:
    """What one ctxkit serving thread made before the clock: its stream, pinned input and
    output, device buffers and prepared launch."""

    stream: ck.Stream
    x: np.ndarray
    y: np.ndarray
    d_in: ck.DeviceBuffer
    d_out: ck.DeviceBuffer
    launch: ck.PreparedLaunch


class CtxkitSide:
    """Serving threads are ``ContextExecutor`` workers of device 0's shared context."""

    name = "ctxkit"

    def __init__(self, nbytes: int, threads: int) -> None:
        self.nbytes = nbytes
        self.ctx = ck.registry.context(0)
        with self.ctx:
            obj = ck.compile(SOURCE, name="bench_server.cu")
        self.kernel = ck.Module.load(obj).function(KERNEL)
        self.pool = ck.ContextExecutor(self.ctx, max_workers=threads)

    def spawn(self, fn: Callable[[], bool]) -> Future[bool]:
        return self.pool.submit(fn)

    def serve(self, gate: Gate, requests: int) -> bool:
        n = self.nbytes // 4
        s = ck.Stream()
        x, y = ck.pinned_empty(n, np.float32), ck.pinned_empty(n, np.float32)
        d_in, d_out = ck.DeviceBuffer(self.nbytes), ck.DeviceBuffer(self.nbytes)
        try:
            fill(x, y)
            launch = self.kernel.prepare(grid_for(n), BLOCK, d_in, d_out, n, stream=s)
            self.requests(gate, requests, Worker(s, x, y, d_in, d_out, launch))
            return response_ok(y, requests)
        finally:
            with contextlib.suppress(ck.CudaError):  # a failed request may leave copies in flight
                s.synchronize()
            d_in.close()
            d_out.close()
            s.close()

    def requests(self, gate: Gate, requests: int, w: Worker) -> None:
        """The timed requests of one serving thread."""
        s, x, y, d_in, d_out, launch = w.stream, w.x, w.y, w.d_in, w.d_out, w.launch
        gate.start()
        for i in range(requests):
            x[0] = i
            d_in.copy_from_host(x, stream=s)
            launch()
            d_out.copy_to_host(y, stream=s)
            s.synchronize()
        gate.finish()

    def close(self) -> None:
        self.pool.shutdown()


class CtxkitGraphSide(CtxkitSide):
    """ctxkit with each worker's request captured once into a graph (``ck.capture``)
    and replayed per request: one ``cuGraphLaunch`` instead of three driver calls, so
    the threads queue for the GIL around two calls a request instead of four."""

    name = "ctxkit_graph"

    def requests(self, gate: Gate, requests: int, w: Worker) -> None:
        """Capture the request once (untimed), then replay it per request."""
        s, x = w.stream, w.x
        with ck.capture(s) as graph:
            w.d_in.copy_from_host(x, stream=s)
            w.launch()
            w.d_out.copy_to_host(w.y, stream=s)
        gate.start()
        for i in range(requests):
            x[0] = i
            graph.launch(s)
            s.synchronize()
        gate.finish()


# --- raw cuda.bindings ------------------------------------------------------------------


def _check(res: Any, what: str) -> Any:
    """The value of a cuda.bindings result tuple; RuntimeError on a failed call."""
    if int(res[0]):
        raise RuntimeError(f"{what} failed: {res[0]!r}")
    return None if len(res) == 1 else res[1] if len(res) == 2 else res[1:]


def nvrtc_cubin(source: str, arch: str) -> bytes:
    """*source* compiled by NVRTC (``cuda.bindings.nvrtc``) into a cubin for *arch*
    (``"sm_90"``); RuntimeError with the log when it does not compile."""
    from cuda.bindings import nvrtc

    def ok(res: Any, what: str) -> Any:
        if int(res[0]):
            raise RuntimeError(f"{what} failed: {res[0]!r}")
        return res[1] if len(res) > 1 else None

    prog = ok(nvrtc.nvrtcCreateProgram(source.encode(), b"bench_server.cu", 0, [], []), "create")
    try:
        opts = [f"--gpu-architecture={arch}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err):
            log = b" " * ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            ok(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            raise RuntimeError(f"nvrtcCompileProgram failed: {err!r}\n{log.decode()}")
        cubin = b" " * ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def device_arch(dev: Any) -> str:
    """``"sm_<major><minor>"`` of the raw device handle *dev*."""
    attr = drv.CUdevice_attribute
    major = _check(
        drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cc"
    )
    minor = _check(
        drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cc"
    )
    return f"sm_{major}{minor}"


def host_view(ptr: int, n: int) -> np.ndarray:
    """A float32 numpy array over *n* elements of host memory at *ptr*."""
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(ptr))


class RawSide:
    """Plain threads on the retained primary context, every call checked."""

    name = "raw"

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.dev = _check(drv.cuDeviceGet(0), "cuDeviceGet")
        self.ctx = _check(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        cubin = nvrtc_cubin(SOURCE, device_arch(self.dev))
        _check(drv.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            self.mod = _check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
            self.fn = _check(drv.cuModuleGetFunction(self.mod, KERNEL.encode()), "function")
        finally:
            _check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")

    spawn = staticmethod(in_thread)

    def serve(self, gate: Gate, requests: int) -> bool:
        _check(drv.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            return self._serve(gate, requests)
        finally:
            _check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def _serve(self, gate: Gate, requests: int) -> bool:
        nbytes, n = self.nbytes, self.nbytes // 4
        stream = _check(drv.cuStreamCreate(STREAM_NON_BLOCKING), "cuStreamCreate")
        h_in = _check(drv.cuMemHostAlloc(nbytes, HOST_ALLOC_PORTABLE), "cuMemHostAlloc")
        h_out = _check(drv.cuMemHostAlloc(nbytes, HOST_ALLOC_PORTABLE), "cuMemHostAlloc")
        d_in = _check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
        d_out = _check(drv.cuMemAlloc(nbytes), "cuMemAlloc")
        try:
            x, y = host_view(int(h_in), n), host_view(int(h_out), n)
            fill(x, y)
            cells = (ctypes.c_void_p(int(d_in)), ctypes.c_void_p(int(d_out)), ctypes.c_int(n))
            params = (ctypes.c_void_p * 3)(*(ctypes.addressof(c) for c in cells))
            self._requests(gate, requests, x, stream, (h_in, h_out, d_in, d_out), params)
            return response_ok(y, requests)
        finally:
            drv.cuStreamSynchronize(stream)  # a failed request may leave copies in flight
            for call, arg in ((drv.cuMemFree, d_in), (drv.cuMemFree, d_out),
                              (drv.cuMemFreeHost, h_in), (drv.cuMemFreeHost, h_out),
                              (drv.cuStreamDestroy, stream)):  # fmt: skip
                _check(call(arg), call.__name__)

    def _requests(
        self,
        gate: Gate,
        requests: int,
        x: np.ndarray,
        stream: Any,
        mem: tuple[Any, ...],
        params: Any,
    ) -> None:
        """The timed requests; *x* is the input array over *mem*'s pinned ``h_in``,
        *params* the packed kernel arguments (kept alive by the caller)."""
        h_in, h_out, d_in, d_out = mem
        nbytes, fn, grid = self.nbytes, self.fn, grid_for(self.nbytes // 4)
        addr = ctypes.addressof(params)
        htod, dtoh = drv.cuMemcpyHtoDAsync, drv.cuMemcpyDtoHAsync
        launch, sync = drv.cuLaunchKernel, drv.cuStreamSynchronize
        gate.start()
        for i in range(requests):
            x[0] = i
            (err,) = htod(d_in, h_in, nbytes, stream)
            if err:
                raise RuntimeError(f"cuMemcpyHtoDAsync failed: {err!r}")
            (err,) = launch(fn, grid, 1, 1, BLOCK, 1, 1, 0, stream, addr, 0)
            if err:
                raise RuntimeError(f"cuLaunchKernel failed: {err!r}")
            (err,) = dtoh(h_out, d_out, nbytes, stream)
            if err:
                raise RuntimeError(f"cuMemcpyDtoHAsync failed: {err!r}")
            (err,) = sync(stream)
            if err:
                raise RuntimeError(f"cuStreamSynchronize failed: {err!r}")
        gate.finish()

    def close(self) -> None:
        _check(drv.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            _check(drv.cuModuleUnload(self.mod), "cuModuleUnload")
        finally:
            _check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")
        _check(drv.cuDevicePrimaryCtxRelease(self.dev), "cuDevicePrimaryCtxRelease")


# --- CuPy -------------------------------------------------------------------------------


class CupySide:
    """Plain threads, each with its own non-blocking CuPy stream current."""

    name = "cupy"

    def __init__(self, nbytes: int, cp: Any, cupyx: Any) -> None:
        self.nbytes, self.cp, self.cupyx = nbytes, cp, cupyx
        with cp.cuda.Device(0):
            self.kernel = cp.RawKernel(SOURCE, KERNEL)
            self.kernel.compile()

    spawn = staticmethod(in_thread)

    def serve(self, gate: Gate, requests: int) -> bool:
        cp, n = self.cp, self.nbytes // 4
        with cp.cuda.Device(0):
            s = cp.cuda.Stream(non_blocking=True)
            x = self.cupyx.empty_pinned((n,), dtype=np.float32)
            y = self.cupyx.empty_pinned((n,), dtype=np.float32)
            d_in, d_out = cp.empty(n, dtype=cp.float32), cp.empty(n, dtype=cp.float32)
            fill(x, y)
            kernel, grid, args = self.kernel, (grid_for(n),), (d_in, d_out, np.int32(n))
            with s:
                gate.start()
                for i in range(requests):
                    x[0] = i
                    d_in.set(x, stream=s)
                    kernel(grid, (BLOCK,), args, stream=s)
                    d_out.get(out=y, stream=s, blocking=False)
                    s.synchronize()
                gate.finish()
            return response_ok(y, requests)

    def close(self) -> None:
        return None


def cupy_side(nbytes: int) -> tuple[CupySide | None, str]:
    """The CuPy side, or None and why it cannot run here."""
    try:
        import cupy as cp
        import cupyx
    except Exception as exc:
        return None, f"CuPy is not installed ({type(exc).__name__})"
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no CUDA device"
        return CupySide(nbytes, cp, cupyx), f"CuPy {cp.__version__}"
    except Exception as exc:
        return None, f"CuPy could not run: {type(exc).__name__}: {exc}"


# --- measuring ----------------------------------------------------------------------------


def rate(side: Side, threads: int, requests: int) -> tuple[float, int]:
    """``(requests/s, wrong responses)`` of *threads* serving threads of *side*, each
    serving *requests* requests; a thread's error is raised here."""
    gate = Gate(threads)

    def body() -> bool:
        try:
            return side.serve(gate, requests)
        except BaseException:
            gate.abort()  # the others wait at the barrier: let them go
            raise

    futures = [side.spawn(body) for _ in range(threads)]
    results, errors = [], []
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (first or errors)[0]
    return threads * requests / gate.seconds(), results.count(False)


def measure(sides: list[Side], threads: int, requests: int, rounds: int) -> dict[str, Any]:
    """Per side, ``<side>_many`` / ``<side>_one``: requests/s of *threads* threads and of
    one thread per round, ``<side>_wrong`` / ``<side>_checked``: wrong responses and
    responses checked. The sides take turns in every round (rotating who goes first);
    a warm-up round comes first, not kept."""
    r: dict[str, Any] = {}
    for side in sides:
        for n in (threads, 1):
            rate(side, n, min(requests, WARMUP_REQUESTS))
        r.update({f"{side.name}_many": [], f"{side.name}_one": []})
        r.update({f"{side.name}_wrong": 0, f"{side.name}_checked": 0})
    for i in range(rounds):
        for side in sides[i % len(sides) :] + sides[: i % len(sides)]:
            for key, n in (("many", threads), ("one", 1)):
                rps, wrong = rate(side, n, requests)
                r[f"{side.name}_{key}"].append(rps)
                r[f"{side.name}_wrong"] += wrong
                r[f"{side.name}_checked"] += n
    return r


# --- verdicts -------------------------------------------------------------------------------


def ratios(a: list[float], b: list[float]) -> list[float]:
    """Round-by-round ``a / b``."""
    return [x / y for x, y in zip(a, b) if y > 0]


def measured(r: dict[str, Any], side: str) -> bool:
    return f"{side}_many" in r


def right(r: dict[str, Any], side: str) -> bool:
    """Measured, and every response checked was right."""
    return measured(r, side) and r[f"{side}_wrong"] == 0


def verdicts(r: dict[str, Any]) -> list[Line]:
    """The lines of this benchmark from its measurements (pure: no GPU). *r* holds what
    :func:`measure` returns plus ``threads``, ``requests``, ``nbytes``, ``cupy_note`` and
    :data:`~verdictlines.QUICK`."""
    threads, what = r["threads"], f"{r['threads']} threads x {r['requests']} requests"
    what += f" of {r['nbytes'] // 1024} KiB"
    lines = [
        check(
            f"server.{side}_results",
            float(r[f"{side}_wrong"]),
            "<=",
            0.0,
            what=f"wrong responses among {r[f'{side}_checked']} checked (each thread's last "
            "request, every round, against 2x+1)",
        )
        for side in SIDES
        if measured(r, side)
    ]
    for side in SIDES:
        lines += rate_lines(r, side, what)
    ck_many = r["ctxkit_many"] if right(r, "ctxkit") else None
    per_round = "median of per-round ratios"
    name = "server.ctxkit_vs_cupy"
    if not measured(r, "cupy"):
        lines.append(missing_baseline(r, name, ">=", 1.0, "x", r.get("cupy_note", "no CuPy")))
    elif ck_many is None or not right(r, "cupy"):
        lines.append(target(name, None, ">=", 1.0, "x", "a side gave wrong responses"))
    else:
        lines.append(
            median_target(
                name, ratios(ck_many, r["cupy_many"]), ">=", 1.0, "x",
                f"{threads} threads: requests/s through ctxkit / through CuPy; {per_round}",
            )
        )  # fmt: skip
    lines += graph_lines(r, per_round)
    name = "server.ctxkit_vs_raw"
    if ck_many is None or not right(r, "raw"):
        lines.append(info(name, None, "x", "a side gave wrong responses"))
    else:
        lines.append(
            median_info(
                name, ratios(ck_many, r["raw_many"]), "x",
                f"{threads} threads: requests/s through ctxkit / through raw cuda.bindings; "
                f"{per_round}",
            )
        )  # fmt: skip
    return lines


def graph_lines(r: dict[str, Any], per_round: str) -> list[Line]:
    """INFO: requests replayed as captured graphs vs raw and CuPy per-call requests (does
    handing a request to one driver call go past the raw floor)."""
    lines: list[Line] = []
    if not measured(r, "ctxkit_graph"):
        return lines
    for other, who in (("raw", "raw cuda.bindings"), ("cupy", "CuPy")):
        name = f"server.ctxkit_graph_vs_{other}"
        if not measured(r, other):
            continue
        if not (right(r, "ctxkit_graph") and right(r, other)):
            lines.append(info(name, None, "x", "a side gave wrong responses"))
            continue
        ratio = ratios(r["ctxkit_graph_many"], r[f"{other}_many"])
        what = f"{r['threads']} threads: a captured request replayed / {who}; {per_round}"
        lines.append(median_info(name, ratio, "x", what))
    return lines


def rate_lines(r: dict[str, Any], side: str, what: str) -> list[Line]:
    """``server.<side>_rps`` and ``server.<side>_rps_1thread``."""
    names = (f"server.{side}_rps", f"server.{side}_rps_1thread")
    if not measured(r, side):
        return [skipped(name, r.get(f"{side}_note", "not measured")) for name in names]
    if not right(r, side):
        return [info(name, None, "req/s", "wrong responses: no rate") for name in names]
    one_what = f"1 thread x {r['requests']} requests"
    return [
        median_info(names[0], r[f"{side}_many"], "req/s", what),
        median_info(names[1], r[f"{side}_one"], "req/s", one_what),
    ]


def print_table(r: dict[str, Any]) -> None:
    threads = r["threads"]
    print(
        f"requests/s, median of rounds ({threads} threads x {r['requests']} requests of "
        f"{r['nbytes'] // 1024} KiB): {threads} threads | 1 thread | scaling"
    )
    for side in SIDES:
        if not measured(r, side):
            print(f"  {side:12s} not measured: {r.get(f'{side}_note', '')}")
            continue
        many, one = median(r[f"{side}_many"]), median(r[f"{side}_one"])
        bad = "" if right(r, side) else f"  ({r[f'{side}_wrong']} WRONG responses)"
        print(f"  {side:12s} {many:12,.0f} | {one:10,.0f} | {many / one:5.2f}x{bad}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    ap.add_argument("--threads", type=int, default=8, help="serving threads (8)")
    ap.add_argument("--requests", type=int, help="requests per thread (2000; quick 200)")
    ap.add_argument("--bytes", type=int, default=64 << 10, help="request size (64 KiB)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (7; quick 3)")
    args = ap.parse_args(argv)
    if args.threads < 1 or args.bytes < 4 or args.bytes % 4:
        ap.error("--threads must be >= 1 and --bytes a positive multiple of 4")
    if ck.device_count() == 0:
        print("bench_server: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    requests = args.requests or (200 if args.quick else 2000)
    rounds = args.rounds or (3 if args.quick else 7)
    cupy, note = cupy_side(args.bytes)
    sides: list[Side] = [
        CtxkitSide(args.bytes, args.threads),
        CtxkitGraphSide(args.bytes, args.threads),
        RawSide(args.bytes),
    ]
    if cupy is not None:
        sides.append(cupy)
    try:
        r = measure(sides, args.threads, requests, rounds)
    finally:
        for side in sides:
            side.close()
    r.update(threads=args.threads, requests=requests, nbytes=args.bytes, cupy_note=note)
    r[QUICK] = args.quick
    print_table(r)
    return emit(verdicts(r))


if __name__ == "__main__":
    sys.exit(main())
