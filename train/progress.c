#include "train/progress.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <sqlite3.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/buf.h"
#include "common/clock.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "proto/progress_db.h"

// A database that cannot be opened or written is the system's failure (disk full, read-only,
// I/O error, no permission, no memory), not bad input. Without a handle sqlite3_open could not
// allocate one.
static int db_fail(ProgressDb *p, const char *what, Err *err) {
    return err_resource(err, "%s: %s: %s", p->path, what,
                        p->db ? sqlite3_errmsg(p->db) : "out of memory");
}

static int exec_sql(ProgressDb *p, const char *sql, Err *err) {
    char *msg = NULL;
    if (sqlite3_exec(p->db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        err_resource(err, "%s: %s", p->path, msg ? msg : "sqlite error");
        sqlite3_free(msg);
        return -1;
    }
    return 0;
}

static int forget_after(ProgressDb *p, long total_steps, long resume_step, Err *err) {
    char sql[1024];
    snprintf(sql, sizeof sql, PROGRESS_DB_FORGET_AFTER, resume_step, resume_step, resume_step,
             resume_step, resume_step, resume_step, total_steps);
    return exec_sql(p, sql, err);
}

int progress_open(ProgressDb *p, const char *dir, long total_steps, long resume_step, Err *err) {
    memset(p, 0, sizeof *p);
    snprintf(p->path, sizeof p->path, "%s/" PROGRESS_DB_FILE, dir);
    if (fs_mkdir_p(dir, err)) return -1;
    if (sqlite3_open(p->path, &p->db) != SQLITE_OK) {
        db_fail(p, "open", err);
        progress_close(p);
        return -1;
    }
    sqlite3_busy_timeout(p->db, 5000);
    if (exec_sql(p, PROGRESS_DB_SCHEMA, err) || forget_after(p, total_steps, resume_step, err) ||
        sqlite3_prepare_v2(p->db, PROGRESS_DB_INSERT_STEP, -1, &p->insert_step, NULL) !=
            SQLITE_OK ||
        sqlite3_prepare_v2(p->db, PROGRESS_DB_INSERT_CHECKPOINT, -1, &p->insert_ckpt, NULL) !=
            SQLITE_OK ||
        sqlite3_prepare_v2(p->db, PROGRESS_DB_DELETE_CHECKPOINT, -1, &p->delete_ckpt, NULL) !=
            SQLITE_OK ||
        sqlite3_prepare_v2(p->db, PROGRESS_DB_INSERT_VALIDATION, -1, &p->insert_val, NULL) !=
            SQLITE_OK ||
        sqlite3_prepare_v2(p->db, PROGRESS_DB_INSERT_METRIC, -1, &p->insert_extra, NULL) !=
            SQLITE_OK ||
        sqlite3_prepare_v2(p->db, PROGRESS_DB_INSERT_EXPERT_LOAD, -1, &p->insert_load, NULL) !=
            SQLITE_OK ||
        sqlite3_prepare_v2(p->db, PROGRESS_DB_SET_PHASE, -1, &p->set_phase, NULL) != SQLITE_OK) {
        if (!err || !*err->msg || !strstr(err->msg, p->path)) db_fail(p, "prepare", err);
        progress_close(p);
        return -1;
    }
    return 0;
}

// JSON has no NaN or infinity, and a non-finite loss or norm is a diverged run, not a number to
// keep: metric.jsonl and progress.db refuse one, naming the step and the key.
static int check_finite(const char *key, long step, double value, Err *err) {
    if (isfinite(value)) return 0;
    return err_set(err, "step %ld: %s is %g: a non-finite number is never recorded", step, key,
                   value);
}

static int check_step_row(const StepRow *r, Err *err) {
    if ((!r->skipped && check_finite("loss", r->step, r->loss, err)) ||
        check_finite("lr", r->step, r->lr, err) ||
        (!r->skipped && check_finite("grad_norm", r->step, r->grad_norm, err)))
        return -1;
    for (int k = 0; k < r->n_extra; k++)
        if (check_finite(r->extra[k].name, r->step, r->extra[k].value, err)) return -1;
    return 0;
}

static int run_insert(ProgressDb *p, sqlite3_stmt *st, Err *err) {
    int rc = sqlite3_step(st);
    sqlite3_reset(st);
    return rc == SQLITE_DONE ? 0 : db_fail(p, "insert", err);
}

static void bind_finite(sqlite3_stmt *st, int at, double v) {
    if (isfinite(v))
        sqlite3_bind_double(st, at, v);
    else
        sqlite3_bind_null(st, at);
}

int progress_add_step(ProgressDb *p, const StepRow *r, Err *err) {
    if (check_step_row(r, err)) return err_prefix(err, "%s", p->path);
    sqlite3_stmt *st = p->insert_step;
    sqlite3_bind_int64(st, 1, r->step);
    sqlite3_bind_int64(st, 2, r->epoch);
    sqlite3_bind_int64(st, 3, r->consumed_samples);
    bind_finite(st, 4, r->loss); // NULL: a skipped step's inf or NaN
    sqlite3_bind_double(st, 5, r->lr);
    bind_finite(st, 6, r->grad_norm);
    sqlite3_bind_double(st, 7, r->tokens_per_s);
    sqlite3_bind_double(st, 8, r->wall_time);
    if (run_insert(p, st, err)) return -1;
    for (int k = 0; k < r->n_extra; k++) {
        sqlite3_bind_int64(p->insert_extra, 1, r->step);
        sqlite3_bind_text(p->insert_extra, 2, r->extra[k].name, -1, SQLITE_STATIC);
        sqlite3_bind_double(p->insert_extra, 3, r->extra[k].value);
        if (run_insert(p, p->insert_extra, err)) return -1;
    }
    return 0;
}

// The end of a transaction of several rows: committed when every row went in (rc 0), else rolled
// back, so that a reader sees all of them or none.
static int end_transaction(ProgressDb *p, int rc, Err *err) {
    if (!rc) return exec_sql(p, "COMMIT", err);
    exec_sql(p, "ROLLBACK", NULL);
    return -1;
}

int progress_add_expert_load(ProgressDb *p, long step, int layers, int experts, const float *tokens,
                             Err *err) {
    if (exec_sql(p, "BEGIN IMMEDIATE", err)) return -1;
    int rc = 0;
    for (int l = 0; l < layers && !rc; l++)
        for (int e = 0; e < experts && !rc; e++) {
            sqlite3_bind_int64(p->insert_load, 1, step);
            sqlite3_bind_int(p->insert_load, 2, l);
            sqlite3_bind_int(p->insert_load, 3, e);
            sqlite3_bind_int64(p->insert_load, 4, (sqlite3_int64)tokens[(size_t)l * experts + e]);
            rc = run_insert(p, p->insert_load, err);
        }
    return end_transaction(p, rc, err);
}

// One sample's row; its texts are copies (SQLITE_TRANSIENT): a bind that cannot copy is memory.
static int insert_sample(ProgressDb *p, sqlite3_stmt *st, long step, int idx, const SampleRow *r,
                         double wall, Err *err) {
    sqlite3_bind_int64(st, 1, step);
    sqlite3_bind_int(st, 2, idx);
    if (sqlite3_bind_text(st, 3, r->prompt, -1, SQLITE_TRANSIENT) != SQLITE_OK ||
        sqlite3_bind_text(st, 4, r->completion, -1, SQLITE_TRANSIENT) != SQLITE_OK)
        return db_fail(p, "sample text", err);
    sqlite3_bind_int(st, 5, r->tokens);
    sqlite3_bind_double(st, 6, wall);
    return run_insert(p, st, err);
}

// Samples are rare (every sample_interval steps): their statement is prepared for each step's
// rows rather than kept open with the others.
int progress_add_samples(ProgressDb *p, long step, const SampleRow *rows, int n, Err *err) {
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(p->db, PROGRESS_DB_INSERT_SAMPLE, -1, &st, NULL) != SQLITE_OK)
        return db_fail(p, "prepare samples", err);
    int rc = exec_sql(p, "BEGIN IMMEDIATE", err);
    double wall = clock_wall_s();
    for (int i = 0; i < n && !rc; i++)
        rc = insert_sample(p, st, step, i, &rows[i], wall, err);
    sqlite3_finalize(st);
    return end_transaction(p, rc, err);
}

