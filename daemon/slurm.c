// slurm.c: the slurm executor (--executor slurm, docs/design.md §12, docs/slurm.md).
//
// A run of a job is one Slurm batch job: run_dir/run<N>.sbatch, a script that sruns
// astrai-train (one task per rank; the ranks start from SLURM_* variables and meet at
// MASTER_ADDR:MASTER_PORT, the first node of the allocation) and then writes srun's exit
// status to run_dir/run<N>.exit. Everything both sides must see is in the run directory,
// under --shared-dir: the script, the ranks' output (run<N>-rank<R>.log, srun --output),
// progress.db, the exit file, and the checkpoints unless the job names another ckpt_dir.
//
// The Slurm commands run off the loop (libuv's threadpool), each bounded by a timeout. One
// poll at a time, every poll-interval: squeue for the jobs Slurm still lists, scontrol for
// those it does not, the exit files, and the new complete lines of the ranks' logs. Its
// result is applied on the loop: PENDING -> queued, RUNNING -> running, and a Slurm job that
// is gone ends the run (job_run_ended, as a local run ends): srun's exit status when the
// script wrote it (0 done, 2 bad input, 3 interrupted after a checkpoint, else a failure),
// else the failure Slurm names (CANCELLED, TIMEOUT, NODE_FAIL, PREEMPTED, ...) with its
// reason. Slurm's own requeue is off (--no-requeue): astraid alone restarts a run, from its
// checkpoint, up to max_restarts.
//
// What astraid asks of a Slurm job (cancel, pause, checkpoint: an scancel) holds until Slurm
// confirms it (scancel exits 0): a try that fails (slurmctld or munge down, a timeout, any
// non-zero exit) is made again after a backoff (job_backoff_s), at once when squeue answers
// again, until it is confirmed or the Slurm job ended. One scancel at a time, like the poll.
// The job's state records the ask (cancelling, pausing): a restarted astraid asks again.
// A failed sbatch is no run: when Slurm could not be reached it is tried again with a
// growing backoff under the same run number (one runs row, one script), spending no
// restart; a refusal Slurm answered (a partition removed) fails the job with its message.
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/buf.h"
#include "common/fsutil.h"
#include "common/words.h"
#include "daemon/daemon.h"
#include "proto/job_spec.h"

extern char **environ;

#define CMD_TIMEOUT_S 30         // a Slurm command that takes longer is killed: slurmctld is down
#define CMD_MAX_OUTPUT (1 << 20) // bytes of a command's output kept
#define LOG_CHUNK (256 * 1024)   // bytes of a rank's log read per poll
#define MAX_RANK_LOGS 4096

// What astraid asks of a Slurm job, weakest first: a stronger ask replaces a weaker one.
typedef enum { ASK_NONE, ASK_CHECKPOINT, ASK_PAUSE, ASK_CANCEL } Ask;
static const char *const ASK_NAMES[] = {"", "checkpoint", "pause", "cancel"};

struct SlurmRun {
    Job *job;
    long run_no;   // the job's run this is (run<N>.sbatch)
    StopKind stop; // why astraid stops it, STOP_NONE while it runs on its own
    int n_ranks;
    long long *log_off; // (n_ranks,) bytes of run<N>-rank<R>.log taken into the job's log
    char *state;        // Slurm's state as last seen ("PENDING", "RUNNING", ...), NULL: none yet
    char *started_from; // the job's last checkpoint when the run started (NULL: none)
    Ask ask;            // what Slurm has not confirmed yet
    long ask_tries;     // its tries that failed
    double ask_at;      // clock_mono_s() of its next try
};

static uv_timer_t poll_timer;
static int poll_busy;
static int poll_answered = 1; // the last poll's squeue answered (loop side)
static int scancel_busy;      // an scancel is under way
static int squeue_failing;    // the last poll's squeue failed (read and set on the threadpool,
                              // by one poll at a time)

// ---------------------------------------------------------------- commands

