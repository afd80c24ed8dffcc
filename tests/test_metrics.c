// test_metrics.c: metric.jsonl rows (worker/lib/progress.c) in AstrAI's shapes: reading
// AstrAI's rows as they are (validation and epoch rows, a step row without grad_norm,
// unknown keys), reading our older rows, writing and reading back, the --metrics selection
// of step rows, errors naming file:line.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "common/fsutil.h"
#include "worker/lib/progress.h"

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
    CHECK_MSG(metrics_load(&m, path, 3, &err) == 0, "%s", err.msg);
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
    char *text = metrics_to_jsonl(&m, &len);
    CHECK(text && strlen(text) == len);
    CHECK(strstr(text,
                 "{\"type\":\"validation\",\"timestamp\":\"2026-07-30T00:49:04\","
                 "\"epoch\":0,\"step\":1,\"consumed_samples\":4,\"val_loss\":5.5}\n") == text);
    CHECK(strstr(text, "{\"type\":\"epoch\",\"timestamp\":\"2026-07-30T00:49:06\",\"epoch\":0,"
                       "\"step\":2,\"consumed_samples\":8}\n"));
    CHECK(strstr(text, "\"consumed_samples\":4,\"loss\":5.25,\"lr\":3.0000000000000001e-05}\n"));
    CHECK(!strstr(text, "tokens_seen") && !strstr(text, "\"train\""));
    char back_path[4096];
    write_file(back_path, sizeof back_path, "back.jsonl", text);
    MetricLog back = {0};
    CHECK_MSG(metrics_load(&back, back_path, 100, &err) == 0, "%s", err.msg);
    CHECK(back.n == m.n && !memcmp(back.rows, m.rows, m.n * sizeof *m.rows));
    free(text);
    metrics_free(&back);
    metrics_free(&m);
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
    CHECK(metrics_append(&m, &s, &err) == 0);
    CHECK(metrics_append_epoch(&m, 1, 0, 4, &err) == 0);
    CHECK(metrics_append_epoch(&m, 1, 0, 4, &err) == 0);
    CHECK(metrics_append_validation(&m, 1, 0, 4, 2.25, &err) == 0);
    CHECK(m.n == 3);
    CHECK(strlen(m.rows[0].timestamp) == 19 && m.rows[0].timestamp[10] == 'T');
    snprintf(m.rows[2].timestamp, sizeof m.rows[2].timestamp, "a\"b\\c");
    size_t len;
    char *text = metrics_to_jsonl(&m, &len);
    CHECK(text && strstr(text, "\"timestamp\":\"a\\\"b\\\\c\""));
    char path[4096];
    write_file(path, sizeof path, "ours.jsonl", text);
    MetricLog back = {0};
    CHECK_MSG(metrics_load(&back, path, 1, &err) == 0, "%s", err.msg);
    CHECK(back.n == 3 && !strcmp(back.rows[2].timestamp, "a\"b\\c"));
    CHECK(back.n == 3 && back.rows[1].kind == METRIC_EPOCH && back.rows[2].val_loss == 2.25);
    free(text);
    metrics_free(&back);
    metrics_free(&m);
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
        CHECK_MSG(metrics_select(&m, cases[i].list, &err) == 0, "%s", err.msg);
        CHECK(metrics_append(&m, &s, &err) == 0);
        CHECK_MSG(m.rows[m.n - 1].has == cases[i].has, "%s: has %u", cases[i].list,
                  m.rows[m.n - 1].has);
    }
    CHECK(metrics_append_validation(&m, 3, 0, 12, 2.25, &err) == 0);
    CHECK(m.rows[m.n - 1].has == METRIC_HAS_VAL_LOSS);
    CHECK(metrics_select(&m, "loss,lrr", &err) != 0 && strstr(err.msg, "'lrr'"));
    size_t len;
    char *text = metrics_to_jsonl(&m, &len);
    CHECK(text && strstr(text, "\"consumed_samples\":12,\"lr\":0.001}\n"));
    CHECK(text && strstr(text, "\"consumed_samples\":12,\"loss\":2.5,\"grad_norm\":0.75}\n"));
    CHECK(text && strstr(text, "\"consumed_samples\":12}\n{\"type\":\"validation\""));
    // Read back (as a resume does) under another selection: every row keeps its keys.
    char path[4096];
    write_file(path, sizeof path, "selected.jsonl", text ? text : "");
    MetricLog back = {0};
    CHECK(metrics_select(&back, "loss,lr,grad_norm", &err) == 0);
    CHECK_MSG(metrics_load(&back, path, 3, &err) == 0, "%s", err.msg);
    CHECK(back.n == m.n);
    for (size_t i = 0; i < back.n && back.n == m.n; i++)
        CHECK_MSG(back.rows[i].has == m.rows[i].has, "row %zu: has %u, wrote %u", i,
                  back.rows[i].has, m.rows[i].has);
    size_t back_len;
    char *again = metrics_to_jsonl(&back, &back_len);
    CHECK(text && again && back_len == len && !strcmp(again, text));
    free(again);
    free(text);
    metrics_free(&back);
    metrics_free(&m);
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
    CHECK(metrics_load(&m, path, 100, &err) != 0);
    char line_ref[4200];
    snprintf(line_ref, sizeof line_ref, "%s:3: not a metric row", path);
    CHECK_MSG(strstr(err.msg, line_ref) && strstr(err.msg, want), "%s", err.msg);
    metrics_free(&m);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    check_astrai_rows();
    check_append();
    check_select();
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
