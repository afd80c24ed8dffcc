// param_table.c: the model's parameter table (docs/design.md §7): the named tensors of a model
// or of a pipeline stage, in AstrAI key order, with their offsets into the flat buffers. It
// needs only the config, so what plans without a model (astraid's preflight) links no
// backend.
#include "engine/param_table.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// A table being built: the tensors of blocks [first, end) of cfg and the ends the stage holds.
typedef struct {
    const ModelConfig *cfg;
    ParamSpec *params;
    int n, cap;
    size_t num_floats;
} Table;

static int add_param(Table *t, const char *name, int64_t rows, int64_t cols) {
    if (t->n == t->cap) return -1;
    ParamSpec *p = &t->params[t->n];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = cols ? 2 : 1;
    p->shape[0] = rows;
    p->shape[1] = cols;
    p->numel = (size_t)rows * (size_t)(cols ? cols : 1);
    p->offset = t->num_floats;
    t->num_floats += p->numel;
    return t->n++;
}

// "layers.<l>.<key>.weight" of rows x cols (cols 0: a vector).
static int add_layer_param(Table *t, int l, const char *key, int64_t rows, int64_t cols) {
    char name[96];
    snprintf(name, sizeof name, "layers.%d.%s.weight", l, key);
    return add_param(t, name, rows, cols);
}

// GQA's projections: q_proj, k_proj, v_proj adjacent, then their biases (one (QKV) vector).
static int add_gqa_projections(Table *t, int l, LayerParams *lp) {
    const ModelConfig *c = t->cfg;
    int C = c->hidden_size, KV = c->num_key_value_heads * c->head_dim;
    lp->q_proj = add_layer_param(t, l, "attention.q_proj", C, C);
    int k_proj = add_layer_param(t, l, "attention.k_proj", KV, C);
    int v_proj = add_layer_param(t, l, "attention.v_proj", KV, C);
    lp->qkv_bias = -1;
    if (c->attention_bias) { // q|k|v biases adjacent: one (QKV) vector (header)
        char name[96];
        snprintf(name, sizeof name, "layers.%d.attention.q_proj.bias", l);
        lp->qkv_bias = add_param(t, name, C, 0);
        snprintf(name, sizeof name, "layers.%d.attention.k_proj.bias", l);
        add_param(t, name, KV, 0);
        snprintf(name, sizeof name, "layers.%d.attention.v_proj.bias", l);
        if (add_param(t, name, KV, 0) < 0) return -1;
    }
    return lp->q_proj < 0 || k_proj < 0 || v_proj < 0 ? -1 : 0;
}

// The q and k norms, in the order of AstrAI's module (after q_proj in MLA, after o_proj in GQA).
static int add_qk_norms(Table *t, int l, LayerParams *lp) {
    int D = t->cfg->head_dim;
    lp->q_norm = lp->k_norm = -1;
    if (!t->cfg->use_qk_norm) return 0;
    lp->q_norm = add_layer_param(t, l, "attention.q_norm", D, 0);
    lp->k_norm = add_layer_param(t, l, "attention.k_norm", D, 0);
    return lp->k_norm < 0 ? -1 : 0;
}

