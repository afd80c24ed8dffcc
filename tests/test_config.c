// test_config: config.json parsing errors name the file and the key; a valid config
// round-trips through model_config_to_json.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "model/config.h"

#define VALID                                                                                      \
    "\"vocab_size\": 100, \"hidden_size\": 64, \"num_hidden_layers\": 2, "                         \
    "\"num_attention_heads\": 4, \"intermediate_size\": 96, "                                      \
    "\"max_position_embeddings\": 128, \"tie_word_embeddings\": true, \"rope_theta\": null, "      \
    "\"use_gated_attention\": null"

// The keys each case below may replace (cJSON keeps the first of duplicate keys).
#define EPS_QK "\"rms_norm_eps\": 1e-5, \"use_qk_norm\": false"

// Parses `json` as "m/config.json"; expects failure with every fragment in the message.
static void expect_error(const char *json, const char *frag1, const char *frag2) {
    ModelConfig cfg;
    Err err = {0};
    int rc = model_config_parse(&cfg, json, "m/config.json", &err);
    CHECK_MSG(rc == -1, "accepted: %s", json);
    CHECK_MSG(strstr(err.msg, "m/config.json"), "no file in '%s'", err.msg);
    CHECK_MSG(strstr(err.msg, frag1), "'%s' not in '%s'", frag1, err.msg);
    CHECK_MSG(!frag2 || strstr(err.msg, frag2), "'%s' not in '%s'", frag2, err.msg);
}

static void test_valid_and_round_trip(void) {
    ModelConfig cfg, back;
    Err err = {0};
    CHECK(model_config_parse(&cfg, "{" VALID ", " EPS_QK ", \"num_key_value_heads\": 2}", "x",
                             &err) == 0);
    CHECK(cfg.head_dim == 16 && cfg.num_key_value_heads == 2 && cfg.tie_word_embeddings);
    CHECK(cfg.rope_theta == 10000.0 && !cfg.use_gated_attention && cfg.rms_norm_eps == 1e-5f);
    char *json = model_config_to_json(&cfg);
    CHECK(json && strstr(json, "\"attn_type\":\t\"gqa\"") && strstr(json, "1e-05"));
    CHECK(model_config_parse(&back, json, "y", &err) == 0);
    CHECK(memcmp(&cfg, &back, sizeof cfg) == 0);
    free(json);
}

#define LLAMA3                                                                                     \
    "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "        \
    "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 8192}"

// The keys Hugging Face families need (docs/design.md §16) and the kept hf_* keys round-trip.
static void test_family_keys_round_trip(void) {
    ModelConfig cfg, back;
    Err err = {0};
    CHECK_MSG(model_config_parse(&cfg,
                                 "{" VALID ", \"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-6, "
                                 "\"use_qk_norm\": true, \"qk_norm_before_rope\": true, "
                                 "\"attention_bias\": true, \"o_proj_bias\": true, "
                                 "\"sliding_window\": 4096, \"hf_model_type\": \"qwen3\", "
                                 "\"hf_config\": {\"bos_token_id\": 1, \"x\": [1, \"a\"]}, " LLAMA3
                                 "}",
                                 "x", &err) == 0,
              "%s", err.msg);
    CHECK(cfg.attention_bias && cfg.qk_norm_before_rope &&
          cfg.rope_scaling.kind == ROPE_SCALING_LLAMA3);
    CHECK(cfg.o_proj_bias && cfg.sliding_window == 4096);
    CHECK(cfg.rope_scaling.factor == 8 && cfg.rope_scaling.high_freq_factor == 4 &&
          cfg.rope_scaling.original_max_position_embeddings == 8192);
    char *json = model_config_to_json(&cfg);
    CHECK_MSG(json && strstr(json, "\"hf_model_type\":\t\"qwen3\"") &&
                  strstr(json, "\"rope_type\":\t\"llama3\"") && strstr(json, "bos_token_id") &&
                  strstr(json, "\"sliding_window\":\t4096") &&
                  strstr(json, "\"o_proj_bias\":\ttrue"),
              "%s", json);
    CHECK(model_config_parse(&back, json, "y", &err) == 0);
    CHECK(memcmp(&cfg, &back, sizeof cfg) == 0);
    free(json);
}

#define MLA_KEYS                                                                                   \
    "\"attn_type\": \"mla\", \"kv_lora_rank\": 24, \"qk_nope_head_dim\": 10, "                     \
    "\"qk_rope_head_dim\": 6"
#define MOE_KEYS                                                                                   \
    "\"ffn_type\": \"moe\", \"n_routed_experts\": 8, \"n_shared_experts\": 0, "                    \
    "\"n_activated_experts\": 2, \"topk_method\": \"greedy\""

