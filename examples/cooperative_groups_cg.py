"""Conjugate gradient in one cooperative kernel: grid-wide sync with cooperative_groups.

Pattern: NVIDIA's ``conjugateGradientMultiBlockCG`` sample. The whole CG loop (sparse
matrix-vector product, two dot products, three vector updates per iteration) runs in a
single kernel launch; ``cooperative_groups::this_grid().sync()`` separates the steps, so
no iteration goes back to the host. That needs a *cooperative* launch: every block of the
grid resident on the GPU at once, at most (blocks per SM) x (SM count) blocks.

This program
1. builds a random symmetric positive definite tridiagonal matrix in CSR form (numpy);
2. compiles the kernel (NVRTC, with the cooperative_groups headers ctxkit.compiler adds),
   sizes the grid from the occupancy calculator and launches it with ``cooperative=True``;
3. shows that one block more than the device holds is refused before anything runs, with
   the occupancy numbers in the message (the raw driver answers only
   ``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE``);
4. checks the solution against the same CG iteration in numpy and the residual A x - b.

The raw Driver-API version needs ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` and the
SM count by hand, ``cuLaunchCooperativeKernel`` (or ``cuLaunchKernelEx`` with a
``CU_LAUNCH_ATTRIBUTE_COOPERATIVE`` attribute), and a ``void**`` array of 13 hand-packed
parameters whose types nothing checks.

    python examples/cooperative_groups_cg.py [--n 1048576] [--tol 1e-10]
"""

from __future__ import annotations

import sys

import numpy as np
from _common import check, example_parser, expect, ok, require_gpus, timed

import ctxkit as ck

BLOCK = 256

CG_SOURCE = r"""
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

// The sum of v over the block, valid in thread 0 (warp shuffles, then one shared slot
// per warp).
__device__ double block_sum(double v, double* warp_sums)
{
    cg::thread_block block = cg::this_thread_block();
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) warp_sums[warp] = v;
    block.sync();
    v = threadIdx.x < (blockDim.x >> 5) ? warp_sums[threadIdx.x] : 0.0;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    block.sync();
    return v;
}

// *result += dot(a, b): one atomic add per block; *result must be zero beforehand.
__device__ void grid_dot(const double* a, const double* b, int n, double* result,
                         double* warp_sums, const cg::grid_group& grid)
{
    double v = 0.0;
    for (int i = grid.thread_rank(); i < n; i += grid.size()) v += a[i] * b[i];
    v = block_sum(v, warp_sums);
    if (threadIdx.x == 0) atomicAdd(result, v);
}

// Solves A x = b (A symmetric positive definite, CSR) from x = 0. scalars[0..2] hold
// r.r, p.Ap and the new r.r; *iterations receives the iteration count.
extern "C" __global__ void cg_solve(const int* row_ptr, const int* cols, const double* vals,
                                    const double* b, double* x, double* r, double* p,
                                    double* ap, double* scalars, int n, int max_iter,
                                    double tol2, int* iterations)
{
    cg::grid_group grid = cg::this_grid();
    __shared__ double warp_sums[32];
    volatile double* s = scalars;
    for (int i = grid.thread_rank(); i < n; i += grid.size()) {
        x[i] = 0.0;
        r[i] = b[i];
        p[i] = b[i];
    }
    if (grid.thread_rank() == 0) scalars[0] = scalars[1] = scalars[2] = 0.0;
    grid.sync();
    grid_dot(r, r, n, &scalars[0], warp_sums, grid);
    grid.sync();
    int k = 0;
    while (k < max_iter && s[0] > tol2) {
        for (int i = grid.thread_rank(); i < n; i += grid.size()) {
            double sum = 0.0;
            for (int j = row_ptr[i]; j < row_ptr[i + 1]; ++j) sum += vals[j] * p[cols[j]];
            ap[i] = sum;
        }
        if (grid.thread_rank() == 0) scalars[1] = scalars[2] = 0.0;
        grid.sync();
        grid_dot(p, ap, n, &scalars[1], warp_sums, grid);
        grid.sync();
        const double alpha = s[0] / s[1];
        for (int i = grid.thread_rank(); i < n; i += grid.size()) {
            x[i] += alpha * p[i];
            r[i] -= alpha * ap[i];
        }
        grid.sync();
        grid_dot(r, r, n, &scalars[2], warp_sums, grid);
        grid.sync();
        const double beta = s[2] / s[0];
        for (int i = grid.thread_rank(); i < n; i += grid.size()) p[i] = r[i] + beta * p[i];
        grid.sync();
        if (grid.thread_rank() == 0) scalars[0] = s[2];
        grid.sync();
        ++k;
    }
    if (grid.thread_rank() == 0) *iterations = k;
}
"""


