// test_records.c: DPO/GRPO record sets (data/records.h): every JSONL record shape, every bad
// record with its file:line message, skip_bad, record shards written and read back (and
// corrupted), and the truncation rule of records_row.
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/fsutil.h"
#include "data/dataset.h"
#include "data/records.h"
#include "data/shard_writer.h"

static char scratch[256]; // this test's temporary directory
static Tokenizer *bytes_tok;

// out = scratch/name
static void path_of(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "%s/%s", scratch, name);
}

// scratch/name holding text; its path into out.
static void write_text(char *out, size_t cap, const char *name, const char *text) {
    path_of(out, cap, name);
    Err err = {0};
    CHECK_MSG(fs_write_file_synced(out, text, strlen(text), &err) == 0, "%s", err.msg);
}

static int span_equals(const int32_t *got, int64_t n_got, const char *bytes) {
    int64_t n = (int64_t)strlen(bytes);
    if (n != n_got) return 0;
    for (int64_t i = 0; i < n; i++)
        if (got[i] != (unsigned char)bytes[i]) return 0;
    return 1;
}

static int ids_equal(const int32_t *got, int64_t n_got, const int32_t *want, int64_t n) {
    return n_got == n && memcmp(got, want, (size_t)n * sizeof *want) == 0;
}

static const int32_t *prompt_of(const RecordSet *rs, int64_t r, int64_t *n) {
    *n = rs->prompt_off[r + 1] - rs->prompt_off[r];
    return rs->prompt + rs->prompt_off[r];
}

static const int32_t *response_of(const RecordSet *rs, int64_t r, int j, int64_t *n) {
    int64_t k = r * rs->group_size + j;
    *n = rs->response_off[k + 1] - rs->response_off[k];
    return rs->response + rs->response_off[k];
}

static void test_dpo_shapes(void) {
    char path[512];
    write_text(path, sizeof path, "dpo_shapes.jsonl",
               "{\"prompt\": \"Hi\", \"chosen\": \" there\", \"rejected\": \" no\"}\n"
               "   \n"
               "{\"input\": [1, 2, 300], \"chosen\": [4], \"rejected\": [5, 6], \"score\": 9}\n"
               "{\"prompt\": \"\", \"input\": \"in\", \"chosen\": [{\"role\": \"assistant\", "
               "\"content\": \"ab\"}, {\"role\": \"x\"}, {\"content\": \"c\"}], \"rejected\": []"
               "}\n"
               "{\"prompt\": [{\"role\": \"user\", \"content\": \"Q?\"}], \"chosen\": \"y\", "
               "\"rejected\": \"n\"}");
    RecordSet rs;
    records_init(&rs, RECORDS_DPO, 7); // DPO's group size is 2 whatever is given
    Err err = {0};
    // The fourth line's rejected is empty: skip_bad keeps the others.
    CHECK_MSG(records_parse_jsonl(&rs, path, bytes_tok, 0, 1, &err) == 0, "%s", err.msg);
    CHECK(rs.group_size == 2 && rs.reward == NULL);
    CHECK(rs.n_records == 3 && rs.skipped == 1);
    CHECK_MSG(strstr(rs.first_skipped.msg, "dpo_shapes.jsonl:4: ") &&
                  strstr(rs.first_skipped.msg, "\"rejected\" is empty"),
              "%s", rs.first_skipped.msg);
    int64_t n;
    const int32_t *ids = prompt_of(&rs, 0, &n);
    CHECK(span_equals(ids, n, "Hi"));
    ids = response_of(&rs, 0, 0, &n);
    CHECK(span_equals(ids, n, " there"));
    ids = response_of(&rs, 0, 1, &n);
    CHECK(span_equals(ids, n, " no"));
    const int32_t p1[3] = {1, 2, 300}, c1[1] = {4}, r1[2] = {5, 6};
    ids = prompt_of(&rs, 1, &n);
    CHECK(ids_equal(ids, n, p1, 3)); // "input" when there is no "prompt"; ids as they are
    ids = response_of(&rs, 1, 0, &n);
    CHECK(ids_equal(ids, n, c1, 1));
    ids = response_of(&rs, 1, 1, &n);
    CHECK(ids_equal(ids, n, r1, 2));
    ids = prompt_of(&rs, 2, &n);
    CHECK(span_equals(ids, n, "Q?")); // a conversation list: its contents joined
    CHECK(rs.prompt_off[3] == 7 && rs.response_off[6] == 6 + 3 + 1 + 2 + 1 + 1);
    records_free(&rs);

    // "prompt": "" falls back to "input" (Python's `or`), a conversation list joins contents.
    write_text(path, sizeof path, "dpo_input.jsonl",
               "{\"prompt\": \"\", \"input\": \"in\", \"chosen\": [{\"role\": \"assistant\", "
               "\"content\": \"ab\"}, {\"role\": \"x\"}, {\"content\": \"c\"}], \"rejected\": "
               "\"r\"}\n");
    records_init(&rs, RECORDS_DPO, 2);
    CHECK_MSG(records_parse_jsonl(&rs, path, bytes_tok, 0, 0, &err) == 0, "%s", err.msg);
    CHECK(rs.n_records == 1);
    ids = prompt_of(&rs, 0, &n);
    CHECK(span_equals(ids, n, "in"));
    ids = response_of(&rs, 0, 0, &n);
    CHECK(span_equals(ids, n, "abc"));
    records_free(&rs);
}

