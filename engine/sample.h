// sample.h: one position's logits to one token, as AstrAI samples (DESIGN.md §17, issue 32).
//
// Matched against AstrAI at commit c8b1e40f71678779b0495421a9a27f855538e3a8:
//   astrai/inference/sample.py      the strategies and their order (sample(), lines 327-375)
//   astrai/inference/core/executor.py:99-125  what the frequency penalty counts (rep_window)
//   astrai/trainer/rollout.py:165-174, 203-218 what a rollout records (post-strategy log-probs)
//   astrai/trainer/strategy.py:439-447        what GRPO uses instead (the untempered model's)
//
// The pipeline, in AstrAI's order (sample.py:362-368: temperature, top-k, top-p, penalty):
//   temperature == 0: the token is argmax(logits), ties to the lowest index (torch.argmax's
//     first maximum); no penalty, no truncation (sample.py:299-300 short-circuits before any
//     strategy). Its log-prob is 0, that of the point mass greedy draws from (see below).
//   otherwise, on w = logits (V):
//   1. temperature: w /= max(t, 1e-8), skipped when t == 1 (sample.py:63-71).
//   2. top-k (k > 0): every w below the k-th largest w (counted with multiplicity) is removed
//      (-inf); ties with the k-th are all kept, so more than k may survive (sample.py:109-112).
//      k >= V keeps everything.
//   3. top-p (p < 1): tokens sorted by w descending, ties by ascending index; a token is kept
//      when the cumulative probability of the tokens before it is <= p (sample.py:130-137),
//      i.e. the shortest prefix whose cumulative probability exceeds p (strictly: a prefix that
//      reaches p exactly keeps the next token too). Probabilities are softmax(w) after top-k.
//   4. frequency penalty (f != 0): w[t] -= f * count(t), count over the last rep_window tokens
//      of the prompt and every token generated so far (executor.py:108-113), on the surviving
//      tokens only (a removed token stays removed, sample.py:232 on -inf).
//   5. the token is drawn from softmax(w) by inverse CDF in token-index order with one uniform
//      u = sample_uniform(seed, sequence, position); its log-prob is log_softmax(w)[token].
//
// The order and the penalty's counts are AstrAI's code, which differs from DESIGN.md §17's
// summary (penalty first, over generated tokens only): the project matches AstrAI's semantics.
//
// Where this departs from AstrAI, and why:
//   - The draw: torch.multinomial on the global torch generator there; here a counter-based
//     uniform keyed by (seed, sequence index, position), so a token does not depend on which
//     other sequences share the batch, on the rank count or on the order of the work.
//   - Greedy: AstrAI short-circuits to argmax only for a batch of one (a one-element temperature
//     tensor, sample.py:267-270); a larger batch at t = 0 divides by 1e-8 instead, which splits
//     ties at the maximum at random and reports a log-prob of ~0, while a batch of one reports
//     the model's log_softmax. Here t = 0 is always the argmax with log-prob 0, whatever the
//     batch; sample_model_logprob() gives the model's.
//   - Top-p ties at the boundary: torch.sort is not stable, so which of equal logits AstrAI
//     keeps is up to its sort; here the lower index wins (torch.sort(stable=True)'s order).
//   - Top-p's cumulative sum is in double (torch's is fp32): a boundary within fp32 rounding of
//     p may fall one token differently.
//   - rep_window 0 counts none of the prompt (Python's prompt[-0:] would count all of it;
//     AstrAI's GenerationRequest rejects 0, engine.py:92).
//   - DESIGN.md §17 lists the penalty first and "the last rep_window generated tokens";
//     AstrAI's code, matched here, applies it last and windows the prompt, not the output.
//   - Bad values are errors here (NaN or +inf logits, out-of-range history tokens), where
//     torch would sample from NaNs or fail an index.
//
// What AstrAI's online RL records: the rollout keeps each token's post-strategy log-prob
// (logprobs_old, rollout.py:217) but GRPO never reads it: it recomputes the old policy's
// log-probs with a forward pass, untempered, over the whole vocabulary (strategy.py:443).
// sample_model_logprob() is that number for the logits the token was drawn from.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "common/hd.h"
#include "common/splitmix64.h"

