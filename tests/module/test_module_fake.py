"""Module / Kernel / PreparedLaunch / Graph logic on CPU.

Image reading and messages are pure; the launch logic runs against a fake of the
driver's library, module, launch and graph calls (on top of tests/support/fakedriver.py's
context stack), so context routing, argument checking, error mapping and capture are
exercised without a GPU. The GPU suite (tests/module/test_module_gpu.py,
tests/module/test_kernel_gpu.py, tests/core/test_graph_gpu.py) checks the same paths
against the real driver.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit import graph as _graph
from ctxkit import stream as stream_mod
from ctxkit.compiler import ObjectCode, compile
from ctxkit.module import image as _image
from ctxkit.module import kernel as _kernel
from ctxkit.module import module as M
from ctxkit.module import ptxsig
from tests.support.fakedriver import FakeHandle, swap_driver

VECTOR_ADD = """
.version 7.0
.target sm_52
.address_size 64
.visible .entry vector_add(
    .param .u64 a, .param .u64 b, .param .u64 c, .param .u64 n
)
{ ret; }
.visible .entry saxpy(.param .f32 a, .param .u64 x, .param .u64 y, .param .u64 n)
{ ret; }
.weak .entry _Z4axpyIfEvT_PKS0_PS0_m(.param .f32 a, .param .u64 x, .param .u64 y,
    .param .u64 n)
{ ret; }
"""

BAD_PTX = ".version 7.0\n.target sm_52\n.visible .entry broken() { BAD; }\n"


class FakeBuffer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class FakeStream:
    def __init__(self, ctx: ck.Context, handle: int = 0x77) -> None:
        self.context = ctx
        self.handle = FakeHandle(handle)


_IDS = itertools.count(0x10_0000, 0x10)  # unique across tests: late finalizers stay apart


class ModuleDriver:
    """Library/module/launch/graph calls, delegating context calls to the fake stack."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.ids = _IDS
        self.libraries: dict[int, dict[str, ptxsig.Signature]] = {}
        self.kernels: dict[int, tuple[int, str]] = {}
        self.functions: dict[int, tuple[str, int]] = {}  # handle -> (kernel name, context)
        self.launches: list[dict[str, Any]] = []
        self.unloaded: list[int] = []
        self.fail_next: int = 0
        self.capturing: dict[int, int] = {}
        self.graph_nodes: dict[int, int] = {}
        self.exec_destroyed: list[tuple[int, int]] = []
        self.graph_launches: list[tuple[int, int, int]] = []
        self.graph_uploads: list[tuple[int, int, int]] = []
        self.param_info_contexts: list[int] = []
        self.attrs = {"MAX_THREADS_PER_BLOCK": 1024, "MAX_DYNAMIC_SHARED_SIZE_BYTES": 49152}
        base.cuDeviceGetAttribute = lambda attr, dev: (0, 1024)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def CUstream(self, handle: Any) -> Any:
        return handle

    def _new(self) -> FakeHandle:
        return FakeHandle(next(self.ids))

    # libraries and modules
    def cuLibraryLoadData(self, code, keys, vals, n, lkeys, lvals, ln):
        assert n == len(keys) == len(vals) and ln == 0
        if b"SILENT" in code:
            return (218, None)  # a failure that leaves the log buffers empty
        if b"BAD" in code:
            vals[2][: len(b"ptxas fatal: bad")] = b"ptxas fatal: bad"
            return (218, None)
        h = self._new()
        cubin = code.startswith(b"\x7fELF")
        self.libraries[int(h)] = ptxsig.parse_entries(VECTOR_ADD if cubin else code)
        return (0, h)

    param_info = True
    param_info_error = 0  # a CUresult cuKernelGetParamInfo returns even in a context
    func_param_info = True

    def _layout(self, name: str, index: int) -> tuple[int, int, int]:
        params = next(lib[name] for lib in self.libraries.values() if name in lib).params
        if index >= len(params):
            return (1, 0, 0)
        return (0, params[index].offset, params[index].size)

    def cuKernelGetParamInfo(self, kernel, index):
        if not self.param_info:
            raise RuntimeError("Function cuKernelGetParamInfo not found")
        cur = self.base.current()
        self.param_info_contexts.append(cur)
        if not cur:
            return (201, 0, 0)  # library-kernel queries need a current context
        if self.param_info_error:
            return (self.param_info_error, 0, 0)
        return self._layout(self.kernels[int(kernel)][1], index)

    def cuFuncGetParamInfo(self, func, index):
        if not self.func_param_info:
            raise RuntimeError("Function cuFuncGetParamInfo not found")
        name, ctx = self.functions[int(func)]
        if ctx != self.base.current():
            return (400, 0, 0)
        return self._layout(name, index)

    def cuLibraryGetKernelCount(self, lib):
        return (0, len(self.libraries[int(lib)]))

    def cuLibraryEnumerateKernels(self, n, lib):
        names = list(self.libraries[int(lib)])[:n]
        return (0, [self.cuLibraryGetKernel(lib, x.encode())[1] for x in names])

    def cuKernelGetName(self, kernel):
        return (0, self.kernels[int(kernel)][1].encode())

    def cuLibraryGetKernel(self, lib, name: bytes):
        if name.decode() not in self.libraries[int(lib)]:
            return (500, None)
        h = self._new()
        self.kernels[int(h)] = (int(lib), name.decode())
        return (0, h)

    def cuKernelGetFunction(self, kernel):
        cur = self.base.current()
        if not cur:
            return (201, None)
        h = self._new()
        self.functions[int(h)] = (self.kernels[int(kernel)][1], cur)
        self.base.calls["cuKernelGetFunction"] += 1
        return (0, h)

    def cuLibraryUnload(self, lib):
        self.unloaded.append(int(lib))
        return (0,)

    def cuModuleLoadDataEx(self, image, n, keys, vals):
        cur = self.base.current()
        if not cur:
            return (201, None)
        if b"SILENT" in image:
            vals[2][:14] = b"diagnosed: bad"
            return (218, None)
        h = self._new()
        self.libraries[int(h)] = ptxsig.parse_entries(image)
        self.module_ctx = cur
        return (0, h)

    def cuModuleGetFunction(self, mod, name: bytes):
        if name.decode() not in self.libraries[int(mod)]:
            return (500, None)
        h = self._new()
        self.functions[int(h)] = (name.decode(), self.base.current())
        return (0, h)

    def cuModuleUnload(self, mod):
        self.unloaded.append(int(mod))
        return (0,)

    # launches
    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shm, hs, params, extra):
        name, ctx = self.functions[int(f)]
        cur = self.base.current()
        if ctx != cur:
            return (400,)
        if self.fail_next:
            code, self.fail_next = self.fail_next, 0
            return (code,)
        if bx * by * bz > self.attrs["MAX_THREADS_PER_BLOCK"]:
            return (1,)
        sig = next(lib[name] for lib in self.libraries.values() if name in lib)
        ptrs: Any = (
            (ctypes.c_void_p * max(len(sig.params), 1)).from_address(params) if params else []
        )
        values = [ctypes.string_at(ptrs[i], p.size) for i, p in enumerate(sig.params)]
        self.launches.append(
            dict(
                name=name,
                ctx=cur,
                grid=(gx, gy, gz),
                block=(bx, by, bz),
                shm=shm,
                stream=int(hs),
                values=values,
            )
        )
        if int(hs) in self.capturing:
            self.capturing[int(hs)] += 1
        return (0,)

    def cuFuncGetAttribute(self, attr, func):
        return (0, self.attrs.get(attr.name[len("CU_FUNC_ATTRIBUTE_") :], 7))

    def cuFuncSetAttribute(self, func, attr, value):
        self.attrs[attr.name[len("CU_FUNC_ATTRIBUTE_") :]] = value
        return (0,)

    def cuOccupancyMaxPotentialBlockSize(self, func, cb, shm, limit):
        assert cb is None
        return (0, 264, 768 if not limit else min(768, limit))

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, func, block, shm):
        return (0, 2048 // block)

    def cuPointerGetAttribute(self, attr, ptr):
        return (1, None)

    # graphs
    def cuStreamBeginCapture(self, hs, mode):
        self.capture_mode = mode
        self.capturing[int(hs)] = 0
        return (0,)

    def cuStreamEndCapture(self, hs):
        n = self.capturing.pop(int(hs))
        g = self._new()
        self.graph_nodes[int(g)] = n
        return (0, g)

    def cuGraphGetNodes(self, g, num):
        return (0, None, self.graph_nodes[int(g)])

    def cuGraphInstantiate(self, g, flags):
        return (0, self._new())

    def cuGraphDestroy(self, g):
        self.graph_nodes.pop(int(g))
        return (0,)

    def cuGraphLaunch(self, exe, hs):
        self.graph_launches.append((int(exe), int(hs), self.base.current()))
        return (0,)

    def cuGraphUpload(self, exe, hs):
        self.graph_uploads.append((int(exe), int(hs), self.base.current()))
        return (0,)

    def cuGraphExecDestroy(self, exe):
        self.exec_destroyed.append((int(exe), self.base.current()))
        return (0,)


_real = M.drv
for _enum in ("CUjit_option", "CUfunction_attribute", "CUstreamCaptureMode", "CUpointer_attribute"):
    setattr(ModuleDriver, _enum, getattr(_real, _enum))


@pytest.fixture
def fake(fake_driver, monkeypatch):
    gc.collect()  # modules of earlier tests unload now, not into this test's records
    drv = ModuleDriver(fake_driver)
    swap_driver(monkeypatch, drv)
    monkeypatch.setattr(stream_mod, "_foreign_stream_int", lambda s: s.handle)
    return drv


def load(text: str | bytes = VECTOR_ADD, **kw: Any) -> M.Module:
    return M.Module.load(text, **kw)


def as_u64(b: bytes) -> int:
    return int.from_bytes(b, "little")


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
    assert _kernel._function_attribute("num_regs").name == "CU_FUNC_ATTRIBUTE_NUM_REGS"
    assert _kernel._function_attribute("CU_FUNC_ATTRIBUTE_NUM_REGS").name.endswith("NUM_REGS")
    with pytest.raises(ValueError, match="unknown kernel attribute 'regs'.*num_regs"):
        _kernel._function_attribute("regs")


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


# --- launching (fake driver) ------------------------------------------------------------


def test_one_kernel_launches_in_each_context_with_a_cached_function(fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    a, b, c = FakeBuffer(0x1000), FakeBuffer(0x2000), FakeBuffer(0x3000)
    with c0:
        k.launch(4, 256, a, b, c, 1000)
        k.launch((4, 2), (32, 8), a, b, c, np.uint64(5))
    with c1:
        k.launch(1, 1, a, b, c, 3)
    assert fake.base.calls["cuKernelGetFunction"] == 2  # once per context
    l0, l1, l2 = fake.launches
    assert (l0["ctx"], l1["ctx"], l2["ctx"]) == (c0.handle, c0.handle, c1.handle)
    assert [as_u64(v) for v in l0["values"]] == [0x1000, 0x2000, 0x3000, 1000]
    assert (l0["grid"], l0["block"], l0["shm"], l0["stream"]) == ((4, 1, 1), (256, 1, 1), 0, 0)
    assert (l1["grid"], l1["block"]) == ((4, 2, 1), (32, 8, 1))
    assert as_u64(l1["values"][3]) == 5


def test_float_parameter_is_packed_as_f32(fake):
    k = load().function("saxpy")
    with ck.registry.context(0):
        k.launch(1, 32, 2.5, FakeBuffer(8), FakeBuffer(16), 4)
    vals = fake.launches[-1]["values"]
    assert np.frombuffer(vals[0], np.float32)[0] == 2.5
    assert [as_u64(v) for v in vals[1:]] == [8, 16, 4]


def test_no_current_context_in_a_worker_thread(fake):
    k = load().function("vector_add")
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            k.launch(1, 1, 0, 0, 0, 0)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker, name="no-ctx-worker")
    t.start()
    t.join()
    assert isinstance(errors[0], ck.NoCurrentContextError)
    assert "launching kernel 'vector_add'" in str(errors[0]) and "no-ctx-worker" in str(errors[0])
    assert fake.launches == []


def test_bad_arguments_never_reach_the_driver(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        with pytest.raises(ck.LaunchArgumentError, match=r"parameter 3 'n' \(.u64\)"):
            k.launch(1, 1, FakeBuffer(1), FakeBuffer(2), FakeBuffer(3), 2.5)
        with pytest.raises(ck.LaunchArgumentError, match="takes 4 arguments but 2"):
            k.launch(1, 1, FakeBuffer(1), FakeBuffer(2))
        with pytest.raises(ck.LaunchArgumentError, match="pageable host memory"):
            k.launch(1, 1, np.zeros(4), FakeBuffer(2), FakeBuffer(3), 4)
        with pytest.raises(ValueError, match="block dimensions must be positive"):
            k.launch(1, 0, FakeBuffer(1), FakeBuffer(2), FakeBuffer(3), 4)
        with pytest.raises(TypeError, match="grid must be an int or a tuple"):
            k.launch(1.5, 1, FakeBuffer(1), FakeBuffer(2), FakeBuffer(3), 4)  # type: ignore[arg-type]
    assert fake.launches == []


def test_launch_config_error_is_explained_with_limits(fake):
    k = load().function("vector_add")
    fake.attrs["MAX_THREADS_PER_BLOCK"] = 512
    with ck.registry.context(0), pytest.raises(ck.CudaError) as info:
        k.launch(1, 1024, 0, 0, 0, 0)
    msg = str(info.value)
    assert "CUDA_ERROR_INVALID_VALUE" in msg
    assert "1024 threads, more than this kernel's limit of 512" in msg
    assert not isinstance(info.value, ck.ContextPoisonedError)


def test_sticky_launch_error_poisons_the_context(fake):
    k = load().function("vector_add")
    ctx = ck.registry.context(0)
    fake.fail_next = 700
    with ctx, pytest.raises(ck.ContextPoisonedError, match="ILLEGAL_ADDRESS"):
        k.launch(1, 1, 0, 0, 0, 0)
    assert ctx.poisoned
    with pytest.raises(ck.ContextPoisonedError):
        ctx.check_usable()


def test_bound_module_refuses_other_contexts_naming_both(fake):
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    mod = load(context=c0)
    assert mod.context is c0 and fake.module_ctx == c0.handle
    with pytest.raises(ck.NoCurrentContextError, match="Module.function"):
        mod.function("vector_add")  # like every ctxkit object: a thread needs a context
    with c1:
        k = mod.function("vector_add")  # looked up in the module's own context
    with c0:
        k.launch(1, 1, 0, 0, 0, 0)
    with c1, pytest.raises(ck.CudaError) as info:
        k.launch(1, 1, 0, 0, 0, 0)
    msg = str(info.value)
    assert repr(c0) in msg and repr(c1) in msg and "context=" in msg
    assert info.value.name == "CUDA_ERROR_INVALID_HANDLE"
    assert len(fake.launches) == 1
    mod.close()
    assert fake.unloaded == [int(mod._handle)]


def test_stream_of_another_context_is_refused(fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    with c0:
        k.launch(1, 1, 0, 0, 0, 0, stream=FakeStream(c0, 0x55))
        with pytest.raises(ck.CudaError, match="belongs to"):
            k.launch(1, 1, 0, 0, 0, 0, stream=FakeStream(c1))
    assert [launch["stream"] for launch in fake.launches] == [0x55]


def test_attributes_and_occupancy(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        attrs = k.attributes
        assert attrs["max_threads_per_block"] == 1024 and "num_regs" in attrs
        assert "max" not in attrs
        assert k.attribute("max_threads_per_block") == 1024
        k.set_attribute("max_dynamic_shared_size_bytes", 100_000)
        assert k.attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES") == 100_000
        assert k.max_block_size() == 768
        assert k.max_block_size(block_size_limit=256) == 256
        assert k.occupancy(256) == 8
        assert k.launch_config(10_000) == (14, 768)
        assert k.launch_config(0) == (1, 768)
    with pytest.raises(ck.NoCurrentContextError):
        k.max_block_size()


# --- PreparedLaunch (fake driver) -------------------------------------------------------


def test_prepared_launch_and_set_arg(fake):
    k = load().function("vector_add")
    ctx = ck.registry.context(0)
    a, b, c = FakeBuffer(0x10), FakeBuffer(0x20), FakeBuffer(0x30)
    with ctx:
        pl = k.prepare(2, 64, a, b, c, 100, stream=FakeStream(ctx, 0x99))
        pl()
        pl.set_arg(3, 50)
        pl.set_arg("c", FakeBuffer(0x40))
        pl()
        with pytest.raises(ck.LaunchArgumentError, match="parameter 3"):
            pl.set_arg("n", -1.5)
        with pytest.raises(KeyError, match="no parameter 'z'"):
            pl.set_arg("z", 1)
    first, second = fake.launches
    assert [as_u64(v) for v in first["values"]] == [0x10, 0x20, 0x30, 100]
    assert [as_u64(v) for v in second["values"]] == [0x10, 0x20, 0x40, 50]
    assert first["stream"] == 0x99 and first["grid"] == (2, 1, 1)
    assert pl.args[2].ptr == 0x40 and pl.context is ctx
    assert "vector_add" in repr(pl)


def test_prepared_launch_binds_its_context_or_needs_one(fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    with c0:
        pl = k.prepare(1, 1, 0, 0, 0, 0)
    with c1:
        pl()  # another context is current: the launch's own context is bound for it
    assert fake.launches[-1]["ctx"] == c0.handle
    assert fake.base.current() == 0
    with pytest.raises(ck.NoCurrentContextError):
        pl()
    with pytest.raises(ValueError, match="shared_mem"):
        with c0:
            k.prepare(1, 1, 0, 0, 0, 0, shared_mem=-1)


def test_every_use_of_a_closed_module_says_it_is_closed(fake):
    mod = load()
    k = mod.function("vector_add")
    c0 = ck.registry.context(0)
    with c0:
        k.launch(1, 1, 0, 0, 0, 0)
    mod.close()
    with pytest.raises(ck.CudaError, match="is closed"):
        mod.function("vector_add")  # cached kernels are refused too
    with pytest.raises(ck.CudaError, match="is closed"):
        k.launch(1, 1, 0, 0, 0, 0)  # no context at all: still the closed module first
    fake.base.cuCtxPushCurrent(c0._cu)  # a raw push ctxkit does not know about
    try:
        with pytest.raises(ck.CudaError, match="is closed"):
            k.launch(1, 1, 0, 0, 0, 0)
    finally:
        fake.base.cuCtxPopCurrent()
    with c0:
        for use in (
            lambda: k.launch(1, 1, 0, 0, 0, 0),
            lambda: k.prepare(1, 1, 0, 0, 0, 0),
            lambda: k.attributes,
            lambda: k.max_block_size(),
        ):
            with pytest.raises(ck.CudaError, match="is closed"):
                use()
    assert len(fake.launches) == 1


def test_prepared_launch_of_a_closed_module_fails_clearly(fake):
    mod = load()
    k = mod.function("vector_add")
    with ck.registry.context(0):
        pl = k.prepare(1, 1, 0, 0, 0, 0)
        mod.close()
        with pytest.raises(ck.CudaError, match="is closed"):
            pl()
        with pytest.raises(ck.CudaError, match="is closed"):
            k.launch(1, 1, 0, 0, 0, 0)
    assert fake.launches == []


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
    assert g.num_nodes == 4 and fake.graph_nodes == {}  # the CUgraph is destroyed
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
    assert isinstance(errors[0], ck.NoCurrentContextError) and "Graph.upload" in str(errors[0])
    g.close()
    g.close()
    assert fake.exec_destroyed and fake.exec_destroyed[0][1] == ctx.handle
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


CUBIN = b"\x7fELF" + bytes(60)


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
