// progress_reader.c: fills each running job's progress fields from the progress
// database its rank 0 writes (run_dir/progress.db, train/progress.h), read
// only, on a timer. The reads run on libuv's threadpool (a slow disk never stalls the
// loop) and their results are applied on the loop; one poll at a time, so the open
// handles it keeps are only ever used by one thread. WAL lets us read while rank 0
// writes; a busy database is simply read at the next tick, never waited on. Changes
// are pushed to watchers. A database that cannot be read for another reason (corrupt, not
// a database, an I/O error) is the job's progress_error until a read succeeds.
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sqlite3.h>

#include "daemon/daemon.h"
#include "proto/progress_db.h"

#define ETA_WINDOW 16 // steps the ETA's pace is measured over

// p's error: "progress.db: " and what sqlite says of db.
static void set_error(sqlite3 *db, JobProgress *p) {
    char msg[300];
    snprintf(msg, sizeof msg, PROGRESS_DB_FILE ": %s", sqlite3_errmsg(db));
    p->error = strdup(msg);
}

// NULL when there is none yet (the run is still starting) or it cannot be opened: then, when
// the file exists, p's error says why.
static sqlite3 *open_progress(const char *run_dir, JobProgress *p) {
    char path[PATH_MAX];
    if ((size_t)snprintf(path, sizeof path, "%s/" PROGRESS_DB_FILE, run_dir) >= sizeof path)
        return NULL;
    sqlite3 *db = NULL;
    if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) != SQLITE_OK) {
        if (access(path, F_OK) == 0) {
            *p = (JobProgress){.opened = 1, .eta_s = -1};
            set_error(db, p);
        }
        sqlite3_close(db);
        return NULL;
    }
    sqlite3_busy_timeout(db, 0);
    return db;
}

// A failed read. Busy (the writer's turn: read at the next poll) and SQLITE_ERROR (a table an
// older astrai-train did not make, or one being created) are no news; any other failure
// (corrupt, not a database, I/O, permission, memory) is the job's progress_error: the first of
// this read, "progress.db: file is not a database".
static void note_failure(sqlite3 *db, int rc, JobProgress *p) {
    int primary = rc & 0xff;
    if (primary != SQLITE_BUSY && primary != SQLITE_LOCKED && primary != SQLITE_ERROR && !p->error)
        set_error(db, p);
}

static int prepare(sqlite3 *db, const char *sql, sqlite3_stmt **st, JobProgress *p) {
    int rc = sqlite3_prepare_v2(db, sql, -1, st, NULL);
    if (rc == SQLITE_OK) return 0;
    note_failure(db, rc, p);
    return -1;
}

// Whether st has a row (else done, or a failure noted).
static int step_row(sqlite3 *db, sqlite3_stmt *st, JobProgress *p) {
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) note_failure(db, rc, p);
    return rc == SQLITE_ROW;
}

