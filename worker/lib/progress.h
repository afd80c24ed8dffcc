// progress.h: what a run reports while it trains (DESIGN §6).
//
// - The progress database `progress.db` (sqlite, WAL, one per job, written only
//   by rank 0): one row per optimizer step and one per checkpoint. Readers
//   (astraid, astraictl, sqlite3) never block the writer thanks to WAL.
// - metric.jsonl rows (kept in memory, cumulative, written into each checkpoint).
// - One human progress line on stderr per log interval.
#pragma once
#include <stddef.h>

#include "common/error.h"

typedef struct sqlite3 sqlite3;
typedef struct sqlite3_stmt sqlite3_stmt;

typedef struct {
    long step; // optimizer steps done after this one (1-based)
    long epoch;
    long consumed_samples;
    float loss; // mean of the step's micro-step losses (averaged over ranks)
    double lr;  // learning rate the step applied
    float grad_norm;
    double tokens_per_s;
    double wall_time; // unix seconds when the step finished
} StepRow;

typedef struct {
    sqlite3 *db;
    sqlite3_stmt *insert_step;
    sqlite3_stmt *insert_ckpt;
    char path[4096];
} ProgressDb;

// Opens (creating) dir/progress.db. Rows of steps after `resume_step` are deleted
// (they belong to a run that continued past the checkpoint we resume from).
int progress_open(ProgressDb *p, const char *dir, long total_steps, long resume_step, Err *err);
int progress_add_step(ProgressDb *p, const StepRow *row, Err *err);
int progress_add_checkpoint(ProgressDb *p, long step, long epoch, const char *path, Err *err);
void progress_close(ProgressDb *p);

// metric.jsonl: the cumulative rows of a run.
typedef struct {
    StepRow *rows;
    size_t n, cap;
} MetricLog;

int metrics_append(MetricLog *m, const StepRow *row, Err *err);
// Loads metric.jsonl rows with step <= up_to_step (a checkpoint's own history).
int metrics_load(MetricLog *m, const char *path, long up_to_step, Err *err);
// Serialises all rows as JSON lines (malloc'd text, *len bytes).
char *metrics_to_jsonl(const MetricLog *m, size_t *len);
void metrics_free(MetricLog *m);

// "step 10/200 (5.0%) | epoch 0 | loss 5.4321 | lr 3.00e-04 | grad_norm 1.23 | 12345 tok/s | ETA
// 1m23s"
void progress_format_line(char *buf, size_t cap, const StepRow *row, long total_steps,
                          double eta_s);
