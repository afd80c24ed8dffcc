// astrai-data: prepares AstrAI "bin" datasets from text or SFT JSONL, and DPO/GRPO record
// shards from their JSONL records, and inspects both (format: docs/data.md).
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "common/error.h"
#include "common/flags.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "data/chat_template.h"
#include "data/conversation.h"
#include "data/dataset.h"
#include "data/jsonl.h"
#include "data/records.h"
#include "data/shard_writer.h"
#include "data/tokenizer.h"

static const char USAGE[] =
    "usage: astrai-data prep --out DIR [--format text|sft-jsonl|dpo-jsonl|grpo-jsonl]\n"
    "                        [--tokenizer bytes|PATH] [--shard_tokens N] FILE...\n"
    "       astrai-data prep --out DIR --format dpo-jsonl|grpo-jsonl [--group_size G]\n"
    "                        [--skip_bad_records] [--vocab_size V] [--shard_records N] FILE...\n"
    "       astrai-data inspect DIR [--json] [--window_size W] [--stride S]\n"
    "       astrai-data decode --tokenizer bytes|PATH [--skip_special_tokens]\n"
    "                          [IDS_FILE|-|--dataset DIR]\n"
    "\n"
    "prep     tokenizes FILEs (in the order given) into the shards DIR/shard_0000/...\n"
    "         text:       every file's bytes, concatenated  -> sequence\n"
    "         sft-jsonl:  one {\"prompt\": P, \"response\": R} per line; loss on response\n"
    "                     tokens; positions restart at 0 for each record; or one\n"
    "                     {\"messages\": [{\"role\", \"content\"}...]} rendered with the\n"
    "                     tokenizer's chat template (--chat_template FILE instead); loss\n"
    "                     on the assistant replies\n"
    "                                                -> sequence, loss_mask, position_ids\n"
    "         dpo-jsonl:  one {\"prompt\"|\"input\": P, \"chosen\": C, \"rejected\": R} per line\n"
    "         grpo-jsonl: one {\"prompt\": P, \"responses\": [G texts], \"rewards\": [G numbers]}\n"
    "                     per line (--group_size G, default 4)\n"
    "                                                -> record shards for --train_type dpo|grpo\n"
    "         A text field is a string, an array of token ids or a conversation list.\n"
    "         --shard_tokens N splits the token stream into shards of N tokens, --shard_records N\n"
    "         the records into shards of N records (0: one shard). --skip_bad_records skips and\n"
    "         counts bad records instead of failing; --vocab_size V refuses token ids >= V.\n"
    "         A chat template's rendering has budgets: --template_max_iterations N (loop\n"
    "         iterations, default 10^7), --template_max_bytes N (output and any one string,\n"
    "         64 MiB), --template_max_memory N (values held, 1 GiB), --template_max_ops N\n"
    "         (expressions and iterations, 10^8); past one: exit 2 naming it and the line.\n"
    "inspect  shards, keys, tokens, token id range, documents, loss fraction, windows; for a\n"
    "         record set: format, group size, records, token counts, lengths, rewards, and\n"
    "         with --window_size the rows it truncates.\n"
    "decode   turns token ids (whitespace-separated in IDS_FILE or standard input, or a\n"
    "         dataset's sequence) back into text on standard output.\n"
    "--tokenizer PATH: a Hugging Face tokenizer.json or the directory holding it.\n"
    "Exit status: 0 ok, 1 write failure, 2 bad input. Details: docs/data.md\n";

// ------------------------------------------------------------ flags

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
        if (!a) return err_resource(err, "out of memory for %" PRId64 " tokens", cap);
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
    if (rc != 0) return err_prefix(err, "%s", path);
    rc = stream_append(s, ids, n, 0, 0, err);
    free(ids);
    return rc;
}

