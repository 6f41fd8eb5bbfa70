"""Process-per-device plumbing on CPU: spawn, results, failures, retries, pool, transport.

The spawned children import this module to find the functions below, so they are
defined at module level. ``_bind=False`` runs the plumbing with explicit ordinals and no
context binding (no GPU here); tests/procs/test_pool_gpu.py covers the binding.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.procs as procs
from ctxkit.errors import ContextPoisonedError, CudaError
from ctxkit.procs import DevicePool, DeviceTaskError, run_per_device
from ctxkit.procs import wire as _procwire

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


# --- functions run in children --------------------------------------------------------


def report(ordinal, scale=1, *, offset=0):
    time.sleep(0.3 if ordinal == 2 else 0.0)  # device 2 finishes last
    return ordinal * scale + offset, os.getpid(), procs.worker_device()


def fail_on_one(ordinal):
    if ordinal == 1:
        raise ValueError(f"bad input on device {ordinal}")
    return ordinal


def mixed_failures(ordinal):
    if ordinal == 1:
        raise KeyError("missing")
    if ordinal == 2:
        os._exit(3)
    return ordinal


def exit_with(ordinal, code):
    if ordinal == 1:
        os._exit(code)
    return ordinal


def kill_self(ordinal):
    if ordinal == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return ordinal


def sleep_and_report(ordinal, seconds, pid_dir):
    Path(pid_dir, f"{ordinal}.pid").write_text(str(os.getpid()))
    time.sleep(seconds)
    return ordinal


def ignore_term_and_sleep(ordinal, pid_dir):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(pid_dir, f"{ordinal}.pid").write_text(str(os.getpid()))
    time.sleep(60)


def fail_first_attempt(ordinal, marker_dir, how):
    marker = Path(marker_dir, f"attempt-{ordinal}")
    n = int(marker.read_text()) if marker.exists() else 0
    marker.write_text(str(n + 1))
    if n == 0:
        if how == "crash":
            os._exit(7)
        raise RuntimeError("first attempt fails")
    return ordinal, n + 1


def always_fails(ordinal):
    raise RuntimeError(f"never works on {ordinal}")


def return_unpicklable(ordinal):
    return lambda: ordinal


def big_result(ordinal, n):
    return np.full(n, ordinal, dtype=np.float32)


def visible_devices(ordinal):
    return ordinal, os.environ.get("CUDA_VISIBLE_DEVICES")


def exit_via_sys_exit(ordinal):
    sys.exit(f"leaving from {ordinal}")


def raise_cuda_error(ordinal):
    raise CudaError("launch failed on purpose", 719, "CUDA_ERROR_LAUNCH_FAILED")


def echo(x):
    return x


def device_and_pid(delay=0.0):
    time.sleep(delay)
    return procs.worker_device(), os.getpid()


def poison():
    raise ContextPoisonedError("fake fault", 700, "CUDA_ERROR_ILLEGAL_ADDRESS")


def crash_task():
    os._exit(5)


def failing_initializer(msg):
    raise OSError(msg)


_initialised: list[str] = []


def remember(tag):
    _initialised.append(tag)


def initialised():
    return list(_initialised)


def add(a, b):
    return a + b


def exit_at_start(code):
    os._exit(code)


def _refuse_outside_children():
    if procs.worker_device() is None:
        raise RuntimeError("this object only loads inside a ctxkit child")
    return "loaded"


class ChildOnly:
    def __reduce__(self):
        return (_refuse_outside_children, ())


def child_only_result(*_args):
    return ChildOnly()


# --- helpers --------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """True for a running (not zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def wait_dead(pids, seconds=10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def shm_names() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


@pytest.fixture(autouse=True)
def no_children_left():
    yield
    assert multiprocessing.active_children() == []


# --- run_per_device -------------------------------------------------------------------


def test_results_come_back_in_device_order():
    out = run_per_device(report, [2, 0, 1], args=(10,), kwargs={"offset": 1}, _bind=False)
    assert [r[0] for r in out] == [21, 1, 11]
    assert [r[2] for r in out] == [2, 0, 1]  # worker_device() in each child
    pids = [r[1] for r in out]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert wait_dead(pids) == []
    assert procs.worker_device() is None


def test_exception_comes_back_with_child_traceback_and_other_results():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(fail_on_one, [0, 1, 2], _bind=False)
    err = info.value
    assert isinstance(err, CudaError) and isinstance(err, RuntimeError)
    assert err.device == 1 and err.kind == "exception"
    assert err.exception_type == "builtins.ValueError"
    assert "fail_on_one" in err.traceback and "bad input on device 1" in err.traceback
    assert "device 1" in str(err) and "Traceback" in str(err)
    assert isinstance(err.child_exception, ValueError)
    assert err.results == [0, None, 2]
    assert set(err.failures) == {1} and err.failures[1] is err
    assert err.pid is not None and not alive(err.pid)


def test_several_failures_are_all_reported():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(mixed_failures, [0, 1, 2], _bind=False)
    err = info.value
    assert err.device == 1 and err.kind == "exception"
    assert "2 of 3 devices failed" in str(err) and "device 2: crash" in str(err)
    assert err.results == [0, None, None]
    assert err.failures[2].kind == "crash" and err.failures[2].exitcode == 3
    assert err.failures[1].exception_type == "builtins.KeyError"


def test_crash_reports_exit_code():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(exit_with, [0, 1], args=(3,), _bind=False)
    err = info.value
    assert err.kind == "crash" and err.exitcode == 3 and err.device == 1
    assert "exited with code 3" in str(err) and err.traceback == ""
    assert err.results == [0, None]


def test_exit_code_zero_without_result_is_a_crash():
    with pytest.raises(DeviceTaskError, match="exited with code 0 before sending a result"):
        run_per_device(exit_with, [0, 1], args=(0,), _bind=False)


def test_signal_death_names_the_signal():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(kill_self, [0, 1], _bind=False)
    assert info.value.exitcode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value) and info.value.results == [None, 1]


def test_sys_exit_is_reported_as_exception():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(exit_via_sys_exit, [0], _bind=False)
    assert info.value.exception_type == "builtins.SystemExit"
    assert "leaving from 0" in str(info.value)


def test_cuda_error_code_and_name_are_carried_over():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(raise_cuda_error, [0], _bind=False)
    err = info.value
    assert err.code == 719 and err.name == "CUDA_ERROR_LAUNCH_FAILED"
    assert err.exception_type == "ctxkit.errors.CudaError"


def test_timeout_stops_the_child(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(sleep_and_report, [0, 1], args=(60, str(tmp_path)), timeout=1.5, _bind=False)
    assert time.monotonic() - t0 < 15
    err = info.value
    assert err.kind == "timeout" and "did not finish within 1.5 s" in str(err)
    assert set(err.failures) == {0, 1}
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and wait_dead(pids, 2) == []


def test_timeout_kills_a_child_that_ignores_sigterm(tmp_path, monkeypatch):
    monkeypatch.setattr(_procwire, "TERM_GRACE_S", 0.5)
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(ignore_term_and_sleep, [0], args=(str(tmp_path),), timeout=1.5, _bind=False)
    assert info.value.kind == "timeout" and info.value.exitcode == -signal.SIGKILL
    pid = int((tmp_path / "0.pid").read_text())
    assert not alive(pid)


def slow_on_one(ordinal):
    if ordinal == 1:
        time.sleep(60)
    return ordinal * 2


def test_fast_device_result_survives_a_slow_one():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(slow_on_one, [0, 1], timeout=2, _bind=False)
    assert info.value.device == 1 and info.value.kind == "timeout"
    assert info.value.results == [0, None]


@pytest.mark.parametrize("how", ["exception", "crash"])
def test_retry_succeeds_in_a_fresh_process(tmp_path, how):
    out = run_per_device(
        fail_first_attempt, [0, 1], args=(str(tmp_path), how), retries=1, _bind=False
    )
    assert out == [(0, 2), (1, 2)]


def test_retries_exhausted_reports_attempts():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(always_fails, [0], retries=2, _bind=False)
    assert info.value.attempts == 3 and "attempt 3 of 3" in str(info.value)


def test_unpicklable_result_is_explained():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(return_unpicklable, [0], _bind=False)
    assert info.value.exception_type == "builtins.TypeError"
    assert "cannot be pickled back to the parent" in str(info.value)


def test_result_that_does_not_load_in_the_parent():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(child_only_result, [0], _bind=False)
    assert "device 0: result not loadable" in str(info.value)
    assert "only loads inside a ctxkit child" in str(info.value)


def test_large_result_travels_through_shared_memory():
    before = shm_names()
    n = (4 << 20) // 4
    out = run_per_device(big_result, [0, 1], args=(n,), _bind=False)
    assert [a.shape for a in out] == [(n,), (n,)]
    assert float(out[0].sum()) == 0.0 and float(out[1].sum()) == n
    assert shm_names() - before == set()


def test_isolate_gives_each_child_one_visible_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert run_per_device(visible_devices, [0, 1], isolate=True, _bind=False) == [
        (0, "0"),
        (1, "1"),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-abc")
    out = run_per_device(visible_devices, [0, 1], isolate=True, _bind=False)
    assert out == [(0, "3"), (1, "GPU-abc")]
    assert run_per_device(visible_devices, [1], _bind=False) == [(1, "3, GPU-abc")]


def test_isolate_with_too_short_visible_list():
    with pytest.raises(ValueError, match="not in this process's CUDA_VISIBLE_DEVICES"):
        _procwire.visible_entry(2, "0,1")


def local_function_holder():
    def inner(ordinal):
        return ordinal

    return inner


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda o: o, "lambda or a nested function"),
        (local_function_holder(), "lambda or a nested function"),
        (42, "expected a callable"),
    ],
)
def test_unshippable_functions_are_refused_before_spawning(fn, match):
    t0 = time.monotonic()
    with pytest.raises(TypeError, match=match):
        run_per_device(fn, [0], _bind=False)
    assert time.monotonic() - t0 < 1.0


