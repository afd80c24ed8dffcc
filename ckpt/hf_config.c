// hf_config.c: Hugging Face config.json <-> AstrAI config.json (ckpt/hf.h, docs/huggingface.md).
//
// Both sides name the sizes alike (vocab_size, hidden_size, ...), so one reader takes them from
// either. An HF key is either mapped, known to be harmless (metadata, token ids, training-only
// settings), or checked to hold the one value the engine computes; any other key is refused,
// since it may change the function the model computes.
#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/hf.h"
#include "common/json.h"
#include "common/path.h"

enum { LLAMA = 1, MISTRAL = 2, QWEN2 = 4, QWEN3 = 8, MIXTRAL = 16, ALL = 31 };

static const struct {
    const char *model_type, *architecture;
    unsigned bit;
} FAMILIES[] = {
    {"llama", "LlamaForCausalLM", LLAMA},
    {"mistral", "MistralForCausalLM", MISTRAL},
    {"qwen2", "Qwen2ForCausalLM", QWEN2},
    {"qwen3", "Qwen3ForCausalLM", QWEN3},
    // DeepSeekMoE's feed-forward without shared experts (docs/design.md §7a)
    {"mixtral", "MixtralForCausalLM", MIXTRAL},
};
enum { N_FAMILIES = sizeof FAMILIES / sizeof *FAMILIES };
#define SUPPORTED "llama, mistral, mixtral, qwen2, qwen3"

// Mixture-of-experts families whose feed-forward (or more) is not DeepSeekMoE's function, with
// what differs: refused by name rather than as an unknown model_type.
static const struct {
    const char *model_type, *why;
} OTHER_MOE[] = {
    {"qwen2_moe",
     "shared_expert gating (sigmoid(shared_expert_gate(x)) times one shared expert of "
     "shared_expert_intermediate_size) is not DeepSeekMoE's mean of shared experts, and "
     "norm_topk_prob false leaves the top-k weights unnormalised"},
    {"qwen3_moe", "norm_topk_prob false (the default) leaves the top-k weights unnormalised, "
                  "dense layers by decoder_sparse_step/mlp_only_layers; and transformers 4.46, "
                  "the reference, has no Qwen3-MoE"},
    {"deepseek_v2", "top-k weights not renormalised (norm_topk_prob false) but scaled by "
                    "routed_scaling_factor, grouped top-k (group_limited_greedy), dense "
                    "first_k_dense_replace layers, and DeepSeek's MLA with a shared rope key"},
    {"deepseek_v3", "sigmoid routing with e_score_correction_bias and grouped top-k (noaux_tc), "
                    "routed_scaling_factor, dense first_k_dense_replace layers and DeepSeek's MLA"},
    {"olmoe", "top-k weights not renormalised (norm_topk_prob false) and qk-norm over all heads"},
    {"dbrx", "LayerNorm, fused Wqkv with clip_qkv and fused expert tensors, and top-k weights "
             "divided by their moe_normalize_expert_weights-norm"},
    {"jamba", "Mamba layers between the attention layers, experts every expert_layer_period"},
    {"granitemoe", "embedding, residual and attention multipliers and logits_scaling"},
    {"phimoe", "sparsemixer routing and LayerNorm with biases"},
    {"jetmoe", "a mixture of attention heads and experts with biases"},
    {"switch_transformers", "an encoder-decoder (T5) model"},
    {"nllb_moe", "an encoder-decoder model"},
    {"gpt_oss", "experts with biases and a clamped SwiGLU, attention sinks"},
    {"llama4", "a multimodal model; llama4_text's shared expert is added, and its routing is "
               "sigmoid of the top-k logits"},
    {"llama4_text", "a shared expert added, not averaged, and sigmoid of the top-k logits as "
                    "routing weights"},
};

static int family_of(const char *model_type) {
    for (int i = 0; i < N_FAMILIES; i++)
        if (!strcmp(FAMILIES[i].model_type, model_type)) return i;
    return -1;
}

// ---------------------------------------------------------------- reading values

static const cJSON *key_of(const cJSON *root, const char *key) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsNull(item) ? NULL : item;
}

// A value as messages show it (truncated JSON).
static void show(char *out, size_t cap, const cJSON *item) {
    char *text = cJSON_PrintUnformatted(item);
    snprintf(out, cap, "%.60s", text ? text : "?");
    free(text);
}

