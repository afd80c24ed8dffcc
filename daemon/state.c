// state.c: the daemon database, state_dir/astraid.db (docs/design.md §6), written only by
// astraid: jobs (one row each, rewritten on every change), runs (one row per
// attempt, with the pids of its ranks) and events (an append-only history). WAL,
// busy_timeout, and BEGIN IMMEDIATE around every write; the writes are made off the
// loop, in order, by one writer (below), and columns are always named.
//
// A write that cannot commit (a full disk, an I/O error, a lock held past the busy timeout)
// is rolled back and its completion gets the error: the verbs then refuse the request and
// leave the job as it was, and no run starts (scheduler.c) (docs/astraid.md).
//
// A damaged database is never run on. At start, PRAGMA quick_check reads every page as
// sqlite sees it through the WAL (a WAL whose frames fail their checksums is cut there by
// sqlite itself: the commits before them stay), so a page of the main file damaged while
// astraid was down, and not replaced by a later WAL frame, fails the start (exit 1, naming
// astraid.db). A write that finds the database damaged later (SQLITE_CORRUPT, SQLITE_NOTADB)
// marks it damaged for good: no write touches it again, every one fails with that error
// (submit, the verbs, rm are refused; no run starts), while reads are served from memory and
// the running jobs go on until astraid is stopped (its ranks then checkpoint and exit); the
// next start refuses the file until it is restored or moved aside.
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
// Under slurm, a cancelling job whose Slurm job is gone is cancelled.
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

// db: the loop's connection, for the reads of startup (recovery, ids). wdb: the writer's,
// used by one write at a time on libuv's threadpool.
static sqlite3 *db, *wdb;
// What found the database damaged, "" while it is not: set on the loop before the next
// write is queued (uv_queue_work orders it before that write's read on the threadpool).
static char damage[ERR_MSG_MAX];

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

// The columns of a jobs row, in the order job_row binds them and job_from_row reads them.
#define JOB_COLUMNS                                                                                \
    "id, name, state, spec, ckpt_dir, step, total_steps, epoch, loss, lr, grad_norm,"              \
    " tokens_per_s, eta_s, has_progress, restarts, max_restarts, priority, n_devices, want_ids,"   \
    " last_checkpoint, error, submitted_by, created_at, started_at, finished_at, resume, runs,"    \
    " slurm_id, hangs, run_time_s, pause_reason"
#define JOB_N_COLUMNS 31

// A column that came after the first databases were written (runs.starts: the ranks' start
// times; jobs.slurm_id).
static int add_column(const char *path, const char *table, const char *column, const char *type,
                      Err *err) {
    sqlite3_stmt *st;
    char sql[256];
    snprintf(sql, sizeof sql, "SELECT 1 FROM pragma_table_info('%s') WHERE name='%s'", table,
             column);
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK)
        return err_set(err, "%s: %s", path, sqlite3_errmsg(db));
    int step = sqlite3_step(st), has = step == SQLITE_ROW;
    sqlite3_finalize(st);
    if (!has && step != SQLITE_DONE) return err_set(err, "%s: %s", path, sqlite3_errstr(step));
    snprintf(sql, sizeof sql, "ALTER TABLE %s ADD COLUMN %s %s", table, column, type);
    if (!has && sqlite3_exec(db, sql, NULL, NULL, NULL))
        return err_set(err, "%s: adding %s.%s: %s", path, table, column, sqlite3_errmsg(db));
    return 0;
}

static int open_db(const char *path, sqlite3 **out, Err *err) {
    if (sqlite3_open_v2(path, out, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL) != SQLITE_OK)
        return *out ? err_set(err, "%s: %s", path, sqlite3_errmsg(*out))
                    : err_resource(err, "%s: out of memory", path); // no handle allocated
    sqlite3_busy_timeout(*out, 5000);
    return 0;
}

// What astraid says of a damaged database, at start or when a write finds it.
#define DAMAGED_ADVICE                                                                             \
    "restore it from a copy, or move it aside with its -wal and -shm files while astraid is "      \
    "stopped (its jobs are then unknown to astraid; their run directories and checkpoints stay)"

// An error of sqlite's that says the file itself is damaged (not the disk, not a lock).
static int is_damage(int rc) {
    return (rc & 0xff) == SQLITE_CORRUPT || (rc & 0xff) == SQLITE_NOTADB;
}

