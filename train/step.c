// step.c: the passes of micro-batches (train/step.h).
#include "train/step.h"

// A pass in flight: what the pipeline's callbacks (PipelineWork) run for each micro-batch.
typedef struct {
    const StepRunner *r;
    PassKind pass;
    const MicroBatch *list; // (n) the pass's micro-batches
    int n;
    float weight; // training: each micro-batch's loss weight
    double *sum;  // evaluation: the losses, each times its micro-batch's samples
    // Each micro-batch is an executor micro-step of its own: with one stage, fsdp gathers the
    // weights for each and frees them after it, and ddp reduces the last one's gradients while
    // its backward runs. A pipeline stage interleaves its micro-batches, so there the whole pass
    // is one micro-step, its gradients reduced after it (executor_sync_grads).
    bool apart;
} Pass;

static MicroStep micro_kind(const Pass *p, int k) {
    if (p->pass != PASS_TRAIN) return MICRO_EVAL;
    return p->apart && k + 1 == p->n ? MICRO_SYNC : MICRO_ACCUMULATE;
}

static long pass_rows(void *ctx, int k) {
    const Pass *p = ctx;
    return p->r->obj->ops->fill(p->r->obj, &p->list[k]);
}

static int pass_forward(void *ctx, int k, Err *err) {
    const Pass *p = ctx;
    Objective *o = p->r->obj;
    Model *m = p->r->model;
    bool own = p->apart && p->pass != PASS_REFERENCE; // the reference pass: one bracket
    if (own && executor_begin_micro(p->r->exec, m, micro_kind(p, k), err)) return -1;
    o->ops->fill(o, &p->list[k]);
    if (p->pass == PASS_TRAIN) m->noise_seed = p->list[k].noise_seed;
    if (o->ops->forward(o, m, k, p->pass, p->weight, err)) return -1;
    if (p->pass == PASS_EVAL && m->has_head) {
        double stats[MODEL_N_STATS];
        model_read_stats(m, stats); // the micro-batch's mean loss; resets the sums
        *p->sum += stats[MODEL_STAT_LOSS] * (double)p->list[k].nb;
    }
    return own && p->pass == PASS_EVAL ? executor_end_micro(p->r->exec, m, MICRO_EVAL, err) : 0;
}

static int pass_backward(void *ctx, int k, Err *err) {
    const Pass *p = ctx;
    Model *m = p->r->model;
    p->r->obj->ops->backward(p->r->obj, m, k, p->weight);
    if (model_take_fault(m, err)) return -1; // the experts' exchanges (expert parallelism)
    return p->apart ? executor_end_micro(p->r->exec, m, micro_kind(p, k), err) : 0;
}

static int run_pass(const Pass *p, Err *err) {
    PipelineWork w = {.rows = pass_rows,
                      .forward = pass_forward,
                      .backward = p->pass == PASS_TRAIN ? pass_backward : NULL,
                      .ctx = (void *)p};
    return pipeline_run(p->r->pipe, p->r->model, &w, p->n, p->pass == PASS_TRAIN, err);
}

// Runs f with the model's NEFTune noise off (evaluation, the reference).
static int without_noise(const Pass *p, int (*f)(const Pass *, Err *), Err *err) {
    Model *m = p->r->model;
    float alpha = m->neftune_alpha;
    m->neftune_alpha = 0.0f;
    int rc = f(p, err);
    m->neftune_alpha = alpha;
    return rc;
}

static int reference_forwards(const Pass *p, Err *err) {
    Executor *x = p->r->exec;
    int rc = executor_begin_reference(x, p->r->model, err) || run_pass(p, err);
    int end = executor_end_reference(x, p->r->model, rc ? NULL : err);
    return rc || end ? -1 : 0;
}

// What the objective needs from every rank, then (an objective with a reference) the
// reference's forwards of the pass's micro-batches.
static int begin_pass(const StepRunner *r, const MicroBatch *list, int n, PassKind pass, Err *err) {
    Objective *o = r->obj;
    if (o->ops->begin_pass && o->ops->begin_pass(o, r->exec, list, n, pass, err)) return -1;
    if (!o->ops->reference) return 0;
    Pass ref = {.r = r, .pass = PASS_REFERENCE, .list = list, .n = n};
    return without_noise(&ref, reference_forwards, err);
}

int step_train(const StepRunner *r, const MicroBatch *list, int n, float weight, Err *err) {
    Pass p = {.r = r,
              .pass = PASS_TRAIN,
              .list = list,
              .n = n,
              .weight = weight,
              .apart = r->pipe->stages == 1};
    Executor *x = r->exec;
    Model *m = r->model;
    if (begin_pass(r, list, n, PASS_TRAIN, err)) return -1;
    if (p.apart) return run_pass(&p, err);
    return executor_begin_micro(x, m, MICRO_ACCUMULATE, err) || run_pass(&p, err) ||
                   executor_end_micro(x, m, MICRO_ACCUMULATE, err) ||
                   pipeline_sum_tied(r->pipe, m, err) || executor_sync_grads(x, m, err)
               ? -1
               : 0;
}

static int eval_forwards(const Pass *p, Err *err) {
    Executor *x = p->r->exec;
    Model *m = p->r->model;
    if (p->apart) return run_pass(p, err);
    if (executor_begin_micro(x, m, MICRO_EVAL, err)) return -1;
    int rc = run_pass(p, err);
    int end = executor_end_micro(x, m, MICRO_EVAL, rc ? NULL : err);
    return rc || end ? -1 : 0;
}

int step_eval(const StepRunner *r, const MicroBatch *list, int n, double *sum, Err *err) {
    Pass p = {
        .r = r, .pass = PASS_EVAL, .list = list, .n = n, .sum = sum, .apart = r->pipe->stages == 1};
    return begin_pass(r, list, n, PASS_EVAL, err) || without_noise(&p, eval_forwards, err) ? -1 : 0;
}