// Runs argv (PATH searched) with stdin /dev/null; its stdout and stderr together in *out
// (NUL-terminated, trailing whitespace trimmed), its wait status in *status. Blocking:
// threadpool only. -1 (err) when it could not run or took longer than CMD_TIMEOUT_S.
static int run_command(char *const argv[], char **out, int *status, Err *err) {
    int fds[2];
    *out = NULL;
    if (pipe2(fds, O_CLOEXEC)) return err_errno(err, errno, "%s: cannot make a pipe", argv[0]);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(fds[1]);
    if (rc) {
        close(fds[0]);
        return err_errno(err, rc, "%s: cannot run it (is Slurm installed and on PATH?)", argv[0]);
    }
    Buf b = {0};
    char chunk[4096];
    double deadline = clock_mono_s() + CMD_TIMEOUT_S;
    int timed_out = 0;
    for (;;) {
        double left = deadline - clock_mono_s();
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        if (left <= 0 || poll(&p, 1, (int)(left * 1000) + 1) == 0) {
            timed_out = 1;
            break;
        }
        ssize_t n = read(fds[0], chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        if (b.len < CMD_MAX_OUTPUT) buf_append(&b, chunk, (size_t)n);
    }
    close(fds[0]);
    if (timed_out) kill(pid, SIGKILL);
    while (waitpid(pid, status, 0) < 0 && errno == EINTR)
        ;
    *out = b.len ? buf_take(&b) : strdup("");
    if (!*out) return err_resource(err, "%s: out of memory", argv[0]);
    size_t len = strlen(*out);
    while (len && ((*out)[len - 1] == '\n' || (*out)[len - 1] == ' '))
        (*out)[--len] = 0;
    if (timed_out)
        return err_resource(err, "%s: no answer within %d s (is slurmctld up?)", argv[0],
                            CMD_TIMEOUT_S);
    return 0;
}

// Whether a Slurm command's output says it got no answer from Slurm (slurmctld down or
// busy, munge down or its credential refused): a failure another try may not have
// (err->resource), unlike a refusal Slurm answered (an invalid partition, ...).
static int slurm_unreachable(const char *text) {
    static const char *const NO_ANSWER[] = {"Unable to contact slurm controller",
                                            "timed out",
                                            "Connection refused",
                                            "Zero Bytes were transmitted",
                                            "Communication connection failure",
                                            "authentication error",
                                            "Munge",
                                            "munge",
                                            "temporarily",
                                            "standby mode",
                                            NULL};
    for (const char *const *p = NO_ANSWER; *p; p++)
        if (strstr(text, *p)) return 1;
    return 0;
}

// Runs argv; 0 when it exited 0, else -1 with err = "NAME: its output" (the name once:
// Slurm's own lines start with it).
static int run_slurm(char *const argv[], char **out, Err *err) {
    int status = 0;
    char *text = NULL;
    if (run_command(argv, &text, &status, err)) {
        free(text);
        return -1;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status)) {
        size_t n = strlen(argv[0]);
        int named = !strncmp(text, argv[0], n) && text[n] == ':';
        err_set(err, "%s%s%s", named ? "" : argv[0], named ? "" : ": ", *text ? text : "failed");
        err->resource = !WIFEXITED(status) || slurm_unreachable(text);
        free(text);
        return -1;
    }
    if (out)
        *out = text;
    else
        free(text);
    return 0;
}

// ---------------------------------------------------------------- the batch script

// s quoted for sh and for sbatch's #SBATCH lines: "..." with \ before each \ " $ `. (sbatch
// splits an #SBATCH line at blanks, honouring quotes, and takes a backslash as an escape even
// within '...': sh's single quotes would lose a path's backslashes there.)
static void shell_quote(Buf *b, const char *s) {
    buf_append(b, "\"", 1);
    for (; *s; s++) {
        if (strchr("\\\"$`", *s)) buf_append(b, "\\", 1);
        buf_append(b, s, 1);
    }
    buf_append(b, "\"", 1);
}

// A count of the spec (0: not given) or dflt.
static long given_or(long value, long dflt) {
    return value > 0 ? value : dflt;
}

// The job's nodes and tasks (ranks) per node. GPU jobs (gpus_per_node, or the daemon's
// --slurm-gpus-per-node): one GPU per rank, gpus_per_node ranks on each node (fewer when the
// job has fewer ranks), as many nodes as that takes. CPU jobs: the ranks spread evenly over
// the job's nodes (or --slurm-nodes).
static void job_layout(const Job *j, long *nodes, long *per_node, long *gpus) {
    long n = j->n_devices;
    *gpus = given_or(j->js.gpus_per_node, astraid.cfg.slurm_gpus_per_node);
    if (*gpus) {
        *per_node = *gpus = *gpus < n ? *gpus : n;
        *nodes = given_or(j->js.nodes, (n + *per_node - 1) / *per_node);
        return;
    }
    *nodes = given_or(j->js.nodes, astraid.cfg.slurm_nodes);
    if (*nodes > n) *nodes = n;
    *per_node = (n + *nodes - 1) / *nodes;
}

// The script of run run_no (argv: astrai-train's).
static char *batch_script(const Job *j, long run_no, char **argv, const char *run_dir) {
    long nodes, per_node, gpus;
    job_layout(j, &nodes, &per_node, &gpus);
    Buf b = {0};
    char line[PATH_MAX + 128];
    buf_printf(&b, "#!/bin/sh\n# astraid job %ld, run %ld (written by astraid: do not edit)\n",
               j->id, run_no);
    buf_printf(&b, "#SBATCH --job-name=astrai-%ld\n#SBATCH --nodes=%ld\n", j->id, nodes);
    buf_printf(&b, "#SBATCH --ntasks=%ld\n#SBATCH --ntasks-per-node=%ld\n", j->n_devices, per_node);
    if (gpus) buf_printf(&b, "#SBATCH --gpus-per-node=%ld\n", gpus);
    snprintf(line, sizeof line, "%s/run%ld-batch.log", run_dir, run_no);
    buf_printf(&b, "#SBATCH --output=");
    shell_quote(&b, line);
    buf_printf(&b, "\n#SBATCH --no-requeue\n");
    buf_printf(&b, "export ASTRAI_RUN_DIR=");
    shell_quote(&b, run_dir);
    // The ranks meet on the allocation's first node, where this script runs (by its host
    // name: Slurm's node names need not resolve); the port follows the Slurm job id so that
    // two jobs sharing a node do not meet each other.
    buf_printf(&b, "\nexport MASTER_ADDR=\"$(hostname)\"\n"
                   "export MASTER_PORT=$((20000 + SLURM_JOB_ID %% 20000))\n");
    snprintf(line, sizeof line, "%s/run%ld-rank%%t.log", run_dir, run_no);
    buf_printf(&b, "srun --kill-on-bad-exit=0 --output=");
    shell_quote(&b, line);
    for (char **a = argv; *a; a++) {
        buf_append(&b, " ", 1);
        shell_quote(&b, *a);
    }
    snprintf(line, sizeof line, "%s/run%ld.exit", run_dir, run_no);
    buf_printf(&b, "\nrc=$?\necho $rc > ");
    shell_quote(&b, line);
    buf_printf(&b, ".tmp && mv ");
    shell_quote(&b, line);
    buf_printf(&b, ".tmp ");
    shell_quote(&b, line);
    buf_printf(&b, "\nexit $rc\n");
    return buf_take(&b);
}

