"""Launch attributes and launch-time refusals on a real device.

Cooperative launches with a grid-wide ``cooperative_groups`` sync, thread-block clusters
with distributed shared memory (compute capability 9.0), programmatic dependent launch,
refusal of oversized cooperative grids and of cluster shapes the device cannot take,
``Kernel.handle`` used with raw ``cuda.bindings`` launches, negative values for unsigned
parameters, and buffers of another device.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

import ctxkit as ck
from ctxkit.memory import to_device
from ctxkit.module import Module
from ctxkit.module.kernel import LaunchConfig

SOURCE = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

// sum of x over the whole grid: per-block partial sums, one grid-wide sync, then block 0
extern "C" __global__ void grid_sum(const double* x, double* partial, double* out, size_t n)
{
    cg::grid_group grid = cg::this_grid();
    __shared__ double s[256];
    double acc = 0.0;
    for (size_t i = grid.thread_rank(); i < n; i += grid.size()) acc += x[i];
    s[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) s[threadIdx.x] += s[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
    grid.sync();
    if (grid.thread_rank() == 0) {
        double t = 0.0;
        for (unsigned b = 0; b < gridDim.x; ++b) t += partial[b];
        *out = t;
    }
}

extern "C" __global__ void vector_add(const float* a, const float* b, float* c, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
"""

CLUSTER_SOURCE = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

// out[c] = sum of x over cluster c: every block adds into block 0's shared memory (DSMEM)
extern "C" __global__ void cluster_sum(const int* x, int* out)
{
    __shared__ int s;
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) s = 0;
    cluster.sync();
    int* dst = cluster.map_shared_rank(&s, 0);
    atomicAdd(dst, x[blockIdx.x * blockDim.x + threadIdx.x]);
    cluster.sync();
    if (cluster.block_rank() == 0 && threadIdx.x == 0) out[blockIdx.x / cluster.num_blocks()] = s;
}

// out[i] = in[i] + 1, waiting for the previous kernel's writes (programmatic dependent launch)
extern "C" __global__ void pdl_add_one(const int* in, int* out, size_t n)
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] + 1;
}

