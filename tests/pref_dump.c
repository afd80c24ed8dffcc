// pref_dump: one DPO or GRPO micro-batch through the C engine, dumped for the PyTorch
// reference (tests/test_pref_ref.py).
//
//   pref_dump --model DIR --reference DIR --data PATH --train_type dpo|grpo --window W
//             [--dpo_beta B] [--group_size G] [--grpo_clip_eps E] [--grpo_kl_coef K]
//             --out OUT.safetensors
//
// Every record of PATH (a .jsonl file or record shards), in order, is one micro-batch of the
// objective's training step (train/objective.h, train/step.h); the reference forward reads
// --reference's weights, the policy's --model's. OUT holds `loss` (1), `metrics` (2: DPO reward
// margin and accuracy, GRPO KL and clip fraction) and `grad.<param>` for every parameter.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/model_dir.h"
#include "data/records.h"
#include "tests/grad_dump.h"
#include "train/step.h"
#include "train/train_ckpt.h"

typedef struct {
    const char *model, *reference, *data, *train_type, *out;
    long window, group_size;
    float beta, clip_eps, kl_coef;
} Args;

static int parse_args(int argc, char **argv, Args *a, Err *err) {
    *a = (Args){.beta = 0.1f, .clip_eps = 0.2f, .kl_coef = 0.01f, .group_size = 4};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--model"))
            a->model = v;
        else if (!strcmp(k, "--reference"))
            a->reference = v;
        else if (!strcmp(k, "--data"))
            a->data = v;
        else if (!strcmp(k, "--train_type"))
            a->train_type = v;
        else if (!strcmp(k, "--out"))
            a->out = v;
        else if (!strcmp(k, "--window"))
            a->window = atol(v);
        else if (!strcmp(k, "--group_size"))
            a->group_size = atol(v);
        else if (!strcmp(k, "--dpo_beta"))
            a->beta = strtof(v, NULL);
        else if (!strcmp(k, "--grpo_clip_eps"))
            a->clip_eps = strtof(v, NULL);
        else if (!strcmp(k, "--grpo_kl_coef"))
            a->kl_coef = strtof(v, NULL);
        else
            return err_set(err, "unknown flag %s", k);
    }
    if (!a->model || !a->reference || !a->data || !a->train_type || !a->out || a->window < 1 ||
        (strcmp(a->train_type, "dpo") && strcmp(a->train_type, "grpo")))
        return err_set(err, "usage: pref_dump --model DIR --reference DIR --data PATH "
                            "--train_type dpo|grpo --window W [knobs] --out OUT");
    return 0;
}

// The spec of the objective: the train type and its knobs, every record in one micro-batch.
static int make_spec(const Args *a, int64_t records, TrainSpec *s, Err *err) {
    char n[32], beta[32], eps[32], kl[32], group[32];
    snprintf(n, sizeof n, "%lld", (long long)records);
    snprintf(beta, sizeof beta, "%.9g", a->beta);
    snprintf(eps, sizeof eps, "%.9g", a->clip_eps);
    snprintf(kl, sizeof kl, "%.9g", a->kl_coef);
    snprintf(group, sizeof group, "%ld", a->group_size);
    const char *kv[][2] = {{"train_type", a->train_type}, {"data_root_path", a->data},
                           {"batch_per_device", n},       {"dpo_beta", beta},
                           {"grpo_clip_eps", eps},        {"grpo_kl_coef", kl},
                           {"group_size", group}};
    if (train_spec_defaults(s, err)) return -1;
    for (size_t k = 0; k < sizeof kv / sizeof *kv; k++)
        if (train_spec_set(s, kv[k][0], kv[k][1], err)) return -1;
    return 0;
}

// The records of the data, counted.
static int count_records(const Args *a, const ModelConfig *cfg, int64_t *n, Err *err) {
    RecordSet rs = {0};
    int rc = records_open(&rs, a->data, strcmp(a->train_type, "dpo") ? RECORDS_GRPO : RECORDS_DPO,
                          (int)a->group_size, cfg->vocab_size, 0, err);
    *n = rs.n_records;
    records_free(&rs);
    return rc;
}

// The micro-batch of every record through the training step (train/step.h) of one rank: m holds
// the reference's weights, kept frozen before the policy's are loaded from policy_dir.
static int train_once(Model *m, Objective *o, const char *policy_dir, long window, Err *err) {
    Executor x = {0};
    Pipeline pipe = {0};
    int64_t *ids = malloc((size_t)o->n_samples * sizeof *ids);
    if (!ids)
        return err_resource(err, "out of memory for %lld record ids", (long long)o->n_samples);
    for (int64_t r = 0; r < o->n_samples; r++)
        ids[r] = r;
    MicroBatch mb = {.ids = ids, .stride = 1, .nb = (int)o->n_samples};
    StepRunner runner = {.pipe = &pipe, .exec = &x, .model = m, .obj = o};
    int rc = pipeline_init(&pipe, NULL, 1, PP_1F1B, &m->cfg, window, m->be, err) ||
             executor_init(&x, EXEC_NONE, NULL, NULL, m, 0, err) ||
             executor_keep_reference(&x, m, err) || train_ckpt_load_weights(m, policy_dir, err);
    long tokens;
    if (!rc) rc = o->ops->stage(o, &mb, true, &tokens, err);
    if (!rc) rc = step_train(&runner, &mb, 1, 1.0f, err);
    executor_free(&x);
    pipeline_free(&pipe);
    free(ids);
    return rc;
}

static int run(const Args *a, Err *err) {
    ModelConfig cfg;
    Model m = {0};
    Objective o = {0};
    TrainSpec spec = {0};
    int64_t records = 0;
    int rc =
        ckpt_model_config(&cfg, a->model, err) || count_records(a, &cfg, &records, err) ||
        make_spec(a, records, &spec, err) ||
        train_ckpt_load_model(&m, &cfg, 0, cfg.num_hidden_layers, backend_cpu(), a->reference, err);
    ObjectiveSetup setup = {.spec = &spec,
                            .cfg = &cfg,
                            .window = a->window,
                            .stride = a->window,
                            .batch = (int)records,
                            .be = m.be};
    if (!rc) rc = objective_open(&o, objective_of(spec.is.train_type), &setup, err);
    if (!rc) {
        model_zero_grad(&m);
        rc = train_once(&m, &o, a->model, a->window, err);
    }
    if (!rc) {
        double stats[MODEL_N_STATS];
        model_read_stats(&m, stats);
        float loss = (float)stats[MODEL_STAT_LOSS];
        float metrics[2] = {(float)stats[MODEL_STAT_PREF_A], (float)stats[MODEL_STAT_PREF_B]};
        StWriteTensor w[2] = {{.name = "loss", .ndim = 1, .shape = {1}, .data = &loss},
                              {.name = "metrics", .ndim = 1, .shape = {2}, .data = metrics}};
        rc = dump_with_grads(&m, a->out, w, 2, err);
    }
    objective_close(&o);
    train_spec_free(&spec);
    model_free(&m);
    return rc;
}

int main(int argc, char **argv) {
    Args a;
    Err err = {0};
    if (parse_args(argc, argv, &a, &err) || run(&a, &err)) {
        fprintf(stderr, "pref_dump: %s\n", err.msg);
        return EXIT_BAD_INPUT;
    }
    return 0;
}
