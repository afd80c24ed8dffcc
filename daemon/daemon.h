// daemon.h: astraid, the training service (docs/design.md §1, §3, §5, §6). One file per
// subsystem, sharing the one daemon state `astraid` (as Redis shares `server`):
//
//   tools/astraid/main.c  main(): flags, startup
//   lifecycle.c       the daemon state `astraid`; stop signals and shutdown
//   config.c          the options (flags and config file keys), the config file's parser
//   log.c             leveled logging to stderr
//   server.c          unix/tcp listeners, connections, line framing, output queues
//   dispatch.c        the JSON-RPC methods
//   http.c            the HTTP listener (--http): the web page, /metrics, /api, off the loop
//   metrics.c         the Prometheus text of /metrics, the request counters
//   jobs.c            jobs and their state machine (docs/design.md §5), ids
//   job_log.c         a job's output lines: the ring of a live job, a final one's files
//   job_json.c        the JOB object, its text kept until a value it shows changes
//   job_paths.c       a job's directories: resolved, checked, never two live jobs' the same
//   history.c         finished jobs: rm, retention (--keep-finished)
//   scheduler.c       devices (CPU slots or GPUs) and the queue
//   gpu.c             NVML (dlopen): the GPUs, their memory and use, sampled on a timer
//   runner.c          the ranks of a run: spawn, control pipes, logs, exits, stops
//   state.c           the daemon database (sqlite: jobs, runs, events), its writer, recovery
//   progress_reader.c each running job's progress.db, polled read-only off the loop
//   curve.c           a job's training curve from its progress.db (history, the web page)
//   samples.c         what a job's model wrote as it trained, from its progress.db (samples)
//   watchdog.c        hangs (no new step: stacks recorded, run restarted) and time limits
//   notify.c          notify_command: a program run on job events
//   helper.c          short-lived helper programs (gdb, notify_command), bounded, never waited on
//   systemd.c         systemd notifications and socket activation
//   slurm.c           the slurm site: jobs run as Slurm batch jobs (sbatch, squeue, scancel)
#pragma once
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "common/clock.h"
#include "common/error.h"
#include "proto/job_spec.h"
#include "proto/rpc.h"

typedef struct cJSON cJSON;

#define ASTRAID_VERSION "0.1.0"

// ---------------------------------------------------------------- log.c
enum { LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG };
int log_set_level(const char *name, Err *err);
void log_msg(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_DEBUG, __VA_ARGS__)

// ---------------------------------------------------------------- config.c: configuration
typedef struct {
    char *socket_path;  // unix control socket
    char *state_dir;    // astraid.db and jobs/<id>/
    char *tcp;          // "HOST:PORT" or NULL (off)
    char *token_file;   // bearer token for tcp and http (mode 0600)
    char *admin_group;  // its members may act on every user's job (NULL: root only)
    char *http;         // "HOST:PORT" of the HTTP listener or NULL (off)
    char *devices;      // "N", "cpu:N", "cuda:0,1" or NULL (auto)
    char *train_binary; // astrai-train
    char *log_level;
    long max_restarts;        // default of a job's max_restarts
    double stop_timeout;      // seconds ranks get to checkpoint and exit before SIGKILL
    long max_connections;     // open unix and authenticated tcp connections at once
    long max_unauthenticated; // open tcp connections that have not authenticated yet
    double auth_timeout;      // seconds a tcp connection gets to authenticate
    double poll_interval;     // seconds between progress.db reads
    char *keep_finished;      // retention of finished jobs: "N" (the N newest) or "Dd" (days)
    char *executor;           // "local" (default) or "slurm"
    char *shared_dir;         // the jobs' run directories (default state_dir): under slurm, a
                              // directory the cluster's nodes see at the same path
    char *slurm_partition, *slurm_account, *slurm_time; // sbatch's --partition/--account/--time
    char *slurm_sbatch_args;                            // more sbatch arguments (sh-like words)
    long slurm_gpus_per_node; // a job's GPUs per node when it does not say (0: CPU tasks)
    long slurm_nodes;         // the nodes of a CPU job that does not say
    char *notify_command;     // run on job events (sh-like words, no shell), NULL: none
    double notify_timeout;    // seconds a notify_command gets before SIGKILL
    char *gdb;                // the hang watchdog's stack recorder; "none": /proc only
} Config;

// One option: a --flag of astraid and a key of its config file.
typedef enum { OPT_STR, OPT_LONG, OPT_DOUBLE } OptType;
typedef struct {
    const char *name; // "max-restarts" (the file may spell it "max_restarts")
    OptType type;
    size_t offset; // of its field in Config
    double lo, hi; // range of a number
    const char *help;
} ConfigOption;
extern const ConfigOption CONFIG_OPTIONS[];
extern const size_t CONFIG_N_OPTIONS;