def test_unpicklable_arguments_are_refused():
    import threading

    with pytest.raises(TypeError, match="must be picklable"):
        run_per_device(report, [0], args=(threading.Lock(),), _bind=False)


def test_function_from_interactive_main_is_refused(monkeypatch):
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    fn = types.FunctionType(report.__code__, {}, "typed_at_prompt")
    fn.__module__ = "__main__"
    with pytest.raises(TypeError, match="interactive session"):
        run_per_device(fn, [0], _bind=False)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_non_spawn_context_is_refused(method):
    with pytest.raises(ValueError, match="needs the 'spawn' start method"):
        run_per_device(report, [0], mp_context=multiprocessing.get_context(method), _bind=False)
    with pytest.raises(ValueError, match="'spawn'"):
        DevicePool([0], mp_context=multiprocessing.get_context(method), _bind=False)


def test_explicit_spawn_context_is_accepted():
    ctx = multiprocessing.get_context("spawn")
    assert run_per_device(fail_on_one, [0], mp_context=ctx, _bind=False) == [0]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"devices": []}, ValueError, "needs at least one device"),
        ({"devices": [0, 1, 0]}, ValueError, "device 0 is listed twice"),
        ({"devices": None}, ValueError, "explicit list of device ordinals"),
        ({"devices": ["0"]}, TypeError, "int ordinal"),
        ({"devices": [True]}, TypeError, "int ordinal"),
        ({"devices": [0], "timeout": 0}, ValueError, "timeout must be"),
        ({"devices": [0], "retries": -1}, ValueError, "retries must be"),
        ({"devices": [0], "retries": True}, ValueError, "retries must be"),
    ],
)
def test_argument_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        run_per_device(report, _bind=False, **kwargs)


