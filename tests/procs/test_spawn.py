"""``run_per_device`` on CPU: results, failures, retries, timeouts, interrupts, what can be sent.

The children run the functions of tests/procs/spawn_tasks.py (pickled by reference: each
child imports that module, which imports no pytest). ``_bind=False`` runs the plumbing with
explicit ordinals and no context binding (no GPU here); tests/procs/test_spawn_gpu.py
covers the binding.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.procs as procs
from ctxkit.errors import CudaError
from ctxkit.procs import DeviceTaskError, run_per_device
from tests.procs.proctools import alive, own_blocks, transport, wait_dead
from tests.procs.spawn_tasks import (
    always_fails,
    big_result,
    big_result_without_room,
    child_only_result,
    die_while_sending,
    exit_via_sys_exit,
    exit_with,
    fail_first_attempt,
    fail_on_one,
    kill_self,
    mixed_failures,
    raise_cuda_error,
    raise_str_raises,
    report,
    return_unpicklable,
    sleep_forever,
    slow_on_one,
    visible_devices,
)

REPO = Path(__file__).resolve().parents[2]


def no_cloudpickle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cloudpickle", None)


def local_function_holder():
    def inner(ordinal):
        return ordinal

    return inner


# --- results and failures -------------------------------------------------------------


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
    assert "native crash" in str(err) and err.results == [0, None]


def test_exit_code_zero_without_result_is_a_crash():
    with pytest.raises(DeviceTaskError, match="exited with code 0 before sending a result"):
        run_per_device(exit_with, [0, 1], args=(0,), _bind=False)


def test_signal_death_names_the_signal():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(kill_self, [0, 1], _bind=False)
    assert info.value.exitcode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value) and info.value.results == [None, 1]


def test_sigbus_is_reported_as_out_of_shared_memory():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(kill_self, [0], args=(signal.SIGBUS,), _bind=False)
    err = info.value
    assert err.kind == "crash" and err.exitcode == -signal.SIGBUS
    assert "out of shared memory" in str(err) and "/dev/shm" in str(err)
    assert "native crash" not in str(err)


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


def test_exception_whose_str_raises_is_reported():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(raise_str_raises, [0], _bind=False)
    err = info.value
    assert err.kind == "exception" and err.exception_type.endswith("StrRaises")
    assert "str() of this StrRaises raised ValueError: no words for this" in str(err)
    assert "raise_str_raises" in err.traceback


def test_unpicklable_result_is_explained():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(return_unpicklable, [0], _bind=False)
    assert info.value.exception_type == "builtins.TypeError"
    assert "cannot be pickled back to the parent" in str(info.value)


def test_result_that_does_not_load_in_the_parent():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(child_only_result, [0], _bind=False)
    assert "device 0 (attempt 1 of 1): result not loadable" in str(info.value)
    assert "only loads inside a ctxkit child" in str(info.value)


def test_device_task_error_pickles():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(fail_on_one, [0, 1], _bind=False)
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.device == 1 and copy.results == [0, None]
    assert copy.failures[1] is copy


# --- timeouts and retries -------------------------------------------------------------


def test_timeout_stops_the_child():
    t0 = time.monotonic()
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(sleep_forever, [0, 1], timeout=1.5, _bind=False)
    assert time.monotonic() - t0 < 30
    err = info.value
    assert err.kind == "timeout" and "did not finish within 1.5 s" in str(err)
    assert set(err.failures) == {0, 1}
    pids = [f.pid for f in err.failures.values()]
    assert all(pids) and len(set(pids)) == 2 and os.getpid() not in pids
    assert wait_dead(pids, 2) == []


def test_fast_device_result_survives_a_slow_one():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(slow_on_one, [0, 1], timeout=5, _bind=False)
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


# --- results through shared memory ----------------------------------------------------


def test_large_result_travels_through_shared_memory():
    n = (4 << 20) // 4
    out = run_per_device(big_result, [0, 1], args=(n,), _bind=False)
    assert [a.shape for a in out] == [(n,), (n,)]
    assert float(out[0].sum()) == 0.0 and float(out[1].sum()) == n
    assert [transport(a) for a in out] == ["shm", "shm"]
    out[1][0] = 5.0  # writable, owns its memory
    assert own_blocks() == set()


def test_large_result_without_room_in_dev_shm_comes_through_the_pipe():
    n = (4 << 20) // 4
    out = run_per_device(big_result_without_room, [0, 1], args=(n,), _bind=False)
    assert transport(out[1]) == "pipe" and float(out[1].sum()) == n
    assert own_blocks() == set()


def test_blocks_of_a_child_that_dies_while_sending_are_removed():
    with pytest.raises(DeviceTaskError) as info:
        run_per_device(die_while_sending, [0, 1], args=(1 << 20,), _bind=False)
    assert info.value.kind == "crash" and set(info.value.failures) == {0, 1}
    assert own_blocks() == set()


# --- isolation ------------------------------------------------------------------------


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


# --- what can be sent -----------------------------------------------------------------


def test_lambda_and_closure_travel_by_value():
    pytest.importorskip("cloudpickle")
    scale = 7
    assert run_per_device(lambda o: o * scale, [0, 1], _bind=False) == [0, 7]

    def with_array(ordinal, a):
        return float(a.sum()) + ordinal

    a = np.ones(1 << 18)
    assert run_per_device(with_array, [0, 1], args=(a,), _bind=False) == [a.size, a.size + 1]
    assert run_per_device(local_function_holder(), [3], _bind=False) == [3]


def _interactive_function(monkeypatch: pytest.MonkeyPatch) -> types.FunctionType:
    main = types.ModuleType("__main__")  # no __file__, no __spec__: python -c, REPL
    monkeypatch.setitem(sys.modules, "__main__", main)
    exec("def typed_at_prompt(ordinal):\n    return ordinal * 11\n", main.__dict__)
    return main.__dict__["typed_at_prompt"]


def test_function_from_an_interactive_main_travels_by_value(monkeypatch):
    pytest.importorskip("cloudpickle")
    fn = _interactive_function(monkeypatch)
    assert fn.__module__ == "__main__"
    assert run_per_device(fn, [0, 1], _bind=False) == [0, 11]


def test_function_defined_in_python_c_runs_in_children():
    pytest.importorskip("cloudpickle")
    code = textwrap.dedent(
        """
        import numpy as np
        from ctxkit import procs
        def triple(ordinal, a):
            return ordinal * 3, float(a.sum())
        a = np.ones(1 << 19)
        print("RUN", procs.run_per_device(triple, [0, 1], args=(a,), _bind=False))
        with procs.DevicePool([0], _bind=False) as pool:
            print("POOL", pool.submit(lambda x: x * 2, 21).result(60))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0, res.stderr
    assert "RUN [(0, 524288.0), (3, 524288.0)]" in res.stdout
    assert "POOL 42" in res.stdout


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda o: o, "is a lambda"),
        (local_function_holder(), "nested function"),
    ],
)
def test_without_cloudpickle_unimportable_functions_are_refused(monkeypatch, fn, match):
    no_cloudpickle(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(TypeError, match=match) as info:
        run_per_device(fn, [0], _bind=False)
    assert "install cloudpickle" in str(info.value) and "module level" in str(info.value)
    assert time.monotonic() - t0 < 5.0  # refused before any process starts


def test_without_cloudpickle_an_interactive_function_is_refused(monkeypatch):
    fn = _interactive_function(monkeypatch)
    no_cloudpickle(monkeypatch)
    with pytest.raises(TypeError, match="interactive session"):
        run_per_device(fn, [0], _bind=False)


def test_non_callable_is_refused():
    with pytest.raises(TypeError, match="expected a callable"):
        run_per_device(42, [0], _bind=False)


def test_unpicklable_arguments_are_refused():
    with pytest.raises(TypeError, match="must be picklable"):
        run_per_device(report, [0], args=(threading.Lock(),), _bind=False)


def test_main_module_read_from_stdin_is_refused_clearly():
    script = textwrap.dedent(
        """
        from ctxkit import procs
        def work(ordinal):
            return ordinal
        if __name__ == "__main__":
            for what in ("run", "pool"):
                try:
                    if what == "run":
                        procs.run_per_device(work, [0], _bind=False)
                    else:
                        procs.DevicePool([0], _bind=False).shutdown()
                    print(what, "STARTED")
                except RuntimeError as exc:
                    print(what, "REFUSED", exc)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for what, line in zip(("run", "pool"), lines, strict=True):
        assert line.startswith(f"{what} REFUSED"), res.stdout + res.stderr
        assert "<stdin>" in line and "python -" in line and "Save the program" in line
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_non_spawn_context_is_refused(method):
    with pytest.raises(ValueError, match="needs the 'spawn' start method"):
        run_per_device(report, [0], mp_context=multiprocessing.get_context(method), _bind=False)
    with pytest.raises(ValueError, match="'spawn'"):
        procs.DevicePool([0], mp_context=multiprocessing.get_context(method), _bind=False)


def test_explicit_spawn_context_is_accepted():
    ctx = multiprocessing.get_context("spawn")
    assert run_per_device(fail_on_one, [0], mp_context=ctx, _bind=False) == [0]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"devices": []}, ValueError, "needs at least one device"),
        ({"devices": [0, 1, 0]}, ValueError, "device 0 is listed twice"),
        ({"devices": None}, ValueError, "explicit list of device ordinals"),
        ({"devices": ["0"]}, TypeError, "ints, Devices or Contexts"),
        ({"devices": [True]}, TypeError, "ints, Devices or Contexts"),
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
        procs.DevicePool()


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
                futures = [pool.submit_to(d, work, d, pid_dir) for d in (0, 1)]
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
    while len([p for p in pid_dir.glob("*.pid") if p.read_text()]) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"children did not start: {out}\n{err}")
        time.sleep(0.05)
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
