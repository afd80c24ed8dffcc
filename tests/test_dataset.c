// test_dataset.c: bin shards (written by shard_writer and by hand), their
// validation errors, vocabulary checks and the windows of docs/design.md §8.
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/fsutil.h"
#include "data/dataset.h"
#include "data/shard_writer.h"

static char scratch[256]; // this test's temporary directory

// out = scratch/name
static void path_of(char *out, size_t cap, const char *name) {
    snprintf(out, cap, "%s/%s", scratch, name);
}

static void write_bytes(const char *dir, const char *file, const void *data, size_t len) {
    char path[768];
    snprintf(path, sizeof path, "%s/%s/%s", scratch, dir, file);
    Err err = {0};
    CHECK_MSG(fs_write_file_synced(path, data, len, &err) == 0, "%s", err.msg);
}

// Little-endian bytes of v[0..n), each `size` bytes wide, into scratch/dir/file.
static void write_le(const char *dir, const char *file, const int64_t *v, int n, int size) {
    unsigned char b[512];
    for (int i = 0; i < n; i++)
        for (int k = 0; k < size; k++)
            b[size * i + k] = (unsigned char)((uint64_t)v[i] >> (8 * k));
    write_bytes(dir, file, b, (size_t)n * (size_t)size);
}

// A hand-made shard scratch/dir with the given meta.json text.
static void hand_shard(const char *dir, const char *meta) {
    char path[512];
    path_of(path, sizeof path, dir);
    Err err = {0};
    CHECK(fs_mkdir_p(path, &err) == 0);
    write_bytes(dir, "meta.json", meta, strlen(meta));
}

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    if (d) closedir(d);
    return n;
}

static const int64_t THREE[3] = {1, 2, 3};

// Opens scratch/name and expects failure with a message holding both needles.
static void expect_open_error(const char *name, int need_sft, const char *n1, const char *n2) {
    char root[512];
    path_of(root, sizeof root, name);
    Dataset d;
    Err err = {0};
    CHECK_MSG(dataset_open(&d, root, need_sft, &err) == -1, "opening %s should fail", root);
    CHECK_MSG(strstr(err.msg, n1) && strstr(err.msg, n2), "'%s', '%s' not in '%s'", n1, n2,
              err.msg);
}

static void test_write_and_concatenate(void) {
    int32_t a_seq[2] = {1, 2}, a_mask[2] = {0, 1}, a_pos[2] = {0, 1};
    int32_t b_seq[3] = {7, 8, 9}, b_mask[3] = {1, 1, 0}, b_pos[3] = {0, 0, 1};
    int32_t c_seq[4] = {3, 4, 5, 6}, c_mask[4] = {0, 0, 1, 1}, c_pos[4] = {5, 6, 7, 8};
    ShardArray a[3] = {{"sequence", a_seq}, {"loss_mask", a_mask}, {"position_ids", a_pos}};
    ShardArray b[3] = {{"sequence", b_seq}, {"loss_mask", b_mask}, {"position_ids", b_pos}};
    ShardArray c[3] = {{"sequence", c_seq}, {"loss_mask", c_mask}, {"position_ids", c_pos}};
    char root[512], shard[640];
    path_of(root, sizeof root, "concat");
    Err err = {0};
    // Written out of order: loading sorts by path (concat/a < concat/b < concat/b/nested).
    snprintf(shard, sizeof shard, "%s/b", root);
    CHECK_MSG(shard_write(shard, b, 3, 3, &err) == 0, "%s", err.msg);
    snprintf(shard, sizeof shard, "%s/b/nested", root);
    CHECK_MSG(shard_write(shard, c, 3, 4, &err) == 0, "%s", err.msg);
    snprintf(shard, sizeof shard, "%s/a", root);
    CHECK_MSG(shard_write(shard, a, 3, 2, &err) == 0, "%s", err.msg);
    CHECK(shard_write(shard, a, 3, 2, &err) == -1 && strstr(err.msg, "already exists"));
    // A hidden directory (e.g. a crashed writer's temporary) is not a shard.
    hand_shard("concat/.partial", "{\"sequence\": ");

    Dataset d;
    CHECK_MSG(dataset_open(&d, root, 1, &err) == 0, "%s", err.msg);
    int32_t seq[9] = {1, 2, 7, 8, 9, 3, 4, 5, 6}, mask[9] = {0, 1, 1, 1, 0, 0, 0, 1, 1};
    int32_t pos[9] = {0, 1, 0, 0, 1, 5, 6, 7, 8};
    CHECK(d.n_shards == 3 && d.n_tokens == 9);
    for (int t = 0; t < 9 && d.n_tokens == 9; t++) {
        CHECK_MSG(d.sequence[t] == seq[t], "sequence[%d] = %d", t, d.sequence[t]);
        CHECK_MSG(d.loss_mask[t] == mask[t], "loss_mask[%d] = %d", t, d.loss_mask[t]);
        CHECK_MSG(d.position_ids[t] == pos[t], "position_ids[%d] = %d", t, d.position_ids[t]);
    }
    dataset_close(&d);
}

