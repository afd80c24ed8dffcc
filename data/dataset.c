// dataset.c: AstrAI "bin" datasets (docs/design.md §8): find root/**/meta.json,
// validate every shard, concatenate each key in sorted shard-path order, and
// cut the token stream into (window, stride) windows exactly as AstrAI's
// Store.sample_window does.
#include "data/dataset.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/buf.h"
#include "common/dtype.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"

enum { KEY_SEQUENCE, KEY_LOSS_MASK, KEY_POSITION_IDS, N_KEYS };
static const char *const KEY_NAMES[N_KEYS] = {"sequence", "loss_mask", "position_ids"};

// A key's dtype is one of the integer types AstrAI's pipeline can write (its output.dtype
// overrides: int32, int64, int16, int8, uint8, bool); every one is widened to int32 on load.
typedef struct {
    int present;
    DType dtype;
} ShardKey;

typedef struct {
    char *meta_path; // root/.../meta.json
    int64_t n;       // elements of each present key
    ShardKey keys[N_KEYS];
} Shard;

typedef struct {
    char **items;
    int n;
    size_t cap;
} PathList;

static void path_list_free(PathList *l) {
    for (int i = 0; i < l->n; i++)
        free(l->items[i]);
    free(l->items);
    *l = (PathList){0};
}

static int path_list_push(PathList *l, const char *path, Err *err) {
    if (buf_reserve(&l->items, &l->cap, (size_t)l->n + 1, sizeof *l->items))
        return err_resource(err, "out of memory listing shards");
    l->items[l->n] = strdup(path);
    if (!l->items[l->n]) return err_resource(err, "out of memory listing shards");
    l->n++;
    return 0;
}

// Appends every regular file named meta.json under dir. Symlinked
// directories are not followed, so a link cycle cannot recurse forever;
// hidden entries are skipped like Python's glob("**") does.
static int collect_meta_paths(const char *dir, PathList *out, Err *err) {
    DIR *d = opendir(dir);
    if (!d) return err_errno(err, errno, "%s: cannot open directory", dir);
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue; // hidden, as AstrAI's glob: also our temporaries
        // On the heap: the recursion is as deep as the tree, PATH_MAX bytes a level.
        char *path = malloc(PATH_MAX);
        if (!path) {
            rc = err_resource(err, "out of memory listing %s", dir);
            break;
        }
        if ((rc = path_join(path, PATH_MAX, dir, e->d_name, err))) {
            free(path);
            break;
        }
        struct stat st;
        if (lstat(path, &st) != 0) {
            rc = err_errno(err, errno, "%s: cannot stat", path);
        } else if (S_ISDIR(st.st_mode)) {
            rc = collect_meta_paths(path, out, err);
        } else if (strcmp(e->d_name, "meta.json") == 0 && fs_is_file(path)) {
            rc = path_list_push(out, path, err);
        }
        free(path);
    }
    closedir(d);
    return rc;
}

