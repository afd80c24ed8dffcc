// astrai-model: create a randomly initialised AstrAI model directory from a config, inspect
// model / checkpoint directories in either checkpoint layout, consolidate a checkpoint into
// the full layout, and convert Hugging Face models in and out (ckpt/hf.h).
//
//   astrai-model init --config model.json --out DIR [--dtype bf16|fp32] [--seed N] [--force]
//   astrai-model info DIR [--json]
//   astrai-model consolidate CKPT --out DIR [--force]
//   astrai-model import-hf HF_DIR --out DIR [--dtype bf16|fp32|fp16] [--force]
//   astrai-model export-hf DIR --out HF_DIR [--dtype bf16|fp32|fp16] [--max_shard_gb G] [--force]
//
// A checkpoint holds its model and optimizer state either whole (model.safetensors,
// optimizer.safetensors: --ckpt_format full) or in Hugging Face's sharded layout (one file per
// rank and STEM.safetensors.index.json: --ckpt_format sharded, ckpt/shards.h). consolidate
// writes the full layout from either, byte for byte what the full format writes for the same
// training state: the same names through st_write in the same dtype.
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt/hf.h"
#include "ckpt/meta.h"
#include "ckpt/safetensors.h"
#include "ckpt/shards.h"
#include "common/error.h"
#include "common/flags.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"
#include "data/tokenizer.h"
#include "engine/model.h"
#include "model/config.h"
#include "train/ckpt_writer.h" // CKPT_TEXT_NAMES: a checkpoint's text files

#define DEFAULT_SEED 3407 // AstrAI's default random_seed

static const char USAGE[] =
    "usage:\n"
    "  astrai-model init --config model.json --out DIR [--dtype bf16|fp32] [--seed N] "
    "[--force]\n"
    "      writes DIR/config.json and DIR/model.safetensors (AstrAI init: N(0, 0.02),\n"
    "      o_proj and mlp.down N(0, 0.02/sqrt(2*num_hidden_layers)), norms 1).\n"
    "      --dtype: file dtype (default bf16, like AstrAI); --seed: default 3407;\n"
    "      --force: replace an existing model in DIR.\n"
    "  astrai-model info DIR [--json]\n"
    "      prints the config, the parameter count and the tensors of the model of DIR\n"
    "      (DIR/model.safetensors, or the sharded set DIR/model.safetensors.index.json\n"
    "      names: its files, and each tensor's file) and DIR/meta.json of a checkpoint,\n"
    "      after checking the weights match the config.\n"
    "  astrai-model consolidate CKPT --out DIR [--force]\n"
    "      writes the checkpoint CKPT (either layout: full or sharded) in the full layout:\n"
    "      DIR/model.safetensors and DIR/optimizer.safetensors (when CKPT has optimizer\n"
    "      state), in the dtype of CKPT's tensors, identical to what --ckpt_format full\n"
    "      writes, and copies of its meta.json, config.json, scheduler.json, sampler.json,\n"
    "      metric.jsonl. The model is checked against config.json first. Holds one output\n"
    "      file's tensors in memory at a time, as fp32 (4 bytes per element).\n"
    "      DIR/model.safetensors is written last: while it is absent DIR is incomplete.\n"
    "      Files of those names that CKPT lacks are removed from DIR.\n"
    "      --force: replace an existing checkpoint in DIR.\n"
    "  astrai-model import-hf HF_DIR --out DIR [--dtype bf16|fp32|fp16] [--force]\n"
    "      converts a Hugging Face model (config.json with model_type llama, mistral,\n"
    "      mixtral, qwen2 or qwen3; model.safetensors or a sharded set with\n"
    "      model.safetensors.index.json; never a pickle) into DIR/config.json and\n"
    "      DIR/model.safetensors, and copies its tokenizer files. q/k rows are permuted\n"
    "      from HF's RoPE halves to AstrAI's pairs; --dtype: cast (default: keep each\n"
    "      tensor's dtype). Unknown or unsupported config keys are refused.\n"
    "  astrai-model export-hf DIR --out HF_DIR [--dtype bf16|fp32|fp16] [--max_shard_gb G]\n"
    "                         [--force]\n"
    "      the reverse, from a model or checkpoint directory (either layout): HF_DIR/\n"
    "      config.json (the imported HF config with the mapped keys updated, else a\n"
    "      llama/mistral/mixtral/qwen2/qwen3 config by the model's features),\n"
    "      model.safetensors or, above G GB (default 5), model-0000K-of-0000N.safetensors\n"
    "      and model.safetensors.index.json, and the tokenizer files of DIR.\n"
    "exit status: 0 ok, 1 i/o failure, 2 bad input\n";

typedef struct {
    const char *config, *out, *dir;
    DType dtype;
    uint64_t seed;
    double max_shard_gb;
    bool force, json;
} Args;

// ---------------------------------------------------------------- arguments

