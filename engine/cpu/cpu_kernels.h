// cpu_kernels.h: the CPU implementations behind engine/backend.h (one file per op family).
// Shapes and semantics are documented on the Backend fields in engine/backend.h.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "engine/backend.h"

#ifdef __clang__
// `omp simd` is a hint: clang reports loops it cannot vectorise (always so under the
// sanitizers) as -Wpass-failed warnings, which -Werror would turn into build failures.
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

// exp(x) for x <= ~88 as plain arithmetic (no libm call), so loops around it vectorise.
// Relative error ~2e-7; returns 0 below -87, NaN for NaN (a diverged run's activations: the
// clamp sends it to -87 so that the int conversion below stays defined).
static inline float cpu_expf(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float xc = x > -87.0f ? (x < 88.0f ? x : 88.0f) : -87.0f;
    float n = __builtin_floorf(xc * log2e + 0.5f);
    float r = xc - n * ln2_hi - n * ln2_lo;
    // Cephes expf polynomial on [-ln2/2, ln2/2]
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : x == x ? p * scale.f : x;
}

// The first failure of a CPU op (engine/backend.h's rule), recorded with first_failure_record:
// "cpu bf16 backend: bf16_rmsnorm_fwd: out of memory for 12.0 MiB of fp32 scratch";
// cpu_failure (the table's `failure`) reports it.
extern FirstFailure cpu_failures;
int cpu_failure(Err *err);

static inline float cpu_sigmoidf(float x) {
    return 1.0f / (1.0f + cpu_expf(-x));
}

void cpu_matmul_fwd(void *out, const void *inp, const void *weight, int N, int C, int OC,
                    int accumulate);
void cpu_matmul_bwd(void *dinp, float *dweight, const void *dout, const void *inp,
                    const void *weight, int N, int C, int OC, int accumulate_dinp);

void cpu_embedding_fwd(void *out, const int32_t *ids, const void *table, int N, int C);
// out: (N, row_bytes) = table row ids[n] for each n: embedding_fwd in any dtype.
void cpu_embedding_gather(void *out, const int32_t *ids, const void *table, int N,
                          size_t row_bytes);
void cpu_embedding_bwd(float *dtable, const void *dout, const int32_t *ids, const int32_t *by_id,
                       int N, int C);

void cpu_rmsnorm_fwd(void *out, float *rstd, const void *inp, const void *weight, int N, int G,
                     int C, int stride, float eps);
void cpu_rmsnorm_bwd(void *dinp, float *dweight, const void *dout, const void *inp,
                     const void *weight, const float *rstd, int N, int G, int C, int stride,
                     int accumulate_dinp);

void cpu_rope_fwd(void *x, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                  int stride);
void cpu_rope_bwd(void *dx, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                  int stride);

int cpu_attention_reserve(int T, int D, Err *err);
void cpu_attention_fwd(void *out, float *lse, const void *q, const void *k, const void *v,
                       const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                       int qkv_stride);
void cpu_attention_bwd(void *dq, void *dk, void *dv, const void *dout, const void *out,
                       const float *lse, const void *q, const void *k, const void *v,
                       const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                       int qkv_stride);
void cpu_attention_decode(void *out, const void *q, const void *k_cache, const void *v_cache,
                          const int32_t *span, int B, int H, int KVH, int D, int q_stride,
                          int max_len);

// moe.c
// rows rows of row_bytes, dst_stride / src_stride bytes apart: copy_rows in any dtype.
void cpu_copy_rows_bytes(void *dst, size_t dst_stride, const void *src, size_t src_stride, int rows,
                         size_t row_bytes);
void cpu_copy_rows(void *dst, int dst_stride, const void *src, int src_stride, int rows, int cols);
// moe_route over fp32 logits, the probabilities and weights rounded to dtype.
void cpu_moe_route_dtype(DType dtype, float *probs, float *weight, int32_t *expert, int32_t *counts,
                         int32_t *token_of, int32_t *slot, const float *logits, int N, int E,
                         int k);
void cpu_moe_route(float *probs, float *weight, int32_t *expert, int32_t *counts, int32_t *token_of,
                   int32_t *slot, const void *logits, int N, int E, int k);
void cpu_moe_route_bwd(void *dlogits, const float *dweight, const float *probs,
                       const int32_t *expert, int N, int E, int k);
void cpu_moe_combine(void *out, const void *resid, const void *shared, float shared_scale,
                     const void *rows, const float *weight, const int32_t *slot, int N, int k,
                     int C);
void cpu_moe_combine_bwd(void *drows, float *dweight, void *dshared, const void *dout,
                         const void *rows, const float *weight, const int32_t *slot,
                         float shared_scale, int N, int k, int C);

void cpu_swiglu_fwd(void *out, const void *h, int N, int FF);
void cpu_swiglu_bwd(void *dh, const void *dout, const void *h, int N, int FF);
void cpu_sigmoid_gate_fwd(void *out, const void *x, const void *g, size_t n);
void cpu_sigmoid_gate_bwd(void *dx, void *dg, const void *dout, const void *x, const void *g,
                          size_t n);

void cpu_cross_entropy_fwd(float *loss, float *lse, const void *logits, const int32_t *targets,
                           const int32_t *mask, int N, int V, float label_smoothing);
void cpu_cross_entropy_bwd(void *dlogits, const void *logits, const float *lse,
                           const int32_t *targets, const int32_t *mask, const float *row_scale,
                           int N, int V, float label_smoothing, float dloss);

void cpu_loss_mean_add(double *acc, const float *loss, int N, int counted);

// preference.c
void cpu_dpo_loss(double *acc, float *scale, const float *nll, const float *ref_nll, int P, int T,
                  float beta, float loss_scale);
void cpu_grpo_loss(double *acc, float *scale, const float *nll, const float *old_nll,
                   const float *ref_nll, const float *adv, const int32_t *mask, int R, int T,
                   float norm, float clip_eps, float kl_coef, float loss_scale);
void cpu_gaussian_noise_add(void *x, size_t n, float std, uint64_t seed);
void cpu_sum_squares(double *out, const float *x, size_t n);
void cpu_scale(float *x, size_t n, float factor);
void cpu_adamw(float *w, const float *g, float *exp_avg, float *exp_avg_sq, size_t n,
               const AdamwArgs *a);
void cpu_muon(float *w, const float *g, float *buf, float *scratch, const MuonArgs *a);
