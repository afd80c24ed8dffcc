// jobs.c: jobs and their state machine (docs/design.md §5).
//
//   queued → starting → running → (pausing → paused) → completed | failed | cancelled
//   interrupted: astraid stopped under the job; it is queued again at the next start.
//   cancelling (slurm): cancelled while its Slurm job lives; cancelled once Slurm says that
//   job ended (until then it keeps its ckpt_dir: its ranks may still write there).
//
// A run that fails, or ends before its end without astraid asking (a rank exits 3 after
// a stop from outside), is restarted from the last checkpoint after a backoff while
// restarts < max_restarts; a run that saved new progress forgives earlier restarts. Bad
// input (exit 2) and an unwritable ckpt_dir are not retried; a run that could not start
// for want of a resource is retried until it starts (it never counts as progress). A job is
// completed only when its ranks exited 0 and its progress reached total_steps (or
// max_steps); such a run is completed whatever was asked meanwhile (a pause, a Slurm job's
// cancel that came too late).
//
// A verb's state change (pause, resume, cancel; submit's new job) is written to the
// database before it takes effect: when the database cannot commit, the request gets
// the error and the job stays as it was; no run starts before a row of its job committed
// (scheduler.c), and a run's own change whose row did not commit is written again until it
// does. The writes are made off the loop (state.c), so a
// verb completes later: planned on the job as it is, written, then made, or planned
// again when the job changed while its row was on its way. Ids are never reused: a new id is past
// every id of the database and every run directory (shared_dir/jobs/<id>). A job's output
// lines are job_log.c's, its JOB object job_json.c's.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "ckpt/checkpoint.h"
#include "common/buf.h"
#include "common/fsutil.h"
#include "common/path.h"
#include "daemon/daemon.h"
#include "proto/job_spec.h"

#define UNKNOWN_DIRS_SHOWN 100 // ids of unknown run directories listed in daemon.info
#define BACKOFF_BASE_S 1.0
#define BACKOFF_MAX_S 60.0

static const char *const STATE_NAMES[JOB_NSTATES] = {
    "queued",    "starting", "running",   "pausing",     "paused",
    "completed", "failed",   "cancelled", "interrupted", "cancelling"};

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

int job_visible(const Job *j) {
    return !j->rows.unsaved && !j->rows.removing;
}

// The adopted jobs by ascending id, as in astraid.jobs: a request finds its job in
// O(log jobs) however long the history. A job leaves it in job_free.
static Job **index_jobs;
static size_t index_n, index_cap;
static int index_lost; // it could not grow once (out of memory): job_find walks the list

