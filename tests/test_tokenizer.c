// test_tokenizer.c: the tokenizer API (data/tokenizer.h) on "bytes" and on a small
// hand-written tokenizer.json whose ids follow by hand: tokenizer_config.json's strings,
// booleans and added_tokens_decoder, token ids, vocab size, added tokens (special,
// single_word, normalized), the Removed split, dropped unknown characters, decode with and
// without special tokens, and the errors. (The ids of real tokenizers against Hugging Face
// tokenizers: tests/test_hf_tokenizer.py.)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "data/tokenizer.h"

static char scratch[256];

static const char TOKENIZER_JSON[] =
    "{\"version\": \"1.0\", \"added_tokens\": ["
    "{\"id\": 5, \"content\": \"<s>\", \"single_word\": false, \"lstrip\": false,"
    " \"rstrip\": false, \"normalized\": false, \"special\": true},"
    "{\"id\": 6, \"content\": \"XY\", \"single_word\": true, \"lstrip\": false,"
    " \"rstrip\": false, \"normalized\": true, \"special\": false}],"
    "\"normalizer\": {\"type\": \"Lowercase\"},"
    "\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"String\": \" \"},"
    " \"behavior\": \"Removed\", \"invert\": false},"
    "\"post_processor\": null, \"decoder\": null,"
    "\"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null,"
    " \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, \"c\": 3, \"abc\": 4},"
    " \"merges\": [\"a b\", [\"ab\", \"c\"]]}}";

static const char CONFIG_JSON[] =
    "{\"bos_token\": {\"content\": \"<s>\", \"special\": true}, \"eos_token\": \"</s>\","
    " \"chat_template\": \"{{ messages }}\", \"add_bos_token\": true,"
    " \"added_tokens_decoder\": {\"5\": {\"content\": \"<s>\", \"special\": true},"
    " \"7\": {\"content\": \"</s>\", \"special\": true, \"normalized\": false}}}";

static void write_file(const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", scratch, name);
    Err err = {0};
    CHECK_MSG(fs_write_file_synced(path, text, strlen(text), &err) == 0, "%s", err.msg);
}

// Encodes text and compares with want[0..n).
static void expect_ids(Tokenizer *t, const char *text, const int32_t *want, int64_t n) {
    int32_t *ids;
    int64_t got;
    Err err = {0};
    CHECK_MSG(tokenizer_encode(t, text, strlen(text), &ids, &got, &err) == 0, "%s", err.msg);
    CHECK_MSG(got == n && (n == 0 || memcmp(ids, want, (size_t)n * sizeof *ids) == 0),
              "'%s': %lld ids", text, (long long)got);
    free(ids);
}

static void expect_text(Tokenizer *t, const int32_t *ids, int64_t n, int skip, const char *want) {
    char *text;
    size_t len;
    Err err = {0};
    CHECK_MSG(tokenizer_decode(t, ids, n, skip, &text, &len, &err) == 0, "%s", err.msg);
    CHECK_MSG(len == strlen(want) && strcmp(text, want) == 0, "'%s' != '%s'", text, want);
    free(text);
}

static void test_bytes(void) {
    Tokenizer *t;
    Err err = {0};
    CHECK(tokenizer_open("bytes", &t, &err) == 0);
    CHECK(tokenizer_vocab_size(t) == 256);
    CHECK(tokenizer_token_id(t, "a") == 97);
    CHECK(tokenizer_config_string(t, "bos_token") == NULL);
    const int32_t hi[] = {'h', 0xC3, 0xA9};
    expect_ids(t, "h\xC3\xA9", hi, 3);
    expect_text(t, hi, 3, 0, "h\xC3\xA9");
    const int32_t bad[] = {300};
    char *text;
    size_t len;
    CHECK(tokenizer_decode(t, bad, 1, 0, &text, &len, &err) == -1 && strstr(err.msg, "300"));
    tokenizer_free(t);
}