int progress_add_checkpoint(ProgressDb *p, long step, long epoch, const char *path, Err *err) {
    sqlite3_stmt *st = p->insert_ckpt;
    sqlite3_bind_int64(st, 1, step);
    sqlite3_bind_int64(st, 2, epoch);
    if (sqlite3_bind_text(st, 3, path, -1, SQLITE_TRANSIENT) != SQLITE_OK) // its copy: memory
        return db_fail(p, "checkpoint path", err);
    sqlite3_bind_double(st, 4, clock_wall_s());
    return run_insert(p, st, err);
}

int progress_remove_checkpoint(ProgressDb *p, long step, Err *err) {
    sqlite3_bind_int64(p->delete_ckpt, 1, step);
    return run_insert(p, p->delete_ckpt, err);
}

int progress_add_validation(ProgressDb *p, long step, long epoch, long consumed_samples,
                            double val_loss, Err *err) {
    if (check_finite("val_loss", step, val_loss, err)) return err_prefix(err, "%s", p->path);
    sqlite3_stmt *st = p->insert_val;
    sqlite3_bind_int64(st, 1, step);
    sqlite3_bind_int64(st, 2, epoch);
    sqlite3_bind_int64(st, 3, consumed_samples);
    sqlite3_bind_double(st, 4, val_loss);
    sqlite3_bind_double(st, 5, clock_wall_s());
    return run_insert(p, st, err);
}