// The option of a flag or key name ('_' and '-' alike), NULL when there is none.
const ConfigOption *config_option(const char *name);
// Sets o's field of c from its text value; err names the option when it is out of range.
int config_set(Config *c, const ConfigOption *o, const char *value, Err *err);
// Applies a config file's keys: text[0..len) is a JSON object, path names it in errors.
int config_apply_json(Config *c, const char *text, size_t len, const char *path, Err *err);
int config_apply_file(Config *c, const char *path, Err *err);
void config_free(Config *c); // its strings

// ---------------------------------------------------------------- scheduler.c: devices
typedef struct {
    int gpu;    // 1: CUDA devices (ids are GPU indices), 0: CPU slots
    int n;      // devices
    int *ids;   // (n,) device ids
    long *used; // (n,) id of the job holding device i, 0 when free
} Devices;

// spec: "N" or "cpu:N" (CPU slots), "cuda:0,1,..." (GPUs NVML finds), NULL: the GPUs
// NVML finds (gpu_count), else one CPU slot per core. Needs gpu_init first. A bad spec is
// bad input; err->resource marks a want of memory.
int devices_init(Devices *d, const char *spec, Err *err);
void devices_free(Devices *d);
cJSON *devices_to_json(const Devices *d);
void device_name(const Devices *d, int id, char *out, size_t cap); // "cuda:0", "cpu:3"
int devices_has(const Devices *d, int id);

// ---------------------------------------------------------------- gpu.c
// Loads NVML, reads the GPUs and takes a first sample, then samples every 2 s on the
// threadpool. Without NVML (or GPUs): no timer, gpu_count() 0. Needs astraid.loop.
void gpu_init(void);
void gpu_free(void); // after uv_run returned
int gpu_count(void); // GPUs NVML found
// From the last sample (never NVML itself); -1 when unknown.
int gpu_utilization(int index);                   // percent
int64_t gpu_process_memory(int index, pid_t pid); // bytes pid uses on the GPU
cJSON *gpus_to_json(void);                        // daemon.info "gpus"
// A GPU's health from the last sample; -1 where the driver does not say.
typedef struct {
    int64_t retired_pages;   // retired memory pages (single- and double-bit ECC causes)
    int retired_pending;     // 1: a retirement waits for a GPU reset
    int64_t ecc_uncorrected; // uncorrected ECC errors since the driver loaded (volatile)
} GpuHealth;
int gpu_health(int index, GpuHealth *out); // -1: no such GPU
// The compute processes of the last sample on GPU index: up to cap pids and their bytes (-1:
// unknown); returns how many there are.
int gpu_processes(int index, pid_t *pids, int64_t *bytes, int cap);

// ---------------------------------------------------------------- jobs.c
typedef enum {
    JOB_QUEUED,
    JOB_STARTING,
    JOB_RUNNING,
    JOB_PAUSING,
    JOB_PAUSED,
    JOB_COMPLETED,
    JOB_FAILED,
    JOB_CANCELLED,
    JOB_INTERRUPTED,
    JOB_CANCELLING, // slurm: cancelled, its Slurm job not yet ended (it holds its ckpt_dir)
    JOB_NSTATES
} JobState;

const char *job_state_name(JobState s);
int job_state_parse(const char *name, JobState *out);

#define JOB_LOG_LINES 1000 // output lines kept in memory per job with a run (all ranks)

typedef struct {
    int rank;
    char *text;
} LogLine;

typedef struct Run Run;
typedef struct JobText JobText;
typedef struct SlurmRun SlurmRun;

// What progress.db says of a job's runs (progress_reader.c's, applied by progress_apply).
// The online strategies' newest step's rollout statistics (docs/training.md "Online GRPO and
// DPO"); has 0: not an online job, or no step yet.
typedef struct {
    double reward_mean, reward_std, response_len, equal_reward_groups;
    int has;
} RolloutNumbers;

typedef struct {
    long step, total_steps, epoch;
    double loss, lr, grad_norm, tokens_per_s, eta_s, val_loss;
    int has_step, has_val_loss;
    double loss_scale; // --loss_scale: the newest step's (has_loss_scale) and the skipped steps
    long skipped_steps;
    int has_loss_scale;
    // a mixture of experts: the newest step's most and least loaded routed expert over its
    // layer's mean (has_expert_load; a dense model has none)
    double expert_load_max, expert_load_min;
    int has_expert_load;
    RolloutNumbers rollout;
    int seen;    // its progress.db was read by this astraid (val_loss is known)
    char *error; // why its progress.db cannot be read, NULL: it can
} JobProgressView;

