// job_json.c: the JOB object (docs/protocol.md "The JOB object"). A JOB object is described once,
// value by value, into an Out: either a cJSON tree (job_to_json), or the values' bytes alone, the
// key of the printed text each job keeps (JobText): job_to_raw_json answers from that text while
// the job's key is the one it was printed from, so a `status` builds no tree and prints no number.
// One description for both: the key cannot miss a value the JOB shows, wherever it changes (a
// state, a poll of progress.db, a rank's exit, a GPU sample).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "common/buf.h"
#include "common/json.h"
#include "daemon/daemon.h"

// A JOB object's text and the key of the values it was printed from (job_to_raw_json).
struct JobText {
    char *json; // the JOB object printed, NULL: none yet
    Buf key;    // the values it was printed from
};

typedef struct {
    int tree;   // building the tree, else the key
    Buf *key;   // the key
    int failed; // out of memory writing the key
} Out;

static void key_put(Out *o, const void *v, size_t n) {
    if (buf_append(o->key, v, n)) o->failed = 1;
}

// Adds item to in (an object under key, an array when key is NULL); freed when it cannot.
static void tree_add(cJSON *in, const char *key, cJSON *item) {
    int added = key ? cJSON_AddItemToObject(in, key, item) : cJSON_AddItemToArray(in, item);
    if (!added) cJSON_Delete(item);
}

// A number, JSON null unless shown.
static void out_number(Out *o, cJSON *in, const char *key, double v, int shown) {
    if (o->tree) {
        tree_add(in, key, shown ? cJSON_CreateNumber(v) : cJSON_CreateNull());
        return;
    }
    char flag = (char)(shown != 0);
    key_put(o, &flag, 1);
    if (shown) key_put(o, &v, sizeof v);
}

// A string, JSON null when s is NULL.
static void out_string(Out *o, cJSON *in, const char *key, const char *s) {
    if (o->tree) {
        tree_add(in, key, s ? cJSON_CreateString(s) : cJSON_CreateNull());
        return;
    }
    size_t n = s ? strlen(s) + 1 : 0; // with its NUL: "" and NULL differ
    key_put(o, &n, sizeof n);
    key_put(o, s, n);
}

// A unix time as "2024-05-01T12:00:00Z", JSON null when t is 0 (not yet).
static void out_time(Out *o, cJSON *in, const char *key, double t) {
    if (!o->tree) {
        key_put(o, &t, sizeof t);
        return;
    }
    char buf[32];
    time_t s = (time_t)t;
    struct tm tm;
    gmtime_r(&s, &tm);
    strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    out_string(o, in, key, t > 0 ? buf : NULL);
}

// An array of n items, or an object (n 0), under key (key NULL: an item of the array in):
// the tree's node, NULL while writing the key (where its n, so that the key splits as
// the values do, and then its values follow).
static cJSON *out_open(Out *o, cJSON *in, const char *key, int is_array, size_t n) {
    if (!o->tree) {
        key_put(o, &n, sizeof n);
        return NULL;
    }
    cJSON *node = is_array ? cJSON_CreateArray() : cJSON_CreateObject();
    int added = key ? cJSON_AddItemToObject(in, key, node) : cJSON_AddItemToArray(in, node);
    if (added) return node;
    cJSON_Delete(node);
    return NULL;
}

// The ranks of a live run: [{"rank":0,"pid":4242,"gpu":1,"memory_used_bytes":...,
// "utilization_pct":87}]; gpu and its figures null on CPU slots or when unknown
// (from gpu.c's last sample, at most a few seconds old). [] without a run.
static void describe_ranks(const Job *j, Out *o, cJSON *obj) {
    int n = j->devices ? runner_ranks(j) : 0;
    if (n > j->n_devices) n = (int)j->n_devices;
    cJSON *list = out_open(o, obj, "ranks", 1, (size_t)n);
    for (int r = 0; r < n; r++) {
        cJSON *rank = out_open(o, list, NULL, 0, 0);
        pid_t pid = runner_rank_pid(j, r);
        int gpu = astraid.devices.gpu ? j->devices[r] : -1; // its LOCAL_RANK-th visible GPU
        int64_t mem = gpu >= 0 ? gpu_process_memory(gpu, pid) : -1;
        int util = gpu >= 0 ? gpu_utilization(gpu) : -1;
        out_number(o, rank, "rank", r, 1);
        out_number(o, rank, "pid", pid, pid > 0);
        out_number(o, rank, "gpu", gpu, gpu >= 0);
        out_number(o, rank, "memory_used_bytes", (double)mem, mem >= 0);
        out_number(o, rank, "utilization_pct", util, util >= 0);
    }
}

static void out_metric(Out *o, cJSON *obj, const char *key, double v, int known) {
    out_number(o, obj, key, v, known && isfinite(v));
}