enum { SBATCH_MAX_ARGS = 56 }; // words of --slurm-sbatch-args (sbatch's argv: 8 more)

// --slurm-sbatch-args split into words (words_split: a quoted value such as
// --comment="two words" stays one).
static char *split_words(const char *s, char **words, int *n, Err *err) {
    return words_split("slurm-sbatch-args", s, words, SBATCH_MAX_ARGS, n, err);
}

int slurm_check_config(const Config *c, Err *err) {
    char *words[SBATCH_MAX_ARGS];
    int n;
    if (!c->slurm_sbatch_args) return 0;
    char *copy = split_words(c->slurm_sbatch_args, words, &n, err);
    int rc = copy ? 0 : -1;
    free(copy);
    return rc;
}

// sbatch's arguments: the configured ones, then [--test-only] script. (argv, its strings:
// its own, as sbatches of different jobs run at once on the threadpool)
typedef struct {
    char *argv[SBATCH_MAX_ARGS + 8];
    char *words; // slurm_sbatch_args split (split_words)
    char part[256], acct[256], tlim[128];
} SbatchArgs;

static int sbatch_args(SbatchArgs *a, int test_only, const char *script, Err *err) {
    int n = 0;
    a->argv[n++] = "sbatch";
    a->argv[n++] = "--parsable";
    const Config *c = &astraid.cfg;
    if (c->slurm_partition) {
        snprintf(a->part, sizeof a->part, "--partition=%s", c->slurm_partition);
        a->argv[n++] = a->part;
    }
    if (c->slurm_account) {
        snprintf(a->acct, sizeof a->acct, "--account=%s", c->slurm_account);
        a->argv[n++] = a->acct;
    }
    if (c->slurm_time) {
        snprintf(a->tlim, sizeof a->tlim, "--time=%s", c->slurm_time);
        a->argv[n++] = a->tlim;
    }
    int words = 0;
    if (c->slurm_sbatch_args &&
        !(a->words = split_words(c->slurm_sbatch_args, a->argv + n, &words, err)))
        return -1;
    n += words;
    if (test_only) a->argv[n++] = "--test-only";
    a->argv[n++] = (char *)script;
    a->argv[n] = NULL;
    return 0;
}

// ---------------------------------------------------------------- submit check, start

typedef struct {
    uv_work_t req;
    long job;
    int test_only;
    char *script, run_dir[PATH_MAX], path[PATH_MAX + 64];
    long slurm_id;
    ChangeDone done; // test_only
    void *arg;
    Err err;
} Sbatch;

static void sbatch_free(Sbatch *s) {
    free(s->script);
    free(s);
}

static void sbatch_work(uv_work_t *req) {
    Sbatch *s = req->data;
    SbatchArgs a = {0};
    char *out = NULL;
    if (fs_mkdir_p(s->run_dir, &s->err) ||
        fs_write_file_atomic(s->path, s->script, strlen(s->script), &s->err) ||
        chmod(s->path, 0755) || sbatch_args(&a, s->test_only, s->path, &s->err) ||
        run_slurm(a.argv, &out, &s->err)) {
        if (!s->err.msg[0]) err_errno(&s->err, errno, "%s: cannot write", s->path);
    } else if (!s->test_only && (s->slurm_id = strtol(out, NULL, 10)) <= 0) {
        err_set(&s->err, "sbatch: unexpected answer '%s'", out);
    }
    if (s->test_only) unlink(s->path);
    free(a.words);
    free(out);
}

static Sbatch *sbatch_new(const Job *j, long run_no, int test_only, Err *err) {
    Sbatch *s = calloc(1, sizeof *s);
    JobSpec run; // the job's spec, resuming when the job resumes (its strings are the job's)
    if (!s) return err_resource(err, "out of memory"), NULL;
    if (job_run_spec(j, &run, err)) {
        free(s);
        return NULL;
    }
    char **argv = job_spec_argv(&run, astraid.cfg.train_binary);
    s->job = j->id;
    s->test_only = test_only;
    if (argv && !job_run_dir(j, s->run_dir, sizeof s->run_dir)) {
        snprintf(s->path, sizeof s->path, "%s/run%ld%s.sbatch", s->run_dir, run_no,
                 test_only ? "-test" : "");
        s->script = batch_script(j, run_no, argv, s->run_dir);
    }
    job_spec_free_argv(argv);
    if (!s->script) {
        sbatch_free(s);
        return err_resource(err, "out of memory writing the batch script"), NULL;
    }
    s->req.data = s;
    return s;
}

