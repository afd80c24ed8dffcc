// param_table.h: the model's parameter table (docs/design.md §7) from its config alone: the
// named tensors of blocks [first, end) in AstrAI key order, with their offsets into the flat
// buffers that engine/model.h's Model, the optimizer and the collectives work on.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "model/config.h"

typedef struct {
    char name[96]; // AstrAI key, e.g. "layers.0.attention.q_proj.weight"
    int ndim;      // 1 or 2
    int64_t shape[2];
    size_t offset; // in elements, into the flat buffers
    size_t numel;
} ParamSpec;

// Parameter indices inside one layer, in AstrAI key order (-1: absent). q_proj comes first in
// every layer. GQA: q_proj, k_proj, v_proj adjacent (one (H+2K)*D x C block). MLA: q_proj,
// kv_a_proj, kv_norm, kv_b_proj. MLP: mlp_up, mlp.gate (adjacent), mlp_down. MoE: the router,
// then each expert's up, gate, down (3 tensors, up and gate adjacent): shared expert s at
// shared_experts + 3s, routed expert e at routed_experts + 3e.
typedef struct {
    int q_proj, qkv_bias, o_proj, o_bias, q_norm, k_norm, gate, input_norm, post_norm, mlp_up,
        mlp_down;
    int kv_a_proj, kv_norm, kv_b_proj;
    int router, shared_experts, routed_experts;
} LayerParams;

// 0 when [first, end) is a stage of cfg's blocks; else an error naming it.
int param_table_check_stage(const ModelConfig *cfg, int first, int end, Err *err);

// The table of the stage of blocks [first_block, end_block) (0 <= first < end <= layers):
// *params (malloc'ed, *n entries, offsets into a flat buffer of *num_floats), layer[l] filled
// for its blocks (layer holds num_hidden_layers), ends[] the indices of the embedding, the
// final norm and the head (-1 where the stage has none; a tied head is the embedding's index
// when the stage holds it). On failure *params is NULL.
int param_table_fill(const ModelConfig *cfg, int first_block, int end_block, LayerParams *layer,
                     ParamSpec **params, int *n, size_t *num_floats, int ends[3], Err *err);

// The table's grads_ready ranges (engine/model.h model_grad_ranges) in the order backward
// completes them: the final norm and head, each block from the last, the embedding (those the
// stage holds); layer and ends as param_table_fill gave them. Returns how many (at most
// end_block - first_block + 2 entries of ranges).
int param_table_grad_ranges(const ModelConfig *cfg, int first_block, int end_block,
                            const LayerParams *layer, const int ends[3], int n_params,
                            int (*ranges)[2]);

// The same table without the layer indices, as model_create_stage lays it out.
int model_stage_table(const ModelConfig *cfg, int first_block, int end_block, ParamSpec **params,
                      int *n, size_t *num_floats, Err *err);

// The parameters one token computes with, of a model of `total` parameters: all of them, less the
// (E - k) routed experts of each MoE layer it is not routed to.
size_t model_active_params(const ModelConfig *cfg, size_t total);

// Whether Muon steps p under OPT_MUON (else AdamW does; engine/optim.h): what the optimizer's
// state holds for p, which astraid's preflight sizes without an optimizer.
bool optim_muon_owns(const ParamSpec *p);
