"""``run_per_device`` on real devices: binding, kernel results, faults, retries, timeouts,
functions sent by value, Ctrl-C, the process-per-GPU example.

The functions the children run live in tests/procs/gpu_tasks.py (the spawned processes
import them by name, without pytest) and do not touch CUDA at import time.
"""

from __future__ import annotations

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
from ctxkit.procs import DeviceTaskError, run_per_device
from tests.procs.gpu_tasks import (
    N,
    bound_ordinal,
    expected,
    fault_first_attempt,
    fault_on,
    scale,
    scale_on_device,
    spin_on,
    what_the_child_sees,
)
from tests.procs.proctools import alive, transport
from tests.support.mpi_launch import child_env

REPO = Path(__file__).resolve().parents[2]


def two_devices() -> list[int]:
    if ck.device_count() < 2:
        pytest.skip("needs at least two CUDA devices")
    return [0, 1]


# --- binding and results --------------------------------------------------------------


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


def test_one_child_binds_its_gpu_and_returns_through_shared_memory():
    ((bus, ordinal, y, pid),) = run_per_device(scale_on_device, [0], args=(N, 3.0))
    assert ordinal == 0 and bus == ck.Device(0).pci_bus_id and pid != os.getpid()
    np.testing.assert_array_equal(y, expected(N, 3.0, 0))
    assert transport(y) == "shm"  # 4 MiB: above SHM_THRESHOLD


def test_a_lambda_runs_by_value_with_the_context_bound():
    pytest.importorskip("cloudpickle")
    alpha = 4.0
    out = run_per_device(lambda o: (bound_ordinal(), scale(1024, alpha, o)), [0])
    assert out[0][0] == 0
    np.testing.assert_array_equal(out[0][1], expected(1024, alpha, 0))


@pytest.mark.multigpu
def test_isolate_shows_each_child_only_its_gpu():
    devices = two_devices()
    out = run_per_device(what_the_child_sees, devices, isolate=True)
    for i, (count, visible, bus, ordinal) in enumerate(out):
        assert count == 1 and ordinal == i and visible is not None
        assert bus == ck.Device(i).pci_bus_id


# --- faults, retries, timeouts --------------------------------------------------------


@pytest.mark.multigpu
def test_fault_in_one_child_keeps_the_other_result():
    devices = two_devices()
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(fault_on, devices, args=(1, N))
    err = info.value
    assert err.device == 1 and err.kind == "exception"
    assert err.code == 700 and err.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert err.exception_type == "ctxkit.errors.ContextPoisonedError"
    assert "ILLEGAL_ADDRESS" in str(err) and "fault" in err.traceback
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
    pids = [f.pid for f in err.failures.values()]
    assert pids and not any(alive(p) for p in pids if p)
    # the GPU is usable again once the stuck process is gone
    assert run_per_device(scale_on_device, [slow], args=(1024, 1.0))[0][1] == slow


# --- Ctrl-C and the example -----------------------------------------------------------


def test_sigint_to_parent_with_gpu_children(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys\n"
        "from tests.procs.gpu_tasks import spin_on\n"
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


def test_process_per_gpu_example():
    res = subprocess.run(
        [sys.executable, "examples/process_per_gpu.py", "--quick"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1].startswith("OK")
    buses = re.findall(r"device \d+ \(([0-9A-Fa-f:.]+)\)", res.stdout)
    assert len(buses) == ck.device_count() and len(set(buses)) == len(buses)