// A record is {"prompt", "response"} or a conversation {"messages"}.
static int check_record_keys(const cJSON *rec, Err *err) {
    if (!cJSON_IsObject(rec)) return err_set(err, "a record must be a JSON object");
    int conversation = cJSON_GetObjectItemCaseSensitive(rec, "messages") != NULL;
    for (const cJSON *e = rec->child; e; e = e->next) {
        if (conversation ? strcmp(e->string, "messages") == 0
                         : strcmp(e->string, "prompt") == 0 || strcmp(e->string, "response") == 0)
            continue;
        if (conversation)
            return err_set(err,
                           "key \"%s\" beside \"messages\" (a conversation record has only "
                           "\"messages\")",
                           e->string);
        return err_set(err,
                       "unknown key \"%s\" (a record has \"prompt\" and \"response\", or "
                       "\"messages\")",
                       e->string);
    }
    if (!conversation && !cJSON_GetObjectItemCaseSensitive(rec, "response"))
        return err_set(err, "key \"response\" missing");
    return 0;
}

typedef struct {
    const Tokenizer *tok;
    Stream *s;
    const char *chat_template_file; // --chat_template, or NULL: the tokenizer's
    ChatTemplate *chat_template;    // parsed at the file's first conversation
    ChatVars vars;
} SftCtx;

static int check_document_length(int64_t n, Err *err) {
    if (n == 0) return err_set(err, "the record has no tokens");
    if (n > (int64_t)INT32_MAX + 1) return err_set(err, "the record has over 2^31 tokens");
    return 0;
}

// text[0..n) tokenized and appended with loss mask `loss`, positions from *pos on.
static int append_text(const SftCtx *ctx, const char *text, size_t n, int loss, int64_t *pos,
                       Err *err) {
    if (n == 0) return 0;
    int32_t *ids;
    int64_t n_ids;
    if (tokenizer_encode(ctx->tok, text, n, &ids, &n_ids, err) != 0) return -1;
    int rc = stream_append(ctx->s, ids, n_ids, loss, *pos, err);
    free(ids);
    *pos += n_ids;
    return rc;
}

// The template: --chat_template's file, else tokenizer_config.json's "chat_template".
static int load_chat_template(SftCtx *ctx, Err *err) {
    if (ctx->chat_template) return 0;
    return conversation_template(ctx->tok, ctx->chat_template_file, &ctx->chat_template, err);
}

// A conversation = one document: the template's rendering, tokenized segment by segment
// (each assistant span and each stretch between them on its own), loss on the assistant
// spans of chat_template_assistant_spans only.
static int prep_conversation(SftCtx *ctx, const cJSON *messages, Err *err) {
    ChatMessage *msgs = NULL;
    int n = 0;
    if (load_chat_template(ctx, err) != 0 || conversation_messages(messages, &msgs, &n, err) != 0)
        return -1;
    char *text;
    size_t len;
    ChatSpan *spans;
    int n_spans;
    int rc = chat_template_assistant_spans(ctx->chat_template, msgs, n, &ctx->vars, &text, &len,
                                           &spans, &n_spans, err);
    free(msgs);
    if (rc != 0) return -1;
    int64_t pos = 0;
    size_t at = 0; // the end of the last span
    for (int k = 0; rc == 0 && k <= n_spans; k++) {
        size_t begin = k < n_spans ? spans[k].begin : len;
        rc = append_text(ctx, text + at, begin - at, 0, &pos, err);
        if (rc == 0 && k < n_spans) {
            rc = append_text(ctx, text + begin, spans[k].end - begin, 1, &pos, err);
            at = spans[k].end;
        }
    }
    free(text);
    free(spans);
    return rc != 0 ? -1 : check_document_length(pos, err);
}

// One record = one document: prompt (loss 0) then response (loss 1), or a conversation;
// positions 0..len-1 (a jsonl_each callback).
static int prep_sft_record(const cJSON *rec, void *ctx_, Err *err) {
    SftCtx *ctx = ctx_;
    if (check_record_keys(rec, err) != 0) return -1;
    const cJSON *messages = cJSON_GetObjectItemCaseSensitive(rec, "messages");
    if (messages) return prep_conversation(ctx, messages, err);
    static const char *const FIELDS[2] = {"prompt", "response"};
    static const char *const WHERE[2] = {"\"prompt\"", "\"response\""};
    int64_t pos = 0;
    for (int f = 0; f < 2; f++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(rec, FIELDS[f]);
        if (!v) continue;
        int32_t *ids;
        int64_t n;
        if (jsonl_field_ids(v, WHERE[f], ctx->tok, &ids, &n, err) != 0) return -1;
        int rc = stream_append(ctx->s, ids, n, f == 1, pos, err);
        free(ids);
        if (rc != 0) return -1;
        pos += n;
    }
    return check_document_length(pos, err);
}

