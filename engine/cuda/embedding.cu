// embedding.cu: token embedding lookup and its deterministic backward (CUDA).
//
// Backward sums the gradient rows of equal token ids without atomics: by_id lists the
// token indices stably sorted by id (built on the host), so the tokens of one id form a run
// of consecutive positions, and one thread per (run, channel) adds them in token order,
// exactly as engine/cpu/elementwise.c does.
#include "engine/cuda/cuda_math.cuh"

namespace {

constexpr int kFwdThreads = 128;
constexpr int kBwdThreads = 256;

// out: (N,C) = table[ids[n]]: (V,C). Block n copies row n; W is the copy word (int4 when
// rows are whole 16-byte words and both buffers are aligned, else the element type).
template <typename W>
__global__ void embedding_fwd_kernel(W *out, const int32_t *ids, const W *table, int words) {
    int n = blockIdx.x;
    const W *src = table + (size_t)ids[n] * words;
    W *dst = out + (size_t)n * words;
    for (int c = threadIdx.x; c < words; c += blockDim.x)
        dst[c] = src[c];
}

// dtable: (V,C) fp32 += dout: (N,C) scattered by ids. Grid (N positions in by_id, channel
// chunks); a block whose position starts a run of equal ids sums the run, the others exit.
// Starting from the old dtable value and adding in token order gives the CPU's bits.
template <typename T>
__global__ void embedding_bwd_kernel(float *dtable, const T *dout, const int32_t *ids,
                                     const int32_t *by_id, int N, int C) {
    int i = blockIdx.x;
    int id = ids[by_id[i]];
    if (i > 0 && ids[by_id[i - 1]] == id) return; // not the start of a run (block-uniform)
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float *dst = dtable + (size_t)id * C + c;
    float acc = *dst;
    for (int j = i; j < N; j++) {
        int n = by_id[j];
        if (ids[n] != id) break;
        acc += to_float(dout[(size_t)n * C + c]);
    }
    *dst = acc;
}

template <typename T>
void embedding_fwd(void *out, const int32_t *ids, const void *table, int N, int C) {
    if (N <= 0 || C <= 0) return;
    size_t row_bytes = (size_t)C * sizeof(T);
    if (row_bytes % 16 == 0 && cu_aligned16(out) && cu_aligned16(table))
        embedding_fwd_kernel<int4><<<N, kFwdThreads, 0, cu_stream()>>>(
            (int4 *)out, ids, (const int4 *)table, (int)(row_bytes / 16));
    else
        embedding_fwd_kernel<T>
            <<<N, kFwdThreads, 0, cu_stream()>>>((T *)out, ids, (const T *)table, C);
    CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void embedding_bwd(float *dtable, const void *dout, const int32_t *ids, const int32_t *by_id, int N,
                   int C) {
    if (N <= 0 || C <= 0) return;
    dim3 grid(N, cu_ceil_div(C, kBwdThreads));
    embedding_bwd_kernel<T>
        <<<grid, kBwdThreads, 0, cu_stream()>>>(dtable, (const T *)dout, ids, by_id, N, C);
    CUDA_CHECK(cudaGetLastError());
}

} // namespace

#define EMBEDDING_OPS(S, T)                                                                        \
    void cuda_embedding_fwd_##S(void *out, const int32_t *ids, const void *table, int N, int C) {  \
        embedding_fwd<T>(out, ids, table, N, C);                                                   \
    }                                                                                              \
    void cuda_embedding_bwd_##S(float *dtable, const void *dout, const int32_t *ids,               \
                                const int32_t *by_id, int N, int C) {                              \
        embedding_bwd<T>(dtable, dout, ids, by_id, N, C);                                          \
    }

EMBEDDING_OPS(f32, float)
EMBEDDING_OPS(bf16, __nv_bfloat16)
EMBEDDING_OPS(f16, __half)
