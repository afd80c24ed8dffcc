// metrics.c: what GET /metrics says (docs/monitoring.md): the Prometheus text exposition
// format 0.0.4 of a Snapshot, and the control requests' counters it carries.
//
// The counters live on the loop thread (dispatch.c counts each request there) and reach
// the HTTP threads only as the copy in a snapshot, so neither side takes a lock for them.
// Their label set is bounded: a method name is a label value only when dispatch.c knows
// the method, and past METRICS_SERIES_MAX (method, code) pairs the rest share one series.
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/buf.h"
#include "daemon/daemon.h"

// Upper bounds (seconds) of the latency buckets; +Inf follows.
static const double BUCKET_LE[METRICS_BUCKETS] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                  0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                                  1,      2.5,     5,      10};

static RequestStats requests; // loop thread

void metrics_request(const char *method, int known, int code, double seconds) {
    const char *label =
        known && strlen(method) < sizeof requests.series[0].method ? method : "other";
    int i = 0;
    while (i < requests.n_series &&
           (requests.series[i].code != code || strcmp(requests.series[i].method, label)))
        i++;
    if (i == requests.n_series && i == METRICS_SERIES_MAX) {
        i = METRICS_SERIES_MAX - 1; // full: the last series takes the rest
        snprintf(requests.series[i].method, sizeof requests.series[i].method, "other");
        requests.series[i].code = -1;
    } else if (i == requests.n_series) {
        snprintf(requests.series[i].method, sizeof requests.series[i].method, "%s", label);
        requests.series[i].code = code;
        requests.n_series++;
    }
    requests.series[i].n++;
    int b = 0;
    while (b < METRICS_BUCKETS && seconds > BUCKET_LE[b])
        b++;
    requests.buckets[b]++;
    requests.sum_s += seconds;
    http_changed(); // counted before its answer goes out: the next /metrics shows it
}

void metrics_requests(RequestStats *out) {
    *out = requests;
}

// ---------------------------------------------------------------- the text

typedef struct {
    Buf b;
    int failed; // out of memory
} Text;

static void put(Text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(Text *t, const char *fmt, ...) {
    char line[256], *p = line;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof line && (p = malloc((size_t)n + 1))) { // a long job name
        va_start(ap, fmt);
        vsnprintf(p, (size_t)n + 1, fmt, ap);
        va_end(ap);
    }
    if (n < 0 || !p || buf_append(&t->b, p, (size_t)n)) t->failed = 1;
    if (p != line) free(p);
}

// A sample value: Go's float syntax, NaN and +Inf/-Inf as the format spells them.
static void put_value(Text *t, double v) {
    if (isnan(v))
        put(t, " NaN\n");
    else if (isinf(v))
        put(t, v > 0 ? " +Inf\n" : " -Inf\n");
    else
        put(t, " %.17g\n", v);
}

// A label value, escaped: backslash, double quote and newline.
static void put_label(Text *t, const char *name, const char *value) {
    put(t, "%s=\"", name);
    for (const char *p = value; *p; p++) {
        size_t plain = strcspn(p, "\\\"\n");
        if (plain && buf_append(&t->b, p, plain)) t->failed = 1;
        p += plain;
        if (!*p) break;
        put(t, "\\%c", *p == '\n' ? 'n' : *p);
    }
    put(t, "\"");
}

