// rmsnorm.cu: RMSNorm forward/backward over grouped rows (CUDA), see engine/backend.h.
//
// Row r = n*G + g of C elements starts at n*stride + g*C (G = 1 for the block norms, G =
// heads for qk-norm, C from 64 to 8192). One warp owns one row: it reads the row once for
// the sum, once more (from cache) to write, so no shared memory and any C works.
// dweight is summed in two fixed-order passes (per-block partials in the scratch buffer,
// then the partials in block order), never with atomics.
#include "engine/cuda/cuda_math.cuh"

namespace {

constexpr int kRowWarps = 8; // rows per block in the row kernels
constexpr int kRowThreads = kRowWarps * 32;
constexpr int kDwCols = 32; // dweight partials: channels per block (threadIdx.x)
constexpr int kDwRows = 8;  // dweight partials: row lanes per block (threadIdx.y)
constexpr int kDwTargetBlocks = 2048;
constexpr int kSumThreads = 256;

// Start of row r = n*G + g. 32-bit division when r fits (always, in practice): the 64-bit
// one is a long software sequence.
__device__ __forceinline__ size_t row_offset(long long r, int G, int C, int stride) {
    size_t n, g;
    if (r <= 0xffffffffLL) {
        unsigned q = (unsigned)r / (unsigned)G;
        n = q;
        g = (unsigned)r - q * (unsigned)G;
    } else {
        n = (size_t)(r / G);
        g = (size_t)(r % G);
    }
    return n * stride + g * C;
}

// out, inp: grouped rows (N*G rows of C); rstd: (N*G); weight: (C). In place is safe
// (out == inp): each lane reads an element before it writes it.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_fwd_kernel(T *out, float *rstd, const T *inp, const T *weight, long long R, int G,
                       int C, int stride, float eps) {
    long long r = (long long)blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (r >= R) return; // the whole warp leaves: its shuffles stay full
    int lane = threadIdx.x % 32;
    size_t at = row_offset(r, G, C, stride);
    const T *x = inp + at;
    T *o = out + at;
    float ss = 0.0f;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float v[VEC];
        load_vec<T, VEC>(x + c, v);
#pragma unroll
        for (int k = 0; k < VEC; k++)
            ss += v[k] * v[k];
    }
    ss = warp_sum(ss); // every lane gets the same bits
    float rs = 1.0f / sqrtf(ss / C + eps);
    if (lane == 0) rstd[r] = rs;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float v[VEC], w[VEC];
        load_vec<T, VEC>(x + c, v);
        load_vec<T, VEC>(weight + c, w);
#pragma unroll
        for (int k = 0; k < VEC; k++)
            v[k] = v[k] * rs * w[k];
        store_vec<T, VEC>(o + c, v);
    }
}

// dinp (= or +=) from dout, inp, weight, rstd; one warp per row. Each lane reads d[c]
// before writing dx[c], so dinp == dout would also be safe.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
    rmsnorm_bwd_dinp_kernel(T *dinp, const T *dout, const T *inp, const T *weight,
                            const float *rstd, long long R, int G, int C, int stride,
                            int accumulate) {
    long long r = (long long)blockIdx.x * kRowWarps + threadIdx.x / 32;
    if (r >= R) return;
    int lane = threadIdx.x % 32;
    size_t at = row_offset(r, G, C, stride);
    const T *x = inp + at, *d = dout + at;
    T *dx = dinp + at;
    float rs = rstd[r], dot = 0.0f;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float xv[VEC], dv[VEC], wv[VEC];
        load_vec<T, VEC>(x + c, xv);
        load_vec<T, VEC>(d + c, dv);
        load_vec<T, VEC>(weight + c, wv);
#pragma unroll
        for (int k = 0; k < VEC; k++)
            dot += dv[k] * wv[k] * xv[k];
    }
    dot = warp_sum(dot);
    // dx = rs * (d*w - xhat * mean(d*w*xhat)), xhat = x*rs
    float kk = dot * rs * rs / C;
    for (int c = lane * VEC; c < C; c += 32 * VEC) {
        float xv[VEC], dv[VEC], wv[VEC], out[VEC];
        load_vec<T, VEC>(x + c, xv);
        load_vec<T, VEC>(d + c, dv);
        load_vec<T, VEC>(weight + c, wv);
        if (accumulate) load_vec<T, VEC>(dx + c, out);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            float v = rs * (dv[k] * wv[k] - xv[k] * kk);
            out[k] = accumulate ? out[k] + v : v;
        }
        store_vec<T, VEC>(dx + c, out);
    }
}

