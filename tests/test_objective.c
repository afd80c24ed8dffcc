// test_objective.c: an objective table exercised alone (train/objective.h) through the one step
// function (train/step.h), with a toy objective of this file: its samples are rows of a table
// in memory, its loss the model's next-token loss of the row repeated. Checked on a real model
// (CPU backend) in a pipeline of one stage:
// - the order of the table's calls: training runs begin_pass, then forward k, backward k for
//   each micro-batch in turn (the one-stage schedule F0 B0 F1 B1 ...); evaluation forwards only;
//   an objective with a reference runs every reference forward first, on the reference's weights
//   with the NEFTune noise off, then the policy's;
// - the numbers: the step's gradients are bit for bit those of the model's own forward and
//   backward of each micro-batch with the step's weight; evaluation's sum is the losses times the
//   samples;
// - a forward that fails stops the step with its message, and the executor's micro-step is left
//   without a gradient applied.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "train/step.h"

enum { B = 2, T = 6, V = 29, SAMPLES = 5, MAX_CALLS = 64 };

static ModelConfig config(void) {
    ModelConfig c = {.vocab_size = V,
                     .hidden_size = 16,
                     .num_hidden_layers = 2,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2,
                     .intermediate_size = 24,
                     .max_position_embeddings = 16,
                     .rms_norm_eps = 1e-5f,
                     .rope_theta = 10000};
    c.head_dim = c.hidden_size / c.num_attention_heads;
    return c;
}

// One call of the toy's table: which, on which micro-batch, in which pass.
typedef struct {
    char op; // 'p' begin_pass, 'f' forward, 'b' backward
    int k;
    PassKind pass;
    bool on_reference; // forward: the model read the executor's reference weights
    float alpha;       // forward: the model's NEFTune alpha
} Call;

typedef struct {
    int32_t rows[SAMPLES][T]; // sample i: its tokens
    int32_t in[B * T], tg[B * T];
    int nb;
    Call calls[MAX_CALLS];
    int n_calls;
    int fail_at; // forward of this micro-batch fails; -1: none
    const Executor *x;
} Toy;

static void record(Toy *toy, Call c) {
    if (toy->n_calls < MAX_CALLS) toy->calls[toy->n_calls++] = c;
}

static int toy_open(Objective *o, const ObjectiveSetup *s, Err *err) {
    (void)s;
    Toy *toy = calloc(1, sizeof *toy);
    if (!toy) return err_resource(err, "toy: out of memory");
    uint32_t seed = 12345;
    for (int i = 0; i < SAMPLES; i++)
        for (int t = 0; t < T; t++) {
            seed = seed * 1664525u + 1013904223u;
            toy->rows[i][t] = (int32_t)(seed >> 8) % V;
        }
    toy->fail_at = -1;
    o->state = toy;
    o->n_samples = SAMPLES;
    return 0;
}

static void toy_close(Objective *o) {
    free(o->state);
}

// The samples' rows as inputs, each token's target the next one (the last: the first).
static void toy_batch(const int32_t rows[SAMPLES][T], const MicroBatch *mb, int32_t *in,
                      int32_t *tg) {
    for (int b = 0; b < micro_samples(mb); b++)
        for (int t = 0; t < T; t++) {
            const int32_t *row = rows[mb->ids[b * mb->stride]];
            in[b * T + t] = row[t];
            tg[b * T + t] = row[(t + 1) % T];
        }
}

static long toy_fill(Objective *o, const MicroBatch *mb) {
    Toy *toy = o->state;
    toy_batch(toy->rows, mb, toy->in, toy->tg);
    toy->nb = micro_samples(mb);
    return (long)toy->nb * T;
}

static int toy_stage(Objective *o, MicroBatch *mb, bool last_stage, long *tokens, Err *err) {
    (void)o, (void)last_stage, (void)err;
    *tokens = (long)mb->nb * T;
    return 0;
}

static int toy_begin_pass(Objective *o, Executor *x, const MicroBatch *list, int n, PassKind pass,
                          Err *err) {
    (void)x, (void)list, (void)n, (void)err;
    record(o->state, (Call){.op = 'p', .pass = pass});
    return 0;
}

