// records.c: DPO/GRPO record sets: validated appends, JSONL records, record shards
// (docs/data.md) and the model rows cut from them.
#include "data/records.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"
#include "data/dataset.h"
#include "data/jsonl.h"
#include "data/shard_writer.h"

// Far past any real group: a larger one is a mistake in the group size, not data.
#define MAX_GROUP_SIZE 65536

const char *records_kind_name(RecordKind kind) {
    return kind == RECORDS_DPO ? "dpo" : "grpo";
}

void records_init(RecordSet *rs, RecordKind kind, int group_size) {
    *rs = (RecordSet){.kind = kind, .group_size = kind == RECORDS_DPO ? 2 : group_size};
}

void records_free(RecordSet *rs) {
    free(rs->prompt);
    free(rs->prompt_off);
    free(rs->response);
    free(rs->response_off);
    free(rs->reward);
    records_init(rs, rs->kind, rs->group_size);
}

static int check_group_size(const RecordSet *rs, Err *err) {
    if (rs->group_size >= 1 && rs->group_size <= MAX_GROUP_SIZE) return 0;
    return err_set(err, "group_size %d is not in [1, %d]", rs->group_size, MAX_GROUP_SIZE);
}

// ------------------------------------------------------------ appending records

typedef struct {
    const int32_t *ids;
    int64_t n;
} Span;

// How messages name response j: a JSON path into AstrAI's record shape.
static void response_where(RecordKind kind, int j, char *buf, size_t cap) {
    if (kind == RECORDS_DPO)
        snprintf(buf, cap, "%s", j == 0 ? "\"chosen\"" : "\"rejected\"");
    else
        snprintf(buf, cap, "\"responses\"[%d]", j);
}

static int64_t next_cap(int64_t cap, int64_t need) {
    int64_t c = cap ? cap : 64;
    while (c < need)
        c *= 2;
    return c;
}

static void *resized(void *p, int64_t n, size_t size) {
    return realloc(p, (size_t)(n ? n : 1) * size);
}

// A token array with room for `need` tokens.
static int grow_tokens(int32_t **tokens, int64_t *cap, int64_t need, const char *what, Err *err) {
    if (need <= *cap) return 0;
    int64_t c = next_cap(*cap, need);
    int32_t *p = resized(*tokens, c, sizeof *p);
    if (!p) return err_resource(err, "out of memory for %" PRId64 " %s tokens", c, what);
    *tokens = p;
    *cap = c;
    return 0;
}

// Room for one more record of n_prompt prompt and n_response response tokens.
static int reserve(RecordSet *rs, int64_t n_prompt, int64_t n_response, Err *err) {
    int64_t G = rs->group_size, n = rs->n_records;
    if (n + 1 > rs->record_cap) {
        int64_t cap = next_cap(rs->record_cap, n + 1);
        int64_t *po = resized(rs->prompt_off, cap + 1, sizeof *po);
        if (po) rs->prompt_off = po;
        int64_t *ro = po ? resized(rs->response_off, cap * G + 1, sizeof *ro) : NULL;
        if (ro) rs->response_off = ro;
        float *rw =
            ro && rs->kind == RECORDS_GRPO ? resized(rs->reward, cap * G, sizeof *rw) : NULL;
        if (rw) rs->reward = rw;
        if (!ro || (rs->kind == RECORDS_GRPO && !rw))
            return err_resource(err, "out of memory for %" PRId64 " records", cap);
        if (n == 0) po[0] = ro[0] = 0;
        rs->record_cap = cap;
    }
    int64_t need_p = rs->prompt_off[n] + n_prompt, need_r = rs->response_off[n * G] + n_response;
    return grow_tokens(&rs->prompt, &rs->prompt_cap, need_p, "prompt", err) ||
           grow_tokens(&rs->response, &rs->response_cap, need_r, "response", err);
}

