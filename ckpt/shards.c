// shards.c: Hugging Face's sharded safetensors layout, read as one StFile and indexed
// (ckpt/shards.h).
#include "ckpt/shards.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"

#define PATH_CAP 4096
// More files than this in one index is no checkpoint of ours nor a model's.
#define SHARDS_MAX_FILES 100000

void shards_file_name(char *out, size_t cap, const char *stem, int k, int n) {
    snprintf(out, cap, "%s-%05d-of-%05d.safetensors", stem, k, n);
}

static int index_path(char *out, size_t cap, const char *dir, const char *stem, Err *err) {
    char name[256];
    snprintf(name, sizeof name, "%s.safetensors.index.json", stem);
    return path_join(out, cap, dir, name, err);
}

int shards_present(const char *dir, const char *stem) {
    char path[PATH_CAP], name[256];
    Err ignored;
    snprintf(name, sizeof name, "%s.safetensors", stem);
    if (!path_join(path, sizeof path, dir, name, &ignored) && fs_is_file(path)) return 1;
    return !index_path(path, sizeof path, dir, stem, &ignored) && fs_is_file(path);
}

// ---------------------------------------------------------------- reading

// A weight_map value: a file of the checkpoint's own directory, never a path out of it.
static int check_file_name(const char *index, const char *tensor, const char *file, Err *err) {
    size_t n = strlen(file), ext = strlen(".safetensors");
    if (n <= ext || strcmp(file + n - ext, ".safetensors") != 0 || strchr(file, '/') ||
        file[0] == '.')
        return err_set(err,
                       "%s: weight_map[\"%s\"] is '%.200s', not the name of a .safetensors file "
                       "beside the index",
                       index, tensor, file);
    return 0;
}

// The distinct files of the weight_map, in the order they first appear.
static int list_files(const cJSON *map, const char *index, const char ***files, int *n, Err *err) {
    int cap = cJSON_GetArraySize(map);
    *files = calloc((size_t)cap + 1, sizeof **files);
    *n = 0;
    if (!*files) return err_resource(err, "%s: out of memory for %d entries", index, cap);
    const cJSON *e;
    cJSON_ArrayForEach(e, map) {
        if (!cJSON_IsString(e))
            return err_set(err, "%s: weight_map[\"%s\"] is not a file name", index, e->string);
        if (check_file_name(index, e->string, e->valuestring, err)) return -1;
        int k = 0;
        while (k < *n && strcmp((*files)[k], e->valuestring) != 0)
            k++;
        if (k == *n) {
            if (*n == SHARDS_MAX_FILES)
                return err_set(err, "%s: more than %d files", index, SHARDS_MAX_FILES);
            (*files)[(*n)++] = e->valuestring;
        }
    }
    return 0;
}

static int cmp_by_name(const void *a, const void *b) {
    return strcmp(((const StTensor *)a)->name, ((const StTensor *)b)->name);
}

// The tensors the weight_map names, each from its file (files[k] opened from names[k]).
static int merge(StFile *f, const cJSON *map, const char **names, const char *index, Err *err) {
    int n = cJSON_GetArraySize(map);
    f->tensors = calloc((size_t)n + 1, sizeof *f->tensors);
    if (!f->tensors) return err_resource(err, "%s: out of memory for %d tensors", index, n);
    const cJSON *e;
    cJSON_ArrayForEach(e, map) {
        int k = 0;
        while (strcmp(names[k], e->valuestring) != 0)
            k++;
        const StTensor *t = st_find(&f->files[k], e->string);
        if (!t)
            return err_set(err, "%s: weight_map puts tensor '%s' in %s, which does not hold it",
                           index, e->string, names[k]);
        StTensor *dst = &f->tensors[f->n_tensors];
        *dst = *t;
        dst->file = f->file_names[k];
        if (!(dst->name = strdup(t->name))) return err_resource(err, "%s: out of memory", index);
        f->n_tensors++;
    }
    qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_by_name);
    for (int i = 1; i < f->n_tensors; i++)
        if (!strcmp(f->tensors[i - 1].name, f->tensors[i].name))
            return err_set(err, "%s: tensor '%s' appears twice in weight_map", index,
                           f->tensors[i].name);
    return 0;
}

