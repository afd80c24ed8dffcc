// state.c: the daemon database, state_dir/astraid.db (DESIGN §6), written only by
// astraid: jobs (one row each, rewritten on every change), runs (one row per
// attempt, with the pids of its ranks) and events (an append-only history). WAL,
// busy_timeout, and BEGIN IMMEDIATE around every write.
//
// Recovery at startup: jobs the daemon died under (starting, running, pausing: a
// crash or kill -9; their ranks got SIGTERM from PR_SET_PDEATHSIG, checkpoint and
// exit) and interrupted ones (a clean stop) are queued again and resume from their
// last checkpoint. Ranks of a killed daemon still checkpointing are waited for
// (bounded by --stop-timeout, then SIGKILL) so two runs never write one ckpt_dir.
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <sqlite3.h>

#include "ckpt/checkpoint.h"
#include "daemon/daemon.h"

static sqlite3 *db;

static const char SCHEMA[] =
    "PRAGMA journal_mode=WAL;"
    "CREATE TABLE IF NOT EXISTS jobs(id INTEGER PRIMARY KEY, name TEXT, state TEXT, spec TEXT,"
    " ckpt_dir TEXT, step INTEGER, total_steps INTEGER, epoch INTEGER, loss REAL, lr REAL,"
    " grad_norm REAL, tokens_per_s REAL, eta_s REAL, has_progress INTEGER, restarts INTEGER,"
    " max_restarts INTEGER, priority INTEGER, n_devices INTEGER, want_ids TEXT,"
    " last_checkpoint TEXT, error TEXT, submitted_by INTEGER, created_at REAL,"
    " started_at REAL, finished_at REAL, resume INTEGER, runs INTEGER);"
    "CREATE TABLE IF NOT EXISTS runs(job_id INTEGER, run INTEGER, started_at REAL,"
    " finished_at REAL, outcome TEXT, pids TEXT, PRIMARY KEY(job_id, run));"
    "CREATE TABLE IF NOT EXISTS events(id INTEGER PRIMARY KEY, job_id INTEGER, time REAL,"
    " kind TEXT, detail TEXT);";

int state_open(const char *state_dir, Err *err) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/astraid.db", state_dir);
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL) != SQLITE_OK)
        return err_set(err, "%s: %s", path, db ? sqlite3_errmsg(db) : "cannot open");
    sqlite3_busy_timeout(db, 5000);
    char *msg = NULL;
    if (sqlite3_exec(db, SCHEMA, NULL, NULL, &msg) != SQLITE_OK) {
        err_set(err, "%s: %s", path, msg ? msg : "schema");
        sqlite3_free(msg);
        return -1;
    }
    return 0;
}

void state_close(void) {
    sqlite3_close(db);
    db = NULL;
}

