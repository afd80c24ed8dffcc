#include "worker/lib/progress.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/fsutil.h"

static const char *SCHEMA =
    "PRAGMA journal_mode=WAL;"
    "PRAGMA synchronous=NORMAL;"
    "CREATE TABLE IF NOT EXISTS steps(step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL,"
    " consumed_samples INTEGER NOT NULL, loss REAL, lr REAL, grad_norm REAL,"
    " tokens_per_s REAL, wall_time REAL NOT NULL);"
    "CREATE TABLE IF NOT EXISTS checkpoints(step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL,"
    " path TEXT NOT NULL, wall_time REAL NOT NULL);"
    "CREATE TABLE IF NOT EXISTS validation(step INTEGER PRIMARY KEY, epoch INTEGER NOT NULL,"
    " consumed_samples INTEGER NOT NULL, val_loss REAL, wall_time REAL NOT NULL);"
    "CREATE TABLE IF NOT EXISTS step_metrics(step INTEGER NOT NULL, name TEXT NOT NULL,"
    " value REAL, PRIMARY KEY(step, name));"
    "CREATE TABLE IF NOT EXISTS run(key TEXT PRIMARY KEY, value);";

static int db_fail(ProgressDb *p, const char *what, Err *err) {
    return err_set(err, "%s: %s: %s", p->path, what, p->db ? sqlite3_errmsg(p->db) : "no db");
}