static int parse_dtype(const Flag *f, const char *s, Err *err) {
    DType *out = f->target;
    if (strcmp(s, "bf16") == 0) return *out = DT_BF16, 0;
    if (strcmp(s, "fp32") == 0 || strcmp(s, "f32") == 0) return *out = DT_F32, 0;
    return err_set(err, "--dtype '%s' is not one of bf16, fp32", s);
}

// The conversions also cast to fp16, and keep each tensor's dtype by default (DT_N).
static int parse_hf_dtype(const Flag *f, const char *s, Err *err) {
    if (strcmp(s, "fp16") == 0 || strcmp(s, "f16") == 0) return *(DType *)f->target = DT_F16, 0;
    if (!parse_dtype(f, s, err)) return 0;
    return err_set(err, "--dtype '%s' is not one of bf16, fp32, fp16", s);
}

static int parse_shard_gb(const Flag *f, const char *s, Err *err) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (*s == '\0' || *end != '\0' || errno || !(v >= 0) || v > 1e6)
        return err_set(err, "--max_shard_gb '%s' is not a size in GB (0: one file)", s);
    *(double *)f->target = v;
    return 0;
}

// Room for "/optimizer.safetensors.index.json" or "/model.safetensors.tmp.<pid>" after a
// directory name.
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
        {.name = "seed", .kind = FLAG_PARSED, .target = &a->seed, .parse = flags_parse_u64},
        {.name = "force", .kind = FLAG_SWITCH, .target = &a->force},
    };
    if (flags_parse(flags, sizeof flags / sizeof *flags, argc - 2, argv + 2, NULL, err))
        return err_prefix(err, "init");
    if (!a->config) return err_set(err, "init: --config is required");
    if (!a->out) return err_set(err, "init: --out is required");
    return check_dir_name(a->out, err);
}

// The one directory argument of info / consolidate (flags_parse moved it to argv[2]).
static int take_dir(Args *a, int n_dirs, char **argv, const char *cmd, const char *what, Err *err) {
    if (n_dirs > 1) return err_set(err, "%s: unexpected argument '%s'", cmd, argv[3]);
    if (!n_dirs) return err_set(err, "%s: the %s directory is required", cmd, what);
    a->dir = argv[2];
    return check_dir_name(a->dir, err);
}

static int parse_info_args(Args *a, int argc, char **argv, Err *err) {
    const Flag flags[] = {{.name = "json", .kind = FLAG_SWITCH, .target = &a->json}};
    int n_dirs = 0;
    if (flags_parse(flags, 1, argc - 2, argv + 2, &n_dirs, err)) return err_prefix(err, "info");
    return take_dir(a, n_dirs, argv, "info", "model", err);
}

static int parse_consolidate_args(Args *a, int argc, char **argv, Err *err) {
    const Flag flags[] = {
        {.name = "out", .kind = FLAG_STRING, .target = &a->out},
        {.name = "force", .kind = FLAG_SWITCH, .target = &a->force},
    };
    int n_dirs = 0;
    if (flags_parse(flags, sizeof flags / sizeof *flags, argc - 2, argv + 2, &n_dirs, err))
        return err_prefix(err, "consolidate");
    if (take_dir(a, n_dirs, argv, "consolidate", "checkpoint", err)) return -1;
    if (!a->out) return err_set(err, "consolidate: --out is required");
    return check_dir_name(a->out, err);
}

// import-hf / export-hf SRC --out DIR: the conversion's flags (export's --max_shard_gb too).
static int parse_hf_args(Args *a, int argc, char **argv, Err *err) {
    const char *cmd = argv[1];
    bool export = !strcmp(cmd, "export-hf");
    const Flag flags[] = {
        {.name = "out", .kind = FLAG_STRING, .target = &a->out},
        {.name = "dtype", .kind = FLAG_PARSED, .target = &a->dtype, .parse = parse_hf_dtype},
        {.name = "force", .kind = FLAG_SWITCH, .target = &a->force},
        {.name = "max_shard_gb",
         .kind = FLAG_PARSED,
         .target = &a->max_shard_gb,
         .parse = parse_shard_gb},
    };
    int n_dirs = 0;
    a->dtype = DT_N;
    a->max_shard_gb = 5;
    // import-hf writes one file: its table ends before --max_shard_gb
    if (flags_parse(flags, sizeof flags / sizeof *flags - !export, argc - 2, argv + 2, &n_dirs,
                    err))
        return err_prefix(err, "%s", cmd);
    if (take_dir(a, n_dirs, argv, cmd, export ? "model" : "Hugging Face model", err)) return -1;
    if (!a->out) return err_set(err, "%s: --out is required", cmd);
    return check_dir_name(a->out, err);
}

// ---------------------------------------------------------------- writing files

// Replaces dir/name by the file fn makes under a temp name, then fsyncs dir: a crash never
// leaves a half-written file under the final name.
typedef int (*WriteFn)(const void *what, const char *path, Err *err);