// The hang watchdog's and the time limit's view of a job (watchdog.c; progress_reader.c places
// the ranks' progress in it). The limits themselves are the spec's (js).
typedef struct {
    long hangs;            // runs stopped as hung (JOB "hangs")
    double seen_mono;      // clock_mono_s() of the run's last progress (a new step or phase,
                           // placed by the ranks' own timestamp), 0: none yet (the watch starts
                           // at the run's first step)
    long seen_step;        // the step then
    double step_median_s;  // median seconds per step of the newest steps, 0: unknown
    char *phase;           // the trainer's phase ("validation", "checkpoint"), NULL: steps
    double phase_since;    // its unix start
    double read_mono;      // clock_mono_s() when the newest read of its steps applied began
    double verdict_mono;   // silent past its limit: clock_mono_s() when the watchdog asked for
                           // the re-read its verdict waits for, 0: none
    char *hang_cause;      // the watchdog stopped the run as hung: why, until the run's end
    double run_time_s;     // seconds its runs took since submit or the last resume
    double run_start_mono; // clock_mono_s() when its current run started, 0: none
} JobWatch;

// Changes on their way to the database (state.c's writer; jobs.c, scheduler.c, history.c): a
// verb's change is made once its row committed, if version (bumped by every change written) is
// still the one it was planned on; changing counts them. unsaved: a submit not committed yet;
// removing: rm or the retention, its rows being deleted. Neither is shown to clients.
typedef struct {
    long version;
    int changing, unsaved, removing;
    int launching; // its start is on its way: the row that must commit before it (scheduler.c)
    int row_stale; // its last row did not commit: it is written again (jobs.c, resave)
} JobRows;

// Its run as the run site keeps it (runner.c, slurm.c): opaque to the rest.
typedef struct {
    Run *run;        // the ranks of its run under the local site, while they live
    SlurmRun *slurm; // its Slurm job under the slurm site, until it ended
    long slurm_id;   // the Slurm job id of its last run (slurm site), 0: none
    int unsubmitted; // slurm: its last run's sbatch failed, so the next try takes its number
} JobSiteRun;

typedef struct Job {
    long id;
    char *name;
    JobState state;
    JobState shown_state; // the state of its last row written: what clients see
    cJSON *spec;          // as submitted, plus the defaulted ckpt_dir: what is shown of it
    JobSpec js;           // spec parsed once (at submit, or at recovery): what is read of it
    char *spec_error;     // why a stored spec no longer parses (recovery): no run starts; NULL
    char *spec_text;      // spec printed (by jobs_adopt), for the JOB objects
    char *ckpt_dir;
    char *ckpt_real; // ckpt_dir's canonical form (job_ckpt_dir_resolve), NULL: did not resolve
    long restarts, max_restarts, priority, n_devices;
    // restarts since this astraid started, for /metrics' counter: never reset, unlike
    // restarts (reset by resume and by a run that saved new progress)
    long restarts_total;
    int *want_ids; // (n_devices,) device ids the spec names, or NULL for any
    int *devices;  // (n_devices,) ids held while a run is alive, else NULL
    char *last_checkpoint, *error;
    long submitted_by;                          // uid, -1 when unknown (tcp)
    double created_at, started_at, finished_at; // unix seconds, 0: not yet
    int resume;                                 // the next run adds --resume=true
    long runs;                                  // runs started so far (run<N>-rank<R>.log)
    double hold_until;  // restart backoff: not started before this clock_mono_s()
    long start_retries; // runs in a row that could not start for want of a resource (fds, memory)
    int ending;         // its run ended: what it left (progress, checkpoints) is being read
    char *pause_reason; // why astraid paused it (its time limit), NULL: none
    LogLine *log;       // (JOB_LOG_LINES,) ring of the last output lines, NULL until the first
                        // one and again once the job is final (its logs are then read from disk)
    int log_start, log_len;
    JobText *text; // its JOB object's last text (job_to_raw_json), NULL: none kept
    // the parts each owned by one file
    JobProgressView progress; // progress_reader.c
    JobWatch watch;           // watchdog.c
    JobRows rows;             // the state file's writes
    JobSiteRun site;          // runner.c or slurm.c
    struct Job *next;
} Job;

// A change's answer, on the loop: code 0 when it was made and written, else why not (its
// RPC error code and err).
typedef void (*ChangeDone)(void *arg, int code, const Err *err);

// What happened to a job, announced once by the code that made it happen (job_changed, on the
// loop); the subsystems that show jobs or act on them listen (jobs_listen, at start), and the
// state machine calls none of them itself.
typedef enum {
    JOB_SHOWN,    // what clients see of it other than progress (a new job, a state, a field)
    JOB_PROGRESS, // its progress fields (progress_reader.c)
    JOB_EVENT,    // an event of notify_command's (`event`: completed, failed, restarted, hang,
                  // time_limit)
    JOB_FINAL,    // it is final now (or may be removed now): the retention may drop old jobs
    JOB_GONE,     // jobs were removed or hidden (j NULL)
    JOB_RELEASED, // it left the queue or released devices: another job may start
} JobChange;
typedef void (*JobListener)(const Job *j, JobChange what, const char *event);
#define JOB_LISTENERS_MAX 8
// Adds a listener (called in the order added); -1 past JOB_LISTENERS_MAX (a bug, in err).
int jobs_listen(JobListener listener, Err *err);
// Calls every listener once with the change. event: JOB_EVENT's name, else NULL.
void job_changed(const Job *j, JobChange what, const char *event);

