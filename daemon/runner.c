// runner.c: the ranks of one run of a job (docs/design.md §5).
//
// Each rank is astrai-train started with uv_spawn in its own session and process
// group (UV_PROCESS_DETACHED), with the environment of a local launch
// (ranks/ranks.h ranks_env: RANK, WORLD_SIZE, ..., ASTRAI_LAUNCHER_PID = astraid, so the
// rank arms PR_SET_PDEATHSIG against us) plus:
//   fd 0            /dev/null
//   fd 1, 2         one pipe: its lines go to run_dir/run<N>-rank<R>.log and to the
//                   job's in-memory log (logs, logs -f)
//   fd 3            ASTRAI_CONTROL_FD: "stop\n" (pause, shutdown), "checkpoint\n"
//   fd 4            rank 0 only: ASTRAI_RENDEZVOUS_FD, a loopback listener (astraid
//                   is the rendezvous of its own jobs: it picks the port)
//   ASTRAI_RUN_DIR  run_dir (rank 0 writes progress.db there)
//   CUDA_VISIBLE_DEVICES  all the job's GPUs ("" on CPU slots); rank R uses the
//                   LOCAL_RANK-th of them (as under torchrun), so rank R's GPU is
//                   job->devices[R]
//   CUDA_DEVICE_ORDER=PCI_BUS_ID  (GPU jobs) CUDA numbers the GPUs as NVML does
//
// The ranks' exits follow ranks/ranks.h's policy, as under astrai-train's own launcher: the
// first rank that fails (non-zero exit or a signal) is the root cause: the others get
// SIGTERM, then SIGKILL after --stop-timeout. A rank that exits 3 (EXIT_INTERRUPTED) though
// astraid did not stop it was stopped from outside: the others are stopped the same way and
// the run is interrupted, not failed (a later real failure still wins). After astraid's own
// stop (pause, shutdown, cancel) no exit is a failure. A run ends when every rank has exited and
// its output is drained; the job then decides what comes next. A rank that cannot be started for
// want of a resource (out of memory; an errno that err_errno, common/error.c, counts as the
// system's: EMFILE, EAGAIN, ENOMEM, EACCES, EIO, ...) makes the run transient: the job tries
// again later; one whose errno blames the name given (ENOENT: no binary to run) fails it.
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "comm/comm.h"
#include "daemon/daemon.h"
#include "proto/job_spec.h"
#include "ranks/ranks.h"

#define CONTROL_FD 3
#define RENDEZVOUS_FD 4
#define LINE_MAX_BYTES (64 * 1024) // longer output lines are split
#define DRAIN_MS 2000              // after the last exit, how long we wait for output EOF
#define CAUSE_LINES 5              // stderr lines of the failing rank kept in the cause

typedef struct {
    Run *run;
    int index;
    uv_process_t proc;
    uv_pipe_t out;
    int control_fd, log_fd;
    int out_open;
    char *line; // the current incomplete output line
    size_t line_len;
    char *tail[CAUSE_LINES]; // this run's last output lines, a ring: the root cause quotes them
    int tail_next;
} Rank;

struct Run {
    Job *job;
    Rank *ranks;
    RankGroup g; // their pids and exits, and what the policy decided
    int n, outs_open;
    int handles; // libuv handles not yet closed: the Run is freed at 0
    int ended;
    StopKind stop;
    int shutdown_asked; // a second SIGTERM kills at once
    int transient;      // a rank could not be started for want of a resource
    char *started_from; // the job's last checkpoint when the run started
    char shm_name[64];
    uv_timer_t kill_timer, drain_timer;
};

static int runs_alive;

int runner_alive(void) {
    return runs_alive;
}

int runner_ranks(const Job *j) {
    return j->site.run && !j->site.run->ended ? j->site.run->n : 0;
}

pid_t runner_rank_pid(const Job *j, int r) {
    if (r < 0 || r >= runner_ranks(j)) return 0;
    const RankExit *rk = &j->site.run->g.rank[r];
    return rk->alive ? rk->pid : 0;
}

// ---------------------------------------------------------------- teardown

static void on_handle_closed(uv_handle_t *h) {
    Run *run = h->data;
    if (--run->handles > 0) return;
    for (int i = 0; i < run->n; i++) {
        free(run->ranks[i].line);
        for (int k = 0; k < CAUSE_LINES; k++)
            free(run->ranks[i].tail[k]);
    }
    free(run->ranks);
    ranks_group_free(&run->g);
    free(run->started_from);
    free(run);
}