static int prep_sft_file(const char *path, const Tokenizer *tok, const char *chat_template,
                         const ChatLimits *limits, Stream *s, Err *err) {
    SftCtx ctx = {.tok = tok, .s = s, .chat_template_file = chat_template};
    if (conversation_vars(tok, &ctx.vars, err) != 0) return -1;
    ctx.vars.limits = limits;
    int rc = jsonl_each(path, prep_sft_record, &ctx, NULL, NULL, err);
    chat_template_free(ctx.chat_template);
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

// Writes the part [first, first+n) of what ctx holds as the shard directory dir.
typedef int (*PartWriter)(const void *ctx, int64_t first, int64_t n, const char *dir, Err *err);

// Splits `total` units (tokens or records) into shards of `per` (0: one shard); on failure
// removes the shards already written so no partial dataset is left.
static int write_shards(const char *out, int64_t total, int64_t per, PartWriter write,
                        const void *ctx, int64_t *n_shards, Err *err) {
    if (per == 0) per = total;
    *n_shards = (total + per - 1) / per;
    char dir[PATH_MAX];
    for (int64_t i = 0; i < *n_shards; i++) {
        int64_t at = i * per, n = total - at < per ? total - at : per;
        if (shard_dir(dir, sizeof dir, out, i, *n_shards, err) != 0) return -1;
        if (write(ctx, at, n, dir, err) == 0) continue;
        for (int64_t j = 0; j < i; j++) {
            Err ignored;
            shard_dir(dir, sizeof dir, out, j, *n_shards, &ignored);
            fs_remove_tree(dir, &ignored);
        }
        return -1;
    }
    return 0;
}

static int write_stream_part(const void *ctx, int64_t at, int64_t n, const char *dir, Err *err) {
    const Stream *s = ctx;
    ShardArray arrays[3] = {{"sequence", s->seq + at},
                            {"loss_mask", s->sft ? s->loss_mask + at : NULL},
                            {"position_ids", s->sft ? s->position_ids + at : NULL}};
    return shard_write(dir, arrays, s->sft ? 3 : 1, n, err);
}

static int write_records_part(const void *ctx, int64_t first, int64_t n, const char *dir,
                              Err *err) {
    return records_write_shard(ctx, first, n, dir, err);
}

typedef struct {
    const char *out, *format, *tokenizer;
    const char *chat_template; // --chat_template FILE (sft-jsonl), or NULL
    int64_t shard_tokens, shard_records, group_size, vocab_size;
    int is_records; // dpo-jsonl or grpo-jsonl
    RecordKind kind;
    int skip_bad;
    ChatLimits limits; // --template_max_*: the chat template's budgets (0: the default)
    char **files;
    int n_files;
} PrepArgs;

// The flags that only some formats take: given to another, they are refused.
static int check_format_flags(const PrepArgs *a, const char *const given[4], Err *err) {
    static const char RECORDS[] = "dpo-jsonl or grpo-jsonl";
    const struct {
        const char *flag;
        int given, allowed;
        const char *formats;
    } rules[] = {
        {"--shard_tokens", given[0] != NULL, !a->is_records, "text or sft-jsonl"},
        {"--shard_records", given[1] != NULL, a->is_records, RECORDS},
        {"--group_size", given[2] != NULL, a->is_records && a->kind == RECORDS_GRPO, "grpo-jsonl"},
        {"--vocab_size", given[3] != NULL, a->is_records, RECORDS},
        {"--skip_bad_records", a->skip_bad, a->is_records, RECORDS},
        {"--chat_template", a->chat_template != NULL, !strcmp(a->format, "sft-jsonl"), "sft-jsonl"},
    };
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++)
        if (rules[i].given && !rules[i].allowed)
            return err_set(err, "%s applies to --format %s, not %s", rules[i].flag,
                           rules[i].formats, a->format);
    return 0;
}