// The JOB object of docs/design.md §3 / docs/protocol.md.
static void describe(const Job *j, Out *o, cJSON *obj) {
    out_number(o, obj, "id", (double)j->id, 1);
    out_string(o, obj, "name", j->name);
    out_string(o, obj, "state", job_state_name(j->shown_state));
    // The spec never changes once adopted: printed then, not at every request (nor keyed).
    if (o->tree)
        tree_add(obj, "spec",
                 j->spec_text ? cJSON_CreateRaw(j->spec_text) : cJSON_Duplicate(j->spec, 1));
    out_number(o, obj, "step", (double)j->progress.step, 1);
    out_number(o, obj, "total_steps", (double)j->progress.total_steps, 1);
    out_number(o, obj, "epoch", (double)j->progress.epoch, 1);
    out_metric(o, obj, "loss", j->progress.loss, j->progress.has_step);
    out_metric(o, obj, "lr", j->progress.lr, j->progress.has_step);
    out_metric(o, obj, "grad_norm", j->progress.grad_norm, j->progress.has_step);
    out_metric(o, obj, "tokens_per_s", j->progress.tokens_per_s, j->progress.has_step);
    out_metric(o, obj, "eta_s", j->progress.eta_s, j->progress.has_step && j->progress.eta_s >= 0);
    out_metric(o, obj, "val_loss", j->progress.val_loss, j->progress.has_val_loss);
    out_metric(o, obj, "loss_scale", j->progress.loss_scale, j->progress.has_loss_scale);
    out_number(o, obj, "skipped_steps", (double)j->progress.skipped_steps,
               j->progress.has_loss_scale);
    out_metric(o, obj, "expert_load_max", j->progress.expert_load_max, j->progress.has_expert_load);
    out_metric(o, obj, "expert_load_min", j->progress.expert_load_min, j->progress.has_expert_load);
    const RolloutNumbers *r = &j->progress.rollout;
    out_metric(o, obj, "reward_mean", r->reward_mean, r->has);
    out_metric(o, obj, "reward_std", r->reward_std, r->has);
    out_metric(o, obj, "response_len", r->response_len, r->has);
    out_metric(o, obj, "equal_reward_groups", r->equal_reward_groups, r->has);
    out_number(o, obj, "restarts", (double)j->restarts, 1);
    out_number(o, obj, "hangs", (double)j->watch.hangs, 1);
    out_string(o, obj, "phase", j->watch.phase);
    double left = job_time_left_s(j); // whole seconds: the text is not printed anew each time
    out_number(o, obj, "time_left_s", floor(left), left >= 0);
    out_string(o, obj, "pause_reason", j->pause_reason);
    if (astraid.site->run_state) {
        out_number(o, obj, "slurm_job", (double)j->site.slurm_id, j->site.slurm_id > 0);
        out_string(o, obj, "slurm_state", astraid.site->run_state(j));
    }
    long n_devices = j->devices ? j->n_devices : 0;
    cJSON *devs = out_open(o, obj, "devices", 1, (size_t)n_devices);
    for (long i = 0; i < n_devices; i++) {
        char name[32];
        device_name(&astraid.devices, j->devices[i], name, sizeof name);
        out_string(o, devs, NULL, name);
    }
    describe_ranks(j, o, obj);
    out_string(o, obj, "last_checkpoint", j->last_checkpoint);
    out_string(o, obj, "error", j->error);
    out_string(o, obj, "progress_error", j->progress.error);
    out_number(o, obj, "submitted_by", (double)j->submitted_by, j->submitted_by >= 0);
    out_time(o, obj, "created_at", j->created_at);
    out_time(o, obj, "started_at", j->started_at);
    out_time(o, obj, "finished_at", j->finished_at);
}

static cJSON *job_to_json(const Job *j) {
    cJSON *obj = cJSON_CreateObject();
    Out o = {.tree = 1};
    if (obj) describe(j, &o, obj);
    return obj;
}

// The key of the job asked now (loop thread only; its buffer kept from one request to the
// next).
static Buf key_now;

cJSON *job_to_raw_json(const Job *j) {
    JobText *t = j->text;
    Buf *key = &key_now;
    Out o = {.key = key};
    key->len = 0;
    if (t) describe(j, &o, NULL);
    if (t && !o.failed && t->json && t->key.len == key->len &&
        !memcmp(t->key.data, key->data, key->len))
        return cJSON_CreateRaw(t->json);
    unsigned long failures = json_failures();
    cJSON *tree = job_to_json(j);
    // A tree that lost a member for want of memory is no JOB: neither answered nor kept.
    char *json = tree && json_failures() == failures ? cJSON_PrintUnformatted(tree) : NULL;
    cJSON_Delete(tree);
    cJSON *raw = json ? cJSON_CreateRaw(json) : NULL;
    if (t) { // kept with its key when there is memory for both, else printed again next time
        cJSON_free(t->json);
        t->json = NULL;
        t->key.len = 0;
        if (json && !o.failed && !buf_append(&t->key, key->data, key->len)) {
            t->json = json;
            json = NULL;
        }
    }
    cJSON_free(json);
    return raw;
}

JobText *job_text_new(void) {
    return calloc(1, sizeof(JobText));
}

void job_text_free(JobText *t) {
    if (!t) return;
    cJSON_free(t->json);
    buf_free(&t->key);
    free(t);
}

void job_text_cache_free(void) {
    buf_free(&key_now);
}
