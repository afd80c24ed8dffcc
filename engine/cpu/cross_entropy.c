// cross_entropy.c: softmax cross-entropy with loss mask and label smoothing (CPU).
//
// Per counted row (torch.nn.functional.cross_entropy with label_smoothing e):
//   loss = lse - (1-e) * z[t] - (e/V) * sum_j z[j]
//   dz[j] = dloss * row_scale[n] * (softmax(z)[j] - e/V - (1-e) * [j == t])
#include <math.h>

#include "engine/cpu/cpu_kernels.h"

static int row_counts(const int32_t *mask, int n) {
    return !mask || mask[n] != 0;
}

void cpu_cross_entropy_fwd(float *loss, float *lse, const void *logits_, const int32_t *targets,
                           const int32_t *mask, int N, int V, float label_smoothing) {
    const float *logits = logits_;
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float *z = logits + (size_t)n * V;
        float mx = -INFINITY, sum = 0.0f, zsum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int j = 0; j < V; j++)
            mx = z[j] > mx ? z[j] : mx;
#pragma omp simd reduction(+ : sum, zsum)
        for (int j = 0; j < V; j++) {
            sum += cpu_expf(z[j] - mx);
            zsum += z[j];
        }
        lse[n] = mx + logf(sum);
        loss[n] = row_counts(mask, n) ? lse[n] - (1.0f - label_smoothing) * z[targets[n]] -
                                            label_smoothing / V * zsum
                                      : 0.0f;
    }
}

void cpu_cross_entropy_bwd(void *dlogits_, const void *logits_, const float *lse,
                           const int32_t *targets, const int32_t *mask, const float *row_scale,
                           int N, int V, float label_smoothing, float dloss) {
    float *dlogits = dlogits_;
    const float *logits = logits_;
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float *z = logits + (size_t)n * V;
        float *dz = dlogits + (size_t)n * V;
        float d = row_counts(mask, n) ? (row_scale ? dloss * row_scale[n] : dloss) : 0.0f,
              l = lse[n], floor = label_smoothing / V;
#pragma omp simd
        for (int j = 0; j < V; j++)
            dz[j] = d * (cpu_expf(z[j] - l) - floor);
        if (row_counts(mask, n)) dz[targets[n]] -= d * (1.0f - label_smoothing);
    }
}
