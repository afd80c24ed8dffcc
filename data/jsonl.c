// jsonl.c: JSONL line iteration and the text fields of records (string, token ids,
// conversation list).
#include "data/jsonl.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/fsutil.h"
#include "common/json.h"

static int is_blank(const char *p, const char *end) {
    for (; p < end; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r') return 0;
    return 1;
}

// One line [p, eol): parsed and handed to fn; errors are left unprefixed.
static int jsonl_line(const char *p, const char *eol, JsonlRecordFn fn, void *ctx, Err *err) {
    const char *end = NULL;
    cJSON *rec = cJSON_ParseWithLengthOpts(p, (size_t)(eol - p), &end, 0);
    int rc = !rec && json_out_of_memory()  ? err_resource(err, "out of memory parsing the line")
             : !rec || !is_blank(end, eol) ? err_set(err, "malformed JSON")
                                           : fn(rec, ctx, err);
    cJSON_Delete(rec);
    return rc;
}

int jsonl_each(const char *path, JsonlRecordFn fn, void *ctx, int64_t *skipped, Err *first_skipped,
               Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(path, &text, &len, err) != 0) return -1;
    int rc = 0;
    long line = 1;
    for (char *p = text; rc == 0 && p < text + len; line++) {
        char *eol = memchr(p, '\n', (size_t)(text + len - p));
        if (!eol) eol = text + len;
        if (!is_blank(p, eol)) {
            Err e = {0};
            if (jsonl_line(p, eol, fn, ctx, &e) != 0) {
                err_prefix(&e, "%s:%ld", path, line);
                if (!skipped || e.resource) {
                    *err = e;
                    rc = -1;
                } else if ((*skipped)++ == 0 && first_skipped) {
                    *first_skipped = e;
                }
            }
        }
        p = eol + 1;
    }
    free(text);
    return rc;
}

// v's elements as token ids in [0, INT32_MAX].
static int id_array(const cJSON *v, const char *where, int32_t *ids, Err *err) {
    int64_t i = 0;
    for (const cJSON *e = v->child; e; e = e->next, i++) {
        // The range test comes before the cast: casting a huge double is undefined.
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > INT32_MAX ||
            e->valuedouble != (double)(int32_t)e->valuedouble)
            return err_set(err, "%s[%" PRId64 "] is not a token id (an integer in [0, %d])", where,
                           i, INT32_MAX);
        ids[i] = (int32_t)e->valuedouble;
    }
    return 0;
}

// A conversation list's "content" strings joined (*text malloc'd, NUL-terminated).
static int join_contents(const cJSON *v, const char *where, char **text, size_t *len, Err *err) {
    *len = 0;
    int64_t i = 0;
    for (const cJSON *m = v->child; m; m = m->next, i++) {
        if (!cJSON_IsObject(m))
            return err_set(err,
                           "%s[%" PRId64 "] is not a message object (a conversation list holds "
                           "objects with \"content\")",
                           where, i);
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (c && !cJSON_IsString(c))
            return err_set(err, "%s[%" PRId64 "]: \"content\" is not a string", where, i);
        if (c) *len += strlen(c->valuestring);
    }
    *text = malloc(*len + 1);
    if (!*text) return err_resource(err, "%s: out of memory for %zu bytes", where, *len);
    size_t at = 0;
    for (const cJSON *m = v->child; m; m = m->next) {
        const cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (!c) continue;
        size_t n = strlen(c->valuestring);
        memcpy(*text + at, c->valuestring, n);
        at += n;
    }
    (*text)[at] = '\0';
    return 0;
}

int jsonl_field_ids(const cJSON *v, const char *where, const Tokenizer *tok, int32_t **ids,
                    int64_t *n, Err *err) {
    if (cJSON_IsString(v))
        return tokenizer_encode(tok, v->valuestring, strlen(v->valuestring), ids, n, err);
    if (!cJSON_IsArray(v))
        return err_set(err, "%s must be a string, an array of token ids or a conversation list",
                       where);
    if (cJSON_IsObject(v->child)) {
        char *text;
        size_t len;
        if (join_contents(v, where, &text, &len, err) != 0) return -1;
        int rc = tokenizer_encode(tok, text, len, ids, n, err);
        free(text);
        return rc;
    }
    *n = cJSON_GetArraySize(v);
    *ids = malloc((size_t)(*n ? *n : 1) * sizeof **ids);
    if (!*ids) return err_resource(err, "%s: out of memory for %" PRId64 " ids", where, *n);
    if (id_array(v, where, *ids, err) == 0) return 0;
    free(*ids);
    *ids = NULL;
    return -1;
}