int job_visible(const Job *j); // shown to clients: neither unsaved nor removing
int job_has_run(const Job *j); // a run of it is alive (the executor's has_run)
Job *job_find(long id);        // a visible job, NULL for any other id
// Sets astraid.next_id past the database's ids and every state_dir/jobs/<id> directory;
// a directory the database does not know is logged and listed by jobs_unknown_dirs.
int jobs_init_ids(Err *err);
cJSON *jobs_unknown_dirs(void); // daemon.info "unknown_job_dirs"
// Validates spec (proto/job_spec.h) and writes a new job: -1 at once when refused (err names
// the bad key; err->resource when the daemon failed: its state directory), else 0 with its
// id in *id, and done once its row committed (then it is queued) or could not be.
int jobs_submit(const cJSON *spec, long uid, ChangeDone done, void *arg, long *id, Err *err);
// The verbs of docs/design.md §5: -1 with *code (RPC_BAD_STATE, ...) and err on refusal; else 0,
// and done once the change is written and made (a reply waits for it).
typedef int (*JobVerb)(Job *j, ChangeDone done, void *arg, int *code, Err *err);
int job_pause(Job *j, ChangeDone done, void *arg, int *code, Err *err);
int job_resume(Job *j, ChangeDone done, void *arg, int *code, Err *err);
int job_cancel(Job *j, ChangeDone done, void *arg, int *code, Err *err);
int job_checkpoint(Job *j, int *code, Err *err); // no state change: at once
void job_set_state(Job *j, JobState s);
// Writes j's row as it is (whatever the disk says: a failure is logged); clients see its
// state, and watchers hear of it, once written. Verbs planned on j before are planned again.
void job_save(Job *j);
int job_is_final(JobState s); // completed, failed, cancelled
// ---- job_log.c
void job_add_log(Job *j, int rank, const char *text, size_t len);
void job_drop_log(Job *j); // its ring (a final job's lines are in its files)
// The last `tail` output lines of `rank` (a JSON array of strings): from the ring while
// the job has one, else read back from its run<N>-rank<R>.log files.
cJSON *job_log_tail(const Job *j, int rank, long tail);
// ---- job_json.c
// The JOB object as a raw node (its text): printed again only when a value it shows changed;
// what replies, pushes and the HTTP snapshot send.
cJSON *job_to_raw_json(const Job *j);
JobText *job_text_new(void);    // NULL when out of memory (the text is then printed each time)
void job_text_free(JobText *t); // NULL: nothing
void job_text_cache_free(void); // at exit
// ---- jobs.c
int job_run_dir(const Job *j, char *out, size_t cap);
// out = run_dir/run<run>-rank<rank>.log, the output of one rank of one run; -1 when it does
// not fit in cap bytes.
int job_log_path(const char *run_dir, long run, int rank, char *out, size_t cap);
// Adds a job read back from the database (state.c).
void jobs_adopt(Job *j);
void job_free(Job *j);
void jobs_free_all(void);

// How a run ended (runner.c → jobs.c).
// STOP_HANG: the watchdog found it hung (TERM, then KILL after --stop-timeout).
typedef enum { STOP_NONE, STOP_PAUSE, STOP_SHUTDOWN, STOP_CANCEL, STOP_HANG } StopKind;
typedef struct {
    StopKind stop;     // why the daemon stopped it, STOP_NONE when it ended by itself
    int failed;        // a rank failed (non-zero exit or signal) on its own
    int bad_input;     // ... with exit code 2: restarting cannot help
    int transient;     // ... could not be started for want of a resource (EMFILE, ENOMEM, ...)
    int interrupted;   // a rank exited 3 (EXIT_INTERRUPTED) though astraid did not stop it
    int exited_ok;     // every rank exited 0 (also after a stop of astraid's): it ran to its end
    const char *cause; // the root cause when failed or interrupted
    const char *started_from; // the job's last checkpoint when the run started, NULL: none
} RunOutcome;
void job_run_ended(Job *j, const RunOutcome *o);
// The executor's start failed before any rank ran: retried after a backoff when err->resource says
// it lacked a resource, else the job fails.
void job_start_failed(Job *j, const Err *err);
// The spec a run of j starts with: j's (a shallow copy: its strings are j's, not to be freed),
// resuming when j resumes; -1 (bad input) when j's stored spec no longer parses.
int job_run_spec(const Job *j, JobSpec *run, Err *err);
// The wait before the next of `tries` tries in a row (restarts, starts, Slurm commands):
// 1 s, doubling, at most 60 s.
double job_backoff_s(long tries);

