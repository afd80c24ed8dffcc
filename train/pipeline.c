// pipeline.c: the stages of a pipeline (train/pipeline.h): the partition of the blocks, the
// ranks' layout and groups, the run of a schedule's ops, the tied embedding's gradient and the
// checkpoint's gathering of the stages on rank 0.
#include "train/pipeline.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"

// ---------------------------------------------------------------- partition

// Multiply-adds per token of one decoder block, forward (backward costs twice that for every
// block and the head alike, so the forward's proportions are the step's): the projections and
// the causal attention over a window (on average window/2 keys, scores and values).
static double block_cost(const ModelConfig *c, long window) {
    double C = c->hidden_size, FF = c->intermediate_size,
           QKV = (double)(c->num_attention_heads + 2 * c->num_key_value_heads) * c->head_dim;
    double proj = C * QKV + C * C * (c->use_gated_attention ? 2 : 1) + 3 * C * FF;
    return proj + (double)window * C;
}

int pipeline_partition(const ModelConfig *cfg, int stages, long window, int *blocks, Err *err) {
    int L = cfg->num_hidden_layers, P = stages;
    double b = block_cost(cfg, window), head = (double)cfg->hidden_size * cfg->vocab_size;
    // best[p*(L+1) + l]: the least largest stage cost of the first l blocks in p stages; cut: where
    // its last stage starts.
    double *best = malloc((size_t)(P + 1) * (size_t)(L + 1) * sizeof *best);
    int *cut = malloc((size_t)(P + 1) * (size_t)(L + 1) * sizeof *cut);
    if (!best || !cut) {
        free(best);
        free(cut);
        return err_resource(err, "pipeline: out of memory for the partition of %d blocks", L);
    }
    for (int l = 0; l <= L; l++)
        best[l] = l ? INFINITY : 0;
    for (int p = 1; p <= P; p++)
        for (int l = 0; l <= L; l++) {
            double *at = &best[p * (L + 1) + l];
            *at = INFINITY;
            for (int k = p - 1; k < l; k++) {
                double cost = (l - k) * b + (p == P ? head : 0);
                double worst = fmax(best[(p - 1) * (L + 1) + k], cost);
                if (worst < *at) *at = worst, cut[p * (L + 1) + l] = k;
            }
        }
    blocks[P] = L;
    for (int p = P, l = L; p > 0; p--)
        l = blocks[p - 1] = cut[p * (L + 1) + l];
    free(best);
    free(cut);
    return 0;
}

// ---------------------------------------------------------------- layout

// Tied embeddings: the first and the last stage of each replica in a group of two (the other
// stages alone), whose all_reduce sums the two gradients in rank order on both.
static int split_tied(Pipeline *p, const ModelConfig *cfg, int rank, Err *err) {
    p->tied_peer = -1;
    if (!cfg->tie_word_embeddings || p->stages == 1) return 0;
    bool end = p->stage == 0 || p->stage == p->stages - 1;
    if (end) p->tied_peer = p->stage == 0 ? rank + p->stages - 1 : rank - (p->stages - 1);
    int color = end ? p->replica : p->replicas + rank;
    return comm_split(p->world, color, rank, &p->tied, err);
}

int pipeline_check(const ModelConfig *cfg, int stages, Err *err) {
    if (stages > cfg->num_hidden_layers)
        return err_set(err, "pp_size: %d stages but the model has %d decoder blocks", stages,
                       cfg->num_hidden_layers);
    return 0;
}

