// y[i] = a * x[i] + y[i] for i < n (grid-stride loop).
extern "C" __global__ void saxpy(float a, const float* x, float* y, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = a * x[i] + y[i];
    }
}
