// rollout.c: the online strategies' rollouts (train/rollout.h).
#include "train/rollout.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/splitmix64.h"
#include "train/policy.h"
#include "train/prompts.h"
#include "train/reward.h"

// A micro-batch slot's kept rollout.
typedef struct {
    RecordSet records;
    int64_t *ids; // (batch) the prompts it was made for
    int nb;
    long step;          // the step it was made at
    bool valid;         // made, and nothing failed since
    RolloutStats stats; // its own (generate_s, reward_s: 0 once kept)
} Slot;

struct Rollout {
    RolloutSetup s;
    PromptList prompts;
    Tokenizer *tok;
    Reward *reward;
    GenerateOptions gen;
    int32_t stop[PROMPTS_MAX_STOP];
    int G;
    int context;   // the model's max_position_embeddings
    long requests; // reward requests made by this rank (their ids)
    Slot *slots;
    RolloutStats step; // the micro-batches' since rollout_take_stats
    // a micro-batch's B x G sequences (B <= batch_per_device), reused
    Generation *out;           // (B*G) prompt i's response j at i*G + j
    char **texts;              // (B*G)
    float *rewards;            // (B*G)
    const int32_t **prompt_of; // (B*G)
    int *lens, *limits;        // (B*G)
    uint64_t *sequences;       // (B*G)
};

static int open_source(Rollout *r, Err *err) {
    const TrainSpec *sp = r->s.spec;
    RewardOptions o = {.command = *sp->reward_command ? sp->reward_command : NULL,
                       .url = *sp->reward_url ? sp->reward_url : NULL,
                       .timeout_s = sp->reward_timeout_s,
                       .restarts = (int)sp->reward_restarts};
    return reward_open(&r->reward, &o, err);
}

// The prompts file (data_root_path), rendered and tokenized as AstrAI's rollout does: every
// prompt must leave room for one generated token (a longer rollout_max_tokens is cut to the
// context, as AstrAI's scheduler cuts it).
static int read_prompts(Rollout *r, Err *err) {
    const TrainSpec *sp = r->s.spec;
    const ModelConfig *c = r->s.cfg;
    PromptLimits lim = {c->vocab_size, c->max_position_embeddings, 1, "a generated token"};
    if (prompts_open_tokenizer(sp->tokenizer, sp->param_path, "tokenizer", &r->tok, err) ||
        prompts_read_jsonl(&r->prompts, sp->data_root_path, r->tok,
                           *sp->chat_template ? sp->chat_template : NULL, 1, &lim, err) ||
        prompts_stop_tokens(r->tok, sp->param_path, c->vocab_size, r->stop, &r->gen.n_stop, err))
        return err_prefix(err, "train_type %s", sp->train_type);
    return 0;
}

static int alloc_batch(Rollout *r, Err *err) {
    size_t n = (size_t)r->s.spec->batch_per_device * (size_t)r->G;
    int slots = r->s.slots;
    r->out = calloc(n, sizeof *r->out);
    r->texts = calloc(n, sizeof *r->texts);
    r->rewards = calloc(n, sizeof *r->rewards);
    r->prompt_of = calloc(n, sizeof *r->prompt_of);
    r->lens = calloc(n, sizeof *r->lens);
    r->limits = calloc(n, sizeof *r->limits);
    r->sequences = calloc(n, sizeof *r->sequences);
    r->slots = calloc((size_t)slots, sizeof *r->slots);
    if (!r->out || !r->texts || !r->rewards || !r->prompt_of || !r->lens || !r->limits ||
        !r->sequences || !r->slots)
        return err_resource(err, "rollout: out of memory");
    for (int k = 0; k < slots; k++) {
        records_init(&r->slots[k].records, r->s.kind, r->G);
        if (!(r->slots[k].ids = malloc((size_t)r->s.spec->batch_per_device * sizeof(int64_t))))
            return err_resource(err, "rollout: out of memory");
    }
    return 0;
}

int rollout_open(Rollout **out, const RolloutSetup *s, int64_t *n_prompts, Err *err) {
    Rollout *r = calloc(1, sizeof *r);
    if (!r) return err_resource(err, "rollout: out of memory");
    *out = r;
    r->s = *s;
    const TrainSpec *sp = s->spec;
    r->G = (int)sp->group_size;
    r->context = s->cfg->max_position_embeddings;
    r->gen = (GenerateOptions){.sample = SAMPLE_OPTIONS_DEFAULT, .stop = r->stop};
    r->gen.sample.temperature = (float)sp->rollout_temperature;
    r->gen.sample.top_k = (int)sp->rollout_top_k;
    r->gen.sample.top_p = (float)sp->rollout_top_p;
    if (sample_options_check(&r->gen.sample, err)) return err_prefix(err, "rollout_*");
    if (read_prompts(r, err) || alloc_batch(r, err) || open_source(r, err)) return -1;
    *n_prompts = r->prompts.n;
    return 0;
}