int progress_set_phase(ProgressDb *p, const char *phase, Err *err) {
    sqlite3_bind_text(p->set_phase, 1, phase, -1, SQLITE_STATIC);
    sqlite3_bind_double(p->set_phase, 2, clock_wall_s());
    return run_insert(p, p->set_phase, err);
}

void progress_close(ProgressDb *p) {
    sqlite3_finalize(p->set_phase);
    sqlite3_finalize(p->insert_val);
    sqlite3_finalize(p->insert_extra);
    sqlite3_finalize(p->insert_load);
    sqlite3_finalize(p->insert_step);
    sqlite3_finalize(p->insert_ckpt);
    sqlite3_finalize(p->delete_ckpt);
    if (p->db) sqlite3_close(p->db);
    memset(p, 0, sizeof *p);
}

// The numbers a row carries, by its METRIC_HAS_* bits.
static int check_row(const MetricRow *r, Err *err) {
    const struct {
        unsigned bit;
        const char *key;
        double value;
    } nums[] = {{METRIC_HAS_LOSS, "loss", r->loss},
                {METRIC_HAS_LR, "lr", r->lr},
                {METRIC_HAS_GRAD_NORM, "grad_norm", r->grad_norm},
                {METRIC_HAS_VAL_LOSS, "val_loss", r->val_loss}};
    for (size_t i = 0; i < sizeof nums / sizeof *nums; i++)
        if ((r->has & nums[i].bit) && check_finite(nums[i].key, r->step, nums[i].value, err))
            return -1;
    for (int k = 0; k < METRIC_N_EXTRA; k++)
        if ((r->has & (METRIC_HAS_EXTRA << k)) &&
            check_finite(METRIC_EXTRA_NAMES[k], r->step, r->extra[k], err))
            return -1;
    return 0;
}

int metric_log_append_row(MetricLog *m, const MetricRow *row, Err *err) {
    if (check_row(row, err)) return err_prefix(err, "metric log");
    if (buf_reserve(&m->rows, &m->cap, m->n + 1, sizeof *m->rows))
        return err_resource(err, "metric log: out of memory");
    m->rows[m->n++] = *row;
    return 0;
}

// AstrAI's time.strftime("%Y-%m-%dT%H:%M:%S"): local time, whole seconds.
static void stamp(char *out, size_t cap, double unix_s) {
    time_t t = (time_t)unix_s;
    struct tm tm;
    localtime_r(&t, &tm);
    strftime(out, cap, "%Y-%m-%dT%H:%M:%S", &tm);
}

