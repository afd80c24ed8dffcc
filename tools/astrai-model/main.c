// astrai-model: create a randomly initialised AstrAI model directory from a
// config, and inspect model / checkpoint directories.
//
//   astrai-model init --config model.json --out DIR [--dtype bf16|fp32] [--seed
//   N] [--force] astrai-model info DIR [--json]
#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt/meta.h"
#include "ckpt/safetensors.h"
#include "common/error.h"
#include "common/flags.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"
#include "engine/config.h"
#include "engine/model.h"

#define DEFAULT_SEED 3407 // AstrAI's default random_seed

static const char USAGE[] = "usage:\n"
                            "  astrai-model init --config model.json --out DIR "
                            "[--dtype bf16|fp32] [--seed N] [--force]\n"
                            "      writes DIR/config.json and "
                            "DIR/model.safetensors (AstrAI init: N(0, 0.02),\n"
                            "      o_proj and mlp.down N(0, "
                            "0.02/sqrt(2*num_hidden_layers)), norms 1).\n"
                            "      --dtype: file dtype (default bf16, like "
                            "AstrAI); --seed: default 3407;\n"
                            "      --force: replace an existing model in DIR.\n"
                            "  astrai-model info DIR [--json]\n"
                            "      prints the config, the parameter count and "
                            "the tensors of DIR/model.safetensors\n"
                            "      (and DIR/meta.json of a checkpoint), after "
                            "checking they match the config.\n"
                            "exit status: 0 ok, 1 i/o failure, 2 bad input\n";

typedef struct {
    const char *config, *out, *dir;
    DType dtype;
    uint64_t seed;
    bool force, json;
} Args;

// ---------------------------------------------------------------- arguments

static int parse_seed(const Flag *f, const char *s, Err *err) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*s == '\0' || *s == '-' || *end != '\0' || errno)
        return err_set(err, "--seed '%s' is not a non-negative integer", s);
    *(uint64_t *)f->target = v;
    return 0;
}

static int parse_dtype(const Flag *f, const char *s, Err *err) {
    DType *out = f->target;
    if (strcmp(s, "bf16") == 0) return *out = DT_BF16, 0;
    if (strcmp(s, "fp32") == 0 || strcmp(s, "f32") == 0) return *out = DT_F32, 0;
    return err_set(err, "--dtype '%s' is not one of bf16, fp32", s);
}

// Room for "/model.safetensors.tmp.<pid>" after a directory name.
#define DIR_NAME_MAX (PATH_MAX - 64)

static int check_dir_name(const char *dir, Err *err) {
    if (strlen(dir) > DIR_NAME_MAX) return err_set(err, "directory name too long: %.60s...", dir);
    return 0;
}

static int parse_init_args(Args *a, int argc, char **argv, Err *err) {
    const Flag flags[] = {
        {.name = "config", .kind = FLAG_STRING, .target = &a->config},
        {.name = "out", .kind = FLAG_STRING, .target = &a->out},
        {.name = "dtype", .kind = FLAG_PARSED, .target = &a->dtype, .parse = parse_dtype},
        {.name = "seed", .kind = FLAG_PARSED, .target = &a->seed, .parse = parse_seed},
        {.name = "force", .kind = FLAG_SWITCH, .target = &a->force},
    };
    if (flags_parse(flags, sizeof flags / sizeof *flags, argc - 2, argv + 2, NULL, err))
        return err_prefix(err, "init");
    if (!a->config) return err_set(err, "init: --config is required");
    if (!a->out) return err_set(err, "init: --out is required");
    return check_dir_name(a->out, err);
}

static int parse_info_args(Args *a, int argc, char **argv, Err *err) {
    const Flag flags[] = {{.name = "json", .kind = FLAG_SWITCH, .target = &a->json}};
    int n_dirs = 0;
    if (flags_parse(flags, 1, argc - 2, argv + 2, &n_dirs, err)) return err_prefix(err, "info");
    if (n_dirs > 1) return err_set(err, "info: unexpected argument '%s'", argv[3]);
    if (!n_dirs) return err_set(err, "info: the model directory is required");
    a->dir = argv[2];
    return check_dir_name(a->dir, err);
}

// ---------------------------------------------------------------- init

