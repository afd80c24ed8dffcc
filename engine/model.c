// model.c: the AstrAI autoregressive LM (docs/design.md §7): parameter table, init, load/save,
// forward with loss and backward, orchestrated over the ops of engine/backend.h.
//
// Layout tricks that keep the big matmuls big (one GEMM over all B*T rows):
// - q_proj, k_proj, v_proj are adjacent in the flat weights, so one matmul with the
//   (H+2*KVH)*D x C block gives qkv: (N, QKV) rows [q | k | v]; rope, qk-norm and
//   attention work on it in place through a token stride.
// - mlp.up and mlp.gate are adjacent too: one matmul gives h: (N, 2FF) rows [up | gate].
// - The q, k, v biases (attention_bias) are adjacent as well: one (QKV) vector added to the
//   qkv rows as a rank-1 matmul, ones: (N,1) @ bias: (QKV,1)^T, and its gradient is that
//   matmul's weight gradient, so every backend's GEMM serves and no bias op is needed;
//   o_proj's bias (o_proj_bias) the same way.
// - The attention mask is one number per token: the first key it sees (its document's start,
//   or the sliding window's, whichever is later), built on the host with the batch.
//
// Generation (model_prefill, model_decode) runs this forward with a KV cache: each layer stores
// its k, v rows there, and a decode step (one row per sequence) attends over the cache.
//
// Activations of a block live in a slot: slot l for block l, or one shared slot 0 with
// gradient checkpointing, where only the block inputs (res) are kept and backward runs
// the block's forward again into slot 0 first (same ops, same bits).
#include "engine/model.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/half.h"
#include "engine/backend.h"
#include "engine/rng.h"

// The batch as uploaded: BATCH_FIELDS int32 arrays of N, one after the other.
enum {
    BATCH_INPUTS,
    BATCH_TARGETS,
    BATCH_MASK,
    BATCH_POS,
    BATCH_DOC_START,
    BATCH_BY_ID,
    BATCH_FIELDS
};

// What every activation set shares.
struct ModelPlan {
    float *rope;              // (max_position_embeddings, head_dim/2, 2) cos, sin
    LayerParams *layer;       // (num_hidden_layers), filled for the blocks the model holds
    int embed, norm, lm_head; // parameter indices, -1 where the stage has none (lm_head = embed
                              // when tied and the model holds the embedding)
    int32_t *host_counts;     // (vocab_size + 1) counting sort of ids (by_id)
};

// Expert parallelism (engine/expert_group.h), one slot's: the rows this rank's experts received,
// in expert order, and what backward needs to move their gradients back.
typedef struct {
    int32_t *from;            // host (size, El) pairs each rank of the group sent per local expert
    int32_t *per_expert;      // host (El) their sum per local expert
    size_t rows, cap;         // pairs received; rows the buffers below hold
    int32_t *order, *inverse; // backend (cap) expert_order's
    void *x, *h, *act;        // backend (cap, C), (cap, 2FF), (cap, FF)
} ExpertSlot;

// One micro-batch's activations. Tensors of the compute dtype are `void *` (bytes through at());
// fp32 ones `float *`. Block l's tensors are at index l - first_block.
struct ModelActs {
    size_t capacity; // token rows the buffers below hold
    int B, T;
    int has_loss;
    float label_smoothing, counted;
    int32_t *host_batch; // (BATCH_FIELDS, N) host staging of the batch
    int32_t *batch;      // (BATCH_FIELDS, N) on the backend
    int32_t *inputs, *targets, *mask, *pos, *doc_start, *by_id; // (N) views into batch
    void *ones;                                                 // (N) 1s (the biases)
    // per slot S (L slots, or 1 with gradient checkpointing): what backward needs
    void *res;            // (L+1, N, C) block inputs: res[L] is the last block's output (L: the
                          // stage's blocks)
    void *ln1;            // (S,N,C)
    float *rstd1;         // (S,N)
    void *qkv;            // (S,N,QKV) after rope (qk-norm after RoPE, or none), else before
    void *qkn;            // (S,N,QKV) q,k after qk-norm (and RoPE when it comes second)
    float *rstdq, *rstdk; // (S,N,H), (S,N,KVH)
    void *att;            // (S,N,C)
    float *lse;           // (S,B,H,T)
    void *gate, *gated;   // (S,N,C) gate pre-activation and att * sigmoid(gate)
    void *mid, *ln2;      // (S,N,C), (S,N,C)
    float *rstd2;         // (S,N)
    void *h, *act;        // (S,M,N,2FF), (S,M,N,FF): the M dense MLPs (1, or MoE's shared ones)
    // MLA, per slot: kv_a_proj's output, kv_norm's output and its rstd
    void *kva, *kvc; // (S,N,R), (S,N,R)
    float *rstdkv;   // (S,N)
    // MoE, per slot (P = N*k (token, choice) pairs, in expert order: engine/backend.h moe_route)
    void *rlogits;                      // (S,N,E) the router's output
    float *probs, *topw;                // (S,N,E), (S,N*k)
    int32_t *topi, *token_of, *pair_of; // (S,N*k) each: expert, token of pair, pair of choice
    int32_t *counts;                    // (S,E) pairs per expert (backend)
    int32_t *host_counts;               // (S,E) the same on the host (drives the GEMMs)
    void *xp, *hp, *actp, *yp;          // (S,P,C), (S,P,2FF), (S,P,FF), (S,P,C)
    void *lnf, *logits;                 // (N,C), (N,V)
    float *rstdf, *lse_ce, *loss_rows;  // (N), (N), (N)
    // scratch, reused by every layer: MLA's projections (N, max(H*D, K*2D)), MoE's shared sum
    void *proj, *shared_sum;
    // backward scratch, reused by every layer
    void *dres, *dln, *dqkv, *dqkn, *dgated, *datt, *dgate, *dh, *dact, *dlogits;
    void *dkvc, *dkva;                              // (N,R) MLA
    void *drows, *dhp, *dactp, *drlogits, *dshared; // (P,C), (P,2FF), (P,FF), (N,E), (N,C) MoE
    float *dtopw;                                   // (P) MoE
    // Expert parallelism: per slot (S), and the exchanges' scratch, reused by every layer:
    // send, recv, y (the experts' outputs, in backward their gradients): (cap, C); dh, dact:
    // (cap, 2FF), (cap, FF); from: backend (size, El) the counts received; bytes: host (2, size).
    ExpertSlot *ep;
    int ep_slots;
    void *ep_send, *ep_recv, *ep_y, *ep_dh, *ep_dact;
    size_t ep_cap;
    int32_t *ep_from;
    size_t *ep_bytes;
};

// Element i of a compute-dtype buffer.
static void *at(const Model *m, const void *base, size_t i) {
    return (char *)base + i * dtype_size(m->be->dtype);
}

// ---------------------------------------------------------------- parameter table

static int build_param_table(Model *m, Err *err) {
    ModelPlan *pl = m->plan;
    if (!(pl->layer = calloc((size_t)m->cfg.num_hidden_layers, sizeof *pl->layer)))
        return err_resource(err, "model: out of memory for the layer table");
    int ends[3];
    int rc = param_table_fill(&m->cfg, m->first_block, m->end_block, pl->layer, &m->params,
                              &m->n_params, &m->num_floats, ends, err);
    pl->embed = ends[0];
    pl->norm = ends[1];
    pl->lm_head = ends[2];
    return rc;
}

// Llama 3's frequency rescaling (transformers' _compute_llama3_parameters): wavelengths
// past original/low_freq_factor slow down by factor, those under original/high_freq_factor
// stay, the band between is interpolated.
static double llama3_frequency(double theta, const RopeScaling *rs) {
    double orig = rs->original_max_position_embeddings, wavelen = 2.0 * M_PI / theta;
    if (wavelen < orig / rs->high_freq_factor) return theta;
    if (wavelen > orig / rs->low_freq_factor) return theta / rs->factor;
    double smooth =
        (orig / wavelen - rs->low_freq_factor) / (rs->high_freq_factor - rs->low_freq_factor);
    return (1.0 - smooth) * theta / rs->factor + smooth * theta;
}

// The RoPE base: rope_theta, or under NTK scaling (AstrAI's ntk_base) base * factor^(d/(d-2)),
// d the rotated dimension.
static double rope_base(const ModelConfig *c) {
    double d = c->rope_dim;
    if (c->rope_scaling.kind != ROPE_SCALING_NTK) return c->rope_theta;
    return c->rope_theta * pow(c->rope_scaling.factor, d / (d - 2.0));
}

// cos/sin of position * base^(-2i/d) over the rotated dimensions d (rope_dim) as AstrAI computes
// them (angle in fp64, then fp32), the frequencies rescaled first where rope_scaling says so.
static void fill_rope_table(float *table, const ModelConfig *c) {
    int half = c->rope_dim / 2;
    double base = rope_base(c);
    for (int p = 0; p < c->max_position_embeddings; p++)
        for (int i = 0; i < half; i++) {
            double theta = pow(base, -2.0 * i / c->rope_dim);
            if (c->rope_scaling.kind == ROPE_SCALING_LLAMA3)
                theta = llama3_frequency(theta, &c->rope_scaling);
            float angle = (float)(p * theta);
            table[((size_t)p * half + i) * 2] = cosf(angle);
            table[((size_t)p * half + i) * 2 + 1] = sinf(angle);
        }
}

// ---------------------------------------------------------------- buffers

static bool weights_are_master(const Model *m) {
    return m->be->dtype == DT_F32;
}

// With an fp32 compute dtype the weights and the master are one buffer.
static int joint(const Model *m, int which) {
    if (weights_are_master(m) && (which & (MODEL_WEIGHTS | MODEL_MASTER)))
        which |= MODEL_WEIGHTS | MODEL_MASTER;
    return which;
}

int model_acquire(Model *m, int which, Err *err) {
    const Backend *be = m->be;
    size_t n = m->num_floats;
    which = joint(m, which);
    if ((which & MODEL_MASTER) && !m->master) {
        if (!(m->master = be->alloc(n * sizeof(float), err)))
            return err_prefix(err, "model: %zu master weights", n);
        if (weights_are_master(m)) m->weights = m->master;
    }
    if ((which & MODEL_WEIGHTS) && !m->weights &&
        !(m->weights = be->alloc(n * dtype_size(be->dtype), err)))
        return err_prefix(err, "model: %zu %s weights", n, dtype_name(be->dtype));
    if ((which & MODEL_GRADS) && !m->grads && !(m->grads = be->alloc(n * sizeof(float), err)))
        return err_prefix(err, "model: %zu gradients", n);
    return 0;
}

