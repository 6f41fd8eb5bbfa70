"""Thread-block clusters: a histogram kept in distributed shared memory (sm_90).

Pattern: the distributed-shared-memory histogram of the CUDA Programming Guide. On Hopper,
blocks launched as a *cluster* run at the same time on one GPU processing cluster and can
read and write each other's shared memory (``cluster.map_shared_rank``). Here each cluster
holds one histogram split across its blocks' shared memory, so the histogram can be
cluster-size times larger than one block's shared memory; every block bins its share of
the input into whichever block owns the bin, ``cluster.sync()`` waits for the whole
cluster, and each block adds its slice to the global histogram.

This program
1. launches the kernel with ``cluster=(4, 1, 1)`` (``cuLaunchKernelEx`` with a
   ``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`` attribute) and checks the histogram against
   ``numpy.bincount``;
2. shows the shapes ctxkit refuses before launching, each with the fix: a grid that is not
   a whole number of clusters, and 16 blocks per cluster without opting in to
   non-portable cluster sizes;
3. opts in (``kernel.set_attribute("non_portable_cluster_size_allowed", 1)``) and runs
   with 16 blocks per cluster where the device can place such a cluster.

    python examples/thread_block_clusters.py [--n 4194304] [--bins 8192]
"""

from __future__ import annotations

import sys

import numpy as np
from _common import check, example_parser, expect, ok, require_gpus

import ctxkit as ck

BLOCK = 256

HISTOGRAM_SOURCE = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

// bins[b] += count of input values equal to b (clamped to 0..nbins-1). The cluster's
// histogram lives in its blocks' shared memory: block rank k owns bins
// [k * bins_per_block, (k + 1) * bins_per_block).
extern "C" __global__ void cluster_histogram(int* bins, int nbins, int bins_per_block,
                                             const int* input, size_t n)
{
    extern __shared__ int slice[];
    cg::cluster_group cluster = cg::this_cluster();
    for (int i = threadIdx.x; i < bins_per_block; i += blockDim.x) slice[i] = 0;
    cluster.sync();  // every block's slice is zero before anyone adds to it

    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride) {
        int bin = input[i];
        bin = bin < 0 ? 0 : (bin >= nbins ? nbins - 1 : bin);
        int* owner = cluster.map_shared_rank(slice, bin / bins_per_block);
        atomicAdd(owner + bin % bins_per_block, 1);
    }
    cluster.sync();  // all adds into this block's slice are done; it stays alive until now

    int* mine = bins + cluster.block_rank() * bins_per_block;
    for (int i = threadIdx.x; i < bins_per_block; i += blockDim.x) atomicAdd(&mine[i], slice[i]);
}
"""


def run(kernel: ck.Kernel, data: ck.DeviceArray, nbins: int, cluster: int) -> np.ndarray:
    """The histogram of *data* computed by clusters of *cluster* blocks."""
    per_block = nbins // cluster
    grid = cluster * max(1, ck.Device(0).multiprocessor_count // cluster)
    bins = ck.device_array(nbins, np.int32)
    bins.buffer.memset(0)
    kernel.launch(
        grid,
        BLOCK,
        bins,
        nbins,
        per_block,
        data,
        data.size,
        cluster=cluster,
        shared_mem=per_block * 4,
    )
    return bins.to_host()


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--n", type=int, default=1 << 22, help="input values")
    parser.add_argument(
        "--bins", type=int, default=8192, help="histogram bins (rounded down to a multiple of 16)"
    )
    args = parser.parse_args()
    require_gpus("thread_block_clusters.py")
    dev = ck.Device(0)
    if dev.compute_capability < (9, 0):
        print(
            f"no GPU: clusters need compute capability 9.0; {dev.name} is {dev.arch}",
            file=sys.stderr,
        )
        sys.exit(2)
    nbins = max(16, args.bins // 16 * 16)
    rng = np.random.default_rng(0)
    values = rng.normal(nbins / 2, nbins / 6, args.n).astype(np.int32)
    want = np.bincount(np.clip(values, 0, nbins - 1), minlength=nbins)

    with ck.bind(0):
        hist = ck.Module.load(ck.compile(HISTOGRAM_SOURCE, name="cluster_histogram.cu"))
        kernel = hist.function("cluster_histogram")
        data = ck.to_device(values)

        got = run(kernel, data, nbins, cluster=4)
        print(
            f"{dev.name}: {nbins} bins in clusters of 4 blocks "
            f"({nbins // 4 * 4} bytes of shared memory per block)"
        )
        check("histogram, clusters of 4", got, want)

        bins = ck.device_array(nbins, np.int32)
        for shape, grid, why in (
            (4, 6, "a grid that is not a whole number of clusters"),
            (16, 16, "16 blocks per cluster without opting in"),
        ):
            try:
                kernel.launch(
                    grid,
                    BLOCK,
                    bins,
                    nbins,
                    nbins // shape,
                    data,
                    data.size,
                    cluster=shape,
                    shared_mem=nbins // shape * 4,
                )
                expect(f"{why} is refused", False, "it was launched")
            except ck.CudaError as exc:
                print(f"refused before launch, {why} ({exc.name}):")
                print(f"  {str(exc).splitlines()[0]}")

        kernel.set_attribute("non_portable_cluster_size_allowed", 1)
        try:
            got16 = run(kernel, data, nbins, cluster=16)
        except ck.CudaError as exc:  # the device cannot place 16 blocks together
            print(f"clusters of 16 do not fit here: {str(exc).splitlines()[0]}")
            sizes = "4"
        else:
            check("histogram, clusters of 16 (non-portable size)", got16, want)
            sizes = "4 and 16"
    ok(f"distributed-shared-memory histogram of {args.n} values, clusters of {sizes} blocks")


if __name__ == "__main__":
    main()
