// test_metrics.c: metric.jsonl rows (train/progress.c) in AstrAI's shapes: reading
// AstrAI's rows as they are (validation and epoch rows, a step row without grad_norm,
// unknown keys), reading our older rows, writing and reading back, the --metrics selection
// of step rows, errors naming file:line; rows written with the shortest decimal that reads back
// exactly; a non-finite number refused by metric.jsonl and progress.db.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "common/fsutil.h"
#include "train/progress.h"

static char dir[] = "/tmp/astrai-test-metrics-XXXXXX";

static void write_file(char *path, size_t cap, const char *name, const char *text) {
    snprintf(path, cap, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f)) abort();
}

// AstrAI's MetricCallback output (c8b1e40), one row per line, plus a blank line, one of our
// older rows ("type":"train") and a row past the checkpoint.
static const char *ASTRAI_ROWS =
    "{\"type\": \"validation\", \"timestamp\": \"2026-07-30T00:49:04\", \"epoch\": 0, "
    "\"step\": 1, \"consumed_samples\": 4, \"val_loss\": 5.5}\n"
    "{\"type\": \"step\", \"timestamp\": \"2026-07-30T00:49:04\", \"epoch\": 0, \"step\": 1, "
    "\"consumed_samples\": 4, \"loss\": 5.25, \"lr\": 3e-05}\n"
    "\n"
    "{\"type\": \"step\", \"timestamp\": \"2026-07-30T00:49:05\", \"epoch\": 0, \"step\": 2, "
    "\"consumed_samples\": 8, \"loss\": 5.0, \"lr\": 0.0015, \"grad_norm\": 2.5, "
    "\"tokens_seen\": 512, \"note\": {\"x\": [1]}}\n"
    "{\"type\": \"epoch\", \"timestamp\": \"2026-07-30T00:49:06\", \"epoch\": 0, \"step\": 2, "
    "\"consumed_samples\": 8}\n"
    "{\"type\":\"train\",\"step\":3,\"epoch\":1,\"consumed_samples\":12,\"loss\":4.75,"
    "\"lr\":0.001,\"grad_norm\":1.5}\n"
    "{\"type\": \"step\", \"epoch\": 1, \"step\": 4, \"consumed_samples\": 16, \"loss\": 4.5}\n";

static void check_astrai_rows(void) {
    char path[4096];
    write_file(path, sizeof path, "astrai.jsonl", ASTRAI_ROWS);
    MetricLog m = {0};
    Err err = {0};
    CHECK_MSG(metric_log_load(&m, path, 3, &err) == 0, "%s", err.msg);
    CHECK(m.n == 5); // the step-4 row is past the checkpoint
    if (m.n != 5) return;
    CHECK(m.rows[0].kind == METRIC_VALIDATION && m.rows[0].has == METRIC_HAS_VAL_LOSS);
    CHECK(m.rows[0].val_loss == 5.5 && !strcmp(m.rows[0].timestamp, "2026-07-30T00:49:04"));
    CHECK(m.rows[1].kind == METRIC_STEP && m.rows[1].has == (METRIC_HAS_LOSS | METRIC_HAS_LR));
    CHECK(m.rows[1].loss == 5.25f && m.rows[1].lr == 3e-05);
    CHECK(m.rows[2].has == (METRIC_HAS_LOSS | METRIC_HAS_LR | METRIC_HAS_GRAD_NORM));
    CHECK(m.rows[2].grad_norm == 2.5f && m.rows[2].step == 2 && m.rows[2].consumed_samples == 8);
    CHECK(m.rows[3].kind == METRIC_EPOCH && m.rows[3].has == 0 && m.rows[3].step == 2);
    CHECK(m.rows[4].kind == METRIC_STEP && m.rows[4].epoch == 1 && m.rows[4].loss == 4.75f);
    CHECK(m.rows[4].timestamp[0] == 0);

    // Written back: AstrAI's shapes, the same rows (a row without grad_norm stays without).
    size_t len;
    char *text = metric_log_to_jsonl(&m, &len);
    CHECK(text && strlen(text) == len);
    CHECK(strstr(text,
                 "{\"type\":\"validation\",\"timestamp\":\"2026-07-30T00:49:04\","
                 "\"epoch\":0,\"step\":1,\"consumed_samples\":4,\"val_loss\":5.5}\n") == text);
    CHECK(strstr(text, "{\"type\":\"epoch\",\"timestamp\":\"2026-07-30T00:49:06\",\"epoch\":0,"
                       "\"step\":2,\"consumed_samples\":8}\n"));
    CHECK(strstr(text, "\"consumed_samples\":4,\"loss\":5.25,\"lr\":3e-05}\n"));
    CHECK(!strstr(text, "tokens_seen") && !strstr(text, "\"train\""));
    char back_path[4096];
    write_file(back_path, sizeof back_path, "back.jsonl", text);
    MetricLog back = {0};
    CHECK_MSG(metric_log_load(&back, back_path, 100, &err) == 0, "%s", err.msg);
    CHECK(back.n == m.n && !memcmp(back.rows, m.rows, m.n * sizeof *m.rows));
    free(text);
    metric_log_free(&back);
    metric_log_free(&m);
}