static void test_grpo_shapes(void) {
    char path[512];
    write_text(path, sizeof path, "grpo.jsonl",
               "{\"prompt\": \"Q\", \"responses\": [\"a\", [7, 8], [{\"content\": \"z\"}]], "
               "\"rewards\": [1, -0.5, 2e3]}\n"
               "{\"prompt\": [9], \"responses\": [\"x\", \"yy\", \"zzz\"], \"rewards\": [0, 0, "
               "0], \"id\": \"ignored\"}\n");
    RecordSet rs;
    records_init(&rs, RECORDS_GRPO, 3);
    Err err = {0};
    CHECK_MSG(records_parse_jsonl(&rs, path, bytes_tok, 0, 0, &err) == 0, "%s", err.msg);
    CHECK(rs.n_records == 2 && rs.skipped == 0 && rs.group_size == 3);
    const float want_rewards[6] = {1, -0.5f, 2000, 0, 0, 0};
    CHECK(rs.reward && memcmp(rs.reward, want_rewards, sizeof want_rewards) == 0);
    int64_t n;
    const int32_t *ids = response_of(&rs, 0, 1, &n);
    const int32_t r01[2] = {7, 8};
    CHECK(ids_equal(ids, n, r01, 2));
    ids = response_of(&rs, 0, 2, &n);
    CHECK(span_equals(ids, n, "z"));
    ids = response_of(&rs, 1, 2, &n);
    CHECK(span_equals(ids, n, "zzz"));
    records_free(&rs);
}

// A file of a good record, a blank line, `bad` (line 3) and a good record: parsing fails
// naming file:3 and holding `needle`; with skip_bad it skips that record only.
static void expect_bad(RecordKind kind, int group_size, int vocab, const char *bad,
                       const char *needle) {
    static int case_no;
    const char *good = kind == RECORDS_DPO
                           ? "{\"prompt\": \"p\", \"chosen\": \"c\", \"rejected\": \"r\"}"
                           : "{\"prompt\": \"p\", \"responses\": [\"a\", \"b\"], \"rewards\": "
                             "[1, 2]}";
    char name[64], text[2048], path[512], where[600];
    snprintf(name, sizeof name, "bad%d.jsonl", case_no++);
    snprintf(text, sizeof text, "%s\n\n%s\n%s\n", good, bad, good);
    write_text(path, sizeof path, name, text);
    snprintf(where, sizeof where, "%s:3: ", path);
    RecordSet rs;
    Err err = {0};
    records_init(&rs, kind, group_size);
    CHECK_MSG(records_parse_jsonl(&rs, path, bytes_tok, vocab, 0, &err) == -1, "%s: accepted", bad);
    CHECK_MSG(strstr(err.msg, where) == err.msg && strstr(err.msg, needle),
              "'%s': '%s' not in '%s'", bad, needle, err.msg);
    records_free(&rs);
    records_init(&rs, kind, group_size);
    CHECK_MSG(records_parse_jsonl(&rs, path, bytes_tok, vocab, 1, &err) == 0, "%s", err.msg);
    CHECK_MSG(rs.n_records == 2 && rs.skipped == 1 && strstr(rs.first_skipped.msg, needle),
              "%s: %" PRId64 " records, %" PRId64 " skipped", bad, rs.n_records, rs.skipped);
    records_free(&rs);
}

