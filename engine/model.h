// model.h: the AstrAI autoregressive LM (docs/design.md §7): parameters, forward, backward.
//
// Parameters live in flat buffers described by a table of named tensors in AstrAI key
// order: fp32 master weights (what the optimizer updates and checkpoints hold), the
// weights forward and backward read, in the backend's compute dtype (the same buffer as
// the master when that is fp32; a bf16 copy refreshed after each optimizer step
// otherwise), and fp32 gradients of the same layout. The flat layout is what the
// optimizer, gradient clipping and the collectives (ddp, fsdp sharding) work on.
//
// Every buffer belongs to the model's Backend (engine/backend.h), chosen at creation;
// the model code only orchestrates its ops. Host and backend memory meet at named
// points: the batch (one upload per forward), the losses (model_read_stats, once per
// optimizer step), weights one tensor at a time through a host staging buffer (load, save,
// init). An executor that shares the model between ranks (train/executor.h) follows
// forward and backward through the hooks of model_set_hooks.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt/safetensors.h"
#include "common/error.h"
#include "engine/backend.h"
#include "engine/expert_group.h"
#include "engine/param_table.h"
#include "model/config.h"

// What an optimizer steps: a table of tensors over flat fp32 buffers of the backend
// (a whole model, or the tensors a rank owns under ddp/fsdp).
typedef struct {
    const Backend *be;
    const ParamSpec *params; // n_params entries; offsets into master/grads
    int n_params;
    size_t num_floats; // buffer length (may exceed the tensors: padding)
    float *master;     // (num_floats,) fp32 weights
    float *grads;      // (num_floats,) fp32 gradients
} ParamView;

typedef struct ModelActs ModelActs; // one micro-batch's activations, private to model.c
typedef struct ModelPlan ModelPlan; // what every micro-batch shares (rope table, indices), private

// The backend accumulators of m->stats, which forward alone adds to: the summed forward losses
// and two metrics of the preference losses (engine/preference.h), at the slots the backend's
// loss ops write (engine/backend.h: acc[0], acc[2], acc[3]; slot 1 is not used).
enum { MODEL_STAT_LOSS = 0, MODEL_STAT_PREF_A = 2, MODEL_STAT_PREF_B = 3, MODEL_N_STATS = 4 };

// What forward and backward tell an executor, each hook given ctx and a range [first, end) of
// parameter indices (NULL: not called). The ranges are the head (final norm, untied lm_head),
// each block, and the embedding; they tile the table. weights_needed: forward is about to read
// those weights (embedding, block 0, ..., block L-1, head): lets an executor gather them just
// in time. grads_ready: backward has finished those gradients (head, block L-1, ..., block 0,
// embedding): lets an executor start reducing them while backward goes on.
typedef struct {
    void (*weights_needed)(void *ctx, int first, int end);
    void (*grads_ready)(void *ctx, int first, int end);
    void *ctx;
} ModelHooks;

// Generation's KV cache (engine/generate.h): every layer's keys (after RoPE and qk-norm, as
// attention reads them) and values of B sequences, max_len positions each.
typedef struct {
    int B, max_len;
    size_t layer_elems; // B * max_len * KVH * D: one layer's keys (its values follow them)
    void *kv;           // backend (L, 2, B, max_len, KVH, D) compute dtype
    int32_t *span;      // backend (2,B): the keys each decoded query sees (attention_decode)
    int32_t *host_span; // host (2,B), its staging
    const int32_t *pos; // host (B) the positions being decoded; NULL while prefilling
} KvCache;

// Flat buffers of model_acquire / model_release.
enum { MODEL_WEIGHTS = 1, MODEL_MASTER = 2, MODEL_GRADS = 4 };

