// preference.h: offline DPO and GRPO (docs/design.md §8; AstrAI's DPOStrategy and GRPOStrategy) on
// top of the model's per-token losses.
//
// A micro-step runs the batch twice: first with the frozen reference weights (forward only;
// pref_keep_reference keeps its per-token NLL), then with the policy weights, after which
// pref_loss adds the loss and its metrics into the model's stats and computes the per-token
// weights model_backward_weighted takes. Rows are sequences of T tokens:
//   DPO:  2P rows, [0,P) the chosen responses and [P,2P) the rejected ones of P records;
//   GRPO: R = records * G rows, record r's response j at row r*G + j.
// In offline GRPO the behaviour policy (π_old) and the reference are the same frozen initial
// weights, so one reference forward serves both; online GRPO's behaviour policy is the policy
// that made the rollout (its NLL given to pref_loss).
#pragma once
#include <stddef.h>

#include "common/error.h"
#include "engine/model.h"

typedef enum { PREF_DPO, PREF_GRPO } PrefKind;

typedef struct {
    PrefKind kind;
    float beta;              // DPO
    float clip_eps, kl_coef; // GRPO
    const Backend *be;
    float *ref_nll; // (cap) the reference's per-token NLL of the batch in flight
    float *scale;   // (cap) d loss / d nll per token, for model_backward_weighted
    float *adv;     // (cap_rows) GRPO: each row's advantage
    size_t cap, cap_rows;
} PrefLoss;

void pref_init(PrefLoss *p, PrefKind kind, float beta, float clip_eps, float kl_coef,
               const Backend *be);
void pref_free(PrefLoss *p);

// After the reference forward (model_forward_tokens) of a batch of `rows` rows of T tokens.
int pref_keep_reference(PrefLoss *p, const Model *m, int rows, int T, Err *err);

// After the policy forward of the same batch: adds the loss (unscaled, as
// model_forward_accumulate adds its mean) to stats[MODEL_STAT_LOSS] and the metrics to
// stats[MODEL_STAT_PREF_A/B] (DPO: reward margin, reward accuracy; GRPO: KL, clip fraction),
// and leaves loss_scale * d loss / d nll in p->scale. GRPO: advantages (rows, host) of each
// row; old_nll (backend, rows x T) the behaviour policy's NLL, NULL: the reference's (offline);
// and token_norm, what its token sums are divided by: the batch's response tokens; when
// the ranks' batches are one batch spread over `world` ranks (data parallel, whose gradients
// and losses are then averaged), the response tokens of all of them divided by world, so that
// every mode computes the mean over the same tokens.
int pref_loss(PrefLoss *p, Model *m, int rows, int T, const float *advantages, const float *old_nll,
              float token_norm, float loss_scale, Err *err);

// GRPO advantages of one record's G rewards: (r - mean) / (std + 1e-8), population std.
void pref_group_advantages(const float *rewards, int G, float *out);
