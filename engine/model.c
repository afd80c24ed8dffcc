// model.c: the AstrAI autoregressive LM (DESIGN §7): parameter table, init, load/save,
// forward with loss and backward, orchestrated over the ops of engine/backend.h.
//
// Layout tricks that keep the big matmuls big (one sgemm over all B*T rows):
// - q_proj, k_proj, v_proj are adjacent in the flat weights, so one matmul with the
//   (H+2*KVH)*D x C block gives qkv: (N, QKV) rows [q | k | v]; rope, qk-norm and
//   attention work on it in place through a token stride.
// - mlp.up and mlp.gate are adjacent too: one matmul gives h: (N, 2FF) rows [up | gate].
#include "engine/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend.h"
#include "engine/rng.h"

// Parameter indices inside one layer, in AstrAI key order (absent optional ones skipped).
typedef struct {
    int q_proj, o_proj, q_norm, k_norm, gate, input_norm, post_norm, mlp_up, mlp_down;
} LayerParams;

struct ModelActs {
    const Backend *be;
    float *rope; // (max_position_embeddings, head_dim/2, 2) cos, sin
    LayerParams *layer;
    int embed, norm, lm_head; // parameter indices (lm_head = embed when tied)

    size_t capacity; // token rows the buffers below hold
    size_t bytes;
    int B, T;
    int has_loss;
    float label_smoothing, counted;
    int32_t *inputs, *targets, *mask, *pos, *doc_start; // (N)
    // per layer, (L, N, ...): the layer input and what backward needs
    float *res;                 // (L+1, N, C): res[L] is the last block's output
    float *ln1, *rstd1;         // (L,N,C), (L,N)
    float *qkv;                 // (L,N,QKV) after rope
    float *qkn, *rstdq, *rstdk; // (L,N,QKV) q,k after qk-norm; (L,N,H), (L,N,KVH)
    float *att, *lse;           // (L,N,C), (L,B,H,T)
    float *gate, *gated;        // (L,N,C) gate pre-activation and att * sigmoid(gate)
    float *mid, *ln2, *rstd2;   // (L,N,C), (L,N,C), (L,N)
    float *h, *act;             // (L,N,2FF), (L,N,FF)
    float *lnf, *rstdf, *logits, *lse_ce, *loss_rows; // (N,C), (N), (N,V), (N), (N)
    // backward scratch, reused by every layer
    float *dres, *dln, *dqkv, *dqkn, *dgated, *datt, *dgate, *dh, *dact, *dlogits;
};

// ---------------------------------------------------------------- parameter table

static int add_param(Model *m, int cap, const char *name, int64_t rows, int64_t cols) {
    if (m->n_params == cap) return -1;
    ParamSpec *p = &m->params[m->n_params];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = cols ? 2 : 1;
    p->shape[0] = rows;
    p->shape[1] = cols;
    p->numel = (size_t)rows * (size_t)(cols ? cols : 1);
    p->offset = m->num_floats;
    m->num_floats += p->numel;
    return m->n_params++;
}

