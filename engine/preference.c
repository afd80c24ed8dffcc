// preference.c: the buffers and the sequence of a DPO/GRPO micro-step (engine/preference.h);
// the arithmetic is the backend's dpo_loss / grpo_loss.
#include "engine/preference.h"

#include <math.h>
#include <string.h>

void pref_init(PrefLoss *p, PrefKind kind, float beta, float clip_eps, float kl_coef,
               const Backend *be) {
    *p = (PrefLoss){.kind = kind, .beta = beta, .clip_eps = clip_eps, .kl_coef = kl_coef, .be = be};
}

void pref_free(PrefLoss *p) {
    if (p->be) {
        p->be->free(p->ref_nll);
        p->be->free(p->scale);
        p->be->free(p->adv);
    }
    memset(p, 0, sizeof *p);
}

// Grows the token buffers to n tokens and the row buffer to `rows`.
static int reserve(PrefLoss *p, size_t n, size_t rows, Err *err) {
    if (n > p->cap) {
        p->be->free(p->ref_nll);
        p->be->free(p->scale);
        p->ref_nll = p->scale = NULL;
        p->cap = 0;
        if (!(p->ref_nll = p->be->alloc(n * sizeof(float), err)) ||
            !(p->scale = p->be->alloc(n * sizeof(float), err)))
            return err_prefix(err, "%s buffers of %zu tokens", p->kind == PREF_DPO ? "dpo" : "grpo",
                              n);
        p->cap = n;
    }
    if (rows > p->cap_rows) {
        p->be->free(p->adv);
        p->cap_rows = 0;
        if (!(p->adv = p->be->alloc(rows * sizeof(float), err)))
            return err_prefix(err, "grpo advantages of %zu rows", rows);
        p->cap_rows = rows;
    }
    return 0;
}

int pref_keep_reference(PrefLoss *p, const Model *m, int rows, int T, Err *err) {
    size_t n = (size_t)rows * T;
    if (reserve(p, n, (size_t)rows, err)) return -1;
    p->be->copy(p->ref_nll, model_token_nll(m), n * sizeof(float));
    return 0;
}

int pref_loss(PrefLoss *p, Model *m, int rows, int T, const float *advantages, const float *old_nll,
              float token_norm, float loss_scale, Err *err) {
    size_t n = (size_t)rows * T;
    if (n > p->cap || (size_t)rows > p->cap_rows)
        return err_set(err, "pref_loss: %d rows of %d tokens without their reference", rows, T);
    const Backend *be = p->be;
    const float *nll = model_token_nll(m);
    if (p->kind == PREF_DPO) {
        if (rows % 2) return err_set(err, "dpo: %d rows is not chosen/rejected pairs", rows);
        be->dpo_loss(m->stats, p->scale, nll, p->ref_nll, rows / 2, T, p->beta, loss_scale);
        return 0;
    }
    if (!(token_norm > 0)) return err_set(err, "grpo: the batch has no response token");
    be->upload(p->adv, advantages, (size_t)rows * sizeof(float));
    // Offline: the behaviour policy is the frozen reference (docs/design.md §8).
    be->grpo_loss(m->stats, p->scale, nll, old_nll ? old_nll : p->ref_nll, p->ref_nll, p->adv,
                  model_token_mask(m), rows, T, token_norm, p->clip_eps, p->kl_coef, loss_scale);
    return 0;
}

void pref_group_advantages(const float *rewards, int G, float *out) {
    double mean = 0, var = 0;
    for (int j = 0; j < G; j++)
        mean += rewards[j];
    mean /= G;
    for (int j = 0; j < G; j++)
        var += (rewards[j] - mean) * (rewards[j] - mean);
    double std = sqrt(var / G);
    for (int j = 0; j < G; j++)
        out[j] = (float)((rewards[j] - mean) / (std + 1e-8));
}