@pytest.mark.skipif(ck.device_count() > 0, reason="checks the no-GPU error")
def test_without_gpu_binding_fails_before_spawning():
    with pytest.raises(CudaError):
        run_per_device(report)
    with pytest.raises(CudaError):
        run_per_device(report, [0])
    with pytest.raises(CudaError):
        DevicePool()


def test_device_task_error_pickles():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(fail_on_one, [0, 1], _bind=False)
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.device == 1 and copy.results == [0, None]
    assert copy.failures[1] is copy


# --- interrupts and parent death (a parent program in a subprocess) -------------------

PARENT_SCRIPT = """
import os, sys, time
from pathlib import Path
from ctxkit import procs

def work(ordinal, pid_dir):
    Path(pid_dir, f"{ordinal}.pid").write_text(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    mode, pid_dir = sys.argv[1], sys.argv[2]
    try:
        if mode == "run":
            procs.run_per_device(work, [0, 1], args=(pid_dir,), _bind=False)
        else:
            with procs.DevicePool([0, 1], _bind=False) as pool:
                futures = [pool.submit(work, d, pid_dir, device=d) for d in (0, 1)]
                [f.result() for f in futures]
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        raise
"""


def start_parent(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT_SCRIPT))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(pid_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    while len(list(pid_dir.glob("*.pid"))) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"children did not start: {out}\n{err}")
        time.sleep(0.05)
    time.sleep(0.1)
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    return proc, pids