static int write_atomic(const char *dir, const char *name, WriteFn fn, const void *what, Err *err) {
    char path[PATH_MAX], tmp[PATH_MAX + 32];
    if (path_join(path, sizeof path, dir, name, err)) return -1;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    if (fn(what, tmp, err)) {
        unlink(tmp);
        return -1;
    }
    if (rename(tmp, path) != 0) {
        err_errno(err, errno, "cannot rename %s to %s", tmp, path);
        unlink(tmp);
        return -1;
    }
    return fs_fsync_dir(dir, err);
}

// DIR/model.safetensors (or the index of a sharded set) exists: refused unless --force.
static int refuse_existing(const char *dir, bool force, Err *err) {
    char path[PATH_MAX];
    static const char *const NAMES[] = {"model.safetensors", "model.safetensors.index.json"};
    for (size_t i = 0; i < sizeof NAMES / sizeof *NAMES; i++) {
        if (path_join(path, sizeof path, dir, NAMES[i], err)) return -1;
        if (!force && fs_is_file(path))
            return err_set(err, "%s already exists (use --force to replace it)", path);
    }
    return 0;
}

// Removes dir/name if it is there (a file of an earlier checkpoint that this one lacks).
static int remove_stale(const char *dir, const char *name, Err *err) {
    char path[PATH_MAX];
    if (path_join(path, sizeof path, dir, name, err)) return -1;
    if (unlink(path) != 0 && errno != ENOENT)
        return err_errno(err, errno, "cannot remove %s", path);
    return 0;
}

// ---------------------------------------------------------------- init

typedef struct {
    const Model *m;
    DType dtype;
} ModelSave;

static int write_model(const void *what, const char *path, Err *err) {
    const ModelSave *s = what;
    return model_save(s->m, path, s->dtype, err);
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
    if (model_config_load(&cfg, a->config, &err) || refuse_existing(a->out, a->force, &err)) {
        fprintf(stderr, "astrai-model: %s\n", err.msg);
        return err_exit_status(&err);
    }
    Model m;
    if (model_create(&m, &cfg, backend_cpu(), &err)) {
        fprintf(stderr, "astrai-model: %s: %s\n", a->config, err.msg);
        return err_exit_status(&err);
    }
    const ModelSave save = {.m = &m, .dtype = a->dtype};
    int rc = model_init_random(&m, a->seed, &err) || fs_mkdir_p(a->out, &err) ||
             write_atomic(a->out, "model.safetensors", write_model, &save, &err) ||
             write_config(&cfg, a->out, &err);
    if (rc)
        fprintf(stderr, "astrai-model: %s\n", err.msg);
    else
        printf("%s: %zu parameters (%s, seed %llu)\n", a->out, m.num_floats,
               a->dtype == DT_BF16 ? "bf16" : "fp32", (unsigned long long)a->seed);
    model_free(&m);
    return rc ? err_exit_status(&err) : 0;
}

// ---------------------------------------------------------------- tensor sets

static const char *st_dtype_name(DType dt) {
    return dt < DT_N ? dtype_info(dt)->safetensors : "?";
}

static uint64_t numel_of(const StTensor *t) {
    uint64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= (uint64_t)t->shape[d];
    return n;
}

// A shard file of a set: the tensors the index maps to it and their bytes.
typedef struct {
    const char *name;
    int tensors;
    uint64_t bytes;
} ShardFile;

// A tensor and the file that holds it (NULL: the one file of the full layout).
typedef struct {
    const StTensor *t;
    const char *file;
} Row;

// A model's or optimizer's tensors in either layout (shards_open), with the file of each tensor.
typedef struct {
    StFile st;
    char path[PATH_MAX]; // what messages name: DIR/STEM.safetensors or DIR/STEM...index.json
    Row *rows;           // [st.n_tensors], in file order: by (file, begin)
    ShardFile *files;    // [n_files], sorted by name; NULL for the full layout
    int n_files;
    uint64_t total_size; // bytes of all tensors
} TensorSet;

static int sharded(const TensorSet *s) {
    return s->st.n_files > 0;
}

static int cmp_row(const void *a, const void *b) {
    const Row *x = a, *y = b;
    int c = x->file && y->file ? strcmp(x->file, y->file) : 0;
    if (c) return c;
    return (x->t->begin > y->t->begin) - (x->t->begin < y->t->begin);
}

// The distinct files of the rows (sorted by file), with their counts: each of the set's files
// holds a tensor the index maps to it.
static int count_files(TensorSet *s, Err *err) {
    s->files = calloc((size_t)s->st.n_files + 1, sizeof *s->files);
    if (!s->files) return err_resource(err, "%s: out of memory", s->path);
    for (int i = 0; i < s->st.n_tensors; i++) {
        const Row *r = &s->rows[i];
        if (!s->n_files || strcmp(s->files[s->n_files - 1].name, r->file) != 0)
            s->files[s->n_files++].name = r->file;
        s->files[s->n_files - 1].tensors++;
        s->files[s->n_files - 1].bytes += r->t->end - r->t->begin;
    }
    return 0;
}

