// shard_writer.c: one shard directory, written to a temporary directory and renamed.
#include "data/shard_writer.h"

#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "common/path.h"

// meta.json text as AstrAI's json.dump writes it (", " and ": " separators),
// so shards written here are byte-identical to AstrAI's.
static int write_meta(const char *dir, const char *head, const ShardKey *keys, int n_keys,
                      Err *err) {
    char text[4096], path[PATH_MAX];
    int len = snprintf(text, sizeof text, "{%s", head ? head : "");
    for (int i = 0; i < n_keys && len < (int)sizeof text; i++)
        len += snprintf(text + len, sizeof text - (size_t)len,
                        "%s\"%s\": {\"shape\": [%" PRId64 "], \"dtype\": \"%s\"}",
                        i || (head && *head) ? ", " : "", keys[i].key, keys[i].n,
                        dtype_info(keys[i].dtype)->numpy);
    if (len < (int)sizeof text) len += snprintf(text + len, sizeof text - (size_t)len, "}");
    if (len >= (int)sizeof text) return err_set(err, "%s: meta.json too long", dir);
    if (path_join(path, sizeof path, dir, "meta.json", err) != 0) return -1;
    return fs_write_file_synced(path, text, (size_t)len, err);
}

static int write_key(const char *dir, const ShardKey *a, Err *err) {
    int64_t n = a->n;
    unsigned char *bytes = malloc((size_t)(n ? n : 1) * 4);
    if (!bytes) return err_resource(err, "%s: out of memory for key '%s'", dir, a->key);
    for (int64_t i = 0; i < n; i++) { // little-endian whatever the host, int32 or float32 alike
        uint32_t v;
        memcpy(&v, (const unsigned char *)a->data + 4 * i, 4);
        for (int b = 0; b < 4; b++)
            bytes[4 * i + b] = (unsigned char)(v >> (8 * b));
    }
    char name[NAME_MAX + 1], path[PATH_MAX];
    int rc = snprintf(name, sizeof name, "%s.bin", a->key) >= (int)sizeof name
                 ? err_set(err, "key '%s': name too long", a->key)
                 : path_join(path, sizeof path, dir, name, err);
    if (rc == 0) rc = fs_write_file_synced(path, bytes, (size_t)n * 4, err);
    free(bytes);
    return rc;
}

static int fill_dir(const char *tmp, const char *head, const ShardKey *keys, int n_keys, Err *err) {
    if (mkdir(tmp, 0755) != 0) return err_set(err, "%s: cannot create: %s", tmp, strerror(errno));
    for (int i = 0; i < n_keys; i++)
        if (write_key(tmp, &keys[i], err) != 0) return -1;
    if (write_meta(tmp, head, keys, n_keys, err) != 0) return -1;
    return fs_fsync_dir(tmp, err);
}

int shard_write(const char *dir, const ShardArray *arrays, int n_arrays, int64_t n, Err *err) {
    ShardKey *keys = malloc((size_t)(n_arrays ? n_arrays : 1) * sizeof *keys);
    if (!keys) return err_resource(err, "%s: out of memory", dir);
    for (int i = 0; i < n_arrays; i++)
        keys[i] = (ShardKey){arrays[i].key, arrays[i].data, n, DT_I32};
    int rc = shard_write_keys(dir, NULL, keys, n_arrays, err);
    free(keys);
    return rc;
}

int shard_write_keys(const char *dir, const char *head, const ShardKey *keys, int n_keys,
                     Err *err) {
    char parent[PATH_MAX], base[PATH_MAX], tmp[PATH_MAX];
    if (snprintf(parent, sizeof parent, "%s", dir) >= (int)sizeof parent)
        return err_set(err, "%s: path too long", dir);
    snprintf(base, sizeof base, "%s", dir);
    char *parent_name = dirname(parent);
    // Hidden (leading '.'): dataset readers, ours and AstrAI's glob, skip it.
    if (snprintf(tmp, sizeof tmp, "%s/.%s.tmp.%ld", parent_name, basename(base), (long)getpid()) >=
        (int)sizeof tmp)
        return err_set(err, "%s: path too long", dir);
    struct stat st;
    if (lstat(dir, &st) == 0) return err_set(err, "%s: already exists", dir);
    if (fs_mkdir_p(parent_name, err) != 0) return -1;
    if (fs_remove_tree(tmp, err) != 0) return -1; // a leftover of a crashed run
    if (fill_dir(tmp, head, keys, n_keys, err) != 0) {
        Err ignored;
        fs_remove_tree(tmp, &ignored);
        return -1;
    }
    if (rename(tmp, dir) != 0) {
        int e = errno;
        Err ignored;
        fs_remove_tree(tmp, &ignored);
        return err_set(err, "%s: cannot rename %s into place: %s", dir, tmp, strerror(e));
    }
    return fs_fsync_dir(parent_name, err);
}
