#include "worker/lib/trainer.h"

#include <cblas.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "worker/lib/train_ckpt.h"

volatile sig_atomic_t trainer_stop_requested = 0;
volatile sig_atomic_t trainer_checkpoint_requested = 0;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

long trainer_total_steps(int64_t n_samples, long nprocs, long batch, long accum, long n_epoch) {
    int64_t per_replica = (n_samples + nprocs - 1) / nprocs;
    int64_t batches = (per_replica + batch - 1) / batch;
    return (long)(batches / accum) * n_epoch;
}

static void set_threads(const TrainSpec *spec) {
    long n = spec->threads;
    if (n <= 0) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        n = cores > 0 ? cores / spec->nprocs : 1;
        if (n < 1) n = 1;
    }
    omp_set_num_threads((int)n);
    openblas_set_num_threads((int)n);
}

static int open_data(Trainer *t, Err *err) {
    const TrainSpec *s = t->spec;
    const ModelConfig *cfg = &t->model.cfg;
    if (dataset_open(&t->data, s->data_root_path, t->sft, err)) return -1;
    if (dataset_check_vocab(&t->data, cfg->vocab_size, err))
        return err_prefix(err, "data_root_path %s", s->data_root_path);
    t->window = s->window_size ? s->window_size : cfg->max_position_embeddings;
    if (t->window > cfg->max_position_embeddings)
        return err_set(err, "window_size: %ld is larger than max_position_embeddings %d",
                       (long)t->window, cfg->max_position_embeddings);
    t->stride = s->stride ? s->stride : t->window;
    t->n_samples = dataset_num_windows(t->data.n_tokens, t->window, t->stride);
    if (t->n_samples == 0)
        return err_set(err, "data_root_path %s: %lld tokens give no sample of window_size %lld",
                       s->data_root_path, (long long)t->data.n_tokens, (long long)t->window);
    return sampler_init(&t->sampler, t->n_samples, (int)s->nprocs, 0, (uint64_t)s->random_seed,
                        s->shuffle, err);
}

static ScheduleKind schedule_kind(const char *name) {
    if (!strcmp(name, "wsd")) return SCHED_WSD;
    if (!strcmp(name, "sgdr")) return SCHED_SGDR;
    return SCHED_COSINE;
}

static int alloc_batch(Trainer *t, Err *err) {
    size_t n = (size_t)t->spec->batch_per_device * (size_t)t->window;
    t->inputs = malloc(n * sizeof(int32_t));
    t->targets = malloc(n * sizeof(int32_t));
    t->loss_mask = malloc(n * sizeof(int32_t));
    t->position_ids = malloc(n * sizeof(int32_t));
    if (!t->inputs || !t->targets || !t->loss_mask || !t->position_ids)
        return err_set(err, "batch buffers: out of memory");
    return 0;
}

int trainer_init(Trainer *t, const TrainSpec *spec, Err *err) {
    memset(t, 0, sizeof *t);
    t->spec = spec;
    t->sft = !strcmp(spec->train_type, "sft");
    set_threads(spec);
    char resume_dir[4096] = "";
    if (spec->resume && train_ckpt_locate(spec, resume_dir, sizeof resume_dir, err)) return -1;
    const char *model_dir = *resume_dir ? resume_dir : spec->param_path;
    if (train_ckpt_load_model(&t->model, model_dir, err) || open_data(t, err)) return -1;
    t->total_steps = trainer_total_steps(t->n_samples, spec->nprocs, spec->batch_per_device,
                                         spec->grad_accum_steps, spec->n_epoch);
    schedule_init(&t->sched, schedule_kind(spec->schedule_type), t->total_steps,
                  spec->warmup_ratio, spec->min_rate, spec->stable_steps, spec->decay_steps,
                  spec->cycle_length, spec->t_mult);
    OptimizerKind kind = !strcmp(spec->optimizer, "adamw") ? OPT_ADAMW : OPT_MUON;
    if (optim_create(&t->opt, kind, &t->model, (float)spec->weight_decay, err)) return -1;
    if (*resume_dir && train_ckpt_load_state(t, resume_dir, err)) return -1;
    t->last_ckpt_step = t->step;
    if (progress_open(&t->progress, spec->ckpt_dir, t->total_steps, t->step, err)) return -1;
    return alloc_batch(t, err);
}

// Fills the batch buffers with nb samples of this rank's epoch order.
static void fill_batch(Trainer *t, int nb) {
    int64_t w = t->window;
    for (int b = 0; b < nb; b++) {
        int64_t idx = t->sampler.order[t->epoch_pos + b];
        dataset_window(&t->data, idx, w, t->stride, t->inputs + b * w, t->targets + b * w,
                       t->sft ? t->loss_mask + b * w : NULL,
                       t->sft ? t->position_ids + b * w : NULL);
    }
}

static int save_checkpoint(Trainer *t, Err *err) {
    char path[4096];
    if (train_ckpt_save(t, path, sizeof path, err)) return -1;
    t->last_ckpt_step = t->step;
    fprintf(stderr, "checkpoint %s\n", path);
    return progress_add_checkpoint(&t->progress, t->step, t->epoch, path, err);
}