int pipeline_init(Pipeline *p, Comm *world, int stages, PpScheduleKind kind, const ModelConfig *cfg,
                  long window, const Backend *be, Err *err) {
    memset(p, 0, sizeof *p);
    int size = world ? comm_world_size(world) : 1, rank = world ? comm_rank(world) : 0;
    if (stages < 1 || size % stages)
        return err_set(err, "pp_size: %d does not divide the %d rank(s) of the job", stages, size);
    if (pipeline_check(cfg, stages, err)) return -1;
    *p = (Pipeline){.stages = stages,
                    .stage = rank % stages,
                    .replicas = size / stages,
                    .replica = rank / stages,
                    .kind = kind,
                    .world = world,
                    .be = be};
    p->prev = p->stage > 0 ? rank - 1 : -1;
    p->next = p->stage + 1 < stages ? rank + 1 : -1;
    if (!(p->blocks = malloc((size_t)(stages + 1) * sizeof *p->blocks)) ||
        pipeline_partition(cfg, stages, window, p->blocks, err))
        return p->blocks ? -1 : err_resource(err, "pipeline: out of memory");
    p->first_block = p->blocks[p->stage];
    p->end_block = p->blocks[p->stage + 1];
    if (stages == 1)
        p->group = world; // every rank a replica of the whole model
    else if (p->replicas > 1 && comm_split(world, p->stage, p->replica, &p->group, err))
        return err_prefix(err, "pipeline stage %d: the group of its %d replicas", p->stage,
                          p->replicas);
    if (split_tied(p, cfg, rank, err))
        return err_prefix(err, "pipeline: the tied embedding's group");
    return 0;
}

void pipeline_free(Pipeline *p) {
    for (int k = 0; k < p->n_sets; k++)
        p->be->free(p->act_in[k]);
    if (p->be) p->be->free(p->grad_in);
    free(p->act_in);
    free(p->act_bytes);
    free(p->ops);
    free(p->waits);
    free(p->blocks);
    comm_destroy(p->tied);
    if (p->group != p->world) comm_destroy(p->group);
    memset(p, 0, sizeof *p);
}

// ---------------------------------------------------------------- a run of micro-batches

static int reserve_sets(Pipeline *p, int n, Err *err) {
    if (n <= p->n_sets) return 0;
    void **in = realloc(p->act_in, (size_t)n * sizeof *in);
    if (in) p->act_in = in;
    size_t *bytes = in ? realloc(p->act_bytes, (size_t)n * sizeof *bytes) : NULL;
    if (!bytes) return err_resource(err, "pipeline: out of memory for %d activation sets", n);
    p->act_bytes = bytes;
    for (; p->n_sets < n; p->n_sets++)
        p->act_in[p->n_sets] = NULL, p->act_bytes[p->n_sets] = 0;
    return 0;
}

// The schedule of a run into p->ops; returns its length, or -1.
static int build_ops(Pipeline *p, int n, bool train, Err *err) {
    if (PP_MAX_OPS(n) > p->cap_ops) {
        free(p->ops);
        free(p->waits);
        p->cap_ops = 0;
        p->waits = malloc((size_t)PP_MAX_OPS(n) * sizeof *p->waits);
        if (!(p->ops = malloc((size_t)PP_MAX_OPS(n) * sizeof *p->ops)) || !p->waits)
            return err_resource(err, "pipeline: out of memory for the schedule of %d micro-batches",
                                n);
        p->cap_ops = PP_MAX_OPS(n);
    }
    int n_ops = train ? pp_schedule_build(p->kind, p->stage, p->stages, n, p->ops)
                      : pp_schedule_forward_only(p->stage, p->stages, n, p->ops);
    if (n_ops < 0) return err_set(err, "pipeline: no schedule for %d micro-batch(es)", n);
    return n_ops;
}

typedef struct {
    Pipeline *p;
    Model *m;
    const PipelineWork *w;
    int sets; // activation sets in turn: micro-batch k uses set k % sets
} Run;

static size_t act_bytes(const Run *r, int k) {
    return (size_t)r->w->rows(r->w->ctx, k) * r->m->cfg.hidden_size * dtype_size(r->m->be->dtype);
}