static int parse_format(PrepArgs *a, Err *err) {
    if (strcmp(a->format, "dpo-jsonl") == 0 || strcmp(a->format, "grpo-jsonl") == 0) {
        a->is_records = 1;
        a->kind = a->format[0] == 'd' ? RECORDS_DPO : RECORDS_GRPO;
        return 0;
    }
    if (strcmp(a->format, "text") != 0 && strcmp(a->format, "sft-jsonl") != 0)
        return err_set(err, "--format: '%s' is not text, sft-jsonl, dpo-jsonl or grpo-jsonl",
                       a->format);
    return 0;
}

// --template_max_iterations / _bytes / _memory / _ops into limits (absent: 0, the default).
static int parse_budgets(const char *const text[4], ChatLimits *limits, Err *err) {
    static const char *const NAMES[4] = {"--template_max_iterations", "--template_max_bytes",
                                         "--template_max_memory", "--template_max_ops"};
    long *fields[4] = {&limits->max_iterations, &limits->max_bytes, &limits->max_memory,
                       &limits->max_ops};
    for (int i = 0; i < 4; i++) {
        int64_t v = 0;
        if (parse_count(NAMES[i], text[i], 1, &v, err) != 0) return -1;
        *fields[i] = (long)v;
    }
    return 0;
}

static int parse_prep_args(int argc, char **argv, PrepArgs *a, Err *err) {
    *a = (PrepArgs){.format = "text", .tokenizer = "bytes", .group_size = 4};
    a->files = calloc((size_t)argc + 1, sizeof *a->files);
    if (!a->files) return err_resource(err, "prep: out of memory for %d arguments", argc);
    const char *given[4] = {NULL};  // shard_tokens, shard_records, group_size, vocab_size
    const char *budget[4] = {NULL}; // template_max_iterations, _bytes, _memory, _ops
    bool skip_bad = false;
    const Flag flags[] = {
        {.name = "out", .kind = FLAG_STRING, .target = &a->out},
        {.name = "format", .kind = FLAG_STRING, .target = &a->format},
        {.name = "tokenizer", .kind = FLAG_STRING, .target = &a->tokenizer},
        {.name = "shard_tokens", .kind = FLAG_STRING, .target = &given[0]},
        {.name = "shard_records", .kind = FLAG_STRING, .target = &given[1]},
        {.name = "group_size", .kind = FLAG_STRING, .target = &given[2]},
        {.name = "vocab_size", .kind = FLAG_STRING, .target = &given[3]},
        {.name = "skip_bad_records", .kind = FLAG_SWITCH, .target = &skip_bad},
        {.name = "chat_template", .kind = FLAG_STRING, .target = &a->chat_template},
        {.name = "template_max_iterations", .kind = FLAG_STRING, .target = &budget[0]},
        {.name = "template_max_bytes", .kind = FLAG_STRING, .target = &budget[1]},
        {.name = "template_max_memory", .kind = FLAG_STRING, .target = &budget[2]},
        {.name = "template_max_ops", .kind = FLAG_STRING, .target = &budget[3]}};
    if (flags_parse(flags, sizeof flags / sizeof *flags, argc, argv, &a->n_files, err))
        return err_prefix(err, "prep");
    memcpy(a->files, argv, (size_t)a->n_files * sizeof *argv);
    a->skip_bad = skip_bad;
    if (parse_count("--shard_tokens", given[0], 0, &a->shard_tokens, err) != 0 ||
        parse_count("--shard_records", given[1], 0, &a->shard_records, err) != 0 ||
        parse_count("--group_size", given[2], 1, &a->group_size, err) != 0 ||
        parse_count("--vocab_size", given[3], 1, &a->vocab_size, err) != 0 ||
        parse_budgets(budget, &a->limits, err) != 0)
        return -1;
    if (a->group_size > INT_MAX || a->vocab_size > INT_MAX)
        return err_set(err, "--%s: %" PRId64 " is too large",
                       a->group_size > INT_MAX ? "group_size" : "vocab_size",
                       a->group_size > INT_MAX ? a->group_size : a->vocab_size);
    if (!a->out) return err_set(err, "prep: --out DIR is required");
    if (parse_format(a, err) != 0 || check_format_flags(a, given, err) != 0) return -1;
    if (a->n_files == 0) return err_set(err, "prep: no input FILE given");
    return 0;
}

