// optim.c: the CPU optimizer ops (engine/backend.h): sum of squares, scaling, AdamW and
// Muon with Newton-Schulz on sgemm, and the loss accumulator.
//
// Numerics follow PyTorch: torch.optim.AdamW (single-tensor path) and torch.optim.Muon
// (torch >= 2.9, _single_tensor_muon), except that Newton-Schulz runs in fp32 (torch: bf16).
// Reductions add fixed blocks in a fixed order, so a step is bitwise reproducible whatever
// the thread count.
#include <cblas.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "engine/cpu/cpu_kernels.h"

// Element loops smaller than this run on one thread (an OpenMP region costs microseconds).
#define PARALLEL_MIN 16384
#define SUM_BLOCKS 256

// Sum of x[i]^2 in double, over fixed blocks added in a fixed order.
static double sum_squares(const float *x, size_t n) {
    double partial[SUM_BLOCKS];
    size_t block = (n + SUM_BLOCKS - 1) / SUM_BLOCKS;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int b = 0; b < SUM_BLOCKS; b++) {
        size_t lo = (size_t)b * block, hi = lo + block < n ? lo + block : n;
        double s = 0.0;
        for (size_t i = lo; i < hi; i++)
            s += (double)x[i] * (double)x[i];
        partial[b] = s;
    }
    double total = 0.0;
    for (int b = 0; b < SUM_BLOCKS; b++)
        total += partial[b];
    return total;
}

void cpu_sum_squares(double *out, const float *x, size_t n) {
    *out = sum_squares(x, n);
}

void cpu_scale(float *x, size_t n, float factor) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (size_t i = 0; i < n; i++)
        x[i] *= factor;
}

void cpu_loss_mean_add(double *acc, const float *loss, int N, int counted) {
    double sum = 0.0;
    for (int n = 0; n < N; n++)
        sum += loss[n];
    *acc += (double)(float)(sum / counted);
}

void cpu_adamw(float *w, const float *g, float *exp_avg, float *exp_avg_sq, size_t n,
               const AdamwArgs *a) {
    const AdamwArgs k = *a;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) {
        w[i] *= k.decay;
        exp_avg[i] = exp_avg[i] * k.beta1 + g[i] * k.one_minus_beta1;
        exp_avg_sq[i] = exp_avg_sq[i] * k.beta2 + g[i] * g[i] * k.one_minus_beta2;
        float denom = sqrtf(exp_avg_sq[i]) / k.bc2_sqrt + k.eps;
        w[i] += -k.step_size * (exp_avg[i] / denom);
    }
}

// torch.lerp's formula (two branches for accuracy), so our numbers track torch's.
static inline float lerp(float start, float end, float weight) {
    return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

// Newton-Schulz orthogonalisation of x: (r, c), r <= c, in place of the scratch.
// Returns the buffer (x or next) that holds the result.
static float *newton_schulz(float *x, float *next, float *gram, float *poly, int r, int c,
                            const MuonArgs *a) {
    size_t n = (size_t)r * c;
    float norm = (float)sqrt(sum_squares(x, n));
    float divisor = norm > a->norm_eps ? norm : a->norm_eps;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (size_t i = 0; i < n; i++)
        x[i] /= divisor;
    for (int k = 0; k < a->ns_steps; k++) {
        // gram = x x^T: (r, r)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, r, c, 1.0f, x, c, x, c, 0.0f, gram,
                    r);
        // poly = b*gram + c*gram@gram
        memcpy(poly, gram, (size_t)r * r * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, r, r, a->ns_c, gram, r, gram, r,
                    a->ns_b, poly, r);
        // next = a*x + poly@x: (r, c)
        memcpy(next, x, n * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, c, r, 1.0f, poly, r, x, c,
                    a->ns_a, next, c);
        float *t = x;
        x = next;
        next = t;
    }
    return x;
}

void cpu_muon(float *w, const float *g, float *buf, float *scratch, const MuonArgs *a) {
    const int rows = a->rows, cols = a->cols;
    // Work on the wide orientation: x = update^T when rows > cols, so x is (r, c), r <= c.
    const bool transposed = rows > cols;
    const int r = transposed ? cols : rows, c = transposed ? rows : cols;
    const size_t n = (size_t)rows * cols;
    float *x = scratch, *next = x + n, *gram = next + n, *poly = gram + (size_t)r * r;
    const float momentum = a->momentum, one_minus_momentum = a->one_minus_momentum;

#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int i = 0; i < rows; i++) {
        for (int j = 0; j < cols; j++) {
            size_t k = (size_t)i * cols + j;
            buf[k] = lerp(buf[k], g[k], one_minus_momentum);
            float update = a->nesterov ? lerp(g[k], buf[k], momentum) : buf[k];
            x[transposed ? (size_t)j * rows + i : k] = update;
        }
    }
    float *ortho = newton_schulz(x, next, gram, poly, r, c, a);
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int i = 0; i < rows; i++) {
        for (int j = 0; j < cols; j++) {
            size_t k = (size_t)i * cols + j;
            w[k] *= a->decay;
            w[k] += -a->adjusted_lr * ortho[transposed ? (size_t)j * rows + i : k];
        }
    }
}
