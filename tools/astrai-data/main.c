// astrai-data: prepares AstrAI "bin" datasets from text or SFT JSONL and
// inspects them (format: docs/data.md).
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/fsutil.h"
#include "data/dataset.h"
#include "data/shard_writer.h"
#include "data/tokenizer.h"

static const char USAGE[] =
    "usage: astrai-data prep --out DIR [--format text|sft-jsonl] [--tokenizer bytes]\n"
    "                        [--shard_tokens N] FILE...\n"
    "       astrai-data inspect DIR [--json] [--window_size W] [--stride S]\n"
    "\n"
    "prep     tokenizes FILEs (in the order given) into the bin shards DIR/shard_0000/...\n"
    "         text:      every file's bytes, concatenated  -> sequence\n"
    "         sft-jsonl: one {\"prompt\": P, \"response\": R} per line, P and R text or\n"
    "                    token-id arrays; loss on response tokens; positions restart\n"
    "                    at 0 for each record      -> sequence, loss_mask, position_ids\n"
    "         --shard_tokens N splits the stream into shards of N tokens (0: one shard).\n"
    "inspect  shards, keys, tokens, token id range, documents, loss fraction, windows.\n"
    "Exit status: 0 ok, 1 write failure, 2 bad input. Details: docs/data.md\n";

// ------------------------------------------------------------ flags

typedef struct {
    const char *name; // "--out"
    const char **value;
} StringFlag;

// Matches argv[*i] against flags as "--name VALUE" (advancing *i) or
// "--name=VALUE": 1 on a match, 0 if none matches, -1 if the value is missing.
static int match_flag(int argc, char **argv, int *i, const StringFlag *flags, int n_flags,
                      Err *err) {
    for (int f = 0; f < n_flags; f++) {
        size_t len = strlen(flags[f].name);
        if (strncmp(argv[*i], flags[f].name, len) != 0) continue;
        if (argv[*i][len] == '=') {
            *flags[f].value = argv[*i] + len + 1;
            return 1;
        }
        if (argv[*i][len] != '\0') continue;
        if (*i + 1 >= argc) return err_set(err, "%s needs a value", flags[f].name);
        *flags[f].value = argv[++*i];
        return 1;
    }
    return 0;
}

// An optional integer flag >= min; *out is left alone when text is NULL.
static int parse_count(const char *flag, const char *text, int64_t min, int64_t *out, Err *err) {
    if (!text) return 0;
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < min)
        return err_set(err, "%s: '%s' is not an integer >= %" PRId64, flag, text, min);
    *out = v;
    return 0;
}

// ------------------------------------------------------------ token stream

typedef struct {
    int32_t *seq, *loss_mask, *position_ids; // (n,) each; the last two only for sft
    int64_t n, cap;
    int sft;
} Stream;

static int stream_reserve(Stream *s, int64_t extra, Err *err) {
    if (s->n + extra <= s->cap) return 0;
    int64_t cap = s->cap ? s->cap : 4096;
    while (cap < s->n + extra)
        cap *= 2;
    int32_t **arrays[3] = {&s->seq, &s->loss_mask, &s->position_ids};
    for (int k = 0; k < (s->sft ? 3 : 1); k++) {
        int32_t *a = realloc(*arrays[k], (size_t)cap * sizeof *a);
        if (!a) return err_set(err, "out of memory for %" PRId64 " tokens", cap);
        *arrays[k] = a;
    }
    s->cap = cap;
    return 0;
}

// Appends ids with loss mask value `loss`; positions continue from `pos0`.
static int stream_append(Stream *s, const int32_t *ids, int64_t n, int loss, int64_t pos0,
                         Err *err) {
    if (stream_reserve(s, n, err) != 0) return -1;
    memcpy(s->seq + s->n, ids, (size_t)n * sizeof *ids);
    for (int64_t i = 0; s->sft && i < n; i++) {
        s->loss_mask[s->n + i] = loss;
        s->position_ids[s->n + i] = (int32_t)(pos0 + i);
    }
    s->n += n;
    return 0;
}

