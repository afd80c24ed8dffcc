// step.h: the passes of micro-batches through this rank's model (docs/design.md §8, §13): a
// training step's forwards and backwards, validation's forwards, and before either (an objective
// with a reference) the frozen reference's forwards. Every pass walks a pipeline schedule
// (train/pp_schedule.h); a run without a pipeline is a pipeline of one stage, whose schedule is
// F0 B0 F1 B1 ...: one step function for both. What each micro-batch computes is the objective's
// (train/objective.h); the executor's micro-steps (train/executor.h) bracket them.
#pragma once
#include "train/executor.h"
#include "train/objective.h"
#include "train/pipeline.h"

typedef struct {
    Pipeline *pipe; // this rank's stage (the whole model in a pipeline of one stage)
    Executor *exec; // over the stage's replicas
    Model *model;   // the stage's
    Objective *obj;
} StepRunner;

// A training step's accumulation window: the gradients of the n micro-batches (each weighted by
// weight: 1/grad_accum_steps times the loss scale) added into the model's, reduced over the
// stage's replicas (a tied embedding's summed between its two stages first). Every rank of the
// job calls it with the same n.
int step_train(const StepRunner *r, const MicroBatch *list, int n, float weight, Err *err);
// Validation's forwards of the n micro-batches, without NEFTune noise: each micro-batch's mean
// loss times its samples added into *sum (on the last stage; the others add nothing).
int step_eval(const StepRunner *r, const MicroBatch *list, int n, double *sum, Err *err);