static int exec_sql(ProgressDb *p, const char *sql, Err *err) {
    char *msg = NULL;
    if (sqlite3_exec(p->db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        err_set(err, "%s: %s", p->path, msg ? msg : "sqlite error");
        sqlite3_free(msg);
        return -1;
    }
    return 0;
}

static int forget_after(ProgressDb *p, long total_steps, long resume_step, Err *err) {
    char sql[512];
    snprintf(sql, sizeof sql,
             "BEGIN IMMEDIATE; DELETE FROM steps WHERE step > %ld;"
             " DELETE FROM checkpoints WHERE step > %ld; DELETE FROM validation WHERE step > %ld;"
             " DELETE FROM step_metrics WHERE step > %ld;"
             " INSERT OR REPLACE INTO run(key, value) VALUES('total_steps', %ld); COMMIT;",
             resume_step, resume_step, resume_step, resume_step, total_steps);
    return exec_sql(p, sql, err);
}

int progress_open(ProgressDb *p, const char *dir, long total_steps, long resume_step, Err *err) {
    memset(p, 0, sizeof *p);
    snprintf(p->path, sizeof p->path, "%s/progress.db", dir);
    if (fs_mkdir_p(dir, err)) return -1;
    if (sqlite3_open(p->path, &p->db) != SQLITE_OK) {
        db_fail(p, "open", err);
        progress_close(p);
        return -1;
    }
    sqlite3_busy_timeout(p->db, 5000);
    if (exec_sql(p, SCHEMA, err) || forget_after(p, total_steps, resume_step, err) ||
        sqlite3_prepare_v2(p->db, "INSERT OR REPLACE INTO steps VALUES(?1,?2,?3,?4,?5,?6,?7,?8)",
                           -1, &p->insert_step, NULL) != SQLITE_OK ||
        sqlite3_prepare_v2(p->db, "INSERT OR REPLACE INTO checkpoints VALUES(?1,?2,?3,?4)", -1,
                           &p->insert_ckpt, NULL) != SQLITE_OK ||
        sqlite3_prepare_v2(p->db, "INSERT OR REPLACE INTO validation VALUES(?1,?2,?3,?4,?5)", -1,
                           &p->insert_val, NULL) != SQLITE_OK ||
        sqlite3_prepare_v2(p->db, "INSERT OR REPLACE INTO step_metrics VALUES(?1,?2,?3)", -1,
                           &p->insert_extra, NULL) != SQLITE_OK) {
        if (!err || !*err->msg || !strstr(err->msg, p->path)) db_fail(p, "prepare", err);
        progress_close(p);
        return -1;
    }
    return 0;
}

static int run_insert(ProgressDb *p, sqlite3_stmt *st, Err *err) {
    int rc = sqlite3_step(st);
    sqlite3_reset(st);
    return rc == SQLITE_DONE ? 0 : db_fail(p, "insert", err);
}

int progress_add_step(ProgressDb *p, const StepRow *r, Err *err) {
    sqlite3_stmt *st = p->insert_step;
    sqlite3_bind_int64(st, 1, r->step);
    sqlite3_bind_int64(st, 2, r->epoch);
    sqlite3_bind_int64(st, 3, r->consumed_samples);
    sqlite3_bind_double(st, 4, r->loss);
    sqlite3_bind_double(st, 5, r->lr);
    sqlite3_bind_double(st, 6, r->grad_norm);
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

int progress_add_checkpoint(ProgressDb *p, long step, long epoch, const char *path, Err *err) {
    sqlite3_stmt *st = p->insert_ckpt;
    sqlite3_bind_int64(st, 1, step);
    sqlite3_bind_int64(st, 2, epoch);
    sqlite3_bind_text(st, 3, path, -1, SQLITE_TRANSIENT);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    sqlite3_bind_double(st, 4, (double)now.tv_sec + now.tv_nsec * 1e-9);
    return run_insert(p, st, err);
}

int progress_add_validation(ProgressDb *p, long step, long epoch, long consumed_samples,
                            double val_loss, Err *err) {
    sqlite3_stmt *st = p->insert_val;
    sqlite3_bind_int64(st, 1, step);
    sqlite3_bind_int64(st, 2, epoch);
    sqlite3_bind_int64(st, 3, consumed_samples);
    sqlite3_bind_double(st, 4, val_loss);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    sqlite3_bind_double(st, 5, (double)now.tv_sec + now.tv_nsec * 1e-9);
    return run_insert(p, st, err);
}

void progress_close(ProgressDb *p) {
    sqlite3_finalize(p->insert_val);
    sqlite3_finalize(p->insert_extra);
    sqlite3_finalize(p->insert_step);
    sqlite3_finalize(p->insert_ckpt);
    if (p->db) sqlite3_close(p->db);
    memset(p, 0, sizeof *p);
}

int metrics_append_row(MetricLog *m, const MetricRow *row, Err *err) {
    if (m->n == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 256;
        MetricRow *rows = realloc(m->rows, cap * sizeof *rows);
        if (!rows) return err_set(err, "metric log: out of memory");
        m->rows = rows;
        m->cap = cap;
    }
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

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

// The numbers a step row can carry, by their --metrics names.
#define STEP_METRICS (METRIC_HAS_LOSS | METRIC_HAS_LR | METRIC_HAS_GRAD_NORM)
static const char *const METRIC_NAMES[] = {"loss", "lr", "grad_norm", "val_loss"};
static const unsigned METRIC_BITS[] = {METRIC_HAS_LOSS, METRIC_HAS_LR, METRIC_HAS_GRAD_NORM,
                                       METRIC_HAS_VAL_LOSS};
#define N_METRICS (sizeof METRIC_NAMES / sizeof *METRIC_NAMES)

int metrics_select(MetricLog *m, const char *list, Err *err) {
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

const char *const METRIC_EXTRA_NAMES[METRIC_N_EXTRA] = {"reward_margin", "reward_accuracy", "kl",
                                                        "clip_fraction", "reward_mean"};

static int extra_index(const char *name) {
    for (int k = 0; k < METRIC_N_EXTRA; k++)
        if (!strcmp(METRIC_EXTRA_NAMES[k], name)) return k;
    return -1;
}

int metrics_append(MetricLog *m, const StepRow *r, Err *err) {
    MetricRow row = {.kind = METRIC_STEP,
                     .step = r->step,
                     .epoch = r->epoch,
                     .consumed_samples = r->consumed_samples,
                     .has = STEP_METRICS & ~m->step_skip,
                     .loss = r->loss,
                     .lr = r->lr,
                     .grad_norm = r->grad_norm};
    for (int k = 0; k < r->n_extra; k++) {
        int i = extra_index(r->extra[k].name);
        if (i < 0) return err_set(err, "metric log: unknown step metric '%s'", r->extra[k].name);
        row.extra[i] = r->extra[k].value;
        row.has |= METRIC_HAS_EXTRA << i;
    }
    stamp(row.timestamp, sizeof row.timestamp, r->wall_time);
    return metrics_append_row(m, &row, err);
}

int metrics_append_epoch(MetricLog *m, long step, long epoch, long consumed_samples, Err *err) {
    for (size_t i = m->n; i-- > 0;) {
        const MetricRow *r = &m->rows[i];
        if (r->step < step) break;
        if (r->kind == METRIC_EPOCH && r->step == step && r->epoch == epoch) return 0;
    }
    MetricRow row = {
        .kind = METRIC_EPOCH, .step = step, .epoch = epoch, .consumed_samples = consumed_samples};
    stamp(row.timestamp, sizeof row.timestamp, wall_now());
    return metrics_append_row(m, &row, err);
}

int metrics_append_validation(MetricLog *m, long step, long epoch, long consumed_samples,
                              double val_loss, Err *err) {
    MetricRow row = {.kind = METRIC_VALIDATION,
                     .step = step,
                     .epoch = epoch,
                     .consumed_samples = consumed_samples,
                     .has = METRIC_HAS_VAL_LOSS,
                     .val_loss = val_loss};
    stamp(row.timestamp, sizeof row.timestamp, wall_now());
    return metrics_append_row(m, &row, err);
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

int metrics_load(MetricLog *m, const char *path, long up_to_step, Err *err) {
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
        if (!obj || parse_row(obj, &row, &why, &what))
            rc = err_set(err, "%s:%ld: not a metric row: %s%s%s%s", path, lineno, *what ? "\"" : "",
                         what, *what ? "\" " : "", why);
        else if (row.step <= up_to_step)
            rc = metrics_append_row(m, &row, err);
        cJSON_Delete(obj);
    }
    free(text);
    return rc;
}

// Appends s as a JSON string (quoted, escaped) to out; returns the bytes written.
static size_t put_json_string(char *out, size_t cap, const char *s) {
    size_t n = 0;
    n += (size_t)snprintf(out + n, cap - n, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p && n + 8 < cap; p++) {
        if (*p == '"' || *p == '\\')
            n += (size_t)snprintf(out + n, cap - n, "\\%c", *p);
        else if (*p < 0x20)
            n += (size_t)snprintf(out + n, cap - n, "\\u%04x", *p);
        else
            out[n++] = (char)*p;
    }
    n += (size_t)snprintf(out + n, cap - n, "\"");
    return n;
}

static const char *kind_name(MetricKind k) {
    return k == METRIC_EPOCH ? "epoch" : k == METRIC_VALIDATION ? "validation" : "step";
}

// One row in AstrAI's key order: type, timestamp, epoch, step, consumed_samples, then the
// metrics (loss, lr, grad_norm; val_loss). %.9g round-trips a float exactly; %.17g a double.
static size_t format_row(char *out, size_t cap, const MetricRow *r) {
    size_t n = (size_t)snprintf(out, cap, "{\"type\":\"%s\",\"timestamp\":", kind_name(r->kind));
    n += put_json_string(out + n, cap - n, r->timestamp);
    n += (size_t)snprintf(out + n, cap - n, ",\"epoch\":%ld,\"step\":%ld,\"consumed_samples\":%ld",
                          r->epoch, r->step, r->consumed_samples);
    if (r->has & METRIC_HAS_LOSS)
        n += (size_t)snprintf(out + n, cap - n, ",\"loss\":%.9g", (double)r->loss);
    if (r->has & METRIC_HAS_LR) n += (size_t)snprintf(out + n, cap - n, ",\"lr\":%.17g", r->lr);
    if (r->has & METRIC_HAS_GRAD_NORM)
        n += (size_t)snprintf(out + n, cap - n, ",\"grad_norm\":%.9g", (double)r->grad_norm);
    for (int k = 0; k < METRIC_N_EXTRA; k++)
        if (r->has & (METRIC_HAS_EXTRA << k))
            n += (size_t)snprintf(out + n, cap - n, ",\"%s\":%.17g", METRIC_EXTRA_NAMES[k],
                                  r->extra[k]);
    if (r->has & METRIC_HAS_VAL_LOSS)
        n += (size_t)snprintf(out + n, cap - n, ",\"val_loss\":%.17g", r->val_loss);
    n += (size_t)snprintf(out + n, cap - n, "}\n");
    return n;
}

// A row is at most ~600 bytes: a 31-character timestamp escaped (<= 186), three 20-digit
// longs and seven numbers of <= 25 characters (a step row's three and its extras), plus the
// key names.
#define ROW_CAP 768

char *metrics_to_jsonl(const MetricLog *m, size_t *len) {
    size_t cap = m->n * ROW_CAP + 1, used = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    for (size_t i = 0; i < m->n; i++)
        used += format_row(out + used, cap - used, &m->rows[i]);
    out[used] = 0;
    *len = used;
    return out;
}

void metrics_free(MetricLog *m) {
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
