// attention.cu: flash-style causal GQA attention with document masks (CUDA), forward and
// backward, and generation's decoding step over a KV cache; see engine/backend.h
// (attention_fwd, attention_bwd, attention_decode) and engine/cpu/attention.c.
//
// No (T,T) matrix ever reaches global memory: a block holds a tile of queries and walks the
// key tiles it can see, keeping a running max and sum per query row (online softmax); the
// forward writes only out and each row's logsumexp. The backward recomputes p = exp(s - lse)
// tile by tile, in three kernels:
//   delta    delta[b,h,i] = sum_d dout[i,d] * out[i,d]          (one warp per row)
//   dk/dv    one block per (b, kv head, key tile): loops over the query tiles that can see
//            it and the H/KVH query heads of its group, accumulates dk and dv on chip and
//            writes them once;
//   dq       one block per (b, head, query tile): loops over the key tiles it can see.
// Every output element is written by one thread, after a sum in a fixed order: no atomics,
// so the results are bitwise reproducible.
//
// Two implementations share this schedule:
//   * SIMT (any head_dim 1..256, fp32, bf16 or fp16 storage): fp32 FMAs only (no TF32), so the
//     fp32 backend matches the CPU to rounding; tiles of 32 queries x 16 keys in shared memory.
//   * Tensor cores (bf16 or fp16, head_dim 64 or 128, 16-byte aligned rows): mma.sync
//     m16n8k16 with bf16 (fp16) operands and fp32 accumulation, tiles of 64 queries x 64 keys
//     (dk/dv: 64 keys x 32 queries), operands staged through shared memory with cp.async,
//     probabilities kept in registers. The storage type E is the operand type: P and dS are
//     rounded to it for their GEMMs (fp16: P in [0, 1] keeps 11 bits; a dS past 65504 is inf,
//     an overflow the trainer's loss scaling sees in the gradients).
// The key-tile ranges, the per-element mask and the update order are the same in both, and
// tests/test_attention_tiling.c replays them on the CPU against a naive attention; the
// kernels themselves run on the CPU in test_cuda_emu (tests/cuda_emu/, PTX emulated).
//
// Masks: key j is visible to query i iff doc_start[b*T+i] <= j <= i. A query tile walks the
// key tiles from the one holding its lowest doc_start to the one holding its last row; a key
// tile visits only the query tiles in which some row sees one of its keys.
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include <initializer_list>
#include <type_traits>

#include "engine/cuda/cuda_math.cuh"

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxHeadDim = 256; // the SIMT kernels' limit (shared memory, see simt_smem_*)

// ================================================================ schedule (both paths)

// Key tiles [x, y) of width BK that query rows [i0, min(i0+BQ, T)) of one sequence can see:
// from the tile of the rows' lowest document start to the tile of the last row. Every warp
// computes the same answer on its own (no barrier); ds: doc_start of the batch row.
template <int BQ, int BK>
__device__ __forceinline__ int2 key_tiles(const int32_t *ds, int i0, int T) {
    int lane = threadIdx.x & 31, lo = INT_MAX;
    for (int r = lane; r < BQ; r += 32)
        if (i0 + r < T) lo = min(lo, ds[i0 + r]);
    lo = max(__reduce_min_sync(0xffffffffu, lo), 0); // >= 0 even for a malformed doc_start
    int last = min(i0 + BQ, T) - 1;
    return make_int2(lo / BK, last / BK + 1);
}

// Whether some row i of query tile [i0, i0+BQ) sees a key of [j0, j_end): row i sees
// [ds[i], i], which meets [j0, j_end) iff i >= j0 and ds[i] < j_end (and ds[i] <= i).
// A barrier (__syncthreads_or): every thread of the block must call it alike; BQ <= blockDim.
template <int BQ>
__device__ __forceinline__ bool q_tile_sees(const int32_t *ds, int i0, int T, int j0, int j_end) {
    int i = i0 + (int)threadIdx.x;
    bool sees = (int)threadIdx.x < BQ && i < T && i >= j0 && ds[i] < j_end && ds[i] <= i;
    return __syncthreads_or(sees) != 0;
}

// The first query tile >= qt (of nqt) that sees keys [j0, j_end), or nqt. A barrier per tile.
template <int BQ>
__device__ int next_q_tile(const int32_t *ds, int qt, int nqt, int T, int j0, int j_end) {
    while (qt < nqt && !q_tile_sees<BQ>(ds, qt * BQ, T, j0, j_end))
        qt++;
    return qt;
}

// ================================================================ SIMT kernels

// 4 warps; a query tile of 32 rows (one per lane in the softmax) and key tiles of 16.
constexpr int kSimtThreads = 128, kSimtBQ = 32, kSimtBK = 16;

// Rows [t0, t0+R) of one head (D values each, token stride `stride`) -> dst (R, ld) as fp32;
// rows at or past T are zero (so that they add nothing and are never NaN).
template <typename E>
__device__ void load_rows_f32(float *dst, int ld, const E *src, int t0, int R, int T, int D,
                              int stride) {
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
        int r = e / D, d = e - r * D;
        dst[r * ld + d] = t0 + r < T ? to_float(src[(size_t)(t0 + r) * stride + d]) : 0.0f;
    }
}

// The block's rows [i0, i0+BQ): lse, delta and doc_start into shared memory (rows past T: a
// doc_start of INT_MAX hides every key from them).
__device__ void load_row_stats(float *row_lse, float *row_delta, int *row_ds, const float *lse,
                               const float *delta, const int32_t *ds, int i0, int T) {
    int r = threadIdx.x, i = i0 + r;
    if (r < kSimtBQ) {
        row_lse[r] = i < T ? lse[i] : 0.0f;
        row_delta[r] = i < T ? delta[i] : 0.0f;
        row_ds[r] = i < T ? ds[i] : INT_MAX;
    }
}

__device__ __forceinline__ float dot_f32(const float *a, const float *b, int D) {
    float s = 0.0f;
    for (int d = 0; d < D; d++)
        s = fmaf(a[d], b[d], s);
    return s;
}

// Shared memory of attn_fwd_simt, in floats: Q (BQ,D), K (BK,D+1), V (BK,D), O (BQ,D),
// S/P (BQ,BK), row max, sum, rescale and doc_start (BQ each).
size_t simt_smem_fwd(int D) {
    return sizeof(float) * ((size_t)kSimtBQ * D * 2 + (size_t)kSimtBK * (2 * D + 1) +
                            kSimtBQ * kSimtBK + 4 * kSimtBQ);
}

