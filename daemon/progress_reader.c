// progress_reader.c: fills each running job's progress fields from the progress
// database its rank 0 writes (run_dir/progress.db, worker/lib/progress.h), read
// only, on a timer. WAL lets us read while rank 0 writes; a busy database is simply
// read at the next tick, never waited on. Changes are pushed to watchers.
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sqlite3.h>

#include "daemon/daemon.h"

#define ETA_WINDOW 16 // steps the ETA's pace is measured over

static uv_timer_t poll_timer;

static sqlite3 *open_progress(Job *j) {
    if (j->progress_db) return j->progress_db;
    char path[PATH_MAX];
    if (job_run_dir(j, path, sizeof path) || strlen(path) + sizeof "/progress.db" > sizeof path)
        return NULL;
    strcat(path, "/progress.db");
    sqlite3 *db = NULL;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        sqlite3_close(db); // not created yet: the run is still starting
        return NULL;
    }
    sqlite3_busy_timeout(db, 0);
    j->progress_db = db;
    return db;
}

void progress_close_job(Job *j) {
    sqlite3_close(j->progress_db);
    j->progress_db = NULL;
}

static int query_long(sqlite3 *db, const char *sql, long *out) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) return -1;
    int rc = sqlite3_step(st) == SQLITE_ROW ? 0 : -1;
    if (!rc) *out = (long)sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return rc;
}

// The newest rows: the latest values, and the pace (seconds per step) for the ETA.
static int read_steps(sqlite3 *db, Job *j) {
    sqlite3_stmt *st;
    const char *sql = "SELECT step, epoch, loss, lr, grad_norm, tokens_per_s, wall_time FROM steps"
                      " ORDER BY step DESC LIMIT 16";
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) return -1;
    int n = 0;
    long first_step = 0, last_step = 0;
    double first_wall = 0, last_wall = 0;
    while (sqlite3_step(st) == SQLITE_ROW && n < ETA_WINDOW) {
        long step = (long)sqlite3_column_int64(st, 0);
        double wall = sqlite3_column_double(st, 6);
        if (n++ == 0) {
            last_step = step;
            last_wall = wall;
            j->step = step;
            j->epoch = (long)sqlite3_column_int64(st, 1);
            j->loss = sqlite3_column_double(st, 2);
            j->lr = sqlite3_column_double(st, 3);
            j->grad_norm = sqlite3_column_double(st, 4);
            j->tokens_per_s = sqlite3_column_double(st, 5);
            j->has_progress = 1;
        }
        first_step = step;
        first_wall = wall;
    }
    sqlite3_finalize(st);
    j->eta_s = -1;
    if (last_step > first_step && j->total_steps > 0)
        j->eta_s = (last_wall - first_wall) / (double)(last_step - first_step) *
                   (double)(j->total_steps > last_step ? j->total_steps - last_step : 0);
    return n > 0 ? 0 : -1;
}

static void read_checkpoint(sqlite3 *db, Job *j) {
    sqlite3_stmt *st;
    const char *sql = "SELECT path FROM checkpoints ORDER BY step DESC LIMIT 1";
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) return;
    if (sqlite3_step(st) == SQLITE_ROW) {
        const char *path = (const char *)sqlite3_column_text(st, 0);
        if (path && (!j->last_checkpoint || strcmp(path, j->last_checkpoint))) {
            free(j->last_checkpoint);
            j->last_checkpoint = strdup(path);
        }
    }
    sqlite3_finalize(st);
}

// The latest validation loss of each job (--val_split), kept here by job id: the Job
// struct has no field for it. Filled by progress_read while a job runs, and read once
// from the run's progress.db for a job seen first after its run (a restarted daemon).
typedef struct {
    long id;
    int has;
    double val_loss;
} ValEntry;

static ValEntry *val_cache;
static size_t n_val_cache, cap_val_cache;

static ValEntry *val_entry(long id, int create) {
    for (size_t i = 0; i < n_val_cache; i++)
        if (val_cache[i].id == id) return &val_cache[i];
    if (!create) return NULL;
    if (n_val_cache == cap_val_cache) {
        size_t cap = cap_val_cache ? cap_val_cache * 2 : 16;
        ValEntry *v = realloc(val_cache, cap * sizeof *v);
        if (!v) return NULL;
        val_cache = v;
        cap_val_cache = cap;
    }
    val_cache[n_val_cache] = (ValEntry){.id = id};
    return &val_cache[n_val_cache++];
}

// The newest validation row; a database from before the validation table: none. Returns
// 1 when the value changed.
static int read_validation(sqlite3 *db, Job *j) {
    ValEntry *e = val_entry(j->id, 1);
    if (!e) return 0;
    sqlite3_stmt *st;
    const char *sql = "SELECT val_loss FROM validation ORDER BY step DESC LIMIT 1";
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) != SQLITE_OK) return 0;
    int changed = 0;
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL) {
        double v = sqlite3_column_double(st, 0);
        changed = !e->has || v != e->val_loss;
        e->has = 1;
        e->val_loss = v;
    }
    sqlite3_finalize(st);
    return changed;
}

int progress_val_loss(const Job *j, double *val_loss) {
    ValEntry *e = val_entry(j->id, 0);
    if (!e) {
        char path[PATH_MAX];
        sqlite3 *db = NULL;
        if (!job_run_dir(j, path, sizeof path) &&
            strlen(path) + sizeof "/progress.db" <= sizeof path) {
            strcat(path, "/progress.db");
            if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK) {
                sqlite3_busy_timeout(db, 0);
                read_validation(db, (Job *)j);
            }
            sqlite3_close(db);
        }
        if (!(e = val_entry(j->id, 1))) return 0;
    }
    if (e->has) *val_loss = e->val_loss;
    return e->has;
}

int progress_read(Job *j) {
    sqlite3 *db = open_progress(j);
    if (!db) return 0;
    long before_step = j->step, before_total = j->total_steps;
    const char *before_ckpt = j->last_checkpoint;
    long total;
    if (!query_long(db, "SELECT CAST(value AS INTEGER) FROM run WHERE key='total_steps'", &total))
        j->total_steps = total;
    read_steps(db, j);
    read_checkpoint(db, j);
    int val_changed = read_validation(db, j);
    return val_changed || j->step != before_step || j->total_steps != before_total ||
           j->last_checkpoint != before_ckpt;
}

static void on_poll(uv_timer_t *t) {
    (void)t;
    for (Job *j = astraid.jobs; j; j = j->next)
        if (j->run && progress_read(j)) server_push_progress(j);
}

void progress_reader_start(void) {
    uv_timer_init(astraid.loop, &poll_timer);
    uint64_t ms = (uint64_t)(astraid.cfg.poll_interval * 1000);
    uv_timer_start(&poll_timer, on_poll, ms, ms);
}