typedef struct {
    ModelConfig cfg;
    const Backend *be;
    ParamSpec *params; // n_params entries
    int n_params;
    size_t num_floats;       // total parameter count
    void *weights;           // (num_floats,) compute dtype, read by forward/backward
    float *master;           // (num_floats,) fp32; == weights when the compute dtype is fp32
    float *grads;            // (num_floats,) fp32, accumulated by model_backward
    double *stats;           // (MODEL_N_STATS,) backend: MODEL_STAT_* sums read once a step
    bool grad_checkpointing; // keep only each block's input; recompute the block in backward
    // NEFTune: forward adds N(0, (neftune_alpha / sqrt(T))^2) noise to the input embeddings,
    // drawn from the stream noise_seed (the caller sets both per training forward; 0: none).
    float neftune_alpha;
    uint64_t noise_seed;
    ModelHooks hooks; // set by model_set_hooks only
    // A pipeline stage (docs/design.md §13) holds the decoder blocks [first_block, end_block)
    // of cfg, the embedding when first_block is 0 and the final norm and head when end_block is
    // cfg.num_hidden_layers (a whole model holds all of them). With tied embeddings a last stage
    // without the embedding holds its own copy of embed_tokens.weight as the head, which the
    // pipeline keeps equal to the first stage's.
    int first_block, end_block;
    bool has_embed, has_head;
    // A stage without the embedding starts forward from stage_input: (B*T, C) compute dtype,
    // the previous stage's output; a stage without the head starts backward from stage_dout:
    // (B*T, C), d loss / d its output. Backend memory the caller sets before each call.
    const void *stage_input, *stage_dout;
    // MoE: the (token, choice) pairs each routed expert received, (num_hidden_layers, E), summed
    // over the forwards since model_reset_expert_tokens (a block's recomputation under gradient
    // checkpointing does not count again); zeros for blocks the stage does not hold. NULL
    // without MoE.
    int64_t *expert_tokens;
    // Expert parallelism (engine/expert_group.h, model_set_expert_group); size 0 or 1: every
    // routed expert is computed here.
    ExpertGroup experts;
    // The first failure of the expert group's exchanges since model_take_fault: forward reports
    // it itself; backward, which returns nothing, leaves it for its caller.
    bool faulted;
    Err fault;
    KvCache *cache; // set by model_prefill / model_decode for their forward only
    ModelPlan *plan;
    ModelActs *acts;      // the activation set forward and backward use (model_select_acts)
    ModelActs **act_sets; // n_act_sets, each sized for the largest (B,T) it has seen
    int n_act_sets;
} Model;

// The grads_ready ranges in the order model_backward completes them: ranges[k] = [first,
// end); returns how many (num_hidden_layers + 2). ranges must hold that many.
int model_grad_ranges(const Model *m, int (*ranges)[2]);

// Installs the hooks forward and backward call from now on (NULL: none).
void model_set_hooks(Model *m, const ModelHooks *hooks);

int model_create(Model *m, const ModelConfig *cfg, const Backend *be, Err *err);
// The pipeline stage of the blocks [first_block, end_block) (0 <= first < end <= layers).
int model_create_stage(Model *m, const ModelConfig *cfg, int first_block, int end_block,
                       const Backend *be, Err *err);
// The parameter table of a stage without a model: model_stage_table (engine/param_table.h).
// Whether m is a part of the model (a pipeline stage) rather than all of it.
bool model_is_stage(const Model *m);

// Splits the routed experts of every MoE layer over the expert group g (g->size divides
// n_routed_experts): from now on forward and backward exchange pairs with the group's other
// ranks, so every rank of the group must run the same forwards and backwards in the same order.
int model_set_expert_group(Model *m, const ExpertGroup *g, Err *err);
// The first failure of an exchange of the expert group since the last call (a backward's, which
// cannot return it): -1 with err set; 0 when there was none.
int model_take_fault(Model *m, Err *err);

// Pipelines keep several micro-batches' activations at once: forward and backward use set k
// from now on (created empty on first use; a backward uses the set of its forward).
int model_select_acts(Model *m, int k, Err *err);
// Of the current set: the last forward's output of the stage's last block, (B*T, C) compute
// dtype (what the next stage receives), and after a backward d loss / d the stage's input,
// (B*T, C) (what the previous stage receives).
const void *model_stage_output(const Model *m);
const void *model_stage_dinput(const Model *m);
// Backend bytes of every activation set (the pipeline's held micro-batches).
size_t model_activation_bytes(const Model *m);
void model_free(Model *m);

const ParamSpec *model_param(const Model *m, const char *name);
// The whole model as the optimizer sees it.
ParamView model_view(const Model *m);

// AstrAI init: N(0, 0.02); o_proj and mlp.down N(0, 0.02/sqrt(2*n_layers)); an expert's down N(0,
// 0.02/sqrt(2*n_layers*(1/max(S,1) + 1/k))) (docs/design.md §7a); norms 1.
int model_init_random(Model *m, uint64_t seed, Err *err);

// Loads the master weights from a safetensors file (bf16/f16/f32) and refreshes the
// compute weights. A missing tensor, an unexpected tensor or a wrong shape is an error
// naming it. With tied embeddings a present lm_head.weight is ignored. A stage reads its own
// tensors of a whole model's file (the others' are expected there, not read).
int model_load(Model *m, const char *safetensors_path, Err *err);
// model_load from an open file or sharded set (ckpt/shards.h); path names it in errors.
int model_load_st(Model *m, const StFile *f, const char *path, Err *err);
// Writes the master weights, one tensor at a time through host memory.
int model_save(const Model *m, const char *safetensors_path, DType dtype, Err *err);
// Writes the tensors of several parameter views (the stages of a pipeline, in order) as one
// file; a name already written (a tied head's copy) is written once.
int model_save_views(const ParamView *views, int n_views, const char *safetensors_path, DType dtype,
                     Err *err);
