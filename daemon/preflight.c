// preflight.c: the checks before a run starts (docs/astraid.md "Preflight"), and the answer of
// the `preflight` method (astraictl preflight job.json) to the same question.
//
// Disk: the next checkpoint's size, estimated from the model's parameter table (its config.json
// at param_path), the weights' dtype in checkpoints (ckpt_dtype: fp32 4 bytes, bf16 2), the
// optimizer's fp32 state (AdamW: two moments per parameter; Muon: one momentum buffer for the
// matrices it steps, AdamW's two for the rest) and the small files (metric rows, JSON, headers),
// against the space free in ckpt_dir's file system (that of its nearest existing ancestor). The
// run's checkpoints together: with checkpoint_keep_last N at most N + 1 at once, else one per
// ckpt_interval to its end (once its total is known).
// GPUs (NVML's last sample, local executor): processes other than astraid's own ranks holding
// memory on the job's GPUs, retired pages, a retirement pending, uncorrected ECC errors.
//
// The rule:
//   fail  the file system is smaller than the next checkpoint (it can never fit), or a GPU is
//         sick: a page retirement pending (the GPU needs a reset), an uncorrected ECC error since
//         the driver loaded, or RETIRED_PAGES_MAX retired pages or more;
//   wait  less space free than the next checkpoint needs, or another process holds memory on
//         one of the job's GPUs: the start is tried again with the backoff of a start that lacked
//         a resource (1 s doubling to 60 s), the job queued with the numbers in its error;
//   ok    otherwise; a run whose checkpoints together would not fit is only warned of.
// A model config that cannot be read gives no estimate (the run reports it itself).
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

#include <cjson/cJSON.h>

#include "ckpt/model_dir.h"
#include "common/buf.h"
#include "daemon/daemon.h"
#include "engine/param_table.h"
#include "proto/job_spec.h"

#define RETIRED_PAGES_MAX 64         // NVIDIA's threshold for replacing a GPU
#define SMALL_FILES_BYTES (64 << 10) // meta.json, config.json, sampler/scheduler state, headers
#define METRIC_ROW_BYTES 200         // metric.jsonl grows by about this much a step
#define TENSOR_HEADER_BYTES 128      // a tensor's entry in a safetensors header
#define PROCS_SHOWN 16               // other processes listed per GPU

typedef struct {
    uv_work_t req;
    // what is checked (copied on the loop)
    char *param_path, *ckpt_dir;
    int weight_bytes;                          // per parameter in checkpoints
    int muon;                                  // the optimizer is Muon
    long keep_last, ckpt_interval, steps_left; // steps_left 0: unknown
    int gpus[64], n_gpus;
    // what the threadpool found
    Err model_err;                 // no estimate: why
    long params;                   // parameters of the model
    int64_t weights, state, small; // bytes of model.safetensors, optimizer.safetensors, the rest
    char fs_path[PATH_MAX];        // the existing directory statvfs read
    int64_t free_bytes, fs_bytes;
    Err fs_err;
    PreflightDone done;
    void *arg;
} Preflight;

// ---------------------------------------------------------------- off the loop

// The checkpoint files' bytes from the parameter table.
static void estimate(Preflight *p) {
    ModelConfig cfg;
    ParamSpec *params = NULL;
    int n = 0;
    size_t floats = 0;
    if (ckpt_model_config(&cfg, p->param_path, &p->model_err) ||
        model_stage_table(&cfg, 0, cfg.num_hidden_layers, &params, &n, &floats, &p->model_err))
        return;
    for (int i = 0; i < n; i++) {
        const ParamSpec *t = &params[i];
        int moments = p->muon && optim_muon_owns(t) ? 1 : 2; // momentum, or AdamW's two
        p->params += (long)t->numel;
        p->weights += (int64_t)t->numel * p->weight_bytes + TENSOR_HEADER_BYTES;
        p->state += (int64_t)t->numel * 4 * moments + TENSOR_HEADER_BYTES * moments;
    }
    p->small = SMALL_FILES_BYTES + (int64_t)METRIC_ROW_BYTES * p->steps_left;
    free(params);
}

// statvfs of dir, or of its nearest existing ancestor.
static void free_space(Preflight *p) {
    snprintf(p->fs_path, sizeof p->fs_path, "%s", p->ckpt_dir);
    struct statvfs st;
    while (statvfs(p->fs_path, &st)) {
        char *slash = strrchr(p->fs_path, '/');
        if (errno != ENOENT || !slash) {
            err_errno(&p->fs_err, errno, "%s: cannot read its file system", p->fs_path);
            return;
        }
        slash[slash == p->fs_path] = 0; // "/a" -> "/"
    }
    p->free_bytes = (int64_t)st.f_bavail * (int64_t)st.f_frsize;
    p->fs_bytes = (int64_t)st.f_blocks * (int64_t)st.f_frsize;
}

static void preflight_work(uv_work_t *req) {
    Preflight *p = req->data;
    estimate(p);
    free_space(p);
}

// ---------------------------------------------------------------- the verdict (loop)