// An integer key in [1, the limit of the AstrAI key it maps to] (model_config_size_limit);
// fallback > 0 when it may be absent or null.
static int read_size_as(const cJSON *root, const char *key, const char *astrai_key,
                        const char *path, int fallback, int *out, Err *err) {
    const cJSON *item = key_of(root, key);
    if (!item && fallback > 0) return *out = fallback, 0;
    if (!item) return err_set(err, "%s: missing required key '%s'", path, key);
    double v = item->valuedouble;
    if (!cJSON_IsNumber(item) || v != floor(v) || v < 1)
        return err_set(err, "%s: key '%s' must be a positive integer", path, key);
    long max = model_config_size_limit(astrai_key);
    if (v > (double)max)
        return err_set(err, "%s: key '%s' = %.0f is above astrai's limit of %ld", path, key, v,
                       max);
    *out = (int)v;
    return 0;
}

static int read_size(const cJSON *root, const char *key, const char *path, int fallback, int *out,
                     Err *err) {
    return read_size_as(root, key, key, path, fallback, out, err);
}

static int read_bool(const cJSON *root, const char *key, const char *path, bool *out, Err *err) {
    const cJSON *item = key_of(root, key);
    if (item && !cJSON_IsBool(item))
        return err_set(err, "%s: key '%s' must be true or false", path, key);
    *out = item && cJSON_IsTrue(item);
    return 0;
}

// Mixtral's experts: num_local_experts and num_experts_per_tok (transformers' defaults 8 and 2
// when absent), as n_routed_experts and n_activated_experts.
static int read_experts(const cJSON *root, const char *path, HfShape *s, int *k, Err *err) {
    if (read_size_as(root, "num_local_experts", "n_routed_experts", path, 8, &s->n_routed_experts,
                     err) ||
        read_size_as(root, "num_experts_per_tok", "n_activated_experts", path, 2, k, err))
        return -1;
    if (*k > s->n_routed_experts)
        return err_set(err, "%s: num_experts_per_tok %d exceeds num_local_experts %d", path, *k,
                       s->n_routed_experts);
    return 0;
}

// The sizes of an HF config (num_key_value_heads defaults to the heads), head_dim =
// hidden_size / num_attention_heads, and mixtral's experts (*k: the experts per token). The
// values of the rest are the engine's to check (the AstrAI config made of them is parsed by
// model/config.c).
static int read_shape(const cJSON *root, const char *path, unsigned family, HfShape *s, int *k,
                      Err *err) {
    memset(s, 0, sizeof *s);
    *k = 0;
    if (read_size(root, "vocab_size", path, 0, &s->vocab_size, err) ||
        read_size(root, "hidden_size", path, 0, &s->hidden_size, err) ||
        read_size(root, "num_hidden_layers", path, 0, &s->num_hidden_layers, err) ||
        read_size(root, "num_attention_heads", path, 0, &s->num_attention_heads, err) ||
        read_size(root, "num_key_value_heads", path, s->num_attention_heads,
                  &s->num_key_value_heads, err) ||
        read_size(root, "intermediate_size", path, 0, &s->intermediate_size, err) ||
        read_size(root, "max_position_embeddings", path, 0, &s->max_position_embeddings, err) ||
        read_bool(root, "tie_word_embeddings", path, &s->tie_word_embeddings, err))
        return -1;
    if (!key_of(root, "rms_norm_eps"))
        return err_set(err, "%s: missing required key 'rms_norm_eps'", path);
    if (s->hidden_size % s->num_attention_heads)
        return err_set(err, "%s: hidden_size %d is not divisible by num_attention_heads %d", path,
                       s->hidden_size, s->num_attention_heads);
    s->head_dim = s->hidden_size / s->num_attention_heads;
    return family == MIXTRAL ? read_experts(root, path, s, k, err) : 0;
}

// The shapes of a parsed AstrAI config.
static void shape_of(const ModelConfig *mc, HfShape *s) {
    *s = (HfShape){
        .vocab_size = mc->vocab_size,
        .hidden_size = mc->hidden_size,
        .num_hidden_layers = mc->num_hidden_layers,
        .num_attention_heads = mc->num_attention_heads,
        .num_key_value_heads = mc->num_key_value_heads,
        .intermediate_size = mc->intermediate_size,
        .max_position_embeddings = mc->max_position_embeddings,
        .head_dim = mc->head_dim,
        .tie_word_embeddings = mc->tie_word_embeddings,
        .attention_bias = mc->attention_bias,
        .o_proj_bias = mc->o_proj_bias,
        .qk_norm = mc->use_qk_norm,
        .sliding_window = mc->sliding_window,
        .n_routed_experts = mc->ffn_type == FFN_MOE ? mc->n_routed_experts : 0,
    };
}

