// render.c: astraictl's human output: job tables that fit 80 columns, a job's
// details (with a line per rank: its GPU, memory, utilisation), daemon info (with a
// line per GPU), and progress lines/bars for watch and --follow.
#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

#include "client/client.h"

bool job_state_is_final(const char *state) {
    return state &&
           (!strcmp(state, "completed") || !strcmp(state, "failed") || !strcmp(state, "cancelled"));
}

static const char *str_field(const cJSON *job, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(job, key);
    return cJSON_IsString(v) ? v->valuestring : "-";
}

// A number field, NAN when missing or null.
static double num_field(const cJSON *job, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(job, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

// "42", "51.2k", "3.1M"; "-" for NAN.
static void fmt_count(double v, char *buf, size_t cap) {
    if (isnan(v))
        snprintf(buf, cap, "-");
    else if (fabs(v) >= 1e6)
        snprintf(buf, cap, "%.1fM", v / 1e6);
    else if (fabs(v) >= 1e4)
        snprintf(buf, cap, "%.1fk", v / 1e3);
    else
        snprintf(buf, cap, "%.0f", v);
}

// "45s", "5m12s", "2h03m", "3d04h"; "-" for NAN or negative.
static void fmt_duration(double s, char *buf, size_t cap) {
    if (isnan(s) || s < 0) {
        snprintf(buf, cap, "-");
        return;
    }
    long t = (long)(s + 0.5);
    if (t < 60)
        snprintf(buf, cap, "%lds", t);
    else if (t < 3600)
        snprintf(buf, cap, "%ldm%02lds", t / 60, t % 60);
    else if (t < 86400)
        snprintf(buf, cap, "%ldh%02ldm", t / 3600, t % 3600 / 60);
    else
        snprintf(buf, cap, "%ldd%02ldh", t / 86400, t % 86400 / 3600);
}

static void fmt_loss(double v, char *buf, size_t cap) {
    if (isnan(v))
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%.4f", v);
}

// "step/total", or "step" while the total is unknown (0 or missing).
static void fmt_steps(const cJSON *job, char *buf, size_t cap) {
    double step = num_field(job, "step"), total = num_field(job, "total_steps");
    if (isnan(step)) step = 0;
    if (isnan(total) || total <= 0)
        snprintf(buf, cap, "%.0f", step);
    else
        snprintf(buf, cap, "%.0f/%.0f", step, total);
}

// Every job column as text, shared by the table and the progress lines.
typedef struct {
    char id[24], name[136], steps[48], loss[24], rate[24], eta[24];
    // " val_loss 3.1234", " loss_scale 65536 (2 skipped)", " expert_load max 1.42x min 0.61x of
    // mean" (a mixture of experts), " reward 3.25 (std 1.1), 42.0 tokens, 25% groups equal"
    // (online) where the job has them
    char val[200];
    const char *state;
} JobText;

// Appends the numbers after the loss the job has (t->val, empty for none).
static void fmt_extras(const cJSON *job, JobText *t) {
    size_t cap = sizeof t->val, n = 0;
    double v = num_field(job, "val_loss"), s = num_field(job, "loss_scale");
    double hi = num_field(job, "expert_load_max"), lo = num_field(job, "expert_load_min");
    t->val[0] = '\0';
    if (!isnan(v)) n += (size_t)snprintf(t->val + n, cap - n, " val_loss %.4f", v);
    if (!isnan(s) && n < cap)
        n += (size_t)snprintf(t->val + n, cap - n, " loss_scale %g (%.0f skipped)", s,
                              num_field(job, "skipped_steps"));
    // Over the layer's mean: 1.00x both is a perfectly balanced router.
    if (!isnan(hi) && !isnan(lo) && n < cap)
        n += (size_t)snprintf(t->val + n, cap - n, " expert_load max %.2fx min %.2fx of mean", hi,
                              lo);
    double r = num_field(job, "reward_mean"), len = num_field(job, "response_len");
    if (!isnan(r) && !isnan(len) && n < cap)
        snprintf(t->val + n, cap - n, " reward %.3g (std %.3g), %.1f tokens, %.0f%% groups equal",
                 r, num_field(job, "reward_std"), len, 100 * num_field(job, "equal_reward_groups"));
}

static void job_text(const cJSON *job, JobText *t) {
    snprintf(t->id, sizeof t->id, "%.0f", num_field(job, "id"));
    snprintf(t->name, sizeof t->name, "%s", str_field(job, "name"));
    t->state = str_field(job, "state");
    fmt_steps(job, t->steps, sizeof t->steps);
    fmt_loss(num_field(job, "loss"), t->loss, sizeof t->loss);
    fmt_count(num_field(job, "tokens_per_s"), t->rate, sizeof t->rate);
    fmt_duration(num_field(job, "eta_s"), t->eta, sizeof t->eta);
    fmt_extras(job, t);
}

// Columns: 5+1+16+1+11+1+13+1+8+1+9+1+8 = 76 characters.
#define ROW_FORMAT "%-5.5s %-16.16s %-11.11s %13.13s %8.8s %9.9s %8.8s\n"

void render_job_table(FILE *out, const cJSON *jobs) {
    fprintf(out, ROW_FORMAT, "ID", "NAME", "STATE", "STEP", "LOSS", "TOK/S", "ETA");
    const cJSON *job;
    cJSON_ArrayForEach(job, jobs) {
        JobText t;
        job_text(job, &t);
        fprintf(out, ROW_FORMAT, t.id, t.name, t.state, t.steps, t.loss, t.rate, t.eta);
    }
}

// "3.2 GiB", "512.0 MiB", "640 KiB"; "-" for NAN (unknown).
static void fmt_bytes(double v, char *buf, size_t cap) {
    if (isnan(v))
        snprintf(buf, cap, "-");
    else if (v >= (double)(1 << 30))
        snprintf(buf, cap, "%.1f GiB", v / (double)(1 << 30));
    else if (v >= (double)(1 << 20))
        snprintf(buf, cap, "%.1f MiB", v / (double)(1 << 20));
    else
        snprintf(buf, cap, "%.0f KiB", v / (double)(1 << 10));
}

static void fmt_pct(double v, char *buf, size_t cap) {
    if (isnan(v))
        snprintf(buf, cap, "-");
    else
        snprintf(buf, cap, "%.0f%%", v);
}

// "key: value" for each member but `skip`, scalars as text and the rest as compact JSON.
static void render_members(FILE *out, const cJSON *obj, int width, const char *skip) {
    const cJSON *v;
    cJSON_ArrayForEach(v, obj) {
        if (skip && !strcmp(v->string, skip)) continue;
        if (cJSON_IsString(v))
            fprintf(out, "%-*s %s\n", width, v->string, v->valuestring);
        else if (cJSON_IsNumber(v))
            fprintf(out, "%-*s %.10g\n", width, v->string, v->valuedouble);
        else {
            char *text = cJSON_PrintUnformatted(v);
            fprintf(out, "%-*s %s\n", width, v->string, text ? text : "?");
            cJSON_free(text);
        }
    }
}

// One line per rank of a running job: "rank 0  cuda:1  3.2 GiB  87%  pid 4242" (the
// rank's memory on its GPU and the GPU's utilisation), "rank 0  cpu  pid 4242".
static void render_ranks(FILE *out, const cJSON *ranks) {
    const cJSON *r;
    cJSON_ArrayForEach(r, ranks) {
        char pid[32], mem[32], pct[16];
        double p = num_field(r, "pid"), gpu = num_field(r, "gpu");
        if (isnan(p))
            snprintf(pid, sizeof pid, "-");
        else
            snprintf(pid, sizeof pid, "%.0f", p);
        if (isnan(gpu)) {
            fprintf(out, "rank %.0f  cpu  pid %s\n", num_field(r, "rank"), pid);
            continue;
        }
        fmt_bytes(num_field(r, "memory_used_bytes"), mem, sizeof mem);
        fmt_pct(num_field(r, "utilization_pct"), pct, sizeof pct);
        fprintf(out, "rank %.0f  cuda:%.0f  %s  %s  pid %s\n", num_field(r, "rank"), gpu, mem, pct,
                pid);
    }
}

// "time left 5m12s (max_duration_hours 2)": a job with a time limit (JOB time_left_s).
static void render_time_left(FILE *out, const cJSON *job) {
    double left = num_field(job, "time_left_s");
    if (isnan(left)) return;
    char text[24];
    fmt_duration(left, text, sizeof text);
    const cJSON *spec = cJSON_GetObjectItemCaseSensitive(job, "spec");
    fprintf(out, "time left %s (max_duration_hours %g)\n", text,
            num_field(spec, "max_duration_hours"));
}

void render_job_detail(FILE *out, const cJSON *job) {
    JobText t;
    job_text(job, &t);
    char val[sizeof t.val + 1] = "";
    if (*t.val) snprintf(val, sizeof val, ",%s", t.val);
    fprintf(out, "job %s (%s): %s, step %s, loss %s%s, %s tok/s, ETA %s\n", t.id, t.name, t.state,
            t.steps, t.loss, val, t.rate, t.eta);
    render_time_left(out, job);
    render_ranks(out, cJSON_GetObjectItemCaseSensitive(job, "ranks"));
    render_members(out, job, 16, "ranks");
}

// "preflight: wait: <reason>", then "disk" and a line per GPU with the numbers of the report.
void render_preflight(FILE *out, const cJSON *report) {
    const cJSON *reason = cJSON_GetObjectItemCaseSensitive(report, "reason");
    fprintf(out, "preflight: %s%s%s\n", str_field(report, "verdict"),
            cJSON_IsString(reason) ? ": " : "", cJSON_IsString(reason) ? reason->valuestring : "");
    const cJSON *disk = cJSON_GetObjectItemCaseSensitive(report, "disk");
    char need[32], avail[32], total[32], params[32], retired[32], ecc[32];
    fmt_bytes(num_field(disk, "checkpoint_bytes"), need, sizeof need);
    fmt_bytes(num_field(disk, "free_bytes"), avail, sizeof avail);
    fmt_bytes(num_field(disk, "total_bytes"), total, sizeof total);
    fmt_count(num_field(disk, "parameters"), params, sizeof params);
    fprintf(out, "disk %s: a checkpoint needs %s (%s parameters), %s free of %s\n",
            str_field(disk, "ckpt_dir"), need, params, avail, total);
    const cJSON *g;
    cJSON_ArrayForEach(g, cJSON_GetObjectItemCaseSensitive(report, "gpus")) {
        fmt_count(num_field(g, "retired_pages"), retired, sizeof retired);
        fmt_count(num_field(g, "ecc_uncorrected_volatile"), ecc, sizeof ecc);
        fprintf(out, "gpu %.0f  other processes %d  retired pages %s  ECC uncorrected %s\n",
                num_field(g, "index"),
                cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(g, "other_processes")), retired,
                ecc);
    }
}

// "gpu 0  NVIDIA H200  12.3/139.8 GiB  87%" per GPU after the other members.
void render_daemon_info(FILE *out, const cJSON *info) {
    render_members(out, info, 10, "gpus");
    const cJSON *g;
    cJSON_ArrayForEach(g, cJSON_GetObjectItemCaseSensitive(info, "gpus")) {
        char used[32], total[32], pct[16];
        fmt_bytes(num_field(g, "memory_used_bytes"), used, sizeof used);
        fmt_bytes(num_field(g, "memory_total_bytes"), total, sizeof total);
        fmt_pct(num_field(g, "utilization_pct"), pct, sizeof pct);
        char *unit = strstr(used, " GiB"); // "12.3/139.8 GiB" when both are GiB
        if (unit && strstr(total, " GiB")) *unit = 0;
        fprintf(out, "gpu %.0f  %s  %s/%s  %s\n", num_field(g, "index"), str_field(g, "name"), used,
                total, pct);
    }
}

// [#####.....] filling `cells` columns with the step fraction.
static void fmt_bar(const cJSON *job, int cells, char *buf, size_t cap) {
    double step = num_field(job, "step"), total = num_field(job, "total_steps");
    double frac = isnan(step) || isnan(total) || total <= 0 ? 0 : fmin(1, fmax(0, step / total));
    if (cells < 1 || (size_t)cells + 3 > cap) cells = 0;
    int filled = (int)(frac * cells);
    buf[0] = '[';
    for (int i = 0; i < cells; i++)
        buf[1 + i] = i < filled ? '#' : '.';
    buf[1 + cells] = ']';
    buf[2 + cells] = '\0';
}

void render_progress_line(const cJSON *job, bool bar, int width, char *buf, size_t cap) {
    JobText t;
    job_text(job, &t);
    if (!bar) {
        snprintf(buf, cap, "job %s %s %s step %s loss %s%s tok/s %s ETA %s", t.id, t.name, t.state,
                 t.steps, t.loss, t.val, t.rate, t.eta);
        return;
    }
    char tail[224], bars[512];
    int n = snprintf(tail, sizeof tail, " %s loss %s%s %s tok/s ETA %s", t.steps, t.loss, t.val,
                     t.rate, t.eta);
    // "ID NAME STATE " takes 5+11+10 columns, the brackets 2; the bar gets what is left.
    int cells = width - 26 - n - 2;
    fmt_bar(job, cells < 5 ? 5 : cells > 400 ? 400 : cells, bars, sizeof bars);
    snprintf(buf, cap, "%-4.4s %-10.10s %-9.9s %s%s", t.id, t.name, t.state, bars, tail);
    if (width > 0 && (size_t)width < cap) buf[width] = '\0'; // never wrap the line
}
