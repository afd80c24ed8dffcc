// jobs.c: jobs and their state machine (DESIGN §5).
//
//   queued → starting → running → (pausing → paused) → completed | failed | cancelled
//   interrupted: astraid stopped under the job; it is queued again at the next start.
//
// A run that fails is restarted from the last checkpoint after a backoff while
// restarts < max_restarts; a rank that exits with 2 (bad input) is not restarted.
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "ckpt/checkpoint.h"
#include "common/fsutil.h"
#include "daemon/daemon.h"
#include "proto/job_spec.h"

#define BACKOFF_BASE_S 1.0
#define BACKOFF_MAX_S 60.0

static const char *const STATE_NAMES[JOB_NSTATES] = {"queued",  "starting",  "running",
                                                     "pausing", "paused",    "completed",
                                                     "failed",  "cancelled", "interrupted"};

const char *job_state_name(JobState s) {
    return s < JOB_NSTATES ? STATE_NAMES[s] : "unknown";
}

int job_state_parse(const char *name, JobState *out) {
    for (int i = 0; i < JOB_NSTATES; i++)
        if (!strcmp(name, STATE_NAMES[i])) {
            *out = (JobState)i;
            return 0;
        }
    return -1;
}

Job *job_find(long id) {
    for (Job *j = astraid.jobs; j; j = j->next)
        if (j->id == id) return j;
    return NULL;
}

