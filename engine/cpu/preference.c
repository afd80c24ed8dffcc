// preference.c: the DPO and GRPO losses over per-token NLLs, and NEFTune's embedding noise
// (CPU; semantics in engine/backend.h). Sums run in double, in token order.
#include <math.h>

#include "engine/counter_rng.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/preference_math.h"

// Minus the row's summed NLL: its log-probability.
static double row_logp(const float *nll, int row, int T) {
    double s = 0;
    for (int t = 0; t < T; t++)
        s -= nll[(size_t)row * T + t];
    return s;
}

void cpu_dpo_loss(double *acc, float *scale, const float *nll, const float *ref_nll, int P, int T,
                  float beta, float loss_scale) {
    double loss = 0, margin = 0, correct = 0;
    for (int p = 0; p < P; p++) {
        double delta = (row_logp(nll, p, T) - row_logp(nll, P + p, T)) -
                       (row_logp(ref_nll, p, T) - row_logp(ref_nll, P + p, T));
        double z = (double)beta * delta;
        loss += pref_neg_log_sigmoid(z);
        margin += z;
        correct += delta > 0;
        // d loss / d nll of a chosen token: β σ(-βΔ) / P (nll lowers π_c); rejected: minus that.
        float d = (float)((double)loss_scale * beta * pref_sigmoid(-z) / P);
        for (int t = 0; t < T; t++) {
            scale[(size_t)p * T + t] = d;
            scale[(size_t)(P + p) * T + t] = -d;
        }
    }
    acc[0] += (double)(float)(loss / P);
    acc[2] += margin / P;
    acc[3] += correct / P;
}

void cpu_grpo_loss(double *acc, float *scale, const float *nll, const float *old_nll,
                   const float *ref_nll, const float *adv, const int32_t *mask, int R, int T,
                   float norm, float clip_eps, float kl_coef, float loss_scale) {
    double policy = 0, kl = 0, clipped = 0;
    float per_token = loss_scale / norm;
    for (int row = 0; row < R; row++)
        for (int t = 0; t < T; t++) {
            size_t n = (size_t)row * T + t;
            if (!mask[n]) {
                scale[n] = 0.0f;
                continue;
            }
            GrpoToken g = grpo_token(nll[n], old_nll[n], ref_nll[n], adv[row], clip_eps, kl_coef);
            policy += g.policy;
            kl += g.kl;
            clipped += g.clipped;
            scale[n] = per_token * g.dnll;
        }
    acc[0] += (double)(float)((policy + kl_coef * kl) / norm);
    acc[2] += kl / norm;
    acc[3] += clipped / norm;
}

void cpu_gaussian_noise_add(void *x_, size_t n, float std, uint64_t seed) {
    float *x = x_;
#pragma omp parallel for
    for (size_t i = 0; i < n; i++)
        x[i] += std * counter_normal(seed, i);
}
