// optim.h: optimizers over a parameter view (engine/model.h ParamView: a table of
// tensors over flat fp32 master/gradient buffers of a backend) (docs/design.md §8).
//
// adamw: torch.optim.AdamW on every parameter (betas 0.9/0.95, eps 1e-8, bias
//        correction, decoupled weight decay `weight_decay`).
// muon:  AstrAI's MuonMix: torch.optim.Muon (defaults momentum 0.95 Nesterov, 5
//        Newton-Schulz steps, adjust_lr "match_rms_adamw"; the fields below change
//        them after optim_create: --muon_* flags), decoupled weight decay
//        `weight_decay`) for 2-D weights whose names contain none of
//        norm/bias/embed/lm_head; AdamW (wd 0) for the rest.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"
#include "engine/model.h"

typedef enum { OPT_ADAMW, OPT_MUON } OptimizerKind;

// The state buffers are the view's backend's, fp32, of the view's num_floats.
typedef struct {
    OptimizerKind kind;
    const Backend *be;
    float weight_decay;
    float beta1, beta2, eps; // AdamW part
    float momentum;          // Muon
    int ns_steps;            // Muon
    bool nesterov;           // Muon: Nesterov momentum (else plain: the update is the buffer)
    bool adjust_lr_original; // Muon adjust_lr_fn: "original" (else "match_rms_adamw")
    long step;               // optimizer steps taken (AdamW bias correction)
    float *exp_avg;          // (num_floats,) AdamW first moment (0 where Muon owns it)
    float *exp_avg_sq;       // (num_floats,) AdamW second moment
    float *momentum_buf;     // (num_floats,) Muon momentum (0 where AdamW owns it); adamw: NULL
    unsigned char *is_muon;  // (n_params,) host: 1 if param i uses Muon
    float *scratch;          // Newton-Schulz workspace (muon_scratch_floats of the largest)
} Optimizer;

int optim_create(Optimizer *o, OptimizerKind kind, const ParamView *v, float weight_decay,
                 Err *err);
// Which tensors Muon steps under OPT_MUON: optim_muon_owns (engine/param_table.h).
// The per-float state arrays (exp_avg, exp_avg_sq, momentum_buf: those the kind has), in that
// order, into arrays; returns how many. The same order for any two optimizers of one kind (a
// shard's and the whole model's, a stage's sent and received).
int optim_state_arrays(const Optimizer *o, float *arrays[3]);
void optim_free(Optimizer *o);

// One step with learning rate lr on v->master using v->grads.
void optim_step(Optimizer *o, const ParamView *v, float lr);

// Gradient clipping as torch's clip_grad_norm_: scales v->grads by max_norm/(norm+1e-6)
// when that is below 1 and max_norm > 0 (norm: the global L2 norm, computed by the
// caller: the backend's sum_squares, summed over ranks when sharded). A NaN norm leaves
// the gradients alone.
void clip_grads(const ParamView *v, double norm, float max_norm);

// State as safetensors ("optimizer.safetensors": exp_avg.<param>, exp_avg_sq.<param>,
// momentum_buffer.<param>, and a 1-element "step") — no pickle. Tensors travel one at a
// time through host memory.
// part: v is a part of the model the file holds (a pipeline stage): the file's other tensors are
// not read (else a tensor that is not v's is an error).
int optim_save(const Optimizer *o, const ParamView *v, const char *path, Err *err);
int optim_load(Optimizer *o, const ParamView *v, const char *path, bool part, Err *err);
// optim_load from an open file or sharded set (ckpt/shards.h); path names it in errors.
int optim_load_st(Optimizer *o, const ParamView *v, const StFile *f, const char *path, bool part,
                  Err *err);
// One file of the state of several optimizers over parts of one model (the stages of a
// pipeline, in order; every step count the same): a tensor already written (a tied head's
// copy) is written once.
int optim_save_parts(const Optimizer *const *opts, const ParamView *views, int n_parts,
                     const char *path, Err *err);
