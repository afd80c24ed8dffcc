// attention.c: causal GQA attention with document masks, flash-attention style (CPU).
//
// Forward walks each query row's visible keys in blocks of KEY_BLOCK with an online
// softmax (running max m and sum l, the output rescaled as m grows) and keeps only the
// row's logsumexp; no (T,T) score matrix exists. Backward recomputes the probabilities
// p = exp(s - lse) from that logsumexp.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_kernels.h"

enum { KEY_BLOCK = 64 };

static inline float dot(const float *a, const float *b, int D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; d++)
        s += a[d] * b[d];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int D) {
#pragma omp simd
    for (int d = 0; d < D; d++)
        y[d] += a * x[d];
}

// Visible keys of query i: [first, i].
static inline int first_key(const int32_t *doc_start, int b, int T, int i) {
    return doc_start ? doc_start[(size_t)b * T + i] : 0;
}

// One query row: o: (D) = softmax(scale * q.K^T) V over keys [j_begin, j_end); returns lse.
static float attend_row(float *o, const float *qi, const float *k, const float *v, int j_begin,
                        int j_end, int D, int stride, float scale) {
    float m = -INFINITY, l = 0.0f, s[KEY_BLOCK];
    memset(o, 0, (size_t)D * sizeof *o);
    for (int j0 = j_begin; j0 < j_end; j0 += KEY_BLOCK) {
        int nb = j_end - j0 < KEY_BLOCK ? j_end - j0 : KEY_BLOCK;
        float block_max = -INFINITY;
        for (int jj = 0; jj < nb; jj++) {
            s[jj] = scale * dot(qi, k + (size_t)(j0 + jj) * stride, D);
            block_max = s[jj] > block_max ? s[jj] : block_max;
        }
        float m_new = m > block_max ? m : block_max;
        float correction = cpu_expf(m - m_new); // 0 on the first block (m = -inf)
        l *= correction;
#pragma omp simd
        for (int d = 0; d < D; d++)
            o[d] *= correction;
        for (int jj = 0; jj < nb; jj++) {
            float p = cpu_expf(s[jj] - m_new);
            l += p;
            axpy(o, p, v + (size_t)(j0 + jj) * stride, D);
        }
        m = m_new;
    }
    float inv = 1.0f / l;
#pragma omp simd
    for (int d = 0; d < D; d++)
        o[d] *= inv;
    return m + logf(l);
}

void cpu_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                       const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                       int qkv_stride) {
    int group = H / KVH;
    float scale = 1.0f / sqrtf((float)D);
#pragma omp parallel for collapse(3) schedule(dynamic, 8)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                size_t row = (size_t)b * T + i,
                       kv_at = (size_t)b * T * qkv_stride + (size_t)(h / group) * D;
                lse[((size_t)b * H + h) * T + i] = attend_row(
                    out + (row * H + h) * D, q + row * qkv_stride + (size_t)h * D, k + kv_at,
                    v + kv_at, first_key(doc_start, b, T, i), i + 1, D, qkv_stride, scale);
            }
}

// dst: (D, T) = the T rows of src (token stride `stride`) transposed, so that the scores
// of one query against consecutive keys vectorise over keys without horizontal sums.
static void transpose_rows(float *dst, const float *src, int T, int D, int stride) {
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++)
            dst[(size_t)d * T + t] = src[(size_t)t * stride + d];
}

// out[j] = sum_d x[d] * mt[d][j] for j in [j0, j1); mt: (D, T).
static void row_times_transposed(float *out, const float *x, const float *mt, int j0, int j1, int D,
                                 int T) {
    memset(out + j0, 0, (size_t)(j1 - j0) * sizeof *out);
    for (int d = 0; d < D; d++) {
        const float *col = mt + (size_t)d * T;
        float xd = x[d];
#pragma omp simd
        for (int j = j0; j < j1; j++)
            out[j] += xd * col[j];
    }
}

// Gradients of the query heads sharing kv head `kvh` of batch row b; the only writer
// of dk/dv of that kv head, so tasks (b, kvh) run in parallel without races.
// scratch: 2*D*T + 2*T floats (k and v transposed; p and ds of one query row).
static void attention_bwd_kv_head(float *dq, float *dk, float *dv, const float *dout,
                                  const float *out, const float *lse, const float *q,
                                  const float *k, const float *v, const int32_t *doc_start, int b,
                                  int kvh, int T, int H, int KVH, int D, int stride,
                                  float *scratch) {
    int group = H / KVH;
    float scale = 1.0f / sqrtf((float)D);
    size_t kv_at = (size_t)b * T * stride + (size_t)kvh * D;
    float *kt = scratch, *vt = kt + (size_t)D * T, *p = vt + (size_t)D * T, *ds = p + T;
    transpose_rows(kt, k + kv_at, T, D, stride);
    transpose_rows(vt, v + kv_at, T, D, stride);
    for (int t = 0; t < T; t++) {
        memset(dk + kv_at + (size_t)t * stride, 0, (size_t)D * sizeof *dk);
        memset(dv + kv_at + (size_t)t * stride, 0, (size_t)D * sizeof *dv);
    }
    for (int h = kvh * group; h < (kvh + 1) * group; h++)
        for (int i = 0; i < T; i++) {
            size_t row = (size_t)b * T + i;
            const float *qi = q + row * stride + (size_t)h * D;
            const float *doi = dout + (row * H + h) * D;
            float *dqi = dq + row * stride + (size_t)h * D;
            float row_lse = lse[((size_t)b * H + h) * T + i];
            float delta = dot(doi, out + (row * H + h) * D, D); // sum_j p_j dp_j
            int j0 = first_key(doc_start, b, T, i);
            row_times_transposed(p, qi, kt, j0, i + 1, D, T);   // scores
            row_times_transposed(ds, doi, vt, j0, i + 1, D, T); // dp
#pragma omp simd
            for (int j = j0; j <= i; j++) {
                p[j] = cpu_expf(scale * p[j] - row_lse);
                ds[j] = p[j] * (ds[j] - delta) * scale;
            }
            memset(dqi, 0, (size_t)D * sizeof *dqi);
            for (int j = j0; j <= i; j++) {
                size_t at = kv_at + (size_t)j * stride;
                axpy(dqi, ds[j], k + at, D);
                axpy(dk + at, ds[j], qi, D);
                axpy(dv + at, p[j], doi, D);
            }
        }
}

void cpu_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out,
                       const float *lse, const float *q, const float *k, const float *v,
                       const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                       int qkv_stride) {
#pragma omp parallel
    {
        // A few KiB per thread; running out here leaves no way to compute the gradient.
        float *scratch = malloc(((size_t)2 * D * T + 2 * (size_t)T) * sizeof *scratch);
        if (!scratch) {
            fprintf(stderr, "attention_bwd: out of memory for %d tokens\n", T);
            abort();
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int kvh = 0; kvh < KVH; kvh++)
                attention_bwd_kv_head(dq, dk, dv, dout, out, lse, q, k, v, doc_start, b, kvh, T, H,
                                      KVH, D, qkv_stride, scratch);
        free(scratch);
    }
}
