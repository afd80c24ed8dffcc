// model.h: the AstrAI autoregressive LM (DESIGN §7): parameters, forward, backward.
//
// Parameters live in one flat fp32 buffer (weights) with a gradient buffer of
// the same layout (grads), described by a table of named tensors in AstrAI key
// order. The flat layout is what the optimizer, gradient clipping and the
// collectives (ddp all-reduce, fsdp sharding) work on.
//
// The numerics run through a Backend (engine/backend.h): the model code only
// orchestrates, so a CUDA backend can be added beside the CPU one.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt/safetensors.h"
#include "common/error.h"
#include "engine/config.h"

typedef struct {
    char name[96]; // AstrAI key, e.g. "layers.0.attention.q_proj.weight"
    int ndim;      // 1 or 2
    int64_t shape[2];
    size_t offset; // in floats, into Model.weights / Model.grads
    size_t numel;
} ParamSpec;

typedef struct ModelActs ModelActs; // activations, private to model.c

typedef struct {
    ModelConfig cfg;
    ParamSpec *params; // n_params entries
    int n_params;
    size_t num_floats; // total parameter count
    float *weights;    // (num_floats,)
    float *grads;      // (num_floats,), accumulated by model_backward
    ModelActs *acts;   // sized for the largest (B,T) seen so far
} Model;

int model_create(Model *m, const ModelConfig *cfg, Err *err);
void model_free(Model *m);

const ParamSpec *model_param(const Model *m, const char *name);

// AstrAI init: N(0, 0.02); o_proj and mlp.down N(0, 0.02/sqrt(2*n_layers)); norms 1.
void model_init_random(Model *m, uint64_t seed);

// Loads weights from a safetensors file (bf16/f16/f32). A missing tensor, an
// unexpected tensor or a wrong shape is an error naming it. With tied
// embeddings a present lm_head.weight is ignored.
int model_load(Model *m, const char *safetensors_path, Err *err);
int model_save(const Model *m, const char *safetensors_path, StDType dtype, Err *err);

// Forward pass with loss.
//   inputs, targets: (B,T) token ids; targets may be NULL (logits only)
//   loss_mask: (B,T) 0/1 or NULL (all tokens count); the loss is the mean over
//              counted tokens (AstrAI: cross_entropy with ignore_index)
//   position_ids: (B,T) or NULL (positions 0..T-1); when given, a document starts
//              where pos[t] <= pos[t-1] and attention stays inside documents
// Returns the mean loss (0 when targets is NULL or no token counts).
// Errors (allocation) are reported through err with a NaN return.
float model_forward(Model *m, const int32_t *inputs, const int32_t *targets,
                    const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                    float label_smoothing, Err *err);

// Logits of the last forward: (B,T,V), row-major.
const float *model_logits(const Model *m);

// Backward of the last forward's loss multiplied by loss_scale (1/grad_accum_steps);
// gradients are ADDED into m->grads.
void model_backward(Model *m, float loss_scale);

void model_zero_grad(Model *m);

// FSDP holds the full weights and gradients only while a micro-step needs them:
// model_release frees the chosen buffers (pointers become NULL), model_acquire
// allocates the missing ones again (zeroed).
int model_acquire(Model *m, bool weights, bool grads, Err *err);
void model_release(Model *m, bool weights, bool grads);

// Bytes held by activations (for memory reports).
size_t model_activation_bytes(const Model *m);