// out: (B,T,H,D); lse: (B,H,T). Grid (query tiles, H, B), the last (longest) tiles first.
// Per key tile: S = scale * Q K^T masked (one thread per entry), then one warp per row takes
// the tile's max, rescales its running sum, and turns S into p = exp(S - max); then
// O = O * rescale + P V (one thread per output element, keys in order).
template <typename E>
__global__ void __launch_bounds__(kSimtThreads)
    attn_fwd_simt(E *out, float *lse, const E *q, const E *k, const E *v, const int32_t *doc_start,
                  int T, int H, int KVH, int D, int stride) {
    constexpr int BQ = kSimtBQ, BK = kSimtBK, NT = kSimtThreads;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float *Qs = (float *)smem_raw, *Ks = Qs + BQ * D, *Vs = Ks + BK * (D + 1), *Os = Vs + BK * D;
    float *Ps = Os + BQ * D, *row_m = Ps + BQ * BK, *row_l = row_m + BQ, *row_a = row_l + BQ;
    int *row_ds = (int *)(row_a + BQ);

    const int nqt = (T + BQ - 1) / BQ, i0 = (nqt - 1 - (int)blockIdx.x) * BQ;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float scale = 1.0f / sqrtf((float)D);
    const int32_t *ds = doc_start + (size_t)b * T;
    const E *qb = q + (size_t)b * T * stride + (size_t)h * D;
    const E *kb = k + (size_t)b * T * stride + (size_t)kvh * D;
    const E *vb = v + (size_t)b * T * stride + (size_t)kvh * D;

    load_rows_f32(Qs, D, qb, i0, BQ, T, D, stride);
    for (int e = tid; e < BQ * D; e += NT)
        Os[e] = 0.0f;
    if (tid < BQ) {
        row_m[tid] = -INFINITY;
        row_l[tid] = 0.0f;
        row_ds[tid] = i0 + tid < T ? ds[i0 + tid] : INT_MAX;
    }
    const int2 kt_range = key_tiles<BQ, BK>(ds, i0, T);
    for (int kt = kt_range.x; kt < kt_range.y; kt++) {
        const int j0 = kt * BK;
        load_rows_f32(Ks, D + 1, kb, j0, BK, T, D, stride);
        load_rows_f32(Vs, D, vb, j0, BK, T, D, stride);
        __syncthreads(); // also orders the Q/O/row initialisation before the first use
        for (int e = tid; e < BQ * BK; e += NT) {
            int r = e / BK, c = e % BK, i = i0 + r, j = j0 + c;
            bool vis = row_ds[r] <= j && j <= i;
            Ps[e] = vis ? dot_f32(Qs + r * D, Ks + c * (D + 1), D) * scale : -INFINITY;
        }
        __syncthreads();
        for (int r = warp; r < BQ; r += NT / 32) {
            float x = lane < BK ? Ps[r * BK + lane] : -INFINITY;
            float m_old = row_m[r], m_new = fmaxf(m_old, warp_reduce(x, MaxOp()));
            float base = m_new == -INFINITY ? 0.0f : m_new; // a row that has seen nothing yet
            float p = expf(x - base);                       // masked: exp(-inf) = 0
            float sum = warp_sum(p);
            if (lane < BK) Ps[r * BK + lane] = p;
            if (lane == 0) {
                float alpha = expf(m_old - base);
                row_l[r] = row_l[r] * alpha + sum;
                row_m[r] = m_new;
                row_a[r] = alpha;
            }
        }
        __syncthreads();
        for (int e = tid; e < BQ * D; e += NT) {
            int r = e / D, d = e - r * D;
            float acc = Os[e] * row_a[r];
            for (int c = 0; c < BK; c++)
                acc = fmaf(Ps[r * BK + c], Vs[c * D + d], acc);
            Os[e] = acc;
        }
        __syncthreads(); // K, V, P and the row stats are rewritten by the next tile
    }
    __syncthreads(); // when no key tile ran: the initialisation above
    for (int e = tid; e < BQ * D; e += NT) {
        int r = e / D, d = e - r * D, i = i0 + r;
        if (i < T) {
            float l = row_l[r];
            out[((size_t)b * T + i) * H * D + (size_t)h * D + d] =
                from_float<E>(l > 0.0f ? Os[e] / l : 0.0f);
        }
    }
    if (tid < BQ && i0 + tid < T)
        lse[((size_t)b * H + h) * T + i0 + tid] = row_m[tid] + logf(row_l[tid]);
}

// delta: (B,H,T) = sum_d dout * out per row; dout, out: (B,T,H,D). One warp per (b,t,h),
// lanes strided over d then a butterfly sum (fixed order).
template <typename E>
__global__ void attn_delta(float *delta, const E *dout, const E *out, int B, int T, int H, int D) {
    size_t row = (size_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= (size_t)B * T * H) return; // whole warps leave together
    int lane = threadIdx.x & 31;
    const E *a = dout + row * D, *o = out + row * D;
    float s = 0.0f;
    for (int d = lane; d < D; d += 32)
        s = fmaf(to_float(a[d]), to_float(o[d]), s);
    s = warp_sum(s);
    if (lane == 0) {
        int h = (int)(row % H);
        size_t bt = row / H;
        int t = (int)(bt % T), b = (int)(bt / T);
        delta[((size_t)b * H + h) * T + t] = s;
    }
}

// The backward's per-entry step, shared by both SIMT kernels: row r of the query tile and
// key c of the key tile -> p = exp(scale*q.k - lse), ds = p * (dout.v - delta) * scale;
// both 0 where the key is hidden.
__device__ __forceinline__ void simt_grad_entry(float *p_out, float *ds_out, const float *Qs,
                                                const float *dOs, const float *Ks, const float *Vs,
                                                const float *row_lse, const float *row_delta,
                                                const int *row_ds, int r, int c, int i, int j,
                                                int D, float scale) {
    float p = 0.0f, dsv = 0.0f;
    if (row_ds[r] <= j && j <= i) {
        p = expf(dot_f32(Qs + r * D, Ks + c * (D + 1), D) * scale - row_lse[r]);
        float dp = dot_f32(dOs + r * D, Vs + c * (D + 1), D);
        dsv = p * (dp - row_delta[r]) * scale;
    }
    if (p_out) *p_out = p;
    *ds_out = dsv;
}

// Shared memory of attn_bwd_dkdv_simt, in floats (+ BQ ints): K, V (BK,D+1); dK, dV (BK,D);
// Q, dO (BQ,D); P, dS (BQ,BK); lse, delta, doc_start (BQ).
size_t simt_smem_dkdv(int D) {
    return sizeof(float) * ((size_t)kSimtBK * (2 * (D + 1) + 2 * D) + (size_t)kSimtBQ * 2 * D +
                            2 * kSimtBQ * kSimtBK + 3 * kSimtBQ);
}

// dk, dv: the k, v layout. Grid (key tiles, KVH, B), first tiles (the most work) first. For
// each query tile that sees the key tile, in order, and each head of the group, in order:
// P, dS (one thread per entry), then dV += P^T dO and dK += dS^T Q (one thread per element,
// query rows in order). lse, delta: (B,H,T).
template <typename E>
__global__ void __launch_bounds__(kSimtThreads)
    attn_bwd_dkdv_simt(E *dk, E *dv, const E *dout, const float *lse, const float *delta,
                       const E *q, const E *k, const E *v, const int32_t *doc_start, int T, int H,
                       int KVH, int D, int stride) {
    constexpr int BQ = kSimtBQ, BK = kSimtBK, NT = kSimtThreads;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float *Ks = (float *)smem_raw, *Vs = Ks + BK * (D + 1), *dKs = Vs + BK * (D + 1);
    float *dVs = dKs + BK * D, *Qs = dVs + BK * D, *dOs = Qs + BQ * D, *Ps = dOs + BQ * D;
    float *dSs = Ps + BQ * BK, *row_lse = dSs + BQ * BK, *row_delta = row_lse + BQ;
    int *row_ds = (int *)(row_delta + BQ);

    const int j0 = blockIdx.x * BK, j_end = min(j0 + BK, T), kvh = blockIdx.y, b = blockIdx.z;
    const int group = H / KVH, nqt = (T + BQ - 1) / BQ, tid = threadIdx.x;
    const float scale = 1.0f / sqrtf((float)D);
    const int32_t *ds = doc_start + (size_t)b * T;
    const size_t kv_at = (size_t)b * T * stride + (size_t)kvh * D;

    load_rows_f32(Ks, D + 1, k + kv_at, j0, BK, T, D, stride);
    load_rows_f32(Vs, D + 1, v + kv_at, j0, BK, T, D, stride);
    for (int e = tid; e < BK * D; e += NT)
        dKs[e] = dVs[e] = 0.0f;
    for (int qt = next_q_tile<BQ>(ds, j0 / BQ, nqt, T, j0, j_end); qt < nqt;
         qt = next_q_tile<BQ>(ds, qt + 1, nqt, T, j0, j_end)) {
        const int i0 = qt * BQ;
        for (int h = kvh * group; h < (kvh + 1) * group; h++) {
            const size_t hT = ((size_t)b * H + h) * T;
            load_rows_f32(Qs, D, q + (size_t)b * T * stride + (size_t)h * D, i0, BQ, T, D, stride);
            load_rows_f32(dOs, D, dout + (size_t)b * T * H * D + (size_t)h * D, i0, BQ, T, D,
                          H * D);
            load_row_stats(row_lse, row_delta, row_ds, lse + hT, delta + hT, ds, i0, T);
            __syncthreads();
            for (int e = tid; e < BQ * BK; e += NT) {
                int r = e / BK, c = e % BK;
                simt_grad_entry(Ps + e, dSs + e, Qs, dOs, Ks, Vs, row_lse, row_delta, row_ds, r, c,
                                i0 + r, j0 + c, D, scale);
            }
            __syncthreads();
            for (int e = tid; e < BK * D; e += NT) {
                int c = e / D, d = e - c * D;
                float acc_k = dKs[e], acc_v = dVs[e];
                for (int r = 0; r < BQ; r++) {
                    acc_v = fmaf(Ps[r * BK + c], dOs[r * D + d], acc_v);
                    acc_k = fmaf(dSs[r * BK + c], Qs[r * D + d], acc_k);
                }
                dKs[e] = acc_k;
                dVs[e] = acc_v;
            }
            __syncthreads(); // Q, dO, P, dS are rewritten by the next (tile, head)
        }
    }
    __syncthreads(); // when no query tile ran: the zeroing above
    for (int e = tid; e < BK * D; e += NT) {
        int c = e / D, d = e - c * D;
        if (j0 + c < T) {
            size_t at = kv_at + (size_t)(j0 + c) * stride + d;
            dk[at] = from_float<E>(dKs[e]);
            dv[at] = from_float<E>(dVs[e]);
        }
    }
}