// A field's tokens: not empty, at most INT32_MAX of them (shards store int32 lengths), every id
// in [0, vocab_size) (vocab_size 0: in [0, INT32_MAX]).
static int check_span(Span s, const char *where, int vocab_size, Err *err) {
    if (s.n == 0) return err_set(err, "%s is empty", where);
    if (s.n > INT32_MAX) return err_set(err, "%s has %" PRId64 " tokens (over 2^31-1)", where, s.n);
    for (int64_t i = 0; i < s.n; i++) {
        if (s.ids[i] < 0)
            return err_set(err, "%s[%" PRId64 "]: token id %" PRId32 " is negative", where, i,
                           s.ids[i]);
        if (vocab_size > 0 && s.ids[i] >= vocab_size)
            return err_set(
                err, "%s[%" PRId64 "]: token id %" PRId32 " is outside the vocabulary [0, %d)",
                where, i, s.ids[i], vocab_size);
    }
    return 0;
}

// Validates one record and appends it; on failure the set is as it was. responses: G spans;
// rewards: G values (GRPO; NULL for DPO).
static int append_record(RecordSet *rs, const char *prompt_where, Span prompt,
                         const Span *responses, const float *rewards, int vocab_size, Err *err) {
    if (prompt.n == 0)
        return err_set(err, "%s is empty (the first response token needs a token before it)",
                       prompt_where);
    if (check_span(prompt, prompt_where, vocab_size, err) != 0) return -1;
    int G = rs->group_size;
    int64_t n_response = 0;
    for (int j = 0; j < G; j++) {
        char where[64];
        response_where(rs->kind, j, where, sizeof where);
        if (check_span(responses[j], where, vocab_size, err) != 0) return -1;
        if (rewards && !isfinite(rewards[j]))
            return err_set(err, "\"rewards\"[%d] = %g is not a finite number", j, rewards[j]);
        n_response += responses[j].n;
    }
    if (reserve(rs, prompt.n, n_response, err) != 0) return -1;
    int64_t r = rs->n_records, k = r * G;
    memcpy(rs->prompt + rs->prompt_off[r], prompt.ids, (size_t)prompt.n * sizeof *prompt.ids);
    rs->prompt_off[r + 1] = rs->prompt_off[r] + prompt.n;
    for (int j = 0; j < G; j++, k++) {
        memcpy(rs->response + rs->response_off[k], responses[j].ids,
               (size_t)responses[j].n * sizeof *responses[j].ids);
        rs->response_off[k + 1] = rs->response_off[k] + responses[j].n;
        if (rewards) rs->reward[k] = rewards[j];
    }
    rs->n_records++;
    return 0;
}

int records_add(RecordSet *rs, const int32_t *prompt, int64_t n_prompt,
                const int32_t *const *responses, const int64_t *n_responses, const float *rewards,
                int vocab_size, Err *err) {
    if (check_group_size(rs, err)) return -1;
    Span p = {prompt, n_prompt}, r[rs->group_size];
    for (int j = 0; j < rs->group_size; j++)
        r[j] = (Span){responses[j], n_responses[j]};
    return append_record(rs, "the prompt", p, r, rs->kind == RECORDS_GRPO ? rewards : NULL,
                         vocab_size, err);
}

void records_clear(RecordSet *rs) {
    rs->n_records = 0; // the offsets start at 0 again; the buffers stay for the next records
}

// ------------------------------------------------------------ JSONL records

typedef struct {
    RecordSet *rs;
    const Tokenizer *tok;
    int vocab_size;
} JsonlCtx;

// Python's truth value of a JSON value (AstrAI: `record.get("prompt") or record.get("input")`).
static int truthy(const cJSON *v) {
    if (!v || cJSON_IsNull(v) || cJSON_IsFalse(v)) return 0;
    if (cJSON_IsString(v)) return v->valuestring[0] != '\0';
    if (cJSON_IsNumber(v)) return v->valuedouble != 0;
    if (cJSON_IsArray(v) || cJSON_IsObject(v)) return v->child != NULL;
    return 1;
}

// rec[key] must be an array of G elements.
static int group_array(const cJSON *v, const char *key, int G, Err *err) {
    if (!v) return err_set(err, "key \"%s\" missing", key);
    if (!cJSON_IsArray(v))
        return err_set(err, "\"%s\" must be an array of group_size %d elements", key, G);
    int n = cJSON_GetArraySize(v);
    if (n != G) return err_set(err, "\"%s\" has %d elements, not group_size %d", key, n, G);
    return 0;
}

