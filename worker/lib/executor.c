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

// The shard view: the owned tensors, in AstrAI order, packed into the region.
static int build_shard(Executor *x, const Model *m, Err *err) {
    Model *s = &x->shard;
    memset(s, 0, sizeof *s);
    s->cfg = m->cfg;
    s->params = calloc((size_t)m->n_params, sizeof *s->params);
    if (!s->params) return err_set(err, "shard plan: out of memory");
    for (int i = 0; i < m->n_params; i++) {
        if (x->owner[i] != x->rank) continue;
        s->params[s->n_params] = m->params[i];
        s->params[s->n_params].offset = x->region_off[i];
        s->n_params++;
    }
    s->num_floats = x->region; // the optimizer state spans the region, padding included
    s->weights = calloc(x->region ? x->region : 1, sizeof(float));
    s->grads = calloc(x->region ? x->region : 1, sizeof(float));
    if (!s->weights || !s->grads) return err_set(err, "shard plan: out of memory for the shard");
    return 0;
}

// Region offsets of every tensor in its owner's region (each rank computes every layout).
static void place_foreign(Executor *x, const Model *m) {
    size_t *used = calloc((size_t)x->world, sizeof *used);
    for (int i = 0; i < m->n_params; i++) {
        x->region_off[i] = used[x->owner[i]];
        used[x->owner[i]] += m->params[i].numel;
    }
    free(used);
}

static int plan_shards(Executor *x, Model *m, Err *err) {
    x->owner = calloc((size_t)m->n_params, sizeof *x->owner);
    x->region_off = calloc((size_t)m->n_params, sizeof *x->region_off);
    size_t *load = calloc((size_t)x->world, sizeof *load);
    if (!x->owner || !x->region_off || !load) {
        free(load);
        return err_set(err, "shard plan: out of memory");
    }
    if (assign_owners(x, m, load)) {
        free(load);
        return err_set(err, "shard plan: out of memory");
    }
    for (int r = 0; r < x->world; r++)
        if (load[r] > x->region) x->region = load[r];
    free(load);
    place_foreign(x, m);
    return build_shard(x, m, err);
}

int executor_init(Executor *x, ExecMode mode, Comm *comm, Model *m, Err *err) {
    memset(x, 0, sizeof *x);
    x->mode = comm && comm_world_size(comm) > 1 ? mode : EXEC_NONE; // one rank: nothing to share
    x->comm = comm;
    x->rank = comm ? comm_rank(comm) : 0;
    x->world = comm ? comm_world_size(comm) : 1;
    if (x->mode == EXEC_NONE) return 0;
    if (plan_shards(x, m, err)) return -1;
    // ddp keeps its exchange buffer for the whole run; fsdp allocates it per use, so that
    // between steps a rank holds only its shard.
    if (x->mode == EXEC_DDP &&
        !(x->regions = calloc((size_t)x->world * x->region + 1, sizeof(float))))
        return err_set(err, "ddp: out of memory for the exchange buffer");
    return 0;
}

void executor_free(Executor *x) {
    free(x->owner);
    free(x->region_off);
    free(x->shard.params);
    free(x->shard.weights);
    free(x->shard.grads);
    free(x->regions);
    memset(x, 0, sizeof *x);
}

Model *executor_opt_model(Executor *x, Model *m) {
    return x->mode == EXEC_NONE ? m : &x->shard;
}

// ---------------------------------------------------------------- region <-> model layout

// full (model layout) -> regions (world*S): every tensor into its owner's region.
static void to_regions(const Executor *x, const Model *m, const float *full, float *regions) {
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        memcpy(regions + (size_t)x->owner[i] * x->region + x->region_off[i], full + p->offset,
               p->numel * sizeof(float));
    }
}

// regions (world*S) -> full (model layout).
static void from_regions(const Executor *x, const Model *m, const float *regions, float *full) {
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        memcpy(full + p->offset, regions + (size_t)x->owner[i] * x->region + x->region_off[i],
               p->numel * sizeof(float));
    }
}