// quick_check's first findings ("ok" when none), or a damage that stopped it, fail the start;
// another error (a lock held past the busy timeout, a read-only directory) is only that.
static int check_db(const char *path, Err *err) {
    sqlite3_stmt *st;
    char found[512] = "";
    size_t n = 0;
    int rc = sqlite3_prepare_v2(db, "PRAGMA quick_check(4)", -1, &st, NULL);
    while (rc == SQLITE_OK && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        const char *row = (const char *)sqlite3_column_text(st, 0);
        if (row && strcmp(row, "ok") && n + 3 < sizeof found)
            n += (size_t)snprintf(found + n, sizeof found - n, "%s%s", n ? "; " : "", row);
        rc = SQLITE_OK;
    }
    if (rc != SQLITE_DONE && !n) {
        // A failed allocation where quick_check opens its temporary tables reads "unable to
        // open a temporary database file"; its code says what it was.
        snprintf(found, sizeof found, "%s",
                 (rc & 0xff) == SQLITE_NOMEM ? "out of memory" : sqlite3_errmsg(db));
        if (!is_damage(rc)) {
            sqlite3_finalize(st);
            return err_resource(err, "%s: %s", path, found);
        }
    }
    sqlite3_finalize(st);
    if (!found[0]) return 0;
    for (char *p = found;
         (p = strchr(p, '\n'));) // one line: "*** in database main *** Page 5: ..."
        *p = ' ';
    // Left as it was found, WAL included (the last close would checkpoint it into the
    // damaged file): whoever repairs it works on what astraid saw.
    sqlite3_db_config(db, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, NULL);
    return err_resource(
        err, "%s is damaged (quick_check: %.400s): astraid does not start on it; " DAMAGED_ADVICE,
        path, found);
}

int state_open(const char *state_dir, Err *err) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/astraid.db", state_dir);
    if (open_db(path, &db, err) || check_db(path, err)) return -1;
    char *msg = NULL;
    if (sqlite3_exec(db, SCHEMA, NULL, NULL, &msg) != SQLITE_OK) {
        err_set(err, "%s: %s", path, msg ? msg : "schema");
        sqlite3_free(msg);
        return -1;
    }
    if (add_column(path, "runs", "starts", "TEXT", err) ||
        add_column(path, "jobs", "slurm_id", "INTEGER", err) ||
        add_column(path, "jobs", "hangs", "INTEGER", err) ||
        add_column(path, "jobs", "run_time_s", "REAL", err) ||
        add_column(path, "jobs", "pause_reason", "TEXT", err) || open_db(path, &wdb, err))
        return -1;
    // A first read opens the writer's WAL files now: a write must not need a descriptor
    // later, when the daemon may have none left (the ranks' logs and pipes).
    if (sqlite3_exec(wdb, "SELECT count(*) FROM jobs", NULL, NULL, NULL) != SQLITE_OK)
        return err_set(err, "%s: %s", path, sqlite3_errmsg(wdb));
    return 0;
}

void state_close(void) {
    if (damage[0]) { // as in check_db: the WAL stays beside it
        sqlite3_db_config(db, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, NULL);
        sqlite3_db_config(wdb, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, NULL);
    }
    sqlite3_close(db);
    sqlite3_close(wdb);
    db = wdb = NULL;
}

// ---------------------------------------------------------------- the writer
//
// Every write of the database goes through one queue: built on the loop (its values
// copied), run on libuv's threadpool one at a time and in order, each in its own
// BEGIN IMMEDIATE transaction, its completion called on the loop. So the loop never
// waits on sqlite's busy timeout or an fsync, and the rows land in the order the
// changes were made. A blocking read that must be ordered with the writes (a run's
// end: its last progress and checkpoints) takes its turn in the same queue.

#define MAX_VALUES JOB_N_COLUMNS
#define MAX_STMTS 3

typedef struct {
    int type; // SQLITE_INTEGER, SQLITE_FLOAT, SQLITE_TEXT or SQLITE_NULL
    sqlite3_int64 i;
    double d;
    char *s;
} Value;

typedef struct {
    const char *sql;
    int n;
    Value v[MAX_VALUES];
} Stmt;

typedef struct Write {
    uv_work_t req;
    char what[64]; // "saving job 3": what a failure's log line names
    Stmt stmts[MAX_STMTS];
    int n_stmts;
    void (*work)(void *arg); // instead of statements: a blocking read in the queue's order
    StateDone done;
    void *arg;
    Err err;
    char damaged[256]; // its error, when it said the database is damaged
    struct Write *next;
} Write;

static Write *queue_head, *queue_tail; // waiting; queue_head is running when busy
static int busy;

static Write *write_new(const char *what, StateDone done, void *arg, Err *err) {
    Write *w = calloc(1, sizeof *w);
    if (!w) {
        log_error("astraid.db: %s: out of memory", what);
        err_resource(err, "astraid.db: %s: out of memory", what);
        return NULL;
    }
    snprintf(w->what, sizeof w->what, "%s", what);
    w->done = done;
    w->arg = arg;
    return w;
}