// The G response fields of a record (fields[j]) and, for GRPO, its G rewards.
static int response_fields(const cJSON *rec, const RecordSet *rs, const cJSON **fields,
                           float *rewards, Err *err) {
    int G = rs->group_size;
    if (rs->kind == RECORDS_DPO) {
        static const char *const KEYS[2] = {"chosen", "rejected"};
        for (int j = 0; j < 2; j++) {
            fields[j] = cJSON_GetObjectItemCaseSensitive(rec, KEYS[j]);
            if (!fields[j]) return err_set(err, "key \"%s\" missing", KEYS[j]);
        }
        return 0;
    }
    const cJSON *responses = cJSON_GetObjectItemCaseSensitive(rec, "responses");
    const cJSON *values = cJSON_GetObjectItemCaseSensitive(rec, "rewards");
    if (group_array(responses, "responses", G, err) != 0 ||
        group_array(values, "rewards", G, err) != 0)
        return -1;
    int j = 0;
    for (const cJSON *v = responses->child; v; v = v->next)
        fields[j++] = v;
    j = 0;
    for (const cJSON *v = values->child; v; v = v->next, j++) {
        if (!cJSON_IsNumber(v)) return err_set(err, "\"rewards\"[%d] is not a number", j);
        rewards[j] = (float)v->valuedouble; // a double past float's range becomes inf: refused
    }
    return 0;
}

// One JSONL record: its fields tokenized, then appended (jsonl_each callback).
static int parse_record(const cJSON *rec, void *ctx_, Err *err) {
    const JsonlCtx *ctx = ctx_;
    RecordSet *rs = ctx->rs;
    if (!cJSON_IsObject(rec)) return err_set(err, "a record must be a JSON object");
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(rec, "prompt");
    const char *prompt_where = "\"prompt\"";
    const cJSON *input =
        rs->kind == RECORDS_DPO ? cJSON_GetObjectItemCaseSensitive(rec, "input") : NULL;
    if (!truthy(prompt) && input) {
        prompt = input;
        prompt_where = "\"input\"";
    }
    if (!prompt)
        return err_set(err, "key \"prompt\"%s missing",
                       rs->kind == RECORDS_DPO ? " (or \"input\")" : "");
    int G = rs->group_size;
    const cJSON **fields = calloc((size_t)G, sizeof *fields);
    float *rewards = rs->kind == RECORDS_GRPO ? calloc((size_t)G, sizeof *rewards) : NULL;
    Span *spans = calloc((size_t)G + 1, sizeof *spans); // [0]: the prompt
    int32_t **ids = calloc((size_t)G + 1, sizeof *ids);
    int rc = !fields || !spans || !ids || (rs->kind == RECORDS_GRPO && !rewards)
                 ? err_resource(err, "out of memory for a record of %d responses", G)
                 : response_fields(rec, rs, fields, rewards, err);
    for (int f = 0; rc == 0 && f <= G; f++) {
        char where[64];
        if (f > 0) response_where(rs->kind, f - 1, where, sizeof where);
        rc = jsonl_field_ids(f ? fields[f - 1] : prompt, f ? where : prompt_where, ctx->tok,
                             &ids[f], &spans[f].n, err);
        spans[f].ids = ids[f];
    }
    if (rc == 0)
        rc = append_record(rs, prompt_where, spans[0], spans + 1, rewards, ctx->vocab_size, err);
    for (int f = 0; ids && f <= G; f++)
        free(ids[f]);
    free(ids);
    free(spans);
    free(rewards);
    free(fields);
    return rc;
}

int records_parse_jsonl(RecordSet *rs, const char *path, const Tokenizer *tok, int vocab_size,
                        int skip_bad, Err *err) {
    if (check_group_size(rs, err) != 0) return -1;
    JsonlCtx ctx = {rs, tok, vocab_size};
    return jsonl_each(path, parse_record, &ctx, skip_bad ? &rs->skipped : NULL, &rs->first_skipped,
                      err);
}