int job_run_dir(const Job *j, char *out, size_t cap) {
    int n = snprintf(out, cap, "%s/jobs/%ld", astraid.cfg.state_dir, j->id);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

void jobs_adopt(Job *j) {
    Job **p = &astraid.jobs;
    while (*p && (*p)->id < j->id)
        p = &(*p)->next;
    j->next = *p;
    *p = j;
}

// ---------------------------------------------------------------- submit

// Paths in a spec are used by ranks whose working directory is not the client's.
static int check_absolute(const cJSON *spec, Err *err) {
    static const char *const PATH_KEYS[] = {"param_path", "data_root_path", "ckpt_dir"};
    for (size_t i = 0; i < sizeof PATH_KEYS / sizeof *PATH_KEYS; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(spec, PATH_KEYS[i]);
        if (cJSON_IsString(v) && v->valuestring[0] != '/')
            return err_set(err, "%s: '%s' is a relative path; astraid needs an absolute one",
                           PATH_KEYS[i], v->valuestring);
    }
    return 0;
}

static int check_devices(const JobSpec *js, const cJSON *spec, Err *err) {
    const Devices *d = &astraid.devices;
    const cJSON *asked = cJSON_GetObjectItemCaseSensitive(spec, "devices");
    if (cJSON_IsString(asked) && !d->gpu)
        return err_set(err, "devices: the job asks for GPUs (%s); astraid has %d CPU slot(s)",
                       asked->valuestring, d->n);
    if (js->n_devices > d->n)
        return err_set(err, "devices: the job needs %ld device(s); astraid has %d (%s)",
                       js->n_devices, d->n, d->gpu ? "cuda" : "cpu");
    for (long i = 0; js->device_ids && i < js->n_devices; i++)
        if (js->device_ids[i] > INT_MAX || !devices_has(d, (int)js->device_ids[i]))
            return err_set(err, "devices: astraid has no device %ld", js->device_ids[i]);
    return 0;
}

static Job *job_new(const JobSpec *js, const cJSON *spec, long uid) {
    Job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->id = astraid.next_id++;
    char name[32];
    snprintf(name, sizeof name, "job-%ld", j->id);
    j->name = strdup(js->name ? js->name : name);
    j->spec = cJSON_Duplicate(spec, 1);
    j->max_restarts = js->max_restarts >= 0 ? js->max_restarts : astraid.cfg.max_restarts;
    j->priority = js->priority;
    j->n_devices = js->n_devices;
    if (js->device_ids) {
        j->want_ids = calloc((size_t)js->n_devices, sizeof *j->want_ids);
        for (long i = 0; j->want_ids && i < js->n_devices; i++)
            j->want_ids[i] = (int)js->device_ids[i];
    }
    j->submitted_by = uid;
    j->created_at = now_wall();
    return j;
}

// ckpt_dir defaults to the job's run directory (so jobs never share checkpoints);
// the spec shown by status then carries it.
static int set_ckpt_dir(Job *j, Err *err) {
    const cJSON *given = cJSON_GetObjectItemCaseSensitive(j->spec, "ckpt_dir");
    char dir[PATH_MAX + 16], run_dir[PATH_MAX];
    if (job_run_dir(j, run_dir, sizeof run_dir) || fs_mkdir_p(run_dir, err)) return -1;
    if (cJSON_IsString(given)) {
        j->ckpt_dir = strdup(given->valuestring);
        return 0;
    }
    snprintf(dir, sizeof dir, "%s/checkpoints", run_dir);
    j->ckpt_dir = strdup(dir);
    cJSON_AddStringToObject(j->spec, "ckpt_dir", dir);
    return 0;
}

Job *jobs_submit(const cJSON *spec, long uid, Err *err) {
    JobSpec js;
    if (job_spec_parse(&js, spec, err)) return NULL;
    Job *j = NULL;
    if (!check_absolute(spec, err) && !check_devices(&js, spec, err)) {
        j = job_new(&js, spec, uid);
        if (!j) err_set(err, "out of memory");
    }
    job_spec_free(&js);
    if (!j) return NULL;
    if (!j->name || !j->spec || set_ckpt_dir(j, err)) {
        if (!*err->msg) err_set(err, "out of memory");
        job_free(j);
        return NULL;
    }
    jobs_adopt(j);
    state_save_job(j);
    state_event(j->id, "submitted", j->name);
    log_info("job %ld (%s) submitted by uid %ld", j->id, j->name, uid);
    server_push_progress(j);
    return j;
}

// ---------------------------------------------------------------- state changes

static int is_final(JobState s) {
    return s == JOB_COMPLETED || s == JOB_FAILED || s == JOB_CANCELLED;
}

void job_set_state(Job *j, JobState s) {
    if (j->state != s)
        log_info("job %ld: %s -> %s", j->id, job_state_name(j->state), job_state_name(s));
    j->state = s;
    if (is_final(s)) j->finished_at = now_wall();
    if (s == JOB_STARTING) j->started_at = now_wall();
    state_save_job(j);
    state_event(j->id, "state", job_state_name(s));
    server_push_progress(j);
}

static int refuse(const Job *j, const char *verb, int *code, Err *err) {
    *code = RPC_BAD_STATE;
    return err_set(err, "job %ld is %s: cannot %s", j->id, job_state_name(j->state), verb);
}

int job_pause(Job *j, int *code, Err *err) {
    if (j->state == JOB_QUEUED) { // not started yet: it just stays out of the queue
        job_set_state(j, JOB_PAUSED);
        return 0;
    }
    if (j->state != JOB_RUNNING && j->state != JOB_STARTING) return refuse(j, "pause", code, err);
    runner_stop(j, STOP_PAUSE);
    job_set_state(j, JOB_PAUSING);
    return 0;
}

// Resume = queue again; the run continues from the last checkpoint when there is one.
int job_resume(Job *j, int *code, Err *err) {
    if (j->run || (j->state != JOB_PAUSED && j->state != JOB_FAILED && j->state != JOB_CANCELLED &&
                   j->state != JOB_INTERRUPTED))
        return refuse(j, "resume", code, err);
    j->restarts = 0;
    j->hold_until = 0;
    j->finished_at = 0;
    free(j->error);
    j->error = NULL;
    job_set_state(j, JOB_QUEUED);
    return 0;
}

int job_checkpoint(Job *j, int *code, Err *err) {
    if (j->state != JOB_RUNNING) return refuse(j, "checkpoint", code, err);
    runner_checkpoint(j);
    state_event(j->id, "checkpoint", "requested");
    return 0;
}

int job_cancel(Job *j, int *code, Err *err) {
    if (is_final(j->state)) return refuse(j, "cancel", code, err);
    if (j->run) runner_stop(j, STOP_CANCEL); // SIGKILL now; the run ends a moment later
    job_set_state(j, JOB_CANCELLED);
    return 0;
}

// The latest checkpoint in the job's ckpt_dir (what --resume=true will find).
static int find_checkpoint(Job *j) {
    char path[PATH_MAX];
    Err err = {0};
    int rc = ckpt_find_latest(j->ckpt_dir, path, sizeof path, &err);
    if (rc < 0) log_warn("job %ld: %s", j->id, err.msg);
    if (rc) return 0;
    free(j->last_checkpoint);
    j->last_checkpoint = strdup(path);
    return 1;
}

static double backoff_s(long restarts) {
    return fmin(BACKOFF_MAX_S, BACKOFF_BASE_S * pow(2.0, (double)(restarts - 1)));
}

static void on_failure(Job *j, const RunOutcome *o) {
    free(j->error);
    j->error = strdup(o->cause ? o->cause : "a rank failed");
    if (o->bad_input || j->restarts >= j->max_restarts) {
        log_error("job %ld failed: %s", j->id, j->error);
        job_set_state(j, JOB_FAILED);
        return;
    }
    j->restarts++;
    j->hold_until = now_wall() + backoff_s(j->restarts);
    log_warn("job %ld: run failed (%s); restart %ld/%ld in %.0f s", j->id, j->error, j->restarts,
             j->max_restarts, backoff_s(j->restarts));
    state_event(j->id, "restart", j->error);
    job_set_state(j, JOB_QUEUED);
}

void job_run_ended(Job *j, const RunOutcome *o) {
    progress_read(j);
    progress_close_job(j);
    devices_release(j);
    j->resume = find_checkpoint(j);
    const char *outcome = o->stop == STOP_CANCEL     ? "cancelled"
                          : o->stop == STOP_SHUTDOWN ? "interrupted"
                          : o->stop == STOP_PAUSE    ? "paused"
                          : o->failed                ? "failed"
                                                     : "completed";
    state_run_ended(j, outcome);
    if (o->stop == STOP_CANCEL)
        job_set_state(j, JOB_CANCELLED);
    else if (o->stop == STOP_SHUTDOWN)
        job_set_state(j, JOB_INTERRUPTED);
    else if (o->stop == STOP_PAUSE)
        job_set_state(j, JOB_PAUSED);
    else if (o->failed)
        on_failure(j, o);
    else {
        free(j->error);
        j->error = NULL;
        job_set_state(j, JOB_COMPLETED);
    }
    if (astraid.stopping)
        daemon_maybe_finish();
    else
        scheduler_kick();
}

// ---------------------------------------------------------------- logs

void job_add_log(Job *j, int rank, const char *text, size_t len) {
    int slot = (j->log_start + j->log_len) % JOB_LOG_LINES;
    if (j->log_len == JOB_LOG_LINES) {
        free(j->log[j->log_start].text);
        j->log_start = (j->log_start + 1) % JOB_LOG_LINES;
    } else {
        j->log_len++;
    }
    j->log[slot].rank = rank;
    j->log[slot].text = strndup(text, len);
    if (j->log[slot].text) server_push_log(j, rank, j->log[slot].text);
}

// ---------------------------------------------------------------- JSON

static void add_time(cJSON *o, const char *key, double t) {
    if (t <= 0) {
        cJSON_AddNullToObject(o, key);
        return;
    }
    char buf[32];
    time_t s = (time_t)t;
    struct tm tm;
    gmtime_r(&s, &tm);
    strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    cJSON_AddStringToObject(o, key, buf);
}

static void add_metric(cJSON *o, const char *key, double v, int known) {
    if (known && isfinite(v))
        cJSON_AddNumberToObject(o, key, v);
    else
        cJSON_AddNullToObject(o, key);
}

static void add_string(cJSON *o, const char *key, const char *s) {
    if (s)
        cJSON_AddStringToObject(o, key, s);
    else
        cJSON_AddNullToObject(o, key);
}

static void add_count(cJSON *o, const char *key, int64_t v) {
    if (v >= 0)
        cJSON_AddNumberToObject(o, key, (double)v);
    else
        cJSON_AddNullToObject(o, key);
}

// The ranks of a live run: [{"rank":0,"pid":4242,"gpu":1,"memory_used_bytes":...,
// "utilization_pct":87}]; gpu and its figures null on CPU slots or when unknown
// (from gpu.c's last sample, at most a few seconds old). [] without a run.
static cJSON *ranks_to_json(const Job *j) {
    cJSON *list = cJSON_CreateArray();
    for (int r = 0; r < runner_ranks(j) && j->devices && r < j->n_devices; r++) {
        cJSON *o = cJSON_CreateObject();
        pid_t pid = runner_rank_pid(j, r);
        int gpu = astraid.devices.gpu ? j->devices[r] : -1; // its LOCAL_RANK-th visible GPU
        cJSON_AddNumberToObject(o, "rank", r);
        add_count(o, "pid", pid > 0 ? pid : -1);
        add_count(o, "gpu", gpu);
        add_count(o, "memory_used_bytes", gpu >= 0 ? gpu_process_memory(gpu, pid) : -1);
        add_count(o, "utilization_pct", gpu >= 0 ? gpu_utilization(gpu) : -1);
        cJSON_AddItemToArray(list, o);
    }
    return list;
}

// The JOB object of DESIGN §3 / docs/protocol.md.
cJSON *job_to_json(const Job *j) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "id", (double)j->id);
    cJSON_AddStringToObject(o, "name", j->name);
    cJSON_AddStringToObject(o, "state", job_state_name(j->state));
    cJSON_AddItemToObject(o, "spec", cJSON_Duplicate(j->spec, 1));
    cJSON_AddNumberToObject(o, "step", (double)j->step);
    cJSON_AddNumberToObject(o, "total_steps", (double)j->total_steps);
    cJSON_AddNumberToObject(o, "epoch", (double)j->epoch);
    add_metric(o, "loss", j->loss, j->has_progress);
    add_metric(o, "lr", j->lr, j->has_progress);
    add_metric(o, "grad_norm", j->grad_norm, j->has_progress);
    add_metric(o, "tokens_per_s", j->tokens_per_s, j->has_progress);
    add_metric(o, "eta_s", j->eta_s, j->has_progress && j->eta_s >= 0);
    double val_loss = NAN;
    int has_val = progress_val_loss(j, &val_loss);
    add_metric(o, "val_loss", val_loss, has_val);
    cJSON_AddNumberToObject(o, "restarts", (double)j->restarts);
    cJSON *devs = cJSON_AddArrayToObject(o, "devices");
    for (long i = 0; j->devices && i < j->n_devices; i++) {
        char name[32];
        device_name(&astraid.devices, j->devices[i], name, sizeof name);
        cJSON_AddItemToArray(devs, cJSON_CreateString(name));
    }
    cJSON_AddItemToObject(o, "ranks", ranks_to_json(j));
    add_string(o, "last_checkpoint", j->last_checkpoint);
    add_string(o, "error", j->error);
    if (j->submitted_by >= 0)
        cJSON_AddNumberToObject(o, "submitted_by", (double)j->submitted_by);
    else
        cJSON_AddNullToObject(o, "submitted_by");
    add_time(o, "created_at", j->created_at);
    add_time(o, "started_at", j->started_at);
    add_time(o, "finished_at", j->finished_at);
    return o;
}

// ---------------------------------------------------------------- teardown

void job_free(Job *j) {
    if (!j) return;
    progress_close_job(j);
    for (int i = 0; i < j->log_len; i++)
        free(j->log[(j->log_start + i) % JOB_LOG_LINES].text);
    free(j->name);
    cJSON_Delete(j->spec);
    free(j->ckpt_dir);
    free(j->want_ids);
    free(j->devices);
    free(j->last_checkpoint);
    free(j->error);
    free(j);
}

void jobs_free_all(void) {
    while (astraid.jobs) {
        Job *j = astraid.jobs;
        astraid.jobs = j->next;
        job_free(j);
    }
}