static void close_handle(Run *run, uv_handle_t *h) {
    h->data = run;
    uv_close(h, on_handle_closed);
}

static void send_control(Run *run, const char *msg) {
    for (int i = 0; i < run->n; i++) {
        Rank *r = &run->ranks[i];
        if (run->g.rank[i].alive && r->control_fd >= 0 &&
            write(r->control_fd, msg, strlen(msg)) < 0)
            log_warn("job %ld: rank %d: control pipe: write failed", run->job->id, i);
    }
}

// "rank 1 (pid 42) was killed by signal 9 (Killed); last output:\n..." (its lines of this
// run only).
static char *root_cause(const Rank *r) {
    char head[256];
    ranks_describe(&r->run->g, r->index, head, sizeof head);
    size_t len = strlen(head) + 32;
    for (int k = 0; k < CAUSE_LINES; k++)
        len += r->tail[k] ? strlen(r->tail[k]) + 1 : 0;
    char *out = malloc(len);
    if (!out) return NULL;
    strcpy(out, head);
    for (int k = 0, first = 1; k < CAUSE_LINES; k++) {
        const char *line = r->tail[(r->tail_next + k) % CAUSE_LINES]; // oldest first
        if (!line) continue;
        strcat(out, first ? "; last output:\n" : "\n");
        strcat(out, line);
        first = 0;
    }
    return out;
}

// Every rank was started and exited 0: the run got to its end (whatever astraid asked).
static int all_exited_ok(const RankGroup *g) {
    for (int i = 0; i < g->n; i++)
        if (!g->rank[i].pid || g->rank[i].term_signal || g->rank[i].exit_code) return 0;
    return 1;
}

static void run_end(Run *run) {
    run->ended = 1;
    runs_alive--;
    uv_timer_stop(&run->kill_timer);
    uv_timer_stop(&run->drain_timer);
    close_handle(run, (uv_handle_t *)&run->kill_timer);
    close_handle(run, (uv_handle_t *)&run->drain_timer);
    for (int i = 0; i < run->n; i++) {
        Rank *r = &run->ranks[i];
        if (r->control_fd >= 0) close(r->control_fd);
        if (r->log_fd >= 0) close(r->log_fd);
        r->control_fd = r->log_fd = -1;
    }
    comm_shm_remove(run->shm_name); // segments of ranks killed before their cleanup
    const RankGroup *g = &run->g;
    int culprit = g->failed >= 0 ? g->failed : g->interrupted;
    char *cause = culprit >= 0 ? root_cause(&run->ranks[culprit]) : NULL;
    // Bad input: a rank that exited 2, or one that could not be started for another reason
    // than a resource (no binary to run).
    const RankExit *f = g->failed >= 0 ? &g->rank[g->failed] : NULL;
    RunOutcome o = {.stop = run->stop,
                    .exited_ok = all_exited_ok(g),
                    .failed = f != NULL,
                    .bad_input = f && (f->pid ? !f->term_signal && f->exit_code == EXIT_BAD_INPUT
                                              : !run->transient),
                    .transient = run->transient,
                    .interrupted = g->interrupted >= 0,
                    .cause = cause,
                    .started_from = run->started_from};
    Job *j = run->job;
    j->site.run = NULL;
    job_run_ended(j, &o);
    free(cause);
}

static void maybe_end(Run *run) {
    if (!run->ended && run->g.alive == 0 && run->outs_open == 0) run_end(run);
}

// ---------------------------------------------------------------- output

static void close_output(Rank *r) {
    if (!r->out_open) return;
    r->out_open = 0;
    r->run->outs_open--;
    uv_read_stop((uv_stream_t *)&r->out);
    close_handle(r->run, (uv_handle_t *)&r->out);
}

// A line of the rank's output: to the job's log, and to the rank's tail for a root cause.
static void keep_line(Rank *r, const char *text, size_t len) {
    job_add_log(r->run->job, r->index, text, len);
    free(r->tail[r->tail_next]);
    r->tail[r->tail_next] = strndup(text, len);
    r->tail_next = (r->tail_next + 1) % CAUSE_LINES;
}

static void flush_line(Rank *r) {
    if (!r->line_len) return;
    keep_line(r, r->line, r->line_len);
    r->line_len = 0;
}