void model_release(Model *m, int which) {
    which = joint(m, which);
    if (which & MODEL_WEIGHTS) {
        if (m->weights != m->master) m->be->free(m->weights);
        m->weights = NULL;
    }
    if (which & MODEL_MASTER) {
        m->be->free(m->master);
        m->master = NULL;
    }
    if (which & MODEL_GRADS) {
        m->be->free(m->grads);
        m->grads = NULL;
    }
}

int model_create_stage(Model *m, const ModelConfig *cfg, int first_block, int end_block,
                       const Backend *be, Err *err) {
    memset(m, 0, sizeof *m);
    if (param_table_check_stage(cfg, first_block, end_block, err)) return -1;
    m->cfg = *cfg;
    m->be = be;
    m->first_block = first_block;
    m->end_block = end_block;
    m->has_embed = first_block == 0;
    m->has_head = end_block == cfg->num_hidden_layers;
    if (!(m->plan = calloc(1, sizeof *m->plan)) || model_select_acts(m, 0, err)) {
        model_free(m);
        return err_resource(err, "model: out of memory for the activations' table");
    }
    ModelPlan *pl = m->plan;
    size_t rope_floats = (size_t)cfg->max_position_embeddings * cfg->rope_dim;
    float *rope = malloc(rope_floats * sizeof *rope);
    pl->host_counts = malloc(((size_t)cfg->vocab_size + 1) * sizeof *pl->host_counts);
    int rc = !rope || !pl->host_counts
                 ? err_resource(err, "model: out of memory for the rope table and token counts")
                 : build_param_table(m, err);
    size_t n_params = m->num_floats; // model_free zeroes m
    if (!rc && (model_acquire(m, MODEL_WEIGHTS | MODEL_MASTER | MODEL_GRADS, err) ||
                !(pl->rope = be->alloc(rope_floats * sizeof(float), err)) ||
                !(m->stats = be->alloc(MODEL_N_STATS * sizeof(double), err))))
        rc = err_prefix(err, "model of %zu parameters", n_params);
    if (rc) {
        free(rope);
        model_free(m);
        return -1;
    }
    if (cfg->ffn_type == FFN_MOE &&
        !(m->expert_tokens = calloc((size_t)cfg->num_hidden_layers * cfg->n_routed_experts,
                                    sizeof *m->expert_tokens))) {
        free(rope);
        model_free(m);
        return err_resource(err, "model: out of memory for the experts' token counts");
    }
    fill_rope_table(rope, cfg);
    be->upload(pl->rope, rope, rope_floats * sizeof(float));
    free(rope);
    return 0;
}

int model_create(Model *m, const ModelConfig *cfg, const Backend *be, Err *err) {
    return model_create_stage(m, cfg, 0, cfg->num_hidden_layers, be, err);
}

bool model_is_stage(const Model *m) {
    return !m->has_embed || !m->has_head;
}

const ParamSpec *model_param(const Model *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

ParamView model_view(const Model *m) {
    return (ParamView){.be = m->be,
                       .params = m->params,
                       .n_params = m->n_params,
                       .num_floats = m->num_floats,
                       .master = m->master,
                       .grads = m->grads};
}

static void *weight(const Model *m, int index) {
    return at(m, m->weights, m->params[index].offset);
}
static float *grad(const Model *m, int index) {
    return m->grads + m->params[index].offset;
}

// ---------------------------------------------------------------- init, load, save

static size_t largest_param(const Model *m) {
    size_t n = 1;
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].numel > n) n = m->params[i].numel;
    return n;
}

void model_refresh_weights(Model *m) {
    if (m->weights != m->master) m->be->cast_from_f32(m->weights, m->master, m->num_floats);
}

// The whole model's table (a stage draws and checks names over all of it).
static int whole_table(const Model *m, ParamSpec **params, int *n, Err *err) {
    size_t num_floats;
    return model_stage_table(&m->cfg, 0, m->cfg.num_hidden_layers, params, n, &num_floats, err);
}

// AstrAI's init std of a 2-D weight: o_proj and the MLP's down 0.02/sqrt(2 L); an expert's down
// 0.02/sqrt(2 L (1/max(S,1) + 1/k)) (DeepSeekMoE's down_init_std); everything else 0.02.
static float init_std(const ModelConfig *c, const char *name) {
    float L = (float)c->num_hidden_layers;
    if (strstr(name, "_experts.") && strstr(name, ".down.")) {
        float S = c->n_shared_experts > 1 ? (float)c->n_shared_experts : 1.0f;
        return 0.02f / sqrtf(2.0f * L * (1.0f / S + 1.0f / (float)c->n_activated_experts));
    }
    if (strstr(name, "o_proj") || strstr(name, "mlp.down")) return 0.02f / sqrtf(2.0f * L);
    return 0.02f;
}

// The draws run over the whole model's tensors in order, so that a stage gets the values the
// whole model would.
int model_init_random(Model *m, uint64_t seed, Err *err) {
    ParamSpec *all;
    int n_all;
    if (whole_table(m, &all, &n_all, err)) return -1;
    size_t largest = 1;
    for (int i = 0; i < n_all; i++)
        if (all[i].numel > largest) largest = all[i].numel;
    float *host = malloc(largest * sizeof *host);
    if (!host) {
        free(all);
        return err_resource(err, "model: out of memory for the init staging buffer");
    }
    Rng rng;
    rng_seed(&rng, seed);
    for (int i = 0; i < n_all; i++) {
        const ParamSpec *p = &all[i];
        float one = strstr(p->name, ".bias") ? 0.0f : 1.0f, std = init_std(&m->cfg, p->name);
        for (size_t j = 0; j < p->numel; j++) // norms 1, biases 0
            host[j] = p->ndim == 1 ? one : rng_normal(&rng, 0.0f, std);
        for (int k = 0; k < m->n_params; k++) // a tied head's copy shares the embedding's name
            if (!strcmp(m->params[k].name, p->name))
                m->be->upload(m->master + m->params[k].offset, host, p->numel * sizeof *host);
    }
    free(host);
    free(all);
    model_refresh_weights(m);
    return 0;
}

static bool table_has(const ParamSpec *params, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(params[i].name, name)) return true;
    return false;
}

// Every tensor of the file belongs to the whole model of this config.
static int check_no_unexpected(const Model *m, const StFile *f, const char *path, Err *err) {
    ParamSpec *all;
    int n_all, rc = 0;
    if (whole_table(m, &all, &n_all, err)) return -1;
    for (int i = 0; i < f->n_tensors && !rc; i++) {
        const char *name = f->tensors[i].name;
        int tied_head = m->cfg.tie_word_embeddings && strcmp(name, "lm_head.weight") == 0;
        if (!tied_head && !table_has(all, n_all, name))
            rc = err_set(err, "%s: unexpected tensor '%s' for this config", path, name);
    }
    free(all);
    return rc;
}

// Each tensor: file -> host staging (fp32) -> master.
static int load_tensors(Model *m, const StFile *f, const char *path, float *host, Err *err) {
    const Backend *be = m->be;
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        float *dst = m->master + p->offset;
        // AstrAI: an untied model without lm_head.weight starts from a copy of the embedding.
        const char *name = p->name;
        if (strcmp(name, "lm_head.weight") == 0 && !st_find(f, name)) {
            name = "embed_tokens.weight";
            if (m->has_embed) {
                be->copy(dst, m->master + m->params[m->plan->embed].offset, p->numel * sizeof *dst);
                continue;
            }
        }
        if (st_read_f32(f, name, p->ndim, p->shape, host, err)) return err_prefix(err, "%s", path);
        be->upload(dst, host, p->numel * sizeof *host);
    }
    return 0;
}

int model_load_st(Model *m, const StFile *f, const char *path, Err *err) {
    float *host = malloc(largest_param(m) * sizeof *host);
    int rc = !host ? err_resource(err, "%s: out of memory for the staging buffer", path)
                   : check_no_unexpected(m, f, path, err);
    if (!rc) rc = load_tensors(m, f, path, host, err);
    free(host);
    if (!rc) model_refresh_weights(m);
    return rc;
}

int model_load(Model *m, const char *path, Err *err) {
    StFile f;
    if (st_open(&f, path, err)) return -1;
    int rc = model_load_st(m, &f, path, err);
    st_close(&f);
    return rc;
}

int model_save_views(const ParamView *views, int n_views, const char *path, DType dtype, Err *err) {
    int cap = 0, n = 0;
    for (int v = 0; v < n_views; v++)
        cap += views[v].n_params;
    StWriteTensor *t = calloc(cap > 0 ? (size_t)cap : 1, sizeof *t);
    if (!t) return err_resource(err, "%s: out of memory", path);
    for (int v = 0; v < n_views; v++)
        for (int i = 0; i < views[v].n_params; i++) {
            const ParamSpec *p = &views[v].params[i];
            bool written = false;
            for (int k = 0; k < n && !written; k++)
                written = !strcmp(t[k].name, p->name);
            if (written) continue;
            t[n++] = (StWriteTensor){.name = p->name,
                                     .ndim = p->ndim,
                                     .shape = {p->shape[0], p->shape[1]},
                                     .data = views[v].master + p->offset,
                                     .fetch = views[v].be->download};
        }
    int rc = st_write(path, t, n, dtype, err);
    free(t);
    return rc;
}

int model_save(const Model *m, const char *path, DType dtype, Err *err) {
    ParamView v = model_view(m);
    return model_save_views(&v, 1, path, dtype, err);
}

// ---------------------------------------------------------------- activation buffers

typedef struct {
    void **ptr;
    size_t bytes;
} Buffer;

// The decoder blocks the model holds.
static int n_blocks(const Model *m) {
    return m->end_block - m->first_block;
}

static int activation_slots(const Model *m) {
    return m->grad_checkpointing ? 1 : n_blocks(m);
}

// The dense SwiGLU MLPs a block runs over every token: its MLP, or MoE's shared experts.
static int dense_mlps(const ModelConfig *c) {
    return c->ffn_type == FFN_MOE ? c->n_shared_experts : 1;
}

