// Pipeline kernels, calling convention (const T* in, T* out, size_t n, <extra args>):
// out[i] = alpha * in[i] for i < n (grid-stride loop).
template <typename T>
__device__ void scale_impl(const T* in, T* out, size_t n, T alpha)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = alpha * in[i];
    }
}

extern "C" __global__ void scale_f32(const float* in, float* out, size_t n, float alpha)
{
    scale_impl(in, out, n, alpha);
}

extern "C" __global__ void scale_f64(const double* in, double* out, size_t n, double alpha)
{
    scale_impl(in, out, n, alpha);
}

extern "C" __global__ void scale_i32(const int* in, int* out, size_t n, int alpha)
{
    scale_impl(in, out, n, alpha);
}
