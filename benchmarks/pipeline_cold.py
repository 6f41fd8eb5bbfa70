"""The cold first call of benchmarks/bench_pipeline.py: ``y = 2 x`` on a 1 GiB float32
array in a fresh process, ctxkit beside PyTorch.

    python3 benchmarks/pipeline_cold.py SIDE [--gib 1]     # one call, one JSON line

Each call runs in a process of its own, as a user's script would: the array (pageable,
filled) is made and the library imported before the clock; the clock covers everything
after it - the CUDA context, the kernel (ctxkit: ``ck.compile`` from a warm compile cache,
the module load), the copies, the kernel and the output. The sides
(:data:`pipeline_verdicts.COLD_SIDES`): ``ctxkit`` (``out="pageable"``: pageable in and
out), ``ctxkit_default_out`` (the output in the pinned pool), ``torch``
(``.cuda() * 2`` then ``.cpu()``) and ``torch_pinned`` (``pin_memory()`` in, a pinned
output). The result is checked after the clock.

:func:`bench_cold` (run by bench_pipeline.py) makes one untimed round (files into the
page cache) and then *rounds* rounds, the sides taking turns.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

GiB = 1 << 30
SIDES = ("ctxkit", "ctxkit_default_out", "torch", "torch_pinned")
#: The exit status of a child whose library is not installed (a missing baseline).
MISSING = 3


Call = Callable[[np.ndarray], tuple[np.ndarray, dict[str, Any], Callable[[], Any]]]


def _ctxkit(out: str | None) -> Call:
    import ctxkit as ck

    def run(x: np.ndarray) -> tuple[np.ndarray, dict[str, Any], Callable[[], Any]]:
        obj = ck.compile(ck.kernel_source("scale.cu"), name="scale.cu")
        p = ck.Pipeline([0])
        y = p.map((obj, "scale_f32"), x, out, args=(2.0,))
        return y, {"cached": obj.from_cache, "path": p.last_stats.path}, p.close

    return run


def _torch(pinned: bool) -> Call:
    import torch

    def run(x: np.ndarray) -> tuple[np.ndarray, dict[str, Any], Callable[[], Any]]:
        if not pinned:
            return (torch.from_numpy(x).cuda() * 2).cpu().numpy(), {}, lambda: None
        d = torch.from_numpy(x).pin_memory().cuda(non_blocking=True)
        y = torch.empty(x.shape, dtype=torch.float32, pin_memory=True)
        y.copy_(d * 2, non_blocking=True)
        torch.cuda.synchronize()
        return y.numpy(), {}, lambda: None

    return run


MAKERS: dict[str, Callable[[], Call]] = {
    "ctxkit": lambda: _ctxkit("pageable"),
    "ctxkit_default_out": lambda: _ctxkit(None),
    "torch": lambda: _torch(False),
    "torch_pinned": lambda: _torch(True),
}


def child(side: str, nbytes: int) -> dict[str, Any]:
    """Time one cold call of *side* in this (fresh) process: from after the import and
    the input array to the output in hand (a ctxkit Pipeline is closed after the clock,
    as a one-line ``ck.Pipeline([0]).map(...)`` leaves it to the garbage collector)."""
    x = np.arange(nbytes // 4, dtype=np.float32)
    run = MAKERS[side]()
    t0 = time.perf_counter()
    y, extra, close = run(x)
    ms = (time.perf_counter() - t0) * 1e3
    close()
    if not np.array_equal(y, x * np.float32(2)):
        raise SystemExit(f"pipeline_cold: {side} returned a wrong result")
    return {"side": side, "ms": ms, **extra}


def run_child(
    side: str, nbytes: int, command: Sequence[str] | None = None, timeout: float = 300
) -> dict[str, Any]:
    """One child's answer: ``{"ms": ...}``, ``{"missing": reason}`` (its library is not
    installed) or ``{"error": what went wrong}``."""
    cmd = [*(command or [sys.executable, str(Path(__file__).resolve())]), side]
    cmd += ["--bytes", str(nbytes)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{side}: no answer in {timeout:.0f} s"}
    lines = res.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if res.returncode == MISSING and isinstance(answer, dict) and "missing" in answer:
        return answer
    if res.returncode or not isinstance(answer, dict) or "ms" not in answer:
        tail = " ".join((res.stderr or res.stdout).split())[-300:]
        return {"error": f"{side}: exited with status {res.returncode}: {tail}"}
    return answer


def bench_cold(
    nbytes: int,
    rounds: int,
    results: dict[str, Any],
    command: Sequence[str] | None = None,
    sides: Sequence[str] = SIDES,
) -> None:
    """*rounds* rounds (after an untimed one) of a cold call per side, each in a fresh
    process; fills ``cold_ms``, ``cold_missing``, ``cold_errors``, ``cold_cached`` and
    ``cold_gib`` of *results*."""
    print(
        f"cold first calls: {nbytes / GiB:.2f} GiB float32, y = 2x, a fresh process per call, "
        f"one untimed round then {rounds} (ms):",
        flush=True,
    )
    ms: dict[str, list[float]] = {s: [] for s in sides}
    missing: dict[str, str] = {}
    errors: list[str] = []
    cached = True
    for i in range(rounds + 1):
        for side in sides:
            if side in missing:
                continue
            answer = run_child(side, nbytes, command)
            if "missing" in answer:
                missing[side] = answer["missing"]
            elif "error" in answer:
                errors.append(answer["error"])
            else:
                cached &= bool(answer.get("cached", True))
                if i:
                    ms[side].append(answer["ms"])
    for side in sides:
        v = ms[side]
        got = f"{np.median(v):8.1f} median, {min(v):8.1f} best" if v else missing.get(side, "-")
        print(f"  {side:20s} {got}", flush=True)
    results.update(
        cold_ms={s: v for s, v in ms.items() if v},
        cold_missing=missing,
        cold_errors=errors,
        cold_cached=cached,
        cold_gib=nbytes / GiB,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("side", choices=SIDES)
    ap.add_argument("--bytes", type=int, default=GiB)
    args = ap.parse_args(argv)
    if args.side.startswith("torch"):
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            print(json.dumps({"missing": f"torch is not installed ({type(exc).__name__})"}))
            return MISSING
    print(json.dumps(child(args.side, args.bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
