// trainer.h: the training loop of one rank (docs/design.md §8): micro-batches, gradient
// accumulation, clipping, optimizer and scheduler steps, progress, checkpoints,
// resume. The parallel mode is the executor's (train/executor.h), the objective its table's
// (train/objective.h), the passes of micro-batches one pipeline schedule (train/step.h): the loop
// is the same for all of them.
#pragma once
#include <signal.h>
#include <stdint.h>

#include "common/error.h"
#include "data/sampler.h"
#include "engine/model.h"
#include "engine/optim.h"
#include "engine/schedule.h"
#include "proto/train_spec.h"
#include "train/ckpt_writer.h"
#include "train/executor.h"
#include "train/grad_scaler.h"
#include "train/objective.h"
#include "train/pipeline.h"
#include "train/progress.h"
#include "train/samples.h"
#include "train/train_ckpt.h"

// Requests from signal handlers, polled at optimizer-step boundaries.
extern volatile sig_atomic_t trainer_stop_requested;       // SIGTERM/SIGINT: checkpoint, exit
extern volatile sig_atomic_t trainer_checkpoint_requested; // SIGUSR1: checkpoint, continue

// What the process gives its trainer besides the spec: astrai-train's main fills it, with what
// a supervisor (astraid) says in the environment read there once.
typedef struct {
    const Backend *be;   // this rank's device
    Comm *comm;          // the job's communicator; NULL for one rank
    long threads;        // CPU threads of this rank
    const char *run_dir; // where progress.db lives (a supervisor's run directory); NULL: ckpt_dir
    const char *memory_report; // a directory for this rank's resident memory report; NULL: none
    // A supervisor's control pipe carrying lines "stop" (checkpoint and exit: pause, shutdown)
    // and "checkpoint" (checkpoint and go on), read without blocking at step boundaries; EOF
    // (the supervisor is gone) counts as stop. -1: none.
    int control_fd;
    // --dry-run: one process checks a job of any number of ranks (a pipeline's settings are
    // checked against the model, its stages not built).
    bool dry_run;
} TrainerOptions;

// Where a run is in its data.
typedef struct {
    long epoch;
    int64_t epoch_pos;
    long consumed_samples;
} RunPosition;

typedef struct Trainer {
    const TrainSpec *spec;
    Executor exec;         // none / ddp / fsdp over the ranks that hold this model
    int rank, world;       // in the job
    int replica, replicas; // the data-parallel replicas (of the pipeline; the ranks without one)
    Pipeline pipe;         // this rank's stage: the whole model in a pipeline of one stage
    Comm *experts;         // --ep_size > 1: the replicas sharing the routed experts (owned)
    Objective obj;         // what training optimises: seq / sft / dpo / grpo
    MicroBatch *batches;   // (grad_accum_steps) the current optimizer step's micro-batches
    int64_t *batch_ids;    // (grad_accum_steps, batch_per_device) their samples
    Model model;
    Optimizer opt;
    Schedule sched;
    GradScaler scaler; // --loss_scale
    Sampler sampler;
    char reference_dir[4096]; // dpo, grpo: the frozen reference's model directory
    char resumed_from[4096];  // the checkpoint this run resumed from ("": a fresh run)
    CkptWriter writer;        // --async_checkpoint: the write in flight (full format: rank 0's)
    CkptPending pending;      // --ckpt_format sharded: the checkpoint rank 0 has yet to commit
    bool ckpt_failed;         // this rank's background write failed (ckpt_failure says why)
    Err ckpt_failure;
    long total_steps;
    // position in the run (what a checkpoint records)
    long epoch;
    int64_t epoch_pos;     // samples of this rank's epoch order already consumed
    long step;             // optimizer steps done
    long micro;            // micro-steps done since the last optimizer step
    long consumed_samples; // samples consumed by all ranks, cumulative
    RunPosition step_from; // the position the step in flight started at
    long last_ckpt_step;
    MetricLog metrics;         // rank 0 only
    ProgressDb progress;       // rank 0 only
    Samples samples;           // --sample_interval: what the model writes as it trains
    int control_fd;            // TrainerOptions' control pipe; -1: none (or it reached EOF)
    const char *memory_report; // TrainerOptions', NULL: resident memory not tracked
    long rss_baseline;         // resident bytes before the model existed
    long rss_state_max;        // most resident bytes above the baseline between steps
    long rss_ckpt_max;         // most resident bytes a checkpoint added while it was taken
} Trainer;

// Sets everything up from the spec: model (from param_path, or the checkpoint
// when resuming) on the options' backend, data, optimizer, schedule, progress database.
// A failure for want of a resource (memory, a device, I/O, the progress database) sets
// err->resource; the others are bad input (flags, files, data, a spec without a step).
int trainer_init(Trainer *t, const TrainSpec *spec, const TrainerOptions *opt, Err *err);
// Runs to the end of the last epoch (or --max_steps): 0; or until a stop request agreed by
// the ranks: 1 (stopped before its end, after the checkpoint --resume continues from); -1 on
// error. Checkpoints on the way (every ckpt_interval steps, on request, at the end).
int trainer_run(Trainer *t, Err *err);
void trainer_free(Trainer *t);

// total_steps = (ceil(ceil(N/nprocs)/batch_per_device) // grad_accum_steps) * n_epoch
long trainer_total_steps(int64_t n_samples, long nprocs, long batch, long accum, long n_epoch);
