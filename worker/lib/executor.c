// executor.c: the none/ddp/fsdp executors (worker/lib/executor.h): the shard plan, the
// exchange between the model layout and the rank regions, and the collectives of a step.
#include "worker/lib/executor.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------- shard plan (ddp, fsdp)

// Greedy: largest tensors first, each to the rank with the fewest floats so far.
static int assign_owners(Executor *x, const Model *m, size_t *load) {
    int n = m->n_params;
    int *order = malloc((size_t)n * sizeof *order);
    if (!order) return -1;
    for (int i = 0; i < n; i++)
        order[i] = i;
    for (int i = 1; i < n; i++) // insertion sort by numel desc, stable (ties keep AstrAI order)
        for (int j = i; j > 0 && m->params[order[j]].numel > m->params[order[j - 1]].numel; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    for (int k = 0; k < n; k++) {
        int best = 0;
        for (int r = 1; r < x->world; r++)
            if (load[r] < load[best]) best = r;
        x->owner[order[k]] = best;
        load[best] += m->params[order[k]].numel;
    }
    free(order);
    return 0;
}

// Region offsets of every tensor in its owner's region (each rank computes every layout).
static void place_tensors(Executor *x, const Model *m, size_t *used) {
    for (int i = 0; i < m->n_params; i++) {
        x->region_off[i] = used[x->owner[i]];
        used[x->owner[i]] += m->params[i].numel;
    }
}

// The shard view: the owned tensors, in AstrAI order, packed into the region; the
// optimizer state spans the region, padding included.
static int build_shard(Executor *x, const Model *m, Err *err) {
    ParamView *s = &x->shard;
    x->owned = calloc(m->n_params > 0 ? (size_t)m->n_params : 1, sizeof *x->owned);
    if (!x->owned) return err_set(err, "shard plan: out of memory");
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

static int plan_shards(Executor *x, Model *m, Err *err) {
    x->owner = calloc((size_t)m->n_params, sizeof *x->owner);
    x->region_off = calloc((size_t)m->n_params, sizeof *x->region_off);
    size_t *load = calloc((size_t)x->world, sizeof *load);
    if (!x->owner || !x->region_off || !load || assign_owners(x, m, load)) {
        free(load);
        return err_set(err, "shard plan: out of memory");
    }
    for (int r = 0; r < x->world; r++)
        if (load[r] > x->region) x->region = load[r];
    memset(load, 0, (size_t)x->world * sizeof *load);
    place_tensors(x, m, load);
    free(load);
    return build_shard(x, m, err);
}

static size_t regions_bytes(const Executor *x) {
    return ((size_t)x->world * x->region + 1) * sizeof(float);
}

int executor_init(Executor *x, ExecMode mode, Comm *comm, Model *m, Err *err) {
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
    if (plan_shards(x, m, err)) return -1;
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
    }
    free(x->owner);
    free(x->region_off);
    free(x->owned);
    memset(x, 0, sizeof *x);
}

ParamView executor_view(const Executor *x, const Model *m) {
    return x->mode == EXEC_NONE ? model_view(m) : x->shard;
}

// ---------------------------------------------------------------- region <-> model layout

// full (model layout) -> regions (world*S): every tensor into its owner's region.
static void to_regions(const Executor *x, const Model *m, const void *full, void *regions,
                       size_t esize) {
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        size_t at = (size_t)x->owner[i] * x->region + x->region_off[i];
        x->be->copy((char *)regions + at * esize, (const char *)full + p->offset * esize,
                    p->numel * esize);
    }
}

// regions (world*S) -> full (model layout).
static void from_regions(const Executor *x, const Model *m, const void *regions, void *full,
                         size_t esize) {
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        size_t at = (size_t)x->owner[i] * x->region + x->region_off[i];
        x->be->copy((char *)full + p->offset * esize, (const char *)regions + at * esize,
                    p->numel * esize);
    }
}

// The (world*S) exchange buffer: ddp's persistent one, or a fresh zeroed one (fsdp).
static void *regions_acquire(Executor *x, Err *err) {
    if (x->regions) return x->regions;
    void *r = x->be->alloc(regions_bytes(x), err);
    if (!r) err_prefix(err, "the exchange buffer");
    return r;
}

static void regions_release(Executor *x, void *r) {
    if (r != x->regions) x->be->free(r);
}

// All ranks: shard (S elements of dt) of every rank -> full (model layout).
static int gather_full(Executor *x, const Model *m, const void *shard, void *full, DType dt,
                       Err *err) {
    void *regions = regions_acquire(x, err);
    if (!regions) return -1;
    int rc = comm_all_gather(x->comm, shard, regions, x->region, dt, err);
    if (!rc) from_regions(x, m, regions, full, dtype_size(dt));
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

// ---------------------------------------------------------------- micro-steps

int executor_begin_micro(Executor *x, Model *m, Err *err) {
    if (x->mode != EXEC_FSDP) return 0;
    if (model_acquire(m, MODEL_WEIGHTS | MODEL_GRADS, err)) return -1;
    return gather_weights(x, m, err);
}

// The padding of the regions is never written by the fp32 layout; a bf16 weight gather
// through the same buffer (ddp) leaves other bytes there, so it is cleared first.
static int reduce_scatter_grads(Executor *x, Model *m, Err *err) {
    void *regions = regions_acquire(x, err);
    if (!regions) return -1;
    if (x->stage && regions == x->regions) x->be->zero(regions, regions_bytes(x));
    to_regions(x, m, m->grads, regions, sizeof(float));
    int rc =
        comm_reduce_scatter(x->comm, regions, x->shard.grads, x->region, DT_F32, COMM_AVG, err);
    regions_release(x, regions);
    return rc;
}

int executor_end_micro(Executor *x, Model *m, bool sync, Err *err) {
    switch (x->mode) {
    case EXEC_NONE:
        return 0;
    case EXEC_DDP:
        return sync ? reduce_scatter_grads(x, m, err) : 0;
    case EXEC_FSDP:
        model_release(m, MODEL_WEIGHTS);
        if (!sync) return 0;
        if (reduce_scatter_grads(x, m, err)) return -1;
        model_release(m, MODEL_GRADS);
        return 0;
    }
    return 0;
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