// partial: (P, C) fp32; block (chunk, p) sums channels [chunk*32, +32) over rows
// [p*rows_per_block, +rows_per_block): row lane ty takes rows r0+ty, r0+ty+8, ... in
// order, then the 8 lanes are added in ty order. Every sum has a fixed order.
template <typename T>
__global__ void __launch_bounds__(kDwCols *kDwRows)
    rmsnorm_dweight_partial_kernel(float *partial, const T *dout, const T *inp, const float *rstd,
                                   long long R, int G, int C, int stride,
                                   long long rows_per_block) {
    __shared__ float lanes[kDwRows][kDwCols + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int c = blockIdx.x * kDwCols + tx;
    long long r0 = (long long)blockIdx.y * rows_per_block;
    long long r1 = r0 + rows_per_block < R ? r0 + rows_per_block : R;
    float acc = 0.0f;
    if (c < C)
        for (long long r = r0 + ty; r < r1; r += kDwRows) {
            size_t at = row_offset(r, G, C, stride) + c;
            acc += to_float(dout[at]) * to_float(inp[at]) * rstd[r];
        }
    lanes[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && c < C) {
        float s = 0.0f;
#pragma unroll
        for (int y = 0; y < kDwRows; y++)
            s += lanes[y][tx];
        partial[(size_t)blockIdx.y * C + c] = s;
    }
}

// dweight: (C) += sum over p of partial[p][c], in p order.
__global__ void rmsnorm_dweight_sum_kernel(float *dweight, const float *partial, int P, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.0f;
    for (int p = 0; p < P; p++)
        s += partial[(size_t)p * C + c];
    dweight[c] += s;
}

// The 16-byte path needs every row start and the weight 16-byte aligned.
template <typename T>
bool rows_vectorisable(int C, int stride, const void *a, const void *b, const void *c,
                       const void *d) {
    return C % kPack<T> == 0 && stride % kPack<T> == 0 && cu_aligned16(a) && cu_aligned16(b) &&
           cu_aligned16(c) && cu_aligned16(d);
}

template <typename T>
void rmsnorm_fwd(void *out, float *rstd, const void *inp, const void *weight, int N, int G, int C,
                 int stride, float eps) {
    long long R = (long long)N * G;
    if (R <= 0 || C <= 0) return;
    unsigned blocks = cu_ceil_div((size_t)R, kRowWarps);
    T *o = (T *)out;
    const T *x = (const T *)inp, *w = (const T *)weight;
    if (rows_vectorisable<T>(C, stride, out, inp, weight, weight))
        rmsnorm_fwd_kernel<T, kPack<T>>
            <<<blocks, kRowThreads, 0, cu_stream()>>>(o, rstd, x, w, R, G, C, stride, eps);
    else
        rmsnorm_fwd_kernel<T, 1>
            <<<blocks, kRowThreads, 0, cu_stream()>>>(o, rstd, x, w, R, G, C, stride, eps);
    CUDA_CHECK(cudaGetLastError());
}

// Partials first, then dinp: dweight then never reads a dinp that aliases dout.
template <typename T>
void rmsnorm_bwd(void *dinp, float *dweight, const void *dout, const void *inp, const void *weight,
                 const float *rstd, int N, int G, int C, int stride, int accumulate_dinp) {
    long long R = (long long)N * G;
    if (R <= 0 || C <= 0) return;
    const T *d = (const T *)dout, *x = (const T *)inp, *w = (const T *)weight;

    // The row-block count depends on the shape only (not the GPU), so the sums are the
    // same on every device; capped so the partials fit in the scratch buffer.
    long long chunks = cu_ceil_div(C, kDwCols);
    long long P = (kDwTargetBlocks + chunks - 1) / chunks;
    long long max_p = (long long)(CUDA_SCRATCH_BYTES / ((size_t)C * sizeof(float)));
    long long min_rows = (R + kDwRows - 1) / kDwRows; // at least kDwRows rows per block
    if (P > max_p) P = max_p;
    if (P > min_rows) P = min_rows;
    if (P > 65535) P = 65535; // grid.y limit
    if (P < 1) P = 1;
    long long rows_per_block = (R + P - 1) / P;
    P = (R + rows_per_block - 1) / rows_per_block; // no empty row blocks
    float *partial = (float *)cuda_scratch((size_t)P * C * sizeof(float));
    if (!partial) return; // recorded (engine/backend.h's failure rule)
    dim3 grid((unsigned)chunks, (unsigned)P), block(kDwCols, kDwRows);
    rmsnorm_dweight_partial_kernel<T>
        <<<grid, block, 0, cu_stream()>>>(partial, d, x, rstd, R, G, C, stride, rows_per_block);
    CUDA_CHECK(cudaGetLastError());
    rmsnorm_dweight_sum_kernel<<<cu_ceil_div(C, kSumThreads), kSumThreads, 0, cu_stream()>>>(
        dweight, partial, (int)P, C);
    CUDA_CHECK(cudaGetLastError());

    unsigned blocks = cu_ceil_div((size_t)R, kRowWarps);
    T *dx = (T *)dinp;
    if (rows_vectorisable<T>(C, stride, dinp, dout, inp, weight))
        rmsnorm_bwd_dinp_kernel<T, kPack<T>><<<blocks, kRowThreads, 0, cu_stream()>>>(
            dx, d, x, w, rstd, R, G, C, stride, accumulate_dinp);
    else
        rmsnorm_bwd_dinp_kernel<T, 1><<<blocks, kRowThreads, 0, cu_stream()>>>(
            dx, d, x, w, rstd, R, G, C, stride, accumulate_dinp);
    CUDA_CHECK(cudaGetLastError());
}

} // namespace

#define RMSNORM_OPS(S, T)                                                                          \
    void cuda_rmsnorm_fwd_##S(void *out, float *rstd, const void *inp, const void *weight, int N,  \
                              int G, int C, int stride, float eps) {                               \
        rmsnorm_fwd<T>(out, rstd, inp, weight, N, G, C, stride, eps);                              \
    }                                                                                              \
    void cuda_rmsnorm_bwd_##S(void *dinp, float *dweight, const void *dout, const void *inp,       \
                              const void *weight, const float *rstd, int N, int G, int C,          \
                              int stride, int accumulate_dinp) {                                   \
        rmsnorm_bwd<T>(dinp, dweight, dout, inp, weight, rstd, N, G, C, stride, accumulate_dinp);  \
    }

RMSNORM_OPS(f32, float)
RMSNORM_OPS(bf16, __nv_bfloat16)
RMSNORM_OPS(f16, __half)
