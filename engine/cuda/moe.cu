// moe.cu: DeepSeekMoE's routing and the combination of its experts' outputs (docs/design.md
// §7a), and MLA's strided row copy (CUDA). Shapes and semantics: engine/backend.h.
//
// Same numbers as engine/cpu/moe.c: every sum the CPU runs in order runs in the same order
// here, spelled with _rn intrinsics (no FMA contraction), so given the same expf the bits
// are the CPU's; only moe_combine_bwd's dweight is a block tree (fixed order, so
// deterministic, but not the CPU's order). No atomics anywhere:
//   moe_route: one thread per token (softmax, torch.topk's choice from engine/topk.h, the
//     weights); then one block per expert scans the (token, choice) pairs in pair order and
//     gives each of its pairs its rank (a block-wide prefix sum per chunk), which is the
//     stable counting sort the pair order needs; then one thread per pair adds its expert's
//     offset (an exclusive scan of the counts, redone by each block: E <= kMaxExperts).
//   moe_combine: one thread per output element sums j = 0..k-1 in order.
//   moe_combine_bwd: one block per token; each drows row written once, each dweight a block
//     reduction.
#include <math.h>

#include "engine/cuda/cuda_math.cuh"
#include "engine/topk.h"

namespace {

// The most experts moe_route takes: the top-k scratch of a token lives in its thread's local
// memory (8 bytes an expert). Tiers below it keep that memory, which the driver reserves for
// every resident thread of the GPU, to what E needs.
constexpr int kMaxExperts = 512;
constexpr int kRouteThreads = 128;
constexpr int kRankThreads = 256;
constexpr int kRankItems = 4; // consecutive pairs a thread takes per chunk of the rank scan
constexpr int kPlaceThreads = 256;
constexpr int kRouteBwdWarps = 4; // tokens per block of moe_route_bwd (a warp each)
constexpr int kCombineThreads = 128;
constexpr int kCopyThreads = 128;
static_assert(kMaxExperts <= 2 * kPlaceThreads, "place_kernel scans two counts a thread");

// x rounded to T and widened back (fp32: x).
template <typename T> __device__ __forceinline__ float round_to(float x) {
    return to_float(from_float<T>(x));
}

// The exclusive prefix sum of v over the block in thread order, and (total) the block's sum.
// Every thread must call it; the leading barrier lets a loop call it again at once.
__device__ int block_exclusive_scan(int v, int *total) {
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    int inc = v; // inclusive scan within the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int t = __shfl_sync(0xffffffffu, inc, (lane - o) & 31);
        if (lane >= o) inc += t;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < nwarps; w++) {
        int s = warp_sums[w];
        if (w < warp) before += s;
        sum += s;
    }
    *total = sum;
    return before + inc - v;
}

// ---------------------------------------------------------------- copy_rows

// dst[r*dst_stride + c] = src[r*src_stride + c] (strides and words in W). Block r copies row r;
// W is int4 when rows and strides are whole 16-byte words and the buffers aligned, else T.
template <typename W>
__global__ void copy_rows_kernel(W *dst, size_t dst_stride, const W *src, size_t src_stride,
                                 int words) {
    const W *s = src + blockIdx.x * src_stride;
    W *d = dst + blockIdx.x * dst_stride;
    for (int c = threadIdx.x; c < words; c += blockDim.x)
        d[c] = s[c];
}