// One transfer of the schedule as a comm_p2p entry.
static int transfer(Run *r, const PpOp *op, CommP2p *out, Err *err) {
    Pipeline *p = r->p;
    Model *m = r->m;
    int set = op->micro % r->sets;
    size_t bytes = act_bytes(r, op->micro);
    if (model_select_acts(m, set, err)) return -1;
    switch (op->kind) {
    case PP_RECV_ACT:
        *out = (CommP2p){.peer = p->prev, .send = 0, .bytes = bytes};
        if (backend_reserve(p->be, &p->act_in[set], &p->act_bytes[set], bytes, err))
            return err_prefix(err, "pipeline: micro-batch %d's input", op->micro);
        out->buf = p->act_in[set];
        return 0;
    case PP_SEND_ACT:
        *out = (CommP2p){
            .peer = p->next, .send = 1, .buf = (void *)model_stage_output(m), .bytes = bytes};
        return 0;
    case PP_RECV_GRAD:
        if (backend_reserve(p->be, &p->grad_in, &p->grad_bytes, bytes, err))
            return err_prefix(err, "pipeline: micro-batch %d's output gradient", op->micro);
        *out = (CommP2p){.peer = p->next, .send = 0, .buf = p->grad_in, .bytes = bytes};
        return 0;
    default: // PP_SEND_GRAD
        *out = (CommP2p){
            .peer = p->prev, .send = 1, .buf = (void *)model_stage_dinput(m), .bytes = bytes};
        return 0;
    }
}

// The transfers ops[0..n) as one group, started: on GPUs it runs on the comm stream while the
// host goes on (the compute that needs it waits on the device, comm_join); shm finishes it here.
static int transfer_group(Run *r, const PpOp *ops, int n, Err *err) {
    CommP2p group[4];
    for (int i = 0; i < n; i++)
        if (transfer(r, &ops[i], &group[i], err)) return -1;
    if (!comm_p2p_start(r->p->world, group, n, err)) return 0;
    // Name the neighbours: the peers of the group's transfers, by stage and rank.
    char peers[96] = "";
    for (int i = 0, len = 0; i < n && len < (int)sizeof peers; i++) {
        int peer = group[i].peer, stage = r->p->stage + (peer == r->p->next ? 1 : -1);
        bool named = false;
        for (int k = 0; k < i; k++)
            named |= group[k].peer == peer;
        if (!named)
            len += snprintf(peers + len, sizeof peers - (size_t)len, "%sstage %d (rank %d)",
                            len ? " and " : "", stage, peer);
    }
    return err_prefix(err,
                      "pipeline stage %d of %d (replica %d), micro-batch %d, transfers with %s",
                      r->p->stage, r->p->stages, r->p->replica, ops[0].micro, peers);
}

// Computation ops[i], after waiting (on the device) for the transfers before it if it must.
static int compute(Run *r, const PpOp *op, bool wait, Err *err) {
    Model *m = r->m;
    if ((wait && comm_join(r->p->world, err)) || model_select_acts(m, op->micro % r->sets, err))
        return -1;
    if (op->kind == PP_BACKWARD) {
        m->stage_dout = r->p->grad_in;
        return r->w->backward(r->w->ctx, op->micro, err);
    }
    m->stage_input = r->p->act_in[op->micro % r->sets];
    return r->w->forward(r->w->ctx, op->micro, err);
}

int pipeline_run(Pipeline *p, Model *m, const PipelineWork *w, int n, bool train, Err *err) {
    if (n == 0) return 0; // a replica without a validation sample where forwards are not collective
    int n_ops = build_ops(p, n, train, err);
    if (n_ops < 0) return -1;
    Run r = {.p = p, .m = m, .w = w, .sets = train ? pp_schedule_peak_held(p->ops, n_ops) : 1};
    if (reserve_sets(p, r.sets, err)) return -1;
    pp_schedule_waits(p->ops, n_ops, r.sets, p->waits);
    int rc = 0;
    for (int i = 0; i < n_ops && !rc;) {
        int j = i;
        while (j < n_ops && pp_is_transfer(p->ops[j].kind) && j - i < 4)
            j++;
        double start = clock_mono_s();
        rc = j > i ? transfer_group(&r, &p->ops[i], j - i, err)
                   : compute(&r, &p->ops[i], p->waits[i], err);
        if (train) *(j > i ? &p->transfer_s : &p->compute_s) += clock_mono_s() - start;
        i = j > i ? j : i + 1;
    }
    m->stage_input = m->stage_dout = NULL;
    if (!rc && p->world && comm_wait(p->world, err))
        rc = err_prefix(err, "pipeline stage %d of %d (replica %d): the run's transfers", p->stage,
                        p->stages, p->replica);
    if (!rc) rc = model_select_acts(m, 0, err);
    return rc;
}

