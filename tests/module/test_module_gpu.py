"""Module loading on a real device: PTX, cubin, fatbin, JIT logs, names, contexts, layouts."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import ctxkit as ck
import ctxkit.compiler as C
from ctxkit import _driver
from ctxkit._driver import drv
from ctxkit.memory import to_device
from ctxkit.module import KernelNotFoundError, Module

REPO = Path(__file__).resolve().parents[2]
VECTOR_ADD = C.kernel_source("vector_add.cu")
SAXPY = C.kernel_source("saxpy.cu")

BAD_PTX = """
.version 7.0
.target sm_52
.address_size 64
.visible .entry bad(.param .u64 p)
{
    .reg .b32 %r<2>;
    mov.u32 %r1, %no_such_register;
    ret;
}
"""


def _obj(source: str, target: str, ctx: ck.Context, **kw) -> ck.ObjectCode:
    try:
        return ck.compile(source, arch=ctx.device.arch, target=target, **kw)
    except ck.CompileError as exc:
        if target == "fatbin" and "nvFatbin" in str(exc):
            pytest.skip(f"no nvFatbin library on this machine: {exc}")
        raise


def _check_vector_add(k: ck.Kernel, ctx: ck.Context, n: int = 100_003) -> None:
    rng = np.random.default_rng(n)
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    with ctx:
        da, db = to_device(a), to_device(b)
        dc = ck.device_array(n, np.float32)
        k.launch(256, 256, da, db, dc, n)
        out = dc.to_host()
    np.testing.assert_array_equal(out, a + b)


@pytest.mark.parametrize("target", ["ptx", "cubin", "fatbin"])
def test_load_each_format_and_compute(ctx0, target):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", C.PtxVersionWarning)
        obj = _obj(VECTOR_ADD, target, ctx0)
    drv_version = _driver.driver_version()
    assert drv_version is not None
    if target == "ptx" and C.nvrtc_version() > drv_version:
        # PTX from a newer NVRTC cannot load: the error must say why, not just fail
        with ctx0, pytest.raises(ck.CompileError) as info:
            Module.load(obj).function("vector_add").launch(1, 1, 0, 0, 0, 0)
        assert info.value.name == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"
        assert "older than the NVRTC that wrote it" in str(info.value)
        return
    mod = Module.load(obj)
    assert mod.format == target and mod.context is None
    k = mod.function("vector_add")
    assert [p.type for p in k.params] == ["u64", "u64", "u64", "u64"]
    _check_vector_add(k, ctx0)


def test_load_from_bytes_and_files(ctx0, tmp_path):
    obj = _obj(VECTOR_ADD, "cubin", ctx0)
    _check_vector_add(Module.load(obj.code).function("vector_add"), ctx0)
    path = obj.save(tmp_path / "va.cubin")
    mod = Module.load(path)
    assert mod.name == str(path) and mod.format == "cubin"
    _check_vector_add(mod.function("vector_add"), ctx0)


def test_hand_written_ptx_needs_no_nvrtc(ctx0):
    mod = Module.load(REPO / "ptx" / "vector_add_lowisa.ptx")
    k = mod.function("vector_add_ptx")
    assert [(p.name, p.type) for p in k.params] == [
        ("a", "u64"),
        ("b", "u64"),
        ("c", "u64"),
        ("n", "u32"),
    ]
    _check_vector_add(k, ctx0, n=4099)
    assert isinstance(mod.jit_log, str)


def test_jit_error_log_is_in_the_exception(ctx0):
    with ctx0:
        with pytest.raises(ck.CompileError) as info:
            mod = Module.load(BAD_PTX, name="bad.ptx")
            mod.function("bad").launch(1, 1, 0)  # lazy loading may defer the JIT to here
    err = info.value
    assert err.name in ("CUDA_ERROR_INVALID_PTX", "CUDA_ERROR_INVALID_IMAGE")
    assert err.log, "the JIT error log must be captured"
    assert "no_such_register" in err.log or "error" in err.log.lower()
    assert err.log in str(err)


def test_jit_error_log_for_a_bound_module(ctx0):
    with pytest.raises(ck.CompileError) as info:
        Module.load(BAD_PTX, context=ctx0)
    assert info.value.log and "JIT error log" in str(info.value)


def test_wrong_kernel_name_lists_the_kernels(ctx0):
    mod = Module.load(_obj(VECTOR_ADD + SAXPY, "cubin", ctx0))
    with pytest.raises(KernelNotFoundError) as info:
        mod.function("vectoradd")
    msg = str(info.value)
    assert "vector_add" in msg and "saxpy" in msg and "Did you mean 'vector_add'" in msg
    assert info.value.name == "CUDA_ERROR_NOT_FOUND"


def test_template_kernels_through_name_expressions(ctx0):
    src = C.kernel_source("templates.cu")
    obj = _obj(src, "cubin", ctx0, name_expressions=("axpy<float>",))
    mod = Module.load(obj)
    k = mod.function("axpy<float>")
    assert k.symbol.startswith("_Z") and k.params[0].type == "f32"
    n = 1000
    x = np.arange(n, dtype=np.float32)
    y = np.ones(n, np.float32)
    with ctx0:
        dx, dy = to_device(x), to_device(y)
        k.launch(4, 256, 2.0, dx, dy, n)
        np.testing.assert_array_equal(dy.to_host(), 2 * x + y)
    with pytest.raises(KernelNotFoundError, match="mangled"):
        mod.function("axpy")


def test_cubin_without_ptx_uses_the_driver_layout(ctx0):
    obj = _obj(SAXPY, "cubin", ctx0)
    mod = Module.load(obj.code)  # raw bytes: no PTX kept
    assert mod.ptx is None
    assert "saxpy" in (mod.entries or [])
    k = mod.function("saxpy")
    assert k.signature is not None
    assert [(p.offset, p.size) for p in k.params] == [(0, 4), (8, 8), (16, 8), (24, 8)]
    n = 513
    x = np.linspace(0, 1, n, dtype=np.float32)
    y = np.full(n, 3, np.float32)
    with ctx0:
        dx, dy = to_device(x), to_device(y)
        with pytest.raises(ck.LaunchArgumentError, match="np.float32"):
            k.launch(2, 256, 2.0, dx, dy, n)  # type unknown: a Python float is ambiguous
        k.launch(2, 256, np.float32(2.0), dx, dy, n)
        np.testing.assert_allclose(dy.to_host(), np.float32(2) * x + y, rtol=1e-6)


def test_cubin_without_ptx_in_a_thread_without_a_context(ctx0):
    """The layout query binds device 0's context when the thread has none."""
    code = _obj(SAXPY, "cubin", ctx0).code
    out: list[object] = []

    def worker() -> None:
        try:
            k = Module.load(code).function("saxpy")
            out.append([(p.offset, p.size) for p in k.params])
            out.append(ck.current_context())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert out[0] == [(0, 4), (8, 8), (16, 8), (24, 8)], out
    assert out[1] is None, "the query must not leave a context current"


