#include "proto/train_spec.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { KEY_STR, KEY_INT, KEY_FLOAT, KEY_BOOL } KeyType;

typedef struct {
    const char *name;
    KeyType type;
    size_t offset;
    const char *def;     // default as text ("" for an empty string)
    double min, max;     // numeric range (inclusive)
    const char *choices; // "a|b|c" for enumerated strings, NULL for free text
    const char *help;
} KeyDef;

#define F(field) offsetof(TrainSpec, field)
#define NOLIM -DBL_MAX, DBL_MAX

// clang-format off
static const KeyDef KEYS[] = {
    {"train_type", KEY_STR, F(train_type), "", 0, 0, "seq|sft", "training type (required)"},
    {"param_path", KEY_STR, F(param_path), "", 0, 0, NULL, "model or checkpoint directory (required)"},
    {"data_root_path", KEY_STR, F(data_root_path), "", 0, 0, NULL, "bin dataset root (required)"},
    {"resume", KEY_BOOL, F(resume), "false", 0, 0, NULL, "continue from the checkpoint in param_path, else the latest in ckpt_dir"},
    {"n_epoch", KEY_INT, F(n_epoch), "1", 1, 1e9, NULL, "number of epochs"},
    {"batch_per_device", KEY_INT, F(batch_per_device), "1", 1, 65536, NULL, "micro-batch size per rank"},
    {"grad_accum_steps", KEY_INT, F(grad_accum_steps), "1", 1, 1e6, NULL, "micro-steps per optimizer step"},
    {"window_size", KEY_INT, F(window_size), "0", 0, 1e7, NULL, "tokens per sample (0: max_position_embeddings)"},
    {"stride", KEY_INT, F(stride), "0", 0, 1e9, NULL, "window stride (0: window_size)"},
    {"shuffle", KEY_BOOL, F(shuffle), "true", 0, 0, NULL, "shuffle samples each epoch (seed random_seed+epoch)"},
    {"random_seed", KEY_INT, F(random_seed), "3407", 0, 9.2e18, NULL, "random seed"},
    {"optimizer", KEY_STR, F(optimizer), "muon", 0, 0, "muon|adamw", "optimizer"},
    {"max_lr", KEY_FLOAT, F(max_lr), "3e-4", 0, 10, NULL, "peak learning rate"},
    {"weight_decay", KEY_FLOAT, F(weight_decay), "0.1", 0, 1, NULL, "decoupled weight decay (Muon part, or every AdamW parameter)"},
    {"max_grad_norm", KEY_FLOAT, F(max_grad_norm), "1.0", 0, 1e9, NULL, "gradient clipping norm (0: off)"},
    {"label_smoothing", KEY_FLOAT, F(label_smoothing), "0.0", 0, 1, NULL, "cross-entropy label smoothing"},
    {"schedule_type", KEY_STR, F(schedule_type), "cosine", 0, 0, "cosine|wsd|sgdr", "learning-rate schedule"},
    {"warmup_ratio", KEY_FLOAT, F(warmup_ratio), "0.05", 0, 1, NULL, "fraction of steps for warmup"},
    {"min_rate", KEY_FLOAT, F(min_rate), "0.01", 0, 1, NULL, "minimum lr as a fraction of max_lr"},
    {"stable_steps", KEY_INT, F(stable_steps), "0", 0, 1e12, NULL, "wsd plateau steps (0: 80% of the post-warmup steps)"},
    {"decay_steps", KEY_INT, F(decay_steps), "0", 0, 1e12, NULL, "wsd decay steps (0: the rest)"},
    {"cycle_length", KEY_INT, F(cycle_length), "0", 0, 1e12, NULL, "sgdr first cycle (0: the post-warmup steps)"},
    {"t_mult", KEY_INT, F(t_mult), "2", 1, 1e6, NULL, "sgdr cycle length multiplier"},
    {"ckpt_interval", KEY_INT, F(ckpt_interval), "5000", 1, 1e12, NULL, "optimizer steps between checkpoints"},
    {"ckpt_dir", KEY_STR, F(ckpt_dir), "checkpoint", 0, 0, NULL, "checkpoint directory (also holds progress.db)"},
    {"ckpt_dtype", KEY_STR, F(ckpt_dtype), "fp32", 0, 0, "fp32|bf16", "dtype of model.safetensors in checkpoints"},
    {"max_steps", KEY_INT, F(max_steps), "0", 0, 1e12, NULL, "stop after this many optimizer steps, with a checkpoint (0: run all epochs; the schedule still spans them)"},
    {"log_interval", KEY_INT, F(log_interval), "10", 1, 1e12, NULL, "optimizer steps between progress lines"},
    {"parallel_mode", KEY_STR, F(parallel_mode), "none", 0, 0, "none|ddp|fsdp", "parallel executor"},
    {"nprocs", KEY_INT, F(nprocs), "1", 1, 4096, NULL, "number of ranks"},
    {"bucket_mb", KEY_FLOAT, F(bucket_mb), "0", 0, 1e6, NULL, "ddp/fsdp: MiB of gradients reduced together while backward goes on (0: 25 with nccl, one bucket on CPU ranks)"},
    {"comm_timeout", KEY_INT, F(comm_timeout), "600", 1, 86400, NULL, "seconds a collective may wait for the other ranks"},
    {"threads", KEY_INT, F(threads), "0", 0, 4096, NULL, "CPU threads per rank (0: cores / local ranks)"},
    {"device_type", KEY_STR, F(device_type), "auto", 0, 0, "auto|cpu|cuda", "where ranks compute (auto: cuda when built with CUDA and a GPU is visible, else cpu); rank r uses visible GPU LOCAL_RANK"},
    {"dtype", KEY_STR, F(dtype), "auto", 0, 0, "auto|bf16|fp32", "compute dtype of weights and activations (auto: bf16 on cuda with fp32 master weights and optimizer state, fp32 on cpu)"},
    {"gradient_checkpointing", KEY_BOOL, F(gradient_checkpointing), "false", 0, 0, NULL, "keep only each block's input and recompute the block in backward (less memory, same numbers)"},
};
// clang-format on
#define N_KEYS (sizeof KEYS / sizeof KEYS[0])

