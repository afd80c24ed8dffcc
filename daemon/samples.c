// samples.c: what a job's model wrote as it trained (train/samples.h), read from the progress
// database its rank 0 writes (table samples) for the `samples` method and /api/samples. Each
// read opens its own read-only connection (progress_db_open_read, curve.c's rule): any thread,
// never blocking the writer. A resumed run drops the rows past its checkpoint before it writes
// again (progress_open), so a step's rows are one run's.
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <sqlite3.h>

#include "daemon/daemon.h"
#include "proto/progress_db.h"

// One row of the query as {step, index, prompt, completion, tokens}; -1 for want of memory.
static int add_row(cJSON *rows, sqlite3_stmt *st) {
    const char *prompt = (const char *)sqlite3_column_text(st, 2);
    const char *completion = (const char *)sqlite3_column_text(st, 3);
    cJSON *row = prompt && completion ? cJSON_CreateObject() : NULL;
    if (!row) return -1;
    cJSON_AddItemToArray(rows, row);
    return cJSON_AddNumberToObject(row, "step", (double)sqlite3_column_int64(st, 0)) &&
                   cJSON_AddNumberToObject(row, "index", sqlite3_column_int(st, 1)) &&
                   cJSON_AddStringToObject(row, "prompt", prompt) &&
                   cJSON_AddStringToObject(row, "completion", completion) &&
                   cJSON_AddNumberToObject(row, "tokens", sqlite3_column_int(st, 4))
               ? 0
               : -1;
}

static double row_step(const cJSON *row) {
    return cJSON_GetObjectItemCaseSensitive(row, "step")->valuedouble;
}

// A page cut inside step `cut` (the step of the row left off) after whole steps ends with the
// whole ones: the next page (since_step: the page's last step) starts at the cut step.
static void drop_cut_step(cJSON *rows, double cut) {
    int n = cJSON_GetArraySize(rows);
    if (row_step(rows->child) == cut) return; // the first step alone passes the bound
    while (n > 0 && row_step(cJSON_GetArrayItem(rows, n - 1)) == cut)
        cJSON_DeleteItemFromArray(rows, --n);
}

// The rows of st (bound) into rows, at most SAMPLES_PAGE_BYTES of their texts; SQLITE_DONE at the
// end of the page.
static int read_rows(sqlite3_stmt *st, const SamplesQuery *q, cJSON *rows, int *more) {
    size_t bytes = 0;
    int rc;
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        size_t len = (size_t)sqlite3_column_bytes(st, 2) + (size_t)sqlite3_column_bytes(st, 3);
        if (rows->child && bytes + len > SAMPLES_PAGE_BYTES) {
            *more = 1;
            if (q->all) drop_cut_step(rows, (double)sqlite3_column_int64(st, 0));
            return SQLITE_DONE;
        }
        if (add_row(rows, st)) return SQLITE_NOMEM;
        bytes += len;
    }
    return rc;
}

static int read_samples(sqlite3 *db, const char *path, const SamplesQuery *q, cJSON *rows,
                        int *more, Err *err) {
    int has = progress_db_has_table(db, "samples");
    if (has < 0) return err_resource(err, "%s: read: %s", path, sqlite3_errmsg(db));
    if (!has) return 0; // an older astrai-train, or rank 0 is creating its tables
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, PROGRESS_DB_SAMPLES, -1, &st, NULL) != SQLITE_OK)
        return err_resource(err, "%s: read samples: %s", path, sqlite3_errmsg(db));
    if (q->step >= 0)
        sqlite3_bind_int64(st, 1, q->step);
    else
        sqlite3_bind_null(st, 1);
    sqlite3_bind_int(st, 2, q->all);
    sqlite3_bind_int64(st, 3, q->since_step);
    int rc = read_rows(st, q, rows, more);
    sqlite3_finalize(st);
    if (rc == SQLITE_NOMEM) return err_resource(err, "%s: out of memory", path);
    if (rc != SQLITE_DONE)
        return err_resource(err, "%s: read samples: %s", path, sqlite3_errmsg(db));
    return 0;
}

int job_samples_read(const char *run_dir, const SamplesQuery *q, cJSON **rows, int *more,
                     Err *err) {
    char path[PATH_MAX];
    sqlite3 *db;
    *more = 0;
    *rows = cJSON_CreateArray();
    if (!*rows) return err_resource(err, "%s: out of memory", run_dir);
    int rc = progress_db_open_read(run_dir, &db, path, sizeof path, err);
    if (!rc && db) rc = read_samples(db, path, q, *rows, more, err);
    sqlite3_close(db);
    if (rc) {
        cJSON_Delete(*rows);
        *rows = NULL;
        *more = 0;
    }
    return rc;
}