// Every backend activation buffer with its size for N token rows; one table for alloc
// and free.
static int activation_buffers(const Model *m, size_t N, Buffer *out) {
    ModelActs *a = m->acts;
    const ModelConfig *c = &m->cfg;
    size_t L = (size_t)n_blocks(m), S = (size_t)activation_slots(m), C = c->hidden_size,
           V = c->vocab_size, FF = c->intermediate_size, H = c->num_attention_heads,
           KVH = c->num_key_value_heads, D = c->head_dim, QKV = (H + 2 * KVH) * D,
           qk = c->use_qk_norm, gated = c->use_gated_attention, head = m->has_head,
           bias = c->attention_bias || c->o_proj_bias, M = (size_t)dense_mlps(c),
           mla = c->attn_type == ATTN_MLA, R = (size_t)c->kv_lora_rank,
           proj = mla * (H * D > 2 * KVH * D ? H * D : 2 * KVH * D), moe = c->ffn_type == FFN_MOE,
           E = (size_t)c->n_routed_experts, P = N * (size_t)c->n_activated_experts;
    const size_t A = dtype_size(m->be->dtype), f = sizeof(float), i32 = sizeof(int32_t);
    Buffer table[] = {
        {(void **)&a->batch, BATCH_FIELDS * N * i32},
        {(void **)&a->ones, bias * N * A},
        {(void **)&a->res, (L + 1) * N * C * A},
        {(void **)&a->ln1, S * N * C * A},
        {(void **)&a->rstd1, S * N * f},
        {(void **)&a->qkv, S * N * QKV * A},
        {(void **)&a->qkn, qk * S * N * QKV * A},
        {(void **)&a->rstdq, qk * S * N * H * f},
        {(void **)&a->rstdk, qk * S * N * KVH * f},
        {(void **)&a->att, S * N * C * A},
        {(void **)&a->lse, S * N * H * f},
        {(void **)&a->gate, gated * S * N * C * A},
        {(void **)&a->gated, gated * S * N * C * A},
        {(void **)&a->mid, S * N * C * A},
        {(void **)&a->ln2, S * N * C * A},
        {(void **)&a->rstd2, S * N * f},
        {(void **)&a->h, S * M * N * 2 * FF * A},
        {(void **)&a->act, S * M * N * FF * A},
        {(void **)&a->kva, S * N * R * A},
        {(void **)&a->kvc, S * N * R * A},
        {(void **)&a->rstdkv, mla * S * N * f},
        {(void **)&a->rlogits, S * N * E * A},
        {(void **)&a->probs, S * N * E * f},
        {(void **)&a->topw, S * P * f},
        {(void **)&a->topi, S * P * i32},
        {(void **)&a->token_of, S * P * i32},
        {(void **)&a->pair_of, S * P * i32},
        {(void **)&a->counts, S * E * i32},
        {(void **)&a->xp, S * P * C * A},
        {(void **)&a->hp, S * P * 2 * FF * A},
        {(void **)&a->actp, S * P * FF * A},
        {(void **)&a->yp, S * P * C * A},
        {(void **)&a->proj, N * proj * A},
        {(void **)&a->shared_sum, (M > 0 && moe) * N * C * A},
        {(void **)&a->lnf, head * N * C * A},
        {(void **)&a->rstdf, head * N * f},
        {(void **)&a->logits, head * N * V * A},
        {(void **)&a->lse_ce, head * N * f},
        {(void **)&a->loss_rows, head * N * f},
        {(void **)&a->dres, N * C * A},
        {(void **)&a->dln, N * C * A},
        {(void **)&a->dqkv, N * QKV * A},
        {(void **)&a->dqkn, qk * N * QKV * A},
        {(void **)&a->dgated, N * C * A},
        {(void **)&a->datt, N * C * A},
        {(void **)&a->dgate, gated * N * C * A},
        {(void **)&a->dh, N * 2 * FF * A},
        {(void **)&a->dact, N * FF * A},
        {(void **)&a->dlogits, head * N * V * A},
        {(void **)&a->dkvc, N * R * A},
        {(void **)&a->dkva, N * R * A},
        {(void **)&a->drows, P * C * A},
        {(void **)&a->dhp, P * 2 * FF * A},
        {(void **)&a->dactp, P * FF * A},
        {(void **)&a->drlogits, N * E * A},
        {(void **)&a->dshared, (M > 0 && moe) * N * C * A},
        {(void **)&a->dtopw, P * f},
    };
    size_t n = sizeof table / sizeof table[0];
    if (out) memcpy(out, table, sizeof table);
    return (int)n;
}

enum { MAX_BUFFERS = 96 };

// ---------------------------------------------------------------- expert parallelism's buffers

static int expert_parallel(const Model *m) {
    return m->experts.size > 1;
}

static void free_expert_slot(const Backend *be, ExpertSlot *es) {
    be->free(es->order);
    be->free(es->inverse);
    be->free(es->x);
    be->free(es->h);
    be->free(es->act);
    free(es->from);
    free(es->per_expert);
}

static void free_expert_scratch(Model *m) {
    ModelActs *a = m->acts;
    void **scratch[] = {&a->ep_send, &a->ep_recv, &a->ep_y, &a->ep_dh, &a->ep_dact};
    for (size_t i = 0; i < sizeof scratch / sizeof *scratch; i++) {
        m->be->free(*scratch[i]);
        *scratch[i] = NULL;
    }
    a->ep_cap = 0;
}

static void free_expert_slots(Model *m) {
    ModelActs *a = m->acts;
    for (int s = 0; s < a->ep_slots; s++)
        free_expert_slot(m->be, &a->ep[s]);
    free(a->ep);
    free_expert_scratch(m);
    m->be->free(a->ep_from);
    free(a->ep_bytes);
    a->ep = NULL;
    a->ep_slots = 0;
    a->ep_from = NULL;
    a->ep_bytes = NULL;
}

static int alloc_expert_slots(Model *m, Err *err) {
    ModelActs *a = m->acts;
    int G = m->experts.size, S = activation_slots(m), El = m->cfg.n_routed_experts / G;
    a->ep = calloc((size_t)S, sizeof *a->ep);
    a->ep_bytes = calloc(2 * (size_t)G, sizeof *a->ep_bytes);
    int rc = !a->ep || !a->ep_bytes;
    if (!rc) a->ep_slots = S;
    for (int s = 0; !rc && s < S; s++) {
        a->ep[s].from = calloc((size_t)G * El, sizeof *a->ep[s].from);
        a->ep[s].per_expert = calloc((size_t)El, sizeof *a->ep[s].per_expert);
        rc = !a->ep[s].from || !a->ep[s].per_expert;
    }
    if (rc) return err_resource(err, "model: out of memory for the expert group's counts");
    return (a->ep_from = m->be->alloc((size_t)G * El * sizeof *a->ep_from, err)) ? 0 : -1;
}

// Grows the buffers of n entries of sizes[i] bytes each to hold `rows` rows (contents dropped).
static int grow_rows(const Backend *be, void **bufs[], const size_t *sizes, int n, size_t rows,
                     Err *err) {
    for (int i = 0; i < n; i++) {
        be->free(*bufs[i]);
        if (!(*bufs[i] = be->alloc(rows * sizes[i] + 1, err)))
            return err_prefix(err, "model: %zu rows of the expert group's exchange", rows);
    }
    return 0;
}

// The slot's and the scratch's buffers for `rows` received pairs.
static int reserve_expert_rows(Model *m, ExpertSlot *es, size_t rows, Err *err) {
    ModelActs *a = m->acts;
    size_t A = dtype_size(m->be->dtype), C = (size_t)m->cfg.hidden_size,
           FF = (size_t)m->cfg.intermediate_size, i32 = sizeof(int32_t);
    if (rows > es->cap) {
        void **bufs[] = {(void **)&es->order, (void **)&es->inverse, &es->x, &es->h, &es->act};
        size_t sizes[] = {i32, i32, C * A, 2 * FF * A, FF * A};
        if (grow_rows(m->be, bufs, sizes, 5, rows, err)) return -1;
        es->cap = rows;
    }
    if (rows > a->ep_cap) {
        void **bufs[] = {&a->ep_send, &a->ep_recv, &a->ep_y, &a->ep_dh, &a->ep_dact};
        size_t sizes[] = {C * A, C * A, C * A, 2 * FF * A, FF * A};
        if (grow_rows(m->be, bufs, sizes, 5, rows, err)) return -1;
        a->ep_cap = rows;
    }
    return 0;
}

static void free_activations(Model *m) {
    Buffer table[MAX_BUFFERS];
    int n = activation_buffers(m, 0, table);
    for (int i = 0; i < n; i++) {
        m->be->free(*table[i].ptr);
        *table[i].ptr = NULL;
    }
    free_expert_slots(m);
    free(m->acts->host_batch);
    free(m->acts->host_counts);
    m->acts->host_batch = NULL;
    m->acts->host_counts = NULL;
    m->acts->capacity = 0;
}

// a->ones: (N) 1s of the compute dtype, the left operand of the bias matmul (header).
static int fill_ones(Model *m, size_t N, Err *err) {
    size_t A = dtype_size(m->be->dtype);
    uint16_t one16 = m->be->dtype == DT_BF16 ? f32_to_bf16(1.0f) : f32_to_f16(1.0f);
    float one32 = 1.0f;
    unsigned char *host = malloc(N * A);
    if (!host) return err_resource(err, "model: out of memory for %zu bias rows", N);
    for (size_t i = 0; i < N; i++)
        memcpy(host + i * A, A == 4 ? (const void *)&one32 : (const void *)&one16, A);
    m->be->upload(m->acts->ones, host, N * A);
    free(host);
    return 0;
}

static int ensure_activations(Model *m, size_t N, Err *err) {
    ModelActs *a = m->acts;
    if (N <= a->capacity) return 0;
    free_activations(m);
    Buffer table[MAX_BUFFERS];
    int n = activation_buffers(m, N, table);
    a->host_batch = malloc(BATCH_FIELDS * N * sizeof *a->host_batch);
    a->host_counts = calloc((size_t)activation_slots(m) * (size_t)m->cfg.n_routed_experts + 1,
                            sizeof *a->host_counts);
    if (!a->host_batch || !a->host_counts) {
        free_activations(m);
        return err_resource(err, "model: out of memory for a batch of %zu tokens", N);
    }
    for (int i = 0; i < n; i++) {
        *table[i].ptr = table[i].bytes ? m->be->alloc(table[i].bytes, err) : NULL;
        if (table[i].bytes && !*table[i].ptr) {
            free_activations(m);
            return err_prefix(err, "model: activations of %zu tokens", N);
        }
    }
    if ((a->ones && fill_ones(m, N, err)) || (expert_parallel(m) && alloc_expert_slots(m, err))) {
        free_activations(m);
        return -1;
    }
    a->capacity = N;
    return 0;
}