static int query_long(sqlite3 *db, const char *sql, long *out, JobProgress *p) {
    sqlite3_stmt *st;
    if (prepare(db, sql, &st, p)) return -1;
    int rc = step_row(db, st, p) ? 0 : -1;
    if (!rc) *out = (long)sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return rc;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// The median of the gaps between the walls of the n (<= ETA_WINDOW) newest steps (newest first)
// where they are consecutive, 0 for none: the hang watchdog's default limit follows it.
static double median_step_s(const long *steps, const double *walls, int n) {
    double gaps[ETA_WINDOW];
    int k = 0;
    for (int i = 0; i + 1 < n; i++)
        if (steps[i] == steps[i + 1] + 1) gaps[k++] = walls[i] - walls[i + 1];
    if (!k) return 0;
    qsort(gaps, (size_t)k, sizeof *gaps, by_value);
    return k % 2 ? gaps[k / 2] : (gaps[k / 2 - 1] + gaps[k / 2]) / 2;
}

// The newest rows: the latest values, the pace (seconds per step) for the ETA, and the median
// step time.
static void read_steps(sqlite3 *db, long total_steps, JobProgress *p) {
    sqlite3_stmt *st;
    p->eta_s = -1;
    if (prepare(db, PROGRESS_DB_LATEST_STEPS, &st, p)) return;
    sqlite3_bind_int(st, 1, ETA_WINDOW);
    int n = 0;
    long first_step = 0, last_step = 0, steps[ETA_WINDOW];
    double first_wall = 0, last_wall = 0, walls[ETA_WINDOW];
    while (n < ETA_WINDOW && step_row(db, st, p)) {
        long step = (long)sqlite3_column_int64(st, 0);
        double wall = sqlite3_column_double(st, 6);
        steps[n] = step;
        walls[n] = wall;
        if (n++ == 0) {
            last_step = step;
            last_wall = wall;
            p->step = step;
            p->step_wall = wall;
            p->epoch = (long)sqlite3_column_int64(st, 1);
            p->loss = sqlite3_column_double(st, 2);
            p->lr = sqlite3_column_double(st, 3);
            p->grad_norm = sqlite3_column_double(st, 4);
            p->tokens_per_s = sqlite3_column_double(st, 5);
            p->has_step = 1;
        }
        first_step = step;
        first_wall = wall;
    }
    sqlite3_finalize(st);
    p->step_median_s = median_step_s(steps, walls, n);
    if (last_step > first_step && total_steps > 0)
        p->eta_s = (last_wall - first_wall) / (double)(last_step - first_step) *
                   (double)(total_steps > last_step ? total_steps - last_step : 0);
}

static void read_checkpoint(sqlite3 *db, JobProgress *p) {
    sqlite3_stmt *st;
    const char *sql = PROGRESS_DB_LAST_CHECKPOINT;
    if (prepare(db, sql, &st, p)) return;
    if (step_row(db, st, p)) {
        const char *path = (const char *)sqlite3_column_text(st, 0);
        p->checkpoint = path ? strdup(path) : NULL;
    }
    sqlite3_finalize(st);
}

// The newest validation row (--val_split); a database from before the validation table:
// none.
static void read_validation(sqlite3 *db, JobProgress *p) {
    sqlite3_stmt *st;
    const char *sql = PROGRESS_DB_LAST_VALIDATION;
    if (prepare(db, sql, &st, p)) return;
    if (step_row(db, st, p) && sqlite3_column_type(st, 0) != SQLITE_NULL) {
        p->val_loss = sqlite3_column_double(st, 0);
        p->has_val = 1;
    }
    sqlite3_finalize(st);
}

// Loss scaling's newest scale and skipped steps; none without step_metrics rows of it.
static void read_loss_scale(sqlite3 *db, JobProgress *p) {
    sqlite3_stmt *st;
    if (prepare(db, PROGRESS_DB_LOSS_SCALE, &st, p)) return;
    if (step_row(db, st, p) && sqlite3_column_type(st, 0) != SQLITE_NULL) {
        p->loss_scale = sqlite3_column_double(st, 0);
        p->skipped_steps = (long)sqlite3_column_int64(st, 1);
        p->has_scale = 1;
    }
    sqlite3_finalize(st);
}

// A mixture of experts' newest load extremes; none for a dense model (no such rows), nor for a
// database from before step_metrics (a prepare failing with SQLITE_ERROR is no news).
static void read_expert_load(sqlite3 *db, JobProgress *p) {
    sqlite3_stmt *st;
    if (prepare(db, PROGRESS_DB_EXPERT_LOAD, &st, p)) return;
    if (step_row(db, st, p) && sqlite3_column_type(st, 0) != SQLITE_NULL &&
        sqlite3_column_type(st, 1) != SQLITE_NULL) {
        p->expert_load_max = sqlite3_column_double(st, 0);
        p->expert_load_min = sqlite3_column_double(st, 1);
        p->has_expert_load = 1;
    }
    sqlite3_finalize(st);
}

// An online job's newest rollout statistics; none for the other train types.
static void read_rollout(sqlite3 *db, JobProgress *p) {
    sqlite3_stmt *st;
    if (prepare(db, PROGRESS_DB_ROLLOUT, &st, p)) return;
    if (step_row(db, st, p) && sqlite3_column_type(st, 2) != SQLITE_NULL) {
        RolloutNumbers *r = &p->rollout;
        r->reward_mean = sqlite3_column_double(st, 0);
        r->reward_std = sqlite3_column_double(st, 1);
        r->response_len = sqlite3_column_double(st, 2);
        r->equal_reward_groups = sqlite3_column_double(st, 3);
        r->has = 1;
    }
    sqlite3_finalize(st);
}

// The trainer's phase (validation, a checkpoint write), none without one or before the keys.
static void read_phase(sqlite3 *db, JobProgress *p) {
    sqlite3_stmt *st;
    if (prepare(db, PROGRESS_DB_PHASE, &st, p)) return;
    if (step_row(db, st, p)) {
        const char *phase = (const char *)sqlite3_column_text(st, 0);
        p->phase = phase && *phase ? strdup(phase) : NULL;
        p->phase_since = sqlite3_column_double(st, 1);
    }
    sqlite3_finalize(st);
}

static void read_db(sqlite3 *db, long total_steps, JobProgress *p) {
    *p = (JobProgress){
        .opened = 1, .eta_s = -1, .read_mono = clock_mono_s(), .read_wall = clock_wall_s()};
    long total;
    if (!query_long(db, PROGRESS_DB_TOTAL_STEPS, &total, p)) {
        p->has_total = 1;
        p->total_steps = total_steps = total;
    }
    read_steps(db, total_steps, p);
    read_checkpoint(db, p);
    read_validation(db, p);
    read_loss_scale(db, p);
    read_expert_load(db, p);
    read_rollout(db, p);
    read_phase(db, p);
}

void progress_read_dir(const char *run_dir, long total_steps, JobProgress *p) {
    *p = (JobProgress){.eta_s = -1};
    sqlite3 *db = open_progress(run_dir, p);
    if (db) read_db(db, total_steps, p);
    sqlite3_close(db);
}

// When the ranks made progress at `wall` (their timestamp), on astraid's clock: the read less
// the progress's age then, so that an astraid that looked late (stopped, a frozen VM, a slow
// poll) never takes the ranks for silent. Never after the read, never before the run's
// progress seen before: a wall clock set meanwhile moves it no further.
static double progress_mono(const Job *j, const JobProgress *p, double wall) {
    double since = fmax(j->watch.seen_mono, j->watch.run_start_mono);
    return fmax(since, p->read_mono - fmax(0, p->read_wall - wall));
}

// A running job's progress for the hang watchdog: a new step, or a new phase (or a phase's
// end), of its current run: rows written before the run started (the run it resumes) are not.
static int watch_progress(Job *j, JobProgress *p) {
    if (!job_has_run(j)) return 0;
    if (p->phase && p->phase_since < j->started_at) { // a phase an earlier run left
        free(p->phase);
        p->phase = NULL;
    }
    int phase =
        !j->watch.phase != !p->phase ||
        (p->phase && (strcmp(j->watch.phase, p->phase) || j->watch.phase_since != p->phase_since));
    int step = p->has_step && p->step_wall >= j->started_at && p->step != j->watch.seen_step;
    if (step || phase)
        j->watch.seen_mono =
            progress_mono(j, p, fmax(step ? p->step_wall : 0, phase ? p->phase_since : 0));
    if (p->has_step) j->watch.read_mono = p->read_mono;
    if (step) j->watch.seen_step = p->step;
    if (p->step_median_s > 0) j->watch.step_median_s = p->step_median_s;
    if (phase) {
        free(j->watch.phase);
        j->watch.phase = p->phase;
        j->watch.phase_since = p->phase_since;
        p->phase = NULL;
    }
    return phase;
}

// A mixture of experts' load extremes, kept once known (a read that failed keeps the last); 1 if
// they changed.
static int apply_expert_load(Job *j, const JobProgress *p) {
    JobProgressView *v = &j->progress;
    if (!p->has_expert_load || (v->has_expert_load && p->expert_load_max == v->expert_load_max &&
                                p->expert_load_min == v->expert_load_min))
        return 0;
    v->expert_load_max = p->expert_load_max;
    v->expert_load_min = p->expert_load_min;
    v->has_expert_load = 1;
    return 1;
}

// The rollout statistics, kept once known; 1 if they changed.
static int apply_rollout(Job *j, const JobProgress *p) {
    if (!p->rollout.has || !memcmp(&p->rollout, &j->progress.rollout, sizeof p->rollout)) return 0;
    j->progress.rollout = p->rollout;
    return 1;
}

int progress_apply(Job *j, JobProgress *p) {
    int changed = !j->progress.seen;
    j->progress.seen = 1;
    if (!p->opened) return changed;
    if (!p->error != !j->progress.error ||
        (p->error && strcmp(p->error, j->progress.error))) { // news: a new failure, or over
        if (p->error) log_warn("job %ld: %s", j->id, p->error);
        free(j->progress.error);
        j->progress.error = p->error;
        p->error = NULL;
        changed = 1;
    }
    changed |= watch_progress(j, p);
    if (p->has_total && p->total_steps != j->progress.total_steps) {
        j->progress.total_steps = p->total_steps;
        changed = 1;
    }
    if (p->has_step) {
        changed |= p->step != j->progress.step;
        j->progress.step = p->step;
        j->progress.epoch = p->epoch;
        j->progress.loss = p->loss;
        j->progress.lr = p->lr;
        j->progress.grad_norm = p->grad_norm;
        j->progress.tokens_per_s = p->tokens_per_s;
        j->progress.has_step = 1;
    }
    j->progress.eta_s = p->eta_s;
    if (p->checkpoint && (!j->last_checkpoint || strcmp(p->checkpoint, j->last_checkpoint))) {
        free(j->last_checkpoint);
        j->last_checkpoint = p->checkpoint;
        p->checkpoint = NULL;
        changed = 1;
    }
    if (p->has_val && (!j->progress.has_val_loss || p->val_loss != j->progress.val_loss)) {
        j->progress.val_loss = p->val_loss;
        j->progress.has_val_loss = 1;
        changed = 1;
    }
    if (p->has_scale && (!j->progress.has_loss_scale || p->loss_scale != j->progress.loss_scale ||
                         p->skipped_steps != j->progress.skipped_steps)) {
        j->progress.loss_scale = p->loss_scale;
        j->progress.skipped_steps = p->skipped_steps;
        j->progress.has_loss_scale = 1;
        changed = 1;
    }
    changed |= apply_expert_load(j, p);
    changed |= apply_rollout(j, p);
    free(p->checkpoint);
    free(p->phase);
    free(p->error);
    p->checkpoint = p->phase = p->error = NULL;
    return changed;
}

// ---------------------------------------------------------------- the poll

// One job of a poll: a running one (its handle kept open between polls), or one this
// astraid has not read yet (a job of the database: its val_loss, read once).
typedef struct {
    long id;
    int running;
    long total_steps;
    char run_dir[PATH_MAX];
    JobProgress p;
} PollItem;

typedef struct {
    uv_work_t req;
    size_t n;
    PollItem *items; // (n,) by ascending id, as astraid.jobs
} Poll;

// Open handles of running jobs, by id. Used by the poll's work function alone (one
// poll at a time): closed once their job is no longer polled as running.
typedef struct {
    long id;
    sqlite3 *db;
} Handle;

static Handle *handles;
static size_t n_handles;
static uv_timer_t poll_timer;
static int polling;    // a poll is on the threadpool
static int poll_again; // asked for meanwhile: another once it is done

static Handle *handle_of(long id) {
    for (size_t i = 0; i < n_handles; i++)
        if (handles[i].id == id) return &handles[i];
    return NULL;
}

// Closes the handles of jobs this poll does not read as running.
static void close_stale_handles(const Poll *poll) {
    for (size_t i = 0; i < n_handles;) {
        int kept = 0;
        for (size_t k = 0; k < poll->n && !kept; k++)
            kept = poll->items[k].running && poll->items[k].id == handles[i].id;
        if (kept) {
            i++;
            continue;
        }
        sqlite3_close(handles[i].db);
        handles[i] = handles[--n_handles];
    }
    if (!n_handles) {
        free(handles);
        handles = NULL;
    }
}

static void drop_handle(long id) {
    Handle *h = handle_of(id);
    if (!h) return;
    sqlite3_close(h->db);
    *h = handles[--n_handles];
}

static sqlite3 *running_handle(PollItem *it) {
    Handle *h = handle_of(it->id);
    if (h) return h->db;
    sqlite3 *db = open_progress(it->run_dir, &it->p);
    Handle *grown = db ? realloc(handles, (n_handles + 1) * sizeof *grown) : NULL;
    if (!grown) {
        sqlite3_close(db);
        return NULL;
    }
    handles = grown;
    handles[n_handles++] = (Handle){it->id, db};
    return db;
}

static void poll_work(uv_work_t *req) {
    Poll *poll = req->data;
    close_stale_handles(poll);
    for (size_t k = 0; k < poll->n; k++) {
        PollItem *it = &poll->items[k];
        it->p = (JobProgress){.eta_s = -1};
        if (!it->running) {
            progress_read_dir(it->run_dir, it->total_steps, &it->p);
            continue;
        }
        sqlite3 *db = running_handle(it);
        if (db) read_db(db, it->total_steps, &it->p);
        if (db && it->p.error) drop_handle(it->id); // the next poll opens the file afresh
    }
}

// Applied to the jobs still as they were polled: a running job that still runs (its
// run's end reads its last progress itself), an unseen one still unseen.
static void poll_done(uv_work_t *req, int status) {
    Poll *poll = req->data;
    Job *j = astraid.jobs;
    for (size_t k = 0; k < poll->n; k++) {
        PollItem *it = &poll->items[k];
        while (j && j->id < it->id)
            j = j->next;
        int current = j && j->id == it->id && (it->running ? job_has_run(j) : !j->progress.seen);
        if (!status && current && progress_apply(j, &it->p) && it->running)
            job_changed(j, JOB_PROGRESS, NULL);
        free(it->p.checkpoint);
        free(it->p.phase);
        free(it->p.error);
    }
    free(poll->items);
    free(poll);
    polling = 0;
    if (poll_again && !status) progress_reader_poll_now();
}

static void poll_start(void) {
    if (polling) return; // a slow disk: the next tick after that poll is done
    size_t n = 0;
    for (Job *j = astraid.jobs; j; j = j->next)
        n += job_has_run(j) || (!j->progress.seen && !j->ending && !j->rows.unsaved);
    if (!n) return;
    Poll *poll = calloc(1, sizeof *poll);
    PollItem *items = poll ? calloc(n, sizeof *items) : NULL;
    if (!items) {
        free(poll);
        return;
    }
    for (Job *j = astraid.jobs; j; j = j->next) {
        if (!job_has_run(j) && (j->progress.seen || j->ending || j->rows.unsaved)) continue;
        PollItem *it = &items[poll->n];
        it->id = j->id;
        it->running = job_has_run(j);
        it->total_steps = j->progress.total_steps;
        if (!job_run_dir(j, it->run_dir, sizeof it->run_dir)) poll->n++;
    }
    poll->items = items;
    poll->req.data = poll;
    polling = 1;
    poll_again = 0;
    (void)uv_queue_work(astraid.loop, &poll->req, poll_work, poll_done); // fails only without work
}

static void on_poll(uv_timer_t *t) {
    (void)t;
    poll_start();
}

void progress_reader_poll_now(void) {
    if (polling)
        poll_again = 1;
    else
        poll_start();
}

void progress_reader_start(void) {
    uv_timer_init(astraid.loop, &poll_timer);
    uint64_t ms = (uint64_t)(astraid.cfg.poll_interval * 1000);
    uv_timer_start(&poll_timer, on_poll, ms, ms);
}
