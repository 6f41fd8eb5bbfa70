"""Launch attributes, refusals before launch, kernel handles and argument checks that need
a context, on CPU against the module fake of tests/module/fakemodule.py.

Cooperative and cluster launches go through ``cuLaunchKernelEx`` with their attributes and
are refused, with the occupancy numbers, when the device cannot run them; plain launches
keep ``cuLaunchKernel``. Negative values for unsigned parameters and ctxkit buffers of
another device are refused before anything reaches the driver. The GPU suite
(tests/module/test_launch_gpu.py) runs the same on an H200.
"""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.compiler import ObjectCode, PtxVersionWarning
from ctxkit.module.kernel import LaunchConfig
from tests.module.fakemodule import (  # noqa: F401
    VECTOR_ADD,
    FakeBuffer,
    FakeStream,
    ModuleDriver,
    as_u64,
    fake,
    load,
    mem_fake,
)
from tests.support.helpers import in_thread

ARGS = (FakeBuffer(0x10), FakeBuffer(0x20), FakeBuffer(0x30), 4)


# --- cooperative launches -------------------------------------------------------------


def test_cooperative_launch_uses_the_attribute_and_the_occupancy_limit(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        k.launch(32, 256, *ARGS, cooperative=True)  # 8 blocks/SM x 4 SMs: exactly full
        k.launch((4, 8), 256, *ARGS, cooperative=True)
        with pytest.raises(ck.CudaError) as info:
            k.launch(33, 256, *ARGS, cooperative=True)
    msg = str(info.value)
    assert info.value.name == "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"
    assert "grid (33, 1, 1) has 33 blocks" in msg and "at most 32" in msg
    assert "8 blocks of 256 threads" in msg and "x 4 SMs" in msg and "grid-stride" in msg
    assert not isinstance(info.value, ck.ContextPoisonedError)
    assert [(x["call"], x["attrs"], x["grid"]) for x in fake.launches] == [
        ("cuLaunchKernelEx", {"cooperative": 1}, (32, 1, 1)),
        ("cuLaunchKernelEx", {"cooperative": 1}, (4, 8, 1)),
    ]
    assert [q for q in fake.occupancy_queries if q[0] == "blocks"] == [("blocks", (256, 0))]


def test_cooperative_limit_follows_block_size_shared_memory_and_attributes(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        k.launch(64, 128, *ARGS, cooperative=True)  # 16 blocks/SM at 128 threads
        with pytest.raises(ck.CudaError, match="at most 64"):
            k.launch(65, 128, *ARGS, cooperative=True)
        k.launch(16, 512, *ARGS, cooperative=True, shared_mem=1024)
        k.set_attribute("max_dynamic_shared_size_bytes", 65536)  # may change the limit
        k.launch(16, 512, *ARGS, cooperative=True, shared_mem=1024)
    queries = [q[1] for q in fake.occupancy_queries if q[0] == "blocks"]
    assert queries == [(128, 0), (512, 1024), (512, 1024)]
    assert fake.launches[-1]["shm"] == 1024


def test_device_without_cooperative_launch_refuses_it(fake):
    fake.dev_attrs["COOPERATIVE_LAUNCH"] = 0
    k = load().function("vector_add")
    with ck.registry.context(0), pytest.raises(ck.CudaError) as info:
        k.launch(1, 32, *ARGS, cooperative=True)
    assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
    assert "does not support cooperative launches" in str(info.value)
    assert fake.launches == []


def test_a_launch_the_driver_refuses_names_the_options(fake):
    k = load().function("vector_add")
    fake.fail_next = 720
    with ck.registry.context(0), pytest.raises(ck.CudaError) as info:
        k.launch(2, 32, *ARGS, cooperative=True)
    msg = str(info.value)
    assert "cuLaunchKernelEx('vector_add', grid=(2, 1, 1)" in msg and "cooperative=True" in msg
    assert "occupancy x SM count" in msg


# --- thread-block clusters --------------------------------------------------------------


def test_cluster_launch_checks_the_device_and_the_grid(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        k.launch((8, 2), 128, *ARGS, cluster=(4, 2))
        with pytest.raises(ck.CudaError) as info:
            k.launch(6, 128, *ARGS, cluster=4)
    assert info.value.name == "CUDA_ERROR_INVALID_CLUSTER_SIZE"
    assert "grid.x = 6 is not a multiple of 4" in str(info.value)
    assert "round the grid up to (8, 1, 1)" in str(info.value)
    (launch,) = fake.launches
    assert launch["call"] == "cuLaunchKernelEx" and launch["attrs"] == {"cluster": (4, 2, 1)}
    assert launch["grid"] == (8, 2, 1)


def test_clusters_need_compute_capability_9(fake):
    fake.dev_attrs["COMPUTE_CAPABILITY_MAJOR"] = 8
    k = load().function("vector_add")
    with ck.registry.context(0), pytest.raises(ck.CudaError) as info:
        k.launch(2, 32, *ARGS, cluster=2)
    assert info.value.name == "CUDA_ERROR_NOT_SUPPORTED"
    assert "compute capability 9.0 or newer" in str(info.value) and "is 8.0" in str(info.value)
    assert fake.launches == [] and fake.occupancy_queries == []


def test_non_portable_cluster_sizes_need_the_kernel_attribute(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        with pytest.raises(ck.CudaError) as info:
            k.launch(16, 64, *ARGS, cluster=16)
        assert info.value.name == "CUDA_ERROR_INVALID_CLUSTER_SIZE"
        assert "non_portable_cluster_size_allowed" in str(info.value)
        assert "cuOccupancyMaxActiveClusters('vector_add', cluster=(16, 1, 1))" in str(info.value)
        k.set_attribute("non_portable_cluster_size_allowed", 1)
        k.launch(16, 64, *ARGS, cluster=16)
        k.launch(32, 64, *ARGS, cluster=16)  # the answer is cached per shape
    assert [x["attrs"] for x in fake.launches] == [{"cluster": (16, 1, 1)}] * 2
    assert [q for q in fake.occupancy_queries if q[0] == "clusters"] == [
        ("clusters", (16, 1, 1))
    ] * 2


def test_a_cluster_that_cannot_be_placed_is_refused(fake):
    fake.active_clusters = 0
    k = load().function("vector_add")
    with ck.registry.context(0), pytest.raises(ck.CudaError) as info:
        k.launch(8, 1024, *ARGS, cluster=8, shared_mem=4096)
    msg = str(info.value)
    assert "cannot place a single cluster of 8 blocks x 1024 threads" in msg
    assert "shared_mem=4096" in msg and info.value.name == "CUDA_ERROR_INVALID_CLUSTER_SIZE"
    assert fake.launches == []


# --- the other attributes, config=, the plain path --------------------------------------


def test_launch_config_carries_programmatic_serialization_and_priority(fake):
    k = load().function("vector_add")
    ctx = ck.registry.context(0)
    cfg = LaunchConfig(programmatic_stream_serialization=True, priority=-1)
    with ctx:
        k.launch(2, 64, *ARGS, config=cfg, stream=FakeStream(ctx, 0x44))
        with pytest.raises(TypeError, match="not both"):
            k.launch(2, 64, *ARGS, config=cfg, cooperative=True)
    (launch,) = fake.launches
    assert launch["attrs"] == {"programmatic": 1, "priority": -1}
    assert launch["stream"] == 0x44 and launch["block"] == (64, 1, 1)
    assert [as_u64(v) for v in launch["values"]] == [0x10, 0x20, 0x30, 4]


def test_plain_launches_keep_cu_launch_kernel(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        k.launch(1, 32, *ARGS)
        k.launch(1, 32, *ARGS, cooperative=False, cluster=None)
        k.launch(1, 32, *ARGS, config=LaunchConfig())
        k.prepare(1, 32, *ARGS)()
    assert [x["call"] for x in fake.launches] == ["cuLaunchKernel"] * 4
    assert fake.occupancy_queries == []


def test_bad_shared_memory_with_attributes(fake):
    k = load().function("vector_add")
    with ck.registry.context(0), pytest.raises(ValueError, match="shared_mem must be"):
        k.launch(1, 32, *ARGS, cooperative=True, shared_mem=-4)
    assert fake.launches == []


# --- prepared launches with attributes ----------------------------------------------------


def test_prepared_cooperative_and_cluster_launches(fake):
    k = load().function("vector_add")
    ctx = ck.registry.context(0)
    with ctx:
        pl = k.prepare(32, 256, *ARGS, cooperative=True, stream=FakeStream(ctx, 0x66))
        with pytest.raises(ck.CudaError, match="at most 32"):
            k.prepare(40, 256, *ARGS, cooperative=True)
        with pytest.raises(ck.CudaError, match="not a multiple of 4"):
            k.prepare(6, 32, *ARGS, cluster=4)
        pc = k.prepare(8, 32, *ARGS, config=LaunchConfig(cluster=(4, 1, 1)))
        for _ in range(3):
            pl()
        pc()
        pl.set_arg(3, 9)
        pl()
    assert pl.config.cooperative and "cooperative=True" in repr(pl)
    coop = ("cuLaunchKernelEx", {"cooperative": 1}, 0x66)
    cluster = ("cuLaunchKernelEx", {"cluster": (4, 1, 1)}, 0)
    got = [(x["call"], x["attrs"], x["stream"]) for x in fake.launches]
    assert got == [coop, coop, coop, cluster, coop]
    assert as_u64(fake.launches[-1]["values"][3]) == 9
    assert len([q for q in fake.occupancy_queries if q[0] == "blocks"]) == 1


def test_prepared_launch_error_with_attributes(fake):
    k = load().function("vector_add")
    with ck.registry.context(0):
        pl = k.prepare(2, 32, *ARGS, cluster=2)
        fake.fail_next = 912
        with pytest.raises(ck.CudaError) as info:
            pl()
    assert "cuLaunchKernelEx" in str(info.value) and "cluster=(2, 1, 1)" in str(info.value)
    assert "__cluster_dims__" in str(info.value)


# --- kernel handles -----------------------------------------------------------------------


def test_kernel_handle_and_function_handle(fake):
    mod = load()
    k = mod.function("vector_add")
    assert fake.kernels[int(k.handle)][1] == "vector_add"  # the library's CUkernel
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    f0 = k.function_handle(c0)
    with c1:
        f1 = k.function_handle()
    assert fake.functions[int(f0)] == ("vector_add", c0.handle)
    assert fake.functions[int(f1)] == ("vector_add", c1.handle)
    assert k.function_handle(c0) is f0  # fetched once per context
    with pytest.raises(ck.NoCurrentContextError):
        k.function_handle()
    with c0:
        bound = load(context=c0).function("saxpy")
    assert fake.functions[int(bound.handle)] == ("saxpy", c0.handle)  # a CUfunction
    mod.close()
    with pytest.raises(ck.CudaError, match="is closed"):
        _ = k.handle


def test_closing_the_module_stops_the_cached_fast_path(fake):
    mod = load()
    k = mod.function("vector_add")
    with ck.registry.context(0):
        k.launch(1, 1, *ARGS)
        mod.close()
        with pytest.raises(ck.CudaError, match="is closed"):
            k.launch(1, 1, *ARGS)
    assert len(fake.launches) == 1


def test_the_first_ctxkit_call_of_a_fresh_thread_can_be_a_launch(fake):
    """A thread that never used ctxkit has no ctxkit state: a prepared launch binds its
    own context there, a plain one takes it from the module in a thread with nothing
    current, and in strict mode the plain one refuses with the fix."""
    mod = load(context=ck.registry.context(0))
    k = mod.function("vector_add")
    with ck.registry.context(0):
        prepared = k.prepare(1, 1, *ARGS)

    in_thread(prepared)
    in_thread(lambda: k.launch(1, 1, *ARGS))
    assert len(fake.launches) == 2
    ck.registry.strict = True
    try:
        with pytest.raises(ck.NoCurrentContextError, match="bind"):
            in_thread(lambda: k.launch(1, 1, *ARGS))
    finally:
        ck.registry.strict = False
    assert len(fake.launches) == 2


# --- unsigned parameters ------------------------------------------------------------------

SOURCE = """
extern "C" __global__ void vector_add(const float* a, const float* b, float* c, size_t n) {}
extern "C" __global__ void saxpy(float a, const float* x, float* y, long long n) {}
"""


def _with_source(source: str = SOURCE) -> SimpleNamespace:
    """An ObjectCode-like object that carries its CUDA source."""
    return SimpleNamespace(
        code=VECTOR_ADD.encode() + b"\0",
        target="ptx",
        ptx=VECTOR_ADD,
        name="va.cu",
        lowered_names={},
        source=source,
    )


def test_negative_values_for_size_t_never_reach_the_kernel(fake):
    k = ck.Module.load(_with_source()).function("vector_add")
    assert k.params[3].unsigned and k.params[3].ctype == "size_t"
    with ck.registry.context(0):
        for bad in (-1, np.int64(-5)):
            with pytest.raises(ck.LaunchArgumentError) as info:
                k.launch(1, 32, *ARGS[:3], bad)
            msg = str(info.value)
            assert (
                "argument 3" in msg and "negative value for an unsigned parameter (size_t)" in msg
            )
        with pytest.raises(ck.LaunchArgumentError, match="negative value"):
            k.prepare(1, 32, *ARGS[:3], -1)
        pl = k.prepare(1, 32, *ARGS)
        with pytest.raises(ck.LaunchArgumentError, match="negative value"):
            pl.set_arg("n", -1)
        pl()
    (launch,) = fake.launches
    assert as_u64(launch["values"][3]) == 4


def test_signed_parameters_take_negative_values(fake):
    k = ck.Module.load(_with_source()).function("saxpy")
    assert k.params[3].signed and k.params[3].ctype == "long long"
    with ck.registry.context(0):
        k.launch(1, 32, 2.0, FakeBuffer(8), FakeBuffer(16), -3)
        with pytest.raises(ck.LaunchArgumentError, match="out of range"):
            k.launch(1, 32, 2.0, FakeBuffer(8), FakeBuffer(16), 2**63)
    assert int.from_bytes(fake.launches[-1]["values"][3], "little", signed=True) == -3


def test_mangled_kernels_know_their_types_without_source(fake):
    pytest.importorskip("cxxfilt", reason="the optional demangler: the demangle extra")
    k = load().function("_Z4axpyIfEvT_PKS0_PS0_m")
    assert [p.ctype for p in k.params] == ["float", "float const*", "float*", "unsigned long"]
    with ck.registry.context(0), pytest.raises(ck.LaunchArgumentError, match="negative"):
        k.launch(1, 32, 1.0, FakeBuffer(8), FakeBuffer(16), -1)
    assert fake.launches == []


def test_without_the_demangler_mangled_kernels_keep_the_ptx_sign(fake, monkeypatch):
    monkeypatch.setitem(sys.modules, "cxxfilt", None)  # the optional extra is absent
    k = load().function("_Z4axpyIfEvT_PKS0_PS0_m")
    assert not k.params[3].unsigned and not k.params[3].signed and not k.params[3].ctype
    with ck.registry.context(0):
        k.launch(1, 32, 1.0, FakeBuffer(8), FakeBuffer(16), -1)
    assert as_u64(fake.launches[-1]["values"][3]) == 2**64 - 1


def test_ptx_text_alone_cannot_tell_the_sign(fake):
    k = load().function("vector_add")  # PTX text: size_t and long long look the same
    assert not k.params[3].unsigned and not k.params[3].signed
    with ck.registry.context(0):
        k.launch(1, 32, *ARGS[:3], -1)
    assert as_u64(fake.launches[-1]["values"][3]) == 2**64 - 1


def test_compiled_object_code_carries_its_source(fake):
    with warnings.catch_warnings():  # a local NVRTC may be newer than the fake's CUDA 13.0
        warnings.simplefilter("ignore", PtxVersionWarning)
        obj = ck.compile(SOURCE, name="va.cu", arch="sm_90", target="ptx", cache=False)
    assert isinstance(obj, ObjectCode) and obj.source is not None
    k = ck.Module.load(obj).function("vector_add")
    assert k.params[3].unsigned
    with ck.registry.context(0), pytest.raises(ck.LaunchArgumentError, match="size_t"):
        k.launch(1, 32, *ARGS[:3], -1)


# --- buffers of another device ------------------------------------------------------------


def test_buffer_of_another_device_is_refused_before_launch(mem_fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    a, b = ck.DeviceBuffer(64, c0), ck.DeviceBuffer(64, c0)
    far = ck.DeviceBuffer(64, c1)
    with c0:
        with pytest.raises(ck.LaunchArgumentError) as info:
            k.launch(1, 32, a, b, far, 4)
        msg = str(info.value)
        assert "argument 2" in msg and "DeviceBuffer on device 1" in msg
        assert "launches on device 0" in msg and "without peer access" in msg
        assert "ck.enable_peer_access" in msg and "ck.copy_peer" in msg
        with pytest.raises(ck.LaunchArgumentError, match=r"DeviceBuffer \(a view\) on device 1"):
            k.launch(1, 32, a, b, far[0:32], 4)
        arr = ck.device_array(16, np.float32, context=c1)
        with pytest.raises(ck.LaunchArgumentError, match="DeviceArray on device 1"):
            k.launch(1, 32, arr, b, a, 4)
        with pytest.raises(ck.LaunchArgumentError, match="on device 1"):
            k.prepare(1, 32, a, b, far, 4)
        pl = k.prepare(1, 32, a, b, a, 4)
        with pytest.raises(ck.LaunchArgumentError, match="on device 1"):
            pl.set_arg(2, far)
        k.launch(1, 32, a, b, ck.device_array(16, np.float32, context=c0), 4)
    assert len(mem_fake.launches) == 1
    with c1:
        k.launch(1, 32, far, far, far, 4)  # on its own device it is fine
    assert mem_fake.launches[-1]["ctx"] == c1.handle


def test_peer_access_managed_memory_and_same_device_contexts_pass(mem_fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    a, far = ck.DeviceBuffer(64, c0), ck.DeviceBuffer(64, c1)
    ck.enable_peer_access(c1, c0)  # the other direction does not help a launch in c0
    with c0, pytest.raises(ck.LaunchArgumentError, match="without peer access"):
        k.launch(1, 32, a, a, far, 4)
    ck.enable_peer_access(c0, c1)
    with c0:
        k.launch(1, 32, a, a, far, 4)
        k.launch(1, 32, a, ck.ManagedBuffer(64, c1), a, 4)
    owned = ck.Context.create(0)
    try:
        near = ck.DeviceBuffer(64, owned)
        with c0:
            k.launch(1, 32, a, near, a, 4)  # another context of the launch's device
        near.close()
    finally:
        owned.close()
    assert [as_u64(x["values"][2]) for x in mem_fake.launches[:1]] == [far.ptr]
    assert len(mem_fake.launches) == 3


def test_closed_buffer_argument_says_it_is_closed(mem_fake):
    k = load().function("vector_add")
    c0 = ck.registry.context(0)
    a, gone = ck.DeviceBuffer(64, c0), ck.DeviceBuffer(64, c0)
    gone.close()
    with c0, pytest.raises(ck.ContextClosedError, match="buffer was closed"):
        k.launch(1, 32, a, a, gone, 4)
    assert mem_fake.launches == []


# --- stream order: the current stream (foreign producers: test_foreign_order_fake.py) ------


def test_stream_none_means_the_current_stream(mem_fake):
    k = load().function("vector_add")
    c0 = ck.registry.context(0)
    with c0:
        s = ck.Stream()
        buf = ck.DeviceBuffer(64)
        k.launch(1, 32, buf, buf, buf, 4)
        with s:
            k.launch(1, 32, buf, buf, buf, 4)
            k.launch(1, 32, buf, buf, buf, 4, cooperative=True)
            pl = k.prepare(1, 32, buf, buf, buf, 4)
        k.launch(1, 32, buf, buf, buf, 4)
        pl()  # prepared inside `with s:`: stays on s
    sh = int(s.handle)
    assert [x["stream"] for x in mem_fake.launches] == [0, sh, sh, 0, sh]


def test_closed_stream_is_refused_explicit_or_current(mem_fake):
    k = load().function("vector_add")
    c0 = ck.registry.context(0)
    with c0:
        buf = ck.DeviceBuffer(64)
        s = ck.Stream()
        s.close()
        with pytest.raises(ck.ContextClosedError, match="stream was closed"):
            k.launch(1, 32, buf, buf, buf, 4, stream=s)
        cur = ck.Stream()
        with cur:
            cur.close()  # closed while current: stream=None must not fall back silently
            with pytest.raises(ck.ContextClosedError, match="stream was closed"):
                k.launch(1, 32, buf, buf, buf, 4)
    assert mem_fake.launches == []


def test_ctxkit_stream_of_another_context_is_refused(mem_fake):
    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    with c1:
        theirs = ck.Stream()
    with c0:
        buf = ck.DeviceBuffer(64)
        with pytest.raises(ck.WrongContextError, match="belongs to"):
            k.launch(1, 32, buf, buf, buf, 4, stream=theirs)
        with pytest.raises(ck.WrongContextError, match="belongs to"):
            k.prepare(1, 32, buf, buf, buf, 4, stream=theirs)
    assert mem_fake.launches == []


def test_a_ctxkit_stream_picks_the_context_over_one_another_library_left_current(mem_fake):
    """torch or CuPy may leave a context current behind ctxkit's back: a launch or a
    prepare given a ctxkit stream then runs in that stream's context, pops back to the
    other library's, and strict mode still refuses the mismatch."""
    import ctxkit._driver as driver

    k = load().function("vector_add")
    c0, c1 = ck.registry.context(0), ck.registry.context(1)
    with c1:
        theirs = ck.Stream()

    def foreign_current(body):
        (err,) = driver.drv.cuCtxPushCurrent(c0.cu)
        assert not err
        try:
            body()
            err, cu = driver.drv.cuCtxGetCurrent()
            assert not err and int(cu) == c0.handle
        finally:
            driver.drv.cuCtxPopCurrent()

    in_thread(lambda: foreign_current(lambda: k.launch(1, 32, *ARGS, stream=theirs)))
    in_thread(lambda: foreign_current(lambda: k.prepare(1, 32, *ARGS, stream=theirs)()))
    assert [(x["ctx"], x["stream"]) for x in mem_fake.launches] == [
        (c1.handle, int(theirs.handle))
    ] * 2
    ck.registry.strict = True
    try:
        with pytest.raises(ck.WrongContextError, match="belongs to"):
            in_thread(lambda: foreign_current(lambda: k.launch(1, 32, *ARGS, stream=theirs)))
    finally:
        ck.registry.strict = False
    assert len(mem_fake.launches) == 2
