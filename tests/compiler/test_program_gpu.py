"""Compiler on a real device: arch=None follows the current context, targets load and run.

Loading and launching here use raw ``cuda.bindings`` calls (through ``ctxkit._driver.drv``)
so these tests check the compiler's output independently of ``ctxkit.module``; one
test at the end goes through the public ``Module``/``DeviceBuffer`` API.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit import _driver
from ctxkit._driver import drv

REPO = Path(__file__).resolve().parents[2]
UNSUPPORTED_PTX_VERSION = 222
SAXPY = C.kernel_source("saxpy.cu")


def _unique(tag: str) -> str:
    return SAXPY + f"\n// {tag} {time.time_ns()} {os.getpid()}\n"


def _check(res: Any, what: str) -> Any:
    err = res[0]
    assert int(err) == 0, f"{what} failed: {err!r}"
    return res[1] if len(res) == 2 else None


@contextmanager
def _module(image: bytes) -> Iterator[Any]:
    mod = _check(drv.cuModuleLoadData(image), "cuModuleLoadData")
    try:
        yield mod
    finally:
        _check(drv.cuModuleUnload(mod), "cuModuleUnload")


@contextmanager
def _device_copy(host: np.ndarray) -> Iterator[int]:
    ptr = _check(drv.cuMemAlloc(host.nbytes), "cuMemAlloc")
    try:
        _check(drv.cuMemcpyHtoD(ptr, host, host.nbytes), "cuMemcpyHtoD")
        yield int(ptr)
    finally:
        _check(drv.cuMemFree(ptr), "cuMemFree")


def _launch(mod: Any, name: str, grid: int, block: int, *args: np.ndarray) -> None:
    func = _check(drv.cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
    packed = np.array([a.ctypes.data for a in args], dtype=np.uint64)
    _check(
        drv.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, 0, 0, packed.ctypes.data, 0),
        "cuLaunchKernel",
    )
    _check(drv.cuCtxSynchronize(), "cuCtxSynchronize")


def _to_host(ptr: int, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    _check(drv.cuMemcpyDtoH(out, ptr, out.nbytes), "cuMemcpyDtoH")
    return out


def _run_saxpy(image: bytes, n: int = 100_003) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    a = np.float32(1.75)
    with _module(image) as mod, _device_copy(x) as dx, _device_copy(y) as dy:
        _launch(
            mod,
            "saxpy",
            64,
            256,
            np.array([a], dtype=np.float32),
            np.array([dx], dtype=np.uint64),
            np.array([dy], dtype=np.uint64),
            np.array([n], dtype=np.uint64),
        )
        got = _to_host(dy, y)
    np.testing.assert_allclose(got, a * x + y, rtol=1e-6, atol=1e-6)


def test_arch_none_picks_the_current_context_device(ctx0: ck.Context) -> None:
    with ctx0:
        obj = ck.compile(SAXPY, cache=False)
    assert obj.arch == ctx0.device.arch
    if ctx0.device.compute_capability == (9, 0):
        assert obj.arch == "sm_90"


def test_auto_target_is_cubin_for_the_device(ctx0: ck.Context) -> None:
    with ctx0:
        obj = ck.compile(SAXPY, target="auto", cache=False)
    major, minor = ctx0.device.compute_capability
    if major * 10 + minor in C.supported_archs():
        assert obj.target == "cubin" and obj.code[:4] == b"\x7fELF"
        assert obj.log == ""


def test_arch_none_in_a_thread_without_context_uses_device_0() -> None:
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["has_ctx"] = ck.current_context() is not None
            result["obj"] = ck.compile(SAXPY, cache=False)
        except BaseException as exc:
            result["exc"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "exc" not in result, result.get("exc")
    assert result["has_ctx"] is False
    assert result["obj"].arch == ck.Device(0).arch


def test_cubin_loads_and_runs(ctx0: ck.Context) -> None:
    with ctx0:
        obj = ck.compile(SAXPY, cache=False)
        _run_saxpy(obj.code)


def test_ptx_loads_or_warns_according_to_versions(ctx0: ck.Context) -> None:
    drv_ver = _driver.driver_version()
    assert drv_ver is not None
    newer = C.nvrtc_version() > drv_ver
    with ctx0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            obj = ck.compile(SAXPY, target="ptx", cache=False)
        warned = [w for w in caught if issubclass(w.category, C.PtxVersionWarning)]
        assert bool(warned) == newer, f"NVRTC {C.nvrtc_version()} driver {drv_ver}"
        if newer:
            err, mod = drv.cuModuleLoadData(obj.code)
            if int(err) == 0:
                drv.cuModuleUnload(mod)
            assert int(err) == UNSUPPORTED_PTX_VERSION
        else:
            _run_saxpy(obj.code)


def test_fatbin_loads_and_runs(ctx0: ck.Context) -> None:
    try:
        from cuda.bindings import nvfatbin

        nvfatbin.destroy(nvfatbin.create([], 0))
    except Exception:
        pytest.skip("nvidia-nvfatbin is not installed")
    with ctx0:
        obj = ck.compile(SAXPY, target="fatbin", cache=False)
        assert obj.target == "fatbin"
        _run_saxpy(obj.code)


def test_hand_written_ptx_loads_without_nvrtc_and_runs(ctx0: ck.Context) -> None:
    image = C.kernel_source("vector_add_lowisa.ptx").encode() + b"\0"
    n = 5_001
    rng = np.random.default_rng(1)
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    with ctx0, _module(image) as mod, _device_copy(a) as da, _device_copy(b) as db:
        with _device_copy(np.zeros_like(a)) as dc:
            _launch(
                mod,
                "vector_add_ptx",
                8,
                128,
                np.array([da], dtype=np.uint64),
                np.array([db], dtype=np.uint64),
                np.array([dc], dtype=np.uint64),
                np.array([n], dtype=np.uint32),
            )
            got = _to_host(dc, a)
    np.testing.assert_allclose(got, a + b, rtol=1e-6)


def test_template_kernel_by_lowered_name(ctx0: ck.Context) -> None:
    n = 1_000
    with ctx0:
        obj = ck.compile(
            C.kernel_source("templates.cu"), name_expressions=("fill_const<int, 7>",), cache=False
        )
        out = np.zeros(n, dtype=np.int32)
        with _module(obj.code) as mod, _device_copy(out) as d:
            _launch(
                mod,
                obj.lowered_name("fill_const<int, 7>"),
                4,
                128,
                np.array([d], dtype=np.uint64),
                np.array([n], dtype=np.uint64),
            )
            got = _to_host(d, out)
    assert (got == 7).all()


def test_cache_hit_in_new_process_with_context(
    ctx0: ck.Context, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _unique("gpu-subprocess")
    monkeypatch.setenv("CTXKIT_CACHE_DIR", str(tmp_path / "cache"))
    with ctx0:
        first = ck.compile(src)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    script = textwrap.dedent(
        f"""
        import hashlib, json, sys
        sys.modules["cuda.bindings.nvrtc"] = None
        import ctxkit as ck
        with ck.registry.context(0):
            obj = ck.compile({src!r})
            k = ck.Module.load(obj).function("saxpy")
        print(json.dumps({{"cached": obj.from_cache, "arch": obj.arch,
                           "sha": hashlib.sha256(obj.code).hexdigest(), "kernel": repr(k)}}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.splitlines()[-1])
    assert res["cached"] is True and res["arch"] == first.arch
    assert res["sha"] == hashlib.sha256(first.code).hexdigest()


def test_public_module_api_runs_library_kernel(ctx0: ck.Context) -> None:
    n = 65_537
    rng = np.random.default_rng(2)
    x = rng.standard_normal(n, dtype=np.float32)
    with ctx0:
        k = ck.Module.load(ck.compile(C.kernel_source("scale.cu"))).function("scale_f32")
        din = ck.DeviceBuffer(x.nbytes)
        dout = ck.DeviceBuffer(x.nbytes)
        din.copy_from_host(x)
        k.launch(64, 256, din, dout, n, 3.0)
        got = dout.copy_to_host(np.empty_like(x))
        ctx0.synchronize()
    np.testing.assert_allclose(got, 3.0 * x, rtol=1e-6)
