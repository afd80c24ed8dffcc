// rmsnorm.c: RMSNorm forward/backward over grouped rows (CPU), see engine/backend.h.
#include <math.h>

#include "engine/cpu/cpu_kernels.h"

void cpu_rmsnorm_fwd(void *out_, float *rstd, const void *inp_, const void *weight_, int N, int G,
                     int C, int stride, float eps) {
    float *out = out_;
    const float *inp = inp_;
    const float *weight = weight_;
#pragma omp parallel for
    for (long r = 0; r < (long)N * G; r++) {
        size_t at = (size_t)(r / G) * stride + (size_t)(r % G) * C;
        const float *x = inp + at;
        float *o = out + at;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int c = 0; c < C; c++)
            ss += x[c] * x[c];
        float rs = 1.0f / sqrtf(ss / C + eps);
        rstd[r] = rs;
#pragma omp simd
        for (int c = 0; c < C; c++)
            o[c] = x[c] * rs * weight[c];
    }
}

void cpu_rmsnorm_bwd(void *dinp_, float *dweight, const void *dout_, const void *inp_,
                     const void *weight_, const float *rstd, int N, int G, int C, int stride,
                     int accumulate_dinp) {
    float *dinp = dinp_;
    const float *dout = dout_;
    const float *inp = inp_;
    const float *weight = weight_;
#pragma omp parallel for
    for (long r = 0; r < (long)N * G; r++) {
        size_t at = (size_t)(r / G) * stride + (size_t)(r % G) * C;
        const float *x = inp + at, *d = dout + at;
        float *dx = dinp + at;
        float rs = rstd[r], dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int c = 0; c < C; c++)
            dot += d[c] * weight[c] * x[c];
        // dx = rs * (d*w - xhat * mean(d*w*xhat)), xhat = x*rs
        float k = dot * rs * rs / C;
        // Added to dx, or over it: never 0 * dx, which keeps a NaN an overflowed step left there
        // (loss scaling skips that step and goes on with the same buffers).
#pragma omp simd
        for (int c = 0; c < C; c++)
            dx[c] = (accumulate_dinp ? dx[c] : 0.0f) + rs * (d[c] * weight[c] - x[c] * k);
    }
    // dweight in a second pass split by channel blocks: race-free and deterministic
    // (the same sum order whatever the thread count).
    enum { BLOCK = 16 };
#pragma omp parallel for
    for (int c0 = 0; c0 < C; c0 += BLOCK) {
        int c1 = c0 + BLOCK < C ? c0 + BLOCK : C;
        float acc[BLOCK] = {0};
        for (long r = 0; r < (long)N * G; r++) {
            size_t at = (size_t)(r / G) * stride + (size_t)(r % G) * C;
            for (int c = c0; c < c1; c++)
                acc[c - c0] += dout[at + c] * inp[at + c] * rstd[r];
        }
        for (int c = c0; c < c1; c++)
            dweight[c] += acc[c - c0];
    }
}