// The files shard_write produces, byte for byte (meta.json as AstrAI's json.dump).
static void test_shard_bytes(void) {
    char shard[640], path[700], *text;
    size_t len;
    Err err = {0};
    int32_t seq[2] = {0x01020304, -2};
    ShardArray a[1] = {{"sequence", seq}};
    path_of(shard, sizeof shard, "bytes/s");
    CHECK_MSG(shard_write(shard, a, 1, 2, &err) == 0, "%s", err.msg);
    snprintf(path, sizeof path, "%s/meta.json", shard);
    CHECK(fs_read_file(path, &text, &len, &err) == 0);
    CHECK_MSG(text && strcmp(text, "{\"sequence\": {\"shape\": [2], \"dtype\": \"int32\"}}") == 0,
              "%s", text);
    free(text);
    snprintf(path, sizeof path, "%s/sequence.bin", shard);
    CHECK(fs_read_file(path, &text, &len, &err) == 0);
    const unsigned char want[8] = {4, 3, 2, 1, 0xfe, 0xff, 0xff, 0xff};
    CHECK(text && len == 8 && memcmp(text, want, 8) == 0);
    free(text);
    path_of(path, sizeof path, "bytes");
    CHECK_MSG(count_entries(path) == 1, "a temporary directory is left in %s", path);
    CHECK(fs_remove_tree(path, &err) == 0 && fs_mkdir_p(path, &err) == 0);
    CHECK(shard_write(path, a, 1, 2, &err) == -1); // the shard dir itself exists
}

static void test_missing_and_malformed(void) {
    expect_open_error("does_not_exist", 0, "does_not_exist", "not a directory");
    char path[512];
    path_of(path, sizeof path, "empty/sub");
    CHECK(fs_mkdir_p(path, NULL) == 0);
    expect_open_error("empty", 0, "/empty", "no meta.json");

    hand_shard("malformed/p", "{\"sequence\": {\"shape\": [3], ");
    expect_open_error("malformed", 0, "malformed/p/meta.json", "malformed JSON");
    hand_shard("toplist/p", "[1, 2]");
    expect_open_error("toplist", 0, "toplist/p/meta.json", "not an object");

    hand_shard("noseq/p", "{\"loss_mask\": {\"shape\": [3], \"dtype\": \"int32\"}}");
    write_le("noseq/p", "loss_mask.bin", THREE, 3, 4);
    expect_open_error("noseq", 0, "noseq/p/meta.json", "key 'sequence' missing");

    hand_shard("nobin/p", "{\"sequence\": {\"shape\": [3], \"dtype\": \"int32\"}}");
    expect_open_error("nobin", 0, "nobin/p/meta.json", "nobin/p/sequence.bin");
}

// SFT keys: required with need_sft, else loaded only when every shard has them.
static void test_sft_keys(void) {
    hand_shard("nosft/a",
               "{\"sequence\": {\"shape\": [3], \"dtype\": \"int32\"}, \"loss_mask\": {\"shape\": "
               "[3], \"dtype\": \"int32\"}, \"position_ids\": {\"shape\": [3], \"dtype\": "
               "\"int32\"}}");
    write_le("nosft/a", "sequence.bin", THREE, 3, 4);
    write_le("nosft/a", "loss_mask.bin", THREE, 3, 4);
    write_le("nosft/a", "position_ids.bin", THREE, 3, 4);
    hand_shard("nosft/b", "{\"sequence\": {\"shape\": [3], \"dtype\": \"int32\"}}");
    write_le("nosft/b", "sequence.bin", THREE, 3, 4);
    expect_open_error("nosft", 1, "nosft/b/meta.json", "key 'loss_mask' missing");
    char root[512];
    path_of(root, sizeof root, "nosft");
    Dataset d;
    Err err = {0};
    CHECK_MSG(dataset_open(&d, root, 0, &err) == 0, "%s", err.msg);
    CHECK(d.n_tokens == 6 && d.loss_mask == NULL && d.position_ids == NULL);
    dataset_close(&d);

    hand_shard("nopos/a", "{\"sequence\": {\"shape\": [3], \"dtype\": \"int32\"}, \"loss_mask\": "
                          "{\"shape\": [3], \"dtype\": \"int32\"}}");
    write_le("nopos/a", "sequence.bin", THREE, 3, 4);
    write_le("nopos/a", "loss_mask.bin", THREE, 3, 4);
    expect_open_error("nopos", 1, "nopos/a/meta.json", "key 'position_ids' missing");
}

