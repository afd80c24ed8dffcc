// policy.c: generation from the policy being trained (train/policy.h).
#include "train/policy.h"

int policy_generate(Executor *x, Model *m, const int32_t *const *prompts, const int *lens, int B,
                    const GenerateOptions *o, Generation *out, Err *err) {
    if (executor_begin_generate(x, m, err)) return -1;
    GenerateOptions go = *o;
    go.no_cache = go.no_cache || !m->be->attention_decode;
    float alpha = m->neftune_alpha;
    m->neftune_alpha = 0.0f;
    int rc = B ? generate(m, prompts, lens, B, &go, out, err) : 0;
    m->neftune_alpha = alpha;
    executor_end_generate(x, m);
    return rc;
}