static const char *const ROPE_NUMBERS[] = {"factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings"};

// rope_scaling: null, or Llama 3's {"rope_type" (or "type"): "llama3", factor, low_freq_factor,
// high_freq_factor, original_max_position_embeddings}; any other key is refused (the values
// are the engine's to check).
static int check_rope_scaling(const cJSON *rs, const char *path, Err *err) {
    if (!rs) return 0;
    if (!cJSON_IsObject(rs))
        return err_set(err, "%s: rope_scaling must be null or an object", path);
    const cJSON *type = key_of(rs, "rope_type") ? key_of(rs, "rope_type") : key_of(rs, "type");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "llama3")) {
        char v[64];
        show(v, sizeof v, type);
        return err_set(err, "%s: rope_scaling type %s is not supported (only \"llama3\")", path,
                       type ? v : "(none)");
    }
    const cJSON *item;
    cJSON_ArrayForEach(item, rs) {
        bool known = !strcmp(item->string, "type") || !strcmp(item->string, "rope_type");
        for (size_t i = 0; i < sizeof ROPE_NUMBERS / sizeof *ROPE_NUMBERS; i++)
            known |= !strcmp(item->string, ROPE_NUMBERS[i]);
        if (!known)
            return err_set(err, "%s: rope_scaling.%s is not a key of llama3 rope scaling", path,
                           item->string);
    }
    return 0;
}

// AstrAI's form of a valid rope_scaling: the five keys, "rope_type" and "type" named so (AstrAI
// reads only "type", and without it would take the object for NTK; NULL: none).
static cJSON *astrai_rope_scaling(const cJSON *rs) {
    if (!rs) return cJSON_CreateNull();
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "rope_type", "llama3");
    cJSON_AddStringToObject(o, "type", "llama3");
    for (size_t i = 0; i < sizeof ROPE_NUMBERS / sizeof *ROPE_NUMBERS; i++)
        if (key_of(rs, ROPE_NUMBERS[i]))
            cJSON_AddItemToObject(o, ROPE_NUMBERS[i],
                                  cJSON_Duplicate(key_of(rs, ROPE_NUMBERS[i]), 0));
    return o;
}

// ---------------------------------------------------------------- the HF keys

typedef struct {
    const char *path;
    const HfShape *shape;
    const cJSON *root;
} KeyCtx;

typedef int (*KeyCheck)(const cJSON *item, const KeyCtx *k, Err *err);

static int refuse(const cJSON *item, const KeyCtx *k, const char *why, Err *err) {
    char v[64];
    show(v, sizeof v, item);
    return err_set(err, "%s: %s = %s is not supported (%s)", k->path, item->string, v, why);
}

static int must_be_false(const cJSON *item, const KeyCtx *k, Err *err) {
    if (cJSON_IsNull(item) || cJSON_IsFalse(item)) return 0;
    if (!strcmp(item->string, "mlp_bias")) return refuse(item, k, "the MLP has no biases", err);
    if (!strcmp(item->string, "use_sliding_window"))
        return refuse(item, k,
                      "the window of only some layers (max_window_layers): astrai's window is "
                      "Mistral's, on every layer",
                      err);
    return refuse(item, k, "must be false", err);
}

static int must_be_bool(const cJSON *item, const KeyCtx *k, Err *err) {
    if (cJSON_IsNull(item) || cJSON_IsBool(item)) return 0;
    return refuse(item, k, "must be true or false", err);
}

static int must_be_zero(const cJSON *item, const KeyCtx *k, Err *err) {
    if (cJSON_IsNull(item) || (cJSON_IsNumber(item) && item->valuedouble == 0)) return 0;
    if (!strcmp(item->string, "router_jitter_noise"))
        return refuse(item, k,
                      "astrai does not compute the router's jitter noise, which transformers "
                      "multiplies into the MoE input while training: only 0",
                      err);
    return refuse(item, k, "must be 0", err);
}

static int must_be_one(const cJSON *item, const KeyCtx *k, Err *err) {
    if (cJSON_IsNull(item) || (cJSON_IsNumber(item) && item->valuedouble == 1)) return 0;
    return refuse(item, k, "must be 1", err);
}

static int must_be_silu(const cJSON *item, const KeyCtx *k, Err *err) {
    if (cJSON_IsNull(item) || (cJSON_IsString(item) && !strcmp(item->valuestring, "silu")))
        return 0;
    return refuse(item, k, "the MLP is SwiGLU: only \"silu\"", err);
}

