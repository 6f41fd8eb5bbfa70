"""Green contexts: a latency-critical kernel beside a saturating one, with and without SM
partitions, through ctxkit and through raw cuda.bindings green contexts.

    PYTHONPATH=. python3 benchmarks/bench_green.py [--quick]

The latency of a 1-block kernel (launch to ``cuStreamSynchronize`` returning, timed on
the host) is measured in one run

* idle: alone on the device (primary context);
* unpartitioned: on a second stream of the same (primary) context, launched 1 ms after a
  heavy kernel: multi-wave, 8 blocks of 1024 threads per SM, 48 KiB dynamic shared memory
  each, every block spinning ~2 ms (~8 ms in all on an H200); the small kernel waits for
  the heavy one's blocks to drain;
* partitioned: in a 16-SM green context, launched 1 ms after the same heavy kernel
  (8 blocks per SM of the partition) saturating the remaining SMs (a 116-SM green context
  on a 132-SM H200);

each through ctxkit (``Device.partition([16])``, ``Stream(context=green)``, a prepared
launch) and through raw cuda.bindings (``cuDevSmResourceSplitByCount``,
``cuGreenCtxCreate``, ``cuGreenCtxStreamCreate``, ``cuLaunchKernel``), interleaved round
by round, the side that goes first alternating (a launch right after another side's heavy
kernel has finished is slower). The latency of one launch spreads widely (on an H200 the
middle half of the rounds spans 16-30 us), so the ctxkit/raw ratio is decided on the
median of 300 per-round ratios. Targets: partitioned latency at most 3x idle and at least
50x better than unpartitioned; ctxkit's partitioned latency within 1.2x of raw's.
Reference (raw, H200, measured when green contexts were added): idle 15 us, same context
beside the heavy kernel 5,005 us, 16-SM partition beside the saturated 116-SM partition
31 us.

Also reported (information): ``Pipeline.map`` throughput over 2 green lanes (a
``partition([64])``) against 1 lane of the primary context, pinned arrays.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from verdictlines import QUICK, Line, emit, median, median_info, median_target

import ctxkit as ck
from ctxkit._driver import drv
from ctxkit.compiler import kernel_source

SOURCE = r"""
extern "C" __global__ void tiny(int* flag)
{
    if (threadIdx.x == 0) {
        flag[0] += 1;
    }
}

extern "C" __global__ void heavy(unsigned long long cycles, int* flag)
{
    extern __shared__ int smem[];
    const long long start = clock64();
    smem[threadIdx.x] = threadIdx.x;
    while ((unsigned long long)(clock64() - start) < cycles) {
    }
    if (smem[threadIdx.x] != (int)threadIdx.x) {
        flag[1] = 1;
    }
}
"""
PARTITION_SMS = 16
BLOCKS_PER_SM = 8
HEAVY_THREADS = 1024
HEAVY_SHARED = 48 << 10
BLOCK_SECONDS = 2e-3  # each heavy block spins this long
HEAD_START_S = 1e-3  # the small kernel is launched this long after the heavy one
REFERENCE_US = {"idle": 15.0, "same": 5005.0, "partitioned": 31.0}
SM = "CU_DEV_RESOURCE_TYPE_SM"


def _check(res: Any, what: str) -> Any:
    if int(res[0]):
        raise RuntimeError(f"{what} failed: {res[0]!r}")
    return None if len(res) == 1 else res[1] if len(res) == 2 else res[1:]


def spin_cycles() -> int:
    """Clock ticks of :data:`BLOCK_SECONDS` at the device's clock rate."""
    try:  # deprecated in CUDA 13: an H200's 1.98 GHz where a driver no longer says
        khz = ck.Device(0).attribute("clock_rate") or 1_980_000
    except (ValueError, ck.CudaError):
        khz = 1_980_000
    return max(1, int(BLOCK_SECONDS * khz * 1e3))


class Lane:
    """One side of a measurement: how to launch its kernel, and how to wait for it.
    ``enter``/``leave`` bracket the timed part (make the lane's context current)."""

    def __init__(
        self,
        launch: Callable[[], None],
        wait: Callable[[], None],
        enter: Callable[[], None],
        leave: Callable[[], None],
    ) -> None:
        self.launch, self.wait, self.enter, self.leave = launch, wait, enter, leave