static int add_layer_params(Model *m, int cap, int l, LayerParams *lp) {
    const ModelConfig *c = &m->cfg;
    int C = c->hidden_size, D = c->head_dim, KV = c->num_key_value_heads * D;
    char name[96];
#define LAYER_PARAM(field, key, rows, cols)                                                        \
    snprintf(name, sizeof name, "layers.%d.%s.weight", l, key);                                    \
    field = add_param(m, cap, name, rows, cols)
    int k_proj, v_proj, mlp_gate;
    LAYER_PARAM(lp->q_proj, "attention.q_proj", C, C);
    LAYER_PARAM(k_proj, "attention.k_proj", KV, C);
    LAYER_PARAM(v_proj, "attention.v_proj", KV, C);
    LAYER_PARAM(lp->o_proj, "attention.o_proj", C, C);
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

static int build_param_table(Model *m, Err *err) {
    const ModelConfig *c = &m->cfg;
    int cap = 3 + 13 * c->num_hidden_layers;
    m->params = calloc((size_t)cap, sizeof *m->params);
    m->acts->layer = calloc((size_t)c->num_hidden_layers, sizeof *m->acts->layer);
    if (!m->params || !m->acts->layer) return err_set(err, "model: out of memory");
    ModelActs *a = m->acts;
    a->embed = add_param(m, cap, "embed_tokens.weight", c->vocab_size, c->hidden_size);
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (add_layer_params(m, cap, l, &a->layer[l])) return err_set(err, "model: table full");
    a->norm = add_param(m, cap, "norm.weight", c->hidden_size, 0);
    a->lm_head = c->tie_word_embeddings
                     ? a->embed
                     : add_param(m, cap, "lm_head.weight", c->vocab_size, c->hidden_size);
    return 0;
}

// cos/sin of position * base^(-2i/D) as AstrAI computes them (angle in fp64, then fp32).
static void fill_rope_table(float *table, const ModelConfig *c) {
    int half = c->head_dim / 2;
    for (int p = 0; p < c->max_position_embeddings; p++)
        for (int i = 0; i < half; i++) {
            double theta = pow(c->rope_theta, -2.0 * i / c->head_dim);
            float angle = (float)(p * theta);
            table[((size_t)p * half + i) * 2] = cosf(angle);
            table[((size_t)p * half + i) * 2 + 1] = sinf(angle);
        }
}

int model_create(Model *m, const ModelConfig *cfg, Err *err) {
    memset(m, 0, sizeof *m);
    m->cfg = *cfg;
    m->acts = calloc(1, sizeof *m->acts);
    if (!m->acts) return err_set(err, "model: out of memory");
    ModelActs *a = m->acts;
    a->be = backend_cpu();
    if (build_param_table(m, err)) return model_free(m), -1;
    size_t rope_floats = (size_t)cfg->max_position_embeddings * cfg->head_dim;
    m->weights = a->be->alloc(m->num_floats * sizeof(float));
    m->grads = a->be->alloc(m->num_floats * sizeof(float));
    a->rope = a->be->alloc(rope_floats * sizeof(float));
    if (!m->weights || !m->grads || !a->rope) {
        model_free(m);
        return err_set(err, "model: out of memory for %zu parameters", m->num_floats);
    }
    fill_rope_table(a->rope, cfg);
    return 0;
}

const ParamSpec *model_param(const Model *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

static float *weight(const Model *m, int index) {
    return m->weights + m->params[index].offset;
}
static float *grad(const Model *m, int index) {
    return m->grads + m->params[index].offset;
}

// ---------------------------------------------------------------- init, load, save

void model_init_random(Model *m, uint64_t seed) {
    Rng rng;
    rng_seed(&rng, seed);
    float std_out = 0.02f / sqrtf(2.0f * m->cfg.num_hidden_layers);
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        float *w = m->weights + p->offset;
        if (p->ndim == 1) {
            for (size_t j = 0; j < p->numel; j++)
                w[j] = 1.0f;
            continue;
        }
        int scaled = strstr(p->name, "o_proj") || strstr(p->name, "mlp.down");
        for (size_t j = 0; j < p->numel; j++)
            w[j] = rng_normal(&rng, 0.0f, scaled ? std_out : 0.02f);
    }
}

static int check_no_unexpected(const Model *m, const StFile *f, const char *path, Err *err) {
    for (int i = 0; i < f->n_tensors; i++) {
        const char *name = f->tensors[i].name;
        int tied_head = m->cfg.tie_word_embeddings && strcmp(name, "lm_head.weight") == 0;
        if (!tied_head && !model_param(m, name))
            return err_set(err, "%s: unexpected tensor '%s' for this config", path, name);
    }
    return 0;
}

int model_load(Model *m, const char *path, Err *err) {
    StFile f;
    if (st_open(&f, path, err)) return -1;
    int rc = check_no_unexpected(m, &f, path, err);
    for (int i = 0; i < m->n_params && rc == 0; i++) {
        const ParamSpec *p = &m->params[i];
        float *w = m->weights + p->offset;
        // AstrAI: an untied model without lm_head.weight starts from a copy of the embedding.
        if (strcmp(p->name, "lm_head.weight") == 0 && !st_find(&f, p->name)) {
            memcpy(w, weight(m, m->acts->embed), p->numel * sizeof *w);
            continue;
        }
        rc = st_read_f32(&f, p->name, p->ndim, p->shape, w, err);
        if (rc) err_prefix(err, "%s", path);
    }
    st_close(&f);
    return rc;
}

int model_save(const Model *m, const char *path, StDType dtype, Err *err) {
    StWriteTensor *t = calloc((size_t)m->n_params, sizeof *t);
    if (!t) return err_set(err, "%s: out of memory", path);
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        t[i] = (StWriteTensor){.name = p->name, .ndim = p->ndim, .data = weight(m, i)};
        t[i].shape[0] = p->shape[0];
        t[i].shape[1] = p->shape[1];
    }
    int rc = st_write(path, t, m->n_params, dtype, err);
    free(t);
    return rc;
}

