// executor.c: the none/ddp/fsdp executors (worker/lib/executor.h): the shard plan, the
// exchange between the model layout and the rank regions, and the collectives of a step.
#include "worker/lib/executor.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------- shard plan (ddp, fsdp)

// Buckets: runs of consecutive grads_ready ranges (engine/model.h) of at least `cap`
// bytes of gradients; in the order backward completes them.
static int plan_buckets(Executor *x, const Model *m, size_t cap, Err *err) {
    int(*ranges)[2] = malloc(((size_t)m->cfg.num_hidden_layers + 2) * sizeof *ranges);
    x->buckets = calloc((size_t)m->cfg.num_hidden_layers + 2, sizeof *x->buckets);
    if (!ranges || !x->buckets) {
        free(ranges);
        return err_resource(err, "shard plan: out of memory");
    }
    int n = model_grad_ranges(m, ranges);
    size_t bytes = 0;
    for (int k = 0; k < n; k++) {
        if (x->n_buckets == 0 || bytes >= cap) {
            x->buckets[x->n_buckets++] = (Bucket){.first = ranges[k][0], .end = ranges[k][1]};
            bytes = 0;
        }
        x->buckets[x->n_buckets - 1].first = ranges[k][0]; // ranges descend contiguously
        for (int i = ranges[k][0]; i < ranges[k][1]; i++)
            bytes += m->params[i].numel * sizeof(float);
    }
    free(ranges);
    return 0;
}