@pytest.mark.parametrize("mode", ["run", "pool"])
def test_keyboard_interrupt_stops_children_then_propagates(tmp_path, mode):
    proc, pids = start_parent(tmp_path, mode)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert "INTERRUPTED" in out, err
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert wait_dead(pids, 5) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
@pytest.mark.parametrize("mode", ["run", "pool"])
def test_children_die_with_a_killed_parent(tmp_path, mode):
    proc, pids = start_parent(tmp_path, mode)
    proc.kill()
    proc.communicate(timeout=30)
    assert wait_dead(pids, 10) == []


# --- DevicePool -----------------------------------------------------------------------


@pytest.fixture
def pool():
    p = DevicePool([0, 1], _bind=False)
    yield p
    p.shutdown()


def test_pool_runs_tasks_on_the_requested_device(pool):
    assert pool.submit(add, 2, b=3).result(30) == 5
    assert pool.submit(device_and_pid, device=1).result(30)[0] == 1
    assert pool.submit(device_and_pid, device=0).result(30)[0] == 0
    assert pool.devices == [0, 1]
    pids = pool.pids
    assert set(pids) == {0, 1} and all(alive(p) for p in pids.values() if p)
    assert "DevicePool devices=[0, 1] running" in repr(pool)


def test_pool_many_quick_round_trips(pool):
    # a worker may answer before submit() returns: the reply must never be lost
    for i in range(300):
        assert pool.submit(add, i, 1).result(10) == i + 1


def test_pool_spreads_work_over_devices(pool):
    futures = [pool.submit(device_and_pid, 0.2) for _ in range(6)]
    devices = [f.result(30)[0] for f in futures]
    assert sorted(set(devices)) == [0, 1] and devices.count(0) == devices.count(1) == 3


def test_pool_exception_keeps_the_worker(pool):
    pid = pool.submit(device_and_pid, device=0).result(30)[1]
    err = pool.submit(always_fails, 0, device=0).exception(30)
    assert isinstance(err, DeviceTaskError) and err.kind == "exception" and err.device == 0
    assert "never works on 0" in err.traceback and "always_fails" in str(err)
    assert pool.submit(device_and_pid, device=0).result(30)[1] == pid


def test_pool_crash_fails_that_task_and_replaces_the_worker(pool):
    pid = pool.submit(device_and_pid, device=1).result(30)[1]
    crashed = pool.submit(crash_task, device=1)
    queued = [pool.submit(add, i, 1, device=1) for i in range(3)]
    err = crashed.exception(30)
    assert isinstance(err, DeviceTaskError) and err.kind == "crash" and err.exitcode == 5
    assert "crash_task" in str(err) and "replaced" in str(err)
    assert [f.result(60) for f in queued] == [1, 2, 3]
    new_pid = pool.submit(device_and_pid, device=1).result(30)[1]
    assert new_pid != pid and wait_dead([pid], 5) == []


def test_pool_replaces_a_worker_after_a_sticky_error(pool):
    pid = pool.submit(device_and_pid, device=0).result(30)[1]
    err = pool.submit(poison, device=0).exception(30)
    assert isinstance(err, DeviceTaskError) and err.code == 700
    assert err.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert pool.submit(device_and_pid, device=0).result(60)[1] != pid


def test_pool_replaces_a_worker_killed_while_idle(pool):
    pid = pool.submit(device_and_pid, device=0).result(30)[1]
    os.kill(pid, signal.SIGKILL)
    assert wait_dead([pid], 5) == []
    deadline = time.monotonic() + 30
    while pool.pids[0] in (pid, None) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.submit(add, 1, 1, device=0).result(30) == 2


