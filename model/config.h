// config.h: the model config (config.json of an AstrAI `autoregressive_lm`), docs/design.md §7.
#pragma once
#include <stdbool.h>

#include "common/error.h"

// rope_scaling as AstrAI reads it (docs/design.md §7b): null; NTK ({"type": "ntk"}, or neither
// "type" nor "rope_type": the base becomes base * factor^(d/(d-2)), factor 1 when absent); Llama
// 3's rescaling of the frequencies (transformers' `_compute_llama3_parameters`: "rope_type" or
// "type" "llama3", "factor", "low_freq_factor", "high_freq_factor",
// "original_max_position_embeddings"); or any other type, which AstrAI ignores: kept verbatim
// (raw), the base left alone.
typedef enum {
    ROPE_SCALING_NONE,
    ROPE_SCALING_NTK,
    ROPE_SCALING_LLAMA3,
    ROPE_SCALING_IGNORED
} RopeScalingKind;
#define ROPE_SCALING_RAW_MAX 1024
typedef struct {
    RopeScalingKind kind;
    double factor, low_freq_factor, high_freq_factor;
    int original_max_position_embeddings;
    char ignored_type[64];          // IGNORED: the type named, for the warning
    char raw[ROPE_SCALING_RAW_MAX]; // IGNORED: the object's JSON text, written back as it was
} RopeScaling;

// attn_type: "gqa" (q/k/v projections) or "mla" (multi-head latent attention, §7a).
typedef enum { ATTN_GQA, ATTN_MLA } AttnType;
// ffn_type: "mlp" (one SwiGLU MLP) or "moe" (DeepSeekMoE: routed and shared SwiGLU experts, §7a).
typedef enum { FFN_MLP, FFN_MOE } FfnType;

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
    AttnType attn_type;
    int kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim; // MLA (0 under GQA)
    FfnType ffn_type;
    int n_routed_experts, n_shared_experts, n_activated_experts; // MoE (0 under MLP)
    double neftune_alpha;         // AstrAI's NEFTune noise scale as config.json records it (0: off)
    char extra[CONFIG_EXTRA_MAX]; // {"hf_...": ...} or ""
    // derived
    int head_dim; // per-head dimension of q, k, v: hidden_size / num_attention_heads (GQA),
                  // qk_nope_head_dim + qk_rope_head_dim (MLA)
    int rope_dim; // the dimensions RoPE rotates per head: head_dim (GQA), qk_rope_head_dim (MLA)
} ModelConfig;

// Parses and validates config.json at path. Errors name the file and key:
// "m/config.json: attn_type 'xyz' is not supported (only 'gqa' or 'mla')".
int model_config_load(ModelConfig *cfg, const char *path, Err *err);

// Same, from JSON text; `source` names the origin in messages.
// The largest value astrai takes for size key `key` of a model config (vocab_size, hidden_size,
// num_hidden_layers, ...; 2^30 for the others).
long model_config_size_limit(const char *key);
int model_config_parse(ModelConfig *cfg, const char *json, const char *source, Err *err);

// Serialises to config.json text with every key AstrAI's AutoRegressiveLMConfig.to_dict()
// writes, in its order (the MLA and MoE keys as null where the model has none), then the keys
// AstrAI lacks (attention_bias, o_proj_bias, sliding_window, qk_norm_before_rope) when set and the
// kept "hf_*" keys; malloc'd, caller frees.
char *model_config_to_json(const ModelConfig *cfg);