// text / sft-jsonl: one token stream, cut into shards of --shard_tokens.
static int prep_tokens(const PrepArgs *a, const Tokenizer *tok, Err *err) {
    Stream s = {.sft = strcmp(a->format, "sft-jsonl") == 0};
    int rc = 0;
    for (int i = 0; rc == 0 && i < a->n_files; i++)
        rc = s.sft ? prep_sft_file(a->files[i], tok, a->chat_template, &a->limits, &s, err)
                   : prep_text_file(a->files[i], tok, &s, err);
    if (rc == 0 && s.n == 0) rc = err_set(err, "prep: the input files hold no tokens");
    int status = rc == 0 ? 0 : err_exit_status(err);
    int64_t n_shards = 0;
    if (rc == 0 &&
        write_shards(a->out, s.n, a->shard_tokens, write_stream_part, &s, &n_shards, err) != 0)
        status = 1;
    if (status == 0)
        printf("wrote %" PRId64 " tokens in %" PRId64 " shard(s) to %s\n", s.n, n_shards, a->out);
    stream_free(&s);
    return status;
}

// dpo-jsonl / grpo-jsonl: the records of every file, cut into shards of --shard_records.
static int prep_records(const PrepArgs *a, const Tokenizer *tok, Err *err) {
    RecordSet rs;
    records_init(&rs, a->kind, (int)a->group_size);
    int rc = 0;
    for (int i = 0; rc == 0 && i < a->n_files; i++)
        rc = records_parse_jsonl(&rs, a->files[i], tok, (int)a->vocab_size, a->skip_bad, err);
    if (rc == 0 && rs.n_records == 0)
        rc = err_set(err, "prep: the input files hold no records (%" PRId64 " bad ones skipped)",
                     rs.skipped);
    int status = rc == 0 ? 0 : err_exit_status(err);
    int64_t n_shards = 0;
    if (rc == 0 && write_shards(a->out, rs.n_records, a->shard_records, write_records_part, &rs,
                                &n_shards, err) != 0)
        status = 1;
    if (status == 0 && rs.skipped)
        fprintf(stderr, "astrai-data: warning: skipped %" PRId64 " bad record(s); the first: %s\n",
                rs.skipped, rs.first_skipped.msg);
    if (status == 0)
        printf("wrote %" PRId64 " %s records (%" PRId64 " skipped) in %" PRId64 " shard(s) to %s\n",
               rs.n_records, records_kind_name(rs.kind), rs.skipped, n_shards, a->out);
    records_free(&rs);
    return status;
}