// MLA and MoE keys parse, derive the per-head and rotated dimensions and round-trip.
static void test_mla_moe_round_trip(void) {
    ModelConfig cfg, back;
    Err err = {0};
    CHECK_MSG(model_config_parse(&cfg,
                                 "{" VALID ", " EPS_QK ", \"num_key_value_heads\": 1, " MLA_KEYS
                                 ", " MOE_KEYS "}",
                                 "x", &err) == 0,
              "%s", err.msg);
    CHECK(cfg.attn_type == ATTN_MLA && cfg.head_dim == 16 && cfg.rope_dim == 6 &&
          cfg.kv_lora_rank == 24);
    CHECK(cfg.ffn_type == FFN_MOE && cfg.n_routed_experts == 8 && cfg.n_shared_experts == 0 &&
          cfg.n_activated_experts == 2);
    char *json = model_config_to_json(&cfg);
    CHECK_MSG(json && strstr(json, "\"attn_type\":\t\"mla\"") &&
                  strstr(json, "\"ffn_type\":\t\"moe\"") &&
                  strstr(json, "\"n_shared_experts\":\t0") &&
                  strstr(json, "\"topk_method\":\t\"greedy\""),
              "%s", json);
    CHECK(model_config_parse(&back, json, "y", &err) == 0);
    CHECK(memcmp(&cfg, &back, sizeof cfg) == 0);
    free(json);
}

