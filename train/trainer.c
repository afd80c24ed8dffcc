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
#include "train/step.h"
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

// Tokens per sample window: window_size, or the model's context.
static int64_t window_of(const TrainSpec *s, const ModelConfig *cfg) {
    return s->window_size ? s->window_size : cfg->max_position_embeddings;
}

// The objective's samples (windows of the token stream; dpo, grpo: records in rows of at most a
// window) and the sampler's split of them.
static int open_data(Trainer *t, const ObjectiveOps *ops, const ModelConfig *cfg, const Backend *be,
                     Err *err) {
    const TrainSpec *s = t->spec;
    int64_t window = window_of(s, cfg);
    if (window > cfg->max_position_embeddings)
        return err_set(err, "window_size: %ld is larger than max_position_embeddings %d",
                       (long)window, cfg->max_position_embeddings);
    ObjectiveSetup setup = {.spec = s,
                            .cfg = cfg,
                            .window = window,
                            .stride = s->stride ? s->stride : window,
                            .batch = (int)s->batch_per_device,
                            .rank = t->rank,
                            .be = be,
                            .slots = (int)s->grad_accum_steps,
                            .exec = &t->exec,
                            .model = &t->model};
    if (objective_open(&t->obj, ops, &setup, err)) return -1;
    return sampler_init_split(&t->sampler, t->obj.n_samples, s->val_split, t->replicas, t->replica,
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

// The optimizer step's micro-batches, staged until its last one arrives.
static int alloc_step(Trainer *t, Err *err) {
    size_t M = (size_t)t->spec->grad_accum_steps, B = (size_t)t->spec->batch_per_device;
    t->batches = calloc(M, sizeof *t->batches);
    t->batch_ids = malloc(M * B * sizeof *t->batch_ids);
    if (!t->batches || !t->batch_ids)
        return err_resource(err, "the %zu micro-batches of a step: out of memory", M);
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

// This rank's stage of pp_size (the one stage of the whole model without a pipeline) and its
// replica (train/pipeline.h). --dry-run: one process, whose pp_size is only checked against the
// model.
static int setup_pipeline(Trainer *t, const ModelConfig *cfg, const TrainerOptions *opt, Err *err) {
    const TrainSpec *s = t->spec;
    int stages = s->pp_size > 1 && !opt->dry_run ? (int)s->pp_size : 1;
    if (opt->dry_run && s->pp_size > 1 && pipeline_check(cfg, (int)s->pp_size, err)) return -1;
    if (pipeline_init(&t->pipe, opt->dry_run ? NULL : opt->comm, stages,
                      pipeline_kind(s->is.pp_schedule), cfg, (long)window_of(s, cfg), opt->be, err))
        return -1;
    t->replica = t->pipe.replica;
    t->replicas = t->pipe.replicas;
    if (stages > 1 && s->grad_accum_steps < s->pp_size && t->rank == 0)
        fprintf(stderr,
                "warning: grad_accum_steps %ld < pp_size %ld: each optimizer step's %ld "
                "micro-batch(es) fill the %ld stages only in part; the stages idle %.0f%% of a "
                "step ((P-1)/(M+P-1))\n",
                s->grad_accum_steps, s->pp_size, s->grad_accum_steps, s->pp_size,
                100 * pp_bubble_fraction((int)s->pp_size, (int)s->grad_accum_steps));
    return 0;
}

static int experts_all_to_all(void *comm, const void *send, const size_t *send_bytes, void *recv,
                              const size_t *recv_bytes, Err *err) {
    return comm_all_to_all(comm, send, send_bytes, recv, recv_bytes, err);
}

// Expert parallelism (--ep_size E, docs/design.md §7a): the stage's replicas in groups of E
// consecutive ones, each group sharing out the routed experts of every MoE layer. The executor
// still spans every replica: a rank's gradients of the experts it does not compute stay zero, so
// the average over replicas gives each expert the sum over the groups that computed it.
// --dry-run: checked against the model only.
static int setup_experts(Trainer *t, const TrainerOptions *opt, Err *err) {
    int E = (int)t->spec->ep_size;
    if (E == 1) return 0;
    if (!opt->dry_run && t->replicas % E)
        return err_set(err, "ep_size: %d does not divide the job's %d data-parallel replica(s)", E,
                       t->replicas);
    if (!opt->dry_run && comm_split(t->pipe.group, t->replica / E, t->replica, &t->experts, err))
        return err_prefix(err, "ep_size %d: the expert group", E);
    ExpertGroup g = {
        .size = E, .rank = t->replica % E, .all_to_all = experts_all_to_all, .ctx = t->experts};
    return model_set_expert_group(&t->model, &g, err);
}

// Whether every rank must run every forward: the executor's gathers, or the experts' exchanges.
static bool forwards_collective(const Trainer *t) {
    return executor_forward_collective(&t->exec) || t->model.experts.size > 1;
}

// The supervisor's control pipe, read without blocking (poll_control).
static void open_control(Trainer *t, int fd) {
    t->control_fd = fd;
    if (fd >= 0) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// The optimizer over what this rank steps (the executor's view), with the spec's knobs.
static int create_optimizer(Trainer *t, Err *err) {
    const TrainSpec *s = t->spec;
    OptimizerKind kind = s->is.optimizer == OPTIMIZER_ADAMW ? OPT_ADAMW : OPT_MUON;
    ParamView view = executor_view(&t->exec, &t->model);
    if (optim_create(&t->opt, kind, &view, (float)s->weight_decay, err)) return -1;
    t->opt.momentum = (float)s->muon_momentum;
    t->opt.nesterov = s->muon_nesterov;
    t->opt.ns_steps = (int)s->muon_ns_steps;
    t->opt.adjust_lr_original = s->is.muon_adjust_lr == MUON_LR_ORIGINAL;
    return 0;
}

int trainer_init(Trainer *t, const TrainSpec *spec, const TrainerOptions *opt, Err *err) {
    memset(t, 0, sizeof *t);
    t->spec = spec;
    const ObjectiveOps *objective = objective_of(spec->is.train_type);
    bool reference = objective && objective->reference;
    t->rank = opt->comm ? comm_rank(opt->comm) : 0;
    t->world = opt->comm ? comm_world_size(opt->comm) : 1;
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
    if (reference && train_ckpt_reference_dir(spec, resume_dir, t->rank, t->reference_dir,
                                              sizeof t->reference_dir, err))
        return -1;
    if (ckpt_model_config(&cfg, model_dir, err) || setup_pipeline(t, &cfg, opt, err) ||
        open_data(t, objective, &cfg, opt->be, err) || set_total_steps(t, err))
        return -1;
    if (t->rank == 0 && cfg.rope_scaling.kind == ROPE_SCALING_IGNORED)
        fprintf(stderr,
                "warning: %s/config.json: rope_scaling type '%s' is not one astrai (or AstrAI) "
                "computes: the RoPE base stays rope_theta, as AstrAI leaves it\n",
                model_dir, cfg.rope_scaling.ignored_type);
    t->memory_report = opt->memory_report;
    if (t->memory_report) t->rss_baseline = resident_bytes();
    t->rss_ckpt_max = -1;
    // DPO/GRPO: the reference's weights first, kept frozen; then the policy's when they differ.
    const char *first_dir = reference ? t->reference_dir : model_dir;
    if (train_ckpt_load_model(&t->model, &cfg, t->pipe.first_block, t->pipe.end_block, opt->be,
                              first_dir, err))
        return -1;
    t->model.grad_checkpointing = spec->gradient_checkpointing;
    t->model.neftune_alpha = (float)spec->neftune_alpha;
    if (setup_experts(t, opt, err)) return -1;
    if (executor_init(&t->exec, exec_mode(spec->is.parallel_mode), t->pipe.group, opt->comm,
                      &t->model, (size_t)(spec->bucket_mb * (1 << 20)), err))
        return -1;
    t->exec.norm_skip = pipeline_norm_skip(&t->pipe, &t->model);
    if (reference &&
        (executor_keep_reference(&t->exec, &t->model, err) ||
         (strcmp(first_dir, model_dir) && train_ckpt_load_weights(&t->model, model_dir, err))))
        return -1;
    if (executor_adopt_weights(&t->exec, &t->model, err)) return -1;
    schedule_init(&t->sched, schedule_kind(spec->is.schedule_type), t->total_steps,
                  spec->warmup_ratio, spec->min_rate, spec->stable_steps, spec->decay_steps,
                  spec->cycle_length, spec->t_mult);
    if (grad_scaler_init(&t->scaler, spec, err)) return -1;
    if (create_optimizer(t, err)) return -1;
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
    if (samples_open(&t->samples, t, err)) return -1;
    return alloc_step(t, err);
}

// What runs this rank's passes of micro-batches.
static StepRunner step_runner(Trainer *t) {
    return (StepRunner){.pipe = &t->pipe, .exec = &t->exec, .model = &t->model, .obj = &t->obj};
}

// The weight of a micro-batch's loss in backward: 1/grad_accum_steps (the step's loss is the
// mean of its micro-batches'), times the loss scale S (--loss_scale; 1 without), which
// optimizer_step divides out of the gradients again. An S too large for a float gives inf: an
// overflow, which the scaler backs off from.
static float micro_weight(const Trainer *t) {
    return test_seam_loss_weight(t->rank, t->step + 1,
                                 (float)(t->scaler.scale / (double)t->spec->grad_accum_steps));
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
} StepClock;

// Summed over ranks at a step boundary: the step's losses, the requests (docs/design.md §5): a
// request that reached any rank applies to all, so they stop or checkpoint at the same step; and
// the executor's slot, where it sums the squared norms of the gradients (executor_agree_step).
// The objective adds its metrics' sums (ObjectiveOps.step_metrics).
enum {
    AGREE_LOSS,
    AGREE_STOP,
    AGREE_CKPT,
    AGREE_NORM,
    AGREE_METRICS,                                             // OBJECTIVE_MAX_METRICS slots
    AGREE_CKPT_FAILED = AGREE_METRICS + OBJECTIVE_MAX_METRICS, // a rank's background checkpoint
                                                               // write failed: every rank stops
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
    double metrics[OBJECTIVE_MAX_METRICS]; // the objective's, means over the micro-steps
    bool overflow;                         // the loss or a gradient on some rank is not finite
} StepTotals;

static int agree_step(Trainer *t, StepTotals *out, Err *err) {
    double stats[MODEL_N_STATS];
    model_read_stats(&t->model, stats);
    poll_control(t);
    bool written;
    poll_checkpoint(t, &written);
    // The backend's first failure (engine/backend.h), checked once per step before anything of
    // the step is applied or written.
    Err backend_err = {0};
    bool backend_failed = t->model.be->failure(&backend_err) != 0;
    float agreed[AGREE_N] = {[AGREE_LOSS] = (float)stats[MODEL_STAT_LOSS],
                             [AGREE_STOP] = (float)(trainer_stop_requested != 0),
                             [AGREE_CKPT] = (float)(trainer_checkpoint_requested != 0),
                             [AGREE_CKPT_FAILED] = (float)t->ckpt_failed,
                             [AGREE_BACKEND_FAILED] = (float)backend_failed,
                             [AGREE_CKPT_WRITTEN] = (float)written};
    if (t->obj.ops->step_metrics) t->obj.ops->step_metrics(&t->obj, stats, agreed + AGREE_METRICS);
    trainer_checkpoint_requested = 0;
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
    for (int k = 0; k < OBJECTIVE_MAX_METRICS; k++)
        out->metrics[k] = agreed[AGREE_METRICS + k] / micro_steps;
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

// The held-out windows' mean loss (--val_split), the same on every rank: replica r evaluates
// windows val_ids[r], val_ids[r + replicas], ... in micro-batches of batch_per_device, forward
// only. A batch's mean loss counts once per window in it (for seq, every window has the
// same number of target tokens, so this is the mean of the windows' own losses); the sum
// and the window count are added over ranks (in a pipeline, the last stage's). Where forward is
// collective (fsdp gathers the weights in each; experts exchange pairs), every replica runs the
// same number of micro-batches: one left without a window in one evaluates val_ids[0] with
// weight 0.
static int validate(Trainer *t, double *val_loss, Err *err) {
    const Sampler *sp = &t->sampler;
    int64_t B = t->spec->batch_per_device, R = t->replicas, r = t->replica;
    int64_t per_rank = (sp->n_val + R - 1) / R;
    int64_t mine = sp->n_val > r ? (sp->n_val - r + R - 1) / R : 0;
    MicroBatch *list = malloc((size_t)((per_rank + B - 1) / B + 1) * sizeof *list);
    if (!list) return err_resource(err, "validation: out of memory");
    int n = 0;
    for (int64_t first = 0; first < per_rank; first += B) {
        int64_t nb = mine - first < B ? mine - first : B;
        if (nb < 0) nb = 0;
        if (nb == 0 && !forwards_collective(t)) continue;
        list[n++] =
            nb ? (MicroBatch){.ids = sp->val_ids + first * R + r, .stride = R, .nb = (int)nb}
               : (MicroBatch){.ids = sp->val_ids, .stride = 1};
    }
    double sum = 0;
    StepRunner runner = step_runner(t);
    int rc = step_eval(&runner, list, n, &sum, err);
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

// The objective's numbers of the step, after grad_norm in the step row.
static void add_objective_metrics(const Trainer *t, StepRow *row, const double *metrics) {
    row->n_extra = objective_n_metrics(&t->obj);
    for (int k = 0; k < row->n_extra; k++)
        row->extra[k] = (StepExtra){.name = t->obj.metrics[k], .value = metrics[k]};
}

// Under loss scaling, the scale the step's backward ran with and whether it was skipped.
static void add_scaler_metrics(const Trainer *t, StepRow *row, double scale, bool skipped) {
    if (!grad_scaler_on(&t->scaler)) return;
    row->extra[row->n_extra++] = (StepExtra){.name = "loss_scale", .value = scale};
    row->extra[row->n_extra++] = (StepExtra){.name = "skipped", .value = skipped};
}

// The most and least loaded routed expert of any layer, relative to its layer's mean (load:
// (L, E) pairs per expert), as the step row's expert_load_max and expert_load_min.
static void add_load_extremes(StepRow *row, const float *load, int L, int E) {
    double most = 0, least = INFINITY;
    for (int l = 0; l < L; l++) {
        double total = 0, hi = 0, lo = INFINITY;
        for (int e = 0; e < E; e++) {
            double v = load[(size_t)l * E + e];
            total += v;
            hi = fmax(hi, v);
            lo = fmin(lo, v);
        }
        if (total <= 0) continue; // a layer without tokens this step (none in practice)
        most = fmax(most, hi * E / total);
        least = fmin(least, lo * E / total);
    }
    if (!isfinite(least)) return;
    row->extra[row->n_extra++] = (StepExtra){.name = "expert_load_max", .value = most};
    row->extra[row->n_extra++] = (StepExtra){.name = "expert_load_min", .value = least};
}

// A mixture of experts' load of the step (docs/design.md §7a): the pairs each routed expert of
// each layer received in the step's training forwards, summed over ranks (every rank calls it;
// a pipeline stage counts only its blocks); rank 0 records them (progress.db) and the extremes
// (the step row). The counts start again at zero.
static int record_expert_load(Trainer *t, StepRow *row, Err *err) {
    Model *m = &t->model;
    if (!m->expert_tokens) return 0;
    int L = m->cfg.num_hidden_layers, E = m->cfg.n_routed_experts;
    size_t n = (size_t)L * E;
    float *load = malloc(n * sizeof *load);
    if (!load) return err_resource(err, "expert load: out of memory for %zu counts", n);
    for (size_t i = 0; i < n; i++)
        load[i] = (float)m->expert_tokens[i];
    int rc = 0;
    for (size_t at = 0; at < n && !rc; at += EXEC_AGREE_MAX)
        rc = executor_sum(&t->exec, load + at,
                          (int)(n - at < EXEC_AGREE_MAX ? n - at : EXEC_AGREE_MAX), err);
    if (!rc && t->rank == 0) {
        add_load_extremes(row, load, L, E);
        rc = progress_add_expert_load(&t->progress, row->step, L, E, load, err);
    }
    free(load);
    model_reset_expert_tokens(m);
    return rc;
}

// Validation's mean loss, recorded by rank 0 (metric.jsonl, progress.db, the log).
static int validate_and_record(Trainer *t, Err *err) {
    double val_loss;
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
    model_reset_expert_tokens(&t->model); // the load counts training forwards only
    return 0;
}

// Rank 0 records the step's row (metric.jsonl, progress.db) and logs every log_interval-th,
// the first and the last.
static int record_step(Trainer *t, const StepClock *c, const StepRow *row, double now, Err *err) {
    if (t->rank != 0) return 0;
    if (metric_log_append(&t->metrics, row, err) || progress_add_step(&t->progress, row, err))
        return -1;
    if (t->step % t->spec->log_interval == 0 || t->step == 1 || t->step == t->total_steps) {
        char line[256];
        double eta =
            (now - c->run_start) / (double)c->steps_run * (double)(t->total_steps - t->step);
        progress_format_line(line, sizeof line, row, t->total_steps, eta);
        fprintf(stderr, "%s\n", line);
    }
    return 0;
}

static int optimizer_step(Trainer *t, StepClock *c, int *stop, int *ckpt, Err *err) {
    const TrainSpec *s = t->spec;
    ParamView view = executor_view(&t->exec, &t->model);
    StepTotals tot;
    if (agree_step(t, &tot, err)) return -1;
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
    add_objective_metrics(t, &row, tot.metrics);
    add_scaler_metrics(t, &row, scale, skipped);
    if (record_expert_load(t, &row, err)) return -1;
    c->steps_run++;
    if (t->memory_report) {
        long rss = resident_bytes() - t->rss_baseline;
        if (rss > t->rss_state_max) t->rss_state_max = rss;
    }
    // The validation row goes first, as AstrAI's: a reader that sees the step sees its
    // validation too.
    if ((validation_due(t) && validate_and_record(t, err)) || record_step(t, c, &row, now, err))
        return -1;
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

// A micro-batch joins the optimizer step (its samples, its noise stream, what the objective
// counts of it); the step's last one runs them all through this rank's stage (train/step.h).
static int micro_step(Trainer *t, StepClock *c, int nb, Err *err) {
    MicroBatch *mb = &t->batches[t->micro];
    int64_t *ids = t->batch_ids + t->micro * t->spec->batch_per_device;
    memcpy(ids, t->sampler.order + t->epoch_pos, (size_t)nb * sizeof *ids);
    *mb = (MicroBatch){.ids = ids,
                       .stride = 1,
                       .nb = nb,
                       .noise_seed = noise_seed(t),
                       .index = (int)t->micro,
                       .step = t->step + 1};
    if (t->micro == 0) t->step_from = (RunPosition){t->epoch, t->epoch_pos, t->consumed_samples};
    long tokens;
    if (t->obj.ops->stage(&t->obj, mb, t->model.has_head, &tokens, err)) return -1;
    c->tokens += tokens;
    t->epoch_pos += nb;
    t->consumed_samples += (long)nb * t->replicas;
    t->micro++;
    if (t->micro < t->spec->grad_accum_steps) return 0;
    StepRunner runner = step_runner(t);
    return step_train(&runner, t->batches, (int)t->micro, micro_weight(t), err);
}

// How the epochs loop ended.
enum { RUN_DONE, RUN_STOPPED, RUN_MAX_STEPS };

// After an optimizer step: checkpoint when due or requested. Returns 0 to go on, RUN_MAX_STEPS
// at --max_steps (the end of this run), RUN_STOPPED on an agreed stop request (before the end).
static int after_step(Trainer *t, int stop, int ckpt, Err *err) {
    int at_max = t->spec->max_steps > 0 && t->step >= t->spec->max_steps;
    int due = t->step - t->last_ckpt_step >= t->spec->ckpt_interval;
    // Before the checkpoint: a crash between them leaves the samples to a step the resumed run
    // forgets and generates again.
    bool end = stop || at_max || t->step == t->total_steps;
    if (samples_after_step(&t->samples, t, end, err)) return -1;
    if ((due || stop || ckpt || at_max) && save_checkpoint(t, err)) return -1;
    if ((stop || at_max) && t->rank == 0)
        fprintf(stderr, "stopped at step %ld of %ld\n", t->step, t->total_steps);
    return at_max ? RUN_MAX_STEPS : stop ? RUN_STOPPED : 0;
}

// With a memory report directory DIR (TrainerOptions), each rank writes DIR/rank<R>.json: the most
// resident bytes it held above its pre-model baseline between optimizer steps (parameters,
// gradients, optimizer state, activations), as measured by the kernel; the bytes of its
// activation sets (a pipeline stage holds one per micro-batch in flight); its stage (0 without
// a pipeline) and the seconds its training steps spent computing and in transfers (none without
// a pipeline); the most resident bytes a checkpoint added while it was taken (VmHWM over it above
// VmRSS before it; -1: the kernel would not restart the peak).
static int write_memory_report(const Trainer *t, Err *err) {
    const char *dir = t->memory_report;
    if (!dir) return 0;
    char name[64], path[4096], text[320];
    snprintf(name, sizeof name, "rank%d.json", t->rank);
    int n = snprintf(text, sizeof text,
                     "{\"rank\": %d, \"state_bytes\": %ld, \"activation_bytes\": %zu, "
                     "\"stage\": %d, \"compute_s\": %.6f, \"transfer_s\": %.6f, "
                     "\"ckpt_bytes\": %ld}\n",
                     t->rank, t->rss_state_max, model_activation_bytes(&t->model), t->pipe.stage,
                     t->pipe.compute_s, t->pipe.transfer_s, t->rss_ckpt_max);
    return path_join(path, sizeof path, dir, name, err) ||
           fs_write_file_atomic(path, text, (size_t)n, err);
}

// A step the objective refused before anything of it was applied (ObjectiveOps.stage: a reward
// that did not come, agreed by every rank): the run's position goes back to the step's start and
// every rank checkpoints it, so that --resume retries the step; the failure stands.
static int checkpoint_refused_step(Trainer *t) {
    if (!t->obj.stop_checkpoint) return -1;
    t->epoch = t->step_from.epoch;
    t->epoch_pos = t->step_from.epoch_pos;
    t->consumed_samples = t->step_from.consumed_samples;
    t->micro = 0;
    sampler_set_epoch(&t->sampler, t->epoch);
    Err ckpt_err = {0};
    if (t->step != t->last_ckpt_step &&
        (save_checkpoint(t, &ckpt_err) || collect_checkpoint(t, &ckpt_err)) && t->rank == 0)
        fprintf(stderr, "checkpoint after the refused step failed: %s\n", ckpt_err.msg);
    return -1;
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
            if (micro_step(t, &clock, nb, err)) return checkpoint_refused_step(t);
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
        // The end (its step's samples already taken unless the run ended short of total_steps).
        if (samples_after_step(&t->samples, t, true, err)) return -1;
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
    samples_close(&t->samples);
    metric_log_free(&t->metrics);
    free(t->batches);
    free(t->batch_ids);
    objective_close(&t->obj);
    optim_free(&t->opt);
    executor_free(&t->exec);
    if (t->experts) comm_destroy(t->experts);
    pipeline_free(&t->pipe); // also what a pipeline_init that failed half-way made
    sampler_free(&t->sampler);
    model_free(&t->model);
}