template <typename T>
void copy_rows(void *dst, int dst_stride, const void *src, int src_stride, int rows, int cols) {
    if (rows <= 0 || cols <= 0) return;
    constexpr int V = kPack<T>; // elements of a 16-byte word
    if (cols % V == 0 && dst_stride % V == 0 && src_stride % V == 0 && cu_aligned16(dst) &&
        cu_aligned16(src))
        copy_rows_kernel<int4><<<rows, kCopyThreads, 0, cu_stream()>>>(
            (int4 *)dst, dst_stride / V, (const int4 *)src, src_stride / V, cols / V);
    else
        copy_rows_kernel<T><<<rows, kCopyThreads, 0, cu_stream()>>>(
            (T *)dst, dst_stride, (const T *)src, src_stride, cols);
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- moe_route

// p: (E) = softmax(z) in fp32, each rounded to T. As engine/cpu/moe.c: the max with `>` (so a
// NaN is skipped as there), the exponentials summed in index order, p holding them until the
// division.
template <typename T> __device__ void softmax_rounded(float *p, const T *z, int E) {
    float max = to_float(z[0]);
    for (int e = 1; e < E; e++) {
        float v = to_float(z[e]);
        max = v > max ? v : max;
    }
    float sum = 0.0f;
    for (int e = 0; e < E; e++) {
        p[e] = expf(to_float(z[e]) - max);
        sum = __fadd_rn(sum, p[e]);
    }
    for (int e = 0; e < E; e++)
        p[e] = round_to<T>(__fdiv_rn(p[e], sum));
}

// probs: (N,E); weight, expert: (N*k); logits: (N,E). Thread n routes token n: its k experts
// as torch.topk picks them, their probabilities summed in that order, then the experts sorted
// by index (insertion sort: k is small) and each weight p / sum rounded to T. MAXE >= E.
template <typename T, int MAXE>
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(float *probs, float *weight, int32_t *expert, const T *logits, int N, int E,
                 int k) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    float *p = probs + (size_t)n * E;
    int32_t *ex = expert + (size_t)n * k;
    softmax_rounded<T>(p, logits + (size_t)n * E, E);
    TopkPair scratch[MAXE];
    topk_torch_cpu(p, E, k, scratch, ex);
    float total = 0.0f;
    for (int j = 0; j < k; j++)
        total = __fadd_rn(total, p[ex[j]]);
    topk_by_index(ex, k);
    for (int j = 0; j < k; j++)
        weight[(size_t)n * k + j] = round_to<T>(__fdiv_rn(p[ex[j]], total));
}

// counts: (E); slot: (pairs) gets, for each pair of expert e = blockIdx.x, its rank among e's
// pairs in pair order (= token order, a token's experts being distinct). Chunks of
// kRankThreads * kRankItems pairs, thread t taking kRankItems consecutive ones.
__global__ void __launch_bounds__(kRankThreads)
    rank_kernel(int32_t *counts, int32_t *slot, const int32_t *expert, int pairs) {
    const int e = blockIdx.x;
    int base = 0;
    for (int p0 = 0; p0 < pairs; p0 += kRankThreads * kRankItems) {
        const int first = p0 + threadIdx.x * kRankItems;
        int mine = 0;
        for (int i = 0; i < kRankItems; i++)
            mine += first + i < pairs && expert[first + i] == e;
        int total, rank = base + block_exclusive_scan(mine, &total);
        for (int i = 0; i < kRankItems && mine; i++)
            if (first + i < pairs && expert[first + i] == e) slot[first + i] = rank++;
        base += total;
    }
    if (threadIdx.x == 0) counts[e] = base;
}

// token_of: (pairs); slot: (pairs), ranks in, pair indices out: slot[p] += the offset of its
// expert (the pairs of the experts before it). Thread t scans counts 2t and 2t + 1.
__global__ void __launch_bounds__(kPlaceThreads)
    place_kernel(int32_t *token_of, int32_t *slot, const int32_t *expert, const int32_t *counts,
                 int pairs, int E, int k) {
    __shared__ int32_t offset[kMaxExperts];
    const int e0 = 2 * threadIdx.x;
    const int c0 = e0 < E ? counts[e0] : 0, c1 = e0 + 1 < E ? counts[e0 + 1] : 0;
    int total, before = block_exclusive_scan(c0 + c1, &total);
    if (e0 < E) offset[e0] = before;
    if (e0 + 1 < E) offset[e0 + 1] = before + c0;
    __syncthreads();
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= pairs) return;
    const int32_t s = offset[expert[p]] + slot[p];
    slot[p] = s;
    token_of[s] = p / k;
}

