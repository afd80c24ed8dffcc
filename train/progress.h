// progress.h: what a run reports while it trains (docs/design.md §6).
//
// - The progress database `progress.db` (sqlite, WAL, one per job, written only
//   by rank 0): one row per optimizer step and one per checkpoint. Readers
//   (astraid, astraictl, sqlite3) never block the writer thanks to WAL.
// - metric.jsonl rows (kept in memory, cumulative, written into each checkpoint).
// - One human progress line on stderr per log interval.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"

typedef struct sqlite3 sqlite3;
typedef struct sqlite3_stmt sqlite3_stmt;

// A number of a step row beyond AstrAI's (DPO, GRPO): "reward_margin", "kl", ...
typedef struct {
    const char *name;
    double value;
} StepExtra;

#define STEP_MAX_EXTRA 12

typedef struct {
    long step; // optimizer steps done after this one (1-based)
    long epoch;
    long consumed_samples;
    float loss; // mean of the step's micro-step losses (averaged over ranks)
    double lr;  // learning rate the step applied
    float grad_norm;
    double tokens_per_s;
    double wall_time; // unix seconds when the step finished
    bool skipped;     // loss scaling skipped it (an overflow): loss and grad_norm may be inf/NaN,
                      // which are recorded as absent (NULL in progress.db, no key in metric.jsonl)
    int n_extra;
    StepExtra extra[STEP_MAX_EXTRA];
} StepRow;

typedef struct {
    sqlite3 *db;
    sqlite3_stmt *insert_step;
    sqlite3_stmt *insert_ckpt;
    sqlite3_stmt *delete_ckpt;
    sqlite3_stmt *insert_val;
    sqlite3_stmt *insert_extra; // step_metrics(step, name, value): DPO/GRPO numbers
    sqlite3_stmt *set_phase;
    sqlite3_stmt *insert_load; // expert_load(step, layer, expert, tokens)
    char path[4096];
} ProgressDb;

// Opens (creating) dir/progress.db. Rows of steps after `resume_step` are deleted
// (they belong to a run that continued past the checkpoint we resume from). A database
// that cannot be created or written fails with err->resource set (the system's failure).
// A row with a non-finite number is refused with an error naming the step and the key.
int progress_open(ProgressDb *p, const char *dir, long total_steps, long resume_step, Err *err);
int progress_add_step(ProgressDb *p, const StepRow *row, Err *err);
int progress_add_checkpoint(ProgressDb *p, long step, long epoch, const char *path, Err *err);
// A mixture of experts' step: tokens: (layers, experts) the pairs each routed expert received
// (table expert_load), in one transaction.
int progress_add_expert_load(ProgressDb *p, long step, int layers, int experts, const float *tokens,
                             Err *err);
// One sample (train/samples.h): the prompt's text, the completion's, its token count.
typedef struct {
    const char *prompt, *completion;
    int tokens;
} SampleRow;
// The samples of `step` (table samples, idx: each row's index in rows), in one transaction:
// a crash leaves all of them or none.
int progress_add_samples(ProgressDb *p, long step, const SampleRow *rows, int n, Err *err);
// The checkpoint of `step` is gone (deleted by the retention): its row goes too.
int progress_remove_checkpoint(ProgressDb *p, long step, Err *err);
// A validation run (--val_split) at `step`: table validation(step, epoch,
// consumed_samples, val_loss, wall_time). Databases written before it existed gain the
// (empty) table when opened; readers treat a missing table as no validation yet.
int progress_add_validation(ProgressDb *p, long step, long epoch, long consumed_samples,
                            double val_loss, Err *err);
// The phase rank 0 is in between optimizer steps: "validation", "checkpoint" (a write that
// blocks training), or "" when it is over (proto/progress_db.h): astraid's hang watchdog gives
// a phase more time than a step.
int progress_set_phase(ProgressDb *p, const char *phase, Err *err);
void progress_close(ProgressDb *p);