// One write statement in its own BEGIN IMMEDIATE transaction; failures are logged
// (the in-memory state stays authoritative while the daemon runs).
static int write_begin(sqlite3_stmt **st, const char *sql) {
    if (!db) return -1;
    if (sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK ||
        sqlite3_prepare_v2(db, sql, -1, st, NULL) != SQLITE_OK) {
        log_error("astraid.db: %s", sqlite3_errmsg(db));
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    return 0;
}

static void write_end(sqlite3_stmt *st) {
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) {
        log_error("astraid.db: %s", sqlite3_errmsg(db));
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        return;
    }
    if (sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
        log_error("astraid.db: commit: %s", sqlite3_errmsg(db));
}

static void bind_text(sqlite3_stmt *st, int i, const char *s) {
    if (s)
        sqlite3_bind_text(st, i, s, -1, SQLITE_TRANSIENT);
    else
        sqlite3_bind_null(st, i);
}

static char *ids_json(const int *ids, long n) {
    if (!ids) return NULL;
    cJSON *a = cJSON_CreateIntArray(ids, (int)n);
    char *s = cJSON_PrintUnformatted(a);
    cJSON_Delete(a);
    return s;
}

void state_save_job(const Job *j) {
    sqlite3_stmt *st;
    if (write_begin(&st, "INSERT OR REPLACE INTO jobs VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,"
                         "?,?,?,?,?,?,?,?,?)"))
        return;
    char *spec = cJSON_PrintUnformatted(j->spec), *want = ids_json(j->want_ids, j->n_devices);
    int i = 1;
    sqlite3_bind_int64(st, i++, j->id);
    bind_text(st, i++, j->name);
    bind_text(st, i++, job_state_name(j->state));
    bind_text(st, i++, spec);
    bind_text(st, i++, j->ckpt_dir);
    sqlite3_bind_int64(st, i++, j->step);
    sqlite3_bind_int64(st, i++, j->total_steps);
    sqlite3_bind_int64(st, i++, j->epoch);
    double metrics[] = {j->loss, j->lr, j->grad_norm, j->tokens_per_s, j->eta_s};
    for (size_t k = 0; k < sizeof metrics / sizeof *metrics; k++)
        sqlite3_bind_double(st, i++, metrics[k]);
    long ints[] = {j->has_progress, j->restarts, j->max_restarts, j->priority, j->n_devices};
    for (size_t k = 0; k < sizeof ints / sizeof *ints; k++)
        sqlite3_bind_int64(st, i++, ints[k]);
    bind_text(st, i++, want);
    bind_text(st, i++, j->last_checkpoint);
    bind_text(st, i++, j->error);
    sqlite3_bind_int64(st, i++, j->submitted_by);
    sqlite3_bind_double(st, i++, j->created_at);
    sqlite3_bind_double(st, i++, j->started_at);
    sqlite3_bind_double(st, i++, j->finished_at);
    sqlite3_bind_int(st, i++, j->resume);
    sqlite3_bind_int64(st, i++, j->runs);
    write_end(st);
    cJSON_free(spec);
    cJSON_free(want);
}

void state_event(long job_id, const char *kind, const char *detail) {
    sqlite3_stmt *st;
    if (write_begin(&st, "INSERT INTO events(job_id, time, kind, detail) VALUES(?,?,?,?)")) return;
    sqlite3_bind_int64(st, 1, job_id);
    sqlite3_bind_double(st, 2, now_wall());
    bind_text(st, 3, kind);
    bind_text(st, 4, detail);
    write_end(st);
}

void state_run_started(const Job *j, const pid_t *pids, int n) {
    sqlite3_stmt *st;
    if (write_begin(&st, "INSERT OR REPLACE INTO runs VALUES(?,?,?,NULL,NULL,?)")) return;
    int *ids = calloc((size_t)n, sizeof *ids);
    for (int i = 0; ids && i < n; i++)
        ids[i] = (int)pids[i];
    char *text = ids_json(ids, n);
    sqlite3_bind_int64(st, 1, j->id);
    sqlite3_bind_int64(st, 2, j->runs);
    sqlite3_bind_double(st, 3, now_wall());
    bind_text(st, 4, text);
    write_end(st);
    cJSON_free(text);
    free(ids);
}

void state_run_ended(const Job *j, const char *outcome) {
    sqlite3_stmt *st;
    if (write_begin(&st, "UPDATE runs SET finished_at=?, outcome=? WHERE job_id=? AND run=?"))
        return;
    sqlite3_bind_double(st, 1, now_wall());
    bind_text(st, 2, outcome);
    sqlite3_bind_int64(st, 3, j->id);
    sqlite3_bind_int64(st, 4, j->runs);
    write_end(st);
}

long state_max_job_id(void) {
    sqlite3_stmt *st;
    long id = 0;
    if (sqlite3_prepare_v2(db, "SELECT max(id) FROM jobs", -1, &st, NULL) != SQLITE_OK) return 0;
    if (sqlite3_step(st) == SQLITE_ROW) id = (long)sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return id;
}

// ---------------------------------------------------------------- recovery

static char *column_text(sqlite3_stmt *st, int i) {
    const unsigned char *t = sqlite3_column_text(st, i);
    return t ? strdup((const char *)t) : NULL;
}

static int *parse_ids(const char *text, long n) {
    cJSON *a = text ? cJSON_Parse(text) : NULL;
    int *ids =
        cJSON_IsArray(a) && cJSON_GetArraySize(a) == n ? calloc((size_t)n, sizeof *ids) : NULL;
    for (long i = 0; ids && i < n; i++)
        ids[i] = (int)cJSON_GetArrayItem(a, (int)i)->valuedouble;
    cJSON_Delete(a);
    return ids;
}

static Job *job_from_row(sqlite3_stmt *st) {
    Job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    int i = 0;
    j->id = (long)sqlite3_column_int64(st, i++);
    j->name = column_text(st, i++);
    const char *state = (const char *)sqlite3_column_text(st, i++);
    if (!state || job_state_parse(state, &j->state)) j->state = JOB_INTERRUPTED;
    const char *spec = (const char *)sqlite3_column_text(st, i++);
    j->spec = spec ? cJSON_Parse(spec) : NULL;
    j->ckpt_dir = column_text(st, i++);
    j->step = (long)sqlite3_column_int64(st, i++);
    j->total_steps = (long)sqlite3_column_int64(st, i++);
    j->epoch = (long)sqlite3_column_int64(st, i++);
    double *metrics[] = {&j->loss, &j->lr, &j->grad_norm, &j->tokens_per_s, &j->eta_s};
    for (size_t k = 0; k < sizeof metrics / sizeof *metrics; k++)
        *metrics[k] = sqlite3_column_double(st, i++);
    j->has_progress = sqlite3_column_int(st, i++);
    long *ints[] = {&j->restarts, &j->max_restarts, &j->priority, &j->n_devices};
    for (size_t k = 0; k < sizeof ints / sizeof *ints; k++)
        *ints[k] = (long)sqlite3_column_int64(st, i++);
    j->want_ids = parse_ids((const char *)sqlite3_column_text(st, i++), j->n_devices);
    j->last_checkpoint = column_text(st, i++);
    j->error = column_text(st, i++);
    j->submitted_by = (long)sqlite3_column_int64(st, i++);
    j->created_at = sqlite3_column_double(st, i++);
    j->started_at = sqlite3_column_double(st, i++);
    j->finished_at = sqlite3_column_double(st, i++);
    j->resume = sqlite3_column_int(st, i++);
    j->runs = (long)sqlite3_column_int64(st, i++);
    if (!j->name || !j->spec || !j->ckpt_dir) {
        job_free(j);
        return NULL;
    }
    return j;
}

// 1 if pid is still an astrai-train rank (its argv[0] is the train binary).
static int is_rank_process(int pid) {
    char path[64], cmd[PATH_MAX];
    snprintf(path, sizeof path, "/proc/%d/cmdline", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(cmd, 1, sizeof cmd - 1, f);
    fclose(f);
    cmd[n] = 0;
    return n > 0 && !strcmp(cmd, astraid.cfg.train_binary);
}

// Ranks of the last run of a job the daemon died under: wait for them to finish
// their checkpoint (their parent died: PDEATHSIG told them to stop), then SIGKILL.
static void wait_orphans(const Job *j) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT pids FROM runs WHERE job_id=? AND run=?", -1, &st, NULL))
        return;
    sqlite3_bind_int64(st, 1, j->id);
    sqlite3_bind_int64(st, 2, j->runs);
    cJSON *pids = sqlite3_step(st) == SQLITE_ROW
                      ? cJSON_Parse((const char *)sqlite3_column_text(st, 0))
                      : NULL;
    sqlite3_finalize(st);
    double deadline = now_wall() + astraid.cfg.stop_timeout;
    const cJSON *p;
    cJSON_ArrayForEach(p, pids) {
        int pid = (int)p->valuedouble;
        while (is_rank_process(pid) && now_wall() < deadline)
            usleep(100 * 1000);
        if (is_rank_process(pid)) {
            log_warn("job %ld: rank pid %d of a previous astraid is still alive; SIGKILL", j->id,
                     pid);
            kill(-pid, SIGKILL);
        }
    }
    cJSON_Delete(pids);
}

static void recover_job(Job *j) {
    int died_under = j->state == JOB_STARTING || j->state == JOB_RUNNING || j->state == JOB_PAUSING;
    if (!died_under && j->state != JOB_INTERRUPTED) return;
    if (died_under) wait_orphans(j);
    char path[PATH_MAX];
    Err err = {0};
    j->resume = ckpt_find_latest(j->ckpt_dir, path, sizeof path, &err) == 0;
    if (j->resume) {
        free(j->last_checkpoint);
        j->last_checkpoint = strdup(path);
    }
    log_info("job %ld was %s; queued again%s", j->id, job_state_name(j->state),
             j->resume ? " (resuming from its checkpoint)" : "");
    state_event(j->id, "recovered", job_state_name(j->state));
    j->state = JOB_QUEUED; // a paused-to-be job comes back queued: its pause was not taken
    state_save_job(j);
}

int state_recover(Err *err) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT * FROM jobs ORDER BY id", -1, &st, NULL) != SQLITE_OK)
        return err_set(err, "astraid.db: %s", sqlite3_errmsg(db));
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        Job *j = job_from_row(st);
        if (!j) {
            log_error("astraid.db: job %lld is unreadable; skipped",
                      (long long)sqlite3_column_int64(st, 0));
            continue;
        }
        jobs_adopt(j);
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) return err_set(err, "astraid.db: %s", sqlite3_errmsg(db));
    for (Job *j = astraid.jobs; j; j = j->next)
        recover_job(j);
    return 0;
}