static void test_bad_records(void) {
    const RecordKind D = RECORDS_DPO, G = RECORDS_GRPO;
    expect_bad(D, 2, 0, "{\"prompt\": \"p\", ", "malformed JSON");
    expect_bad(D, 2, 0, "{\"prompt\": \"p\", \"chosen\": \"c\", \"rejected\": \"r\"} x",
               "malformed JSON");
    expect_bad(D, 2, 0, "[1, 2]", "must be a JSON object");
    expect_bad(D, 2, 0, "{\"chosen\": \"c\", \"rejected\": \"r\"}",
               "key \"prompt\" (or \"input\")");
    expect_bad(D, 2, 0, "{\"prompt\": \"p\", \"rejected\": \"r\"}", "key \"chosen\" missing");
    expect_bad(D, 2, 0, "{\"prompt\": \"p\", \"chosen\": \"c\"}", "key \"rejected\" missing");
    expect_bad(D, 2, 0, "{\"prompt\": 7, \"chosen\": \"c\", \"rejected\": \"r\"}",
               "\"prompt\" must be a string, an array of token ids or a conversation list");
    expect_bad(D, 2, 0, "{\"prompt\": \"p\", \"chosen\": {}, \"rejected\": \"r\"}",
               "\"chosen\" must be a string");
    expect_bad(D, 2, 0, "{\"prompt\": \"\", \"chosen\": \"c\", \"rejected\": \"r\"}",
               "\"prompt\" is empty (the first response token needs a token before it)");
    expect_bad(D, 2, 0, "{\"input\": [], \"chosen\": \"c\", \"rejected\": \"r\"}",
               "\"input\" is empty");
    expect_bad(D, 2, 0, "{\"prompt\": \"p\", \"chosen\": \"\", \"rejected\": \"r\"}",
               "\"chosen\" is empty");
    expect_bad(D, 2, 0, "{\"prompt\": \"p\", \"chosen\": \"c\", \"rejected\": []}",
               "\"rejected\" is empty");
    expect_bad(D, 2, 0, "{\"prompt\": [1, -1], \"chosen\": \"c\", \"rejected\": \"r\"}",
               "\"prompt\"[1] is not a token id");
    expect_bad(D, 2, 0, "{\"prompt\": [1.5], \"chosen\": \"c\", \"rejected\": \"r\"}",
               "\"prompt\"[0] is not a token id");
    expect_bad(D, 2, 0, "{\"prompt\": [2147483648], \"chosen\": \"c\", \"rejected\": \"r\"}",
               "\"prompt\"[0] is not a token id");
    expect_bad(D, 2, 150, "{\"prompt\": \"p\", \"chosen\": [5, 150], \"rejected\": \"r\"}",
               "\"chosen\"[1]: token id 150 is outside the vocabulary [0, 150)");
    expect_bad(D, 2, 150, "{\"prompt\": \"p\", \"chosen\": \"c\", \"rejected\": \"\\u00ff\"}",
               "\"rejected\"[0]: token id 195 is outside the vocabulary [0, 150)");
    expect_bad(D, 2, 0,
               "{\"prompt\": [{\"content\": \"a\"}, 3], \"chosen\": \"c\", "
               "\"rejected\": \"r\"}",
               "\"prompt\"[1] is not a message object");
    expect_bad(D, 2, 0,
               "{\"prompt\": [{\"content\": 3}], \"chosen\": \"c\", \"rejected\": "
               "\"r\"}",
               "\"prompt\"[0]: \"content\" is not a string");
    expect_bad(G, 2, 0, "{\"prompt\": \"p\", \"rewards\": [1, 2]}", "key \"responses\" missing");
    expect_bad(G, 2, 0, "{\"prompt\": \"p\", \"responses\": [\"a\", \"b\"]}",
               "key \"rewards\" missing");
    expect_bad(G, 2, 0, "{\"input\": \"p\", \"responses\": [\"a\", \"b\"], \"rewards\": [1, 2]}",
               "key \"prompt\" missing");
    expect_bad(G, 2, 0, "{\"prompt\": \"p\", \"responses\": \"a\", \"rewards\": [1, 2]}",
               "\"responses\" must be an array of group_size 2");
    expect_bad(G, 2, 0, "{\"prompt\": \"p\", \"responses\": [\"a\", \"b\"], \"rewards\": 1}",
               "\"rewards\" must be an array of group_size 2");
    expect_bad(G, 2, 0, "{\"prompt\": \"p\", \"responses\": [\"a\"], \"rewards\": [1, 2]}",
               "\"responses\" has 1 elements, not group_size 2");
    expect_bad(G, 2, 0,
               "{\"prompt\": \"p\", \"responses\": [\"a\", \"b\"], \"rewards\": [1, 2, 3]}",
               "\"rewards\" has 3 elements, not group_size 2");
    expect_bad(G, 2, 0, "{\"prompt\": \"p\", \"responses\": [\"a\", \"\"], \"rewards\": [1, 2]}",
               "\"responses\"[1] is empty");
    expect_bad(G, 2, 0,
               "{\"prompt\": \"p\", \"responses\": [\"a\", \"b\"], \"rewards\": [1, \"2\"]}",
               "\"rewards\"[1] is not a number");
    expect_bad(G, 2, 0,
               "{\"prompt\": \"p\", \"responses\": [\"a\", \"b\"], \"rewards\": [1e999, 2]}",
               "\"rewards\"[0] = inf is not a finite number");
    expect_bad(G, 2, 0,
               "{\"prompt\": \"p\", \"responses\": [\"a\", \"b\"], \"rewards\": [1, 1e39]}",
               "\"rewards\"[1] = inf is not a finite number"); // past float32's range
    expect_bad(G, 2, 0, "{\"prompt\": \"p\", \"responses\": [\"a\", [3, -3]], \"rewards\": [1, 2]}",
               "\"responses\"[1][1] is not a token id");

    // A missing file is named; a group size out of range is refused before reading.
    RecordSet rs;
    Err err = {0};
    char path[512];
    path_of(path, sizeof path, "missing.jsonl");
    records_init(&rs, RECORDS_GRPO, 2);
    CHECK(records_parse_jsonl(&rs, path, bytes_tok, 0, 1, &err) == -1 &&
          strstr(err.msg, "missing.jsonl"));
    records_init(&rs, RECORDS_GRPO, 0);
    CHECK(records_parse_jsonl(&rs, path, bytes_tok, 0, 0, &err) == -1 &&
          strstr(err.msg, "group_size 0"));
}