// Launches route_kernel with the smallest scratch tier that holds E.
template <typename T>
void launch_route(float *probs, float *weight, int32_t *expert, const T *logits, int N, int E,
                  int k) {
    const unsigned blocks = cu_ceil_div(N, kRouteThreads);
#define ROUTE_TIER(MAXE)                                                                           \
    route_kernel<T, MAXE>                                                                          \
        <<<blocks, kRouteThreads, 0, cu_stream()>>>(probs, weight, expert, logits, N, E, k)
    if (E <= 32)
        ROUTE_TIER(32);
    else if (E <= 64)
        ROUTE_TIER(64);
    else if (E <= 128)
        ROUTE_TIER(128);
    else if (E <= 256)
        ROUTE_TIER(256);
    else
        ROUTE_TIER(kMaxExperts);
#undef ROUTE_TIER
    CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void moe_route(float *probs, float *weight, int32_t *expert, int32_t *counts, int32_t *token_of,
               int32_t *slot, const void *logits, int N, int E, int k) {
    if (E < 1 || E > kMaxExperts || k < 1 || k > E || N < 0 || (long long)N * k > INT32_MAX) {
        first_failure_record(&cuda_failures,
                             "cuda backend: moe_route: unsupported shape N=%d E=%d k=%d (1 <= k "
                             "<= E <= %d)",
                             N, E, k, kMaxExperts);
        return;
    }
    const int pairs = N * k;
    if (N > 0) launch_route<T>(probs, weight, expert, (const T *)logits, N, E, k);
    rank_kernel<<<E, kRankThreads, 0, cu_stream()>>>(counts, slot, expert, pairs);
    CUDA_CHECK(cudaGetLastError());
    if (pairs == 0) return;
    place_kernel<<<cu_ceil_div(pairs, kPlaceThreads), kPlaceThreads, 0, cu_stream()>>>(
        token_of, slot, expert, counts, pairs, E, k);
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- moe_route_bwd

// dlogits: (N,E) from dweight: (N*k). A warp per token: every lane computes the token's
// scalars (the same operations, so the same bits), as engine/cpu/moe.c in its order, then
// the lanes write the row; a chosen expert's j is found by bisection (expert rows ascend).
template <typename T>
__global__ void __launch_bounds__(kRouteBwdWarps * 32)
    route_bwd_kernel(T *dlogits, const float *dweight, const float *probs, const int32_t *expert,
                     int N, int E, int k) {
    const int n = blockIdx.x * kRouteBwdWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n >= N) return;
    const float *p = probs + (size_t)n * E, *dw = dweight + (size_t)n * k;
    const int32_t *ex = expert + (size_t)n * k;
    float s = 0.0f, dot_w = 0.0f, dot_p = 0.0f;
    for (int j = 0; j < k; j++)
        s = __fadd_rn(s, p[ex[j]]);
    for (int j = 0; j < k; j++)
        dot_w = __fadd_rn(dot_w, __fmul_rn(dw[j], __fdiv_rn(p[ex[j]], s)));
    for (int j = 0; j < k; j++)
        dot_p = __fadd_rn(dot_p, __fmul_rn(__fdiv_rn(__fsub_rn(dw[j], dot_w), s), p[ex[j]]));
    T *dz = dlogits + (size_t)n * E;
    for (int e = lane; e < E; e += 32) {
        float v = __fmul_rn(-p[e], dot_p);
        int lo = 0, hi = k; // the first j with ex[j] >= e
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (ex[mid] < e)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo < k && ex[lo] == e)
            v = __fadd_rn(v, __fdiv_rn(__fmul_rn(p[e], __fsub_rn(dw[lo], dot_w)), s));
        dz[e] = from_float<T>(v);
    }
}

