// history.c: finished jobs do not pile up forever. `rm JOB` removes one final job;
// --keep-finished N keeps the N most recently finished jobs, --keep-finished Dd those
// finished within the last D days; the retention runs at startup and after a job
// becomes final.
//
// A removed job loses its row, runs and events in one transaction (nothing changes
// when it cannot commit; written off the loop, the job stays until it committed), then
// its run directory (logs, progress.db) on libuv's threadpool. Its ckpt_dir is never touched: when
// it lies inside the run directory (the default, state_dir/jobs/<id>/checkpoints) that directory
// stays with the checkpoints alone, and its id is never given again (jobs.c).
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fsutil.h"
#include "common/path.h"
#include "daemon/daemon.h"

#define KEEP_MAX 1e12 // a count or a number of days beyond any real history

static long keep_count = -1; // keep the N most recently finished jobs, -1: no count
static double keep_s = -1;   // keep those finished within this many seconds, -1: no age

int retention_configure(const char *spec, Err *err) {
    if (!spec) return 0;
    char *end;
    errno = 0;
    double x = strtod(spec, &end);
    int days = end[0] == 'd' && end[1] == 0;
    if (spec[0] < '0' || spec[0] > '9' || errno || !(x <= KEEP_MAX) || (*end && !days) ||
        (!days && x != floor(x)))
        return err_set(err,
                       "keep-finished: '%s' is neither a count of jobs (e.g. 100) nor days "
                       "(e.g. 7d)",
                       spec);
    if (days)
        keep_s = x * 86400;
    else
        keep_count = (long)x;
    return 0;
}

// ---------------------------------------------------------------- the run directory

// Removes dir but the subtree `keep` inside it (NULL: dir whole). keep is a real path
// (no symlink, no ..), so every directory on the way to it is a real directory.
static int remove_except(const char *dir, const char *keep, Err *err) {
    if (!keep) return fs_remove_tree(dir, err);
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : err_errno(err, errno, "%s: cannot list", dir);
    int rc = 0;
    struct dirent *e;
    while (!rc && (e = readdir(d))) {
        char path[PATH_MAX];
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (path_join(path, sizeof path, dir, e->d_name, err)) {
            rc = -1;
            break;
        }
        size_t n = strlen(path);
        if (!strcmp(path, keep)) continue;
        rc = !strncmp(keep, path, n) && keep[n] == '/' ? remove_except(path, keep, err)
                                                       : fs_remove_tree(path, err);
    }
    closedir(d);
    return rc;
}

typedef struct {
    uv_work_t req;
    long id;
    char dir[PATH_MAX];  // the run directory, a real path
    char keep[PATH_MAX]; // the ckpt_dir when it lies inside dir, else ""
    Err err;
    int rc;
} Removal;

static void removal_work(uv_work_t *w) {
    Removal *r = w->data;
    r->rc = remove_except(r->dir, r->keep[0] ? r->keep : NULL, &r->err);
}

static void removal_done(uv_work_t *w, int status) {
    Removal *r = w->data;
    if (status || r->rc)
        log_warn("job %ld: removing %s: %s", r->id, r->dir,
                 status ? uv_strerror(status) : r->err.msg);
    free(r);
}

// Queues the removal of j's run directory but its ckpt_dir.
static void remove_run_dir(const Job *j) {
    char run_dir[PATH_MAX], ckpt[PATH_MAX];
    Removal *r = calloc(1, sizeof *r);
    if (!r || job_run_dir(j, run_dir, sizeof run_dir) || !realpath(run_dir, r->dir)) {
        free(r); // no run directory: nothing to remove
        return;
    }
    size_t n = strlen(r->dir);
    int has_ckpt = realpath(j->ckpt_dir, ckpt) != NULL; // else no checkpoint was ever written
    if (has_ckpt && !strcmp(ckpt, r->dir)) {
        log_info("job %ld: %s is its ckpt_dir: kept", j->id, r->dir);
        free(r);
        return;
    }
    if (has_ckpt && !strncmp(ckpt, r->dir, n) && ckpt[n] == '/')
        snprintf(r->keep, sizeof r->keep, "%s", ckpt);
    r->id = j->id;
    r->req.data = r;
    if (uv_queue_work(astraid.loop, &r->req, removal_work, removal_done)) free(r);
}

// ---------------------------------------------------------------- removing jobs

// A removal on its way to the database: the jobs stay (removing: hidden from clients, no
// verb, no second removal) until their rows are gone.
typedef struct {
    Job **jobs; // (n,)
    size_t n;
    ChangeDone done; // NULL: the retention's
    void *arg;
} Deletion;

static void deletion_free(Deletion *r) {
    free(r->jobs);
    free(r);
}

