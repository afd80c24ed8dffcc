// objective.h: what training optimises (docs/design.md §8, §17): the next token of every window
// (language modelling: seq, sft), or a preference loss against a frozen reference model (dpo,
// grpo, and online_dpo / online_grpo on the policy's own rollouts, train/rollout.h). Each objective
// is a table of operations (ObjectiveOps), as each parallel mode is the executor's
// (train/executor.h): the samples it reads, what a micro-batch stages, what its forward and the
// last stage compute, its backward and the numbers a step reports. The passes that run
// micro-batches (train/step.h) and the trainer never ask which objective runs: a new objective is a
// new table.
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "common/error.h"
#include "engine/model.h"
#include "model/config.h"
#include "proto/train_spec.h"
#include "train/executor.h"

// The passes of micro-batches: a training step's forwards and backwards, validation's forwards,
// and (an objective with a reference) the frozen reference's forwards that come first.
typedef enum { PASS_TRAIN, PASS_EVAL, PASS_REFERENCE } PassKind;

// A micro-batch: the nb samples ids[0], ids[stride], ...; nb 0: a forward of one sample that
// counts nothing (validation, where every rank must run every forward).
typedef struct {
    const int64_t *ids;
    int64_t stride;
    int nb;
    uint64_t noise_seed; // training: its NEFTune noise stream
    int counted;         // training: what the objective counted of it when it was staged
    int index;           // training: its place among the step's micro-batches
    long step;           // training: the optimizer step it joins (1-based)
} MicroBatch;

// The samples a micro-batch's forward runs on.
static inline int micro_samples(const MicroBatch *mb) {
    return mb->nb ? mb->nb : 1;
}

#define OBJECTIVE_MAX_METRICS 8

// What an objective is given to open its samples.
typedef struct {
    const TrainSpec *spec;  // data_root_path, train_type and the objective's knobs
    const ModelConfig *cfg; // the model's vocabulary and context
    int64_t window, stride; // tokens per sample window and between windows' starts
    int batch;              // the most samples of a micro-batch
    int rank;               // in the job (warnings come from rank 0)
    const Backend *be;      // the model's
    int slots;              // micro-batches per optimizer step (grad_accum_steps)
    // The policy, which an objective that generates (the online ones) generates from; neither
    // is built yet at open, both are by the first micro-batch.
    Executor *exec;
    Model *model;
} ObjectiveSetup;

typedef struct Objective Objective;

typedef struct {
    // A frozen reference model's forward runs before the policy's, in a pass of its own
    // (PASS_REFERENCE): the trainer keeps the reference weights when it loads the model.
    bool reference;
    // Reads the samples (o->n_samples of them), reserves a micro-batch's buffers, names the
    // metrics.
    int (*open)(Objective *o, const ObjectiveSetup *s, Err *err);
    void (*close)(Objective *o);
    // Fills the model's batch with mb's samples; returns its token rows (B*T: the activations a
    // pipeline stage sends are (rows, hidden)).
    long (*fill)(Objective *o, const MicroBatch *mb);
    // A training micro-batch joins its step (filled here where its count needs its samples): sets
    // mb->counted and *tokens, its tokens (for tokens/s). last_stage: this rank computes the loss
    // (what the step's metrics count). Every rank stages the step's micro-batches in the same
    // order (an online objective's rollouts are collective there). A failure with
    // o->stop_checkpoint set left the run as it was before the step.
    int (*stage)(Objective *o, MicroBatch *mb, bool last_stage, long *tokens, Err *err);
    // Before a pass's forwards, on every rank of the job: what they need from all ranks. NULL:
    // nothing.
    int (*begin_pass)(Objective *o, Executor *x, const MicroBatch *list, int n, PassKind pass,
                      Err *err);
    // Micro-batch k of the pass (filled): the forward on the model (a stage's part of it), and on
    // the last stage the loss into the model's stats. weight: training's loss weight.
    int (*forward)(Objective *o, Model *m, int k, PassKind pass, float weight, Err *err);
    // The backward of training micro-batch k's loss, weighted.
    void (*backward)(Objective *o, Model *m, int k, float weight);
    // This rank's sums of the step's metrics (one per name) from the model's stats and what the
    // step's micro-batches staged; starts the next step's. NULL: no metrics.
    void (*step_metrics)(Objective *o, const double stats[MODEL_N_STATS], float *sums);
} ObjectiveOps;

struct Objective {
    const ObjectiveOps *ops;
    int64_t n_samples; // windows (or records) of the data, as open found them
    // The names of the numbers a step reports besides its loss (step_metrics), NULL-terminated;
    // NULL: none. Set by open.
    const char *const *metrics;
    // A failed stage left nothing of its step applied (a reward that did not come, on every
    // rank alike): the trainer checkpoints the state before the step, then fails.
    bool stop_checkpoint;
    void *state; // the objective's own
};

// The table of a train type.
const ObjectiveOps *objective_of(TrainType train_type);
// Opens the objective ops on s's samples.
int objective_open(Objective *o, const ObjectiveOps *ops, const ObjectiveSetup *s, Err *err);
void objective_close(Objective *o);
// How many metrics the objective's steps report.
int objective_n_metrics(const Objective *o);

// The tables (objective_lm.c: seq, sft; objective_pref.c: dpo, grpo, online_dpo, online_grpo),
// whose open reads the spec's train type.
extern const ObjectiveOps OBJECTIVE_LM, OBJECTIVE_PREF;
