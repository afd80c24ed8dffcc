// test_generate.c: what engine/generate.h refuses, each with a message naming the value at
// fault: a backend without attention_decode (here the CPU table without it; the
// recomputation without a cache still runs there and gives the cached run's tokens), a pipeline
// stage, expert parallelism, bad options; and that generation leaves the training's NEFTune
// setting and expert-load counts as they were. The numbers themselves: test_generate_ref.py.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "engine/generate.h"

enum { V = 37, B = 2, MAX_TOKENS = 5 };

static ModelConfig config(bool moe) {
    ModelConfig c = {.vocab_size = V,
                     .hidden_size = 16,
                     .num_hidden_layers = 2,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2,
                     .intermediate_size = 24,
                     .max_position_embeddings = 32,
                     .rms_norm_eps = 1e-5f,
                     .rope_theta = 10000};
    c.head_dim = c.rope_dim = c.hidden_size / c.num_attention_heads;
    if (moe) {
        c.ffn_type = FFN_MOE;
        c.n_routed_experts = 4;
        c.n_shared_experts = 1;
        c.n_activated_experts = 2;
    }
    return c;
}

static const int32_t p0[] = {1, 2, 3, 4, 5, 6, 7}, p1[] = {8, 9};
static const int32_t *const prompts[B] = {p0, p1};
static const int lens[B] = {7, 2};

static GenerateOptions greedy(void) {
    GenerateOptions o = {.sample = SAMPLE_OPTIONS_DEFAULT, .max_tokens = MAX_TOKENS};
    o.sample.temperature = 0.0f;
    return o;
}

// generate fails with a message containing `fragment`.
static void check_refused(Model *m, const GenerateOptions *o, const int *l, const char *fragment) {
    Generation g[B];
    Err err = {0};
    CHECK(generate(m, prompts, l, B, o, g, &err) != 0);
    CHECK_MSG(strstr(err.msg, fragment) != NULL, "'%s' lacks '%s'", err.msg, fragment);
    generation_free(g, B);
}

static void check_no_decode_op(void) {
    Backend nodecode = *backend_cpu();
    nodecode.attention_decode = NULL;
    ModelConfig c = config(false);
    Model m;
    Err err = {0};
    CHECK_MSG(!model_create(&m, &c, &nodecode, &err) && !model_init_random(&m, 3, &err), "%s",
              err.msg);
    GenerateOptions o = greedy();
    check_refused(&m, &o, lens, "the cpu backend has no attention_decode");
    Generation full[B], cached[B];
    o.no_cache = true;
    CHECK_MSG(!generate(&m, prompts, lens, B, &o, full, &err), "%s", err.msg);
    model_free(&m);
    CHECK_MSG(!model_create(&m, &c, backend_cpu(), &err) && !model_init_random(&m, 3, &err), "%s",
              err.msg);
    o.no_cache = false;
    CHECK_MSG(!generate(&m, prompts, lens, B, &o, cached, &err), "%s", err.msg);
    for (int b = 0; b < B; b++)
        CHECK(full[b].n == MAX_TOKENS && cached[b].n == MAX_TOKENS &&
              !memcmp(full[b].tokens, cached[b].tokens, MAX_TOKENS * sizeof *full[b].tokens));
    generation_free(full, B);
    generation_free(cached, B);
    model_free(&m);
}

static void check_stage_and_experts(void) {
    ModelConfig c = config(true);
    Model m;
    Err err = {0};
    GenerateOptions o = greedy();
    CHECK_MSG(!model_create_stage(&m, &c, 0, 1, backend_cpu(), &err), "%s", err.msg);
    check_refused(&m, &o, lens, "blocks [0, 1) of 2 are a pipeline stage");
    model_free(&m);
    CHECK_MSG(!model_create(&m, &c, backend_cpu(), &err), "%s", err.msg);
    ExpertGroup g = {.size = 2, .rank = 0};
    CHECK_MSG(!model_set_expert_group(&m, &g, &err), "%s", err.msg);
    check_refused(&m, &o, lens, "ep_size 2: expert parallelism is not supported");
    model_free(&m);
}

static void check_options(void) {
    ModelConfig c = config(true);
    Model m;
    Err err = {0};
    CHECK_MSG(!model_create(&m, &c, backend_cpu(), &err) && !model_init_random(&m, 5, &err), "%s",
              err.msg);
    GenerateOptions o = greedy();
    int empty[B] = {7, 0}, long_prompt[B] = {7, 30};
    check_refused(&m, &o, empty, "prompt 1 is empty");
    check_refused(&m, &o, long_prompt,
                  "prompt 1 of 30 tokens with max_tokens 5 passes max_position_embeddings 32");
    o.max_tokens = 0;
    check_refused(&m, &o, lens, "max_tokens 0");
    o = greedy();
    o.sample.temperature = -1.0f;
    check_refused(&m, &o, lens, "generation: temperature -1");
    o = greedy();
    int32_t stop = V;
    o.stop = &stop;
    o.n_stop = 1;
    check_refused(&m, &o, lens, "stop token 37 outside vocab_size 37");
    // generation is not training: no noise, no expert loads, and the setting is kept
    o = greedy();
    m.neftune_alpha = 5.0f;
    Generation a[B], b[B];
    CHECK_MSG(!generate(&m, prompts, lens, B, &o, a, &err), "%s", err.msg);
    m.neftune_alpha = 0.0f;
    CHECK_MSG(!generate(&m, prompts, lens, B, &o, b, &err), "%s", err.msg);
    for (int s = 0; s < B; s++)
        CHECK(!memcmp(a[s].tokens, b[s].tokens, (size_t)a[s].n * sizeof *a[s].tokens));
    int64_t loads = 0;
    for (int i = 0; i < c.num_hidden_layers * c.n_routed_experts; i++)
        loads += m.expert_tokens[i];
    CHECK(loads == 0);
    generation_free(b, B);
    m.neftune_alpha = 5.0f;
    CHECK_MSG(!generate(&m, prompts, lens, B, &o, b, &err) && m.neftune_alpha == 5.0f, "%s",
              err.msg);
    generation_free(a, B);
    generation_free(b, B);
    model_free(&m);
}

int main(void) {
    check_no_decode_op();
    check_stage_and_experts();
    check_options();
    CHECK_DONE();
}