static void test_json(void) {
    write_file("tokenizer.json", TOKENIZER_JSON);
    write_file("tokenizer_config.json", CONFIG_JSON);
    Tokenizer *t;
    Err err = {0};
    CHECK_MSG(tokenizer_open(scratch, &t, &err) == 0, "%s", err.msg);
    if (!t) return;
    CHECK(tokenizer_vocab_size(t) == 8); // </s> added from added_tokens_decoder as id 7
    CHECK(tokenizer_token_id(t, "</s>") == 7 && tokenizer_token_id(t, "ab") == 2);
    CHECK(tokenizer_token_id(t, "XY") == 6 && tokenizer_token_id(t, "zz") == -1);
    CHECK(strcmp(tokenizer_config_string(t, "bos_token"), "<s>") == 0);
    CHECK(strcmp(tokenizer_config_string(t, "eos_token"), "</s>") == 0);
    CHECK(strcmp(tokenizer_config_string(t, "chat_template"), "{{ messages }}") == 0);
    CHECK(tokenizer_config_string(t, "missing") == NULL);
    CHECK(tokenizer_config_bool(t, "add_bos_token", false));
    CHECK(!tokenizer_config_bool(t, "add_eos_token", false));
    // lowercased, split at (and without) spaces, merged; <s> and </s> cut out first
    const int32_t ids[] = {4, 2, 5, 2, 7};
    expect_ids(t, "ABC  ab<s>aB</s>", ids, 5);
    // XY (normalized, single word) matches as "xy" only between non-word characters;
    // x and y are not in the vocabulary, no unk: dropped
    const int32_t xy[] = {0, 6, 1, 2};
    expect_ids(t, "a Xy b axyb", xy, 4);
    expect_ids(t, "", NULL, 0);
    expect_text(t, ids, 5, 0, "abc ab <s> ab </s>"); // no decoder: joined by spaces
    expect_text(t, ids, 5, 1, "abc ab ab");
    int32_t *out;
    int64_t n;
    CHECK(tokenizer_encode(t, "caf\xE9", 4, &out, &n, &err) == -1 && strstr(err.msg, "UTF-8"));
    const int32_t bad[] = {8};
    char *text;
    size_t len;
    CHECK(tokenizer_decode(t, bad, 1, 0, &text, &len, &err) == -1 && strstr(err.msg, "8"));
    tokenizer_free(t);
}

static void expect_open_error(const char *json, const char *needle) {
    write_file("tokenizer.json", json);
    Tokenizer *t;
    Err err = {0};
    CHECK_MSG(tokenizer_open(scratch, &t, &err) == -1 && strstr(err.msg, needle) &&
                  strstr(err.msg, "tokenizer.json"),
              "%s: '%s'", needle, err.msg);
    CHECK(t == NULL);
}

static void test_errors(void) {
    Tokenizer *t;
    Err err = {0};
    CHECK(tokenizer_open("no-such-tokenizer", &t, &err) == -1 &&
          strstr(err.msg, "no-such-tokenizer"));
    char config[512];
    snprintf(config, sizeof config, "%s/tokenizer_config.json", scratch);
    remove(config);
    expect_open_error("[1, 2", "not valid JSON");
    expect_open_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": "
                      "[\"a q\"]}}",
                      "model.merges[0]: 'q' is not in model.vocab");
    expect_open_error("{\"model\": {\"vocab\": {\"a\": 0, \"b\": 2000000000}, \"merges\": []}}",
                      "model.vocab[\"b\"]: id 2000000000 is far past");
    expect_open_error("{\"model\": {\"vocab\": {\"a\": 0}, \"merges\": [], \"unk_token\": "
                      "\"<unk>\"}}",
                      "model.unk_token");
    expect_open_error("{\"model\": {\"vocab\": {}, \"merges\": []}, \"decoder\": {\"type\": "
                      "\"Sequence\", \"decoders\": [{\"type\": \"CTC\"}]}}",
                      "decoder.decoders[0] type 'CTC' is not supported");
    expect_open_error("{\"model\": {\"vocab\": {}, \"merges\": []}, \"pre_tokenizer\": "
                      "{\"type\": \"Split\", \"pattern\": {\"String\": \" \"}, \"behavior\": "
                      "\"Sideways\"}}",
                      "pre_tokenizer.behavior");
}

int main(void) {
    json_init();
    snprintf(scratch, sizeof scratch, "/tmp/astrai_test_tokenizer_XXXXXX");
    if (!mkdtemp(scratch)) return 1;
    test_bytes();
    test_json();
    test_errors();
    Err err = {0};
    fs_remove_tree(scratch, &err);
    CHECK_DONE();
}