// Within bucket b, greedy: largest tensors first (ties keep AstrAI order), each to the rank
// with the fewest floats of the bucket so far; then each rank's tensors in AstrAI order.
// The bucket's part of every region is as long as the largest rank's share.
static int assign_bucket(Executor *x, const Model *m, Bucket *b, size_t *load) {
    int n = b->end - b->first;
    int *order = malloc((size_t)n * sizeof *order);
    if (!order) return -1;
    for (int i = 0; i < n; i++)
        order[i] = b->first + i;
    for (int i = 1; i < n; i++) // insertion sort by numel desc, stable
        for (int j = i; j > 0 && m->params[order[j]].numel > m->params[order[j - 1]].numel; j--) {
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
        load[best] += m->params[order[k]].numel;
    }
    free(order);
    memset(load, 0, (size_t)x->world * sizeof *load);
    for (int i = b->first; i < b->end; i++) {
        x->region_off[i] = b->base + load[x->owner[i]];
        load[x->owner[i]] += m->params[i].numel;
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

static int plan_shards(Executor *x, Model *m, size_t cap, Err *err) {
    x->owner = calloc((size_t)m->n_params, sizeof *x->owner);
    x->region_off = calloc((size_t)m->n_params, sizeof *x->region_off);
    size_t *load = calloc((size_t)x->world, sizeof *load);
    int rc = !x->owner || !x->region_off || !load ? err_resource(err, "shard plan: out of memory")
                                                  : plan_buckets(x, m, cap, err);
    for (int k = 0; !rc && k < x->n_buckets; k++) {
        x->buckets[k].base = x->region;
        if (assign_bucket(x, m, &x->buckets[k], load))
            rc = err_resource(err, "shard plan: out of memory");
        x->region += x->buckets[k].size;
    }
    free(load);
    return rc ? rc : build_shard(x, m, err);
}

static size_t regions_bytes(const Executor *x) {
    return ((size_t)x->world * x->region + 1) * sizeof(float);
}

// Gradients reduced together by default: PyTorch DDP's 25 MiB buckets on GPUs, where the
// reduction overlaps the rest of backward; one bucket on CPU ranks, where the collectives
// run on the same cores as the compute and fewer, larger calls are faster.
#define GPU_BUCKET_BYTES ((size_t)25 << 20)

int executor_init(Executor *x, ExecMode mode, Comm *comm, Model *m, size_t bucket_bytes, Err *err) {
    memset(x, 0, sizeof *x);
    x->mode = comm && comm_world_size(comm) > 1 ? mode : EXEC_NONE; // one rank: nothing to share
    x->comm = comm;
    x->rank = comm ? comm_rank(comm) : 0;
    x->world = comm ? comm_world_size(comm) : 1;
    x->be = m->be;
    if (comm && comm_device_memory(comm) &&
        !(x->agree = x->be->alloc(EXEC_AGREE_MAX * sizeof(float), err)))
        return err_prefix(err, "executor");
    if (x->mode == EXEC_NONE) return 0;
    if (!bucket_bytes) bucket_bytes = comm_device_memory(comm) ? GPU_BUCKET_BYTES : SIZE_MAX;
    if (plan_shards(x, m, bucket_bytes, err)) return -1;
    // ddp keeps its exchange buffer for the whole run; fsdp allocates it per use, so that
    // between steps a rank holds only its shard.
    if (x->mode == EXEC_DDP && !(x->regions = x->be->alloc(regions_bytes(x), err)))
        return err_prefix(err, "ddp: the exchange buffer");
    return 0;
}

void executor_free(Executor *x) {
    if (x->be) {
        x->be->free(x->shard.master);
        x->be->free(x->shard.grads);
        x->be->free(x->regions);
        x->be->free(x->stage);
        x->be->free(x->agree);
        x->be->free(x->reference);
    }
    free(x->owner);
    free(x->region_off);
    free(x->owned);
    free(x->buckets);
    memset(x, 0, sizeof *x);
}

ParamView executor_view(const Executor *x, const Model *m) {
    return x->mode == EXEC_NONE ? model_view(m) : x->shard;
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
static int gather_full(Executor *x, const Model *m, const void *shard, void *full, DType dt,
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
    return gather_full(x, m, mine, m->weights, x->be->dtype, err);
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

// Before a micro-step: the exchange buffer and the hooks. fsdp gathers its weights bucket by
// bucket as forward reaches them (the first one starts here); a sync micro-step reduces its
// gradients bucket by bucket as backward finishes them. The padding of the staging is
// never written by gradients; a bf16 weight gather through ddp's persistent buffer leaves
// other bytes there, so it is cleared first.
static int arm(Executor *x, Model *m, bool sync, Err *err) {
    bool gather = x->mode == EXEC_FSDP;
    if (!gather && !sync) return 0;
    if (!(x->pending = regions_acquire(x, err))) return -1;
    if (sync && x->stage && x->pending == x->regions) x->be->zero(x->regions, regions_bytes(x));
    x->model = m;
    x->async_failed = 0;
    x->launched = sync ? 0 : x->n_buckets;
    x->needed = gather ? x->n_buckets - 1 : -1; // forward needs the buckets last to first
    m->hook_ctx = x;
    m->grads_ready = sync ? on_grads_ready : NULL;
    m->weights_needed = gather ? on_weights_needed : NULL;
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
    m->grads_ready = NULL;
    m->weights_needed = NULL;
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

// ---------------------------------------------------------------- micro-steps

int executor_begin_micro(Executor *x, Model *m, bool sync, Err *err) {
    if (x->mode == EXEC_NONE) return 0;
    if (x->mode == EXEC_FSDP && model_acquire(m, MODEL_WEIGHTS | MODEL_GRADS, err)) return -1;
    return arm(x, m, sync, err);
}

int executor_end_micro(Executor *x, Model *m, bool sync, Err *err) {
    if (x->mode == EXEC_NONE) return 0;
    int rc = disarm(x, m, err);
    if (x->mode == EXEC_FSDP) model_release(m, sync ? MODEL_WEIGHTS | MODEL_GRADS : MODEL_WEIGHTS);
    return rc;
}

int executor_after_step(Executor *x, Model *m, Err *err) {
    if (x->mode == EXEC_NONE) model_refresh_weights(m);
    return x->mode == EXEC_DDP ? gather_weights(x, m, err) : 0;
}

int executor_sum(Executor *x, float *vals, int n, Err *err) {
    if (!x->comm) return 0;
    if (n > EXEC_AGREE_MAX)
        return err_set(err, "executor_sum: %d values (at most %d)", n, EXEC_AGREE_MAX);
    if (!x->agree) return comm_all_reduce(x->comm, vals, (size_t)n, DT_F32, COMM_SUM, err);
    x->be->upload(x->agree, vals, (size_t)n * sizeof *vals);
    if (comm_all_reduce(x->comm, x->agree, (size_t)n, DT_F32, COMM_SUM, err)) return -1;
    x->be->download(vals, x->agree, (size_t)n * sizeof *vals);
    return 0;
}

// ---------------------------------------------------------------- checkpoints

int executor_gather_weights(Executor *x, Model *m, Err *err) {
    x->transient = 0;
    if (x->mode == EXEC_NONE || m->master) return 0; // ddp fp32: the weights are the master
    if (model_acquire(m, MODEL_MASTER, err)) return -1;
    x->transient = MODEL_MASTER;
    return gather_full(x, m, x->shard.master, m->master, DT_F32, err);
}

void executor_drop_full(Executor *x, Model *m) {
    if (x->transient) model_release(m, x->transient);
    x->transient = 0;
}

// ---------------------------------------------------------------- reference weights

int executor_keep_reference(Executor *x, Model *m, Err *err) {
    size_t esize = dtype_size(x->be->dtype);
    size_t n = x->mode == EXEC_FSDP ? (x->region ? x->region : 1) : m->num_floats;
    if (!(x->reference = x->be->alloc(n * esize, err)))
        return err_prefix(err, "the reference weights (%zu parameters)", n);
    if (x->mode != EXEC_FSDP) {
        x->be->copy(x->reference, m->weights, n * esize);
        return 0;
    }
    for (int i = 0; i < m->n_params; i++) // this rank's tensors, at their region offsets
        if (x->owner[i] == x->rank)
            x->be->copy((char *)x->reference + x->region_off[i] * esize,
                        (const char *)m->weights + m->params[i].offset * esize,
                        m->params[i].numel * esize);
    return 0;
}

int executor_begin_reference(Executor *x, Model *m, Err *err) {
    if (x->mode != EXEC_FSDP) {
        x->policy_weights = m->weights;
        m->weights = x->reference;
        return 0;
    }
    if (model_acquire(m, MODEL_WEIGHTS, err)) return -1;
    x->gather_src = x->reference;
    return arm(x, m, false, err);
}

int executor_end_reference(Executor *x, Model *m, Err *err) {
    if (x->mode != EXEC_FSDP) {
        m->weights = x->policy_weights;
        x->policy_weights = NULL;
        return 0;
    }
    int rc = disarm(x, m, err);
    model_release(m, MODEL_WEIGHTS);
    return rc;
}

int executor_adopt_weights(Executor *x, Model *m, Err *err) {
    (void)err;
    if (x->mode == EXEC_NONE) return 0;
    take_own(x, m, m->master, x->shard.master);
    if (x->mode == EXEC_FSDP)
        model_release(m, MODEL_WEIGHTS | MODEL_MASTER | MODEL_GRADS);
    else if (m->weights != m->master)
        model_release(m, MODEL_MASTER); // ddp keeps the compute weights, the shard the master
    return 0;
}

// The optimizer's per-float state arrays, in the same order for the shard and the full one.
static int state_arrays(const Optimizer *o, float *arrays[3]) {
    int n = 0;
    if (o->exp_avg) arrays[n++] = o->exp_avg;
    if (o->exp_avg_sq) arrays[n++] = o->exp_avg_sq;
    if (o->momentum_buf) arrays[n++] = o->momentum_buf;
    return n;
}

int executor_gather_optim(Executor *x, Model *m, const Optimizer *opt, Optimizer *full, Err *err) {
    float *mine[3], *all[3];
    int n = state_arrays(opt, mine);
    if (state_arrays(full, all) != n) return err_set(err, "optimizer state layouts differ");
    full->step = opt->step;
    for (int k = 0; k < n; k++)
        if (gather_full(x, m, mine[k], all[k], DT_F32, err)) return -1;
    return 0;
}

void executor_scatter_optim(Executor *x, Model *m, const Optimizer *full, Optimizer *opt) {
    float *mine[3], *all[3];
    int n = state_arrays(opt, mine);
    state_arrays(full, all);
    opt->step = full->step;
    for (int k = 0; k < n; k++)
        take_own(x, m, all[k], mine[k]);
}