static void test_bad_entries(void) {
    hand_shard("float/p", "{\"sequence\": {\"shape\": [3], \"dtype\": \"float32\"}}");
    write_le("float/p", "sequence.bin", THREE, 3, 4);
    expect_open_error("float", 0, "float/p/meta.json: key 'sequence'", "float32");

    hand_shard("nodtype/p", "{\"sequence\": {\"shape\": [3]}}");
    expect_open_error("nodtype", 0, "nodtype/p/meta.json: key 'sequence'", "dtype");

    hand_shard("size/p", "{\"sequence\": {\"shape\": [4], \"dtype\": \"int32\"}}");
    write_le("size/p", "sequence.bin", THREE, 3, 4);
    expect_open_error("size", 0, "size/p/meta.json: key 'sequence'", "has 12");

    hand_shard("twod/p", "{\"sequence\": {\"shape\": [3, 1], \"dtype\": \"int32\"}}");
    write_le("twod/p", "sequence.bin", THREE, 3, 4);
    expect_open_error("twod", 0, "twod/p/meta.json: key 'sequence'", "shape");

    hand_shard("lengths/p", "{\"sequence\": {\"shape\": [3], \"dtype\": \"int32\"}, "
                            "\"position_ids\": {\"shape\": [2], \"dtype\": \"int32\"}}");
    write_le("lengths/p", "sequence.bin", THREE, 3, 4);
    write_le("lengths/p", "position_ids.bin", THREE, 2, 4);
    expect_open_error("lengths", 0, "lengths/p/meta.json: key 'position_ids' has 2",
                      "'sequence' has 3");

    const int64_t big[2] = {5, (int64_t)1 << 40};
    hand_shard("big/p", "{\"sequence\": {\"shape\": [2], \"dtype\": \"int64\"}}");
    write_le("big/p", "sequence.bin", big, 2, 8);
    expect_open_error("big", 0, "big/p/meta.json: key 'sequence': element 1", "exceeds int32");
}

// The other integer dtypes AstrAI can write are widened to int32.
static void test_other_dtypes(void) {
    const int64_t seq[3] = {5, 70000, -7}, mask[3] = {0, 1, 2}, pos[3] = {-2, 300, 0};
    hand_shard("dtypes/p", "{\"sequence\": {\"shape\": [3], \"dtype\": \"int64\"}, \"loss_mask\": "
                           "{\"shape\": [3], \"dtype\": \"bool\"}, \"position_ids\": {\"shape\": "
                           "[3], \"dtype\": \"int16\"}}");
    write_le("dtypes/p", "sequence.bin", seq, 3, 8);
    write_le("dtypes/p", "loss_mask.bin", mask, 3, 1);
    write_le("dtypes/p", "position_ids.bin", pos, 3, 2);
    const int64_t bytes[2] = {200, 7};
    hand_shard("dtypes/q", "{\"sequence\": {\"shape\": [2], \"dtype\": \"uint8\"}, \"loss_mask\": "
                           "{\"shape\": [2], \"dtype\": \"int8\"}, \"position_ids\": {\"shape\": "
                           "[2], \"dtype\": \"int32\"}}");
    write_le("dtypes/q", "sequence.bin", bytes, 2, 1);
    write_le("dtypes/q", "loss_mask.bin", (const int64_t[]){-1, 1}, 2, 1);
    write_le("dtypes/q", "position_ids.bin", bytes, 2, 4);
    char root[512];
    path_of(root, sizeof root, "dtypes");
    Dataset d;
    Err err = {0};
    CHECK_MSG(dataset_open(&d, root, 1, &err) == 0, "%s", err.msg);
    const int32_t want_seq[5] = {5, 70000, -7, 200, 7}, want_mask[5] = {0, 1, 1, -1, 1};
    const int32_t want_pos[5] = {-2, 300, 0, 200, 7};
    CHECK(d.n_tokens == 5);
    for (int t = 0; t < 5 && d.n_tokens == 5; t++)
        CHECK_MSG(d.sequence[t] == want_seq[t] && d.loss_mask[t] == want_mask[t] &&
                      d.position_ids[t] == want_pos[t],
                  "t=%d: %d %d %d", t, d.sequence[t], d.loss_mask[t], d.position_ids[t]);
    dataset_close(&d);
}