// ---------------------------------------------------------------- job_paths.c
// The paths of a new job, checked as astraid's user (docs/astraid.md "Paths"): param_path
// and data_root_path hold what a run reads, and ckpt_dir (resolved: j->ckpt_real) passes
// job_ckpt_dir_usable and job_ckpt_dir_free. Errors name the key and the path.
int job_paths_check(Job *j, Err *err);
// Sets j->ckpt_real to ckpt_dir's canonical form (NULL and err when it does not resolve):
// once, when the job is accepted or adopted.
int job_ckpt_dir_resolve(Job *j, Err *err);
// ckpt_dir can be created and written: its nearest existing ancestor is a directory astraid's
// user may write, on a file system mounted read-write.
int job_ckpt_dir_usable(const Job *j, Err *err);
// ckpt_dir is no other live job's ckpt_dir, nor inside or around one (by their ckpt_real).
int job_ckpt_dir_free(const Job *j, Err *err);

// ---------------------------------------------------------------- history.c
// rm: a final job's row, events and run directory go; its ckpt_dir stays (even inside
// the run directory). -1 with *code (RPC_BAD_STATE, ...) and err on refusal.
// Else 0, and done once the rows are gone (and j freed).
int job_remove(Job *j, ChangeDone done, void *arg, int *code, Err *err);
// --keep-finished "N" or "Dd" (NULL: keep every job); err names the bad value.
int retention_configure(const char *spec, Err *err);
// Removes the finished jobs the retention does not keep; at startup, and (from the
// loop, after the current request) each time a job becomes final.
void retention_apply(void);
void retention_on_job(const Job *j, JobChange what, const char *event); // JOB_FINAL

// ---------------------------------------------------------------- scheduler.c: the queue
// Starts queued jobs whose devices are free (priority, then FIFO).
void scheduler_kick(void);
void scheduler_on_job(const Job *j, JobChange what, const char *event); // JOB_RELEASED: a kick
void devices_release(Job *j);

// ---------------------------------------------------------------- run sites (--executor)
// Where the ranks of a job run, the --executor of the command line: the local site (runner.c:
// child processes on this machine) or the slurm site (slurm.c: Slurm batch jobs), chosen at
// start. (train/'s Executor is something else: the parallel mode of the ranks.) Whatever
// differs between the two is an operation here (docs/design.md §12), as engine/ and comm/
// choose their backends: the rest of astraid never asks which one runs.
typedef struct {
    const char *name;     // --executor's value
    int takes_devices;    // runs take this machine's devices (the scheduler's); else the
                          // executor's resource manager allocates them
    int cancel_confirmed; // a cancel is final only once the run is seen ended (cancelling)
    void (*init)(void);   // once the loop and the state are up (NULL: nothing)
    // A new job's check before it is written: done(arg, 0, NULL) when it may run, else
    // done(arg, code, err); -1 when it could not even be asked. NULL: nothing to check.
    int (*check_submit)(const Job *j, ChangeDone done, void *arg, Err *err);
    // A run: ends through job_run_ended; -1 (err->resource: retried) when none started.
    int (*start)(Job *j, Err *err);
    void (*stop)(Job *j, StopKind why); // of the live run, if any
    void (*checkpoint)(Job *j);         // asked of the live run, if any
    int (*has_run)(const Job *j);       // a run of it is alive
    // At start, a job whose last run was still open: tracked again when it lives on, else -1.
    // NULL: a run never outlives its astraid.
    int (*attach)(Job *j);
    // Its word for a job's live run (JOB's slurm_job and slurm_state); NULL: no such fields.
    const char *(*run_state)(const Job *j);
} RunSite;
extern const RunSite LOCAL_SITE; // runner.c
extern const RunSite SLURM_SITE; // slurm.c

// ---------------------------------------------------------------- runner.c
// The local executor (LOCAL_SITE), and what astraid asks of its runs:
int runner_alive(void);                     // runs not yet ended
int runner_ranks(const Job *j);             // ranks of j's run, 0 without one
pid_t runner_rank_pid(const Job *j, int r); // 0 when rank r is not alive

// ---------------------------------------------------------------- state.c
int state_open(const char *state_dir, Err *err);
void state_close(void); // after uv_run returned: every write is done
// A write's completion, on the loop: err->msg is empty when it committed, else it says why
// (err->resource; the failure is logged).
typedef void (*StateDone)(void *arg, const Err *err);
// Writes are queued and committed in order off the loop (libuv's threadpool); done (may be
// NULL) follows the commit. -1 (err, may be NULL) when the write could not even be queued
// (no memory): done is then never called.
int state_save_job(const Job *j, StateDone done, void *arg, Err *err);
// The jobs' rows, runs and events, in one transaction.
int state_delete_jobs(const long *ids, size_t n, StateDone done, void *arg, Err *err);
// A blocking read that must see the writes queued before it: work(arg) runs on the
// threadpool in the writes' turn, done(arg, no error) on the loop after it.
int state_queue_work(void (*work)(void *arg), StateDone done, void *arg, Err *err);
// Why the database is damaged (a write found it so: none is made any more), NULL while not.
const char *state_damage(void);
void state_event(long job_id, const char *kind, const char *detail);
void state_run_started(const Job *j, const pid_t *pids, int n);
void state_run_ended(const Job *j, const char *outcome);
// Loads every job; running/starting/pausing ones (the daemon died under them) and
// interrupted ones go back to the queue, resuming when they have a checkpoint; under slurm
// those whose Slurm job lives on are tracked again (the executor's attach); a cancelling one
// without one is cancelled. Waits (bounded by stop_timeout) for ranks of a killed daemon still
// finishing.
int state_recover(Err *err);
long state_max_job_id(void);

