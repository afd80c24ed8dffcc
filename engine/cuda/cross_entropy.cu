// cross_entropy.cu: fused softmax cross-entropy with loss mask and label smoothing (CUDA),
// and the mean of the row losses into a device accumulator.
//
// Per counted row (torch.nn.functional.cross_entropy with label_smoothing e), as
// engine/cpu/cross_entropy.c:
//   loss = lse - (1-e) * z[t] - (e/V) * sum_j z[j]
//   dz[j] = dloss * row_scale[n] * (softmax(z)[j] - e/V - (1-e) * [j == t])
// One block per row reads the logits once (an online max/sum of exponentials), so rows of
// up to ~200k logits never need shared memory; the probabilities are never written.
// Every sum runs in a fixed order (per-thread strided, then the block tree): deterministic.
#include <math.h>

#include "engine/cuda/cuda_math.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kMeanThreads = 256;

// A running softmax denominator: s = sum of exp(z - m) over the values seen, m their max.
struct MaxSum {
    float m, s;
};

// Merges two partial (max, sum) pairs. Commutative in its bits (explicit roundings, no
// fused multiply-add), so the butterfly shuffles give every lane the same result.
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
    float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {m, 0.0f}; // both empty
    return {m, __fadd_rn(__fmul_rn(a.s, expf(a.m - m)), __fmul_rn(b.s, expf(b.m - m)))};
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        MaxSum other = {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
        v = merge(v, other);
    }
    return v;
}

// Block-wide merge (every thread gets the result), like block_reduce in cuda_math.cuh.
__device__ MaxSum block_merge(MaxSum v) {
    __shared__ MaxSum partial[32];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    v = warp_merge(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < nwarps ? partial[lane] : MaxSum{-INFINITY, 0.0f};
    return warp_merge(v);
}

// loss, lse: (N) fp32; logits: (N,V); one block per row, thread t takes the VEC-element
// vectors t, t + blockDim, ... of the row. Logits are assumed finite.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_fwd_kernel(float *loss, float *lse, const T *logits, const int32_t *targets,
                             const int32_t *mask, int V, float label_smoothing) {
    int n = blockIdx.x;
    const T *z = logits + (size_t)n * V;
    MaxSum ms = {-INFINITY, 0.0f};
    float zsum = 0.0f;
    for (int j = threadIdx.x * VEC; j < V; j += blockDim.x * VEC) {
        float v[VEC];
        load_vec<T, VEC>(z + j, v);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            // one exp per element: rescale the sum when the max grows
            if (v[k] > ms.m) {
                ms.s = ms.s * expf(ms.m - v[k]) + 1.0f;
                ms.m = v[k];
            } else {
                ms.s += expf(v[k] - ms.m);
            }
            zsum += v[k];
        }
    }
    ms = block_merge(ms);
    zsum = block_reduce(zsum, SumOp(), 0.0f);
    if (threadIdx.x == 0) {
        float l = ms.m + logf(ms.s);
        lse[n] = l;
        loss[n] = mask[n] != 0 ? l - (1.0f - label_smoothing) * to_float(z[targets[n]]) -
                                     label_smoothing / V * zsum
                               : 0.0f;
    }
}

// dlogits: (N,V); one block per row. Rows not counted are zeroed without reading logits.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_bwd_kernel(T *dlogits, const T *logits, const float *lse, const int32_t *targets,
                             const int32_t *mask, const float *row_scale, int V,
                             float label_smoothing, float dloss) {
    int n = blockIdx.x;
    const T *z = logits + (size_t)n * V;
    T *dz = dlogits + (size_t)n * V;
    if (mask[n] == 0) { // block-uniform
        float zero[VEC] = {};
        for (int j = threadIdx.x * VEC; j < V; j += blockDim.x * VEC)
            store_vec<T, VEC>(dz + j, zero);
        return;
    }
    if (row_scale) dloss *= row_scale[n];
    float l = lse[n], smooth = label_smoothing / V, hit = dloss * (1.0f - label_smoothing);
    int t = targets[n];
    for (int j = threadIdx.x * VEC; j < V; j += blockDim.x * VEC) {
        float v[VEC];
        load_vec<T, VEC>(z + j, v);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            v[k] = dloss * (expf(v[k] - l) - smooth);
            if (j + k == t) v[k] -= hit; // in fp32, then one rounding to T
        }
        store_vec<T, VEC>(dz + j, v);
    }
}

