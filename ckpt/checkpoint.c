// checkpoint.c: write-to-temp, fsync, rename: the atomic checkpoint directory.
#include "ckpt/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "common/path.h"

#define TMP_PREFIX ".tmp-"
#define OLD_PREFIX ".old-"
// Inside every temporary directory astrai makes (ckpt_begin, ckpt_remove): only a `.tmp-*` entry
// holding it is ever cleaned, so a user's own `.tmp-notes/` is left alone.
#define TMP_MARKER ".astrai-tmp"

// This process's run (ckpt_set_run): what the ledger records with each commit.
static char current_run[64] = "-";

void ckpt_set_run(const char *run) {
    snprintf(current_run, sizeof current_run, "%s", run && *run ? run : "-");
}

const char *ckpt_current_run(void) {
    return current_run;
}

// A checkpoint name is one path component that cannot collide with our temp names.
static int check_name(const char *name, Err *err) {
    if (name[0] == '\0' || name[0] == '.' || strchr(name, '/'))
        return err_set(err,
                       "bad checkpoint name '%s' (one path component, not starting "
                       "with '.')",
                       name);
    return 0;
}

int ckpt_tmp_path(const char *ckpt_dir, const char *name, long writer, char *out, size_t cap,
                  Err *err) {
    char base[NAME_MAX + 1];
    if (check_name(name, err)) return -1;
    if ((size_t)snprintf(base, sizeof base, TMP_PREFIX "%s-%ld", name, writer) >= sizeof base)
        return err_set(err, "checkpoint name '%s' too long", name);
    return path_join(out, cap, ckpt_dir, base, err);
}

// The marker that makes dir a temporary directory of astrai's (TMP_MARKER).
static int write_marker(const char *dir, Err *err) {
    char path[PATH_MAX];
    static const char TEXT[] = "astrai: a checkpoint being written or removed\n";
    return path_join(path, sizeof path, dir, TMP_MARKER, err) ||
           fs_write_file_synced(path, TEXT, sizeof TEXT - 1, err);
}

static bool has_marker(const char *dir) {
    char path[PATH_MAX];
    return (size_t)snprintf(path, sizeof path, "%s/%s", dir, TMP_MARKER) < sizeof path &&
           fs_is_file(path);
}

int ckpt_begin(const char *ckpt_dir, const char *name, char *tmp_path_out, size_t cap, Err *err) {
    if (check_name(name, err) != 0 || fs_mkdir_p(ckpt_dir, err) != 0 ||
        ckpt_tmp_path(ckpt_dir, name, (long)getpid(), tmp_path_out, cap, err))
        return -1;
    // A leftover of an earlier attempt by a process with our pid is garbage.
    if (fs_remove_tree(tmp_path_out, err) != 0) return -1;
    if (mkdir(tmp_path_out, 0755) != 0)
        return err_errno(err, errno, "%s: cannot create directory", tmp_path_out);
    return write_marker(tmp_path_out, err);
}

static int fsync_file(const char *path, Err *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return err_errno(err, errno, "%s: cannot open", path);
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0) return err_errno(err, e, "%s: fsync failed", path);
    return 0;
}

// Fsyncs every regular file of dir (recursively) and then dir itself.
static int fsync_tree(const char *dir, Err *err) {
    DIR *d = opendir(dir);
    if (!d) return err_errno(err, errno, "%s: cannot list", dir);
    int rc = 0;
    struct dirent *ent;
    while (rc == 0 && (ent = readdir(d)) != NULL) {
        if (strcmp(ent->d_name, ".") == 0 || strcmp(ent->d_name, "..") == 0) continue;
        char path[PATH_MAX];
        if (path_join(path, sizeof path, dir, ent->d_name, err) != 0) {
            rc = -1;
        } else if (fs_is_dir(path)) {
            rc = fsync_tree(path, err);
        } else if (fs_is_file(path)) {
            rc = fsync_file(path, err);
        }
    }
    closedir(d);
    return rc ? rc : fs_fsync_dir(dir, err);
}

