// preference_math.h: the per-pair and per-token formulas of the DPO and GRPO losses
// (engine/backend.h dpo_loss, grpo_loss), shared by the CPU and CUDA kernels; the kernels
// own the sums and the memory layout.
#pragma once
#include <math.h>

#include "common/hd.h"

// -log(sigmoid(x)) = log(1 + e^-x), without overflow for either sign.
HD_FN double pref_neg_log_sigmoid(double x) {
    return x >= 0 ? log1p(exp(-x)) : -x + log1p(exp(x));
}

HD_FN double pref_sigmoid(double x) {
    return x >= 0 ? 1.0 / (1.0 + exp(-x)) : exp(x) / (1.0 + exp(x));
}

typedef struct {
    float policy; // -min(ρA, clamp(ρ, 1-ε, 1+ε) A)
    float kl;     // r - log(r + 1e-8) - 1
    float dnll;   // d (policy + kl_coef kl) / d nll
    int clipped;  // |ρ - 1| > ε
} GrpoToken;

// One response token: ρ = exp(old_nll - nll), r = exp(nll - ref_nll). The gradient follows
// torch: min's smaller branch takes it and a tie splits it, clamp passes it inside
// [1-ε, 1+ε] only; through ρ, d(-ρA)/d nll = ρA.
HD_FN GrpoToken grpo_token(float nll, float old_nll, float ref_nll, float A, float clip_eps,
                           float kl_coef) {
    float rho = expf(old_nll - nll);
    float lo = 1.0f - clip_eps, hi = 1.0f + clip_eps;
    int inside = rho >= lo && rho <= hi;
    float clamped = inside ? rho : rho < lo ? lo : hi;
    float s1 = rho * A, s2 = clamped * A;
    float active = s1 < s2 ? 1.0f : s1 == s2 ? 0.5f + 0.5f * (float)inside : 0.0f;
    float r = expf(nll - ref_nll);
    GrpoToken g;
    g.policy = -(s1 < s2 ? s1 : s2);
    g.kl = r - logf(r + 1e-8f) - 1.0f;
    g.dnll = active * s1 + kl_coef * r * (1.0f - 1.0f / (r + 1e-8f));
    g.clipped = !inside;
    return g;
}
