// generate.c: prefill, decode steps and sampling (engine/generate.h).
#include "engine/generate.h"

#include <stdlib.h>
#include <string.h>

// One generate call. Sequence b holds its prompt then its output in seq[b*cap ..], n[b] tokens;
// the rest of the row is 0, the padding of the batches built from it.
typedef struct {
    Model *m;
    const GenerateOptions *o;
    const int32_t *const *prompts;
    const int *lens;
    int B, V, cap;       // cap: the longest prompt + max_tokens
    int32_t *seq;        // (B, cap)
    int *n;              // (B)
    int32_t *batch;      // (B, cap): seq packed as (B, T) for a prefill
    int32_t *feed, *pos; // (B), (B): a decode step's tokens and positions
    float *logits;       // (B, V) the next position's of each sequence
    void *scratch;       // sample_scratch_bytes(V)
    KvCache cache;       // empty with no_cache
} Run;

static int check_options(const Model *m, const GenerateOptions *o, int B, Err *err) {
    if (sample_options_check(&o->sample, err)) return err_prefix(err, "generation");
    if (B < 1) return err_set(err, "generation: %d prompts (at least 1)", B);
    if (o->max_tokens < 1)
        return err_set(err, "generation: max_tokens %d (at least 1)", o->max_tokens);
    if (o->n_stop < 0) return err_set(err, "generation: %d stop tokens", o->n_stop);
    for (int i = 0; i < o->n_stop; i++)
        if (o->stop[i] < 0 || o->stop[i] >= m->cfg.vocab_size)
            return err_set(err, "generation: stop token %d outside vocab_size %d", o->stop[i],
                           m->cfg.vocab_size);
    return 0;
}

// Prompt b's most tokens.
static int limit_of(const GenerateOptions *o, int b) {
    return o->max_tokens_of ? o->max_tokens_of[b] : o->max_tokens;
}

// Positions 0 .. lens[b] + max_tokens - 2 are run (the last token drawn is not fed back).
static int check_prompts(const Model *m, const int *lens, int B, const GenerateOptions *o,
                         Err *err) {
    int P = m->cfg.max_position_embeddings;
    for (int b = 0; b < B; b++) {
        int max_tokens = limit_of(o, b);
        if (max_tokens < 1 || max_tokens > o->max_tokens)
            return err_set(err, "generation: prompt %d's max_tokens %d is not in [1, %d]", b,
                           max_tokens, o->max_tokens);
        if (lens[b] < 1) return err_set(err, "generation: prompt %d is empty", b);
        if (lens[b] > P - max_tokens + 1)
            return err_set(err,
                           "generation: prompt %d of %d tokens with max_tokens %d passes "
                           "max_position_embeddings %d",
                           b, lens[b], max_tokens, P);
    }
    return 0;
}

static void run_free(Run *r) {
    free(r->seq);
    free(r->n);
    free(r->batch);
    free(r->feed);
    free(r->pos);
    free(r->logits);
    free(r->scratch);
    model_cache_free(r->m, &r->cache);
}

static int run_alloc(Run *r, Generation *out, Err *err) {
    size_t B = (size_t)r->B, cap = (size_t)r->cap, mt = (size_t)r->o->max_tokens;
    r->seq = calloc(B * cap, sizeof *r->seq);
    r->n = calloc(B, sizeof *r->n);
    r->batch = calloc(B * cap, sizeof *r->batch);
    r->feed = calloc(B, sizeof *r->feed);
    r->pos = calloc(B, sizeof *r->pos);
    r->logits = malloc(B * (size_t)r->V * sizeof *r->logits);
    r->scratch = malloc(sample_scratch_bytes(r->V));
    int failed = !r->seq || !r->n || !r->batch || !r->feed || !r->pos || !r->logits || !r->scratch;
    for (size_t b = 0; b < B && !failed; b++) {
        out[b].tokens = malloc(mt * sizeof *out[b].tokens);
        out[b].logprobs = malloc(mt * sizeof *out[b].logprobs);
        out[b].model_logprobs = malloc(mt * sizeof *out[b].model_logprobs);
        failed = !out[b].tokens || !out[b].logprobs || !out[b].model_logprobs;
    }
    if (failed)
        return err_resource(err, "generation: out of memory for %zu sequences of %zu tokens", B,
                            cap);
    for (size_t b = 0; b < B; b++) {
        memcpy(r->seq + b * cap, r->prompts[b], (size_t)r->lens[b] * sizeof *r->seq);
        r->n[b] = r->lens[b];
    }
    // the decode steps run positions up to cap - 2 (check_prompts)
    return r->o->no_cache ? 0 : model_cache_create(r->m, &r->cache, r->B, r->cap - 1, err);
}