static int check_head_dim(const cJSON *item, const KeyCtx *k, Err *err) {
    if (cJSON_IsNull(item) || (cJSON_IsNumber(item) && item->valuedouble == k->shape->head_dim))
        return 0;
    char why[96];
    snprintf(why, sizeof why, "head_dim must be hidden_size / num_attention_heads = %d",
             k->shape->head_dim);
    return refuse(item, k, why, err);
}

static int check_rope_key(const cJSON *item, const KeyCtx *k, Err *err) {
    return check_rope_scaling(cJSON_IsNull(item) ? NULL : item, k->path, err);
}

static const struct {
    const char *key;
    unsigned families;
    KeyCheck check; // NULL: mapped or harmless
} HF_KEYS[] = {
    // mapped (read_shape)
    {"vocab_size", ALL, NULL},
    {"hidden_size", ALL, NULL},
    {"num_hidden_layers", ALL, NULL},
    {"num_attention_heads", ALL, NULL},
    {"num_key_value_heads", ALL, NULL},
    {"intermediate_size", ALL, NULL},
    {"max_position_embeddings", ALL, NULL},
    {"rms_norm_eps", ALL, NULL},
    {"rope_theta", ALL, NULL},
    {"tie_word_embeddings", ALL, NULL},
    {"model_type", ALL, NULL},
    {"rope_scaling", LLAMA | QWEN2 | QWEN3, check_rope_key},
    {"num_local_experts", MIXTRAL, NULL},   // n_routed_experts (read_experts)
    {"num_experts_per_tok", MIXTRAL, NULL}, // n_activated_experts
    // metadata, token ids, and what only matters to training or generation in transformers
    {"architectures", ALL, NULL},
    {"torch_dtype", ALL, NULL},
    {"transformers_version", ALL, NULL},
    {"_name_or_path", ALL, NULL},
    {"bos_token_id", ALL, NULL},
    {"eos_token_id", ALL, NULL},
    {"pad_token_id", ALL, NULL},
    {"initializer_range", ALL, NULL},
    {"use_cache", ALL, NULL},
    {"output_attentions", ALL, NULL},
    {"output_hidden_states", ALL, NULL},
    {"max_window_layers", QWEN2 | QWEN3, NULL}, // only with use_sliding_window
    // transformers' auxiliary load-balancing loss (training only, with output_router_logits;
    // astrai computes none, as AstrAI: docs/huggingface.md) and whether forward returns the
    // router logits: kept in hf_config, not interpreted
    {"router_aux_loss_coef", MIXTRAL, NULL},
    {"output_router_logits", MIXTRAL, must_be_bool},
    // the one value the engine computes
    {"hidden_act", ALL, must_be_silu},
    {"attention_dropout", ALL, must_be_zero},
    {"pretraining_tp", LLAMA, must_be_one},
    {"mlp_bias", LLAMA, must_be_false},
    {"attention_bias", LLAMA, must_be_bool}, // mapped: biases on q, k, v and o_proj
    {"attention_bias", QWEN3, must_be_false},
    {"head_dim", LLAMA | MISTRAL | QWEN3 | MIXTRAL, check_head_dim},
    {"sliding_window", MISTRAL | MIXTRAL, NULL}, // mapped (the engine checks its value)
    {"sliding_window", QWEN2 | QWEN3, NULL},     // only with use_sliding_window
    {"use_sliding_window", QWEN2 | QWEN3, must_be_false},
    {"use_mrope", QWEN2, must_be_false},
    {"router_jitter_noise", MIXTRAL, must_be_zero},
};

// Keys of mixture-of-experts models (of other designs than mixtral's, for a mixtral config).
static const char *const MOE_KEYS[] = {
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "n_routed_experts",
    "n_shared_experts",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "shared_expert_intermediate_size",
    "router_aux_loss_coef",
    "output_router_logits",
    "mlp_only_layers",
    "norm_topk_prob",
    "first_k_dense_replace",
    "router_jitter_noise",
    "routed_scaling_factor",
    "topk_method",
    "n_group",
    "topk_group",
    "scoring_func",
    "shared_expert_gate",
};

