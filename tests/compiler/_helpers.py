"""Helpers shared by the compiler tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import ctxkit.compiler as C

REPO = Path(__file__).resolve().parents[2]
SAXPY = C.kernel_source("saxpy.cu")


def unique(tag: str = "") -> str:
    """SAXPY with a unique comment: a source no earlier test or run has cached."""
    return SAXPY + f"\n// {tag} {time.time_ns()} {os.getpid()}\n"


def entries(d: Path) -> list[Path]:
    """The cache entries in *d*."""
    return sorted(d.glob("*.ctxobj")) if d.is_dir() else []


def delta(before: dict[str, int]) -> dict[str, int]:
    """How much each cache counter moved since *before* (a copy of ``cache.stats``)."""
    return {k: C.cache.stats[k] - before[k] for k in before}


def child_env(cache: Path | str) -> dict[str, str]:
    env = {**os.environ, "CTXKIT_CACHE_DIR": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_py(script: str, cache: Path | str, timeout: float = 240) -> str:
    """Run *script* in a new interpreter using *cache*; its stdout (fails on exit != 0)."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout
