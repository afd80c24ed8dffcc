// watchdog.c: hangs and time limits of running jobs (docs/astraid.md "Hangs", "Time limits").
//
// Hangs (the local executor's runs: astraid sees their processes). A run's progress is what
// progress_reader.c reads: a new optimizer step, or a new phase the trainer reports
// (validation, a checkpoint write: train/progress.h). The watch of a run starts at its first
// progress (loading and the rendezvous are bounded by the ranks' own timeouts); then no progress
// for the job's hang limit is a hang:
//   limit = hang_timeout_s when the spec gives it, else max(HANG_FLOOR_S, HANG_STEP_FACTOR x the
//           median seconds per step of the newest steps)
//   within a phase: max(PHASE_FACTOR x limit, PHASE_FLOOR_S)
// The silence is the ranks' own (their progress placed by its timestamps, progress_reader.c),
// and is judged only on a read of their progress begun once it passed the limit: astraid
// itself may have been the one not looking. A tick later than max(LATE_FLOOR_S, LATE_FACTOR x
// the poll interval) (astraid stopped, a frozen VM, a swap storm) judges nothing: the hang
// clocks restart and the progress is read again.
// A hung run's ranks have their stacks recorded in their logs (gdb in batch mode, bounded by
// STACK_TIMEOUT_S; without gdb, or where it fails, /proc/PID/task/*/stack and wchan), then the
// run is stopped (SIGTERM, SIGKILL after --stop-timeout) and restarted from the last checkpoint
// like a crash (counted in restarts and hangs), error naming the hang, the step and the silent
// rank: the first one stopped (state T) or in uninterruptible sleep (D).
//
// Time limits: a job's runs since its submit or last resume may take max_duration_hours; at
// the limit its ranks checkpoint and exit (a pause) and the job is paused with pause_reason.
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/buf.h"
#include "daemon/daemon.h"

#define HANG_FLOOR_S 300.0
#define HANG_STEP_FACTOR 20.0
#define PHASE_FACTOR 10.0
#define PHASE_FLOOR_S 600.0
#define STACK_TIMEOUT_S 30.0
#define PROC_STACK_MAX 16384 // bytes of one thread's /proc stack read
#define LATE_FLOOR_S 5.0
#define LATE_FACTOR 10.0

static uv_timer_t tick;
static double last_tick; // clock_mono_s() of the previous tick

double job_time_left_s(const Job *j) {
    double max_h = j->js.max_duration_hours;
    if (max_h <= 0) return -1;
    double used = j->watch.run_time_s +
                  (j->watch.run_start_mono > 0 ? clock_mono_s() - j->watch.run_start_mono : 0);
    return fmax(0, max_h * 3600 - used);
}

void job_watch_run_started(Job *j) {
    j->watch.run_start_mono = clock_mono_s();
    j->watch.seen_mono = 0;
    j->watch.verdict_mono = 0;
    j->watch.seen_step = j->progress.step;
    free(j->watch.phase);
    j->watch.phase = NULL;
}

void job_watch_run_ended(Job *j) {
    if (j->watch.run_start_mono > 0)
        j->watch.run_time_s += clock_mono_s() - j->watch.run_start_mono;
    j->watch.run_start_mono = 0;
    free(j->watch.phase);
    j->watch.phase = NULL;
}

static double hang_limit_s(const Job *j) {
    double given = j->js.hang_timeout_s;
    double limit =
        given > 0 ? given : fmax(HANG_FLOOR_S, HANG_STEP_FACTOR * j->watch.step_median_s);
    return j->watch.phase ? fmax(PHASE_FACTOR * limit, PHASE_FLOOR_S) : limit;
}

// ---------------------------------------------------------------- the ranks' stacks