def tridiagonal(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR arrays of a random symmetric, diagonally dominant tridiagonal matrix."""
    rng = np.random.default_rng(seed)
    off = rng.random(n - 1) + 0.1  # A[i, i+1] == A[i+1, i]
    diag = rng.random(n) + 4.0
    rows = [np.arange(n), np.arange(n - 1), np.arange(1, n)]
    cols = [np.arange(n), np.arange(1, n), np.arange(n - 1)]
    vals = [diag, off, off]
    r, c, v = (np.concatenate(a) for a in (rows, cols, vals))
    order = np.lexsort((c, r))
    r, c, v = r[order], c[order], v[order]
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=n))]).astype(np.int32)
    return row_ptr, c.astype(np.int32), v


def csr_matvec(row_ptr: np.ndarray, cols: np.ndarray, vals: np.ndarray, x: np.ndarray):
    return np.add.reduceat(vals * x[cols], row_ptr[:-1])


def numpy_cg(row_ptr, cols, vals, b, tol2: float, max_iter: int) -> tuple[np.ndarray, int]:
    """The same iteration on the host, as the reference."""
    x = np.zeros_like(b)
    r, p = b.copy(), b.copy()
    rr = float(r @ r)
    k = 0
    while k < max_iter and rr > tol2:
        ap = csr_matvec(row_ptr, cols, vals, p)
        alpha = rr / float(p @ ap)
        x += alpha * p
        r -= alpha * ap
        rr_new = float(r @ r)
        p = r + (rr_new / rr) * p
        rr = rr_new
        k += 1
    return x, k


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--n", type=int, default=1 << 20, help="matrix rows")
    parser.add_argument("--tol", type=float, default=1e-10, help="stop when |r| < tol")
    parser.add_argument("--max-iter", type=int, default=10_000)
    args = parser.parse_args()
    require_gpus("cooperative_groups_cg.py")
    dev = ck.Device(0)
    if not dev.attribute("cooperative_launch"):
        print(f"no GPU: {dev.name} does not support cooperative launches", file=sys.stderr)
        sys.exit(2)

    n, tol2 = args.n, args.tol**2
    row_ptr, cols, vals = tridiagonal(n)
    b = np.ones(n)
    with ck.bind(0) as ctx:
        obj = ck.compile(CG_SOURCE, name="cg_solve.cu")
        solve = ck.Module.load(obj).function("cg_solve")
        per_sm = solve.occupancy(BLOCK)
        blocks = per_sm * dev.multiprocessor_count
        print(
            f"{dev.name}: {per_sm} blocks of {BLOCK} threads per SM x "
            f"{dev.multiprocessor_count} SMs = {blocks} co-resident blocks"
        )
        d_row, d_col, d_val, d_b = (ck.to_device(a) for a in (row_ptr, cols, vals, b))
        x, r, p, ap = (ck.device_array(n, np.float64) for _ in range(4))
        scalars, iters = ck.device_array(3, np.float64), ck.device_array(1, np.int32)
        operands = (d_row, d_col, d_val, d_b, x, r, p, ap, scalars, n, args.max_iter, tol2, iters)

        try:
            solve.launch(blocks + 1, BLOCK, *operands, cooperative=True)
            expect("an oversized cooperative grid is refused", False, "it was launched")
        except ck.CudaError as exc:
            print(f"{blocks + 1} blocks are refused before launch ({exc.name}):")
            print(f"  {str(exc).splitlines()[0]}")

        with timed() as t:
            solve.launch(blocks, BLOCK, *operands, cooperative=True)
            ctx.synchronize()
        got, k = x.to_host(), int(iters.to_host()[0])
    print(f"CG on the GPU: {k} iterations in one launch, {t[0] * 1e3:.1f} ms")

    want, k_host = numpy_cg(row_ptr, cols, vals, b, tol2, args.max_iter)
    expect("the iteration count matches numpy", abs(k - k_host) <= 1, f"{k} vs {k_host}")
    check("x against numpy's CG", got, want, rtol=1e-8)
    residual = np.linalg.norm(csr_matvec(row_ptr, cols, vals, got) - b)
    expect(f"|A x - b| = {residual:.2e} < {10 * args.tol:.0e}", residual < 10 * args.tol)
    ok(f"conjugate gradient, n={n}, {k} iterations in one cooperative launch of {blocks} blocks")


if __name__ == "__main__":
    main()
