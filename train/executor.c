// executor.c: the none/ddp/fsdp executors (train/executor.h): the shard plan, the
// exchange between the model layout and the rank regions, the collectives of a step, one
// table of operations per mode, and the mode-independent half (the dispatch, the sums over
// ranks, the global gradient norm).
#include "train/executor.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------- shard plan (ddp, fsdp)

// Gradients reduced together by default: PyTorch DDP's 25 MiB buckets on GPUs, where the
// reduction overlaps the rest of backward; one bucket on CPU ranks, where the collectives
// run on the same cores as the compute and fewer, larger calls are faster.
#define GPU_BUCKET_BYTES ((size_t)25 << 20)

static size_t bucket_cap(size_t bucket_bytes, bool gpu) {
    return bucket_bytes ? bucket_bytes : gpu ? GPU_BUCKET_BYTES : SIZE_MAX;
}

// Buckets: runs of consecutive grads_ready ranges (engine/model.h; ranges[0..n)) of at least
// `cap` bytes of gradients; in the order backward completes them.
static int plan_buckets(Executor *x, const ParamSpec *params, const int (*ranges)[2], int n,
                        size_t cap, Err *err) {
    if (!(x->buckets = calloc((size_t)n + 1, sizeof *x->buckets)))
        return err_resource(err, "shard plan: out of memory");
    size_t bytes = 0;
    for (int k = 0; k < n; k++) {
        if (x->n_buckets == 0 || bytes >= cap) {
            x->buckets[x->n_buckets++] = (Bucket){.first = ranges[k][0], .end = ranges[k][1]};
            bytes = 0;
        }
        x->buckets[x->n_buckets - 1].first = ranges[k][0]; // ranges descend contiguously
        for (int i = ranges[k][0]; i < ranges[k][1]; i++)
            bytes += params[i].numel * sizeof(float);
    }
    return 0;
}

