// samples.h: samples during training (--sample_interval N, --sample_prompts FILE; issue 32):
// every N optimizer steps and at the end of the run (its last step, max_steps, an agreed stop),
// rank 0 generates a completion for each prompt of the file from the weights of that step and
// writes them into progress.db (table samples), so that a person sees what the model writes as
// it trains (astraictl samples, the web page).
//
// Generation is train/policy.h's: every rank takes part (fsdp gathers the weights once), rank 0
// alone with prompts. Prompt i is the sampler's sequence i and the seed is random_seed, so a
// sample is what astrai-generate writes from the checkpoint of that step with the same
// --max_tokens, --temperature, --top_k, --top_p and --seed (greedy by default: successive
// samples compare). The tokenizer is the `tokenizer` key's, else param_path's tokenizer.json,
// else bytes; the stop tokens are its eos_token and param_path's generation_config.json's.
#pragma once
#include <stdbool.h>

#include "common/error.h"
#include "data/tokenizer.h"
#include "engine/generate.h"
#include "train/prompts.h"

struct Trainer;

typedef struct {
    long interval; // optimizer steps between samples; 0: no samples
    Tokenizer *tok;
    PromptList prompts; // every rank reads them (bad input fails the run alike on each)
    GenerateOptions gen;
    int32_t stop[PROMPTS_MAX_STOP];
    long last_step; // the step of the newest samples, or the one the run starts from
} Samples;

// Reads the tokenizer and the prompts when the spec asks for samples (t: set up up to its model
// and position). Errors name the key (sample_prompts, tokenizer) and the file.
int samples_open(Samples *s, const struct Trainer *t, Err *err);
// After an optimizer step, on every rank: generates and records the step's samples when they are
// due (every interval steps, or `end`: the run's last step), once per step.
int samples_after_step(Samples *s, struct Trainer *t, bool end, Err *err);
void samples_close(Samples *s);