static void stream_free(Stream *s) {
    free(s->seq);
    free(s->loss_mask);
    free(s->position_ids);
}

// ------------------------------------------------------------ prep: inputs

static int prep_text_file(const char *path, const Tokenizer *tok, Stream *s, Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(path, &text, &len, err) != 0) return -1;
    int32_t *ids;
    int64_t n;
    int rc = tokenizer_encode(tok, text, len, &ids, &n, err);
    free(text);
    if (rc == 0) {
        rc = stream_append(s, ids, n, 0, 0, err);
        free(ids);
    }
    return rc;
}

// A record field: text (tokenized) or an array of token ids in [0, INT32_MAX].
static int field_ids(const cJSON *v, const char *name, const Tokenizer *tok, int32_t **ids,
                     int64_t *n, Err *err) {
    if (cJSON_IsString(v))
        return tokenizer_encode(tok, v->valuestring, strlen(v->valuestring), ids, n, err);
    if (!cJSON_IsArray(v))
        return err_set(err, "\"%s\" must be a string or an array of token ids", name);
    *n = cJSON_GetArraySize(v);
    *ids = malloc((size_t)(*n ? *n : 1) * sizeof **ids);
    if (!*ids) return err_set(err, "out of memory");
    int64_t i = 0;
    for (const cJSON *e = v->child; e; e = e->next, i++) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > INT32_MAX ||
            e->valuedouble != (double)(int32_t)e->valuedouble) {
            free(*ids);
            return err_set(err, "\"%s\"[%" PRId64 "] is not a token id (an integer in [0, %d])",
                           name, i, INT32_MAX);
        }
        (*ids)[i] = (int32_t)e->valuedouble;
    }
    return 0;
}

static int check_record_keys(const cJSON *rec, Err *err) {
    if (!cJSON_IsObject(rec)) return err_set(err, "a record must be a JSON object");
    for (const cJSON *e = rec->child; e; e = e->next)
        if (strcmp(e->string, "prompt") != 0 && strcmp(e->string, "response") != 0)
            return err_set(err, "unknown key \"%s\" (a record has \"prompt\" and \"response\")",
                           e->string);
    if (!cJSON_GetObjectItemCaseSensitive(rec, "response"))
        return err_set(err, "key \"response\" missing");
    return 0;
}

// One record = one document: prompt (loss 0) then response (loss 1),
// positions 0..len-1.
static int prep_sft_record(const cJSON *rec, const Tokenizer *tok, Stream *s, Err *err) {
    if (check_record_keys(rec, err) != 0) return -1;
    static const char *const FIELDS[2] = {"prompt", "response"};
    int64_t pos = 0;
    for (int f = 0; f < 2; f++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(rec, FIELDS[f]);
        if (!v) continue;
        int32_t *ids;
        int64_t n;
        if (field_ids(v, FIELDS[f], tok, &ids, &n, err) != 0) return -1;
        int rc = stream_append(s, ids, n, f == 1, pos, err);
        free(ids);
        if (rc != 0) return -1;
        pos += n;
    }
    if (pos == 0) return err_set(err, "the record has no tokens");
    if (pos > (int64_t)INT32_MAX + 1) return err_set(err, "the record has over 2^31 tokens");
    return 0;
}

static int is_blank(const char *p, const char *end) {
    for (; p < end; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r') return 0;
    return 1;
}

static int prep_sft_file(const char *path, const Tokenizer *tok, Stream *s, Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(path, &text, &len, err) != 0) return -1;
    int rc = 0;
    long line = 1;
    for (char *p = text; rc == 0 && p < text + len; line++) {
        char *eol = memchr(p, '\n', (size_t)(text + len - p));
        if (!eol) eol = text + len;
        if (!is_blank(p, eol)) {
            const char *end = NULL;
            cJSON *rec = cJSON_ParseWithLengthOpts(p, (size_t)(eol - p), &end, 0);
            if (!rec || !is_blank(end, eol))
                rc = err_set(err, "malformed JSON");
            else
                rc = prep_sft_record(rec, tok, s, err);
            cJSON_Delete(rec);
            if (rc != 0) err_prefix(err, "%s:%ld", path, line);
        }
        p = eol + 1;
    }
    free(text);
    return rc;
}

