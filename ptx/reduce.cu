// out[0] += sum(in[0:n]). Each thread sums a grid-stride slice, each warp reduces with
// shuffles, each block combines its warps in shared memory and adds one atomicAdd.
// Works for any grid and any block size up to 1024 threads; zero out[0] first.
extern "C" __global__ void reduce_sum_f32(const float* in, float* out, size_t n)
{
    __shared__ float warp_sums[32];
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    float acc = 0.0f;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        acc += in[i];
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_sums[warp] = acc;
    }
    __syncthreads();
    if (warp == 0) {
        const unsigned int nwarps = (blockDim.x + 31u) >> 5;
        float v = lane < nwarps ? warp_sums[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1) {
            v += __shfl_down_sync(0xffffffffu, v, offset);
        }
        if (lane == 0) {
            atomicAdd(out, v);
        }
    }
}