static void check_done(uv_work_t *req, int status) {
    (void)status;
    Sbatch *s = req->data;
    if (s->err.msg[0]) err_prefix(&s->err, "slurm refuses the job");
    s->done(s->arg, s->err.msg[0] ? RPC_INVALID_PARAMS : 0, &s->err);
    sbatch_free(s);
}

// A new job's sbatch --test-only (off the loop): done(arg, 0, NULL) when Slurm would take
// it, else done(arg, RPC_INVALID_PARAMS, err) with Slurm's message. -1 when it could not
// even be queued.
static int slurm_check_submit(const Job *j, ChangeDone done, void *arg, Err *err) {
    Sbatch *s = sbatch_new(j, 0, 1, err);
    if (!s) return -1;
    s->done = done;
    s->arg = arg;
    if (uv_queue_work(astraid.loop, &s->req, sbatch_work, check_done)) {
        sbatch_free(s);
        return err_resource(err, "cannot queue sbatch");
    }
    return 0;
}

static SlurmRun *run_new(Job *j) {
    SlurmRun *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->job = j;
    r->run_no = j->runs;
    r->n_ranks = j->n_devices > MAX_RANK_LOGS ? MAX_RANK_LOGS : (int)j->n_devices;
    r->log_off = calloc((size_t)r->n_ranks, sizeof *r->log_off);
    r->started_from = j->last_checkpoint ? strdup(j->last_checkpoint) : NULL;
    if (!r->log_off || (j->last_checkpoint && !r->started_from)) {
        free(r->log_off);
        free(r);
        return NULL;
    }
    return r;
}

static void run_free(SlurmRun *r) {
    free(r->log_off);
    free(r->state);
    free(r->started_from);
    free(r);
}

static void send_asks(void);

// The run is over for astraid: the job decides what comes next.
static void run_over(SlurmRun *r, const RunOutcome *o) {
    r->job->site.slurm = NULL;
    job_run_ended(r->job, o);
    run_free(r);
}

// A start Slurm did not take is no run: Slurm out of reach (or the run directory's disk
// full) and the job waits and tries again (job_run_ended: start_later, no restart spent, no
// progress); a refusal Slurm answered (a partition since removed, ...) fails the job.
static void start_failed(Job *j, SlurmRun *r, Err *err) {
    if (!err->resource) err_prefix(err, "slurm refuses the job");
    RunOutcome o = {.stop = r->stop,
                    .failed = 1,
                    .transient = err->resource,
                    .bad_input = !err->resource,
                    .cause = err->msg,
                    .started_from = r->started_from};
    j->site.unsubmitted = 1;
    run_over(r, &o);
}

static void start_done(uv_work_t *req, int status) {
    (void)status;
    Sbatch *s = req->data;
    Job *j = job_find(s->job);
    SlurmRun *r = j ? j->site.slurm : NULL;
    if (r && s->err.msg[0]) {
        start_failed(j, r, &s->err);
    } else if (r) {
        j->site.slurm_id = s->slurm_id;
        j->site.unsubmitted = 0;
        log_info("job %ld: run %ld is Slurm job %ld", j->id, r->run_no, j->site.slurm_id);
        state_event(j->id, "slurm", s->path);
        job_save(j); // its Slurm id, before anything is asked of that job
        send_asks(); // what was asked while sbatch ran
    }
    sbatch_free(s);
}

// A run as a Slurm job: the batch script into the run directory, sbatch off the loop; the
// job is `starting` until Slurm answers, then as squeue says (PENDING: queued, RUNNING:
// running). Ends through job_run_ended like a local run.
static int slurm_start(Job *j, Err *err) {
    // A run whose sbatch failed never was a Slurm job: its next try takes its number again.
    long run_no = j->site.unsubmitted ? j->runs : j->runs + 1;
    SlurmRun *r = run_new(j);
    Sbatch *s = r ? sbatch_new(j, run_no, 0, err) : NULL;
    if (!s) {
        if (r)
            run_free(r);
        else
            err_resource(err, "out of memory");
        return -1;
    }
    j->runs = run_no;
    r->run_no = j->runs;
    j->site.slurm = r;
    j->site.slurm_id = 0;
    state_run_started(j, NULL, 0); // open until the run ends: at a restart, astraid looks for it
    if (uv_queue_work(astraid.loop, &s->req, sbatch_work, start_done)) {
        j->site.slurm = NULL;
        j->site.unsubmitted = 1;
        run_free(r);
        sbatch_free(s);
        return err_resource(err, "cannot queue sbatch");
    }
    job_set_state(j, JOB_STARTING);
    return 0;
}

// ---------------------------------------------------------------- stop, checkpoint

typedef struct {
    uv_work_t req;
    long job, slurm_id, run_no;
    Ask ask;
    char signal[16]; // "" : a plain scancel
    Err err;
} Scancel;

static void scancel_work(uv_work_t *req) {
    Scancel *c = req->data;
    char id[32], sig[32];
    snprintf(id, sizeof id, "%ld", c->slurm_id);
    snprintf(sig, sizeof sig, "--signal=%s", c->signal);
    char *argv[] = {"scancel", c->signal[0] ? sig : id, c->signal[0] ? id : NULL, NULL};
    run_slurm(argv, NULL, &c->err);
}