template <typename T>
void moe_route_bwd(void *dlogits, const float *dweight, const float *probs, const int32_t *expert,
                   int N, int E, int k) {
    if (N <= 0 || E <= 0) return;
    route_bwd_kernel<T><<<cu_ceil_div(N, kRouteBwdWarps), kRouteBwdWarps * 32, 0, cu_stream()>>>(
        (T *)dlogits, dweight, probs, expert, N, E, k);
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- moe_combine

// out: (N,C) = resid + (shared_scale * shared + sum_j weight * rows[slot]), the CPU's order and
// roundings (rounded to T once, at the store). Grid (N, chunks of kCombineThreads*VEC
// columns). out may be resid: each element is read before it is written, by its thread.
template <typename T, int VEC>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(T *out, const T *resid, const T *shared, float shared_scale, const T *rows,
                   const float *weight, const int32_t *slot, int k, int C) {
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (c >= C) return;
    const size_t n = blockIdx.x, at = n * C + c;
    float acc[VEC], v[VEC];
    if (shared) {
        load_vec<T, VEC>(shared + at, v);
#pragma unroll
        for (int i = 0; i < VEC; i++)
            acc[i] = __fmul_rn(shared_scale, v[i]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++)
            acc[i] = 0.0f;
    }
    for (int j = 0; j < k; j++) {
        const float w = weight ? weight[n * k + j] : 1.0f;
        load_vec<T, VEC>(rows + (size_t)slot[n * k + j] * C + c, v);
#pragma unroll
        for (int i = 0; i < VEC; i++)
            acc[i] = __fadd_rn(acc[i], __fmul_rn(w, v[i]));
    }
    if (resid) {
        load_vec<T, VEC>(resid + at, v);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++)
            v[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < VEC; i++)
        acc[i] = __fadd_rn(v[i], acc[i]);
    store_vec<T, VEC>(out + at, acc);
}

template <typename T>
void moe_combine(void *out, const void *resid, const void *shared, float shared_scale,
                 const void *rows, const float *weight, const int32_t *slot, int N, int k, int C) {
    if (N <= 0 || C <= 0) return;
    constexpr int V = kPack<T>;
    const bool vec = C % V == 0 && cu_aligned16(out) && cu_aligned16(rows) &&
                     (!resid || cu_aligned16(resid)) && (!shared || cu_aligned16(shared));
    const int per = vec ? V : 1;
    dim3 grid(N, cu_ceil_div(C / per, kCombineThreads));
#define COMBINE(VEC)                                                                               \
    combine_kernel<T, VEC><<<grid, kCombineThreads, 0, cu_stream()>>>(                             \
        (T *)out, (const T *)resid, (const T *)shared, shared_scale, (const T *)rows, weight,      \
        slot, k, C)
    if (vec)
        COMBINE(V);
    else
        COMBINE(1);
#undef COMBINE
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------- moe_combine_bwd

// Block n: for j = 0..k-1, row slot[n*k+j] of drows = weight * dout[n] and dweight[n*k+j] =
// <dout[n], that row of rows> (per-thread strided partials, then the block tree); dshared[n]
// = shared_scale * dout[n] when dshared is not NULL. Thread t takes the VEC-element vectors t,
// t + blockDim, ... of the row.
template <typename T, int VEC>
__global__ void __launch_bounds__(256)
    combine_bwd_kernel(T *drows, float *dweight, T *dshared, const T *dout, const T *rows,
                       const float *weight, const int32_t *slot, float shared_scale, int k, int C) {
    const size_t n = blockIdx.x;
    const T *d = dout + n * C;
    for (int j = 0; j < k; j++) {
        const size_t row = (size_t)slot[n * k + j] * C;
        const float w = weight[n * k + j];
        float dot = 0.0f;
        for (int c = threadIdx.x * VEC; c < C; c += blockDim.x * VEC) {
            float dv[VEC], rv[VEC], o[VEC];
            load_vec<T, VEC>(d + c, dv);
            load_vec<T, VEC>(rows + row + c, rv);
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                o[i] = __fmul_rn(w, dv[i]);
                dot += dv[i] * rv[i];
            }
            store_vec<T, VEC>(drows + row + c, o);
        }
        dot = block_reduce(dot, SumOp(), 0.0f);
        if (threadIdx.x == 0) dweight[n * k + j] = dot;
    }
    if (!dshared) return;
    for (int c = threadIdx.x * VEC; c < C; c += blockDim.x * VEC) {
        float dv[VEC];
        load_vec<T, VEC>(d + c, dv);
#pragma unroll
        for (int i = 0; i < VEC; i++)
            dv[i] = __fmul_rn(shared_scale, dv[i]);
        store_vec<T, VEC>(dshared + n * C + c, dv);
    }
}

template <typename T>
void moe_combine_bwd(void *drows, float *dweight, void *dshared, const void *dout, const void *rows,
                     const float *weight, const int32_t *slot, float shared_scale, int N, int k,
                     int C) {
    if (N <= 0 || C <= 0) return;
    constexpr int V = kPack<T>;
    const bool vec = C % V == 0 && cu_aligned16(drows) && cu_aligned16(dout) &&
                     cu_aligned16(rows) && (!dshared || cu_aligned16(dshared));
    const int per = vec ? V : 1;
    // Enough whole warps for a row's vectors (block_reduce needs whole warps), 256 at most.
    const int warps = (int)cu_ceil_div(C / per, 32), threads = warps < 8 ? 32 * warps : 256;
#define COMBINE_BWD(VEC)                                                                           \
    combine_bwd_kernel<T, VEC><<<N, threads, 0, cu_stream()>>>((T *)drows, dweight, (T *)dshared,  \
                                                               (const T *)dout, (const T *)rows,   \
                                                               weight, slot, shared_scale, k, C)
    if (vec)
        COMBINE_BWD(V);
    else
        COMBINE_BWD(1);
#undef COMBINE_BWD
    CUDA_CHECK(cudaGetLastError());
}

} // namespace