static int check_key(const cJSON *item, const KeyCtx *k, unsigned family, Err *err) {
    for (size_t i = 0; i < sizeof HF_KEYS / sizeof *HF_KEYS; i++)
        if ((HF_KEYS[i].families & family) && !strcmp(HF_KEYS[i].key, item->string))
            return HF_KEYS[i].check ? HF_KEYS[i].check(item, k, err) : 0;
    for (size_t i = 0; i < sizeof MOE_KEYS / sizeof *MOE_KEYS; i++)
        if (!strcmp(MOE_KEYS[i], item->string))
            return family == MIXTRAL
                       ? err_set(err,
                                 "%s: key '%s' is not mixtral's: a mixture-of-experts design "
                                 "other than mixtral's (DeepSeekMoE without shared experts)",
                                 k->path, item->string)
                       : err_set(err,
                                 "%s: key '%s': mixture-of-experts models are supported as "
                                 "model_type mixtral only, not %s",
                                 k->path, item->string, key_of(k->root, "model_type")->valuestring);
    return err_set(err,
                   "%s: unknown key '%s' (not known to be harmless for model_type %s: it may "
                   "change the model's function)",
                   k->path, item->string, key_of(k->root, "model_type")->valuestring);
}

static int check_keys(const cJSON *hf, const char *path, const HfShape *shape, unsigned family,
                      Err *err) {
    const KeyCtx k = {.path = path, .shape = shape, .root = hf};
    const cJSON *item;
    cJSON_ArrayForEach(item, hf) {
        if (check_key(item, &k, family, err)) return -1;
    }
    return 0;
}

static int read_family(const cJSON *root, const char *key, const char *path, int *family,
                       Err *err) {
    const cJSON *mt = key_of(root, key);
    if (!cJSON_IsString(mt)) return err_set(err, "%s: no string '%s'", path, key);
    if ((*family = family_of(mt->valuestring)) >= 0) return 0;
    for (size_t i = 0; i < sizeof OTHER_MOE / sizeof *OTHER_MOE; i++)
        if (!strcmp(OTHER_MOE[i].model_type, mt->valuestring))
            return err_set(err,
                           "%s: %s '%s' is not supported: its mixture of experts is not "
                           "DeepSeekMoE's function (%s); only mixtral's is (" SUPPORTED ")",
                           path, key, mt->valuestring, OTHER_MOE[i].why);
    return err_set(err, "%s: %s '%.60s' is not supported (" SUPPORTED ")", path, key,
                   mt->valuestring);
}

// ---------------------------------------------------------------- import

// Replaces or adds key (item NULL: out of memory, which the caller's count of failures sees).
static void put(cJSON *obj, const char *key, cJSON *item) {
    if (!item) return;
    if (cJSON_GetObjectItemCaseSensitive(obj, key))
        cJSON_ReplaceItemInObjectCaseSensitive(obj, key, item);
    else
        cJSON_AddItemToObject(obj, key, item);
}

// AstrAI's config: the engine's own serialisation of the sizes and features, then the HF
// numbers verbatim, rope scaling and the origin. k: mixtral's experts per token.
static cJSON *astrai_config(const cJSON *hf, const HfShape *s, int k, int family) {
    unsigned bit = FAMILIES[family].bit;
    bool llama_bias = bit == LLAMA && cJSON_IsTrue(key_of(hf, "attention_bias"));
    ModelConfig mc = {
        .vocab_size = s->vocab_size,
        .hidden_size = s->hidden_size,
        .num_hidden_layers = s->num_hidden_layers,
        .num_attention_heads = s->num_attention_heads,
        .num_key_value_heads = s->num_key_value_heads,
        .intermediate_size = s->intermediate_size,
        .max_position_embeddings = s->max_position_embeddings,
        .rope_theta = bit == MIXTRAL ? 1e6 : 10000.0, // transformers' default when absent
        .tie_word_embeddings = s->tie_word_embeddings,
        .attention_bias = bit == QWEN2 || llama_bias,
        .o_proj_bias = llama_bias,
        .use_qk_norm = bit == QWEN3,
        .qk_norm_before_rope = bit == QWEN3,
        .ffn_type = bit == MIXTRAL ? FFN_MOE : FFN_MLP,
        .n_routed_experts = s->n_routed_experts,
        .n_shared_experts = 0,
        .n_activated_experts = k,
    };
    char *text = model_config_to_json(&mc);
    cJSON *o = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (!o) return NULL;
    put(o, "rms_norm_eps", cJSON_Duplicate(key_of(hf, "rms_norm_eps"), 0));
    if (key_of(hf, "rope_theta"))
        put(o, "rope_theta", cJSON_Duplicate(key_of(hf, "rope_theta"), 0));
    put(o, "rope_scaling", astrai_rope_scaling(key_of(hf, "rope_scaling")));
    put(o, "attention_bias", cJSON_CreateBool(mc.attention_bias));
    put(o, "o_proj_bias", cJSON_CreateBool(mc.o_proj_bias));
    if ((bit & (MISTRAL | MIXTRAL)) && key_of(hf, "sliding_window"))
        put(o, "sliding_window", cJSON_Duplicate(key_of(hf, "sliding_window"), 0));
    put(o, "qk_norm_before_rope", cJSON_CreateBool(mc.qk_norm_before_rope));
    put(o, "hf_model_type", cJSON_CreateString(FAMILIES[family].model_type));
    put(o, "hf_config", cJSON_Duplicate(hf, 1));
    return o;
}