typedef struct {
    float temperature;       // >= 0; 0: greedy; 1: the model's distribution
    int top_k;               // >= 0; 0: off
    float top_p;             // (0, 1]; 1: off
    float frequency_penalty; // finite; 0: off (AstrAI's server takes [-2, 2])
    int rep_window;          // >= 0: how many of the prompt's last tokens the penalty counts
    uint64_t seed;           // the draws' stream; change it per rollout, or rounds repeat
} SampleOptions;

// AstrAI sample()'s neutral values (sample.py:330-333) and the executor's window (task.py:66).
// AstrAI's online rollout defaults are temperature 0.7, top_k 0, top_p 0.9, no penalty
// (train_config.py:149-158).
#define SAMPLE_OPTIONS_DEFAULT                                                                     \
    { 1.0f, 0, 1.0f, 0.0f, 64, 0 }

// The tokens the frequency penalty counts: the last rep_window of the prompt and all of the
// output (the tokens generated so far for this sequence, not the one being drawn). Either
// array may be NULL when its count is 0. Every token must lie in [0, V).
typedef struct {
    const int32_t *prompt;
    int n_prompt;
    const int32_t *output;
    int n_output;
} SampleHistory;

// 0, or -1 with a message naming the first bad field and its value.
int sample_options_check(const SampleOptions *o, Err *err);

// Bytes of the scratch that sample_transform and sample_token take for a vocabulary of V
// (16 V: no state is kept in it between calls, and it need not be initialised).
size_t sample_scratch_bytes(int V);

// The final logits (V) that step 5 draws from: steps 1-4 applied, removed tokens -inf. At
// temperature 0, the point mass: 0 at the argmax, -inf elsewhere. `out` may be `logits`.
// Errors (bad input): bad options, V < 1, a NaN or +inf logit, no finite logit, a history token
// outside [0, V), a logit overflowing under the temperature or the penalty.
int sample_transform(const SampleOptions *o, const float *logits, int V, const SampleHistory *h,
                     void *scratch, float *out, Err *err);

// One token for position `position` of sequence `sequence` (both any counters unique per draw:
// the index of the sequence in the whole rollout, B*G of them, and the position in it of the
// token being drawn, prompt length + tokens generated so far), with its log-prob under the
// final distribution (of sample_transform). h may be NULL (no penalty). Errors as
// sample_transform.
int sample_token(const SampleOptions *o, const float *logits, int V, const SampleHistory *h,
                 uint64_t sequence, uint64_t position, void *scratch, int32_t *token,
                 float *logprob, Err *err);

// log_softmax(logits)[token]: the token's log-prob under the untempered, untruncated model, in
// double and rounded once. Errors: V < 1, token outside [0, V), a NaN or +inf logit, no finite
// logit.
int sample_model_logprob(const float *logits, int V, int32_t token, float *logprob, Err *err);

// Keeps these draws apart from counter_normal()'s (engine/counter_rng.h) for the same seed.
#define SAMPLE_RNG_DOMAIN 0x73616d706c652121ULL // "sample!!"

// A uniform in [0, 1) (53 bits), a pure function of (seed, sequence, position): counter_rng.h's
// construction (the mixed seed advanced by the golden gamma times the counter + 1, mixed)
// applied twice, first for the sequence, then for the position, so that distinct pairs draw
// unrelated numbers (no (s, p) and (s + 1, p - 1) aliasing as a flat s * N + p counter has).
HD_FN double sample_uniform(uint64_t seed, uint64_t sequence, uint64_t position) {
    uint64_t s = splitmix64_mix(seed ^ SAMPLE_RNG_DOMAIN);
    s = splitmix64_mix(s + SPLITMIX64_GAMMA * (sequence + 1));
    uint64_t bits = splitmix64_mix(s + SPLITMIX64_GAMMA * (position + 1));
    return (double)(bits >> 11) * 0x1.0p-53;
}
