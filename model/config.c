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

// Optional string key that must equal `only` when present.
static int config_choice(const cJSON *root, const char *key, const char *only, const char *source,
                         Err *err) {
    const cJSON *item = config_key(root, key);
    if (!item) return 0;
    if (!cJSON_IsString(item)) return err_set(err, "%s: key '%s' must be a string", source, key);
    if (strcmp(item->valuestring, only) != 0)
        return err_set(err, "%s: %s '%s' is not supported (only '%s')", source, key,
                       item->valuestring, only);
    return 0;
}

// rope_scaling: null, or {"rope_type" (or "type"): "llama3", factor, low_freq_factor,
// high_freq_factor, original_max_position_embeddings} as transformers reads it.
static int config_rope_scaling(const cJSON *root, const char *source, RopeScaling *out, Err *err) {
    const cJSON *rs = config_key(root, "rope_scaling");
    *out = (RopeScaling){0};
    if (!rs) return 0;
    if (!cJSON_IsObject(rs))
        return err_set(err, "%s: rope_scaling must be null or an object", source);
    const cJSON *type = config_key(rs, "rope_type");
    if (!type) type = config_key(rs, "type");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "llama3") != 0)
        return err_set(err, "%s: rope_scaling type '%s' is not supported (only 'llama3')", source,
                       cJSON_IsString(type) ? type->valuestring : "(none)");
    char where[256];
    snprintf(where, sizeof where, "%s: rope_scaling", source);
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
    out->llama3 = true;
    return 0;
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

static int config_check_shapes(ModelConfig *cfg, const char *source, Err *err) {
    if (cfg->hidden_size % cfg->num_attention_heads)
        return err_set(err, "%s: hidden_size %d is not divisible by num_attention_heads %d", source,
                       cfg->hidden_size, cfg->num_attention_heads);
    if (cfg->num_attention_heads % cfg->num_key_value_heads)
        return err_set(err, "%s: num_attention_heads %d is not divisible by num_key_value_heads %d",
                       source, cfg->num_attention_heads, cfg->num_key_value_heads);
    cfg->head_dim = cfg->hidden_size / cfg->num_attention_heads;
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
    if (config_choice(root, "model_type", "autoregressive_lm", source, err) ||
        config_choice(root, "attn_type", "gqa", source, err) ||
        config_choice(root, "ffn_type", "mlp", source, err))
        return -1;
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
    return config_check_shapes(cfg, source, err);
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
    if (!rs->llama3) {
        cJSON_AddNullToObject(root, "rope_scaling");
        return;
    }
    cJSON *o = cJSON_AddObjectToObject(root, "rope_scaling");
    if (!o) return;
    cJSON_AddStringToObject(o, "rope_type", "llama3");
    cJSON_AddNumberToObject(o, "factor", rs->factor);
    cJSON_AddNumberToObject(o, "low_freq_factor", rs->low_freq_factor);
    cJSON_AddNumberToObject(o, "high_freq_factor", rs->high_freq_factor);
    cJSON_AddNumberToObject(o, "original_max_position_embeddings",
                            rs->original_max_position_embeddings);
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
    cJSON_AddStringToObject(root, "attn_type", "gqa");
    cJSON_AddNumberToObject(root, "num_attention_heads", cfg->num_attention_heads);
    cJSON_AddNumberToObject(root, "num_key_value_heads", cfg->num_key_value_heads);
    cJSON_AddBoolToObject(root, "use_qk_norm", cfg->use_qk_norm);
    cJSON_AddBoolToObject(root, "use_gated_attention", cfg->use_gated_attention);
    // MLA and MoE are not supported (attn_type gqa, ffn_type mlp): AstrAI writes them as null.
    cJSON_AddNullToObject(root, "kv_lora_rank");
    cJSON_AddNullToObject(root, "qk_nope_head_dim");
    cJSON_AddNullToObject(root, "qk_rope_head_dim");
    cJSON_AddStringToObject(root, "ffn_type", "mlp");
    cJSON_AddNullToObject(root, "n_routed_experts");
    cJSON_AddNullToObject(root, "n_shared_experts");
    cJSON_AddNullToObject(root, "n_activated_experts");
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
