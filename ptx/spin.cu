// Timed kernels for overlap tests: every thread busy-waits `cycles` clock64() ticks.

// Only forward steps of clock64() count: a block preempted (another context's time slice)
// may resume on an SM whose counter is behind, where `clock64() - start` turns negative and,
// as an unsigned count, would end the wait at once.
__device__ void spin_for(unsigned long long cycles)
{
    unsigned long long spun = 0;
    long long last = clock64();
    while (spun < cycles) {
        const long long now = clock64();
        if (now > last) {
            spun += (unsigned long long)(now - last);
        }
        last = now;
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