// ---------------------------------------------------------------- tied embedding

int pipeline_sum_tied(Pipeline *p, Model *m, Err *err) {
    if (p->tied_peer < 0) return 0;
    const ParamSpec *e = model_param(m, "embed_tokens.weight");
    if (!e || !m->grads) return err_set(err, "pipeline: no gradient of the tied embedding here");
    if (comm_all_reduce(p->tied, m->grads + e->offset, e->numel, DT_F32, COMM_SUM, err))
        return err_prefix(err, "pipeline: the tied embedding's gradient (stages 0 and %d)",
                          p->stages - 1);
    return 0;
}

int pipeline_norm_skip(const Pipeline *p, const Model *m) {
    if (p->tied_peer < 0 || p->stage == 0) return -1;
    const ParamSpec *e = model_param(m, "embed_tokens.weight");
    return e ? (int)(e - m->params) : -1;
}

// ---------------------------------------------------------------- checkpoints

// Stage s's master weights and optimizer state from its first replica (global rank s).
static int receive_stage(Pipeline *p, const ModelConfig *cfg, const Optimizer *like, int s,
                         PipelineParts *parts, Err *err) {
    ParamView *v = &parts->views[s];
    Optimizer *o = &parts->owned[s];
    *v = (ParamView){.be = p->be};
    if (model_stage_table(cfg, p->blocks[s], p->blocks[s + 1], &parts->tables[s], &v->n_params,
                          &v->num_floats, err))
        return -1;
    v->params = parts->tables[s];
    if (!(v->master = p->be->alloc(v->num_floats * sizeof(float), err)) ||
        optim_create(o, like->kind, v, like->weight_decay, err))
        return err_prefix(err, "checkpoint: stage %d's state", s);
    o->step = like->step;
    parts->opts[s] = o;
    float *arrays[3];
    int n = optim_state_arrays(o, arrays);
    int rc = comm_recv(p->world, v->master, v->num_floats * sizeof(float), s, err);
    for (int k = 0; k < n && !rc; k++)
        rc = comm_recv(p->world, arrays[k], v->num_floats * sizeof(float), s, err);
    return rc ? err_prefix(err, "checkpoint: stage %d's state from rank %d", s, s) : 0;
}

static int send_stage(Pipeline *p, const Model *m, const Optimizer *opt, Err *err) {
    float *arrays[3];
    int n = optim_state_arrays(opt, arrays);
    size_t bytes = m->num_floats * sizeof(float);
    int rc = comm_send(p->world, m->master, bytes, 0, err);
    for (int k = 0; k < n && !rc; k++)
        rc = comm_send(p->world, arrays[k], bytes, 0, err);
    return rc ? err_prefix(err, "checkpoint: stage %d's state to rank 0", p->stage) : 0;
}

int pipeline_collect(Pipeline *p, Model *m, const Optimizer *opt, PipelineParts *parts, Err *err) {
    int P = p->stages;
    memset(parts, 0, sizeof *parts);
    if (p->replica != 0) return 0;
    if (p->stage != 0) return send_stage(p, m, opt, err);
    parts->be = p->be;
    parts->views = calloc((size_t)P, sizeof *parts->views);
    parts->opts = calloc((size_t)P, sizeof *parts->opts);
    parts->owned = calloc((size_t)P, sizeof *parts->owned);
    parts->tables = calloc((size_t)P, sizeof *parts->tables);
    if (!parts->views || !parts->opts || !parts->owned || !parts->tables)
        return err_resource(err, "checkpoint: out of memory for %d stages", P);
    parts->n = P;
    parts->views[0] = model_view(m);
    parts->opts[0] = opt;
    for (int s = 1; s < P; s++)
        if (receive_stage(p, &m->cfg, opt, s, parts, err)) return -1;
    return 0;
}

void pipeline_parts_free(PipelineParts *parts) {
    for (int s = 1; s < parts->n; s++) {
        parts->be->free(parts->views[s].master);
        optim_free(&parts->owned[s]);
        free(parts->tables[s]);
    }
    free(parts->views);
    free(parts->opts);
    free(parts->owned);
    free(parts->tables);
    memset(parts, 0, sizeof *parts);
}