// model_save to a temp name, then rename: a crash never leaves a half
// model.safetensors.
static int save_weights_atomic(const Model *m, const char *dir, DType dtype, Err *err) {
    char path[PATH_MAX], tmp[PATH_MAX + 32];
    if (path_join(path, sizeof path, dir, "model.safetensors", err)) return -1;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    if (model_save(m, tmp, dtype, err)) {
        unlink(tmp);
        return -1;
    }
    if (rename(tmp, path) != 0) {
        err_set(err, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return fs_fsync_dir(dir, err);
}

static int write_config(const ModelConfig *cfg, const char *dir, Err *err) {
    char path[PATH_MAX];
    if (path_join(path, sizeof path, dir, "config.json", err)) return -1;
    char *text = model_config_to_json(cfg);
    if (!text) return err_resource(err, "%s: out of memory", path);
    int rc = fs_write_file_atomic(path, text, strlen(text), err);
    free(text);
    return rc;
}

static int cmd_init(const Args *a) {
    Err err = {0};
    ModelConfig cfg;
    if (model_config_load(&cfg, a->config, &err)) {
        fprintf(stderr, "astrai-model: %s\n", err.msg);
        return err_exit_status(&err);
    }
    char existing[PATH_MAX];
    if (path_join(existing, sizeof existing, a->out, "model.safetensors", &err)) {
        fprintf(stderr, "astrai-model: %s\n", err.msg);
        return EXIT_BAD_INPUT;
    }
    if (!a->force && fs_is_file(existing)) {
        fprintf(stderr, "astrai-model: %s already exists (use --force to replace it)\n", existing);
        return EXIT_BAD_INPUT;
    }
    Model m;
    if (model_create(&m, &cfg, backend_cpu(), &err)) {
        fprintf(stderr, "astrai-model: %s: %s\n", a->config, err.msg);
        return err_exit_status(&err);
    }
    int rc = model_init_random(&m, a->seed, &err) || fs_mkdir_p(a->out, &err) ||
             save_weights_atomic(&m, a->out, a->dtype, &err) || write_config(&cfg, a->out, &err);
    if (rc)
        fprintf(stderr, "astrai-model: %s\n", err.msg);
    else
        printf("%s: %zu parameters (%s, seed %llu)\n", a->out, m.num_floats,
               a->dtype == DT_BF16 ? "bf16" : "fp32", (unsigned long long)a->seed);
    model_free(&m);
    return rc ? 1 : 0;
}

// ---------------------------------------------------------------- info

static const char *st_dtype_name(DType dt) {
    static const char *names[] = {[DT_F32] = "F32", [DT_BF16] = "BF16", [DT_F16] = "F16",
                                  [DT_I32] = "I32", [DT_I64] = "I64",   [DT_U8] = "U8"};
    return names[dt];
}

static uint64_t numel_of(const StTensor *t) {
    uint64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= (uint64_t)t->shape[d];
    return n;
}

// Loads config + weights the way training would: any mismatch is an error.
typedef struct {
    ModelConfig cfg;
    StFile st;
    CkptMeta meta;
    int has_meta;
    uint64_t n_params;
} ModelDir;

static int open_model_dir(ModelDir *d, const char *dir, Err *err) {
    memset(d, 0, sizeof *d);
    char path[PATH_MAX];
    if (path_join(path, sizeof path, dir, "config.json", err)) return -1;
    if (model_config_load(&d->cfg, path, err)) return -1;
    if (path_join(path, sizeof path, dir, "model.safetensors", err)) return -1;
    Model m;
    if (model_create(&m, &d->cfg, backend_cpu(), err))
        return err_prefix(err, "%s/config.json", dir);
    int rc = model_load(&m, path, err);
    model_free(&m);
    if (rc || st_open(&d->st, path, err)) return -1;
    for (int i = 0; i < d->st.n_tensors; i++)
        d->n_params += numel_of(&d->st.tensors[i]);
    if (path_join(path, sizeof path, dir, "meta.json", err)) return -1;
    if (fs_is_file(path)) {
        if (meta_load(&d->meta, path, err)) return -1;
        d->has_meta = 1;
    }
    return 0;
}

static void close_model_dir(ModelDir *d) {
    st_close(&d->st);
    if (d->has_meta) meta_free(&d->meta);
}

// Tensors in file order (by data offset), as a Python reader lists them.
static int cmp_offset(const void *a, const void *b) {
    const StTensor *x = *(const StTensor *const *)a, *y = *(const StTensor *const *)b;
    return (x->begin > y->begin) - (x->begin < y->begin);
}

static const StTensor **tensors_in_file_order(const StFile *f) {
    const StTensor **order = malloc(((size_t)f->n_tensors + 1) * sizeof *order);
    if (!order) return NULL;
    for (int i = 0; i < f->n_tensors; i++)
        order[i] = &f->tensors[i];
    qsort(order, (size_t)f->n_tensors, sizeof *order, cmp_offset);
    return order;
}

static cJSON *tensor_json(const StTensor *t) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", t->name);
    cJSON_AddStringToObject(o, "dtype", st_dtype_name(t->dtype));
    cJSON *shape = cJSON_AddArrayToObject(o, "shape");
    for (int d = 0; d < t->ndim; d++)
        cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->shape[d]));
    cJSON_AddNumberToObject(o, "bytes", (double)(t->end - t->begin));
    return o;
}

