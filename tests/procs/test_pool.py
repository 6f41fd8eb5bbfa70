"""``DevicePool`` on CPU: scheduling, failures and replacement, timeouts, shared memory,
the ``Executor`` contract, what can be sent, fork safety.

The workers run the functions of tests/procs/pool_tasks.py (pickled by reference: each
worker imports that module, which imports no pytest). ``_bind=False`` runs the plumbing
with explicit ordinals and no context (no GPU here); tests/procs/test_pool_gpu.py covers
the binding.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import CancelledError, Executor
from pathlib import Path

import numpy as np
import pytest

from ctxkit.procs import DevicePool, DeviceTaskError, TaskOptions, spawn, wire
from tests.procs.pool_tasks import (
    MiB,
    add,
    call,
    crash_task,
    device_and_pid,
    echo,
    exit_at_start,
    failing_initializer,
    ignore_term_and_sleep,
    initialised,
    kill_self,
    leave_a_block_and,
    ones_without_room,
    poison,
    raise_str_raises,
    remember,
    sleep_and_record,
    sleep_forever,
    takes_anything,
    takes_device,
    transports,
    wait_for_gate,
)
from tests.procs.proctools import (
    SHARED_POOLS,
    alive,
    own_blocks,
    transport,
    wait_dead,
    wait_for,
)
from tests.procs.spawn_tasks import always_fails, child_only_result

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool():
    """One pool for the tests that need no fresh one: each leaves it working (a replaced
    worker included), so starting two workers per test is not needed."""
    p = DevicePool([0, 1], _bind=False)
    SHARED_POOLS.append(p)
    yield p
    SHARED_POOLS.remove(p)
    pids = [pid for pid in p.pids.values() if pid]
    p.shutdown()
    assert wait_dead(pids, 5) == []


@pytest.fixture
def gate(tmp_path):
    """A file path tasks wait for (``wait_for_gate``); the test creates it to let them go."""
    path = tmp_path / "gate"
    yield str(path)
    path.touch()  # never leave a task waiting


# --- running tasks --------------------------------------------------------------------


def test_pool_runs_tasks_on_the_requested_device(pool):
    assert pool.submit(add, 2, b=3).result(60) == 5
    assert pool.submit_to(1, device_and_pid).result(60)[0] == 1
    assert pool.submit_to(0, device_and_pid).result(60)[0] == 0
    assert pool.submit_to(TaskOptions(device=1), device_and_pid).result(60)[0] == 1
    assert pool.submit_to(None, device_and_pid).result(60)[0] in (0, 1)
    assert pool.devices == [0, 1]
    pids = pool.pids
    assert set(pids) == {0, 1} and all(alive(p) for p in pids.values() if p)
    assert "DevicePool devices=[0, 1] running" in repr(pool)


def test_pool_many_quick_round_trips(pool):
    # a worker may answer before submit() returns: the reply must never be lost
    for i in range(300):
        assert pool.submit(add, i, 1).result(30) == i + 1


def test_pool_spreads_work_over_devices(pool, gate):
    futures = [pool.submit(wait_for_gate, gate) for _ in range(6)]  # none can finish yet
    Path(gate).touch()
    devices = [f.result(60)[0] for f in futures]
    assert devices.count(0) == devices.count(1) == 3


def test_pool_exception_keeps_the_worker(pool):
    pid = pool.submit_to(0, device_and_pid).result(60)[1]
    err = pool.submit_to(0, always_fails, 0).exception(60)
    assert isinstance(err, DeviceTaskError) and err.kind == "exception" and err.device == 0
    assert "never works on 0" in err.traceback and "always_fails" in str(err)
    assert pool.submit_to(0, device_and_pid).result(60)[1] == pid


def test_pool_exception_whose_str_raises_is_reported_and_keeps_the_worker(pool):
    pid = pool.submit_to(0, device_and_pid).result(60)[1]
    err = pool.submit_to(0, raise_str_raises).exception(60)
    assert isinstance(err, DeviceTaskError) and err.kind == "exception"
    assert "str() of this StrRaises raised ValueError: no words for this" in str(err)
    assert pool.submit_to(0, device_and_pid).result(60)[1] == pid


def test_pool_crash_fails_that_task_and_replaces_the_worker(pool):
    pid = pool.submit_to(1, device_and_pid).result(60)[1]
    crashed = pool.submit_to(1, crash_task)
    queued = [pool.submit_to(1, add, i, 1) for i in range(3)]
    err = crashed.exception(60)
    assert isinstance(err, DeviceTaskError) and err.kind == "crash" and err.exitcode == 5
    assert "crash_task" in str(err) and "replaced" in str(err) and "native crash" in str(err)
    assert [f.result(60) for f in queued] == [1, 2, 3]
    new_pid = pool.submit_to(1, device_and_pid).result(60)[1]
    assert new_pid != pid and wait_dead([pid], 5) == []


def test_pool_sigbus_is_reported_as_out_of_shared_memory(pool):
    err = pool.submit_to(0, kill_self, signal.SIGBUS).exception(60)
    assert isinstance(err, DeviceTaskError) and err.kind == "crash"
    assert err.exitcode == -signal.SIGBUS and "out of shared memory" in str(err)
    assert "--shm-size" in str(err) and "native crash" not in str(err)
    assert pool.submit_to(0, add, 1, 1).result(60) == 2


def test_pool_replaces_a_worker_after_a_sticky_error(pool):
    pid = pool.submit_to(0, device_and_pid).result(60)[1]
    err = pool.submit_to(0, poison).exception(60)
    assert isinstance(err, DeviceTaskError) and err.code == 700
    assert err.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert pool.submit_to(0, device_and_pid).result(60)[1] != pid


def test_pool_replaces_a_worker_killed_while_idle(pool):
    pid = pool.submit_to(0, device_and_pid).result(60)[1]
    os.kill(pid, signal.SIGKILL)
    assert wait_dead([pid], 5) == []
    wait_for(lambda: pool.pids[0] not in (pid, None), what="a replacement worker")
    assert pool.submit_to(0, add, 1, 1).result(60) == 2


def test_pool_result_that_does_not_load_in_the_parent(pool):
    err = pool.submit(child_only_result).exception(60)
    assert isinstance(err, DeviceTaskError) and "result not loadable" in str(err)
    assert pool.submit(add, 2, 2).result(60) == 4


# --- timeouts -------------------------------------------------------------------------


def test_pool_timeout_stops_a_hung_task_and_queued_work_continues(pool):
    pid = pool.submit_to(0, device_and_pid).result(60)[1]
    hung = pool.submit_to(TaskOptions(device=0, timeout=1.0), sleep_forever)
    queued = [pool.submit_to(0, add, i, 10) for i in range(3)]
    err = hung.exception(60)
    assert isinstance(err, DeviceTaskError) and err.kind == "timeout" and err.device == 0
    assert "sleep_forever" in str(err) and "did not finish within 1 s" in str(err)
    assert err.pid == pid and err.exitcode == -signal.SIGTERM
    assert [f.result(60) for f in queued] == [10, 11, 12]
    assert wait_dead([pid], 5) == [] and pool.pids[0] != pid
    assert pool.submit_to(1, add, 1, 1).result(60) == 2  # the other device never noticed


def test_pool_timeout_kills_a_task_that_ignores_sigterm(monkeypatch):
    monkeypatch.setattr(spawn, "TERM_GRACE_S", 0.5)
    # the initializer imports the tasks' module in each worker, outside any task's timeout
    with DevicePool([0], task_timeout=1.0, initializer=add, initargs=(0, 0), _bind=False) as p:
        err = p.submit(ignore_term_and_sleep).exception(60)
        assert isinstance(err, DeviceTaskError) and err.kind == "timeout"
        assert err.exitcode == -signal.SIGKILL
        assert p.submit(add, 2, 3).result(60) == 5  # task_timeout only stops slow tasks


def test_pool_timeout_counts_from_the_start_of_the_task(gate):
    with DevicePool([0], _bind=False) as p:
        first = p.submit(wait_for_gate, gate, "first")
        later = p.submit_to(TaskOptions(timeout=2.0), device_and_pid)
        time.sleep(3.0)  # longer than `later`'s timeout, all of it spent queued
        Path(gate).touch()
        assert first.result(60) == (0, "first")
        assert later.result(60)[0] == 0


@pytest.mark.parametrize("how", ["die", "hang"])
def test_pool_removes_the_blocks_of_a_worker_killed_while_sending(how):
    with DevicePool([0], initializer=add, initargs=(0, 0), _bind=False) as p:
        options = TaskOptions(timeout=2.0) if how == "hang" else None
        err = p.submit_to(options, leave_a_block_and, how).exception(60)
        assert isinstance(err, DeviceTaskError)
        assert err.kind == ("crash" if how == "die" else "timeout")
        assert own_blocks() == set()
        assert p.submit(add, 1, 2).result(60) == 3


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TaskOptions(timeout=0), "TaskOptions\\(timeout=\\) must be a positive"),
        (lambda: TaskOptions(timeout=True), "must be a positive"),
        (lambda: DevicePool([0], task_timeout=-1, _bind=False), "task_timeout must be"),
        (lambda: DevicePool([0], shm_limit=-1, _bind=False), "shm_limit must be"),
    ],
)
def test_bad_timeouts_and_limits_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --- the Executor contract and the device keyword -------------------------------------


def test_pool_is_a_concurrent_futures_executor():
    with DevicePool([0, 1], _bind=False) as p:
        assert isinstance(p, Executor)
        assert list(p.map(add, range(6), range(10, 16), timeout=120)) == list(range(10, 22, 2))
        assert list(p.map(echo, [])) == []
    with pytest.raises(RuntimeError, match="after shutdown"):
        p.submit(add, 1, 2)
    with pytest.raises(RuntimeError, match="after shutdown"):
        list(p.map(add, [1], [2]))


def test_submit_passes_a_device_keyword_to_the_task(pool):
    assert pool.submit(takes_device, 1, device="cuda:7").result(60) == (1, "cuda:7")
    assert pool.submit(takes_anything, device=3, timeout=4).result(60) == [
        ("device", 3),
        ("timeout", 4),
    ]
    assert pool.submit_to(1, takes_device, 2, device=0).result(60) == (2, 0)


def test_submit_device_keyword_goes_to_the_task_even_when_it_takes_none(pool):
    with pytest.raises(DeviceTaskError, match="unexpected keyword argument 'device'"):
        pool.submit(device_and_pid, device=1).result(60)


def test_pool_rejects_bad_submissions(pool, monkeypatch):
    with pytest.raises(ValueError, match=r"device 5 is not in this pool \(devices \[0, 1\]\)"):
        pool.submit_to(5, add, 1, 2)
    with pytest.raises(TypeError, match="int ordinal"):
        pool.submit_to("0", add, 1, 2)
    with pytest.raises(TypeError, match="must be picklable"):
        pool.submit(echo, threading.Lock())
    with pytest.raises(TypeError, match="expected a callable"):
        pool.submit(42)
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    with pytest.raises(TypeError, match="is a lambda.*install cloudpickle"):
        pool.submit(lambda: 1)
    with pytest.raises(TypeError, match="is a lambda.*install cloudpickle"):
        DevicePool([0], initializer=lambda: None, _bind=False)


def test_pool_sends_lambdas_and_closures_by_value(pool):
    pytest.importorskip("cloudpickle")
    offset = 5
    assert pool.submit(lambda x: x + offset, 1).result(60) == 6
    big = np.arange(MiB, dtype=np.float64)  # 8 MiB: still through shared memory
    kinds, sums = pool.submit(lambda a: transports(a), big).result(60)
    assert kinds == ["shm"] and sums == [float(big.sum())]
    # a lambda among the arguments of a module-level function is sent by value too
    assert pool.submit(call, lambda: 3).result(60) == 3
    with DevicePool(
        [0], initializer=lambda tag: remember(tag), initargs=("by value",), _bind=False
    ) as p:
        assert p.submit(initialised).result(60) == ["by value"]


# --- shared memory --------------------------------------------------------------------


def test_pool_large_arrays_use_shared_memory(pool):
    a = np.arange(MiB, dtype=np.float64)  # 8 MiB
    small = np.arange(10)
    kinds, sums = pool.submit(transports, a, small).result(60)
    assert kinds == ["shm", "pipe"] and sums == [float(a.sum()), 45.0]
    b = pool.submit(echo, a).result(60)
    assert np.array_equal(a, b) and b is not a and transport(b) == "shm"
    assert own_blocks() == set()


def test_pool_without_shared_memory():
    a = np.arange(MiB // 2, dtype=np.float64)
    with DevicePool([0], shm_threshold=None, _bind=False) as p:
        b = p.submit(echo, a).result(60)
        assert np.array_equal(b, a) and transport(b) == "pipe"
        assert p.submit(transports, a).result(60)[0] == ["pipe"]


def test_pool_shm_limit_caps_the_bytes_in_flight():
    a, b = np.ones(MiB), np.ones(MiB)  # 8 MiB each
    with DevicePool([0], shm_limit=9 * MiB, _bind=False) as p:
        kinds, sums = p.submit(transports, a, b).result(60)
        assert kinds == ["shm", "pipe"] and sums == [MiB, MiB]
        assert p.submit(transports, a).result(60)[0] == ["shm"]  # the budget came back
    with DevicePool([0], shm_limit=0, _bind=False) as p:
        assert p.submit(transports, a).result(60)[0] == ["pipe"]


def test_pool_puts_queued_arguments_in_shared_memory_only_when_sent(gate):
    with DevicePool([0], _bind=False) as p:
        first = p.submit(wait_for_gate, gate)
        queued = [p.submit(transports, np.full(MiB, float(i))) for i in range(3)]
        wait_for(first.running, what="the first task to start")
        assert own_blocks() == set()  # 24 MiB of queued arrays are not in /dev/shm
        Path(gate).touch()
        for i, f in enumerate(queued):
            assert f.result(60) == (["shm"], [i * MiB])


def test_pool_task_sees_its_arguments_as_they_were_at_submit(gate):
    a = np.zeros(MiB)
    with DevicePool([0], _bind=False) as p:
        p.submit(wait_for_gate, gate)
        queued = p.submit(transports, a)
        a[:] = 1.0  # after submit() returned, before the task is sent
        Path(gate).touch()
        assert queued.result(60) == (["shm"], [0.0])


def test_pool_without_room_in_dev_shm_uses_the_pipe(pool, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    a = np.arange(MiB, dtype=np.float64)
    kinds, sums = pool.submit(transports, a).result(60)
    assert kinds == ["pipe"] and sums == [float(a.sum())]
    assert own_blocks() == set()


def test_pool_failure_to_copy_an_argument_fails_that_task_only(pool, monkeypatch):
    def broken(fd, offset, length):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "posix_fallocate", broken)
    err = pool.submit_to(0, transports, np.ones(MiB)).exception(60)
    assert isinstance(err, OSError) and "Input/output error" in str(err)
    monkeypatch.undo()
    assert pool.submit_to(0, transports, np.ones(MiB)).result(60) == (["shm"], [MiB])
    assert own_blocks() == set()


def test_pool_submit_that_cannot_copy_a_queued_array_raises_and_the_queue_goes_on(
    gate, monkeypatch
):
    with DevicePool([0], _bind=False) as p:
        first = p.submit(wait_for_gate, gate, "first")
        wait_for(first.running, what="the first task to start")

        def no_memory(self):
            raise MemoryError("no room for a copy")

        with monkeypatch.context() as m:
            m.setattr(wire.Payload, "snapshot", no_memory)
            with pytest.raises(MemoryError, match="no room for a copy"):
                p.submit(transports, np.ones(MiB))
        after = p.submit(add, 1, 2)
        Path(gate).touch()
        assert first.result(60) == (0, "first") and after.result(60) == 3


def test_worker_without_room_in_dev_shm_sends_its_result_through_the_pipe():
    with DevicePool([0], _bind=False) as p:
        out = p.submit(ones_without_room, MiB).result(60)
        assert transport(out) == "pipe" and float(out.sum()) == MiB


# --- shutdown and terminate -----------------------------------------------------------


def test_pool_shutdown_waits_and_refuses_new_work():
    p = DevicePool([0, 1], _bind=False)
    futures = [p.submit(device_and_pid, 0.1) for _ in range(4)]
    wait_for(lambda: all(p.pids.values()), what="both workers")
    pids = list(p.pids.values())
    p.shutdown(wait=True)
    assert all(f.done() for f in futures) and all(f.exception() is None for f in futures)
    with pytest.raises(RuntimeError, match="after shutdown"):
        p.submit(add, 1, 2)
    assert wait_dead(pids, 5) == []
    assert p.pids == {0: None, 1: None} and "shut down" in repr(p)
    p.shutdown()  # idempotent


def test_pool_shutdown_can_cancel_queued_work(gate):
    p = DevicePool([0], _bind=False)
    first = p.submit(wait_for_gate, gate, "first")
    queued = [p.submit(add, i, 0) for i in range(5)]
    wait_for(first.running, what="the first task to start")
    threading.Timer(0.2, Path(gate).touch).start()
    p.shutdown(wait=True, cancel_futures=True)
    assert first.result() == (0, "first")
    assert all(f.cancelled() for f in queued)


def test_pool_shutdown_before_a_worker_started_cancels_everything():
    p = DevicePool([0], _bind=False)
    futures = [p.submit(add, i, 0) for i in range(3)]
    p.shutdown(wait=True, cancel_futures=True)
    for i, f in enumerate(futures):  # each either ran or was cancelled, none is left pending
        assert f.done()
        if f.cancelled():
            with pytest.raises(CancelledError):
                f.result()
        else:
            assert f.result() == i


def test_pool_initializer_runs_in_each_worker():
    with DevicePool([0, 1], initializer=remember, initargs=("ready",), _bind=False) as p:
        assert p.submit_to(0, initialised).result(60) == ["ready"]
        assert p.submit_to(1, initialised).result(60) == ["ready"]


def test_pool_initializer_failure_breaks_that_device():
    with DevicePool([0], initializer=failing_initializer, initargs=("no disk",), _bind=False) as p:
        f = p.submit(add, 1, 2)
        err = f.exception(60)
        assert isinstance(err, DeviceTaskError) and err.kind == "init"
        assert "failed to start" in str(err) and "no disk" in err.traceback
        with pytest.raises(DeviceTaskError, match="failed to start"):
            p.submit(add, 1, 2)
        with pytest.raises(DeviceTaskError):
            p.submit_to(0, add, 1, 2)


def test_pool_worker_dying_during_start_breaks_that_device():
    with DevicePool([0, 1], initializer=exit_at_start, initargs=(9,), _bind=False) as p:
        err = p.submit_to(1, add, 1, 2).exception(60)
        assert isinstance(err, DeviceTaskError) and err.kind == "init" and err.exitcode == 9
        assert "exited with code 9 while starting" in str(err)


def test_pool_context_manager_terminates_on_exception(tmp_path):
    with pytest.raises(KeyError), DevicePool([0, 1], _bind=False) as p:
        running = p.submit_to(0, sleep_and_record, 600, str(tmp_path))
        queued = p.submit_to(0, add, 1, 1)
        wait_for(lambda: (tmp_path / "running.pid").exists(), what="the task to start")
        wait_for(lambda: (tmp_path / "running.pid").read_text(), what="its pid")
        pid = int((tmp_path / "running.pid").read_text())
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


# --- fork -----------------------------------------------------------------------------

FORK_SCRIPT = """
import os, sys
from ctxkit import procs
from tests.procs.pool_tasks import device_and_pid