// metric.jsonl: the cumulative rows of a run, in AstrAI's row shapes
// (astrai/trainer/train_callback.py MetricCallback), one JSON object a line:
//   {"type":"step","timestamp":"2026-07-30T00:49:04","epoch":0,"step":1,
//    "consumed_samples":4,"loss":5.5,"lr":0.0003,"grad_norm":1.2}
//   {"type":"epoch","timestamp":...,"epoch":0,"step":20,"consumed_samples":80}
//   {"type":"validation","timestamp":...,"epoch":0,"step":20,"consumed_samples":80,
//    "val_loss":5.1}
// Our grad_norm is the step's own (before clipping); AstrAI's is one step late (its metric
// callback runs before its clipping callback), so its first step row has none.
typedef enum { METRIC_STEP, METRIC_EPOCH, METRIC_VALIDATION } MetricKind;

// Which optional numbers a row carries (AstrAI's `--metrics` columns).
enum { METRIC_HAS_LOSS = 1, METRIC_HAS_LR = 2, METRIC_HAS_GRAD_NORM = 4, METRIC_HAS_VAL_LOSS = 8 };

// The numbers DPO and GRPO add to their step rows (after grad_norm), by name:
// reward_margin, reward_accuracy (dpo); kl, clip_fraction, reward_mean (grpo); and loss scaling
// (--loss_scale): loss_scale (the step's S), skipped (1: an overflow skipped it); a mixture of
// experts: expert_load_max and expert_load_min (the most and least loaded routed expert of any
// layer, relative to its layer's mean). Row bit of extra k: METRIC_HAS_EXTRA << k.
#define METRIC_N_EXTRA 14
#define METRIC_HAS_EXTRA 16u
extern const char *const METRIC_EXTRA_NAMES[METRIC_N_EXTRA];

typedef struct {
    MetricKind kind;
    long step; // optimizer steps done when the row was written
    long epoch;
    long consumed_samples;
    char timestamp[32]; // "YYYY-MM-DDTHH:MM:SS", local time like AstrAI; "" when absent
    unsigned has;       // METRIC_HAS_* bits
    float loss;
    double lr;
    float grad_norm;
    double val_loss;
    double extra[METRIC_N_EXTRA]; // by METRIC_EXTRA_NAMES, where the row has them
} MetricRow;

typedef struct {
    MetricRow *rows;
    size_t n, cap;
    unsigned step_skip; // METRIC_HAS_* bits new step rows leave out (--metrics); 0: none
} MetricLog;

// AstrAI's `--metrics` (comma-separated names among loss, lr, grad_norm, val_loss): new step
// rows carry only the named ones of loss, lr and grad_norm. val_loss never enters a step row
// (validation rows carry it whatever the list says); rows already in the log keep their keys.
// An unknown name is an error naming it.
int metric_log_select(MetricLog *m, const char *list, Err *err);
// A "step" row with the selected metrics (all three unless metric_log_select said otherwise),
// stamped with row->wall_time.
int metric_log_append(MetricLog *m, const StepRow *row, Err *err);
// An "epoch" row (the end of an epoch), stamped now. A second row for the same epoch and
// step (the end of an epoch replayed by a resumed run) is not added.
int metric_log_append_epoch(MetricLog *m, long step, long epoch, long consumed_samples, Err *err);
// A "validation" row with val_loss, stamped now.
int metric_log_append_validation(MetricLog *m, long step, long epoch, long consumed_samples,
                                 double val_loss, Err *err);
// Every append refuses a row with a non-finite number (JSON has none; it would poison the
// file for every later resume) with an error naming the step and the key.
int metric_log_append_row(MetricLog *m, const MetricRow *row, Err *err);
// Loads metric.jsonl rows with step <= up_to_step (a checkpoint's own history): ours and
// AstrAI's as they are (a step row without grad_norm or loss, epoch and validation rows,
// unknown keys ignored). A line that is not such a row is an error naming path:line.
int metric_log_load(MetricLog *m, const char *path, long up_to_step, Err *err);
// Serialises all rows as JSON lines (malloc'd text, *len bytes), each number the shortest
// decimal that reads back as the same float (loss, grad_norm) or double; NULL when out of
// memory.
char *metric_log_to_jsonl(const MetricLog *m, size_t *len);
void metric_log_free(MetricLog *m);

// "step 10/200 (5.0%) | epoch 0 | loss 5.4321 | lr 3.00e-04 | grad_norm 1.23 | 12345 tok/s | ETA
// 1m23s"
void progress_format_line(char *buf, size_t cap, const StepRow *row, long total_steps,
                          double eta_s);
