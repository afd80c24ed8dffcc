// config.c: config.json of an AstrAI autoregressive_lm (docs/design.md §7) <-> ModelConfig.
#include "model/config.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fsutil.h"
#include "common/json.h"

static const cJSON *config_key(const cJSON *root, const char *key) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    return cJSON_IsNull(item) ? NULL : item;
}

// The size limits (docs/training.md "Model config"): far above any released model, low enough
// that no product of them overflows the planner's 64-bit sizes.
static const struct {
    const char *key;
    long max;
} SIZE_LIMITS[] = {
    {"vocab_size", 1L << 24},
    {"hidden_size", 1L << 16},
    {"num_hidden_layers", 1L << 12},
    {"num_attention_heads", 1L << 12},
    {"num_key_value_heads", 1L << 12},
    {"intermediate_size", 1L << 20},
    {"max_position_embeddings", 1L << 24},
    {"sliding_window", 1L << 24},
    {"kv_lora_rank", 1L << 16},
    {"qk_nope_head_dim", 1L << 12},
    {"qk_rope_head_dim", 1L << 12},
    {"n_routed_experts", 1L << 12},
    {"n_shared_experts", 1L << 8},
    {"n_activated_experts", 1L << 12},
};

long model_config_size_limit(const char *key) {
    for (size_t i = 0; i < sizeof SIZE_LIMITS / sizeof *SIZE_LIMITS; i++)
        if (!strcmp(SIZE_LIMITS[i].key, key)) return SIZE_LIMITS[i].max;
    return 1L << 30;
}

// A size key in [1, max]: a value above max is refused before anything is planned or allocated.
static int config_size(const cJSON *root, const char *key, long max, const char *source, int *out,
                       Err *err) {
    const cJSON *item = config_key(root, key);
    if (!item) return err_set(err, "%s: missing required key '%s'", source, key);
    double v = item->valuedouble;
    if (!cJSON_IsNumber(item) || v != floor(v))
        return err_set(err, "%s: key '%s' must be an integer", source, key);
    if (v <= 0) return err_set(err, "%s: key '%s' = %g must be a positive integer", source, key, v);
    if (v > (double)max)
        return err_set(err, "%s: key '%s' = %.0f is above astrai's limit of %ld", source, key, v,
                       max);
    *out = (int)v;
    return 0;
}

// An optional size key: absent or null is 0, else as config_size.
static int config_optional_size(const cJSON *root, const char *key, const char *source, int *out,
                                Err *err) {
    *out = 0;
    return config_key(root, key)
               ? config_size(root, key, model_config_size_limit(key), source, out, err)
               : 0;
}

static int config_positive_number(const cJSON *root, const char *key, const char *source,
                                  double fallback, double *out, Err *err) {
    const cJSON *item = config_key(root, key);
    if (!item) {
        if (fallback > 0) return *out = fallback, 0;
        return err_set(err, "%s: missing required key '%s'", source, key);
    }
    if (!cJSON_IsNumber(item)) return err_set(err, "%s: key '%s' must be a number", source, key);
    if (!(item->valuedouble > 0))
        return err_set(err, "%s: key '%s' = %g must be positive", source, key, item->valuedouble);
    *out = item->valuedouble;
    return 0;
}

// Optional boolean: absent or null means false (AstrAI's None).
static int config_bool(const cJSON *root, const char *key, const char *source, bool *out,
                       Err *err) {
    const cJSON *item = config_key(root, key);
    if (item && !cJSON_IsBool(item))
        return err_set(err, "%s: key '%s' must be true or false", source, key);
    *out = item && cJSON_IsTrue(item);
    return 0;
}

// Optional string key: absent or null is choices[0]; else the index of its value in choices
// (n of them), an error naming the key and value when it is none of them.
static int config_enum(const cJSON *root, const char *key, const char *const *choices, int n,
                       const char *source, int *out, Err *err) {
    const cJSON *item = config_key(root, key);
    *out = 0;
    if (!item) return 0;
    if (!cJSON_IsString(item)) return err_set(err, "%s: key '%s' must be a string", source, key);
    for (int i = 0; i < n; i++)
        if (!strcmp(item->valuestring, choices[i])) return *out = i, 0;
    char only[128] = "";
    for (int i = 0; i < n; i++)
        snprintf(only + strlen(only), sizeof only - strlen(only), "%s'%s'", i ? " or " : "",
                 choices[i]);
    return err_set(err, "%s: %s '%s' is not supported (only %s)", source, key, item->valuestring,
                   only);
}