static void fmt_bytes(int64_t b, char *out, size_t cap) {
    const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024 && u < 4)
        v /= 1024, u++;
    snprintf(out, cap, u ? "%.1f %s" : "%.0f %s", v, units[u]);
}

typedef struct {
    PreflightVerdict verdict;
    Buf why; // the reasons, "; " between them
} Verdict;

static void add_reason(Verdict *v, PreflightVerdict level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void add_reason(Verdict *v, PreflightVerdict level, const char *fmt, ...) {
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    buf_printf(&v->why, "%s%s", v->why.len ? "; " : "", text);
    if (level > v->verdict) v->verdict = level;
}

static int64_t checkpoint_bytes(const Preflight *p) {
    return p->weights + p->state + p->small;
}

// The run's checkpoints at once on disk (0: unknown).
static long run_checkpoints(const Preflight *p) {
    if (p->keep_last > 0) return p->keep_last + 1;
    if (p->steps_left <= 0) return 0;
    return (p->steps_left + p->ckpt_interval - 1) / p->ckpt_interval + 1;
}

static cJSON *check_disk(const Preflight *p, Verdict *v) {
    cJSON *d = cJSON_CreateObject();
    cJSON_AddStringToObject(d, "ckpt_dir", p->ckpt_dir);
    if (p->fs_err.msg[0]) {
        cJSON_AddStringToObject(d, "error", p->fs_err.msg);
        add_reason(v, PREFLIGHT_WAIT, "ckpt_dir: %s", p->fs_err.msg);
        return d;
    }
    cJSON_AddStringToObject(d, "file_system_of", p->fs_path);
    cJSON_AddNumberToObject(d, "free_bytes", (double)p->free_bytes);
    cJSON_AddNumberToObject(d, "total_bytes", (double)p->fs_bytes);
    if (p->model_err.msg[0]) {
        cJSON_AddStringToObject(d, "error", p->model_err.msg);
        return d; // no estimate: the run itself says what is wrong with its model
    }
    int64_t need = checkpoint_bytes(p);
    long n = run_checkpoints(p);
    cJSON_AddNumberToObject(d, "parameters", (double)p->params);
    cJSON_AddNumberToObject(d, "weights_bytes", (double)p->weights);
    cJSON_AddNumberToObject(d, "optimizer_bytes", (double)p->state);
    cJSON_AddNumberToObject(d, "other_bytes", (double)p->small);
    cJSON_AddNumberToObject(d, "checkpoint_bytes", (double)need);
    if (n) cJSON_AddNumberToObject(d, "run_checkpoint_bytes", (double)need * (double)n);
    char free_s[32], need_s[32], fs_s[32], w_s[32], st_s[32];
    fmt_bytes(p->free_bytes, free_s, sizeof free_s);
    fmt_bytes(need, need_s, sizeof need_s);
    fmt_bytes(p->fs_bytes, fs_s, sizeof fs_s);
    fmt_bytes(p->weights, w_s, sizeof w_s);
    fmt_bytes(p->state, st_s, sizeof st_s);
    const char *opt = p->muon ? "muon" : "adamw";
    if (p->fs_bytes < need)
        add_reason(v, PREFLIGHT_FAIL,
                   "ckpt_dir %s: its file system (%s) holds %s in all: the next checkpoint, about "
                   "%s (%ld parameters: weights %s, %s state %s), can never fit",
                   p->ckpt_dir, p->fs_path, fs_s, need_s, p->params, w_s, opt, st_s);
    else if (p->free_bytes < need)
        add_reason(v, PREFLIGHT_WAIT,
                   "ckpt_dir %s: %s free of %s, the next checkpoint needs about %s (%ld "
                   "parameters: weights %s, %s state %s)",
                   p->ckpt_dir, free_s, fs_s, need_s, p->params, w_s, opt, st_s);
    else if (n && p->free_bytes < need * n)
        cJSON_AddStringToObject(d, "warning", "the run's checkpoints together do not fit");
    return d;
}

// A pid of a live rank of astraid's (another job's ranks never share a GPU; this job's own
// are gone, or it is not started).
static int astraid_rank(pid_t pid) {
    for (Job *j = astraid.jobs; j; j = j->next)
        for (int r = 0; r < runner_ranks(j); r++)
            if (runner_rank_pid(j, r) == pid) return 1;
    return 0;
}

static void check_processes(int gpu, cJSON *g, Verdict *v) {
    pid_t pids[PROCS_SHOWN];
    int64_t bytes[PROCS_SHOWN];
    int n = gpu_processes(gpu, pids, bytes, PROCS_SHOWN);
    cJSON *list = cJSON_AddArrayToObject(g, "other_processes");
    Buf text = {0};
    for (int k = 0; k < n && k < PROCS_SHOWN; k++) {
        if (astraid_rank(pids[k])) continue;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "pid", pids[k]);
        if (bytes[k] >= 0)
            cJSON_AddNumberToObject(o, "memory_bytes", (double)bytes[k]);
        else
            cJSON_AddNullToObject(o, "memory_bytes");
        cJSON_AddItemToArray(list, o);
        char b[32] = "unknown";
        if (bytes[k] >= 0) fmt_bytes(bytes[k], b, sizeof b);
        buf_printf(&text, "%spid %d (%s)", text.len ? ", " : "", (int)pids[k], b);
    }
    if (text.len)
        add_reason(v, PREFLIGHT_WAIT, "cuda:%d: other processes hold its memory: %s", gpu,
                   text.data);
    buf_free(&text);
}

