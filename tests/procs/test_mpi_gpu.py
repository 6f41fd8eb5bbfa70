"""MPI on real devices: ranks bind their node-local GPU; the MPI example with one rank per GPU,
with ranks sharing a GPU, and refusing more ranks than GPUs unless asked to share."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ctxkit as ck
from tests.support.mpi_launch import MPIEXEC, child_env, mpiexec_cmd

REPO = Path(__file__).resolve().parents[2]
RANK_LINE = re.compile(r"rank (\d+): \S+ device (\d+) \(([0-9A-Fa-f:.]+)\)")


def _mpi_ready() -> None:
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH (pip install mpich)")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=REPO, env=env or child_env(), capture_output=True, text=True, timeout=300
    )


def _one_gpu_env() -> dict[str, str]:
    """The environment with only the first visible GPU left visible."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    return {**child_env(), "CUDA_VISIBLE_DEVICES": first}


def _ranks(stdout: str) -> list[tuple[int, int, str]]:
    return sorted((int(r), int(d), bus) for r, d, bus in RANK_LINE.findall(stdout))


@pytest.mark.multigpu
def test_mpi_example_two_ranks_two_gpus():
    _mpi_ready()
    res = _run(mpiexec_cmd(2, sys.executable, "examples/mpi_pipeline.py", "--quick"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check gathered result: ok" in res.stdout
    assert res.stdout.strip().splitlines()[-1].startswith("OK")
    ranks = _ranks(res.stdout)
    assert [(r, d) for r, d, _ in ranks] == [(0, 0), (1, 1)]
    assert len({bus for *_, bus in ranks}) == 2


def test_mpi_example_ranks_share_one_gpu_when_asked():
    _mpi_ready()
    cmd = mpiexec_cmd(2, sys.executable, "examples/mpi_pipeline.py", "--quick", "--share-gpus")
    res = _run(cmd, _one_gpu_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ranks share GPUs: 2 rank(s) on 1 GPU(s)" in res.stdout
    assert "check gathered result: ok" in res.stdout
    ranks = _ranks(res.stdout)
    assert [(r, d) for r, d, _ in ranks] == [(0, 0), (1, 0)]
    assert len({bus for *_, bus in ranks}) == 1


def test_mpi_example_refuses_more_ranks_than_gpus_without_sharing():
    _mpi_ready()
    res = _run(
        mpiexec_cmd(2, sys.executable, "examples/mpi_pipeline.py", "--quick"), _one_gpu_env()
    )
    assert res.returncode != 0 and "Traceback" not in res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if "mpi_pipeline.py:" in line]
    assert len(lines) == 1, res.stderr
    assert "2 MPI ranks run" in lines[0] and "only 1 CUDA device(s)" in lines[0]
    assert "--share-gpus" in lines[0]


MPI_BIND_SCRIPT = """
import ctxkit as ck
from mpi4py import MPI
from ctxkit import procs

comm = MPI.COMM_WORLD
over = comm.Get_size() > ck.device_count()
try:
    dev = procs.mpi_local_device(comm, oversubscribe=over)
    again = procs.mpi_local_device(comm, oversubscribe=over)
    cur = ck.current_context()
    row = (comm.Get_rank(), dev.ordinal, again is dev, cur is not None and cur.device is dev, "")
except Exception as exc:
    row = (comm.Get_rank(), -1, False, False, type(exc).__name__)
try:
    procs.mpi_local_device(comm)
    strict = "ok"
except ValueError as exc:
    strict = "refused" if "oversubscribe=True" in str(exc) else str(exc)
rows = comm.gather(row + (strict,))
if comm.Get_rank() == 0:
    for r in rows:
        print("BIND", *r)
"""


@pytest.mark.multigpu
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpi_local_device_binds_node_local_gpus(tmp_path, ranks):
    _mpi_ready()
    n_dev = ck.device_count()
    script = tmp_path / "bind.py"
    script.write_text(MPI_BIND_SCRIPT)
    res = _run(mpiexec_cmd(ranks, sys.executable, str(script)))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = sorted(line.split()[1:] for line in res.stdout.splitlines() if line.startswith("BIND"))
    assert len(rows) == ranks, res.stdout
    for rank, (r, dev, same, current, *rest) in enumerate(rows):
        assert int(r) == rank and rest[-1] == ("ok" if ranks <= n_dev else "refused")
        assert int(dev) == rank % n_dev and same == "True" and current == "True", rows