def test_parsed_layout_matches_the_driver(ctx0):
    """Offsets and sizes from our PTX parser equal cuKernelGetParamInfo's."""
    invalid_value = drv.CUresult.CUDA_ERROR_INVALID_VALUE
    with ctx0:
        for name in ("vector_add.cu", "saxpy.cu", "scale.cu", "fill.cu", "spin.cu", "empty.cu"):
            mod = Module.load(_obj(C.kernel_source(name), "cubin", ctx0))
            for entry in mod.entries or []:
                k = mod.function(entry)
                driver = []
                while True:
                    res = drv.cuKernelGetParamInfo(k._handle, len(driver))
                    if res[0]:
                        break
                    driver.append((int(res[1]), int(res[2])))
                assert res[0] == invalid_value, f"{entry}: {res[0]!r} at {len(driver)}"
                assert driver, f"{entry}: the driver reported no parameters"
                assert [(p.offset, p.size) for p in k.params] == driver, entry
                raw = Module.load(_obj(C.kernel_source(name), "cubin", ctx0).code)
                assert [(p.offset, p.size) for p in raw.function(entry).params] == driver


@pytest.mark.multigpu
def test_one_library_kernel_on_two_devices(ctx0, ctx1):
    k = Module.load(_obj(VECTOR_ADD, "cubin", ctx0)).function("vector_add")
    _check_vector_add(k, ctx0)
    _check_vector_add(k, ctx1)
    assert {c.device.ordinal for c, _f in k._funcs.values()} == {0, 1}


