// meta.c: meta.json of a checkpoint: parse with validation, serialise.
#include "ckpt/meta.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/fsutil.h"
#include "common/json.h"

// Integers in JSON arrive as doubles: beyond 2^53 they are no longer exact.
#define META_MAX_INT 9007199254740992.0

// The value as it appears in the file, shortened for a message.
static void describe(const cJSON *item, char *out, size_t cap) {
    char *text = cJSON_PrintUnformatted(item);
    snprintf(out, cap, "%.60s%s", text ? text : "?", text && strlen(text) > 60 ? "..." : "");
    free(text);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

// cJSON keeps both copies of a repeated key; Python keeps the last. Refuse it.
static int check_duplicate_keys(const cJSON *root, const char *source, Err *err) {
    int n = cJSON_GetArraySize(root);
    const char **names = malloc(((size_t)n + 1) * sizeof *names);
    if (!names) return err_resource(err, "%s: out of memory", source);
    int i = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, root) names[i++] = item->string;
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    int rc = 0;
    for (i = 1; i < n && rc == 0; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            rc = err_set(err, "%s: key \"%s\" appears twice", source, names[i]);
    free(names);
    return rc;
}

// Takes key out of root as a non-negative integer; absent → *out = dflt, or an
// error when required.
static int take_count(cJSON *root, const char *key, int required, long dflt, long *out,
                      const char *source, Err *err) {
    cJSON *item = cJSON_DetachItemFromObjectCaseSensitive(root, key);
    if (!item) {
        *out = dflt;
        return required ? err_set(err, "%s: missing key \"%s\"", source, key) : 0;
    }
    double d = item->valuedouble;
    int ok = cJSON_IsNumber(item) && d >= 0 && d <= META_MAX_INT && d == floor(d);
    if (ok) *out = (long)d;
    char got[80];
    if (!ok) describe(item, got, sizeof got);
    cJSON_Delete(item);
    if (!ok)
        return err_set(err, "%s: \"%s\" must be a non-negative integer, got %s", source, key, got);
    return 0;
}

static int take_timestamp(cJSON *root, char *out, size_t cap, const char *source, Err *err) {
    cJSON *item = cJSON_DetachItemFromObjectCaseSensitive(root, "timestamp");
    out[0] = '\0';
    if (!item) return 0;
    int ok = cJSON_IsString(item) && strlen(item->valuestring) < cap;
    char got[80];
    if (ok)
        snprintf(out, cap, "%s", item->valuestring);
    else
        describe(item, got, sizeof got);
    cJSON_Delete(item);
    if (!ok)
        return err_set(err, "%s: \"timestamp\" must be a string of at most %zu characters, got %s",
                       source, cap - 1, got);
    return 0;
}

int meta_parse(CkptMeta *m, const char *json, const char *source, Err *err) {
    memset(m, 0, sizeof *m);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(json, &end, 1);
    if (!root && json_out_of_memory()) return err_resource(err, "%s: out of memory", source);
    if (!root)
        return err_set(err, "%s: not valid JSON (near byte %zu)", source,
                       end ? (size_t)(end - json) : 0);
    int rc = 0;
    if (!cJSON_IsObject(root))
        rc = err_set(err, "%s: not a JSON object", source);
    else if (check_duplicate_keys(root, source, err) != 0 ||
             take_count(root, "epoch", 1, 0, &m->epoch, source, err) != 0 ||
             take_count(root, "consumed_samples", 1, 0, &m->consumed_samples, source, err) != 0 ||
             take_count(root, "step", 0, -1, &m->step, source, err) != 0 ||
             take_timestamp(root, m->timestamp, sizeof m->timestamp, source, err) != 0)
        rc = -1;
    if (rc != 0) {
        cJSON_Delete(root);
        memset(m, 0, sizeof *m);
        return -1;
    }
    m->config = root;
    return 0;
}

int meta_load(CkptMeta *m, const char *path, Err *err) {
    memset(m, 0, sizeof *m);
    char *text;
    if (fs_read_file(path, &text, NULL, err) != 0) return -1;
    int rc = meta_parse(m, text, path, err);
    free(text);
    return rc;
}

void meta_stamp_now(CkptMeta *m) {
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(m->timestamp, sizeof m->timestamp, "%Y-%m-%dT%H:%M:%S", &tm);
}

static int is_own_key(const char *key) {
    return strcmp(key, "epoch") == 0 || strcmp(key, "consumed_samples") == 0 ||
           strcmp(key, "timestamp") == 0 || strcmp(key, "step") == 0;
}

// A count as its exact decimal digits: cJSON prints a double with 15 digits when it reads back
// within a relative epsilon, which loses the last unit of integers near 2^53.
static int add_count(cJSON *root, const char *key, long v) {
    char digits[32];
    snprintf(digits, sizeof digits, "%ld", v);
    return cJSON_AddRawToObject(root, key, digits) != NULL;
}

char *meta_to_json(const CkptMeta *m) {
    cJSON *root = cJSON_CreateObject();
    int ok = root && add_count(root, "epoch", m->epoch) &&
             add_count(root, "consumed_samples", m->consumed_samples) &&
             cJSON_AddStringToObject(root, "timestamp", m->timestamp) &&
             (m->step < 0 || add_count(root, "step", m->step));
    const cJSON *item;
    if (ok && m->config) {
        cJSON_ArrayForEach(item, m->config) {
            if (is_own_key(item->string)) continue; // ours above win over a stray copy
            cJSON *copy = cJSON_Duplicate(item, 1);
            if (!copy || !cJSON_AddItemToObject(root, item->string, copy)) {
                cJSON_Delete(copy);
                ok = 0;
                break;
            }
        }
    }
    char *text = ok ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    return text;
}

void meta_free(CkptMeta *m) {
    cJSON_Delete(m->config);
    m->config = NULL;
}