// A required count in [0, limit]: n_shared_experts may be 0.
static int config_count(const cJSON *root, const char *key, const char *source, int *out,
                        Err *err) {
    const cJSON *item = config_key(root, key);
    if (item && cJSON_IsNumber(item) && item->valuedouble == 0) return *out = 0, 0;
    return config_size(root, key, model_config_size_limit(key), source, out, err);
}

// Llama 3's keys of rope_scaling (where: "<source>: rope_scaling").
static int config_llama3_scaling(const cJSON *rs, const char *where, RopeScaling *out, Err *err) {
    double orig = 0;
    if (config_positive_number(rs, "factor", where, 0, &out->factor, err) ||
        config_positive_number(rs, "low_freq_factor", where, 0, &out->low_freq_factor, err) ||
        config_positive_number(rs, "high_freq_factor", where, 0, &out->high_freq_factor, err) ||
        config_positive_number(rs, "original_max_position_embeddings", where, 0, &orig, err))
        return -1;
    if (!(out->high_freq_factor > out->low_freq_factor))
        return err_set(err, "%s: high_freq_factor %g must exceed low_freq_factor %g", where,
                       out->high_freq_factor, out->low_freq_factor);
    if (orig != floor(orig) || orig > 1 << 30)
        return err_set(err, "%s: original_max_position_embeddings %g must be an integer", where,
                       orig);
    out->original_max_position_embeddings = (int)orig;
    out->kind = ROPE_SCALING_LLAMA3;
    return 0;
}

// A type AstrAI does not compute (it leaves the base alone): kept verbatim for config.json.
static int config_ignored_scaling(const cJSON *rs, const char *type, const char *where,
                                  RopeScaling *out, Err *err) {
    char *text = cJSON_PrintUnformatted(rs);
    if (!text) return err_resource(err, "%s: out of memory", where);
    int rc = 0;
    if (strlen(text) >= sizeof out->raw)
        rc = err_set(err, "%s: the object takes %zu bytes (at most %zu)", where, strlen(text),
                     sizeof out->raw - 1);
    else
        snprintf(out->raw, sizeof out->raw, "%s", text);
    snprintf(out->ignored_type, sizeof out->ignored_type, "%s", type);
    out->kind = ROPE_SCALING_IGNORED;
    free(text);
    return rc;
}

// rope_scaling as AstrAI reads it (docs/design.md §7b; config.h).
static int config_rope_scaling(const cJSON *root, const char *source, RopeScaling *out, Err *err) {
    const cJSON *rs = config_key(root, "rope_scaling");
    *out = (RopeScaling){0};
    if (!rs) return 0;
    if (!cJSON_IsObject(rs))
        return err_set(err, "%s: rope_scaling must be null or an object", source);
    char where[256];
    snprintf(where, sizeof where, "%s: rope_scaling", source);
    const cJSON *type = config_key(rs, "type"), *rope_type = config_key(rs, "rope_type");
    if ((type && !cJSON_IsString(type)) || (rope_type && !cJSON_IsString(rope_type)))
        return err_set(err, "%s: type and rope_type must be strings", where);
    const char *name = type ? type->valuestring : rope_type ? rope_type->valuestring : "ntk";
    if (!strcmp(name, "llama3") || (rope_type && !strcmp(rope_type->valuestring, "llama3")))
        return config_llama3_scaling(rs, where, out, err);
    if (strcmp(name, "ntk") != 0 || (!type && rope_type))
        return config_ignored_scaling(rs, name, where, out, err);
    out->kind = ROPE_SCALING_NTK;
    return config_positive_number(rs, "factor", where, 1.0, &out->factor, err);
}

// The "hf_*" keys, kept verbatim as one JSON object's text in extra (CONFIG_EXTRA_MAX bytes).
static int config_keep_extra(const cJSON *root, const char *source, char *extra, Err *err) {
    extra[0] = 0;
    cJSON *kept = cJSON_CreateObject();
    if (!kept) return err_resource(err, "%s: out of memory", source);
    int rc = 0;
    for (const cJSON *e = root->child; e && !rc; e = e->next) {
        if (strncmp(e->string, "hf_", 3) != 0) continue;
        cJSON *copy = cJSON_Duplicate(e, 1);
        if (!copy || !cJSON_AddItemToObject(kept, e->string, copy))
            rc = err_resource(err, "%s: out of memory", source);
    }
    char *text = rc || !kept->child ? NULL : cJSON_PrintUnformatted(kept);
    if (!rc && kept->child && !text) rc = err_resource(err, "%s: out of memory", source);
    if (text && strlen(text) >= CONFIG_EXTRA_MAX)
        rc = err_set(err, "%s: the hf_* keys take %zu bytes (at most %d)", source, strlen(text),
                     CONFIG_EXTRA_MAX - 1);
    else if (text)
        memcpy(extra, text, strlen(text) + 1);
    free(text);
    cJSON_Delete(kept);
    return rc;
}

