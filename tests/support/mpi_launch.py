"""How the tests start ``mpiexec``: one environment and command line for MPICH and Open MPI.

Open MPI refuses to run as root (GPU containers often run as root) unless
``OMPI_ALLOW_RUN_AS_ROOT=1`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` are set, and refuses
more ranks than the node has cores unless given ``--oversubscribe``. MPICH needs neither
and ignores the variables.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MPIEXEC: str | None = shutil.which("mpiexec") or (
    "/usr/bin/mpiexec" if Path("/usr/bin/mpiexec").exists() else None
)
RUN_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def child_env() -> dict[str, str]:
    """``os.environ`` with the repository first on ``PYTHONPATH`` and Open MPI's consent to
    run as root (values already set in the environment win)."""
    env = {**RUN_AS_ROOT, **os.environ}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@functools.cache
def is_open_mpi(mpiexec: str) -> bool:
    """True when *mpiexec* is Open MPI's launcher (``mpiexec --version`` says so)."""
    try:
        res = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=60, env=child_env()
        )
    except (OSError, subprocess.SubprocessError):
        return False
    out = res.stdout + res.stderr
    return any(name in out for name in ("Open MPI", "OpenRTE", "Open RTE"))


def physical_cores() -> int:
    """Cores (not hardware threads) this process may run on: what Open MPI counts as slots."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology / "core_cpus_list").read_text().strip())
        except OSError:
            try:
                cores.add((topology / "thread_siblings_list").read_text().strip())
            except OSError:
                cores.add(str(cpu))
    return max(1, len(cores))


def mpiexec_cmd(n: int, *argv: str, mpiexec: str | None = None) -> list[str]:
    """``mpiexec -n <n> argv...``, with ``--oversubscribe`` only where Open MPI needs it."""
    launcher = mpiexec or MPIEXEC
    assert launcher is not None, "no mpiexec on this machine"
    cmd = [launcher, "-n", str(n)]
    if n > physical_cores() and is_open_mpi(launcher):
        cmd.append("--oversubscribe")
    return [*cmd, *argv]