// ------------------------------------------------------------ prep: output

static int check_out_dir(const char *out, Err *err) {
    DIR *d = opendir(out);
    if (!d) {
        if (errno == ENOENT) return 0;
        return err_set(err, "--out %s: %s", out, strerror(errno));
    }
    struct dirent *e;
    int empty = 1;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) empty = 0;
    closedir(d);
    return empty ? 0 : err_set(err, "--out %s: exists and is not empty", out);
}

// DIR/shard_0000, ...: zero-padded to a common width so that the sorted
// path order of the reader is the writing order even past 10000 shards.
static int shard_dir(char *buf, size_t cap, const char *out, int64_t i, int64_t n_shards,
                     Err *err) {
    int width = 4;
    for (int64_t limit = 10000; n_shards > limit && width < 19; limit *= 10)
        width++;
    if (snprintf(buf, cap, "%s/shard_%0*" PRId64, out, width, i) >= (int)cap)
        return err_set(err, "--out %s: path too long", out);
    return 0;
}

// Splits the stream into shards of shard_tokens (0: one shard); on failure
// removes the shards already written so no partial dataset is left.
static int write_shards(const char *out, const Stream *s, int64_t shard_tokens, int64_t *n_shards,
                        Err *err) {
    int64_t per = shard_tokens ? shard_tokens : s->n;
    *n_shards = (s->n + per - 1) / per;
    char dir[PATH_MAX];
    for (int64_t i = 0; i < *n_shards; i++) {
        int64_t at = i * per, n = s->n - at < per ? s->n - at : per;
        ShardArray arrays[3] = {{"sequence", s->seq + at},
                                {"loss_mask", s->sft ? s->loss_mask + at : NULL},
                                {"position_ids", s->sft ? s->position_ids + at : NULL}};
        if (shard_dir(dir, sizeof dir, out, i, *n_shards, err) != 0) return -1;
        if (shard_write(dir, arrays, s->sft ? 3 : 1, n, err) == 0) continue;
        for (int64_t j = 0; j < i; j++) {
            Err ignored;
            shard_dir(dir, sizeof dir, out, j, *n_shards, &ignored);
            fs_remove_tree(dir, &ignored);
        }
        return -1;
    }
    return 0;
}

typedef struct {
    const char *out, *format, *tokenizer;
    int64_t shard_tokens;
    char **files;
    int n_files;
} PrepArgs;

static int parse_prep_args(int argc, char **argv, PrepArgs *a, Err *err) {
    *a = (PrepArgs){.format = "text", .tokenizer = "bytes"};
    a->files = calloc((size_t)argc + 1, sizeof *a->files);
    if (!a->files) return err_set(err, "out of memory");
    const char *shard_tokens = NULL;
    const StringFlag flags[] = {{"--out", &a->out},
                                {"--format", &a->format},
                                {"--tokenizer", &a->tokenizer},
                                {"--shard_tokens", &shard_tokens}};
    for (int i = 0; i < argc; i++) {
        int m = match_flag(argc, argv, &i, flags, 4, err);
        if (m < 0) return -1;
        if (m) continue;
        if (argv[i][0] == '-' && argv[i][1] != '\0')
            return err_set(err, "prep: unknown flag '%s'", argv[i]);
        a->files[a->n_files++] = argv[i];
    }
    if (parse_count("--shard_tokens", shard_tokens, 0, &a->shard_tokens, err) != 0) return -1;
    if (!a->out) return err_set(err, "prep: --out DIR is required");
    if (strcmp(a->format, "text") != 0 && strcmp(a->format, "sft-jsonl") != 0)
        return err_set(err, "--format: '%s' is not text or sft-jsonl", a->format);
    if (a->n_files == 0) return err_set(err, "prep: no input FILE given");
    return 0;
}