// The (world*S) exchange buffer: ddp's persistent one, or a fresh zeroed one (fsdp).
static float *regions_acquire(Executor *x, Err *err) {
    if (x->regions) return x->regions;
    float *r = calloc((size_t)x->world * x->region + 1, sizeof(float));
    if (!r) err_set(err, "out of memory for the exchange buffer");
    return r;
}

static void regions_release(Executor *x, float *r) {
    if (r != x->regions) free(r);
}

// All ranks: shard (S) of every rank -> full (model layout).
static int gather_full(Executor *x, const Model *m, const float *shard, float *full, Err *err) {
    float *regions = regions_acquire(x, err);
    if (!regions) return -1;
    int rc = comm_all_gather(x->comm, shard, regions, x->region, err);
    if (!rc) from_regions(x, m, regions, full);
    regions_release(x, regions);
    return rc;
}

// full (model layout) -> this rank's shard (S), no communication.
static void take_own(const Executor *x, const Model *m, const float *full, float *shard) {
    for (int i = 0; i < m->n_params; i++)
        if (x->owner[i] == x->rank)
            memcpy(shard + x->region_off[i], full + m->params[i].offset,
                   m->params[i].numel * sizeof(float));
}

// ---------------------------------------------------------------- micro-steps

int executor_begin_micro(Executor *x, Model *m, Err *err) {
    if (x->mode != EXEC_FSDP) return 0;
    if (model_acquire(m, true, true, err)) return -1;
    return gather_full(x, m, x->shard.weights, m->weights, err);
}

// The padding of the regions is never written, so it stays zero in a reused buffer.
static int reduce_scatter_grads(Executor *x, Model *m, Err *err) {
    float *regions = regions_acquire(x, err);
    if (!regions) return -1;
    to_regions(x, m, m->grads, regions);
    int rc = comm_reduce_scatter(x->comm, regions, x->shard.grads, x->region, COMM_AVG, err);
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
        model_release(m, true, false);
        if (!sync) return 0;
        if (reduce_scatter_grads(x, m, err)) return -1;
        model_release(m, false, true);
        return 0;
    }
    return 0;
}

int executor_clip(Executor *x, Model *m, float max_norm, float *norm, Err *err) {
    Model *om = executor_opt_model(x, m);
    double total = grad_sq_sum(om);
    if (x->mode != EXEC_NONE) { // sharded gradients: sum the ranks' sums of squares
        float sq = (float)total;
        if (comm_all_reduce(x->comm, &sq, 1, COMM_SUM, err)) return -1;
        total = sq;
    }
    *norm = (float)sqrt(total);
    clip_grads_to(om, sqrt(total), max_norm);
    return 0;
}

int executor_after_step(Executor *x, Model *m, Err *err) {
    return x->mode == EXEC_DDP ? gather_full(x, m, x->shard.weights, m->weights, err) : 0;
}

int executor_sum(Executor *x, float *vals, int n, Err *err) {
    return x->comm ? comm_all_reduce(x->comm, vals, (size_t)n, COMM_SUM, err) : 0;
}

// ---------------------------------------------------------------- checkpoints

int executor_gather_weights(Executor *x, Model *m, Err *err) {
    if (x->mode != EXEC_FSDP) return 0;
    if (model_acquire(m, true, false, err)) return -1;
    return gather_full(x, m, x->shard.weights, m->weights, err);
}

void executor_drop_full(Executor *x, Model *m) {
    if (x->mode == EXEC_FSDP) model_release(m, true, false);
}

int executor_adopt_weights(Executor *x, Model *m, Err *err) {
    (void)err;
    if (x->mode == EXEC_NONE) return 0;
    take_own(x, m, m->weights, x->shard.weights);
    if (x->mode == EXEC_FSDP) model_release(m, true, true);
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
    for (int k = 0; k < n; k++) {
        if (gather_full(x, m, mine[k], all[k], err)) return -1;
    }
    return 0;
}

void executor_scatter_optim(Executor *x, Model *m, const Optimizer *full, Optimizer *opt) {
    float *mine[3], *all[3];
    int n = state_arrays(opt, mine);
    state_arrays(full, all);
    opt->step = full->step;
    for (int k = 0; k < n; k++) {
        take_own(x, m, all[k], mine[k]);
    }
}
