// job_paths.c: the paths of a job, checked at submit as astraid's user, so that a job
// that cannot run is refused at once instead of failing after hours in the queue, and
// so that two jobs never write one checkpoint directory (docs/astraid.md "Paths").
//
//   param_path      a directory with config.json, and model.safetensors (or the index of a
//                   sharded set) unless it is a checkpoint (meta.json): what a run loads
//   data_root_path  a dataset directory; for dpo/grpo also a record file (.jsonl)
//   sample_prompts, tokenizer, chat_template  when given (tokenizer: but "bytes"), readable
//   ckpt_dir        can be created and written; not a system directory, not inside
//                   astraid's state directory (but for the job's own run directory), and
//                   no other live job's ckpt_dir, nor inside or around one
//
// ckpt_dir need not exist yet: it is compared by its canonical form, the real path of
// its longest existing prefix (symlinks resolved, a dangling one followed) and the rest,
// resolved once when the job is accepted or adopted (Job.ckpt_real): a submit compares
// with the live jobs' forms, it does not resolve each of them again.
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/fsutil.h"
#include "common/path.h"
#include "daemon/daemon.h"

// The top-level directories no job may write checkpoints into; "lib" stands for every
// /lib* (/lib32, /lib64, ...), and /var/tmp is the one place under /var that may.
static const char *const SYSTEM_DIRS[] = {"bin", "boot", "dev", "etc", "lib", "proc",
                                          "run", "sbin", "sys", "usr", "var"};

// 1 if path is dir or inside it (both canonical).
static int is_within(const char *path, const char *dir) {
    size_t n = strlen(dir);
    if (!strcmp(dir, "/")) return 1;
    return !strncmp(path, dir, n) && (path[n] == 0 || path[n] == '/');
}

// ---------------------------------------------------------------- canonical paths

#define MAX_LINKS 40 // dangling symlinks followed in one path, as the kernel's ELOOP bound

// out = the canonical form of the absolute path (see the top); *existing = the length of
// its part that exists (the nearest existing ancestor, or the whole path). A dangling
// symlink on the way is followed by hand (its target is where mkdir -p will create).
static int canonical_at(const char *key, const char *path, char *out, size_t *existing, int links,
                        Err *err) {
    char copy[PATH_MAX], prefix[PATH_MAX], target[PATH_MAX];
    const char *names[PATH_MAX / 2];
    int n = 0;
    if (snprintf(copy, sizeof copy, "%s", path) >= (int)sizeof copy)
        return err_set(err, "%s: '%s' is too long", key, path);
    for (char *save = NULL, *s = strtok_r(copy, "/", &save); s; s = strtok_r(NULL, "/", &save))
        if (strcmp(s, ".")) names[n++] = s;
    // The longest prefix of names that exists, resolved by the kernel (".." included).
    int k = n;
    struct stat st;
    for (;; k--) {
        size_t len = 0;
        prefix[0] = 0;
        for (int i = 0; i < k; i++)
            len += (size_t)snprintf(prefix + len, sizeof prefix - len, "/%s", names[i]);
        if (realpath(k ? prefix : "/", out)) break;
        if (errno != ENOENT) return err_errno(err, errno, "%s: %s", key, prefix);
        if (lstat(prefix, &st) || !S_ISLNK(st.st_mode)) continue;
        // prefix is a dangling symlink: its target, then the rest of the names.
        ssize_t t = readlink(prefix, target, sizeof target - 1);
        if (t < 0 || links >= MAX_LINKS)
            return err_set(err, "%s: %s: a symlink that cannot be followed", key, prefix);
        target[t] = 0;
        char next[PATH_MAX];
        int dir = (int)(strrchr(prefix, '/') - prefix); // a relative target is from there
        int m = target[0] == '/' ? snprintf(next, sizeof next, "%s", target)
                                 : snprintf(next, sizeof next, "%.*s/%s", dir, prefix, target);
        for (int i = k; i < n && m > 0 && (size_t)m < sizeof next; i++)
            m += snprintf(next + m, sizeof next - (size_t)m, "/%s", names[i]);
        if (m < 0 || (size_t)m >= sizeof next)
            return err_set(err, "%s: '%s' is too long", key, path);
        return canonical_at(key, next, out, existing, links + 1, err);
    }
    *existing = strlen(out);
    // The rest does not exist yet: mkdir -p creates real directories, so ".." is lexical.
    for (int i = k; i < n; i++) {
        size_t len = strlen(out);
        if (!strcmp(names[i], "..")) {
            char *slash = strrchr(out, '/');
            slash[slash == out] = 0; // "/a/b" -> "/a", "/a" -> "/"
        } else if (len + 1 + strlen(names[i]) >= PATH_MAX) {
            return err_set(err, "%s: '%s' is too long", key, path);
        } else {
            snprintf(out + len, PATH_MAX - len, "%s%s", len > 1 ? "/" : "", names[i]);
        }
    }
    return 0;
}