// The whole content of two sets, compared.
static int sets_equal(const RecordSet *a, const RecordSet *b) {
    int64_t n = a->n_records, G = a->group_size;
    if (a->kind != b->kind || G != b->group_size || n != b->n_records) return 0;
    if (memcmp(a->prompt_off, b->prompt_off, (size_t)(n + 1) * sizeof(int64_t)) ||
        memcmp(a->response_off, b->response_off, (size_t)(n * G + 1) * sizeof(int64_t)) ||
        memcmp(a->prompt, b->prompt, (size_t)a->prompt_off[n] * sizeof(int32_t)) ||
        memcmp(a->response, b->response, (size_t)a->response_off[n * G] * sizeof(int32_t)))
        return 0;
    if (!a->reward != !b->reward) return 0;
    return !a->reward || memcmp(a->reward, b->reward, (size_t)(n * G) * sizeof(float)) == 0;
}

// A GRPO set of 5 records, G = 3, of varied lengths and rewards: record r's prompt is [r] and,
// for odd r, [r, 20, 21]; every response id is below 10.
static void make_grpo(RecordSet *rs) {
    char line[512], text[4096] = "", path[512];
    for (int r = 0; r < 5; r++) {
        snprintf(line, sizeof line,
                 "{\"prompt\": [%d%s], \"responses\": [[%d], [1, 2, %d], [4%s]], \"rewards\": "
                 "[%d, %g, -1.25]}\n",
                 r, r % 2 ? ", 20, 21" : "", r, r + 3, r % 2 ? "" : ", 5, 6", r, 0.5 * r);
        strcat(text, line);
    }
    write_text(path, sizeof path, "grpo5.jsonl", text);
    records_init(rs, RECORDS_GRPO, 3);
    Err err = {0};
    CHECK_MSG(records_parse_jsonl(rs, path, bytes_tok, 0, 0, &err) == 0, "%s", err.msg);
    CHECK(rs->n_records == 5);
}

