"""Module loading, kernel lookup, parameter layouts and capture on CPU.

Image reading and messages are pure; the rest runs against the module fake of
tests/module/fakemodule.py. Launches are in test_kernel_fake.py and test_launch_fake.py;
the GPU suite (tests/module/test_module_gpu.py, tests/core/test_graph_gpu.py) checks the
same paths against the real driver.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import graph as _graph
from ctxkit.compiler import ObjectCode, compile
from ctxkit.module import kernel as _launch
from ctxkit.module import module as M
from ctxkit.module import module as _image
from tests.module.fakemodule import (  # noqa: F401
    BAD_PTX,
    CUBIN,
    VECTOR_ADD,
    FakeBuffer,
    FakeStream,
    as_u64,
    fake,
    load,
)

# --- images -----------------------------------------------------------------------------


def test_read_image_from_object_code_bytes_text_and_paths(tmp_path: Path):
    src = 'extern "C" __global__ void k(float* x, int n) { if (n) x[0] = 1; }'
    cubin = compile(src, arch="sm_90", target="cubin", cache=False)
    img = M.read_image(cubin)
    assert (img.format, img.code[:4], img.label) == ("cubin", b"\x7fELF", "kernel.cu")
    assert img.ptx and ".entry k(" in img.ptx
    ptx = compile(src, arch="sm_90", target="ptx", cache=False)
    img = M.read_image(ptx, name="mine")
    assert (img.format, img.label, img.code[-1:]) == ("ptx", "mine", b"\0")
    assert img.code.count(b"\0") == 1
    assert M.read_image(cubin.code).format == "cubin"
    assert M.read_image(ptx.code).ptx == (ptx.ptx or "").rstrip("\0")
    text = M.read_image(VECTOR_ADD)
    assert (text.format, text.label, text.code) == (
        "ptx",
        "<PTX text>",
        VECTOR_ADD.encode() + b"\0",
    )
    f = tmp_path / "va.ptx"
    f.write_text(VECTOR_ADD)
    for source in (f, str(f)):
        img = M.read_image(source)
        assert img.format == "ptx" and img.label == str(f)
    fat = compile(src, arch="sm_90", target="fatbin", cache=False)
    img = M.read_image(fat)
    assert img.format == "fatbin" and img.ptx
    assert M.read_image(fat.code).format == "fatbin"
    lowered = ObjectCode(code=b"\x7fELF...", target="cubin", arch="sm_90",
                         lowered_names={"axpy<float>": "_Z4axpy"})  # fmt: skip
    assert M.read_image(lowered).lowered == {"axpy<float>": "_Z4axpy"}


def test_read_image_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="neither a file nor PTX text"):
        M.read_image(str(tmp_path / "missing.ptx"))
    with pytest.raises(TypeError, match="ck.ObjectCode, bytes, PTX text or a path, not int"):
        M.read_image(42)
    with pytest.raises(ValueError, match="not PTX"):
        M.read_image(b"\x00\x01garbage")
    bad = ObjectCode(code=b"x", target="ltoir", arch="sm_90")
    with pytest.raises(ValueError, match="ptx, cubin or fatbin"):
        M.read_image(bad)


def test_missing_kernel_message():
    entries = ["vector_add", "_Z4axpyIfEvT_PKS0_PS0_m"]
    msg = M.missing_kernel_message("vector_ad", "m.ptx", entries, {})
    assert "no kernel 'vector_ad' in module m.ptx" in msg
    assert "Kernels present: vector_add, _Z4axpyIfEvT_PKS0_PS0_m" in msg
    assert "Did you mean 'vector_add'" in msg and 'extern "C"' in msg
    msg = M.missing_kernel_message("axpy", "m", entries, {})
    assert "mangled (_Z4axpyIfEvT_PKS0_PS0_m)" in msg and "name_expressions" in msg
    msg = M.missing_kernel_message("axpy<int>", "m", entries, {})
    assert "name_expressions=('axpy<int>',)" in msg
    lowered = {"axpy<float>": "_Z4axpyIfEvT_PKS0_PS0_m"}
    msg = M.missing_kernel_message("axpy<double>", "m", entries, lowered)
    assert "axpy<float> (_Z4axpyIfEvT_PKS0_PS0_m)" in msg
    assert "unknown" in M.missing_kernel_message("k", "m", None, {})


def test_jit_detail(monkeypatch):
    assert _image.jit_detail(218, None, "", "") == ""
    text = _image.jit_detail(218, None, "ptxas error: bad", "info: 10 registers")
    assert "JIT error log:\nptxas error: bad" in text and "JIT info log:\ninfo" in text
    monkeypatch.setattr(M._driver, "driver_version", lambda: (12, 4))
    text = _image.jit_detail(222, ".version 9.5\n.target sm_90", "", "")
    assert "ISA version 9.5" in text and "CUDA 12.4" in text


def test_function_attribute_names():
    assert _launch.function_attribute("num_regs").name == "CU_FUNC_ATTRIBUTE_NUM_REGS"
    assert _launch.function_attribute("CU_FUNC_ATTRIBUTE_NUM_REGS").name.endswith("NUM_REGS")
    with pytest.raises(ValueError, match="unknown kernel attribute 'regs'.*num_regs"):
        _launch.function_attribute("regs")


def test_public_names_and_error_types():
    assert ck.Module is M.Module and ck.Kernel is M.Kernel
    assert ck.PreparedLaunch is ck.module.PreparedLaunch
    assert issubclass(M.KernelNotFoundError, ck.CudaError)
    assert issubclass(M.KernelNotFoundError, LookupError)


def test_module_load_without_a_driver_says_so():
    if ck.device_count() > 0:
        pytest.skip("this machine has a driver")
    with pytest.raises(ck.DriverNotFoundError):
        M.Module.load(VECTOR_ADD)


def test_capture_argument_errors():
    with pytest.raises(ValueError, match="created stream"):
        with _graph.capture(None):
            pass
    with pytest.raises(ValueError, match="mode must be one of"):
        with _graph.capture(object(), mode="everything"):
            pass


# --- loading and looking up (fake driver) -----------------------------------------------


def test_library_load_and_function_lookup(fake):
    mod = load()
    assert mod.context is None and mod.format == "ptx"
    assert mod.entries == ["vector_add", "saxpy", "_Z4axpyIfEvT_PKS0_PS0_m"]
    k = mod.function("vector_add")
    assert mod.function("vector_add") is k
    assert [p.type for p in k.params] == ["u64"] * 4
    assert "vector_add(.u64 a" in repr(k)
    with pytest.raises(M.KernelNotFoundError, match="Kernels present: vector_add, saxpy") as info:
        mod.function("vectoradd")
    assert info.value.code == 500 and "Did you mean 'vector_add'" in str(info.value)


def test_name_expressions_resolve_to_lowered_names(fake):
    obj = ObjectCode(code=VECTOR_ADD.encode() + b"\0", target="ptx", arch="compute_52",
                     lowered_names={"axpy<float>": "_Z4axpyIfEvT_PKS0_PS0_m"})  # fmt: skip
    k = M.Module.load(obj).function("axpy<float>")
    assert (k.name, k.symbol) == ("axpy<float>", "_Z4axpyIfEvT_PKS0_PS0_m")
    assert [p.type for p in k.params] == ["f32", "u64", "u64", "u64"]


def test_jit_failure_raises_compile_error_with_the_log(fake):
    with pytest.raises(ck.CompileError, match="ptxas fatal: bad") as info:
        load(BAD_PTX, name="broken.ptx")
    assert info.value.log == "ptxas fatal: bad"
    assert info.value.name == "CUDA_ERROR_INVALID_PTX"
    assert "cuLibraryLoadData(broken.ptx, ptx)" in str(info.value)


def test_library_is_unloaded_on_close_and_when_collected(fake):
    mod = load()
    handle = int(mod._handle)
    mod.close()
    mod.close()
    assert fake.unloaded == [handle]
    with pytest.raises(ck.CudaError, match="is closed"):
        mod.function("saxpy")
    mod2 = load()
    h2 = int(mod2._handle)
    del mod2
    gc.collect()
    assert h2 in fake.unloaded


# --- graphs (fake driver) ---------------------------------------------------------------


def test_capture_records_launches_and_replays(fake):
    k = load().function("vector_add")
    ctx = ck.registry.context(0)
    s = FakeStream(ctx, 0x123)
    with ctx:
        pl = k.prepare(1, 1, 0, 0, 0, 0, stream=s)
    with ctx, _graph.capture(s) as g:
        assert g.num_nodes == 0
        for _ in range(3):
            pl()
        k.launch(1, 1, 0, 0, 0, 0, stream=s)
    assert g.num_nodes == 4 and len(fake.graph_nodes) == 1  # the CUgraph is kept
    assert fake.capture_mode.name == "CU_STREAM_CAPTURE_MODE_THREAD_LOCAL"
    with ctx:
        g.launch(s)
    with ck.registry.context(1):
        g.launch()  # binds the graph's own context
        g.upload(s)
    assert [(h, c) for _e, h, c in fake.graph_launches] == [(0x123, ctx.handle), (0, ctx.handle)]
    assert [(h, c) for _e, h, c in fake.graph_uploads] == [(0x123, ctx.handle)]
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(errors, g.upload))
    t.start()
    t.join()
    assert errors == []  # a thread with no context: the graph binds its own
    assert fake.graph_uploads[-1][2] == ctx.handle
    g.close()
    g.close()
    assert fake.exec_destroyed and fake.exec_destroyed[0][1] == ctx.handle
    assert fake.graph_nodes == {}  # close() destroys the CUgraph too
    with pytest.raises(ck.CudaError, match="graph is empty"):
        g.launch()
    with pytest.raises(ck.CudaError, match="graph is empty"):
        g.upload()
    assert "Graph 4 nodes" in repr(g)


def _catch(errors: list[BaseException], fn: Any) -> None:
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)


def test_capture_ends_cleanly_when_the_block_raises(fake):
    ctx = ck.registry.context(0)
    s = FakeStream(ctx, 0x321)
    with ctx:
        with pytest.raises(RuntimeError, match="boom"), _graph.capture(s, mode="global") as g:
            raise RuntimeError("boom")
    assert fake.capturing == {} and fake.graph_nodes == {}
    with pytest.raises(ck.CudaError, match="graph is empty"):
        g.launch()
    with pytest.raises(ValueError, match="default stream cannot be captured"):
        with ctx, _graph.capture(FakeStream(ctx, 0)):
            pass


def test_jit_log_is_recovered_in_the_current_context(fake):
    silent = BAD_PTX.replace("BAD", "SILENT")
    with pytest.raises(ck.CompileError) as info:
        load(silent)
    assert info.value.log == ""  # no context current: nothing to re-read the log with
    with ck.registry.context(0), pytest.raises(ck.CompileError) as info:
        load(silent)
    assert info.value.log == "diagnosed: bad" and "JIT error log:\ndiagnosed: bad" in str(
        info.value
    )


def test_cubin_without_ptx_uses_the_driver_layout(fake):
    mod = load(CUBIN)
    assert (mod.format, mod.ptx) == ("cubin", None)
    assert mod.entries == ["vector_add", "saxpy", "_Z4axpyIfEvT_PKS0_PS0_m"]
    k = mod.function("saxpy")  # no context current: device 0's is bound for the query
    c0 = ck.registry.context(0)
    assert set(fake.param_info_contexts) == {c0.handle}
    assert fake.base.current() == 0 and ck.current_context() is None
    assert [(p.kind, p.offset, p.size) for p in k.params] == [
        ("bits", 0, 4),
        ("bits", 8, 8),
        ("bits", 16, 8),
        ("bits", 24, 8),
    ]
    assert k.signature is not None and "type unknown" in k.params[0].ptx_type
    with ck.registry.context(0):
        with pytest.raises(ck.LaunchArgumentError, match=r"np\.float32\(x\)"):
            k.launch(1, 1, 2.0, FakeBuffer(8), FakeBuffer(16), 4)
        k.launch(1, 1, np.float32(2.0), FakeBuffer(8), FakeBuffer(16), 4)
    vals = fake.launches[-1]["values"]
    assert np.frombuffer(vals[0], np.float32)[0] == 2.0
    assert [as_u64(v) for v in vals[1:]] == [8, 16, 4]


def test_layout_query_uses_the_current_context(fake):
    c1 = ck.registry.context(1)
    with c1:
        k = load(CUBIN).function("vector_add")
    assert set(fake.param_info_contexts) == {c1.handle}
    assert [p.size for p in k.params] == [8, 8, 8, 8]
    raw = fake.base.primary[0]
    fake.base.cuCtxPushCurrent(raw)  # current through a raw driver call, unknown to ctxkit
    try:
        load(CUBIN).function("saxpy")
    finally:
        fake.base.cuCtxPopCurrent()
    assert fake.param_info_contexts[-1] == int(raw)


def test_layout_falls_back_to_the_function_in_the_context(fake):
    fake.param_info_error = 801
    k = load(CUBIN).function("saxpy")
    assert [(p.offset, p.size) for p in k.params] == [(0, 4), (8, 8), (16, 8), (24, 8)]
    assert fake.base.current() == 0


def test_unknown_layout_is_refused_with_the_reason(fake):
    fake.param_info = False
    fake.func_param_info = False
    k = load(CUBIN).function("vector_add")
    assert k.signature is None
    with pytest.raises(ck.LaunchArgumentError, match="parameter list of kernel 'vector_") as info:
        _ = k.params
    assert "cuKernelGetParamInfo is not available in this driver" in str(info.value)
    with ck.registry.context(0), pytest.raises(ck.LaunchArgumentError, match="unknown"):
        k.launch(1, 1, 0, 0, 0, 0)
    assert fake.launches == []


def test_failed_layout_query_names_each_call_and_its_cuda_error(fake):
    fake.param_info_error = 801
    fake.func_param_info = False
    k = load(CUBIN).function("saxpy")
    with pytest.raises(ck.LaunchArgumentError) as info:
        _ = k.params
    msg = str(info.value)
    assert "cuKernelGetParamInfo(param 0) returned CUDA_ERROR_NOT_SUPPORTED" in msg
    assert "cuFuncGetParamInfo is not available" in msg


def test_layout_query_without_a_usable_context_says_so(fake):
    k = load().function("vector_add")
    c0 = ck.registry.context(0)
    fake.fail_next = 700
    with c0, pytest.raises(ck.ContextPoisonedError):
        k.launch(1, 1, 0, 0, 0, 0)
    k2 = load(CUBIN).function("saxpy")
    with pytest.raises(ck.LaunchArgumentError, match="no usable context to query it in.*poisoned"):
        _ = k2.params