static const KeyDef *find_key(const char *name) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(KEYS[i].name, name) == 0) return &KEYS[i];
    return NULL;
}

// Levenshtein distance, for "did you mean" suggestions.
static size_t edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return SIZE_MAX;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t sub = diag + (a[i - 1] != b[j - 1]);
            size_t best = up + 1 < row[j - 1] + 1 ? up + 1 : row[j - 1] + 1;
            row[j] = sub < best ? sub : best;
            diag = up;
        }
    }
    return row[lb];
}

static int unknown_key(const char *name, Err *err) {
    const char *best = NULL;
    size_t best_d = SIZE_MAX;
    for (size_t i = 0; i < N_KEYS; i++) {
        size_t d = edit_distance(name, KEYS[i].name);
        if (d < best_d) best_d = d, best = KEYS[i].name;
    }
    if (best && best_d <= strlen(name) / 2 + 1)
        return err_set(err, "unknown key '%s' (did you mean '%s'?)", name, best);
    return err_set(err, "unknown key '%s' (see --help for the valid keys)", name);
}

static int choice_ok(const char *choices, const char *value) {
    size_t n = strlen(value);
    for (const char *p = choices; *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, value, n) == 0) return 1;
        p += len + (bar != NULL);
    }
    return 0;
}

static int check_range(const KeyDef *k, double v, const char *text, Err *err) {
    if (v < k->min || v > k->max || isnan(v))
        return err_set(err, "%s: value %s is out of range [%g, %g]", k->name, text, k->min, k->max);
    return 0;
}

static int set_bool(const KeyDef *k, bool *dst, const char *value, Err *err) {
    if (!strcmp(value, "true") || !strcmp(value, "1") || !strcmp(value, "yes"))
        *dst = true;
    else if (!strcmp(value, "false") || !strcmp(value, "0") || !strcmp(value, "no"))
        *dst = false;
    else
        return err_set(err, "%s: '%s' is not a boolean (true|false)", k->name, value);
    return 0;
}