static int cmd_prep(int argc, char **argv) {
    Err err = {0};
    PrepArgs a;
    Tokenizer *tok = NULL;
    int rc = parse_prep_args(argc, argv, &a, &err);
    if (rc == 0 && tokenizer_open(a.tokenizer, &tok, &err) != 0)
        rc = err_prefix(&err, "--tokenizer");
    if (rc == 0) rc = check_out_dir(a.out, &err);
    int status = rc != 0        ? err_exit_status(&err)
                 : a.is_records ? prep_records(&a, tok, &err)
                                : prep_tokens(&a, tok, &err);
    if (status != 0) fprintf(stderr, "astrai-data: %s\n", err.msg);
    tokenizer_free(tok);
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
// (the SFT packing rule of docs/design.md §7).
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

static int inspect_tokens(const char *root, int64_t window, int64_t stride, int as_json, Err *err) {
    Dataset d;
    if (dataset_open(&d, root, 0, err) != 0) return -1;
    Stats st = dataset_stats(&d, window, stride ? stride : window);
    if (as_json)
        print_json(root, &d, &st);
    else
        print_text(root, &d, &st);
    dataset_close(&d);
    return 0;
}

// ------------------------------------------------------------ inspect: record sets

typedef struct {
    int64_t min, max, sum;
} Range;

static void range_add(Range *r, int64_t v, int first) {
    if (first || v < r->min) r->min = v;
    if (first || v > r->max) r->max = v;
    r->sum += v;
}

typedef struct {
    Range prompt_len, response_len, id;
    float min_reward, max_reward;    // GRPO
    int64_t window, rows, truncated; // window 0: not asked for
} RecordStats;

// A row is truncated when prompt and response do not fit window + 1 tokens (records_row).
static RecordStats record_stats(const RecordSet *rs, int64_t window) {
    RecordStats st = {.window = window, .rows = rs->n_records * rs->group_size};
    int64_t G = rs->group_size, n_p = rs->prompt_off[rs->n_records];
    int64_t n_r = rs->response_off[st.rows];
    for (int64_t r = 0; r < rs->n_records; r++) {
        int64_t p = rs->prompt_off[r + 1] - rs->prompt_off[r];
        range_add(&st.prompt_len, p, r == 0);
        for (int64_t k = r * G; k < (r + 1) * G; k++) {
            int64_t q = rs->response_off[k + 1] - rs->response_off[k];
            range_add(&st.response_len, q, k == 0);
            st.truncated += window && p + q > window + 1;
            if (!rs->reward) continue;
            if (k == 0 || rs->reward[k] < st.min_reward) st.min_reward = rs->reward[k];
            if (k == 0 || rs->reward[k] > st.max_reward) st.max_reward = rs->reward[k];
        }
    }
    for (int64_t t = 0; t < n_p + n_r; t++)
        range_add(&st.id, t < n_p ? rs->prompt[t] : rs->response[t - n_p], t == 0);
    return st;
}

static void print_records_json(const char *root, const RecordSet *rs, const RecordStats *st) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "root", root);
    cJSON_AddNumberToObject(o, "shards", rs->n_shards);
    cJSON_AddStringToObject(o, "format", records_kind_name(rs->kind));
    cJSON_AddNumberToObject(o, "group_size", rs->group_size);
    cJSON_AddNumberToObject(o, "records", (double)rs->n_records);
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)st->prompt_len.sum);
    cJSON_AddNumberToObject(o, "min_prompt_len", (double)st->prompt_len.min);
    cJSON_AddNumberToObject(o, "max_prompt_len", (double)st->prompt_len.max);
    cJSON_AddNumberToObject(o, "response_tokens", (double)st->response_len.sum);
    cJSON_AddNumberToObject(o, "min_response_len", (double)st->response_len.min);
    cJSON_AddNumberToObject(o, "max_response_len", (double)st->response_len.max);
    cJSON_AddNumberToObject(o, "min_token_id", (double)st->id.min);
    cJSON_AddNumberToObject(o, "max_token_id", (double)st->id.max);
    if (rs->reward) {
        cJSON_AddNumberToObject(o, "min_reward", st->min_reward);
        cJSON_AddNumberToObject(o, "max_reward", st->max_reward);
    } else {
        cJSON_AddNullToObject(o, "min_reward");
        cJSON_AddNullToObject(o, "max_reward");
    }
    if (st->window) {
        cJSON_AddNumberToObject(o, "window_size", (double)st->window);
        cJSON_AddNumberToObject(o, "rows", (double)st->rows);
        cJSON_AddNumberToObject(o, "truncated_rows", (double)st->truncated);
    }
    char *text = cJSON_Print(o);
    if (text) puts(text);
    free(text);
    cJSON_Delete(o);
}