if __name__ == "__main__":
    pool = procs.DevicePool([0, 1], _bind=False)
    with pool:
        pids = [pool.submit_to(d, device_and_pid).result(60)[1] for d in (0, 1)]
        child = os.fork()
        if child == 0:  # the forked process uses the pool wrongly, then exits normally
            try:
                pool.submit(device_and_pid)
                print("CHILD submit accepted", flush=True)
            except RuntimeError as exc:
                print("CHILD refused:", exc, flush=True)
            pool.shutdown()
            pool.terminate()
            sys.exit(0)  # runs atexit: must not stop the parent's workers
        _, status = os.waitpid(child, 0)
        print("CHILD EXIT", os.waitstatus_to_exitcode(status), flush=True)
        same = [pool.submit_to(d, device_and_pid).result(60)[1] for d in (0, 1)]
        print("WORKERS", "same" if same == pids else f"replaced {pids} -> {same}", flush=True)
"""


def test_a_forked_process_leaves_the_parents_workers_alone(tmp_path):
    script = tmp_path / "forker.py"
    script.write_text(textwrap.dedent(FORK_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "CHILD refused: this DevicePool belongs to process" in res.stdout, res.stdout
    assert "CHILD EXIT 0" in res.stdout and "WORKERS same" in res.stdout, res.stdout