static int set_int(const KeyDef *k, long *dst, const char *value, Err *err) {
    char *end;
    errno = 0;
    long v = strtol(value, &end, 10);
    if (errno || end == value || *end)
        return err_set(err, "%s: '%s' is not an integer", k->name, value);
    if (check_range(k, (double)v, value, err)) return -1;
    *dst = v;
    return 0;
}

static int set_float(const KeyDef *k, double *dst, const char *value, Err *err) {
    char *end;
    errno = 0;
    double v = strtod(value, &end);
    if (errno || end == value || *end || !isfinite(v))
        return err_set(err, "%s: '%s' is not a number", k->name, value);
    if (check_range(k, v, value, err)) return -1;
    *dst = v;
    return 0;
}

static int set_str(const KeyDef *k, char **dst, const char *value, Err *err) {
    if (k->choices && !choice_ok(k->choices, value))
        return err_set(err, "%s: '%s' is not one of %s", k->name, value, k->choices);
    char *copy = strdup(value);
    if (!copy) return err_set(err, "%s: out of memory", k->name);
    free(*dst);
    *dst = copy;
    return 0;
}

static int set_key(TrainSpec *s, const KeyDef *k, const char *value, Err *err) {
    char *field = (char *)s + k->offset;
    switch (k->type) {
    case KEY_BOOL:
        return set_bool(k, (bool *)field, value, err);
    case KEY_INT:
        return set_int(k, (long *)field, value, err);
    case KEY_FLOAT:
        return set_float(k, (double *)field, value, err);
    case KEY_STR:
        return set_str(k, (char **)field, value, err);
    }
    return err_set(err, "%s: unknown key type", k->name);
}

void train_spec_defaults(TrainSpec *s) {
    memset(s, 0, sizeof *s);
    for (size_t i = 0; i < N_KEYS; i++) {
        Err err;
        // Required keys default to "" (unset), which is not one of their choices.
        if (!*KEYS[i].def)
            *(char **)((char *)s + KEYS[i].offset) = strdup("");
        else if (set_key(s, &KEYS[i], KEYS[i].def, &err))
            abort(); // a bad default is a bug
    }
}

void train_spec_free(TrainSpec *s) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (KEYS[i].type == KEY_STR) free(*(char **)((char *)s + KEYS[i].offset));
    memset(s, 0, sizeof *s);
}

int train_spec_set(TrainSpec *s, const char *key, const char *value, Err *err) {
    const KeyDef *k = find_key(key);
    if (!k) return unknown_key(key, err);
    return set_key(s, k, value, err);
}

int train_spec_parse_args(TrainSpec *s, int argc, char **argv, bool *help, Err *err) {
    *help = false;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            *help = true;
            continue;
        }
        if (strncmp(arg, "--", 2) != 0 || !arg[2])
            return err_set(err, "unexpected argument '%s' (flags look like --key=value)", arg);
        char key[128];
        const char *eq = strchr(arg + 2, '=');
        size_t klen = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
        if (klen >= sizeof key) return err_set(err, "flag '%s' is too long", arg);
        memcpy(key, arg + 2, klen);
        key[klen] = 0;
        const KeyDef *k = find_key(key);
        if (!k) return unknown_key(key, err);
        const char *value = eq ? eq + 1 : NULL;
        if (!value && k->type == KEY_BOOL) value = "true";
        if (!value) {
            if (i + 1 >= argc) return err_set(err, "%s: missing value", key);
            value = argv[++i];
        }
        if (set_key(s, k, value, err)) return -1;
    }
    return 0;
}

