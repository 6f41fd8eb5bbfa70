"""``Pipeline`` without a driver: options are checked before the driver is touched, a
machine without a GPU gets a clear error, and waiting for a run handles Ctrl-C promptly."""

from __future__ import annotations

import _thread
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

import ctxkit as ck
from ctxkit.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        ({"devices": []}, ValueError, "at least one device"),
        ({"devices": 0}, TypeError, "sequence"),
        ({"devices": ["gpu0"]}, TypeError, "ints, Devices or Contexts"),
        ({"devices": [1, 1]}, ValueError, "listed twice"),
        ({"devices": [-1]}, ValueError, ">= 0"),
        ({"devices": [0], "options": {"staging_buffers": 0}}, ValueError, "staging_buffers"),
        ({"devices": [0], "options": {"chunk_bytes": 1.5}}, TypeError, "chunk_bytes must be"),
        ({"devices": [0], "options": {"host_threads": 0}}, ValueError, "host_threads"),
        ({"devices": [0], "options": {"schedule": "random"}}, ValueError, "schedule"),
        ({"devices": [0], "options": {"host_path": "fast"}}, ValueError, "host_path"),
        ({"devices": [0], "options": {"pin_cache_bytes": -1}}, ValueError, "pin_cache_bytes"),
        ({"devices": [0], "options": {"pin_cache_bytes": 1.5}}, ValueError, "pin_cache_bytes"),
        ({"devices": [0], "options": {"pin_cache_bytes": True}}, ValueError, "pin_cache_bytes"),
        ({"devices": [0], "options": {"pin_cache_bytes": "1G"}}, ValueError, "pin_cache_bytes"),
    ],
)
def test_constructor_validates_before_touching_the_driver(kw, exc, match):
    with pytest.raises(exc, match=match):
        opts = kw.get("options")
        Pipeline(kw["devices"], options=None if opts is None else ck.PipelineOptions(**opts))


def test_constructor_takes_only_pipeline_options():
    with pytest.raises(TypeError, match="options must be a ctxkit.PipelineOptions"):
        Pipeline([0], options={"chunk_bytes": 1 << 20})


@pytest.mark.skipif(ck.device_count() > 0, reason="checks the machine-without-GPU error")
def test_pipeline_without_gpu_is_a_clear_error():
    with pytest.raises(ck.CudaError, match="driver|no CUDA device"):
        Pipeline()


def test_benchmark_exits_2_without_gpu():
    if ck.device_count() > 0:
        pytest.skip("checks the machine-without-GPU path")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2, res.stderr
    assert "no GPU" in (res.stdout + res.stderr)


def test_waiting_for_a_run_handles_a_pending_ctrl_c_promptly():
    """A KeyboardInterrupt that is pending but interrupts no system call (here
    ``_thread.interrupt_main``, or a signal landing just before the wait starts) must not
    wait for the whole run."""
    from ctxkit.pipeline.run import _result_interruptibly

    fut: Future[int] = Future()
    done_later = threading.Timer(3.0, fut.set_result, (1,))
    done_later.start()
    threading.Timer(0.1, _thread.interrupt_main).start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            _result_interruptibly(fut)
        assert time.perf_counter() - t0 < 1.0
    finally:
        done_later.cancel()
    done: Future[int] = Future()
    done.set_result(7)
    assert _result_interruptibly(done) == 7
    failed: Future[int] = Future()
    failed.set_exception(TimeoutError("from the task"))
    with pytest.raises(TimeoutError, match="from the task"):
        _result_interruptibly(failed)
