"""Every example runs on the GPU machine, checks itself, and ends with its "OK" line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.mpi_launch import MPIEXEC, child_env, mpiexec_cmd

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.py") if not p.name.startswith("_"))
MPI = {"mpi_pipeline.py"}
#: Examples of an optional library, each with its own test that needs the library.
OPTIONAL = {"cuda_core_interop.py"}
#: Smaller sizes than the defaults where an example takes them, to keep the suite quick.
ARGS = {
    "multi_device_streams.py": ["--mb", "64"],
    "peer_copy.py": ["--mb", "64", "--reps", "5"],
    "thread_pool_server.py": ["--requests", "20"],
    "launch_queue.py": ["--steps", "500"],
    "green_contexts.py": ["--requests", "50", "--mb", "32"],
    "process_per_gpu.py": ["--quick"],
    "mpi_pipeline.py": ["--quick"],
}


def _env() -> dict[str, str]:
    return {**child_env(), "PYTHONUNBUFFERED": "1"}


def _check(proc: subprocess.CompletedProcess[str], name: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{out[-6000:]}"
    assert "Traceback" not in out, f"{name} printed a traceback:\n{out[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("OK"), f"{name}: no final OK line:\n{proc.stdout[-3000:]}"
    assert "FAILED" not in out


@pytest.mark.parametrize(
    "path", [p for p in EXAMPLES if p.name not in MPI | OPTIONAL], ids=lambda p: p.name
)
def test_example(path: Path) -> None:
    _run_and_check([sys.executable, str(path), *ARGS.get(path.name, [])], path.name)


def test_cuda_core_interop_example() -> None:
    """cuda.core streams and buffers in ctxkit launches, ctxkit's in cuda.core copies."""
    pytest.importorskip("cuda.core", reason="cuda.core is not installed (pip install cuda-core)")
    name = "cuda_core_interop.py"
    _run_and_check([sys.executable, str(REPO / "examples" / name)], name)


@pytest.mark.parametrize("path", [p for p in EXAMPLES if p.name in MPI], ids=lambda p: p.name)
def test_mpi_example(path: Path) -> None:
    """One rank per GPU (at most 8); on one GPU, two ranks that share it (--share-gpus)."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec on this machine")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    from tests.conftest import GPU_COUNT

    ranks = min(GPU_COUNT, 8) if GPU_COUNT >= 2 else 2
    share = ["--share-gpus"] if GPU_COUNT < 2 else []
    cmd = mpiexec_cmd(ranks, sys.executable, str(path), *ARGS.get(path.name, []), *share)
    _run_and_check(cmd, path.name)


def _run_and_check(cmd: list[str], name: str) -> None:
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600, check=False
    )
    print(proc.stdout)
    _check(proc, name)