static int config_read_sizes(ModelConfig *cfg, const cJSON *root, const char *source, Err *err) {
    const struct {
        const char *key;
        int *out;
    } sizes[] = {
        {"vocab_size", &cfg->vocab_size},
        {"hidden_size", &cfg->hidden_size},
        {"num_hidden_layers", &cfg->num_hidden_layers},
        {"num_attention_heads", &cfg->num_attention_heads},
        {"num_key_value_heads", &cfg->num_key_value_heads},
        {"intermediate_size", &cfg->intermediate_size},
        {"max_position_embeddings", &cfg->max_position_embeddings},
    };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        if (config_size(root, sizes[i].key, model_config_size_limit(sizes[i].key), source,
                        sizes[i].out, err))
            return -1;
    return 0;
}

// MLA's keys (docs/design.md §7a): the per-head dimension is nope + rope, and o_proj (hidden x
// heads*head_dim) needs heads*head_dim = hidden_size.
static int config_read_mla(ModelConfig *cfg, const cJSON *root, const char *source, Err *err) {
    if (config_size(root, "kv_lora_rank", model_config_size_limit("kv_lora_rank"), source,
                    &cfg->kv_lora_rank, err) ||
        config_size(root, "qk_nope_head_dim", model_config_size_limit("qk_nope_head_dim"), source,
                    &cfg->qk_nope_head_dim, err) ||
        config_size(root, "qk_rope_head_dim", model_config_size_limit("qk_rope_head_dim"), source,
                    &cfg->qk_rope_head_dim, err))
        return -1;
    if (cfg->attention_bias)
        return err_set(err,
                       "%s: attention_bias does not apply to attn_type 'mla' (AstrAI's MLA "
                       "projections have no biases)",
                       source);
    cfg->head_dim = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim;
    cfg->rope_dim = cfg->qk_rope_head_dim;
    if ((long)cfg->num_attention_heads * cfg->head_dim != cfg->hidden_size)
        return err_set(err,
                       "%s: attn_type 'mla' needs num_attention_heads %d * (qk_nope_head_dim %d + "
                       "qk_rope_head_dim %d) = hidden_size %d (AstrAI's o_proj)",
                       source, cfg->num_attention_heads, cfg->qk_nope_head_dim,
                       cfg->qk_rope_head_dim, cfg->hidden_size);
    if (cfg->rope_dim % 2)
        return err_set(err, "%s: qk_rope_head_dim %d must be even for RoPE", source, cfg->rope_dim);
    return 0;
}

// DeepSeekMoE's keys (docs/design.md §7a); topk_method "greedy" (null: greedy).
static int config_read_moe(ModelConfig *cfg, const cJSON *root, const char *source, Err *err) {
    static const char *const methods[] = {"greedy"};
    int method;
    if (config_size(root, "n_routed_experts", model_config_size_limit("n_routed_experts"), source,
                    &cfg->n_routed_experts, err) ||
        config_count(root, "n_shared_experts", source, &cfg->n_shared_experts, err) ||
        config_size(root, "n_activated_experts", model_config_size_limit("n_activated_experts"),
                    source, &cfg->n_activated_experts, err) ||
        config_enum(root, "topk_method", methods, 1, source, &method, err))
        return -1;
    if (cfg->n_activated_experts > cfg->n_routed_experts)
        return err_set(err, "%s: n_activated_experts %d exceeds n_routed_experts %d", source,
                       cfg->n_activated_experts, cfg->n_routed_experts);
    return 0;
}

static int config_check_shapes(ModelConfig *cfg, const cJSON *root, const char *source, Err *err) {
    if (cfg->num_attention_heads % cfg->num_key_value_heads)
        return err_set(err, "%s: num_attention_heads %d is not divisible by num_key_value_heads %d",
                       source, cfg->num_attention_heads, cfg->num_key_value_heads);
    if (cfg->ffn_type == FFN_MOE && config_read_moe(cfg, root, source, err)) return -1;
    if (cfg->attn_type == ATTN_MLA) return config_read_mla(cfg, root, source, err);
    if (cfg->hidden_size % cfg->num_attention_heads)
        return err_set(err, "%s: hidden_size %d is not divisible by num_attention_heads %d", source,
                       cfg->hidden_size, cfg->num_attention_heads);
    cfg->head_dim = cfg->rope_dim = cfg->hidden_size / cfg->num_attention_heads;
    if (cfg->head_dim % 2)
        return err_set(err,
                       "%s: head_dim %d (hidden_size / num_attention_heads) must be even "
                       "for RoPE",
                       source, cfg->head_dim);
    return 0;
}

