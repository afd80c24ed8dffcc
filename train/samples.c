// samples.c: samples during training (train/samples.h).
#include "train/samples.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/policy.h"
#include "train/trainer.h"

// Prompts generated together: astrai-generate's default --batch_size, so that a sample's GEMMs
// have the rows they have there and its tokens are the ones astrai-generate writes from the
// step's checkpoint (engine/generate.h: a batch's rounding may change with its row count).
#define SAMPLES_BATCH 16

static int read_prompts(Samples *s, const TrainSpec *spec, const ModelConfig *cfg, Err *err) {
    PromptLimits lim = {cfg->vocab_size, cfg->max_position_embeddings, s->gen.max_tokens,
                        "sample_max_tokens"};
    const char *template_file = *spec->chat_template ? spec->chat_template : NULL;
    if (prompts_read_jsonl(&s->prompts, spec->sample_prompts, s->tok, template_file, 0, &lim, err))
        return err_prefix(err, "sample_prompts");
    return 0;
}

int samples_open(Samples *s, const Trainer *t, Err *err) {
    const TrainSpec *spec = t->spec;
    memset(s, 0, sizeof *s);
    s->last_step = t->step; // a resumed run's samples of that step are the earlier run's
    if (spec->sample_interval == 0) return 0;
    s->interval = spec->sample_interval;
    s->gen = (GenerateOptions){.sample = SAMPLE_OPTIONS_DEFAULT,
                               .max_tokens = (int)spec->sample_max_tokens};
    s->gen.sample.temperature = (float)spec->sample_temperature;
    s->gen.sample.top_k = (int)spec->sample_top_k;
    s->gen.sample.top_p = (float)spec->sample_top_p;
    s->gen.sample.seed = (uint64_t)spec->random_seed;
    int V = t->model.cfg.vocab_size;
    if (prompts_open_tokenizer(spec->tokenizer, spec->param_path, "tokenizer", &s->tok, err) ||
        prompts_stop_tokens(s->tok, spec->param_path, V, s->stop, &s->gen.n_stop, err) ||
        read_prompts(s, spec, &t->model.cfg, err))
        return -1;
    s->gen.stop = s->stop;
    return 0;
}

// Prompts [first, first + B) as sequences first.. (B = 0 on the ranks other than 0, which only
// take part); rank 0's completions into text[first..] and tokens[first..].
static int generate_batch(Samples *s, Trainer *t, int first, int B, char **text, int *tokens,
                          Err *err) {
    const int32_t *ids[SAMPLES_BATCH] = {0};
    int lens[SAMPLES_BATCH] = {0};
    Generation g[SAMPLES_BATCH];
    for (int b = 0; b < B; b++)
        ids[b] = s->prompts.v[first + b].ids, lens[b] = s->prompts.v[first + b].n;
    GenerateOptions o = s->gen;
    o.first_sequence = (uint64_t)first;
    int rc = policy_generate(&t->exec, &t->model, ids, lens, B, &o, g, err);
    for (int b = 0; b < B && !rc; b++) {
        rc = prompts_completion_text(s->tok, &g[b], &text[first + b], err);
        tokens[first + b] = g[b].n;
    }
    generation_free(g, B);
    return rc ? err_prefix(err, "sample_prompts %d-%d", first + 1, first + B) : 0;
}

// Rank 0 records the step's n samples, in one transaction.
static int record(Samples *s, Trainer *t, char *const *text, const int *tokens, Err *err) {
    int n = s->prompts.n;
    SampleRow *rows = malloc((size_t)n * sizeof *rows);
    if (!rows) return err_resource(err, "samples: out of memory for %d rows", n);
    for (int i = 0; i < n; i++)
        rows[i] = (SampleRow){s->prompts.v[i].text, text[i], tokens[i]};
    int rc = progress_add_samples(&t->progress, t->step, rows, n, err);
    free(rows);
    if (!rc) fprintf(stderr, "step %ld | %d sample(s) in progress.db\n", t->step, n);
    return rc;
}

// Every rank runs the same batches (fsdp gathers the weights in each); rank 0 alone has prompts
// in them and records the texts.
static int generate_all(Samples *s, Trainer *t, Err *err) {
    int n = s->prompts.n, rc = 0;
    char **text = calloc((size_t)n, sizeof *text);
    int *tokens = calloc((size_t)n, sizeof *tokens);
    if (!text || !tokens) rc = err_resource(err, "samples: out of memory for %d texts", n);
    for (int first = 0; first < n && !rc; first += SAMPLES_BATCH) {
        int B = n - first < SAMPLES_BATCH ? n - first : SAMPLES_BATCH;
        rc = generate_batch(s, t, first, t->rank == 0 ? B : 0, text, tokens, err);
    }
    if (!rc && t->rank == 0) rc = record(s, t, text, tokens, err);
    for (int i = 0; text && i < n; i++)
        free(text[i]);
    free(text);
    free(tokens);
    return rc;
}

int samples_after_step(Samples *s, Trainer *t, bool end, Err *err) {
    if (!s->interval || t->step == s->last_step || (t->step % s->interval && !end)) return 0;
    s->last_step = t->step;
    // astraid's hang watchdog gives a phase more time than a step (rank 0 reports it).
    if (t->rank == 0 && progress_set_phase(&t->progress, "samples", err)) return -1;
    if (generate_all(s, t, err) || t->model.be->failure(err))
        return err_prefix(err, "samples at step %ld", t->step);
    return t->rank == 0 ? progress_set_phase(&t->progress, "", err) : 0;
}

void samples_close(Samples *s) {
    prompts_free(&s->prompts);
    tokenizer_free(s->tok);
    memset(s, 0, sizeof *s);
}
