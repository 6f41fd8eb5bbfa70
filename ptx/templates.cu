// C++ templates: load them through name expressions, e.g.
// ctxkit.compile(src, name_expressions=("axpy<float>", "axpy<double>")).lowered_names
template <typename T>
__global__ void axpy(T a, const T* x, T* y, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = a * x[i] + y[i];
    }
}

// out[i] = V for i < n: a value template parameter.
template <typename T, int V>
__global__ void fill_const(T* out, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = (T)V;
    }
}