static int config_from_json(ModelConfig *cfg, const cJSON *root, const char *source, Err *err) {
    if (!cJSON_IsObject(root)) return err_set(err, "%s: not a JSON object", source);
    memset(cfg, 0, sizeof *cfg);
    static const char *const model_types[] = {"autoregressive_lm"}, *const attn[] = {"gqa", "mla"},
                             *const ffn[] = {"mlp", "moe"};
    int model_type, attn_type, ffn_type;
    if (config_enum(root, "model_type", model_types, 1, source, &model_type, err) ||
        config_enum(root, "attn_type", attn, 2, source, &attn_type, err) ||
        config_enum(root, "ffn_type", ffn, 2, source, &ffn_type, err))
        return -1;
    cfg->attn_type = (AttnType)attn_type;
    cfg->ffn_type = (FfnType)ffn_type;
    double eps = 0;
    if (config_read_sizes(cfg, root, source, err) ||
        config_positive_number(root, "rms_norm_eps", source, 0, &eps, err) ||
        config_positive_number(root, "rope_theta", source, 10000.0, &cfg->rope_theta, err) ||
        config_bool(root, "tie_word_embeddings", source, &cfg->tie_word_embeddings, err) ||
        config_bool(root, "use_qk_norm", source, &cfg->use_qk_norm, err) ||
        config_bool(root, "use_gated_attention", source, &cfg->use_gated_attention, err) ||
        config_bool(root, "attention_bias", source, &cfg->attention_bias, err) ||
        config_bool(root, "o_proj_bias", source, &cfg->o_proj_bias, err) ||
        config_optional_size(root, "sliding_window", source, &cfg->sliding_window, err) ||
        config_bool(root, "qk_norm_before_rope", source, &cfg->qk_norm_before_rope, err) ||
        config_rope_scaling(root, source, &cfg->rope_scaling, err) ||
        config_keep_extra(root, source, cfg->extra, err))
        return -1;
    if (cfg->qk_norm_before_rope && !cfg->use_qk_norm)
        return err_set(err, "%s: qk_norm_before_rope needs use_qk_norm true", source);
    cfg->rms_norm_eps = (float)eps;
    const cJSON *alpha = config_key(root, "neftune_alpha");
    if (alpha && !(cJSON_IsNumber(alpha) && alpha->valuedouble >= 0))
        return err_set(err, "%s: key 'neftune_alpha' must be a non-negative number", source);
    cfg->neftune_alpha = alpha ? alpha->valuedouble : 0.0;
    return config_check_shapes(cfg, root, source, err);
}

int model_config_parse(ModelConfig *cfg, const char *json, const char *source, Err *err) {
    cJSON *root = cJSON_Parse(json);
    if (!root && json_out_of_memory()) return err_resource(err, "%s: out of memory", source);
    if (!root)
        return err_set(err, "%s: malformed JSON near byte %td", source,
                       cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - json : (ptrdiff_t)0);
    int rc = config_from_json(cfg, root, source, err);
    cJSON_Delete(root);
    return rc;
}

int model_config_load(ModelConfig *cfg, const char *path, Err *err) {
    char *text = NULL;
    size_t len = 0;
    if (fs_read_file(path, &text, &len, err)) return -1;
    int rc = model_config_parse(cfg, text, path, err);
    free(text);
    return rc;
}

// The shortest decimal that reads back as the same float (1e-05, not 9.99999975e-06).
static double float_as_short_decimal(float f) {
    char buf[32];
    for (int digits = 6; digits < 9; digits++) {
        snprintf(buf, sizeof buf, "%.*g", digits, (double)f);
        if ((float)strtod(buf, NULL) == f) return strtod(buf, NULL);
    }
    return (double)f;
}