// Shared memory of attn_bwd_dq_simt, in floats (+ BQ ints): Q, dO, dQ (BQ,D); K, V (BK,D+1);
// dS (BQ,BK); lse, delta, doc_start (BQ).
size_t simt_smem_dq(int D) {
    return sizeof(float) * ((size_t)kSimtBQ * 3 * D + (size_t)kSimtBK * 2 * (D + 1) +
                            kSimtBQ * kSimtBK + 3 * kSimtBQ);
}

// dq: the q layout. Grid (query tiles, H, B), the last tiles first. Per visible key tile:
// dS (one thread per entry), then dQ += dS K (one thread per element, keys in order).
template <typename E>
__global__ void __launch_bounds__(kSimtThreads)
    attn_bwd_dq_simt(E *dq, const E *dout, const float *lse, const float *delta, const E *q,
                     const E *k, const E *v, const int32_t *doc_start, int T, int H, int KVH, int D,
                     int stride) {
    constexpr int BQ = kSimtBQ, BK = kSimtBK, NT = kSimtThreads;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float *Qs = (float *)smem_raw, *dOs = Qs + BQ * D, *dQs = dOs + BQ * D, *Ks = dQs + BQ * D;
    float *Vs = Ks + BK * (D + 1), *dSs = Vs + BK * (D + 1), *row_lse = dSs + BQ * BK;
    float *row_delta = row_lse + BQ;
    int *row_ds = (int *)(row_delta + BQ);

    const int nqt = (T + BQ - 1) / BQ, i0 = (nqt - 1 - (int)blockIdx.x) * BQ;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH), tid = threadIdx.x;
    const float scale = 1.0f / sqrtf((float)D);
    const int32_t *ds = doc_start + (size_t)b * T;
    const size_t q_at = (size_t)b * T * stride + (size_t)h * D, hT = ((size_t)b * H + h) * T;
    const size_t kv_at = (size_t)b * T * stride + (size_t)kvh * D;

    load_rows_f32(Qs, D, q + q_at, i0, BQ, T, D, stride);
    load_rows_f32(dOs, D, dout + (size_t)b * T * H * D + (size_t)h * D, i0, BQ, T, D, H * D);
    for (int e = tid; e < BQ * D; e += NT)
        dQs[e] = 0.0f;
    load_row_stats(row_lse, row_delta, row_ds, lse + hT, delta + hT, ds, i0, T);
    const int2 kt_range = key_tiles<BQ, BK>(ds, i0, T);
    for (int kt = kt_range.x; kt < kt_range.y; kt++) {
        const int j0 = kt * BK;
        load_rows_f32(Ks, D + 1, k + kv_at, j0, BK, T, D, stride);
        load_rows_f32(Vs, D + 1, v + kv_at, j0, BK, T, D, stride);
        __syncthreads();
        for (int e = tid; e < BQ * BK; e += NT) {
            int r = e / BK, c = e % BK;
            simt_grad_entry(nullptr, dSs + e, Qs, dOs, Ks, Vs, row_lse, row_delta, row_ds, r, c,
                            i0 + r, j0 + c, D, scale);
        }
        __syncthreads();
        for (int e = tid; e < BQ * D; e += NT) {
            int r = e / D, d = e - r * D;
            float acc = dQs[e];
            for (int c = 0; c < BK; c++)
                acc = fmaf(dSs[r * BK + c], Ks[c * (D + 1) + d], acc);
            dQs[e] = acc;
        }
        __syncthreads(); // K, V, dS are rewritten by the next tile
    }
    __syncthreads(); // when no key tile ran: the zeroing above
    for (int e = tid; e < BQ * D; e += NT) {
        int r = e / D, d = e - r * D;
        if (i0 + r < T) dq[q_at + (size_t)(i0 + r) * stride + d] = from_float<E>(dQs[e]);
    }
}

// ================================================================ decoding (SIMT)
//
// attention_decode: one new query per (sequence, head) over the sequence's cached keys
// [span[b], span[B+b]). One block per (sequence, kv head, chunk of up to kDecRows of the
// group's query heads), not per (sequence, head): the query heads of a GQA group see the same
// keys and values, so each tile of the cache is read once into shared memory for all of them
// (a decode step reads the whole cache and is bound by that read, not by its few FLOPs), and
// the chunk keeps shared memory bounded for any group (a group past kDecRows heads reads the
// tiles once per chunk). Per tile of kDecBK keys, as attn_fwd_simt per key tile: scores (one
// thread per entry, fp32 FMAs in d order), online softmax (one warp per head, a lane per key),
// O = O * rescale + P V (one thread per element, keys in order). No split over the keys: every
// output element is written by one thread after sums in a fixed order, so the results are
// bitwise reproducible. 16-bit storage is widened to fp32 on loading; no tensor-core path (a
// chunk is at most 8 query rows, where an m16 tile would be at least half padding).
constexpr int kDecRows = 8, kDecBK = 32; // query heads per block; keys per tile (one per lane)

// Shared memory of attn_decode_simt, in floats: Q, O (kDecRows,D), K (BK,D+1), V (BK,D),
// S/P (kDecRows,BK), row max, sum, rescale (kDecRows each).
size_t simt_smem_decode(int D) {
    return sizeof(float) * ((size_t)kDecRows * D * 2 + (size_t)kDecBK * (2 * D + 1) +
                            kDecRows * kDecBK + 3 * kDecRows);
}