static void test_check_vocab(void) {
    int32_t seq[5] = {0, 255, 3, 256, -1};
    Dataset d = {.sequence = seq, .n_tokens = 5};
    Err err = {0};
    CHECK(dataset_check_vocab(&d, 256, &err) == -1);
    CHECK_MSG(strstr(err.msg, "token id 256 at position 3"), "%s", err.msg);
    d.n_tokens = 3;
    CHECK(dataset_check_vocab(&d, 256, &err) == 0);
    seq[1] = -1;
    CHECK(dataset_check_vocab(&d, 256, &err) == -1);
    CHECK_MSG(strstr(err.msg, "token id -1 at position 1"), "%s", err.msg);
}

// Window counts by enumeration: every i >= 0 with i*stride <= T-1-w starts one.
static int64_t count_windows_by_enumeration(int64_t T, int64_t w, int64_t stride) {
    int64_t n = 0;
    for (int64_t begin = 0; begin + w <= T - 1; begin += stride)
        n++;
    return n;
}

static void test_window_counts(void) {
    CHECK(dataset_num_windows(8, 8, 8) == 0);  // T == w
    CHECK(dataset_num_windows(5, 8, 8) == 0);  // T < w
    CHECK(dataset_num_windows(9, 8, 8) == 1);  // T == w+1
    CHECK(dataset_num_windows(16, 8, 8) == 1); // the second window needs a 17th token
    CHECK(dataset_num_windows(17, 8, 8) == 2);
    CHECK(dataset_num_windows(20, 4, 3) == 6); // begins 0,3,6,9,12,15
    CHECK(dataset_num_windows(0, 4, 4) == 0);
    for (int64_t T = 0; T < 40; T++)
        for (int64_t w = 1; w < 10; w++)
            for (int64_t s = 1; s < 12; s++)
                CHECK_MSG(dataset_num_windows(T, w, s) == count_windows_by_enumeration(T, w, s),
                          "T=%" PRId64 " w=%" PRId64 " stride=%" PRId64, T, w, s);
}

// Window i of an SFT stream whose values encode their position (seq[t] = 100+t).
static void test_window_contents(void) {
    enum { T = 20 };
    int32_t seq[T], mask[T], pos[T];
    for (int t = 0; t < T; t++)
        seq[t] = 100 + t, mask[t] = 200 + t, pos[t] = 300 + t;
    Dataset d = {.sequence = seq, .loss_mask = mask, .position_ids = pos, .n_tokens = T};
    int32_t in[8], tg[8], lm[8], pi[8];
    // w=4, stride 3: window 5 begins at 15 = T-1-w and its last target is seq[19].
    const int64_t begins[6] = {0, 3, 6, 9, 12, 15};
    for (int i = 0; i < 6; i++) {
        dataset_window(&d, i, 4, 3, in, tg, lm, pi);
        for (int k = 0; k < 4; k++)
            CHECK_MSG(in[k] == 100 + begins[i] + k && tg[k] == 101 + begins[i] + k &&
                          lm[k] == 201 + begins[i] + k && pi[k] == 300 + begins[i] + k,
                      "window %d k %d: %d %d %d %d", i, k, in[k], tg[k], lm[k], pi[k]);
    }
    // An index past the count clamps to begin = T-1-w (AstrAI's sample_window).
    dataset_window(&d, 7, 4, 3, in, tg, NULL, NULL);
    CHECK(in[0] == 115 && tg[3] == 119);
    // T == w+1: the single window is seq[0:w] -> seq[1:w+1].
    d.n_tokens = 9;
    dataset_window(&d, 0, 8, 8, in, tg, NULL, NULL);
    CHECK(in[0] == 100 && in[7] == 107 && tg[0] == 101 && tg[7] == 108);
}

int main(void) {
    snprintf(scratch, sizeof scratch, "/tmp/astrai_test_dataset_XXXXXX");
    if (!mkdtemp(scratch)) return 1;
    test_write_and_concatenate();
    test_shard_bytes();
    test_missing_and_malformed();
    test_sft_keys();
    test_bad_entries();
    test_other_dtypes();
    test_check_vocab();
    test_window_counts();
    test_window_contents();
    Err err;
    fs_remove_tree(scratch, &err);
    CHECK_DONE();
}