// ------------------------------------------------------------ record shards

enum { KEY_PROMPT, KEY_PROMPT_LEN, KEY_RESPONSE, KEY_RESPONSE_LEN, KEY_REWARD, N_KEYS };
static const char *const KEY_NAMES[N_KEYS] = {"prompt", "prompt_len", "response", "response_len",
                                              "reward"};

int records_write_shard(const RecordSet *rs, int64_t first, int64_t n, const char *dir, Err *err) {
    if (first < 0 || n < 1 || first + n > rs->n_records)
        return err_set(err, "%s: records [%" PRId64 ", %" PRId64 ") are not in the set of %" PRId64,
                       dir, first, first + n, rs->n_records);
    int64_t G = rs->group_size, k0 = first * G;
    int32_t *prompt_len = malloc((size_t)n * sizeof *prompt_len);
    int32_t *response_len = malloc((size_t)(n * G) * sizeof *response_len);
    if (!prompt_len || !response_len) {
        free(prompt_len);
        free(response_len);
        return err_resource(err, "%s: out of memory for %" PRId64 " records", dir, n);
    }
    // Lengths fit int32: append_record refuses longer fields.
    for (int64_t r = 0; r < n; r++)
        prompt_len[r] = (int32_t)(rs->prompt_off[first + r + 1] - rs->prompt_off[first + r]);
    for (int64_t k = 0; k < n * G; k++)
        response_len[k] = (int32_t)(rs->response_off[k0 + k + 1] - rs->response_off[k0 + k]);
    const int64_t p0 = rs->prompt_off[first], r0 = rs->response_off[k0];
    const ShardKey keys[N_KEYS] = {
        {KEY_NAMES[KEY_PROMPT], rs->prompt + p0, rs->prompt_off[first + n] - p0, DT_I32},
        {KEY_NAMES[KEY_PROMPT_LEN], prompt_len, n, DT_I32},
        {KEY_NAMES[KEY_RESPONSE], rs->response + r0, rs->response_off[k0 + n * G] - r0, DT_I32},
        {KEY_NAMES[KEY_RESPONSE_LEN], response_len, n * G, DT_I32},
        {KEY_NAMES[KEY_REWARD], rs->reward ? rs->reward + k0 : NULL, n * G, DT_F32},
    };
    char head[160];
    snprintf(head, sizeof head, "\"format\": \"%s\", \"group_size\": %d, \"records\": %" PRId64,
             records_kind_name(rs->kind), rs->group_size, n);
    int rc = shard_write_keys(dir, head, keys, rs->kind == RECORDS_GRPO ? 5 : 4, err);
    free(prompt_len);
    free(response_len);
    return rc;
}

// A JSON number that is an integer in [0, 2^52] (exact in a double).
static int as_count(const cJSON *v, int64_t *out) {
    // The range test comes before the cast: casting a huge double is undefined.
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 0x1p52 ||
        v->valuedouble != (double)(int64_t)v->valuedouble)
        return 0;
    *out = (int64_t)v->valuedouble;
    return 1;
}

static int read_meta(const char *meta_path, cJSON **meta, Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(meta_path, &text, &len, err) != 0) return -1;
    *meta = cJSON_ParseWithOpts(text, NULL, 1);
    free(text);
    if (!*meta && json_out_of_memory()) return err_resource(err, "%s: out of memory", meta_path);
    if (cJSON_IsObject(*meta)) return 0;
    cJSON_Delete(*meta);
    return err_set(err, "%s: malformed JSON or not an object", meta_path);
}

typedef struct {
    int is_records; // 0: no "format" (a token shard); the rest is then unset
    RecordKind kind;
    int group_size;
    int64_t n_records;
} ShardHead;

// "format", "group_size" and "records" of a shard's meta.json.
static int parse_head(const char *meta_path, const cJSON *meta, ShardHead *h, Err *err) {
    *h = (ShardHead){0};
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(meta, "format");
    if (!format) return 0;
    h->is_records = 1;
    if (cJSON_IsString(format) && strcmp(format->valuestring, "dpo") == 0)
        h->kind = RECORDS_DPO;
    else if (cJSON_IsString(format) && strcmp(format->valuestring, "grpo") == 0)
        h->kind = RECORDS_GRPO;
    else
        return err_set(err, "%s: \"format\" is not \"dpo\" or \"grpo\"", meta_path);
    int64_t g;
    if (!as_count(cJSON_GetObjectItemCaseSensitive(meta, "group_size"), &g) || g < 1 ||
        g > MAX_GROUP_SIZE || (h->kind == RECORDS_DPO && g != 2))
        return err_set(err, "%s: \"group_size\" must be %s", meta_path,
                       h->kind == RECORDS_DPO ? "2 for dpo" : "an integer in [1, 65536]");
    h->group_size = (int)g;
    if (!as_count(cJSON_GetObjectItemCaseSensitive(meta, "records"), &h->n_records))
        return err_set(err, "%s: \"records\" must be a non-negative integer", meta_path);
    return 0;
}

// The run's kind and group size against a shard's.
static int check_head(const char *meta_path, const ShardHead *h, const RecordSet *rs, Err *err) {
    const char *want = records_kind_name(rs->kind);
    if (!h->is_records)
        return err_set(err,
                       "%s: a token dataset (its meta.json has no \"format\"), not a %s record "
                       "set; prepare one with astrai-data prep --format %s-jsonl",
                       meta_path, want, want);
    if (h->kind != rs->kind)
        return err_set(err, "%s: a %s record set, but the run asks for %s", meta_path,
                       records_kind_name(h->kind), want);
    if (h->group_size != rs->group_size)
        return err_set(err, "%s: group_size %d, but the run asks for group_size %d", meta_path,
                       h->group_size, rs->group_size);
    return 0;
}

// meta[key] = {"shape": [n], "dtype": dtype}, n = want unless want < 0 (any); sets *n.
static int parse_key(const char *meta_path, const cJSON *meta, int k, const char *dtype,
                     int64_t want, int64_t *n, Err *err) {
    const char *key = KEY_NAMES[k];
    const cJSON *entry = cJSON_GetObjectItemCaseSensitive(meta, key);
    if (!cJSON_IsObject(entry))
        return err_set(err, "%s: key '%s' missing or not an object", meta_path, key);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(entry, "dtype");
    if (!cJSON_IsString(t) || strcmp(t->valuestring, dtype) != 0)
        return err_set(err, "%s: key '%s': \"dtype\" must be \"%s\"", meta_path, key, dtype);
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(entry, "shape");
    if (!cJSON_IsArray(shape) || cJSON_GetArraySize(shape) != 1 ||
        !as_count(cJSON_GetArrayItem(shape, 0), n))
        return err_set(err, "%s: key '%s': \"shape\" must be [N] with N a non-negative integer",
                       meta_path, key);
    if (want >= 0 && *n != want)
        return err_set(err, "%s: key '%s': shape [%" PRId64 "] but the shard needs [%" PRId64 "]",
                       meta_path, key, *n, want);
    return 0;
}

// <key>.bin next to meta_path: exactly n little-endian 4-byte elements, into dst[0..n).
static int load_key(const char *meta_path, int k, int64_t n, void *dst, Err *err) {
    char dir[PATH_MAX], name[64], bin[PATH_MAX];
    const char *slash = strrchr(meta_path, '/'); // meta paths are root/.../meta.json
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - meta_path), meta_path);
    snprintf(name, sizeof name, "%s.bin", KEY_NAMES[k]);
    if (path_join(bin, sizeof bin, dir, name, err) != 0) return -1;
    char *raw;
    size_t len;
    if (fs_read_file(bin, &raw, &len, err) != 0)
        return err_prefix(err, "%s: key '%s'", meta_path, KEY_NAMES[k]);
    int rc = 0;
    if ((int64_t)len != 4 * n)
        rc =
            err_set(err, "%s: key '%s': shape [%" PRId64 "] needs %" PRId64 " bytes but %s has %zu",
                    meta_path, KEY_NAMES[k], n, 4 * n, bin, len);
    for (int64_t i = 0; rc == 0 && i < n; i++) {
        const unsigned char *b = (const unsigned char *)raw + 4 * i;
        uint32_t v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                     (uint32_t)b[3] << 24; // little-endian whatever the host
        memcpy((unsigned char *)dst + 4 * i, &v, 4);
    }
    free(raw);
    return rc;
}