// The attention's tensors (docs/design.md §7, §7a), in AstrAI's order.
static int add_attention(Table *t, int l, LayerParams *lp) {
    const ModelConfig *c = t->cfg;
    int C = c->hidden_size, HD = c->num_attention_heads * c->head_dim, R = c->kv_lora_rank;
    lp->kv_a_proj = lp->kv_norm = lp->kv_b_proj = -1;
    if (c->attn_type == ATTN_MLA) {
        lp->qkv_bias = -1;
        if ((lp->q_proj = add_layer_param(t, l, "attention.q_proj", HD, C)) < 0 ||
            add_qk_norms(t, l, lp) ||
            (lp->kv_a_proj = add_layer_param(t, l, "attention.kv_a_proj", R, C)) < 0 ||
            (lp->kv_norm = add_layer_param(t, l, "attention.kv_norm", R, 0)) < 0 ||
            (lp->kv_b_proj =
                 add_layer_param(t, l, "attention.kv_b_proj",
                                 (int64_t)c->num_key_value_heads * 2 * c->head_dim, R)) < 0)
            return -1;
    } else if (add_gqa_projections(t, l, lp)) {
        return -1;
    }
    lp->o_proj = add_layer_param(t, l, "attention.o_proj", C, HD);
    lp->o_bias = -1;
    if (c->o_proj_bias) {
        char name[96];
        snprintf(name, sizeof name, "layers.%d.attention.o_proj.bias", l);
        if ((lp->o_bias = add_param(t, name, C, 0)) < 0) return -1;
    }
    if (c->attn_type == ATTN_GQA && add_qk_norms(t, l, lp)) return -1;
    lp->gate = -1;
    if (c->use_gated_attention && (lp->gate = add_layer_param(t, l, "attention.gate", C, C)) < 0)
        return -1;
    return lp->o_proj < 0 ? -1 : 0;
}

// One SwiGLU MLP "<prefix>.{up,gate,down}"; returns the index of its up.
static int add_swiglu(Table *t, int l, const char *prefix) {
    const ModelConfig *c = t->cfg;
    int C = c->hidden_size, FF = c->intermediate_size;
    char key[64];
    snprintf(key, sizeof key, "%s.up", prefix);
    int up = add_layer_param(t, l, key, FF, C);
    snprintf(key, sizeof key, "%s.gate", prefix);
    add_layer_param(t, l, key, FF, C);
    snprintf(key, sizeof key, "%s.down", prefix);
    return add_layer_param(t, l, key, C, FF) < 0 ? -1 : up;
}

// The feed-forward's tensors: one MLP, or DeepSeekMoE's router and experts.
static int add_ffn(Table *t, int l, LayerParams *lp) {
    const ModelConfig *c = t->cfg;
    lp->router = lp->shared_experts = lp->routed_experts = lp->mlp_up = lp->mlp_down = -1;
    if (c->ffn_type == FFN_MLP) {
        if ((lp->mlp_up = add_swiglu(t, l, "mlp")) < 0) return -1;
        lp->mlp_down = lp->mlp_up + 2;
        return 0;
    }
    if ((lp->router = add_layer_param(t, l, "mlp.router", c->n_routed_experts, c->hidden_size)) < 0)
        return -1;
    char prefix[64];
    for (int s = 0; s < c->n_shared_experts; s++) {
        snprintf(prefix, sizeof prefix, "mlp.shared_experts.%d", s);
        int up = add_swiglu(t, l, prefix);
        if (up < 0) return -1;
        if (s == 0) lp->shared_experts = up;
    }
    for (int e = 0; e < c->n_routed_experts; e++) {
        snprintf(prefix, sizeof prefix, "mlp.routed_experts.%d", e);
        int up = add_swiglu(t, l, prefix);
        if (up < 0) return -1;
        if (e == 0) lp->routed_experts = up;
    }
    return 0;
}

static int add_layer_params(Table *t, int l, LayerParams *lp) {
    const ModelConfig *c = t->cfg;
    if (add_attention(t, l, lp)) return -1;
    lp->input_norm = add_layer_param(t, l, "input_norm", c->hidden_size, 0);
    lp->post_norm = add_layer_param(t, l, "post_attention_norm", c->hidden_size, 0);
    return lp->post_norm < 0 ? -1 : add_ffn(t, l, lp);
}

// The most tensors a layer of c holds: 16 of the attention and norms, 3 per expert.
static int layer_capacity(const ModelConfig *c) {
    return 16 + 3 * (c->ffn_type == FFN_MOE ? c->n_routed_experts + c->n_shared_experts : 1) + 1;
}