typedef struct {
    double loss_sum;   // sum of the current step's micro-step losses
    double step_start; // wall time the current optimizer step began
    double run_start;  // wall time this process began training
    long steps_run;    // optimizer steps done by this process
    long tokens;       // tokens of the current optimizer step
} StepClock;

static int optimizer_step(Trainer *t, StepClock *c, Err *err) {
    const TrainSpec *s = t->spec;
    float gnorm = clip_grad_norm(&t->model, (float)s->max_grad_norm);
    double lr = s->max_lr * schedule_factor(&t->sched, t->step);
    optim_step(&t->opt, &t->model, (float)lr);
    model_zero_grad(&t->model);
    t->step++;
    double now = now_s();
    StepRow row = {.step = t->step,
                   .epoch = t->epoch,
                   .consumed_samples = t->consumed_samples,
                   .loss = (float)(c->loss_sum / (double)s->grad_accum_steps),
                   .lr = lr,
                   .grad_norm = gnorm,
                   .tokens_per_s = (double)c->tokens / fmax(now - c->step_start, 1e-9),
                   .wall_time = now};
    c->steps_run++;
    if (metrics_append(&t->metrics, &row, err) || progress_add_step(&t->progress, &row, err))
        return -1;
    if (t->step % s->log_interval == 0 || t->step == 1 || t->step == t->total_steps) {
        char line[256];
        double eta = (now - c->run_start) / (double)c->steps_run * (double)(t->total_steps - t->step);
        progress_format_line(line, sizeof line, &row, t->total_steps, eta);
        fprintf(stderr, "%s\n", line);
    }
    c->loss_sum = 0;
    c->tokens = 0;
    c->step_start = now;
    return 0;
}

// One micro-step: forward, backward (scaled by 1/grad_accum_steps), bookkeeping.
static int micro_step(Trainer *t, StepClock *c, int nb, Err *err) {
    const TrainSpec *s = t->spec;
    fill_batch(t, nb);
    Err ferr = {{0}};
    float loss = model_forward(&t->model, t->inputs, t->targets, t->sft ? t->loss_mask : NULL,
                               t->sft ? t->position_ids : NULL, nb, (int)t->window,
                               (float)s->label_smoothing, &ferr);
    if (*ferr.msg) return err_set(err, "%s", ferr.msg);
    if (!isfinite(loss))
        return err_set(err, "loss is %f at step %ld (diverged: lower max_lr?)", (double)loss,
                       t->step + 1);
    model_backward(&t->model, 1.0f / (float)s->grad_accum_steps);
    c->loss_sum += loss;
    c->tokens += (long)nb * (long)t->window;
    t->epoch_pos += nb;
    t->consumed_samples += (long)nb * s->nprocs;
    t->micro++;
    return 0;
}

// After an optimizer step: checkpoint when due or requested. Returns 1 to stop.
static int after_step(Trainer *t, Err *err) {
    int stop = trainer_stop_requested != 0 ||
               (t->spec->max_steps > 0 && t->step >= t->spec->max_steps);
    int due = t->step - t->last_ckpt_step >= t->spec->ckpt_interval;
    if (due || stop || trainer_checkpoint_requested) {
        trainer_checkpoint_requested = 0;
        if (save_checkpoint(t, err)) return -1;
    }
    if (stop) fprintf(stderr, "stopped at step %ld of %ld\n", t->step, t->total_steps);
    return stop;
}

int trainer_run(Trainer *t, Err *err) {
    const TrainSpec *s = t->spec;
    StepClock clock = {.step_start = now_s(), .run_start = now_s()};
    for (; t->epoch < s->n_epoch; t->epoch++, t->epoch_pos = 0) {
        sampler_set_epoch(&t->sampler, t->epoch);
        while (t->epoch_pos < t->sampler.per_replica) {
            int64_t left = t->sampler.per_replica - t->epoch_pos;
            int nb = (int)(left < s->batch_per_device ? left : s->batch_per_device);
            if (micro_step(t, &clock, nb, err)) return -1;
            if (t->micro < s->grad_accum_steps) continue;
            t->micro = 0;
            if (optimizer_step(t, &clock, err)) return -1;
            int rc = after_step(t, err);
            if (rc) return rc < 0 ? -1 : 0;
        }
    }
    // The epoch loop ended: the last epoch is complete.
    t->epoch = s->n_epoch - 1;
    t->epoch_pos = t->sampler.per_replica;
    if (t->step != t->last_ckpt_step && save_checkpoint(t, err)) return -1;
    fprintf(stderr, "done: %ld optimizer steps\n", t->step);
    return 0;
}

void trainer_free(Trainer *t) {
    progress_close(&t->progress);
    metrics_free(&t->metrics);
    free(t->inputs);
    free(t->targets);
    free(t->loss_mask);
    free(t->position_ids);
    optim_free(&t->opt);
    sampler_free(&t->sampler);
    dataset_close(&t->data);
    model_free(&t->model);
}