// Every length of key k (n of them) is > 0 and they sum to total, the token count of key k-1.
static int check_lengths(const char *meta_path, int k, const int32_t *len, int64_t n, int64_t total,
                         Err *err) {
    int64_t sum = 0;
    for (int64_t i = 0; i < n; i++) {
        if (len[i] <= 0)
            return err_set(err,
                           "%s: key '%s': element %" PRId64 " = %" PRId32 " is not a length > 0",
                           meta_path, KEY_NAMES[k], i, len[i]);
        sum += len[i];
    }
    if (sum != total)
        return err_set(err, "%s: key '%s' sums to %" PRId64 " but key '%s' has %" PRId64 " tokens",
                       meta_path, KEY_NAMES[k], sum, KEY_NAMES[k - 1], total);
    return 0;
}

// One shard's arrays, loaded and checked against each other.
typedef struct {
    int64_t n[N_KEYS];
    int32_t *prompt, *prompt_len, *response, *response_len;
    float *reward; // GRPO
} ShardData;

static void shard_data_free(ShardData *d) {
    free(d->prompt);
    free(d->prompt_len);
    free(d->response);
    free(d->response_len);
    free(d->reward);
}

static int load_shard_data(const char *meta_path, const cJSON *meta, const ShardHead *h,
                           ShardData *d, Err *err) {
    int64_t N = h->n_records, NG = N * h->group_size;
    int grpo = h->kind == RECORDS_GRPO;
    const int64_t want[N_KEYS] = {-1, N, -1, NG, NG};
    void **dst[N_KEYS] = {(void **)&d->prompt, (void **)&d->prompt_len, (void **)&d->response,
                          (void **)&d->response_len, (void **)&d->reward};
    for (int k = 0; k < (grpo ? N_KEYS : KEY_REWARD); k++) {
        if (parse_key(meta_path, meta, k, k == KEY_REWARD ? "float32" : "int32", want[k], &d->n[k],
                      err) != 0)
            return -1;
        *dst[k] = malloc((size_t)(d->n[k] ? d->n[k] : 1) * 4);
        if (!*dst[k])
            return err_resource(err, "%s: out of memory for key '%s'", meta_path, KEY_NAMES[k]);
        if (load_key(meta_path, k, d->n[k], *dst[k], err) != 0) return -1;
    }
    if (check_lengths(meta_path, KEY_PROMPT_LEN, d->prompt_len, N, d->n[KEY_PROMPT], err) != 0)
        return -1;
    return check_lengths(meta_path, KEY_RESPONSE_LEN, d->response_len, NG, d->n[KEY_RESPONSE], err);
}

// Appends a loaded shard's records through append_record (the checks JSONL records get).
static int append_shard(RecordSet *rs, const char *meta_path, const ShardData *d, int64_t n_records,
                        int vocab_size, int skip_bad, Err *err) {
    int G = rs->group_size;
    Span *responses = malloc((size_t)G * sizeof *responses);
    if (!responses) return err_resource(err, "out of memory for a group of %d", G);
    int64_t p_at = 0, r_at = 0;
    int rc = 0;
    for (int64_t r = 0; rc == 0 && r < n_records; r++) {
        Span prompt = {d->prompt + p_at, d->prompt_len[r]};
        p_at += prompt.n;
        for (int j = 0; j < G; j++) {
            responses[j] = (Span){d->response + r_at, d->response_len[r * G + j]};
            r_at += responses[j].n;
        }
        Err e = {0};
        const float *rewards = d->reward ? d->reward + r * G : NULL;
        if (append_record(rs, "\"prompt\"", prompt, responses, rewards, vocab_size, &e) == 0)
            continue;
        err_prefix(&e, "%s: record %" PRId64, meta_path, r);
        if (!skip_bad || e.resource) {
            *err = e;
            rc = -1;
        } else if (rs->skipped++ == 0) {
            rs->first_skipped = e;
        }
    }
    free(responses);
    return rc;
}