// The position of the first job of the index with an id >= id.
static size_t index_at(long id) {
    size_t lo = 0, hi = index_n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (index_jobs[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void index_add(Job *j) {
    if (index_lost || buf_reserve(&index_jobs, &index_cap, index_n + 1, sizeof *index_jobs)) {
        index_lost = 1;
        return;
    }
    size_t k = index_at(j->id);
    memmove(index_jobs + k + 1, index_jobs + k, (index_n - k) * sizeof *index_jobs);
    index_jobs[k] = j;
    index_n++;
}

static void index_remove(const Job *j) {
    size_t k = index_at(j->id);
    if (k == index_n || index_jobs[k] != j) return; // never adopted
    memmove(index_jobs + k, index_jobs + k + 1, (index_n - k - 1) * sizeof *index_jobs);
    index_n--;
}

Job *job_find(long id) {
    Job *j = NULL;
    if (index_lost) {
        for (j = astraid.jobs; j && j->id != id; j = j->next)
            ;
    } else {
        size_t k = index_at(id);
        j = k < index_n && index_jobs[k]->id == id ? index_jobs[k] : NULL;
    }
    return j && job_visible(j) ? j : NULL;
}

int job_has_run(const Job *j) {
    return astraid.site->has_run(j);
}

int job_run_dir(const Job *j, char *out, size_t cap) {
    int n = snprintf(out, cap, "%s/jobs/%ld", astraid.cfg.shared_dir, j->id);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

int job_log_path(const char *run_dir, long run, int rank, char *out, size_t cap) {
    int n = snprintf(out, cap, "%s/run%ld-rank%d.log", run_dir, run, rank);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

void jobs_adopt(Job *j) {
    j->spec_text = cJSON_PrintUnformatted(j->spec); // NULL: job_to_json copies the tree
    Err ignored = {0}; // a ckpt_dir that no longer resolves is compared with no other
    if (!j->ckpt_real) job_ckpt_dir_resolve(j, &ignored);
    j->text = job_text_new(); // NULL: its JOB text is printed at each request
    index_add(j);
    Job **p = &astraid.jobs;
    while (*p && (*p)->id < j->id)
        p = &(*p)->next;
    j->next = *p;
    *p = j;
}

// ---------------------------------------------------------------- ids

// Ids of shared_dir/jobs/<id> directories astraid.db does not know (it was deleted or
// emptied): reported, never adopted, and their ids never given again.
static long *unknown_dirs;
static size_t n_unknown_dirs;

// "42" → 42; -1 for a name that is not a job id.
static long dir_job_id(const char *name) {
    char *end;
    errno = 0;
    long id = strtol(name, &end, 10);
    return name[0] >= '1' && name[0] <= '9' && !*end && !errno ? id : -1;
}

static int by_id(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}

static void note_unknown_dir(long id) {
    long *grown = realloc(unknown_dirs, (n_unknown_dirs + 1) * sizeof *grown);
    if (!grown) return;
    unknown_dirs = grown;
    unknown_dirs[n_unknown_dirs++] = id;
}

int jobs_init_ids(Err *err) {
    char dir[PATH_MAX];
    if (path_join(dir, sizeof dir, astraid.cfg.shared_dir, "jobs", err)) return -1;
    DIR *d = opendir(dir);
    if (!d) return err_errno(err, errno, "%s: cannot list", dir);
    long max_id = state_max_job_id();
    struct dirent *e;
    while ((e = readdir(d))) {
        long id = dir_job_id(e->d_name);
        if (id < 1) continue;
        if (id > max_id) max_id = id;
        if (!job_find(id)) note_unknown_dir(id);
    }
    closedir(d);
    astraid.next_id = max_id + 1;
    if (!n_unknown_dirs) return 0;
    qsort(unknown_dirs, n_unknown_dirs, sizeof *unknown_dirs, by_id);
    char ids[256] = "";
    size_t n = 0, shown = 0;
    for (; shown < n_unknown_dirs && n + 24 < sizeof ids; shown++)
        n += (size_t)snprintf(ids + n, sizeof ids - n, "%s%ld", shown ? " " : "",
                              unknown_dirs[shown]);
    log_warn("%zu job director%s in %s unknown to astraid.db (ids %s%s): left as they are; new "
             "jobs start at id %ld",
             n_unknown_dirs, n_unknown_dirs == 1 ? "y" : "ies", dir, ids,
             shown < n_unknown_dirs ? " ..." : "", astraid.next_id);
    return 0;
}

cJSON *jobs_unknown_dirs(void) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "count", (double)n_unknown_dirs);
    cJSON *ids = cJSON_AddArrayToObject(o, "ids");
    for (size_t i = 0; i < n_unknown_dirs && i < UNKNOWN_DIRS_SHOWN; i++)
        cJSON_AddItemToArray(ids, cJSON_CreateNumber((double)unknown_dirs[i]));
    return o;
}

// The first id from next_id on whose run directory does not exist: one left by a job
// the database forgot keeps its checkpoints and logs to itself. astraid alone makes
// run directories (it holds the state directory's lock), so the id stays free until
// the submit makes its directory.
static long next_free_id(void) {
    char dir[PATH_MAX];
    for (;; astraid.next_id++) {
        int n = snprintf(dir, sizeof dir, "%s/jobs/%ld", astraid.cfg.shared_dir, astraid.next_id);
        if (n < 0 || (size_t)n >= sizeof dir || access(dir, F_OK)) return astraid.next_id;
        log_warn("job id %ld: %s exists but is no job of astraid.db; id skipped", astraid.next_id,
                 dir);
    }
}

// ---------------------------------------------------------------- submit

// Paths in a spec are used by ranks whose working directory is not the client's.
static int check_absolute(const cJSON *spec, Err *err) {
    for (const char *const *key = JOB_SPEC_PATH_KEYS; *key; key++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(spec, *key);
        if (cJSON_IsString(v) && v->valuestring[0] != '/' &&
            job_spec_value_is_path(*key, v->valuestring))
            return err_set(err, "%s: '%s' is a relative path; astraid needs an absolute one", *key,
                           v->valuestring);
    }
    return 0;
}

// What a run needs from this machine: its devices (the local executor; under slurm,
// Slurm decides, sbatch --test-only at submit).
static int check_devices(const JobSpec *js, const cJSON *spec, Err *err) {
    const Devices *d = &astraid.devices;
    if (!astraid.site->takes_devices) return 0;
    if (js->nodes > 1)
        return err_set(err,
                       "nodes: %ld nodes, but astraid runs jobs on this machine only "
                       "(astraid --executor slurm runs multi-node jobs)",
                       js->nodes);
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

// The GPUs a run of js would have now: those it names, else the lowest free ones (then the
// lowest busy ones); their number.
static int wanted_gpus(const JobSpec *js, int *gpus, int cap) {
    const Devices *d = &astraid.devices;
    int n = 0;
    for (long i = 0; js->device_ids && i < js->n_devices && n < cap; i++)
        gpus[n++] = (int)js->device_ids[i];
    for (int busy = 0; !js->device_ids && busy < 2; busy++)
        for (int i = 0; i < d->n && n < js->n_devices && n < cap; i++)
            if ((d->used[i] != 0) == busy) gpus[n++] = d->ids[i];
    return n;
}

int jobs_preflight(const cJSON *spec, PreflightDone done, void *arg, Err *err) {
    JobSpec js;
    if (job_spec_parse(&js, spec, err)) return -1;
    int gpus[64], n = 0, rc = check_absolute(spec, err) || check_devices(&js, spec, err);
    if (!rc && astraid.devices.gpu && astraid.site->takes_devices)
        n = wanted_gpus(&js, gpus, (int)(sizeof gpus / sizeof *gpus));
    const cJSON *dir = cJSON_GetObjectItemCaseSensitive(spec, "ckpt_dir");
    char jobs_dir[PATH_MAX]; // a job without ckpt_dir checkpoints into its run directory
    rc = rc || path_join(jobs_dir, sizeof jobs_dir, astraid.cfg.shared_dir, "jobs", err) ||
         preflight_run(&js, cJSON_IsString(dir) ? dir->valuestring : jobs_dir, 0, gpus, n, done,
                       arg, err);
    job_spec_free(&js);
    return rc ? -1 : 0;
}

// A new job taking *js (which is then the job's: not freed by the caller).
static Job *job_new(JobSpec *js, const cJSON *spec, long uid) {
    Job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->js = *js;
    j->id = next_free_id();
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
    j->created_at = clock_wall_s();
    return j;
}

// ckpt_dir defaults to the job's run directory (so jobs never share checkpoints);
// the spec shown by status then carries it.
static int set_ckpt_dir(Job *j, Err *err) {
    const cJSON *given = cJSON_GetObjectItemCaseSensitive(j->spec, "ckpt_dir");
    char dir[PATH_MAX + 16], run_dir[PATH_MAX];
    if (job_run_dir(j, run_dir, sizeof run_dir))
        return err_set(err, "shared-dir: %s is too long", astraid.cfg.shared_dir);
    if (cJSON_IsString(given)) {
        j->ckpt_dir = strdup(given->valuestring);
        return 0;
    }
    snprintf(dir, sizeof dir, "%s/checkpoints", run_dir);
    j->ckpt_dir = strdup(dir);
    free(j->js.train.ckpt_dir);
    j->js.train.ckpt_dir = strdup(dir);
    if (!j->js.train.ckpt_dir || !cJSON_AddStringToObject(j->spec, "ckpt_dir", dir))
        return err_resource(err, "ckpt_dir: out of memory");
    return 0;
}

// The run directory is made once the job's paths passed: a refused job leaves nothing.
static int make_run_dir(const Job *j, Err *err) {
    char run_dir[PATH_MAX];
    return job_run_dir(j, run_dir, sizeof run_dir) || fs_mkdir_p(run_dir, err);
}

// A submit that failed after make_run_dir: its (still empty) directory goes again.
static void drop_run_dir(const Job *j) {
    char run_dir[PATH_MAX];
    if (!job_run_dir(j, run_dir, sizeof run_dir)) rmdir(run_dir);
}

// A new job on its way to the database: in astraid.jobs (its id and ckpt_dir are taken)
// but unsaved, unknown to clients and the queue, until its row committed.
typedef struct {
    Job *job;
    ChangeDone done;
    void *arg;
} Submit;

static void unlink_job(Job *j) {
    for (Job **p = &astraid.jobs; *p; p = &(*p)->next)
        if (*p == j) {
            *p = j->next;
            return;
        }
}

// Nothing was queued: the job goes, and its run directory.
static void submit_refused(Submit *s, int code, const Err *err) {
    unlink_job(s->job);
    drop_run_dir(s->job);
    job_free(s->job);
    s->done(s->arg, code, err);
    free(s);
}

// ---------------------------------------------------------------- announcing changes

static JobListener listeners[JOB_LISTENERS_MAX];
static int n_listeners;

int jobs_listen(JobListener listener, Err *err) {
    if (n_listeners == JOB_LISTENERS_MAX)
        return err_set(err, "more than %d listeners of job changes", JOB_LISTENERS_MAX);
    listeners[n_listeners++] = listener;
    return 0;
}

void job_changed(const Job *j, JobChange what, const char *event) {
    for (int i = 0; i < n_listeners; i++)
        listeners[i](j, what, event);
}

// What clients see of j other than its progress changed: the watchers and the HTTP side hear
// of it (before the acknowledgement goes out).
static void shown_changed(const Job *j) {
    job_changed(j, JOB_SHOWN, NULL);
}

static void submit_written(void *arg, const Err *err) {
    Submit *s = arg;
    Job *j = s->job;
    if (err->msg[0]) {
        submit_refused(s, RPC_INTERNAL_ERROR, err);
        return;
    }
    j->rows.unsaved = 0;
    state_event(j->id, "submitted", j->name);
    log_info("job %ld (%s) submitted by uid %ld", j->id, j->name, j->submitted_by);
    shown_changed(j);
    s->done(s->arg, 0, err);
    free(s);
    job_changed(j, JOB_RELEASED, NULL); // queued: after the reply said so
}

// Under slurm, Slurm takes the job (sbatch --test-only) before its row is written: a bad
// partition or an impossible request is refused at submit with Slurm's message.
static void submit_checked(void *arg, int code, const Err *err) {
    Submit *s = arg;
    Err serr = {0};
    if (!code && !state_save_job(s->job, submit_written, s, &serr)) return;
    submit_refused(s, code ? code : RPC_INTERNAL_ERROR, code ? err : &serr);
}

int jobs_submit(const cJSON *spec, long uid, ChangeDone done, void *arg, long *id, Err *err) {
    JobSpec js;
    if (job_spec_parse(&js, spec, err)) return -1;
    Job *j = NULL;
    if (!check_absolute(spec, err) && !check_devices(&js, spec, err)) {
        j = job_new(&js, spec, uid);
        if (!j) err_resource(err, "out of memory for a new job");
    }
    int lost_ids = j && j->js.device_ids && !j->want_ids;
    if (!j) {
        job_spec_free(&js);
        return -1;
    }
    Submit *s = NULL;
    if (!j->name || !j->spec || lost_ids || set_ckpt_dir(j, err) || !j->ckpt_dir ||
        job_paths_check(j, err) || !(s = malloc(sizeof *s)) || make_run_dir(j, err) ||
        (astraid.site->check_submit ? astraid.site->check_submit(j, submit_checked, s, err)
                                    : state_save_job(j, submit_written, s, err))) {
        if (!*err->msg) err_resource(err, "out of memory for job %ld", j->id);
        drop_run_dir(j);
        job_free(j);
        free(s);
        return -1;
    }
    *s = (Submit){j, done, arg}; // before the check or write completes: both run off the loop
    j->rows.unsaved = 1;
    astraid.next_id = j->id + 1;
    jobs_adopt(j);
    *id = j->id;
    return 0;
}

// ---------------------------------------------------------------- state changes

int job_is_final(JobState s) {
    return s == JOB_COMPLETED || s == JOB_FAILED || s == JOB_CANCELLED;
}

// The state and the times that go with it.
static void apply_state(Job *j, JobState s) {
    j->state = s;
    if (job_is_final(s)) j->finished_at = clock_wall_s();
    if (s == JOB_STARTING) j->started_at = clock_wall_s();
}

// What follows a change from `from`: the log line, the event; a final job's lines go back
// to its files only, and the retention may drop old jobs. (The watchers hear of it once
// its row is written.)
static void announce_state(Job *j, JobState from) {
    if (from != j->state)
        log_info("job %ld: %s -> %s", j->id, job_state_name(from), job_state_name(j->state));
    state_event(j->id, "state", job_state_name(j->state));
    if (job_is_final(j->state)) {
        job_drop_log(j);
        job_changed(j, JOB_FINAL, NULL);
    }
}

// A run's own change is made whatever the disk says; a row of it that did not commit (a full
// disk) is written again after a backoff until one does, so that the next astraid does not
// find the job as it was before. Not while the database is damaged (nothing is written to it
// then), nor once astraid is stopping.
static uv_timer_t resave_timer;
static int resave_ready;
static long resave_tries; // in a row since a row last committed

static void resave(uv_timer_t *t) {
    (void)t;
    for (Job *j = astraid.jobs; j; j = j->next)
        if (j->rows.row_stale && !j->rows.removing) job_save(j);
}

static void resave_later(Job *j) {
    j->rows.row_stale = 1;
    if (astraid.stopping || state_damage()) return;
    if (!resave_ready) {
        uv_timer_init(astraid.loop, &resave_timer);
        resave_ready = 1;
    }
    if (uv_is_closing((uv_handle_t *)&resave_timer) || uv_is_active((uv_handle_t *)&resave_timer))
        return;
    resave_tries++;
    uv_timer_start(&resave_timer, resave, (uint64_t)(job_backoff_s(resave_tries) * 1000), 0);
}

// A row of a job written: clients now see its state. j is still there: it is freed only
// by its removal's write, which comes after this one.
typedef struct {
    Job *job;
    JobState state;
    long version;
} Saved;

static void saved(void *arg, const Err *err) {
    Saved *s = arg;
    s->job->shown_state = s->state; // shown whatever the disk said (the failure is logged)
    if (err->msg[0]) {
        resave_later(s->job);
    } else if (s->version == s->job->rows.version) {
        s->job->rows.row_stale = 0;
        resave_tries = 0;
    }
    shown_changed(s->job);
    free(s);
}

void job_save(Job *j) {
    j->rows.version++;
    Saved *s = malloc(sizeof *s);
    if (s) *s = (Saved){j, j->state, j->rows.version};
    if (!s || state_save_job(j, saved, s, NULL)) {
        free(s);
        j->shown_state = j->state; // not written: shown as it is
        shown_changed(j);
    }
}

// A run's own transitions happen whatever the database says (a failed write is logged, and
// the row written again: resave_later).
void job_set_state(Job *j, JobState s) {
    JobState from = j->state;
    apply_state(j, s);
    job_save(j);
    announce_state(j, from);
}

static int refuse(const Job *j, const char *verb, int *code, Err *err) {
    *code = RPC_BAD_STATE;
    return err_set(err, "job %ld is %s: cannot %s", j->id, job_state_name(j->state), verb);
}

// A verb that changes a job's state: whether it may (else *code and err), the change
// (made on a copy for the row to write, then on the job once that row committed; real:
// the job's own strings may be freed), and what follows it (stopping the ranks).
typedef struct {
    const char *name;
    int (*check)(const Job *j, int *code, Err *err);
    void (*change)(Job *j, int real);
    void (*after)(Job *j, JobState from);
} Verb;

typedef struct {
    const Verb *verb;
    Job *job;     // never removed meanwhile: no rm while it is `changing`
    long version; // of the job it was planned on
    ChangeDone done;
    void *arg;
} Change;

static void change_written(void *arg, const Err *err);

// Checks the verb on j as it is and queues its row: the job as the verb makes it.
static int plan(Job *j, Change *c, int *code, Err *err) {
    if (j->rows.removing) {
        *code = RPC_BAD_STATE;
        return err_set(err, "job %ld is being removed: cannot %s", j->id, c->verb->name);
    }
    if (c->verb->check(j, code, err)) return -1;
    Job next = *j;
    c->verb->change(&next, 0);
    c->version = j->rows.version;
    if (state_save_job(&next, change_written, c, err)) {
        *code = RPC_INTERNAL_ERROR;
        return -1;
    }
    return 0;
}

static void change_finish(Change *c, int code, const Err *err) {
    c->job->rows.changing--;
    c->done(c->arg, code, err);
    free(c);
}

// The row committed: the change is made, unless the job changed meanwhile (a run's own
// transition, another verb): then it is planned again on the job as it is now, and when
// it no longer applies, the job's current row replaces the one just written.
static void change_written(void *arg, const Err *err) {
    Change *c = arg;
    Job *j = c->job;
    int code = RPC_INTERNAL_ERROR;
    Err again = {0};
    if (err->msg[0]) {
        change_finish(c, code, err);
        return;
    }
    if (j->rows.version != c->version) {
        if (plan(j, c, &code, &again)) {
            job_save(j);
            change_finish(c, code, &again);
        }
        return;
    }
    JobState from = j->state;
    c->verb->change(j, 1);
    j->rows.version++;
    j->shown_state = j->state;
    announce_state(j, from);
    shown_changed(j);
    if (c->verb->after) c->verb->after(j, from);
    change_finish(c, 0, err);
}

static int change_job(Job *j, const Verb *verb, ChangeDone done, void *arg, int *code, Err *err) {
    Change *c = malloc(sizeof *c);
    if (!c) {
        *code = RPC_INTERNAL_ERROR;
        return err_resource(err, "out of memory");
    }
    *c = (Change){.verb = verb, .job = j, .done = done, .arg = arg};
    if (plan(j, c, code, err)) {
        free(c);
        return -1;
    }
    j->rows.changing++;
    return 0;
}

// pause: a queued job is not started yet: it just stays out of the queue; a running one
// is stopped (its ranks checkpoint and exit).
static int pause_check(const Job *j, int *code, Err *err) {
    if (j->state == JOB_QUEUED || j->state == JOB_RUNNING || j->state == JOB_STARTING) return 0;
    return refuse(j, "pause", code, err);
}

static void pause_change(Job *j, int real) {
    (void)real;
    apply_state(j, j->state == JOB_QUEUED && !job_has_run(j) ? JOB_PAUSED : JOB_PAUSING);
}

// A queued job may have a run: a Slurm job still pending.
static void pause_after(Job *j, JobState from) {
    if (from != JOB_QUEUED || job_has_run(j)) astraid.site->stop(j, STOP_PAUSE);
}

static const Verb PAUSE = {"pause", pause_check, pause_change, pause_after};

int job_pause(Job *j, ChangeDone done, void *arg, int *code, Err *err) {
    return change_job(j, &PAUSE, done, arg, code, err);
}

// Resume = queue again; the run continues from the last checkpoint when there is one.
static int resume_check(const Job *j, int *code, Err *err) {
    if (job_has_run(j) || j->ending ||
        (j->state != JOB_PAUSED && j->state != JOB_FAILED && j->state != JOB_CANCELLED &&
         j->state != JOB_INTERRUPTED))
        return refuse(j, "resume", code, err);
    if (job_ckpt_dir_free(j, err)) { // a job submitted while this one was finished took it
        *code = RPC_BAD_STATE;
        return -1;
    }
    return 0;
}

static void resume_change(Job *j, int real) {
    j->restarts = 0;
    j->hold_until = 0;
    j->finished_at = 0;
    j->watch.run_time_s = 0; // max_duration_hours counts from the resume
    if (real) {
        free(j->error);
        free(j->pause_reason);
    }
    j->error = j->pause_reason = NULL;
    apply_state(j, JOB_QUEUED);
}

static void resume_after(Job *j, JobState from) {
    (void)from;
    job_changed(j, JOB_RELEASED, NULL); // queued again
}

static const Verb RESUME = {"resume", resume_check, resume_change, resume_after};

int job_resume(Job *j, ChangeDone done, void *arg, int *code, Err *err) {
    return change_job(j, &RESUME, done, arg, code, err);
}

int job_checkpoint(Job *j, int *code, Err *err) {
    if (j->state != JOB_RUNNING) return refuse(j, "checkpoint", code, err);
    astraid.site->checkpoint(j);
    state_event(j->id, "checkpoint", "requested");
    return 0;
}

static int cancel_check(const Job *j, int *code, Err *err) {
    return job_is_final(j->state) ? refuse(j, "cancel", code, err) : 0;
}

// A Slurm job is cancelled once Slurm says it ended (slurmctld may be down meanwhile);
// local ranks get SIGKILL: the job is cancelled at once.
static void cancel_change(Job *j, int real) {
    (void)real;
    apply_state(j,
                astraid.site->cancel_confirmed && job_has_run(j) ? JOB_CANCELLING : JOB_CANCELLED);
}

static void cancel_after(Job *j, JobState from) {
    (void)from;
    if (job_has_run(j)) astraid.site->stop(j, STOP_CANCEL); // the run ends a moment later
}

static const Verb CANCEL = {"cancel", cancel_check, cancel_change, cancel_after};

int job_cancel(Job *j, ChangeDone done, void *arg, int *code, Err *err) {
    return change_job(j, &CANCEL, done, arg, code, err);
}

double job_backoff_s(long tries) {
    return fmin(BACKOFF_MAX_S, BACKOFF_BASE_S * pow(2.0, (double)(tries - 1)));
}

// A message of two parts, "a; b" (NULL when out of memory).
static char *join(const char *a, const char *b) {
    size_t n = strlen(a) + strlen(b) + 3;
    char *s = malloc(n);
    if (s) snprintf(s, n, "%s; %s", a, b);
    return s;
}

static void fail(Job *j, char *error) {
    free(j->error);
    j->error = error;
    log_error("job %ld failed: %s", j->id, error ? error : "out of memory");
    job_set_state(j, JOB_FAILED);
    job_changed(j, JOB_EVENT, "failed");
}

// A run that ended short of its end is restarted from the last checkpoint after a backoff
// while restarts < max_restarts. restarts counts the early ends since the job last saved
// new progress: a run that wrote a checkpoint past the one it started from forgives the
// earlier ones (so kills hours apart never add up), and is itself restart 1. permanent: no
// restart can help (bad input); nor can one when ckpt_dir cannot be written.
static void on_failure(Job *j, const char *cause, int permanent, const char *started_from) {
    Err unusable = {0};
    if (!permanent && job_ckpt_dir_usable(j, &unusable)) {
        fail(j, join(unusable.msg, cause));
        return;
    }
    if (permanent) {
        fail(j, strdup(cause));
        return;
    }
    int progressed =
        j->last_checkpoint && (!started_from || strcmp(started_from, j->last_checkpoint));
    if (progressed && j->restarts) {
        log_info("job %ld: the run saved %s: its %ld earlier restart(s) are forgiven", j->id,
                 j->last_checkpoint, j->restarts);
        j->restarts = 0;
    }
    if (j->restarts >= j->max_restarts) {
        fail(j, strdup(cause));
        return;
    }
    free(j->error);
    j->error = strdup(cause);
    j->restarts++;
    j->restarts_total++;
    j->hold_until = clock_mono_s() + job_backoff_s(j->restarts);
    log_warn("job %ld: run ended early (%s); restart %ld/%ld in %.0f s", j->id, cause, j->restarts,
             j->max_restarts, job_backoff_s(j->restarts));
    state_event(j->id, "restart", cause);
    job_set_state(j, JOB_QUEUED);
    job_changed(j, JOB_EVENT, "restarted");
}

// A run that could not start for want of a resource (too many open files, no memory) is
// tried again after a backoff for as long as it takes: the job itself did not fail.
static void start_later(Job *j, const char *cause) {
    free(j->error);
    j->error = strdup(cause);
    j->start_retries++;
    j->hold_until = clock_mono_s() + job_backoff_s(j->start_retries);
    log_warn("job %ld: could not start (%s); trying again in %.0f s", j->id, cause,
             job_backoff_s(j->start_retries));
    state_event(j->id, "retry", cause);
    job_set_state(j, JOB_QUEUED);
}

void job_start_failed(Job *j, const Err *err) {
    if (err->resource)
        start_later(j, err->msg);
    else
        fail(j, strdup(err->msg));
}

int job_run_spec(const Job *j, JobSpec *run, Err *err) {
    if (j->spec_error) return err_set(err, "job spec: %s", j->spec_error);
    *run = j->js;
    run->train.resume = run->train.resume || j->resume;
    return 0;
}

// The run's progress reached its end: total_steps, or the spec's max_steps. A fresh run that
// starts part-way (start_epoch, start_samples) ends short of total_steps by design: there
// the ranks' exit status alone tells.
static int reached_end(const Job *j) {
    if (j->js.train.start_epoch > 0 || j->js.train.start_samples > 0) return 1;
    long end = j->progress.total_steps, max_steps = j->js.train.max_steps;
    if (max_steps > 0 && max_steps < end) end = max_steps;
    return j->progress.has_step && end > 0 && j->progress.step >= end;
}

// Why a run that astraid did not stop ended before its end: a rank stopped by a signal from
// outside astraid (an admin, a container stop, timeout) exits 3 after its checkpoint.
static char *interrupted_cause(const Job *j, const RunOutcome *o) {
    char head[256];
    snprintf(head, sizeof head,
             "interrupted at step %ld of %ld by a stop astraid did not send (SIGTERM/SIGINT from "
             "outside)",
             j->progress.step, j->progress.total_steps);
    if (o->interrupted && o->cause) return join(head, o->cause);
    snprintf(head, sizeof head,
             "the run ended at step %ld of %ld, before its end, with exit code 0", j->progress.step,
             j->progress.total_steps);
    return strdup(head);
}

// A run that ended, while what it left is read off the loop (in the writes' order, so
// that a verb queued after the end is planned on the job as the end leaves it): its last
// progress, and the latest checkpoint of its ckpt_dir (what --resume=true will find; a
// directory of thousands of entries takes a while).
typedef struct {
    Job *job; // ending: neither removed nor resumed meanwhile
    RunOutcome o;
    char *cause, *started_from; // o's strings, copied
    char run_dir[PATH_MAX], *ckpt_dir;
    long total_steps;
    JobProgress progress;
    int found; // ckpt_find_latest: 0 found (in ckpt), 1 none, -1 error (in err)
    char ckpt[PATH_MAX];
    Err err;
} RunEnd;

static void run_end_read(void *arg) {
    RunEnd *e = arg;
    progress_read_dir(e->run_dir, e->total_steps, &e->progress);
    e->found = ckpt_find_latest(e->ckpt_dir, e->ckpt, sizeof e->ckpt, &e->err);
}

static void run_end_free(RunEnd *e) {
    free(e->cause);
    free(e->started_from);
    free(e->ckpt_dir);
    free(e);
}

// What the run's end decides, on the job as it is now, and what follows (the next job, or
// the daemon's exit). A cancel or a pause that was written as the run ended (its ranks
// already gone) still counts as the daemon's stop; a run that ran to its end is completed
// whatever was asked meanwhile (unless the job is final already: a local cancel).
static void run_end_decide(Job *j, RunOutcome o) {
    if (o.exited_ok && reached_end(j) && !job_is_final(j->state))
        o.stop = STOP_NONE;
    else if (o.stop == STOP_NONE && (j->state == JOB_CANCELLED || j->state == JOB_CANCELLING))
        o.stop = STOP_CANCEL;
    else if ((o.stop == STOP_NONE || o.stop == STOP_HANG) && j->state == JOB_PAUSING &&
             (o.failed || !reached_end(j)))
        o.stop = STOP_PAUSE;
    j->progress.eta_s = -1; // until a run measures it again
    if (!o.transient) j->start_retries = 0;
    int short_end = o.stop == STOP_NONE && !o.failed && (o.interrupted || !reached_end(j));
    const char *outcome = o.stop == STOP_CANCEL     ? "cancelled"
                          : o.stop == STOP_SHUTDOWN ? "interrupted"
                          : o.stop == STOP_PAUSE    ? "paused"
                          : o.stop == STOP_HANG     ? "hang"
                          : o.failed                ? "failed"
                          : short_end               ? "interrupted"
                                                    : "completed";
    state_run_ended(j, outcome);
    if (o.stop == STOP_CANCEL)
        job_set_state(j, JOB_CANCELLED);
    else if (o.stop == STOP_SHUTDOWN)
        job_set_state(j, JOB_INTERRUPTED);
    else if (o.stop == STOP_PAUSE) {
        job_set_state(j, JOB_PAUSED);
        if (j->pause_reason) job_changed(j, JOB_EVENT, "time_limit");
    } else if (o.stop == STOP_HANG)
        on_failure(j, j->watch.hang_cause ? j->watch.hang_cause : "hang", 0, o.started_from);
    else if (o.failed && o.transient)
        start_later(j, o.cause ? o.cause : "a rank could not be started");
    else if (o.failed)
        on_failure(j, o.cause ? o.cause : "a rank failed", o.bad_input, o.started_from);
    else if (short_end) {
        char *cause = interrupted_cause(j, &o);
        on_failure(j, cause ? cause : "interrupted", 0, o.started_from);
        free(cause);
    } else {
        free(j->error);
        j->error = NULL;
        j->progress.eta_s = 0;
        free(j->pause_reason); // a time limit reached as the run got to its end
        j->pause_reason = NULL;
        job_set_state(j, JOB_COMPLETED);
        job_changed(j, JOB_EVENT, "completed");
    }
    free(j->watch.hang_cause);
    j->watch.hang_cause = NULL;
    if (astraid.stopping)
        daemon_maybe_finish();
    else
        job_changed(j, JOB_RELEASED, NULL); // its devices are free
}

static void run_end_read_done(void *arg, const Err *err) {
    (void)err;
    RunEnd *e = arg;
    Job *j = e->job;
    j->ending = 0;
    progress_apply(j, &e->progress);
    if (e->found < 0) log_warn("job %ld: %s", j->id, e->err.msg);
    j->resume = e->found == 0;
    if (j->resume && (!j->last_checkpoint || strcmp(j->last_checkpoint, e->ckpt))) {
        free(j->last_checkpoint);
        j->last_checkpoint = strdup(e->ckpt);
    }
    run_end_decide(j, e->o);
    run_end_free(e);
}

void job_run_ended(Job *j, const RunOutcome *o) {
    devices_release(j);
    job_watch_run_ended(j);
    RunEnd *e = calloc(1, sizeof *e);
    Err err = {0};
    if (e) {
        e->job = j;
        e->o = *o;
        e->o.cause = e->cause = o->cause ? strdup(o->cause) : NULL;
        e->o.started_from = e->started_from = o->started_from ? strdup(o->started_from) : NULL;
        e->ckpt_dir = strdup(j->ckpt_dir);
        e->total_steps = j->progress.total_steps;
    }
    if (!e || !e->ckpt_dir || job_run_dir(j, e->run_dir, sizeof e->run_dir) ||
        state_queue_work(run_end_read, run_end_read_done, e, &err)) {
        // Without memory to read them: decided on what the last poll saw.
        log_error("job %ld: cannot read what its run left: out of memory", j->id);
        if (e) run_end_free(e);
        run_end_decide(j, *o);
        return;
    }
    j->ending = 1;
}

// ---------------------------------------------------------------- teardown

void job_free(Job *j) {
    if (!j) return;
    index_remove(j);
    job_drop_log(j);
    free(j->name);
    cJSON_Delete(j->spec);
    cJSON_free(j->spec_text);
    free(j->ckpt_dir);
    free(j->ckpt_real);
    job_text_free(j->text);
    free(j->want_ids);
    free(j->devices);
    free(j->progress.error);
    job_spec_free(&j->js);
    free(j->spec_error);
    free(j->last_checkpoint);
    free(j->error);
    free(j->watch.phase);
    free(j->watch.hang_cause);
    free(j->pause_reason);
    free(j);
}

void jobs_free_all(void) {
    while (astraid.jobs) {
        Job *j = astraid.jobs;
        astraid.jobs = j->next;
        job_free(j);
    }
    free(index_jobs);
    index_jobs = NULL;
    index_n = index_cap = 0;
    index_lost = 0;
    job_text_cache_free();
    free(unknown_dirs);
    unknown_dirs = NULL;
    n_unknown_dirs = 0;
}