int model_set_expert_group(Model *m, const ExpertGroup *g, Err *err) {
    const ModelConfig *c = &m->cfg;
    if (g->size > 1 && c->ffn_type != FFN_MOE)
        return err_set(err, "ep_size: %d needs a mixture of experts (ffn_type 'moe')", g->size);
    if (g->size > 1 && c->n_routed_experts % g->size)
        return err_set(err, "ep_size: %d does not divide n_routed_experts %d", g->size,
                       c->n_routed_experts);
    ModelActs *current = m->acts;
    for (int k = 0; k < m->n_act_sets; k++) { // the next forward sizes them for the group
        m->acts = m->act_sets[k];
        free_activations(m);
    }
    m->acts = current;
    m->experts = *g;
    return 0;
}

int model_take_fault(Model *m, Err *err) {
    if (!m->faulted) return 0;
    m->faulted = false;
    if (err) *err = m->fault;
    return -1;
}

int model_select_acts(Model *m, int k, Err *err) {
    if (k >= m->n_act_sets) {
        ModelActs **sets = realloc(m->act_sets, (size_t)(k + 1) * sizeof *sets);
        if (!sets) return err_resource(err, "model: out of memory for %d activation sets", k + 1);
        m->act_sets = sets;
        for (; m->n_act_sets <= k; m->n_act_sets++)
            if (!(sets[m->n_act_sets] = calloc(1, sizeof **sets)))
                return err_resource(err, "model: out of memory for activation set %d", k);
    }
    m->acts = m->act_sets[k];
    return 0;
}

// Bytes of a set's expert-parallel rows: its slots' and the exchange scratch (their capacities).
static size_t expert_rows_bytes(const Model *m, const ModelActs *a) {
    size_t A = dtype_size(m->be->dtype), C = (size_t)m->cfg.hidden_size,
           FF = (size_t)m->cfg.intermediate_size, bytes = a->ep_cap * (3 * C + 3 * FF) * A;
    for (int s = 0; s < a->ep_slots; s++)
        bytes += a->ep[s].cap * (2 * sizeof(int32_t) + (C + 3 * FF) * A);
    return bytes;
}

size_t model_activation_bytes(const Model *m) {
    Buffer table[MAX_BUFFERS];
    size_t bytes = 0;
    for (int k = 0; k < m->n_act_sets; k++) {
        int n = activation_buffers(m, m->act_sets[k]->capacity, table);
        for (int i = 0; i < n; i++)
            bytes += table[i].bytes;
        bytes += expert_rows_bytes(m, m->act_sets[k]);
    }
    return bytes;
}

void model_free(Model *m) {
    if (m->be) {
        for (int k = 0; k < m->n_act_sets; k++) {
            m->acts = m->act_sets[k];
            free_activations(m);
            free(m->acts);
        }
        m->be->free(m->stats);
        model_release(m, MODEL_WEIGHTS | MODEL_MASTER | MODEL_GRADS);
    }
    if (m->plan) {
        if (m->be) m->be->free(m->plan->rope);
        free(m->plan->host_counts);
        free(m->plan->layer);
        free(m->plan);
    }
    free(m->act_sets);
    free(m->params);
    free(m->expert_tokens);
    memset(m, 0, sizeof *m);
}

const void *model_stage_output(const Model *m) {
    const ModelActs *a = m->acts;
    return at(m, a->res, (size_t)n_blocks(m) * a->B * a->T * m->cfg.hidden_size);
}

const void *model_stage_dinput(const Model *m) {
    return m->acts->dres;
}

void model_reset_expert_tokens(Model *m) {
    if (m->expert_tokens)
        memset(m->expert_tokens, 0,
               (size_t)m->cfg.num_hidden_layers * m->cfg.n_routed_experts *
                   sizeof *m->expert_tokens);
}

void model_zero_grad(Model *m) {
    m->be->zero(m->grads, m->num_floats * sizeof(float));
}

void model_logits(const Model *m, float *host) {
    const ModelActs *a = m->acts;
    m->be->download_f32(host, a->logits, (size_t)a->B * a->T * m->cfg.vocab_size);
}

void model_read_stats(Model *m, double out[MODEL_N_STATS]) {
    m->be->download(out, m->stats, MODEL_N_STATS * sizeof(double));
    m->be->zero(m->stats, MODEL_N_STATS * sizeof(double));
}

const float *model_token_nll(const Model *m) {
    return m->acts->loss_rows;
}

const int32_t *model_token_mask(const Model *m) {
    return m->acts->mask;
}

// One past block l's last parameter index (block parameters are contiguous).
static int layer_params_end(const Model *m, int l) {
    const ModelPlan *pl = m->plan;
    if (l + 1 < m->end_block) return pl->layer[l + 1].q_proj;
    return m->has_head ? pl->norm : m->n_params;
}

int model_grad_ranges(const Model *m, int (*ranges)[2]) {
    const ModelPlan *pl = m->plan;
    const int ends[3] = {pl->embed, pl->norm, pl->lm_head};
    return param_table_grad_ranges(&m->cfg, m->first_block, m->end_block, pl->layer, ends,
                                   m->n_params, ranges);
}

void model_set_hooks(Model *m, const ModelHooks *hooks) {
    m->hooks = hooks ? *hooks : (ModelHooks){0};
}

static void grads_ready(const Model *m, int first, int end) {
    if (m->hooks.grads_ready) m->hooks.grads_ready(m->hooks.ctx, first, end);
}

static void weights_needed(const Model *m, int first, int end) {
    if (m->hooks.weights_needed) m->hooks.weights_needed(m->hooks.ctx, first, end);
}

// ---------------------------------------------------------------- forward

// by_id: the token indices stably sorted by id (counting sort over the vocabulary).
static void sort_by_id(const int32_t *ids, int N, int V, int32_t *counts, int32_t *by_id) {
    memset(counts, 0, ((size_t)V + 1) * sizeof *counts);
    for (int n = 0; n < N; n++)
        counts[ids[n] + 1]++;
    for (int v = 1; v <= V; v++)
        counts[v] += counts[v - 1]; // counts[v]: where id v's run starts
    for (int n = 0; n < N; n++)
        by_id[counts[ids[n]]++] = n;
}

// Checks ids and positions and builds the batch on the host: ids, targets, mask,
// positions, the first visible key of each token (the start of its document, or of the
// sliding window: transformers' mask, key j hidden when j <= i - sliding_window) and by_id;
// then uploads it in one transfer. Returns the number of counted tokens, or -1.
static int prepare_inputs(Model *m, const int32_t *inputs, const int32_t *targets,
                          const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                          Err *err) {
    ModelActs *a = m->acts;
    const ModelConfig *c = &m->cfg;
    size_t N = (size_t)B * T;
    int32_t *hb = a->host_batch, *in = hb + BATCH_INPUTS * N, *tg = hb + BATCH_TARGETS * N,
            *mask = hb + BATCH_MASK * N, *pos = hb + BATCH_POS * N,
            *start_of = hb + BATCH_DOC_START * N;
    if (!position_ids && T > c->max_position_embeddings)
        return err_set(err, "model: sequence length %d exceeds max_position_embeddings %d", T,
                       c->max_position_embeddings);
    int counted_total = 0;
    for (int b = 0; b < B; b++)
        for (int t = 0, start = 0; t < T; t++) {
            size_t n = (size_t)b * T + t;
            if (inputs[n] < 0 || inputs[n] >= c->vocab_size)
                return err_set(err, "model: input token %d at (%d,%d) outside vocab_size %d",
                               inputs[n], b, t, c->vocab_size);
            int counted = targets && (!loss_mask || loss_mask[n]);
            if (counted && (targets[n] < 0 || targets[n] >= c->vocab_size))
                return err_set(err, "model: target token %d at (%d,%d) outside vocab_size %d",
                               targets[n], b, t, c->vocab_size);
            int p = position_ids ? position_ids[n] : t;
            if (p < 0 || p >= c->max_position_embeddings)
                return err_set(err, "model: position id %d at (%d,%d) outside [0, %d)", p, b, t,
                               c->max_position_embeddings);
            if (t > 0 && p <= pos[n - 1]) start = t; // a new packed document
            int window_start = c->sliding_window ? t - c->sliding_window + 1 : 0;
            pos[n] = p;
            start_of[n] = start > window_start ? start : window_start;
            in[n] = inputs[n];
            tg[n] = counted ? targets[n] : 0;
            mask[n] = counted;
            counted_total += counted;
        }
    sort_by_id(in, (int)N, c->vocab_size, m->plan->host_counts, hb + BATCH_BY_ID * N);
    int32_t *db = a->batch;
    a->inputs = db + BATCH_INPUTS * N;
    a->targets = db + BATCH_TARGETS * N;
    a->mask = db + BATCH_MASK * N;
    a->pos = db + BATCH_POS * N;
    a->doc_start = db + BATCH_DOC_START * N;
    a->by_id = db + BATCH_BY_ID * N;
    m->be->upload(db, hb, BATCH_FIELDS * N * sizeof *hb);
    return counted_total;
}

static size_t qkv_width(const ModelConfig *c) {
    return (size_t)(c->num_attention_heads + 2 * c->num_key_value_heads) * c->head_dim;
}

// The activations of one slot (engine/model.c header).
typedef struct {
    void *ln1, *qkv, *qkn, *att, *gate, *gated, *mid, *ln2, *h, *act, *kva, *kvc;
    float *rstd1, *rstdq, *rstdk, *lse, *rstd2, *rstdkv;
    void *rlogits, *xp, *hp, *actp, *yp;
    float *probs, *topw;
    int32_t *topi, *token_of, *pair_of, *counts, *host_counts;
} Slot;

// Element k*n of a buffer of slots, NULL when the buffer is absent.
static void *slot_part(const Model *m, void *base, size_t k, size_t n) {
    return base ? at(m, base, k * n) : NULL;
}

