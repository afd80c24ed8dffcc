// objective_pref.c: the preference objectives (train/objective.h), DPO and GRPO
// (engine/preference.h), offline and online. A sample is a record (data/records.h), a
// micro-batch its rows (train/pref_batch.h). Offline the records are a file's; online (the
// samples are prompts) each training micro-batch's are its rollout's (train/rollout.h), made when
// it is staged. Every pass's forwards first run the frozen reference (PASS_REFERENCE), whose
// per-token NLL the last stage keeps for each micro-batch until the policy's forward of that
// micro-batch; training keeps the policy's token weights from that forward to its backward,
// which a pipeline's schedule runs later. Online GRPO's behaviour policy is the policy as it was
// when the micro-batch's rollout was made: the policy's own NLL of the forward right after a new
// rollout (the same weights), kept for the steps that train on that rollout again.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "train/objective.h"
#include "train/pref_batch.h"
#include "train/rollout.h"

// The last stage's state of micro-batch k of a pass.
typedef struct {
    float *ref, *scale; // backend: the reference's NLL; d loss / d nll per token
    float *old;         // online GRPO: the behaviour policy's NLL of its rollout
    size_t ref_bytes, scale_bytes, old_bytes; // their capacities
} Kept;

// Online: the training micro-batches' rollouts, by their place in the step.
typedef struct {
    Rollout *rollout;
    const RecordSet **records; // (slots) each slot's, as rollout_records gave them
    bool *fresh;               // (slots) made for this step: its behaviour policy is the policy's
    int64_t *iota;             // (batch) 0, 1, ...: a rollout's records in order
    int staged;                // micro-batches staged since the last step's metrics
} Online;

typedef struct {
    RecordSet records;
    PrefBatch pb;
    PrefLoss loss;
    Kept *kept; // (n_kept) of cap_kept
    size_t n_kept, cap_kept;
    float *norms; // (cap_norms) grpo training: each micro-batch's token norm over the ranks
    size_t cap_norms;
    bool use_norms;    // the pass in flight is grpo training's
    double reward_sum; // grpo, the last stage: the sum of the step's micro-batches' mean rewards
    Online *online;    // NULL: offline
} Pref;

static const char *const DPO_METRICS[] = {"reward_margin", "reward_accuracy", NULL};
static const char *const GRPO_METRICS[] = {"kl", "clip_fraction", "reward_mean", NULL};
// Online: the rollouts' statistics after the loss's two (train/rollout.h RolloutStats).
#define ROLLOUT_METRICS                                                                            \
    "reward_mean", "reward_std", "response_len", "equal_reward_groups", "rollout_s", "reward_s",   \
        NULL
static const char *const ONLINE_DPO_METRICS[] = {"reward_margin", "reward_accuracy",
                                                 ROLLOUT_METRICS};
static const char *const ONLINE_GRPO_METRICS[] = {"kl", "clip_fraction", ROLLOUT_METRICS};

static int open_online(Pref *p, const ObjectiveSetup *s, RecordKind kind, int64_t *n, Err *err) {
    Online *on = p->online = calloc(1, sizeof *on);
    if (!on) return err_resource(err, "objective: out of memory");
    on->records = calloc((size_t)s->slots, sizeof *on->records);
    on->fresh = calloc((size_t)s->slots, sizeof *on->fresh);
    on->iota = malloc((size_t)s->batch * sizeof *on->iota);
    if (!on->records || !on->fresh || !on->iota)
        return err_resource(err, "objective: out of memory");
    for (int i = 0; i < s->batch; i++)
        on->iota[i] = i;
    RolloutSetup rs = {.spec = s->spec,
                       .cfg = s->cfg,
                       .kind = kind,
                       .slots = s->slots,
                       .rank = s->rank,
                       .exec = s->exec,
                       .model = s->model};
    return rollout_open(&on->rollout, &rs, n, err);
}

static void close_online(Online *on) {
    if (!on) return;
    rollout_close(on->rollout);
    free(on->records);
    free(on->fresh);
    free(on->iota);
    free(on);
}

// The records (offline: the file's; online: the rollout's, whose samples are its own) and the
// samples of micro-batch mb.
static const RecordSet *records_of(const Pref *p, const MicroBatch *mb, const int64_t **ids,
                                   int64_t *stride) {
    if (!p->online) {
        *ids = mb->ids, *stride = mb->stride;
        return &p->records;
    }
    *ids = p->online->iota, *stride = 1;
    return p->online->records[mb->index];
}

