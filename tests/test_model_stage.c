// test_model_stage.c: a model cut into pipeline stages (engine/model.h) computes what the whole
// model does: the chain of stages, each forward from the previous stage's output and each
// backward from the next stage's input gradient, gives the whole model's loss and gradients
// bit for bit (a tied embedding: the sum of the two stages' parts, to rounding), with packed
// documents, qk-norm, gated attention and gradient checkpointing; and activation sets keep
// several micro-batches apart. On the CPU backend, and where a GPU is visible on the CUDA
// backend too, in bf16 and fp32 (tests/gpu/run.sh runs it there).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "engine/model.h"

enum { B = 2, T = 8 };

static ModelConfig config(bool tied) {
    ModelConfig c = {.vocab_size = 37,
                     .hidden_size = 16,
                     .num_hidden_layers = 4,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2,
                     .intermediate_size = 24,
                     .max_position_embeddings = 16,
                     .rms_norm_eps = 1e-5f,
                     .rope_theta = 10000,
                     .tie_word_embeddings = tied,
                     .use_qk_norm = true,
                     .use_gated_attention = true};
    c.head_dim = c.hidden_size / c.num_attention_heads;
    return c;
}

typedef struct {
    int32_t in[B * T], tg[B * T], mask[B * T], pos[B * T];
} Batch;

// Two packed documents per row; a few tokens not counted.
static void make_batch(Batch *b, uint32_t seed) {
    for (int n = 0; n < B * T; n++) {
        seed = seed * 1664525u + 1013904223u;
        b->in[n] = (int32_t)(seed >> 8) % 37;
        b->tg[n] = (int32_t)(seed >> 16) % 37;
        b->mask[n] = n % 5 != 0;
        b->pos[n] = n % T < 5 ? n % T : n % T - 5;
    }
}

static float forward(Model *m, const Batch *b) {
    Err err = {0};
    float loss = model_forward(m, b->in, b->tg, b->mask, b->pos, B, T, 0.1f, &err);
    CHECK_MSG(m->has_head ? loss == loss : true, "%s", err.msg);
    return loss;
}

// The gradients of tensor `name` of m in host memory (malloc'ed), or NULL when m has none.
static float *grad_of(const Model *m, const char *name) {
    const ParamSpec *p = model_param(m, name);
    if (!p) return NULL;
    float *host = malloc(p->numel * sizeof *host);
    if (host) m->be->download(host, m->grads + p->offset, p->numel * sizeof *host);
    return host;
}

// Every tensor of stage st has the whole model's gradient (bitwise, or to rounding for the
// tied embedding, whose whole-model gradient is the sum over both stages).
static void check_grads(const Model *whole, Model *const *st, int n_st) {
    for (int i = 0; i < whole->n_params; i++) {
        const ParamSpec *p = &whole->params[i];
        float *want = grad_of(whole, p->name), *parts[2];
        int n_parts = 0;
        for (int s = 0; s < n_st && n_parts < 2; s++)
            if ((parts[n_parts] = grad_of(st[s], p->name))) n_parts++;
        CHECK_MSG(n_parts >= 1, "%s: no stage holds it", p->name);
        if (n_parts == 0) {
            free(want);
            continue;
        }
        size_t bad = 0;
        for (size_t j = 0; j < p->numel; j++) {
            float got = n_parts == 1 ? parts[0][j] : parts[0][j] + parts[1][j];
            double tol = n_parts == 1 ? 0 : 1e-6 + 1e-5 * fabs(want[j]);
            bad += fabs((double)got - want[j]) > tol;
        }
        CHECK_MSG(bad == 0, "%s: %zu of %zu gradients differ", p->name, bad, p->numel);
        free(want);
        for (int k = 0; k < n_parts; k++)
            free(parts[k]);
    }
}