def test_pool_large_arrays_use_shared_memory(pool):
    before = shm_names()
    a = np.arange(1 << 20, dtype=np.float64)  # 8 MiB
    data, blocks = _procwire.encode((echo, (a,), {}), _procwire.SHM_THRESHOLD)
    assert len(blocks) == 1 and len(data) < 10_000
    _procwire.discard(blocks)
    b = pool.submit(echo, a).result(30)
    assert np.array_equal(a, b) and b is not a
    small = np.arange(10)
    assert np.array_equal(pool.submit(echo, small).result(30), small)
    assert shm_names() - before == set()


def test_pool_without_shared_memory():
    a = np.arange(1 << 19, dtype=np.float64)
    with DevicePool([0], shm_threshold=None, _bind=False) as p:
        assert np.array_equal(p.submit(echo, a).result(30), a)


def test_pool_rejects_bad_submissions(pool):
    with pytest.raises(ValueError, match=r"device 5 is not in this pool \(devices \[0, 1\]\)"):
        pool.submit(add, 1, 2, device=5)
    with pytest.raises(TypeError, match="nested function"):
        pool.submit(lambda: 1)
    import threading

    with pytest.raises(TypeError, match="must be picklable"):
        pool.submit(echo, threading.Lock())


def test_pool_shutdown_waits_and_refuses_new_work():
    p = DevicePool([0, 1], _bind=False)
    futures = [p.submit(device_and_pid, 0.1) for _ in range(4)]
    pids = [pid for pid in p.pids.values() if pid]
    p.shutdown(wait=True)
    assert all(f.done() for f in futures) and all(f.exception() is None for f in futures)
    with pytest.raises(RuntimeError, match="after shutdown"):
        p.submit(add, 1, 2)
    assert wait_dead(pids, 5) == []
    assert p.pids == {0: None, 1: None} and "shut down" in repr(p)
    p.shutdown()  # idempotent


def test_pool_shutdown_can_cancel_queued_work():
    p = DevicePool([0], _bind=False)
    first = p.submit(device_and_pid, 0.5)
    queued = [p.submit(add, i, 0) for i in range(5)]
    time.sleep(0.2)
    p.shutdown(wait=True, cancel_futures=True)
    assert first.result() is not None
    assert all(f.cancelled() for f in queued)


def test_pool_initializer_runs_in_each_worker():
    with DevicePool([0, 1], initializer=remember, initargs=("ready",), _bind=False) as p:
        assert p.submit(initialised, device=0).result(30) == ["ready"]
        assert p.submit(initialised, device=1).result(30) == ["ready"]


def test_pool_initializer_failure_breaks_that_device():
    with DevicePool([0], initializer=failing_initializer, initargs=("no disk",), _bind=False) as p:
        f = p.submit(add, 1, 2)
        err = f.exception(30)
        assert isinstance(err, DeviceTaskError) and err.kind == "init"
        assert "failed to start" in str(err) and "no disk" in err.traceback
        with pytest.raises(DeviceTaskError, match="failed to start"):
            p.submit(add, 1, 2)
        with pytest.raises(DeviceTaskError):
            p.submit(add, 1, 2, device=0)
    with pytest.raises(TypeError, match="nested function"):
        DevicePool([0], initializer=lambda: None, _bind=False)


def test_pool_worker_dying_during_start_breaks_that_device():
    with DevicePool([0, 1], initializer=exit_at_start, initargs=(9,), _bind=False) as p:
        err = p.submit(add, 1, 2, device=1).exception(30)
        assert isinstance(err, DeviceTaskError) and err.kind == "init" and err.exitcode == 9
        assert "exited with code 9 while starting" in str(err)


def test_pool_result_that_does_not_load_in_the_parent(pool):
    err = pool.submit(child_only_result).exception(30)
    assert isinstance(err, DeviceTaskError) and "result not loadable" in str(err)
    assert pool.submit(add, 2, 2).result(30) == 4