// out: (B,H,D); q: (B,H,D) of row stride q_stride; k_cache, v_cache: (B,max_len,KVH,D).
// Grid (KVH * chunks, B): block x = kvh * chunks + chunk.
template <typename E>
__global__ void __launch_bounds__(kSimtThreads)
    attn_decode_simt(E *out, const E *q, const E *k_cache, const E *v_cache, const int32_t *span,
                     int B, int H, int KVH, int D, int q_stride, int max_len) {
    constexpr int R = kDecRows, BK = kDecBK, NT = kSimtThreads;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    float *Qs = (float *)smem_raw, *Os = Qs + R * D, *Ks = Os + R * D, *Vs = Ks + BK * (D + 1);
    float *Ps = Vs + BK * D, *row_m = Ps + R * BK, *row_l = row_m + R, *row_a = row_l + R;

    const int group = H / KVH, chunks = (group + R - 1) / R, b = blockIdx.y;
    const int kvh = blockIdx.x / chunks, h0 = kvh * group + (blockIdx.x % chunks) * R;
    const int rows = min(R, (kvh + 1) * group - h0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float scale = 1.0f / sqrtf((float)D);
    // The visible keys, clamped to the cache (a malformed span reads nothing outside it).
    const int j_begin = max(span[b], 0), j_end = min(span[B + b], max_len);
    const size_t kv_stride = (size_t)KVH * D;
    const E *kb = k_cache + (size_t)b * max_len * kv_stride + (size_t)kvh * D;
    const E *vb = v_cache + (size_t)b * max_len * kv_stride + (size_t)kvh * D;

    // The chunk's query heads (rows past `rows` zero: their results are never stored).
    load_rows_f32(Qs, D, q + (size_t)b * q_stride + (size_t)h0 * D, 0, R, rows, D, D);
    for (int e = tid; e < R * D; e += NT)
        Os[e] = 0.0f;
    if (tid < R) {
        row_m[tid] = -INFINITY;
        row_l[tid] = 0.0f;
    }
    for (int j0 = j_begin; j0 < j_end; j0 += BK) {
        load_rows_f32(Ks, D + 1, kb, j0, BK, j_end, D, (int)kv_stride); // keys >= j_end: zero
        load_rows_f32(Vs, D, vb, j0, BK, j_end, D, (int)kv_stride);
        __syncthreads(); // also orders the Q/O/row initialisation before the first use
        for (int e = tid; e < R * BK; e += NT) {
            int r = e / BK, c = e % BK;
            Ps[e] = j0 + c < j_end ? dot_f32(Qs + r * D, Ks + c * (D + 1), D) * scale : -INFINITY;
        }
        __syncthreads();
        for (int r = warp; r < R; r += NT / 32) {
            float x = Ps[r * BK + lane];
            float m_old = row_m[r], m_new = fmaxf(m_old, warp_reduce(x, MaxOp()));
            float p = expf(x - m_new); // the tile's first key is visible: m_new is finite
            float sum = warp_sum(p);
            Ps[r * BK + lane] = p;
            if (lane == 0) {
                float alpha = expf(m_old - m_new); // 0 on the first tile (m_old = -inf)
                row_l[r] = row_l[r] * alpha + sum;
                row_m[r] = m_new;
                row_a[r] = alpha;
            }
        }
        __syncthreads();
        for (int e = tid; e < R * D; e += NT) {
            int r = e / D, d = e - r * D;
            float acc = Os[e] * row_a[r];
            for (int c = 0; c < BK; c++)
                acc = fmaf(Ps[r * BK + c], Vs[c * D + d], acc);
            Os[e] = acc;
        }
        __syncthreads(); // K, V, P and the row stats are rewritten by the next tile
    }
    __syncthreads(); // when no key tile ran: the initialisation above
    E *ob = out + ((size_t)b * H + h0) * D;
    for (int e = tid; e < rows * D; e += NT) {
        float l = row_l[e / D];
        ob[e] = from_float<E>(l > 0.0f ? Os[e] / l : 0.0f); // an empty span: zeros
    }
}

// ================================================================ tensor-core primitives
//
// mma.sync.m16n8k16.row.col, bf16 or fp16 in (E, 16 bits), fp32 accumulate: the .bf16 and
// .f16 variants share every fragment layout, so the primitives below serve both. A warp's lane
// l has g = l/4 (group) and t = l%4 (thread in group). Fragments (PTX ISA, "Matrix fragments
// for mma.m16n8k16"):
//   A (16x16, row major), 4 regs of 2 E:     a0: (g, 2t..2t+1)    a1: (g+8, 2t..2t+1)
//                                            a2: (g, 2t+8..2t+9)  a3: (g+8, 2t+8..2t+9)
//   B (16x8, k x n), 2 regs of 2 E:          b0: (k 2t..2t+1, n g)  b1: (k 2t+8..2t+9, n g)
//   C (16x8, fp32), 4 floats:                c0,c1: (g, 2t..2t+1)  c2,c3: (g+8, 2t..2t+1)
// The lower 16 bits of a register hold the lower column (or k). Hence the accumulators of
// two adjacent n-tiles (columns 0-7 and 8-15) ARE the A fragment of a 16x16 block:
//   a0 = pack(C0.c0, C0.c1), a1 = pack(C0.c2, C0.c3), a2 = pack(C1.c0, C1.c1),
//   a3 = pack(C1.c2, C1.c3)                                          (see a_from_acc)
// which is how P (and dS) go from one product to the next without leaving registers.
//
// Operands come from shared memory with ldmatrix (.x4: four 8x8 b16 matrices; lanes 8m..8m+7
// give the row addresses of matrix m; lane l receives of matrix m the elements (l/4, 2(l%4)
// and +1), or with .trans the elements (2(l%4) and +1, l/4)). Rows of every tile are D E
// padded to LD = D+8: a row pitch of 16 bytes mod 128, so the 8 rows of one matrix hit 8
// distinct 16-byte bank groups (no conflicts), and each row start stays 16-byte aligned.

// Whether accumulator element e of n-tile nt of a key tile at j0 is a key its row sees (in
// the row's document, not after the row): row x = e/2, key j0 + 8nt + 2tq + e%2.
__device__ __forceinline__ bool mma_sees(const int row_ds[2], const int row_i[2], int j0, int nt,
                                         int tq, int e) {
    int x = e >> 1, j = j0 + nt * 8 + 2 * tq + (e & 1);
    return row_ds[x] <= j && j <= row_i[x];
}

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

template <typename E> __device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const E *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}

template <typename E> __device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const E *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p))
                 : "memory");
}