// The state letter of /proc/PID/stat ('R', 'S', 'D', 'T', ...), 0 when pid is gone.
static char proc_state(pid_t pid) {
    char path[64], text[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    const char *close = strrchr(text, ')'); // the command may hold spaces and parentheses
    return close && close[1] == ' ' ? close[2] : 0;
}

// Appends /proc/PID/<name> (whitespace-trimmed) to b; "?" when unreadable.
static void append_proc_file(Buf *b, const char *dir, const char *name) {
    char path[PATH_MAX], text[PROC_STACK_MAX];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(text, 1, sizeof text - 1, f) : 0;
    if (f) fclose(f);
    while (n && (text[n - 1] == '\n' || text[n - 1] == ' '))
        n--;
    text[n] = 0;
    buf_printf(b, "%s", n ? text : "?");
}

// Each thread of pid: "thread TID state S wchan W" and its kernel stack.
static void proc_stacks(Buf *b, pid_t pid) {
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
    DIR *d = opendir(dir);
    if (!d) {
        buf_printf(b, "%s: gone\n", dir);
        return;
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char task[320];
        snprintf(task, sizeof task, "%s/%s", dir, e->d_name);
        buf_printf(b, "thread %s state %c wchan ", e->d_name, proc_state(atoi(e->d_name)));
        append_proc_file(b, task, "wchan");
        buf_printf(b, "\n");
        append_proc_file(b, task, "stack");
        buf_printf(b, "\n");
    }
    closedir(d);
}

// The stacks of one hung run: each rank's recorded, then the run stopped.
typedef struct {
    long job_id, run_no, step;
    int pending; // ranks whose stack is still being recorded
} Capture;

typedef struct {
    Capture *c;
    int rank;
    pid_t pid;
} RankCapture;

// text (len bytes) into rank's log of the run: its file, and the job's lines while it has them.
static void log_to_rank(const Capture *c, int rank, const char *text, size_t len) {
    Job *j = job_find(c->job_id);
    char run_dir[PATH_MAX], path[PATH_MAX + 64];
    if (!j || job_run_dir(j, run_dir, sizeof run_dir) ||
        job_log_path(run_dir, c->run_no, rank, path, sizeof path))
        return;
    int fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd >= 0 && write(fd, text, len) < 0)
        log_warn("job %ld: %s: cannot write rank %d's stack", j->id, path, rank);
    if (fd >= 0) close(fd);
    for (size_t at = 0; at < len;) {
        size_t n = strcspn(text + at, "\n");
        job_add_log(j, rank, text + at, n);
        at += n + 1;
    }
}

// Every stack recorded: the run, if it is still the one found hung, is stopped.
static void capture_done(Capture *c) {
    if (--c->pending > 0) return;
    Job *j = job_find(c->job_id);
    if (j && j->runs == c->run_no && runner_ranks(j) && j->watch.hang_cause)
        astraid.site->stop(j, STOP_HANG);
    free(c);
}

static void record_stack(RankCapture *rc, const char *how, const char *gdb_out, size_t gdb_len) {
    Buf b = {0};
    buf_printf(&b, "astraid: hang at step %ld: stack of rank %d (pid %d, %s):\n", rc->c->step,
               rc->rank, (int)rc->pid, how);
    if (gdb_len) buf_append(&b, gdb_out, gdb_len);
    if (strcmp(how, "gdb")) proc_stacks(&b, rc->pid);
    if (b.len) log_to_rank(rc->c, rc->rank, b.data, b.len);
    buf_free(&b);
    capture_done(rc->c);
    free(rc);
}

static void gdb_done(void *arg, const char *output, size_t len, int exit_code, int term_signal,
                     int timed_out) {
    RankCapture *rc = arg;
    if (!output) { // astraid is exiting
        if (--rc->c->pending == 0) free(rc->c);
        free(rc);
        return;
    }
    (void)term_signal;
    int ok = exit_code == 0 && !timed_out && len;
    record_stack(rc,
                 ok          ? "gdb"
                 : timed_out ? "gdb timed out; /proc"
                             : "gdb failed; /proc",
                 output, len);
}

static void capture_rank(Capture *c, int rank, pid_t pid) {
    RankCapture *rc = malloc(sizeof *rc);
    if (!rc) {
        capture_done(c);
        return;
    }
    *rc = (RankCapture){c, rank, pid};
    const char *gdb = astraid.cfg.gdb ? astraid.cfg.gdb : "gdb";
    if (!strcmp(gdb, "none")) {
        record_stack(rc, "/proc", NULL, 0);
        return;
    }
    char pid_text[24];
    snprintf(pid_text, sizeof pid_text, "%d", (int)pid);
    char *argv[] = {(char *)gdb,           "-batch", "-nx", "-p", pid_text, "-ex",
                    "thread apply all bt", NULL};
    Err err = {0};
    if (helper_run(argv, "", 0, 1, STACK_TIMEOUT_S, gdb_done, rc, &err)) {
        log_warn("job %ld: %s; rank %d's stack from /proc", c->job_id, err.msg, rank);
        record_stack(rc, "no gdb; /proc", NULL, 0);
    }
}

// ---------------------------------------------------------------- a hang