static Slot slot_at(const Model *m, int s) {
    const ModelActs *a = m->acts;
    const ModelConfig *c = &m->cfg;
    size_t N = (size_t)a->B * a->T, nc = N * c->hidden_size, QKV = qkv_width(c),
           FF = c->intermediate_size, H = c->num_attention_heads, KVH = c->num_key_value_heads,
           M = (size_t)dense_mlps(c), R = (size_t)c->kv_lora_rank, E = (size_t)c->n_routed_experts,
           P = N * (size_t)c->n_activated_experts;
    size_t k = (size_t)s;
    return (Slot){.ln1 = at(m, a->ln1, k * nc),
                  .qkv = at(m, a->qkv, k * N * QKV),
                  .qkn = slot_part(m, a->qkn, k, N * QKV),
                  .att = at(m, a->att, k * nc),
                  .gate = slot_part(m, a->gate, k, nc),
                  .gated = slot_part(m, a->gated, k, nc),
                  .mid = at(m, a->mid, k * nc),
                  .ln2 = at(m, a->ln2, k * nc),
                  .h = slot_part(m, a->h, k, M * N * 2 * FF),
                  .act = slot_part(m, a->act, k, M * N * FF),
                  .kva = slot_part(m, a->kva, k, N * R),
                  .kvc = slot_part(m, a->kvc, k, N * R),
                  .rstd1 = a->rstd1 + k * N,
                  .rstdq = c->use_qk_norm ? a->rstdq + k * N * H : NULL,
                  .rstdk = c->use_qk_norm ? a->rstdk + k * N * KVH : NULL,
                  .lse = a->lse + k * N * H,
                  .rstd2 = a->rstd2 + k * N,
                  .rstdkv = a->rstdkv ? a->rstdkv + k * N : NULL,
                  .rlogits = slot_part(m, a->rlogits, k, N * E),
                  .xp = slot_part(m, a->xp, k, P * c->hidden_size),
                  .hp = slot_part(m, a->hp, k, P * 2 * FF),
                  .actp = slot_part(m, a->actp, k, P * FF),
                  .yp = slot_part(m, a->yp, k, P * c->hidden_size),
                  .probs = a->probs ? a->probs + k * N * E : NULL,
                  .topw = a->topw ? a->topw + k * P : NULL,
                  .topi = a->topi ? a->topi + k * P : NULL,
                  .token_of = a->token_of ? a->token_of + k * P : NULL,
                  .pair_of = a->pair_of ? a->pair_of + k * P : NULL,
                  .counts = a->counts ? a->counts + k * E : NULL,
                  .host_counts = a->host_counts + k * E};
}

static int slot_of_layer(const Model *m, int l) {
    return m->grad_checkpointing ? 0 : l - m->first_block;
}

// RoPE (forward, or its transpose for sign < 0) on the q and k heads of the (N, QKV) rows x: all
// of each head (GQA), or the last rope_dim dimensions of each (MLA's q_rope, k_rope).
static void rope_heads(const Model *m, void *x, int sign) {
    const ModelActs *a = m->acts;
    const ModelConfig *c = &m->cfg;
    int N = a->B * a->T, H = c->num_attention_heads, KVH = c->num_key_value_heads, D = c->head_dim,
        QKV = (int)qkv_width(c);
    void (*rope)(void *, const int32_t *, const float *, int, int, int, int) =
        sign > 0 ? m->be->rope_fwd : m->be->rope_bwd;
    if (c->rope_dim == D) {
        rope(x, a->pos, m->plan->rope, N, H, D, QKV);
        rope(at(m, x, (size_t)H * D), a->pos, m->plan->rope, N, KVH, D, QKV);
        return;
    }
    for (int h = 0; h < H + KVH; h++)
        rope(at(m, x, (size_t)h * D + (D - c->rope_dim)), a->pos, m->plan->rope, N, 1, c->rope_dim,
             QKV);
}

// MLA's k and v of kv head h: columns [2hD, 2hD + D) and [2hD + D, 2(h+1)D) of the kv_b rows
// (K*2D wide), columns (H + h)D and (H + K + h)D of the q|k|v rows. to_qkv: kv -> qkv, else back.
static void mla_move_kv(const Model *m, void *qkv, void *kv, bool to_qkv) {
    const ModelConfig *c = &m->cfg;
    int N = m->acts->B * m->acts->T, H = c->num_attention_heads, K = c->num_key_value_heads,
        D = c->head_dim, QKV = (int)qkv_width(c), KV = 2 * K * D;
    for (int h = 0; h < K; h++)
        for (int part = 0; part < 2; part++) {
            void *q = at(m, qkv, (size_t)(H + part * K + h) * D),
                 *v = at(m, kv, (size_t)(2 * h + part) * D);
            if (to_qkv)
                m->be->copy_rows(q, QKV, v, KV, N, D);
            else
                m->be->copy_rows(v, KV, q, QKV, N, D);
        }
}

// x.qkv = the q|k|v rows of MLA (docs/design.md §7a) from x.ln1: q = q_proj(h); k, v per kv
// head from kv_b_proj(kv_norm(kv_a_proj(h))).
static void mla_project(Model *m, const LayerParams *p, const Slot *x) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    int N = a->B * a->T, C = c->hidden_size, HD = c->num_attention_heads * c->head_dim,
        R = c->kv_lora_rank, KV = 2 * c->num_key_value_heads * c->head_dim, QKV = (int)qkv_width(c);
    be->matmul_fwd(a->proj, x->ln1, weight(m, p->q_proj), N, C, HD, 0);
    be->copy_rows(x->qkv, QKV, a->proj, HD, N, HD);
    be->matmul_fwd(x->kva, x->ln1, weight(m, p->kv_a_proj), N, C, R, 0);
    be->rmsnorm_fwd(x->kvc, x->rstdkv, x->kva, weight(m, p->kv_norm), N, 1, R, R, c->rms_norm_eps);
    be->matmul_fwd(a->proj, x->kvc, weight(m, p->kv_b_proj), N, R, KV, 0);
    mla_move_kv(m, x->qkv, a->proj, true);
}

// Generation: layer l's cached keys; its values follow them (KvCache).
static void *cached_keys(const Model *m, int l) {
    const KvCache *c = m->cache;
    return at(m, c->kv, 2 * (size_t)(l - m->first_block) * c->layer_elems);
}

// The k and v rows (token stride QKV) of the forward into layer l's cache: a prefill's T rows of
// each sequence at positions 0..T-1, a decode's one row per sequence at its position.
static void cache_store(Model *m, int l, const void *k, const void *v) {
    const ModelActs *a = m->acts;
    const KvCache *c = m->cache;
    int KVD = m->cfg.num_key_value_heads * m->cfg.head_dim, QKV = (int)qkv_width(&m->cfg);
    void *keys = cached_keys(m, l), *values = at(m, keys, c->layer_elems);
    for (int b = 0; b < a->B; b++) {
        size_t dst = ((size_t)b * c->max_len + (c->pos ? c->pos[b] : 0)) * KVD,
               src = (size_t)b * a->T * QKV;
        m->be->copy_rows(at(m, keys, dst), KVD, at(m, k, src), QKV, a->T, KVD);
        m->be->copy_rows(at(m, values, dst), KVD, at(m, v, src), QKV, a->T, KVD);
    }
}

// x.mid = res + attn(input_norm(res)) of layer l; while decoding (m->cache->pos), attention over
// the cache instead of the batch's own rows.
static void attention_forward(Model *m, int l, const LayerParams *p, const Slot *x,
                              const void *res) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    int B = a->B, T = a->T, N = B * T, C = c->hidden_size, H = c->num_attention_heads,
        KVH = c->num_key_value_heads, D = c->head_dim, QKV = (int)qkv_width(c);
    size_t nc = (size_t)N * C;
    be->rmsnorm_fwd(x->ln1, x->rstd1, res, weight(m, p->input_norm), N, 1, C, C, c->rms_norm_eps);
    if (c->attn_type == ATTN_MLA) {
        mla_project(m, p, x);
    } else {
        be->matmul_fwd(x->qkv, x->ln1, weight(m, p->q_proj), N, C, QKV, 0);
        if (c->attention_bias)
            be->matmul_fwd(x->qkv, a->ones, weight(m, p->qkv_bias), N, 1, QKV, 1);
    }
    // q and k as attention sees them: qkv after RoPE, then qk-norm into qkn; or (qk-norm
    // before RoPE) normed into qkn and rotated there, qkv kept as the norm's input.
    void *qk = c->use_qk_norm ? x->qkn : x->qkv;
    if (!c->qk_norm_before_rope) rope_heads(m, x->qkv, 1);
    if (c->use_qk_norm) {
        be->rmsnorm_fwd(qk, x->rstdq, x->qkv, weight(m, p->q_norm), N, H, D, QKV, c->rms_norm_eps);
        be->rmsnorm_fwd(at(m, qk, (size_t)H * D), x->rstdk, at(m, x->qkv, (size_t)H * D),
                        weight(m, p->k_norm), N, KVH, D, QKV, c->rms_norm_eps);
    }
    if (c->qk_norm_before_rope) rope_heads(m, qk, 1);
    const void *k = at(m, qk, (size_t)H * D), *v = at(m, x->qkv, (size_t)(H + KVH) * D);
    const KvCache *cache = m->cache;
    if (cache) cache_store(m, l, k, v);
    if (cache && cache->pos) {
        void *keys = cached_keys(m, l);
        be->attention_decode(x->att, qk, keys, at(m, keys, cache->layer_elems), cache->span, B, H,
                             KVH, D, QKV, cache->max_len);
    } else {
        be->attention_fwd(x->att, x->lse, qk, k, v, a->doc_start, B, T, H, KVH, D, QKV);
    }
    void *o_in = x->att;
    if (c->use_gated_attention) {
        o_in = x->gated;
        be->matmul_fwd(x->gate, x->ln1, weight(m, p->gate), N, C, C, 0);
        be->sigmoid_gate_fwd(o_in, x->att, x->gate, nc);
    }
    be->copy(x->mid, res, nc * dtype_size(be->dtype));
    be->matmul_fwd(x->mid, o_in, weight(m, p->o_proj), N, C, C, 1);
    if (c->o_proj_bias) be->matmul_fwd(x->mid, a->ones, weight(m, p->o_bias), N, 1, C, 1);
}

// One SwiGLU MLP over the rows of x.ln2: h = [up | gate] rows, act; out (+)= down(act).
static void swiglu_forward(Model *m, int up, const Slot *x, void *h, void *act, void *out,
                           int accumulate) {
    const ModelConfig *c = &m->cfg;
    int N = m->acts->B * m->acts->T, C = c->hidden_size, FF = c->intermediate_size;
    m->be->matmul_fwd(h, x->ln2, weight(m, up), N, C, 2 * FF, 0);
    m->be->swiglu_fwd(act, h, N, FF);
    m->be->matmul_fwd(out, act, weight(m, up + 2), N, FF, C, accumulate);
}

// Dense MLP i's activations of the slot (the MLP, or MoE's shared expert i).
static void *dense_h(const Model *m, const Slot *x, int i) {
    return at(m, x->h, (size_t)i * m->acts->B * m->acts->T * 2 * m->cfg.intermediate_size);
}
static void *dense_act(const Model *m, const Slot *x, int i) {
    return at(m, x->act, (size_t)i * m->acts->B * m->acts->T * m->cfg.intermediate_size);
}

