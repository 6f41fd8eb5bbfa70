"""MPI rank -> GPU logic on CPU: real ``mpiexec`` runs with a fake device count.

Ranks gather their findings to rank 0, which prints them (the launcher may interleave
lines printed by several ranks).

``mpi_local_rank`` and the no-GPU paths run under ``mpiexec -n 4`` (skipped with a
reason when no MPI launcher is installed); ``local_device_for`` is pure and tested here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ctxkit.procs as procs
from ctxkit.errors import CudaError
from tests.support.mpi_launch import MPIEXEC, child_env, is_open_mpi, mpiexec_cmd, physical_cores

REPO = Path(__file__).resolve().parents[2]
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


@pytest.mark.parametrize(
    "local_rank, local_size, count, over, want",
    [
        (0, 1, 1, False, 0),
        (1, 2, 2, False, 1),
        (3, 4, 8, False, 3),
        (3, 4, 2, True, 1),
        (2, 4, 2, True, 0),
        (5, 6, 4, True, 1),
    ],
)
def test_local_device_for(local_rank, local_size, count, over, want):
    assert procs.local_device_for(local_rank, local_size, count, over) == want


def test_more_local_ranks_than_devices_names_both_counts():
    with pytest.raises(ValueError) as info:
        procs.local_device_for(0, 4, 2, host="node7")
    msg = str(info.value)
    assert "4 MPI ranks run on node7" in msg and "only 2 CUDA device(s)" in msg
    assert "oversubscribe=True" in msg and "local rank 0" in msg


def test_no_device_is_a_cuda_error():
    with pytest.raises(CudaError) as info:
        procs.local_device_for(0, 2, 0, oversubscribe=True)
    assert info.value.code == 100 and "found no CUDA device" in str(info.value)


@pytest.mark.parametrize("rank, size", [(-1, 2), (2, 2), (0, 0)])
def test_inconsistent_rank(rank, size):
    with pytest.raises(ValueError, match="not in range"):
        procs.local_device_for(rank, size, 4)


def test_missing_mpi4py_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    for fn in (procs.mpi_local_device, procs.mpi_local_rank):
        with pytest.raises(ImportError) as info:
            fn()
        msg = str(info.value)
        assert 'pip install -e ".[mpi]"' in msg and "ctxkit-cuda[mpi]" in msg and "mpi4py" in msg


LAUNCHER_VERSIONS = {
    "openmpi4": "mpiexec (OpenRTE) 4.1.2\n\nReport bugs to http://www.open-mpi.org/community/help/",
    "openmpi5": "mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/",
    "mpich": "HYDRA build details:\n    Version:                                 4.1.2",
}


@pytest.mark.parametrize("name", sorted(LAUNCHER_VERSIONS))
def test_mpiexec_cmd_oversubscribes_only_open_mpi_beyond_the_cores(tmp_path, name):
    fake = tmp_path / f"mpiexec-{name}"
    env_file = tmp_path / "env"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$OMPI_ALLOW_RUN_AS_ROOT $OMPI_ALLOW_RUN_AS_ROOT_CONFIRM" > {env_file}\n'
        f"cat <<'EOF'\n{LAUNCHER_VERSIONS[name]}\nEOF\n"
    )
    fake.chmod(0o755)
    open_mpi = name.startswith("openmpi")
    assert is_open_mpi(str(fake)) is open_mpi
    assert env_file.read_text().split() == ["1", "1"]  # --version ran with the consent set
    many = physical_cores() + 1
    assert mpiexec_cmd(1, "prog", mpiexec=str(fake)) == [str(fake), "-n", "1", "prog"]
    over = ["--oversubscribe"] if open_mpi else []
    assert mpiexec_cmd(many, "prog", mpiexec=str(fake)) == [
        str(fake),
        "-n",
        str(many),
        *over,
        "prog",
    ]


def test_is_open_mpi_is_false_for_a_launcher_that_cannot_run(tmp_path):
    assert not is_open_mpi(str(tmp_path / "no-such-mpiexec"))


def test_child_env_consents_to_root_and_puts_the_repo_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "0")
    env = child_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/elsewhere"]
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "0"  # the caller's choice wins
    assert env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_importing_ctxkit_does_not_import_mpi4py():
    code = "import sys, ctxkit, ctxkit.procs; print('mpi4py' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


RANKS_SCRIPT = """
from mpi4py import MPI
from ctxkit import procs

world = MPI.COMM_WORLD
rank = world.Get_rank()
local_rank, local_size = procs.mpi_local_rank()
half = world.Split(color=rank % 2, key=rank)
sub_rank, sub_size = procs.mpi_local_rank(half)
dev4 = procs.local_device_for(local_rank, local_size, 4)
dev2 = procs.local_device_for(local_rank, local_size, 2, oversubscribe=True)
dev_half = procs.local_device_for(sub_rank, sub_size, 2)
try:
    procs.mpi_local_device(device_count=2)
    err = "none"
except ValueError as exc:
    err = str(exc).replace(" ", "_")
row = (rank, local_rank, local_size, sub_rank, sub_size, dev4, dev2, dev_half, err)
rows = world.gather(row)
if rank == 0:
    for row in rows:
        print("RANK", *row)
"""


def run_mpi(tmp_path: Path, n: int, script: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "ranks.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run(
        mpiexec_cmd(n, sys.executable, str(path)),
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )


@needs_mpi
def test_four_ranks_get_node_local_devices(tmp_path):
    res = run_mpi(tmp_path, 4, RANKS_SCRIPT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = sorted(line.split()[1:] for line in res.stdout.splitlines() if line.startswith("RANK"))
    assert len(rows) == 4, res.stdout
    for rank, row in enumerate(rows):
        r, lr, ls, sr, ss, dev4, dev2, dev_half, err = row
        assert int(r) == rank and int(lr) == rank and int(ls) == 4  # one node: local == global
        assert (int(sr), int(ss)) == (rank // 2, 2)  # rank order kept inside a sub-communicator
        assert int(dev4) == rank and int(dev2) == rank % 2 and int(dev_half) == rank // 2
        assert "4_MPI_ranks_run_on" in err and "only_2_CUDA_device(s)" in err
        assert f"local_rank_{rank})" in err


NO_GPU_SCRIPT = """
from mpi4py import MPI
from ctxkit import procs
from ctxkit.errors import CudaError

try:
    procs.mpi_local_device()
    code = 0
except CudaError as exc:
    code = exc.code
codes = MPI.COMM_WORLD.gather(code)
if MPI.COMM_WORLD.Get_rank() == 0:
    for rank, code in enumerate(codes):
        print("NODEVICE", rank, code)
"""


@needs_mpi
def test_ranks_without_gpu_get_a_no_device_error(tmp_path):
    import ctxkit

    if ctxkit.device_count() > 0:
        pytest.skip("checks the no-GPU error")
    res = run_mpi(tmp_path, 2, NO_GPU_SCRIPT)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("NODEVICE"))
    assert lines == ["NODEVICE 0 100", "NODEVICE 1 100"]


@needs_mpi
def test_mpi_example_exits_2_with_one_line_without_gpu():
    import ctxkit

    if ctxkit.device_count() > 0:
        pytest.skip("checks the no-GPU exit")
    res = subprocess.run(
        mpiexec_cmd(2, sys.executable, str(REPO / "examples/mpi_pipeline.py"), "--quick"),
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("no GPU"), res.stderr
    assert "Traceback" not in res.stdout + res.stderr
