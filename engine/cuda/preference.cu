// preference.cu: the DPO and GRPO losses over per-token NLLs, and NEFTune's embedding noise
// (CUDA; semantics in engine/backend.h, formulas as engine/cpu/preference.c).
//
// The losses are small (a batch's tokens, once per micro-step), so each runs as one block:
// per-thread strided sums in double, then the block tree, a fixed order (deterministic, no
// atomics); thread 0 alone touches acc. The noise kernel writes each element from one thread
// with a counter-based draw (engine/counter_rng.h): independent of the launch layout.
#include "engine/counter_rng.h"
#include "engine/cuda/cuda_math.cuh"
#include "engine/preference_math.h"

namespace {

constexpr int kLossThreads = 512;
constexpr int kNoiseThreads = 256;
constexpr unsigned kMaxNoiseBlocks = 1u << 16; // the grid-stride loop covers the rest

// The block's sum of -x[row*T + t] over t: the row's log-probability (every thread gets it).
__device__ double row_logp(const float *x, int row, int T) {
    double s = 0.0;
    for (int t = threadIdx.x; t < T; t += blockDim.x)
        s -= (double)x[(size_t)row * T + t];
    return block_reduce(s, SumOp(), 0.0);
}

// One block; pair p's rows are p (chosen) and P + p (rejected).
__global__ void __launch_bounds__(kLossThreads)
    dpo_loss_kernel(double *acc, float *scale, const float *nll, const float *ref_nll, int P, int T,
                    float beta, float loss_scale) {
    double loss = 0.0, margin = 0.0, correct = 0.0;
    for (int p = 0; p < P; p++) {
        double pc = row_logp(nll, p, T), pr = row_logp(nll, P + p, T);
        double rc = row_logp(ref_nll, p, T), rr = row_logp(ref_nll, P + p, T);
        double delta = (pc - pr) - (rc - rr), z = (double)beta * delta;
        float d = (float)((double)loss_scale * beta * pref_sigmoid(-z) / P);
        for (int t = threadIdx.x; t < T; t += blockDim.x) {
            scale[(size_t)p * T + t] = d;
            scale[(size_t)(P + p) * T + t] = -d;
        }
        loss += pref_neg_log_sigmoid(z);
        margin += z;
        correct += delta > 0;
    }
    if (threadIdx.x == 0) {
        acc[0] += (double)(float)(loss / P);
        acc[2] += margin / P;
        acc[3] += correct / P;
    }
}

// One block over the R*T tokens, strided by thread.
__global__ void __launch_bounds__(kLossThreads)
    grpo_loss_kernel(double *acc, float *scale, const float *nll, const float *old_nll,
                     const float *ref_nll, const float *adv, const int32_t *mask, int R, int T,
                     float norm, float clip_eps, float kl_coef, float loss_scale) {
    double policy = 0.0, kl = 0.0, clipped = 0.0;
    float per_token = loss_scale / norm;
    size_t N = (size_t)R * T;
    for (size_t n = threadIdx.x; n < N; n += blockDim.x) {
        if (!mask[n]) {
            scale[n] = 0.0f;
            continue;
        }
        GrpoToken g = grpo_token(nll[n], old_nll[n], ref_nll[n], adv[n / T], clip_eps, kl_coef);
        policy += g.policy;
        kl += g.kl;
        clipped += g.clipped;
        scale[n] = per_token * g.dnll;
    }
    policy = block_reduce(policy, SumOp(), 0.0);
    kl = block_reduce(kl, SumOp(), 0.0);
    clipped = block_reduce(clipped, SumOp(), 0.0);
    if (threadIdx.x == 0) {
        acc[0] += (double)(float)((policy + kl_coef * kl) / norm);
        acc[2] += kl / norm;
        acc[3] += clipped / norm;
    }
}

template <typename T>
__global__ void noise_kernel(T *x, size_t n, float std, unsigned long long seed) {
    size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)
        x[i] = from_float<T>(to_float(x[i]) + std * counter_normal(seed, i));
}

template <typename T> void gaussian_noise_add(void *x, size_t n, float std, uint64_t seed) {
    if (n == 0) return;
    size_t blocks = (n + kNoiseThreads - 1) / kNoiseThreads;
    unsigned grid = blocks < kMaxNoiseBlocks ? (unsigned)blocks : kMaxNoiseBlocks;
    noise_kernel<T><<<grid, kNoiseThreads, 0, cu_stream()>>>((T *)x, n, std, seed);
    CUDA_CHECK(cudaGetLastError());
}

} // namespace

void cuda_dpo_loss(double *acc, float *scale, const float *nll, const float *ref_nll, int P, int T,
                   float beta, float loss_scale) {
    if (P <= 0 || T <= 0) return;
    dpo_loss_kernel<<<1, kLossThreads, 0, cu_stream()>>>(acc, scale, nll, ref_nll, P, T, beta,
                                                         loss_scale);
    CUDA_CHECK(cudaGetLastError());
}

void cuda_grpo_loss(double *acc, float *scale, const float *nll, const float *old_nll,
                    const float *ref_nll, const float *adv, const int32_t *mask, int R, int T,
                    float norm, float clip_eps, float kl_coef, float loss_scale) {
    if (R <= 0 || T <= 0 || !(norm > 0)) return;
    grpo_loss_kernel<<<1, kLossThreads, 0, cu_stream()>>>(
        acc, scale, nll, old_nll, ref_nll, adv, mask, R, T, norm, clip_eps, kl_coef, loss_scale);
    CUDA_CHECK(cudaGetLastError());
}

#define NOISE_OPS(S, T)                                                                            \
    void cuda_gaussian_noise_add_##S(void *x, size_t n, float std, uint64_t seed) {                \
        gaussian_noise_add<T>(x, n, std, seed);                                                    \
    }

NOISE_OPS(f32, float)
NOISE_OPS(bf16, __nv_bfloat16)
NOISE_OPS(f16, __half)