// The engine parses the AstrAI config into *mc: every value is checked as for any model, and
// messages name the HF file.
static int engine_check(const cJSON *astrai, const char *path, ModelConfig *mc, Err *err) {
    char *text = cJSON_PrintUnformatted(astrai);
    if (!text) return err_resource(err, "%s: out of memory", path);
    int rc = model_config_parse(mc, text, path, err);
    free(text);
    return rc;
}

static int import_config(const char *path, cJSON **astrai, ModelConfig *mc, Err *err) {
    *astrai = NULL;
    cJSON *hf = NULL;
    HfShape shape;
    int family = -1, k = 0;
    int rc = json_read_file(path, &hf, err);
    if (!rc && !cJSON_IsObject(hf)) rc = err_set(err, "%s: not a JSON object", path);
    if (!rc) rc = read_family(hf, "model_type", path, &family, err);
    if (!rc) rc = read_shape(hf, path, FAMILIES[family].bit, &shape, &k, err);
    if (!rc) rc = check_keys(hf, path, &shape, FAMILIES[family].bit, err);
    if (!rc) {
        unsigned long failures = json_failures();
        *astrai = astrai_config(hf, &shape, k, family);
        if (!*astrai || json_failures() != failures)
            rc = err_resource(err, "%s: out of memory", path);
    }
    if (!rc) rc = engine_check(*astrai, path, mc, err);
    cJSON_Delete(hf);
    return rc;
}

int hf_config_import(const char *path, cJSON **astrai, HfShape *shape, Err *err) {
    ModelConfig mc;
    if (import_config(path, astrai, &mc, err)) return -1;
    shape_of(&mc, shape);
    return 0;
}

int hf_is_model_dir(const char *dir, bool *hf, Err *err) {
    char path[PATH_MAX];
    cJSON *root = NULL;
    Err why = {0};
    *hf = false;
    if (path_join(path, sizeof path, dir, "config.json", err)) return -1;
    if (json_read_file(path, &root, &why)) // unreadable: the AstrAI loader's message says why
        return why.resource ? err_resource(err, "%s", why.msg) : 0;
    const cJSON *mt = key_of(root, "model_type");
    *hf = cJSON_IsString(mt) && strcmp(mt->valuestring, "autoregressive_lm") != 0;
    cJSON_Delete(root);
    return 0;
}

int hf_load_config(ModelConfig *cfg, const char *hf_dir, Err *err) {
    char path[PATH_MAX];
    cJSON *astrai = NULL;
    int rc = path_join(path, sizeof path, hf_dir, "config.json", err) ||
             import_config(path, &astrai, cfg, err);
    cJSON_Delete(astrai);
    return rc;
}

// ---------------------------------------------------------------- export

// What of AstrAI's no HF family computes: gated attention, qk-norm after RoPE, MLA, shared
// experts.
static int check_exportable(const ModelConfig *mc, const char *path, Err *err) {
    if (mc->use_gated_attention)
        return err_set(err, "%s: use_gated_attention has no Hugging Face family", path);
    if (mc->attn_type == ATTN_MLA)
        return err_set(err,
                       "%s: attn_type mla has no Hugging Face family (DeepSeek's MLA shares one "
                       "rope key across heads, AstrAI's rotates one per kv head)",
                       path);
    if (mc->rope_scaling.kind == ROPE_SCALING_NTK)
        return err_set(err,
                       "%s: rope_scaling ntk (AstrAI's larger base) has no Hugging Face form: no "
                       "transformers rope type computes it",
                       path);
    if (mc->rope_scaling.kind == ROPE_SCALING_IGNORED)
        return err_set(err,
                       "%s: rope_scaling type '%s', which AstrAI ignores and transformers would "
                       "apply, has no Hugging Face form",
                       path, mc->rope_scaling.ignored_type);
    if (mc->ffn_type == FFN_MOE && mc->n_shared_experts)
        return err_set(err,
                       "%s: ffn_type moe with n_shared_experts %d has no Hugging Face family "
                       "(mixtral has no shared experts; qwen2_moe gates its one shared expert, "
                       "deepseek adds them up)",
                       path, mc->n_shared_experts);
    return 0;
}

