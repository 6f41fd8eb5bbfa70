"""Kernel launches on a real device: results, argument checking, interop, prepared launches."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit.memory import to_device
from ctxkit.module import Module

N = 100_003
REPO = Path(__file__).resolve().parents[2]


def _kernels(ctx: ck.Context, *files: str) -> dict[str, ck.Kernel]:
    out = {}
    for f in files:
        mod = Module.load(ck.compile(C.kernel_source(f), name=f, arch=ctx.device.arch))
        out.update({name: mod.function(name) for name in mod.entries or []})
    return out


@pytest.fixture
def k(ctx0):
    return _kernels(ctx0, "vector_add.cu", "saxpy.cu", "scale.cu", "fill.cu", "empty.cu")


def _rand(n: int, seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


# --- results against numpy ------------------------------------------------------------


def test_vector_add_saxpy_scale_match_numpy(ctx0, k):
    a, b = _rand(N, 1), _rand(N, 2)
    with ctx0:
        da, db, dc = to_device(a), to_device(b), ck.device_array(N, np.float32)
        k["vector_add"].launch(128, 256, da, db, dc, N)
        np.testing.assert_array_equal(dc.to_host(), a + b)

        dy = to_device(b)
        k["saxpy"].launch((64,), (256,), np.float32(1.5), da, dy, N)
        fma = (1.5 * a.astype(np.float64) + b).astype(np.float32)  # one rounding, like FMA
        np.testing.assert_array_max_ulp(dy.to_host(), fma, maxulp=1)

        k["scale_f32"].launch(64, 256, da, dc, N, 3.0)
        np.testing.assert_allclose(dc.to_host(), np.float32(3.0) * a, rtol=1e-6)

        x64 = _rand(N, 3, np.float64)
        d64, o64 = to_device(x64), ck.device_array(N, np.float64)
        k["scale_f64"].launch(64, 256, d64, o64, N, -0.25)
        np.testing.assert_array_equal(o64.to_host(), -0.25 * x64)

        xi = np.arange(-500, 500, dtype=np.int32)
        di, oi = to_device(xi), ck.device_array(xi.size, np.int32)
        k["scale_i32"].launch(4, 256, di, oi, xi.size, -3)
        np.testing.assert_array_equal(oi.to_host(), -3 * xi)


def test_2d_grid_and_block_tuples(ctx0, k):
    with ctx0:
        out = ck.device_array(N, np.float32)
        k["fill_f32"].launch((8, 4, 2), (32, 4), out, 7.0, N)
        assert (out.to_host() == 7.0).all()


def test_launch_on_a_stream(ctx0, k):
    a = _rand(N, 4)
    with ctx0:
        s = ck.Stream()
        da, out = to_device(a), ck.device_array(N, np.float32)
        k["scale_f32"].launch(64, 256, da, out, N, 2.0, stream=s)
        s.synchronize()
        np.testing.assert_array_equal(out.to_host(), 2 * a)


def test_raw_int_pointers_and_managed_and_pinned_host_memory(ctx0, k):
    n = 4096
    with ctx0:
        buf = ck.DeviceBuffer(n * 4)
        k["fill_f32"].launch(16, 256, buf.ptr, 1.0, n)  # a plain int is a pointer too
        assert (buf.copy_to_host(np.empty(n, np.float32)) == 1.0).all()

        m = ck.ManagedBuffer(n * 4)
        host = m.as_numpy(np.float32)
        k["fill_f32"].launch(16, 256, m, 2.0, n)
        ctx0.synchronize()
        assert (host == 2.0).all()
        k["fill_f32"].launch(16, 256, host[1024:], 3.0, n - 1024)  # managed numpy view
        ctx0.synchronize()
        assert (host[:1024] == 2.0).all() and (host[1024:] == 3.0).all()

        pinned = ck.pinned_empty(n, np.float32)
        k["fill_f32"].launch(16, 256, pinned, 4.0, n)  # page-locked host memory is mapped
        ctx0.synchronize()
        assert (pinned == 4.0).all()


# --- argument checking: nothing runs when the arguments are wrong -----------------------


def _bad_cases(dx, dy):
    """(kernel, args, substring of the message) -- each names the parameter."""
    sx = "saxpy"
    return [
        (sx, (1.0, dx, dy), "takes 4 arguments but 3 were given"),
        (sx, (1.0, dx, dy, N, 5), "takes 4 arguments but 5 were given"),
        (sx, (dx, dx, dy, N), "parameter 0 'saxpy_param_0' (.f32"),
        (sx, (1.0, 2.5, dy, N), "parameter 1 'saxpy_param_1' (.u64"),
        (sx, (1.0, dx, dy, 10.0), "parameter 3 'saxpy_param_3' (.u64"),
        (sx, (1.0, np.zeros(4, np.float32), dy, N), "pageable host memory"),
        (sx, (1.0, dx, dy, b"12"), "expected an integer or a device pointer"),
        (sx, (1.0, dx, dy, 2**64), "out of range for .u64"),
        (sx, ("1.0", dx, dy, N), "expected a real number"),
        (sx, (np.ones(3), dx, dy, N), "takes one number"),
        (sx, (1e40, dx, dy, N), "out of range for .f32"),
        ("scale_i32", (dx, dy, N, 1.5), "parameter 3 'scale_i32_param_3' (.u32"),
        ("scale_i32", (dx, dy, N, 2**32), "out of range for .u32"),
        ("scale_i32", (dx, dy, N, dx), "cannot hold a pointer"),
        ("scale_i32", (dx, dy, N, np.float32(2)), "a float for an integer parameter"),
        ("fill_u8", (dy, 256, N), "out of range for .u8"),
        ("fill_u8", (dy, "a", N), "expected an integer"),
        ("empty", (None, None), "parameter 1 'empty_param_1' (.u32"),
    ]


def test_wrong_arguments_raise_before_launch(ctx0, k):
    x = np.arange(N, dtype=np.float32)
    with ctx0:
        dx, dy = to_device(x), to_device(np.zeros(N, np.float32))
        cases = _bad_cases(dx, dy)
        assert len(cases) >= 15
        for name, args, why in cases:
            with pytest.raises(ck.LaunchArgumentError) as info:
                k[name].launch(64, 256, *args)
            assert why in str(info.value), (name, why, str(info.value))
            assert "Signature:" in str(info.value)
        ctx0.synchronize()
        assert not dy.to_host().any(), "a refused launch must not have run"


def test_launch_config_errors_explain_the_limits(ctx0, k):
    with ctx0:
        out = ck.device_array(64, np.float32)
        with pytest.raises(ck.CudaError, match="more than this kernel's limit of 1024"):
            k["fill_f32"].launch(1, 2048, out, 1.0, 64)
        with pytest.raises(ck.CudaError, match="block.z = 128 exceeds the device maximum 64"):
            k["fill_f32"].launch(1, (1, 1, 128), out, 1.0, 64)
        with pytest.raises(ck.CudaError, match="dynamic shared limit"):
            k["fill_f32"].launch(1, 32, out, 1.0, 64, shared_mem=1 << 20)
        with pytest.raises(ck.CudaError, match=r"grid\.y = 70000"):
            k["fill_f32"].launch((1, 70000), 32, out, 1.0, 64)
        k["fill_f32"].launch(1, 32, out, 1.0, 64)  # the context is fine afterwards
        ctx0.synchronize()


def test_no_current_context_in_a_new_thread(k):
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            k["empty"].launch(1, 1, None, 0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker, name="launcher-without-context")
    t.start()
    t.join()
    assert isinstance(errors[0], ck.NoCurrentContextError)
    assert "launcher-without-context" in str(errors[0])


def test_worker_thread_with_bind_launches(ctx0, k):
    out: list[np.ndarray] = []

    def worker() -> None:
        with ck.bind(ctx0):
            d = ck.device_array(1000, np.float32)
            k["fill_f32"].launch(4, 256, d, 5.0, 1000)
            out.append(d.to_host())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert (out[0] == 5.0).all()


# --- interop --------------------------------------------------------------------------


def test_cupy_arrays_as_arguments(ctx0, k):
    cp = pytest.importorskip("cupy")
    a, b = _rand(N, 5), _rand(N, 6)
    with ctx0, cp.cuda.Device(0):
        ca, cb, cc = cp.asarray(a), cp.asarray(b), cp.empty(N, cp.float32)
        cp.cuda.runtime.deviceSynchronize()
        k["vector_add"].launch(128, 256, ca, cb, cc, N)
        ctx0.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(cc), a + b)
        k["fill_f32"].launch(1, 256, cc[10:20], 9.0, 10)  # a view starts at its offset
        ctx0.synchronize()
        got = cp.asnumpy(cc)
        assert (got[10:20] == 9.0).all() and (got[:10] == (a + b)[:10]).all()


def test_torch_tensors_as_arguments(ctx0, k):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    a, b = _rand(N, 7), _rand(N, 8)
    ta, tb = torch.from_numpy(a).cuda(0), torch.from_numpy(b).cuda(0)
    tc = torch.empty(N, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()
    with ctx0:
        k["vector_add"].launch(128, 256, ta, tb, tc, N)
        ctx0.synchronize()
        with pytest.raises(ck.LaunchArgumentError, match="torch tensor on cpu"):
            k["vector_add"].launch(128, 256, torch.from_numpy(a), tb, tc, N)
    np.testing.assert_array_equal(tc.cpu().numpy(), a + b)


# --- prepared launches ------------------------------------------------------------------


def test_prepared_launch_and_set_arg(ctx0, k):
    a = _rand(N, 9)
    with ctx0:
        da, out = to_device(a), ck.device_array(N, np.float32)
        pl = k["scale_f32"].prepare(64, 256, da, out, N, 2.0)
        pl()
        np.testing.assert_array_equal(out.to_host(), 2 * a)
        pl.set_arg(3, -1.0)
        pl()
        np.testing.assert_array_equal(out.to_host(), -a)
        other = ck.device_array(N, np.float32)
        pl.set_arg("scale_f32_param_1", other)
        pl.set_arg(3, 0.5)
        pl()
        np.testing.assert_array_equal(other.to_host(), 0.5 * a)
        with pytest.raises(ck.LaunchArgumentError, match="parameter 2"):
            pl.set_arg(2, 1.5)
        s = ck.Stream()
        pls = k["fill_f32"].prepare(64, 256, out, 8.0, N, stream=s)
        pls()
        s.synchronize()
        assert (out.to_host() == 8.0).all()


def test_prepared_launch_from_a_thread_with_another_context(ctx0, k):
    with ctx0:
        out = ck.device_array(1000, np.float32)
        pl = k["fill_f32"].prepare(4, 256, out, 6.0, 1000)
    other = ck.Context.create(0)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with other:
                pl()  # binds ctx0 for the call
                assert ck.current_context() is other
        except BaseException as exc:
            errors.append(exc)

    try:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    finally:
        other.close()
    assert not errors, errors
    with ctx0:
        assert (out.to_host() == 6.0).all()


# --- sticky faults (in a child process: a fault poisons every context of the process) ----


def test_fault_poisons_the_process_and_every_later_call_is_typed():
    """A fault in an owned context: ContextPoisonedError at the synchronize, an immediate
    ContextPoisonedError on the next launch there, and (driver 580 / CUDA 13.0) a typed
    ContextPoisonedError on device 1 too; the child exits 0 without a traceback.
    tests/core/test_sticky_gpu.py has the full matrix and the process-per-device recipe."""
    script = textwrap.dedent(
        """
        import time
        import numpy as np, ctxkit as ck
        from ctxkit import compiler as C
        owned = ck.Context.create(0)
        with owned:
            obj = ck.compile(C.kernel_source("fault.cu"), arch=owned.device.arch)
            k = ck.Module.load(obj).function("fault")
            buf = ck.DeviceBuffer(4)
            k.launch(1, 1, buf)
            try:
                owned.synchronize()
            except ck.ContextPoisonedError as e:
                print("POISONED", e.name, flush=True)
            t0 = time.perf_counter()
            try:
                k.launch(1, 1, buf)
            except ck.ContextPoisonedError as e:
                print("FAST_FAIL", e.name, f"{time.perf_counter() - t0:.6f}", flush=True)
            print("POISONED_FLAG", owned.poisoned, flush=True)
        if ck.device_count() > 1:
            try:
                with ck.registry.context(1):
                    v = ck.compile(C.kernel_source("fill.cu"), arch=ck.Device(1).arch)
                    f = ck.Module.load(v).function("fill_f32")
                    d = ck.device_array(100, np.float32)
                    f.launch(1, 128, d, 2.0, 100)
                    print("DEVICE1 OK", bool((d.to_host() == 2.0).all()), flush=True)
            except Exception as e:
                print("DEVICE1 ERROR", type(e).__name__, getattr(e, "name", "-"), flush=True)
        print("DONE", flush=True)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
        env=env,
    )
    out = proc.stdout
    assert proc.returncode == 0, (out, proc.stderr)
    assert "Traceback" not in proc.stderr and "DONE" in out, (out, proc.stderr)
    assert "POISONED CUDA_ERROR_ILLEGAL_ADDRESS" in out, (out, proc.stderr)
    fast = [ln.split() for ln in out.splitlines() if ln.startswith("FAST_FAIL ")]
    assert fast and fast[0][1] == "CUDA_ERROR_ILLEGAL_ADDRESS", out
    assert float(fast[0][2]) < 0.01, out
    assert "POISONED_FLAG True" in out
    if ck.device_count() > 1:
        assert "DEVICE1 ERROR ContextPoisonedError CUDA_ERROR_ILLEGAL_ADDRESS" in out, (
            "device 1 after the fault: expected the driver's process-wide failure as a typed "
            "error (if device 1 now computes, update ContextPoisonedError's docs)",
            out,
            proc.stderr,
        )
