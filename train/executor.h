// executor.h: how the ranks of a job share the work (docs/design.md §9). The executor is the one
// owner of what differs between the parallel modes: which weights and gradients a rank holds, how
// gradients are zeroed and reduced, the global gradient norm, what evaluation and checkpoints
// gather, and the buffers all of that needs. The trainer calls the executor_* functions below
// at fixed points of its loop (llm.c's order: forward, backward, norm, clip, step, zero) and
// never asks which mode runs; each mode is a table of operations (ExecutorOps, executor.c), so
// another way of sharing a model's tensors is another table, not a branch in the trainer. A
// pipeline (train/pipeline.h) splits the model itself: each stage is a model of its own, shared
// by the stage's replicas through an executor over their group, while the sums below span every
// rank of the job.
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
//
// Sums over ranks follow one rule: one rank keeps its exact double; several add fp32 partial
// sums (one small collective).
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "comm/comm.h"
#include "common/error.h"
#include "engine/model.h"
#include "engine/optim.h"

typedef enum { EXEC_NONE, EXEC_DDP, EXEC_FSDP } ExecMode;

// The kinds of micro-step (one forward, and for training its backward).
typedef enum {
    MICRO_ACCUMULATE, // training: gradients added to the accumulation window's
    MICRO_SYNC,       // training, the last of the window: gradients reduced over ranks
    MICRO_EVAL,       // forward only (validation): no gradient buffer, no backward
} MicroStep;

// Gradient buckets (ddp, fsdp): consecutive parameters whose gradients are reduced together,
// started as soon as backward has finished them (engine/model.h grads_ready), so that the
// reduction overlaps the rest of backward on GPUs. Ownership is planned per bucket, and each
// rank's region holds its tensors of bucket b in [base, base + size).
typedef struct {
    int first, end; // parameter indices
    size_t base, size;
} Bucket;

typedef struct ExecutorOps ExecutorOps;