// ---------------------------------------------------------------- progress_reader.c
// What a run's progress.db says (read off the loop, applied on it).
typedef struct {
    int opened;    // the database could be read
    int has_total; // total_steps from its run table
    long total_steps;
    int has_step; // the newest step row
    long step, epoch;
    double loss, lr, grad_norm, tokens_per_s, eta_s; // eta_s -1: unknown
    char *checkpoint;                                // the newest, NULL: none
    int has_val;                                     // the newest validation row
    double val_loss;
    int has_scale; // loss scaling: the newest step's scale and the steps skipped
    double loss_scale;
    long skipped_steps;
    int has_expert_load; // a mixture of experts: the newest step's load extremes (over the mean)
    double expert_load_max, expert_load_min;
    RolloutNumbers rollout;
    double step_wall;     // unix time of the newest step row
    double step_median_s; // median seconds per step of the newest steps, 0: unknown
    char *phase;          // the trainer's phase, NULL: none ("" is read as none)
    double phase_since;
    double read_mono, read_wall; // when it was read (clock_mono_s, clock_wall_s)
    char *error;                 // why it could not be read ("progress.db: ..."), NULL: it was
} JobProgress;

// Polls the running jobs' progress.db every poll-interval on the threadpool (and once that
// of each job it has not seen, for its val_loss); changes are pushed to watchers.
void progress_reader_start(void);
// A poll now (the hang watchdog's re-read before a verdict), or right after the one under way.
void progress_reader_poll_now(void);
// Reads run_dir/progress.db (blocking: off the loop). total_steps: the job's, for the ETA
// when the database has none.
void progress_read_dir(const char *run_dir, long total_steps, JobProgress *p);
// Sets j's progress from p (and frees p's strings); 1 if the job changed.
int progress_apply(Job *j, JobProgress *p);

// ---------------------------------------------------------------- curve.c
// A job's training curve (the `history` method, the web page): the steps rows of
// run_dir/progress.db with step > since_step, in step order, at most limit of them, as a
// JSON array of {step, loss, val_loss (only at steps with a validation row), lr, grad_norm,
// tokens_per_s, wall_time, and the step's numbers of step_metrics where it has them:
// loss_scale, skipped, the DPO/GRPO ones}; a non-finite value is null. *more is 1 when rows past
// the limit remain. No database yet is an empty curve. Blocking, and safe on any thread (its own
// read-only connection that never blocks the writer): call it off the loop.
int curve_read(const char *run_dir, long since_step, long limit, cJSON **steps, int *more,
               Err *err);
#define HISTORY_LIMIT 2000      // steps of a history page (method, /api/history) unless asked
#define HISTORY_LIMIT_MAX 10000 // the largest page asked for
// The readers' way into run_dir/progress.db (curve.c, samples.c): opened read-only for one read
// on any thread, never blocking the writer (a busy wal-index is waited for briefly); *db NULL (and
// 0) when there is no database yet. path (cap bytes) gets its path for the errors.
typedef struct sqlite3 sqlite3;
int progress_db_open_read(const char *run_dir, sqlite3 **db, char *path, size_t cap, Err *err);
// 1 when the database has table `name`, 0 when not, -1 on a read error.
int progress_db_has_table(sqlite3 *db, const char *name);

// ---------------------------------------------------------------- samples.c
// What the model wrote as it trained (train/samples.h; the `samples` method, /api/samples): rows
// of run_dir/progress.db's samples as a JSON array of {step, index, prompt, completion, tokens}
// in (step, index) order: with `all` those of every step after since_step, else those of `step`
// (-1: the newest step that has samples). A page holds at most SAMPLES_PAGE_BYTES of text (the
// first row always goes; with `all`, whole steps unless the first alone is larger); *more is 1
// when rows were left off. No database or no samples yet: none. Blocking, safe on any thread.
typedef struct {
    long step; // -1: the newest step with samples
    bool all;
    long since_step; // with all
} SamplesQuery;
int job_samples_read(const char *run_dir, const SamplesQuery *q, cJSON **rows, int *more, Err *err);
// Of a page's prompts and completions: JSON writes a byte as 6 at most, so a page stays under the
// line limit.
#define SAMPLES_PAGE_BYTES (RPC_MAX_LINE / 8)
// ---------------------------------------------------------------- slurm.c
// At start: --slurm-sbatch-args splits into words (its quotes balanced).
int slurm_check_config(const Config *c, Err *err);
void slurm_free(void); // after uv_run returned
// The slurm executor's operations (SLURM_SITE) are slurm.c's; their rules are there.