static int compare_paths(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

// "root/a/meta.json" + "sequence" -> "root/a/sequence.bin" (malloc'd).
static char *bin_path_for(const char *meta_path, const char *key) {
    const char *slash = strrchr(meta_path, '/');
    int dir_len = slash ? (int)(slash - meta_path) : 1;
    const char *dir = slash ? meta_path : ".";
    size_t len = (size_t)dir_len + strlen(key) + 6;
    char *p = malloc(len);
    if (p) snprintf(p, len, "%.*s/%s.bin", dir_len, dir, key);
    return p;
}

// <key>.bin next to meta_path must hold exactly n elements of dtype t.
static int check_bin_size(const char *meta_path, const char *key, int64_t n, DType dtype,
                          Err *err) {
    const DTypeInfo *t = dtype_info(dtype);
    char *bin = bin_path_for(meta_path, key);
    if (!bin) return err_resource(err, "%s: out of memory", meta_path);
    struct stat st;
    int rc = 0;
    if (stat(bin, &st) != 0)
        rc = err_errno(err, errno, "%s: key '%s': %s", meta_path, key, bin);
    else if (!S_ISREG(st.st_mode))
        rc = err_set(err, "%s: key '%s': %s is not a regular file", meta_path, key, bin);
    else if ((int64_t)st.st_size != n * t->size)
        rc = err_set(
            err, "%s: key '%s': shape [%" PRId64 "] of %s needs %" PRId64 " bytes but %s has %lld",
            meta_path, key, n, t->numpy, n * t->size, bin, (long long)st.st_size);
    free(bin);
    return rc;
}

// Validates meta[key] = {"shape":[N], "dtype":D} and that <key>.bin holds
// exactly N elements of D; sets *n.
static int parse_key_entry(const char *meta_path, const char *key, const cJSON *entry,
                           ShardKey *out, int64_t *n, Err *err) {
    if (!cJSON_IsObject(entry))
        return err_set(err, "%s: key '%s' is not an object", meta_path, key);
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(entry, "dtype");
    if (!cJSON_IsString(dtype))
        return err_set(err, "%s: key '%s': \"dtype\" missing or not a string", meta_path, key);
    if (dtype_from_name(dtype->valuestring, 1, &out->dtype) || !dtype_info(out->dtype)->is_int)
        return err_set(err,
                       "%s: key '%s': dtype '%s' is not an integer type "
                       "(int32, int64, int16, int8, uint8, bool)",
                       meta_path, key, dtype->valuestring);
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(entry, "shape");
    const cJSON *dim = cJSON_IsArray(shape) ? cJSON_GetArrayItem(shape, 0) : NULL;
    // The range test comes before the cast: casting a huge double is undefined.
    if (!dim || cJSON_GetArraySize(shape) != 1 || !cJSON_IsNumber(dim) || dim->valuedouble < 0 ||
        dim->valuedouble > 0x1p52 || dim->valuedouble != (double)(int64_t)dim->valuedouble)
        return err_set(err, "%s: key '%s': \"shape\" must be [N] with N a non-negative integer",
                       meta_path, key);
    *n = (int64_t)dim->valuedouble;
    out->present = 1;
    return check_bin_size(meta_path, key, *n, out->dtype, err);
}

static int parse_meta_json(const char *meta_path, cJSON **json, Err *err) {
    char *text;
    size_t len = 0;
    if (fs_read_file(meta_path, &text, &len, err) != 0) return -1;
    // len + 1 takes in the terminating NUL that cJSON's check for trailing
    // garbage wants; an embedded NUL would hide the rest, so it is malformed.
    *json = strlen(text) == len ? cJSON_ParseWithLengthOpts(text, len + 1, NULL, 1) : NULL;
    free(text);
    if (!*json && json_out_of_memory()) return err_resource(err, "%s: out of memory", meta_path);
    if (!*json) return err_set(err, "%s: malformed JSON", meta_path);
    if (!cJSON_IsObject(*json)) {
        cJSON_Delete(*json);
        return err_set(err, "%s: top level is not an object", meta_path);
    }
    return 0;
}

// Reads one shard's meta.json; every key we know and find must be valid,
// and all of them must have the same length.
static int parse_shard(Shard *s, Err *err) {
    cJSON *meta;
    if (parse_meta_json(s->meta_path, &meta, err) != 0) return -1;
    // Record shards (data/records.h) say what they hold; they have no token stream to window.
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(meta, "format");
    if (cJSON_IsString(format)) {
        err_set(err, "%s: a %s record set; use --train_type %s", s->meta_path, format->valuestring,
                format->valuestring);
        cJSON_Delete(meta);
        return -1;
    }
    int rc = 0, first = -1;
    for (int k = 0; k < N_KEYS && rc == 0; k++) {
        const cJSON *entry = cJSON_GetObjectItemCaseSensitive(meta, KEY_NAMES[k]);
        if (!entry) continue;
        int64_t n = 0;
        rc = parse_key_entry(s->meta_path, KEY_NAMES[k], entry, &s->keys[k], &n, err);
        if (rc == 0 && first < 0) {
            first = k;
            s->n = n;
        } else if (rc == 0 && n != s->n) {
            rc = err_set(err, "%s: key '%s' has %" PRId64 " elements but '%s' has %" PRId64,
                         s->meta_path, KEY_NAMES[k], n, KEY_NAMES[first], s->n);
        }
    }
    cJSON_Delete(meta);
    if (rc == 0 && !s->keys[KEY_SEQUENCE].present)
        rc = err_set(err, "%s: key 'sequence' missing", s->meta_path);
    return rc;
}

static int64_t read_element(const unsigned char *p, DType dtype) {
    const DTypeInfo *t = dtype_info(dtype);
    uint64_t u = 0;
    for (int b = t->size - 1; b >= 0; b--)
        u = (u << 8) | p[b]; // little-endian
    if (t->is_signed && t->size < 8 && (u >> (8 * t->size - 1)))
        u |= ~(uint64_t)0 << (8 * t->size); // sign-extend
    if (dtype == DT_BOOL) return u != 0;    // numpy's bool: any non-zero byte is True
    return (int64_t)u;
}

// Decodes <key>.bin of shard s into dst[0..s->n), widening to int32.
static int load_key(const Shard *s, int k, int32_t *dst, Err *err) {
    char *bin = bin_path_for(s->meta_path, KEY_NAMES[k]);
    if (!bin) return err_resource(err, "%s: out of memory", s->meta_path);
    char *raw = NULL;
    size_t len = 0;
    int rc = fs_read_file(bin, &raw, &len, err);
    DType dtype = s->keys[k].dtype;
    const DTypeInfo *t = dtype_info(dtype);
    if (rc == 0 && (int64_t)len != s->n * t->size)
        rc = err_set(err, "%s: changed size while loading", bin);
    for (int64_t i = 0; rc == 0 && i < s->n; i++) {
        int64_t v = read_element((const unsigned char *)raw + i * t->size, dtype);
        if (v < INT32_MIN || v > INT32_MAX)
            rc = err_set(err, "%s: key '%s': element %" PRId64 " = %" PRId64 " exceeds int32",
                         s->meta_path, KEY_NAMES[k], i, v);
        dst[i] = (int32_t)v;
    }
    free(raw);
    free(bin);
    return rc;
}

// A key is loaded when required, or (if optional) when every shard has it.
static int decide_loaded_keys(const Shard *shards, int n, int need_sft, int loaded[N_KEYS],
                              Err *err) {
    for (int k = 0; k < N_KEYS; k++) {
        loaded[k] = 1;
        for (int i = 0; i < n && loaded[k]; i++) {
            if (shards[i].keys[k].present) continue;
            if (k == KEY_SEQUENCE || need_sft)
                return err_set(err, "%s: key '%s' missing", shards[i].meta_path, KEY_NAMES[k]);
            loaded[k] = 0;
        }
    }
    return 0;
}

static int32_t **key_array(Dataset *d, int k) {
    int32_t **arrays[N_KEYS] = {&d->sequence, &d->loss_mask, &d->position_ids};
    return arrays[k];
}

static int concatenate_shards(Dataset *d, const Shard *shards, int n, const int loaded[N_KEYS],
                              Err *err) {
    for (int i = 0; i < n; i++)
        d->n_tokens += shards[i].n;
    for (int k = 0; k < N_KEYS; k++) {
        if (!loaded[k]) continue;
        int32_t *all = malloc((size_t)(d->n_tokens ? d->n_tokens : 1) * sizeof *all);
        if (!all)
            return err_resource(err, "out of memory for %" PRId64 " tokens of key '%s'",
                                d->n_tokens, KEY_NAMES[k]);
        *key_array(d, k) = all;
        int64_t at = 0;
        for (int i = 0; i < n; i++) {
            if (load_key(&shards[i], k, all + at, err) != 0) return -1;
            at += shards[i].n;
        }
    }
    return 0;
}

static int open_shards(Dataset *d, char *const *paths, int n_paths, int need_sft, Err *err) {
    Shard *shards = calloc((size_t)n_paths, sizeof *shards);
    if (!shards) return err_resource(err, "out of memory for %d shards", n_paths);
    int rc = 0;
    for (int i = 0; i < n_paths && rc == 0; i++) {
        shards[i].meta_path = paths[i];
        rc = parse_shard(&shards[i], err);
    }
    int loaded[N_KEYS];
    if (rc == 0) rc = decide_loaded_keys(shards, n_paths, need_sft, loaded, err);
    if (rc == 0) rc = concatenate_shards(d, shards, n_paths, loaded, err);
    d->n_shards = n_paths;
    free(shards);
    return rc;
}

int dataset_find_shards(const char *root, char ***paths, int *n, Err *err) {
    *paths = NULL;
    *n = 0;
    if (!fs_is_dir(root)) return err_set(err, "%s: dataset root is not a directory", root);
    PathList list = {0};
    int rc = collect_meta_paths(root, &list, err);
    if (rc == 0 && list.n == 0) rc = err_set(err, "%s: no meta.json found under it", root);
    if (rc != 0) {
        path_list_free(&list);
        return -1;
    }
    qsort(list.items, (size_t)list.n, sizeof *list.items, compare_paths);
    *paths = list.items;
    *n = list.n;
    return 0;
}

void dataset_free_shards(char **paths, int n) {
    PathList list = {paths, n, n};
    path_list_free(&list);
}

int dataset_open(Dataset *d, const char *root, int need_sft, Err *err) {
    *d = (Dataset){0};
    char **paths;
    int n;
    if (dataset_find_shards(root, &paths, &n, err) != 0) return -1;
    int rc = open_shards(d, paths, n, need_sft, err);
    dataset_free_shards(paths, n);
    if (rc != 0) dataset_close(d);
    return rc;
}

void dataset_close(Dataset *d) {
    free(d->sequence);
    free(d->loss_mask);
    free(d->position_ids);
    *d = (Dataset){0};
}

// Fails naming the first value of key k (a[0..d->n_tokens)) outside [0, limit) and its
// position; `what` names such a value, `limit_name` the limit. A key not loaded passes.
static int check_key_range(const Dataset *d, const int32_t *a, int k, const char *what,
                           const char *limit_name, int limit, Err *err) {
    for (int64_t t = 0; a && t < d->n_tokens; t++)
        if (a[t] < 0 || a[t] >= limit)
            return err_set(err,
                           "dataset: key '%s': %s %" PRId32 " at position %" PRId64
                           " is outside [0, %s %d)",
                           KEY_NAMES[k], what, a[t], t, limit_name, limit);
    return 0;
}

int dataset_check_vocab(const Dataset *d, int vocab_size, Err *err) {
    return check_key_range(d, d->sequence, KEY_SEQUENCE, "token id", "vocab_size", vocab_size, err);
}

int dataset_check_positions(const Dataset *d, int max_positions, Err *err) {
    return check_key_range(d, d->position_ids, KEY_POSITION_IDS, "position id",
                           "max_position_embeddings", max_positions, err);
}

int64_t dataset_num_windows(int64_t n_tokens, int64_t window, int64_t stride) {
    if (window <= 0 || stride <= 0 || n_tokens <= window) return 0;
    return (n_tokens - 1 - window) / stride + 1;
}

void dataset_window(const Dataset *d, int64_t i, int64_t window, int64_t stride, int32_t *inputs,
                    int32_t *targets, int32_t *loss_mask, int32_t *position_ids) {
    int64_t last_begin = d->n_tokens - 1 - window;
    int64_t begin = i * stride < last_begin ? i * stride : last_begin;
    // T > w makes begin + w <= T - 1, so the window is always full: end = begin + w.
    size_t bytes = (size_t)window * sizeof(int32_t);
    memcpy(inputs, d->sequence + begin, bytes);
    memcpy(targets, d->sequence + begin + 1, bytes);
    if (loss_mask) memcpy(loss_mask, d->loss_mask + begin + 1, bytes);
    if (position_ids) memcpy(position_ids, d->position_ids + begin, bytes);
}