static int cmd_prep(int argc, char **argv) {
    Err err = {0};
    PrepArgs a;
    Tokenizer tok;
    Stream s = {0};
    int rc = parse_prep_args(argc, argv, &a, &err);
    if (rc == 0) rc = tokenizer_lookup(a.tokenizer, &tok, &err);
    if (rc == 0) rc = check_out_dir(a.out, &err);
    s.sft = rc == 0 && strcmp(a.format, "sft-jsonl") == 0;
    for (int i = 0; rc == 0 && i < a.n_files; i++)
        rc = s.sft ? prep_sft_file(a.files[i], &tok, &s, &err)
                   : prep_text_file(a.files[i], &tok, &s, &err);
    if (rc == 0 && s.n == 0) rc = err_set(&err, "prep: the input files hold no tokens");
    int status = rc == 0 ? 0 : EXIT_BAD_INPUT;
    int64_t n_shards = 0;
    if (rc == 0 && write_shards(a.out, &s, a.shard_tokens, &n_shards, &err) != 0) status = 1;
    if (status == 0)
        printf("wrote %" PRId64 " tokens in %" PRId64 " shard(s) to %s\n", s.n, n_shards, a.out);
    else
        fprintf(stderr, "astrai-data: %s\n", err.msg);
    stream_free(&s);
    free(a.files);
    return status;
}

// ------------------------------------------------------------ inspect

typedef struct {
    int64_t min_id, max_id;
    int64_t documents;               // -1 without position_ids
    int64_t loss_tokens;             // -1 without loss_mask
    int64_t window, stride, windows; // window 0: not asked for
} Stats;

// A document starts at t = 0 and wherever position_ids[t] <= position_ids[t-1]
// (the SFT packing rule of DESIGN §7).
static Stats dataset_stats(const Dataset *d, int64_t window, int64_t stride) {
    Stats st = {.documents = -1, .loss_tokens = -1, .window = window, .stride = stride};
    for (int64_t t = 0; t < d->n_tokens; t++) {
        if (t == 0 || d->sequence[t] < st.min_id) st.min_id = d->sequence[t];
        if (t == 0 || d->sequence[t] > st.max_id) st.max_id = d->sequence[t];
    }
    if (d->position_ids) {
        st.documents = d->n_tokens > 0;
        for (int64_t t = 1; t < d->n_tokens; t++)
            st.documents += d->position_ids[t] <= d->position_ids[t - 1];
    }
    if (d->loss_mask) {
        st.loss_tokens = 0;
        for (int64_t t = 0; t < d->n_tokens; t++)
            st.loss_tokens += d->loss_mask[t] != 0;
    }
    if (window) st.windows = dataset_num_windows(d->n_tokens, window, stride);
    return st;
}

static void add_count_or_null(cJSON *o, const char *key, int64_t v, int present) {
    if (present)
        cJSON_AddNumberToObject(o, key, (double)v);
    else
        cJSON_AddNullToObject(o, key);
}

static void print_json(const char *root, const Dataset *d, const Stats *st) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "root", root);
    cJSON_AddNumberToObject(o, "shards", d->n_shards);
    cJSON *keys = cJSON_AddArrayToObject(o, "keys");
    cJSON_AddItemToArray(keys, cJSON_CreateString("sequence"));
    if (d->loss_mask) cJSON_AddItemToArray(keys, cJSON_CreateString("loss_mask"));
    if (d->position_ids) cJSON_AddItemToArray(keys, cJSON_CreateString("position_ids"));
    cJSON_AddNumberToObject(o, "tokens", (double)d->n_tokens);
    add_count_or_null(o, "min_token_id", st->min_id, d->n_tokens > 0);
    add_count_or_null(o, "max_token_id", st->max_id, d->n_tokens > 0);
    add_count_or_null(o, "documents", st->documents, st->documents >= 0);
    add_count_or_null(o, "loss_tokens", st->loss_tokens, st->loss_tokens >= 0);
    if (st->loss_tokens >= 0 && d->n_tokens > 0)
        cJSON_AddNumberToObject(o, "loss_fraction", (double)st->loss_tokens / (double)d->n_tokens);
    else
        cJSON_AddNullToObject(o, "loss_fraction");
    if (st->window) {
        cJSON_AddNumberToObject(o, "window_size", (double)st->window);
        cJSON_AddNumberToObject(o, "stride", (double)st->stride);
        cJSON_AddNumberToObject(o, "windows", (double)st->windows);
    }
    char *text = cJSON_Print(o);
    if (text) puts(text);
    free(text);
    cJSON_Delete(o);
}

