"""Helpers shared by the examples: the argument parser, the no-GPU exit, result checks.

Each example parses its arguments first (so ``--help`` works on any machine), then calls
:func:`require_gpus` before it touches CUDA: on a machine without a GPU it prints one line
on stderr and exits with code 2 (no traceback). Results are checked against numpy with
:func:`check`; a wrong result exits with code 1. The last line an example prints on
success starts with ``OK``. The examples import ctxkit themselves; nothing here wraps it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import ctxkit

EXIT_NO_GPU = 2


def example_parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser whose help is the example's summary line and what it needs."""
    return argparse.ArgumentParser(
        description=(doc or "").strip().splitlines()[0],
        epilog="Needs an NVIDIA GPU: without one it says so and exits 2. Every result is "
        "checked against numpy; the last line printed on success starts with OK.",
    )


def require_gpus(example: str, minimum: int = 1) -> int:
    """Return the number of visible devices; exit 2 with a one-line note when too few."""
    n = ctxkit.device_count()
    if n == 0:
        print(
            f"no GPU: {example} needs an NVIDIA GPU and driver "
            "(ctxkit.device_count() == 0); run it on a GPU machine",
            file=sys.stderr,
        )
        sys.exit(EXIT_NO_GPU)
    if n < minimum:
        print(f"no GPU: {example} needs {minimum} GPUs, this machine has {n}", file=sys.stderr)
        sys.exit(EXIT_NO_GPU)
    return n


def blocks_for(n: int, block: int = 256, cap: int = 65535) -> int:
    """Grid size for the kernel library's grid-stride kernels: enough blocks, at most *cap*."""
    return max(1, min(cap, (n + block - 1) // block))


def check(what: str, got: Any, want: Any, rtol: float = 0.0) -> None:
    """Compare *got* with *want* (numpy); print the outcome, exit 1 when they differ."""
    got_a, want_a = np.asarray(got), np.asarray(want)
    if got_a.shape == want_a.shape and np.allclose(got_a, want_a, rtol=rtol, atol=0.0):
        print(f"check {what}: ok ({want_a.size} values)")
        return
    if got_a.shape != want_a.shape:
        detail = f"shape {got_a.shape} != {want_a.shape}"
    else:
        bad = np.flatnonzero(~np.isclose(got_a, want_a, rtol=rtol, atol=0.0))
        i = int(bad[0])
        detail = (
            f"{bad.size} of {want_a.size} values differ, first at index {i}: "
            f"{got_a.flat[i]!r} != {want_a.flat[i]!r}"
        )
    print(f"FAILED {what}: {detail}", file=sys.stderr)
    sys.exit(1)


def expect(what: str, condition: bool, detail: str = "") -> None:
    """Exit 1 with a message when *condition* is false."""
    if condition:
        print(f"check {what}: ok")
        return
    print(f"FAILED {what}" + (f": {detail}" if detail else ""), file=sys.stderr)
    sys.exit(1)


@contextmanager
def timed() -> Iterator[list[float]]:
    """``with timed() as t: ...`` then ``t[0]`` holds the elapsed seconds."""
    out = [0.0]
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        out[0] = time.perf_counter() - t0


def gbps(nbytes: int, seconds: float) -> str:
    """``"12.3 GB/s"`` for *nbytes* moved in *seconds*."""
    return f"{nbytes / max(seconds, 1e-12) / 1e9:.1f} GB/s"


def ok(summary: str) -> None:
    """Print the final line of a successful example."""
    print(f"OK {summary}")
