// elementwise.c: embedding lookup, SwiGLU and the sigmoid gate of gated attention (CPU).
#include <string.h>

#include "engine/cpu/cpu_kernels.h"

void cpu_embedding_gather(void *out, const int32_t *ids, const void *table, int N,
                          size_t row_bytes) {
#pragma omp parallel for
    for (int n = 0; n < N; n++)
        memcpy((char *)out + (size_t)n * row_bytes,
               (const char *)table + (size_t)ids[n] * row_bytes, row_bytes);
}

void cpu_embedding_fwd(void *out, const int32_t *ids, const void *table, int N, int C) {
    cpu_embedding_gather(out, ids, table, N, (size_t)C * sizeof(float));
}

void cpu_embedding_bwd(float *dtable, const void *dout_, const int32_t *ids, const int32_t *by_id,
                       int N, int C) {
    const float *dout = dout_;
    (void)by_id; // needed by backends that sum per table row
    // Split by channel blocks, not tokens: tokens repeat, channels never collide.
    enum { BLOCK = 64 };
#pragma omp parallel for
    for (int c0 = 0; c0 < C; c0 += BLOCK) {
        int c1 = c0 + BLOCK < C ? c0 + BLOCK : C;
        for (int n = 0; n < N; n++) {
            float *dst = dtable + (size_t)ids[n] * C;
            const float *src = dout + (size_t)n * C;
#pragma omp simd
            for (int c = c0; c < c1; c++)
                dst[c] += src[c];
        }
    }
}

void cpu_swiglu_fwd(void *out_, const void *h_, int N, int FF) {
    float *out = out_;
    const float *h = h_;
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float *up = h + (size_t)n * 2 * FF, *gate = up + FF;
        float *o = out + (size_t)n * FF;
#pragma omp simd
        for (int i = 0; i < FF; i++)
            o[i] = up[i] * gate[i] * cpu_sigmoidf(gate[i]);
    }
}

void cpu_swiglu_bwd(void *dh_, const void *dout_, const void *h_, int N, int FF) {
    float *dh = dh_;
    const float *dout = dout_;
    const float *h = h_;
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float *up = h + (size_t)n * 2 * FF, *gate = up + FF, *d = dout + (size_t)n * FF;
        float *dup = dh + (size_t)n * 2 * FF, *dgate = dup + FF;
#pragma omp simd
        for (int i = 0; i < FF; i++) {
            float s = cpu_sigmoidf(gate[i]);
            dup[i] = d[i] * gate[i] * s;
            // d silu(g)/dg = s * (1 + g * (1 - s))
            dgate[i] = d[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
        }
    }
}

void cpu_sigmoid_gate_fwd(void *out_, const void *x_, const void *g_, size_t n) {
    float *out = out_;
    const float *x = x_;
    const float *g = g_;
#pragma omp parallel for simd
    for (size_t i = 0; i < n; i++)
        out[i] = x[i] * cpu_sigmoidf(g[i]);
}

void cpu_sigmoid_gate_bwd(void *dx_, void *dg_, const void *dout_, const void *x_, const void *g_,
                          size_t n) {
    float *dx = dx_;
    float *dg = dg_;
    const float *dout = dout_;
    const float *x = x_;
    const float *g = g_;
#pragma omp parallel for simd
    for (size_t i = 0; i < n; i++) {
        float s = cpu_sigmoidf(g[i]);
        dx[i] = dout[i] * s;
        dg[i] = dout[i] * x[i] * s * (1.0f - s);
    }
}