// The routed experts [first, first + n) of a layer over `rows` rows in expert order (counts[j] rows
// of expert first + j): y = down(swiglu(up|gate(x))), one GEMM per expert and matrix (an expert
// without rows computes nothing). Backward: d holds d loss / d y on entry and d loss / d x on
// return (dh, dact its scratch; h, act forward's).
typedef struct {
    int first, n;
    const int32_t *counts;
    size_t rows;
    void *x, *h, *act, *y;
    void *d, *dh, *dact;
} ExpertRows;

// Every routed expert over this rank's own pairs (no expert parallelism).
static ExpertRows own_pairs(const Model *m, const Slot *x) {
    ModelActs *a = m->acts;
    return (ExpertRows){.first = 0,
                        .n = m->cfg.n_routed_experts,
                        .counts = x->host_counts,
                        .rows = (size_t)a->B * a->T * m->cfg.n_activated_experts,
                        .x = x->xp,
                        .h = x->hp,
                        .act = x->actp,
                        .y = x->yp,
                        .d = a->drows,
                        .dh = a->dhp,
                        .dact = a->dactp};
}

static void experts_forward(Model *m, const LayerParams *p, const ExpertRows *r) {
    const Backend *be = m->be;
    int C = m->cfg.hidden_size, FF = m->cfg.intermediate_size;
    for (int j = 0, first = 0; j < r->n; first += r->counts[j++]) {
        if (!r->counts[j]) continue;
        be->matmul_fwd(at(m, r->h, (size_t)first * 2 * FF), at(m, r->x, (size_t)first * C),
                       weight(m, p->routed_experts + 3 * (r->first + j)), r->counts[j], C, 2 * FF,
                       0);
    }
    if (r->rows) be->swiglu_fwd(r->act, r->h, (int)r->rows, FF);
    for (int j = 0, first = 0; j < r->n; first += r->counts[j++]) {
        if (!r->counts[j]) continue;
        be->matmul_fwd(at(m, r->y, (size_t)first * C), at(m, r->act, (size_t)first * FF),
                       weight(m, p->routed_experts + 3 * (r->first + j) + 2), r->counts[j], FF, C,
                       0);
    }
}

// ---------------------------------------------------------------- expert parallelism

static void record_fault(Model *m, const Err *e) {
    if (m->faulted) return;
    m->faulted = true;
    m->fault = *e;
}

// What the slot's exchange moves: bytes[q] = rows to rank q (to) or from it, of `width` elements.
static size_t *exchange_bytes(const Model *m, const ExpertSlot *es, const Slot *x, bool to,
                              size_t width) {
    const ExpertGroup *g = &m->experts;
    size_t *bytes = m->acts->ep_bytes + (to ? 0 : g->size);
    if (to)
        expert_rows_to(g, m->cfg.n_routed_experts, x->host_counts, bytes);
    else
        expert_rows_from(g, m->cfg.n_routed_experts / g->size, es->from, bytes);
    for (int q = 0; q < g->size; q++)
        bytes[q] *= width * dtype_size(m->be->dtype);
    return bytes;
}

// Forward: the pairs each rank of the group sends this rank's experts (counts first), and the
// expert order of the rows to come (es).
static int plan_exchange(Model *m, const Slot *x, ExpertSlot *es, Err *err) {
    const ExpertGroup *g = &m->experts;
    ModelActs *a = m->acts;
    int El = m->cfg.n_routed_experts / g->size;
    size_t *bytes = a->ep_bytes;
    for (int q = 0; q < 2 * g->size; q++)
        bytes[q] = (size_t)El * sizeof(int32_t);
    if (g->all_to_all(g->ctx, x->counts, bytes, a->ep_from, bytes + g->size, err))
        return err_prefix(err, "expert parallelism: the pair counts");
    m->be->download(es->from, a->ep_from, (size_t)g->size * El * sizeof *es->from);
    es->rows = expert_rows_from(g, El, es->from, bytes);
    if (reserve_expert_rows(m, es, es->rows, err)) return -1;
    int32_t *order = malloc((2 * es->rows + 1) * sizeof *order);
    if (!order) return err_resource(err, "model: out of memory for %zu pairs' order", es->rows);
    expert_order(g, El, es->from, order, order + es->rows, es->per_expert);
    m->be->upload(es->order, order, es->rows * sizeof *order);
    m->be->upload(es->inverse, order + es->rows, es->rows * sizeof *order);
    free(order);
    return 0;
}

// This rank's pairs' rows (pair order, (P,C)) to their experts' ranks: `rows` gets what this
// rank's experts receive, in expert order ((es->rows, C)).
static int pairs_to_experts(Model *m, const Slot *x, const ExpertSlot *es, const void *pairs,
                            void *rows, Err *err) {
    const ExpertGroup *g = &m->experts;
    ModelActs *a = m->acts;
    int C = m->cfg.hidden_size;
    size_t *to = exchange_bytes(m, es, x, true, (size_t)C);
    size_t *from = exchange_bytes(m, es, x, false, (size_t)C);
    if (g->all_to_all(g->ctx, pairs, to, a->ep_recv, from, err))
        return err_prefix(err, "expert parallelism: the pairs to their experts");
    if (es->rows) m->be->embedding_fwd(rows, es->order, a->ep_recv, (int)es->rows, C);
    return 0;
}

// The way back: rows of this rank's experts (expert order) to the pairs' ranks, into `pairs`.
static int experts_to_pairs(Model *m, const Slot *x, const ExpertSlot *es, const void *rows,
                            void *pairs, Err *err) {
    const ExpertGroup *g = &m->experts;
    ModelActs *a = m->acts;
    int C = m->cfg.hidden_size;
    if (es->rows) m->be->embedding_fwd(a->ep_send, es->inverse, rows, (int)es->rows, C);
    size_t *to = exchange_bytes(m, es, x, true, (size_t)C);
    size_t *from = exchange_bytes(m, es, x, false, (size_t)C);
    if (g->all_to_all(g->ctx, a->ep_send, from, pairs, to, err))
        return err_prefix(err, "expert parallelism: the experts' rows back");
    return 0;
}

// This rank's experts over the rows of the slot's exchange.
static ExpertRows received_pairs(const Model *m, const ExpertSlot *es) {
    ModelActs *a = m->acts;
    int El = m->cfg.n_routed_experts / m->experts.size;
    return (ExpertRows){.first = m->experts.rank * El,
                        .n = El,
                        .counts = es->per_expert,
                        .rows = es->rows,
                        .x = es->x,
                        .h = es->h,
                        .act = es->act,
                        .y = a->ep_y,
                        .d = a->ep_y,
                        .dh = a->ep_dh,
                        .dact = a->ep_dact};
}

// The routed experts' outputs of the slot's pairs (x->yp, pair order): computed here, or by
// their ranks of the expert group. A failed exchange is recorded (m->fault).
static void routed_forward(Model *m, const LayerParams *p, const Slot *x, int s) {
    if (!expert_parallel(m)) {
        ExpertRows r = own_pairs(m, x);
        experts_forward(m, p, &r);
        return;
    }
    Err err = {0};
    ExpertSlot *es = &m->acts->ep[s];
    if (plan_exchange(m, x, es, &err) || pairs_to_experts(m, x, es, x->xp, es->x, &err)) {
        record_fault(m, &err);
        return;
    }
    ExpertRows r = received_pairs(m, es);
    experts_forward(m, p, &r);
    if (experts_to_pairs(m, x, es, r.y, x->yp, &err)) record_fault(m, &err);
}

// DeepSeekMoE (docs/design.md §7a): res_next = mid + (mean of the shared experts + sum of the
// chosen experts' outputs, weighted).
static void moe_forward(Model *m, const LayerParams *p, const Slot *x, int s, void *res_next) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    int N = a->B * a->T, C = c->hidden_size, E = c->n_routed_experts, k = c->n_activated_experts,
        S = c->n_shared_experts;
    be->matmul_fwd(x->rlogits, x->ln2, weight(m, p->router), N, C, E, 0);
    be->moe_route(x->probs, x->topw, x->topi, x->counts, x->token_of, x->pair_of, x->rlogits, N, E,
                  k);
    be->download(x->host_counts, x->counts, (size_t)E * sizeof *x->host_counts);
    be->embedding_fwd(x->xp, x->token_of, x->ln2, N * k, C); // the pairs' token rows
    routed_forward(m, p, x, s);
    for (int i = 0; i < S; i++)
        swiglu_forward(m, p->shared_experts + 3 * i, x, dense_h(m, x, i), dense_act(m, x, i),
                       a->shared_sum, i > 0);
    be->moe_combine(res_next, x->mid, S ? a->shared_sum : NULL, S ? 1.0f / (float)S : 0.0f, x->yp,
                    x->topw, x->pair_of, N, k, C);
}

// res[l+1] = res[l] + attn(input_norm(res[l])) + ffn(post_attention_norm(.)), layer l,
// activations into slot s.
static void layer_forward(Model *m, int l, int s) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &m->plan->layer[l];
    int N = a->B * a->T, C = c->hidden_size;
    size_t nc = (size_t)N * C, r = (size_t)(l - m->first_block);
    Slot x = slot_at(m, s);
    void *res = at(m, a->res, r * nc), *res_next = at(m, a->res, (r + 1) * nc);

    attention_forward(m, l, p, &x, res);
    be->rmsnorm_fwd(x.ln2, x.rstd2, x.mid, weight(m, p->post_norm), N, 1, C, C, c->rms_norm_eps);
    if (c->ffn_type == FFN_MOE) {
        moe_forward(m, p, &x, s, res_next);
        return;
    }
    be->copy(res_next, x.mid, nc * dtype_size(be->dtype));
    swiglu_forward(m, p->mlp_up, &x, x.h, x.act, res_next, 1);
}

// Block l's pairs per expert, from its forward just run (m->expert_tokens).
static void count_expert_tokens(Model *m, int l) {
    if (!m->expert_tokens) return;
    int E = m->cfg.n_routed_experts;
    const int32_t *counts = slot_at(m, slot_of_layer(m, l)).host_counts;
    for (int e = 0; e < E; e++)
        m->expert_tokens[(size_t)l * E + e] += counts[e];
}

static int check_forward_args(int B, int T, float label_smoothing, Err *err) {
    if (B <= 0 || T <= 0 || (size_t)B * T > (size_t)1 << 30)
        return err_set(err, "model: bad batch shape B=%d T=%d", B, T);
    if (!(label_smoothing >= 0.0f && label_smoothing <= 1.0f))
        return err_set(err, "model: label_smoothing %g outside [0, 1]", label_smoothing);
    return 0;
}

