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

static int add_layer_params(Table *t, int l, LayerParams *lp) {
    const ModelConfig *c = t->cfg;
    int C = c->hidden_size, D = c->head_dim, KV = c->num_key_value_heads * D;
    char name[96];
#define LAYER_PARAM(field, key, rows, cols)                                                        \
    snprintf(name, sizeof name, "layers.%d.%s.weight", l, key);                                    \
    field = add_param(t, name, rows, cols)
    int k_proj, v_proj, mlp_gate;
    LAYER_PARAM(lp->q_proj, "attention.q_proj", C, C);
    LAYER_PARAM(k_proj, "attention.k_proj", KV, C);
    LAYER_PARAM(v_proj, "attention.v_proj", KV, C);
    lp->qkv_bias = -1;
    if (c->attention_bias) { // q|k|v biases adjacent: one (QKV) vector (header)
        snprintf(name, sizeof name, "layers.%d.attention.q_proj.bias", l);
        lp->qkv_bias = add_param(t, name, C, 0);
        snprintf(name, sizeof name, "layers.%d.attention.k_proj.bias", l);
        add_param(t, name, KV, 0);
        snprintf(name, sizeof name, "layers.%d.attention.v_proj.bias", l);
        if (add_param(t, name, KV, 0) < 0) return -1;
    }
    LAYER_PARAM(lp->o_proj, "attention.o_proj", C, C);
    lp->o_bias = -1;
    if (c->o_proj_bias) {
        snprintf(name, sizeof name, "layers.%d.attention.o_proj.bias", l);
        if ((lp->o_bias = add_param(t, name, C, 0)) < 0) return -1;
    }
    lp->q_norm = lp->k_norm = lp->gate = -1;
    if (c->use_qk_norm) {
        LAYER_PARAM(lp->q_norm, "attention.q_norm", D, 0);
        LAYER_PARAM(lp->k_norm, "attention.k_norm", D, 0);
    }
    if (c->use_gated_attention) {
        LAYER_PARAM(lp->gate, "attention.gate", C, C);
    }
    LAYER_PARAM(lp->input_norm, "input_norm", C, 0);
    LAYER_PARAM(lp->post_norm, "post_attention_norm", C, 0);
    LAYER_PARAM(lp->mlp_up, "mlp.up", c->intermediate_size, C);
    LAYER_PARAM(mlp_gate, "mlp.gate", c->intermediate_size, C);
    LAYER_PARAM(lp->mlp_down, "mlp.down", C, c->intermediate_size);
#undef LAYER_PARAM
    return lp->mlp_down < 0 || k_proj < 0 || v_proj < 0 || mlp_gate < 0 ? -1 : 0;
}

// The tensors of blocks [first, end), in AstrAI key order: the embedding when first is 0, the
// final norm and head when end is the last block (a tied head without the embedding: its copy,
// under the embedding's name). layer (num_hidden_layers) and the ends' indices are filled.
static int fill_table(Table *t, int first, int end, LayerParams *layer, int ends[3], Err *err) {
    const ModelConfig *c = t->cfg;
    int V = c->vocab_size, C = c->hidden_size;
    t->cap = 3 + 16 * (end - first); // a layer holds at most 16 tensors
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

// MuonMix: Muon for 2-D weights whose names contain none of norm/bias/embed/lm_head.
bool optim_muon_owns(const ParamSpec *p) {
    return p->ndim == 2 && !strstr(p->name, "norm") && !strstr(p->name, "bias") &&
           !strstr(p->name, "embed") && !strstr(p->name, "lm_head");
}