static void add_rope_scaling(cJSON *root, const RopeScaling *rs) {
    if (rs->kind == ROPE_SCALING_NONE) {
        cJSON_AddNullToObject(root, "rope_scaling");
        return;
    }
    cJSON *o = rs->kind == ROPE_SCALING_IGNORED ? cJSON_Parse(rs->raw) : cJSON_CreateObject();
    if (!o || !cJSON_AddItemToObject(root, "rope_scaling", o)) {
        cJSON_Delete(o);
        return;
    }
    if (rs->kind == ROPE_SCALING_NTK) {
        cJSON_AddStringToObject(o, "type", "ntk");
        cJSON_AddNumberToObject(o, "factor", rs->factor);
    } else if (rs->kind == ROPE_SCALING_LLAMA3) {
        // "type" too: AstrAI reads only "type", and without it would take the object for NTK.
        cJSON_AddStringToObject(o, "rope_type", "llama3");
        cJSON_AddStringToObject(o, "type", "llama3");
        cJSON_AddNumberToObject(o, "factor", rs->factor);
        cJSON_AddNumberToObject(o, "low_freq_factor", rs->low_freq_factor);
        cJSON_AddNumberToObject(o, "high_freq_factor", rs->high_freq_factor);
        cJSON_AddNumberToObject(o, "original_max_position_embeddings",
                                rs->original_max_position_embeddings);
    }
}

// An MLA or MoE key: its value where the model has that part, else null (as AstrAI writes it).
static void add_size_or_null(cJSON *root, const char *key, bool present, int value) {
    if (present)
        cJSON_AddNumberToObject(root, key, value);
    else
        cJSON_AddNullToObject(root, key);
}

// The kept hf_* keys (text that config_keep_extra printed, so it parses).
static void add_extra(cJSON *root, const char *extra) {
    cJSON *kept = extra[0] ? cJSON_Parse(extra) : NULL;
    for (cJSON *e = kept ? kept->child : NULL; e; e = e->next)
        cJSON_AddItemToObject(root, e->string, cJSON_Duplicate(e, 1));
    cJSON_Delete(kept);
}

char *model_config_to_json(const ModelConfig *cfg) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    cJSON_AddStringToObject(root, "model_type", "autoregressive_lm");
    cJSON_AddNumberToObject(root, "neftune_alpha", cfg->neftune_alpha);
    cJSON_AddNumberToObject(root, "vocab_size", cfg->vocab_size);
    cJSON_AddNumberToObject(root, "hidden_size", cfg->hidden_size);
    cJSON_AddNumberToObject(root, "num_hidden_layers", cfg->num_hidden_layers);
    cJSON_AddNumberToObject(root, "rms_norm_eps", float_as_short_decimal(cfg->rms_norm_eps));
    cJSON_AddNumberToObject(root, "intermediate_size", cfg->intermediate_size);
    cJSON_AddBoolToObject(root, "tie_word_embeddings", cfg->tie_word_embeddings);
    cJSON_AddNumberToObject(root, "max_position_embeddings", cfg->max_position_embeddings);
    cJSON_AddNumberToObject(root, "rope_theta", cfg->rope_theta);
    add_rope_scaling(root, &cfg->rope_scaling);
    bool mla = cfg->attn_type == ATTN_MLA, moe = cfg->ffn_type == FFN_MOE;
    cJSON_AddStringToObject(root, "attn_type", mla ? "mla" : "gqa");
    cJSON_AddNumberToObject(root, "num_attention_heads", cfg->num_attention_heads);
    cJSON_AddNumberToObject(root, "num_key_value_heads", cfg->num_key_value_heads);
    cJSON_AddBoolToObject(root, "use_qk_norm", cfg->use_qk_norm);
    cJSON_AddBoolToObject(root, "use_gated_attention", cfg->use_gated_attention);
    add_size_or_null(root, "kv_lora_rank", mla, cfg->kv_lora_rank);
    add_size_or_null(root, "qk_nope_head_dim", mla, cfg->qk_nope_head_dim);
    add_size_or_null(root, "qk_rope_head_dim", mla, cfg->qk_rope_head_dim);
    cJSON_AddStringToObject(root, "ffn_type", moe ? "moe" : "mlp");
    add_size_or_null(root, "n_routed_experts", moe, cfg->n_routed_experts);
    add_size_or_null(root, "n_shared_experts", moe, cfg->n_shared_experts);
    add_size_or_null(root, "n_activated_experts", moe, cfg->n_activated_experts);
    if (moe)
        cJSON_AddStringToObject(root, "topk_method", "greedy");
    else
        cJSON_AddNullToObject(root, "topk_method");
    if (cfg->attention_bias) cJSON_AddBoolToObject(root, "attention_bias", true);
    if (cfg->o_proj_bias) cJSON_AddBoolToObject(root, "o_proj_bias", true);
    if (cfg->sliding_window) cJSON_AddNumberToObject(root, "sliding_window", cfg->sliding_window);
    if (cfg->qk_norm_before_rope) cJSON_AddBoolToObject(root, "qk_norm_before_rope", true);
    add_extra(root, cfg->extra);
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    return text;
}
