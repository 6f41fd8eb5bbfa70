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

Then, in this process, the warm hit of ``ctxkit.compile(...)`` itself (the call a program
makes again and again): the same request repeated after a first call filled the cache,
without include directories and with ``include_dirs`` holding 1,500 headers (built in a
temporary directory). Every timed call must come from the cache (a CHECK line).

Targets decide on medians; the best run is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verdictlines import (
    QUICK,
    Line,
    check,
    emit,
    info,
    median,
    median_target,
    missing_baseline,
    skipped,
    target,
)

REPO = Path(__file__).resolve().parent.parent
WARM_TARGET_MS = 2.0
WARM_HIT_TARGET_MS = 0.05
WARM_HIT_HEADERS = 1500
WARM_HIT_HEADERS_TARGET_MS = 1.0


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


def values(results: Sequence[dict[str, Any] | None], key: str = "total_ms") -> list[float]:
    """The *key* of every child run that produced a result."""
    return [r[key] for r in results if r is not None and r.get(key) is not None]


def med(results: Sequence[dict[str, Any] | None], key: str = "total_ms") -> float | None:
    v = values(results, key)
    return median(v) if v else None


def fmt(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:8.3f} ms"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def have_cupy() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


# --- warm hits in this process ----------------------------------------------------------

WARM_HIT_SOURCE = """{include}
extern "C" __global__ void warm_hit(int* x) {{ x[0] = {value}; }}
// bench_compile warm hit {stamp}
"""


def make_header_tree(root: Path, count: int, per_dir: int = 100) -> Path:
    """*count* small headers ``d<NN>/h<NNNN>.cuh`` under *root* (an include directory)."""
    for i in range(count):
        d = root / f"d{i // per_dir:02d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"h{i:04d}.cuh").write_text(f"#pragma once\n#define CTXKIT_BENCH_H{i} {i}\n")
    return root


def warm_hits_ms(
    source: str, calls: int, include_dirs: Sequence[Path] = (), arch: str | None = None
) -> tuple[list[float], bool]:
    """Milliseconds of each of *calls* repeated ``ctxkit.compile(source, ...)`` calls after
    a first call filled the cache, and whether every timed call came from the cache."""
    import ctxkit as ck

    compile_fn, dirs = ck.compile, [str(d) for d in include_dirs]
    compile_fn(source, name="warm_hit.cu", include_dirs=dirs, arch=arch)
    times, hits = [], True
    for _ in range(calls):
        t0 = time.perf_counter()
        obj = compile_fn(source, name="warm_hit.cu", include_dirs=dirs, arch=arch)
        times.append((time.perf_counter() - t0) * 1e3)
        hits = hits and obj.from_cache
    return times, hits


def bench_warm_hits(root: Path, calls: int, arch: str | None = None) -> dict[str, Any]:
    """Warm in-process hits without include dirs and with :data:`WARM_HIT_HEADERS` headers,
    with ``CTXKIT_CACHE_DIR`` pointing into *root* for the duration."""
    saved = os.environ.get("CTXKIT_CACHE_DIR")
    os.environ["CTXKIT_CACHE_DIR"] = str(root / "warm_hit_cache")
    try:
        stamp = time.time_ns()
        plain = WARM_HIT_SOURCE.format(include="", value=1, stamp=stamp)
        r: dict[str, Any] = {}
        r["warm_hit_ms"], r["warm_hit_cached"] = warm_hits_ms(plain, calls, arch=arch)
        tree = make_header_tree(root / "include", WARM_HIT_HEADERS)
        with_headers = WARM_HIT_SOURCE.format(
            include='#include "d00/h0000.cuh"', value="CTXKIT_BENCH_H0", stamp=stamp
        )
        r["warm_hit_headers_ms"], r["warm_hit_headers_cached"] = warm_hits_ms(
            with_headers, calls, [tree], arch=arch
        )
    finally:
        if saved is None:
            os.environ.pop("CTXKIT_CACHE_DIR", None)
        else:
            os.environ["CTXKIT_CACHE_DIR"] = saved
    return r


# --- verdicts ----------------------------------------------------------------------------