static int is_pending(const SlurmRun *r) {
    return !r->state || !strcmp(r->state, "PENDING") || !strcmp(r->state, "CONFIGURING");
}

// The scancel signal of r's ask ("": a plain scancel), NULL while it must wait for what
// Slurm says of the job: a pause withdraws a pending job but signals a running one (its
// ranks checkpoint); a checkpoint needs running ranks.
static const char *ask_signal(const SlurmRun *r) {
    if (r->ask == ASK_CANCEL) return "";
    if (r->ask == ASK_PAUSE && r->state) return is_pending(r) ? "" : "TERM";
    if (r->ask == ASK_CHECKPOINT && r->state && !strcmp(r->state, "RUNNING")) return "USR1";
    return NULL;
}

// The ask due first that can be sent now, NULL: none.
static Job *next_ask(void) {
    double now = clock_mono_s();
    Job *pick = NULL;
    for (Job *j = astraid.jobs; j; j = j->next) {
        const SlurmRun *r = j->site.slurm;
        if (r && j->site.slurm_id && r->ask && r->ask_at <= now && ask_signal(r) &&
            (!pick || r->ask_at < pick->site.slurm->ask_at))
            pick = j;
    }
    return pick;
}

static void scancel_done(uv_work_t *req, int status) {
    (void)status;
    Scancel *c = req->data;
    Job *j = job_find(c->job);
    SlurmRun *r = j ? j->site.slurm : NULL;
    scancel_busy = 0;
    // Of the run it was sent to, and not replaced meanwhile by a stronger ask.
    if (r && r->run_no == c->run_no && j->site.slurm_id == c->slurm_id && r->ask == c->ask) {
        if (!c->err.msg[0]) {
            if (r->ask_tries)
                log_info("job %ld: Slurm job %ld took the %s (after %ld failed tr%s)", j->id,
                         c->slurm_id, ASK_NAMES[c->ask], r->ask_tries,
                         r->ask_tries == 1 ? "y" : "ies");
            r->ask = ASK_NONE;
            r->ask_tries = 0;
        } else {
            double wait = job_backoff_s(++r->ask_tries);
            r->ask_at = clock_mono_s() + wait;
            log_warn("job %ld: %s (the %s is asked again in %.0f s)", j->id, c->err.msg,
                     ASK_NAMES[c->ask], wait);
        }
    }
    free(c);
    send_asks();
}

// Sends the next ask due (one scancel at a time: a dead slurmctld holds one thread of the
// threadpool, not one per job). None while astraid stops: the job's state keeps it.
static void send_asks(void) {
    Job *j = scancel_busy || astraid.stopping ? NULL : next_ask();
    Scancel *c = j ? calloc(1, sizeof *c) : NULL;
    if (!c) return; // none due, or no memory: the next poll tries again
    const SlurmRun *r = j->site.slurm;
    *c = (Scancel){.job = j->id, .slurm_id = j->site.slurm_id, .run_no = r->run_no, .ask = r->ask};
    snprintf(c->signal, sizeof c->signal, "%s", ask_signal(r));
    c->req.data = c;
    if (uv_queue_work(astraid.loop, &c->req, scancel_work, scancel_done)) {
        free(c);
        return;
    }
    scancel_busy = 1;
}

// r is to get `ask` (unless a stronger one is under way), at once.
static void ask(SlurmRun *r, Ask a) {
    if (a < r->ask) return;
    r->ask = a;
    r->ask_at = 0;
    send_asks();
}

// pause: scancel --signal=TERM (every rank checkpoints at one step and exits 3); a pending
// job is just cancelled; shutdown leaves the Slurm job running (astraid finds it again at
// its next start). cancel: scancel. What Slurm did not confirm (scancel failed: slurmctld
// or munge down) is tried again with a backoff until it does or the Slurm job ended.
static void slurm_stop(Job *j, StopKind why) {
    SlurmRun *r = j->site.slurm;
    if (!r) return;
    if (why == STOP_SHUTDOWN) return; // the cluster keeps it; astraid tracks it again at start
    if (r->stop == STOP_NONE || why == STOP_CANCEL) r->stop = why;
    ask(r, why == STOP_CANCEL ? ASK_CANCEL : ASK_PAUSE); // before sbatch answered: start_done
}

// scancel --signal=USR1, tried again like a stop.
static void slurm_checkpoint(Job *j) {
    if (j->site.slurm) ask(j->site.slurm, ASK_CHECKPOINT);
}

// ---------------------------------------------------------------- the poll

typedef struct {
    long job, slurm_id, run_no;
    char run_dir[PATH_MAX];
    int n_ranks;
    long long *log_off;   // (n_ranks,) where to read from (copied), then where the reads ended
    char **lines;         // (n_ranks,) complete new lines of each rank's log, NULL: none
    char *state, *reason; // Slurm's, NULL when Slurm does not know the job any more
    int exit_code;        // from run<N>.exit, -1: not written
    char *batch_tail;     // a failed srun: the last lines of run<N>-batch.log (srun's errors)
} Watch;

typedef struct {
    uv_work_t req;
    Watch *w;
    int n;
    int listed; // squeue answered: a job it does not list is not pending or running
} Poll;