// Buffers are the model's backend's; the collectives run on them (device memory with
// nccl). Gradients, masters and optimizer state travel in fp32; weights for forward in
// the compute dtype (bf16 on the GPU: half the bytes of an fp32 gather). Only executor.c
// reads the fields past rank and world.
typedef struct {
    const ExecutorOps *ops; // the mode's
    Comm *comm;             // the ranks that share this model's tensors; NULL for one rank
    Comm *world_comm;       // every rank of the job, which the sums span; NULL for one rank
    int rank, world;        // in comm
    int norm_skip;          // a tensor of m the global norm leaves out (a pipeline's copy of a tied
                            // embedding, counted where the embedding is); -1: none
    const Backend *be;
    double *sq_norm;    // (1,) backend: this rank's squared norm of the gradients it steps
    float *agree;       // (EXEC_AGREE_MAX,) device staging of executor_sum when comm needs it
    Optimizer full_opt; // ddp, fsdp: the whole model's optimizer state while a checkpoint needs it
    // ddp, fsdp
    int *owner;         // (n_params,) owner rank of each tensor
    size_t *region_off; // (n_params,) offset of each tensor in its owner's region
    size_t region;      // S, elements per rank region
    ParamSpec *owned;   // the owned tensors, offsets into the region
    ParamView shard;    // owned tensors: master and grads are (S,) region buffers
    void *regions;      // ddp: (world*S,) fp32 exchange buffer kept for the run; fsdp: NULL
    void *stage;        // (S,) this rank's weights in the compute dtype; NULL when fp32
    // DPO/GRPO: the frozen reference weights in the compute dtype, sharded like the policy's:
    // none/ddp the full (num_floats,) model layout, fsdp this rank's region (S,); NULL: none.
    void *reference;
    void *policy_weights; // none/ddp: m->weights while the reference stands in for it
    int transient;        // MODEL_* buffers executor_gather_full acquired for a checkpoint
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

#define EXEC_AGREE_MAX 16

// What a mode provides (executor.c holds one table per ExecMode). Each entry does for that
// mode what the executor_* function of the same name does (init: the mode's part of
// executor_init: its plan and buffers).
struct ExecutorOps {
    // Every rank must run every forward, the same number of them: forward has collectives.
    bool forward_collective;
    int (*init)(Executor *x, Model *m, size_t bucket_bytes, Err *err);
    ParamView (*view)(const Executor *x, const Model *m);
    int (*begin_micro)(Executor *x, Model *m, MicroStep kind, Err *err);
    int (*end_micro)(Executor *x, Model *m, MicroStep kind, Err *err);
    int (*sync_grads)(Executor *x, Model *m, Err *err);
    int (*after_step)(Executor *x, Model *m, Err *err);
    int (*gather_full)(Executor *x, Model *m, const Optimizer *opt, const Optimizer **full,
                       Err *err);
    void (*drop_full)(Executor *x, Model *m);
    int (*load_optim)(Executor *x, Model *m, Optimizer *opt, const StFile *f, const char *path,
                      Err *err);
    int (*keep_reference)(Executor *x, Model *m, Err *err);
    int (*begin_reference)(Executor *x, Model *m, Err *err);
    int (*end_reference)(Executor *x, Model *m, Err *err);
    int (*begin_generate)(Executor *x, Model *m, Err *err);
    void (*end_generate)(Executor *x, Model *m);
    int (*adopt_weights)(Executor *x, Model *m, Err *err);
};

// group: the ranks that hold this model (a pipeline stage's replicas; every rank without a
// pipeline); world: every rank of the job, over which the sums, the agreement and the global norm
// run (== group without a pipeline). bucket_bytes: gradient bytes per bucket (0: 25 MiB with
// nccl, one bucket with shm). A group of one rank (NULL or of one rank) runs none whatever the
// mode.
int executor_init(Executor *x, ExecMode mode, Comm *group, Comm *world, Model *m,
                  size_t bucket_bytes, Err *err);
// The owner rank of each tensor of a table (params[0..n), grads_ready ranges[0..n_ranges) as
// model_grad_ranges / param_table_grad_ranges give them) under ddp/fsdp over `world` ranks, as
// executor_init plans it: bucket_bytes as there (0: the default of GPU ranks when gpu, else of CPU
// ranks). For --dry-run's account of a job it does not run. owner: (n).
int executor_plan_owners(const ParamSpec *params, int n, const int (*ranges)[2], int n_ranges,
                         int world, bool gpu, size_t bucket_bytes, int *owner, Err *err);
// Frees every buffer the executor allocated.
void executor_free(Executor *x);

// What the optimizer steps: the whole model (none), or this rank's shard.
ParamView executor_view(const Executor *x, const Model *m);

// Before a micro-step's forward: fsdp allocates the full weights (and, for training, the
// gradient buffer at the start of an accumulation window) and gathers the weights bucket by
// bucket as forward reaches them, the next bucket's gather running while one computes. On a
// sync micro-step backward starts averaging each gradient bucket over ranks (reduce-scatter
// into the owners' regions) as soon as it is final.
int executor_begin_micro(Executor *x, Model *m, MicroStep kind, Err *err);
// After a micro-step's backward (or an evaluation's forward): the micro-step's collectives are
// waited for (on a sync micro-step after starting the buckets backward did not); fsdp frees
// the full weights (and on a sync micro-step the full gradients).
int executor_end_micro(Executor *x, Model *m, MicroStep kind, Err *err);
// Whether every rank must run every forward (evaluation included), even one without a sample.
bool executor_forward_collective(const Executor *x);

// A pipeline stage's accumulation window spans many forwards and backwards in the schedule's
// order (train/pipeline.h): it is one MICRO_ACCUMULATE micro-step from before its first forward
// to after its last backward, then this: the window's gradients averaged over the group into
// the owners' shards, as a sync micro-step does (ddp, fsdp; fsdp frees the full gradients).
int executor_sync_grads(Executor *x, Model *m, Err *err);

// The agreement of an optimizer step, one collective: sums vals[0..n) over ranks in place as
// executor_sum does (n <= EXEC_AGREE_MAX; vals[norm_at] is the executor's slot), and gives the
// global L2 norm of the gradients the optimizer steps (executor_view of m) in *norm: each
// rank's squared norm of its view's gradients, summed by the rule above.
int executor_agree_step(Executor *x, const Model *m, float *vals, int n, int norm_at, double *norm,
                        Err *err);

// After the optimizer stepped the view's master weights: the compute weights follow (none:
// refreshed from the master; ddp: the owners' shards all-gathered into every rank's model;
// fsdp: at the next executor_begin_micro), and the gradients start the next accumulation window
// at zero (fsdp: freed at the sync micro-step already; the next one allocates them zeroed).
int executor_after_step(Executor *x, Model *m, Err *err);

// Sums vals[0..n) (n <= EXEC_AGREE_MAX, host memory) over ranks in place (losses, stop
// flags, counts); one rank: no-op. A separate small collective after the gradients'.
int executor_sum(Executor *x, float *vals, int n, Err *err);
// The ranks of the job, over which the sums run.
int executor_job_ranks(const Executor *x);
// The mean over ranks of values of which this rank holds `count` summing to `sum` (every rank
// calls it), by the rule above.
int executor_mean(Executor *x, double sum, double count, double *mean, Err *err);

// For a checkpoint (every rank calls it and takes part): the full fp32 master weights in
// m->master and the whole model's optimizer state in *full (opt itself under none; a state
// the executor holds under ddp/fsdp). executor_drop_full frees what was gathered.
int executor_gather_full(Executor *x, Model *m, const Optimizer *opt, const Optimizer **full,
                         Err *err);
void executor_drop_full(Executor *x, Model *m);
// Resuming: loads the whole model's optimizer state (optim_save of model_view), open as f (a
// file or a sharded set; path names it in errors), into opt, which holds this rank's part of it.
int executor_load_optim(Executor *x, Model *m, Optimizer *opt, const StFile *f, const char *path,
                        Err *err);

// DPO/GRPO: keeps m's current compute weights (full, before executor_adopt_weights) as the
// frozen reference, sharded like the policy under fsdp.
int executor_keep_reference(Executor *x, Model *m, Err *err);
// A forward-only pass with the reference weights: between begin and end, m's forward reads
// the reference (none/ddp: m->weights points at it; fsdp: gathered bucket by bucket like the
// policy's). No backward may run in between.
int executor_begin_reference(Executor *x, Model *m, Err *err);
int executor_end_reference(Executor *x, Model *m, Err *err);

// Generation with the policy's current weights (samples, rollouts): between begin and end m holds
// the whole model's compute weights (fsdp: gathered at once, every rank of the group taking part,
// and freed at the end; none/ddp hold them already), so any number of forwards may run on any
// rank without collectives. No training micro-step may run in between.
int executor_begin_generate(Executor *x, Model *m, Err *err);
void executor_end_generate(Executor *x, Model *m);

// After the full model weights were loaded into m: ddp/fsdp copy the owned tensors
// into the shard and free the full buffers the mode does not keep.
int executor_adopt_weights(Executor *x, Model *m, Err *err);