static int open_shard(RecordSet *rs, const char *meta_path, int vocab_size, int skip_bad,
                      Err *err) {
    cJSON *meta;
    if (read_meta(meta_path, &meta, err) != 0) return -1;
    ShardHead h;
    ShardData d = {0};
    int rc = parse_head(meta_path, meta, &h, err);
    if (rc == 0) rc = check_head(meta_path, &h, rs, err);
    if (rc == 0) rc = load_shard_data(meta_path, meta, &h, &d, err);
    cJSON_Delete(meta);
    if (rc == 0) rc = append_shard(rs, meta_path, &d, h.n_records, vocab_size, skip_bad, err);
    shard_data_free(&d);
    return rc;
}

int records_probe(const char *root, int *is_records, RecordKind *kind, int *group_size, Err *err) {
    char **paths;
    int n;
    if (dataset_find_shards(root, &paths, &n, err) != 0) return -1;
    cJSON *meta;
    ShardHead h;
    int rc = read_meta(paths[0], &meta, err);
    if (rc == 0) {
        rc = parse_head(paths[0], meta, &h, err);
        cJSON_Delete(meta);
    }
    dataset_free_shards(paths, n);
    if (rc != 0) return -1;
    *is_records = h.is_records;
    if (h.is_records) {
        *kind = h.kind;
        *group_size = h.group_size;
    }
    return 0;
}

static int open_shards(RecordSet *rs, const char *root, int vocab_size, int skip_bad, Err *err) {
    char **paths;
    int n;
    if (dataset_find_shards(root, &paths, &n, err) != 0) return -1;
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++)
        rc = open_shard(rs, paths[i], vocab_size, skip_bad, err);
    rs->n_shards = n;
    dataset_free_shards(paths, n);
    return rc;
}

int records_open(RecordSet *rs, const char *path, RecordKind kind, int group_size, int vocab_size,
                 int skip_bad, Err *err) {
    records_init(rs, kind, group_size);
    int rc = check_group_size(rs, err);
    if (rc == 0 && fs_is_dir(path)) {
        rc = open_shards(rs, path, vocab_size, skip_bad, err);
    } else if (rc == 0) {
        Tokenizer *tok;
        rc = tokenizer_open("bytes", &tok, err);
        if (rc == 0) rc = records_parse_jsonl(rs, path, tok, vocab_size, skip_bad, err);
        tokenizer_free(tok);
    }
    if (rc == 0 && rs->n_records == 0)
        rc = err_set(err, "%s: no %s records (%" PRId64 " bad ones skipped)", path,
                     records_kind_name(kind), rs->skipped);
    if (rc != 0) records_free(rs);
    return rc;
}

// ------------------------------------------------------------ rows

int records_row(const RecordSet *rs, int64_t r, int j, int64_t window, int32_t *inputs,
                int32_t *targets, int32_t *loss_mask) {
    int64_t k = r * rs->group_size + j;
    const int32_t *P = rs->prompt + rs->prompt_off[r], *R = rs->response + rs->response_off[k];
    int64_t n_p = rs->prompt_off[r + 1] - rs->prompt_off[r];
    int64_t n_r = rs->response_off[k + 1] - rs->response_off[k];
    int64_t q = n_r < window ? n_r : window;
    int64_t p = n_p < window + 1 - q ? n_p : window + 1 - q;
    int64_t len = p + q - 1;
    const int32_t *tail = P + n_p - p; // s[t] = tail[t] for t < p, R[t - p] after
    for (int64_t t = 0; t < window; t++) {
        int in = t < len;
        inputs[t] = !in ? 0 : t < p ? tail[t] : R[t - p];
        targets[t] = !in ? 0 : t + 1 < p ? tail[t + 1] : R[t + 1 - p];
        loss_mask[t] = in && t + 1 >= p;
    }
    return (int)len;
}