// "KEY=VALUE" of scontrol's one-line output (VALUE up to the next space).
static char *scontrol_field(const char *text, const char *key) {
    size_t k = strlen(key);
    for (const char *p = text; (p = strstr(p, key)); p += k)
        if ((p == text || p[-1] == ' ') && p[k] == '=')
            return strndup(p + k + 1, strcspn(p + k + 1, " "));
    return NULL;
}

// The last BATCH_TAIL bytes of run<N>-batch.log, from its first whole line.
#define BATCH_TAIL 600
static char *read_batch_tail(const Watch *w) {
    char path[PATH_MAX + 32], buf[BATCH_TAIL + 1];
    snprintf(path, sizeof path, "%s/run%ld-batch.log", w->run_dir, w->run_no);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    off_t at = st.st_size > BATCH_TAIL ? st.st_size - BATCH_TAIL : 0;
    ssize_t n = pread(fd, buf, BATCH_TAIL, at);
    close(fd);
    if (n <= 0) return NULL;
    buf[n] = 0;
    char *start = at ? strchr(buf, '\n') : buf;
    return start && *start ? strdup(start + (at != 0)) : NULL;
}

static void read_exit(Watch *w) {
    char path[PATH_MAX + 32], text[32] = {0};
    snprintf(path, sizeof path, "%s/run%ld.exit", w->run_dir, w->run_no);
    FILE *f = fopen(path, "r");
    w->exit_code = -1;
    if (f && fgets(text, sizeof text, f)) w->exit_code = atoi(text);
    if (f) fclose(f);
    if (w->exit_code > 0 && w->exit_code != EXIT_INTERRUPTED) w->batch_tail = read_batch_tail(w);
}

// The complete lines appended to rank r's log since log_off[r].
static void read_log(Watch *w, int r) {
    char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/run%ld-rank%d.log", w->run_dir, w->run_no, r);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char *buf = malloc(LOG_CHUNK + 1);
    ssize_t n = buf ? pread(fd, buf, LOG_CHUNK, (off_t)w->log_off[r]) : -1;
    close(fd);
    if (n <= 0) {
        free(buf);
        return;
    }
    ssize_t end = n;
    while (end > 0 && buf[end - 1] != '\n')
        end--;
    if (end == 0 && n == LOG_CHUNK) end = n; // one line longer than a chunk: split
    buf[end] = 0;
    w->log_off[r] += end;
    if (end)
        w->lines[r] = buf;
    else
        free(buf);
}

static void squeue_states(Poll *p) {
    Buf ids = {0};
    for (int i = 0; i < p->n; i++)
        buf_printf(&ids, "%s%ld", i ? "," : "", p->w[i].slurm_id);
    char *list = buf_take(&ids), *out = NULL;
    char *argv[] = {"squeue", "--noheader", "--states=all", "--format=%i|%T|%r", "--jobs",
                    list,     NULL};
    Err err = {0};
    if (list && !run_slurm(argv, &out, &err)) {
        p->listed = 1;
        char *save = NULL;
        for (char *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
            long id = strtol(line, NULL, 10);
            char *st = strchr(line, '|'), *reason = st ? strchr(st + 1, '|') : NULL;
            if (!reason) continue;
            *reason++ = 0;
            for (int i = 0; i < p->n; i++)
                if (p->w[i].slurm_id == id) {
                    p->w[i].state = strdup(st + 1);
                    p->w[i].reason = strdup(reason);
                }
        }
    }
    // Said once when squeue starts failing and once when it answers again, not at each poll.
    if (list && p->listed && squeue_failing)
        log_info("slurm: squeue answers again");
    else if (list && !p->listed && !squeue_failing)
        log_warn("slurm: %s", err.msg);
    if (list) squeue_failing = !p->listed;
    free(list);
    free(out);
}

// A job squeue no longer lists: scontrol may still know how it ended.
static void scontrol_state(Watch *w) {
    char id[32], *out = NULL;
    snprintf(id, sizeof id, "%ld", w->slurm_id);
    char *argv[] = {"scontrol", "--oneliner", "show", "job", id, NULL};
    Err err = {0};
    if (run_slurm(argv, &out, &err)) {
        free(out);
        return;
    }
    w->state = scontrol_field(out, "JobState");
    w->reason = scontrol_field(out, "Reason");
    free(out);
}

static void poll_work(uv_work_t *req) {
    Poll *p = req->data;
    squeue_states(p);
    for (int i = 0; i < p->n; i++) {
        Watch *w = &p->w[i];
        if (p->listed && !w->state) scontrol_state(w);
        read_exit(w); // after the state: an exit file written meanwhile is seen
        for (int r = 0; r < w->n_ranks; r++)
            read_log(w, r);
    }
}

static int is_final_state(const char *s) {
    static const char *const LIVE[] = {"PENDING",   "CONFIGURING", "RUNNING",  "COMPLETING",
                                       "SUSPENDED", "REQUEUED",    "RESIZING", "SIGNALING",
                                       "STAGE_OUT", "STOPPED",     NULL};
    for (const char *const *l = LIVE; *l; l++)
        if (!strcmp(s, *l)) return 0;
    return 1;
}

static void take_lines(Job *j, int rank, char *text) {
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save))
        job_add_log(j, rank, line, strlen(line));
}