// The numbers a step row can carry, by their --metrics names.
#define STEP_METRICS (METRIC_HAS_LOSS | METRIC_HAS_LR | METRIC_HAS_GRAD_NORM)
static const char *const METRIC_NAMES[] = {"loss", "lr", "grad_norm", "val_loss"};
static const unsigned METRIC_BITS[] = {METRIC_HAS_LOSS, METRIC_HAS_LR, METRIC_HAS_GRAD_NORM,
                                       METRIC_HAS_VAL_LOSS};
#define N_METRICS (sizeof METRIC_NAMES / sizeof *METRIC_NAMES)

int metric_log_select(MetricLog *m, const char *list, Err *err) {
    unsigned named = 0;
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ",");
        size_t i = 0;
        while (i < N_METRICS &&
               (strlen(METRIC_NAMES[i]) != len || strncmp(p, METRIC_NAMES[i], len)))
            i++;
        if (len && i == N_METRICS)
            return err_set(err, "metrics: '%.*s' is not one of loss|lr|grad_norm|val_loss",
                           (int)len, p);
        if (len) named |= METRIC_BITS[i];
        p += len + (p[len] == ',');
    }
    m->step_skip = STEP_METRICS & ~named;
    return 0;
}

const char *const METRIC_EXTRA_NAMES[METRIC_N_EXTRA] = {
    "reward_margin",   "reward_accuracy", "kl",           "clip_fraction",
    "reward_mean",     "loss_scale",      "skipped",      "expert_load_max",
    "expert_load_min", "reward_std",      "response_len", "equal_reward_groups",
    "rollout_s",       "reward_s"};

static int extra_index(const char *name) {
    for (int k = 0; k < METRIC_N_EXTRA; k++)
        if (!strcmp(METRIC_EXTRA_NAMES[k], name)) return k;
    return -1;
}

int metric_log_append(MetricLog *m, const StepRow *r, Err *err) {
    MetricRow row = {.kind = METRIC_STEP,
                     .step = r->step,
                     .epoch = r->epoch,
                     .consumed_samples = r->consumed_samples,
                     .has = STEP_METRICS & ~m->step_skip,
                     .loss = r->loss,
                     .lr = r->lr,
                     .grad_norm = r->grad_norm};
    if (r->skipped && !isfinite(r->loss)) row.has &= ~(unsigned)METRIC_HAS_LOSS;
    if (r->skipped && !isfinite(r->grad_norm)) row.has &= ~(unsigned)METRIC_HAS_GRAD_NORM;
    for (int k = 0; k < r->n_extra; k++) {
        int i = extra_index(r->extra[k].name);
        if (i < 0) return err_set(err, "metric log: unknown step metric '%s'", r->extra[k].name);
        row.extra[i] = r->extra[k].value;
        row.has |= METRIC_HAS_EXTRA << i;
    }
    stamp(row.timestamp, sizeof row.timestamp, r->wall_time);
    return metric_log_append_row(m, &row, err);
}

int metric_log_append_epoch(MetricLog *m, long step, long epoch, long consumed_samples, Err *err) {
    for (size_t i = m->n; i-- > 0;) {
        const MetricRow *r = &m->rows[i];
        if (r->step < step) break;
        if (r->kind == METRIC_EPOCH && r->step == step && r->epoch == epoch) return 0;
    }
    MetricRow row = {
        .kind = METRIC_EPOCH, .step = step, .epoch = epoch, .consumed_samples = consumed_samples};
    stamp(row.timestamp, sizeof row.timestamp, clock_wall_s());
    return metric_log_append_row(m, &row, err);
}

int metric_log_append_validation(MetricLog *m, long step, long epoch, long consumed_samples,
                                 double val_loss, Err *err) {
    MetricRow row = {.kind = METRIC_VALIDATION,
                     .step = step,
                     .epoch = epoch,
                     .consumed_samples = consumed_samples,
                     .has = METRIC_HAS_VAL_LOSS,
                     .val_loss = val_loss};
    stamp(row.timestamp, sizeof row.timestamp, clock_wall_s());
    return metric_log_append_row(m, &row, err);
}

// A required count: a JSON number that is a non-negative integer.
static const char *take_count(const cJSON *obj, const char *key, long *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v) return "is missing";
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble != floor(v->valuedouble) ||
        v->valuedouble > 9007199254740992.0)
        return "must be a non-negative integer";
    *out = (long)v->valuedouble;
    return NULL;
}