static void print_text(const char *root, const Dataset *d, const Stats *st) {
    printf("root: %s\nshards: %d\nkeys: sequence%s%s\ntokens: %" PRId64 "\n", root, d->n_shards,
           d->loss_mask ? " loss_mask" : "", d->position_ids ? " position_ids" : "", d->n_tokens);
    if (d->n_tokens > 0) printf("token ids: %" PRId64 " .. %" PRId64 "\n", st->min_id, st->max_id);
    if (st->documents >= 0) printf("documents: %" PRId64 "\n", st->documents);
    if (st->loss_tokens >= 0 && d->n_tokens > 0)
        printf("loss tokens: %" PRId64 " (%.4f of all)\n", st->loss_tokens,
               (double)st->loss_tokens / (double)d->n_tokens);
    if (st->window)
        printf("windows: %" PRId64 " (window_size %" PRId64 ", stride %" PRId64 ")\n", st->windows,
               st->window, st->stride);
}

static int cmd_inspect(int argc, char **argv) {
    Err err = {0};
    const char *root = NULL, *window_text = NULL, *stride_text = NULL;
    int as_json = 0, rc = 0;
    const StringFlag flags[] = {{"--window_size", &window_text}, {"--stride", &stride_text}};
    for (int i = 0; rc == 0 && i < argc; i++) {
        int m = match_flag(argc, argv, &i, flags, 2, &err);
        if (m < 0)
            rc = -1;
        else if (m)
            continue;
        else if (strcmp(argv[i], "--json") == 0)
            as_json = 1;
        else if (argv[i][0] == '-')
            rc = err_set(&err, "inspect: unknown flag '%s'", argv[i]);
        else if (root)
            rc = err_set(&err, "inspect: more than one DIR ('%s')", argv[i]);
        else
            root = argv[i];
    }
    int64_t window = 0, stride = 0;
    if (rc == 0) rc = parse_count("--window_size", window_text, 1, &window, &err);
    if (rc == 0) rc = parse_count("--stride", stride_text, 1, &stride, &err);
    if (rc == 0 && stride && !window) rc = err_set(&err, "inspect: --stride needs --window_size");
    if (rc == 0 && !root) rc = err_set(&err, "inspect: no DIR given");
    Dataset d;
    if (rc == 0) rc = dataset_open(&d, root, 0, &err);
    if (rc != 0) {
        fprintf(stderr, "astrai-data: %s\n", err.msg);
        return EXIT_BAD_INPUT;
    }
    Stats st = dataset_stats(&d, window, stride ? stride : window);
    if (as_json)
        print_json(root, &d, &st);
    else
        print_text(root, &d, &st);
    dataset_close(&d);
    return 0;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0 ||
            (i == 1 && strcmp(argv[i], "help") == 0)) {
            fputs(USAGE, stdout);
            return 0;
        }
    }
    if (argc >= 2 && strcmp(argv[1], "prep") == 0) return cmd_prep(argc - 2, argv + 2);
    if (argc >= 2 && strcmp(argv[1], "inspect") == 0) return cmd_inspect(argc - 2, argv + 2);
    fprintf(stderr, "astrai-data: %s%s%s\n%s", argc >= 2 ? "unknown command '" : "no command",
            argc >= 2 ? argv[1] : "", argc >= 2 ? "'" : "", USAGE);
    return EXIT_BAD_INPUT;
}