// acc[0] += (double)(float)(sum of loss / counted); one block, the sum in double: strided
// per thread, then the block tree, a fixed order; thread 0 alone touches acc.
__global__ void __launch_bounds__(kMeanThreads)
    loss_mean_add_kernel(double *acc, const float *loss, int N, int counted) {
    double s = 0.0;
    for (int n = threadIdx.x; n < N; n += blockDim.x)
        s += (double)loss[n];
    s = block_reduce(s, SumOp(), 0.0);
    if (threadIdx.x == 0) acc[0] += (double)(float)(s / counted);
}

template <typename T> bool rows_vectorisable(int V, const void *a, const void *b) {
    return V % kPack<T> == 0 && cu_aligned16(a) && cu_aligned16(b);
}

template <typename T>
void cross_entropy_fwd(float *loss, float *lse, const void *logits, const int32_t *targets,
                       const int32_t *mask, int N, int V, float label_smoothing) {
    if (N <= 0 || V <= 0) return;
    const T *z = (const T *)logits;
    if (rows_vectorisable<T>(V, logits, logits))
        cross_entropy_fwd_kernel<T, kPack<T>>
            <<<N, kThreads, 0, cu_stream()>>>(loss, lse, z, targets, mask, V, label_smoothing);
    else
        cross_entropy_fwd_kernel<T, 1>
            <<<N, kThreads, 0, cu_stream()>>>(loss, lse, z, targets, mask, V, label_smoothing);
    CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void cross_entropy_bwd(void *dlogits, const void *logits, const float *lse, const int32_t *targets,
                       const int32_t *mask, const float *row_scale, int N, int V,
                       float label_smoothing, float dloss) {
    if (N <= 0 || V <= 0) return;
    T *dz = (T *)dlogits;
    const T *z = (const T *)logits;
    if (rows_vectorisable<T>(V, dlogits, logits))
        cross_entropy_bwd_kernel<T, kPack<T>><<<N, kThreads, 0, cu_stream()>>>(
            dz, z, lse, targets, mask, row_scale, V, label_smoothing, dloss);
    else
        cross_entropy_bwd_kernel<T, 1><<<N, kThreads, 0, cu_stream()>>>(
            dz, z, lse, targets, mask, row_scale, V, label_smoothing, dloss);
    CUDA_CHECK(cudaGetLastError());
}

} // namespace

#define CROSS_ENTROPY_OPS(S, T)                                                                    \
    void cuda_cross_entropy_fwd_##S(float *loss, float *lse, const void *logits,                   \
                                    const int32_t *targets, const int32_t *mask, int N, int V,     \
                                    float label_smoothing) {                                       \
        cross_entropy_fwd<T>(loss, lse, logits, targets, mask, N, V, label_smoothing);             \
    }                                                                                              \
    void cuda_cross_entropy_bwd_##S(void *dlogits, const void *logits, const float *lse,           \
                                    const int32_t *targets, const int32_t *mask,                   \
                                    const float *row_scale, int N, int V, float label_smoothing,   \
                                    float dloss) {                                                 \
        cross_entropy_bwd<T>(dlogits, logits, lse, targets, mask, row_scale, N, V,                 \
                             label_smoothing, dloss);                                              \
    }

CROSS_ENTROPY_OPS(f32, float)
CROSS_ENTROPY_OPS(bf16, __nv_bfloat16)
CROSS_ENTROPY_OPS(f16, __half)

void cuda_loss_mean_add(double *acc, const float *loss, int N, int counted) {
    if (counted <= 0) return; // the caller guarantees counted > 0; never divide by zero
    loss_mean_add_kernel<<<1, kMeanThreads, 0, cu_stream()>>>(acc, loss, N, counted);
    CUDA_CHECK(cudaGetLastError());
}