// An optional number: absent or null (AstrAI drops a None metric) leaves the bit clear.
static const char *take_number(const cJSON *obj, const char *key, unsigned bit, unsigned *has,
                               double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) return NULL;
    if (!cJSON_IsNumber(v)) return "must be a number";
    *out = v->valuedouble;
    *has |= bit;
    return NULL;
}

static int kind_of(const cJSON *obj, MetricKind *kind) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(obj, "type");
    // No type, or "train": rows written by astrai before it wrote AstrAI's shapes.
    if (!t || (cJSON_IsString(t) && !strcmp(t->valuestring, "train")) ||
        (cJSON_IsString(t) && !strcmp(t->valuestring, "step")))
        *kind = METRIC_STEP;
    else if (cJSON_IsString(t) && !strcmp(t->valuestring, "epoch"))
        *kind = METRIC_EPOCH;
    else if (cJSON_IsString(t) && !strcmp(t->valuestring, "validation"))
        *kind = METRIC_VALIDATION;
    else
        return -1;
    return 0;
}

// Parses one row; on failure *why says what is wrong (key names *what).
static int parse_row(const cJSON *obj, MetricRow *row, const char **why, const char **what) {
    memset(row, 0, sizeof *row);
    *what = "";
    if (!cJSON_IsObject(obj)) return *why = "not a JSON object", -1;
    if (kind_of(obj, &row->kind))
        return *what = "type", *why = "must be step, epoch or validation", -1;
    static const char *counts[] = {"step", "epoch", "consumed_samples"};
    long *outs[] = {&row->step, &row->epoch, &row->consumed_samples};
    for (int i = 0; i < 3; i++)
        if ((*why = take_count(obj, counts[i], outs[i]))) return *what = counts[i], -1;
    double loss = 0, gnorm = 0;
    double *nums[N_METRICS] = {&loss, &row->lr, &gnorm, &row->val_loss};
    for (size_t i = 0; i < N_METRICS; i++)
        if ((*why = take_number(obj, METRIC_NAMES[i], METRIC_BITS[i], &row->has, nums[i])))
            return *what = METRIC_NAMES[i], -1;
    for (int k = 0; k < METRIC_N_EXTRA; k++)
        if ((*why = take_number(obj, METRIC_EXTRA_NAMES[k], METRIC_HAS_EXTRA << k, &row->has,
                                &row->extra[k])))
            return *what = METRIC_EXTRA_NAMES[k], -1;
    if (row->kind == METRIC_VALIDATION && !(row->has & METRIC_HAS_VAL_LOSS))
        return *what = "val_loss", *why = "is missing (a validation row needs it)", -1;
    row->loss = (float)loss;
    row->grad_norm = (float)gnorm;
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(obj, "timestamp");
    if (cJSON_IsString(ts)) snprintf(row->timestamp, sizeof row->timestamp, "%s", ts->valuestring);
    return 0;
}

int metric_log_load(MetricLog *m, const char *path, long up_to_step, Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(path, &text, &len, err)) return -1;
    int rc = 0;
    long lineno = 0;
    char *save = NULL;
    // Lines are counted one by one (strtok_r would merge empty lines and shift numbers).
    for (char *line = text; line && !rc; line = save) {
        char *nl = strchr(line, '\n');
        save = nl ? nl + 1 : NULL;
        if (nl) *nl = 0;
        lineno++;
        if (strspn(line, " \t\r") == strlen(line)) continue; // blank line
        cJSON *obj = cJSON_Parse(line);
        MetricRow row;
        const char *why = "not valid JSON", *what = "";
        if (!obj && json_out_of_memory())
            rc = err_resource(err, "%s:%ld: out of memory", path, lineno);
        else if (!obj || parse_row(obj, &row, &why, &what))
            rc = err_set(err, "%s:%ld: not a metric row: %s%s%s%s", path, lineno, *what ? "\"" : "",
                         what, *what ? "\" " : "", why);
        else if (row.step <= up_to_step && metric_log_append_row(m, &row, err))
            rc = err_prefix(err, "%s:%ld", path, lineno);
        cJSON_Delete(obj);
    }
    free(text);
    return rc;
}