// ---------------------------------------------------------------- activation buffers

typedef struct {
    void **ptr;
    size_t bytes;
} Buffer;

// Every activation buffer with its size for N token rows; one table for alloc and free.
static int activation_buffers(const Model *m, size_t N, int B, Buffer *out) {
    ModelActs *a = m->acts;
    const ModelConfig *c = &m->cfg;
    size_t L = c->num_hidden_layers, C = c->hidden_size, V = c->vocab_size,
           FF = c->intermediate_size, H = c->num_attention_heads, KVH = c->num_key_value_heads,
           QKV = (H + 2 * KVH) * c->head_dim, qk = c->use_qk_norm, gated = c->use_gated_attention;
    const size_t f = sizeof(float), i32 = sizeof(int32_t);
    (void)B;
    Buffer table[] = {
        {(void **)&a->inputs, N * i32},
        {(void **)&a->targets, N * i32},
        {(void **)&a->mask, N * i32},
        {(void **)&a->pos, N * i32},
        {(void **)&a->doc_start, N * i32},
        {(void **)&a->res, (L + 1) * N * C * f},
        {(void **)&a->ln1, L * N * C * f},
        {(void **)&a->rstd1, L * N * f},
        {(void **)&a->qkv, L * N * QKV * f},
        {(void **)&a->qkn, qk * L * N * QKV * f},
        {(void **)&a->rstdq, qk * L * N * H * f},
        {(void **)&a->rstdk, qk * L * N * KVH * f},
        {(void **)&a->att, L * N * C * f},
        {(void **)&a->lse, L * N * H * f},
        {(void **)&a->gate, gated * L * N * C * f},
        {(void **)&a->gated, gated * L * N * C * f},
        {(void **)&a->mid, L * N * C * f},
        {(void **)&a->ln2, L * N * C * f},
        {(void **)&a->rstd2, L * N * f},
        {(void **)&a->h, L * N * 2 * FF * f},
        {(void **)&a->act, L * N * FF * f},
        {(void **)&a->lnf, N * C * f},
        {(void **)&a->rstdf, N * f},
        {(void **)&a->logits, N * V * f},
        {(void **)&a->lse_ce, N * f},
        {(void **)&a->loss_rows, N * f},
        {(void **)&a->dres, N * C * f},
        {(void **)&a->dln, N * C * f},
        {(void **)&a->dqkv, N * QKV * f},
        {(void **)&a->dqkn, qk * N * QKV * f},
        {(void **)&a->dgated, N * C * f},
        {(void **)&a->datt, N * C * f},
        {(void **)&a->dgate, gated * N * C * f},
        {(void **)&a->dh, N * 2 * FF * f},
        {(void **)&a->dact, N * FF * f},
        {(void **)&a->dlogits, N * V * f},
    };
    size_t n = sizeof table / sizeof table[0];
    if (out) memcpy(out, table, sizeof table);
    return (int)n;
}

enum { MAX_BUFFERS = 64 };

static void free_activations(Model *m) {
    Buffer table[MAX_BUFFERS];
    int n = activation_buffers(m, 0, 0, table);
    for (int i = 0; i < n; i++) {
        m->acts->be->free(*table[i].ptr);
        *table[i].ptr = NULL;
    }
    m->acts->capacity = 0;
    m->acts->bytes = 0;
}

static int ensure_activations(Model *m, size_t N, Err *err) {
    ModelActs *a = m->acts;
    if (N <= a->capacity) return 0;
    free_activations(m);
    Buffer table[MAX_BUFFERS];
    int n = activation_buffers(m, N, 0, table);
    for (int i = 0; i < n; i++) {
        *table[i].ptr = table[i].bytes ? a->be->alloc(table[i].bytes) : NULL;
        if (table[i].bytes && !*table[i].ptr) {
            free_activations(m);
            return err_set(err, "model: out of memory for activations of %zu tokens", N);
        }
        a->bytes += table[i].bytes;
    }
    a->capacity = N;
    return 0;
}

