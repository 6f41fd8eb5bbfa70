// c[i] = a[i] + b[i] for i < n (grid-stride loop: any grid size covers any n).
extern "C" __global__ void vector_add(const float* a, const float* b, float* c, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        c[i] = a[i] + b[i];
    }
}
