// curve.c: a job's training curve, read from the progress database its rank 0 writes
// (run_dir/progress.db, train/progress.h) for the `history` method and the web page.
// Each read opens its own read-only connection: it may run on any thread (the threadpool,
// an HTTP thread), shares no handle with progress_reader.c, and in WAL mode never blocks
// the writer. Its numbers are raw items, exact (print the tree: valuedouble is not set). A
// restarted run deletes the rows past the step it resumes from before it writes again
// (progress_open), so the steps read are one curve: increasing, no duplicates.
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <sqlite3.h>

#include "daemon/daemon.h"
#include "proto/progress_db.h"

#define CURVE_BUSY_MS 200 // a reader waits for the wal-index at most this (rare in WAL mode)

// The columns of a row, in the SELECT's order after step; val_loss is read apart (it only
// exists at the steps with a validation row).
static const char *const COLUMNS[] = {"loss", "lr", "grad_norm", "tokens_per_s", "wall_time"};
#define N_COLUMNS (sizeof COLUMNS / sizeof *COLUMNS)

static int db_fail(sqlite3 *db, const char *path, const char *what, Err *err) {
    return err_resource(err, "%s: %s: %s", path, what, db ? sqlite3_errmsg(db) : "out of memory");
}

// A REAL column as a JSON number that reads back as the same double (cJSON's own print may
// lose the last bit): the shortest of %.15g, %.16g, %.17g that does, as a raw item. NULL or
// a non-finite value (JSON has neither) as null.
static int add_value(cJSON *row, const char *key, sqlite3_stmt *st, int col) {
    double v = sqlite3_column_double(st, col);
    if (sqlite3_column_type(st, col) == SQLITE_NULL || !isfinite(v))
        return cJSON_AddNullToObject(row, key) ? 0 : -1;
    char text[32];
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(text, sizeof text, "%.*g", digits, v);
        if (strtod(text, NULL) == v) break;
    }
    return cJSON_AddRawToObject(row, key, text) ? 0 : -1;
}

int progress_db_has_table(sqlite3 *db, const char *name) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "SELECT 1 FROM sqlite_master WHERE type='table' AND name=?1", -1,
                           &st, NULL) != SQLITE_OK)
        return -1;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    return rc == SQLITE_ROW ? 1 : rc == SQLITE_DONE ? 0 : -1;
}

// Appends the rows of st (prepared and bound) to steps, at most limit of them; *more when
// one past the limit was read (the query asks for limit + 1).
static int read_rows(sqlite3_stmt *st, int with_val, long limit, cJSON *steps, int *more) {
    long n = 0;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        if (n++ == limit) {
            *more = 1;
            return SQLITE_DONE;
        }
        cJSON *row = cJSON_CreateObject();
        if (!row) return SQLITE_NOMEM;
        cJSON_AddItemToArray(steps, row);
        int bad = !cJSON_AddNumberToObject(row, "step", (double)sqlite3_column_int64(st, 0));
        for (size_t k = 0; k < N_COLUMNS && !bad; k++)
            bad = add_value(row, COLUMNS[k], st, (int)k + 1);
        if (!bad && with_val && sqlite3_column_type(st, 1 + N_COLUMNS) != SQLITE_NULL)
            bad = add_value(row, "val_loss", st, 2 + N_COLUMNS);
        if (bad) return SQLITE_NOMEM;
    }
    return rc;
}

// The step_metrics numbers (loss_scale, skipped, DPO/GRPO's) of the rows read, added to them by
// step: both in step order, so one pass merges them.
static int add_metrics(sqlite3 *db, long since_step, cJSON *steps) {
    cJSON *last = cJSON_GetArrayItem(steps, cJSON_GetArraySize(steps) - 1), *row = steps->child;
    sqlite3_stmt *st;
    if (!last) return SQLITE_DONE;
    if (sqlite3_prepare_v2(db, PROGRESS_DB_CURVE_METRICS, -1, &st, NULL) != SQLITE_OK)
        return SQLITE_ERROR;
    sqlite3_bind_int64(st, 1, since_step);
    sqlite3_bind_int64(st, 2, (sqlite3_int64)cJSON_GetObjectItem(last, "step")->valuedouble);
    int rc, bad = 0;
    while (!bad && (rc = sqlite3_step(st)) == SQLITE_ROW) {
        double step = (double)sqlite3_column_int64(st, 0);
        while (row && cJSON_GetObjectItem(row, "step")->valuedouble < step)
            row = row->next;
        const char *name = (const char *)sqlite3_column_text(st, 1);
        if (row && name && cJSON_GetObjectItem(row, "step")->valuedouble == step &&
            !cJSON_GetObjectItemCaseSensitive(row, name))
            bad = add_value(row, name, st, 2);
    }
    sqlite3_finalize(st);
    return bad ? SQLITE_NOMEM : rc;
}

// The rows of an open database (see curve_read).
static int read_curve(sqlite3 *db, const char *path, long since_step, long limit, cJSON *steps,
                      int *more, Err *err) {
    int has_steps = progress_db_has_table(db, "steps"),
        has_val = progress_db_has_table(db, "validation"),
        has_metrics = progress_db_has_table(db, "step_metrics");
    if (has_steps < 0 || has_val < 0 || has_metrics < 0) return db_fail(db, path, "read", err);
    if (!has_steps) return 0; // rank 0 created the file and is creating its tables
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(
            db, has_val ? PROGRESS_DB_CURVE_WITH_VALIDATION : PROGRESS_DB_CURVE_STEPS_ONLY, -1, &st,
            NULL) != SQLITE_OK)
        return db_fail(db, path, "read", err);
    sqlite3_bind_int64(st, 1, since_step);
    sqlite3_bind_int64(st, 2, limit + 1);
    int rc = read_rows(st, has_val, limit, steps, more);
    sqlite3_finalize(st);
    if (rc == SQLITE_DONE && has_metrics) rc = add_metrics(db, since_step, steps);
    if (rc == SQLITE_NOMEM) return err_resource(err, "%s: out of memory", path);
    return rc == SQLITE_DONE ? 0 : db_fail(db, path, "read steps", err);
}

int progress_db_open_read(const char *run_dir, sqlite3 **db, char *path, size_t cap, Err *err) {
    *db = NULL;
    if ((size_t)snprintf(path, cap, "%s/" PROGRESS_DB_FILE, run_dir) >= cap)
        return err_set(err, "%s: path too long", run_dir);
    int rc = sqlite3_open_v2(path, db, SQLITE_OPEN_READONLY, NULL);
    if (rc == SQLITE_CANTOPEN) { // no database yet: the first run has not started
        sqlite3_close(*db);
        *db = NULL;
        return 0;
    }
    if (rc != SQLITE_OK) {
        db_fail(*db, path, "open", err);
        sqlite3_close(*db);
        *db = NULL;
        return -1;
    }
    sqlite3_busy_timeout(*db, CURVE_BUSY_MS);
    return 0;
}

int curve_read(const char *run_dir, long since_step, long limit, cJSON **steps, int *more,
               Err *err) {
    char path[PATH_MAX];
    sqlite3 *db;
    *more = 0;
    *steps = NULL;
    cJSON *rows = cJSON_CreateArray();
    if (!rows) return err_resource(err, "%s: out of memory", run_dir);
    int rc = progress_db_open_read(run_dir, &db, path, sizeof path, err);
    if (!rc && db) rc = read_curve(db, path, since_step, limit, rows, more, err);
    sqlite3_close(db);
    if (rc) {
        cJSON_Delete(rows);
        *more = 0;
        return -1;
    }
    *steps = rows;
    return 0;
}
