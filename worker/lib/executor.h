// executor.h: how the ranks of a job share the work (DESIGN §9).
//
// none: one rank, the model as is.
// ddp:  every rank holds the whole model and its gradients; on sync micro-steps the
//       gradients are averaged with a reduce_scatter into the ranks' shards (the
//       tensor ownership of fsdp below), each rank steps the optimizer on the tensors
//       it owns (so the optimizer work and state are split, ZeRO-1 style, instead of
//       done N times), and the updated weights are all-gathered.
// fsdp: parameters, gradients and optimizer state are sharded by whole tensors:
//       each tensor has one owner rank (greedy by size, so each rank owns ~1/N of
//       the floats), and a rank's tensors sit contiguously in its region of S floats
//       (S = the largest region; the others are padded). Whole tensors keep Muon
//       exact: the owner orthogonalises the full matrix. The full weights are
//       all-gathered before a micro-step and freed after its backward; the full
//       gradients live through one accumulation window and are reduce-scattered
//       (averaged) into the owners' regions on the sync micro-step, then freed.
//       The optimizer steps the shard view: a Model whose tensors are the owned ones.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "comm/comm.h"
#include "common/error.h"
#include "engine/model.h"
#include "engine/optim.h"

typedef enum { EXEC_NONE, EXEC_DDP, EXEC_FSDP } ExecMode;

typedef struct {
    ExecMode mode;
    Comm *comm; // NULL for none
    int rank, world;
    // fsdp
    int *owner;         // (n_params,) owner rank of each tensor
    size_t *region_off; // (n_params,) offset of each tensor in its owner's region
    size_t region;      // S, floats per rank region
    Model shard;        // view: owned tensors; weights/grads are (S,) region buffers
    float *regions;     // ddp: (world*S,) exchange buffer kept for the run; fsdp: NULL
} Executor;

int executor_init(Executor *x, ExecMode mode, Comm *comm, Model *m, Err *err);
void executor_free(Executor *x);

// The model the optimizer steps: m itself (none), or this rank's shard view.
Model *executor_opt_model(Executor *x, Model *m);

// Before a micro-step's forward: fsdp gathers the full weights (and allocates the
// gradient buffer at the start of an accumulation window).
int executor_begin_micro(Executor *x, Model *m, Err *err);
// After a micro-step's backward: fsdp frees the full weights; on a sync micro-step
// the gradients are averaged over ranks (ddp all_reduce, fsdp reduce_scatter into
// the owners' regions, then the full gradients are freed).
int executor_end_micro(Executor *x, Model *m, bool sync, Err *err);

// Global gradient norm (sharded: all-reduce of the local sums of squares) and
// clipping of the optimizer model's gradients.
int executor_clip(Executor *x, Model *m, float max_norm, float *norm, Err *err);

// After the optimizer step: ddp all-gathers the updated weights into every rank's model.
int executor_after_step(Executor *x, Model *m, Err *err);

// Sums vals[0..n) over ranks in place (loss, stop flags, ...); none: no-op.
int executor_sum(Executor *x, float *vals, int n, Err *err);

// Full weights on every rank (fsdp: gathered into m->weights; the caller releases
// them with executor_drop_full); none/ddp: already there.
int executor_gather_weights(Executor *x, Model *m, Err *err);
void executor_drop_full(Executor *x, Model *m);

// After the full model weights were loaded into m: fsdp copies the owned tensors
// into the shard and frees the full buffers.
int executor_adopt_weights(Executor *x, Model *m, Err *err);

// ddp/fsdp only: the optimizer state as for the full model (every rank calls it and
// takes part in the gather): fills a full Optimizer `full` created by the caller for m.
int executor_gather_optim(Executor *x, Model *m, const Optimizer *opt, Optimizer *full, Err *err);
// The inverse: takes this rank's part of a full optimizer state.
void executor_scatter_optim(Executor *x, Model *m, const Optimizer *full, Optimizer *opt);
