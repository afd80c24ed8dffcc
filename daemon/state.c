// state.c: the daemon database, state_dir/astraid.db (DESIGN §6), written only by
// astraid: jobs (one row each, rewritten on every change), runs (one row per
// attempt, with the pids of its ranks) and events (an append-only history). WAL,
// busy_timeout, and BEGIN IMMEDIATE around every write.
//
// A write that cannot commit (a full disk) is rolled back and returns -1: the verbs
// then refuse the request and leave the job as it was (docs/astraid.md).
//
// Recovery at startup: jobs the daemon died under (starting, running, pausing: a
// crash or kill -9; their ranks got SIGTERM from PR_SET_PDEATHSIG, checkpoint and
// exit) and interrupted ones (a clean stop) are queued again and resume from their
// last checkpoint. Ranks of a killed daemon still checkpointing are waited for
// (bounded by --stop-timeout, then SIGKILL) so two runs never write one ckpt_dir; a
// rank is known by its pid, its start time and its run directory, never by its name
// alone (a pid reused by another astraid's rank is not ours). The temporary
// directories of checkpoint writes that never finished are removed from every job's
// ckpt_dir before any run starts.
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
    " finished_at REAL, outcome TEXT, pids TEXT, starts TEXT, PRIMARY KEY(job_id, run));"
    "CREATE TABLE IF NOT EXISTS events(id INTEGER PRIMARY KEY, job_id INTEGER, time REAL,"
    " kind TEXT, detail TEXT);";

// runs.starts (the ranks' start times) came after the first databases were written.
static int add_starts_column(const char *path, Err *err) {
    sqlite3_stmt *st;
    int has = 0;
    if (sqlite3_prepare_v2(db, "SELECT 1 FROM pragma_table_info('runs') WHERE name='starts'", -1,
                           &st, NULL) != SQLITE_OK)
        return err_set(err, "%s: %s", path, sqlite3_errmsg(db));
    has = sqlite3_step(st) == SQLITE_ROW;
    sqlite3_finalize(st);
    if (!has && sqlite3_exec(db, "ALTER TABLE runs ADD COLUMN starts TEXT", NULL, NULL, NULL))
        return err_set(err, "%s: adding runs.starts: %s", path, sqlite3_errmsg(db));
    return 0;
}

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
    return add_starts_column(path, err);
}

void state_close(void) {
    sqlite3_close(db);
    db = NULL;
}

// A failed write: logged, and in err (may be NULL) as a resource failure.
static int db_failed(const char *what, Err *err) {
    log_error("astraid.db: %s: %s", what, sqlite3_errmsg(db));
    return err_resource(err, "astraid.db: %s: %s", what, sqlite3_errmsg(db));
}