static int rename_or_fail(const char *from, const char *to, Err *err) {
    if (rename(from, to) != 0) return err_errno(err, errno, "cannot rename %s to %s", from, to);
    return 0;
}

// ---------------------------------------------------------------- the ledger
// ckpt_dir/.astrai-ledger: one line per checkpoint astrai committed into ckpt_dir ("commit NAME
// RUN") or removed from it ("remove NAME"), appended and fsynced; the line number orders the
// commits. A torn last line (a crash while appending) has no newline and is ignored.

static int ledger_path(const char *ckpt_dir, char *out, size_t cap, Err *err) {
    return path_join(out, cap, ckpt_dir, CKPT_LEDGER, err);
}

static int ledger_append(const char *ckpt_dir, const char *verb, const char *name, Err *err) {
    char path[PATH_MAX], line[NAME_MAX + 128];
    int n = !strcmp(verb, "commit")
                ? snprintf(line, sizeof line, "commit %s %s\n", name, current_run)
                : snprintf(line, sizeof line, "%s %s\n", verb, name);
    if (n < 0 || (size_t)n >= sizeof line)
        return err_set(err, "checkpoint name '%s' too long", name);
    if (ledger_path(ckpt_dir, path, sizeof path, err)) return -1;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return err_errno(err, errno, "%s: cannot open", path);
    int rc = write(fd, line, (size_t)n) == n && fsync(fd) == 0 ? 0 : -1;
    int e = errno;
    close(fd);
    if (rc) return err_errno(err, e, "%s: cannot append", path);
    return 0;
}

// The ledger's live commit of name (the last line about it is a commit) into e.
static void ledger_lookup(const char *text, const char *name, CkptEntry *e) {
    e->ours = false;
    long seq = 0;
    for (const char *line = text; line && *line; seq++) {
        const char *end = strchr(line, '\n');
        if (!end) break; // torn
        char verb[16], nm[NAME_MAX + 1], run[64] = "-";
        char buf[NAME_MAX + 128];
        size_t len = (size_t)(end - line);
        if (len < sizeof buf) {
            memcpy(buf, line, len);
            buf[len] = '\0';
            int got = sscanf(buf, "%15s %255s %63s", verb, nm, run);
            if (got >= 2 && !strcmp(nm, name)) {
                e->ours = !strcmp(verb, "commit");
                e->seq = seq;
                snprintf(e->run, sizeof e->run, "%s", run);
            }
        }
        line = end + 1;
    }
}

// The ledger's text into *text (NULL with *present false when ckpt_dir has none).
static int ledger_read(const char *ckpt_dir, char **text, bool *present, Err *err) {
    char path[PATH_MAX];
    size_t len;
    *text = NULL;
    *present = false;
    if (ledger_path(ckpt_dir, path, sizeof path, err)) return -1;
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : err_errno(err, errno, "%s", path);
    if (!S_ISREG(st.st_mode)) return err_set(err, "%s: not a regular file", path);
    *present = true;
    return fs_read_file(path, text, &len, err);
}

// A checkpoint replaces only one astrai committed under that name: a user's directory or a
// symlink there is never moved aside and deleted.
static int refuse_foreign(const char *ckpt_dir, const char *name, const char *final_path,
                          Err *err) {
    struct stat st;
    if (lstat(final_path, &st) != 0) return 0;
    char *ledger;
    bool present;
    if (ledger_read(ckpt_dir, &ledger, &present, err)) return -1;
    CkptEntry e = {0};
    ledger_lookup(ledger, name, &e);
    free(ledger);
    if (S_ISDIR(st.st_mode) && e.ours) return 0;
    return err_set(err,
                   "%s exists and is not a checkpoint astrai committed there (not in %s/%s): "
                   "move it away; it is never replaced",
                   final_path, ckpt_dir, CKPT_LEDGER);
}