static void rows_removed(void *arg, const Err *err) {
    Deletion *r = arg;
    job_changed(NULL, JOB_GONE, NULL); // the jobs are gone, or shown again (the database failed)
    for (size_t i = 0; i < r->n; i++) {
        Job *j = r->jobs[i];
        j->rows.removing = 0;
        if (err->msg[0]) continue; // the database failed: the job stays
        log_info("job %ld removed%s", j->id, r->done ? "" : " (keep-finished)");
        remove_run_dir(j);
        for (Job **p = &astraid.jobs; *p; p = &(*p)->next)
            if (*p == j) {
                *p = j->next;
                break;
            }
        job_free(j);
    }
    if (r->done) r->done(r->arg, err->msg[0] ? RPC_INTERNAL_ERROR : 0, err);
    deletion_free(r);
}

// Takes r (its jobs, and done): -1 when its write cannot be queued (no memory).
static int remove_jobs(Deletion *r, Err *err) {
    long *ids = malloc(r->n * sizeof *ids);
    for (size_t i = 0; ids && i < r->n; i++)
        ids[i] = r->jobs[i]->id;
    int rc = ids ? state_delete_jobs(ids, r->n, rows_removed, r, err)
                 : err_resource(err, "out of memory");
    free(ids);
    if (rc) {
        deletion_free(r);
        return -1;
    }
    for (size_t i = 0; i < r->n; i++)
        r->jobs[i]->rows.removing = 1;
    job_changed(NULL, JOB_GONE, NULL); // hidden from now on
    return 0;
}

// A final job whose ranks are gone and that no change or removal is under way for.
static int removable(const Job *j) {
    return job_is_final(j->state) && !job_has_run(j) && !j->ending && !j->rows.changing &&
           !j->rows.removing && !j->rows.launching; // its start's preflight holds it
}

int job_remove(Job *j, ChangeDone done, void *arg, int *code, Err *err) {
    if (!removable(j)) {
        *code = RPC_BAD_STATE;
        return err_set(err,
                       "job %ld is %s%s: cannot rm (only a completed, failed or cancelled job)",
                       j->id, job_state_name(j->state),
                       job_has_run(j) || j->ending ? " and its ranks are still exiting"
                       : j->rows.changing          ? " and a change of it is being written"
                       : j->rows.launching         ? " and its start is being checked"
                                                   : "");
    }
    Deletion *r = malloc(sizeof *r);
    Job **jobs = r ? malloc(sizeof *jobs) : NULL;
    if (!jobs) {
        free(r);
        *code = RPC_INTERNAL_ERROR;
        return err_resource(err, "out of memory");
    }
    jobs[0] = j;
    *r = (Deletion){jobs, 1, done, arg};
    if (remove_jobs(r, err)) {
        *code = RPC_INTERNAL_ERROR;
        return -1;
    }
    return 0;
}

// Newest first: by finished_at, then by id.
static int finished_later(const void *a, const void *b) {
    const Job *x = *(Job *const *)a, *y = *(Job *const *)b;
    if (x->finished_at != y->finished_at) return x->finished_at < y->finished_at ? 1 : -1;
    return (x->id < y->id) - (x->id > y->id);
}

// The jobs the retention does not keep go in one transaction.
void retention_apply(void) {
    if (keep_count < 0 && keep_s < 0) return;
    size_t n = 0;
    for (Job *j = astraid.jobs; j; j = j->next)
        n += removable(j);
    Deletion *r = n ? calloc(1, sizeof *r) : NULL;
    Job **done = r ? malloc(n * sizeof *done) : NULL;
    if (!done) {
        free(r);
        return;
    }
    n = 0;
    for (Job *j = astraid.jobs; j; j = j->next)
        if (removable(j)) done[n++] = j;
    qsort(done, n, sizeof *done, finished_later);
    double now = clock_wall_s();
    for (size_t i = 0; i < n; i++)
        if ((keep_count >= 0 && (long)i >= keep_count) ||
            (keep_s >= 0 && now - done[i]->finished_at > keep_s))
            done[r->n++] = done[i]; // in place: r->n <= i
    r->jobs = done;
    if (!r->n) {
        deletion_free(r);
        return;
    }
    log_info("keep-finished %s: removing %zu finished job(s)", astraid.cfg.keep_finished, r->n);
    Err err = {0};
    if (remove_jobs(r, &err)) log_warn("keep-finished: %s", err.msg); // again at the next end
}

// ---------------------------------------------------------------- after a job ends

static uv_timer_t retention_timer; // fires once the request that ended a job is done
static int retention_timer_ready;

static void on_retention_timer(uv_timer_t *t) {
    (void)t;
    retention_apply();
}

// The job that just became final may still be in use up the stack (a verb's reply):
// the retention runs from the loop, never from inside the change.
static void retention_schedule(void) {
    if (keep_count < 0 && keep_s < 0) return;
    if (!retention_timer_ready) {
        uv_timer_init(astraid.loop, &retention_timer);
        retention_timer_ready = 1;
    }
    if (!uv_is_closing((uv_handle_t *)&retention_timer))
        uv_timer_start(&retention_timer, on_retention_timer, 0, 0);
}

void retention_on_job(const Job *j, JobChange what, const char *event) {
    (void)j, (void)event;
    if (what == JOB_FINAL) retention_schedule();
}