static void take_output(Rank *r, const char *buf, size_t n) {
    if (r->log_fd >= 0 && write(r->log_fd, buf, n) < 0)
        log_warn("job %ld: rank %d: cannot write its log file", r->run->job->id, r->index);
    for (size_t i = 0; i < n; i++) {
        if (buf[i] == '\n' || r->line_len == LINE_MAX_BYTES) flush_line(r);
        if (buf[i] != '\n') r->line[r->line_len++] = buf[i];
    }
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    (void)h;
    (void)suggested;
    static char chunk[64 * 1024]; // consumed by on_read before the next allocation
    *buf = uv_buf_init(chunk, sizeof chunk);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
    Rank *r = s->data;
    if (n > 0) {
        take_output(r, buf->base, (size_t)n);
        return;
    }
    if (n == 0) return;
    flush_line(r);
    Run *run = r->run;
    close_output(r);
    maybe_end(run);
}

static void on_drain_timeout(uv_timer_t *t) {
    Run *run = t->data;
    for (int i = 0; i < run->n; i++) {
        flush_line(&run->ranks[i]);
        close_output(&run->ranks[i]);
    }
    maybe_end(run);
}

// ---------------------------------------------------------------- exits

static void on_kill_timeout(uv_timer_t *t) {
    Run *run = t->data;
    log_warn("job %ld: %d rank(s) did not stop within %g s; SIGKILL", run->job->id, run->g.alive,
             astraid.cfg.stop_timeout);
    ranks_signal(&run->g, SIGKILL);
}

static void arm_kill(Run *run) {
    if (!uv_is_active((uv_handle_t *)&run->kill_timer))
        uv_timer_start(&run->kill_timer, on_kill_timeout,
                       (uint64_t)(astraid.cfg.stop_timeout * 1000), 0);
}

static void on_rank_exit(uv_process_t *p, int64_t exit_status, int term_signal) {
    Rank *r = p->data;
    Run *run = r->run;
    close_handle(run, (uv_handle_t *)p);
    log_debug("job %ld: rank %d exited (code %lld, signal %d)", run->job->id, r->index,
              (long long)exit_status, term_signal);
    if (ranks_exited(&run->g, r->index, (int)exit_status, term_signal) == RANKS_STOP_OTHERS) {
        char how[128];
        ranks_describe(&run->g, r->index, how, sizeof how);
        // An interrupted rank was stopped from outside (SIGTERM/SIGINT astraid did not send):
        // it checkpointed; the others stop too (their checkpoint agrees on the step), then
        // the job restarts.
        log_warn("job %ld: %s%s; stopping the other %d rank(s)", run->job->id, how,
                 run->g.failed < 0 ? " (stopped from outside astraid)" : "", run->g.alive);
        ranks_signal(&run->g, SIGTERM);
        arm_kill(run);
    }
    if (run->g.alive == 0) uv_timer_start(&run->drain_timer, on_drain_timeout, DRAIN_MS, 0);
    maybe_end(run);
}

// ---------------------------------------------------------------- spawn

typedef struct {
    RanksLaunch ranks; // what every rank's environment says
    int listen_fd;     // astraid's copy of rank 0's rendezvous socket
    char **argv;
    char shm_name[64];
    const char *extra[5]; // ranks.extra
    char run_dir[PATH_MAX];
    char control[32], run_dir_env[PATH_MAX + 16], cuda[4096];
} Launch;

static int visible_devices(const Job *j, char *out, size_t cap) {
    out[0] = 0;
    int n = snprintf(out, cap, "CUDA_VISIBLE_DEVICES=");
    for (long i = 0; astraid.devices.gpu && i < j->n_devices && n > 0 && (size_t)n < cap; i++)
        n += snprintf(out + n, cap - (size_t)n, "%s%d", i ? "," : "", j->devices[i]);
    return n > 0 && (size_t)n < cap ? 0 : -1;
}