// Our own rows: timestamps in AstrAI's format; an epoch row replayed at the same step is
// not added twice; a timestamp with quotes stays valid JSON.
static void check_append(void) {
    MetricLog m = {0};
    Err err = {0};
    StepRow s = {.step = 1,
                 .epoch = 0,
                 .consumed_samples = 4,
                 .loss = 2.5f,
                 .lr = 1e-3,
                 .grad_norm = 0.75f,
                 .wall_time = 1785372544.0};
    CHECK(metric_log_append(&m, &s, &err) == 0);
    CHECK(metric_log_append_epoch(&m, 1, 0, 4, &err) == 0);
    CHECK(metric_log_append_epoch(&m, 1, 0, 4, &err) == 0);
    CHECK(metric_log_append_validation(&m, 1, 0, 4, 2.25, &err) == 0);
    CHECK(m.n == 3);
    CHECK(strlen(m.rows[0].timestamp) == 19 && m.rows[0].timestamp[10] == 'T');
    snprintf(m.rows[2].timestamp, sizeof m.rows[2].timestamp, "a\"b\\c");
    size_t len;
    char *text = metric_log_to_jsonl(&m, &len);
    CHECK(text && strstr(text, "\"timestamp\":\"a\\\"b\\\\c\""));
    char path[4096];
    write_file(path, sizeof path, "ours.jsonl", text);
    MetricLog back = {0};
    CHECK_MSG(metric_log_load(&back, path, 1, &err) == 0, "%s", err.msg);
    CHECK(back.n == 3 && !strcmp(back.rows[2].timestamp, "a\"b\\c"));
    CHECK(back.n == 3 && back.rows[1].kind == METRIC_EPOCH && back.rows[2].val_loss == 2.25);
    free(text);
    metric_log_free(&back);
    metric_log_free(&m);
}