def latency_us(tiny: Lane, heavy: Lane | None, rounds: int) -> list[float]:
    """Per round: the heavy kernel (if any), then after :data:`HEAD_START_S` the tiny one;
    its launch-to-completion time in microseconds."""
    out = []
    for _ in range(rounds):
        if heavy is not None:
            heavy.enter()
            heavy.launch()
            heavy.leave()
            time.sleep(HEAD_START_S)
        tiny.enter()
        t0 = time.perf_counter()
        tiny.launch()
        tiny.wait()
        out.append((time.perf_counter() - t0) * 1e6)
        tiny.leave()
        if heavy is not None:
            heavy.enter()
            heavy.wait()
            heavy.leave()
    return out


class CkSide:
    """The three cases through ctxkit."""

    def __init__(self, code: Any, cycles: int) -> None:
        self.prim = ck.Context.primary(0)
        self.parts = ck.Device(0).partition([PARTITION_SMS])
        self.cycles = cycles
        with self.prim:
            mod = ck.Module.load(code)
        self.tiny_k, self.heavy_k = mod.function("tiny"), mod.function("heavy")

    def tiny(self, ctx: ck.Context) -> Lane:
        s = ck.Stream(context=ctx)
        flag = ck.DeviceBuffer(8, context=ctx)
        with ctx:
            pl = self.tiny_k.prepare(1, 32, flag, stream=s)
        return Lane(pl, s.synchronize, ctx.__enter__, lambda: ctx.__exit__(None, None, None))

    def heavy(self, ctx: ck.Context) -> Lane:
        s = ck.Stream(context=ctx)
        flag = ck.DeviceBuffer(8, context=ctx)
        grid = BLOCKS_PER_SM * ctx.sm_count
        k, cycles = self.heavy_k, self.cycles

        def launch() -> None:
            k.launch(grid, HEAVY_THREADS, cycles, flag, stream=s, shared_mem=HEAVY_SHARED)

        return Lane(launch, s.synchronize, ctx.__enter__, lambda: ctx.__exit__(None, None, None))

    def cases(self) -> dict[str, tuple[Lane, Lane | None]]:
        small, rest = self.parts
        return {
            "idle": (self.tiny(self.prim), None),
            "same": (self.tiny(self.prim), self.heavy(self.prim)),
            "partitioned": (self.tiny(small), self.heavy(rest)),
        }

    def close(self) -> None:
        for p in self.parts:
            p.close()