static int open_set(TensorSet *s, const char *dir, const char *stem, Err *err) {
    memset(s, 0, sizeof *s);
    if (shards_open(&s->st, dir, stem, s->path, sizeof s->path, err)) return -1;
    s->rows = calloc((size_t)s->st.n_tensors + 1, sizeof *s->rows);
    if (!s->rows) return err_resource(err, "%s: out of memory", s->path);
    for (int i = 0; i < s->st.n_tensors; i++) {
        s->rows[i].t = &s->st.tensors[i];
        s->rows[i].file = s->st.tensors[i].file;
        s->total_size += s->st.tensors[i].end - s->st.tensors[i].begin;
    }
    qsort(s->rows, (size_t)s->st.n_tensors, sizeof *s->rows, cmp_row);
    return sharded(s) ? count_files(s, err) : 0;
}

static void close_set(TensorSet *s) {
    st_close(&s->st);
    free(s->rows);
    free(s->files);
    memset(s, 0, sizeof *s);
}

// What st_write can write back unchanged: one dtype of F32 / BF16 for the whole set.
static int check_set_dtype(const TensorSet *s, Err *err) {
    for (int i = 0; i < s->st.n_tensors; i++) {
        const StTensor *t = s->rows[i].t, *first = s->rows[0].t;
        const char *file = s->rows[i].file;
        if (t->dtype != DT_F32 && t->dtype != DT_BF16)
            return err_set(err, "%s: tensor '%s'%s%s is %s: only F32 and BF16 can be written",
                           s->path, t->name, file ? " in " : "", file ? file : "",
                           st_dtype_name(t->dtype));
        if (t->dtype != first->dtype)
            return err_set(
                err, "%s: tensor '%s'%s%s is %s but '%s' is %s: a consolidated file has one dtype",
                s->path, t->name, file ? " in " : "", file ? file : "", st_dtype_name(t->dtype),
                first->name, st_dtype_name(first->dtype));
    }
    return 0;
}

static int same_shape(const StTensor *a, const StTensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

// The parameter whose optimizer state t is (engine/optim.h's names), or NULL.
static const StTensor *state_param(const TensorSet *model, const StTensor *t) {
    static const char *const prefixes[] = {"exp_avg.", "exp_avg_sq.", "momentum_buffer."};
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++) {
        size_t n = strlen(prefixes[i]);
        if (strncmp(t->name, prefixes[i], n) == 0) return st_find(&model->st, t->name + n);
    }
    return NULL;
}

// The optimizer state is of this model: a 1-element "step" and a tensor of each parameter's
// shape per state. (Which states a parameter has depends on the optimizer: the training run
// that resumes checks that.)
static int check_optimizer(const TensorSet *opt, const TensorSet *model, Err *err) {
    const StTensor *step = st_find(&opt->st, "step");
    if (!step || step->ndim != 1 || step->shape[0] != 1)
        return err_set(err, "%s: no 1-element tensor 'step'", opt->path);
    for (int i = 0; i < opt->st.n_tensors; i++) {
        const StTensor *t = &opt->st.tensors[i], *p = state_param(model, t);
        if (t == step) continue;
        if (!p)
            return err_set(err, "%s: tensor '%s' is not the state of a tensor of %s", opt->path,
                           t->name, model->path);
        if (!same_shape(t, p))
            return err_set(err, "%s: tensor '%s' differs in shape from '%s' of %s", opt->path,
                           t->name, p->name, model->path);
    }
    return 0;
}

// ---------------------------------------------------------------- model directories

// Loads config + weights the way training would: any mismatch is an error.
typedef struct {
    ModelConfig cfg;
    TensorSet model;
    CkptMeta meta;
    int has_meta;
    uint64_t n_params;
} ModelDir;

static int check_model(const ModelDir *d, const char *dir, Err *err) {
    Model m;
    if (model_create(&m, &d->cfg, backend_cpu(), err))
        return err_prefix(err, "%s/config.json", dir);
    int rc = model_load_st(&m, &d->model.st, d->model.path, err);
    model_free(&m);
    return rc;
}

static int open_model_dir(ModelDir *d, const char *dir, Err *err) {
    memset(d, 0, sizeof *d);
    char path[PATH_MAX];
    if (path_join(path, sizeof path, dir, "config.json", err)) return -1;
    if (model_config_load(&d->cfg, path, err)) return -1;
    if (open_set(&d->model, dir, "model", err) || check_model(d, dir, err)) return -1;
    for (int i = 0; i < d->model.st.n_tensors; i++)
        d->n_params += numel_of(&d->model.st.tensors[i]);
    if (path_join(path, sizeof path, dir, "meta.json", err)) return -1;
    if (fs_is_file(path)) {
        if (meta_load(&d->meta, path, err)) return -1;
        d->has_meta = 1;
    }
    return 0;
}