// "srun exited with code 1 (Slurm job 12); last output: ..." (srun's own error lines),
// or "Slurm job 12 TIMEOUT (reason)" when the batch script could not write srun's status.
static char *slurm_cause(const Watch *w, const char *state) {
    Buf b = {0};
    if (w->exit_code >= 0) {
        buf_printf(&b, "srun exited with code %d (Slurm job %ld)", w->exit_code, w->slurm_id);
        if (w->batch_tail) buf_printf(&b, "; last output:\n%s", w->batch_tail);
    } else {
        buf_printf(&b, "Slurm job %ld %s", w->slurm_id, state);
        if (w->reason && strcmp(w->reason, "None")) buf_printf(&b, " (%s)", w->reason);
    }
    return buf_take(&b);
}

// What the Slurm job's end means for the run (it ended: its exit file or Slurm says so).
static void apply_end(SlurmRun *r, const Watch *w) {
    const char *state = w->state ? w->state : "is no longer known to Slurm";
    int code = w->exit_code;
    RunOutcome o = {.stop = r->stop};
    o.failed = code != 0 && code != EXIT_INTERRUPTED;
    o.bad_input = code == EXIT_BAD_INPUT;
    o.interrupted = code == EXIT_INTERRUPTED;
    o.exited_ok = code == 0;
    o.started_from = r->started_from;
    char *cause = o.failed || o.interrupted ? slurm_cause(w, state) : NULL;
    o.cause = cause;
    log_info("job %ld: Slurm job %ld ended: %s, exit %d", r->job->id, w->slurm_id, state, code);
    run_over(r, &o);
    free(cause);
}

static void apply_watch(const Watch *w) {
    Job *j = job_find(w->job);
    SlurmRun *r = j ? j->site.slurm : NULL;
    if (!r || r->run_no != w->run_no || j->site.slurm_id != w->slurm_id) return;
    for (int rank = 0; rank < w->n_ranks && rank < r->n_ranks; rank++) {
        r->log_off[rank] = w->log_off[rank];
        if (w->lines[rank]) take_lines(j, rank, w->lines[rank]);
    }
    if (w->state && (!r->state || strcmp(r->state, w->state))) {
        free(r->state);
        r->state = strdup(w->state);
        if (w->reason && strcmp(w->reason, "None")) state_event(j->id, w->state, w->reason);
    }
    int gone = w->exit_code >= 0 || (w->state ? is_final_state(w->state) : 1);
    if (gone) {
        apply_end(r, w);
        return;
    }
    JobState want = is_pending(r) ? JOB_QUEUED : JOB_RUNNING;
    if ((j->state == JOB_STARTING || j->state == JOB_QUEUED || j->state == JOB_RUNNING) &&
        j->state != want)
        job_set_state(j, want);
}

static void poll_free(Poll *p) {
    for (int i = 0; i < p->n; i++) {
        Watch *w = &p->w[i];
        for (int r = 0; w->lines && r < w->n_ranks; r++)
            free(w->lines[r]);
        free(w->lines);
        free(w->log_off);
        free(w->state);
        free(w->reason);
        free(w->batch_tail);
    }
    free(p->w);
    free(p);
}

// squeue answers again: what waited for Slurm is asked now, not after its backoff.
static void asks_due_now(void) {
    for (Job *j = astraid.jobs; j; j = j->next)
        if (j->site.slurm) j->site.slurm->ask_at = 0;
}

static void poll_done(uv_work_t *req, int status) {
    (void)status;
    Poll *p = req->data;
    poll_busy = 0;
    if (p->listed && !poll_answered) asks_due_now();
    poll_answered = p->listed;
    // A job squeue could not be asked about stays as it is: slurmctld may be back soon.
    for (int i = 0; i < p->n; i++)
        if (p->listed || p->w[i].exit_code >= 0) apply_watch(&p->w[i]);
    poll_free(p);
    send_asks(); // a pause waits for the job's state
}

static void on_poll(uv_timer_t *t) {
    (void)t;
    send_asks(); // those whose backoff ended
    int n = 0;
    for (Job *j = astraid.jobs; j; j = j->next)
        n += j->site.slurm && j->site.slurm_id;
    if (poll_busy || n == 0) return;
    Poll *p = calloc(1, sizeof *p);
    if (p) p->w = calloc((size_t)n, sizeof *p->w);
    if (!p || !p->w) {
        free(p);
        return;
    }
    for (Job *j = astraid.jobs; j; j = j->next) {
        SlurmRun *r = j->site.slurm;
        if (!r || !j->site.slurm_id) continue;
        Watch *w = &p->w[p->n];
        *w = (Watch){.job = j->id,
                     .slurm_id = j->site.slurm_id,
                     .run_no = r->run_no,
                     .n_ranks = r->n_ranks,
                     .exit_code = -1};
        w->log_off = malloc((size_t)r->n_ranks * sizeof *w->log_off);
        w->lines = calloc((size_t)r->n_ranks, sizeof *w->lines);
        if (!w->log_off || !w->lines || job_run_dir(j, w->run_dir, sizeof w->run_dir)) {
            free(w->log_off);
            free(w->lines);
            continue;
        }
        memcpy(w->log_off, r->log_off, (size_t)r->n_ranks * sizeof *w->log_off);
        p->n++;
    }
    p->req.data = p;
    if (p->n == 0 || uv_queue_work(astraid.loop, &p->req, poll_work, poll_done)) {
        poll_free(p);
        return;
    }
    poll_busy = 1;
}

// ---------------------------------------------------------------- startup