class RawSide:
    """The same cases through raw cuda.bindings green contexts."""

    def __init__(self, cubin: bytes, cycles: int) -> None:
        self.dev = _check(drv.cuDeviceGet(0), "cuDeviceGet")
        self.prim = _check(drv.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        kind = getattr(drv.CUdevResourceType, SM)
        res = _check(drv.cuDeviceGetDevResource(self.dev, kind), "cuDeviceGetDevResource")
        groups, _n, rest = _check(
            drv.cuDevSmResourceSplitByCount(1, res, 0, PARTITION_SMS), "split"
        )
        flags = drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        self.greens = []
        self.ctxs: dict[str, tuple[Any, Any, int]] = {}  # name -> (CUcontext, green, SMs)
        for name, r in (("small", groups[0]), ("rest", rest)):
            desc = _check(drv.cuDevResourceGenerateDesc([r], 1), "cuDevResourceGenerateDesc")
            green = _check(drv.cuGreenCtxCreate(desc, self.dev, flags), "cuGreenCtxCreate")
            cu = _check(drv.cuCtxFromGreenCtx(green), "cuCtxFromGreenCtx")
            self.greens.append(green)
            self.ctxs[name] = (cu, green, int(r.sm.smCount))
        total = ck.Device(0).multiprocessor_count
        self.ctxs["prim"] = (self.prim, None, total)
        self.cubin, self.cycles = cubin, cycles
        self.modules: list[tuple[Any, Any]] = []
        self.streams: list[tuple[Any, Any]] = []
        self.flags: list[tuple[Any, Any]] = []
        self.keep: list[Any] = []

    def _in(self, cu: Any) -> tuple[Callable[[], None], Callable[[], None]]:
        return (lambda: drv.cuCtxPushCurrent(cu)), (lambda: drv.cuCtxPopCurrent())

    def _setup(self, name: str, entry: bytes) -> tuple[Any, Any, Any, int]:
        cu, green, sms = self.ctxs[name]
        _check(drv.cuCtxPushCurrent(cu), "cuCtxPushCurrent")
        try:
            mod = _check(drv.cuModuleLoadData(self.cubin), "cuModuleLoadData")
            fn = _check(drv.cuModuleGetFunction(mod, entry), "cuModuleGetFunction")
            if green is None:
                s = _check(drv.cuStreamCreate(1), "cuStreamCreate")
            else:
                s = _check(drv.cuGreenCtxStreamCreate(green, 1, 0), "cuGreenCtxStreamCreate")
            flag = _check(drv.cuMemAlloc(8), "cuMemAlloc")
        finally:
            drv.cuCtxPopCurrent()
        self.modules.append((cu, mod))
        self.streams.append((cu, s))
        self.flags.append((cu, flag))
        return fn, s, flag, sms

    def _args(self, *values: Any) -> int:
        """The address of a ``void**`` over ctypes copies of *values* (kept alive)."""
        cells = [v if isinstance(v, ctypes._SimpleCData) else ctypes.c_void_p(v) for v in values]
        ptrs = (ctypes.c_void_p * len(cells))(*(ctypes.addressof(c) for c in cells))
        self.keep += [cells, ptrs]
        return ctypes.addressof(ptrs)

    def tiny(self, name: str) -> Lane:
        fn, s, flag, _ = self._setup(name, b"tiny")
        addr = self._args(int(flag))
        launch = drv.cuLaunchKernel

        def run() -> None:
            (err,) = launch(fn, 1, 1, 1, 32, 1, 1, 0, s, addr, 0)
            if err:
                raise RuntimeError(err)

        enter, leave = self._in(self.ctxs[name][0])
        return Lane(run, lambda: _check(drv.cuStreamSynchronize(s), "sync"), enter, leave)

    def heavy(self, name: str) -> Lane:
        fn, s, flag, sms = self._setup(name, b"heavy")
        addr = self._args(ctypes.c_uint64(self.cycles), int(flag))
        grid = BLOCKS_PER_SM * sms

        def run() -> None:
            (err,) = drv.cuLaunchKernel(
                fn, grid, 1, 1, HEAVY_THREADS, 1, 1, HEAVY_SHARED, s, addr, 0
            )
            if err:
                raise RuntimeError(err)

        enter, leave = self._in(self.ctxs[name][0])
        return Lane(run, lambda: _check(drv.cuStreamSynchronize(s), "sync"), enter, leave)

    def cases(self) -> dict[str, tuple[Lane, Lane | None]]:
        return {
            "idle": (self.tiny("prim"), None),
            "same": (self.tiny("prim"), self.heavy("prim")),
            "partitioned": (self.tiny("small"), self.heavy("rest")),
        }

    def close(self) -> None:
        for _cu, s in self.streams:
            drv.cuStreamDestroy(s)
        for (cu, mod), (_, flag) in zip(self.modules, self.flags, strict=True):
            drv.cuCtxPushCurrent(cu)
            drv.cuMemFree(flag)
            drv.cuModuleUnload(mod)
            drv.cuCtxPopCurrent()
        for green in self.greens:
            drv.cuGreenCtxDestroy(green)
        drv.cuDevicePrimaryCtxRelease(self.dev)


def measure_latency(rounds: int) -> dict[str, list[float]]:
    """``{"<side>_<case>": [us per round]}`` for both sides and the three cases,
    interleaved round by round, the first side alternating (one warm-up round first, not
    kept)."""
    prim = ck.Context.primary(0)
    with prim:
        code = ck.compile(SOURCE, name="green_bench.cu", target="cubin")
    cycles = spin_cycles()
    sides = {"ctxkit": CkSide(code, cycles), "raw": RawSide(code.code, cycles)}
    r: dict[str, list[float]] = {}
    try:
        cases = {name: side.cases() for name, side in sides.items()}
        order = list(cases.items())
        for i in range(rounds + 1):
            for side, by_case in order if i % 2 else order[::-1]:
                for case, (tiny, heavy) in by_case.items():
                    got = latency_us(tiny, heavy, 1)
                    if i:
                        r.setdefault(f"{side}_{case}", []).extend(got)
    finally:
        for side in sides.values():
            side.close()
    return r


def measure_pipeline(nbytes: int, rounds: int) -> dict[str, list[float]]:
    """GB/s of ``Pipeline.map`` (scale_f32, pinned in and out) over 1 primary lane and
    over 2 green lanes (``partition([64])``), interleaved."""
    n = nbytes // 4
    prim = ck.Context.primary(0)
    with prim:
        mod = ck.Module.load(ck.compile(kernel_source("scale.cu"), name="scale.cu"))
    kernel = mod.function("scale_f32")
    x = ck.pinned_empty(n, np.float32, context=prim)
    x[...] = np.arange(n, dtype=np.float32) % 1000
    out = ck.pinned_empty(n, np.float32, context=prim)
    lanes = ck.Device(0).partition([64])
    r: dict[str, list[float]] = {"pipeline_primary": [], "pipeline_green2": []}
    try:
        with ck.Pipeline([prim]) as one, ck.Pipeline(lanes) as two:
            for i in range(rounds + 1):
                for key, p in (("pipeline_primary", one), ("pipeline_green2", two)):
                    t0 = time.perf_counter()
                    p.map(kernel, x, out, args=(2.0,))
                    if i:
                        r[key].append(nbytes / (time.perf_counter() - t0) / 1e9)
            if not np.array_equal(out[: min(n, 1 << 20)], x[: min(n, 1 << 20)] * 2):
                raise AssertionError("Pipeline over green lanes gave wrong results")
    finally:
        for c in lanes:
            c.close()
    return r


def ratios(a: list[float], b: list[float]) -> list[float]:
    """Round-by-round ``a / b``."""
    return [x / y for x, y in zip(a, b, strict=False) if y > 0]


def verdicts(r: dict[str, Any]) -> list[Line]:
    lines = []
    for side in ("ctxkit", "raw"):
        for case in ("idle", "same", "partitioned"):
            ref = f"reference (raw, H200): {REFERENCE_US[case]:g} us"
            vals = r[f"{side}_{case}"]
            lines.append(median_info(f"green.{side}_{case}_us", vals, "us", ref, higher=False))
    ck_part, ck_idle, ck_same = (r[f"ctxkit_{c}"] for c in ("partitioned", "idle", "same"))
    lines += [
        median_target(
            "green.partitioned_vs_idle",
            ratios(ck_part, ck_idle),
            "<=",
            3.0,
            "x",
            "ctxkit: 16-SM partition beside the saturated rest / idle",
        ),
        median_target(
            "green.unpartitioned_vs_partitioned",
            ratios(ck_same, ck_part),
            ">=",
            50.0,
            "x",
            "ctxkit: same context beside the heavy kernel / 16-SM partition",
        ),
        median_target(
            "green.partitioned_ctxkit_vs_raw",
            ratios(ck_part, r["raw_partitioned"]),
            "<=",
            1.2,
            "x",
            "16-SM partition latency, ctxkit / raw cuda.bindings green contexts",
        ),
    ]
    if r.get("pipeline_primary"):
        one, two = r["pipeline_primary"], r["pipeline_green2"]
        lines += [
            median_info("green.pipeline_primary_gbps", one, "GB/s", "1 lane: primary context"),
            median_info("green.pipeline_green2_gbps", two, "GB/s", "2 green lanes (64 + rest)"),
            median_info(
                "green.pipeline_green2_vs_primary", ratios(two, one), "x", "throughput ratio"
            ),
        ]
    return lines


def print_table(r: dict[str, Any]) -> None:
    print("1-block kernel latency, us (median of rounds): ctxkit | raw | reference (raw, H200)")
    for case in ("idle", "same", "partitioned"):
        a, b = median(r[f"ctxkit_{case}"]), median(r[f"raw_{case}"])
        print(f"  {case:12s} {a:10.1f} | {b:10.1f} | {REFERENCE_US[case]:10.1f}")
    if r.get("pipeline_primary"):
        one, two = median(r["pipeline_primary"]), median(r["pipeline_green2"])
        print(f"Pipeline.map GB/s: 1 primary lane {one:.2f} | 2 green lanes {two:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, a smaller array")
    ap.add_argument("--pipeline-mib", type=int, help="array size of the pipeline section")
    args = ap.parse_args(argv)
    if ck.device_count() == 0:
        print("bench_green: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    rounds = 5 if args.quick else 300
    r: dict[str, Any] = dict(measure_latency(rounds))
    mib = args.pipeline_mib or (64 if args.quick else 512)
    r.update(measure_pipeline(mib << 20, 2 if args.quick else 5))
    r[QUICK] = args.quick
    print_table(r)
    return emit(verdicts(r))


if __name__ == "__main__":
    sys.exit(main())