// --metrics: new step rows carry only the named columns (val_loss never: validation rows
// carry it anyway); rows loaded from a checkpoint keep the keys they had, step rows without
// loss or lr included; an unknown name is an error naming it.
static void check_select(void) {
    MetricLog m = {0};
    Err err = {0};
    StepRow s = {.step = 3,
                 .epoch = 0,
                 .consumed_samples = 12,
                 .loss = 2.5f,
                 .lr = 1e-3,
                 .grad_norm = 0.75f,
                 .wall_time = 1785372544.0};
    struct {
        const char *list;
        unsigned has;
    } cases[] = {{"loss,lr,grad_norm", METRIC_HAS_LOSS | METRIC_HAS_LR | METRIC_HAS_GRAD_NORM},
                 {"lr", METRIC_HAS_LR},
                 {"grad_norm,loss,,loss", METRIC_HAS_LOSS | METRIC_HAS_GRAD_NORM},
                 {"val_loss", 0}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        CHECK_MSG(metric_log_select(&m, cases[i].list, &err) == 0, "%s", err.msg);
        CHECK(metric_log_append(&m, &s, &err) == 0);
        CHECK_MSG(m.rows[m.n - 1].has == cases[i].has, "%s: has %u", cases[i].list,
                  m.rows[m.n - 1].has);
    }
    CHECK(metric_log_append_validation(&m, 3, 0, 12, 2.25, &err) == 0);
    CHECK(m.rows[m.n - 1].has == METRIC_HAS_VAL_LOSS);
    CHECK(metric_log_select(&m, "loss,lrr", &err) != 0 && strstr(err.msg, "'lrr'"));
    size_t len;
    char *text = metric_log_to_jsonl(&m, &len);
    CHECK(text && strstr(text, "\"consumed_samples\":12,\"lr\":0.001}\n"));
    CHECK(text && strstr(text, "\"consumed_samples\":12,\"loss\":2.5,\"grad_norm\":0.75}\n"));
    CHECK(text && strstr(text, "\"consumed_samples\":12}\n{\"type\":\"validation\""));
    // Read back (as a resume does) under another selection: every row keeps its keys.
    char path[4096];
    write_file(path, sizeof path, "selected.jsonl", text ? text : "");
    MetricLog back = {0};
    CHECK(metric_log_select(&back, "loss,lr,grad_norm", &err) == 0);
    CHECK_MSG(metric_log_load(&back, path, 3, &err) == 0, "%s", err.msg);
    CHECK(back.n == m.n);
    for (size_t i = 0; i < back.n && back.n == m.n; i++)
        CHECK_MSG(back.rows[i].has == m.rows[i].has, "row %zu: has %u, wrote %u", i,
                  back.rows[i].has, m.rows[i].has);
    size_t back_len;
    char *again = metric_log_to_jsonl(&back, &back_len);
    CHECK(text && again && back_len == len && !strcmp(again, text));
    free(again);
    free(text);
    metric_log_free(&back);
    metric_log_free(&m);
}

// A float or double from its bits (random finite values cover every exponent and mantissa).
static uint64_t next_bits(uint64_t *state) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return *state ^ (*state >> 29);
}

static float random_float(uint64_t *state) {
    float f;
    do {
        uint32_t bits = (uint32_t)(next_bits(state) >> 32);
        memcpy(&f, &bits, sizeof f);
    } while (!isfinite(f));
    return f;
}

static double random_double(uint64_t *state) {
    double d;
    do {
        uint64_t bits = next_bits(state);
        memcpy(&d, &bits, sizeof d);
    } while (!isfinite(d));
    return d;
}

