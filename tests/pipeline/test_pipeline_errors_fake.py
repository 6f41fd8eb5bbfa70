"""Pipeline.map when things go wrong, on a simulated GPU: a failing chunk, a kernel
fault, Ctrl-C (also twice), and a map still running in a daemon thread when the
interpreter exits."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.context import thread_state
from ctxkit.pipeline import Pipeline, PipelineError
from tests.support.fakegpu import Fault, host_view, scale_body

ROOT = Path(__file__).resolve().parents[2]


# --- errors ---------------------------------------------------------------------------


def test_error_in_one_chunk_names_device_and_chunk_and_pipeline_is_reusable(gpu):
    x = np.arange(8000, dtype=np.float32)  # 2 devices x 4 chunks of 1000 rows

    def body(ctx, stream, d_in, d_out, n):
        calls.append((ctx.device.ordinal, n))
        if ctx.device.ordinal == 1 and sum(1 for c in calls if c[0] == 1) == 2:
            raise ValueError("bad kernel argument")
        scale_body(gpu, 2.0)(ctx, stream, d_in, d_out, n)

    calls: list[tuple[int, int]] = []
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4000)) as p:
        with pytest.raises(PipelineError) as info:
            p.map(body, x)
        err = info.value
        assert err.device == 1 and err.chunk == 5 and err.step == "kernel"
        assert "device 1" in str(err) and "chunk 5" in str(err) and "rows 5000..6000" in str(err)
        assert isinstance(err.__cause__, ValueError) and not err.poisoned
        assert not p.poisoned
        calls.clear()
        out = p.map(scale_body(gpu, 2.0), x)  # buffers reusable afterwards
        np.testing.assert_array_equal(out, x * 2)


def test_kernel_fault_poisons_the_pipeline_with_a_clear_message(gpu):
    x = np.arange(8000, dtype=np.float32)

    def body(ctx, stream, d_in, d_out, n):
        if ctx.device.ordinal == 0 and not faulted:
            faulted.append(1)

            def bad():
                raise Fault

            gpu.launch(stream, bad)
            return
        scale_body(gpu, 2.0)(ctx, stream, d_in, d_out, n)

    faulted: list[int] = []
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4000)) as p:
        with pytest.raises(PipelineError) as info:
            p.map(body, x)
        err = info.value
        # As on current drivers, the fault poisons every context: either device may
        # report it first.
        assert err.device in (0, 1) and err.poisoned
        assert err.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert "poisoned" in str(err) and "chunk" in str(err)
        assert p.poisoned
        with pytest.raises(ck.ContextPoisonedError, match=r"device \d was poisoned"):
            p.map(scale_body(gpu, 2.0), x)
    assert p.closed


def test_keyboard_interrupt_from_a_worker_propagates_and_pipeline_recovers(gpu):
    x = np.arange(8000, dtype=np.float32)
    n_calls = []

    def body(ctx, stream, d_in, d_out, n):
        n_calls.append(1)
        if len(n_calls) == 3:
            raise KeyboardInterrupt
        scale_body(gpu, 2.0)(ctx, stream, d_in, d_out, n)

    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4000)) as p:
        with pytest.raises(KeyboardInterrupt):
            p.map(body, x)
        out = p.map(scale_body(gpu, 2.0), x)
    np.testing.assert_array_equal(out, x * 2)


def test_ctrl_c_in_the_main_thread_during_map(gpu):
    """A real SIGINT while map waits: workers stop early, nothing stays pushed, and the
    pipeline works afterwards."""
    x = np.arange(64_000, dtype=np.float32)  # 64 chunks of 20 ms kernels: >= 320 ms in all
    calls = []

    def body(ctx, stream, d_in, d_out, n):
        calls.append(n)
        scale_body(gpu, 2.0, delay=0.02)(ctx, stream, d_in, d_out, n)

    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4000, staging_buffers=2)) as p:
        main = threading.main_thread().ident
        assert main is not None
        timer = threading.Timer(0.05, signal.pthread_kill, (main, signal.SIGINT))
        t0 = time.perf_counter()
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                p.map(body, x)
        finally:
            timer.cancel()
        assert time.perf_counter() - t0 < 0.2  # interrupted, not run to the end
        assert len(calls) < 64
        assert not thread_state().stack
        out = p.map(scale_body(gpu, 2.0), x)
        np.testing.assert_array_equal(out, x * 2)


def test_a_second_ctrl_c_during_cleanup_still_waits_for_every_chunk(gpu, monkeypatch):
    """Ctrl-C, then Ctrl-C again while map stops its workers: map raises only once no
    chunk task runs and no kernel of the run is in flight, so nothing touches the
    arrays or the pipeline's buffers after map is back in the caller's hands."""
    from ctxkit.pipeline import run as _runner

    lock = threading.Lock()
    active = {"tasks": 0, "kernels": 0}

    def counted(task):
        def run(*args):
            with lock:
                active["tasks"] += 1
            try:
                return task(*args)
            finally:
                with lock:
                    active["tasks"] -= 1

        return run

    monkeypatch.setattr(_runner, "feed", counted(_runner.feed))
    monkeypatch.setattr(_runner, "drain", counted(_runner.drain))

    def body(ctx, stream, d_in, d_out, n):
        def kernel():
            with lock:
                active["kernels"] += 1
            time.sleep(0.15)
            host_view(d_out)[...] = host_view(d_in) * 2
            with lock:
                active["kernels"] -= 1

        gpu.launch(stream, kernel)

    x = np.arange(64_000, dtype=np.float32)
    main = threading.main_thread().ident
    assert main is not None
    with Pipeline([0, 1], options=ck.PipelineOptions(chunk_bytes=4000, staging_buffers=2)) as p:
        kill = (main, signal.SIGINT)
        timers = [threading.Timer(t, signal.pthread_kill, kill) for t in (0.05, 0.1)]
        for t in timers:
            t.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                p.map(body, x)
            with lock:
                assert active == {"tasks": 0, "kernels": 0}
        finally:
            for t in timers:
                t.cancel()
        out = p.map(scale_body(gpu, 2.0), x)
    np.testing.assert_array_equal(out, x * 2)


EXIT_CHILD = """
import atexit, sys, threading, time, weakref
atexit.register(time.sleep, 0.5)  # runs last: the maps go on after ctxkit's exit handlers
assert not weakref.finalize._registered_with_atexit
import numpy as np, pytest
from ctxkit import _driver
from tests.support.fakegpu import FakeGPU, scale_body
from tests.support.fakedriver import swap_driver
fake = FakeGPU(ndev=2)
mp = pytest.MonkeyPatch()
swap_driver(mp, fake)
mp.setattr(_driver, "_init_pid", None)
mp.setattr(_driver, "_no_device", False)
import ctxkit as ck
x = np.arange(50_000, dtype=np.float32)
def mapping(p):
    while True:
        if not np.array_equal(p.map(scale_body(fake, 2.0), x), x * 2):
            raise AssertionError("wrong result")