static void close_model_dir(ModelDir *d) {
    close_set(&d->model);
    if (d->has_meta) meta_free(&d->meta);
}

// ---------------------------------------------------------------- info

static cJSON *tensor_json(const Row *r) {
    const StTensor *t = r->t;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", t->name);
    cJSON_AddStringToObject(o, "dtype", st_dtype_name(t->dtype));
    cJSON *shape = cJSON_AddArrayToObject(o, "shape");
    for (int d = 0; d < t->ndim; d++)
        cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)t->shape[d]));
    cJSON_AddNumberToObject(o, "bytes", (double)(t->end - t->begin));
    cJSON_AddStringToObject(o, "file", r->file ? r->file : "model.safetensors");
    return o;
}

static void add_format_json(cJSON *root, const TensorSet *s) {
    cJSON_AddStringToObject(root, "format", sharded(s) ? "sharded" : "full");
    if (!sharded(s)) return;
    cJSON_AddNumberToObject(root, "total_size", (double)s->total_size);
    cJSON *files = cJSON_AddArrayToObject(root, "files");
    for (int i = 0; i < s->n_files; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", s->files[i].name);
        cJSON_AddNumberToObject(o, "tensors", s->files[i].tensors);
        cJSON_AddNumberToObject(o, "bytes", (double)s->files[i].bytes);
        cJSON_AddItemToArray(files, o);
    }
}

static int print_info_json(const ModelDir *d, const char *dir) {
    cJSON *root = cJSON_CreateObject();
    char *cfg_text = model_config_to_json(&d->cfg);
    cJSON_AddStringToObject(root, "dir", dir);
    cJSON_AddItemToObject(root, "config", cJSON_Parse(cfg_text ? cfg_text : "null"));
    cJSON_AddNumberToObject(root, "num_parameters", (double)d->n_params);
    cJSON_AddNumberToObject(root, "active_parameters",
                            (double)model_active_params(&d->cfg, d->n_params));
    add_format_json(root, &d->model);
    cJSON *list = cJSON_AddArrayToObject(root, "tensors");
    for (int i = 0; i < d->model.st.n_tensors; i++)
        cJSON_AddItemToArray(list, tensor_json(&d->model.rows[i]));
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

static void print_format(const TensorSet *s) {
    if (!sharded(s)) {
        printf("format: full\n");
        return;
    }
    printf("format: sharded, %d files (%s%s%s), total_size %llu bytes\n", s->n_files,
           s->files[0].name, s->n_files > 1 ? " ... " : "",
           s->n_files > 1 ? s->files[s->n_files - 1].name : "", (unsigned long long)s->total_size);
}

static void print_info_text(const ModelDir *d, const char *dir) {
    char *cfg_text = model_config_to_json(&d->cfg);
    printf("model: %s\nconfig: %s\n", dir, cfg_text ? cfg_text : "?");
    free(cfg_text);
    if (d->has_meta)
        printf("checkpoint: epoch %ld, step %ld, consumed_samples %ld, timestamp %s\n",
               d->meta.epoch, d->meta.step, d->meta.consumed_samples, d->meta.timestamp);
    print_format(&d->model);
    printf("parameters: %llu", (unsigned long long)d->n_params);
    if (d->cfg.ffn_type == FFN_MOE)
        printf(" (%llu active per token: %d of %d routed experts)",
               (unsigned long long)model_active_params(&d->cfg, d->n_params),
               d->cfg.n_activated_experts, d->cfg.n_routed_experts);
    printf("\n\n%-48s %-5s %-16s %12s%s\n", "name", "dtype", "shape", "bytes",
           sharded(&d->model) ? "  file" : "");
    for (int i = 0; i < d->model.st.n_tensors; i++) {
        const Row *r = &d->model.rows[i];
        const StTensor *t = r->t;
        char shape[64] = "[";
        for (int k = 0; k < t->ndim; k++)
            snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "%s%lld", k ? ", " : "",
                     (long long)t->shape[k]);
        snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "]");
        printf("%-48s %-5s %-16s %12llu%s%s\n", t->name, st_dtype_name(t->dtype), shape,
               (unsigned long long)(t->end - t->begin), r->file ? "  " : "",
               r->file ? r->file : "");
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
    int rc = a->json ? print_info_json(&d, a->dir) : (print_info_text(&d, a->dir), 0);
    close_model_dir(&d);
    return rc;
}

// ---------------------------------------------------------------- consolidate

// The text files of a checkpoint, copied as they are.

typedef struct {
    ModelDir dir;
    TensorSet opt;
    int has_opt;
} Checkpoint;

// Opens and checks everything before DIR is touched: a refused checkpoint writes nothing.
static int open_checkpoint(Checkpoint *c, const char *dir, Err *err) {
    memset(c, 0, sizeof *c);
    if (open_model_dir(&c->dir, dir, err) || check_set_dtype(&c->dir.model, err)) return -1;
    if (!shards_present(dir, "optimizer")) return 0;
    c->has_opt = 1;
    return open_set(&c->opt, dir, "optimizer", err) || check_set_dtype(&c->opt, err) ||
           check_optimizer(&c->opt, &c->dir.model, err);
}