static void add_health_number(cJSON *g, const char *key, int64_t x) {
    if (x >= 0)
        cJSON_AddNumberToObject(g, key, (double)x);
    else
        cJSON_AddNullToObject(g, key);
}

static void check_health(int gpu, cJSON *g, Verdict *v) {
    GpuHealth h = {-1, -1, -1};
    gpu_health(gpu, &h);
    add_health_number(g, "retired_pages", h.retired_pages);
    if (h.retired_pending >= 0)
        cJSON_AddBoolToObject(g, "retirement_pending", h.retired_pending);
    else
        cJSON_AddNullToObject(g, "retirement_pending");
    add_health_number(g, "ecc_uncorrected_volatile", h.ecc_uncorrected);
    if (h.ecc_uncorrected > 0)
        add_reason(v, PREFLIGHT_FAIL,
                   "cuda:%d is sick: %lld uncorrected ECC error(s) since the "
                   "driver loaded",
                   gpu, (long long)h.ecc_uncorrected);
    if (h.retired_pending > 0)
        add_reason(v, PREFLIGHT_FAIL,
                   "cuda:%d is sick: a page retirement is pending (%lld retired): reset the GPU",
                   gpu, (long long)h.retired_pages);
    else if (h.retired_pages >= RETIRED_PAGES_MAX)
        add_reason(v, PREFLIGHT_FAIL, "cuda:%d is sick: %lld retired pages (limit %d)", gpu,
                   (long long)h.retired_pages, RETIRED_PAGES_MAX);
}

static cJSON *check_gpus(const Preflight *p, Verdict *v) {
    cJSON *list = cJSON_CreateArray();
    for (int i = 0; i < p->n_gpus; i++) {
        cJSON *g = cJSON_CreateObject();
        cJSON_AddNumberToObject(g, "index", p->gpus[i]);
        check_processes(p->gpus[i], g, v);
        check_health(p->gpus[i], g, v);
        cJSON_AddItemToArray(list, g);
    }
    return list;
}

static const char *const VERDICTS[] = {"ok", "wait", "fail"};

static void preflight_free(Preflight *p) {
    free(p->param_path);
    free(p->ckpt_dir);
    free(p);
}

static void preflight_after(uv_work_t *req, int status) {
    (void)status; // never cancelled
    Preflight *p = req->data;
    Verdict v = {PREFLIGHT_OK, {0}};
    cJSON *report = cJSON_CreateObject();
    cJSON *disk = check_disk(p, &v), *gpus = check_gpus(p, &v);
    cJSON_AddStringToObject(report, "verdict", VERDICTS[v.verdict]);
    if (v.why.len)
        cJSON_AddStringToObject(report, "reason", v.why.data);
    else
        cJSON_AddNullToObject(report, "reason");
    cJSON_AddItemToObject(report, "disk", disk);
    cJSON_AddItemToObject(report, "gpus", gpus);
    Err why = {0};
    if (v.why.len) err_set(&why, "preflight: %s", v.why.data);
    why.resource = v.verdict == PREFLIGHT_WAIT; // a start that waits is tried again later
    p->done(p->arg, v.verdict, report, &why);
    cJSON_Delete(report);
    buf_free(&v.why);
    preflight_free(p);
}

int preflight_run(const JobSpec *js, const char *ckpt_dir, long steps_left, const int *gpus,
                  int n_gpus, PreflightDone done, void *arg, Err *err) {
    Preflight *p = calloc(1, sizeof *p);
    if (p) {
        p->param_path = strdup(js->train.param_path);
        p->ckpt_dir = strdup(ckpt_dir);
        p->weight_bytes = js->train.is.ckpt_dtype == CKPT_BF16 ? 2 : 4;
        p->muon = js->train.is.optimizer == OPTIMIZER_MUON;
        p->keep_last = js->train.checkpoint_keep_last;
        p->ckpt_interval = js->train.ckpt_interval;
    }
    if (!p || !p->param_path || !p->ckpt_dir) {
        if (p) preflight_free(p);
        return err_resource(err, "preflight: out of memory");
    }
    p->steps_left = steps_left > 0 ? steps_left : 0;
    for (int i = 0; i < n_gpus && i < (int)(sizeof p->gpus / sizeof *p->gpus); i++)
        p->gpus[p->n_gpus++] = gpus[i];
    p->done = done;
    p->arg = arg;
    p->req.data = p;
    if (uv_queue_work(astraid.loop, &p->req, preflight_work, preflight_after)) {
        preflight_free(p);
        return err_resource(err, "preflight: cannot queue its work");
    }
    return 0;
}