extern "C" __global__ void pdl_fill(int* out, int value, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
    asm volatile("griddepcontrol.launch_dependents;");
}
"""

# a C++ (mangled) kernel: its parameter types come from the mangled name alone
MANGLED_SOURCE = r"""
__global__ void fill_n(float* out, float value, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""


@pytest.fixture
def kernels() -> dict[str, ck.Kernel]:
    """Loaded per test (compiled once, from the cache): attributes set by a test stay there."""
    with ck.bind(0):
        mod = Module.load(ck.compile(SOURCE, name="launch_gpu.cu"))
        return {name: mod.function(name) for name in ("grid_sum", "vector_add")}


def _co_resident_blocks(k: ck.Kernel, ctx: ck.Context, block: int) -> int:
    with ctx:
        return k.occupancy(block) * ctx.device.multiprocessor_count


# --- cooperative launches -------------------------------------------------------------


def test_cooperative_grid_sync_sums_the_whole_grid(ctx0, kernels):
    k = kernels["grid_sum"]
    blocks = _co_resident_blocks(k, ctx0, 256)
    assert blocks >= ctx0.device.multiprocessor_count
    x = np.random.default_rng(7).standard_normal(3_000_017)
    with ctx0:
        dx = to_device(x)
        partial, out = ck.device_array(blocks, np.float64), ck.device_array(1, np.float64)
        k.launch(blocks, 256, dx, partial, out, x.size, cooperative=True)
        got = out.to_host()[0]
        pl = k.prepare(blocks // 2, 256, dx, partial, out, x.size, cooperative=True)
        out.copy_from_host(np.zeros(1))
        pl()
        got_prepared = out.to_host()[0]
    tol = 1e-9 * np.abs(x).sum()  # summation order differs; a missing block is off by far more
    np.testing.assert_allclose(got, x.sum(), rtol=0, atol=tol)
    np.testing.assert_allclose(got_prepared, x.sum(), rtol=0, atol=tol)


def test_oversized_cooperative_grid_is_refused_with_the_numbers(ctx0, kernels):
    k = kernels["grid_sum"]
    blocks = _co_resident_blocks(k, ctx0, 256)
    sms = ctx0.device.multiprocessor_count
    with ctx0:
        partial, out = ck.device_array(blocks + 1, np.float64), ck.device_array(1, np.float64)
        dx = ck.device_array(16, np.float64)
        with pytest.raises(ck.CudaError) as info:
            k.launch(blocks + 1, 256, dx, partial, out, 16, cooperative=True)
        with pytest.raises(ck.CudaError, match=f"at most {blocks}"):
            k.prepare(blocks + 1, 256, dx, partial, out, 16, cooperative=True)
        ctx0.synchronize()  # nothing was launched, nothing faulted
    assert info.value.name == "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"
    msg = str(info.value)
    assert f"{blocks + 1} blocks" in msg and f"at most {blocks}" in msg and f"x {sms} SMs" in msg


# --- thread-block clusters --------------------------------------------------------------


@pytest.fixture
def cluster_kernels() -> dict[str, ck.Kernel]:
    with ck.bind(0):
        if ck.Device(0).compute_capability < (9, 0):
            pytest.skip("thread-block clusters and griddepcontrol need sm_90")
        mod = Module.load(ck.compile(CLUSTER_SOURCE, name="cluster_gpu.cu"))
        return {n: mod.function(n) for n in ("cluster_sum", "pdl_add_one", "pdl_fill")}


def test_cluster_launch_with_distributed_shared_memory(ctx0, cluster_kernels):
    k = cluster_kernels["cluster_sum"]
    block, cluster, clusters = 128, 4, 24
    x = np.random.default_rng(3).integers(-1000, 1000, clusters * cluster * block, np.int32)
    with ctx0:
        dx, out = to_device(x), ck.device_array(clusters, np.int32)
        k.launch(clusters * cluster, block, dx, out, cluster=cluster)
        got = out.to_host()
        out.copy_from_host(np.zeros(clusters, np.int32))
        k.launch(clusters * cluster, block, dx, out, config=LaunchConfig(cluster=(cluster, 1, 1)))
        again = out.to_host()
    want = x.reshape(clusters, -1).sum(axis=1)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(again, want)


def test_cluster_shapes_the_device_cannot_take_are_refused(ctx0, cluster_kernels):
    k = cluster_kernels["cluster_sum"]
    with ctx0:
        x, out = ck.device_array(64 * 128, np.int32), ck.device_array(64, np.int32)
        with pytest.raises(ck.CudaError, match="grid.x = 6 is not a multiple of 4") as info:
            k.launch(6, 128, x, out, cluster=4)
        assert info.value.name == "CUDA_ERROR_INVALID_CLUSTER_SIZE"
        with pytest.raises(ck.CudaError) as info:
            k.launch(16, 128, x, out, cluster=16)
        assert "non_portable_cluster_size_allowed" in str(info.value)
        with pytest.raises(ck.CudaError, match=r"cluster=\(64, 1, 1\)"):
            k.launch(64, 128, x, out, cluster=64)
        ctx0.synchronize()


def test_non_portable_cluster_size_after_opting_in(ctx0, cluster_kernels):
    k = cluster_kernels["cluster_sum"]
    x = np.arange(16 * 64, dtype=np.int32)
    with ctx0:
        k.set_attribute("non_portable_cluster_size_allowed", 1)
        dx, out = to_device(x), ck.device_array(1, np.int32)
        k.launch(16, 64, dx, out, cluster=16)
        assert out.to_host()[0] == x.sum()


def test_programmatic_dependent_launch(ctx0, cluster_kernels):
    fill, add_one = cluster_kernels["pdl_fill"], cluster_kernels["pdl_add_one"]
    n = 1 << 20
    cfg = LaunchConfig(programmatic_stream_serialization=True)
    with ctx0:
        s = ck.Stream()
        a, b = ck.device_array(n, np.int32), ck.device_array(n, np.int32)
        for value in (5, 11):
            fill.launch(n // 256, 256, a, value, n, stream=s)
            add_one.launch(n // 256, 256, a, b, n, stream=s, config=cfg)
            s.synchronize()
            assert (b.to_host() == value + 1).all()
        pl = add_one.prepare(n // 256, 256, a, b, n, stream=s, config=cfg)
        fill.launch(n // 256, 256, a, 20, n, stream=s)
        pl()
        s.synchronize()
        assert (b.to_host() == 21).all()


def test_launch_priority(ctx0, kernels):
    from cuda.bindings import driver as cu

    k = kernels["vector_add"]
    a = np.arange(1000, dtype=np.float32)
    with ctx0:
        err, _least, greatest = cu.cuCtxGetStreamPriorityRange()
        assert int(err) == 0
        da, out = to_device(a), ck.device_array(1000, np.float32)
        k.launch(4, 256, da, da, out, 1000, config=LaunchConfig(priority=int(greatest)))
        np.testing.assert_array_equal(out.to_host(), 2 * a)


# --- Kernel.handle with raw cuda.bindings ------------------------------------------------


def _raw_params(*pointers: int, n: int) -> tuple[int, list[Any]]:
    """A ``void**`` kernelParams array by hand: its address and what keeps it alive."""
    values: list[Any] = [ctypes.c_void_p(p) for p in pointers] + [ctypes.c_size_t(n)]
    array = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    return ctypes.addressof(array), [values, array]


def test_kernel_handle_with_a_raw_cu_launch_kernel(ctx0, kernels):
    from cuda.bindings import driver as cu

    k = kernels["vector_add"]
    n = 5000
    a, b = np.arange(n, dtype=np.float32), np.full(n, 0.5, np.float32)
    with ctx0:
        da, db, dc = to_device(a), to_device(b), ck.device_array(n, np.float32)
        params, keep = _raw_params(da.ptr, db.ptr, dc.ptr, n=n)
        kernel = cu.CUfunction(int(k.handle))  # a CUkernel launches in the current context
        (err,) = cu.cuLaunchKernel(kernel, 20, 1, 1, 256, 1, 1, 0, 0, params, 0)
        assert int(err) == 0
        np.testing.assert_array_equal(dc.to_host(), a + b)
        dc.copy_from_host(np.zeros(n, np.float32))
        (err,) = cu.cuLaunchKernel(k.function_handle(), 20, 1, 1, 256, 1, 1, 0, 0, params, 0)
        assert int(err) == 0
        np.testing.assert_array_equal(dc.to_host(), a + b)
        assert int(k.function_handle()) == int(k.function_handle(ctx0))
    del keep


# --- arguments that would fault the GPU -----------------------------------------------------


def test_negative_size_t_is_refused_and_a_valid_launch_follows(ctx0):
    pytest.importorskip("cxxfilt", reason="C++ kernels' types need the extra: the demangle extra")
    obj = ck.compile(MANGLED_SOURCE, name="fill_n.cu", name_expressions=("fill_n",))
    k = Module.load(obj).function("fill_n")
    assert k.params[2].unsigned
    with ctx0:
        out = ck.device_array(1000, np.float32)
        for bad in (-1, np.int64(-5)):
            with pytest.raises(ck.LaunchArgumentError, match="negative value for an unsigned"):
                k.launch(4, 256, out, 1.0, bad)
        k.launch(4, 256, out, 2.0, 1000)
        assert (out.to_host() == 2.0).all()


@pytest.mark.multigpu
def test_buffer_of_another_device_needs_peer_access(ctx0, ctx1, kernels):
    k = kernels["vector_add"]
    n = 4096
    a = np.arange(n, dtype=np.float32)
    with ctx0:
        da = to_device(a)
    far = ck.device_array(n, np.float32, context=ctx1)
    managed = ck.ManagedBuffer(n * 4, ctx1)
    with ctx0:
        if not ck.memory.peer_access_enabled(ctx0, ctx1):
            with pytest.raises(ck.LaunchArgumentError) as info:
                k.launch(n // 256, 256, da, da, far, n)
            msg = str(info.value)
            assert "on device 1" in msg and "launches on device 0" in msg
            assert "enable_peer_access" in msg
        k.launch(n // 256, 256, da, da, managed, n)  # managed memory is fine anywhere
        ctx0.synchronize()
        np.testing.assert_array_equal(managed.as_numpy(np.float32), 2 * a)
    if not ctx0.device.can_access_peer(ctx1.device):
        pytest.skip("devices 0 and 1 have no peer path")
    ck.enable_peer_access(ctx0, ctx1)
    with ctx0:
        k.launch(n // 256, 256, da, da, far, n)
        ctx0.synchronize()
    np.testing.assert_array_equal(far.to_host(), 2 * a)