// The family of AstrAI's features: hf_model_type when recorded, else mixtral for experts, qwen3
// for qk-norm, mistral for a window, qwen2 for biases, llama otherwise.
static int export_family(const cJSON *root, const ModelConfig *mc, const char *path, int *family,
                         Err *err) {
    if (check_exportable(mc, path, err)) return -1;
    if (mc->use_qk_norm && !mc->qk_norm_before_rope)
        return err_set(err,
                       "%s: use_qk_norm with qk_norm_before_rope false (qk-norm after RoPE) has "
                       "no Hugging Face family",
                       path);
    if (key_of(root, "hf_model_type")) {
        if (read_family(root, "hf_model_type", path, family, err)) return -1;
    } else {
        *family = family_of(mc->ffn_type == FFN_MOE ? "mixtral"
                            : mc->use_qk_norm       ? "qwen3"
                            : mc->sliding_window    ? "mistral"
                            : mc->o_proj_bias       ? "llama"
                            : mc->attention_bias    ? "qwen2"
                                                    : "llama");
    }
    unsigned bit = FAMILIES[*family].bit;
    const char *name = FAMILIES[*family].model_type;
    // q/k/v biases: always qwen2's, llama's only with o_proj's (its attention_bias: all four)
    bool biases_fit = bit == QWEN2   ? mc->attention_bias && !mc->o_proj_bias
                      : bit == LLAMA ? mc->attention_bias == mc->o_proj_bias
                                     : !mc->attention_bias && !mc->o_proj_bias;
    if (!biases_fit)
        return err_set(err, "%s: attention_bias %s with o_proj_bias %s does not fit the family %s",
                       path, mc->attention_bias ? "true" : "false",
                       mc->o_proj_bias ? "true" : "false", name);
    if (mc->sliding_window && !(bit & (MISTRAL | MIXTRAL)))
        return err_set(err,
                       "%s: sliding_window does not fit the family %s (only mistral and mixtral)",
                       path, name);
    if ((mc->ffn_type == FFN_MOE) != (bit == MIXTRAL))
        return err_set(err, "%s: ffn_type %s does not fit the family %s", path,
                       mc->ffn_type == FFN_MOE ? "moe" : "mlp", name);
    if (mc->use_qk_norm != (bit == QWEN3))
        return err_set(err, "%s: use_qk_norm %s does not fit the family %s", path,
                       mc->use_qk_norm ? "true" : "false", name);
    if (mc->rope_scaling.kind == ROPE_SCALING_LLAMA3 && (bit & (MISTRAL | MIXTRAL)))
        return err_set(err, "%s: rope_scaling does not fit the family %s", path, name);
    return 0;
}

// The HF keys a config synthesised for the family needs beyond the mapped ones.
static void add_family_defaults(cJSON *hf, int family, int head_dim) {
    unsigned bit = FAMILIES[family].bit;
    cJSON *arch = cJSON_AddArrayToObject(hf, "architectures");
    cJSON_AddItemToArray(arch, cJSON_CreateString(FAMILIES[family].architecture));
    cJSON_AddStringToObject(hf, "hidden_act", "silu");
    if (bit & (LLAMA | QWEN3)) cJSON_AddBoolToObject(hf, "attention_bias", false);
    if (bit == LLAMA) cJSON_AddBoolToObject(hf, "mlp_bias", false);
    if (!(bit & (QWEN2 | MIXTRAL))) cJSON_AddNumberToObject(hf, "head_dim", head_dim);
    if (bit & (MISTRAL | MIXTRAL)) cJSON_AddNullToObject(hf, "sliding_window");
    if (bit & (QWEN2 | QWEN3)) cJSON_AddBoolToObject(hf, "use_sliding_window", false);
}

// cJSON prints a whole-number double as an integer ("factor": 8), which transformers rejects or
// warns about for keys it types as floats: those are written as floats ("factor": 8.0).
static void floats_as_floats(cJSON *o) {
    static const char *const FLOAT_KEYS[] = {
        "rms_norm_eps",
        "rope_theta",
        "initializer_range",
        "attention_dropout",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "router_aux_loss_coef",
        "router_jitter_noise",
    };
    if (!cJSON_IsObject(o)) return;
    for (size_t i = 0; i < sizeof FLOAT_KEYS / sizeof *FLOAT_KEYS; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, FLOAT_KEYS[i]);
        char text[400];
        if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) ||
            v->valuedouble != floor(v->valuedouble))
            continue;
        snprintf(text, sizeof text, "%.1f", v->valuedouble);
        put(o, FLOAT_KEYS[i], cJSON_CreateRaw(text));
    }
}