size_t model_activation_bytes(const Model *m) {
    return m->acts ? m->acts->bytes : 0;
}

void model_free(Model *m) {
    if (m->acts) {
        free_activations(m);
        m->acts->be->free(m->acts->rope);
        m->acts->be->free(m->weights);
        m->acts->be->free(m->grads);
        free(m->acts->layer);
        free(m->acts);
    }
    free(m->params);
    memset(m, 0, sizeof *m);
}

int model_acquire(Model *m, bool weights, bool grads, Err *err) {
    const Backend *be = m->acts->be;
    size_t bytes = m->num_floats * sizeof(float);
    if (weights && !m->weights && !(m->weights = be->alloc(bytes)))
        return err_set(err, "model: out of memory for %zu weights", m->num_floats);
    if (grads && !m->grads && !(m->grads = be->alloc(bytes)))
        return err_set(err, "model: out of memory for %zu gradients", m->num_floats);
    return 0;
}

void model_release(Model *m, bool weights, bool grads) {
    if (weights) {
        m->acts->be->free(m->weights);
        m->weights = NULL;
    }
    if (grads) {
        m->acts->be->free(m->grads);
        m->grads = NULL;
    }
}

void model_zero_grad(Model *m) {
    m->acts->be->zero(m->grads, m->num_floats * sizeof(float));
}

const float *model_logits(const Model *m) {
    return m->acts->logits;
}

// ---------------------------------------------------------------- forward

// Checks ids and positions, copies what backward needs, derives positions and the
// first visible key of each token (the start of its document).
static int prepare_inputs(Model *m, const int32_t *inputs, const int32_t *targets,
                          const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                          Err *err) {
    ModelActs *a = m->acts;
    const ModelConfig *c = &m->cfg;
    if (!position_ids && T > c->max_position_embeddings)
        return err_set(err, "model: sequence length %d exceeds max_position_embeddings %d", T,
                       c->max_position_embeddings);
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
            int pos = position_ids ? position_ids[n] : t;
            if (pos < 0 || pos >= c->max_position_embeddings)
                return err_set(err, "model: position id %d at (%d,%d) outside [0, %d)", pos, b, t,
                               c->max_position_embeddings);
            if (t > 0 && pos <= a->pos[n - 1]) start = t; // a new packed document
            a->pos[n] = pos;
            a->doc_start[n] = start;
            a->inputs[n] = inputs[n];
            a->targets[n] = counted ? targets[n] : 0;
            a->mask[n] = counted;
        }
    return 0;
}

static size_t qkv_width(const ModelConfig *c) {
    return (size_t)(c->num_attention_heads + 2 * c->num_key_value_heads) * c->head_dim;
}

// res[l+1] = res[l] + attn(input_norm(res[l])) + mlp(post_attention_norm(.)), layer l.
static void layer_forward(Model *m, int l, int B, int T) {
    ModelActs *a = m->acts;
    const Backend *be = a->be;
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &a->layer[l];
    int N = B * T, C = c->hidden_size, H = c->num_attention_heads, KVH = c->num_key_value_heads,
        D = c->head_dim, FF = c->intermediate_size, QKV = (int)qkv_width(c);
    size_t nc = (size_t)N * C;
    float *res = a->res + l * nc, *ln1 = a->ln1 + l * nc, *qkv = a->qkv + (size_t)l * N * QKV,
          *att = a->att + l * nc, *mid = a->mid + l * nc, *ln2 = a->ln2 + l * nc,
          *h = a->h + (size_t)l * N * 2 * FF, *act = a->act + (size_t)l * N * FF;

    be->rmsnorm_fwd(ln1, a->rstd1 + (size_t)l * N, res, weight(m, p->input_norm), N, 1, C, C,
                    c->rms_norm_eps);
    be->matmul_fwd(qkv, ln1, weight(m, p->q_proj), N, C, QKV, 0);
    be->rope_fwd(qkv, a->pos, a->rope, N, H, D, QKV);
    be->rope_fwd(qkv + H * D, a->pos, a->rope, N, KVH, D, QKV);
    float *qk = qkv; // q and k as attention sees them
    if (c->use_qk_norm) {
        qk = a->qkn + (size_t)l * N * QKV;
        be->rmsnorm_fwd(qk, a->rstdq + (size_t)l * N * H, qkv, weight(m, p->q_norm), N, H, D, QKV,
                        c->rms_norm_eps);
        be->rmsnorm_fwd(qk + H * D, a->rstdk + (size_t)l * N * KVH, qkv + H * D,
                        weight(m, p->k_norm), N, KVH, D, QKV, c->rms_norm_eps);
    }
    be->attention_fwd(att, a->lse + (size_t)l * N * H, qk, qk + H * D, qkv + (H + KVH) * D,
                      a->doc_start, B, T, H, KVH, D, QKV);
    float *o_in = att;
    if (c->use_gated_attention) {
        float *gate = a->gate + l * nc;
        o_in = a->gated + l * nc;
        be->matmul_fwd(gate, ln1, weight(m, p->gate), N, C, C, 0);
        be->sigmoid_gate_fwd(o_in, att, gate, nc);
    }
    be->copy(mid, res, nc * sizeof(float));
    be->matmul_fwd(mid, o_in, weight(m, p->o_proj), N, C, C, 1);

    be->rmsnorm_fwd(ln2, a->rstd2 + (size_t)l * N, mid, weight(m, p->post_norm), N, 1, C, C,
                    c->rms_norm_eps);
    be->matmul_fwd(h, ln2, weight(m, p->mlp_up), N, C, 2 * FF, 0);
    be->swiglu_fwd(act, h, N, FF);
    be->copy(res + nc, mid, nc * sizeof(float));
    be->matmul_fwd(res + nc, act, weight(m, p->mlp_down), N, FF, C, 1);
}