static void test_shard_round_trip(void) {
    RecordSet rs, back;
    make_grpo(&rs);
    char root[512], dir[640], path[700];
    Err err = {0};
    path_of(root, sizeof root, "grpo_shards");
    // Two shards, [0, 2) and [2, 5): loading concatenates them in path order.
    snprintf(dir, sizeof dir, "%s/shard_0001", root);
    CHECK_MSG(records_write_shard(&rs, 2, 3, dir, &err) == 0, "%s", err.msg);
    snprintf(dir, sizeof dir, "%s/shard_0000", root);
    CHECK_MSG(records_write_shard(&rs, 0, 2, dir, &err) == 0, "%s", err.msg);
    CHECK(records_write_shard(&rs, 4, 2, dir, &err) == -1 && strstr(err.msg, "[4, 6)"));
    CHECK_MSG(records_open(&back, root, RECORDS_GRPO, 3, 0, 0, &err) == 0, "%s", err.msg);
    CHECK(back.n_shards == 2 && sets_equal(&rs, &back));
    records_free(&back);

    // meta.json as docs/data.md shows it, read back with the lengths of shard [0, 2).
    char *text;
    size_t len;
    snprintf(path, sizeof path, "%s/meta.json", dir);
    CHECK(fs_read_file(path, &text, &len, &err) == 0);
    int64_t p = rs.prompt_off[2], q = rs.response_off[6];
    char want[1024];
    snprintf(want, sizeof want,
             "{\"format\": \"grpo\", \"group_size\": 3, \"records\": 2, \"prompt\": {\"shape\": "
             "[%" PRId64 "], \"dtype\": \"int32\"}, \"prompt_len\": {\"shape\": [2], \"dtype\": "
             "\"int32\"}, \"response\": {\"shape\": [%" PRId64 "], \"dtype\": \"int32\"}, "
             "\"response_len\": {\"shape\": [6], \"dtype\": \"int32\"}, \"reward\": {\"shape\": "
             "[6], \"dtype\": \"float32\"}}",
             p, q);
    CHECK_MSG(text && strcmp(text, want) == 0, "%s", text);
    free(text);

    // A token dataset refuses a record-shard root, naming what it is.
    Dataset d;
    CHECK(dataset_open(&d, root, 0, &err) == -1 &&
          strstr(err.msg, "a grpo record set; use --train_type grpo"));
    int is_records = 0, g = 0;
    RecordKind kind = RECORDS_DPO;
    CHECK_MSG(records_probe(root, &is_records, &kind, &g, &err) == 0, "%s", err.msg);
    CHECK(is_records && kind == RECORDS_GRPO && g == 3);

    // The set parsed from the same JSONL file directly.
    path_of(path, sizeof path, "grpo5.jsonl");
    CHECK_MSG(records_open(&back, path, RECORDS_GRPO, 3, 0, 0, &err) == 0, "%s", err.msg);
    CHECK(back.n_shards == 0 && sets_equal(&rs, &back));
    records_free(&back);
    // vocab_size: the first id >= it is named with its file:line (JSONL) or shard and record.
    CHECK(records_open(&back, path, RECORDS_GRPO, 3, 21, 0, &err) == -1 &&
          strstr(err.msg, "grpo5.jsonl:2: \"prompt\"[2]: token id 21 is outside"));
    CHECK(records_open(&back, root, RECORDS_GRPO, 3, 21, 0, &err) == -1 &&
          strstr(err.msg, "shard_0000/meta.json: record 1: \"prompt\"[2]: token id 21"));
    // With skip_bad those records are dropped: records 1 and 3 have prompts [r, 20, 21].
    CHECK_MSG(records_open(&back, root, RECORDS_GRPO, 3, 21, 1, &err) == 0, "%s", err.msg);
    CHECK(back.n_records == 3 && back.skipped == 2 && back.prompt[1] == 2 && back.reward[3] == 2);
    records_free(&back);
    CHECK(records_open(&back, root, RECORDS_GRPO, 3, 1, 1, &err) == -1 &&
          strstr(err.msg, "no grpo records (5 bad ones skipped)"));

    // A DPO set: no reward key, and the kinds do not mix.
    RecordSet dpo;
    write_text(path, sizeof path, "dpo2.jsonl",
               "{\"prompt\": \"ab\", \"chosen\": \"c\", \"rejected\": \"dd\"}\n"
               "{\"prompt\": \"e\", \"chosen\": \"fff\", \"rejected\": \"g\"}\n");
    CHECK_MSG(records_open(&dpo, path, RECORDS_DPO, 4, 0, 0, &err) == 0, "%s", err.msg);
    path_of(root, sizeof root, "dpo_shards");
    snprintf(dir, sizeof dir, "%s/shard_0000", root);
    CHECK_MSG(records_write_shard(&dpo, 0, 2, dir, &err) == 0, "%s", err.msg);
    snprintf(path, sizeof path, "%s/reward.bin", dir);
    CHECK(!fs_is_file(path));
    CHECK_MSG(records_open(&back, root, RECORDS_DPO, 4, 0, 0, &err) == 0, "%s", err.msg);
    CHECK(sets_equal(&dpo, &back));
    records_free(&back);
    CHECK(records_open(&back, root, RECORDS_GRPO, 2, 0, 0, &err) == -1 &&
          strstr(err.msg, "dpo_shards/shard_0000/meta.json: a dpo record set, but the run asks "
                          "for grpo"));
    CHECK(dataset_open(&d, root, 1, &err) == -1 &&
          strstr(err.msg, "a dpo record set; use --train_type dpo"));
    records_free(&dpo);
    records_free(&rs);
}

