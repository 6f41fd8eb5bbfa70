"""Process per GPU on real devices: binding, kernel results, faults, retries, timeouts, MPI.

The functions the children run are defined at module level (they are imported by name in
the spawned processes) and must not touch CUDA at import time.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.procs import DevicePool, DeviceTaskError, run_per_device
from tests.support.mpi_launch import MPIEXEC, child_env, mpiexec_cmd

REPO = Path(__file__).resolve().parents[2]
N = 1 << 20
SPIN_FOREVER = 1 << 62  # clock64 ticks: far longer than any timeout here


# --- functions run in the children ----------------------------------------------------


def _kernel(file: str, name: str) -> ck.Kernel:
    obj = ck.compile(ck.compiler.kernel_source(file), name=file)
    return ck.Module.load(obj).function(name)


def _scale(n: int, alpha: float, offset: float) -> np.ndarray:
    x = np.arange(n, dtype=np.float32) + np.float32(offset)
    d_in, d_out = ck.DeviceBuffer(x.nbytes), ck.DeviceBuffer(x.nbytes)
    grid = max(1, min(65535, (n + 255) // 256))
    d_in.copy_from_host(x)
    _kernel("scale.cu", "scale_f32").launch(grid, 256, d_in, d_out, n, np.float32(alpha))
    return d_out.copy_to_host(np.empty_like(x))


def scale_on_device(ordinal: int, n: int, alpha: float) -> tuple[str, int, np.ndarray, int]:
    ctx = ck.current_context()
    assert ctx is not None, "run_per_device did not bind a context"
    return ctx.device.pci_bus_id, ctx.device.ordinal, _scale(n, alpha, ordinal), os.getpid()


def what_the_child_sees(ordinal: int) -> tuple[int, str | None, str, int]:
    ctx = ck.current_context()
    assert ctx is not None
    return ck.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"), ctx.device.pci_bus_id, ordinal


def _fault() -> None:
    _kernel("fault.cu", "fault").launch(1, 1, 0)
    ctx = ck.current_context()
    assert ctx is not None
    ctx.synchronize()  # raises ContextPoisonedError (CUDA_ERROR_ILLEGAL_ADDRESS)


def fault_on(ordinal: int, bad: int, n: int) -> np.ndarray:
    if ordinal == bad:
        _fault()
    return _scale(n, 2.0, ordinal)


def fault_first_attempt(ordinal: int, marker_dir: str, n: int) -> np.ndarray:
    marker = Path(marker_dir, f"faulted-{ordinal}")
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        _fault()
    return _scale(n, 2.0, ordinal)


def spin_on(ordinal: int, slow: int, pid_dir: str) -> int:
    Path(pid_dir, f"{ordinal}.pid").write_text(str(os.getpid()))
    if ordinal == slow:
        _kernel("spin.cu", "spin").launch(1, 1, SPIN_FOREVER, None)
        ctx = ck.current_context()
        assert ctx is not None
        ctx.synchronize()
    return ordinal


_pool_kernel: list[ck.Kernel] = []


def pool_init() -> None:
    _pool_kernel.append(_kernel("scale.cu", "scale_f32"))


def pool_scale(x: np.ndarray, alpha: float) -> tuple[int, np.ndarray, int]:
    ctx = ck.current_context()
    assert ctx is not None and _pool_kernel
    d_in, d_out = ck.DeviceBuffer(x.nbytes), ck.DeviceBuffer(x.nbytes)
    d_in.copy_from_host(x)
    grid = max(1, min(65535, (x.size + 255) // 256))
    _pool_kernel[0].launch(grid, 256, d_in, d_out, x.size, np.float32(alpha))
    return ctx.device.ordinal, d_out.copy_to_host(np.empty_like(x)), os.getpid()


def pool_fault() -> None:
    _fault()


# --- helpers --------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def expected(n: int, alpha: float, offset: int) -> np.ndarray:
    return (np.arange(n, dtype=np.float32) + np.float32(offset)) * np.float32(alpha)


@pytest.fixture(autouse=True)
def no_children_left():
    yield
    assert multiprocessing.active_children() == []


def two_devices() -> list[int]:
    if ck.device_count() < 2:
        pytest.skip("needs at least two CUDA devices")
    return [0, 1]


# --- run_per_device -------------------------------------------------------------------


@pytest.mark.multigpu
def test_each_child_runs_the_kernel_on_its_own_gpu():
    out = run_per_device(scale_on_device, args=(N, 3.0))
    assert len(out) == ck.device_count()
    buses = [bus for bus, *_ in out]
    assert len(set(buses)) == len(out), buses
    for i, (bus, ordinal, y, pid) in enumerate(out):
        assert ordinal == i and bus == ck.Device(i).pci_bus_id
        np.testing.assert_array_equal(y, expected(N, 3.0, i))
        assert pid != os.getpid() and not alive(pid)


@pytest.mark.multigpu
def test_isolate_shows_each_child_only_its_gpu():
    devices = two_devices()
    out = run_per_device(what_the_child_sees, devices, isolate=True)
    for i, (count, visible, bus, ordinal) in enumerate(out):
        assert count == 1 and ordinal == i and visible is not None
        assert bus == ck.Device(i).pci_bus_id


@pytest.mark.multigpu
def test_fault_in_one_child_keeps_the_other_result():
    devices = two_devices()
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(fault_on, devices, args=(1, N))
    err = info.value
    assert err.device == 1 and err.kind == "exception"
    assert err.code == 700 and err.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert err.exception_type == "ctxkit.errors.ContextPoisonedError"
    assert "ILLEGAL_ADDRESS" in str(err) and "_fault" in err.traceback
    assert set(err.failures) == {1} and err.results[1] is None
    np.testing.assert_array_equal(err.results[0], expected(N, 2.0, 0))
    assert err.pid is not None and not alive(err.pid)
    # the parent's own contexts are untouched by the child's fault
    with ck.registry.context(1) as ctx:
        ctx.synchronize()


def test_retry_recovers_from_a_fault_in_a_fresh_process(tmp_path):
    out = run_per_device(fault_first_attempt, [0], args=(str(tmp_path), N), retries=1)
    np.testing.assert_array_equal(out[0], expected(N, 2.0, 0))
    assert (tmp_path / "faulted-0").exists()


def test_fault_without_retry_reports_the_attempts(tmp_path):
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(fault_first_attempt, [0], args=(str(tmp_path), N))
    assert info.value.attempts == 1 and info.value.code == 700


def test_timeout_kills_a_child_stuck_in_a_kernel(tmp_path):
    devices = [0, 1] if ck.device_count() >= 2 else [0]
    slow = devices[-1]
    t0 = time.monotonic()
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(spin_on, devices, args=(slow, str(tmp_path)), timeout=8)
    assert time.monotonic() - t0 < 60
    err = info.value
    assert err.kind == "timeout" and err.device == slow
    assert "did not finish within 8 s" in str(err)
    if len(devices) == 2:
        assert err.results == [0, None]
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert pids and not any(alive(p) for p in pids)
    # the GPU is usable again once the stuck process is gone
    assert run_per_device(scale_on_device, [slow], args=(1024, 1.0))[0][1] == slow


# --- DevicePool -----------------------------------------------------------------------


def test_pool_runs_kernels_and_replaces_a_faulted_worker():
    devices = list(range(min(2, ck.device_count())))
    x = np.arange(N, dtype=np.float32)  # 4 MiB: through shared memory
    with DevicePool(devices, initializer=pool_init) as pool:
        futures = {d: pool.submit(pool_scale, x, 2.0, device=d) for d in devices}
        first_pid = {}
        for d, f in futures.items():
            ordinal, y, pid = f.result(120)
            assert ordinal == d
            np.testing.assert_array_equal(y, x * 2)
            first_pid[d] = pid
        err = pool.submit(pool_fault, device=devices[-1]).exception(120)
        assert isinstance(err, DeviceTaskError) and err.code == 700
        ordinal, y, pid = pool.submit(pool_scale, x, 3.0, device=devices[-1]).result(120)
        assert ordinal == devices[-1] and pid != first_pid[devices[-1]]
        np.testing.assert_array_equal(y, x * 3)
        pids = [p for p in pool.pids.values() if p]
    assert not any(alive(p) for p in pids)


# --- examples and MPI -----------------------------------------------------------------


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout
    )


def test_process_per_gpu_example():
    res = _run([sys.executable, "examples/process_per_gpu.py", "--quick"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1].startswith("OK")
    buses = re.findall(r"device \d+ \(([0-9A-Fa-f:.]+)\)", res.stdout)
    assert len(buses) == ck.device_count() and len(set(buses)) == len(buses)


def _mpi_ready() -> str:
    if MPIEXEC is None:
        return "no mpiexec on PATH (pip install mpich)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    return ""


@pytest.mark.multigpu
def test_mpi_example_two_ranks_two_gpus():
    reason = _mpi_ready()
    if reason:
        pytest.skip(reason)
    res = _run(mpiexec_cmd(2, sys.executable, "examples/mpi_pipeline.py", "--quick"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check gathered result: ok" in res.stdout
    assert res.stdout.strip().splitlines()[-1].startswith("OK")
    ranks = re.findall(r"rank (\d+): \S+ device (\d+) \(([0-9A-Fa-f:.]+)\)", res.stdout)
    assert sorted((int(r), int(d)) for r, d, _ in ranks) == [(0, 0), (1, 1)]
    assert len({bus for *_, bus in ranks}) == 2


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
    reason = _mpi_ready()
    if reason:
        pytest.skip(reason)
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


def test_sigint_to_parent_with_gpu_children(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys\n"
        "from tests.procs.test_pool_gpu import spin_on\n"
        "from ctxkit.procs import run_per_device\n"
        "if __name__ == '__main__':\n"
        "    run_per_device(spin_on, [0], args=(0, sys.argv[1]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "0.pid").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    time.sleep(2.0)  # the child is inside the spinning kernel now
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    child = int((tmp_path / "0.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)