// Rows written and read back are the rows (every bit of every number, the extremes and -0
// included), in AstrAI's key order with the DPO/GRPO numbers after grad_norm; numbers are the
// shortest decimals that read back exactly (0.0003, not 0.00029999999999999997).
static void check_round_trip(void) {
    enum { N = 2000 };
    static MetricRow rows[N];
    const float floats[] = {0.0f, -0.0f, FLT_MIN, FLT_TRUE_MIN, FLT_MAX, -FLT_MAX, 5.4321f, 1e-7f};
    const double doubles[] = {0.0, -0.0, DBL_MIN, DBL_TRUE_MIN, DBL_MAX, -DBL_MAX, 3e-4, 0.1};
    const size_t n_fixed = sizeof floats / sizeof *floats;
    uint64_t state = 42;
    MetricLog m = {0};
    Err err = {0};
    for (size_t i = 0; i < N; i++) {
        MetricRow *r = &rows[i];
        memset(r, 0, sizeof *r);
        r->kind = i % 3 == 2 ? METRIC_VALIDATION : METRIC_STEP;
        r->step = (long)i + 1;
        r->epoch = (long)(i / 100);
        r->consumed_samples = 9007199254738000L + (long)i;
        snprintf(r->timestamp, sizeof r->timestamp, "2026-07-30T00:49:%02zu", i % 60);
        if (r->kind == METRIC_VALIDATION) {
            r->has = METRIC_HAS_VAL_LOSS;
            r->val_loss = i < n_fixed ? doubles[i] : random_double(&state);
            CHECK(metric_log_append_row(&m, r, &err) == 0);
            continue;
        }
        r->has = METRIC_HAS_LOSS | METRIC_HAS_LR | METRIC_HAS_GRAD_NORM;
        r->loss = i < n_fixed ? floats[i] : random_float(&state);
        r->lr = i < n_fixed ? doubles[i] : random_double(&state);
        r->grad_norm = i < n_fixed ? floats[n_fixed - 1 - i] : random_float(&state);
        for (int k = 0; k < METRIC_N_EXTRA; k++)
            if ((i + (size_t)k) % 4 == 0) {
                r->has |= METRIC_HAS_EXTRA << k;
                r->extra[k] = random_double(&state);
            }
        CHECK(metric_log_append_row(&m, r, &err) == 0);
    }
    size_t len;
    char *text = metric_log_to_jsonl(&m, &len);
    CHECK(text && strlen(text) == len);
    char path[4096];
    write_file(path, sizeof path, "round-trip.jsonl", text ? text : "");
    MetricLog back = {0};
    CHECK_MSG(metric_log_load(&back, path, N, &err) == 0, "%s", err.msg);
    CHECK(back.n == N);
    size_t differ = 0;
    for (size_t i = 0; i < back.n && back.n == N; i++)
        differ += memcmp(&back.rows[i], &rows[i], sizeof rows[i]) != 0;
    CHECK_MSG(differ == 0, "%zu of %d rows read back differently", differ, N);
    free(text);
    metric_log_free(&back);
    metric_log_free(&m);

    // Key order of a DPO step row and the shortest decimals.
    StepRow s = {.step = 7,
                 .epoch = 1,
                 .consumed_samples = 28,
                 .loss = 0.693147182f,
                 .lr = 3e-4,
                 .grad_norm = 0.1f,
                 .wall_time = 1785372544.0,
                 .n_extra = 2,
                 .extra = {{"reward_margin", 0.25}, {"reward_accuracy", 0.5}}};
    CHECK(metric_log_append(&m, &s, &err) == 0);
    text = metric_log_to_jsonl(&m, &len);
    CHECK_MSG(text && strstr(text, "\",\"epoch\":1,\"step\":7,\"consumed_samples\":28,"
                                   "\"loss\":0.6931472,\"lr\":0.0003,\"grad_norm\":0.1,"
                                   "\"reward_margin\":0.25,\"reward_accuracy\":0.5}\n"),
              "%s", text ? text : "(null)");
    CHECK(text && !strncmp(text, "{\"type\":\"step\",\"timestamp\":\"", 26));
    free(text);
    metric_log_free(&m);
}

