// trainer.c: the training loop of one rank (train/trainer.h). As llm.c's: for each
// micro-batch forward and backward, then per optimizer step the agreed sums and gradient norm,
// clipping, the optimizer, the next window's zeroed gradients. What differs between the
// parallel modes (which weights and gradients a rank holds, their collectives, the norm over
// ranks, what evaluation and checkpoints gather) is the executor's (train/executor.h):
// this file never asks which mode runs.
#include "train/trainer.h"

#include <cblas.h>
#include <cjson/cJSON.h>
#include <fcntl.h>
#include <malloc.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/model_dir.h"
#include "common/clock.h"
#include "common/fsutil.h"
#include "common/path.h"
#include "engine/counter_rng.h"
#include "train/test_seam.h"
#include "train/train_ckpt.h"

volatile sig_atomic_t trainer_stop_requested = 0;
volatile sig_atomic_t trainer_checkpoint_requested = 0;

long trainer_total_steps(int64_t n_samples, long nprocs, long batch, long accum, long n_epoch) {
    int64_t per_replica = (n_samples + nprocs - 1) / nprocs;
    int64_t batches = (per_replica + batch - 1) / batch;
    return (long)(batches / accum) * n_epoch;
}

static void set_threads(long n) {
    omp_set_num_threads((int)n);
    openblas_set_num_threads((int)n);
}

// The token windows of a seq/sft dataset.
static int open_windows(Trainer *t, const ModelConfig *cfg, Err *err) {
    const TrainSpec *s = t->spec;
    if (dataset_open(&t->data, s->data_root_path, t->sft, err)) return -1;
    if (dataset_check_vocab(&t->data, cfg->vocab_size, err) ||
        dataset_check_positions(&t->data, cfg->max_position_embeddings, err))
        return err_prefix(err, "data_root_path %s", s->data_root_path);
    t->n_samples = dataset_num_windows(t->data.n_tokens, t->window, t->stride);
    if (t->n_samples == 0)
        return err_set(err, "data_root_path %s: %lld tokens give no sample of window_size %lld",
                       s->data_root_path, (long long)t->data.n_tokens, (long long)t->window);
    return 0;
}

// The records of dpo/grpo: every record is one sample.
static int open_records(Trainer *t, const ModelConfig *cfg, Err *err) {
    const TrainSpec *s = t->spec;
    RecordKind kind = s->is.train_type == TRAIN_DPO ? RECORDS_DPO : RECORDS_GRPO;
    if (records_open(&t->records, s->data_root_path, kind, (int)s->group_size, cfg->vocab_size,
                     s->skip_bad_records, err))
        return -1;
    if (t->records.skipped && t->rank == 0)
        fprintf(stderr, "warning: %s: %lld bad record(s) skipped; the first: %s\n",
                s->data_root_path, (long long)t->records.skipped, t->records.first_skipped.msg);
    t->n_samples = t->records.n_records;
    return 0;
}

// Tokens per sample window: window_size, or the model's context.
static int64_t window_of(const TrainSpec *s, const ModelConfig *cfg) {
    return s->window_size ? s->window_size : cfg->max_position_embeddings;
}

static int open_data(Trainer *t, const ModelConfig *cfg, Err *err) {
    const TrainSpec *s = t->spec;
    t->window = window_of(s, cfg);
    if (t->window > cfg->max_position_embeddings)
        return err_set(err, "window_size: %ld is larger than max_position_embeddings %d",
                       (long)t->window, cfg->max_position_embeddings);
    t->stride = s->stride ? s->stride : t->window;
    if (t->pref ? open_records(t, cfg, err) : open_windows(t, cfg, err)) return -1;
    return sampler_init_split(&t->sampler, t->n_samples, s->val_split, t->replicas, t->replica,
                              (uint64_t)s->random_seed, s->shuffle, err);
}

// ---------------------------------------------------------------- the spec's choices, as the
// engine and the executor name them

static ScheduleKind schedule_kind(ScheduleChoice c) {
    return c == SCHEDULE_WSD ? SCHED_WSD : c == SCHEDULE_SGDR ? SCHED_SGDR : SCHED_COSINE;
}

static ExecMode exec_mode(ParallelChoice c) {
    return c == PARALLEL_DDP ? EXEC_DDP : c == PARALLEL_FSDP ? EXEC_FSDP : EXEC_NONE;
}

static PpScheduleKind pipeline_kind(PipelineChoice c) {
    return c == PIPELINE_GPIPE ? PP_GPIPE : PP_1F1B;
}

static int alloc_batch(Trainer *t, Err *err) {
    if (t->pref)
        return pref_batch_init(&t->pb, &t->records, (int)t->spec->batch_per_device, t->window, err);
    size_t n = (size_t)t->spec->batch_per_device * (size_t)t->window;
    t->inputs = malloc(n * sizeof(int32_t));
    t->targets = malloc(n * sizeof(int32_t));
    t->loss_mask = malloc(n * sizeof(int32_t));
    t->position_ids = malloc(n * sizeof(int32_t));
    if (!t->inputs || !t->targets || !t->loss_mask || !t->position_ids)
        return err_resource(err, "batch buffers: out of memory");
    return 0;
}

// A "FIELD: N kB" line of /proc/self/status in bytes; 0 if unknown.
static long status_bytes(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256], format[64];
    snprintf(format, sizeof format, "%s: %%ld kB", field);
    long kib = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, format, &kib) == 1) break;
    fclose(f);
    return kib * 1024;
}

// Private anonymous resident bytes of this process (RssAnon): the heap and mmap'd buffers,
// without the code, mapped files and the shared collectives segment.
static long resident_bytes(void) {
    return status_bytes("RssAnon");
}

// The kernel's peak resident set (VmHWM) restarts from the current one (proc(5): clear_refs 5),
// so that it measures what one phase adds. False when the kernel refuses.
static bool restart_peak_resident(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    bool ok = f && fputs("5", f) >= 0;
    if (f && fclose(f)) ok = false;
    return ok;
}