static int open_files(StFile *f, const char *dir, const char *index, const char **names, int n,
                      Err *err) {
    f->files = calloc((size_t)n + 1, sizeof *f->files);
    f->file_names = calloc((size_t)n + 1, sizeof *f->file_names);
    if (!f->files || !f->file_names)
        return err_resource(err, "%s: out of memory for %d files", dir, n);
    char path[PATH_CAP];
    for (int k = 0; k < n; k++) {
        if (!(f->file_names[k] = strdup(names[k])))
            return err_resource(err, "%s: out of memory", index);
        f->n_files = k + 1; // st_close frees the name from here on
        if (path_join(path, sizeof path, dir, names[k], err) || st_open(&f->files[k], path, err))
            return err_prefix(err, "%s", index);
    }
    return 0;
}

static int read_index(cJSON **root, const char *index, Err *err) {
    if (json_read_file(index, root, err)) return -1;
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(*root, "weight_map");
    if (!cJSON_IsObject(map)) return err_set(err, "%s: no \"weight_map\" object", index);
    return 0;
}

static int open_set(StFile *f, const char *dir, const char *index, Err *err) {
    cJSON *root = NULL;
    const char **names = NULL;
    int n = 0;
    int rc = read_index(&root, index, err);
    const cJSON *map = rc ? NULL : cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!rc) rc = list_files(map, index, &names, &n, err);
    if (!rc) rc = open_files(f, dir, index, names, n, err);
    if (!rc) rc = merge(f, map, names, index, err);
    free(names);
    cJSON_Delete(root);
    return rc;
}

int shards_open(StFile *f, const char *dir, const char *stem, char *path, size_t cap, Err *err) {
    memset(f, 0, sizeof *f);
    char name[256];
    snprintf(name, sizeof name, "%s.safetensors", stem);
    if (path_join(path, cap, dir, name, err)) return -1;
    if (fs_is_file(path)) return st_open(f, path, err);
    if (index_path(path, cap, dir, stem, err)) return -1;
    if (!fs_is_file(path))
        return err_set(err, "%s: neither %s.safetensors nor %s.safetensors.index.json", dir, stem,
                       stem);
    if (open_set(f, dir, path, err)) {
        st_close(f);
        return -1;
    }
    return 0;
}

// ---------------------------------------------------------------- the index

// Adds the tensors of file k not mapped yet to map; *total: their bytes.
static int index_file(cJSON *map, const char *dir, const char *file, double *total, Err *err) {
    char path[PATH_CAP];
    StFile f;
    if (path_join(path, sizeof path, dir, file, err) || st_open(&f, path, err)) return -1;
    int rc = 0;
    for (int i = 0; i < f.n_tensors && !rc; i++) {
        const StTensor *t = &f.tensors[i];
        if (cJSON_GetObjectItemCaseSensitive(map, t->name)) continue;
        if (!cJSON_AddStringToObject(map, t->name, file))
            rc = err_resource(err, "%s: out of memory", path);
        *total += (double)(t->end - t->begin);
    }
    st_close(&f);
    return rc;
}

int shards_write_index(const char *dir, const char *stem, int n, Err *err) {
    char index[PATH_CAP], file[256];
    if (index_path(index, sizeof index, dir, stem, err)) return -1;
    cJSON *root = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(root, "metadata");
    cJSON *map = cJSON_AddObjectToObject(root, "weight_map");
    if (!root || !meta || !map) {
        cJSON_Delete(root);
        return err_resource(err, "%s: out of memory", index);
    }
    double total = 0;
    int rc = 0;
    for (int k = 1; k <= n && !rc; k++) {
        shards_file_name(file, sizeof file, stem, k, n);
        rc = index_file(map, dir, file, &total, err);
    }
    char *text = NULL;
    if (!rc && (!cJSON_AddNumberToObject(meta, "total_size", total) || !(text = cJSON_Print(root))))
        rc = err_resource(err, "%s: out of memory", index);
    if (!rc) rc = fs_write_file_synced(index, text, strlen(text), err);
    free(text);
    cJSON_Delete(root);
    return rc;
}
