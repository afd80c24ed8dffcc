// policy.h: generation from the weights being trained (training's samples, the online
// strategies' rollouts), between optimizer steps.
#pragma once
#include "engine/generate.h"
#include "train/executor.h"

// Generates for the B prompts on this rank with the model's current weights (generate(), the
// KV cache where the backend has attention_decode), NEFTune's noise off. Every rank of the
// executor's group calls it (fsdp gathers the whole weights first, and frees them after); a rank
// without prompts passes B = 0. out: as generate's, released by generation_free.
int policy_generate(Executor *x, Model *m, const int32_t *const *prompts, const int *lens, int B,
                    const GenerateOptions *o, Generation *out, Err *err);
