"""Child process helpers: exit wording, the out-of-shared-memory hint, isolation, set-up,
stopping a child that ignores SIGTERM."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from ctxkit.procs import spawn, wire


def test_exit_reason_wording():
    assert spawn.exit_reason(None) == "is still running"
    assert spawn.exit_reason(3) == "exited with code 3"
    assert spawn.exit_reason(-9) == "was killed by SIGKILL (9)"
    assert "signal 200" in spawn.exit_reason(-200)


def test_death_hint_names_shared_memory_for_sigbus_only(monkeypatch):
    monkeypatch.setattr(wire, "shm_space", lambda: (3 << 20, 64 << 20))
    hint = spawn.death_hint(-signal.SIGBUS)
    assert hint.startswith("out of shared memory") and "3 MiB free of 64 MiB" in hint
    assert "--shm-size" in hint and "--ipc=host" in hint
    for code in (-signal.SIGSEGV, -signal.SIGKILL, 1, None):
        assert "native crash" in spawn.death_hint(code)


def test_isolate_entries():
    assert spawn.visible_entry(1, None) == "1"
    assert spawn.visible_entry(1, "3, GPU-abc") == "GPU-abc"
    with pytest.raises(ValueError, match="not in this process's CUDA_VISIBLE_DEVICES"):
        spawn.visible_entry(2, "0,1")
    assert spawn.visible_for([0, 1], False) == [None, None]


def test_child_set_up_refuses_isolation_after_cuda_init(monkeypatch):
    from ctxkit import _driver

    monkeypatch.setattr(_driver, "_init_pid", os.getpid())
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    with pytest.raises(RuntimeError, match="CUDA was already initialised"):
        with spawn.Child(0, "0", False, parent_pid=os.getppid(), shm_prefix="x").setup():
            pass


def _ignore_term(ready):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(600)


def test_stop_processes_kills_a_child_that_ignores_sigterm():
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_ignore_term, args=(ready,))
    proc.start()
    assert ready.wait(60), "the child did not start"
    t0 = time.monotonic()
    spawn.stop_processes([proc], grace=0.5)
    assert proc.exitcode == -signal.SIGKILL
    assert 0.4 < time.monotonic() - t0 < 10


def test_stop_processes_ignores_processes_that_already_ended():
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=os.getpid)
    proc.start()
    proc.join()
    spawn.stop_processes([proc], grace=0.5)
    assert proc.exitcode == 0