// ---------------------------------------------------------------- helper.c
// A helper's end: its stdout (when kept; NULL: astraid is exiting and only arg is to be freed),
// its exit code (-1 when killed by term_signal), timed_out when killed at its bound.
typedef void (*HelperDone)(void *arg, const char *output, size_t len, int exit_code,
                           int term_signal, int timed_out);
// Runs argv (argv[0] looked up in PATH) with input on its stdin; done follows its exit. -1 and
// err (err_errno's: ENOENT when there is no such program) when it could not start: done is
// then never called.
int helper_run(char *const *argv, const char *input, size_t input_len, int keep_output,
               double timeout_s, HelperDone done, void *arg, Err *err);
void helpers_free(void); // after uv_run returned: the helpers still running are killed

// ---------------------------------------------------------------- watchdog.c
// Every poll-interval: the running jobs of the local executor without progress for their hang
// limit are hung (docs/astraid.md "Hangs"), those past max_duration_hours are paused.
void job_watch_start(void);
// The run of j started (its time counts) / ended (the time it took is added).
void job_watch_run_started(Job *j);
void job_watch_run_ended(Job *j);
// Seconds j may still run before its time limit; -1 without max_duration_hours.
double job_time_left_s(const Job *j);

// ---------------------------------------------------------------- preflight.c
// Before a run starts, and the `preflight` method: room in ckpt_dir for the next checkpoint
// and the health of the job's GPUs (docs/astraid.md "Preflight" states the rule).
typedef enum { PREFLIGHT_OK, PREFLIGHT_WAIT, PREFLIGHT_FAIL } PreflightVerdict;
// The verdict, the report (docs/protocol.md "preflight") and, unless ok, why (err->resource
// set when the run should wait).
typedef void (*PreflightDone)(void *arg, PreflightVerdict v, const cJSON *report, const Err *why);
// Checks a run of the parsed spec writing to ckpt_dir with steps_left steps to go (0: unknown)
// on the GPUs gpus[0..n_gpus) (NVML indices); the file system off the loop, done on the loop.
int preflight_run(const JobSpec *js, const char *ckpt_dir, long steps_left, const int *gpus,
                  int n_gpus, PreflightDone done, void *arg, Err *err);
// jobs.c, the `preflight` method: spec checked as submit checks it (-1 and err when refused),
// then preflight_run on its ckpt_dir and the GPUs it would have now.
int jobs_preflight(const cJSON *spec, PreflightDone done, void *arg, Err *err);

// ---------------------------------------------------------------- notify.c
// notify_command (if any) run for event ("completed", "failed", "restarted", "hang",
// "time_limit") of j: the event its argument, the JOB object on its stdin; once, bounded by
// notify_timeout, its failure logged.
int notify_check_config(const Config *c, Err *err);
void notify_on_job(const Job *j, JobChange what, const char *event); // JOB_EVENT