// scratch/grpo_shards/shard_0000 copied to scratch/name/shard_0000 (via a fresh write).
static void fresh_grpo_shard(const char *name, char *dir, size_t cap) {
    RecordSet rs;
    make_grpo(&rs);
    char root[512];
    path_of(root, sizeof root, name);
    snprintf(dir, cap, "%s/shard_0000", root);
    Err err = {0};
    CHECK_MSG(records_write_shard(&rs, 0, 5, dir, &err) == 0, "%s", err.msg);
    records_free(&rs);
}

static void overwrite(const char *dir, const char *file, const void *data, size_t len) {
    char path[768];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    Err err = {0};
    CHECK_MSG(fs_write_file_synced(path, data, len, &err) == 0, "%s", err.msg);
}

// records_open(scratch/name as GRPO G) fails with a message holding both needles.
static void expect_open_error(const char *name, int group_size, const char *n1, const char *n2) {
    char root[512];
    path_of(root, sizeof root, name);
    RecordSet rs;
    Err err = {0};
    CHECK_MSG(records_open(&rs, root, RECORDS_GRPO, group_size, 0, 0, &err) == -1, "%s opened",
              root);
    CHECK_MSG(strstr(err.msg, n1) && strstr(err.msg, n2), "'%s', '%s' not in '%s'", n1, n2,
              err.msg);
}

