// rope.cu: rotary embedding on interleaved pairs (2i, 2i+1), per-token positions (CUDA),
// in place on grouped rows, see engine/backend.h and engine/cpu/rope.c.
#include "engine/cuda/cuda_math.cuh"

namespace {

constexpr int kThreads = 256;

// x: token n, head g, pair i at x[n*stride + g*D + 2i]; cos_sin: (P, D/2, 2) fp32.
// Grid (N tokens, chunks of the G*D/2 pairs of a token); one thread rotates one pair by
// +angle (sign 1) or -angle (sign -1). Each pair is read and written by one thread only.
template <typename T>
__global__ void rope_kernel(T *x, const int32_t *pos, const float *cos_sin, int G, int D,
                            int stride, float sign) {
    int n = blockIdx.x, half = D / 2;
    int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= G * half) return;
    int g = j / half, i = j - g * half;
    const float *cs = cos_sin + (size_t)pos[n] * D + 2 * i;
    float c = cs[0], s = sign * cs[1];
    T *v = x + (size_t)n * stride + (size_t)g * D + 2 * i;
    float a = to_float(v[0]), b = to_float(v[1]);
    v[0] = from_float<T>(a * c - b * s);
    v[1] = from_float<T>(a * s + b * c);
}

template <typename T>
void rope(void *x, const int32_t *pos, const float *cos_sin, int N, int G, int D, int stride,
          float sign) {
    if (N <= 0 || G <= 0 || D < 2) return;
    dim3 grid(N, cu_ceil_div((size_t)G * (D / 2), kThreads));
    rope_kernel<T><<<grid, kThreads, 0, cu_stream()>>>((T *)x, pos, cos_sin, G, D, stride, sign);
    CUDA_CHECK(cudaGetLastError());
}

} // namespace

#define ROPE_OPS(S, T)                                                                             \
    void cuda_rope_fwd_##S(void *x, const int32_t *pos, const float *cos_sin, int N, int G, int D, \
                           int stride) {                                                           \
        rope<T>(x, pos, cos_sin, N, G, D, stride, 1.0f);                                           \
    }                                                                                              \
    void cuda_rope_bwd_##S(void *dx, const int32_t *pos, const float *cos_sin, int N, int G,       \
                           int D, int stride) {                                                    \
        rope<T>(dx, pos, cos_sin, N, G, D, stride, -1.0f);                                         \
    }

ROPE_OPS(f32, float)
ROPE_OPS(bf16, __nv_bfloat16)
ROPE_OPS(f16, __half)