// The tensors of blocks [first, end), in AstrAI key order: the embedding when first is 0, the
// final norm and head when end is the last block (a tied head without the embedding: its copy,
// under the embedding's name). layer (num_hidden_layers) and the ends' indices are filled.
static int fill_table(Table *t, int first, int end, LayerParams *layer, int ends[3], Err *err) {
    const ModelConfig *c = t->cfg;
    int V = c->vocab_size, C = c->hidden_size;
    t->cap = 3 + layer_capacity(c) * (end - first);
    if (!(t->params = calloc((size_t)t->cap, sizeof *t->params)))
        return err_resource(err, "model: out of memory for the table of %d parameters", t->cap);
    ends[0] = ends[1] = ends[2] = -1;
    if (first == 0) ends[0] = add_param(t, "embed_tokens.weight", V, C);
    for (int l = first; l < end; l++)
        if (add_layer_params(t, l, &layer[l])) return err_set(err, "model: table full");
    if (end < c->num_hidden_layers) return 0;
    ends[1] = add_param(t, "norm.weight", C, 0);
    ends[2] =
        c->tie_word_embeddings && first == 0
            ? ends[0]
            : add_param(t, c->tie_word_embeddings ? "embed_tokens.weight" : "lm_head.weight", V, C);
    return 0;
}

int param_table_check_stage(const ModelConfig *c, int first, int end, Err *err) {
    if (first < 0 || end <= first || end > c->num_hidden_layers)
        return err_set(err, "model: stage of blocks [%d, %d) outside the %d blocks", first, end,
                       c->num_hidden_layers);
    return 0;
}

int param_table_fill(const ModelConfig *cfg, int first_block, int end_block, LayerParams *layer,
                     ParamSpec **params, int *n, size_t *num_floats, int ends[3], Err *err) {
    *params = NULL;
    if (param_table_check_stage(cfg, first_block, end_block, err)) return -1;
    Table t = {.cfg = cfg};
    if (fill_table(&t, first_block, end_block, layer, ends, err)) {
        free(t.params);
        return -1;
    }
    *params = t.params;
    *n = t.n;
    *num_floats = t.num_floats;
    return 0;
}

int model_stage_table(const ModelConfig *cfg, int first_block, int end_block, ParamSpec **params,
                      int *n, size_t *num_floats, Err *err) {
    *params = NULL;
    LayerParams *layer = calloc((size_t)cfg->num_hidden_layers, sizeof *layer);
    if (!layer) return err_resource(err, "model: out of memory for the layer table");
    int ends[3];
    int rc = param_table_fill(cfg, first_block, end_block, layer, params, n, num_floats, ends, err);
    free(layer);
    return rc;
}

size_t model_active_params(const ModelConfig *c, size_t total) {
    if (c->ffn_type != FFN_MOE) return total;
    size_t expert = 3 * (size_t)c->intermediate_size * (size_t)c->hidden_size;
    return total - (size_t)c->num_hidden_layers *
                       (size_t)(c->n_routed_experts - c->n_activated_experts) * expert;
}

// MuonMix: Muon for 2-D weights whose names contain none of norm/bias/embed/lm_head.
bool optim_muon_owns(const ParamSpec *p) {
    return p->ndim == 2 && !strstr(p->name, "norm") && !strstr(p->name, "bias") &&
           !strstr(p->name, "embed") && !strstr(p->name, "lm_head");
}

int param_table_grad_ranges(const ModelConfig *cfg, int first_block, int end_block,
                            const LayerParams *layer, const int ends[3], int n_params,
                            int (*ranges)[2]) {
    int n = 0;
    bool head = end_block == cfg->num_hidden_layers;
    if (head) ranges[n][0] = ends[1], ranges[n++][1] = n_params;
    for (int l = end_block - 1; l >= first_block; l--) {
        int next = l + 1 < end_block ? layer[l + 1].q_proj : head ? ends[1] : n_params;
        ranges[n][0] = layer[l].q_proj, ranges[n++][1] = next;
    }
    if (first_block == 0) ranges[n][0] = ends[0], ranges[n++][1] = ends[0] + 1;
    return n;
}