int ckpt_commit(const char *ckpt_dir, const char *tmp_path, const char *name, Err *err) {
    char final_path[PATH_MAX], old_path[PATH_MAX], old_base[NAME_MAX + 1];
    if (check_name(name, err) != 0 || path_join(final_path, sizeof final_path, ckpt_dir, name, err))
        return -1;
    if ((size_t)snprintf(old_base, sizeof old_base, OLD_PREFIX "%s-%ld", name, (long)getpid()) >=
            sizeof old_base ||
        path_join(old_path, sizeof old_path, ckpt_dir, old_base, err) != 0)
        return err_set(err, "checkpoint name '%s' too long", name);
    char marker[PATH_MAX];
    if (path_join(marker, sizeof marker, tmp_path, TMP_MARKER, err)) return -1;
    if (unlink(marker) != 0 && errno != ENOENT)
        return err_errno(err, errno, "%s: cannot remove", marker);
    if (refuse_foreign(ckpt_dir, name, final_path, err) || fsync_tree(tmp_path, err) != 0)
        return -1;
    // The ledger names it before it lands: a crash in between leaves an entry whose directory is
    // missing (skipped), never a committed checkpoint astrai would not know as its own.
    if (ledger_append(ckpt_dir, "commit", name, err)) return -1;
    // Replacing: move the old one aside first (a crash in between leaves it under
    // .old-*, which ckpt_remove_stale puts back), then the new one in.
    int replacing = fs_is_dir(final_path);
    if (replacing) {
        if (fs_remove_tree(old_path, err) != 0) return -1;
        if (rename_or_fail(final_path, old_path, err) != 0) return -1;
    }
    if (rename_or_fail(tmp_path, final_path, err) != 0) {
        if (replacing) rename(old_path, final_path); // best effort: put the old one back
        return -1;
    }
    if (fs_fsync_dir(ckpt_dir, err) != 0) return -1;
    return replacing ? fs_remove_tree(old_path, err) : 0;
}

int ckpt_abort(const char *tmp_path, Err *err) {
    return fs_remove_tree(tmp_path, err);
}

// Parses the decimal digits at *p (at least one) and advances *p past them.
static int parse_digits(const char **p, long *out) {
    const char *s = *p;
    long v = 0;
    if (*s < '0' || *s > '9') return -1;
    for (; *s >= '0' && *s <= '9'; s++) {
        if (v > (LONG_MAX - 9) / 10) return -1;
        v = v * 10 + (*s - '0');
    }
    *p = s;
    *out = v;
    return 0;
}

int ckpt_parse_name(const char *name, long *epoch, long *step) {
    const char *p = name;
    if (strncmp(p, "epoch_", 6) != 0) return -1;
    p += 6;
    if (parse_digits(&p, epoch) != 0 || strncmp(p, "_step_", 6) != 0) return -1;
    p += 6;
    if (parse_digits(&p, step) != 0 || *p != '\0') return -1;
    return 0;
}

// A committed checkpoint: a directory with the right name and a meta.json.
static int is_checkpoint(const char *ckpt_dir, const char *name, long *epoch, long *step) {
    if (ckpt_parse_name(name, epoch, step) != 0) return 0;
    char meta[PATH_MAX];
    struct stat st; // a symlink is never a checkpoint of ckpt_dir: never loaded, never deleted
    if ((size_t)snprintf(meta, sizeof meta, "%s/%s", ckpt_dir, name) >= sizeof meta ||
        lstat(meta, &st) != 0 || !S_ISDIR(st.st_mode))
        return 0;
    if ((size_t)snprintf(meta, sizeof meta, "%s/%s/meta.json", ckpt_dir, name) >= sizeof meta)
        return 0;
    return fs_is_file(meta);
}