// NEFTune (AstrAI's Embedding in training mode): the input embeddings of a (B,T) batch get
// normal noise of std alpha / sqrt(T).
static void add_embedding_noise(Model *m, int T) {
    const ModelActs *a = m->acts;
    if (m->neftune_alpha <= 0.0f) return;
    size_t n = (size_t)a->B * T * m->cfg.hidden_size;
    m->be->gaussian_noise_add(a->res, n, m->neftune_alpha / sqrtf((float)T), m->noise_seed);
}

// The forward pass and, with targets, the per-token losses (loss_rows); returns the number of
// counted tokens, or -1.
static int forward(Model *m, const int32_t *inputs, const int32_t *targets,
                   const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                   float label_smoothing, Err *err) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    a->has_loss = 0;
    if (check_forward_args(B, T, label_smoothing, err)) return -1;
    const ModelPlan *pl = m->plan;
    int N = B * T, C = c->hidden_size, V = c->vocab_size, L = n_blocks(m);
    if (!m->has_embed && !m->stage_input)
        return err_set(err, "model: a stage without the embedding needs its input activations");
    if (ensure_activations(m, (size_t)N, err) ||
        (be->attention_reserve && be->attention_reserve(T, c->head_dim, err)))
        return -1;
    int counted = prepare_inputs(m, inputs, targets, loss_mask, position_ids, B, T, err);
    if (counted < 0) return -1;
    a->B = B;
    a->T = T;
    if (m->has_embed) {
        weights_needed(m, pl->embed, pl->embed + 1);
        be->embedding_fwd(a->res, a->inputs, weight(m, pl->embed), N, C);
        add_embedding_noise(m, T);
    } else {
        be->copy(a->res, m->stage_input, (size_t)N * C * dtype_size(be->dtype));
    }
    for (int l = m->first_block; l < m->end_block; l++) {
        weights_needed(m, pl->layer[l].q_proj, layer_params_end(m, l));
        layer_forward(m, l, slot_of_layer(m, l));
        count_expert_tokens(m, l);
    }
    if (m->faulted) return model_take_fault(m, err);
    if (!m->has_head) return 0;
    weights_needed(m, pl->norm, m->n_params);
    be->rmsnorm_fwd(a->lnf, a->rstdf, at(m, a->res, (size_t)L * N * C), weight(m, pl->norm), N, 1,
                    C, C, c->rms_norm_eps);
    be->matmul_fwd(a->logits, a->lnf, weight(m, pl->lm_head), N, C, V, 0);
    if (!targets) return 0;

    be->cross_entropy_fwd(a->loss_rows, a->lse_ce, a->logits, a->targets, a->mask, N, V,
                          label_smoothing);
    a->has_loss = 1;
    a->counted = (float)counted;
    a->label_smoothing = label_smoothing;
    return counted;
}

int model_forward_accumulate(Model *m, const int32_t *inputs, const int32_t *targets,
                             const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                             float label_smoothing, Err *err) {
    int counted = forward(m, inputs, targets, loss_mask, position_ids, B, T, label_smoothing, err);
    if (counted < 0) return -1;
    if (counted) m->be->loss_mean_add(m->stats, m->acts->loss_rows, B * T, counted);
    return 0;
}

int model_forward_tokens(Model *m, const int32_t *inputs, const int32_t *targets,
                         const int32_t *loss_mask, int B, int T, Err *err) {
    return forward(m, inputs, targets, loss_mask, NULL, B, T, 0.0f, err);
}

float model_forward(Model *m, const int32_t *inputs, const int32_t *targets,
                    const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                    float label_smoothing, Err *err) {
    m->be->zero(m->stats, MODEL_N_STATS * sizeof(double));
    if (model_forward_accumulate(m, inputs, targets, loss_mask, position_ids, B, T, label_smoothing,
                                 err))
        return NAN;
    double stats[MODEL_N_STATS];
    model_read_stats(m, stats);
    return (float)stats[MODEL_STAT_LOSS];
}

// ---------------------------------------------------------------- backward

// One SwiGLU MLP's backward from dout: (N,C) into dln (= or += with accumulate_dln), its gradients
// added; h, act its forward's.
static void swiglu_backward(Model *m, int up, const Slot *x, const void *h, const void *act,
                            const void *dout, int accumulate_dln) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    int N = a->B * a->T, C = m->cfg.hidden_size, FF = m->cfg.intermediate_size;
    be->matmul_bwd(a->dact, grad(m, up + 2), dout, act, weight(m, up + 2), N, FF, C, 0);
    be->swiglu_bwd(a->dh, a->dact, h, N, FF);
    be->matmul_bwd(a->dln, grad(m, up), a->dh, x->ln2, weight(m, up), N, C, 2 * FF, accumulate_dln);
}

static void experts_backward(Model *m, const LayerParams *p, const ExpertRows *r) {
    const Backend *be = m->be;
    int C = m->cfg.hidden_size, FF = m->cfg.intermediate_size;
    for (int j = 0, first = 0; j < r->n; first += r->counts[j++]) {
        if (!r->counts[j]) continue;
        int down = p->routed_experts + 3 * (r->first + j) + 2;
        be->matmul_bwd(at(m, r->dact, (size_t)first * FF), grad(m, down),
                       at(m, r->d, (size_t)first * C), at(m, r->act, (size_t)first * FF),
                       weight(m, down), r->counts[j], FF, C, 0);
    }
    if (r->rows) be->swiglu_bwd(r->dh, r->dact, r->h, (int)r->rows, FF);
    for (int j = 0, first = 0; j < r->n; first += r->counts[j++]) {
        if (!r->counts[j]) continue;
        int up = p->routed_experts + 3 * (r->first + j);
        be->matmul_bwd(at(m, r->d, (size_t)first * C), grad(m, up),
                       at(m, r->dh, (size_t)first * 2 * FF), at(m, r->x, (size_t)first * C),
                       weight(m, up), r->counts[j], C, 2 * FF, 0);
    }
}

// a->drows from d loss / d the routed experts' outputs to d loss / d their inputs (pair order),
// through this rank's experts or their ranks' (expert parallelism: a failure is recorded).
static void routed_backward(Model *m, const LayerParams *p, const Slot *x, int s) {
    if (!expert_parallel(m)) {
        ExpertRows r = own_pairs(m, x);
        experts_backward(m, p, &r);
        return;
    }
    Err err = {0};
    const ExpertSlot *es = &m->acts->ep[s];
    ExpertRows r = received_pairs(m, es);
    if (pairs_to_experts(m, x, es, m->acts->drows, r.d, &err)) {
        record_fault(m, &err);
        return;
    }
    experts_backward(m, p, &r);
    if (experts_to_pairs(m, x, es, r.d, m->acts->drows, &err)) record_fault(m, &err);
}

// DeepSeekMoE's backward from dres = d loss / d res_next into dln = d loss / d ln2: the routed
// experts (through the combination's weights to the router) and the shared ones.
static void moe_backward(Model *m, const LayerParams *p, const Slot *x, int s) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    int N = a->B * a->T, C = c->hidden_size, E = c->n_routed_experts, k = c->n_activated_experts,
        S = c->n_shared_experts;
    float shared_scale = S ? 1.0f / (float)S : 0.0f;
    be->moe_combine_bwd(a->drows, a->dtopw, S ? a->dshared : NULL, a->dres, x->yp, x->topw,
                        x->pair_of, shared_scale, N, k, C);
    routed_backward(m, p, x, s);
    be->moe_combine(a->dln, NULL, NULL, 0.0f, a->drows, NULL, x->pair_of, N, k, C);
    for (int i = 0; i < S; i++)
        swiglu_backward(m, p->shared_experts + 3 * i, x, dense_h(m, x, i), dense_act(m, x, i),
                        a->dshared, 1);
    be->moe_route_bwd(a->drlogits, a->dtopw, x->probs, x->topi, N, E, k);
    be->matmul_bwd(a->dln, grad(m, p->router), a->drlogits, x->ln2, weight(m, p->router), N, C, E,
                   1);
}

// MLA's projections backward from dqkv (d loss / d the q|k|v rows) into dln (= or +=).
static void mla_project_backward(Model *m, const LayerParams *p, const Slot *x, int have_dln) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    int N = a->B * a->T, C = c->hidden_size, HD = c->num_attention_heads * c->head_dim,
        R = c->kv_lora_rank, KV = 2 * c->num_key_value_heads * c->head_dim, QKV = (int)qkv_width(c);
    be->copy_rows(a->proj, HD, a->dqkv, QKV, N, HD);
    be->matmul_bwd(a->dln, grad(m, p->q_proj), a->proj, x->ln1, weight(m, p->q_proj), N, C, HD,
                   have_dln);
    mla_move_kv(m, a->dqkv, a->proj, false);
    be->matmul_bwd(a->dkvc, grad(m, p->kv_b_proj), a->proj, x->kvc, weight(m, p->kv_b_proj), N, R,
                   KV, 0);
    be->rmsnorm_bwd(a->dkva, grad(m, p->kv_norm), a->dkvc, x->kva, weight(m, p->kv_norm), x->rstdkv,
                    N, 1, R, R, 0);
    be->matmul_bwd(a->dln, grad(m, p->kv_a_proj), a->dkva, x->ln1, weight(m, p->kv_a_proj), N, C, R,
                   1);
}