static Stmt *add_stmt(Write *w, const char *sql) {
    Stmt *s = &w->stmts[w->n_stmts++];
    s->sql = sql;
    return s;
}

static void put_int(Stmt *s, sqlite3_int64 i) {
    s->v[s->n++] = (Value){.type = SQLITE_INTEGER, .i = i};
}

static void put_double(Stmt *s, double d) {
    s->v[s->n++] = (Value){.type = SQLITE_FLOAT, .d = d};
}

// Takes t (a copy to free, NULL: SQL NULL).
static void put_owned(Stmt *s, char *t) {
    s->v[s->n++] = (Value){.type = t ? SQLITE_TEXT : SQLITE_NULL, .s = t};
}

static void put_text(Stmt *s, const char *t) {
    put_owned(s, t ? strdup(t) : NULL);
}

static void write_free(Write *w) {
    for (int k = 0; k < w->n_stmts; k++)
        for (int i = 0; i < w->stmts[k].n; i++)
            free(w->stmts[k].v[i].s);
    free(w);
}

// A failed write (on the threadpool: logged by its completion).
static void write_failed(Write *w, const char *step) {
    if (is_damage(sqlite3_errcode(wdb)))
        snprintf(w->damaged, sizeof w->damaged, "%s: %s", step, sqlite3_errmsg(wdb));
    err_resource(&w->err, "astraid.db: %s: %s", step, sqlite3_errmsg(wdb));
}

static int run_stmt(Write *w, const Stmt *s) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(wdb, s->sql, -1, &st, NULL) != SQLITE_OK) {
        write_failed(w, "prepare");
        return -1;
    }
    for (int i = 0; i < s->n; i++) {
        const Value *v = &s->v[i];
        if (v->type == SQLITE_INTEGER)
            sqlite3_bind_int64(st, i + 1, v->i);
        else if (v->type == SQLITE_FLOAT)
            sqlite3_bind_double(st, i + 1, v->d);
        else if (v->type == SQLITE_TEXT)
            sqlite3_bind_text(st, i + 1, v->s, -1, SQLITE_STATIC);
        else
            sqlite3_bind_null(st, i + 1);
    }
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) write_failed(w, "write");
    return rc == SQLITE_DONE ? 0 : -1;
}

