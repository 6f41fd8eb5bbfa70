"""Bad-input corpus: each mistake raises the documented typed error with an actionable message,
and the process keeps working afterwards (a vector_add runs after every case).

Cases here cover devices, contexts, the registry and executors, memory, streams and events,
the pipeline, procs, fork and a sticky fault (the last in a subprocess); the compiler,
modules and launches are in test_bad_input_launch_gpu.py. The machinery (environment,
registry, the after-each-case check) is tests/core/badinput.py.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

import ctxkit as ck
from tests.core.badinput import (  # noqa: F401
    Env,
    N,
    env,
    in_thread,
    make_registry,
    run_case,
    still_works,
    vadd_args,
)
from tests.support.helpers import object_array

REPO = Path(__file__).resolve().parents[2]

CASES, case = make_registry()


# --- devices, contexts, registry, executors --------------------------------------------------


@case(ValueError, "out of range", "valid")
def device_ordinal_out_of_range(env: Env) -> None:
    ck.Device(99)


@case(TypeError, "must be an int")
def device_ordinal_wrong_type(env: Env) -> None:
    ck.Device("0")  # type: ignore[arg-type]


@case(ValueError, "unknown device attribute", "warp_size")
def device_attribute_unknown(env: Env) -> None:
    ck.Device(0).attribute("warp")


@case(TypeError, "flags must be an int")
def context_flags_wrong_type(env: Env) -> None:
    ck.Context.create(0, flags="fast")  # type: ignore[arg-type]


@case(ck.ContextClosedError, "is closed")
def closed_context_pushed(env: Env) -> None:
    c = ck.Context.create(0)
    c.close()
    with c:
        pass


@case(ck.ContextStackError, "pushed nothing here")
def pop_without_push(env: Env) -> None:
    in_thread(env.owned.pop)


@case(ck.ContextStackError, "reverse order")
def pop_out_of_order(env: Env) -> None:
    env.ctx0.push()
    env.owned.push()
    try:
        env.ctx0.pop()
    finally:
        env.owned.pop()
        env.ctx0.pop()


@case(ck.ContextInUseError, "is current in thread")
def close_while_current(env: Env) -> None:
    c = ck.Context.create(0)
    try:
        with c:
            c.close()
    finally:
        c.close()


@case(TypeError, "expected a ctxkit.Context")
def bind_wrong_type(env: Env) -> None:
    ck.bind("zero")  # type: ignore[arg-type]


@case(TypeError, "expected a ctxkit.Context")
def registry_set_wrong_type(env: Env) -> None:
    ck.registry.set(0, "ctx")  # type: ignore[arg-type]


@case(ValueError, "belongs to device 1", devices=2)
def registry_set_wrong_device(env: Env) -> None:
    ck.registry.set(0, ck.registry.context(1))


@case(ValueError, "max_workers must be at least 1")
def executor_without_workers(env: Env) -> None:
    ck.ContextExecutor(0, max_workers=0)


@case(ValueError, "blas_threads must be a positive int")
def executor_bad_blas_threads(env: Env) -> None:
    ck.ContextExecutor(0, max_workers=1, blas_threads=-2)


@case(RuntimeError, "after shutdown")
def executor_submit_after_shutdown(env: Env) -> None:
    ex = ck.ContextExecutor(0, max_workers=1)
    ex.shutdown()
    ex.submit(print)


@case(ck.NoCurrentContextError, "worker-without-context", "ctxkit.bind")
def buffer_in_thread_without_context(env: Env) -> None:
    in_thread(lambda: ck.DeviceBuffer(256), name="worker-without-context")


@case(ck.NoCurrentContextError, "needs a current CUDA context", "ContextExecutor")
def launch_in_thread_without_context(env: Env) -> None:
    # Without strict mode the kernel binds its buffers' context; strict mode refuses.
    with mock.patch.object(ck.registry, "strict", True):
        in_thread(lambda: env.vadd.launch(4, 256, *vadd_args(env)))


# --- memory ----------------------------------------------------------------------------------


@case(ValueError, "nbytes must be >= 0")
def buffer_negative_size(env: Env) -> None:
    ck.DeviceBuffer(-1)


@case(TypeError, "nbytes must be an int")
def buffer_float_size(env: Env) -> None:
    ck.DeviceBuffer(1.5)  # type: ignore[arg-type]


@case(ck.OutOfMemoryError, "cannot allocate", "are free", "close()")
def buffer_10_tib(env: Env) -> None:
    ck.DeviceBuffer(10 << 40)


@case(ValueError, "above 2**64 - 1")
def buffer_2_pow_64(env: Env) -> None:
    ck.DeviceBuffer(2**64)


@case(ValueError, "above 2**64 - 1")
def pinned_empty_overflowing_shape(env: Env) -> None:
    ck.pinned_empty((2**40, 2**40), np.uint8)


@case(ValueError, "sizes must match")
def copy_from_host_wrong_size(env: Env) -> None:
    ck.DeviceBuffer(16).copy_from_host(np.zeros(3, np.float32))


@case(ValueError, "sizes must match")
def copy_to_host_wrong_size(env: Env) -> None:
    ck.DeviceBuffer(16).copy_to_host(np.zeros(5, np.float32))


@case(ValueError, "not C-contiguous", "ascontiguousarray")
def copy_from_non_contiguous(env: Env) -> None:
    ck.DeviceBuffer(32).copy_from_host(np.zeros(16, np.float32)[::2])


@case(ValueError, "read-only")
def copy_into_read_only(env: Env) -> None:
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    ck.DeviceBuffer(16).copy_to_host(out)


@case(TypeError, "numpy array or a buffer")
def copy_from_a_string(env: Env) -> None:
    ck.DeviceBuffer(16).copy_from_host("sixteen bytes!!!")


@case(ck.ContextClosedError, "buffer was closed")
def closed_buffer(env: Env) -> None:
    buf = ck.DeviceBuffer(16)
    buf.close()
    buf.copy_to_host()


@case(ck.ContextClosedError, "is closed", "create a new context")
def buffer_of_closed_context(env: Env) -> None:
    c = ck.Context.create(0)
    buf = ck.DeviceBuffer(64, c)
    c.close()
    buf.copy_to_host()


@case(ValueError, "0..255")
def memset_out_of_range(env: Env) -> None:
    ck.DeviceBuffer(16).memset(300)


@case(ValueError, "needs 12 bytes")
def view_wrong_shape(env: Env) -> None:
    ck.DeviceBuffer(10).view((3,), np.float32)


@case(TypeError, "byte slice")
def buffer_indexed_with_int(env: Env) -> None:
    ck.DeviceBuffer(16)[3]  # type: ignore[index]


@case(ValueError, "do not fit")
def copy_peer_too_many_bytes(env: Env) -> None:
    src, dst = ck.DeviceBuffer(64, env.ctx0), ck.DeviceBuffer(64, env.owned)
    ck.copy_peer(dst, src, 128)


@case(ValueError, "numpy view")
def managed_close_with_live_views(env: Env) -> None:
    m = ck.ManagedBuffer(4096)
    view = m.as_numpy(np.float32)
    m.close()
    del view


@case(ValueError, "register_host", "not C-contiguous", "ascontiguousarray")
def register_host_non_contiguous(env: Env) -> None:
    # Two arrays sharing a page may or may not be refused by the driver (CUDA 13.0 accepts
    # them): both outcomes are checked in test_memory.py::test_register_host_neighbours_in_one_page.
    with ck.register_host(np.zeros(4 * 4096, np.uint8)[::2]):
        pass


@case(TypeError, "copy_from_host", "dtype object holds Python objects", "astype")
def copy_from_host_object_array(env: Env) -> None:
    ck.DeviceBuffer(512).copy_from_host(object_array("object", 512))


@case(TypeError, "copy_to_host", "dtype [('f0', '<f8'), ('f1', 'O')] holds Python objects")
def copy_to_host_object_field(env: Env) -> None:
    buf = ck.DeviceBuffer(512)
    buf.memset(0xFF)  # would be references to nowhere
    buf.copy_to_host(object_array("f8,O", 512), stream=ck.Stream())


@case(TypeError, "register_host", "dtype object holds Python objects")
def register_host_object_array(env: Env) -> None:
    with ck.register_host(object_array("object", 1 << 16)):
        pass


@case(TypeError, "Pipeline.map: x", "dtype [('f0', '<f8'), ('f1', 'O')] holds Python objects")
def pipeline_map_object_field(env: Env) -> None:
    with ck.Pipeline(devices=[0]) as p:
        p.map(env.scale, object_array("f8,O", 1 << 16), args=(2.0,))


@case(TypeError, "Pipeline.map: out", "dtype object holds Python objects")
def pipeline_map_into_object_array(env: Env) -> None:
    with ck.Pipeline(devices=[0]) as p:
        p.map(
            env.scale, np.zeros(4096, np.float32), out=object_array("object", 1 << 15), args=(2.0,)
        )


# --- streams and events ----------------------------------------------------------------------


@case(ValueError, "outside the range")
def stream_priority_out_of_range(env: Env) -> None:
    ck.Stream(priority=99)


@case(TypeError, "priority must be an int")
def stream_priority_wrong_type(env: Env) -> None:
    ck.Stream(priority="high")  # type: ignore[arg-type]


@case(ck.ContextClosedError, "stream was closed")
def closed_stream(env: Env) -> None:
    s = ck.Stream()
    s.close()
    s.synchronize()


@case(ck.ContextClosedError, "event was closed")
def closed_event(env: Env) -> None:
    e = ck.Event()
    e.close()
    e.record()


@case(ValueError, "timing=False")
def elapsed_without_timing(env: Env) -> None:
    start = ck.Event(timing=False).record()
    start.elapsed_ms(ck.Event().record())


@case(ValueError, "never recorded")
def elapsed_of_unrecorded_events(env: Env) -> None:
    ck.Event().elapsed_ms(ck.Event())


@case(ValueError, "different devices", devices=2)
def elapsed_across_devices(env: Env) -> None:
    start = ck.Event(context=env.ctx0).record()
    end = ck.Event(context=ck.registry.context(1)).record()
    start.elapsed_ms(end)


@case(ValueError, "the stream's context")
def event_recorded_on_stream_of_other_context(env: Env) -> None:
    ck.Event(context=env.ctx0).record(ck.Stream(env.owned))


@case(TypeError, "expected a stream")
def launch_with_a_string_stream(env: Env) -> None:
    env.vadd.launch(4, 256, *vadd_args(env), stream="fast")


@case(TypeError, "must be callable")
def host_func_not_callable(env: Env) -> None:
    ck.Stream().launch_host_func(5)  # type: ignore[arg-type]


@case(ZeroDivisionError, "division")
def host_func_exception_reraised(env: Env) -> None:
    s = ck.Stream()
    s.launch_host_func(lambda: 1 / 0)
    s.synchronize()


# --- pipeline, procs, fork -------------------------------------------------------------------


@case(ValueError, "at least one device")
def pipeline_without_devices(env: Env) -> None:
    ck.Pipeline(devices=[])


@case(ValueError, "listed twice")
def pipeline_duplicate_device(env: Env) -> None:
    ck.Pipeline(devices=[0, 0])


@case(ValueError, "out of range")
def pipeline_missing_device(env: Env) -> None:
    ck.Pipeline(devices=[99])


@case(ValueError, "chunk_bytes must be >= 1")
def pipeline_zero_chunk(env: Env) -> None:
    ck.Pipeline(options=ck.PipelineOptions(chunk_bytes=0))


@case(ck.LaunchArgumentError, "args=")
def pipeline_kernel_arguments_missing(env: Env) -> None:
    with ck.Pipeline(devices=[0]) as p:
        p.map(env.scale, np.zeros(1024, np.float32))


def top_level_task(ordinal: int) -> int:
    return ordinal


@case(ValueError, "'spawn' start method")
def procs_with_fork_context(env: Env) -> None:
    ck.procs.run_per_device(top_level_task, mp_context=multiprocessing.get_context("fork"))


@case(TypeError, "lambda", "module level", "cloudpickle")
def procs_with_lambda(env: Env) -> None:
    with mock.patch.dict(sys.modules, {"cloudpickle": None}):  # by value needs cloudpickle
        ck.procs.run_per_device(lambda d: d)


@case(ck.ForkError, "forked", "spawn")
def cuda_in_forked_child(env: Env) -> None:
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            os.close(read_fd)
            try:
                ck.device_count()
                report = "no error"
            except BaseException as exc:
                report = f"{type(exc).__name__}\n{exc}"
            os.write(write_fd, report.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        report = f.read().decode()
    os.waitpid(pid, 0)
    kind, _, message = report.partition("\n")
    if kind == "ForkError":
        raise ck.ForkError(message)
    raise AssertionError(f"the forked child got {report!r}, not ForkError")


# --- the runner ------------------------------------------------------------------------------


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name: str, env: Env) -> None:
    run_case(name, CASES[name], env)


STICKY = """
import time
import numpy as np
import ctxkit as ck
from ctxkit.compiler import kernel_source

