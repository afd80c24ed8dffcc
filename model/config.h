// config.h: the model config (config.json of an AstrAI `autoregressive_lm`), docs/design.md §7.
#pragma once
#include <stdbool.h>

#include "common/error.h"

// rope_scaling: null, or Llama 3's rescaling of the RoPE frequencies (transformers'
// `_compute_llama3_parameters`): {"rope_type": "llama3", "factor", "low_freq_factor",
// "high_freq_factor", "original_max_position_embeddings"}.
typedef struct {
    bool llama3; // false: no scaling (null)
    double factor, low_freq_factor, high_freq_factor;
    int original_max_position_embeddings;
} RopeScaling;

// Keys an importer recorded for itself ("hf_*", e.g. hf_model_type), which the engine does not
// interpret but keeps through checkpoints: their JSON text as one object, "" when none.
#define CONFIG_EXTRA_MAX 8192

typedef struct {
    int vocab_size;
    int hidden_size;
    int num_hidden_layers;
    int num_attention_heads;
    int num_key_value_heads;
    int intermediate_size;
    int max_position_embeddings;
    float rms_norm_eps;
    double rope_theta; // 10000 when null/absent
    bool tie_word_embeddings;
    bool use_qk_norm;
    bool use_gated_attention;
    bool attention_bias;      // q_proj, k_proj, v_proj carry biases (Qwen2)
    bool o_proj_bias;         // o_proj carries one too (Llama's attention_bias)
    int sliding_window;       // 0: none; else query i sees keys (i - sliding_window, i] (Mistral)
    bool qk_norm_before_rope; // qk-norm on q and k before RoPE (Qwen3), not after (AstrAI)
    RopeScaling rope_scaling;
    double neftune_alpha;         // AstrAI's NEFTune noise scale as config.json records it (0: off)
    char extra[CONFIG_EXTRA_MAX]; // {"hf_...": ...} or ""
    // derived
    int head_dim; // hidden_size / num_attention_heads
} ModelConfig;

// Parses and validates config.json at path. Errors name the file and key:
// "m/config.json: attn_type 'mla' is not supported (only 'gqa')".
int model_config_load(ModelConfig *cfg, const char *path, Err *err);

// Same, from JSON text; `source` names the origin in messages.
// The largest value astrai takes for size key `key` of a model config (vocab_size, hidden_size,
// num_hidden_layers, ...; 2^30 for the others).
long model_config_size_limit(const char *key);
int model_config_parse(ModelConfig *cfg, const char *json, const char *source, Err *err);

// Serialises to config.json text with every key AstrAI's AutoRegressiveLMConfig.to_dict()
// writes, in its order (the MLA and MoE keys as null), then the keys AstrAI lacks
// (attention_bias, o_proj_bias, sliding_window, qk_norm_before_rope) when set and the kept "hf_*"
// keys; malloc'd, caller frees.
char *model_config_to_json(const ModelConfig *cfg);
