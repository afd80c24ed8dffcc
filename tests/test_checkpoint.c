// test_checkpoint.c: atomic checkpoint directories (commit, replace, latest,
// crash leftovers), meta.json parsing, and the file helpers under them.
#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "ckpt/checkpoint.h"
#include "ckpt/meta.h"
#include "common/fsutil.h"

static char root[PATH_MAX]; // a fresh directory for this run

// out = dir/rel (out has PATH_MAX bytes).
static void join(char *out, const char *dir, const char *rel) {
    if (snprintf(out, PATH_MAX, "%s/%s", dir, rel) >= PATH_MAX) abort();
}

static void path_in(char *out, const char *rel) {
    join(out, root, rel);
}

static int contains(const char *msg, const char *want) {
    return strstr(msg, want) != NULL;
}

static int dir_entries_starting(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int found = 0;
    struct dirent *ent;
    while ((ent = readdir(d)) != NULL)
        if (strncmp(ent->d_name, prefix, strlen(prefix)) == 0) found = 1;
    closedir(d);
    return found;
}

// A directory under root that looks like a checkpoint (with_meta: has meta.json).
static void make_fake(const char *rel, int with_meta) {
    char dir[PATH_MAX], meta[PATH_MAX + 16];
    Err err = {0};
    path_in(dir, rel);
    CHECK_MSG(fs_mkdir_p(dir, &err) == 0, "%s", err.msg);
    snprintf(meta, sizeof meta, "%s/meta.json", dir);
    const char *json = "{\"epoch\": 9, \"consumed_samples\": 9, \"step\": 999}";
    if (with_meta) CHECK(fs_write_file_synced(meta, json, strlen(json), &err) == 0);
}

// Writes a complete checkpoint `name` whose meta.json holds the given step.
static int save_checkpoint(const char *dir, const char *name, long step) {
    char tmp[PATH_MAX], file[PATH_MAX + 16], text[128];
    Err err = {0};
    if (ckpt_begin(dir, name, tmp, sizeof tmp, &err) != 0) goto fail;
    snprintf(text, sizeof text, "{\"epoch\": 0, \"consumed_samples\": %ld, \"step\": %ld}",
             step * 4, step);
    snprintf(file, sizeof file, "%s/meta.json", tmp);
    if (fs_write_file_synced(file, text, strlen(text), &err) != 0) goto fail;
    if (ckpt_commit(dir, tmp, name, &err) != 0) goto fail;
    return 0;
fail:
    fprintf(stderr, "save_checkpoint %s: %s\n", name, err.msg);
    return -1;
}