static void print_records_text(const char *root, const RecordSet *rs, const RecordStats *st) {
    printf("root: %s\nshards: %d\nformat: %s (group_size %d)\nrecords: %" PRId64 "\n", root,
           rs->n_shards, records_kind_name(rs->kind), rs->group_size, rs->n_records);
    printf("prompt tokens: %" PRId64 " (lengths %" PRId64 " .. %" PRId64 ")\n", st->prompt_len.sum,
           st->prompt_len.min, st->prompt_len.max);
    printf("response tokens: %" PRId64 " (lengths %" PRId64 " .. %" PRId64 ")\n",
           st->response_len.sum, st->response_len.min, st->response_len.max);
    printf("token ids: %" PRId64 " .. %" PRId64 "\n", st->id.min, st->id.max);
    if (rs->reward) printf("rewards: %g .. %g\n", st->min_reward, st->max_reward);
    if (st->window)
        printf("rows truncated: %" PRId64 " of %" PRId64 " (window_size %" PRId64 ")\n",
               st->truncated, st->rows, st->window);
}

static int inspect_records(const char *root, RecordKind kind, int group_size, int64_t window,
                           int as_json, Err *err) {
    RecordSet rs;
    if (records_open(&rs, root, kind, group_size, 0, 0, err) != 0) return -1;
    RecordStats st = record_stats(&rs, window);
    if (as_json)
        print_records_json(root, &rs, &st);
    else
        print_records_text(root, &rs, &st);
    records_free(&rs);
    return 0;
}

static int cmd_inspect(int argc, char **argv) {
    Err err = {0};
    const char *root = NULL, *window_text = NULL, *stride_text = NULL;
    int rc = 0;
    bool as_json = false;
    int n_dirs = 0;
    const Flag flags[] = {{.name = "window_size", .kind = FLAG_STRING, .target = &window_text},
                          {.name = "stride", .kind = FLAG_STRING, .target = &stride_text},
                          {.name = "json", .kind = FLAG_SWITCH, .target = &as_json}};
    if (flags_parse(flags, sizeof flags / sizeof *flags, argc, argv, &n_dirs, &err))
        rc = err_prefix(&err, "inspect");
    else if (n_dirs > 1)
        rc = err_set(&err, "inspect: more than one DIR ('%s')", argv[1]);
    else if (n_dirs == 1)
        root = argv[0];
    int64_t window = 0, stride = 0;
    if (rc == 0) rc = parse_count("--window_size", window_text, 1, &window, &err);
    if (rc == 0) rc = parse_count("--stride", stride_text, 1, &stride, &err);
    if (rc == 0 && stride && !window) rc = err_set(&err, "inspect: --stride needs --window_size");
    if (rc == 0 && !root) rc = err_set(&err, "inspect: no DIR given");
    int is_records = 0, group_size = 0;
    RecordKind kind = RECORDS_DPO;
    if (rc == 0) rc = records_probe(root, &is_records, &kind, &group_size, &err);
    if (rc == 0 && is_records && stride)
        rc = err_set(&err, "inspect: --stride applies to token datasets, not the %s record set %s",
                     records_kind_name(kind), root);
    if (rc == 0)
        rc = is_records ? inspect_records(root, kind, group_size, window, as_json, &err)
                        : inspect_tokens(root, window, stride, as_json, &err);
    if (rc == 0) return 0;
    fprintf(stderr, "astrai-data: %s\n", err.msg);
    return err_exit_status(&err);
}

// ------------------------------------------------------------ decode

// The whitespace-separated ids of text into *ids (malloc'd), each an integer in [0, 2^31).
static int parse_ids(const char *name, const char *text, int32_t **ids, int64_t *n, Err *err) {
    size_t cap = 0;
    *ids = NULL;
    *n = 0;
    for (const char *p = text;;) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
            p++;
        if (!*p) return 0;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX ||
            (*end && *end != ' ' && *end != '\t' && *end != '\n' && *end != '\r'))
            return err_set(err, "%s: id %" PRId64 " ('%.20s') is not an integer in [0, 2^31)", name,
                           *n, p);
        if (buf_reserve(ids, &cap, (size_t)*n + 1, sizeof **ids) != 0)
            return err_resource(err, "%s: out of memory for %" PRId64 " ids", name, *n);
        (*ids)[(*n)++] = (int32_t)v;
        p = end;
    }
}

