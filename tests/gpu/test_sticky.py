"""Sticky errors: a kernel that faults (ptx/fault.cu) poisons its context; synchronize
raises ContextPoisonedError, every later use of that context fails fast with the same
type, and another device keeps computing correctly.

The fault runs in a child process: a faulted primary context stays poisoned for the
rest of the process, which would break every later GPU test here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ctxkit as ck

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import time
    import numpy as np
    import ctxkit as ck
    from ctxkit.compiler import kernel_source
    from ctxkit.errors import ContextPoisonedError

    n_dev = ck.device_count()
    ctx0 = ck.registry.context(0)
    with ctx0:
        fault = ck.Module.load(ck.compile(kernel_source("fault.cu"))).function("fault")
        scale = ck.Module.load(ck.compile(kernel_source("scale.cu"))).function("scale_f32")
        s0 = ck.Stream()
        e0 = ck.Event()
        buf0 = ck.DeviceBuffer(64)
        fault.launch(1, 1, buf0, stream=s0)
        try:
            s0.synchronize()
            print("SYNC no error", flush=True)
        except ContextPoisonedError as exc:
            print("SYNC ContextPoisonedError", exc.name, flush=True)
    print("POISONED", ctx0.poisoned, flush=True)

    def use_buffer():
        with ctx0:
            buf0.copy_to_host()

    ops = {
        "ctx.synchronize": ctx0.synchronize,
        "stream.synchronize": s0.synchronize,
        "event.synchronize": e0.synchronize,
        "DeviceBuffer": lambda: ck.DeviceBuffer(16, context=ctx0),
        "Stream": lambda: ck.Stream(ctx0),
        "copy": use_buffer,
        "bind": lambda: ck.bind(0).__enter__(),
    }
    for name, op in ops.items():
        t0 = time.perf_counter()
        try:
            op()
            print("OP", name, "no error", flush=True)
        except ContextPoisonedError:
            print("OP", name, "ContextPoisonedError", f"{time.perf_counter() - t0:.6f}", flush=True)
        except Exception as exc:
            print("OP", name, type(exc).__name__, exc, flush=True)
    if n_dev > 1:
        ctx1 = ck.registry.context(1)
        with ctx1:
            x = np.arange(100_000, dtype=np.float32)
            a = ck.memory.to_device(x)
            out = ck.device_array(x.size, np.float32)
            s1 = ck.Stream()
            scale.launch(64, 256, a, out, x.size, np.float32(3.0), stream=s1)
            s1.synchronize()
            ok = np.array_equal(out.to_host(), 3 * x)
        print("DEVICE1", "OK" if ok else "WRONG", flush=True)
    print("DONE", flush=True)
    """
)


@pytest.fixture(scope="module")
def child_output(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    script = tmp_path_factory.mktemp("sticky") / "fault_then_use.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env
    )


def lines(out: str, prefix: str) -> list[list[str]]:
    return [ln.split() for ln in out.splitlines() if ln.startswith(prefix + " ")]


def test_fault_poisons_the_context(child_output):
    out = child_output.stdout
    assert "SYNC ContextPoisonedError CUDA_ERROR_ILLEGAL_ADDRESS" in out, out + child_output.stderr
    assert "POISONED True" in out


def test_later_uses_fail_fast_with_the_same_type(child_output):
    ops = lines(child_output.stdout, "OP")
    assert {op[1] for op in ops} == {
        "ctx.synchronize",
        "stream.synchronize",
        "event.synchronize",
        "DeviceBuffer",
        "Stream",
        "copy",
        "bind",
    }, child_output.stdout + child_output.stderr
    for op in ops:
        assert op[2] == "ContextPoisonedError", op
        assert float(op[3]) < 0.01, op  # fails fast: no driver round trip waiting on work


def test_child_exits_cleanly(child_output):
    assert child_output.returncode == 0, child_output.stderr
    assert "DONE" in child_output.stdout
    assert "Traceback" not in child_output.stderr, child_output.stderr


@pytest.mark.multigpu
def test_other_device_still_computes(child_output):
    assert ck.device_count() > 1
    assert "DEVICE1 OK" in child_output.stdout, child_output.stdout + child_output.stderr