static const char *kind_name(MetricKind k) {
    return k == METRIC_EPOCH ? "epoch" : k == METRIC_VALIDATION ? "validation" : "step";
}

// Adds key: the shortest decimal that reads back as v exactly (as a float when is_float: the
// loss and norm are floats). Finite numbers only (metric_log_append_row refuses the others).
static int add_number(cJSON *obj, const char *key, double v, bool is_float) {
    char text[32];
    for (int digits = 1; digits <= (is_float ? 9 : 17); digits++) {
        snprintf(text, sizeof text, "%.*g", digits, v);
        double back = strtod(text, NULL);
        if (is_float ? (float)back == (float)v : back == v) break;
    }
    return cJSON_AddRawToObject(obj, key, text) ? 0 : -1;
}

static int add_count(cJSON *obj, const char *key, long v) {
    char text[24];
    snprintf(text, sizeof text, "%ld", v);
    return cJSON_AddRawToObject(obj, key, text) ? 0 : -1;
}

// One row in AstrAI's key order: type, timestamp, epoch, step, consumed_samples, then the
// metrics (loss, lr, grad_norm, the DPO/GRPO numbers; val_loss). NULL when out of memory.
static cJSON *row_json(const MetricRow *r) {
    cJSON *o = cJSON_CreateObject();
    int rc = !o || !cJSON_AddStringToObject(o, "type", kind_name(r->kind)) ||
             !cJSON_AddStringToObject(o, "timestamp", r->timestamp) ||
             add_count(o, "epoch", r->epoch) || add_count(o, "step", r->step) ||
             add_count(o, "consumed_samples", r->consumed_samples);
    if (!rc && (r->has & METRIC_HAS_LOSS)) rc = add_number(o, "loss", r->loss, true);
    if (!rc && (r->has & METRIC_HAS_LR)) rc = add_number(o, "lr", r->lr, false);
    if (!rc && (r->has & METRIC_HAS_GRAD_NORM)) rc = add_number(o, "grad_norm", r->grad_norm, true);
    for (int k = 0; k < METRIC_N_EXTRA && !rc; k++)
        if (r->has & (METRIC_HAS_EXTRA << k))
            rc = add_number(o, METRIC_EXTRA_NAMES[k], r->extra[k], false);
    if (!rc && (r->has & METRIC_HAS_VAL_LOSS)) rc = add_number(o, "val_loss", r->val_loss, false);
    if (rc) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

char *metric_log_to_jsonl(const MetricLog *m, size_t *len) {
    Buf out = {0};
    int rc = buf_append(&out, "", 0);
    for (size_t i = 0; i < m->n && !rc; i++) {
        cJSON *o = row_json(&m->rows[i]);
        char *line = o ? cJSON_PrintUnformatted(o) : NULL;
        cJSON_Delete(o);
        rc = !line || buf_append(&out, line, strlen(line)) || buf_append(&out, "\n", 1);
        free(line);
    }
    if (rc) {
        buf_free(&out);
        return NULL;
    }
    *len = out.len;
    return buf_take(&out);
}

void metric_log_free(MetricLog *m) {
    free(m->rows);
    memset(m, 0, sizeof *m);
}

static void format_duration(char *buf, size_t cap, double s) {
    if (!isfinite(s) || s < 0) {
        snprintf(buf, cap, "?");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, cap, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60)
        snprintf(buf, cap, "%ldm%02lds", t / 60, t % 60);
    else
        snprintf(buf, cap, "%lds", t);
}

void progress_format_line(char *buf, size_t cap, const StepRow *r, long total_steps, double eta_s) {
    char eta[32];
    format_duration(eta, sizeof eta, eta_s);
    double pct = total_steps > 0 ? 100.0 * (double)r->step / (double)total_steps : 0;
    snprintf(buf, cap,
             "step %ld/%ld (%.1f%%) | epoch %ld | loss %.4f | lr %.3e | grad_norm %.3f | "
             "%.0f tok/s | ETA %s",
             r->step, total_steps, pct, r->epoch, (double)r->loss, r->lr, (double)r->grad_norm,
             r->tokens_per_s, eta);
}