// The statements in one transaction; one that cannot commit (SQLITE_FULL, an I/O error, a
// lock held past the busy timeout) is rolled back, so that the next write starts afresh.
static void write_work(uv_work_t *req) {
    Write *w = req->data;
    if (w->work) {
        w->work(w->arg);
        return;
    }
    if (!wdb) {
        err_resource(&w->err, "astraid.db is not open");
        return;
    }
    if (damage[0]) { // a write to a damaged b-tree could only make it worse
        err_resource(&w->err, "astraid.db is damaged (%.600s): nothing is written to it", damage);
        return;
    }
    if (sqlite3_exec(wdb, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) {
        write_failed(w, "begin");
        return;
    }
    int rc = 0;
    for (int k = 0; k < w->n_stmts && !rc; k++)
        rc = run_stmt(w, &w->stmts[k]);
    if (!rc && sqlite3_exec(wdb, "COMMIT", NULL, NULL, NULL) != SQLITE_OK) {
        write_failed(w, "commit");
        rc = -1;
    }
    if (rc) sqlite3_exec(wdb, "ROLLBACK", NULL, NULL, NULL);
}

static void start_next(void);

// The first write that finds the database damaged: from now on none is made.
static void mark_damaged(const Write *w) {
    snprintf(damage, sizeof damage, "%s, at %s", w->damaged, w->what);
    log_error("astraid.db is damaged (%s): astraid writes nothing more to it: submit, the verbs "
              "and rm are refused and no job is started; the running jobs go on until astraid is "
              "stopped; then " DAMAGED_ADVICE,
              damage);
}

static void write_done(uv_work_t *req, int status) {
    (void)status; // never cancelled
    Write *w = req->data;
    queue_head = w->next;
    if (!queue_head) queue_tail = NULL;
    busy = 0;
    if (w->damaged[0] && !damage[0]) mark_damaged(w);
    start_next(); // the next write runs while this one's completion does
    if (w->err.msg[0]) log_error("%s (%s)", w->err.msg, w->what);
    if (w->done) w->done(w->arg, &w->err);
    write_free(w);
}

static void start_next(void) {
    if (busy || !queue_head) return;
    busy = 1;
    queue_head->req.data = queue_head;
    // Fails only without a work function.
    (void)uv_queue_work(astraid.loop, &queue_head->req, write_work, write_done);
}

static void enqueue(Write *w) {
    if (queue_tail)
        queue_tail->next = w;
    else
        queue_head = w;
    queue_tail = w;
    start_next();
}

const char *state_damage(void) {
    return damage[0] ? damage : NULL;
}

int state_queue_work(void (*work)(void *arg), StateDone done, void *arg, Err *err) {
    Write *w = write_new("a read", done, arg, err);
    if (!w) return -1;
    w->work = work;
    enqueue(w);
    return 0;
}

static char *ids_json(const int *ids, long n) {
    if (!ids) return NULL;
    cJSON *a = cJSON_CreateIntArray(ids, (int)n);
    char *s = cJSON_PrintUnformatted(a);
    cJSON_Delete(a);
    return s;
}

int state_save_job(const Job *j, StateDone done, void *arg, Err *err) {
    char what[64];
    snprintf(what, sizeof what, "saving job %ld", j->id);
    Write *w = write_new(what, done, arg, err);
    if (!w) return -1;
    Stmt *s = add_stmt(w, "INSERT OR REPLACE INTO jobs(" JOB_COLUMNS ") VALUES(?,?,?,?,?,?,?,?,?,"
                          "?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)");
    put_int(s, j->id);
    put_text(s, j->name);
    put_text(s, job_state_name(j->state));
    put_owned(s, cJSON_PrintUnformatted(j->spec));
    put_text(s, j->ckpt_dir);
    put_int(s, j->progress.step);
    put_int(s, j->progress.total_steps);
    put_int(s, j->progress.epoch);
    double metrics[] = {j->progress.loss, j->progress.lr, j->progress.grad_norm,
                        j->progress.tokens_per_s, j->progress.eta_s};
    for (size_t k = 0; k < sizeof metrics / sizeof *metrics; k++)
        put_double(s, metrics[k]);
    long ints[] = {j->progress.has_step, j->restarts, j->max_restarts, j->priority, j->n_devices};
    for (size_t k = 0; k < sizeof ints / sizeof *ints; k++)
        put_int(s, ints[k]);
    put_owned(s, ids_json(j->want_ids, j->n_devices));
    put_text(s, j->last_checkpoint);
    put_text(s, j->error);
    put_int(s, j->submitted_by);
    put_double(s, j->created_at);
    put_double(s, j->started_at);
    put_double(s, j->finished_at);
    put_int(s, j->resume);
    put_int(s, j->runs);
    put_int(s, j->site.slurm_id);
    put_int(s, j->watch.hangs);
    double run_time = j->watch.run_time_s +
                      (j->watch.run_start_mono > 0 ? clock_mono_s() - j->watch.run_start_mono : 0);
    put_double(s, run_time);
    put_text(s, j->pause_reason);
    enqueue(w);
    return 0;
}

void state_event(long job_id, const char *kind, const char *detail) {
    char what[64];
    snprintf(what, sizeof what, "job %ld: event %s", job_id, kind);
    Write *w = write_new(what, NULL, NULL, NULL);
    if (!w) return;
    Stmt *s = add_stmt(w, "INSERT INTO events(job_id, time, kind, detail) VALUES(?,?,?,?)");
    put_int(s, job_id);
    put_double(s, clock_wall_s());
    put_text(s, kind);
    put_text(s, detail);
    enqueue(w);
}

int state_delete_jobs(const long *ids, size_t n, StateDone done, void *arg, Err *err) {
    char what[64];
    if (n == 1)
        snprintf(what, sizeof what, "removing job %ld", ids[0]);
    else
        snprintf(what, sizeof what, "removing %zu jobs", n);
    cJSON *list = cJSON_CreateArray();
    for (size_t i = 0; list && i < n; i++)
        cJSON_AddItemToArray(list, cJSON_CreateNumber((double)ids[i]));
    char *text = list ? cJSON_PrintUnformatted(list) : NULL;
    cJSON_Delete(list);
    if (!text) return err_resource(err, "astraid.db: %s: out of memory", what);
    Write *w = write_new(what, done, arg, err);
    if (!w) {
        free(text);
        return -1;
    }
    static const char *const SQL[] = {
        "DELETE FROM jobs WHERE id IN (SELECT value FROM json_each(?))",
        "DELETE FROM runs WHERE job_id IN (SELECT value FROM json_each(?))",
        "DELETE FROM events WHERE job_id IN (SELECT value FROM json_each(?))"};
    for (size_t k = 0; k < sizeof SQL / sizeof *SQL; k++)
        put_text(add_stmt(w, SQL[k]), text);
    free(text);
    enqueue(w);
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
    char what[64];
    snprintf(what, sizeof what, "job %ld: run %ld started", j->id, j->runs);
    Write *w = write_new(what, NULL, NULL, NULL);
    if (!w) return;
    int *ids = calloc((size_t)n, sizeof *ids);
    cJSON *starts = cJSON_CreateArray();
    for (int i = 0; ids && i < n; i++) {
        ids[i] = (int)pids[i];
        cJSON_AddItemToArray(starts, cJSON_CreateNumber((double)proc_start_time(ids[i])));
    }
    Stmt *s = add_stmt(w, "INSERT OR REPLACE INTO runs(job_id, run, started_at, pids, starts)"
                          " VALUES(?,?,?,?,?)");
    put_int(s, j->id);
    put_int(s, j->runs);
    put_double(s, clock_wall_s());
    put_owned(s, ids_json(ids, n));
    put_owned(s, cJSON_PrintUnformatted(starts));
    cJSON_Delete(starts);
    free(ids);
    enqueue(w);
}

void state_run_ended(const Job *j, const char *outcome) {
    char what[64];
    snprintf(what, sizeof what, "job %ld: run %ld ended", j->id, j->runs);
    Write *w = write_new(what, NULL, NULL, NULL);
    if (!w) return;
    Stmt *s = add_stmt(w, "UPDATE runs SET finished_at=?, outcome=? WHERE job_id=? AND run=?");
    put_double(s, clock_wall_s());
    put_text(s, outcome);
    put_int(s, j->id);
    put_int(s, j->runs);
    enqueue(w);
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
    j->shown_state = j->state;
    const char *spec = (const char *)sqlite3_column_text(st, i++);
    j->spec = spec ? cJSON_Parse(spec) : NULL;
    j->ckpt_dir = column_text(st, i++);
    j->progress.step = (long)sqlite3_column_int64(st, i++);
    j->progress.total_steps = (long)sqlite3_column_int64(st, i++);
    j->progress.epoch = (long)sqlite3_column_int64(st, i++);
    double *metrics[] = {&j->progress.loss, &j->progress.lr, &j->progress.grad_norm,
                         &j->progress.tokens_per_s, &j->progress.eta_s};
    for (size_t k = 0; k < sizeof metrics / sizeof *metrics; k++)
        *metrics[k] = sqlite3_column_double(st, i++);
    j->progress.has_step = sqlite3_column_int(st, i++);
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
    j->site.slurm_id = (long)sqlite3_column_int64(st, i++);
    j->watch.hangs = (long)sqlite3_column_int64(st, i++);
    j->watch.run_time_s = sqlite3_column_double(st, i++);
    j->pause_reason = column_text(st, i++);
    Err why = {0}; // a spec an older astraid took: the job is shown, no run of it starts
    int bad_spec = j->spec && job_spec_parse(&j->js, j->spec, &why);
    if (bad_spec) j->spec_error = strdup(why.msg);
    if (!j->name || !j->spec || !j->ckpt_dir || (bad_spec && !j->spec_error)) {
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
            log_info("job %ld: recorded rank pid %d is no longer that rank; left alone", j->id,
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

// 1 if the job's last run has no end in the runs table: under slurm its Slurm job may live on.
static int last_run_open(const Job *j) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT finished_at IS NULL FROM runs WHERE job_id=? AND run=?", -1,
                           &st, NULL) != SQLITE_OK)
        return 0;
    sqlite3_bind_int64(st, 1, j->id);
    sqlite3_bind_int64(st, 2, j->runs);
    int open = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0);
    sqlite3_finalize(st);
    return open;
}

static void recover_job(Job *j) {
    if (astraid.site->attach && !job_is_final(j->state) && last_run_open(j) &&
        !astraid.site->attach(j))
        return; // its Slurm job (its ranks) ran on without astraid: squeue says how it is now
    if (j->state == JOB_CANCELLING) { // and no Slurm job is left of it
        if (last_run_open(j)) state_run_ended(j, "cancelled");
        j->state = JOB_CANCELLED;
        j->finished_at = clock_wall_s();
        job_save(j);
        return;
    }
    int died_under = j->state == JOB_STARTING || j->state == JOB_RUNNING || j->state == JOB_PAUSING;
    if (!died_under && j->state != JOB_INTERRUPTED) return;
    if (died_under) {
        wait_orphans(j);
        state_run_ended(j, "interrupted"); // its astraid died: the run row is closed here
    }
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
    job_save(j);
}

int state_recover(Err *err) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT " JOB_COLUMNS " FROM jobs ORDER BY id", -1, &st, NULL) !=
        SQLITE_OK)
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