// rope_scaling as AstrAI reads it: "ntk" or no type is NTK (factor 1 by default), an unknown
// type is kept verbatim and ignored.
static void test_rope_scaling_kinds(void) {
    static const struct {
        const char *json;
        RopeScalingKind kind;
        double factor;
    } cases[] = {
        {"{\"type\": \"ntk\", \"factor\": 4}", ROPE_SCALING_NTK, 4},
        {"{\"factor\": 2.5}", ROPE_SCALING_NTK, 2.5},
        {"{}", ROPE_SCALING_NTK, 1},
        {"{\"type\": \"linear\", \"factor\": 2}", ROPE_SCALING_IGNORED, 0},
        {"{\"rope_type\": \"yarn\", \"factor\": 2}", ROPE_SCALING_IGNORED, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char text[1024];
        snprintf(text, sizeof text,
                 "{" VALID ", " EPS_QK ", \"num_key_value_heads\": 2, \"rope_scaling\": %s}",
                 cases[i].json);
        ModelConfig cfg, back;
        Err err = {0};
        CHECK_MSG(model_config_parse(&cfg, text, "x", &err) == 0, "%s: %s", cases[i].json, err.msg);
        CHECK_MSG(cfg.rope_scaling.kind == cases[i].kind, "%s", cases[i].json);
        CHECK_MSG(cases[i].kind != ROPE_SCALING_NTK || cfg.rope_scaling.factor == cases[i].factor,
                  "%s: factor %g", cases[i].json, cfg.rope_scaling.factor);
        CHECK(cases[i].kind != ROPE_SCALING_IGNORED || cfg.rope_scaling.ignored_type[0]);
        char *json = model_config_to_json(&cfg);
        CHECK(json && model_config_parse(&back, json, "y", &err) == 0);
        CHECK_MSG(back.rope_scaling.kind == cfg.rope_scaling.kind &&
                      back.rope_scaling.factor == cfg.rope_scaling.factor,
                  "%s -> %s", cases[i].json, json);
        free(json);
    }
}

static void test_mla_moe_errors(void) {
    const char *base = "{" VALID ", " EPS_QK ", \"num_key_value_heads\": 1, ";
    char text[1024];
#define MLA_MOE_ERROR(keys, frag1, frag2)                                                          \
    snprintf(text, sizeof text, "%s%s}", base, keys);                                              \
    expect_error(text, frag1, frag2)
    MLA_MOE_ERROR("\"attn_type\": \"mla\", \"kv_lora_rank\": 24, \"qk_nope_head_dim\": 10",
                  "qk_rope_head_dim", "missing");
    MLA_MOE_ERROR("\"attn_type\": \"mla\", \"kv_lora_rank\": 24, \"qk_nope_head_dim\": 12, "
                  "\"qk_rope_head_dim\": 6",
                  "hidden_size 64", "o_proj");
    MLA_MOE_ERROR("\"attn_type\": \"mla\", \"kv_lora_rank\": 24, \"qk_nope_head_dim\": 11, "
                  "\"qk_rope_head_dim\": 5",
                  "qk_rope_head_dim 5", "even");
    MLA_MOE_ERROR(MLA_KEYS ", \"attention_bias\": true", "attention_bias", "'mla'");
    MLA_MOE_ERROR("\"ffn_type\": \"moe\", \"n_routed_experts\": 8, \"n_shared_experts\": 1",
                  "n_activated_experts", "missing");
    MLA_MOE_ERROR("\"ffn_type\": \"moe\", \"n_routed_experts\": 4, \"n_shared_experts\": 1, "
                  "\"n_activated_experts\": 5",
                  "n_activated_experts 5", "n_routed_experts 4");
    MLA_MOE_ERROR("\"ffn_type\": \"moe\", \"n_routed_experts\": 4, \"n_shared_experts\": 1, "
                  "\"n_activated_experts\": 0",
                  "n_activated_experts", "positive");
    MLA_MOE_ERROR("\"ffn_type\": \"moe\", \"n_routed_experts\": 4, \"n_shared_experts\": -1, "
                  "\"n_activated_experts\": 1",
                  "n_shared_experts", "positive");
    MLA_MOE_ERROR("\"ffn_type\": \"moe\", \"n_routed_experts\": 4, \"n_shared_experts\": 1, "
                  "\"n_activated_experts\": 2, \"topk_method\": \"group_limited_greedy\"",
                  "topk_method", "'group_limited_greedy'");
#undef MLA_MOE_ERROR
}

static void test_errors(void) {
    expect_error(
        "{" VALID ", \"num_key_value_heads\": 2, \"rope_scaling\": {\"rope_type\": "
        "\"llama3\", \"factor\": 8, \"low_freq_factor\": 1, \"high_freq_factor\": 4}, " EPS_QK "}",
        "rope_scaling", "original_max_position_embeddings");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"qk_norm_before_rope\": true, " EPS_QK
                 "}",
                 "qk_norm_before_rope", "use_qk_norm");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"attention_bias\": \"yes\", " EPS_QK "}",
                 "attention_bias", "true or false");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"o_proj_bias\": 1, " EPS_QK "}",
                 "o_proj_bias", "true or false");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"sliding_window\": 0, " EPS_QK "}",
                 "sliding_window", "positive integer");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"sliding_window\": \"4k\", " EPS_QK "}",
                 "sliding_window", "integer");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"sliding_window\": 1e9, " EPS_QK "}",
                 "sliding_window", "limit");
    expect_error("{" VALID ", " EPS_QK ", \"num_key_value_heads\": 2", "malformed JSON", NULL);
    expect_error("{" VALID ", " EPS_QK "}", "num_key_value_heads", "missing");
    expect_error("{" VALID ", \"num_key_value_heads\": \"2\", " EPS_QK "}", "num_key_value_heads",
                 "integer");
    expect_error("{" VALID ", \"num_key_value_heads\": 2.5, " EPS_QK "}", "num_key_value_heads",
                 "integer");
    expect_error("{" VALID ", \"num_key_value_heads\": 0, " EPS_QK "}", "num_key_value_heads",
                 "positive");
    expect_error("{" VALID ", \"num_key_value_heads\": 3, " EPS_QK "}", "num_key_value_heads",
                 "divisible");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"attn_type\": \"xla\", " EPS_QK "}",
                 "attn_type", "'xla'");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"ffn_type\": \"dense\", " EPS_QK "}",
                 "ffn_type", "'mlp' or 'moe'");
    expect_error("{" VALID ", \"num_key_value_heads\": 2, \"rope_scaling\": {\"type\": \"ntk\", "
                 "\"factor\": -2}, " EPS_QK "}",
                 "rope_scaling", "factor");
    expect_error("{" VALID
                 ", \"num_key_value_heads\": 2, \"use_qk_norm\": 1, \"rms_norm_eps\": 1e-5}",
                 "use_qk_norm", "true or false");
    expect_error("{" VALID
                 ", \"num_key_value_heads\": 2, \"rms_norm_eps\": -1, \"use_qk_norm\": false}",
                 "rms_norm_eps", "positive");
    expect_error("[1, 2]", "JSON object", NULL);
}

static void test_missing_file(void) {
    ModelConfig cfg;
    Err err = {0};
    CHECK(model_config_load(&cfg, "/nonexistent/dir/config.json", &err) == -1);
    CHECK_MSG(strstr(err.msg, "/nonexistent/dir/config.json"), "%s", err.msg);
}

static void test_load_from_file(void) {
    char path[] = "test_config_tmp.json";
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (!f) return;
    fputs("{" VALID ", " EPS_QK ", \"num_key_value_heads\": 4, \"attn_type\": \"moe\"}", f);
    fclose(f);
    ModelConfig cfg;
    Err err = {0};
    CHECK(model_config_load(&cfg, path, &err) == -1);
    CHECK_MSG(strstr(err.msg, path) && strstr(err.msg, "attn_type"), "%s", err.msg);
    remove(path);
}

int main(void) {
    test_valid_and_round_trip();
    test_family_keys_round_trip();
    test_mla_moe_round_trip();
    test_rope_scaling_kinds();
    test_mla_moe_errors();
    test_errors();
    test_missing_file();
    test_load_from_file();
    CHECK_DONE();
}
