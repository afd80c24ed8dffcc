// scheduler.c: the devices astraid hands out and the queue of jobs waiting for them.
//
// Devices are CPU slots (one per core unless --devices says otherwise) or GPUs, by
// default the ones NVML finds (gpu.c; astraid never initialises CUDA itself, docs/design.md
// §1). A GPU's id is its NVML index. A job needs n_devices of them (or the ones its
// spec names); queued jobs start in order of priority, then submission (FIFO), on
// disjoint devices. The head of the queue is never overtaken
// by a smaller job behind it, so a large job cannot starve.
//
// A run starts only once a write of its job's row has committed: a start the database
// cannot record (a full disk, an I/O error, a damaged astraid.db) would be unknown to the
// next astraid, which could start a second run on the same ckpt_dir while the first one's
// ranks still checkpoint. When that write fails the job stays queued, its error naming
// astraid.db, and is tried again after a backoff (as a start that lacked a resource); while
// the database is damaged no job is tried at all.
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "daemon/daemon.h"

#define MAX_DEVICES 4096

// ---------------------------------------------------------------- devices

static int usable_cores(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int devices_alloc(Devices *d, int gpu, int n, Err *err) {
    if (n < 1 || n > MAX_DEVICES)
        return err_set(err, "devices: %d is not a device count in [1, %d]", n, MAX_DEVICES);
    d->gpu = gpu;
    d->n = n;
    d->ids = calloc((size_t)n, sizeof *d->ids);
    d->used = calloc((size_t)n, sizeof *d->used);
    if (!d->ids || !d->used) return err_resource(err, "devices: out of memory");
    for (int i = 0; i < n; i++)
        d->ids[i] = i;
    return 0;
}

// "0,1,3": the GPU indices to use.
static int parse_cuda_list(Devices *d, const char *list, Err *err) {
    int n = 1;
    for (const char *p = list; *p; p++)
        n += *p == ',';
    if (devices_alloc(d, 1, n, err)) return -1;
    const char *p = list;
    for (int i = 0; i < n; i++) {
        char *end;
        errno = 0;
        long id = strtol(p, &end, 10);
        if (end == p || errno || id < 0 || id > INT_MAX || (*end && *end != ','))
            return err_set(err, "devices: 'cuda:%s' is not a list of GPU indices", list);
        for (int k = 0; k < i; k++)
            if (d->ids[k] == id) return err_set(err, "devices: GPU %ld is listed twice", id);
        d->ids[i] = (int)id;
        p = end + 1;
    }
    // A GPU NVML does not find would fail every job sent to it, long after the start.
    int found = gpu_count();
    for (int i = 0; i < n; i++)
        if (d->ids[i] >= found)
            return err_set(err, "devices: cuda:%s names GPU %d, but NVML finds %d GPU(s)%s", list,
                           d->ids[i], found,
                           found ? "" : " (no NVIDIA driver, or libnvidia-ml.so.1 not found)");
    return 0;
}

int devices_init(Devices *d, const char *spec, Err *err) {
    memset(d, 0, sizeof *d);
    if (!spec || !*spec) {
        int gpus = gpu_count();
        return gpus > 0 ? devices_alloc(d, 1, gpus, err) : devices_alloc(d, 0, usable_cores(), err);
    }
    if (!strncmp(spec, "cuda:", 5)) return parse_cuda_list(d, spec + 5, err);
    const char *count = !strncmp(spec, "cpu:", 4) ? spec + 4 : spec;
    char *end;
    errno = 0;
    long n = strtol(count, &end, 10);
    if (end == count || *end || errno || n < 1 || n > MAX_DEVICES)
        return err_set(err, "devices: '%s' is not N, cpu:N or cuda:0,1,...", spec);
    return devices_alloc(d, 0, (int)n, err);
}

void devices_free(Devices *d) {
    free(d->ids);
    free(d->used);
    memset(d, 0, sizeof *d);
}

void device_name(const Devices *d, int id, char *out, size_t cap) {
    snprintf(out, cap, "%s:%d", d->gpu ? "cuda" : "cpu", id);
}

// [{"id":"cpu:0","busy_job":3}, ...] (docs/protocol.md, daemon.info)
cJSON *devices_to_json(const Devices *d) {
    cJSON *list = cJSON_CreateArray();
    for (int i = 0; i < d->n; i++) {
        cJSON *dev = cJSON_CreateObject();
        char name[32];
        device_name(d, d->ids[i], name, sizeof name);
        cJSON_AddStringToObject(dev, "id", name);
        if (d->used[i])
            cJSON_AddNumberToObject(dev, "busy_job", (double)d->used[i]);
        else
            cJSON_AddNullToObject(dev, "busy_job");
        cJSON_AddItemToArray(list, dev);
    }
    return list;
}

int devices_has(const Devices *d, int id) {
    for (int i = 0; i < d->n; i++)
        if (d->ids[i] == id) return 1;
    return 0;
}

static int device_index(int id) {
    for (int i = 0; i < astraid.devices.n; i++)
        if (astraid.devices.ids[i] == id) return i;
    return -1;
}

// Takes j's devices if they are free: the ones its spec names, else the first free ones.
// 1 taken, 0 busy, -1 out of memory (err).
static int devices_take(Job *j, Err *err) {
    Devices *d = &astraid.devices;
    int *pick = calloc((size_t)j->n_devices, sizeof *pick), found = 0;
    if (!pick) return err_resource(err, "out of memory for the %ld device(s)", j->n_devices);
    for (int k = 0; k < j->n_devices && j->want_ids; k++) {
        int i = device_index(j->want_ids[k]);
        if (i >= 0 && !d->used[i]) pick[found++] = i;
    }
    for (int i = 0; i < d->n && !j->want_ids && found < j->n_devices; i++)
        if (!d->used[i]) pick[found++] = i;
    if (found < j->n_devices) {
        free(pick);
        return 0;
    }
    for (int k = 0; k < found; k++) {
        d->used[pick[k]] = j->id;
        pick[k] = d->ids[pick[k]];
    }
    j->devices = pick;
    return 1;
}

void devices_release(Job *j) {
    for (int i = 0; i < astraid.devices.n; i++)
        if (astraid.devices.used[i] == j->id) astraid.devices.used[i] = 0;
    free(j->devices);
    j->devices = NULL;
}

// ---------------------------------------------------------------- the queue

static uv_timer_t wake_timer; // the earliest end of a restart backoff
static int wake_timer_ready;

static int runs_before(const Job *a, const Job *b) {
    return a->priority != b->priority ? a->priority > b->priority : a->id < b->id;
}

// The next queued job to start, skipping those held by a backoff (*earliest gets
// the first time one of them may start).
static Job *queue_head(double now, double *earliest) {
    Job *best = NULL;
    for (Job *j = astraid.jobs; j; j = j->next) {
        // unsaved: not acknowledged yet; a run: a Slurm job pending in Slurm's own queue
        if (j->state != JOB_QUEUED || j->rows.unsaved || j->rows.launching || job_has_run(j))
            continue;
        if (j->hold_until > now) {
            if (!*earliest || j->hold_until < *earliest) *earliest = j->hold_until;
            continue;
        }
        if (!best || runs_before(j, best)) best = j;
    }
    return best;
}

static void on_wake(uv_timer_t *t) {
    (void)t;
    scheduler_kick();
}

static void arm_wake(double earliest, double now) {
    if (!wake_timer_ready) {
        uv_timer_init(astraid.loop, &wake_timer);
        wake_timer_ready = 1;
    }
    if (uv_is_closing((uv_handle_t *)&wake_timer)) return;
    uv_timer_stop(&wake_timer);
    if (earliest > 0)
        uv_timer_start(&wake_timer, on_wake, (uint64_t)((earliest - now) * 1000) + 1, 0);
}

// A start whose row is on its way to the database.
typedef struct {
    Job *job; // launching: neither removed nor started meanwhile
    long version;
} Launch;

// The row committed: the run starts, unless the job changed meanwhile (a verb written before
// the row: the row as the job is now goes after it, unless the job is being removed) or
// astraid is stopping.
static void start_or_release(Launch *l, const Err *err) {
    Job *j = l->job;
    Err serr = {0};
    if (j->state != JOB_QUEUED || j->rows.version != l->version) {
        devices_release(j);
        if (!j->rows.removing) job_save(j); // (a removed job's rows go)
    } else if (err->msg[0]) {
        devices_release(j);
        job_start_failed(j, err); // queued again after a backoff
    } else if (astraid.stopping) {
        devices_release(j);
    } else if (astraid.site->start(j, &serr)) {
        devices_release(j);
        job_start_failed(j, &serr); // queued again after a backoff, or failed
    } else {
        job_watch_run_started(j);
    }
}

static void start_decided(Launch *l, const Err *err) {
    l->job->rows.launching = 0;
    // Cancelled while its preflight ran: the retention, which could not remove it then, may now.
    if (job_is_final(l->job->state)) job_changed(l->job, JOB_FINAL, NULL);
    start_or_release(l, err);
    free(l);
    scheduler_kick(); // the devices of a start not made, for the next job
}

// The preflight's verdict (preflight.c): the run starts, waits (tried again later: the job
// queued with the numbers in its error) or fails.
static void preflight_done(void *arg, PreflightVerdict v, const cJSON *report, const Err *why) {
    (void)report;
    Err ok = {0};
    start_decided(arg, v == PREFLIGHT_OK ? &ok : why);
}

// The row committed: the preflight runs first, on the GPUs the job holds (local executor).
static void start_written(void *arg, const Err *err) {
    Launch *l = arg;
    Job *j = l->job;
    Err perr = {0};
    int gpus = astraid.devices.gpu && astraid.site->takes_devices && j->devices;
    long left =
        j->progress.total_steps > j->progress.step ? j->progress.total_steps - j->progress.step : 0;
    JobSpec run;
    if (!err->msg[0] && j->state == JOB_QUEUED && j->rows.version == l->version &&
        !astraid.stopping) {
        if (!job_run_spec(j, &run, &perr) &&
            !preflight_run(&run, j->ckpt_dir, left, gpus ? j->devices : NULL,
                           gpus ? (int)j->n_devices : 0, preflight_done, l, &perr))
            return;
        log_warn("job %ld: %s; started without it", j->id, perr.msg);
    }
    start_decided(l, err);
}

void scheduler_on_job(const Job *j, JobChange what, const char *event) {
    (void)j, (void)event;
    if (what == JOB_RELEASED) scheduler_kick();
}

void scheduler_kick(void) {
    if (astraid.stopping || state_damage()) return;
    for (;;) {
        double now = clock_mono_s(), earliest = 0;
        Job *j = queue_head(now, &earliest);
        arm_wake(earliest, now);
        Err err = {0};
        // 1 taken, 0 none free, -1 failed (out of memory); Slurm allocates its own.
        int taken = !j ? 0 : !astraid.site->takes_devices ? 1 : devices_take(j, &err);
        if (!taken) return;
        Launch *l = taken > 0 ? malloc(sizeof *l) : NULL;
        if (l) *l = (Launch){j, j->rows.version};
        if (!l || state_save_job(j, start_written, l, &err)) {
            if (!err.msg[0]) err_resource(&err, "out of memory starting job %ld", j->id);
            free(l);
            devices_release(j);
            job_start_failed(j, &err);
            continue;
        }
        j->rows.launching = 1;
    }
}