#define MOE_OPS(S, T)                                                                              \
    void cuda_copy_rows_##S(void *dst, int dst_stride, const void *src, int src_stride, int rows,  \
                            int cols) {                                                            \
        copy_rows<T>(dst, dst_stride, src, src_stride, rows, cols);                                \
    }                                                                                              \
    void cuda_moe_route_##S(float *probs, float *weight, int32_t *expert, int32_t *counts,         \
                            int32_t *token_of, int32_t *slot, const void *logits, int N, int E,    \
                            int k) {                                                               \
        moe_route<T>(probs, weight, expert, counts, token_of, slot, logits, N, E, k);              \
    }                                                                                              \
    void cuda_moe_route_bwd_##S(void *dlogits, const float *dweight, const float *probs,           \
                                const int32_t *expert, int N, int E, int k) {                      \
        moe_route_bwd<T>(dlogits, dweight, probs, expert, N, E, k);                                \
    }                                                                                              \
    void cuda_moe_combine_##S(void *out, const void *resid, const void *shared,                    \
                              float shared_scale, const void *rows, const float *weight,           \
                              const int32_t *slot, int N, int k, int C) {                          \
        moe_combine<T>(out, resid, shared, shared_scale, rows, weight, slot, N, k, C);             \
    }                                                                                              \
    void cuda_moe_combine_bwd_##S(void *drows, float *dweight, void *dshared, const void *dout,    \
                                  const void *rows, const float *weight, const int32_t *slot,      \
                                  float shared_scale, int N, int k, int C) {                       \
        moe_combine_bwd<T>(drows, dweight, dshared, dout, rows, weight, slot, shared_scale, N, k,  \
                           C);                                                                     \
    }

MOE_OPS(f32, float)
MOE_OPS(bf16, __nv_bfloat16)
MOE_OPS(f16, __half)