def test_pool_context_manager_terminates_on_exception(tmp_path):
    with pytest.raises(KeyError), DevicePool([0, 1], _bind=False) as p:
        running = p.submit(sleep_and_report, 0, 60, str(tmp_path), device=0)
        queued = p.submit(add, 1, 1, device=0)
        while not list(tmp_path.glob("*.pid")):
            time.sleep(0.05)
        pid = int((tmp_path / "0.pid").read_text())
        raise KeyError("user code failed")
    err = running.exception(5)
    assert isinstance(err, DeviceTaskError) and err.kind == "terminated"
    assert queued.cancelled()
    assert wait_dead([pid], 5) == []


def test_pool_terminate_is_idempotent():
    p = DevicePool([0], _bind=False)
    p.terminate()
    p.terminate()
    with pytest.raises(RuntimeError):
        p.submit(add, 1, 1)


# --- transport and helpers ------------------------------------------------------------


def test_encode_keeps_small_buffers_in_band_and_moves_large_ones():
    small, large = np.arange(100), np.arange(1 << 18, dtype=np.float32)
    data, blocks = _procwire.encode({"s": small, "l": large}, threshold=2 << 20)
    assert blocks == []
    before = shm_names()
    data, blocks = _procwire.encode({"s": small, "l": large}, threshold=1 << 10)
    assert [size for _, size in blocks] == [large.nbytes]
    assert {name for name, _ in blocks} <= shm_names()
    out = _procwire.decode(data, blocks)
    assert np.array_equal(out["s"], small) and np.array_equal(out["l"], large)
    out["l"][0] = 7.0  # writable, owns its memory after the name is gone
    assert shm_names() - before == set()
    assert _procwire.encode(large, threshold=None)[1] == []


def test_decode_without_dev_shm_copies(monkeypatch):
    large = np.arange(1 << 12, dtype=np.float64)
    data, blocks = _procwire.encode(large, threshold=1)
    monkeypatch.setattr(_procwire, "_SHM_DIR", "/nonexistent-shm-dir")
    assert np.array_equal(_procwire.decode(data, blocks), large)
    assert not any((SHM / name).exists() for name, _ in blocks)


def test_discard_unlinks_undelivered_blocks():
    _data, blocks = _procwire.encode(np.zeros(4096), threshold=1)
    assert all((SHM / n).exists() for n, _ in blocks)
    _procwire.discard(blocks)
    _procwire.discard(blocks)  # already gone: no error
    assert not any((SHM / n).exists() for n, _ in blocks)


def test_encode_failure_leaves_no_blocks():
    import threading

    before = shm_names()
    with pytest.raises(TypeError):
        _procwire.encode([np.zeros(4096), threading.Lock()], threshold=1)
    assert shm_names() - before == set()


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling")


def test_describe_exception_survives_unpicklable_exceptions():
    try:
        raise Unpicklable("odd")
    except Unpicklable as exc:
        desc = _procwire.describe_exception(exc)
    assert desc["pickled"] is None and desc["message"] == "odd"
    assert desc["type"].endswith("Unpicklable") and "raise Unpicklable" in desc["traceback"]
    assert _procwire.unpickle_exception(desc) is None
    assert isinstance(
        _procwire.unpickle_exception(_procwire.describe_exception(KeyError(1))), KeyError
    )


def test_exit_reason_wording():
    assert _procwire.exit_reason(None) == "is still running"
    assert _procwire.exit_reason(3) == "exited with code 3"
    assert _procwire.exit_reason(-9) == "was killed by SIGKILL (9)"
    assert "signal 200" in _procwire.exit_reason(-200)


def test_child_setup_refuses_isolation_after_cuda_init(monkeypatch):
    from ctxkit import _driver

    monkeypatch.setattr(_driver, "_init_pid", os.getpid())
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    with pytest.raises(RuntimeError, match="CUDA was already initialised"):
        _procwire.child_setup(os.getppid(), "0")


def test_examples_and_benchmark_exit_2_without_gpu():
    if ck.device_count() > 0:
        pytest.skip("checks the no-GPU exit")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for script in ("examples/process_per_gpu.py", "benchmarks/bench_procs.py"):
        res = subprocess.run(
            [sys.executable, str(REPO / script), "--quick"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert res.returncode == 2, (script, res.stdout, res.stderr)
        lines = (res.stdout + res.stderr).strip().splitlines()
        assert len(lines) == 1 and "no GPU" in lines[0]
