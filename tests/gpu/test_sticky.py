"""Sticky errors: a kernel that faults (ptx/fault.cu) poisons its context; synchronize
raises ContextPoisonedError, every later use of that context fails fast with the same
type, ctxkit leaves no context current behind, and another device keeps computing.

Each fault runs in a child process (a faulted context stays poisoned for the rest of the
process, which would break every later GPU test here), in three scenarios:

* ``owned``: device 0's context comes from ``ContextRegistry(kind="owned")``, the
  isolation recipe; device 1 (an owned context made after the fault) must compute
  correctly.
* ``primary``: device 0's primary context faults and device 1's primary context is
  retained afterwards. The first GPU run (CUDA 13.0 driver) saw that retain fail with
  CUDA_ERROR_ILLEGAL_ADDRESS. The child prints the thread's current context right
  before the retain and tries an owned context on device 1 as well, so the run tells
  whether the driver reports the fault process-wide; the outcome must be a correct
  result or a typed ContextPoisonedError and is recorded in junit.xml
  (``device1_after_primary_fault*`` properties).
* ``primary_early``: as ``primary``, but device 1's primary context was retained
  before the fault (what an application that set up all devices at start-up has).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import ctxkit as ck

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    import time
    import numpy as np
    import ctxkit as ck
    from ctxkit._driver import drv
    from ctxkit.compiler import kernel_source
    from ctxkit.errors import ContextPoisonedError

    scenario = sys.argv[1]
    n_dev = ck.device_count()
    reg = ck.registry if scenario.startswith("primary") else ck.ContextRegistry(kind="owned")
    early1 = reg.context(1) if scenario == "primary_early" and n_dev > 1 else None
    ctx0 = reg.context(0)
    print("KIND", ctx0.kind, flush=True)
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
        "bind": lambda: ck.bind(ctx0).__enter__(),
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


    def current():
        err, cu = drv.cuCtxGetCurrent()
        return f"error:{int(err)}" if err else f"{int(cu):#x}"


    def compute_on(make, label, close=False):
        ctx1 = None
        try:
            ctx1 = make()
            with ctx1:
                x = np.arange(100_000, dtype=np.float32)
                a = ck.memory.to_device(x)
                out = ck.device_array(x.size, np.float32)
                s1 = ck.Stream()
                scale.launch(64, 256, a, out, x.size, np.float32(3.0), stream=s1)
                s1.synchronize()
                result = "OK" if np.array_equal(out.to_host(), 3 * x) else "WRONG"
        except Exception as exc:
            result = f"ERROR {type(exc).__name__} {getattr(exc, 'name', '') or '-'}"
            print(label + "_DETAIL", str(exc).splitlines()[0], flush=True)
        finally:
            if close and ctx1 is not None:
                try:
                    ctx1.close()
                except Exception:
                    pass
        print(label, result, flush=True)


    print("CURRENT_BEFORE_DEVICE1", current(), flush=True)
    print("CTXKIT_PUSHES", sum(len(v) for v in ck.registry.bindings().values()), flush=True)
    if n_dev > 1:
        if scenario == "owned":
            compute_on(lambda: reg.context(1), "DEVICE1")
        elif scenario == "primary_early":
            compute_on(lambda: early1, "DEVICE1")
        else:
            compute_on(lambda: ck.registry.context(1), "DEVICE1")
            compute_on(lambda: ck.Context.create(1), "DEVICE1_OWNED", close=True)
    print("CURRENT_AT_END", current(), flush=True)
    print("DONE", flush=True)
    """
)

SCENARIOS = ["owned", "primary", "primary_early"]
OPS = {
    "ctx.synchronize",
    "stream.synchronize",
    "event.synchronize",
    "DeviceBuffer",
    "Stream",
    "copy",
    "bind",
}


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sticky") / "fault_then_use.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module", params=SCENARIOS)
def child(request: Any, script: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script), request.param],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    return request.param, proc


def lines(out: str, prefix: str) -> list[list[str]]:
    return [ln.split() for ln in out.splitlines() if ln.startswith(prefix + " ")]


def value(out: str, prefix: str) -> str:
    found = lines(out, prefix)
    assert found, f"no {prefix} line in:\n{out}"
    return " ".join(found[-1][1:])


def test_fault_poisons_the_context(child):
    scenario, proc = child
    out = proc.stdout
    assert "SYNC ContextPoisonedError CUDA_ERROR_ILLEGAL_ADDRESS" in out, out + proc.stderr
    assert "POISONED True" in out
    assert value(out, "KIND") == ("owned" if scenario == "owned" else "primary")


def test_later_uses_fail_fast_with_the_same_type(child):
    _, proc = child
    ops = lines(proc.stdout, "OP")
    assert {op[1] for op in ops} == OPS, proc.stdout + proc.stderr
    for op in ops:
        assert op[2] == "ContextPoisonedError", op
        assert float(op[3]) < 0.01, op  # fails fast: no driver round trip waiting on work


def test_no_context_is_left_current(child):
    """Nothing ctxkit did around the fault leaves a context pushed in the thread."""
    _, proc = child
    out = proc.stdout
    assert value(out, "CURRENT_BEFORE_DEVICE1") == "0x0", out + proc.stderr
    assert value(out, "CTXKIT_PUSHES") == "0"
    assert value(out, "CURRENT_AT_END") == "0x0"


def test_child_exits_cleanly(child):
    _, proc = child
    assert proc.returncode == 0, proc.stderr
    assert "DONE" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.multigpu
def test_other_device_still_computes(child, record_property):
    """After an owned context on device 0 faulted, device 1 computes correctly. After a
    primary-context fault the driver may refuse device 1 too: then the error must be the
    typed ContextPoisonedError, never a wrong result or a crash; the outcome is recorded."""
    scenario, proc = child
    assert ck.device_count() > 1
    out = proc.stdout
    result = value(out, "DEVICE1")
    if scenario == "owned":
        assert result == "OK", out + proc.stderr
        return
    record_property(f"device1_after_primary_fault_{scenario}", result)
    if scenario == "primary":
        record_property("device1_owned_after_primary_fault", value(out, "DEVICE1_OWNED"))
    for label in ("DEVICE1", "DEVICE1_OWNED") if scenario == "primary" else ("DEVICE1",):
        got = value(out, label)
        assert got == "OK" or got.startswith("ERROR ContextPoisonedError"), (
            label,
            out + proc.stderr,
        )