// Newest first: astrai's own by commit (the ledger's order), then the others by the larger step,
// then the larger epoch.
static int newer_first(const void *a, const void *b) {
    const CkptEntry *x = a, *y = b;
    if (x->ours != y->ours) return x->ours ? -1 : 1;
    if (x->ours) return x->seq > y->seq ? -1 : x->seq < y->seq;
    if (x->step != y->step) return x->step > y->step ? -1 : 1;
    return x->epoch > y->epoch ? -1 : x->epoch < y->epoch;
}

int ckpt_list(const char *ckpt_dir, CkptEntry **out, int *n, bool *has_ledger, Err *err) {
    *out = NULL;
    *n = 0;
    *has_ledger = false;
    DIR *d = opendir(ckpt_dir);
    if (!d) return errno == ENOENT ? 0 : err_errno(err, errno, "%s: cannot list", ckpt_dir);
    char *ledger;
    if (ledger_read(ckpt_dir, &ledger, has_ledger, err)) {
        closedir(d);
        return -1;
    }
    int cap = 0, rc = 0;
    struct dirent *ent;
    while (!rc && (ent = readdir(d)) != NULL) {
        long epoch, step;
        if (!is_checkpoint(ckpt_dir, ent->d_name, &epoch, &step)) continue;
        if (*n == cap) {
            CkptEntry *more = realloc(*out, (size_t)(cap = cap ? 2 * cap : 16) * sizeof *more);
            if (!more) {
                rc = err_resource(err, "%s: out of memory listing checkpoints", ckpt_dir);
                break;
            }
            *out = more;
        }
        CkptEntry *e = &(*out)[(*n)++];
        snprintf(e->name, sizeof e->name, "%s", ent->d_name);
        e->epoch = epoch;
        e->step = step;
        ledger_lookup(ledger, ent->d_name, e);
    }
    closedir(d);
    free(ledger);
    if (rc) {
        free(*out);
        *out = NULL;
        *n = 0;
        return -1;
    }
    if (*n > 1) qsort(*out, (size_t)*n, sizeof **out, newer_first);
    return 0;
}

int ckpt_find_latest(const char *ckpt_dir, char *out, size_t cap, Err *err) {
    CkptEntry *all;
    int n;
    bool has_ledger;
    if (ckpt_list(ckpt_dir, &all, &n, &has_ledger, err)) return -1;
    // With a ledger only astrai's own count; without one (AstrAI's checkpoints, or an older
    // astrai's) the largest step.
    bool found = n > 0 && (all[0].ours || !has_ledger);
    int rc = !found ? 1 : path_join(out, cap, ckpt_dir, all[0].name, err);
    free(all);
    return rc;
}

