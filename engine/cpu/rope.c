// rope.c: rotary embedding on interleaved pairs (2i, 2i+1), per-token positions (CPU).
#include "engine/cpu/cpu_kernels.h"

// Rotates every pair of x by +angle (sign 1) or -angle (sign -1).
static void rope_rotate(float *x, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                        int stride, float sign) {
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float *cs = cos_sin + (size_t)pos[n] * D; // (D/2, 2)
        for (int g = 0; g < G; g++) {
            float *v = x + (size_t)n * stride + (size_t)g * D;
#pragma omp simd
            for (int i = 0; i < D / 2; i++) {
                float c = cs[2 * i], s = sign * cs[2 * i + 1];
                float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * c - b * s;
                v[2 * i + 1] = a * s + b * c;
            }
        }
    }
}

void cpu_rope_fwd(void *x_, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                  int stride) {
    float *x = x_;
    rope_rotate(x, pos, cos_sin, N, G, D, stride, 1.0f);
}

void cpu_rope_bwd(void *dx_, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                  int stride) {
    float *dx = dx_;
    rope_rotate(dx, pos, cos_sin, N, G, D, stride, -1.0f);
}
