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
//       The optimizer steps the shard view: the owned tensors over the region buffers.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "comm/comm.h"
#include "common/error.h"
#include "engine/model.h"
#include "engine/optim.h"

typedef enum { EXEC_NONE, EXEC_DDP, EXEC_FSDP } ExecMode;

// Gradient buckets (ddp, fsdp): consecutive parameters whose gradients are reduced together,
// started as soon as backward has finished them (engine/model.h grads_ready), so that the
// reduction overlaps the rest of backward on GPUs. Ownership is planned per bucket, and each
// rank's region holds its tensors of bucket b in [base, base + size).
typedef struct {
    int first, end; // parameter indices
    size_t base, size;
} Bucket;

// Buffers are the model's backend's; the collectives run on them (device memory with
// nccl). Gradients, masters and optimizer state travel in fp32; weights for forward in
// the compute dtype (bf16 on the GPU: half the bytes of an fp32 gather).
typedef struct {
    ExecMode mode;
    Comm *comm; // NULL for none
    int rank, world;
    const Backend *be;
    // ddp, fsdp
    int *owner;         // (n_params,) owner rank of each tensor
    size_t *region_off; // (n_params,) offset of each tensor in its owner's region
    size_t region;      // S, elements per rank region
    ParamSpec *owned;   // the owned tensors, offsets into the region
    ParamView shard;    // owned tensors: master and grads are (S,) region buffers
    void *regions;      // ddp: (world*S,) fp32 exchange buffer kept for the run; fsdp: NULL
    void *stage;        // (S,) this rank's weights in the compute dtype; NULL when fp32
    float *agree;       // (EXEC_AGREE_MAX,) device staging of executor_sum when comm needs it
    // DPO/GRPO: the frozen reference weights in the compute dtype, sharded like the policy's:
    // none/ddp the full (num_floats,) model layout, fsdp this rank's region (S,); NULL: none.
    void *reference;
    void *policy_weights; // none/ddp: m->weights while the reference stands in for it
    int transient;        // MODEL_* buffers executor_gather_weights acquired for a checkpoint
    Bucket *buckets;      // n_buckets, in the order backward completes them
    int n_buckets;
    // the micro-step in flight
    void *pending;          // the exchange buffer of its collectives
    Model *model;           // whose weights and gradients they move
    const void *gather_src; // fsdp: the region whose weights forward gathers (policy or reference)
    int needed;             // fsdp: the bucket forward needs next (counting down), -1: all ready
    int launched;           // gradient buckets started
    int async_failed;       // a collective failed to start in a hook: async_err says why
    Err async_err;
} Executor;

#define EXEC_AGREE_MAX 8

// bucket_bytes: gradient bytes per bucket (0: 25 MiB with nccl, one bucket with shm).
int executor_init(Executor *x, ExecMode mode, Comm *comm, Model *m, size_t bucket_bytes, Err *err);
void executor_free(Executor *x);

// What the optimizer steps: the whole model (none), or this rank's shard.
ParamView executor_view(const Executor *x, const Model *m);

// Before a micro-step's forward: fsdp allocates the full weights (and the gradient buffer
// at the start of an accumulation window) and gathers the weights bucket by bucket as
// forward reaches them, the next bucket's gather running while one computes. On a sync
// micro-step (the last of an accumulation window) backward starts averaging each gradient
// bucket over ranks (reduce-scatter into the owners' regions) as soon as it is final.
int executor_begin_micro(Executor *x, Model *m, bool sync, Err *err);
// After a micro-step's backward: the micro-step's collectives are waited for (on a sync
// micro-step after starting the buckets backward did not); fsdp frees the full weights
// (and on a sync micro-step the full gradients).
int executor_end_micro(Executor *x, Model *m, bool sync, Err *err);

// After the optimizer stepped the view's master weights: the compute weights follow
// (none: refreshed from the master; ddp: the owners' shards all-gathered into every
// rank's model; fsdp: at the next executor_begin_micro).
int executor_after_step(Executor *x, Model *m, Err *err);

// Sums vals[0..n) (n <= EXEC_AGREE_MAX, host memory) over ranks in place (losses, stop
// flags, squared norms); none: no-op. A separate small collective after the gradients'.
int executor_sum(Executor *x, float *vals, int n, Err *err);

// The full fp32 master weights on every rank (for a checkpoint), gathered into
// m->master where the model does not hold them; executor_drop_full frees what was
// gathered.
int executor_gather_weights(Executor *x, Model *m, Err *err);
void executor_drop_full(Executor *x, Model *m);

// DPO/GRPO: keeps m's current compute weights (full, before executor_adopt_weights) as the
// frozen reference, sharded like the policy under fsdp.
int executor_keep_reference(Executor *x, Model *m, Err *err);
// A forward-only pass with the reference weights: between begin and end, m's forward reads
// the reference (none/ddp: m->weights points at it; fsdp: gathered bucket by bucket like the
// policy's). No backward may run in between.
int executor_begin_reference(Executor *x, Model *m, Err *err);
int executor_end_reference(Executor *x, Model *m, Err *err);

// After the full model weights were loaded into m: ddp/fsdp copy the owned tensors
// into the shard and free the full buffers the mode does not keep.
int executor_adopt_weights(Executor *x, Model *m, Err *err);

// ddp/fsdp only: the optimizer state as for the full model (every rank calls it and
// takes part in the gather): fills a full Optimizer `full` created by the caller for m.
int executor_gather_optim(Executor *x, Model *m, const Optimizer *opt, Optimizer *full, Err *err);
// The inverse: takes this rank's part of a full optimizer state.
void executor_scatter_optim(Executor *x, Model *m, const Optimizer *full, Optimizer *opt);