static bool finished(const Run *r, const Generation *g, int b) {
    return g->stopped || g->n == limit_of(r->o, b);
}

static bool is_stop(const GenerateOptions *o, int32_t token) {
    for (int i = 0; i < o->n_stop; i++)
        if (o->stop[i] == token) return true;
    return false;
}

// The longest sequence; r->batch = the sequences as (B, T) rows, right-padded with 0.
static int pack(Run *r) {
    int T = 0;
    for (int b = 0; b < r->B; b++)
        T = r->n[b] > T ? r->n[b] : T;
    for (int b = 0; b < r->B; b++)
        memcpy(r->batch + (size_t)b * T, r->seq + (size_t)b * r->cap, (size_t)T * sizeof *r->batch);
    return T;
}

// r->logits for the next token of every sequence: the whole sequences again (no_cache), or one
// decode step (a finished sequence's row runs at position 0: its cache is no longer read).
static int next_logits(Run *r, const Generation *out, Err *err) {
    if (r->o->no_cache) {
        int T = pack(r);
        return model_prefill(r->m, NULL, r->batch, r->n, r->B, T, r->logits, err);
    }
    for (int b = 0; b < r->B; b++) {
        bool done = finished(r, &out[b], b);
        r->pos[b] = done ? 0 : r->n[b] - 1;
        r->feed[b] = r->seq[(size_t)b * r->cap + r->pos[b]];
    }
    return model_decode(r->m, &r->cache, r->feed, r->pos, r->logits, err);
}

// Sequence b's next token from its logits, keyed (seed, its sequence index, its position); the
// penalty counts the prompt's last rep_window tokens and the output (engine/sample.h).
static int draw(Run *r, int b, Generation *g, Err *err) {
    const GenerateOptions *o = r->o;
    const float *row = r->logits + (size_t)b * r->V;
    int L = r->lens[b], w = o->sample.rep_window < L ? o->sample.rep_window : L;
    SampleHistory h = {r->prompts[b] + L - w, w, g->tokens, g->n};
    int32_t token;
    float lp, model_lp;
    uint64_t sequence = o->sequences ? o->sequences[b] : o->first_sequence + (uint64_t)b;
    if (sample_token(&o->sample, row, r->V, &h, sequence, (uint64_t)(L + g->n), r->scratch, &token,
                     &lp, err) ||
        sample_model_logprob(row, r->V, token, &model_lp, err))
        return err_prefix(err, "generation: prompt %d, token %d", b, g->n);
    g->tokens[g->n] = token;
    g->logprobs[g->n] = lp;
    g->model_logprobs[g->n] = model_lp;
    g->n++;
    g->stopped = is_stop(o, token);
    r->seq[(size_t)b * r->cap + r->n[b]++] = token;
    return o->on_token ? o->on_token(o->on_token_ctx, b, g, err) : 0;
}

static int run_steps(Run *r, Generation *out, Err *err) {
    int T = pack(r);
    KvCache *c = r->o->no_cache ? NULL : &r->cache;
    if (model_prefill(r->m, c, r->batch, r->n, r->B, T, r->logits, err)) return -1;
    for (;;) {
        int left = 0;
        for (int b = 0; b < r->B; b++) {
            if (finished(r, &out[b], b)) continue;
            if (draw(r, b, &out[b], err)) return -1;
            left += !finished(r, &out[b], b);
        }
        if (!left) break;
        if (next_logits(r, out, err)) return -1;
    }
    return r->m->be->failure(err);
}

int generate(Model *m, const int32_t *const *prompts, const int *lens, int B,
             const GenerateOptions *o, Generation *out, Err *err) {
    if (B > 0) memset(out, 0, (size_t)B * sizeof *out);
    if (check_options(m, o, B, err) || check_prompts(m, lens, B, o, err)) return -1;
    Run r = {.m = m, .o = o, .prompts = prompts, .lens = lens, .B = B, .V = m->cfg.vocab_size};
    for (int b = 0; b < B; b++)
        r.cap = lens[b] + o->max_tokens > r.cap ? lens[b] + o->max_tokens : r.cap;
    int rc = run_alloc(&r, out, err);
    if (!rc) rc = run_steps(&r, out, err);
    run_free(&r);
    return rc;
}

void generation_free(Generation *out, int B) {
    for (int b = 0; b < B; b++) {
        free(out[b].tokens);
        free(out[b].logprobs);
        free(out[b].model_logprobs);
        memset(&out[b], 0, sizeof out[b]);
    }
}