static int toy_forward(Objective *o, Model *m, int k, PassKind pass, float weight, Err *err) {
    (void)weight;
    Toy *toy = o->state;
    record(toy, (Call){.op = 'f',
                       .k = k,
                       .pass = pass,
                       .on_reference = toy->x && m->weights == toy->x->reference,
                       .alpha = m->neftune_alpha});
    if (k == toy->fail_at) return err_set(err, "toy: micro-batch %d refused", k);
    return model_forward_accumulate(m, toy->in, toy->tg, NULL, NULL, toy->nb, T, 0.0f, err);
}

static void toy_backward(Objective *o, Model *m, int k, float weight) {
    record(o->state, (Call){.op = 'b', .k = k, .pass = PASS_TRAIN});
    model_backward(m, weight);
}

static const ObjectiveOps TOY = {.open = toy_open,
                                 .close = toy_close,
                                 .fill = toy_fill,
                                 .stage = toy_stage,
                                 .begin_pass = toy_begin_pass,
                                 .forward = toy_forward,
                                 .backward = toy_backward};

// The step's micro-batches: samples {0,1}, {2,3}, {4}.
static const int64_t IDS[SAMPLES] = {0, 1, 2, 3, 4};
static const MicroBatch LIST[3] = {{.ids = IDS, .stride = 1, .nb = 2},
                                   {.ids = IDS + 2, .stride = 1, .nb = 2},
                                   {.ids = IDS + 4, .stride = 1, .nb = 1}};

typedef struct {
    Model model;
    Executor exec;
    Pipeline pipe;
    Objective obj;
    StepRunner runner;
} Rig;

static void rig_open(Rig *r, const ObjectiveOps *ops) {
    Err err = {0};
    ModelConfig c = config();
    memset(r, 0, sizeof *r);
    CHECK_MSG(model_create(&r->model, &c, backend_cpu(), &err) == 0, "%s", err.msg);
    CHECK(model_init_random(&r->model, 7, &err) == 0);
    CHECK_MSG(pipeline_init(&r->pipe, NULL, 1, PP_1F1B, &c, T, r->model.be, &err) == 0, "%s",
              err.msg);
    CHECK_MSG(executor_init(&r->exec, EXEC_NONE, NULL, NULL, &r->model, 0, &err) == 0, "%s",
              err.msg);
    ObjectiveSetup setup = {.window = T, .stride = T, .batch = B, .be = r->model.be};
    CHECK_MSG(objective_open(&r->obj, ops, &setup, &err) == 0, "%s", err.msg);
    ((Toy *)r->obj.state)->x = &r->exec;
    r->runner =
        (StepRunner){.pipe = &r->pipe, .exec = &r->exec, .model = &r->model, .obj = &r->obj};
    model_zero_grad(&r->model);
}

static void rig_close(Rig *r) {
    objective_close(&r->obj);
    executor_free(&r->exec);
    pipeline_free(&r->pipe);
    model_free(&r->model);
}

static bool call_is(const Call *c, char op, int k, PassKind pass) {
    return c->op == op && c->k == k && c->pass == pass;
}

// Training: begin_pass, then F0 B0 F1 B1 F2 B2; the gradients are the model's own.
static void test_train_order_and_numbers(void) {
    Err err = {0};
    Rig r;
    rig_open(&r, &TOY);
    const float weight = 1.0f / 3;
    CHECK_MSG(step_train(&r.runner, LIST, 3, weight, &err) == 0, "%s", err.msg);
    Toy *toy = r.obj.state;
    CHECK(toy->n_calls == 7);
    CHECK(call_is(&toy->calls[0], 'p', 0, PASS_TRAIN));
    for (int k = 0; k < 3 && toy->n_calls == 7; k++) {
        CHECK_MSG(call_is(&toy->calls[1 + 2 * k], 'f', k, PASS_TRAIN), "call %d", 1 + 2 * k);
        CHECK_MSG(call_is(&toy->calls[2 + 2 * k], 'b', k, PASS_TRAIN), "call %d", 2 + 2 * k);
    }
    // The model's own forward and backward of each micro-batch, on a model with the same weights.
    Model want;
    ModelConfig c = config();
    CHECK(model_create(&want, &c, backend_cpu(), &err) == 0);
    CHECK(model_init_random(&want, 7, &err) == 0);
    model_zero_grad(&want);
    int32_t in[B * T], tg[B * T];
    for (int k = 0; k < 3; k++) {
        toy_batch(toy->rows, &LIST[k], in, tg);
        CHECK(model_forward_accumulate(&want, in, tg, NULL, NULL, LIST[k].nb, T, 0.0f, &err) == 0);
        model_backward(&want, weight);
    }
    size_t bad = 0, nonzero = 0;
    for (size_t i = 0; i < want.num_floats; i++) {
        bad += r.model.grads[i] != want.grads[i];
        nonzero += want.grads[i] != 0;
    }
    CHECK_MSG(bad == 0, "%zu of %zu gradients differ from the model's own", bad, want.num_floats);
    CHECK(nonzero > want.num_floats / 2);
    double got[MODEL_N_STATS], expect[MODEL_N_STATS];
    model_read_stats(&r.model, got);
    model_read_stats(&want, expect);
    CHECK(got[MODEL_STAT_LOSS] == expect[MODEL_STAT_LOSS]);
    model_free(&want);
    rig_close(&r);
}