void rollout_close(Rollout *r) {
    if (!r) return;
    reward_close(r->reward);
    for (int k = 0; r->slots && k < r->s.slots; k++) {
        records_free(&r->slots[k].records);
        free(r->slots[k].ids);
    }
    free(r->slots);
    free(r->out);
    free(r->texts);
    free(r->rewards);
    free(r->prompt_of);
    free(r->lens);
    free(r->limits);
    free(r->sequences);
    prompts_free(&r->prompts);
    tokenizer_free(r->tok);
    free(r);
}

// ---------------------------------------------------------------- a micro-batch's groups

static void free_batch(Rollout *r, int n) {
    generation_free(r->out, n);
    for (int i = 0; i < n; i++) {
        free(r->texts[i]);
        r->texts[i] = NULL;
    }
}

// The mb's prompts' G responses each, as one batch: prompt p's response j is sequence p·G + j of
// the stream (random_seed, step), its length cut to the context as AstrAI's scheduler cuts it.
static int generate_batch(Rollout *r, const MicroBatch *mb, Err *err) {
    int G = r->G, context = r->context;
    long most = r->s.spec->rollout_max_tokens;
    GenerateOptions o = r->gen;
    o.max_tokens = 1;
    for (int i = 0; i < mb->nb; i++) {
        const Prompt *pr = &r->prompts.v[mb->ids[i * mb->stride]];
        int room = context - pr->n, limit = (int)(most < room ? most : room);
        o.max_tokens = limit > o.max_tokens ? limit : o.max_tokens;
        for (int j = 0; j < G; j++) {
            int b = i * G + j;
            r->prompt_of[b] = pr->ids, r->lens[b] = pr->n, r->limits[b] = limit;
            r->sequences[b] = (uint64_t)mb->ids[i * mb->stride] * (uint64_t)G + (uint64_t)j;
        }
    }
    o.sample.seed =
        splitmix64_mix((uint64_t)r->s.spec->random_seed ^ splitmix64_mix((uint64_t)mb->step));
    o.sequences = r->sequences, o.max_tokens_of = r->limits;
    int n = mb->nb * G;
    if (policy_generate(r->s.exec, r->s.model, r->prompt_of, r->lens, n, &o, r->out, err))
        return err_prefix(err, "the rollout of step %ld", mb->step);
    for (int b = 0; b < n; b++)
        if (prompts_completion_text(r->tok, &r->out[b], &r->texts[b], err)) return -1;
    return 0;
}

static cJSON *ids_array(const int32_t *ids, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
    return a;
}

// Prompt p's group (its G texts from `first` on) scored into r->rewards + first. The meta says
// where the request comes from and what the model saw and wrote, as token ids (a reward that
// counts tokens, or a test that replays the rollout).
static int score_group(Rollout *r, int64_t p, int first, long step, Err *err) {
    const Prompt *pr = &r->prompts.v[p];
    cJSON *meta = cJSON_CreateObject(), *resp = cJSON_CreateArray();
    cJSON_AddItemToObject(meta, "index", cJSON_CreateNumber((double)p));
    cJSON_AddItemToObject(meta, "step", cJSON_CreateNumber((double)step));
    cJSON_AddItemToObject(meta, "rank", cJSON_CreateNumber(r->s.rank));
    cJSON_AddItemToObject(meta, "prompt_ids", ids_array(pr->ids, pr->n));
    for (int j = 0; j < r->G; j++)
        cJSON_AddItemToArray(resp, ids_array(r->out[first + j].tokens, r->out[first + j].n));
    cJSON_AddItemToObject(meta, "response_ids", resp);
    RewardRequest q = {.id = ++r->requests,
                       .prompt = p,
                       .prompt_text = r->prompts.v[p].text,
                       .responses = (const char *const *)r->texts + first,
                       .G = r->G,
                       .meta = meta};
    int rc = reward_score(r->reward, &q, r->rewards + first, err);
    cJSON_Delete(meta);
    return rc;
}

