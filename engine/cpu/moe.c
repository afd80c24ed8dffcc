// moe.c: DeepSeekMoE's routing and the combination of its experts' outputs (docs/design.md §7a),
// and the strided row copy of MLA (CPU). Shapes: engine/backend.h.
//
// The router's probabilities are rounded to the compute dtype before the top-k (AstrAI casts
// the fp32 softmax back to x.dtype), so a reduced dtype passes its DType to the fp32 kernels
// here (lowp_table.h) instead of staging the rounding in a wrapper.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/topk.h"

void cpu_copy_rows_bytes(void *dst, size_t dst_stride, const void *src, size_t src_stride, int rows,
                         size_t row_bytes) {
#pragma omp parallel for
    for (int r = 0; r < rows; r++)
        memcpy((char *)dst + (size_t)r * dst_stride, (const char *)src + (size_t)r * src_stride,
               row_bytes);
}

void cpu_copy_rows(void *dst, int dst_stride, const void *src, int src_stride, int rows, int cols) {
    size_t f = sizeof(float);
    cpu_copy_rows_bytes(dst, (size_t)dst_stride * f, src, (size_t)src_stride * f, rows,
                        (size_t)cols * f);
}

// x rounded to dtype and back (fp32: x).
static float round_to(DType dtype, float x) {
    if (dtype == DT_BF16) return bf16_to_f32(f32_to_bf16(x));
    if (dtype == DT_F16) return f16_to_f32(f32_to_f16(x));
    return x;
}

// Token n: probs = rounded softmax of its logits; its k experts (torch.topk's choice) by
// ascending index, with their renormalised weights.
static void route_token(float *probs, float *weight, int32_t *expert, const float *logits, int E,
                        int k, DType dtype, TopkPair *scratch, int32_t *chosen) {
    float max = logits[0];
    for (int e = 1; e < E; e++)
        max = logits[e] > max ? logits[e] : max;
    float sum = 0.0f;
    for (int e = 0; e < E; e++)
        sum += probs[e] = expf(logits[e] - max);
    for (int e = 0; e < E; e++)
        probs[e] = round_to(dtype, probs[e] / sum);
    topk_torch_cpu(probs, E, k, scratch, chosen);
    float total = 0.0f; // in torch.topk's order, as AstrAI's topk_weights.sum()
    for (int j = 0; j < k; j++)
        total += probs[chosen[j]];
    topk_by_index(chosen, k);
    for (int j = 0; j < k; j++) {
        expert[j] = chosen[j];
        weight[j] = round_to(dtype, probs[chosen[j]] / total);
    }
}

// The (token, choice) pairs grouped by expert, token order within each (a counting sort).
static void group_pairs(int32_t *counts, int32_t *token_of, int32_t *slot, const int32_t *expert,
                        int N, int E, int k) {
    memset(counts, 0, (size_t)E * sizeof *counts);
    for (size_t p = 0; p < (size_t)N * k; p++)
        counts[expert[p]]++;
    int32_t *next = malloc((size_t)E * sizeof *next);
    if (!next) {
        first_failure_record(&cpu_failures,
                             "cpu backend: moe_route: out of memory for %d expert offsets", E);
        return;
    }
    for (int e = 0, at = 0; e < E; e++) {
        next[e] = at;
        at += counts[e];
    }
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            int32_t p = next[expert[(size_t)n * k + j]]++;
            token_of[p] = n;
            slot[(size_t)n * k + j] = p;
        }
    free(next);
}

void cpu_moe_route_dtype(DType dtype, float *probs, float *weight, int32_t *expert, int32_t *counts,
                         int32_t *token_of, int32_t *slot, const float *logits, int N, int E,
                         int k) {
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        TopkPair *scratch = malloc((size_t)E * sizeof *scratch);
        int32_t *chosen = malloc((size_t)k * sizeof *chosen);
        failed = !scratch || !chosen;
#pragma omp for
        for (int n = 0; n < N; n++)
            if (!failed)
                route_token(probs + (size_t)n * E, weight + (size_t)n * k, expert + (size_t)n * k,
                            logits + (size_t)n * E, E, k, dtype, scratch, chosen);
        free(scratch);
        free(chosen);
    }
    if (failed) {
        first_failure_record(
            &cpu_failures, "cpu backend: moe_route: out of memory for the top-k of %d experts", E);
        return;
    }
    group_pairs(counts, token_of, slot, expert, N, E, k);
}

void cpu_moe_route(float *probs, float *weight, int32_t *expert, int32_t *counts, int32_t *token_of,
                   int32_t *slot, const void *logits, int N, int E, int k) {
    cpu_moe_route_dtype(DT_F32, probs, weight, expert, counts, token_of, slot, logits, N, E, k);
}

// w_j = p_j / s over the chosen experts (s their sum): dp_j = (dw_j - sum_i dw_i w_i) / s; then
// the softmax: dlogit_e = p_e (dp_e - sum_j dp_j p_j), dp_e = 0 off the chosen ones.
void cpu_moe_route_bwd(void *dlogits_, const float *dweight, const float *probs,
                       const int32_t *expert, int N, int E, int k) {
    float *dlogits = dlogits_;
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float *p = probs + (size_t)n * E, *dw = dweight + (size_t)n * k;
        const int32_t *ex = expert + (size_t)n * k;
        float s = 0.0f, dot_w = 0.0f;
        for (int j = 0; j < k; j++)
            s += p[ex[j]];
        for (int j = 0; j < k; j++)
            dot_w += dw[j] * (p[ex[j]] / s);
        float dot_p = 0.0f;
        for (int j = 0; j < k; j++)
            dot_p += (dw[j] - dot_w) / s * p[ex[j]];
        float *dz = dlogits + (size_t)n * E;
        for (int e = 0; e < E; e++)
            dz[e] = -p[e] * dot_p;
        for (int j = 0; j < k; j++)
            dz[ex[j]] += p[ex[j]] * (dw[j] - dot_w) / s;
    }
}

void cpu_moe_combine(void *out_, const void *resid_, const void *shared_, float shared_scale,
                     const void *rows_, const float *weight, const int32_t *slot, int N, int k,
                     int C) {
    float *out = out_;
    const float *resid = resid_, *shared = shared_, *rows = rows_;
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        float *o = out + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            float moe = shared ? shared_scale * shared[(size_t)n * C + c] : 0.0f;
            for (int j = 0; j < k; j++) {
                float w = weight ? weight[(size_t)n * k + j] : 1.0f;
                moe += w * rows[(size_t)slot[(size_t)n * k + j] * C + c];
            }
            o[c] = (resid ? resid[(size_t)n * C + c] : 0.0f) + moe;
        }
    }
}

void cpu_moe_combine_bwd(void *drows_, float *dweight, void *dshared_, const void *dout_,
                         const void *rows_, const float *weight, const int32_t *slot,
                         float shared_scale, int N, int k, int C) {
    float *drows = drows_, *dshared = dshared_;
    const float *dout = dout_, *rows = rows_;
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float *d = dout + (size_t)n * C;
        for (int j = 0; j < k; j++) {
            size_t p = (size_t)slot[(size_t)n * k + j];
            float w = weight[(size_t)n * k + j], dot = 0.0f;
            for (int c = 0; c < C; c++) {
                drows[p * C + c] = w * d[c];
                dot += d[c] * rows[p * C + c];
            }
            dweight[(size_t)n * k + j] = dot;
        }
        if (dshared)
            for (int c = 0; c < C; c++)
                dshared[(size_t)n * C + c] = shared_scale * d[c];
    }
}