static int launch_prepare(Launch *l, Job *j, Err *err) {
    JobSpec run; // the job's spec, resuming when the job resumes (its strings are the job's)
    if (job_run_spec(j, &run, err)) return -1;
    l->argv = job_spec_argv(&run, astraid.cfg.train_binary);
    if (!l->argv) return err_resource(err, "out of memory building the argv");
    comm_shm_new_name(l->shm_name, sizeof l->shm_name);
    snprintf(l->control, sizeof l->control, "ASTRAI_CONTROL_FD=%d", CONTROL_FD);
    if (job_run_dir(j, l->run_dir, sizeof l->run_dir) ||
        visible_devices(j, l->cuda, sizeof l->cuda))
        return err_set(err, "run directory or device list too long");
    snprintf(l->run_dir_env, sizeof l->run_dir_env, "ASTRAI_RUN_DIR=%s", l->run_dir);
    // GPU ids are NVML's indices (PCI bus order); CUDA's default order is fastest first.
    const char *order = astraid.devices.gpu ? "CUDA_DEVICE_ORDER=PCI_BUS_ID" : NULL;
    const char *extra[] = {l->control, l->run_dir_env, l->cuda, order, NULL};
    memcpy(l->extra, extra, sizeof extra);
    l->ranks = (RanksLaunch){.world_size = (int)j->n_devices,
                             .listen_fd = RENDEZVOUS_FD,
                             .shm_name = l->shm_name,
                             .extra = l->extra};
    // A loopback listener on any port fails only for want of a resource (fds, ports, memory).
    if (ranks_listen("127.0.0.1", 0, &l->listen_fd, &l->ranks.port, err)) {
        err->resource = 1;
        return -1;
    }
    return 0;
}

static int open_rank_log(const Launch *l, long run_no, int rank, Err *err) {
    char path[PATH_MAX + 64];
    if (job_log_path(l->run_dir, run_no, rank, path, sizeof path))
        return err_set(err, "%s: the path of rank %d's log is too long", l->run_dir, rank);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) err_errno(err, errno, "%s: cannot open", path);
    return fd;
}

// Spawns rank r; on failure err says why and the rank stays not alive.
static int spawn_rank(Run *run, Launch *l, int r, Err *err) {
    Rank *rk = &run->ranks[r];
    *rk = (Rank){.run = run, .index = r, .control_fd = -1, .log_fd = -1};
    rk->line = malloc(LINE_MAX_BYTES);
    int out[2] = {-1, -1}, ctl[2] = {-1, -1}, rc = 0;
    char what[PATH_MAX + 64];
    snprintf(what, sizeof what, "rank %d: cannot create its pipes", r);
    if (!rk->line)
        err_resource(err, "rank %d: out of memory", r);
    else if ((rk->log_fd = open_rank_log(l, run->job->runs, r, err)) >= 0 &&
             ((rc = uv_pipe(out, UV_NONBLOCK_PIPE, 0)) || (rc = uv_pipe(ctl, 0, UV_NONBLOCK_PIPE))))
        err_errno(err, -rc, "%s", what);
    if (!rk->line || rk->log_fd < 0 || rc) {
        for (int k = 0; k < 2; k++) {
            if (out[k] >= 0) close(out[k]);
            if (ctl[k] >= 0) close(ctl[k]);
        }
        return -1;
    }
    char **env = ranks_env(&l->ranks, r);
    uv_stdio_container_t stdio[5] = {
        {.flags = UV_IGNORE},
        {.flags = UV_INHERIT_FD, .data.fd = out[1]},
        {.flags = UV_INHERIT_FD, .data.fd = out[1]},
        {.flags = UV_INHERIT_FD, .data.fd = ctl[0]},
        {.flags = UV_INHERIT_FD, .data.fd = l->listen_fd},
    };
    uv_process_options_t opt = {.exit_cb = on_rank_exit,
                                .file = l->argv[0],
                                .args = l->argv,
                                .env = env,
                                .flags = UV_PROCESS_DETACHED,
                                .stdio_count = r == 0 ? 5 : 4,
                                .stdio = stdio};
    rk->proc.data = rk;
    int spawned = env != NULL; // uv_spawn initialises the handle even when it fails
    rc = spawned ? uv_spawn(astraid.loop, &rk->proc, &opt) : UV_ENOMEM;
    ranks_free_env(env);
    close(out[1]);
    close(ctl[0]);
    run->handles += spawned;
    if (rc) {
        if (spawned) close_handle(run, (uv_handle_t *)&rk->proc);
        close(out[0]);
        close(ctl[1]);
        snprintf(what, sizeof what, "cannot start rank %d (%s)", r, l->argv[0]);
        return err_errno(err, -rc, "%s", what);
    }
    ranks_started(&run->g, r, rk->proc.pid);
    rk->control_fd = ctl[1];
    uv_pipe_init(astraid.loop, &rk->out, 0);
    uv_pipe_open(&rk->out, out[0]);
    rk->out.data = rk;
    rk->out_open = 1;
    run->outs_open++;
    run->handles++;
    uv_read_start((uv_stream_t *)&rk->out, on_alloc, on_read);
    return 0;
}