n = ck.device_count()
victim = ck.Context.create(n - 1)
with victim:
    fault = ck.Module.load(ck.compile(kernel_source("fault.cu"), name="fault.cu")).function("fault")
    buf = ck.DeviceBuffer(64)
    fault.launch(1, 1, buf)
    try:
        victim.synchronize()
    except ck.ContextPoisonedError as exc:
        print("FIRST", exc.name, str(exc).splitlines()[0])
t0 = time.perf_counter()
try:
    with victim:
        ck.DeviceBuffer(64)
except ck.ContextPoisonedError as exc:
    print("LATER", "poisoned" in str(exc), exc.name, f"{time.perf_counter() - t0:.6f}")
if n > 1:
    try:
        with ck.bind(0):
            b = ck.DeviceBuffer(16)
            b.copy_from_host(np.arange(4, dtype=np.float32))
            print("OTHER", b.copy_to_host(np.empty(4, np.float32)).tolist())
    except Exception as exc:
        print("OTHER", type(exc).__name__, getattr(exc, "name", "-"), "procs" in str(exc))
print("DONE")
"""


def test_sticky_fault_fails_every_later_call_with_a_typed_error() -> None:
    """A kernel fault (in a child process, to keep this one clean): ContextPoisonedError on
    the sync, fail-fast ContextPoisonedError on the next use of that context, and (driver
    580 / CUDA 13.0: the fault is process-wide) a typed ContextPoisonedError whose message
    points to ctxkit.procs on the other device; the child exits 0 without a traceback."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", STICKY],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "Traceback" not in proc.stderr and "DONE" in out, out + proc.stderr
    assert "FIRST CUDA_ERROR_ILLEGAL_ADDRESS" in out, out + proc.stderr
    later = [ln.split() for ln in out.splitlines() if ln.startswith("LATER ")]
    assert later and later[0][1:3] == ["True", "CUDA_ERROR_ILLEGAL_ADDRESS"], out
    assert float(later[0][3]) < 0.01, out
    if ck.device_count() > 1:
        assert "OTHER ContextPoisonedError CUDA_ERROR_ILLEGAL_ADDRESS True" in out, (
            out + proc.stderr
        )