// The ids of FILE ("-": standard input).
static int read_ids(const char *path, int32_t **ids, int64_t *n, Err *err) {
    Buf in = {0};
    int rc = 0;
    if (strcmp(path, "-") == 0) {
        char chunk[65536];
        size_t got;
        while (rc == 0 && (got = fread(chunk, 1, sizeof chunk, stdin)) > 0)
            if (buf_append(&in, chunk, got) != 0) rc = err_resource(err, "stdin: out of memory");
        if (rc == 0 && ferror(stdin)) rc = err_errno(err, errno, "stdin");
    } else {
        rc = fs_read_file(path, &in.data, &in.len, err);
    }
    if (rc == 0) rc = parse_ids(path, in.data ? in.data : "", ids, n, err);
    if (rc != 0) {
        free(*ids);
        *ids = NULL;
    }
    buf_free(&in);
    return rc;
}

// The ids of a dataset's `sequence`.
static int dataset_ids(const char *root, int32_t **ids, int64_t *n, Err *err) {
    Dataset d;
    if (dataset_open(&d, root, 0, err) != 0) return -1;
    *n = d.n_tokens;
    *ids = malloc((size_t)(d.n_tokens ? d.n_tokens : 1) * sizeof **ids);
    int rc = *ids ? 0 : err_resource(err, "%s: out of memory for %" PRId64 " ids", root, *n);
    if (rc == 0) memcpy(*ids, d.sequence, (size_t)d.n_tokens * sizeof **ids);
    dataset_close(&d);
    return rc;
}

static int cmd_decode(int argc, char **argv) {
    Err err = {0};
    const char *spec = NULL, *dataset = NULL;
    bool skip_special = false;
    int n_files = 0, rc = 0;
    const Flag flags[] = {
        {.name = "tokenizer", .kind = FLAG_STRING, .target = &spec},
        {.name = "dataset", .kind = FLAG_STRING, .target = &dataset},
        {.name = "skip_special_tokens", .kind = FLAG_SWITCH, .target = &skip_special}};
    if (flags_parse(flags, sizeof flags / sizeof *flags, argc, argv, &n_files, &err))
        rc = err_prefix(&err, "decode");
    else if (!spec)
        rc = err_set(&err, "decode: --tokenizer is required");
    else if (n_files > 1 || (dataset && n_files))
        rc = err_set(&err, "decode: give one IDS_FILE, '-' or --dataset DIR");
    Tokenizer *tok = NULL;
    int32_t *ids = NULL;
    int64_t n = 0;
    char *text = NULL;
    size_t len = 0;
    if (rc == 0 && tokenizer_open(spec, &tok, &err) != 0) rc = err_prefix(&err, "--tokenizer");
    if (rc == 0)
        rc = dataset ? dataset_ids(dataset, &ids, &n, &err)
                     : read_ids(n_files ? argv[0] : "-", &ids, &n, &err);
    if (rc == 0) rc = tokenizer_decode(tok, ids, n, skip_special, &text, &len, &err);
    if (rc == 0 && (fwrite(text, 1, len, stdout) != len || fflush(stdout) != 0))
        rc = err_errno(&err, errno, "decode: writing the text");
    free(text);
    free(ids);
    tokenizer_free(tok);
    if (rc == 0) return 0;
    fprintf(stderr, "astrai-data: %s\n", err.msg);
    return err_exit_status(&err);
}

int main(int argc, char **argv) {
    json_init();
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0 ||
            (i == 1 && strcmp(argv[i], "help") == 0)) {
            fputs(USAGE, stdout);
            return 0;
        }
    }
    if (argc >= 2 && strcmp(argv[1], "prep") == 0) return cmd_prep(argc - 2, argv + 2);
    if (argc >= 2 && strcmp(argv[1], "inspect") == 0) return cmd_inspect(argc - 2, argv + 2);
    if (argc >= 2 && strcmp(argv[1], "decode") == 0) return cmd_decode(argc - 2, argv + 2);
    fprintf(stderr, "astrai-data: %s%s%s\n%s", argc >= 2 ? "unknown command '" : "no command",
            argc >= 2 ? argv[1] : "", argc >= 2 ? "'" : "", USAGE);
    return EXIT_BAD_INPUT;
}