static void test_corrupt_shards(void) {
    char dir[640];
    fresh_grpo_shard("truncated", dir, sizeof dir);
    overwrite(dir, "prompt.bin", "\1\0\0\0", 4);
    expect_open_error("truncated", 3, "truncated/shard_0000/meta.json: key 'prompt'",
                      "needs 36 bytes but");

    fresh_grpo_shard("sums", dir, sizeof dir);
    const int32_t lens[5] = {1, 3, 1, 3, 2}; // the last prompt is 1 token long
    overwrite(dir, "prompt_len.bin", lens, sizeof lens);
    expect_open_error("sums", 3, "sums/shard_0000/meta.json: key 'prompt_len' sums to 10",
                      "key 'prompt' has 9 tokens");

    fresh_grpo_shard("zero_len", dir, sizeof dir);
    const int32_t zero[5] = {1, 3, 0, 4, 1};
    overwrite(dir, "prompt_len.bin", zero, sizeof zero);
    expect_open_error("zero_len", 3, "key 'prompt_len': element 2 = 0", "not a length > 0");

    fresh_grpo_shard("group", dir, sizeof dir);
    expect_open_error("group", 4, "group/shard_0000/meta.json: group_size 3",
                      "the run asks for group_size 4");

    fresh_grpo_shard("nan", dir, sizeof dir);
    const float rewards[15] = {0, 0, 0, 0, 0, 0, 0, NAN, 0, 0, 0, 0, 0, 0, 0};
    overwrite(dir, "reward.bin", rewards, sizeof rewards);
    expect_open_error("nan", 3, "nan/shard_0000/meta.json: record 2",
                      "\"rewards\"[1] = nan is not a finite number");

    fresh_grpo_shard("meta", dir, sizeof dir);
    const char *meta = "{\"format\": \"grpo\", \"group_size\": 3, \"records\": 4, \"prompt\": "
                       "{\"shape\": [9], \"dtype\": \"int32\"}}";
    overwrite(dir, "meta.json", meta, strlen(meta));
    expect_open_error("meta", 3, "meta/shard_0000/meta.json: key 'prompt_len'", "missing");

    // A token dataset given to a record run.
    char root[512];
    path_of(root, sizeof root, "tokens/shard_0000");
    int32_t seq[3] = {1, 2, 3};
    ShardArray a[1] = {{"sequence", seq}};
    Err err = {0};
    CHECK_MSG(shard_write(root, a, 1, 3, &err) == 0, "%s", err.msg);
    expect_open_error("tokens", 3, "tokens/shard_0000/meta.json: a token dataset",
                      "not a grpo record set");
    expect_open_error("no_such_dir", 3, "no_such_dir", "");
}

// records_row of the single record (prompt P, response R) in `window` positions against the
// sequence s = want (prompt part first p tokens of it).
static void expect_row(const char *prompt, const char *response, int64_t window, const char *want_s,
                       int want_p) {
    char line[512], path[512];
    snprintf(line, sizeof line, "{\"prompt\": \"%s\", \"chosen\": \"%s\", \"rejected\": \"x\"}",
             prompt, response);
    write_text(path, sizeof path, "row.jsonl", line);
    RecordSet rs;
    Err err = {0};
    CHECK_MSG(records_open(&rs, path, RECORDS_DPO, 2, 0, 0, &err) == 0, "%s", err.msg);
    int32_t inputs[64], targets[64], mask[64];
    for (int t = 0; t < 64; t++)
        inputs[t] = targets[t] = mask[t] = -7;
    int len = records_row(&rs, 0, 0, window, inputs, targets, mask);
    int want_len = (int)strlen(want_s) - 1;
    CHECK_MSG(len == want_len, "%s|%s in %" PRId64 ": len %d, want %d", prompt, response, window,
              len, want_len);
    for (int t = 0; t < window; t++) {
        int in = t < want_len;
        CHECK_MSG(inputs[t] == (in ? want_s[t] : 0) && targets[t] == (in ? want_s[t + 1] : 0) &&
                      mask[t] == (in && t + 1 >= want_p),
                  "%s|%s in %" PRId64 ": position %d", prompt, response, window, t);
    }
    CHECK(inputs[window] == -7); // nothing past the window
    records_free(&rs);
}

static void test_rows(void) {
    expect_row("abc", "XY", 8, "abcXY", 3);         // fits: all of both
    expect_row("abc", "XY", 4, "abcXY", 3);         // exactly window + 1 tokens
    expect_row("abcdefg", "XY", 4, "efgXY", 3);     // the prompt loses its start
    expect_row("abcdefg", "XYZUV", 4, "gXYZU", 1);  // q = window, one prompt token kept
    expect_row("a", "XYZUVWXYZ", 3, "aXYZ", 1);     // the response loses its end
    expect_row("abcdefg", "XYZUVWXYZ", 1, "gX", 1); // the smallest row
    expect_row("abcdefgh", "XYZ", 6, "efghXYZ", 4); // p = window + 1 - q
}

int main(void) {
    snprintf(scratch, sizeof scratch, "/tmp/astrai_test_records_XXXXXX");
    if (!mkdtemp(scratch)) return 1;
    Err err = {0};
    if (tokenizer_open("bytes", &bytes_tok, &err) != 0) return 1;
    test_dpo_shapes();
    test_grpo_shapes();
    test_bad_records();
    test_shard_round_trip();
    test_corrupt_shards();
    test_rows();
    fs_remove_tree(scratch, &err);
    tokenizer_free(bytes_tok);
    CHECK_DONE();
}