// The training windows (the dataset less the validation split) set the schedule. A run
// without one optimizer step is bad input: it would end at once having learned nothing.
static int set_total_steps(Trainer *t, Err *err) {
    const TrainSpec *s = t->spec;
    t->total_steps = trainer_total_steps(t->sampler.n, t->replicas, s->batch_per_device,
                                         s->grad_accum_steps, s->n_epoch);
    if (t->total_steps > 0) return 0;
    int64_t batches = (t->sampler.per_replica + s->batch_per_device - 1) / s->batch_per_device;
    return err_set(err,
                   "grad_accum_steps: %ld is more than the %lld micro-batch(es) of an epoch "
                   "(%lld training samples over %d rank(s) in batches of batch_per_device %ld): "
                   "no optimizer step would run",
                   s->grad_accum_steps, (long long)batches, (long long)t->sampler.n, t->replicas,
                   s->batch_per_device);
}

// pp_size > 1: this rank's stage and replica (train/pipeline.h) and the staging of a step's
// micro-batches (--dry-run: only the check of pp_size against the model).
static int setup_pipeline(Trainer *t, const ModelConfig *cfg, const TrainerOptions *opt, Err *err) {
    const TrainSpec *s = t->spec;
    if (s->pp_size <= 1) return 0;
    if (opt->dry_run) return pipeline_check(cfg, (int)s->pp_size, err);
    if (pipeline_init(&t->pipe, opt->comm, (int)s->pp_size, pipeline_kind(s->is.pp_schedule), cfg,
                      (long)window_of(s, cfg), opt->be, err))
        return -1;
    t->pipelined = true;
    t->replica = t->pipe.replica;
    t->replicas = t->pipe.replicas;
    if (!(t->staged = calloc((size_t)s->grad_accum_steps, sizeof *t->staged)))
        return err_resource(err, "pipeline: out of memory");
    for (long k = 0; k < s->grad_accum_steps; k++)
        if (!(t->staged[k].ids = malloc((size_t)s->batch_per_device * sizeof(int64_t))))
            return err_resource(err, "pipeline: out of memory");
    if (s->grad_accum_steps < s->pp_size && t->rank == 0)
        fprintf(stderr,
                "warning: grad_accum_steps %ld < pp_size %ld: each optimizer step's %ld "
                "micro-batch(es) fill the %ld stages only in part; the stages idle %.0f%% of a "
                "step ((P-1)/(M+P-1))\n",
                s->grad_accum_steps, s->pp_size, s->grad_accum_steps, s->pp_size,
                100 * pp_bubble_fraction((int)s->pp_size, (int)s->grad_accum_steps));
    return 0;
}

