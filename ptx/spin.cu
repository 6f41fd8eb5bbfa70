// Timed kernels for overlap tests: every thread busy-waits `cycles` clock64() ticks.

__device__ void spin_for(unsigned long long cycles)
{
    const long long start = clock64();
    while ((unsigned long long)(clock64() - start) < cycles) {
    }
}

// Spin, then the first thread of the grid writes *flag = 1 (flag may be NULL).
extern "C" __global__ void spin(unsigned long long cycles, int* flag)
{
    spin_for(cycles);
    if (flag != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        *(volatile int*)flag = 1;
    }
}

// Spin, then out[i] = in[i] for i < n (grid-stride loop).
extern "C" __global__ void spin_then_copy(unsigned long long cycles, const float* in, float* out,
                                          size_t n)
{
    spin_for(cycles);
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = in[i];
    }
}