static void close_checkpoint(Checkpoint *c) {
    close_model_dir(&c->dir);
    if (c->has_opt) close_set(&c->opt);
}

// Writes the tensors of s to path through st_write in their dtype: fp32 read back and written
// in the dtype it came from is the same bytes (bf16 -> fp32 -> bf16 is exact).
static int write_set(const void *what, const char *path, Err *err) {
    const TensorSet *s = what;
    int n = s->st.n_tensors;
    StWriteTensor *w = calloc((size_t)n + 1, sizeof *w);
    float **data = calloc((size_t)n + 1, sizeof *data);
    int rc = !w || !data ? err_resource(err, "%s: out of memory for %d tensors", path, n) : 0;
    for (int i = 0; i < n && !rc; i++) {
        const StTensor *t = &s->st.tensors[i];
        uint64_t count = numel_of(t);
        if (!(data[i] = malloc((size_t)(count ? count : 1) * sizeof(float)))) {
            rc = err_resource(err, "%s: out of memory for tensor '%s' (%llu floats)", path, t->name,
                              (unsigned long long)count);
            break;
        }
        w[i] = (StWriteTensor){.name = t->name, .ndim = t->ndim, .data = data[i]};
        memcpy(w[i].shape, t->shape, sizeof t->shape);
        if (st_read_f32(&s->st, t->name, t->ndim, t->shape, data[i], err))
            rc = err_prefix(err, "%s", s->path);
    }
    if (!rc) rc = st_write(path, w, n, n ? s->st.tensors[0].dtype : DT_F32, err);
    for (int i = 0; data && i < n; i++)
        free(data[i]);
    free(data);
    free(w);
    return rc;
}

static int copy_text(const char *from, const char *to, const char *name, Err *err) {
    char src[PATH_MAX], dst[PATH_MAX];
    if (path_join(src, sizeof src, from, name, err) || path_join(dst, sizeof dst, to, name, err))
        return -1;
    if (!fs_is_file(src)) return 0; // a file the checkpoint lacks: DIR's own is not ours to drop
    char *text;
    size_t len;
    if (fs_read_file(src, &text, &len, err)) return -1;
    int rc = fs_write_file_atomic(dst, text, len, err);
    free(text);
    return rc;
}

// Consolidating into the checkpoint itself would leave both layouts in one directory.
static int refuse_same_dir(const char *ckpt, const char *out, Err *err) {
    struct stat a, b;
    if (stat(ckpt, &a) == 0 && stat(out, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
        return err_set(err, "--out %s is the checkpoint %s itself: give another directory", out,
                       ckpt);
    return 0;
}

// DIR gets the text files, then the optimizer state, then model.safetensors: an old
// model.safetensors goes first so that until the new one lands DIR reads as incomplete.
static int write_checkpoint(const Checkpoint *c, const char *ckpt, const char *out, Err *err) {
    if (fs_mkdir_p(out, err) || remove_stale(out, "model.safetensors", err)) return -1;
    for (int i = 0; i < CKPT_N_TEXTS; i++)
        if (copy_text(ckpt, out, CKPT_TEXT_NAMES[i], err)) return -1;
    int rc = c->has_opt ? write_atomic(out, "optimizer.safetensors", write_set, &c->opt, err) : 0;
    return rc || write_atomic(out, "model.safetensors", write_set, &c->dir.model, err) ||
           fs_fsync_dir(out, err);
}

static void describe_set(const char *what, const TensorSet *s) {
    printf(", %s: %d tensors (%s) from %d file%s", what, s->st.n_tensors,
           s->st.n_tensors ? st_dtype_name(s->st.tensors[0].dtype) : "-",
           sharded(s) ? s->n_files : 1, sharded(s) && s->n_files != 1 ? "s" : "");
}

// consolidate writes into a new or empty directory; an existing one with anything in it is the
// user's, and only --force lets it replace the files consolidate writes there (no others).
static int refuse_nonempty(const char *dir, bool force, Err *err) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *ent;
    bool empty = true;
    while (empty && (ent = readdir(d)) != NULL)
        empty = !strcmp(ent->d_name, ".") || !strcmp(ent->d_name, "..");
    closedir(d);
    if (!empty && !force)
        return err_set(err,
                       "--out %s: directory exists and is not empty (use --force to replace "
                       "the files consolidate writes)",
                       dir);
    return 0;
}

static int cmd_consolidate(const Args *a) {
    Err err = {0};
    Checkpoint c = {0};
    int rc = refuse_nonempty(a->out, a->force, &err) || refuse_same_dir(a->dir, a->out, &err) ||
             open_checkpoint(&c, a->dir, &err) || write_checkpoint(&c, a->dir, a->out, &err);
    if (rc) {
        fprintf(stderr, "astrai-model: %s\n", err.msg);
    } else {
        printf("%s: consolidated %s (%s layout)", a->out, a->dir,
               sharded(&c.dir.model) ? "sharded" : "full");
        describe_set("model", &c.dir.model);
        if (c.has_opt) describe_set("optimizer", &c.opt);
        printf("\n");
    }
    close_checkpoint(&c);
    return rc ? err_exit_status(&err) : 0;
}

// ---------------------------------------------------------------- Hugging Face

// What a model directory carries beside its weights, copied through both ways when present.
static const char *const TOKENIZER_FILES[] = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
};
enum { N_TOKENIZER_FILES = sizeof TOKENIZER_FILES / sizeof *TOKENIZER_FILES };