// weights = master in the compute dtype (after the optimizer stepped the master); no-op in fp32.
void model_refresh_weights(Model *m);

// Forward pass with loss.
//   inputs, targets: (B,T) token ids (host memory); targets may be NULL (logits only)
//   loss_mask: (B,T) 0/1 or NULL (all tokens count); the loss is the mean over
//              counted tokens (AstrAI: cross_entropy with ignore_index)
//   position_ids: (B,T) or NULL (positions 0..T-1); when given, a document starts
//              where pos[t] <= pos[t-1] and attention stays inside documents
// model_forward_accumulate adds the mean loss into stats[0] on the backend (nothing is
// read back); model_forward also reads it back: it returns the mean loss (0 when targets
// is NULL or no token counts), or NaN with err set (bad ids, shapes, memory).
int model_forward_accumulate(Model *m, const int32_t *inputs, const int32_t *targets,
                             const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                             float label_smoothing, Err *err);
float model_forward(Model *m, const int32_t *inputs, const int32_t *targets,
                    const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                    float label_smoothing, Err *err);

// The forward pass with the per-token loss and no mean: model_token_nll then holds (B*T) fp32
// -log p(target) of each counted token (0 elsewhere) on the backend, for a loss built from
// them (DPO, GRPO) whose gradient model_backward_weighted takes. Positions are 0..T-1 per row.
int model_forward_tokens(Model *m, const int32_t *inputs, const int32_t *targets,
                         const int32_t *loss_mask, int B, int T, Err *err);
const float *model_token_nll(const Model *m);
// (B*T) 0/1 on the backend: the tokens counted by the last forward.
const int32_t *model_token_mask(const Model *m);

// Reads stats (MODEL_STAT_*) in one transfer and resets them.
void model_read_stats(Model *m, double out[MODEL_N_STATS]);

// Logits of the last forward: (B,T,V) fp32 into host memory.
void model_logits(const Model *m, float *host);

// Backward of the last forward's loss multiplied by loss_scale (1/grad_accum_steps);
// gradients are ADDED into m->grads.
void model_backward(Model *m, float loss_scale);
// Backward of a loss L(nll) of the last model_forward_tokens: token_scale (B*T, backend fp32)
// holds d L / d nll per token (any loss scale included); gradients are ADDED.
void model_backward_weighted(Model *m, const float *token_scale);

void model_zero_grad(Model *m);

// ---------------------------------------------------------------- generation (engine/generate.h)
// A whole model (no pipeline stage) without expert parallelism, on a backend with
// attention_decode; errors name what is missing. The forwards below use the current activation
// set, add no NEFTune noise and do not count expert loads.

// A cache of B sequences of up to max_len positions (max_len <= max_position_embeddings).
int model_cache_create(const Model *m, KvCache *c, int B, int max_len, Err *err);
void model_cache_free(const Model *m, KvCache *c); // takes a zeroed or freed cache too

// The forward of B sequences, right-padded to T: tokens (B,T) host, lens (B) their lengths (1..T;
// positions 0..T-1, causal, so a sequence never sees its padding). logits: (B,V) host fp32, the
// last real position's of each. With a cache (c->B == B, T <= c->max_len) every layer's keys
// and values of positions [0, T) are stored in it; c NULL: the plain forward (generation
// without a cache recomputes the whole sequences every step).
int model_prefill(Model *m, KvCache *c, const int32_t *tokens, const int *lens, int B, int T,
                  float *logits, Err *err);
// One token per sequence: tokens (B), pos (B) host, sequence b's token at position pos[b] <
// c->max_len, whose positions [0, pos[b]) the cache holds; stores its keys and values at pos[b]
// and attends over them (the sliding window's part of them). logits: (B,V) host fp32.
int model_decode(Model *m, KvCache *c, const int32_t *tokens, const int32_t *pos, float *logits,
                 Err *err);

void model_reset_expert_tokens(Model *m);

// FSDP and checkpoints hold full buffers only while they need them: model_release frees
// the chosen buffers (pointers become NULL), model_acquire allocates the missing ones
// (zeroed). With an fp32 compute dtype MODEL_WEIGHTS and MODEL_MASTER are one buffer.
int model_acquire(Model *m, int which, Err *err);
void model_release(Model *m, int which);