for devices in ([0, 1], [1]):
    p = ck.Pipeline(devices, options=ck.PipelineOptions(chunk_bytes=4096, host_threads=2))
    p.map(scale_body(fake, 2.0), x)
    threading.Thread(target=mapping, args=(p,), daemon=True).start()
time.sleep(0.1)
print("main returns", flush=True)
"""


def test_maps_in_daemon_threads_at_exit_are_quiet():
    """Maps still running in daemon threads while the interpreter exits: no traceback
    (the pipeline's executors are not shut down under them) and no hang."""
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXIT_CHILD)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr[-3000:]
    assert "main returns" in res.stdout


# --- knobs that could explode ---------------------------------------------------------


def test_pipeline_knobs_past_their_limits_are_refused_before_anything_starts(gpu):
    threads = threading.active_count()
    with pytest.raises(ValueError, match=r"staging_buffers must be in 1\.\.64, got 1099511627776"):
        Pipeline([0], options=ck.PipelineOptions(staging_buffers=2**40))
    with pytest.raises(ValueError, match=r"host_threads must be in 1\.\.256, got 100000"):
        Pipeline([0], options=ck.PipelineOptions(host_threads=100_000))
    assert threading.active_count() == threads


def test_map_with_a_chunk_per_byte_is_refused_with_the_smallest_chunk_allowed(gpu):
    x = np.zeros(1 << 20, np.float32)
    with Pipeline([0]) as p:
        with pytest.raises(ValueError, match=r"chunk_bytes=1 .* pass chunk_bytes >= 68"):
            p.map(scale_body(gpu, 2.0), x, chunk_bytes=1)
        np.testing.assert_array_equal(p.map(scale_body(gpu, 2.0), x[:1000], chunk_bytes=1), 0)