typedef struct {
    const HfConversion *c;
    int k;
} ShardWrite;

static int write_shard(const void *what, const char *path, Err *err) {
    const ShardWrite *w = what;
    return hf_write_shard(w->c, w->k, path, err);
}

static int write_text(const char *dir, const char *name, char *text, Err *err) {
    char path[PATH_MAX];
    int rc = !text ? err_resource(err, "%s/%s: out of memory", dir, name)
                   : path_join(path, sizeof path, dir, name, err) ||
                         fs_write_file_atomic(path, text, strlen(text), err);
    free(text);
    return rc;
}

// The weights of an earlier model in dir, in either layout: they go first, so that until the
// new ones land dir reads as incomplete, and no shard of another count is left behind.
static int remove_weights(const char *dir, Err *err) {
    if (remove_stale(dir, "model.safetensors.index.json", err) ||
        remove_stale(dir, "model.safetensors", err))
        return -1;
    DIR *d = opendir(dir);
    if (!d) return err_errno(err, errno, "%s: cannot list", dir);
    int rc = 0;
    for (struct dirent *e; !rc && (e = readdir(d));)
        if (!fnmatch("model-[0-9]*-of-[0-9]*.safetensors", e->d_name, 0))
            rc = remove_stale(dir, e->d_name, err);
    closedir(d);
    return rc;
}

// Whether text (len bytes) is what the support file `name` claims to be: tokenizer.json a
// tokenizer (a BPE one: one astrai loads), another .json a JSON object, merges.txt "a b" lines,
// tokenizer.model a SentencePiece protobuf (its first field). path names the file in the message.
static int check_support_file(const char *name, const char *path, const char *text, size_t len,
                              Err *err) {
    if (strlen(name) > 5 && !strcmp(name + strlen(name) - 5, ".json")) {
        cJSON *o = cJSON_ParseWithLength(text, len);
        const cJSON *model = cJSON_GetObjectItemCaseSensitive(o, "model");
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "type");
        int rc = !o                   ? err_set(err, "%s: not valid JSON", path)
                 : !cJSON_IsObject(o) ? err_set(err, "%s: not a JSON object", path)
                                      : 0;
        if (!rc && !strcmp(name, "tokenizer.json")) {
            if (!cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(model, "vocab")))
                rc = err_set(err, "%s: not a tokenizer (no model.vocab object)", path);
            // A model astrai tokenizes must load whole; another (WordLevel, Unigram, ...) is
            // carried for Hugging Face's tools after the structural check.
            Tokenizer *t;
            if (!rc && cJSON_IsString(type) && !strcmp(type->valuestring, "BPE")) {
                rc = tokenizer_open(path, &t, err);
                if (!rc) tokenizer_free(t);
            }
        }
        cJSON_Delete(o);
        return rc;
    }
    if (!strcmp(name, "tokenizer.model"))
        return len > 0 && (unsigned char)text[0] == 0x0a
                   ? 0
                   : err_set(err, "%s: not a SentencePiece model", path);
    if (memchr(text, '\0', len)) return err_set(err, "%s: not a text file", path);
    for (const char *line = text, *end = text + len; line < end;) {
        const char *nl = memchr(line, '\n', (size_t)(end - line));
        size_t n = nl ? (size_t)(nl - line) : (size_t)(end - line);
        const char *space = memchr(line, ' ', n);
        if (n && line[0] != '#' &&
            (!space || space == line || memchr(space + 1, ' ', n - (size_t)(space + 1 - line))))
            return err_set(err, "%s: line '%.*s' is not a merge (\"a b\")", path,
                           (int)(n > 60 ? 60 : n), line);
        line += n + 1;
    }
    return 0;
}