// c (16x8) += a (16x16) * b (16x8), a and b of E.
template <typename E>
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
    static_assert(kIs16Bit<E>, "bf16 or fp16 operands");
    if constexpr (std::is_same<E, __half>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A fragment of rows [row0, row0+16) x columns [k0, k0+16) of a row-major tile (pitch ld).
// Matrices: 0 = (rows 0-7, cols 0-7) -> a0, 1 = (rows 8-15, cols 0-7) -> a1,
// 2 = (rows 0-7, cols 8-15) -> a2, 3 = (rows 8-15, cols 8-15) -> a3.
template <typename E>
__device__ __forceinline__ void load_a(uint32_t a[4], const E *tile, int ld, int row0, int k0) {
    int lane = threadIdx.x & 31;
    ldmatrix_x4(a, tile + (row0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}

// B fragments for n-tile [n0, n0+8) and the two k-steps [k0, k0+16), [k0+16, k0+32), from a
// tile stored n-major (row n holds B[., n] along k: B = tile^T, as K is for S = Q K^T).
// Matrix m = rows n0..n0+7, columns k0+8m..k0+8m+7 -> b[m]: b[0..1] is k-step k0, b[2..3]
// is k-step k0+16.
template <typename E>
__device__ __forceinline__ void load_b_nmajor(uint32_t b[4], const E *tile, int ld, int n0,
                                              int k0) {
    int lane = threadIdx.x & 31;
    ldmatrix_x4(b, tile + (n0 + (lane & 7)) * ld + k0 + (lane >> 3) * 8);
}

// B fragments for k-step [k0, k0+16) and the two n-tiles [n0, n0+8), [n0+8, n0+16), from a
// tile stored k-major (row k holds B[k, .] along n, as V is for O = P V), transposed by
// ldmatrix. Matrix m = rows k0 + 8(m&1).., columns n0 + 8(m>>1).. -> b[0..1] is n-tile n0,
// b[2..3] is n-tile n0+8.
template <typename E>
__device__ __forceinline__ void load_b_kmajor(uint32_t b[4], const E *tile, int ld, int k0,
                                              int n0) {
    int lane = threadIdx.x & 31;
    ldmatrix_x4_trans(b,
                      tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

// Two products over the same k = 0..D, as both backward kernels need them: for this warp's 16
// rows from row0, c1 (16 x 8NT) += A1 B1^T and c2 += A2 B2^T; A1, A2 row-major, B1, B2
// n-major (NT*8 rows along k), every tile of pitch ld.
template <int D, int NT, typename E>
__device__ __forceinline__ void mma_pair_nmajor(float c1[NT][4], float c2[NT][4], const E *A1,
                                                const E *A2, const E *B1, const E *B2, int ld,
                                                int row0) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {
        uint32_t a1[2][4], a2[2][4];
        load_a(a1[0], A1, ld, row0, kk * 16);
        load_a(a1[1], A1, ld, row0, kk * 16 + 16);
        load_a(a2[0], A2, ld, row0, kk * 16);
        load_a(a2[1], A2, ld, row0, kk * 16 + 16);
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            uint32_t bf[4];
            load_b_nmajor(bf, B1, ld, nt * 8, kk * 16);
            mma16816<E>(c1[nt], a1[0], bf);
            mma16816<E>(c1[nt], a1[1], bf + 2);
            load_b_nmajor(bf, B2, ld, nt * 8, kk * 16);
            mma16816<E>(c2[nt], a2[0], bf);
            mma16816<E>(c2[nt], a2[1], bf + 2);
        }
    }
}

// The A fragment (16 rows x 16 k) made of accumulator n-tiles c[2kk], c[2kk+1] (see above),
// rounded to E.
template <typename E>
__device__ __forceinline__ void a_from_acc(uint32_t a[4], const float c0[4], const float c1[4]) {
    a[0] = pack2<E>(c0[0], c0[1]);
    a[1] = pack2<E>(c0[2], c0[3]);
    a[2] = pack2<E>(c1[0], c1[1]);
    a[3] = pack2<E>(c1[2], c1[3]);
}

// c (16 x D) += A B for this warp's 16 rows: A (16 x K) is the accumulator n-tiles
// acc[0..K/8) rounded to E (P or dS), B a k-major tile (K rows of D, pitch ld).
template <int K, int D, typename E>
__device__ __forceinline__ void mma_acc_kmajor(float c[D / 8][4], const float acc[K / 8][4],
                                               const E *B, int ld) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        uint32_t a[4];
        a_from_acc<E>(a, acc[2 * kk], acc[2 * kk + 1]);
#pragma unroll
        for (int dt = 0; dt < D / 16; dt++) {
            uint32_t b[4];
            load_b_kmajor(b, B, ld, kk * 16, dt * 16);
            mma16816<E>(c[2 * dt], a, b);
            mma16816<E>(c[2 * dt + 1], a, b + 2);
        }
    }
}

// 16-byte global -> shared copy, asynchronous; zero-fills instead when !valid (src must
// still be a mapped address).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight (other
// threads' copies are visible only after a following __syncthreads).
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

constexpr int kMmaThreads = 128; // 4 warps, each owning 16 rows of the tile's M dimension

// Rows [t0, t0+R) of one head (D E, token stride `stride`) -> dst (R, D+8), async; rows
// at or past T are zero-filled (read from row 0 of src, which exists, with size 0).
template <int R, int D, typename E>
__device__ __forceinline__ void load_rows_async(E *dst, const E *src, int t0, int T, int stride) {
    constexpr int CH = D / 8; // 16-byte chunks per row
    for (int e = threadIdx.x; e < R * CH; e += kMmaThreads) {
        int r = e / CH, c = e % CH;
        bool valid = t0 + r < T;
        cp_async16(dst + r * (D + 8) + c * 8, src + (size_t)(valid ? t0 + r : 0) * stride + c * 8,
                   valid);
    }
}

// Stores row `row` (< 16, of a warp's accumulators acc: D/8 n-tiles) to dst[d], d < D:
// the thread's two columns 2t, 2t+1 of each n-tile, times `mul`, rounded to E. x = 0: rows g,
// x = 1: g+8.
template <int D, typename E>
__device__ __forceinline__ void store_acc_row(E *dst, const float (*acc)[4], int x, float mul) {
    int tq = threadIdx.x & 3;
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++)
        *reinterpret_cast<uint32_t *>(dst + dt * 8 + 2 * tq) =
            pack2<E>(acc[dt][2 * x] * mul, acc[dt][2 * x + 1] * mul);
}

// ================================================================ tensor-core kernels

constexpr int kFwdBQ = 64, kFwdBK = 64; // forward and dq: 64 queries (16 per warp) x 64 keys
constexpr int kKvBK = 64, kKvBQ = 32;   // dk/dv: 64 keys (16 per warp) x 32 queries

// Shared memory: Q (BQ,LD) + 2 stages x [K, V] (BK,LD), E.
template <typename E, int D> constexpr size_t mma_smem_fwd() {
    return sizeof(E) * (size_t)(kFwdBQ + 4 * kFwdBK) * (D + 8);
}

// The forward of attn_fwd_simt on tensor cores. Grid (query tiles, H, B), last tiles first;
// 4 warps, warp w owns query rows 16w..16w+15 of the tile, and per key tile (64 keys):
//   S (16x64, 8 n-tiles, registers) = Q K^T    Q fragments loaded once, K from shared
//   mask, scale by 1/sqrt(D) in log2 units, online softmax per row (each row's 64 entries
//   live in the 4 lanes of a quad: max and sum over the quad with xor-shuffles 1, 2)
//   O (16xD, D/8 n-tiles, registers) = O * alpha + P V    P stays in registers (a_from_acc)
// K and V tiles are double-buffered: the copy of tile kt+1 runs during the math of tile kt.
// The row sum l is kept per lane (its own 16 columns of each tile) and summed over the quad
// at the end; alpha is uniform over the quad, so that sum equals the row's sum.
template <typename E, int D>
__global__ void __launch_bounds__(kMmaThreads)
    attn_fwd_mma(E *out, float *lse, const E *q, const E *k, const E *v, const int32_t *doc_start,
                 int T, int H, int KVH, int stride) {
    static_assert(D % 32 == 0, "load_b_nmajor pairs k-steps of 16");
    constexpr int BQ = kFwdBQ, BK = kFwdBK, LD = D + 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    E *Qs = (E *)smem_raw, *KVs = Qs + BQ * LD; // stage s: K at KVs + 2s*BK*LD, V after

    const int nqt = (T + BQ - 1) / BQ, i0 = (nqt - 1 - (int)blockIdx.x) * BQ;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const float scale = 1.0f / sqrtf((float)D), c2 = scale * kLog2e;
    const int32_t *ds = doc_start + (size_t)b * T;
    const E *qb = q + (size_t)b * T * stride + (size_t)h * D;
    const E *kb = k + (size_t)b * T * stride + (size_t)kvh * D;
    const E *vb = v + (size_t)b * T * stride + (size_t)kvh * D;

    const int2 kt_range = key_tiles<BQ, BK>(ds, i0, T);
    load_rows_async<BQ, D>(Qs, qb, i0, T, stride);
    load_rows_async<BK, D>(KVs, kb, kt_range.x * BK, T, stride);
    load_rows_async<BK, D>(KVs + BK * LD, vb, kt_range.x * BK, T, stride);
    cp_async_commit();

    // This thread's rows: x = 0 -> tile row 16w+g, x = 1 -> 16w+g+8 (rows past T see nothing).
    int row_i[2], row_ds[2];
#pragma unroll
    for (int x = 0; x < 2; x++) {
        row_i[x] = i0 + warp * 16 + g + 8 * x;
        row_ds[x] = row_i[x] < T ? ds[row_i[x]] : INT_MAX;
    }
    cp_async_wait<0>();
    __syncthreads();
    uint32_t qf[D / 16][4]; // A fragments of the warp's 16 query rows, all k-steps
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        load_a(qf[kk], Qs, LD, warp * 16, kk * 16);

    float o[D / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; // m in log2 units
    for (int kt = kt_range.x; kt < kt_range.y; kt++) {
        const int stage = (kt - kt_range.x) & 1;
        if (kt + 1 < kt_range.y) { // prefetch tile kt+1 into the other stage
            E *next = KVs + (stage ^ 1) * 2 * BK * LD;
            load_rows_async<BK, D>(next, kb, (kt + 1) * BK, T, stride);
            load_rows_async<BK, D>(next + BK * LD, vb, (kt + 1) * BK, T, stride);
            cp_async_commit();
            cp_async_wait<1>(); // tile kt has landed (this thread's part)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); // ... and everyone's
        const E *Kt = KVs + stage * 2 * BK * LD, *Vt = Kt + BK * LD;

        float s[BK / 8][4] = {}; // S = Q K^T: n-tile nt holds keys 8nt..8nt+7 of the tile
#pragma unroll
        for (int nt = 0; nt < BK / 8; nt++)
#pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                uint32_t bk[4];
                load_b_nmajor(bk, Kt, LD, nt * 8, kk * 16);
                mma16816<E>(s[nt], qf[kk], bk);
                mma16816<E>(s[nt], qf[kk + 1], bk + 2);
            }

        // Mask and scale; element e of n-tile nt: row x = e/2, key j0 + 8nt + 2t + e%2.
        const int j0 = kt * BK;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < BK / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int x = e >> 1;
                s[nt][e] = mma_sees(row_ds, row_i, j0, nt, tq, e) ? s[nt][e] * c2 : -INFINITY;
                mx[x] = fmaxf(mx[x], s[nt][e]);
            }
        float base[2], alpha[2];
#pragma unroll
        for (int x = 0; x < 2; x++) {
            mx[x] = fmaxf(mx[x], __shfl_xor_sync(0xffffffffu, mx[x], 1));
            mx[x] = fmaxf(mx[x], __shfl_xor_sync(0xffffffffu, mx[x], 2));
            float m_new = fmaxf(m[x], mx[x]);
            base[x] = m_new == -INFINITY ? 0.0f : m_new; // a row that has seen nothing yet
            alpha[x] = exp2f(m[x] - base[x]);            // 0 on the first visible tile
            m[x] = m_new;
            l[x] *= alpha[x];
        }
#pragma unroll
        for (int nt = 0; nt < BK / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[nt][e] = exp2f(s[nt][e] - base[e >> 1]); // masked: 0
                l[e >> 1] += s[nt][e];
            }
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[dt][e] *= alpha[e >> 1];

        // O += P V: k-step kk covers keys 16kk..16kk+15 = n-tiles 2kk, 2kk+1 of S.
        mma_acc_kmajor<BK, D>(o, s, Vt, LD);
        __syncthreads(); // this stage is refilled two tiles later
    }

#pragma unroll
    for (int x = 0; x < 2; x++) {
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 1);
        l[x] += __shfl_xor_sync(0xffffffffu, l[x], 2);
        int i = row_i[x];
        if (i < T) {
            store_acc_row<D>(out + ((size_t)b * T + i) * H * D + (size_t)h * D, o, x,
                             l[x] > 0.0f ? 1.0f / l[x] : 0.0f);
            if (tq == 0) lse[((size_t)b * H + h) * T + i] = (m[x] + log2f(l[x])) * kLn2;
        }
    }
}