// HF's form of AstrAI's (llama3) rope_scaling: the type keys ("rope_type", "type") the recorded
// HF config had, of those AstrAI's has (import adds "type" for AstrAI, §7b); "rope_type" alone
// without a recorded one.
static cJSON *hf_rope_scaling(const cJSON *rs, const cJSON *orig) {
    if (!rs) return cJSON_CreateNull();
    cJSON *o = cJSON_Duplicate(rs, 1);
    if (!o) return NULL;
    bool has_type = key_of(o, "type"), has_rope_type = key_of(o, "rope_type");
    bool keep_type = cJSON_IsObject(orig) ? key_of(orig, "type") != NULL : !has_rope_type;
    bool keep_rope_type = cJSON_IsObject(orig) ? key_of(orig, "rope_type") != NULL : true;
    if (has_type && !keep_type && (has_rope_type && keep_rope_type))
        cJSON_DeleteItemFromObjectCaseSensitive(o, "type");
    if (has_rope_type && !keep_rope_type && (has_type && keep_type))
        cJSON_DeleteItemFromObjectCaseSensitive(o, "rope_type");
    return o;
}

static cJSON *hf_config(const cJSON *root, const HfShape *s, int family, DType dtype) {
    const cJSON *orig = cJSON_GetObjectItemCaseSensitive(root, "hf_config");
    cJSON *hf = cJSON_IsObject(orig) ? cJSON_Duplicate(orig, 1) : cJSON_CreateObject();
    if (!hf) return NULL;
    if (!cJSON_IsObject(orig)) add_family_defaults(hf, family, s->head_dim);
    static const char *const COPIED[] = {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
    };
    for (size_t i = 0; i < sizeof COPIED / sizeof *COPIED; i++)
        if (key_of(root, COPIED[i]))
            put(hf, COPIED[i], cJSON_Duplicate(key_of(root, COPIED[i]), 0));
    put(hf, "model_type", cJSON_CreateString(FAMILIES[family].model_type));
    put(hf, "tie_word_embeddings", cJSON_CreateBool(s->tie_word_embeddings));
    if (cJSON_GetObjectItemCaseSensitive(hf, "head_dim"))
        put(hf, "head_dim", cJSON_CreateNumber(s->head_dim));
    // the engine's values of the family's keys, where the source has them or they differ from
    // the absent key's meaning
    unsigned bit = FAMILIES[family].bit;
    if (bit == LLAMA && (s->o_proj_bias || cJSON_GetObjectItemCaseSensitive(hf, "attention_bias")))
        put(hf, "attention_bias", cJSON_CreateBool(s->o_proj_bias));
    if ((bit & (MISTRAL | MIXTRAL)) &&
        (s->sliding_window || cJSON_GetObjectItemCaseSensitive(hf, "sliding_window")))
        put(hf, "sliding_window",
            s->sliding_window ? cJSON_CreateNumber(s->sliding_window) : cJSON_CreateNull());
    if (bit == MIXTRAL) {
        put(hf, "num_local_experts", cJSON_Duplicate(key_of(root, "n_routed_experts"), 0));
        put(hf, "num_experts_per_tok", cJSON_Duplicate(key_of(root, "n_activated_experts"), 0));
    }
    if (!(bit & (MISTRAL | MIXTRAL)))
        put(hf, "rope_scaling",
            hf_rope_scaling(key_of(root, "rope_scaling"),
                            cJSON_IsObject(orig) ? key_of(orig, "rope_scaling") : NULL));
    put(hf, "torch_dtype", cJSON_CreateString(dtype_info(dtype)->numpy));
    floats_as_floats(hf);
    floats_as_floats(cJSON_GetObjectItemCaseSensitive(hf, "rope_scaling"));
    return hf;
}

int hf_config_export(const char *path, DType dtype, cJSON **hf, HfShape *shape, Err *err) {
    *hf = NULL;
    ModelConfig mc;
    cJSON *root = NULL;
    int family = -1;
    int rc = model_config_load(&mc, path, err) || json_read_file(path, &root, err) ||
             export_family(root, &mc, path, &family, err);
    if (!rc) {
        shape_of(&mc, shape);
        unsigned long failures = json_failures();
        *hf = hf_config(root, shape, family, dtype);
        if (!*hf || json_failures() != failures) rc = err_resource(err, "%s: out of memory", path);
    }
    cJSON_Delete(root);
    return rc;
}