// The support files of src that are present, each read (symlinks followed: Hugging Face's cache
// links every file into blobs/) and checked before anything is written; texts[i] NULL: absent.
static int read_support_files(const char *src, char **texts, size_t *lens, mode_t *modes,
                              Err *err) {
    for (int i = 0; i < N_TOKENIZER_FILES; i++)
        texts[i] = NULL;
    for (int i = 0; i < N_TOKENIZER_FILES; i++) {
        char path[PATH_MAX];
        struct stat st;
        if (path_join(path, sizeof path, src, TOKENIZER_FILES[i], err)) return -1;
        if (!fs_is_file(path)) continue;
        if (stat(path, &st) != 0) return err_errno(err, errno, "%s: cannot stat", path);
        if (fs_read_file(path, &texts[i], &lens[i], err) ||
            check_support_file(TOKENIZER_FILES[i], path, texts[i], lens[i], err))
            return -1;
        modes[i] = st.st_mode & 0644; // never more permissive than the source
    }
    return 0;
}

// DIR gets the tokenizer files and config.json, then the weights, the index of a sharded set
// last: each file under a temp name renamed into place.
static int write_hf_output(const HfConversion *c, int n_files, const char *src, const char *out,
                           Err *err) {
    char *texts[N_TOKENIZER_FILES];
    size_t lens[N_TOKENIZER_FILES];
    mode_t modes[N_TOKENIZER_FILES];
    int rc = read_support_files(src, texts, lens, modes, err) || fs_mkdir_p(out, err) ||
             remove_weights(out, err);
    for (int i = 0; i < N_TOKENIZER_FILES && !rc; i++) {
        char path[PATH_MAX];
        rc = texts[i] ? path_join(path, sizeof path, out, TOKENIZER_FILES[i], err) ||
                            fs_write_file_atomic_mode(path, texts[i], lens[i], modes[i], err)
                      : remove_stale(out, TOKENIZER_FILES[i], err);
    }
    for (int i = 0; i < N_TOKENIZER_FILES; i++)
        free(texts[i]);
    if (rc) return -1;
    if (write_text(out, "config.json", cJSON_Print(hf_output_config(c)), err)) return -1;
    for (int k = 0; k < n_files; k++) {
        char name[64];
        if (n_files == 1)
            snprintf(name, sizeof name, "model.safetensors");
        else
            shards_file_name(name, sizeof name, "model", k + 1, n_files);
        const ShardWrite w = {.c = c, .k = k};
        if (write_atomic(out, name, write_shard, &w, err)) return -1;
    }
    if (n_files > 1 && write_text(out, "model.safetensors.index.json", hf_index_json(c), err))
        return -1;
    return fs_fsync_dir(out, err);
}

static int cmd_hf(const Args *a, bool export) {
    Err err = {0};
    HfConversion *c = NULL;
    int rc = refuse_existing(a->out, a->force, &err) || refuse_same_dir(a->dir, a->out, &err) ||
             (export ? hf_open_export(&c, a->dir, a->dtype, &err)
                     : hf_open_import(&c, a->dir, a->dtype, &err));
    int n_files = 1;
    if (!rc && export) n_files = hf_plan_shards(c, (uint64_t)(a->max_shard_gb * 1e9));
    if (!rc) rc = write_hf_output(c, n_files, a->dir, a->out, &err);
    if (rc)
        fprintf(stderr, "astrai-model: %s\n", err.msg);
    else
        printf("%s: %s %s (%d file%s)\n", a->out, export ? "exported" : "imported", a->dir, n_files,
               n_files > 1 ? "s" : "");
    hf_close(c);
    return rc ? err_exit_status(&err) : 0;
}

static int cmd_import_hf(const Args *a) {
    return cmd_hf(a, false);
}

static int cmd_export_hf(const Args *a) {
    return cmd_hf(a, true);
}

// ---------------------------------------------------------------- main

static int wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) return 1;
    return argc >= 2 && strcmp(argv[1], "help") == 0;
}

typedef struct {
    const char *name;
    int (*parse)(Args *a, int argc, char **argv, Err *err);
    int (*run)(const Args *a);
} Command;

static const Command COMMANDS[] = {
    {"init", parse_init_args, cmd_init},
    {"info", parse_info_args, cmd_info},
    {"consolidate", parse_consolidate_args, cmd_consolidate},
    {"import-hf", parse_hf_args, cmd_import_hf},
    {"export-hf", parse_hf_args, cmd_export_hf},
};

int main(int argc, char **argv) {
    json_init();
    if (wants_help(argc, argv)) {
        fputs(USAGE, stdout);
        return 0;
    }
    Args a = {.dtype = DT_BF16, .seed = DEFAULT_SEED};
    Err err = {0};
    const Command *cmd = NULL;
    for (size_t i = 0; argc >= 2 && i < sizeof COMMANDS / sizeof *COMMANDS; i++)
        if (strcmp(argv[1], COMMANDS[i].name) == 0) cmd = &COMMANDS[i];
    int rc;
    if (cmd)
        rc = cmd->parse(&a, argc, argv, &err);
    else if (argc < 2)
        rc = err_set(&err, "no command given");
    else
        rc = err_set(&err, "unknown command '%s'", argv[1]);
    if (rc) {
        fprintf(stderr, "astrai-model: %s\n%s", err.msg, USAGE);
        return err_exit_status(&err);
    }
    return cmd->run(&a);
}