// One write statement in its own BEGIN IMMEDIATE transaction.
static int write_begin(sqlite3_stmt **st, const char *sql, Err *err) {
    if (!db) return err_resource(err, "astraid.db is not open");
    if (sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        return db_failed("begin", err);
    if (sqlite3_prepare_v2(db, sql, -1, st, NULL) != SQLITE_OK) {
        db_failed("prepare", err);
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    return 0;
}

// Steps and commits; a failed commit (SQLITE_FULL, an I/O error) is rolled back, so
// that the next write starts a fresh transaction.
static int write_end(sqlite3_stmt *st, Err *err) {
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE || sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        db_failed(rc != SQLITE_DONE ? "write" : "commit", err);
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    return 0;
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

int state_save_job(const Job *j, Err *err) {
    sqlite3_stmt *st;
    if (write_begin(&st,
                    "INSERT OR REPLACE INTO jobs VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,"
                    "?,?,?,?,?,?,?,?,?)",
                    err))
        return -1;
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
    int rc = write_end(st, err);
    cJSON_free(spec);
    cJSON_free(want);
    return rc;
}

void state_event(long job_id, const char *kind, const char *detail) {
    sqlite3_stmt *st;
    if (write_begin(&st, "INSERT INTO events(job_id, time, kind, detail) VALUES(?,?,?,?)", NULL))
        return;
    sqlite3_bind_int64(st, 1, job_id);
    sqlite3_bind_double(st, 2, clock_wall_s());
    bind_text(st, 3, kind);
    bind_text(st, 4, detail);
    write_end(st, NULL);
}

int state_delete_job(long job_id, Err *err) {
    if (!db) return err_resource(err, "astraid.db is not open");
    if (sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        return db_failed("begin", err);
    static const char *const SQL[] = {"DELETE FROM jobs WHERE id=?",
                                      "DELETE FROM runs WHERE job_id=?",
                                      "DELETE FROM events WHERE job_id=?"};
    int rc = SQLITE_DONE;
    for (size_t k = 0; k < sizeof SQL / sizeof *SQL && rc == SQLITE_DONE; k++) {
        sqlite3_stmt *st;
        rc = sqlite3_prepare_v2(db, SQL[k], -1, &st, NULL);
        if (rc != SQLITE_OK) break;
        sqlite3_bind_int64(st, 1, job_id);
        rc = sqlite3_step(st);
        sqlite3_finalize(st);
    }
    if (rc != SQLITE_DONE || sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        db_failed("removing a job", err);
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        return -1;
    }
    return 0;
}

// A process's start time, /proc/PID/stat field 22 (clock ticks since boot); 0 when
// the process is gone. With the pid it names one process for the machine's uptime.
static unsigned long long proc_start_time(int pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'), *save = NULL;            // comm may hold spaces and parentheses
    char *field = p ? strtok_r(p + 1, " ", &save) : NULL; // field 3, the state
    for (int k = 3; field && k < 22; k++)
        field = strtok_r(NULL, " ", &save);
    return field ? strtoull(field, NULL, 10) : 0;
}

// The ranks' pids and start times (read now: a rank that already exited is a zombie
// until libuv reaps it, so its /proc entry is still there).
void state_run_started(const Job *j, const pid_t *pids, int n) {
    sqlite3_stmt *st;
    if (write_begin(&st,
                    "INSERT OR REPLACE INTO runs(job_id, run, started_at, pids, starts)"
                    " VALUES(?,?,?,?,?)",
                    NULL))
        return;
    int *ids = calloc((size_t)n, sizeof *ids);
    cJSON *starts = cJSON_CreateArray();
    for (int i = 0; ids && i < n; i++) {
        ids[i] = (int)pids[i];
        cJSON_AddItemToArray(starts, cJSON_CreateNumber((double)proc_start_time(ids[i])));
    }
    char *text = ids_json(ids, n), *starts_text = cJSON_PrintUnformatted(starts);
    sqlite3_bind_int64(st, 1, j->id);
    sqlite3_bind_int64(st, 2, j->runs);
    sqlite3_bind_double(st, 3, clock_wall_s());
    bind_text(st, 4, text);
    bind_text(st, 5, starts_text);
    write_end(st, NULL);
    cJSON_free(text);
    cJSON_free(starts_text);
    cJSON_Delete(starts);
    free(ids);
}

void state_run_ended(const Job *j, const char *outcome) {
    sqlite3_stmt *st;
    if (write_begin(&st, "UPDATE runs SET finished_at=?, outcome=? WHERE job_id=? AND run=?", NULL))
        return;
    sqlite3_bind_double(st, 1, clock_wall_s());
    bind_text(st, 2, outcome);
    sqlite3_bind_int64(st, 3, j->id);
    sqlite3_bind_int64(st, 4, j->runs);
    write_end(st, NULL);
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

// Reads a /proc file of pid whole (environ, cmdline: NUL-separated); NULL when gone.
static char *read_proc(int pid, const char *name, size_t *len) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", pid, name);
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    size_t cap = 4096, n = 0, got;
    char *buf = malloc(cap + 1);
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        char *grown = n == cap ? realloc(buf, (cap *= 2) + 1) : buf;
        if (!grown) free(buf);
        buf = grown;
    }
    fclose(f);
    if (buf) buf[n] = 0;
    *len = n;
    return buf;
}

// 1 if NUL-separated `list` (len bytes) holds the entry `want`.
static int has_entry(const char *list, size_t len, const char *want) {
    for (size_t i = 0; i < len; i += strlen(list + i) + 1)
        if (!strcmp(list + i, want)) return 1;
    return 0;
}

// 1 if pid is still a rank of this job's run: its argv[0] is the train binary, its
// environment names the job's run directory (ASTRAI_RUN_DIR), and its start time is the
// one recorded when it was spawned (0: a run recorded before start times were kept).
// A pid the kernel gave since to another process, even another astraid's rank of the
// same binary, fails one of these.
static int is_our_rank(int pid, unsigned long long start, const char *run_env) {
    if (pid <= 0) return 0;
    size_t n;
    char *cmd = read_proc(pid, "cmdline", &n);
    int ours = cmd && n > 0 && !strcmp(cmd, astraid.cfg.train_binary);
    free(cmd);
    char *env = ours ? read_proc(pid, "environ", &n) : NULL;
    ours = env && has_entry(env, n, run_env);
    free(env);
    // Last: a process that took the pid while we read the others has another start time.
    return ours && (!start || proc_start_time(pid) == start);
}

// Ranks of the last run of a job the daemon died under: wait for them to finish
// their checkpoint (their parent died: PDEATHSIG told them to stop), then SIGKILL.
static void wait_orphans(const Job *j) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT pids, starts FROM runs WHERE job_id=? AND run=?", -1, &st,
                           NULL))
        return;
    sqlite3_bind_int64(st, 1, j->id);
    sqlite3_bind_int64(st, 2, j->runs);
    cJSON *pids = NULL, *starts = NULL;
    if (sqlite3_step(st) == SQLITE_ROW) {
        const char *p = (const char *)sqlite3_column_text(st, 0);
        const char *s = (const char *)sqlite3_column_text(st, 1);
        pids = p ? cJSON_Parse(p) : NULL;
        starts = s ? cJSON_Parse(s) : NULL;
    }
    sqlite3_finalize(st);
    char run_dir[PATH_MAX], run_env[PATH_MAX + 16];
    if (job_run_dir(j, run_dir, sizeof run_dir)) run_dir[0] = 0;
    snprintf(run_env, sizeof run_env, "ASTRAI_RUN_DIR=%s", run_dir);
    double deadline = clock_mono_s() + astraid.cfg.stop_timeout;
    for (int i = 0; i < cJSON_GetArraySize(pids); i++) {
        int pid = (int)cJSON_GetArrayItem(pids, i)->valuedouble;
        const cJSON *s = cJSON_GetArrayItem(starts, i);
        unsigned long long start = cJSON_IsNumber(s) ? (unsigned long long)s->valuedouble : 0;
        while (is_our_rank(pid, start, run_env) && clock_mono_s() < deadline)
            usleep(100 * 1000);
        if (is_our_rank(pid, start, run_env)) {
            log_warn("job %ld: rank pid %d of a previous astraid is still alive; SIGKILL", j->id,
                     pid);
            kill(-pid, SIGKILL);
        } else if (pid > 0 && kill(pid, 0) == 0) {
            log_info("job %ld: recorded rank pid %d is now another process; left alone", j->id,
                     pid);
        }
    }
    cJSON_Delete(pids);
    cJSON_Delete(starts);
}

static void report_stale(void *ctx, const char *what) {
    log_info("job %ld: %s", *(const long *)ctx, what);
}

// Temporary directories of checkpoint writes that never finished (a rank killed
// mid-write) hold gigabytes on a real model: removed while no run can write there.
static void remove_stale_checkpoints(const Job *j) {
    Err err = {0};
    if (ckpt_remove_stale(j->ckpt_dir, report_stale, (void *)&j->id, &err))
        log_warn("job %ld: %s", j->id, err.msg);
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
    state_save_job(j, NULL);
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
    // No run has started yet and the orphans are gone: nothing writes a ckpt_dir now.
    for (Job *j = astraid.jobs; j; j = j->next)
        remove_stale_checkpoints(j);
    return 0;
}