// Offline: the records file (or shards).
static int open_records(Pref *p, const ObjectiveSetup *s, RecordKind kind, int64_t *n, Err *err) {
    const TrainSpec *sp = s->spec;
    if (records_open(&p->records, sp->data_root_path, kind, (int)sp->group_size, s->cfg->vocab_size,
                     sp->skip_bad_records, err))
        return -1;
    if (p->records.skipped && s->rank == 0)
        fprintf(stderr, "warning: %s: %lld bad record(s) skipped; the first: %s\n",
                sp->data_root_path, (long long)p->records.skipped, p->records.first_skipped.msg);
    *n = p->records.n_records;
    return 0;
}

static int pref_open(Objective *o, const ObjectiveSetup *s, Err *err) {
    const TrainSpec *sp = s->spec;
    TrainType tt = sp->is.train_type;
    bool online = tt == TRAIN_ONLINE_DPO || tt == TRAIN_ONLINE_GRPO;
    RecordKind kind = tt == TRAIN_DPO || tt == TRAIN_ONLINE_DPO ? RECORDS_DPO : RECORDS_GRPO;
    o->metrics = kind == RECORDS_DPO ? (online ? ONLINE_DPO_METRICS : DPO_METRICS)
                                     : (online ? ONLINE_GRPO_METRICS : GRPO_METRICS);
    Pref *p = calloc(1, sizeof *p);
    if (!p) return err_resource(err, "objective: out of memory");
    o->state = p;
    records_init(&p->records, kind, (int)sp->group_size); // online: the group's shape only
    if ((online ? open_online : open_records)(p, s, kind, &o->n_samples, err)) return -1;
    pref_init(&p->loss, kind == RECORDS_DPO ? PREF_DPO : PREF_GRPO, (float)sp->dpo_beta,
              (float)sp->grpo_clip_eps, (float)sp->grpo_kl_coef, s->be);
    return pref_batch_init(&p->pb, &p->records, s->batch, s->window, err);
}

static void pref_close(Objective *o) {
    Pref *p = o->state;
    if (!p) return;
    for (size_t k = 0; k < p->n_kept; k++) {
        p->loss.be->free(p->kept[k].ref);
        p->loss.be->free(p->kept[k].scale);
        p->loss.be->free(p->kept[k].old);
    }
    close_online(p->online);
    free(p->kept);
    free(p->norms);
    pref_batch_free(&p->pb);
    pref_free(&p->loss);
    records_free(&p->records);
    free(p);
}

static long pref_fill(Objective *o, const MicroBatch *mb) {
    Pref *p = o->state;
    const int64_t *ids;
    int64_t stride;
    const RecordSet *rs = records_of(p, mb, &ids, &stride);
    pref_batch_fill(&p->pb, rs, ids, stride, micro_samples(mb));
    return (long)p->pb.rows * p->pb.T;
}

// Online: the micro-batch's rollout, kept or made now.
static int stage_rollout(Objective *o, Pref *p, const MicroBatch *mb, Err *err) {
    Online *on = p->online;
    on->staged++;
    if (rollout_records(on->rollout, mb, &on->records[mb->index], &on->fresh[mb->index], err)) {
        o->stop_checkpoint = true;
        return -1;
    }
    return 0;
}

// Its response tokens, its real tokens, and (the last stage) its mean reward for offline GRPO's
// metric: counted once per replica.
static int pref_stage(Objective *o, MicroBatch *mb, bool last_stage, long *tokens, Err *err) {
    Pref *p = o->state;
    if (p->online && stage_rollout(o, p, mb, err)) return -1;
    pref_fill(o, mb);
    mb->counted = p->pb.counted;
    if (last_stage && !p->online) p->reward_sum += p->pb.reward_sum / p->pb.rows;
    *tokens = p->pb.tokens;
    return 0;
}

// GRPO training: the ranks' batches are one batch, so each micro-batch's token mean runs over
// the response tokens of all of them: its count (from staging) summed over the job's ranks and
// divided by them (a pipeline replica's stages count the same tokens). Evaluation and DPO: each
// rank's own count.
static int pref_begin_pass(Objective *o, Executor *x, const MicroBatch *list, int n, PassKind pass,
                           Err *err) {
    Pref *p = o->state;
    p->use_norms = pass == PASS_TRAIN && p->loss.kind == PREF_GRPO;
    if (!p->use_norms) return 0;
    if (buf_reserve(&p->norms, &p->cap_norms, (size_t)n, sizeof *p->norms))
        return err_resource(err, "grpo: out of memory for %d token norms", n);
    for (int k = 0; k < n; k++)
        p->norms[k] = (float)list[k].counted;
    for (int k = 0; k < n; k += EXEC_AGREE_MAX)
        if (executor_sum(x, p->norms + k, n - k < EXEC_AGREE_MAX ? n - k : EXEC_AGREE_MAX, err))
            return -1;
    int ranks = executor_job_ranks(x);
    for (int k = 0; k < n; k++)
        p->norms[k] /= (float)ranks;
    return 0;
}