// At start: whether Slurm answers, said in the log (a dead slurmctld may take the command's
// whole timeout: on the threadpool, so that astraid serves meanwhile).
static void probe_work(uv_work_t *req) {
    (void)req;
    char *out = NULL;
    Err err = {0};
    char *argv[] = {"sinfo", "--noheader", "--format=%P %a %D", NULL};
    if (run_slurm(argv, &out, &err))
        log_error("slurm: %s (jobs cannot run until Slurm answers)", err.msg);
    else
        log_info("slurm: partitions: %s", out);
    free(out);
}

static void probe_done(uv_work_t *req, int status) {
    (void)req, (void)status;
}

// --executor slurm (docs/slurm.md): asks slurmctld (sinfo, off the loop; a failure is logged:
// astraid serves, and submits say why they cannot run), and starts the poll of the Slurm jobs
// (squeue/scontrol and the ranks' log files, every poll-interval, off the loop). Needs
// astraid.loop.
static void slurm_init(void) {
    static uv_work_t probe;
    uv_timer_init(astraid.loop, &poll_timer);
    uint64_t ms = (uint64_t)(astraid.cfg.poll_interval * 1000);
    uv_timer_start(&poll_timer, on_poll, ms, ms);
    (void)uv_queue_work(astraid.loop, &probe, probe_work, probe_done); // fails only without work
}

void slurm_free(void) {
    for (Job *j = astraid.jobs; j; j = j->next)
        if (j->site.slurm) {
            run_free(j->site.slurm);
            j->site.slurm = NULL;
        }
}

// The Slurm job of run run_no when sbatch submitted it but astraid died before it heard the
// id: the job Slurm lists under the job's name whose script is that run's (its path is in
// this astraid's run directory, so no other astraid's job matches). 0: none. Blocking
// (startup only).
static long find_submitted(const Job *j, long run_no) {
    char run_dir[PATH_MAX], script[PATH_MAX + 64], name[48], *out = NULL;
    if (job_run_dir(j, run_dir, sizeof run_dir)) return 0;
    snprintf(script, sizeof script, "%s/run%ld.sbatch", run_dir, run_no);
    snprintf(name, sizeof name, "--name=astrai-%ld", j->id);
    char *argv[] = {"squeue", "--noheader", "--format=%i|%o", name, NULL};
    Err err = {0};
    long id = 0;
    if (run_slurm(argv, &out, &err)) log_warn("job %ld: %s", j->id, err.msg);
    char *save = NULL;
    for (char *line = out ? strtok_r(out, "\n", &save) : NULL; line && !id;
         line = strtok_r(NULL, "\n", &save)) {
        char *bar = strchr(line, '|');
        if (bar && !strcmp(bar + 1, script)) id = strtol(line, NULL, 10);
    }
    free(out);
    return id;
}

// At start, for a job whose last run was still open: its Slurm job (slurm_id, or when astraid
// died before sbatch answered, the job squeue lists with that run's script) is tracked
// again. -1 when it has none (the run is over: the job is recovered as a local one).
static int slurm_attach(Job *j) {
    if (!j->site.slurm_id && !(j->site.slurm_id = find_submitted(j, j->runs))) return -1;
    SlurmRun *r = run_new(j);
    if (!r) return -1;
    j->site.slurm = r;
    // Its logs were taken into the ring before astraid stopped: new lines only.
    char run_dir[PATH_MAX], path[PATH_MAX + 64];
    for (int rank = 0; !job_run_dir(j, run_dir, sizeof run_dir) && rank < r->n_ranks; rank++) {
        struct stat st;
        snprintf(path, sizeof path, "%s/run%ld-rank%d.log", run_dir, r->run_no, rank);
        if (!stat(path, &st)) r->log_off[rank] = (long long)st.st_size;
    }
    // A pause or a cancel astraid asked before it stopped is asked again (Slurm may not have
    // confirmed it; again, it changes nothing: the ranks stop once).
    if (j->state == JOB_PAUSING || j->state == JOB_CANCELLING) {
        int cancel = j->state == JOB_CANCELLING;
        r->stop = cancel ? STOP_CANCEL : STOP_PAUSE;
        r->ask = cancel ? ASK_CANCEL : ASK_PAUSE;
    }
    log_info("job %ld: tracking Slurm job %ld again%s%s", j->id, j->site.slurm_id,
             r->ask ? ", asking again for its " : "", ASK_NAMES[r->ask]);
    return 0;
}

// Slurm's word for its live run ("RUNNING"), or NULL.
static const char *slurm_state(const Job *j) {
    return j->site.slurm ? j->site.slurm->state : NULL;
}

static int slurm_has_run(const Job *j) {
    return j->site.slurm != NULL;
}

const RunSite SLURM_SITE = {
    .name = "slurm",
    .takes_devices = 0,    // Slurm allocates the nodes and GPUs
    .cancel_confirmed = 1, // a cancel is Slurm's to confirm (slurmctld may be down)
    .init = slurm_init,
    // sbatch --test-only before the job is written
    .check_submit = slurm_check_submit,
    .start = slurm_start,
    .stop = slurm_stop,
    .checkpoint = slurm_checkpoint,
    // its Slurm job lives on
    .has_run = slurm_has_run,
    .attach = slurm_attach,
    .run_state = slurm_state,
};