// Evaluation: forwards only, no noise, the losses times the samples; the gradients untouched.
static void test_eval(void) {
    Err err = {0};
    Rig r;
    rig_open(&r, &TOY);
    r.model.neftune_alpha = 5.0f;
    double sum = 0, want = 0;
    CHECK_MSG(step_eval(&r.runner, LIST, 3, &sum, &err) == 0, "%s", err.msg);
    Toy *toy = r.obj.state;
    CHECK(toy->n_calls == 4);
    CHECK(call_is(&toy->calls[0], 'p', 0, PASS_EVAL));
    for (int k = 0; k < 3 && toy->n_calls == 4; k++) {
        CHECK(call_is(&toy->calls[1 + k], 'f', k, PASS_EVAL));
        CHECK(toy->calls[1 + k].alpha == 0.0f);
    }
    CHECK(r.model.neftune_alpha == 5.0f); // restored
    r.model.neftune_alpha = 0.0f;         // the model's own forwards, without noise
    int32_t in[B * T], tg[B * T];
    for (int k = 0; k < 3; k++) {
        toy_batch(toy->rows, &LIST[k], in, tg);
        want += model_forward(&r.model, in, tg, NULL, NULL, LIST[k].nb, T, 0.0f, &err) * LIST[k].nb;
    }
    CHECK_NEAR(sum, want, 1e-6);
    size_t nonzero = 0;
    for (size_t i = 0; i < r.model.num_floats; i++)
        nonzero += r.model.grads[i] != 0;
    CHECK(nonzero == 0);
    rig_close(&r);
}

// A reference: every reference forward first, on its weights without noise, then the policy's.
static void test_reference(void) {
    Err err = {0};
    ObjectiveOps with_reference = TOY; // the same objective with a frozen reference
    with_reference.reference = true;
    Rig r;
    rig_open(&r, &with_reference);
    CHECK_MSG(executor_keep_reference(&r.exec, &r.model, &err) == 0, "%s", err.msg);
    r.model.neftune_alpha = 5.0f;
    CHECK_MSG(step_train(&r.runner, LIST, 3, 1.0f, &err) == 0, "%s", err.msg);
    Toy *toy = r.obj.state;
    CHECK(toy->n_calls == 10);
    CHECK(call_is(&toy->calls[0], 'p', 0, PASS_TRAIN));
    for (int k = 0; k < 3 && toy->n_calls == 10; k++) {
        const Call *ref = &toy->calls[1 + k], *f = &toy->calls[4 + 2 * k];
        CHECK_MSG(call_is(ref, 'f', k, PASS_REFERENCE), "call %d", 1 + k);
        CHECK(ref->on_reference && ref->alpha == 0.0f);
        CHECK_MSG(call_is(f, 'f', k, PASS_TRAIN), "call %d", 4 + 2 * k);
        CHECK(!f->on_reference && f->alpha == 5.0f);
        CHECK(call_is(&toy->calls[5 + 2 * k], 'b', k, PASS_TRAIN));
    }
    rig_close(&r);
}

// A forward that fails: the step fails with its message, before any later micro-batch.
static void test_failure(void) {
    Err err = {0};
    Rig r;
    rig_open(&r, &TOY);
    Toy *toy = r.obj.state;
    toy->fail_at = 1;
    CHECK(step_train(&r.runner, LIST, 3, 1.0f, &err) != 0);
    CHECK_MSG(strstr(err.msg, "toy: micro-batch 1 refused") != NULL, "%s", err.msg);
    CHECK(toy->n_calls == 4); // p, F0, B0, F1
    rig_close(&r);
}

int main(void) {
    test_train_order_and_numbers();
    test_eval();
    test_reference();
    test_failure();
    CHECK_DONE();
}
