// generate.h: text generation with the model (DESIGN.md §17, issue 32): prefill of the
// prompts, then one token per sequence per step with a KV cache (engine/model.h model_prefill,
// model_decode), each drawn by engine/sample.h.
//
// The prompts run as one batch, right-padded to the longest: causal attention keeps a sequence
// from seeing its padding, so each gets what it would alone (up to the GEMMs' rounding, which
// may change with their row count), while the projections stay one GEMM over all prompts
// (running them one by one would make every GEMM of the prefill B times smaller). A
// finished sequence's row keeps running (at position 0, its cache no longer read) until every
// sequence has finished: the batch keeps its shape.
//
// Draws are keyed (seed, first_sequence + b, position): a sequence's tokens do not depend on
// the other sequences of the batch, nor on how a rollout is split over calls or ranks.
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "common/error.h"
#include "engine/model.h"
#include "engine/sample.h"

struct Generation;

typedef struct {
    SampleOptions sample;
    int max_tokens;            // >= 1: the most tokens generated per sequence
    const int32_t *stop;       // n_stop tokens that end a sequence (EOS and extra stop ids)
    int n_stop;                // >= 0
    uint64_t first_sequence;   // the sampler's sequence index of prompt 0 (b + first_sequence)
    const uint64_t *sequences; // (B) each prompt's sequence index instead; NULL: first_sequence + b
    const int *max_tokens_of;  // (B) each prompt's own limit (1..max_tokens); NULL: max_tokens
    bool no_cache;             // recompute the whole sequences every step (tests, a reference)
    // Called, when set, after each token is drawn for sequence b, with its output so far
    // (out[b]: the token is its last); a non-zero return stops the generation with that
    // failure in err (astrai-generate streams the text as it comes).
    int (*on_token)(void *ctx, int b, const struct Generation *g, Err *err);
    void *on_token_ctx;
} GenerateOptions;

// One sequence's output; a stop token, when one ended it, is its last token.
typedef struct Generation {
    int32_t *tokens;       // (n)
    float *logprobs;       // (n) under the distribution each was drawn from (sample_token's)
    float *model_logprobs; // (n) under the untempered model (sample_model_logprob)
    int n;
    bool stopped; // ended on a stop token (else after max_tokens)
} Generation;

// Generates for B prompts (prompts[b]: lens[b] >= 1 token ids) into out (B), which
// generation_free releases (also after a failure). Errors name the prompt or option at fault:
// bad options, an empty prompt or one that with max_tokens passes max_position_embeddings,
// token ids outside the vocabulary, a model or backend that cannot generate, memory.
int generate(Model *m, const int32_t *const *prompts, const int *lens, int B,
             const GenerateOptions *o, Generation *out, Err *err);
void generation_free(Generation *out, int B);
