// pref_dump: one DPO or GRPO micro-batch through the C engine, dumped for the PyTorch
// reference (tests/test_pref_ref.py).
//
//   pref_dump --model DIR --reference DIR --data PATH --train_type dpo|grpo --window W
//             [--dpo_beta B] [--group_size G] [--grpo_clip_eps E] [--grpo_kl_coef K]
//             --out OUT.safetensors
//
// Every record of PATH (a .jsonl file or record shards), in order, is one micro-batch
// (train/pref_batch.h's rows); the reference forward reads --reference's weights, the
// policy's --model's. OUT holds `loss` (1), `metrics` (2: DPO reward margin and accuracy,
// GRPO KL and clip fraction) and `grad.<param>` for every parameter.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/model_dir.h"
#include "engine/preference.h"
#include "tests/grad_dump.h"
#include "train/pref_batch.h"
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

static int run(const Args *a, Err *err) {
    int dpo = !strcmp(a->train_type, "dpo");
    ModelConfig cfg;
    Model m = {0};
    Executor x = {0};
    RecordSet rs = {0};
    PrefBatch b = {0};
    PrefLoss p = {0};
    int rc = ckpt_model_config(&cfg, a->model, err) ||
             records_open(&rs, a->data, dpo ? RECORDS_DPO : RECORDS_GRPO, (int)a->group_size,
                          cfg.vocab_size, 0, err) ||
             train_ckpt_load_model(&m, &cfg, 0, cfg.num_hidden_layers, backend_cpu(), a->reference,
                                   err) ||
             executor_init(&x, EXEC_NONE, NULL, NULL, &m, 0, err) ||
             executor_keep_reference(&x, &m, err) || train_ckpt_load_weights(&m, a->model, err) ||
             pref_batch_init(&b, &rs, (int)rs.n_records, a->window, err);
    int64_t *ids = rc ? NULL : malloc((size_t)rs.n_records * sizeof *ids);
    if (!rc && !ids) rc = err_resource(err, "out of memory for %d record ids", (int)rs.n_records);
    if (!rc) {
        for (int64_t r = 0; r < rs.n_records; r++)
            ids[r] = r;
        pref_batch_fill(&b, &rs, ids, 1, (int)rs.n_records);
        pref_init(&p, dpo ? PREF_DPO : PREF_GRPO, a->beta, a->clip_eps, a->kl_coef, m.be);
        model_zero_grad(&m);
        rc = pref_batch_forward(&b, &p, &x, &m, MICRO_SYNC, 1.0f, err);
    }
    if (!rc) {
        model_backward_weighted(&m, p.scale);
        double stats[MODEL_N_STATS];
        model_read_stats(&m, stats);
        float loss = (float)stats[MODEL_STAT_LOSS];
        float metrics[2] = {(float)stats[MODEL_STAT_PREF_A], (float)stats[MODEL_STAT_PREF_B]};
        StWriteTensor w[2] = {{.name = "loss", .ndim = 1, .shape = {1}, .data = &loss},
                              {.name = "metrics", .ndim = 1, .shape = {2}, .data = metrics}};
        rc = dump_with_grads(&m, a->out, w, 2, err);
    }
    free(ids);
    pref_free(&p);
    pref_batch_free(&b);
    executor_free(&x);
    records_free(&rs);
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
