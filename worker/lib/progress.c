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
    char sql[256];
    snprintf(sql, sizeof sql,
             "BEGIN IMMEDIATE; DELETE FROM steps WHERE step > %ld;"
             " DELETE FROM checkpoints WHERE step > %ld;"
             " INSERT OR REPLACE INTO run(key, value) VALUES('total_steps', %ld); COMMIT;",
             resume_step, resume_step, total_steps);
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
                           &p->insert_ckpt, NULL) != SQLITE_OK) {
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
    return run_insert(p, st, err);
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

void progress_close(ProgressDb *p) {
    sqlite3_finalize(p->insert_step);
    sqlite3_finalize(p->insert_ckpt);
    if (p->db) sqlite3_close(p->db);
    memset(p, 0, sizeof *p);
}

int metrics_append(MetricLog *m, const StepRow *row, Err *err) {
    if (m->n == m->cap) {
        size_t cap = m->cap ? m->cap * 2 : 256;
        StepRow *rows = realloc(m->rows, cap * sizeof *rows);
        if (!rows) return err_set(err, "metric log: out of memory");
        m->rows = rows;
        m->cap = cap;
    }
    m->rows[m->n++] = *row;
    return 0;
}

static int number_field(const cJSON *obj, const char *key, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(v)) return -1;
    *out = v->valuedouble;
    return 0;
}

static int parse_metric_line(const char *line, StepRow *row) {
    cJSON *obj = cJSON_Parse(line);
    double step, epoch, consumed, loss, lr, gnorm;
    int bad = !obj || number_field(obj, "step", &step) || number_field(obj, "epoch", &epoch) ||
              number_field(obj, "consumed_samples", &consumed) ||
              number_field(obj, "loss", &loss) || number_field(obj, "lr", &lr) ||
              number_field(obj, "grad_norm", &gnorm);
    cJSON_Delete(obj);
    if (bad) return -1;
    *row = (StepRow){.step = (long)step,
                     .epoch = (long)epoch,
                     .consumed_samples = (long)consumed,
                     .loss = (float)loss,
                     .lr = lr,
                     .grad_norm = (float)gnorm};
    return 0;
}

int metrics_load(MetricLog *m, const char *path, long up_to_step, Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(path, &text, &len, err)) return -1;
    int rc = 0;
    long lineno = 0;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line && !rc;
         line = strtok_r(NULL, "\n", &save)) {
        StepRow row;
        lineno++;
        if (parse_metric_line(line, &row))
            rc = err_set(err,
                         "%s:%ld: not a metric row {step, epoch, consumed_samples, loss, "
                         "lr, grad_norm}",
                         path, lineno);
        else if (row.step <= up_to_step)
            rc = metrics_append(m, &row, err);
    }
    free(text);
    return rc;
}

char *metrics_to_jsonl(const MetricLog *m, size_t *len) {
    // A row is at most ~220 bytes (three 20-digit longs, %.9g and %.17g numbers).
    size_t cap = m->n * 256 + 1, used = 0;
    char *out = malloc(cap);
    if (!out) return NULL;
    for (size_t i = 0; i < m->n; i++) {
        const StepRow *r = &m->rows[i];
        // %.9g round-trips a float exactly; %.17g a double.
        used += (size_t)snprintf(out + used, cap - used,
                                 "{\"type\":\"train\",\"step\":%ld,\"epoch\":%ld,"
                                 "\"consumed_samples\":%ld,\"loss\":%.9g,\"lr\":%.17g,"
                                 "\"grad_norm\":%.9g}\n",
                                 r->step, r->epoch, r->consumed_samples, (double)r->loss, r->lr,
                                 (double)r->grad_norm);
    }
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
