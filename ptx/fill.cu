// out[i] = value for i < n (grid-stride loop).
extern "C" __global__ void fill_f32(float* out, float value, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = value;
    }
}

extern "C" __global__ void fill_u8(unsigned char* out, unsigned char value, size_t n)
{
    const size_t stride = (size_t)blockDim.x * gridDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = value;
    }
}