static int canonical(const char *key, const char *path, char *out, size_t *existing, Err *err) {
    return canonical_at(key, path, out, existing, 0, err);
}

// ---------------------------------------------------------------- what a run reads

static int readable_dir(const char *key, const char *path, Err *err) {
    if (!fs_is_dir(path))
        return access(path, F_OK) ? err_errno(err, errno, "%s: %s", key, path)
                                  : err_set(err, "%s: %s is not a directory", key, path);
    if (access(path, R_OK | X_OK))
        return err_errno(err, errno, "%s: %s cannot be read by astraid's user", key, path);
    return 0;
}

static int has_file(const char *dir, const char *name) {
    char path[PATH_MAX];
    return !path_join(path, sizeof path, dir, name, NULL) && fs_is_file(path) &&
           access(path, R_OK) == 0;
}

static int check_param_path(const char *dir, Err *err) {
    if (readable_dir("param_path", dir, err)) return -1;
    if (!has_file(dir, "config.json"))
        return err_set(err,
                       "param_path: %s has no readable config.json (a model directory holds "
                       "config.json and model.safetensors)",
                       dir);
    if (!has_file(dir, "model.safetensors") && !has_file(dir, "model.safetensors.index.json") &&
        !has_file(dir, "meta.json"))
        return err_set(err,
                       "param_path: %s has no readable model.safetensors (nor the "
                       "model.safetensors.index.json of sharded weights, nor meta.json of a "
                       "checkpoint)",
                       dir);
    return 0;
}

// A dataset directory (astrai-data prep); dpo and grpo also read a record file; the online
// strategies read a prompts file only.
static int check_data_root(const char *path, const TrainSpec *t, Err *err) {
    TrainType tt = t->is.train_type;
    int records = tt == TRAIN_DPO || tt == TRAIN_GRPO;
    if (tt == TRAIN_ONLINE_GRPO || tt == TRAIN_ONLINE_DPO) {
        if (!fs_is_file(path))
            return access(path, F_OK) ? err_errno(err, errno, "data_root_path: %s", path)
                                      : err_set(err,
                                                "data_root_path: %s is not a file (%s: a "
                                                "prompts .jsonl file)",
                                                path, t->train_type);
        return access(path, R_OK)
                   ? err_errno(err, errno, "data_root_path: %s cannot be read by astraid's user",
                               path)
                   : 0;
    }
    if (records && fs_is_file(path))
        return access(path, R_OK)
                   ? err_errno(err, errno, "data_root_path: %s cannot be read by astraid's user",
                               path)
                   : 0;
    if (readable_dir("data_root_path", path, err))
        return records ? err_prefix(err, "(dpo/grpo: record shards or a .jsonl file)")
                       : err_prefix(err, "(%s: a dataset directory of astrai-data prep)",
                                    t->train_type);
    return 0;
}

// What the samples read (train/samples.h), where the spec names it: readable, and a file but for
// the tokenizer (a tokenizer.json or its directory, whose contents the run checks).
static int check_sample_paths(const TrainSpec *t, Err *err) {
    const struct {
        const char *key, *path;
        bool file;
    } paths[] = {{"sample_prompts", t->sample_prompts, true},
                 {"tokenizer", t->tokenizer, false},
                 {"chat_template", t->chat_template, true}};
    for (size_t i = 0; i < sizeof paths / sizeof *paths; i++) {
        const char *key = paths[i].key, *path = paths[i].path;
        if (!job_spec_value_is_path(key, path)) continue;
        if (access(path, R_OK))
            return err_errno(err, errno, "%s: %s cannot be read by astraid's user", key, path);
        if (paths[i].file && !fs_is_file(path))
            return err_set(err, "%s: %s is not a file", key, path);
    }
    return 0;
}

// ---------------------------------------------------------------- ckpt_dir

int job_ckpt_dir_usable(const Job *j, Err *err) {
    char path[PATH_MAX];
    size_t existing;
    if (canonical("ckpt_dir", j->ckpt_dir, path, &existing, err)) return -1;
    path[existing] = 0; // the nearest existing ancestor, or ckpt_dir itself
    if (!fs_is_dir(path))
        return err_set(err, "ckpt_dir: %s is not a directory, so %s cannot be created", path,
                       j->ckpt_dir);
    if (access(path, W_OK | X_OK)) // EROFS: a read-only file system, even for root
        return err_errno(err, errno, "ckpt_dir: %s cannot be written by astraid's user (uid %d)",
                         path, (int)geteuid());
    return 0;
}

