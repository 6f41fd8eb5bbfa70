"""Run-time compilation: source -> loaded kernel, cold vs warm cache, each in a NEW process.

    PYTHONPATH=. python3 benchmarks/bench_compile.py [--quick]

Every measurement runs in a fresh Python process (the realistic case: a program starts,
compiles its kernels, runs). Imports and context creation happen before the clock
starts; the clock covers source text -> a kernel handle ready to launch, then (reported
separately) the first launch. Variants, same kernel (ptx/saxpy.cu), same run:

* ctxkit  ``ck.Module.load(ck.compile(src)).function("saxpy")``; cold = empty cache
  (NVRTC load + compile + module load), warm = cache filled by an earlier process;
* raw     cuda.bindings by hand: cold = NVRTC + ``cuModuleLoadData``; warm floor = read the
  cubin from a file + ``cuModuleLoadData`` (no hashing, no checks);
* cupy    ``cupy.RawKernel(src, "saxpy").kernel`` with ``CUPY_CACHE_DIR`` empty (cold) or
  filled by an earlier process (warm), when CuPy is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WARM_TARGET_MS = 2.0


# --- children (one measurement each) -------------------------------------------------


def _child_ctxkit(src: str) -> dict[str, Any]:
    import ctxkit as ck

    ctx = ck.registry.context(0)
    ctx.push()
    compile_fn, module_cls = ck.compile, ck.Module  # imports outside the clock
    t0 = time.perf_counter()
    obj = compile_fn(src, name="saxpy.cu")
    t1 = time.perf_counter()
    kernel = module_cls.load(obj).function("saxpy")
    t2 = time.perf_counter()
    first = _first_launch(lambda: kernel.launch(1, 32, 0.0, 0, 0, 0), ctx.synchronize)
    ctx.pop()
    return {
        "total_ms": (t2 - t0) * 1e3,
        "compile_ms": (t1 - t0) * 1e3,
        "load_ms": (t2 - t1) * 1e3,
        "first_launch_ms": first,
        "cached": obj.from_cache,
        "target": obj.target,
    }


def _child_raw(src: str, cubin_file: str | None) -> dict[str, Any]:
    import numpy as np

    import ctxkit as ck
    from ctxkit._driver import drv

    ctx = ck.registry.context(0)
    ctx.push()
    arch = ctx.device.arch
    t0 = time.perf_counter()
    if cubin_file:
        with open(cubin_file, "rb") as f:
            image = f.read()
    else:
        image = _raw_nvrtc(src, arch)
    err, mod = drv.cuModuleLoadData(image)
    if err:
        raise RuntimeError(f"cuModuleLoadData: {err!r}")
    err, func = drv.cuModuleGetFunction(mod, b"saxpy")
    if err:
        raise RuntimeError(f"cuModuleGetFunction: {err!r}")
    t1 = time.perf_counter()
    args = [np.array([0.0], np.float32)] + [np.array([0], np.uint64) for _ in range(3)]
    packed = np.array([a.ctypes.data for a in args], dtype=np.uint64)

    def launch() -> None:
        (e,) = drv.cuLaunchKernel(func, 1, 1, 1, 32, 1, 1, 0, 0, packed.ctypes.data, 0)
        if e:
            raise RuntimeError(f"cuLaunchKernel: {e!r}")

    first = _first_launch(launch, ctx.synchronize)
    drv.cuModuleUnload(mod)
    ctx.pop()
    return {"total_ms": (t1 - t0) * 1e3, "first_launch_ms": first, "cached": bool(cubin_file)}


def _raw_nvrtc(src: str, arch: str) -> bytes:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"saxpy.cu", 0, [], [])
    opts = [f"-arch={arch}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err:
        raise RuntimeError(f"nvrtcCompileProgram: {err!r}")
    err, size = nvrtc.nvrtcGetCUBINSize(prog)
    buf = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, buf)
    nvrtc.nvrtcDestroyProgram(prog)
    return buf


def _child_cupy(src: str) -> dict[str, Any]:
    import cupy
    import numpy as np

    cupy.cuda.Device(0).use()
    cupy.empty(1)  # creates the context outside the clock
    raw_kernel = cupy.RawKernel
    t0 = time.perf_counter()
    k = raw_kernel(src, "saxpy")
    _ = k.kernel  # compiles (or reads CuPy's cache) and loads the module
    t1 = time.perf_counter()

    def launch() -> None:
        k((1,), (32,), (np.float32(0), np.uint64(0), np.uint64(0), np.uint64(0)))

    first = _first_launch(launch, cupy.cuda.Device(0).synchronize)
    return {"total_ms": (t1 - t0) * 1e3, "first_launch_ms": first}


def _first_launch(launch: Any, sync: Any) -> float | None:
    try:
        t0 = time.perf_counter()
        launch()
        sync()
        return (time.perf_counter() - t0) * 1e3
    except Exception as exc:
        print(f"first launch failed: {exc!r}", file=sys.stderr)
        return None


def child_main(args: argparse.Namespace) -> int:
    src = Path(args.source).read_text()
    if args.child == "ctxkit":
        result = _child_ctxkit(src)
    elif args.child == "raw":
        result = _child_raw(src, args.cubin)
    else:
        result = _child_cupy(src)
    print("RESULT " + json.dumps(result))
    return 0


# --- parent ---------------------------------------------------------------------------


def run_child(
    mode: str, source: Path, env_extra: dict[str, str], cubin: Path | None = None
) -> dict[str, Any] | None:
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--child", mode, "--source", str(source)]
    if cubin is not None:
        cmd += ["--cubin", str(cubin)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]
    print(f"[{mode}] child failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
    return None


def median(results: list[dict[str, Any] | None], key: str = "total_ms") -> float | None:
    values = [r[key] for r in results if r is not None and r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:8.3f} ms"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(
    name: str, value: float | None, unit: str, target: str | None = None, ok: bool | None = None
) -> None:
    if value is None:
        print(f"SUMMARY {name} n/a")
        return
    text = f"{value:.2f}{unit}" if unit == "x" else f"{value:.3f}{unit}"
    if target is None:
        print(f"SUMMARY {name} {text} (info)")
    else:
        print(f"SUMMARY {name} {text} (target {target}) {'PASS' if ok else 'FAIL'}")


def have_cupy() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


def parent_main(quick: bool) -> int:
    import ctxkit as ck

    if ck.device_count() == 0:
        print("bench_compile: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    cold_n, warm_n = (2, 3) if quick else (3, 7)
    dev = ck.Device(0)
    with tempfile.TemporaryDirectory(prefix="ctxkit-bench-compile-") as tmp:
        root = Path(tmp)
        source = root / "saxpy.cu"
        source.write_text(
            ck.compiler.kernel_source("saxpy.cu") + f"\n// bench_compile {time.time_ns()}\n"
        )
        nv = ck.compiler.nvrtc_version()
        print(f"device 0: {dev.name} ({dev.arch}); NVRTC {nv[0]}.{nv[1]}")
        print(f"{cold_n} cold and {warm_n} warm runs per variant, each in a new process (median)")

        cold = [
            run_child("ctxkit", source, {"CTXKIT_CACHE_DIR": str(root / f"cold{i}")})
            for i in range(cold_n)
        ]
        warm_env = {"CTXKIT_CACHE_DIR": str(root / "warm")}
        fill = run_child("ctxkit", source, warm_env)
        warm = [run_child("ctxkit", source, warm_env) for _ in range(warm_n)]
        if any(r is not None and not r["cached"] for r in warm):
            print("warning: a warm ctxkit run missed the cache", file=sys.stderr)

        cubin = root / "saxpy.cubin"
        obj = ck.compile(source.read_text(), name="saxpy.cu", arch=dev.arch, cache=False)
        cubin.write_bytes(obj.code)
        raw_cold = [run_child("raw", source, {}) for _ in range(cold_n)]
        raw_warm = [run_child("raw", source, {}, cubin=cubin) for _ in range(warm_n)]

        cupy_cold: list[dict[str, Any] | None] = []
        cupy_warm: list[dict[str, Any] | None] = []
        if have_cupy():
            cupy_cold = [
                run_child("cupy", source, {"CUPY_CACHE_DIR": str(root / f"cupy_cold{i}")})
                for i in range(cold_n)
            ]
            cupy_env = {"CUPY_CACHE_DIR": str(root / "cupy_warm")}
            run_child("cupy", source, cupy_env)
            cupy_warm = [run_child("cupy", source, cupy_env) for _ in range(warm_n)]
        else:
            print("CuPy is not installed: CuPy rows skipped")

    rows = [
        ("ctxkit cold (NVRTC + load)", median(cold), median(cold, "first_launch_ms")),
        ("ctxkit warm (cache, new process)", median(warm), median(warm, "first_launch_ms")),
        ("  of which compile() cache hit", median(warm, "compile_ms"), None),
        ("  of which Module.load+function", median(warm, "load_ms"), None),
        (
            "raw cold (NVRTC + cuModuleLoadData)",
            median(raw_cold),
            median(raw_cold, "first_launch_ms"),
        ),
        (
            "raw warm floor (read cubin + load)",
            median(raw_warm),
            median(raw_warm, "first_launch_ms"),
        ),
        ("cupy cold (RawKernel)", median(cupy_cold), median(cupy_cold, "first_launch_ms")),
        ("cupy warm (RawKernel, cache)", median(cupy_warm), median(cupy_warm, "first_launch_ms")),
    ]
    print(f"\n{'variant':40s} {'to kernel':>12s} {'first launch':>14s}")
    for label, total, first in rows:
        print(f"{label:40s} {fmt(total):>12s} {fmt(first):>14s}")
    if fill is not None:
        print(f"(the run that filled the warm cache took {fmt(fill['total_ms']).strip()})")

    warm_ms, cold_ms = median(warm), median(cold)
    print()
    summary(
        "compile.warm_new_process",
        warm_ms,
        "ms",
        f"<= {WARM_TARGET_MS:.2f}ms",
        warm_ms is not None and warm_ms <= WARM_TARGET_MS,
    )
    summary("compile.cold_new_process", cold_ms, "ms")
    summary("compile.cold_over_warm", ratio(cold_ms, warm_ms), "x")
    summary("compile.warm_vs_raw_floor", ratio(warm_ms, median(raw_warm)), "x")
    summary("compile.cold_vs_raw_cold", ratio(cold_ms, median(raw_cold)), "x")
    if cupy_warm:
        r = ratio(warm_ms, median(cupy_warm))
        summary("compile.warm_vs_cupy_warm", r, "x", "<= 1.00x", r is not None and r <= 1.0)
        summary("compile.cold_vs_cupy_cold", ratio(cold_ms, median(cupy_cold)), "x")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer runs")
    ap.add_argument("--child", choices=("ctxkit", "raw", "cupy"), help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--cubin", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args)
    return parent_main(args.quick)


if __name__ == "__main__":
    sys.exit(main())