int ckpt_remove(const char *ckpt_dir, const char *name, Err *err) {
    char path[PATH_MAX], base[NAME_MAX + 1], doomed[PATH_MAX];
    if ((size_t)snprintf(base, sizeof base, TMP_PREFIX "%s-%ld", name, (long)getpid()) >=
        sizeof base)
        return err_set(err, "%s/%s: name too long", ckpt_dir, name);
    if (path_join(path, sizeof path, ckpt_dir, name, err) ||
        path_join(doomed, sizeof doomed, ckpt_dir, base, err))
        return -1;
    struct stat st;
    if (lstat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return err_set(err, "%s: not a checkpoint directory (never removed)", path);
    if (write_marker(path, err) || ledger_append(ckpt_dir, "remove", name, err)) return -1;
    if (rename(path, doomed) != 0) return err_errno(err, errno, "rename %s to %s", path, doomed);
    return fs_remove_tree(doomed, err);
}

// ".old-<name>-<pid>" → <name> into out; -1 when the entry does not have that form.
static int old_entry_name(const char *entry, char *out, size_t cap) {
    size_t plen = strlen(OLD_PREFIX);
    const char *dash = strrchr(entry, '-');
    if (strncmp(entry, OLD_PREFIX, plen) != 0 || !dash || dash <= entry + plen) return -1;
    size_t n = (size_t)(dash - entry) - plen;
    if (n >= cap) return -1;
    memcpy(out, entry + plen, n);
    out[n] = '\0';
    return 0;
}

// A replace interrupted between its two renames leaves the old checkpoint
// under .old-*: put it back when nothing took its name, else drop it.
static int settle_old(const char *ckpt_dir, const char *entry, const char *path, char *what,
                      size_t cap, Err *err) {
    char name[NAME_MAX + 1], final_path[PATH_MAX];
    if (old_entry_name(entry, name, sizeof name) == 0 &&
        path_join(final_path, sizeof final_path, ckpt_dir, name, err) == 0 &&
        !fs_is_dir(final_path)) {
        snprintf(what, cap, "restored %s from %s (a replace that did not finish)", final_path,
                 path);
        return rename_or_fail(path, final_path, err);
    }
    snprintf(what, cap, "removed %s (the old copy of a replaced checkpoint)", path);
    return fs_remove_tree(path, err);
}

// Whether entry of ckpt_dir is a directory astrai made aside: "<prefix>epoch_E_step_S-PID", a
// real directory, and for `.tmp-` one holding TMP_MARKER. Anything else is the user's.
static bool astrai_temp(const char *ckpt_dir, const char *entry) {
    bool tmp = !strncmp(entry, TMP_PREFIX, strlen(TMP_PREFIX));
    if (!tmp && strncmp(entry, OLD_PREFIX, strlen(OLD_PREFIX))) return false;
    const char *dash = strrchr(entry, '-');
    char name[NAME_MAX + 1], path[PATH_MAX];
    size_t plen = strlen(TMP_PREFIX), n = dash ? (size_t)(dash - entry) : 0;
    long pid, epoch, step;
    const char *digits = dash ? dash + 1 : NULL;
    if (!dash || n <= plen || n - plen >= sizeof name || parse_digits(&digits, &pid) || *digits)
        return false;
    memcpy(name, entry + plen, n - plen);
    name[n - plen] = '\0';
    struct stat st;
    if (ckpt_parse_name(name, &epoch, &step) ||
        (size_t)snprintf(path, sizeof path, "%s/%s", ckpt_dir, entry) >= sizeof path ||
        lstat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return false;
    return !tmp || has_marker(path);
}

// Settles one .tmp-* or .old-* entry of ckpt_dir; what says what was done.
static int settle_entry(const char *ckpt_dir, const char *entry, char *what, size_t cap, Err *err) {
    char path[PATH_MAX];
    if (path_join(path, sizeof path, ckpt_dir, entry, err) != 0) return -1;
    if (strncmp(entry, OLD_PREFIX, strlen(OLD_PREFIX)) == 0)
        return settle_old(ckpt_dir, entry, path, what, cap, err);
    snprintf(what, cap, "removed %s (a checkpoint write that did not finish)", path);
    return fs_remove_tree(path, err);
}

int ckpt_remove_stale(const char *ckpt_dir, CkptStaleReport report, void *ctx, Err *err) {
    DIR *d = opendir(ckpt_dir);
    if (!d) {
        if (errno == ENOENT) return 0;
        return err_errno(err, errno, "%s: cannot list", ckpt_dir);
    }
    int rc = 0, settled = 0;
    struct dirent *ent;
    while (rc == 0 && (ent = readdir(d)) != NULL) {
        if (!astrai_temp(ckpt_dir, ent->d_name)) continue;
        char what[2 * PATH_MAX + 64];
        rc = settle_entry(ckpt_dir, ent->d_name, what, sizeof what, err);
        if (rc == 0 && report) report(ctx, what);
        settled += rc == 0;
    }
    closedir(d);
    if (rc == 0 && settled) rc = fs_fsync_dir(ckpt_dir, err);
    return rc;
}