// The attention branch's backward: mid = res + o_proj(att [* sigmoid(gate(ln1))]); dres holds d
// loss / d mid on entry and d loss / d res on return.
static void attention_backward(Model *m, const LayerParams *p, const Slot *x, const void *res) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    int B = a->B, T = a->T, N = B * T, C = c->hidden_size, H = c->num_attention_heads,
        KVH = c->num_key_value_heads, D = c->head_dim, QKV = (int)qkv_width(c);
    size_t nc = (size_t)N * C, hd = (size_t)H * D, kvd = (size_t)(H + KVH) * D;
    void *o_in = c->use_gated_attention ? x->gated : x->att;
    if (c->o_proj_bias)
        be->matmul_bwd(NULL, grad(m, p->o_bias), a->dres, a->ones, weight(m, p->o_bias), N, 1, C,
                       0);
    be->matmul_bwd(a->dgated, grad(m, p->o_proj), a->dres, o_in, weight(m, p->o_proj), N, C, C, 0);
    void *datt = a->dgated;
    if (c->use_gated_attention) {
        datt = a->datt;
        be->sigmoid_gate_bwd(datt, a->dgate, a->dgated, x->att, x->gate, nc);
    }
    void *qk = c->use_qk_norm ? x->qkn : x->qkv;
    void *dqk = c->use_qk_norm ? a->dqkn : a->dqkv;
    be->attention_bwd(dqk, at(m, dqk, hd), at(m, a->dqkv, kvd), datt, x->att, x->lse, qk,
                      at(m, qk, hd), at(m, x->qkv, kvd), a->doc_start, B, T, H, KVH, D, QKV);
    if (c->qk_norm_before_rope) rope_heads(m, dqk, -1);
    if (c->use_qk_norm) {
        be->rmsnorm_bwd(a->dqkv, grad(m, p->q_norm), dqk, x->qkv, weight(m, p->q_norm), x->rstdq, N,
                        H, D, QKV, 0);
        be->rmsnorm_bwd(at(m, a->dqkv, hd), grad(m, p->k_norm), at(m, dqk, hd), at(m, x->qkv, hd),
                        weight(m, p->k_norm), x->rstdk, N, KVH, D, QKV, 0);
    }
    if (!c->qk_norm_before_rope) rope_heads(m, a->dqkv, -1);
    if (c->attention_bias)
        be->matmul_bwd(NULL, grad(m, p->qkv_bias), a->dqkv, a->ones, weight(m, p->qkv_bias), N, 1,
                       QKV, 0);
    int have_dln = 0;
    if (c->use_gated_attention) {
        be->matmul_bwd(a->dln, grad(m, p->gate), a->dgate, x->ln1, weight(m, p->gate), N, C, C, 0);
        have_dln = 1;
    }
    if (c->attn_type == ATTN_MLA)
        mla_project_backward(m, p, x, have_dln);
    else
        be->matmul_bwd(a->dln, grad(m, p->q_proj), a->dqkv, x->ln1, weight(m, p->q_proj), N, C, QKV,
                       have_dln);
    be->rmsnorm_bwd(a->dres, grad(m, p->input_norm), a->dln, res, weight(m, p->input_norm),
                    x->rstd1, N, 1, C, C, 1);
}

// Takes dres = d loss / d res[l+1]; leaves d loss / d res[l] in it. Slot s holds
// layer l's activations.
static void layer_backward(Model *m, int l, int s) {
    ModelActs *a = m->acts;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &m->plan->layer[l];
    int N = a->B * a->T, C = c->hidden_size;
    Slot x = slot_at(m, s);
    void *res = at(m, a->res, (size_t)(l - m->first_block) * N * C);

    // ffn branch: res[l+1] = mid + ffn(ln2)
    if (c->ffn_type == FFN_MOE)
        moe_backward(m, p, &x, s);
    else
        swiglu_backward(m, p->mlp_up, &x, x.h, x.act, a->dres, 0);
    be->rmsnorm_bwd(a->dres, grad(m, p->post_norm), a->dln, x.mid, weight(m, p->post_norm), x.rstd2,
                    N, 1, C, C, 1);
    attention_backward(m, p, &x, res);
}

// The head's backward from dlogits = dloss * row_scale[n] * d CE_n / d logits (row_scale NULL:
// 1) into dres; false when the loss is constant (no counted token: nothing to do).
static bool head_backward(Model *m, const float *row_scale, float dloss) {
    ModelActs *a = m->acts;
    const ModelPlan *pl = m->plan;
    const Backend *be = m->be;
    const ModelConfig *c = &m->cfg;
    int N = a->B * a->T, C = c->hidden_size, V = c->vocab_size;
    if (!a->has_loss || a->counted == 0) return false;
    be->cross_entropy_bwd(a->dlogits, a->logits, a->lse_ce, a->targets, a->mask, row_scale, N, V,
                          a->label_smoothing, dloss);
    be->matmul_bwd(a->dln, grad(m, pl->lm_head), a->dlogits, a->lnf, weight(m, pl->lm_head), N, C,
                   V, 0);
    be->rmsnorm_bwd(a->dres, grad(m, pl->norm), a->dln, model_stage_output(m), weight(m, pl->norm),
                    a->rstdf, N, 1, C, C, 0);
    grads_ready(m, pl->norm, m->n_params);
    return true;
}

// Backward of the stage: from the loss (the head), or from stage_dout (the next stage's
// gradient). A last stage whose loss is constant leaves the gradients as they are; its dres is
// then zero, which is what the previous stage receives.
static void backward(Model *m, const float *row_scale, float dloss) {
    ModelActs *a = m->acts;
    const ModelPlan *pl = m->plan;
    const Backend *be = m->be;
    int N = a->B * a->T, C = m->cfg.hidden_size, last = m->end_block - 1;
    size_t dres_bytes = (size_t)N * C * dtype_size(be->dtype);
    if (!m->has_head) {
        be->copy(a->dres, m->stage_dout, dres_bytes);
    } else if (!head_backward(m, row_scale, dloss)) {
        if (!m->has_embed) be->zero(a->dres, dres_bytes);
        return;
    }
    for (int l = last; l >= m->first_block; l--) {
        // Checkpointing: slot 0 holds the last block after forward; recompute the others.
        if (m->grad_checkpointing && l != last) layer_forward(m, l, 0);
        layer_backward(m, l, slot_of_layer(m, l));
        grads_ready(m, pl->layer[l].q_proj, layer_params_end(m, l));
    }
    if (!m->has_embed) return;
    be->embedding_bwd(grad(m, pl->embed), a->dres, a->inputs, a->by_id, N, C);
    grads_ready(m, pl->embed, pl->embed + 1);
}

void model_backward(Model *m, float loss_scale) {
    float counted = m->has_head ? m->acts->counted : 1.0f;
    backward(m, NULL, counted > 0 ? loss_scale / counted : 0.0f);
}

void model_backward_weighted(Model *m, const float *token_scale) {
    backward(m, token_scale, 1.0f);
}

// ---------------------------------------------------------------- generation

static int check_generation(const Model *m, Err *err) {
    if (model_is_stage(m))
        return err_set(err,
                       "generation: blocks [%d, %d) of %d are a pipeline stage; it needs the "
                       "whole model",
                       m->first_block, m->end_block, m->cfg.num_hidden_layers);
    if (expert_parallel(m))
        return err_set(err,
                       "generation: ep_size %d: expert parallelism is not supported (each "
                       "rank generates with all of its experts)",
                       m->experts.size);
    return 0;
}

void model_cache_free(const Model *m, KvCache *c) {
    m->be->free(c->kv);
    m->be->free(c->span);
    free(c->host_span);
    memset(c, 0, sizeof *c);
}

int model_cache_create(const Model *m, KvCache *c, int B, int max_len, Err *err) {
    const ModelConfig *cf = &m->cfg;
    memset(c, 0, sizeof *c);
    if (check_generation(m, err)) return -1;
    if (!m->be->attention_decode)
        return err_set(err, "generation: the %s backend has no attention_decode", m->be->name);
    if (B < 1 || max_len < 1 || max_len > cf->max_position_embeddings)
        return err_set(err,
                       "generation: a KV cache of %d sequences of %d positions "
                       "(max_position_embeddings %d)",
                       B, max_len, cf->max_position_embeddings);
    c->B = B;
    c->max_len = max_len;
    c->layer_elems = (size_t)B * max_len * cf->num_key_value_heads * cf->head_dim;
    size_t bytes = 2 * (size_t)n_blocks(m) * c->layer_elems * dtype_size(m->be->dtype);
    if (!(c->kv = m->be->alloc(bytes, err)) ||
        !(c->span = m->be->alloc(2 * (size_t)B * sizeof *c->span, err))) {
        model_cache_free(m, c);
        return err_prefix(err, "generation: a KV cache of %d x %d positions", B, max_len);
    }
    if (!(c->host_span = malloc(2 * (size_t)B * sizeof *c->host_span))) {
        model_cache_free(m, c);
        return err_resource(err, "generation: out of memory for %d sequences' spans", B);
    }
    return 0;
}

// forward() as generation runs it, with the cache c (NULL: none): no NEFTune noise (AstrAI's
// Embedding adds it in training mode only) and no expert-load counts (they are the training's).
static int generation_forward(Model *m, KvCache *c, const int32_t *tokens, const int32_t *pos,
                              int B, int T, Err *err) {
    float alpha = m->neftune_alpha;
    int64_t *loads = m->expert_tokens;
    m->neftune_alpha = 0.0f;
    m->expert_tokens = NULL;
    m->cache = c;
    int rc = forward(m, tokens, NULL, NULL, pos, B, T, 0.0f, err);
    m->neftune_alpha = alpha;
    m->expert_tokens = loads;
    m->cache = NULL;
    return rc < 0 ? -1 : 0;
}

// logits: (B,V) host fp32 = row (b, lens[b] - 1) of the last forward's (lens NULL: row (b, 0)).
static void download_last_logits(const Model *m, const int *lens, float *logits) {
    const ModelActs *a = m->acts;
    size_t V = (size_t)m->cfg.vocab_size;
    for (int b = 0; b < a->B; b++) {
        size_t row = (size_t)b * a->T + (lens ? (size_t)lens[b] - 1 : 0);
        m->be->download_f32(logits + b * V, at(m, a->logits, row * V), V);
    }
}

int model_prefill(Model *m, KvCache *c, const int32_t *tokens, const int *lens, int B, int T,
                  float *logits, Err *err) {
    if (check_generation(m, err)) return -1;
    if (c && (c->B != B || T > c->max_len))
        return err_set(err,
                       "generation: a prefill of %d sequences of %d tokens into a KV cache "
                       "of %d x %d",
                       B, T, c->B, c->max_len);
    for (int b = 0; b < B; b++)
        if (lens[b] < 1 || lens[b] > T)
            return err_set(err, "generation: sequence %d of %d tokens in a prefill of %d", b,
                           lens[b], T);
    if (c) c->pos = NULL;
    if (generation_forward(m, c, tokens, NULL, B, T, err)) return -1;
    download_last_logits(m, lens, logits);
    return 0;
}

int model_decode(Model *m, KvCache *c, const int32_t *tokens, const int32_t *pos, float *logits,
                 Err *err) {
    const ModelConfig *cf = &m->cfg;
    int B = c->B, W = cf->sliding_window;
    for (int b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= c->max_len)
            return err_set(err, "generation: position %d of sequence %d outside its KV cache of %d",
                           pos[b], b, c->max_len);
        int first = W ? pos[b] - W + 1 : 0; // transformers' window: keys j > pos - W
        c->host_span[b] = first > 0 ? first : 0;
        c->host_span[B + b] = pos[b] + 1;
    }
    m->be->upload(c->span, c->host_span, 2 * (size_t)B * sizeof *c->span);
    if (m->be->attention_reserve && m->be->attention_reserve(c->max_len, cf->head_dim, err))
        return -1;
    c->pos = pos;
    int rc = generation_forward(m, c, tokens, pos, B, 1, err);
    c->pos = NULL;
    if (rc) return -1;
    download_last_logits(m, NULL, logits);
    return 0;
}