// Renders a JSON scalar as the text a flag would carry, checking the JSON type.
static int json_value_text(const KeyDef *k, const cJSON *v, char *buf, size_t cap, Err *err) {
    switch (k->type) {
    case KEY_BOOL:
        if (!cJSON_IsBool(v)) return err_set(err, "%s: expected true or false", k->name);
        snprintf(buf, cap, "%s", cJSON_IsTrue(v) ? "true" : "false");
        return 0;
    case KEY_INT:
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
            return err_set(err, "%s: expected an integer", k->name);
        snprintf(buf, cap, "%.0f", v->valuedouble);
        return 0;
    case KEY_FLOAT:
        if (!cJSON_IsNumber(v)) return err_set(err, "%s: expected a number", k->name);
        snprintf(buf, cap, "%.17g", v->valuedouble);
        return 0;
    case KEY_STR:
        if (!cJSON_IsString(v)) return err_set(err, "%s: expected a string", k->name);
        if (strlen(v->valuestring) >= cap) return err_set(err, "%s: value too long", k->name);
        snprintf(buf, cap, "%s", v->valuestring);
        return 0;
    }
    return err_set(err, "%s: unknown key type", k->name);
}

static int ignored(const char *key, const char *const *ignore) {
    for (; ignore && *ignore; ignore++)
        if (!strcmp(*ignore, key)) return 1;
    return 0;
}

int train_spec_apply_json(TrainSpec *s, const cJSON *obj, const char *const *ignore, Err *err) {
    if (!cJSON_IsObject(obj)) return err_set(err, "the spec must be a JSON object");
    const cJSON *item;
    cJSON_ArrayForEach(item, obj) {
        if (ignored(item->string, ignore)) continue;
        const KeyDef *k = find_key(item->string);
        if (!k) return unknown_key(item->string, err);
        char text[4096];
        if (json_value_text(k, item, text, sizeof text, err)) return -1;
        if (set_key(s, k, text, err)) return -1;
    }
    return 0;
}

int train_spec_validate(const TrainSpec *s, Err *err) {
    if (!*s->train_type) return err_set(err, "train_type: required (seq|sft)");
    if (!*s->param_path) return err_set(err, "param_path: required");
    if (!*s->data_root_path) return err_set(err, "data_root_path: required");
    if (!*s->ckpt_dir) return err_set(err, "ckpt_dir: must not be empty");
    if (!strcmp(s->device_type, "cpu") && !strcmp(s->dtype, "bf16"))
        return err_set(err, "dtype: bf16 needs device_type cuda (the CPU computes in fp32)");
    if (s->nprocs > 1 && !strcmp(s->parallel_mode, "none"))
        return err_set(err, "nprocs: %ld ranks need parallel_mode ddp or fsdp", s->nprocs);
    return 0;
}

cJSON *train_spec_to_json(const TrainSpec *s) {
    cJSON *obj = cJSON_CreateObject();
    for (size_t i = 0; obj && i < N_KEYS; i++) {
        const KeyDef *k = &KEYS[i];
        const char *field = (const char *)s + k->offset;
        switch (k->type) {
        case KEY_BOOL:
            cJSON_AddBoolToObject(obj, k->name, *(const bool *)field);
            break;
        case KEY_INT:
            cJSON_AddNumberToObject(obj, k->name, (double)*(const long *)field);
            break;
        case KEY_FLOAT:
            cJSON_AddNumberToObject(obj, k->name, *(const double *)field);
            break;
        case KEY_STR:
            cJSON_AddStringToObject(obj, k->name, *(char *const *)field);
            break;
        }
    }
    return obj;
}

void train_spec_print_help(const char *prog) {
    printf("usage: %s --train_type=seq|sft --param_path=DIR --data_root_path=DIR [options]\n\n"
           "Flags take --key=value or --key value; booleans also --key alone.\n\n",
           prog);
    for (size_t i = 0; i < N_KEYS; i++) {
        const KeyDef *k = &KEYS[i];
        char name[64];
        snprintf(name, sizeof name, "--%s", k->name);
        printf("  %-20s %s", name, k->help);
        if (k->choices) printf(" [%s]", k->choices);
        if (*k->def) printf(" (default %s)", k->def);
        putchar('\n');
    }
}