// The whole model against stages cut at `cuts` (first blocks of stages 1..n-1).
static void test_chain(const Backend *be, bool tied, bool ckpt, const int *cuts, int n_st) {
    Err err = {0};
    ModelConfig c = config(tied);
    Model whole, *st[4], stages[4];
    CHECK(model_create(&whole, &c, be, &err) == 0);
    CHECK(model_init_random(&whole, 7, &err) == 0);
    whole.grad_checkpointing = ckpt;
    for (int s = 0; s < n_st; s++) {
        int first = s ? cuts[s - 1] : 0, end = s + 1 < n_st ? cuts[s] : c.num_hidden_layers;
        st[s] = &stages[s];
        CHECK_MSG(model_create_stage(st[s], &c, first, end, be, &err) == 0, "%s", err.msg);
        CHECK(model_init_random(st[s], 7, &err) == 0);
        st[s]->grad_checkpointing = ckpt;
        CHECK(model_is_stage(st[s]));
    }
    CHECK(!model_is_stage(&whole));
    Batch b[2];
    make_batch(&b[0], 1);
    make_batch(&b[1], 2);
    model_zero_grad(&whole);
    float want[2];
    for (int k = 0; k < 2; k++) {
        want[k] = forward(&whole, &b[k]);
        model_backward(&whole, 0.5f);
    }
    // The stages run both forwards first (activation sets 0 and 1), then both backwards.
    float got[2];
    for (int s = 0; s < n_st; s++)
        model_zero_grad(st[s]);
    for (int k = 0; k < 2; k++)
        for (int s = 0; s < n_st; s++) {
            CHECK(model_select_acts(st[s], k, &err) == 0);
            st[s]->stage_input = s ? model_stage_output(st[s - 1]) : NULL;
            got[k] = forward(st[s], &b[k]);
        }
    for (int k = 0; k < 2; k++)
        for (int s = n_st - 1; s >= 0; s--) {
            CHECK(model_select_acts(st[s], k, &err) == 0);
            st[s]->stage_dout = s + 1 < n_st ? model_stage_dinput(st[s + 1]) : NULL;
            model_backward(st[s], 0.5f);
        }
    for (int k = 0; k < 2; k++)
        CHECK_MSG(got[k] == want[k], "micro-batch %d: loss %.9g, whole model %.9g", k, got[k],
                  want[k]);
    check_grads(&whole, st, n_st);
    CHECK(model_activation_bytes(st[0]) > 0);
    for (int s = 0; s < n_st; s++)
        model_free(st[s]);
    model_free(&whole);
}

static void test_bad_stage(void) {
    Err err = {0};
    ModelConfig c = config(false);
    Model m;
    CHECK(model_create_stage(&m, &c, 2, 2, backend_cpu(), &err) != 0);
    CHECK(strstr(err.msg, "[2, 2)") != NULL);
    CHECK(model_create_stage(&m, &c, 0, 5, backend_cpu(), &err) != 0);
    // A middle stage refuses a forward without its input.
    CHECK(model_create_stage(&m, &c, 1, 3, backend_cpu(), &err) == 0);
    Batch b;
    make_batch(&b, 3);
    CHECK(model_forward_accumulate(&m, b.in, b.tg, b.mask, b.pos, B, T, 0, &err) != 0);
    CHECK(strstr(err.msg, "input activations") != NULL);
    ParamSpec *table;
    int n;
    size_t floats;
    CHECK(model_stage_table(&c, 1, 3, &table, &n, &floats, &err) == 0);
    CHECK(n == 2 * 12 && floats == m.num_floats &&
          !strcmp(table[0].name, "layers.1.attention.q_proj.weight"));
    free(table);
    model_free(&m);
}

static void test_backend(const Backend *be) {
    const int two[] = {2}, three[] = {1, 3}, four[] = {1, 2, 3};
    int before = check_failures;
    test_chain(be, false, false, two, 2);
    test_chain(be, true, false, two, 2);
    test_chain(be, false, true, three, 3);
    test_chain(be, true, true, four, 4);
    printf("test_model_stage: %s %s: %s\n", be->name, dtype_name(be->dtype),
           check_failures == before ? "ok" : "FAILED");
}

int main(void) {
    test_backend(backend_cpu());
    test_bad_stage();
    const DType cuda_dtypes[] = {DT_BF16, DT_F32};
    for (int k = 0; k < 2 && backend_cuda_available(); k++) {
        const Backend *be;
        Err err = {0};
        CHECK_MSG(backend_open(&be, BACKEND_CUDA, 0, cuda_dtypes[k], &err) == 0, "%s", err.msg);
        if (!err.msg[0]) test_backend(be);
    }
    CHECK_DONE();
}
