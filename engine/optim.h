// optim.h: optimizers over the model's flat parameter buffer (DESIGN §8).
//
// adamw: torch.optim.AdamW on every parameter (betas 0.9/0.95, eps 1e-8, bias
//        correction, decoupled weight decay `weight_decay`).
// muon:  AstrAI's MuonMix: torch.optim.Muon (momentum 0.95 Nesterov, 5
//        Newton-Schulz steps, adjust_lr "match_rms_adamw", decoupled weight decay
//        `weight_decay`) for 2-D weights whose names contain none of
//        norm/bias/embed/lm_head; AdamW (wd 0) for the rest.
#pragma once
#include <stddef.h>

#include "common/error.h"
#include "engine/model.h"

typedef enum { OPT_ADAMW, OPT_MUON } OptimizerKind;

typedef struct {
    OptimizerKind kind;
    float weight_decay;
    float beta1, beta2, eps; // AdamW part
    float momentum;          // Muon
    int ns_steps;            // Muon
    long step;               // optimizer steps taken (AdamW bias correction)
    float *exp_avg;          // (num_floats,) AdamW first moment (0 where Muon owns it)
    float *exp_avg_sq;       // (num_floats,) AdamW second moment
    float *momentum_buf;     // (num_floats,) Muon momentum (0 where AdamW owns it)
    unsigned char *is_muon;  // (n_params,) 1 if param i uses Muon
    float *scratch;          // Newton-Schulz workspace
    size_t scratch_floats;
} Optimizer;

int optim_create(Optimizer *o, OptimizerKind kind, const Model *m, float weight_decay, Err *err);
void optim_free(Optimizer *o);

// One step with learning rate lr on m->weights using m->grads.
void optim_step(Optimizer *o, Model *m, float lr);

// Global L2 norm of m->grads; scales grads by min(1, max_norm/(norm+1e-6)) when
// max_norm > 0. Returns the norm before clipping.
float clip_grad_norm(Model *m, float max_norm);
// The two halves of clip_grad_norm, for sharded gradients: the local sum of
// squares (deterministic order), and the scaling for a global norm.
double grad_sq_sum(const Model *m);
void clip_grads_to(Model *m, double norm, float max_norm);

// State as safetensors ("optimizer.safetensors": exp_avg.<param>, exp_avg_sq.<param>,
// momentum_buffer.<param>, and a 1-element "step") — no pickle.
int optim_save(const Optimizer *o, const Model *m, const char *path, Err *err);
int optim_load(Optimizer *o, const Model *m, const char *path, Err *err);