static int reserve_kept(Pref *p, int k, size_t n, bool old, Err *err) {
    if ((size_t)k >= p->n_kept) {
        if (buf_reserve(&p->kept, &p->cap_kept, (size_t)k + 1, sizeof *p->kept))
            return err_resource(err, "preference: out of memory");
        memset(p->kept + p->n_kept, 0, ((size_t)k + 1 - p->n_kept) * sizeof *p->kept);
        p->n_kept = (size_t)k + 1;
    }
    Kept *kp = &p->kept[k];
    const Backend *be = p->loss.be;
    if (backend_reserve(be, (void **)&kp->ref, &kp->ref_bytes, n * sizeof(float), err) ||
        backend_reserve(be, (void **)&kp->scale, &kp->scale_bytes, n * sizeof(float), err) ||
        (old && backend_reserve(be, (void **)&kp->old, &kp->old_bytes, n * sizeof(float), err)))
        return err_prefix(err, "preference: the state of micro-batch %d", k);
    return 0;
}

// The last stage's loss of micro-batch k after the policy's forward, or (the reference pass) the
// reference's NLL kept for it.
static int last_stage_loss(Pref *p, Model *m, int k, PassKind pass, float weight, Err *err) {
    const PrefBatch *b = &p->pb;
    size_t n = (size_t)b->rows * b->T;
    bool train = pass == PASS_TRAIN;
    // Online GRPO training: the behaviour policy's NLL, the policy's own after a new rollout.
    bool behaviour = train && p->online && p->loss.kind == PREF_GRPO;
    if (reserve_kept(p, k, n, behaviour && p->online->fresh[k], err)) return -1;
    Kept *kp = &p->kept[k];
    const Backend *be = m->be;
    if (pass == PASS_REFERENCE) {
        if (pref_keep_reference(&p->loss, m, b->rows, b->T, err)) return -1;
        be->copy(kp->ref, p->loss.ref_nll, n * sizeof(float));
        return 0;
    }
    be->copy(p->loss.ref_nll, kp->ref, n * sizeof(float));
    if (behaviour && p->online->fresh[k]) be->copy(kp->old, model_token_nll(m), n * sizeof(float));
    float norm = p->use_norms ? p->norms[k] : (float)b->counted;
    if (pref_loss(&p->loss, m, b->rows, b->T, b->advantages, behaviour ? kp->old : NULL, norm,
                  train ? weight : 1.0f, err))
        return -1;
    if (train) be->copy(kp->scale, p->loss.scale, n * sizeof(float));
    return 0;
}

static int pref_forward(Objective *o, Model *m, int k, PassKind pass, float weight, Err *err) {
    Pref *p = o->state;
    const PrefBatch *b = &p->pb;
    if (model_forward_tokens(m, b->inputs, b->targets, b->loss_mask, b->rows, b->T, err) < 0)
        return -1;
    return m->has_head ? last_stage_loss(p, m, k, pass, weight, err) : 0;
}

static void pref_backward(Objective *o, Model *m, int k, float weight) {
    (void)weight; // in the token weights already
    Pref *p = o->state;
    model_backward_weighted(m, m->has_head ? p->kept[k].scale : NULL);
}

// Online: the rollouts' statistics, each micro-batch's summed (the trainer divides by the
// micro-batches of every rank); the seconds are this rank's, times its micro-batches, so that
// the division leaves their mean over the ranks.
static void rollout_metrics(Online *on, float *sums) {
    RolloutStats st;
    rollout_take_stats(on->rollout, &st);
    sums[0] = (float)st.reward_mean;
    sums[1] = (float)st.reward_std;
    sums[2] = (float)st.response_len;
    sums[3] = (float)st.equal_groups;
    sums[4] = (float)(st.generate_s * on->staged);
    sums[5] = (float)(st.reward_s * on->staged);
    on->staged = 0;
}

// DPO: the reward margin and accuracy of the model's stats; GRPO: its KL and clip fraction, and
// (offline) the mean reward the step's micro-batches staged; online the rollouts' statistics.
static void pref_step_metrics(Objective *o, const double stats[MODEL_N_STATS], float *sums) {
    Pref *p = o->state;
    sums[0] = (float)stats[MODEL_STAT_PREF_A];
    sums[1] = (float)stats[MODEL_STAT_PREF_B];
    if (p->online)
        rollout_metrics(p->online, sums + 2);
    else if (p->loss.kind == PREF_GRPO)
        sums[2] = (float)p->reward_sum;
    p->reward_sum = 0;
}

const ObjectiveOps OBJECTIVE_PREF = {.reference = true,
                                     .open = pref_open,
                                     .close = pref_close,
                                     .fill = pref_fill,
                                     .stage = pref_stage,
                                     .begin_pass = pref_begin_pass,
                                     .forward = pref_forward,
                                     .backward = pref_backward,
                                     .step_metrics = pref_step_metrics};