static long step_in(const char *ckpt_path) {
    char file[PATH_MAX + 16];
    snprintf(file, sizeof file, "%s/meta.json", ckpt_path);
    CkptMeta m;
    Err err = {0};
    if (meta_load(&m, file, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return -99;
    }
    long step = m.step;
    meta_free(&m);
    return step;
}

// ---------------------------------------------------------------- checkpoints

static void test_commit_and_latest(void) {
    char dir[PATH_MAX], latest[PATH_MAX], want[PATH_MAX];
    path_in(dir, "ck/nested");
    Err err = {0};
    CHECK(ckpt_find_latest(dir, latest, sizeof latest, &err) == 1); // does not exist yet
    CHECK(save_checkpoint(dir, "epoch_0_step_5", 5) == 0);
    CHECK(save_checkpoint(dir, "epoch_1_step_12", 12) == 0);
    CHECK(save_checkpoint(dir, "epoch_0_step_9", 9) == 0);
    CHECK(!dir_entries_starting(dir, ".tmp-"));
    // Not checkpoints: no meta.json, wrong names, temp leftovers.
    make_fake("ck/nested/epoch_2_step_20", 0);
    make_fake("ck/nested/epoch_1_step_99x", 1);
    make_fake("ck/nested/.tmp-epoch_3_step_30-77", 1);
    make_fake("ck/nested/.old-epoch_3_step_40-77", 1);
    // A lookalike astrai did not commit here (a user's copy, another run's), and a symlink to
    // one of ours: neither is ever the latest, nor listed as ours.
    make_fake("ck/nested/epoch_7_step_70", 1);
    char link_path[PATH_MAX], target[PATH_MAX];
    join(link_path, dir, "epoch_8_step_80");
    join(target, dir, "epoch_1_step_12");
    CHECK(symlink(target, link_path) == 0);
    // The latest is the last one committed (the ledger's order), not the largest step.
    CHECK(ckpt_find_latest(dir, latest, sizeof latest, &err) == 0);
    join(want, dir, "epoch_0_step_9");
    CHECK_MSG(strcmp(latest, want) == 0, "%s", latest);
    CHECK(step_in(latest) == 9);
    CkptEntry *all;
    int n;
    bool has_ledger;
    CHECK(ckpt_list(dir, &all, &n, &has_ledger, &err) == 0 && has_ledger);
    int ours = 0;
    for (int i = 0; i < n; i++) {
        CHECK_MSG(strcmp(all[i].name, "epoch_8_step_80"), "the symlink is listed");
        ours += all[i].ours;
        if (!strcmp(all[i].name, "epoch_7_step_70")) CHECK(!all[i].ours);
    }
    CHECK(ours == 3 && n == 4);
    free(all);
    // Removal never takes a symlink, and leaves the ledger's record of the removal.
    CHECK(ckpt_remove(dir, "epoch_8_step_80", &err) == -1);
    CHECK(fs_is_dir(target));
    CHECK(ckpt_remove(dir, "epoch_0_step_9", &err) == 0);
    CHECK(ckpt_find_latest(dir, latest, sizeof latest, &err) == 0);
    CHECK(step_in(latest) == 12);
    // A user's .tmp-* directories (no astrai marker) survive the clean-up.
    make_fake("ck/nested/.tmp-notes", 1);
    CHECK(ckpt_remove_stale(dir, NULL, NULL, &err) == 0);
    CHECK(dir_entries_starting(dir, ".tmp-notes"));
    CHECK(dir_entries_starting(dir, ".tmp-epoch_3_step_30-77"));

    char empty[PATH_MAX];
    path_in(empty, "ck/empty");
    CHECK(fs_mkdir_p(empty, &err) == 0);
    CHECK(ckpt_find_latest(empty, latest, sizeof latest, &err) == 1);
}

static void test_replace(void) {
    char dir[PATH_MAX], latest[PATH_MAX];
    path_in(dir, "ck/replace");
    Err err = {0};
    CHECK(save_checkpoint(dir, "epoch_0_step_3", 3) == 0);
    CHECK(save_checkpoint(dir, "epoch_0_step_3", 33) == 0); // same name, new content
    CHECK(ckpt_find_latest(dir, latest, sizeof latest, &err) == 0);
    CHECK(step_in(latest) == 33);
    CHECK(!dir_entries_starting(dir, ".old-"));
    CHECK(!dir_entries_starting(dir, ".tmp-"));
}

static void test_abort_and_bad_names(void) {
    char dir[PATH_MAX], tmp[PATH_MAX];
    path_in(dir, "ck/abort");
    Err err = {0};
    CHECK(ckpt_begin(dir, "epoch_0_step_1", tmp, sizeof tmp, &err) == 0);
    CHECK(fs_is_dir(tmp));
    CHECK(ckpt_abort(tmp, &err) == 0);
    CHECK(!fs_is_dir(tmp));
    CHECK(ckpt_begin(dir, "../escape", tmp, sizeof tmp, &err) == -1);
    CHECK_MSG(contains(err.msg, "bad checkpoint name '../escape'"), "%s", err.msg);
    CHECK(ckpt_begin(dir, ".hidden", tmp, sizeof tmp, &err) == -1);
    char small[8];
    CHECK(ckpt_begin(dir, "epoch_0_step_1", small, sizeof small, &err) == -1);
    CHECK_MSG(contains(err.msg, "path too long"), "%s", err.msg);
}

// A writer killed in the middle of a checkpoint leaves only a .tmp-* directory:
// the last good checkpoint stays the latest, and the leftover can be removed.
static void test_crash_leaves_previous(void) {
    char dir[PATH_MAX], latest[PATH_MAX];
    path_in(dir, "ck/crash");
    Err err = {0};
    CHECK(save_checkpoint(dir, "epoch_0_step_10", 10) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        char tmp[PATH_MAX], file[PATH_MAX + 16];
        if (ckpt_begin(dir, "epoch_0_step_20", tmp, sizeof tmp, &err) != 0) _exit(3);
        snprintf(file, sizeof file, "%s/meta.json", tmp);
        FILE *fp = fopen(file, "w");
        fputs("{\"epoch\": 0, \"consumed_sam", fp); // half a file, then the crash
        fflush(fp);
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(dir_entries_starting(dir, ".tmp-epoch_0_step_20-"));
    CHECK(ckpt_find_latest(dir, latest, sizeof latest, &err) == 0);
    CHECK(step_in(latest) == 10);

    // Crash between the two renames of a replace: the old one sits under .old-*.
    char from[PATH_MAX], to[PATH_MAX];
    join(from, dir, "epoch_0_step_10");
    join(to, dir, ".old-epoch_0_step_10-4242");
    CHECK(rename(from, to) == 0);
    CHECK(ckpt_find_latest(dir, latest, sizeof latest, &err) == 1);

    CHECK_MSG(ckpt_remove_stale(dir, NULL, NULL, &err) == 0, "%s", err.msg);
    CHECK(!dir_entries_starting(dir, ".tmp-"));
    CHECK(!dir_entries_starting(dir, ".old-"));
    CHECK(ckpt_find_latest(dir, latest, sizeof latest, &err) == 0);
    CHECK(step_in(latest) == 10); // put back
}

static void test_parse_name(void) {
    long e = -1, s = -1;
    CHECK(ckpt_parse_name("epoch_3_step_120", &e, &s) == 0 && e == 3 && s == 120);
    CHECK(ckpt_parse_name("epoch_3_step_", &e, &s) == -1);
    CHECK(ckpt_parse_name("epoch_-1_step_2", &e, &s) == -1);
    CHECK(ckpt_parse_name("epoch_1_step_2.bak", &e, &s) == -1);
    CHECK(ckpt_parse_name("epoch_1_step_99999999999999999999999", &e, &s) == -1);
    CHECK(ckpt_parse_name(".tmp-epoch_1_step_2-77", &e, &s) == -1);
}

// ---------------------------------------------------------------- meta.json

static void test_meta_astrai(void) {
    // As AstrAI's Checkpoint.save writes it: no "step", config keys after ours.
    const char *json = "{\n  \"epoch\": 1,\n  \"consumed_samples\": 640,\n"
                       "  \"timestamp\": \"2025-03-01T12:00:00\",\n  \"train_type\": \"seq\",\n"
                       "  \"max_lr\": 0.0003\n}";
    CkptMeta m;
    Err err = {0};
    CHECK_MSG(meta_parse(&m, json, "meta.json", &err) == 0, "%s", err.msg);
    CHECK(m.epoch == 1 && m.consumed_samples == 640 && m.step == -1);
    CHECK(strcmp(m.timestamp, "2025-03-01T12:00:00") == 0);
    CHECK(cJSON_GetArraySize(m.config) == 2);
    CHECK(cJSON_GetObjectItem(m.config, "epoch") == NULL);
    const cJSON *tt = cJSON_GetObjectItem(m.config, "train_type");
    CHECK(cJSON_IsString(tt) && strcmp(tt->valuestring, "seq") == 0);

    // Round trip through our writer, with a step.
    m.step = 80;
    char *text = meta_to_json(&m);
    CkptMeta back;
    CHECK_MSG(meta_parse(&back, text, "again", &err) == 0, "%s", err.msg);
    CHECK(back.epoch == 1 && back.consumed_samples == 640 && back.step == 80);
    CHECK(strcmp(back.timestamp, m.timestamp) == 0);
    CHECK(cJSON_Compare(back.config, m.config, 1));
    free(text);
    meta_free(&back);

    meta_stamp_now(&m);
    CHECK(strlen(m.timestamp) == 19 && m.timestamp[10] == 'T');
    meta_free(&m);
}

static void expect_meta_error(const char *json, const char *want) {
    CkptMeta m;
    Err err = {0};
    CHECK_MSG(meta_parse(&m, json, "ck/meta.json", &err) == -1, "accepted %s", json);
    CHECK_MSG(contains(err.msg, "ck/meta.json: ") && contains(err.msg, want),
              "message '%s' lacks '%s'", err.msg, want);
    CHECK(m.config == NULL);
}

static void test_meta_errors(void) {
    expect_meta_error("{\"epoch\": 0,", "not valid JSON");
    expect_meta_error("[0]", "not a JSON object");
    expect_meta_error("{\"epoch\": 0, \"consumed_samples\": 1} trailing", "not valid JSON");
    expect_meta_error("{\"consumed_samples\": 1}", "missing key \"epoch\"");
    expect_meta_error("{\"epoch\": 1}", "missing key \"consumed_samples\"");
    expect_meta_error("{\"epoch\": \"x\", \"consumed_samples\": 1}",
                      "\"epoch\" must be a non-negative integer, got \"x\"");
    expect_meta_error("{\"epoch\": -1, \"consumed_samples\": 1}",
                      "\"epoch\" must be a non-negative integer, got -1");
    expect_meta_error("{\"epoch\": 0, \"consumed_samples\": 1.5}",
                      "\"consumed_samples\" must be a non-negative integer, got 1.5");
    expect_meta_error("{\"epoch\": 0, \"consumed_samples\": null}",
                      "\"consumed_samples\" must be a non-negative integer, got null");
    expect_meta_error("{\"epoch\": 0, \"consumed_samples\": 1, \"step\": -3}",
                      "\"step\" must be a non-negative integer, got -3");
    expect_meta_error("{\"epoch\": 0, \"consumed_samples\": 1, \"timestamp\": 5}",
                      "\"timestamp\" must be a string");
    expect_meta_error("{\"epoch\": 0, \"consumed_samples\": 1, \"epoch\": 2}",
                      "key \"epoch\" appears twice");

    CkptMeta m;
    Err err = {0};
    CHECK(meta_load(&m, "no/such/meta.json", &err) == -1);
    CHECK_MSG(contains(err.msg, "no/such/meta.json: cannot open: No such file"), "%s", err.msg);
}

// ---------------------------------------------------------------- file helpers

static void test_fsutil(void) {
    char file[PATH_MAX], dir[PATH_MAX];
    Err err = {0};
    path_in(file, "fs/atomic.txt");
    CHECK(fs_write_file_atomic(file, "x", 1, &err) == -1); // no parent directory yet
    CHECK_MSG(contains(err.msg, "fs/atomic.txt") && contains(err.msg, "No such file"), "%s",
              err.msg);
    path_in(dir, "fs");
    CHECK(fs_mkdir_p(dir, &err) == 0);
    CHECK(fs_mkdir_p(dir, &err) == 0); // already there
    CHECK(fs_write_file_atomic(file, "first", 5, &err) == 0);
    CHECK(fs_write_file_atomic(file, "second", 6, &err) == 0);
    char *data;
    size_t len;
    CHECK(fs_read_file(file, &data, &len, &err) == 0);
    CHECK(len == 6 && strcmp(data, "second") == 0);
    free(data);
    CHECK(fs_is_file(file) && !fs_is_dir(file));
    CHECK(!dir_entries_starting(dir, "atomic.txt.tmp"));

    char under_file[PATH_MAX];
    path_in(under_file, "fs/atomic.txt/sub");
    CHECK(fs_mkdir_p(under_file, &err) == -1);
    CHECK_MSG(contains(err.msg, "atomic.txt/sub"), "%s", err.msg);
    CHECK(fs_read_file(dir, &data, &len, &err) == -1);
    CHECK_MSG(contains(err.msg, "not a regular file"), "%s", err.msg);

    // rm -rf does not follow a symlink out of the tree.
    char outside[PATH_MAX], keep[PATH_MAX], tree[PATH_MAX], link[PATH_MAX];
    path_in(outside, "outside");
    path_in(keep, "outside/keep.txt");
    path_in(tree, "fs/tree/a/b");
    path_in(link, "fs/tree/a/link");
    CHECK(fs_mkdir_p(outside, &err) == 0 && fs_mkdir_p(tree, &err) == 0);
    CHECK(fs_write_file_synced(keep, "k", 1, &err) == 0);
    CHECK(symlink(outside, link) == 0);
    path_in(tree, "fs/tree");
    CHECK_MSG(fs_remove_tree(tree, &err) == 0, "%s", err.msg);
    CHECK(!fs_is_dir(tree));
    CHECK(fs_is_file(keep));
    CHECK(fs_remove_tree(tree, &err) == 0); // missing is fine
}

int main(void) {
    snprintf(root, sizeof root, "%s/astrai_test_checkpoint_XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    test_commit_and_latest();
    test_replace();
    test_abort_and_bad_names();
    test_crash_leaves_previous();
    test_parse_name();
    test_meta_astrai();
    test_meta_errors();
    test_fsutil();
    Err err = {0};
    if (check_failures == 0) fs_remove_tree(root, &err); // keep it for a look when failing
    CHECK_DONE();
}