// The entry of SYSTEM_DIRS the canonical path is in, or NULL.
static const char *system_dir(const char *path) {
    const char *top = path + 1;
    size_t n = strcspn(top, "/");
    if (is_within(path, "/var/tmp")) return NULL;
    for (size_t i = 0; i < sizeof SYSTEM_DIRS / sizeof *SYSTEM_DIRS; i++) {
        const char *dir = SYSTEM_DIRS[i];
        int lib = !strcmp(dir, "lib") && !strncmp(top, dir, 3);
        if (lib || (strlen(dir) == n && !strncmp(top, dir, n))) return dir;
    }
    return NULL;
}

// Not the root or a system directory, nor in astraid's state directory but for the job's
// own run directory (where the default ckpt_dir is).
static int check_ckpt_place(const Job *j, const char *path, Err *err) {
    char state[PATH_MAX], run_dir[PATH_MAX], own[PATH_MAX];
    size_t existing;
    if (canonical("state-dir", astraid.cfg.state_dir, state, &existing, err) ||
        job_run_dir(j, run_dir, sizeof run_dir) ||
        canonical("ckpt_dir", run_dir, own, &existing, err))
        return -1;
    if (is_within(path, own)) return 0;
    if (!strcmp(path, "/")) return err_set(err, "ckpt_dir: %s is the root directory", j->ckpt_dir);
    if (is_within(path, state) || is_within(state, path))
        return err_set(err,
                       "ckpt_dir: %s %s astraid's state directory %s (there, only the job's own "
                       "run directory %s may hold its checkpoints)",
                       j->ckpt_dir, is_within(path, state) ? "is inside" : "contains", state, own);
    const char *sys = system_dir(path);
    if (sys)
        return err_set(err,
                       "ckpt_dir: %s is in the system directory /%s%s (use a directory of "
                       "your own, /tmp or /var/tmp)",
                       j->ckpt_dir, sys, strcmp(sys, "lib") ? "" : "*");
    return 0;
}

// A path of the spec that the job cannot use is bad input, even for EACCES or EROFS.
static int spec_path_refused(Err *err) {
    err->resource = 0;
    return -1;
}

int job_ckpt_dir_resolve(Job *j, Err *err) {
    char path[PATH_MAX];
    size_t existing;
    free(j->ckpt_real);
    j->ckpt_real = NULL;
    if (canonical("ckpt_dir", j->ckpt_dir, path, &existing, err)) return spec_path_refused(err);
    j->ckpt_real = strdup(path);
    return j->ckpt_real ? 0 : err_resource(err, "ckpt_dir: out of memory");
}

int job_ckpt_dir_free(const Job *j, Err *err) {
    char own[PATH_MAX];
    size_t existing;
    // A job whose ckpt_dir did not resolve when it was adopted: say why now.
    const char *path = j->ckpt_real;
    if (!path && canonical("ckpt_dir", j->ckpt_dir, own, &existing, err)) return -1;
    if (!path) path = own;
    for (const Job *o = astraid.jobs; o; o = o->next) {
        // a path that did not resolve is no one's checkpoint directory
        const char *other = o->ckpt_real;
        if (o == j || job_is_final(o->state) || !other) continue;
        if (is_within(path, other) || is_within(other, path))
            return err_set(err,
                           "ckpt_dir: %s %s job %ld's ckpt_dir %s (job %ld is %s; two live jobs "
                           "would overwrite each other's checkpoints)",
                           j->ckpt_dir,
                           !strcmp(path, other)     ? "is"
                           : is_within(path, other) ? "is inside"
                                                    : "contains",
                           o->id, o->ckpt_dir, o->id, job_state_name(o->state));
    }
    return 0;
}

int job_paths_check(Job *j, Err *err) {
    const char *param = j->js.train.param_path, *data = j->js.train.data_root_path;
    if (!param || !data || j->js.train.is.train_type == TRAIN_UNSET)
        return err_set(err, "param_path, data_root_path and train_type are required");
    if (check_param_path(param, err) || check_data_root(data, &j->js.train, err) ||
        check_sample_paths(&j->js.train, err))
        return spec_path_refused(err);
    if (job_ckpt_dir_resolve(j, err)) return -1; // refused, or out of memory
    if (check_ckpt_place(j, j->ckpt_real, err) || job_ckpt_dir_usable(j, err) ||
        job_ckpt_dir_free(j, err))
        return spec_path_refused(err);
    return 0;
}