static void family(Text *t, const char *name, const char *type, const char *help) {
    put(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void job_labels(Text *t, const char *name, const JobGauge *j) {
    put(t, "%s{job_id=\"%ld\",", name, j->id);
    put_label(t, "job_name", j->name);
}

// A family of one series per job: the double at `offset` in a JobGauge, where known.
typedef enum {
    KNOWN_ALWAYS,
    KNOWN_PROGRESS,
    KNOWN_VAL,
    KNOWN_ETA,
    KNOWN_EXPERTS,
    KNOWN_ROLLOUT
} Known;
typedef struct {
    const char *name, *type, *help;
    size_t offset;
    Known known;
} JobFamily;

static const JobFamily JOB_FAMILIES[] = {
    {"astrai_job_step", "gauge", "The job's last step done.", offsetof(JobGauge, step),
     KNOWN_ALWAYS},
    {"astrai_job_total_steps", "gauge", "Steps the job's run does in all.",
     offsetof(JobGauge, total_steps), KNOWN_ALWAYS},
    {"astrai_job_loss", "gauge", "Training loss of the job's last step.", offsetof(JobGauge, loss),
     KNOWN_PROGRESS},
    {"astrai_job_val_loss", "gauge", "Validation loss of the job's last validation.",
     offsetof(JobGauge, val_loss), KNOWN_VAL},
    {"astrai_job_learning_rate", "gauge", "Learning rate of the job's last step.",
     offsetof(JobGauge, lr), KNOWN_PROGRESS},
    {"astrai_job_grad_norm", "gauge", "Gradient norm of the job's last step.",
     offsetof(JobGauge, grad_norm), KNOWN_PROGRESS},
    {"astrai_job_tokens_per_second", "gauge", "Training tokens per second of the job.",
     offsetof(JobGauge, tokens_per_s), KNOWN_PROGRESS},
    {"astrai_job_eta_seconds", "gauge", "Seconds the job's run still needs (estimate).",
     offsetof(JobGauge, eta_s), KNOWN_ETA},
    {"astrai_job_expert_load_max", "gauge",
     "Load of the most loaded routed expert of any layer over its layer's mean, last step (MoE).",
     offsetof(JobGauge, expert_load_max), KNOWN_EXPERTS},
    {"astrai_job_expert_load_min", "gauge",
     "Load of the least loaded routed expert of any layer over its layer's mean, last step (MoE).",
     offsetof(JobGauge, expert_load_min), KNOWN_EXPERTS},
    {"astrai_job_reward_mean", "gauge",
     "Mean reward of the last step's rollouts (online_grpo, online_dpo).",
     offsetof(JobGauge, rollout.reward_mean), KNOWN_ROLLOUT},
    {"astrai_job_reward_std", "gauge",
     "Standard deviation of the last step's rewards (online_grpo, online_dpo).",
     offsetof(JobGauge, rollout.reward_std), KNOWN_ROLLOUT},
    {"astrai_job_response_tokens", "gauge",
     "Mean tokens of the last step's rollout responses (online_grpo, online_dpo).",
     offsetof(JobGauge, rollout.response_len), KNOWN_ROLLOUT},
    {"astrai_job_equal_reward_groups", "gauge",
     "Share of the last step's prompts whose responses got equal rewards (online).",
     offsetof(JobGauge, rollout.equal_reward_groups), KNOWN_ROLLOUT},
    {"astrai_job_restarts_total", "counter",
     "Restarts of the job after a failed run, since astraid started.", offsetof(JobGauge, restarts),
     KNOWN_ALWAYS},
};

static int known(const JobGauge *j, Known k) {
    return k == KNOWN_ALWAYS || (k == KNOWN_PROGRESS && j->has_progress) ||
           (k == KNOWN_VAL && j->has_val_loss) ||
           (k == KNOWN_ETA && j->has_progress && j->eta_s >= 0) ||
           (k == KNOWN_EXPERTS && j->has_expert_load) || (k == KNOWN_ROLLOUT && j->rollout.has);
}

// When its last checkpoint was written: the mtime of its directory (a stat: HTTP threads
// only); 0 without one (or when it is gone from the disk).
static double checkpoint_time(const JobGauge *j) {
    struct stat st;
    if (!j->last_checkpoint || stat(j->last_checkpoint, &st)) return 0;
    return (double)st.st_mtim.tv_sec + st.st_mtim.tv_nsec * 1e-9;
}

static void put_jobs(Text *t, const Snapshot *s) {
    family(t, "astrai_job_state", "gauge", "1 for the job's state, 0 for the others.");
    for (int i = 0; i < s->n_jobs; i++)
        for (int st = 0; st < JOB_NSTATES; st++) {
            job_labels(t, "astrai_job_state", &s->jobs[i]);
            put(t, ",state=\"%s\"}", job_state_name((JobState)st));
            put_value(t, s->jobs[i].state == (JobState)st);
        }
    for (size_t f = 0; f < sizeof JOB_FAMILIES / sizeof *JOB_FAMILIES; f++) {
        const JobFamily *jf = &JOB_FAMILIES[f];
        family(t, jf->name, jf->type, jf->help);
        for (int i = 0; i < s->n_jobs; i++) {
            if (!known(&s->jobs[i], jf->known)) continue;
            job_labels(t, jf->name, &s->jobs[i]);
            put(t, "}");
            put_value(t, *(const double *)((const char *)&s->jobs[i] + jf->offset));
        }
    }
    const char *ckpt = "astrai_job_last_checkpoint_timestamp_seconds";
    family(t, ckpt, "gauge", "When the job's last checkpoint was written (unix seconds).");
    for (int i = 0; i < s->n_jobs; i++) {
        double when = checkpoint_time(&s->jobs[i]);
        if (when == 0) continue;
        job_labels(t, ckpt, &s->jobs[i]);
        put(t, "}");
        put_value(t, when);
    }
}

static void put_devices(Text *t, const Snapshot *s) {
    family(t, "astrai_device_busy", "gauge", "1 while a job's run holds the device, else 0.");
    for (int i = 0; i < s->n_devices; i++) {
        put(t, "astrai_device_busy{device=\"%s\"}", s->devices[i].name);
        put_value(t, s->devices[i].job != 0);
    }
    family(t, "astrai_device_job_id", "gauge", "Id of the job holding the device, 0 when free.");
    for (int i = 0; i < s->n_devices; i++) {
        put(t, "astrai_device_job_id{device=\"%s\"}", s->devices[i].name);
        put_value(t, (double)s->devices[i].job);
    }
    family(t, "astrai_gpu_memory_used_bytes", "gauge", "GPU memory in use (NVML).");
    for (int i = 0; i < s->n_devices; i++) {
        if (s->devices[i].mem_used < 0) continue;
        put(t, "astrai_gpu_memory_used_bytes{device=\"%s\"}", s->devices[i].name);
        put_value(t, (double)s->devices[i].mem_used);
    }
    family(t, "astrai_gpu_utilization_ratio", "gauge",
           "Share of the last sample period the GPU was busy (NVML), 0 to 1.");
    for (int i = 0; i < s->n_devices; i++) {
        if (s->devices[i].util_pct < 0) continue;
        put(t, "astrai_gpu_utilization_ratio{device=\"%s\"}", s->devices[i].name);
        put_value(t, s->devices[i].util_pct / 100.0);
    }
}

static void put_requests(Text *t, const RequestStats *r) {
    family(t, "astrai_requests_total", "counter",
           "Control requests answered, by method and error code (0: success).");
    for (int i = 0; i < r->n_series; i++)
        put(t, "astrai_requests_total{method=\"%s\",code=\"%d\"} %" PRIu64 "\n",
            r->series[i].method, r->series[i].code, r->series[i].n);
    family(t, "astrai_request_duration_seconds", "histogram",
           "Seconds the loop spent on a control request.");
    uint64_t cum = 0;
    for (int b = 0; b <= METRICS_BUCKETS; b++) {
        cum += r->buckets[b];
        if (b < METRICS_BUCKETS)
            put(t, "astrai_request_duration_seconds_bucket{le=\"%g\"} %" PRIu64 "\n", BUCKET_LE[b],
                cum);
        else
            put(t, "astrai_request_duration_seconds_bucket{le=\"+Inf\"} %" PRIu64 "\n", cum);
    }
    put(t, "astrai_request_duration_seconds_sum");
    put_value(t, r->sum_s);
    put(t, "astrai_request_duration_seconds_count %" PRIu64 "\n", cum);
}

char *metrics_render(const Snapshot *s, size_t *len) {
    Text t = {0};
    // About 80 bytes a series, 13 series a job: room for the usual text at once.
    if (buf_reserve(&t.b.data, &t.b.cap, 4096 + (size_t)s->n_jobs * 1536, 1)) return NULL;
    family(&t, "astrai_build_info", "gauge", "astraid's version (the value is 1).");
    put(&t, "astrai_build_info{version=\"%s\"} 1\n", ASTRAID_VERSION);
    family(&t, "astrai_uptime_seconds", "gauge", "Seconds since astraid started.");
    put(&t, "astrai_uptime_seconds");
    put_value(&t, clock_mono_s() - astraid.started_at);
    family(&t, "astrai_jobs", "gauge", "Jobs astraid knows, by state.");
    for (int st = 0; st < JOB_NSTATES; st++)
        put(&t, "astrai_jobs{state=\"%s\"} %ld\n", job_state_name((JobState)st), s->by_state[st]);
    family(&t, "astrai_clients_connected", "gauge", "Open control connections (unix and tcp).");
    put(&t, "astrai_clients_connected %d\n", s->connections);
    put_requests(&t, &s->requests);
    put_devices(&t, s);
    put_jobs(&t, s);
    if (t.failed) {
        buf_free(&t.b);
        return NULL;
    }
    *len = t.b.len;
    return buf_take(&t.b);
}