// The supervisor's control pipe, read without blocking (poll_control).
static void open_control(Trainer *t, int fd) {
    t->control_fd = fd;
    if (fd >= 0) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

int trainer_init(Trainer *t, const TrainSpec *spec, const TrainerOptions *opt, Err *err) {
    memset(t, 0, sizeof *t);
    t->spec = spec;
    t->sft = spec->is.train_type == TRAIN_SFT;
    t->pref = spec->is.train_type == TRAIN_DPO || spec->is.train_type == TRAIN_GRPO;
    t->rank = opt->comm ? comm_rank(opt->comm) : 0;
    t->world = opt->comm ? comm_world_size(opt->comm) : 1;
    t->replica = t->rank;
    t->replicas = t->world;
    open_control(t, opt->control_fd);
    set_threads(opt->threads);
    // Large buffers (fsdp's transient full weights and gradients) come from mmap and go
    // back to the system when freed; a fixed threshold stops glibc from moving them to the
    // heap after the first free.
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    char *resume_dir = t->resumed_from;
    if (spec->resume && train_ckpt_locate(spec, resume_dir, sizeof t->resumed_from, err)) return -1;
    train_ckpt_choose_run(spec, resume_dir, t->rank);
    const char *model_dir = *resume_dir ? resume_dir : spec->param_path;
    ModelConfig cfg;
    if (t->pref && train_ckpt_reference_dir(spec, resume_dir, t->rank, t->reference_dir,
                                            sizeof t->reference_dir, err))
        return -1;
    if (ckpt_model_config(&cfg, model_dir, err) || setup_pipeline(t, &cfg, opt, err) ||
        open_data(t, &cfg, err) || set_total_steps(t, err))
        return -1;
    t->memory_report = opt->memory_report;
    if (t->memory_report) t->rss_baseline = resident_bytes();
    t->rss_ckpt_max = -1;
    // DPO/GRPO: the reference's weights first, kept frozen; then the policy's when they differ.
    const char *first_dir = t->pref ? t->reference_dir : model_dir;
    int first = t->pipelined ? t->pipe.first_block : 0,
        end = t->pipelined ? t->pipe.end_block : cfg.num_hidden_layers;
    if (train_ckpt_load_model(&t->model, &cfg, first, end, opt->be, first_dir, err)) return -1;
    t->model.grad_checkpointing = spec->gradient_checkpointing;
    t->model.neftune_alpha = (float)spec->neftune_alpha;
    if (executor_init(&t->exec, exec_mode(spec->is.parallel_mode),
                      t->pipelined ? t->pipe.group : opt->comm, opt->comm, &t->model,
                      (size_t)(spec->bucket_mb * (1 << 20)), err))
        return -1;
    if (t->pipelined) t->exec.norm_skip = pipeline_norm_skip(&t->pipe, &t->model);
    if (t->pref &&
        (executor_keep_reference(&t->exec, &t->model, err) ||
         (strcmp(first_dir, model_dir) && train_ckpt_load_weights(&t->model, model_dir, err))))
        return -1;
    if (executor_adopt_weights(&t->exec, &t->model, err)) return -1;
    if (t->pref)
        pref_init(&t->pref_loss, t->records.kind == RECORDS_DPO ? PREF_DPO : PREF_GRPO,
                  (float)spec->dpo_beta, (float)spec->grpo_clip_eps, (float)spec->grpo_kl_coef,
                  opt->be);
    schedule_init(&t->sched, schedule_kind(spec->is.schedule_type), t->total_steps,
                  spec->warmup_ratio, spec->min_rate, spec->stable_steps, spec->decay_steps,
                  spec->cycle_length, spec->t_mult);
    if (grad_scaler_init(&t->scaler, spec, err)) return -1;
    OptimizerKind kind = spec->is.optimizer == OPTIMIZER_ADAMW ? OPT_ADAMW : OPT_MUON;
    ParamView view = executor_view(&t->exec, &t->model);
    if (optim_create(&t->opt, kind, &view, (float)spec->weight_decay, err)) return -1;
    t->opt.momentum = (float)spec->muon_momentum;
    t->opt.nesterov = spec->muon_nesterov;
    t->opt.ns_steps = (int)spec->muon_ns_steps;
    t->opt.adjust_lr_original = spec->is.muon_adjust_lr == MUON_LR_ORIGINAL;
    if (!*resume_dir) { // a fresh run starts where --start_epoch/--start_samples say (AstrAI)
        t->epoch = spec->start_epoch;
        t->consumed_samples = spec->start_samples * t->replicas;
        t->epoch_pos = spec->start_samples % t->sampler.per_replica;
    }
    if (*resume_dir && train_ckpt_load_state(t, resume_dir, err)) return -1;
    t->last_ckpt_step = t->step;
    if (metric_log_select(&t->metrics, spec->metrics, err)) return -1; // new step rows' columns
    if (t->rank == 0 && progress_open(&t->progress, opt->run_dir ? opt->run_dir : spec->ckpt_dir,
                                      t->total_steps, t->step, err))
        return -1;
    return alloc_batch(t, err);
}

// Fills the batch with the nb samples ids[0], ids[stride], ...: token windows, or (dpo, grpo)
// records as model rows.
static void fill_batch(Trainer *t, const int64_t *ids, int64_t stride, int nb) {
    if (t->pref) {
        pref_batch_fill(&t->pb, &t->records, ids, stride, nb);
        return;
    }
    int64_t w = t->window;
    for (int b = 0; b < nb; b++)
        dataset_window(&t->data, ids[b * stride], w, t->stride, t->inputs + b * w,
                       t->targets + b * w, t->sft ? t->loss_mask + b * w : NULL,
                       t->sft ? t->position_ids + b * w : NULL);
}

// The weight of a micro-batch's loss in backward: 1/grad_accum_steps (the step's loss is the
// mean of its micro-batches'), times the loss scale S (--loss_scale; 1 without), which
// optimizer_step divides out of the gradients again. An S too large for a float gives inf: an
// overflow, which the scaler backs off from.
static float micro_weight(const Trainer *t) {
    return test_seam_loss_weight(t->rank, t->step + 1,
                                 (float)(t->scaler.scale / (double)t->spec->grad_accum_steps));
}

// The forward of the batch of nb samples with the loss into the model's stats; begins the
// executor's micro-step of that kind. Training: every rank runs it (validation: not all of
// them).

static int forward_batch(Trainer *t, int nb, MicroStep kind, float loss_scale, Err *err) {
    if (t->pref)
        return pref_batch_forward(&t->pb, &t->pref_loss, &t->exec, &t->model, kind, loss_scale,
                                  err);
    return executor_begin_micro(&t->exec, &t->model, kind, err) ||
           model_forward_accumulate(&t->model, t->inputs, t->targets, t->sft ? t->loss_mask : NULL,
                                    t->sft ? t->position_ids : NULL, nb, (int)t->window,
                                    (float)t->spec->label_smoothing, err);
}

// Rank 0, a checkpoint committed: it counts from now on (progress.db, the line, retention).
static int checkpoint_committed(Trainer *t, const char *path, long step, long epoch, Err *err) {
    fprintf(stderr, "checkpoint %s\n", path);
    return progress_add_checkpoint(&t->progress, step, epoch, path, err) ||
           train_ckpt_prune(t, err);
}

// Every rank: waits for the background write in flight (none: nothing to do) and rank 0 records
// it; a sharded checkpoint's ranks first wait for each other (train_ckpt_finish).
static int collect_checkpoint(Trainer *t, Err *err) {
    char path[4096];
    long step, epoch;
    int rc = train_ckpt_finish(t, path, sizeof path, &step, &epoch, err);
    if (rc < 0) return -1;
    if (rc > 0) return t->rank == 0 ? checkpoint_committed(t, path, step, epoch, err) : 0;
    if (!t->writer.running) return 0;
    step = t->writer.step, epoch = t->writer.epoch;
    if (ckpt_writer_collect(&t->writer, err)) return -1;
    return checkpoint_committed(t, t->writer.dir, step, epoch, err);
}

// At a step boundary, without blocking, for the agreement: whether this rank's background write
// has finished (*written) or failed (kept in t->ckpt_failure; the agreement stops every rank). A
// full checkpoint that rank 0 wrote is recorded at once; a sharded one is committed once every
// rank's files are written.
static void poll_checkpoint(Trainer *t, bool *written) {
    bool failed;
    *written = ckpt_writer_done(&t->writer, &failed) && !failed;
    if (failed && !t->ckpt_failed) {
        t->ckpt_failed = true;
        ckpt_writer_collect(&t->writer, &t->ckpt_failure);
    } else if (*written && !t->pending.active && collect_checkpoint(t, &t->ckpt_failure)) {
        t->ckpt_failed = true;
    }
}

// Rank 0 reports a phase between steps (validation, a checkpoint write; "" when over) to
// progress.db: astraid's hang watchdog gives it more time than a step.
static int report_phase(Trainer *t, const char *phase, Err *err) {
    return t->rank == 0 ? progress_set_phase(&t->progress, phase, err) : 0;
}

static int write_checkpoint(Trainer *t, Err *err) {
    bool background;
    char path[4096];
    if (t->model.be->failure(err)) return -1; // what it would write may be unspecified
    // One write in flight at most: the next checkpoint waits for the one before.
    if (collect_checkpoint(t, err)) return -1;
    long before = t->memory_report && restart_peak_resident() ? status_bytes("VmRSS") : -1;
    if (train_ckpt_save(t, path, sizeof path, &background, err)) return -1;
    long added = before >= 0 ? status_bytes("VmHWM") - before : -1;
    if (added > t->rss_ckpt_max) t->rss_ckpt_max = added;
    t->last_ckpt_step = t->step;
    if (t->rank != 0 || background) return 0;
    return checkpoint_committed(t, path, t->step, t->epoch, err);
}

static int save_checkpoint(Trainer *t, Err *err) {
    if (report_phase(t, "checkpoint", err) || write_checkpoint(t, err)) return -1;
    return report_phase(t, "", err);
}

typedef struct {
    double step_start; // clock_mono_s() when the current optimizer step began
    double run_start;  // clock_mono_s() when this process began training
    long steps_run;    // optimizer steps done by this process
    long tokens;       // tokens of the current optimizer step
    double reward_sum; // GRPO: the sum of its micro-batches' mean rewards
} StepClock;

// Summed over ranks at a step boundary: the step's losses, the requests (docs/design.md §5): a
// request that reached any rank applies to all, so they stop or checkpoint at the same step; and
// the executor's slot, where it sums the squared norms of the gradients (executor_agree_step).
// DPO/GRPO add their metrics: two from the model's stats and GRPO's mean reward.
enum {
    AGREE_LOSS,
    AGREE_STOP,
    AGREE_CKPT,
    AGREE_NORM,
    AGREE_PREF_A,
    AGREE_PREF_B,
    AGREE_REWARD,
    AGREE_CKPT_FAILED,    // a rank's background checkpoint write failed: every rank stops
    AGREE_BACKEND_FAILED, // an op of a rank's backend failed this step: every rank stops
    AGREE_CKPT_WRITTEN,   // ranks whose files of the pending sharded checkpoint are written
    AGREE_N
};

// The requests on the supervisor's control pipe (TrainerOptions), at a step boundary.
static void poll_control(Trainer *t) {
    char buf[256];
    ssize_t n;
    while (t->control_fd >= 0 && (n = read(t->control_fd, buf, sizeof buf - 1)) != 0) {
        if (n < 0) return; // EAGAIN: nothing new
        buf[n] = 0;
        if (strstr(buf, "stop")) trainer_stop_requested = 1;
        if (strstr(buf, "checkpoint")) trainer_checkpoint_requested = 1;
    }
    if (t->control_fd >= 0) {
        close(t->control_fd);
        t->control_fd = -1;
        trainer_stop_requested = 1;
    }
}

// The step's agreed numbers, from the one read-back of the step's losses (model stats) summed
// over ranks with the stop/checkpoint requests and the gradient norm.
typedef struct {
    float loss;  // the mean of the micro-step losses over ranks
    double norm; // the global gradient norm
    int stop, ckpt;
    double pref[3]; // DPO: reward margin, accuracy; GRPO: KL, clip fraction, mean reward
    bool overflow;  // the loss or a gradient on some rank is not finite
} StepTotals;

static int agree_step(Trainer *t, StepTotals *out, StepClock *c, Err *err) {
    double stats[MODEL_N_STATS];
    model_read_stats(&t->model, stats);
    poll_control(t);
    bool written;
    poll_checkpoint(t, &written);
    // The backend's first failure (engine/backend.h), checked once per step before anything of
    // the step is applied or written.
    Err backend_err = {0};
    bool backend_failed = t->model.be->failure(&backend_err) != 0;
    float agreed[AGREE_N] = {(float)stats[MODEL_STAT_LOSS],
                             (float)(trainer_stop_requested != 0),
                             (float)(trainer_checkpoint_requested != 0),
                             0.0f, // AGREE_NORM: the executor's
                             (float)stats[MODEL_STAT_PREF_A],
                             (float)stats[MODEL_STAT_PREF_B],
                             (float)c->reward_sum,
                             (float)t->ckpt_failed,
                             (float)backend_failed,
                             (float)written};
    trainer_checkpoint_requested = 0;
    c->reward_sum = 0;
    if (executor_agree_step(&t->exec, &t->model, agreed, AGREE_N, AGREE_NORM, &out->norm, err))
        return -1;
    float micro_steps = (float)(t->spec->grad_accum_steps * t->replicas);
    if (agreed[AGREE_BACKEND_FAILED] > 0) {
        if (backend_failed) *err = backend_err;
        return backend_failed ? -1
                              : err_resource(err,
                                             "step %ld: another rank's backend failed (its "
                                             "message is in its log)",
                                             t->step + 1);
    }
    if (agreed[AGREE_CKPT_FAILED] > 0) {
        if (t->ckpt_failed) *err = t->ckpt_failure;
        return t->ckpt_failed
                   ? -1
                   : err_set(err, "another rank failed to write a checkpoint in the background");
    }
    // Every rank's files are written: rank 0 commits, here on every rank at the same step.
    if (t->pending.active && agreed[AGREE_CKPT_WRITTEN] == (float)t->world &&
        collect_checkpoint(t, err))
        return -1;
    out->stop = agreed[AGREE_STOP] > 0;
    out->ckpt = agreed[AGREE_CKPT] > 0;
    out->loss = agreed[AGREE_LOSS] / micro_steps;
    for (int k = 0; k < 3; k++)
        out->pref[k] = agreed[AGREE_PREF_A + k] / micro_steps;
    // Under dynamic loss scaling a number that is not finite is an overflow to back off from
    // (optimizer_step), not a failure.
    out->overflow = !isfinite(out->loss) || !isfinite(out->norm);
    if (t->scaler.mode == LOSS_SCALE_DYNAMIC) return 0;
    if (!isfinite(out->loss))
        return err_set(err, "loss is %f at step %ld (diverged: lower max_lr?)", (double)out->loss,
                       t->step + 1);
    if (!isfinite(out->norm))
        return err_set(err, "gradient norm is %f at step %ld (diverged: lower max_lr?)", out->norm,
                       t->step + 1);
    return 0;
}

// A validation micro-batch: the nb samples ids[0], ids[stride], ...; nb 0: a forward of one
// sample that counts nothing (where every rank must run every forward).
typedef struct {
    const int64_t *ids;
    int64_t stride;
    int nb;
} EvalBatch;

// The samples a batch's forward runs on.
static int eval_nb(const EvalBatch *b) {
    return b->nb ? b->nb : 1;
}

static int eval_batches(Trainer *t, const EvalBatch *list, int n, double *sum, Err *err) {
    int rc = 0;
    for (int k = 0; !rc && k < n; k++) {
        double stats[MODEL_N_STATS];
        fill_batch(t, list[k].ids, list[k].stride, eval_nb(&list[k]));
        rc = forward_batch(t, eval_nb(&list[k]), MICRO_EVAL, 1.0f, err);
        if (!rc) model_read_stats(&t->model, stats); // the batch's mean loss; resets the sums
        if (!rc) rc = executor_end_micro(&t->exec, &t->model, MICRO_EVAL, err);
        if (!rc) *sum += stats[MODEL_STAT_LOSS] * (double)list[k].nb;
    }
    return rc;
}

// ---------------------------------------------------------------- pipelined runs

// The passes of micro-batches through a pipeline (train/pipeline.h): a training step's forwards
// and backwards, validation's forwards, and (dpo, grpo) the frozen reference's forwards that
// come first, whose per-token NLL the last stage keeps for each micro-batch.
typedef enum { PASS_TRAIN, PASS_EVAL, PASS_REFERENCE } PassKind;

typedef struct {
    Trainer *t;
    PassKind pass;
    const EvalBatch *list; // the run's micro-batches
    const float *norms;    // grpo training: each micro-batch's token norm (over the replicas)
    double *sum;           // eval: the losses, each weighted by its batch's samples
} PipeRun;

// The last stage's per-micro-batch state of the preference losses: the reference's NLL (from
// the reference pass to the policy's forward) and the token weights (from the forward to its
// backward, which 1F1B and GPipe run later).
typedef struct PipePref PipePref;
struct PipePref {
    float *ref, *scale;            // backend
    size_t ref_bytes, scale_bytes; // their capacities
};

static int pipe_pref_reserve(Trainer *t, int k, size_t n, Err *err) {
    if (k >= t->n_pipe_pref) {
        PipePref *more = realloc(t->pipe_pref, (size_t)(k + 1) * sizeof *more);
        if (!more) return err_resource(err, "pipeline: out of memory");
        memset(more + t->n_pipe_pref, 0, (size_t)(k + 1 - t->n_pipe_pref) * sizeof *more);
        t->pipe_pref = more;
        t->n_pipe_pref = k + 1;
    }
    PipePref *pp = &t->pipe_pref[k];
    const Backend *be = t->model.be;
    if (backend_reserve(be, (void **)&pp->ref, &pp->ref_bytes, n * sizeof(float), err) ||
        backend_reserve(be, (void **)&pp->scale, &pp->scale_bytes, n * sizeof(float), err))
        return err_prefix(err, "pipeline: the preference state of micro-batch %d", k);
    return 0;
}

static void pipe_pref_free(Trainer *t) {
    for (int k = 0; k < t->n_pipe_pref; k++) {
        t->model.be->free(t->pipe_pref[k].ref);
        t->model.be->free(t->pipe_pref[k].scale);
    }
    free(t->pipe_pref);
}

// Fills the batch of micro-batch k (every stage reads the samples itself).
static void fill_micro(const PipeRun *r, int k) {
    fill_batch(r->t, r->list[k].ids, r->list[k].stride, eval_nb(&r->list[k]));
}

// Token rows of micro-batch k: windows of the run's length, or (dpo, grpo) the rows of its
// records at their longest length, which filling the batch tells.
static long pipe_rows(void *ctx, int k) {
    const PipeRun *r = ctx;
    if (!r->t->pref) return (long)eval_nb(&r->list[k]) * (long)r->t->window;
    fill_micro(r, k);
    return (long)r->t->pb.rows * r->t->pb.T;
}

// The last stage's preference loss of micro-batch k after its policy forward (or the reference's
// NLL after the reference's).
static int pipe_pref_loss(PipeRun *r, int k, Err *err) {
    Trainer *t = r->t;
    const PrefBatch *b = &t->pb;
    size_t n = (size_t)b->rows * b->T;
    if (pipe_pref_reserve(t, k, n, err)) return -1;
    PipePref *pp = &t->pipe_pref[k];
    const Backend *be = t->model.be;
    if (r->pass == PASS_REFERENCE) {
        if (pref_keep_reference(&t->pref_loss, &t->model, b->rows, b->T, err)) return -1;
        be->copy(pp->ref, t->pref_loss.ref_nll, n * sizeof(float));
        return 0;
    }
    be->copy(t->pref_loss.ref_nll, pp->ref, n * sizeof(float));
    bool train = r->pass == PASS_TRAIN;
    float norm = train && r->norms ? r->norms[k] : (float)b->counted;
    float scale = train ? micro_weight(t) : 1.0f;
    if (pref_loss(&t->pref_loss, &t->model, b->rows, b->T, b->advantages, norm, scale, err))
        return -1;
    if (train) be->copy(pp->scale, t->pref_loss.scale, n * sizeof(float));
    return 0;
}

static int pipe_forward(void *ctx, int k, Err *err) {
    PipeRun *r = ctx;
    Trainer *t = r->t;
    Model *m = &t->model;
    int nb = eval_nb(&r->list[k]);
    fill_micro(r, k);
    if (r->pass == PASS_TRAIN) m->noise_seed = t->staged[k].noise_seed;
    int rc = t->pref
                 ? model_forward_tokens(m, t->pb.inputs, t->pb.targets, t->pb.loss_mask, t->pb.rows,
                                        t->pb.T, err) < 0
                 : model_forward_accumulate(m, t->inputs, t->targets, t->sft ? t->loss_mask : NULL,
                                            t->sft ? t->position_ids : NULL, nb, (int)t->window,
                                            (float)t->spec->label_smoothing, err);
    if (rc || !m->has_head) return rc ? -1 : 0;
    if (t->pref && pipe_pref_loss(r, k, err)) return -1;
    if (r->pass == PASS_EVAL) {
        double stats[MODEL_N_STATS];
        model_read_stats(m, stats);
        *r->sum += stats[MODEL_STAT_LOSS] * (double)r->list[k].nb;
    }
    return 0;
}

static void pipe_backward(void *ctx, int k) {
    PipeRun *r = ctx;
    Model *m = &r->t->model;
    if (r->t->pref)
        model_backward_weighted(m, m->has_head ? r->t->pipe_pref[k].scale : NULL);
    else
        model_backward(m, micro_weight(r->t));
}

// A forward-only pass of the frozen reference (dpo, grpo) over the micro-batches, as in
// evaluation: no NEFTune noise.
static int reference_pass(Trainer *t, const EvalBatch *list, int n, Err *err) {
    if (!t->pref) return 0;
    PipeRun r = {.t = t, .pass = PASS_REFERENCE, .list = list};
    PipelineWork w = {.rows = pipe_rows, .forward = pipe_forward, .ctx = &r};
    float alpha = t->model.neftune_alpha;
    t->model.neftune_alpha = 0.0f;
    int rc = executor_begin_reference(&t->exec, &t->model, err) ||
             pipeline_run(&t->pipe, &t->model, &w, n, false, err);
    int end = executor_end_reference(&t->exec, &t->model, rc ? NULL : err);
    t->model.neftune_alpha = alpha;
    return rc || end ? -1 : 0;
}

static int eval_pipelined(Trainer *t, const EvalBatch *list, int n, double *sum, Err *err) {
    PipeRun r = {.t = t, .pass = PASS_EVAL, .list = list, .sum = sum};
    PipelineWork w = {.rows = pipe_rows, .forward = pipe_forward, .ctx = &r};
    if (reference_pass(t, list, n, err) ||
        executor_begin_micro(&t->exec, &t->model, MICRO_EVAL, err))
        return -1;
    int rc = pipeline_run(&t->pipe, &t->model, &w, n, false, err);
    int end = executor_end_micro(&t->exec, &t->model, MICRO_EVAL, rc ? NULL : err);
    return rc || end ? -1 : 0;
}

// The held-out windows' mean loss (--val_split), the same on every rank: replica r evaluates
// windows val_ids[r], val_ids[r + replicas], ... in micro-batches of batch_per_device, forward
// only. A batch's mean loss counts once per window in it (for seq, every window has the
// same number of target tokens, so this is the mean of the windows' own losses); the sum
// and the window count are added over ranks (in a pipeline, the last stage's). Where the
// executor's forward is collective (fsdp gathers the weights in each), every replica runs the
// same number of micro-batches: one left without a window in one evaluates val_ids[0] with
// weight 0.
static int validate(Trainer *t, double *val_loss, Err *err) {
    const Sampler *sp = &t->sampler;
    int64_t B = t->spec->batch_per_device, R = t->replicas, r = t->replica;
    int64_t per_rank = (sp->n_val + R - 1) / R;
    int64_t mine = sp->n_val > r ? (sp->n_val - r + R - 1) / R : 0;
    EvalBatch *list = malloc((size_t)((per_rank + B - 1) / B + 1) * sizeof *list);
    if (!list) return err_resource(err, "validation: out of memory");
    int n = 0;
    for (int64_t first = 0; first < per_rank; first += B) {
        int64_t nb = mine - first < B ? mine - first : B;
        if (nb < 0) nb = 0;
        if (nb == 0 && !executor_forward_collective(&t->exec)) continue;
        list[n++] = nb ? (EvalBatch){sp->val_ids + first * R + r, R, (int)nb}
                       : (EvalBatch){sp->val_ids, 1, 0};
    }
    double sum = 0;
    float alpha = t->model.neftune_alpha; // evaluation: no NEFTune noise
    t->model.neftune_alpha = 0.0f;
    int rc =
        t->pipelined ? eval_pipelined(t, list, n, &sum, err) : eval_batches(t, list, n, &sum, err);
    t->model.neftune_alpha = alpha;
    free(list);
    double counted = t->model.has_head ? (double)mine : 0; // a pipeline: the last stage's
    return rc ? -1 : executor_mean(&t->exec, sum, counted, val_loss, err);
}

// Validation is due every val_step optimizer steps and at the last step (the end of the
// run, or max_steps).
static int validation_due(const Trainer *t) {
    const TrainSpec *s = t->spec;
    if (t->sampler.n_val == 0) return 0;
    return t->step % s->val_step == 0 || t->step == t->total_steps ||
           (s->max_steps > 0 && t->step == s->max_steps);
}

// The per-step numbers of DPO and GRPO, after grad_norm in the step row.
static void add_pref_metrics(const Trainer *t, StepRow *row, const double pref[3]) {
    static const char *const DPO[] = {"reward_margin", "reward_accuracy"};
    static const char *const GRPO[] = {"kl", "clip_fraction", "reward_mean"};
    if (!t->pref) return;
    int grpo = t->records.kind == RECORDS_GRPO;
    row->n_extra = grpo ? 3 : 2;
    for (int k = 0; k < row->n_extra; k++)
        row->extra[k] = (StepExtra){.name = grpo ? GRPO[k] : DPO[k], .value = pref[k]};
}

// Under loss scaling, the scale the step's backward ran with and whether it was skipped.
static void add_scaler_metrics(const Trainer *t, StepRow *row, double scale, bool skipped) {
    if (!grad_scaler_on(&t->scaler)) return;
    row->extra[row->n_extra++] = (StepExtra){.name = "loss_scale", .value = scale};
    row->extra[row->n_extra++] = (StepExtra){.name = "skipped", .value = skipped};
}

static int optimizer_step(Trainer *t, StepClock *c, int *stop, int *ckpt, Err *err) {
    const TrainSpec *s = t->spec;
    ParamView view = executor_view(&t->exec, &t->model);
    StepTotals tot;
    if (agree_step(t, &tot, c, err)) return -1;
    *stop = tot.stop;
    *ckpt = tot.ckpt;
    double lr = s->max_lr * schedule_factor(&t->sched, t->step);
    double scale = t->scaler.scale;
    // A skipped step (an overflow under loss scaling) leaves weights and optimizer state as
    // they are; the schedule advances all the same, as PyTorch's scheduler.step() after a
    // skipped scaler.step() does.
    bool skipped = t->scaler.mode == LOSS_SCALE_DYNAMIC && tot.overflow;
    if (!skipped) {
        if (scale != 1.0) { // unscaled before clipping: a power of two divides exactly
            view.be->scale(view.grads, view.num_floats, (float)(1.0 / scale));
            tot.norm /= scale;
        }
        clip_grads(&view, tot.norm, (float)s->max_grad_norm);
        optim_step(&t->opt, &view, (float)lr);
    }
    if (!grad_scaler_update(&t->scaler, tot.overflow, t->step + 1, err) ||
        executor_after_step(&t->exec, &t->model, err))
        return -1;
    t->step++;
    double now = clock_mono_s();
    StepRow row = {.step = t->step,
                   .epoch = t->epoch,
                   .consumed_samples = t->consumed_samples,
                   .loss = tot.loss,
                   .lr = lr,
                   .grad_norm = (float)tot.norm,
                   .tokens_per_s =
                       (double)c->tokens * t->replicas / fmax(now - c->step_start, 1e-9),
                   .wall_time = clock_wall_s(),
                   .skipped = skipped};
    add_pref_metrics(t, &row, tot.pref);
    add_scaler_metrics(t, &row, scale, skipped);
    c->steps_run++;
    if (t->memory_report) {
        long rss = resident_bytes() - t->rss_baseline;
        if (rss > t->rss_state_max) t->rss_state_max = rss;
    }
    // The validation row goes first, as AstrAI's: a reader that sees the step sees its
    // validation too.
    double val_loss;
    if (validation_due(t)) {
        if (report_phase(t, "validation", err) || validate(t, &val_loss, err) ||
            t->model.be->failure(err))
            return -1;
        if ((t->rank == 0 && (metric_log_append_validation(&t->metrics, t->step, t->epoch,
                                                           t->consumed_samples, val_loss, err) ||
                              progress_add_validation(&t->progress, t->step, t->epoch,
                                                      t->consumed_samples, val_loss, err))) ||
            report_phase(t, "", err))
            return -1;
        if (t->rank == 0) fprintf(stderr, "step %ld | val_loss %.4f\n", t->step, val_loss);
    }
    if (t->rank == 0 &&
        (metric_log_append(&t->metrics, &row, err) || progress_add_step(&t->progress, &row, err)))
        return -1;
    if (t->rank == 0 &&
        (t->step % s->log_interval == 0 || t->step == 1 || t->step == t->total_steps)) {
        char line[256];
        double eta =
            (now - c->run_start) / (double)c->steps_run * (double)(t->total_steps - t->step);
        progress_format_line(line, sizeof line, &row, t->total_steps, eta);
        fprintf(stderr, "%s\n", line);
    }
    c->tokens = 0;
    c->step_start = clock_mono_s(); // after any validation: the next step is timed alone
    return 0;
}

// The NEFTune noise stream of the micro-step at the current position: a function of the
// seed, the samples consumed and the rank, so that a resumed run draws what it would have.
static uint64_t noise_seed(const Trainer *t) {
    return splitmix64_mix(splitmix64_mix((uint64_t)t->spec->random_seed) ^
                          ((uint64_t)t->consumed_samples << 16 | (uint64_t)t->replica));
}

// GRPO: each staged micro-batch's token norm, its response tokens (counted when it was staged)
// summed over the replicas (every rank adds its count; each replica's P stages count the same)
// and divided by them, as pref_batch_forward does without a pipeline.
static int grpo_norms(Trainer *t, int n, float *norms, Err *err) {
    for (int k = 0; k < n; k++)
        norms[k] = (float)t->staged[k].counted;
    for (int k = 0; k < n; k += EXEC_AGREE_MAX)
        if (executor_sum(&t->exec, norms + k, n - k < EXEC_AGREE_MAX ? n - k : EXEC_AGREE_MAX, err))
            return -1;
    for (int k = 0; k < n; k++)
        norms[k] /= (float)t->world;
    return 0;
}

// The window of a pipelined optimizer step: (dpo, grpo: the reference's pass first) one
// accumulation window of the executor over the schedule's forwards and backwards, the tied
// embedding's gradient summed between its two stages, then the gradients reduced over the
// stage's replicas.
static int run_pipelined_step(Trainer *t, Err *err) {
    int M = (int)t->spec->grad_accum_steps;
    EvalBatch *list = malloc((size_t)M * sizeof *list);
    float *norms = malloc((size_t)M * sizeof *norms);
    if (!list || !norms) {
        free(list);
        free(norms);
        return err_resource(err, "pipeline: out of memory for %d micro-batches", M);
    }
    for (int k = 0; k < M; k++)
        list[k] = (EvalBatch){t->staged[k].ids, 1, t->staged[k].nb};
    bool grpo = t->pref && t->records.kind == RECORDS_GRPO;
    PipeRun r = {.t = t, .pass = PASS_TRAIN, .list = list, .norms = grpo ? norms : NULL};
    PipelineWork w = {
        .rows = pipe_rows, .forward = pipe_forward, .backward = pipe_backward, .ctx = &r};
    Model *m = &t->model;
    int rc = (grpo && grpo_norms(t, M, norms, err)) || reference_pass(t, list, M, err) ||
             executor_begin_micro(&t->exec, m, MICRO_ACCUMULATE, err) ||
             pipeline_run(&t->pipe, m, &w, M, true, err) ||
             executor_end_micro(&t->exec, m, MICRO_ACCUMULATE, err) ||
             pipeline_sum_tied(&t->pipe, m, err) || executor_sync_grads(&t->exec, m, err);
    free(list);
    free(norms);
    return rc ? -1 : 0;
}

// Pipelined: the micro-batch is staged (its samples, its noise stream) with the bookkeeping a
// micro-step does; the step's last one runs them all through the pipeline. The rewards of GRPO
// count once per replica: on its last stage.
static int stage_micro(Trainer *t, StepClock *c, int nb, Err *err) {
    StagedMicro *s = &t->staged[t->micro];
    memcpy(s->ids, t->sampler.order + t->epoch_pos, (size_t)nb * sizeof *s->ids);
    s->nb = nb;
    s->noise_seed = noise_seed(t);
    if (t->pref) {
        fill_batch(t, s->ids, 1, nb);
        s->counted = t->pb.counted;
        c->tokens += t->pb.tokens;
        if (t->model.has_head) c->reward_sum += t->pb.reward_sum / t->pb.rows;
    } else {
        c->tokens += (long)nb * (long)t->window;
    }
    t->epoch_pos += nb;
    t->consumed_samples += (long)nb * t->replicas;
    t->micro++;
    return t->micro == t->spec->grad_accum_steps ? run_pipelined_step(t, err) : 0;
}

// One micro-step: forward, backward (weighted by micro_weight), bookkeeping,
// and on a sync micro-step the gradient exchange between ranks.
static int micro_step(Trainer *t, StepClock *c, int nb, Err *err) {
    const TrainSpec *s = t->spec;
    if (t->pipelined) return stage_micro(t, c, nb, err);
    fill_batch(t, t->sampler.order + t->epoch_pos, 1, nb);
    MicroStep kind = t->micro + 1 == s->grad_accum_steps ? MICRO_SYNC : MICRO_ACCUMULATE;
    float weight = micro_weight(t);
    t->model.noise_seed = noise_seed(t);
    if (forward_batch(t, nb, kind, weight, err)) return -1;
    if (t->pref) {
        model_backward_weighted(&t->model, t->pref_loss.scale);
        c->tokens += t->pb.tokens;
        c->reward_sum += t->pb.reward_sum / t->pb.rows;
    } else {
        model_backward(&t->model, weight);
        c->tokens += (long)nb * (long)t->window;
    }
    t->epoch_pos += nb;
    t->consumed_samples += (long)nb * t->replicas;
    t->micro++;
    return executor_end_micro(&t->exec, &t->model, kind, err);
}

// How the epochs loop ended.
enum { RUN_DONE, RUN_STOPPED, RUN_MAX_STEPS };

// After an optimizer step: checkpoint when due or requested. Returns 0 to go on, RUN_MAX_STEPS
// at --max_steps (the end of this run), RUN_STOPPED on an agreed stop request (before the end).
static int after_step(Trainer *t, int stop, int ckpt, Err *err) {
    int at_max = t->spec->max_steps > 0 && t->step >= t->spec->max_steps;
    int due = t->step - t->last_ckpt_step >= t->spec->ckpt_interval;
    if ((due || stop || ckpt || at_max) && save_checkpoint(t, err)) return -1;
    if ((stop || at_max) && t->rank == 0)
        fprintf(stderr, "stopped at step %ld of %ld\n", t->step, t->total_steps);
    return at_max ? RUN_MAX_STEPS : stop ? RUN_STOPPED : 0;
}

// With a memory report directory DIR (TrainerOptions), each rank writes DIR/rank<R>.json: the most
// resident bytes it held above its pre-model baseline between optimizer steps (parameters,
// gradients, optimizer state, activations), as measured by the kernel; the bytes of its
// activation sets (a pipeline stage holds one per micro-batch in flight); and, in a pipeline,
// its stage and the seconds its training steps spent computing and in transfers; the most
// resident bytes a checkpoint added while it was taken (VmHWM over it above VmRSS before it; -1:
// the kernel would not restart the peak).
static int write_memory_report(const Trainer *t, Err *err) {
    const char *dir = t->memory_report;
    if (!dir) return 0;
    char name[64], path[4096], text[320];
    snprintf(name, sizeof name, "rank%d.json", t->rank);
    int n = snprintf(text, sizeof text,
                     "{\"rank\": %d, \"state_bytes\": %ld, \"activation_bytes\": %zu, "
                     "\"stage\": %d, \"compute_s\": %.6f, \"transfer_s\": %.6f, "
                     "\"ckpt_bytes\": %ld}\n",
                     t->rank, t->rss_state_max, model_activation_bytes(&t->model),
                     t->pipelined ? t->pipe.stage : 0, t->pipe.compute_s, t->pipe.transfer_s,
                     t->rss_ckpt_max);
    return path_join(path, sizeof path, dir, name, err) ||
           fs_write_file_atomic(path, text, (size_t)n, err);
}

// Trains until the last epoch ends (RUN_DONE), max_steps (RUN_MAX_STEPS) or a stop is agreed
// (RUN_STOPPED); -1 on error.
static int run_epochs(Trainer *t, Err *err) {
    const TrainSpec *s = t->spec;
    StepClock clock = {.step_start = clock_mono_s(), .run_start = clock_mono_s()};
    for (; t->epoch < s->n_epoch; t->epoch++, t->epoch_pos = 0) {
        sampler_set_epoch(&t->sampler, t->epoch);
        while (t->epoch_pos < t->sampler.per_replica) {
            int64_t left = t->sampler.per_replica - t->epoch_pos;
            int nb = (int)(left < s->batch_per_device ? left : s->batch_per_device);
            if (micro_step(t, &clock, nb, err)) return -1;
            if (t->micro < s->grad_accum_steps) continue;
            t->micro = 0;
            int stop, ckpt;
            if (optimizer_step(t, &clock, &stop, &ckpt, err)) return -1;
            int rc = after_step(t, stop, ckpt, err);
            if (rc) return rc;
        }
        // AstrAI's on_epoch_end row: the epoch is complete.
        if (t->rank == 0 &&
            metric_log_append_epoch(&t->metrics, t->step, t->epoch, t->consumed_samples, err))
            return -1;
    }
    return 0;
}

int trainer_run(Trainer *t, Err *err) {
    int rc = run_epochs(t, err);
    // The end waits for the background write in flight: it is committed before the exit.
    if (rc >= 0 && (report_phase(t, "checkpoint", err) || collect_checkpoint(t, err) ||
                    report_phase(t, "", err)))
        rc = -1;
    if (rc < 0) return -1;
    if (rc == RUN_DONE) {
        // The last epoch is complete.
        t->epoch = t->spec->n_epoch - 1;
        t->epoch_pos = t->sampler.per_replica;
        if (t->step != t->last_ckpt_step && (save_checkpoint(t, err) || collect_checkpoint(t, err)))
            return -1;
        if (t->rank == 0) fprintf(stderr, "done: %ld optimizer steps\n", t->step);
    }
    if (write_memory_report(t, err)) return -1;
    return rc == RUN_STOPPED;
}

void trainer_free(Trainer *t) {
    ckpt_writer_free(&t->writer);
    train_ckpt_pending_free(&t->pending);
    progress_close(&t->progress);
    metric_log_free(&t->metrics);
    free(t->inputs);
    free(t->targets);
    free(t->loss_mask);
    free(t->position_ids);
    pref_batch_free(&t->pb);
    pref_free(&t->pref_loss);
    records_free(&t->records);
    optim_free(&t->opt);
    executor_free(&t->exec);
    for (long k = 0; t->staged && k < t->spec->grad_accum_steps; k++)
        free(t->staged[k].ids);
    free(t->staged);
    pipe_pref_free(t);
    pipeline_free(&t->pipe); // also what a pipeline_init that failed half-way made
    sampler_free(&t->sampler);
    dataset_close(&t->data);
    model_free(&t->model);
}