// Prompt p's group (from `first` on) as a record: GRPO all G with their rewards; DPO the first
// response of the highest reward (chosen) and of the lowest (rejected), as torch's argmax and
// argmin pick them.
static int add_record(Rollout *r, RecordSet *rs, int64_t p, int first, Err *err) {
    const float *rw = r->rewards + first;
    int G = r->G, best = 0, worst = 0;
    for (int j = 1; j < G; j++) {
        if (rw[j] > rw[best]) best = j;
        if (rw[j] < rw[worst]) worst = j;
    }
    const int32_t *resp[G];
    int64_t n[G];
    int pick[2] = {best, worst};
    for (int j = 0; j < rs->group_size; j++) {
        const Generation *g = &r->out[first + (rs->kind == RECORDS_DPO ? pick[j] : j)];
        resp[j] = g->tokens, n[j] = g->n;
    }
    const Prompt *pr = &r->prompts.v[p];
    return records_add(rs, pr->ids, pr->n, resp, n, rw, 0, err);
}

// The group's part of the micro-batch's statistics (sums; made means by make_rollout).
static void count_group(const Rollout *r, int first, RolloutStats *st) {
    const float *rw = r->rewards + first;
    bool equal = true;
    for (int j = 0; j < r->G; j++) {
        st->reward_mean += rw[j], st->reward_std += (double)rw[j] * rw[j];
        st->response_len += r->out[first + j].n;
        equal = equal && rw[j] == rw[0];
    }
    st->equal_groups += equal;
}

// ---------------------------------------------------------------- a micro-batch

// A new rollout of the slot's prompts; its statistics as means over them.
static int make_rollout(Rollout *r, Slot *sl, const MicroBatch *mb, Err *err) {
    RolloutStats st = {0};
    records_clear(&sl->records);
    double t0 = clock_mono_s();
    int rc = generate_batch(r, mb, err);
    double t1 = clock_mono_s();
    for (int i = 0; i < mb->nb && !rc; i++) {
        int64_t p = mb->ids[i * mb->stride];
        rc = score_group(r, p, i * r->G, mb->step, err) ||
             add_record(r, &sl->records, p, i * r->G, err);
        if (!rc) count_group(r, i * r->G, &st);
    }
    st.generate_s = t1 - t0, st.reward_s = clock_mono_s() - t1;
    free_batch(r, mb->nb * r->G);
    if (rc) return -1;
    double n = (double)mb->nb * r->G, mean = st.reward_mean / n;
    st.reward_std = sqrt(fmax(st.reward_std / n - mean * mean, 0)); // population std
    st.reward_mean = mean;
    st.response_len /= n;
    st.equal_groups /= mb->nb;
    sl->stats = st;
    sl->nb = mb->nb;
    sl->step = mb->step;
    for (int i = 0; i < mb->nb; i++)
        sl->ids[i] = mb->ids[i * mb->stride];
    return 0;
}

// Whether the slot's rollout serves mb: the same prompts, fewer than rollout_interval steps on.
static bool kept(const Rollout *r, const Slot *sl, const MicroBatch *mb) {
    if (!sl->valid || sl->nb != mb->nb || mb->step - sl->step >= r->s.spec->rollout_interval)
        return false;
    for (int i = 0; i < mb->nb; i++)
        if (sl->ids[i] != mb->ids[i * mb->stride]) return false;
    return true;
}

static void add_stats(RolloutStats *to, const RolloutStats *st, bool with_time) {
    to->reward_mean += st->reward_mean, to->reward_std += st->reward_std;
    to->response_len += st->response_len, to->equal_groups += st->equal_groups;
    if (with_time) to->generate_s += st->generate_s, to->reward_s += st->reward_s;
}

// Every rank's outcome: a rank that failed printed its message already (its own is err); the
// others fail too, naming it as another rank's.
static int agree(Rollout *r, int rc, Err *err) {
    float failed = rc != 0;
    Err sum_err = {0};
    if (executor_sum(r->s.exec, &failed, 1, &sum_err)) return rc ? -1 : (*err = sum_err, -1);
    if (rc) return -1;
    return failed > 0 ? err_set(err, "another rank's rollout failed (its message is in the log)")
                      : 0;
}

int rollout_records(Rollout *r, const MicroBatch *mb, const RecordSet **records, bool *fresh,
                    Err *err) {
    Slot *sl = &r->slots[mb->index];
    *fresh = !kept(r, sl, mb);
    // Under fsdp every rank gathers the weights for a generation, whatever its own slot needs.
    int rc = *fresh ? make_rollout(r, sl, mb, err)
                    : policy_generate(r->s.exec, r->s.model, NULL, NULL, 0, &r->gen, NULL, err);
    sl->valid = !rc;
    if (agree(r, rc, err)) return sl->valid = false, -1;
    add_stats(&r->step, &sl->stats, *fresh);
    *records = &sl->records;
    return 0;
}

void rollout_take_stats(Rollout *r, RolloutStats *out) {
    *out = r->step;
    r->step = (RolloutStats){0};
}