// ---------------------------------------------------------------- systemd.c
void sd_init(void); // takes NOTIFY_SOCKET / LISTEN_* out of the environment
void systemd_notify(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int sd_listen_fd(void); // the activated unix socket, or -1

// ---------------------------------------------------------------- server.c
typedef struct Conn Conn;
int server_start(Err *err);
void server_close_listeners(void);
void server_close_all(void);
// Takes ownership of msg (a serialised line). Drops the client when its queue is full.
void conn_send(Conn *c, char *msg);
// c's current request is answered later (its change is being written): c is served no
// further line, and stays allocated even if it closes, until conn_answer sends msg (NULL:
// none, a notification) and serves the lines that came meanwhile.
void conn_defer(Conn *c);
void conn_answer(Conn *c, char *msg);
long conn_uid(const Conn *c);
// Closes c once what it was sent is written (an error reply before hanging up).
void conn_hang_up(Conn *c);
int conn_is_authed(const Conn *c);
// A TCP peer (it authenticated with the token), not one of the unix socket.
int conn_is_tcp(const Conn *c);
// -1 when c would exceed max-connections (it stays unauthenticated).
int conn_set_authed(Conn *c);
int server_check_token(const char *token);
// "HOST:PORT" or "[IPv6]:PORT" (numeric) of the listener `option` ("tcp", "http").
int server_parse_address(const char *option, const char *spec, struct sockaddr_storage *ss,
                         Err *err);
void conn_watch(Conn *c, long job_id);            // 0: every job
void conn_follow(Conn *c, long job_id, int rank); // rank -1: every rank
// After the reply to a watch or logs: a one-job watch or follow of a job already final
// gets its end push now (it will see no change that would send one).
void conn_end_if_final(Conn *c);
// JOB_SHOWN, JOB_PROGRESS: the watchers of j hear of it.
void server_on_job(const Job *j, JobChange what, const char *event);
void server_push_log(const Job *j, int rank, const char *line);
int server_connections(void);

// ---------------------------------------------------------------- dispatch.c
void dispatch_line(Conn *c, const char *line, size_t len);

// ---------------------------------------------------------------- http.c, metrics.c
// The HTTP listener (docs/monitoring.md): libmicrohttpd's threads serve GET /, /metrics,
// /api/jobs and /api/history. They never touch the Job list: they read a Snapshot the loop
// builds when asked (uv_async) and hands over under a mutex, immutable once published.

// A job as /metrics shows it.
typedef struct {
    long id;
    char *name;
    JobState state; // as clients see it
    // values as /metrics writes them (doubles: a table of offsets renders them all)
    double step, total_steps, restarts, loss, lr, grad_norm, tokens_per_s, val_loss;
    double eta_s;                            // < 0: unknown
    double expert_load_max, expert_load_min; // a mixture of experts' (has_expert_load)
    int has_progress, has_val_loss, has_expert_load;
    RolloutNumbers rollout;
    char *last_checkpoint; // its path (the mtime is read when rendering, off the loop); NULL
} JobGauge;

typedef struct {
    char name[32];    // "cpu:0", "cuda:1"
    long job;         // holding it, 0 when free
    int64_t mem_used; // bytes (NVML), -1: unknown
    int util_pct;     // percent (NVML), -1: unknown
} DeviceGauge;

#define METRICS_SERIES_MAX 128 // (method, code) pairs counted; the rest count as "other"
#define METRICS_BUCKETS 16     // request latency buckets: 100 us to 10 s, then +Inf

// The control requests answered, as counted by dispatch.c (loop thread).
typedef struct {
    struct {
        char method[24]; // a known method's name, "other" for the rest
        int code;        // 0: a result, else the RPC error code
        uint64_t n;
    } series[METRICS_SERIES_MAX];
    int n_series;
    uint64_t buckets[METRICS_BUCKETS + 1]; // (+Inf last) not cumulative
    double sum_s;
} RequestStats;

typedef struct {
    long id;
    char *run_dir;
} JobRunDir;

typedef struct {
    int refs; // readers holding it, +1 while it is the current one (under http.c's mutex)
    unsigned long generation; // http_changed's count when built
    double built_mono;        // clock_mono_s() when built
    char *jobs_json;          // the JOB array of /api/jobs (live jobs, the newest finished ones)
    JobGauge *jobs;           // (n_jobs,) the same jobs, ascending id
    int n_jobs;
    JobRunDir *runs; // (n_runs,) every visible job, ascending id: /api/history
    int n_runs;
    DeviceGauge *devices; // (n_devices,)
    int n_devices;
    long by_state[JOB_NSTATES]; // visible jobs
    int connections;            // control connections open
    RequestStats requests;
} Snapshot;

// Starts the listener when --http is set (after server_start: it reads the token); -1 with
// err when it cannot listen.
int http_start(Err *err);
// Stops the listener's threads and frees the snapshot; before the loop's handles close.
void http_stop(void);
// Loop thread, before the acknowledgement goes out: what a snapshot shows changed other
// than progress numbers (a job visible, gone, in a new shown state; a request counted),
// so the next HTTP request answers from a new snapshot. Costs one atomic increment.
void http_changed(void);
void http_on_job(const Job *j, JobChange what, const char *event); // JOB_SHOWN, JOB_GONE
// --http's value: a numeric address; off loopback it needs --token-file. Bad input in err.
int http_check_config(const Config *c, Err *err);

// Counts one control request: its method (known: one of dispatch.c's, else "other"), the
// code of its answer (0: a result) and the seconds from its arrival to its answer (a
// request answered later, once its change is written, counts then). Loop thread only.
void metrics_request(const char *method, int known, int code, double seconds);
void metrics_requests(RequestStats *out); // a copy of the counts, for a snapshot
// The Prometheus text (format 0.0.4) of s; NULL when out of memory. Any thread.
char *metrics_render(const Snapshot *s, size_t *len);

// ---------------------------------------------------------------- the daemon
typedef struct {
    uv_loop_t *loop;
    Config cfg;
    Devices devices;
    Job *jobs; // by id, ascending
    long next_id;
    double started_at;   // clock_mono_s() at start (uptime)
    int stopping;        // SIGTERM/SIGINT taken: no new runs, the running ones are stopped
    const RunSite *site; // --executor's: local or slurm
} Astraid;

extern Astraid astraid;

// ---------------------------------------------------------------- lifecycle.c
// Called when a run ended while stopping: exits the loop once none is left.
void daemon_maybe_finish(void);
// Closes the listeners, the connections, the HTTP threads and every loop handle: uv_run returns.
void daemon_close_all(void);
// Installs the SIGTERM/SIGINT handlers that stop every job, then the loop.
void daemon_watch_signals(void);