float model_forward(Model *m, const int32_t *inputs, const int32_t *targets,
                    const int32_t *loss_mask, const int32_t *position_ids, int B, int T,
                    float label_smoothing, Err *err) {
    ModelActs *a = m->acts;
    const Backend *be = a->be;
    const ModelConfig *c = &m->cfg;
    a->has_loss = 0;
    if (B <= 0 || T <= 0 || (size_t)B * T > (size_t)1 << 30) {
        err_set(err, "model: bad batch shape B=%d T=%d", B, T);
        return NAN;
    }
    if (!(label_smoothing >= 0.0f && label_smoothing <= 1.0f)) {
        err_set(err, "model: label_smoothing %g outside [0, 1]", label_smoothing);
        return NAN;
    }
    int N = B * T, C = c->hidden_size, V = c->vocab_size, L = c->num_hidden_layers;
    if (ensure_activations(m, (size_t)N, err) ||
        prepare_inputs(m, inputs, targets, loss_mask, position_ids, B, T, err))
        return NAN;
    a->B = B;
    a->T = T;
    be->embedding_fwd(a->res, a->inputs, weight(m, a->embed), N, C);
    for (int l = 0; l < L; l++)
        layer_forward(m, l, B, T);
    be->rmsnorm_fwd(a->lnf, a->rstdf, a->res + (size_t)L * N * C, weight(m, a->norm), N, 1, C, C,
                    c->rms_norm_eps);
    be->matmul_fwd(a->logits, a->lnf, weight(m, a->lm_head), N, C, V, 0);
    if (!targets) return 0.0f;

    be->cross_entropy_fwd(a->loss_rows, a->lse_ce, a->logits, a->targets, a->mask, N, V,
                          label_smoothing);
    double sum = 0.0;
    int counted = 0;
    for (int n = 0; n < N; n++) {
        sum += a->loss_rows[n];
        counted += a->mask[n] != 0;
    }
    a->has_loss = 1;
    a->counted = (float)counted;
    a->label_smoothing = label_smoothing;
    return counted ? (float)(sum / counted) : 0.0f;
}

// ---------------------------------------------------------------- backward

