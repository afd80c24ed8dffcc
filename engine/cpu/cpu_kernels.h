// cpu_kernels.h: the CPU implementations behind engine/backend.h (one file per op family).
// Shapes and semantics are documented on the Backend fields in engine/backend.h.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __clang__
// `omp simd` is a hint: clang reports loops it cannot vectorise (always so under the
// sanitizers) as -Wpass-failed warnings, which -Werror would turn into build failures.
#pragma clang diagnostic ignored "-Wpass-failed"
#endif

// exp(x) for x <= ~88 as plain arithmetic (no libm call), so loops around it vectorise.
// Relative error ~2e-7; returns 0 below -87.
static inline float cpu_expf(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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
    return x < -87.0f ? 0.0f : p * scale.f;
}

static inline float cpu_sigmoidf(float x) {
    return 1.0f / (1.0f + cpu_expf(-x));
}

void cpu_matmul_fwd(float *out, const float *inp, const float *weight, int N, int C, int OC,
                    int accumulate);
void cpu_matmul_bwd(float *dinp, float *dweight, const float *dout, const float *inp,
                    const float *weight, int N, int C, int OC, int accumulate_dinp);

void cpu_embedding_fwd(float *out, const int32_t *ids, const float *table, int N, int C);
void cpu_embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int N, int C);

void cpu_rmsnorm_fwd(float *out, float *rstd, const float *inp, const float *weight, int N, int G,
                     int C, int stride, float eps);
void cpu_rmsnorm_bwd(float *dinp, float *dweight, const float *dout, const float *inp,
                     const float *weight, const float *rstd, int N, int G, int C, int stride,
                     int accumulate_dinp);

void cpu_rope_fwd(float *x, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                  int stride);
void cpu_rope_bwd(float *dx, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                  int stride);

void cpu_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                       const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                       int qkv_stride);
void cpu_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out,
                       const float *lse, const float *q, const float *k, const float *v,
                       const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                       int qkv_stride);

void cpu_swiglu_fwd(float *out, const float *h, int N, int FF);
void cpu_swiglu_bwd(float *dh, const float *dout, const float *h, int N, int FF);
void cpu_sigmoid_gate_fwd(float *out, const float *x, const float *g, size_t n);
void cpu_sigmoid_gate_bwd(float *dx, float *dg, const float *dout, const float *x, const float *g,
                          size_t n);

void cpu_cross_entropy_fwd(float *loss, float *lse, const float *logits, const int32_t *targets,
                           const int32_t *mask, int N, int V, float label_smoothing);
void cpu_cross_entropy_bwd(float *dlogits, const float *logits, const float *lse,
                           const int32_t *targets, const int32_t *mask, int N, int V,
                           float label_smoothing, float dloss);