static int print_info_json(const ModelDir *d, const char *dir, const StTensor **order) {
    cJSON *root = cJSON_CreateObject();
    char *cfg_text = model_config_to_json(&d->cfg);
    cJSON_AddStringToObject(root, "dir", dir);
    cJSON_AddItemToObject(root, "config", cJSON_Parse(cfg_text ? cfg_text : "null"));
    cJSON_AddNumberToObject(root, "num_parameters", (double)d->n_params);
    cJSON *list = cJSON_AddArrayToObject(root, "tensors");
    for (int i = 0; i < d->st.n_tensors; i++)
        cJSON_AddItemToArray(list, tensor_json(order[i]));
    if (d->has_meta) {
        char *meta = meta_to_json(&d->meta);
        cJSON_AddItemToObject(root, "meta", cJSON_Parse(meta ? meta : "null"));
        free(meta);
    }
    char *text = cJSON_Print(root);
    int rc = text ? 0 : 1;
    if (text) printf("%s\n", text);
    free(text);
    free(cfg_text);
    cJSON_Delete(root);
    return rc;
}

static void print_info_text(const ModelDir *d, const char *dir, const StTensor **order) {
    char *cfg_text = model_config_to_json(&d->cfg);
    printf("model: %s\nconfig: %s\n", dir, cfg_text ? cfg_text : "?");
    free(cfg_text);
    if (d->has_meta)
        printf("checkpoint: epoch %ld, step %ld, consumed_samples %ld, timestamp %s\n",
               d->meta.epoch, d->meta.step, d->meta.consumed_samples, d->meta.timestamp);
    printf("parameters: %llu\n\n%-48s %-5s %-16s %12s\n", (unsigned long long)d->n_params, "name",
           "dtype", "shape", "bytes");
    for (int i = 0; i < d->st.n_tensors; i++) {
        const StTensor *t = order[i];
        char shape[64] = "[";
        for (int k = 0; k < t->ndim; k++)
            snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "%s%lld", k ? ", " : "",
                     (long long)t->shape[k]);
        snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "]");
        printf("%-48s %-5s %-16s %12llu\n", t->name, st_dtype_name(t->dtype), shape,
               (unsigned long long)(t->end - t->begin));
    }
}

static int cmd_info(const Args *a) {
    Err err = {0};
    ModelDir d;
    if (open_model_dir(&d, a->dir, &err)) {
        fprintf(stderr, "astrai-model: %s\n", err.msg);
        close_model_dir(&d);
        return err_exit_status(&err);
    }
    const StTensor **order = tensors_in_file_order(&d.st);
    int rc = 1;
    if (!order) fprintf(stderr, "astrai-model: %s: out of memory\n", a->dir);
    if (order && a->json) rc = print_info_json(&d, a->dir, order);
    if (order && !a->json) rc = (print_info_text(&d, a->dir, order), 0);
    free(order);
    close_model_dir(&d);
    return rc;
}

// ---------------------------------------------------------------- main

static int wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) return 1;
    return argc >= 2 && strcmp(argv[1], "help") == 0;
}

int main(int argc, char **argv) {
    json_init();
    if (wants_help(argc, argv)) {
        fputs(USAGE, stdout);
        return 0;
    }
    Args a = {.dtype = DT_BF16, .seed = DEFAULT_SEED};
    Err err = {0};
    const char *cmd = argc >= 2 ? argv[1] : "";
    int rc;
    if (strcmp(cmd, "init") == 0)
        rc = parse_init_args(&a, argc, argv, &err);
    else if (strcmp(cmd, "info") == 0)
        rc = parse_info_args(&a, argc, argv, &err);
    else if (argc < 2)
        rc = err_set(&err, "no command given");
    else
        rc = err_set(&err, "unknown command '%s'", cmd);
    if (rc) {
        fprintf(stderr, "astrai-model: %s\n%s", err.msg, USAGE);
        return err_exit_status(&err);
    }
    return strcmp(cmd, "init") == 0 ? cmd_init(&a) : cmd_info(&a);
}