// Shared memory: Q, dO (BQ,LD) + 2 stages x [K, V] (BK,LD), E.
template <typename E, int D> constexpr size_t mma_smem_dq() {
    return sizeof(E) * (size_t)(2 * kFwdBQ + 4 * kFwdBK) * (D + 8);
}

// dq on tensor cores: attn_bwd_dq_simt's schedule with the forward's tiles. Warp w owns
// query rows 16w..16w+15; per key tile: S = Q K^T and dP = dO V^T (registers, Q and dO
// fragments reloaded from shared memory), p = exp2(S*c - lse*log2e), dS = p (dP - delta)
// scale, dQ += dS K (dS through a_from_acc, K transposed by ldmatrix).
template <typename E, int D>
__global__ void __launch_bounds__(kMmaThreads)
    attn_bwd_dq_mma(E *dq, const E *dout, const float *lse, const float *delta, const E *q,
                    const E *k, const E *v, const int32_t *doc_start, int T, int H, int KVH,
                    int stride) {
    static_assert(D % 32 == 0, "load_b_nmajor pairs k-steps of 16");
    constexpr int BQ = kFwdBQ, BK = kFwdBK, LD = D + 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    E *Qs = (E *)smem_raw, *dOs = Qs + BQ * LD, *KVs = dOs + BQ * LD;

    const int nqt = (T + BQ - 1) / BQ, i0 = (nqt - 1 - (int)blockIdx.x) * BQ;
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const float scale = 1.0f / sqrtf((float)D), c2 = scale * kLog2e;
    const int32_t *ds = doc_start + (size_t)b * T;
    const size_t hT = ((size_t)b * H + h) * T;
    E *dqb = dq + (size_t)b * T * stride + (size_t)h * D;
    const E *qb = q + (size_t)b * T * stride + (size_t)h * D;
    const E *kb = k + (size_t)b * T * stride + (size_t)kvh * D;
    const E *vb = v + (size_t)b * T * stride + (size_t)kvh * D;

    const int2 kt_range = key_tiles<BQ, BK>(ds, i0, T);
    load_rows_async<BQ, D>(Qs, qb, i0, T, stride);
    load_rows_async<BQ, D>(dOs, dout + (size_t)b * T * H * D + (size_t)h * D, i0, T, H * D);
    load_rows_async<BK, D>(KVs, kb, kt_range.x * BK, T, stride);
    load_rows_async<BK, D>(KVs + BK * LD, vb, kt_range.x * BK, T, stride);
    cp_async_commit();

    int row_i[2], row_ds[2];
    float row_lse2[2], row_delta[2]; // lse in log2 units
#pragma unroll
    for (int x = 0; x < 2; x++) {
        int i = row_i[x] = i0 + warp * 16 + g + 8 * x;
        row_ds[x] = i < T ? ds[i] : INT_MAX;
        row_lse2[x] = i < T ? lse[hT + i] * kLog2e : 0.0f;
        row_delta[x] = i < T ? delta[hT + i] : 0.0f;
    }

    float dqa[D / 8][4] = {};
    for (int kt = kt_range.x; kt < kt_range.y; kt++) {
        const int stage = (kt - kt_range.x) & 1;
        if (kt + 1 < kt_range.y) {
            E *next = KVs + (stage ^ 1) * 2 * BK * LD;
            load_rows_async<BK, D>(next, kb, (kt + 1) * BK, T, stride);
            load_rows_async<BK, D>(next + BK * LD, vb, (kt + 1) * BK, T, stride);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const E *Kt = KVs + stage * 2 * BK * LD, *Vt = Kt + BK * LD;

        float s[BK / 8][4] = {}, dp[BK / 8][4] = {};
        mma_pair_nmajor<D, BK / 8>(s, dp, Qs, dOs, Kt, Vt, LD, warp * 16); // S = Q K^T, dP = dO V^T

        const int j0 = kt * BK;
#pragma unroll
        for (int nt = 0; nt < BK / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int x = e >> 1;
                bool vis = mma_sees(row_ds, row_i, j0, nt, tq, e);
                float p = vis ? exp2f(s[nt][e] * c2 - row_lse2[x]) : 0.0f;
                s[nt][e] = vis ? p * (dp[nt][e] - row_delta[x]) * scale : 0.0f; // dS
            }

        mma_acc_kmajor<BK, D>(dqa, s, Kt, LD);
        __syncthreads();
    }
    cp_async_wait<0>(); // nothing in flight at exit, even when no key tile ran

#pragma unroll
    for (int x = 0; x < 2; x++)
        if (row_i[x] < T) store_acc_row<D>(dqb + (size_t)row_i[x] * stride, dqa, x, 1.0f);
}

// Shared memory: K, V (BK,LD) + 2 stages x [Q, dO] (BQ,LD) E, + 2 stages x [lse, delta,
// doc_start] (BQ) 4-byte values.
template <typename E, int D> constexpr size_t mma_smem_dkdv() {
    return sizeof(E) * (size_t)(2 * kKvBK + 4 * kKvBQ) * (D + 8) + 4 * 2 * 3 * kKvBQ;
}

// dk, dv on tensor cores: attn_bwd_dkdv_simt's schedule. Warp w owns key rows 16w..16w+15
// of the tile and computes everything transposed, keys as rows: per (query tile, head),
//   S^T = K Q^T, dP^T = V dO^T (16x32 each; K, V fragments from shared memory)
//   P^T = exp2(S^T c - lse2[i]), dS^T = P^T (dP^T - delta[i]) scale (per column i)
//   dV += P^T dO, dK += dS^T Q (P^T, dS^T through a_from_acc; dO, Q transposed by ldmatrix)
// The (query tile, head) items are double-buffered: Q, dO and the rows' lse, delta and
// doc_start of the next item load during the math of this one.
template <typename E, int D>
__global__ void __launch_bounds__(kMmaThreads)
    attn_bwd_dkdv_mma(E *dk, E *dv, const E *dout, const float *lse, const float *delta, const E *q,
                      const E *k, const E *v, const int32_t *doc_start, int T, int H, int KVH,
                      int stride) {
    static_assert(D % 32 == 0, "load_b_nmajor pairs k-steps of 16");
    constexpr int BK = kKvBK, BQ = kKvBQ, LD = D + 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    E *Ks = (E *)smem_raw, *Vs = Ks + BK * LD;
    E *QdO = Vs + BK * LD;                      // stage s: Q at QdO + 2s*BQ*LD, dO after
    float *rows = (float *)(QdO + 4 * BQ * LD); // stage s: lse, delta, doc_start at 3s*BQ

    const int j0 = blockIdx.x * BK, j_end = min(j0 + BK, T), kvh = blockIdx.y, b = blockIdx.z;
    const int group = H / KVH, h_first = kvh * group, nqt = (T + BQ - 1) / BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const float scale = 1.0f / sqrtf((float)D), c2 = scale * kLog2e;
    const int32_t *ds = doc_start + (size_t)b * T;
    const size_t kv_at = (size_t)b * T * stride + (size_t)kvh * D;

    // Item (qt, h) -> stage st: Q, dO rows and the per-row values (rows past T: zeros, and
    // hidden by the i < T test below).
    auto load_item = [&](int st, int qt, int h) {
        const int i0 = qt * BQ;
        E *Qt = QdO + st * 2 * BQ * LD;
        load_rows_async<BQ, D>(Qt, q + (size_t)b * T * stride + (size_t)h * D, i0, T, stride);
        load_rows_async<BQ, D>(Qt + BQ * LD, dout + (size_t)b * T * H * D + (size_t)h * D, i0, T,
                               H * D);
        int r = threadIdx.x, i = i0 + r;
        if (r < BQ) {
            const size_t at = ((size_t)b * H + h) * T + (i < T ? i : 0);
            float *rs = rows + st * 3 * BQ;
            cp_async4(rs + r, lse + at, i < T);
            cp_async4(rs + BQ + r, delta + at, i < T);
            cp_async4(rs + 2 * BQ + r, ds + (i < T ? i : 0), i < T);
        }
    };

    load_rows_async<BK, D>(Ks, k + kv_at, j0, T, stride);
    load_rows_async<BK, D>(Vs, v + kv_at, j0, T, stride);
    int qt = next_q_tile<BQ>(ds, j0 / BQ, nqt, T, j0, j_end), h = h_first;
    if (qt < nqt) load_item(0, qt, h);
    cp_async_commit();

    int key_j[2]; // this thread's key rows: x = 0 -> 16w+g, x = 1 -> 16w+g+8
#pragma unroll
    for (int x = 0; x < 2; x++)
        key_j[x] = j0 + warp * 16 + g + 8 * x;

    float dka[D / 8][4] = {}, dva[D / 8][4] = {};
    for (int stage = 0; qt < nqt; stage ^= 1) {
        int next_h = h + 1, next_qt = qt; // heads of the group inner, query tiles outer
        if (next_h == h_first + group) {
            next_h = h_first;
            next_qt = next_q_tile<BQ>(ds, qt + 1, nqt, T, j0, j_end);
        }
        if (next_qt < nqt) {
            load_item(stage ^ 1, next_qt, next_h);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int i0 = qt * BQ;
        const E *Qt = QdO + stage * 2 * BQ * LD, *dOt = Qt + BQ * LD;
        const float *r_lse = rows + stage * 3 * BQ, *r_delta = r_lse + BQ;
        const int *r_ds = (const int *)(r_delta + BQ);

        float st[BQ / 8][4] = {}, dpt[BQ / 8][4] = {}; // n-tile nt: queries 8nt..8nt+7
        mma_pair_nmajor<D, BQ / 8>(st, dpt, Ks, Vs, Qt, dOt, LD, warp * 16); // S^T, dP^T

        // Element e of n-tile nt: key row x = e/2, query column 8nt + 2t + e%2.
#pragma unroll
        for (int nt = 0; nt < BQ / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int x = e >> 1, col = nt * 8 + 2 * tq + (e & 1), i = i0 + col, j = key_j[x];
                bool vis = i < T && r_ds[col] <= j && j <= i;
                float p = vis ? exp2f(st[nt][e] * c2 - r_lse[col] * kLog2e) : 0.0f;
                dpt[nt][e] = vis ? p * (dpt[nt][e] - r_delta[col]) * scale : 0.0f; // dS^T
                st[nt][e] = p;                                                     // P^T
            }

        // k-step kq covers queries 16kq..16kq+15 = n-tiles 2kq, 2kq+1.
        mma_acc_kmajor<BQ, D>(dva, st, dOt, LD); // dV += P^T dO
        mma_acc_kmajor<BQ, D>(dka, dpt, Qt, LD); // dK += dS^T Q
        __syncthreads(); // this stage is refilled by the next item's prefetch
        qt = next_qt;
        h = next_h;
    }
    cp_async_wait<0>(); // nothing in flight at exit, even when no item ran

#pragma unroll
    for (int x = 0; x < 2; x++)
        if (key_j[x] < T) {
            const size_t at = kv_at + (size_t)key_j[x] * stride;
            store_acc_row<D>(dk + at, dka, x, 1.0f);
            store_acc_row<D>(dv + at, dva, x, 1.0f);
        }
}

// ================================================================ host side

// Shapes every kernel relies on: grid limits, whole GQA groups, head_dim within the SIMT
// kernels' shared memory. Another is the backend's failure (recorded; the op is skipped).
bool shape_ok(const char *op, int B, int T, int H, int KVH, int D) {
    if (D < 1 || D > kMaxHeadDim) {
        first_failure_record(&cuda_failures, "cuda backend: %s: head_dim %d unsupported (1..%d)",
                             op, D, kMaxHeadDim);
        return false;
    }
    if (KVH < 1 || H < KVH || H % KVH || H > 65535 || B > 65535 || T < 0) {
        first_failure_record(&cuda_failures,
                             "cuda backend: %s: unsupported shape B=%d T=%d H=%d KVH=%d", op, B, T,
                             H, KVH);
        return false;
    }
    return true;
}

// Launches with `smem` bytes of dynamic shared memory (above 48 KiB needs the opt-in).
template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, int threads, size_t smem, Args... args) {
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<grid, threads, smem, cu_stream()>>>(args...);
    CUDA_CHECK(cudaGetLastError());
}

// The tensor-core kernels: bf16 or fp16, head_dim 64 or 128, 16-byte aligned rows and heads.
// NULL when they apply, else why the SIMT ones run instead.
template <typename E>
const char *mma_refused(int D, int stride, std::initializer_list<const void *> ptrs) {
    if constexpr (!kIs16Bit<E>) {
        return "fp32 storage";
    } else {
        if (D != 64 && D != 128) return "head_dim not 64 or 128";
        if (stride % 8) return "token stride not a multiple of 8 elements";
        for (const void *p : ptrs)
            if (!cu_aligned16(p)) return "a tensor not 16-byte aligned";
        return NULL;
    }
}

const char *last_kernels = "none"; // cuda_attention_kernels()

// Records the kernels this op runs. A bf16 or fp16 op that cannot use the tensor cores is a
// silent slow path: said once per reason and dtype (fp32 has no tensor-core kernels, so it is
// no fallback).
template <typename E>
bool use_mma(const char *op, int D, int stride, std::initializer_list<const void *> ptrs) {
    const char *why = mma_refused<E>(D, stride, ptrs);
    last_kernels = why ? "simt" : "tensor-core";
    if (why && kIs16Bit<E>) {
        static const char *said[4]; // the reasons logged (mma_refused's literals)
        int n = 0;
        while (n < 4 && said[n] && said[n] != why)
            n++;
        if (n < 4 && !said[n]) {
            said[n] = why;
            fprintf(stderr,
                    "astrai: CUDA attention: %s runs the SIMT kernels, not the tensor cores (%s: "
                    "head_dim %d, token stride %d)\n",
                    op, why, D, stride);
        }
    }
    return !why;
}

template <typename E, int D>
void fwd_mma(E *out, float *lse, const E *q, const E *k, const E *v, const int32_t *doc_start,
             int B, int T, int H, int KVH, int stride) {
    dim3 grid(cu_ceil_div(T, kFwdBQ), H, B);
    launch(attn_fwd_mma<E, D>, grid, kMmaThreads, mma_smem_fwd<E, D>(), out, lse, q, k, v,
           doc_start, T, H, KVH, stride);
}

template <typename E>
void attention_fwd(E *out, float *lse, const E *q, const E *k, const E *v, const int32_t *doc_start,
                   int B, int T, int H, int KVH, int D, int stride) {
    if (!shape_ok("attention_fwd", B, T, H, KVH, D) || B <= 0 || T <= 0) return;
    if (use_mma<E>("attention_fwd", D, stride, {out, q, k, v})) {
        if constexpr (kIs16Bit<E>) {
            if (D == 64)
                fwd_mma<E, 64>(out, lse, q, k, v, doc_start, B, T, H, KVH, stride);
            else
                fwd_mma<E, 128>(out, lse, q, k, v, doc_start, B, T, H, KVH, stride);
        }
        return;
    }
    dim3 grid(cu_ceil_div(T, kSimtBQ), H, B);
    launch(attn_fwd_simt<E>, grid, kSimtThreads, simt_smem_fwd(D), out, lse, q, k, v, doc_start, T,
           H, KVH, D, stride);
}

// The dk/dv and dq kernels of one chunk of batch rows (pointers already offset to it).
template <typename E, int D>
void bwd_mma(E *dq, E *dk, E *dv, const E *dout, const float *lse, const float *delta, const E *q,
             const E *k, const E *v, const int32_t *doc_start, int B, int T, int H, int KVH,
             int stride) {
    launch(attn_bwd_dkdv_mma<E, D>, dim3(cu_ceil_div(T, kKvBK), KVH, B), kMmaThreads,
           mma_smem_dkdv<E, D>(), dk, dv, dout, lse, delta, q, k, v, doc_start, T, H, KVH, stride);
    launch(attn_bwd_dq_mma<E, D>, dim3(cu_ceil_div(T, kFwdBQ), H, B), kMmaThreads,
           mma_smem_dq<E, D>(), dq, dout, lse, delta, q, k, v, doc_start, T, H, KVH, stride);
}

// delta lives in cuda_scratch: (B,H,T) floats. When that exceeds CUDA_SCRATCH_BYTES the
// batch is processed in chunks of whole batch rows (rows are independent, so the results do
// not depend on the chunking); only one batch row over the limit (H*T > 16M) is refused.
template <typename E>
void attention_bwd(E *dq, E *dk, E *dv, const E *dout, const E *out, const float *lse, const E *q,
                   const E *k, const E *v, const int32_t *doc_start, int B, int T, int H, int KVH,
                   int D, int stride) {
    if (!shape_ok("attention_bwd", B, T, H, KVH, D) || B <= 0 || T <= 0) return;
    const size_t row_bytes = (size_t)H * T * sizeof(float);
    if (row_bytes > CUDA_SCRATCH_BYTES) {
        first_failure_record(
            &cuda_failures,
            "cuda backend: attention_bwd: H*T = %d above the scratch buffer (16M floats)", H * T);
        return;
    }
    const int chunk =
        (int)(CUDA_SCRATCH_BYTES / row_bytes < (size_t)B ? CUDA_SCRATCH_BYTES / row_bytes
                                                         : (size_t)B);
    float *delta = (float *)cuda_scratch((size_t)chunk * row_bytes);
    if (!delta) return; // recorded (engine/backend.h's failure rule)
    const bool mma = use_mma<E>("attention_bwd", D, stride, {dq, dk, dv, dout, out, q, k, v});
    for (int b0 = 0; b0 < B; b0 += chunk) {
        const int nb = B - b0 < chunk ? B - b0 : chunk;
        const size_t qkv_off = (size_t)b0 * T * stride, o_off = (size_t)b0 * T * H * D;
        const float *lse_b = lse + (size_t)b0 * H * T;
        const int32_t *ds_b = doc_start + (size_t)b0 * T;
        const size_t rows = (size_t)nb * T * H;
        attn_delta<E><<<cu_ceil_div(rows, 8), 256, 0, cu_stream()>>>(delta, dout + o_off,
                                                                     out + o_off, nb, T, H, D);
        CUDA_CHECK(cudaGetLastError());
        if (mma) {
            if constexpr (kIs16Bit<E>) {
                if (D == 64)
                    bwd_mma<E, 64>(dq + qkv_off, dk + qkv_off, dv + qkv_off, dout + o_off, lse_b,
                                   delta, q + qkv_off, k + qkv_off, v + qkv_off, ds_b, nb, T, H,
                                   KVH, stride);
                else
                    bwd_mma<E, 128>(dq + qkv_off, dk + qkv_off, dv + qkv_off, dout + o_off, lse_b,
                                    delta, q + qkv_off, k + qkv_off, v + qkv_off, ds_b, nb, T, H,
                                    KVH, stride);
            }
            continue;
        }
        launch(attn_bwd_dkdv_simt<E>, dim3(cu_ceil_div(T, kSimtBK), KVH, nb), kSimtThreads,
               simt_smem_dkdv(D), dk + qkv_off, dv + qkv_off, dout + o_off, lse_b,
               (const float *)delta, q + qkv_off, k + qkv_off, v + qkv_off, ds_b, T, H, KVH, D,
               stride);
        launch(attn_bwd_dq_simt<E>, dim3(cu_ceil_div(T, kSimtBQ), H, nb), kSimtThreads,
               simt_smem_dq(D), dq + qkv_off, dout + o_off, lse_b, (const float *)delta,
               q + qkv_off, k + qkv_off, v + qkv_off, ds_b, T, H, KVH, D, stride);
    }
}

// One launch; the SIMT kernel in every dtype (see attn_decode_simt).
template <typename E>
void attention_decode(E *out, const E *q, const E *k_cache, const E *v_cache, const int32_t *span,
                      int B, int H, int KVH, int D, int q_stride, int max_len) {
    if (!shape_ok("attention_decode", B, max_len, H, KVH, D) || B <= 0 || max_len <= 0) return;
    last_kernels = "simt";
    const int chunks = cu_ceil_div(H / KVH, kDecRows);
    launch(attn_decode_simt<E>, dim3(KVH * chunks, B), kSimtThreads, simt_smem_decode(D), out, q,
           k_cache, v_cache, span, B, H, KVH, D, q_stride, max_len);
}

} // namespace

