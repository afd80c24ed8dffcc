// pipeline.h: pipeline parallelism (docs/design.md §13). The job's P x D ranks are D replicas of
// a pipeline of P stages; stage s of a replica holds a contiguous run of decoder blocks (the
// embedding on stage 0, the final norm, head and loss on stage P-1) and the M = grad_accum_steps
// micro-batches of an optimizer step stream through the stages in the order of the schedule
// (train/pp_schedule.h): activations forward, their gradients backward, point to point
// (comm_p2p). The stage's D replicas share its tensors through the executor (none/ddp/fsdp over
// their group, train/executor.h); the sums of a step (losses, requests, the global norm) span
// every rank.
//
// Rank layout: global rank g = replica * P + stage, so a replica's stages are consecutive ranks
// (on one node when a node holds a multiple of P ranks) and stage s's replicas are g = s, s + P,
// ...
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "comm/comm.h"
#include "common/error.h"
#include "engine/model.h"
#include "engine/optim.h"
#include "model/config.h"
#include "train/pp_schedule.h"

typedef struct {
    int stages, stage;     // P, s
    int replicas, replica; // D, d
    PpScheduleKind kind;
    int *blocks;                // (P+1) the first block of each stage; blocks[P] = the blocks
    int first_block, end_block; // this stage's decoder blocks
    Comm *world;                // every rank (not owned)
    Comm *group; // this stage's D replicas (owned; NULL when D is 1; one stage: world, not owned)
    int prev, next; // global ranks of this replica's neighbouring stages, -1: none
    int tied_peer;  // tied embeddings, on the first and the last stage: the other one, -1: none
    Comm *tied;     // tied embeddings with P > 1: the replica's first and last stage (owned)
    const Backend *be;
    PpOp *ops;   // the schedule being run
    bool *waits; // its computations that wait for the transfers before them (pp_schedule_waits)
    int cap_ops;
    void **act_in;     // (n_sets) the received input activations of each activation set
    size_t *act_bytes; // (n_sets) their capacities
    int n_sets;
    void *grad_in; // the received gradient of the stage's output
    size_t grad_bytes;
    // Seconds of training runs spent computing (forwards, backwards) and in transfers, waits
    // for the neighbours included: the measured bubble is the transfer share (bench/).
    double compute_s, transfer_s;
} Pipeline;

// The first block of each of `stages` stages (blocks[stages] = the number of blocks), balanced
// by compute per token of a window of `window` tokens: each stage's blocks, plus the head on the
// last (the embedding, a lookup, costs nothing), with the largest stage as small as it can be.
// 1 <= stages <= num_hidden_layers.
int pipeline_partition(const ModelConfig *cfg, int stages, long window, int *blocks, Err *err);

// Whether cfg's model can be cut into `stages` stages (one block at least each).
int pipeline_check(const ModelConfig *cfg, int stages, Err *err);

// This rank's place (world: every rank, NULL for one; stages divides its size) and the group of
// its stage's replicas (collective over world; with one stage, world itself). kind: the schedule
// of training windows.
int pipeline_init(Pipeline *p, Comm *world, int stages, PpScheduleKind kind, const ModelConfig *cfg,
                  long window, const Backend *be, Err *err);
void pipeline_free(Pipeline *p);

// What a run of micro-batches computes, per micro-batch k of the run.
typedef struct {
    // Token rows (B*T) of micro-batch k: the activations that travel are (rows, C).
    long (*rows)(void *ctx, int k);
    // Its forward on the stage's model (the model's batch filled; the loss on the last stage).
    int (*forward)(void *ctx, int k, Err *err);
    // Its backward (training runs only).
    int (*backward)(void *ctx, int k, Err *err);
    void *ctx;
} PipelineWork;

// Runs n micro-batches through the pipeline on m (the stage's model): the training schedule
// (train: forward and backward of each), or forwards only. Every rank of the replica runs it
// with the same n (0: nothing runs). A peer that fails or dies: an error naming it (the comm's
// timeout).
int pipeline_run(Pipeline *p, Model *m, const PipelineWork *w, int n, bool train, Err *err);

// Tied embeddings: the first and the last stage of each replica add their gradients of the
// embedding (the first stage's and the last stage's copy) into both, in one order, so that both
// hold the same sum and step the same tensor. No-op elsewhere.
int pipeline_sum_tied(Pipeline *p, Model *m, Err *err);
// The index in m of the tensor the global norm leaves out: the last stage's copy of a tied
// embedding (counted on the first stage); -1: none.
int pipeline_norm_skip(const Pipeline *p, const Model *m);

// The whole model as parts a checkpoint writes (model_save_views, optim_save_parts): the stages
// in order, each a view of its master weights with its optimizer state.
typedef struct {
    int n;
    ParamView *views;
    const Optimizer **opts;
    Optimizer *owned;   // (n) the received stages' optimizer state ([0] unused)
    ParamSpec **tables; // (n) their parameter tables ([0] unused)
    const Backend *be;
} PipelineParts;

// A checkpoint's whole model, collective over world (after each stage gathered its full state
// over its group, executor_gather_full): each stage's first replica sends its master weights and
// `opt`, the stage's whole optimizer state, to global rank 0, whose *parts then hold every stage
// (its own first); the other ranks' parts are empty.
int pipeline_collect(Pipeline *p, Model *m, const Optimizer *opt, PipelineParts *parts, Err *err);
void pipeline_parts_free(PipelineParts *parts);