static Run *run_new(Job *j) {
    Run *run = calloc(1, sizeof *run);
    if (run) run->ranks = calloc((size_t)j->n_devices, sizeof *run->ranks);
    if (!run || !run->ranks ||
        ranks_group_init(&run->g, (int)j->n_devices, (int)j->js.train.pp_size, NULL)) {
        if (run) free(run->ranks);
        free(run);
        return NULL;
    }
    run->job = j;
    uv_timer_init(astraid.loop, &run->kill_timer);
    uv_timer_init(astraid.loop, &run->drain_timer);
    run->kill_timer.data = run->drain_timer.data = run;
    run->handles = 2;
    return run;
}

// A rank that could not be started fails the run: for want of a resource the job tries
// again later (transient), else like a rank that exits with 2 (no binary to run).
static void spawn_failed(Run *run, int r, const Err *err) {
    keep_line(&run->ranks[r], err->msg, strlen(err->msg));
    ranks_start_failed(&run->g, r);
    run->transient = err->resource;
    ranks_signal(&run->g, SIGKILL);
}

static int local_start(Job *j, Err *err) {
    Launch l = {.listen_fd = -1};
    if (launch_prepare(&l, j, err)) {
        job_spec_free_argv(l.argv);
        return -1;
    }
    Run *run = run_new(j);
    if (!run) {
        close(l.listen_fd);
        job_spec_free_argv(l.argv);
        return err_resource(err, "out of memory for a run of %ld rank(s)", j->n_devices);
    }
    memcpy(run->shm_name, l.shm_name, sizeof run->shm_name);
    run->n = (int)j->n_devices;
    run->started_from = j->last_checkpoint ? strdup(j->last_checkpoint) : NULL;
    j->site.run = run;
    j->runs++;
    runs_alive++;
    job_set_state(j, JOB_STARTING);
    pid_t *pids = calloc((size_t)run->n, sizeof *pids);
    for (int r = 0; r < run->n && run->g.failed < 0; r++) {
        Err serr = {0};
        if (spawn_rank(run, &l, r, &serr)) spawn_failed(run, r, &serr);
        if (pids) pids[r] = run->g.rank[r].pid;
    }
    run->n = run->g.failed >= 0 ? run->g.failed + 1 : run->n;
    close(l.listen_fd); // rank 0 has its own copy
    job_spec_free_argv(l.argv);
    if (pids) state_run_started(j, pids, run->n);
    free(pids);
    log_info("job %ld: run %ld started: %d rank(s)%s", j->id, j->runs, run->g.alive,
             j->resume ? ", resuming from the last checkpoint" : "");
    if (run->g.failed < 0) job_set_state(j, JOB_RUNNING);
    if (run->g.alive == 0) uv_timer_start(&run->drain_timer, on_drain_timeout, 0, 0);
    return 0;
}

// ---------------------------------------------------------------- control

static void local_stop(Job *j, StopKind why) {
    Run *run = j->site.run;
    if (!run || run->ended) return;
    ranks_stop_asked(&run->g); // their exits from now on are expected
    if (why == STOP_CANCEL || (why == STOP_SHUTDOWN && run->shutdown_asked)) {
        if (why == STOP_CANCEL) run->stop = why; // else a second SIGTERM: no more waiting
        ranks_signal(&run->g, SIGKILL);
        return;
    }
    if (why == STOP_HANG) { // a hung rank heeds no control line: TERM, then KILL
        if (run->stop == STOP_NONE) run->stop = why;
        ranks_signal(&run->g, SIGTERM);
        arm_kill(run);
        return;
    }
    run->shutdown_asked |= why == STOP_SHUTDOWN;
    if (run->stop == STOP_NONE) run->stop = why; // a pause under way stays a pause
    send_control(run, "stop\n"); // checkpoint at the next step, all ranks agree, exit 3
    arm_kill(run);
}

static void local_checkpoint(Job *j) {
    if (j->site.run) send_control(j->site.run, "checkpoint\n");
}

static int local_has_run(const Job *j) {
    return j->site.run != NULL;
}

const RunSite LOCAL_SITE = {.name = "local",
                            .takes_devices = 1,
                            .start = local_start,
                            .stop = local_stop,
                            .checkpoint = local_checkpoint,
                            .has_run = local_has_run};