#define ATTENTION_OPS(S, E)                                                                        \
    void cuda_attention_fwd_##S(void *out, float *lse, const void *q, const void *k,               \
                                const void *v, const int32_t *doc_start, int B, int T, int H,      \
                                int KVH, int D, int qkv_stride) {                                  \
        attention_fwd<E>((E *)out, lse, (const E *)q, (const E *)k, (const E *)v, doc_start, B, T, \
                         H, KVH, D, qkv_stride);                                                   \
    }                                                                                              \
    void cuda_attention_bwd_##S(void *dq, void *dk, void *dv, const void *dout, const void *out,   \
                                const float *lse, const void *q, const void *k, const void *v,     \
                                const int32_t *doc_start, int B, int T, int H, int KVH, int D,     \
                                int qkv_stride) {                                                  \
        attention_bwd<E>((E *)dq, (E *)dk, (E *)dv, (const E *)dout, (const E *)out, lse,          \
                         (const E *)q, (const E *)k, (const E *)v, doc_start, B, T, H, KVH, D,     \
                         qkv_stride);                                                              \
    }                                                                                              \
    void cuda_attention_decode_##S(void *out, const void *q, const void *k_cache,                  \
                                   const void *v_cache, const int32_t *span, int B, int H,         \
                                   int KVH, int D, int q_stride, int max_len) {                    \
        attention_decode<E>((E *)out, (const E *)q, (const E *)k_cache, (const E *)v_cache, span,  \
                            B, H, KVH, D, q_stride, max_len);                                      \
    }

ATTENTION_OPS(f32, float)
ATTENTION_OPS(bf16, __nv_bfloat16)
ATTENTION_OPS(f16, __half)

const char *cuda_attention_kernels(void) {
    return last_kernels;
}