// Takes dres = d loss / d res[l+1]; leaves d loss / d res[l] in it.
static void layer_backward(Model *m, int l) {
    ModelActs *a = m->acts;
    const Backend *be = a->be;
    const ModelConfig *c = &m->cfg;
    const LayerParams *p = &a->layer[l];
    int B = a->B, T = a->T, N = B * T, C = c->hidden_size, H = c->num_attention_heads,
        KVH = c->num_key_value_heads, D = c->head_dim, FF = c->intermediate_size,
        QKV = (int)qkv_width(c);
    size_t nc = (size_t)N * C;
    float *res = a->res + l * nc, *ln1 = a->ln1 + l * nc, *qkv = a->qkv + (size_t)l * N * QKV,
          *att = a->att + l * nc, *mid = a->mid + l * nc, *ln2 = a->ln2 + l * nc,
          *h = a->h + (size_t)l * N * 2 * FF, *act = a->act + (size_t)l * N * FF;

    // mlp branch: res[l+1] = mid + down(swiglu(up|gate(ln2)))
    be->matmul_bwd(a->dact, grad(m, p->mlp_down), a->dres, act, weight(m, p->mlp_down), N, FF, C,
                   0);
    be->swiglu_bwd(a->dh, a->dact, h, N, FF);
    be->matmul_bwd(a->dln, grad(m, p->mlp_up), a->dh, ln2, weight(m, p->mlp_up), N, C, 2 * FF, 0);
    be->rmsnorm_bwd(a->dres, grad(m, p->post_norm), a->dln, mid, weight(m, p->post_norm),
                    a->rstd2 + (size_t)l * N, N, 1, C, C, 1);

    // attention branch: mid = res + o_proj(att [* sigmoid(gate(ln1))])
    float *o_in = c->use_gated_attention ? a->gated + l * nc : att;
    be->matmul_bwd(a->dgated, grad(m, p->o_proj), a->dres, o_in, weight(m, p->o_proj), N, C, C, 0);
    float *datt = a->dgated;
    if (c->use_gated_attention) {
        datt = a->datt;
        be->sigmoid_gate_bwd(datt, a->dgate, a->dgated, att, a->gate + l * nc, nc);
    }
    float *qk = c->use_qk_norm ? a->qkn + (size_t)l * N * QKV : qkv;
    float *dqk = c->use_qk_norm ? a->dqkn : a->dqkv;
    be->attention_bwd(dqk, dqk + H * D, a->dqkv + (H + KVH) * D, datt, att,
                      a->lse + (size_t)l * N * H, qk, qk + H * D, qkv + (H + KVH) * D, a->doc_start,
                      B, T, H, KVH, D, QKV);
    if (c->use_qk_norm) {
        be->rmsnorm_bwd(a->dqkv, grad(m, p->q_norm), dqk, qkv, weight(m, p->q_norm),
                        a->rstdq + (size_t)l * N * H, N, H, D, QKV, 0);
        be->rmsnorm_bwd(a->dqkv + H * D, grad(m, p->k_norm), dqk + H * D, qkv + H * D,
                        weight(m, p->k_norm), a->rstdk + (size_t)l * N * KVH, N, KVH, D, QKV, 0);
    }
    be->rope_bwd(a->dqkv, a->pos, a->rope, N, H, D, QKV);
    be->rope_bwd(a->dqkv + H * D, a->pos, a->rope, N, KVH, D, QKV);
    int have_dln = 0;
    if (c->use_gated_attention) {
        be->matmul_bwd(a->dln, grad(m, p->gate), a->dgate, ln1, weight(m, p->gate), N, C, C, 0);
        have_dln = 1;
    }
    be->matmul_bwd(a->dln, grad(m, p->q_proj), a->dqkv, ln1, weight(m, p->q_proj), N, C, QKV,
                   have_dln);
    be->rmsnorm_bwd(a->dres, grad(m, p->input_norm), a->dln, res, weight(m, p->input_norm),
                    a->rstd1 + (size_t)l * N, N, 1, C, C, 1);
}

void model_backward(Model *m, float loss_scale) {
    ModelActs *a = m->acts;
    if (!a->has_loss || a->counted == 0) return; // no counted token: the loss is constant 0
    const Backend *be = a->be;
    const ModelConfig *c = &m->cfg;
    int N = a->B * a->T, C = c->hidden_size, V = c->vocab_size, L = c->num_hidden_layers;
    be->cross_entropy_bwd(a->dlogits, a->logits, a->lse_ce, a->targets, a->mask, N, V,
                          a->label_smoothing, loss_scale / a->counted);
    be->matmul_bwd(a->dln, grad(m, a->lm_head), a->dlogits, a->lnf, weight(m, a->lm_head), N, C, V,
                   0);
    be->rmsnorm_bwd(a->dres, grad(m, a->norm), a->dln, a->res + (size_t)L * N * C,
                    weight(m, a->norm), a->rstdf, N, 1, C, C, 0);
    for (int l = L - 1; l >= 0; l--)
        layer_backward(m, l);
    be->embedding_bwd(grad(m, a->embed), a->dres, a->inputs, N, C);
}