// Within bucket b, greedy: largest tensors first (ties keep AstrAI order), each to the rank
// with the fewest floats of the bucket so far; then each rank's tensors in AstrAI order.
// The bucket's part of every region is as long as the largest rank's share.
static int assign_bucket(Executor *x, const ParamSpec *params, Bucket *b, size_t *load) {
    int n = b->end - b->first;
    int *order = malloc((size_t)n * sizeof *order);
    if (!order) return -1;
    for (int i = 0; i < n; i++)
        order[i] = b->first + i;
    for (int i = 1; i < n; i++) // insertion sort by numel desc, stable
        for (int j = i; j > 0 && params[order[j]].numel > params[order[j - 1]].numel; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    memset(load, 0, (size_t)x->world * sizeof *load);
    for (int k = 0; k < n; k++) {
        int best = 0;
        for (int r = 1; r < x->world; r++)
            if (load[r] < load[best]) best = r;
        x->owner[order[k]] = best;
        load[best] += params[order[k]].numel;
    }
    free(order);
    memset(load, 0, (size_t)x->world * sizeof *load);
    for (int i = b->first; i < b->end; i++) {
        x->region_off[i] = b->base + load[x->owner[i]];
        load[x->owner[i]] += params[i].numel;
    }
    for (int r = 0; r < x->world; r++)
        if (load[r] > b->size) b->size = load[r];
    return 0;
}

// The shard view: the owned tensors, in AstrAI order, at their region offsets; the
// optimizer state spans the region, padding included.
static int build_shard(Executor *x, const Model *m, Err *err) {
    ParamView *s = &x->shard;
    x->owned = calloc(m->n_params > 0 ? (size_t)m->n_params : 1, sizeof *x->owned);
    if (!x->owned) return err_resource(err, "shard plan: out of memory");
    *s = (ParamView){.be = x->be, .params = x->owned, .num_floats = x->region};
    for (int i = 0; i < m->n_params; i++) {
        if (x->owner[i] != x->rank) continue;
        x->owned[s->n_params] = m->params[i];
        x->owned[s->n_params].offset = x->region_off[i];
        s->n_params++;
    }
    size_t bytes = (x->region ? x->region : 1) * sizeof(float);
    if (!(s->master = x->be->alloc(bytes, err)) || !(s->grads = x->be->alloc(bytes, err)))
        return err_prefix(err, "shard of %zu parameters", x->region);
    if (x->be->dtype != DT_F32 &&
        !(x->stage = x->be->alloc((x->region ? x->region : 1) * dtype_size(x->be->dtype), err)))
        return err_prefix(err, "shard weights in %s", dtype_name(x->be->dtype));
    return 0;
}

// The owners and region offsets of the table's tensors (params[0..n)), bucket by bucket.
static int plan_owners(Executor *x, const ParamSpec *params, int n, const int (*ranges)[2],
                       int n_ranges, size_t cap, Err *err) {
    x->owner = calloc((size_t)n + 1, sizeof *x->owner);
    x->region_off = calloc((size_t)n + 1, sizeof *x->region_off);
    size_t *load = calloc((size_t)x->world, sizeof *load);
    int rc = !x->owner || !x->region_off || !load
                 ? err_resource(err, "shard plan: out of memory")
                 : plan_buckets(x, params, ranges, n_ranges, cap, err);
    for (int k = 0; !rc && k < x->n_buckets; k++) {
        x->buckets[k].base = x->region;
        if (assign_bucket(x, params, &x->buckets[k], load))
            rc = err_resource(err, "shard plan: out of memory");
        x->region += x->buckets[k].size;
    }
    free(load);
    return rc;
}

static int plan_shards(Executor *x, const Model *m, size_t cap, Err *err) {
    int(*ranges)[2] = malloc(((size_t)m->cfg.num_hidden_layers + 2) * sizeof *ranges);
    if (!ranges) return err_resource(err, "shard plan: out of memory");
    int rc = plan_owners(x, m->params, m->n_params, (const int(*)[2])ranges,
                         model_grad_ranges(m, ranges), cap, err);
    free(ranges);
    return rc ? rc : build_shard(x, m, err);
}

int executor_plan_owners(const ParamSpec *params, int n, const int (*ranges)[2], int n_ranges,
                         int world, bool gpu, size_t bucket_bytes, int *owner, Err *err) {
    Executor x = {.world = world};
    int rc = plan_owners(&x, params, n, ranges, n_ranges, bucket_cap(bucket_bytes, gpu), err);
    if (!rc) memcpy(owner, x.owner, (size_t)n * sizeof *owner);
    free(x.owner);
    free(x.region_off);
    free(x.buckets);
    return rc;
}

static size_t regions_bytes(const Executor *x) {
    return ((size_t)x->world * x->region + 1) * sizeof(float);
}

// ---------------------------------------------------------------- staging <-> model layout

// The exchange buffer (world*S elements) holds bucket by bucket what the collectives of a
// bucket send or receive: bucket b's staging at world*base, rank r's part of it at r*size.
// Where tensor i lies in its bucket's staging:
static size_t staged_at(const Executor *x, const Bucket *b, int i) {
    return (size_t)x->owner[i] * b->size + (x->region_off[i] - b->base);
}

// full (model layout) -> the bucket's staging: every tensor into its owner's part.
static void to_staging(const Executor *x, const Model *m, const Bucket *b, const void *full,
                       void *staging, size_t esize) {
    for (int i = b->first; i < b->end; i++)
        x->be->copy((char *)staging + staged_at(x, b, i) * esize,
                    (const char *)full + m->params[i].offset * esize, m->params[i].numel * esize);
}

// The bucket's staging -> full (model layout).
static void from_staging(const Executor *x, const Model *m, const Bucket *b, const void *staging,
                         void *full, size_t esize) {
    for (int i = b->first; i < b->end; i++)
        x->be->copy((char *)full + m->params[i].offset * esize,
                    (const char *)staging + staged_at(x, b, i) * esize, m->params[i].numel * esize);
}

// The exchange buffer: ddp's persistent one, or a fresh zeroed one (fsdp).
static void *regions_acquire(Executor *x, Err *err) {
    if (x->regions) return x->regions;
    void *r = x->be->alloc(regions_bytes(x), err);
    if (!r) err_prefix(err, "the exchange buffer");
    return r;
}

static void regions_release(Executor *x, void *r) {
    if (r != x->regions) x->be->free(r);
}

// All ranks: shard (S elements of dt) of every rank -> full (model layout), bucket by bucket.
static int all_gather_full(Executor *x, const Model *m, const void *shard, void *full, DType dt,
                           Err *err) {
    void *regions = regions_acquire(x, err);
    if (!regions) return -1;
    size_t esize = dtype_size(dt);
    int rc = 0;
    for (int k = 0; k < x->n_buckets && !rc; k++) {
        const Bucket *b = &x->buckets[k];
        void *staging = (char *)regions + (size_t)x->world * b->base * esize;
        rc = comm_all_gather(x->comm, (const char *)shard + b->base * esize, staging, b->size, dt,
                             err);
        if (!rc) from_staging(x, m, b, staging, full, esize);
    }
    regions_release(x, regions);
    return rc;
}

// The compute weights of every rank's shard -> m->weights.
static int gather_weights(Executor *x, Model *m, Err *err) {
    const void *mine = x->shard.master;
    if (x->stage) {
        x->be->cast_from_f32(x->stage, x->shard.master, x->region);
        mine = x->stage;
    }
    return all_gather_full(x, m, mine, m->weights, x->be->dtype, err);
}

// full (model layout, fp32) -> this rank's shard (S), no communication.
static void take_own(const Executor *x, const Model *m, const float *full, float *shard) {
    for (int i = 0; i < m->n_params; i++)
        if (x->owner[i] == x->rank)
            x->be->copy(shard + x->region_off[i], full + m->params[i].offset,
                        m->params[i].numel * sizeof(float));
}

// ---------------------------------------------------------------- buckets of a micro-step

// A bucket's staging in the exchange buffer of the micro-step in flight.
static void *staging_of(const Executor *x, const Bucket *b, size_t esize) {
    return (char *)x->pending + (size_t)x->world * b->base * esize;
}

// Records the first failure of a hook (hooks cannot return one); end_micro reports it.
static void hook_failed(Executor *x, int rc) {
    if (rc) x->async_failed = 1;
}

// fsdp, forward: starts gathering bucket `b`'s weights (compute dtype) from every rank.
static int start_gather(Executor *x, int b) {
    const Bucket *k = &x->buckets[b];
    size_t esize = dtype_size(x->be->dtype);
    const char *mine = x->gather_src;
    return comm_all_gather_start(x->comm, mine + k->base * esize, staging_of(x, k, esize), k->size,
                                 x->be->dtype, &x->async_err);
}

// Model hook (fsdp): forward is about to read [first, end). Every bucket it reaches is made
// ready: the compute waits (on the device) for its gather, copies it into the model's
// weights, and the next bucket's gather starts, to run while this one computes.
static void on_weights_needed(void *ctx, int first, int end) {
    (void)end;
    Executor *x = ctx;
    size_t esize = dtype_size(x->be->dtype);
    while (!x->async_failed && x->needed >= 0 && first >= x->buckets[x->needed].first) {
        const Bucket *k = &x->buckets[x->needed--];
        hook_failed(x, comm_join(x->comm, &x->async_err));
        from_staging(x, x->model, k, staging_of(x, k, esize), x->model->weights, esize);
        if (x->needed >= 0) hook_failed(x, start_gather(x, x->needed));
    }
}

// Starts the averaging reduce-scatter of bucket `launched` into the owners' regions.
static int start_reduce(Executor *x, Err *err) {
    const Bucket *b = &x->buckets[x->launched++];
    void *staging = staging_of(x, b, sizeof(float));
    to_staging(x, x->model, b, x->model->grads, staging, sizeof(float));
    return comm_reduce_scatter_start(x->comm, staging, x->shard.grads + b->base, b->size, DT_F32,
                                     COMM_AVG, err);
}

// Model hook: the gradients of [first, end) are final; start every bucket they complete.
static void on_grads_ready(void *ctx, int first, int end) {
    (void)end;
    Executor *x = ctx;
    while (!x->async_failed && x->launched < x->n_buckets && first <= x->buckets[x->launched].first)
        hook_failed(x, start_reduce(x, &x->async_err));
}

// Before a micro-step: the exchange buffer and the hooks. gather (fsdp): forward gathers its
// weights bucket by bucket as it reaches them (the first one starts here); sync: backward
// reduces the gradients bucket by bucket as it finishes them. The padding of the staging is
// never written by gradients; a bf16 weight gather through ddp's persistent buffer leaves
// other bytes there, so it is cleared first.
static int arm(Executor *x, Model *m, bool gather, bool sync, Err *err) {
    if (!gather && !sync) return 0;
    if (!(x->pending = regions_acquire(x, err))) return -1;
    if (sync && x->stage && x->pending == x->regions) x->be->zero(x->regions, regions_bytes(x));
    x->model = m;
    x->async_failed = 0;
    x->launched = sync ? 0 : x->n_buckets;
    x->needed = gather ? x->n_buckets - 1 : -1; // forward needs the buckets last to first
    model_set_hooks(m, &(ModelHooks){.grads_ready = sync ? on_grads_ready : NULL,
                                     .weights_needed = gather ? on_weights_needed : NULL,
                                     .ctx = x});
    if (!gather) return 0;
    if (!x->gather_src) {
        if (x->stage) x->be->cast_from_f32(x->stage, x->shard.master, x->region);
        x->gather_src = x->stage ? x->stage : x->shard.master;
    }
    return start_gather(x, x->needed) ? err_set(err, "%s", x->async_err.msg) : 0;
}

// After a micro-step's backward: the reductions backward did not start (a batch without
// counted tokens runs no backward), then the wait for every collective of the micro-step.
static int disarm(Executor *x, Model *m, Err *err) {
    if (!x->pending) return 0;
    model_set_hooks(m, NULL);
    while (!x->async_failed && x->launched < x->n_buckets)
        hook_failed(x, start_reduce(x, &x->async_err));
    int rc = x->async_failed ? err_set(err, "%s", x->async_err.msg) : comm_wait(x->comm, err);
    // The comm's stream is done with the exchange buffer (comm_wait); the compute stream may
    // still be reading it (from_staging copies) or the gathered weights, which the caller
    // releases next: the backend's free is ordered after those reads (backend.h).
    regions_release(x, x->pending);
    x->pending = NULL;
    x->gather_src = NULL;
    return rc;
}

// ---------------------------------------------------------------- none

static int none_init(Executor *x, Model *m, size_t bucket_bytes, Err *err) {
    (void)x, (void)m, (void)bucket_bytes, (void)err;
    return 0;
}

static ParamView none_view(const Executor *x, const Model *m) {
    (void)x;
    return model_view(m);
}

static int none_micro(Executor *x, Model *m, MicroStep kind, Err *err) {
    (void)x, (void)m, (void)kind, (void)err;
    return 0;
}

static int none_sync_grads(Executor *x, Model *m, Err *err) {
    (void)x, (void)m, (void)err;
    return 0;
}

static int none_after_step(Executor *x, Model *m, Err *err) {
    (void)x, (void)err;
    model_refresh_weights(m);
    model_zero_grad(m);
    return 0;
}

static int none_gather_full(Executor *x, Model *m, const Optimizer *opt, const Optimizer **full,
                            Err *err) {
    (void)x, (void)m, (void)err;
    *full = opt;
    return 0;
}

static void none_drop_full(Executor *x, Model *m) {
    (void)x, (void)m;
}

static int none_load_optim(Executor *x, Model *m, Optimizer *opt, const StFile *f, const char *path,
                           Err *err) {
    (void)x;
    ParamView v = model_view(m);
    return optim_load_st(opt, &v, f, path, model_is_stage(m), err);
}

static int none_adopt_weights(Executor *x, Model *m, Err *err) {
    (void)x, (void)m, (void)err;
    return 0;
}

// The reference weights of none and ddp: a full copy, which forward reads in place of the
// policy's.
static int alloc_reference(Executor *x, size_t n, Err *err) {
    if (!(x->reference = x->be->alloc(n * dtype_size(x->be->dtype), err)))
        return err_prefix(err, "the reference weights (%zu parameters)", n);
    return 0;
}

static int whole_keep_reference(Executor *x, Model *m, Err *err) {
    if (alloc_reference(x, m->num_floats, err)) return -1;
    x->be->copy(x->reference, m->weights, m->num_floats * dtype_size(x->be->dtype));
    return 0;
}

static int whole_begin_reference(Executor *x, Model *m, Err *err) {
    (void)err;
    x->policy_weights = m->weights;
    m->weights = x->reference;
    return 0;
}

static int whole_end_reference(Executor *x, Model *m, Err *err) {
    (void)err;
    m->weights = x->policy_weights;
    x->policy_weights = NULL;
    return 0;
}

// none, ddp: the model holds its whole compute weights.
static int whole_begin_generate(Executor *x, Model *m, Err *err) {
    (void)x, (void)m, (void)err;
    return 0;
}

static void whole_end_generate(Executor *x, Model *m) {
    (void)x, (void)m;
}

// ---------------------------------------------------------------- ddp and fsdp

static int shard_init(Executor *x, Model *m, size_t bucket_bytes, Err *err) {
    return plan_shards(x, m, bucket_cap(bucket_bytes, comm_device_memory(x->comm)), err);
}

static ParamView shard_view(const Executor *x, const Model *m) {
    (void)m;
    return x->shard;
}

// The full fp32 master weights, gathered into m->master where the model does not hold them.
static int gather_master(Executor *x, Model *m, Err *err) {
    x->transient = 0;
    if (m->master) return 0; // ddp fp32: the weights are the master
    if (model_acquire(m, MODEL_MASTER, err)) return -1;
    x->transient = MODEL_MASTER;
    return all_gather_full(x, m, x->shard.master, m->master, DT_F32, err);
}

// The optimizer state as for the full model (every rank takes part in the gather): fills a
// full Optimizer `full` created for m.
static int gather_optim(Executor *x, Model *m, const Optimizer *opt, Optimizer *full, Err *err) {
    float *mine[3], *all[3];
    int n = optim_state_arrays(opt, mine);
    if (optim_state_arrays(full, all) != n) return err_set(err, "optimizer state layouts differ");
    full->step = opt->step;
    for (int k = 0; k < n; k++)
        if (all_gather_full(x, m, mine[k], all[k], DT_F32, err)) return -1;
    return 0;
}

// The inverse: takes this rank's part of a full optimizer state.
static void scatter_optim(Executor *x, Model *m, const Optimizer *full, Optimizer *opt) {
    float *mine[3], *all[3];
    int n = optim_state_arrays(opt, mine);
    optim_state_arrays(full, all);
    opt->step = full->step;
    for (int k = 0; k < n; k++)
        take_own(x, m, all[k], mine[k]);
}

static int shard_gather_full(Executor *x, Model *m, const Optimizer *opt, const Optimizer **full,
                             Err *err) {
    ParamView v = model_view(m);
    *full = &x->full_opt;
    return gather_master(x, m, err) ||
           optim_create(&x->full_opt, opt->kind, &v, opt->weight_decay, err) ||
           gather_optim(x, m, opt, &x->full_opt, err);
}

static void shard_drop_full(Executor *x, Model *m) {
    if (x->transient) model_release(m, x->transient);
    x->transient = 0;
    optim_free(&x->full_opt);
}

static int shard_load_optim(Executor *x, Model *m, Optimizer *opt, const StFile *f,
                            const char *path, Err *err) {
    ParamView v = model_view(m);
    Optimizer full;
    if (optim_create(&full, opt->kind, &v, opt->weight_decay, err)) return -1;
    int rc = optim_load_st(&full, &v, f, path, model_is_stage(m), err);
    if (!rc) scatter_optim(x, m, &full, opt);
    optim_free(&full);
    return rc;
}

// ---------------------------------------------------------------- ddp

static int ddp_init(Executor *x, Model *m, size_t bucket_bytes, Err *err) {
    if (shard_init(x, m, bucket_bytes, err)) return -1;
    // ddp keeps its exchange buffer for the whole run; fsdp allocates it per use, so that
    // between steps a rank holds only its shard.
    if (!(x->regions = x->be->alloc(regions_bytes(x), err)))
        return err_prefix(err, "ddp: the exchange buffer");
    return 0;
}

static int ddp_begin_micro(Executor *x, Model *m, MicroStep kind, Err *err) {
    return arm(x, m, false, kind == MICRO_SYNC, err);
}

static int ddp_end_micro(Executor *x, Model *m, MicroStep kind, Err *err) {
    (void)kind;
    return disarm(x, m, err);
}

// Every bucket reduced now, after the last backward (arm's hooks never fire).
static int shard_sync_grads(Executor *x, Model *m, Err *err) {
    return arm(x, m, false, true, err) || disarm(x, m, err);
}

static int ddp_after_step(Executor *x, Model *m, Err *err) {
    if (gather_weights(x, m, err)) return -1;
    model_zero_grad(m);
    return 0;
}

static int ddp_adopt_weights(Executor *x, Model *m, Err *err) {
    (void)err;
    take_own(x, m, m->master, x->shard.master);
    if (m->weights != m->master)
        model_release(m, MODEL_MASTER); // ddp keeps the compute weights, the shard the master
    return 0;
}

// ---------------------------------------------------------------- fsdp

static int fsdp_begin_micro(Executor *x, Model *m, MicroStep kind, Err *err) {
    int full = kind == MICRO_EVAL ? MODEL_WEIGHTS : MODEL_WEIGHTS | MODEL_GRADS;
    if (model_acquire(m, full, err)) return -1;
    return arm(x, m, true, kind == MICRO_SYNC, err);
}

static int fsdp_end_micro(Executor *x, Model *m, MicroStep kind, Err *err) {
    int rc = disarm(x, m, err);
    model_release(m, kind == MICRO_SYNC ? MODEL_WEIGHTS | MODEL_GRADS : MODEL_WEIGHTS);
    return rc;
}

static int fsdp_sync_grads(Executor *x, Model *m, Err *err) {
    int rc = shard_sync_grads(x, m, err);
    model_release(m, MODEL_GRADS);
    return rc;
}

static int fsdp_after_step(Executor *x, Model *m, Err *err) {
    (void)x, (void)m, (void)err;
    return 0;
}

static int fsdp_keep_reference(Executor *x, Model *m, Err *err) {
    if (alloc_reference(x, x->region ? x->region : 1, err)) return -1;
    size_t esize = dtype_size(x->be->dtype);
    for (int i = 0; i < m->n_params; i++) // this rank's tensors, at their region offsets
        if (x->owner[i] == x->rank)
            x->be->copy((char *)x->reference + x->region_off[i] * esize,
                        (const char *)m->weights + m->params[i].offset * esize,
                        m->params[i].numel * esize);
    return 0;
}

static int fsdp_begin_reference(Executor *x, Model *m, Err *err) {
    if (model_acquire(m, MODEL_WEIGHTS, err)) return -1;
    x->gather_src = x->reference;
    return arm(x, m, true, false, err);
}

static int fsdp_end_reference(Executor *x, Model *m, Err *err) {
    int rc = disarm(x, m, err);
    model_release(m, MODEL_WEIGHTS);
    return rc;
}

static int fsdp_begin_generate(Executor *x, Model *m, Err *err) {
    return model_acquire(m, MODEL_WEIGHTS, err) || gather_weights(x, m, err) ? -1 : 0;
}

static void fsdp_end_generate(Executor *x, Model *m) {
    (void)x;
    model_release(m, MODEL_WEIGHTS);
}

static int fsdp_adopt_weights(Executor *x, Model *m, Err *err) {
    (void)err;
    take_own(x, m, m->master, x->shard.master);
    model_release(m, MODEL_WEIGHTS | MODEL_MASTER | MODEL_GRADS);
    return 0;
}

// ---------------------------------------------------------------- the modes

static const ExecutorOps NONE_OPS = {.forward_collective = false,
                                     .init = none_init,
                                     .view = none_view,
                                     .begin_micro = none_micro,
                                     .end_micro = none_micro,
                                     .sync_grads = none_sync_grads,
                                     .after_step = none_after_step,
                                     .gather_full = none_gather_full,
                                     .drop_full = none_drop_full,
                                     .load_optim = none_load_optim,
                                     .keep_reference = whole_keep_reference,
                                     .begin_reference = whole_begin_reference,
                                     .end_reference = whole_end_reference,
                                     .begin_generate = whole_begin_generate,
                                     .end_generate = whole_end_generate,
                                     .adopt_weights = none_adopt_weights};

static const ExecutorOps DDP_OPS = {.forward_collective = false,
                                    .init = ddp_init,
                                    .view = shard_view,
                                    .begin_micro = ddp_begin_micro,
                                    .end_micro = ddp_end_micro,
                                    .sync_grads = shard_sync_grads,
                                    .after_step = ddp_after_step,
                                    .gather_full = shard_gather_full,
                                    .drop_full = shard_drop_full,
                                    .load_optim = shard_load_optim,
                                    .keep_reference = whole_keep_reference,
                                    .begin_reference = whole_begin_reference,
                                    .end_reference = whole_end_reference,
                                    .begin_generate = whole_begin_generate,
                                    .end_generate = whole_end_generate,
                                    .adopt_weights = ddp_adopt_weights};

// Forward gathers the weights: every rank runs every forward.
static const ExecutorOps FSDP_OPS = {.forward_collective = true,
                                     .init = shard_init,
                                     .view = shard_view,
                                     .begin_micro = fsdp_begin_micro,
                                     .end_micro = fsdp_end_micro,
                                     .sync_grads = fsdp_sync_grads,
                                     .after_step = fsdp_after_step,
                                     .gather_full = shard_gather_full,
                                     .drop_full = shard_drop_full,
                                     .load_optim = shard_load_optim,
                                     .keep_reference = fsdp_keep_reference,
                                     .begin_reference = fsdp_begin_reference,
                                     .end_reference = fsdp_end_reference,
                                     .begin_generate = fsdp_begin_generate,
                                     .end_generate = fsdp_end_generate,
                                     .adopt_weights = fsdp_adopt_weights};

static const ExecutorOps *const MODES[] = {
    [EXEC_NONE] = &NONE_OPS, [EXEC_DDP] = &DDP_OPS, [EXEC_FSDP] = &FSDP_OPS};

// ---------------------------------------------------------------- every mode

int executor_init(Executor *x, ExecMode mode, Comm *group, Comm *world, Model *m,
                  size_t bucket_bytes, Err *err) {
    memset(x, 0, sizeof *x);
    bool shared = group && comm_world_size(group) > 1;
    x->ops = MODES[shared ? mode : EXEC_NONE]; // one rank: nothing to share
    x->comm = shared ? group : NULL;
    x->world_comm = world && comm_world_size(world) > 1 ? world : NULL;
    x->rank = shared ? comm_rank(group) : 0;
    x->world = shared ? comm_world_size(group) : 1;
    x->norm_skip = -1;
    x->be = m->be;
    if (!(x->sq_norm = x->be->alloc(sizeof *x->sq_norm, err)) ||
        (x->world_comm && comm_device_memory(x->world_comm) &&
         !(x->agree = x->be->alloc(EXEC_AGREE_MAX * sizeof(float), err))))
        return err_prefix(err, "executor");
    return x->ops->init(x, m, bucket_bytes, err);
}

void executor_free(Executor *x) {
    if (x->be) {
        x->be->free(x->shard.master);
        x->be->free(x->shard.grads);
        x->be->free(x->regions);
        x->be->free(x->stage);
        x->be->free(x->agree);
        x->be->free(x->sq_norm);
        x->be->free(x->reference);
    }
    optim_free(&x->full_opt);
    free(x->owner);
    free(x->region_off);
    free(x->owned);
    free(x->buckets);
    memset(x, 0, sizeof *x);
}

ParamView executor_view(const Executor *x, const Model *m) {
    return x->ops->view(x, m);
}

int executor_begin_micro(Executor *x, Model *m, MicroStep kind, Err *err) {
    return x->ops->begin_micro(x, m, kind, err);
}

int executor_end_micro(Executor *x, Model *m, MicroStep kind, Err *err) {
    return x->ops->end_micro(x, m, kind, err);
}

int executor_sync_grads(Executor *x, Model *m, Err *err) {
    return x->ops->sync_grads(x, m, err);
}

bool executor_forward_collective(const Executor *x) {
    return x->ops->forward_collective;
}

int executor_after_step(Executor *x, Model *m, Err *err) {
    return x->ops->after_step(x, m, err);
}

// One rank sums nothing: its values stay exact.
static bool one_rank(const Executor *x) {
    return !x->world_comm;
}

int executor_sum(Executor *x, float *vals, int n, Err *err) {
    if (one_rank(x)) return 0;
    if (n > EXEC_AGREE_MAX)
        return err_set(err, "executor_sum: %d values (at most %d)", n, EXEC_AGREE_MAX);
    if (!x->agree) return comm_all_reduce(x->world_comm, vals, (size_t)n, DT_F32, COMM_SUM, err);
    x->be->upload(x->agree, vals, (size_t)n * sizeof *vals);
    if (comm_all_reduce(x->world_comm, x->agree, (size_t)n, DT_F32, COMM_SUM, err)) return -1;
    x->be->download(vals, x->agree, (size_t)n * sizeof *vals);
    return 0;
}

// The squares of the gradients of [from, to) of the view, in double.
static double sum_squares(const Executor *x, const float *grads, size_t from, size_t to) {
    double sq = 0;
    if (to <= from) return 0;
    x->be->sum_squares(x->sq_norm, grads + from, to - from);
    x->be->download(&sq, x->sq_norm, sizeof sq);
    return sq;
}

// This rank's squared norm of the gradients of its view, without the norm_skip tensor.
static double view_sq_norm(const Executor *x, const Model *m) {
    ParamView v = executor_view(x, m);
    int skip = x->norm_skip;
    if (skip < 0 || (x->owner && x->owner[skip] != x->rank))
        return sum_squares(x, v.grads, 0, v.num_floats);
    size_t at = x->owner ? x->region_off[skip] : m->params[skip].offset;
    return sum_squares(x, v.grads, 0, at) +
           sum_squares(x, v.grads, at + m->params[skip].numel, v.num_floats);
}

int executor_agree_step(Executor *x, const Model *m, float *vals, int n, int norm_at, double *norm,
                        Err *err) {
    if (norm_at < 0 || norm_at >= n)
        return err_set(err, "executor_agree_step: slot %d outside %d values", norm_at, n);
    double sq = view_sq_norm(x, m);
    vals[norm_at] = (float)sq;
    if (executor_sum(x, vals, n, err)) return -1;
    *norm = sqrt(one_rank(x) ? sq : (double)vals[norm_at]);
    return 0;
}

int executor_job_ranks(const Executor *x) {
    return one_rank(x) ? 1 : comm_world_size(x->world_comm);
}

int executor_mean(Executor *x, double sum, double count, double *mean, Err *err) {
    float both[2] = {(float)sum, (float)count};
    if (executor_sum(x, both, 2, err)) return -1;
    *mean = one_rank(x) ? sum / count : (double)both[0] / (double)both[1];
    return 0;
}

int executor_gather_full(Executor *x, Model *m, const Optimizer *opt, const Optimizer **full,
                         Err *err) {
    return x->ops->gather_full(x, m, opt, full, err);
}

void executor_drop_full(Executor *x, Model *m) {
    x->ops->drop_full(x, m);
}

int executor_load_optim(Executor *x, Model *m, Optimizer *opt, const StFile *f, const char *path,
                        Err *err) {
    return x->ops->load_optim(x, m, opt, f, path, err);
}

int executor_keep_reference(Executor *x, Model *m, Err *err) {
    return x->ops->keep_reference(x, m, err);
}

int executor_begin_reference(Executor *x, Model *m, Err *err) {
    return x->ops->begin_reference(x, m, err);
}

int executor_end_reference(Executor *x, Model *m, Err *err) {
    return x->ops->end_reference(x, m, err);
}

int executor_begin_generate(Executor *x, Model *m, Err *err) {
    return x->ops->begin_generate(x, m, err) ? err_prefix(err, "generation: the weights") : 0;
}

void executor_end_generate(Executor *x, Model *m) {
    x->ops->end_generate(x, m);
}

int executor_adopt_weights(Executor *x, Model *m, Err *err) {
    return x->ops->adopt_weights(x, m, err);
}