def test_bound_module_used_from_another_context_names_both(ctx0):
    owned = ck.Context.create(0)
    try:
        mod = Module.load(_obj(VECTOR_ADD, "cubin", ctx0), context=owned)
        assert mod.context is owned
        with owned:
            k = mod.function("vector_add")
        _check_vector_add(k, owned)
        with ctx0, pytest.raises(ck.CudaError) as info:
            k.launch(1, 32, 0, 0, 0, 0)
        msg = str(info.value)
        assert repr(owned) in msg and repr(ctx0) in msg
        assert "INVALID_HANDLE" in info.value.name
        mod.close()
    finally:
        owned.close()


@pytest.mark.multigpu
def test_bound_module_on_the_second_device(ctx0, ctx1):
    mod = Module.load(_obj(VECTOR_ADD, "cubin", ctx1), context=ctx1)
    with ctx1:
        k = mod.function("vector_add")
    _check_vector_add(k, ctx1)
    with ctx0, pytest.raises(ck.CudaError, match="bound to"):
        k.launch(1, 1, 0, 0, 0, 0)


def test_attributes_and_occupancy(ctx0):
    k = Module.load(_obj(VECTOR_ADD, "cubin", ctx0)).function("vector_add")
    with ctx0:
        attrs = k.attributes
        assert attrs["max_threads_per_block"] == 1024
        assert attrs["num_regs"] > 0 and "shared_size_bytes" in attrs
        block = k.max_block_size()
        assert 32 <= block <= 1024 and block % 32 == 0
        assert k.max_block_size(block_size_limit=128) <= 128
        assert k.occupancy(block) >= 1
        grid, b = k.launch_config(1_000_000)
        assert b == block and grid * b >= 1_000_000
    errors: list[BaseException] = []

    def worker() -> None:  # a fresh thread truly has no current context
        try:
            k.max_block_size()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker, name="occupancy-no-ctx")
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ck.NoCurrentContextError), errors
    assert "max_block_size" in str(errors[0]) and "occupancy-no-ctx" in str(errors[0])


def test_close_unloads(ctx0):
    mod = Module.load(_obj(VECTOR_ADD, "cubin", ctx0))
    k = mod.function("vector_add")
    with ctx0:
        pl = k.prepare(1, 1, 0, 0, 0, 0)
    mod.close()
    with ctx0, pytest.raises(ck.CudaError, match="is closed"):
        k.launch(1, 1, 0, 0, 0, 0)
    with ctx0, pytest.raises(ck.CudaError, match="is closed"):
        pl()
    with pytest.raises(ck.CudaError, match="is closed"):
        mod.function("vector_add")  # it was looked up (cached) before the close
    with pytest.raises(ck.CudaError, match="is closed"):
        k.launch(1, 1, 0, 0, 0, 0)  # outside ctxkit: whatever the driver has current
    errors: list[BaseException] = []

    def worker() -> None:  # a thread with no context at all
        try:
            k.launch(1, 1, 0, 0, 0, 0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(errors) == 1 and "is closed" in str(errors[0]), errors