def verdicts(r: Mapping[str, Any]) -> list[Line]:
    """The SUMMARY and CHECK lines of this benchmark from its measurements (pure).

    *r*: the child results (lists of dicts, ``None`` for a failed child) ``cold``,
    ``warm``, ``raw_cold``, ``raw_warm``, ``cupy_cold``, ``cupy_warm`` (empty without
    CuPy), and the in-process warm hits of :func:`bench_warm_hits`.
    """
    runs = [
        x for k in ("cold", "warm", "raw_cold", "raw_warm", "cupy_cold", "cupy_warm") for x in r[k]
    ]
    warm_ms, cold_ms = med(r["warm"]), med(r["cold"])
    warm_note = f"median of {len(values(r['warm']))} new processes"
    lines = [
        check(
            "compile.child_runs_ok",
            sum(x is not None for x in runs) / max(1, len(runs)),
            ">=",
            1,
            "",
            "fraction of the measuring processes that produced a result",
        ),
        check(
            "compile.warm_runs_from_cache",
            sum(bool(x and x.get("cached")) for x in r["warm"]) / max(1, len(r["warm"])),
            ">=",
            1,
            "",
            "fraction of the warm new-process runs that hit the cache",
        ),
        target("compile.warm_new_process", warm_ms, "<=", WARM_TARGET_MS, "ms", warm_note),
        info("compile.cold_new_process", cold_ms, "ms", f"median of {len(values(r['cold']))}"),
        info("compile.cold_over_warm", ratio(cold_ms, warm_ms), "x", "medians"),
        info("compile.warm_vs_raw_floor", ratio(warm_ms, med(r["raw_warm"])), "x", "medians"),
        info("compile.cold_vs_raw_cold", ratio(cold_ms, med(r["raw_cold"])), "x", "medians"),
    ]
    if r["cupy_warm"]:
        lines.append(
            target(
                "compile.warm_vs_cupy_warm",
                ratio(warm_ms, med(r["cupy_warm"])),
                "<=",
                1.0,
                "x",
                "medians, new processes",
            )
        )
        lines.append(
            info("compile.cold_vs_cupy_cold", ratio(cold_ms, med(r["cupy_cold"])), "x", "medians")
        )
    else:
        why = "CuPy is not installed"
        lines.append(missing_baseline(r, "compile.warm_vs_cupy_warm", "<=", 1.0, "x", why))
        lines.append(skipped("compile.cold_vs_cupy_cold", why))
    hits_ok = bool(r["warm_hit_cached"] and r["warm_hit_headers_cached"])
    lines += [
        check(
            "compile.warm_hits_from_cache",
            1.0 if hits_ok else 0.0,
            ">=",
            1,
            "",
            "1 = every timed in-process call came from the cache",
        ),
        median_target(
            "compile.warm_hit_in_process_ms",
            r["warm_hit_ms"],
            "<=",
            WARM_HIT_TARGET_MS,
            "ms",
            "ctxkit.compile(...) again in the same process, no include dirs",
        ),
        median_target(
            "compile.warm_hit_1500_headers_ms",
            r["warm_hit_headers_ms"],
            "<=",
            WARM_HIT_HEADERS_TARGET_MS,
            "ms",
            f"the same with include_dirs holding {WARM_HIT_HEADERS} headers",
        ),
    ]
    return lines


def parent_main(quick: bool) -> int:
    import ctxkit as ck

    if ck.device_count() == 0:
        print("bench_compile: no GPU: no CUDA device/driver on this machine", file=sys.stderr)
        return 2
    cold_n, warm_n = (2, 3) if quick else (3, 7)
    dev = ck.Device(0)
    r: dict[str, Any] = {QUICK: quick}
    with tempfile.TemporaryDirectory(prefix="ctxkit-bench-compile-") as tmp:
        root = Path(tmp)
        source = root / "saxpy.cu"
        source.write_text(
            ck.compiler.kernel_source("saxpy.cu") + f"\n// bench_compile {time.time_ns()}\n"
        )
        nv = ck.compiler.nvrtc_version()
        print(f"device 0: {dev.name} ({dev.arch}); NVRTC {nv[0]}.{nv[1]}")
        print(f"{cold_n} cold and {warm_n} warm runs per variant, each in a new process (median)")

        r["cold"] = [
            run_child("ctxkit", source, {"CTXKIT_CACHE_DIR": str(root / f"cold{i}")})
            for i in range(cold_n)
        ]
        warm_env = {"CTXKIT_CACHE_DIR": str(root / "warm")}
        fill = run_child("ctxkit", source, warm_env)
        r["warm"] = [run_child("ctxkit", source, warm_env) for _ in range(warm_n)]

        cubin = root / "saxpy.cubin"
        obj = ck.compile(source.read_text(), name="saxpy.cu", arch=dev.arch, cache=False)
        cubin.write_bytes(obj.code)
        r["raw_cold"] = [run_child("raw", source, {}) for _ in range(cold_n)]
        r["raw_warm"] = [run_child("raw", source, {}, cubin=cubin) for _ in range(warm_n)]

        r["cupy_cold"], r["cupy_warm"] = [], []
        if have_cupy():
            r["cupy_cold"] = [
                run_child("cupy", source, {"CUPY_CACHE_DIR": str(root / f"cupy_cold{i}")})
                for i in range(cold_n)
            ]
            cupy_env = {"CUPY_CACHE_DIR": str(root / "cupy_warm")}
            run_child("cupy", source, cupy_env)
            r["cupy_warm"] = [run_child("cupy", source, cupy_env) for _ in range(warm_n)]
        else:
            print("CuPy is not installed: CuPy rows skipped")
        with ck.registry.context(0):
            r.update(bench_warm_hits(root, 50 if quick else 200))

    rows = [
        ("ctxkit cold (NVRTC + load)", "cold", "total_ms"),
        ("ctxkit warm (cache, new process)", "warm", "total_ms"),
        ("  of which compile() cache hit", "warm", "compile_ms"),
        ("  of which Module.load+function", "warm", "load_ms"),
        ("raw cold (NVRTC + cuModuleLoadData)", "raw_cold", "total_ms"),
        ("raw warm floor (read cubin + load)", "raw_warm", "total_ms"),
        ("cupy cold (RawKernel)", "cupy_cold", "total_ms"),
        ("cupy warm (RawKernel, cache)", "cupy_warm", "total_ms"),
    ]
    print(f"\n{'variant':40s} {'to kernel':>12s} {'first launch':>14s}")
    for label, key, field in rows:
        first = med(r[key], "first_launch_ms") if field == "total_ms" else None
        print(f"{label:40s} {fmt(med(r[key], field)):>12s} {fmt(first):>14s}")
    if fill is not None:
        print(f"(the run that filled the warm cache took {fmt(fill['total_ms']).strip()})")
    for label, key in (
        ("no include dirs", "warm_hit_ms"),
        ("1,500 headers", "warm_hit_headers_ms"),
    ):
        print(
            f"in-process warm hit, {label:16s}: median {median(r[key]):.4f} ms, "
            f"best {min(r[key]):.4f} ms"
        )
    print()
    return emit(verdicts(r))


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