// "rank 1 (pid 42, state T: stopped)", the first rank stopped or in uninterruptible sleep.
static void silent_rank(const Job *j, char *out, size_t cap) {
    for (int r = 0; r < runner_ranks(j); r++) {
        pid_t pid = runner_rank_pid(j, r);
        char s = pid ? proc_state(pid) : 0;
        if (s == 'T' || s == 't' || s == 'D') {
            snprintf(out, cap, "rank %d (pid %d, state %c: %s)", r, (int)pid, s,
                     s == 'D' ? "uninterruptible sleep" : "stopped");
            return;
        }
    }
    snprintf(out, cap, "none stopped or in uninterruptible sleep: every rank waits");
}

static void hang_found(Job *j, double silent_s) {
    char who[128], cause[512];
    silent_rank(j, who, sizeof who);
    double given = j->js.hang_timeout_s;
    snprintf(cause, sizeof cause,
             "hang at step %ld: no new optimizer step for %.1f s (limit %.0f s%s%s%s); silent "
             "rank: %s",
             j->watch.seen_step, silent_s, hang_limit_s(j), given > 0 ? ", hang_timeout_s" : "",
             j->watch.phase ? ", in " : "", j->watch.phase ? j->watch.phase : "", who);
    j->watch.hang_cause = strdup(cause);
    if (!j->watch.hang_cause) return; // out of memory: found again at the next tick
    j->watch.hangs++;
    log_warn("job %ld: %s; recording the ranks' stacks, then restarting it", j->id, cause);
    state_event(j->id, "hang", cause);
    job_changed(j, JOB_EVENT, "hang");
    Capture *c = malloc(sizeof *c);
    int n = runner_ranks(j);
    if (!c) {
        astraid.site->stop(j, STOP_HANG);
        return;
    }
    *c =
        (Capture){.job_id = j->id, .run_no = j->runs, .step = j->watch.seen_step, .pending = n + 1};
    for (int r = 0; r < n; r++)
        capture_rank(c, r, runner_rank_pid(j, r));
    capture_done(c); // its own count: the run stops once every rank's stack is recorded
}

// ---------------------------------------------------------------- the time limit

static void time_limit_reached(Job *j) {
    char reason[256];
    double max_h = j->js.max_duration_hours;
    snprintf(
        reason, sizeof reason,
        "max_duration_hours %g (%.1f s of running) reached at step %ld: paused with a checkpoint "
        "at the next step; resume continues",
        max_h, max_h * 3600, j->progress.step);
    free(j->pause_reason);
    j->pause_reason = strdup(reason);
    log_warn("job %ld: %s", j->id, reason);
    state_event(j->id, "time_limit", reason);
    job_set_state(j, JOB_PAUSING);
    astraid.site->stop(j, STOP_PAUSE);
}

// ---------------------------------------------------------------- the tick

// A run silent past its limit is hung once a read of its progress begun then (not one under
// way since before) still shows the silence.
static void watch_hang(Job *j, double now) {
    double silent_s = now - j->watch.seen_mono;
    if (silent_s <= hang_limit_s(j)) {
        j->watch.verdict_mono = 0;
    } else if (!j->watch.verdict_mono) {
        j->watch.verdict_mono = now;
        progress_reader_poll_now();
    } else if (j->watch.read_mono > j->watch.verdict_mono) {
        hang_found(j, silent_s);
    }
}

// 1 when this tick came far later than due: the loop itself stalled, so the silence the clocks
// show is astraid's own; the progress is read again.
static int loop_was_late(double now) {
    double interval = astraid.cfg.poll_interval, gap = now - last_tick;
    last_tick = now;
    if (gap <= fmax(LATE_FLOOR_S, LATE_FACTOR * interval)) return 0;
    log_info("astraid's loop was late by %.1f s: hang clocks restarted", gap - interval);
    progress_reader_poll_now();
    return 1;
}

static void on_tick(uv_timer_t *t) {
    (void)t;
    double now = clock_mono_s();
    int late = loop_was_late(now);
    for (Job *j = astraid.jobs; j; j = j->next) {
        if (j->state != JOB_RUNNING || !job_has_run(j) || j->watch.hang_cause || j->rows.changing)
            continue;
        if (job_time_left_s(j) == 0) {
            time_limit_reached(j);
            continue;
        }
        if (!runner_ranks(j) || j->watch.seen_mono <= 0) continue;
        if (late) {
            j->watch.seen_mono = now;
            j->watch.verdict_mono = 0;
        } else {
            watch_hang(j, now);
        }
    }
}

void job_watch_start(void) {
    last_tick = clock_mono_s();
    uv_timer_init(astraid.loop, &tick);
    uint64_t ms = (uint64_t)(astraid.cfg.poll_interval * 1000);
    uv_timer_start(&tick, on_tick, ms, ms);
}