// A non-finite number (a diverged step) never reaches metric.jsonl or progress.db: the row is
// refused with an error naming the step and the key, and nothing is added.
static void check_non_finite(void) {
    MetricLog m = {0};
    Err err = {0};
    StepRow s = {.step = 12,
                 .epoch = 0,
                 .consumed_samples = 48,
                 .loss = 2.5f,
                 .lr = 1e-3,
                 .grad_norm = NAN,
                 .wall_time = 1785372544.0};
    CHECK(metric_log_append(&m, &s, &err) != 0 && m.n == 0);
    CHECK_MSG(strstr(err.msg, "step 12") && strstr(err.msg, "grad_norm is nan"), "%s", err.msg);
    s.grad_norm = 1.0f;
    s.loss = INFINITY;
    CHECK(metric_log_append(&m, &s, &err) != 0 && m.n == 0);
    CHECK_MSG(strstr(err.msg, "step 12") && strstr(err.msg, "loss is inf"), "%s", err.msg);
    s.loss = 2.5f;
    s.n_extra = 1;
    s.extra[0] = (StepExtra){"kl", -INFINITY};
    CHECK(metric_log_append(&m, &s, &err) != 0 && m.n == 0);
    CHECK_MSG(strstr(err.msg, "kl is -inf"), "%s", err.msg);
    CHECK(metric_log_append_validation(&m, 13, 0, 52, NAN, &err) != 0 && m.n == 0);
    CHECK_MSG(strstr(err.msg, "step 13") && strstr(err.msg, "val_loss is nan"), "%s", err.msg);

    // A number too large for a double (or, for the loss, a float) in a file is refused too.
    char path[4096];
    write_file(path, sizeof path, "huge.jsonl",
               "{\"type\":\"step\",\"epoch\":0,\"step\":1,\"consumed_samples\":4,"
               "\"loss\":1e39}\n");
    CHECK(metric_log_load(&m, path, 10, &err) != 0 && m.n == 0);
    char where[4200];
    snprintf(where, sizeof where, "%s:1", path);
    CHECK_MSG(strstr(err.msg, where) && strstr(err.msg, "loss is inf"), "%s", err.msg);

    ProgressDb p;
    CHECK_MSG(progress_open(&p, dir, 100, 0, &err) == 0, "%s", err.msg);
    s.n_extra = 0;
    s.grad_norm = NAN;
    CHECK(progress_add_step(&p, &s, &err) != 0);
    CHECK_MSG(strstr(err.msg, "progress.db") && strstr(err.msg, "grad_norm is nan"), "%s", err.msg);
    CHECK(progress_add_validation(&p, 12, 0, 48, INFINITY, &err) != 0);
    CHECK_MSG(strstr(err.msg, "val_loss is inf"), "%s", err.msg);
    s.grad_norm = 1.0f;
    CHECK_MSG(progress_add_step(&p, &s, &err) == 0, "%s", err.msg);
    progress_close(&p);
    metric_log_free(&m);
}

// A malformed line is an error naming path:line (blank lines counted) and the key.
static void check_malformed(const char *body, const char *want) {
    char path[4096], text[1024];
    snprintf(text, sizeof text,
             "{\"type\":\"step\",\"epoch\":0,\"step\":1,\"consumed_samples\":4,\"loss\":1}\n\n%s\n",
             body);
    write_file(path, sizeof path, "bad.jsonl", text);
    MetricLog m = {0};
    Err err = {0};
    CHECK(metric_log_load(&m, path, 100, &err) != 0);
    char line_ref[4200];
    snprintf(line_ref, sizeof line_ref, "%s:3: not a metric row", path);
    CHECK_MSG(strstr(err.msg, line_ref) && strstr(err.msg, want), "%s", err.msg);
    metric_log_free(&m);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    check_astrai_rows();
    check_append();
    check_select();
    check_round_trip();
    check_non_finite();
    check_malformed("{\"type\":\"step\",\"epoch\":0,\"step\":\"two\",\"consumed_samples\":8}",
                    "\"step\" must be a non-negative integer");
    check_malformed("{\"type\":\"epoch\",\"epoch\":0,\"step\":2}",
                    "\"consumed_samples\" is missing");
    check_malformed("{\"type\":\"val\",\"epoch\":0,\"step\":2,\"consumed_samples\":8}",
                    "\"type\" must be step, epoch or validation");
    check_malformed("{\"type\":\"validation\",\"epoch\":0,\"step\":2,\"consumed_samples\":8}",
                    "\"val_loss\" is missing");
    check_malformed(
        "{\"type\":\"step\",\"epoch\":0,\"step\":2,\"consumed_samples\":8,\"lr\":\"x\"}",
        "\"lr\" must be a number");
    check_malformed("{\"type\":\"step\",", "not valid JSON");
    check_malformed("[1, 2]", "not a JSON object");
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    CHECK_DONE();
}
