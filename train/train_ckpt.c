// train_ckpt.c: a run's checkpoints, written and resumed (train/train_ckpt.h). Every
// parallel mode writes the same files: the executor gathers the full weights and optimizer
// state on every rank (executor_gather_full) and rank 0 writes them; resuming, the executor
// takes this rank's part of them (executor_load_optim).
#include "train/train_ckpt.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/checkpoint.h"
#include "ckpt/hf.h"
#include "ckpt/meta.h"
#include "ckpt/shards.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"
#include "train/ckpt_writer.h"
#include "train/trainer.h"

#define PATH_CAP 4096

int train_ckpt_locate(const TrainSpec *spec, char *out, size_t cap, Err *err) {
    char meta[PATH_CAP];
    if (path_join(meta, sizeof meta, spec->param_path, "meta.json", err)) return -1;
    if (fs_is_file(meta)) {
        snprintf(out, cap, "%s", spec->param_path);
        return 0;
    }
    int rc = ckpt_find_latest(spec->ckpt_dir, out, cap, err);
    if (rc == 1)
        return err_set(err,
                       "resume: no checkpoint in param_path %s (no meta.json) nor in ckpt_dir %s",
                       spec->param_path, spec->ckpt_dir);
    return rc;
}

// A run continues the lineage of the checkpoint it resumed from when that is the last its run
// committed (a pause, a crash, a restart); from an older one (a branch), or fresh, it is a new
// run, whose retention leaves the other run's checkpoints alone.
void train_ckpt_choose_run(const TrainSpec *spec, const char *resume_dir, int rank) {
    char run[64];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(run, sizeof run, "%lx%05lx-%ld", (long)ts.tv_sec, (long)(ts.tv_nsec >> 12) & 0xfffff,
             (long)getpid());
    CkptEntry *all;
    int n;
    bool has_ledger;
    Err ignored;
    if (ckpt_list(spec->ckpt_dir, &all, &n, &has_ledger, &ignored)) {
        ckpt_set_run(run);
        return;
    }
    const char *resumed = strrchr(resume_dir, '/');
    resumed = resumed ? resumed + 1 : resume_dir;
    for (int i = 0; i < n; i++) {
        const CkptEntry *e = &all[i];
        if (!e->ours && has_ledger && rank == 0)
            fprintf(stderr,
                    "checkpoints: %s/%s is not one astrai committed into this ckpt_dir (not in "
                    "its %s): never resumed from unless named by --param_path, never deleted\n",
                    spec->ckpt_dir, e->name, CKPT_LEDGER);
    }
    // The list is newest first: the resumed one continues its run if no later commit has it.
    for (int i = 0; *resumed && i < n; i++) {
        if (!all[i].ours || strcmp(all[i].name, resumed)) continue;
        bool newest = true;
        for (int j = 0; j < i; j++)
            newest &= !(all[j].ours && !strcmp(all[j].run, all[i].run));
        if (newest && strcmp(all[i].run, "-")) snprintf(run, sizeof run, "%s", all[i].run);
        break;
    }
    free(all);
    ckpt_set_run(run);
}

static void print_cleaned(void *ctx, const char *what) {
    (void)ctx;
    fprintf(stderr, "ckpt_dir cleanup: %s\n", what);
}

int train_ckpt_clean_dir(const TrainSpec *spec, Err *err) {
    return ckpt_remove_stale(spec->ckpt_dir, print_cleaned, NULL, err);
}

// The marker's name and content: "ckpt_dir/.astrai-shared-<32 hex digits>" holding the digits.
#define MARKER_HEX 32

static int write_marker(const char *dir, char *hex, char *path, size_t cap, Err *err) {
    uint8_t raw[MARKER_HEX / 2];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw)
        return err_errno(err, errno, "ckpt_dir %s: no random bytes for its marker", dir);
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(hex + 2 * i, 3, "%02x", raw[i]);
    snprintf(path, cap, "%s/.astrai-shared-%s", dir, hex);
    return fs_mkdir_p(dir, err) || fs_write_file_synced(path, hex, MARKER_HEX, err);
}

// 1 when this rank reads rank 0's marker (named and holding hex) in dir.
static int sees_marker(const char *dir, const char *hex) {
    char path[4096], *data = NULL;
    size_t len = 0;
    Err ignored = {0};
    snprintf(path, sizeof path, "%s/.astrai-shared-%s", dir, hex);
    int ok = fs_read_file(path, &data, &len, &ignored) == 0 && len == MARKER_HEX &&
             !memcmp(data, hex, MARKER_HEX);
    free(data);
    return ok;
}

// The error naming the ranks (and their hosts) that do not see the marker.
static int not_shared(const char *dir, const float *seen, int world, const char *const *hosts,
                      Err *err) {
    char list[512] = "";
    size_t used = 0;
    for (int r = 0; r < world && used < sizeof list - 80; r++)
        if (seen[r] < 0.5f)
            used += (size_t)snprintf(list + used, sizeof list - used, "%srank %d (%s)",
                                     used ? ", " : "", r, hosts ? hosts[r] : "?");
    return err_set(err,
                   "ckpt_dir %s is not the same directory on every host: %s cannot read the "
                   "marker rank 0 wrote there; sharded checkpoints and --resume need a directory "
                   "every host sees (a shared filesystem)",
                   dir, list);
}

int train_ckpt_check_shared_dir(const TrainSpec *spec, Comm *comm, const char *const *hosts,
                                Err *err) {
    int rank = comm_rank(comm), world = comm_world_size(comm);
    char hex[MARKER_HEX + 1] = "", path[4096] = "";
    // A rank 0 that cannot write its marker still takes part, with an empty name nobody sees.
    Err write_err = {0};
    int wrote = rank != 0 || !write_marker(spec->ckpt_dir, hex, path, sizeof path, &write_err);
    if (comm_broadcast(comm, hex, sizeof hex, 0, err)) return -1;
    float mine = hex[0] && sees_marker(spec->ckpt_dir, hex),
          *seen = malloc(sizeof(float) * (size_t)world);
    if (!seen) return err_resource(err, "ckpt_dir check: out of memory for %d ranks", world);
    int rc = comm_all_gather(comm, &mine, seen, 1, DT_F32, err);
    if (rank == 0 && path[0]) unlink(path);
    if (!rc && !wrote) {
        *err = write_err;
        rc = -1;
    } else if (!rc && !hex[0]) {
        rc = err_set(err, "ckpt_dir %s: rank 0 could not write its marker (its log says why)",
                     spec->ckpt_dir);
    }
    for (int r = 0; !rc && r < world; r++)
        if (seen[r] < 0.5f) rc = not_shared(spec->ckpt_dir, seen, world, hosts, err);
    free(seen);
    return rc;
}

// A Hugging Face model directory (config.json with an HF model_type) is converted as it is
// read, in memory (ckpt/hf.h): the source is never written.
int train_ckpt_load_weights(Model *m, const char *dir, Err *err) {
    char what[PATH_CAP];
    StFile f;
    bool hf;
    if (hf_is_model_dir(dir, &hf, err)) return -1;
    if (hf) {
        if (hf_open_weights(&f, dir, err)) return -1;
        snprintf(what, sizeof what, "%s (converted from Hugging Face's layout)", dir);
    } else if (shards_open(&f, dir, "model", what, sizeof what, err)) {
        return -1;
    }
    int rc = model_load_st(m, &f, what, err);
    st_close(&f);
    return rc;
}

int train_ckpt_load_model(Model *m, const ModelConfig *cfg, int first_block, int end_block,
                          const Backend *be, const char *dir, Err *err) {
    return model_create_stage(m, cfg, first_block, end_block, be, err) ||
           train_ckpt_load_weights(m, dir, err);
}

int train_ckpt_reference_dir(const TrainSpec *spec, const char *resume_dir, int rank, char *out,
                             size_t cap, Err *err) {
    snprintf(out, cap, "%s", spec->param_path);
    if (strcmp(resume_dir, spec->param_path) != 0) return 0; // a fresh run, or from ckpt_dir
    char path[PATH_CAP];
    CkptMeta meta;
    if (path_join(path, sizeof path, resume_dir, "meta.json", err) || meta_load(&meta, path, err))
        return -1;
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(meta.config, "reference_path");
    int rc = 0;
    if (cJSON_IsString(ref) && *ref->valuestring)
        snprintf(out, cap, "%s", ref->valuestring);
    else if (ref)
        rc = err_set(err, "%s: \"reference_path\" must be a directory name", path);
    else if (rank == 0) // written by AstrAI, whose reference is the model it resumes
        fprintf(stderr,
                "warning: %s names no reference_path: the reference model is this "
                "checkpoint's weights\n",
                path);
    meta_free(&meta);
    return rc;
}

static char *json_text(cJSON *obj) {
    char *text = obj ? cJSON_Print(obj) : NULL;
    cJSON_Delete(obj);
    return text;
}

static char *meta_text(const Trainer *t) {
    CkptMeta m = {.epoch = t->epoch,
                  .consumed_samples = t->consumed_samples,
                  .step = t->step,
                  .config = train_spec_to_json(t->spec)};
    // DPO/GRPO: where the frozen reference comes from when this checkpoint is resumed.
    if (m.config && t->obj.ops->reference &&
        !cJSON_AddStringToObject(m.config, "reference_path", t->reference_dir))
        cJSON_Delete(m.config), m.config = NULL;
    meta_stamp_now(&m);
    char *text = m.config ? meta_to_json(&m) : NULL;
    meta_free(&m);
    return text;
}

static char *scheduler_text(const Trainer *t) {
    const Schedule *s = &t->sched;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "schedule_type", t->spec->schedule_type);
    cJSON_AddNumberToObject(o, "last_epoch", (double)t->step);
    cJSON_AddNumberToObject(o, "total_steps", (double)s->total_steps);
    cJSON_AddNumberToObject(o, "warmup_steps", (double)s->warmup_steps);
    cJSON_AddNumberToObject(o, "min_rate", s->min_rate);
    cJSON_AddNumberToObject(o, "stable_steps", (double)s->stable_steps);
    cJSON_AddNumberToObject(o, "decay_steps", (double)s->decay_steps);
    cJSON_AddNumberToObject(o, "cycle_length", (double)s->cycle_length);
    cJSON_AddNumberToObject(o, "t_mult", (double)s->t_mult);
    // Loss scaling's state (docs/design.md §15), as PyTorch's GradScaler state_dict keeps it.
    if (t->scaler.mode == LOSS_SCALE_DYNAMIC) {
        cJSON_AddNumberToObject(o, "loss_scale", t->scaler.scale);
        cJSON_AddNumberToObject(o, "loss_scale_growth_tracker", (double)t->scaler.growth_tracker);
    }
    return json_text(o);
}

// The sampler position is kept in global samples so a run can resume with
// another number of ranks.
static char *sampler_text(const Trainer *t) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "epoch", (double)t->epoch);
    cJSON_AddNumberToObject(o, "epoch_samples", (double)(t->epoch_pos * t->replicas));
    cJSON_AddNumberToObject(o, "n_samples", (double)t->obj.n_samples);
    cJSON_AddNumberToObject(o, "seed", (double)t->spec->random_seed);
    cJSON_AddBoolToObject(o, "shuffle", t->spec->shuffle);
    return json_text(o);
}

static char *metric_jsonl_text(const Trainer *t) {
    size_t len;
    return metric_log_to_jsonl(&t->metrics, &len);
}

static void render_texts(const Trainer *t, char *texts[CKPT_N_TEXTS]) {
    texts[CKPT_META] = meta_text(t);
    texts[CKPT_CONFIG] = model_config_to_json(&t->model.cfg);
    texts[CKPT_SCHEDULER] = scheduler_text(t);
    texts[CKPT_SAMPLER] = sampler_text(t);
    texts[CKPT_METRIC] = metric_jsonl_text(t);
}

static void free_texts(char *texts[CKPT_N_TEXTS]) {
    for (int k = 0; k < CKPT_N_TEXTS; k++)
        free(texts[k]);
}

static DType ckpt_dtype(const Trainer *t) {
    return t->spec->is.ckpt_dtype == CKPT_BF16 ? DT_BF16 : DT_F32;
}

// --ckpt_format full: every rank takes part in gathering the full weights and optimizer state
// (the executor's concern: under none they are the rank's own; a pipeline's stages then go to
// rank 0); rank 0 writes them, or (--async_checkpoint) copies them to host memory for its writer
// thread.
static int save_full(Trainer *t, const char *name, bool *background, Err *err) {
    const Optimizer *full = NULL;
    ParamView whole;
    PipelineParts parts = {0};
    *background = t->spec->async_checkpoint && t->rank == 0;
    int rc = executor_gather_full(&t->exec, &t->model, &t->opt, &full, err);
    if (!rc && t->pipe.stages > 1) {
        rc = pipeline_collect(&t->pipe, &t->model, full, &parts, err);
    } else if (!rc) {
        whole = model_view(&t->model);
        parts = (PipelineParts){.n = 1, .views = &whole, .opts = &full};
    }
    if (!rc && t->rank == 0) {
        char *texts[CKPT_N_TEXTS];
        render_texts(t, texts);
        CkptContent c = {.ckpt_dir = t->spec->ckpt_dir,
                         .name = name,
                         .dtype = ckpt_dtype(t),
                         .texts = texts,
                         .n_parts = parts.n,
                         .views = parts.views,
                         .opts = parts.opts};
        rc = *background ? ckpt_writer_start(&t->writer, &c, t->step, t->epoch, err)
                         : ckpt_write(&c, err);
        free_texts(texts);
    }
    if (t->pipe.stages > 1) pipeline_parts_free(&parts);
    executor_drop_full(&t->exec, &t->model);
    return rc;
}

// Rank 0 makes the temporary directory of a sharded checkpoint; every rank learns whether it
// could and its path (named by rank 0's pid, which travels as two floats exact below 2^24).
static int sharded_begin(Trainer *t, const char *name, char *tmp, Err *err) {
    const char *dir = t->spec->ckpt_dir;
    float v[3] = {0, 0, 0};
    int rc = 0;
    if (t->rank == 0) {
        long pid = (long)getpid();
        rc = ckpt_begin(dir, name, tmp, PATH_CAP, err);
        v[0] = rc != 0;
        v[1] = (float)(pid & 0xFFF);
        v[2] = (float)(pid >> 12);
    }
    if (executor_sum(&t->exec, v, 3, rc ? NULL : err)) return -1;
    if (rc) return -1;
    if (v[0] > 0)
        return err_set(err, "rank 0 could not create the directory of checkpoint %s", name);
    return t->rank == 0
               ? 0
               : ckpt_tmp_path(dir, name, (long)v[1] + ((long)v[2] << 12), tmp, PATH_CAP, err);
}

// Rank 0, once every rank's files are durable: the texts, both indexes, the commit.
static int sharded_commit(Trainer *t, const CkptPending *p, Err *err) {
    return ckpt_write_texts(p->texts, p->tmp, err) ||
           shards_write_index(p->tmp, "model", t->world, err) ||
           shards_write_index(p->tmp, "optimizer", t->world, err) ||
           ckpt_commit(t->spec->ckpt_dir, p->tmp, p->name, err);
}

void train_ckpt_pending_free(CkptPending *p) {
    free_texts(p->texts);
    *p = (CkptPending){0};
}

// Every rank, once every rank's files are written (a failure on any rank: none is committed):
// rank 0 commits the checkpoint, and every rank learns whether it did.
static int sharded_finish(Trainer *t, int rc, Err *err) {
    CkptPending *p = &t->pending;
    float failed = rc != 0;
    if (executor_sum(&t->exec, &failed, 1, rc ? NULL : err))
        rc = -1;
    else if (failed > 0 && !rc)
        rc = err_set(err, "another rank failed to write its files (its own error says why)");
    if (!rc && t->rank == 0) rc = sharded_commit(t, p, err);
    if (rc && t->rank == 0) {
        Err ignored;
        ckpt_abort(p->tmp, &ignored);
    }
    if (rc) err_prefix(err, "checkpoint %s/%s", t->spec->ckpt_dir, p->name);
    train_ckpt_pending_free(p);
    return rc;
}

// --ckpt_format sharded (docs/design.md §14): no gather; every rank writes the tensors its
// optimizer steps (the executor's view: its fsdp/ddp shard, its pipeline stage) and their state
// into rank 0's temporary directory, at once or (--async_checkpoint) from a host copy in the
// background; rank 0 commits it only after every rank reported its files written and fsynced.
// A pipeline's two copies of a tied embedding are both written; the index maps the name to
// stage 0's file.
static int save_sharded(Trainer *t, const char *name, bool *background, Err *err) {
    CkptPending *p = &t->pending;
    *p = (CkptPending){.step = t->step, .epoch = t->epoch};
    snprintf(p->name, sizeof p->name, "%s", name);
    if (sharded_begin(t, name, p->tmp, err)) return -1;
    if (t->rank == 0) render_texts(t, p->texts);
    char model_file[128], optim_file[128];
    shards_file_name(model_file, sizeof model_file, "model", t->rank + 1, t->world);
    shards_file_name(optim_file, sizeof optim_file, "optimizer", t->rank + 1, t->world);
    ParamView view = executor_view(&t->exec, &t->model);
    const Optimizer *opt = &t->opt;
    CkptContent c = {.ckpt_dir = t->spec->ckpt_dir,
                     .name = name,
                     .dtype = ckpt_dtype(t),
                     .n_parts = 1,
                     .views = &view,
                     .opts = &opt,
                     .shard_tmp = p->tmp,
                     .model_file = model_file,
                     .optim_file = optim_file};
    p->active = true;
    *background = t->spec->async_checkpoint;
    if (!*background) return sharded_finish(t, ckpt_write(&c, err), err);
    // A start that failed on one rank reaches the others in train_ckpt_save's agreement.
    if (ckpt_writer_start(&t->writer, &c, t->step, t->epoch, err)) {
        train_ckpt_pending_free(p);
        return -1;
    }
    return 0;
}

int train_ckpt_finish(Trainer *t, char *path_out, size_t cap, long *step, long *epoch, Err *err) {
    if (!t->pending.active) return 0;
    *step = t->pending.step;
    *epoch = t->pending.epoch;
    int rc = path_join(path_out, cap, t->spec->ckpt_dir, t->pending.name, err);
    Err written;
    if (ckpt_writer_collect(&t->writer, &written) && !rc) {
        *err = written;
        rc = -1;
    }
    return sharded_finish(t, rc, err) ? -1 : 1;
}

int train_ckpt_save(Trainer *t, char *path_out, size_t cap, bool *background, Err *err) {
    char name[128];
    snprintf(name, sizeof name, "epoch_%ld_step_%ld", t->epoch, t->step);
    *background = false;
    int rc = t->spec->is.ckpt_format == CKPT_SHARDED ? save_sharded(t, name, background, err)
                                                     : save_full(t, name, background, err);
    // Every rank learns whether rank 0 wrote it (or took its copy), so none trains on alone.
    float failed = rc != 0;
    if (executor_sum(&t->exec, &failed, 1, rc ? NULL : err)) return -1;
    if (failed > 0 && !rc) return err_set(err, "rank 0 failed to write checkpoint %s", name);
    if (rc) return -1;
    return path_join(path_out, cap, t->spec->ckpt_dir, name, err);
}

// The val_loss of the validation at `step` in the run's metric rows; false when there is none.
static bool val_loss_at(const Trainer *t, long step, double *out) {
    for (size_t i = t->metrics.n; i-- > 0;) {
        const MetricRow *r = &t->metrics.rows[i];
        if (r->kind == METRIC_VALIDATION && r->step == step) {
            *out = r->val_loss;
            return true;
        }
    }
    return false;
}

// A checkpoint this run's lineage committed (the ledger's run): the only ones retention deletes.
static bool this_run(const CkptEntry *e) {
    return e->ours && !strcmp(e->run, ckpt_current_run());
}

// Whether the retention keeps all[i] (the list newest first by commit; rank_in_ours: how many
// checkpoints of this run were committed after it).
static bool kept(const Trainer *t, const CkptEntry *all, int n, int i, int rank_in_ours) {
    const TrainSpec *s = t->spec;
    const char *resumed = strrchr(t->resumed_from, '/');
    resumed = resumed ? resumed + 1 : t->resumed_from;
    if (!this_run(&all[i]) || rank_in_ours < s->checkpoint_keep_last ||
        !strcmp(all[i].name, resumed))
        return true;
    double mine;
    if (s->checkpoint_keep_best <= 0 || !val_loss_at(t, all[i].step, &mine)) return false;
    long better = 0; // astrai's checkpoints validated lower (ties: the newer one first)
    for (int j = 0; j < n; j++) {
        double other;
        if (j != i && this_run(&all[j]) && val_loss_at(t, all[j].step, &other) &&
            (other < mine || (other == mine && j < i)))
            better++;
    }
    return better < s->checkpoint_keep_best;
}

int train_ckpt_prune(Trainer *t, Err *err) {
    const TrainSpec *s = t->spec;
    if (s->checkpoint_keep_last <= 0) return 0;
    CkptEntry *all;
    int n, rc = 0;
    bool has_ledger;
    if (ckpt_list(s->ckpt_dir, &all, &n, &has_ledger, err))
        return err_prefix(err, "checkpoint retention");
    for (int i = 0, ours = 0; i < n && !rc; i++) {
        if (!kept(t, all, n, i, ours)) {
            rc = ckpt_remove(s->ckpt_dir, all[i].name, err) ||
                 progress_remove_checkpoint(&t->progress, all[i].step, err);
            if (!rc)
                fprintf(stderr, "checkpoint retention: removed %s/%s\n", s->ckpt_dir, all[i].name);
        }
        ours += this_run(&all[i]);
    }
    free(all);
    return rc ? err_prefix(err, "checkpoint retention") : 0;
}

static int json_long(const cJSON *o, const char *key, long *out, const char *path, Err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || v->valuedouble < 0)
        return err_set(err, "%s: \"%s\" must be a non-negative integer", path, key);
    *out = (long)v->valuedouble;
    return 0;
}

// A checkpoint written by AstrAI has no sampler.json: the position comes from
// consumed_samples as AstrAI's TrainContextBuilder derives it: consumed_samples rounded
// down to whole optimizer steps, then (when > 0) epoch = (consumed / world) // per_replica
// and the position inside it = (consumed / world) % per_replica (RDSampler's start_iter).
static void astrai_position(Trainer *t) {
    const TrainSpec *s = t->spec;
    long per_step = s->batch_per_device * t->replicas * s->grad_accum_steps;
    t->consumed_samples = t->consumed_samples / per_step * per_step;
    int64_t offset = t->consumed_samples / t->replicas;
    t->epoch_pos = 0;
    if (offset > 0 && t->sampler.per_replica > 0) {
        t->epoch = (long)(offset / t->sampler.per_replica);
        t->epoch_pos = offset % t->sampler.per_replica;
    }
}

// Restores epoch and the position inside it from sampler.json; without one (a
// checkpoint written by AstrAI) derives it from consumed_samples as AstrAI does.
static int load_sampler_position(Trainer *t, const char *dir, Err *err) {
    char path[PATH_CAP];
    if (path_join(path, sizeof path, dir, "sampler.json", err)) return -1;
    long world = t->replicas;
    if (!fs_is_file(path)) {
        astrai_position(t);
        return 0;
    }
    cJSON *o;
    if (json_read_file(path, &o, err)) return -1;
    long epoch = 0, samples = 0, n = 0;
    int rc = json_long(o, "epoch", &epoch, path, err) ||
             json_long(o, "epoch_samples", &samples, path, err) ||
             json_long(o, "n_samples", &n, path, err);
    cJSON_Delete(o);
    if (rc) return -1;
    if (n != t->obj.n_samples)
        return err_set(err,
                       "%s: the checkpoint was trained on %ld samples, data_root_path now "
                       "gives %lld (a different dataset or window_size)",
                       path, n, (long long)t->obj.n_samples);
    t->epoch = epoch;
    t->epoch_pos = (samples + world - 1) / world;
    return 0;
}

static int load_optimizer(Trainer *t, const char *dir, Err *err) {
    if (!shards_present(dir, "optimizer")) {
        char pt[PATH_CAP];
        if (path_join(pt, sizeof pt, dir, "optimizer.pt", err)) return -1;
        // One warning for the job (rank 0).
        if (t->rank == 0 && fs_is_file(pt))
            fprintf(stderr,
                    "warning: %s is a PyTorch pickle, which astrai never executes (loading "
                    "one runs arbitrary code): the optimizer state starts fresh\n",
                    pt);
        else if (t->rank == 0)
            fprintf(stderr,
                    "warning: %s: no optimizer.safetensors; the optimizer state starts "
                    "fresh\n",
                    dir);
        return 0;
    }
    char what[PATH_CAP];
    StFile f;
    if (shards_open(&f, dir, "optimizer", what, sizeof what, err)) return -1;
    int rc = executor_load_optim(&t->exec, &t->model, &t->opt, &f, what, err);
    st_close(&f);
    return rc;
}

// AstrAI's optimizer_step: consumed_samples // (batch_per_device * nprocs *
// grad_accum_steps), with the values its meta.json records. -1 when they are absent.
static long astrai_step(const CkptMeta *meta) {
    const char *keys[] = {"batch_per_device", "nprocs", "grad_accum_steps"};
    double per_step = 1;
    for (int i = 0; i < 3; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(meta->config, keys[i]);
        if (!cJSON_IsNumber(v) || v->valuedouble < 1) return -1;
        per_step *= v->valuedouble;
    }
    return (long)((double)meta->consumed_samples / per_step);
}

// The number of optimizer steps done, which is also the schedule position (AstrAI's
// scheduler.pt, a pickle, is never read): meta.json's "step" (ours), else the directory
// name epoch_E_step_S as AstrAI names it, else AstrAI's formula over meta.json's keys.
static int load_step(Trainer *t, const CkptMeta *meta, const char *dir, const char **from,
                     Err *err) {
    t->step = meta->step;
    *from = "meta.json";
    if (t->step >= 0) return 0;
    const char *base = strrchr(dir, '/') ? strrchr(dir, '/') + 1 : dir;
    long name_epoch;
    *from = "the directory name";
    if (!ckpt_parse_name(base, &name_epoch, &t->step)) return 0;
    *from = "consumed_samples";
    t->step = astrai_step(meta);
    if (t->step >= 0) return 0;
    return err_set(err,
                   "%s/meta.json: no \"step\", the directory name is not epoch_E_step_S, and "
                   "no batch_per_device/nprocs/grad_accum_steps to derive it",
                   dir);
}

// The dynamic loss scale where the checkpoint left it (scheduler.json's "loss_scale" and
// "loss_scale_growth_tracker"); a checkpoint without them (written without dynamic scaling, or
// by AstrAI) leaves the scale at --init_loss_scale.
static int load_scaler(Trainer *t, const char *dir, Err *err) {
    char path[PATH_CAP];
    if (t->scaler.mode != LOSS_SCALE_DYNAMIC) return 0;
    if (path_join(path, sizeof path, dir, "scheduler.json", err)) return -1;
    cJSON *o;
    if (!fs_is_file(path)) return 0;
    if (json_read_file(path, &o, err)) return -1;
    const cJSON *scale = cJSON_GetObjectItemCaseSensitive(o, "loss_scale");
    long tracker = 0;
    int rc = 0;
    if (scale &&
        (!cJSON_IsNumber(scale) || !(scale->valuedouble > 0) || !isfinite(scale->valuedouble)))
        rc = err_set(err, "%s: \"loss_scale\" must be a positive number", path);
    else if (scale && !(rc = json_long(o, "loss_scale_growth_tracker", &tracker, path, err)))
        t->scaler.scale = scale->valuedouble, t->scaler.growth_tracker = tracker;
    cJSON_Delete(o);
    return rc;
}

int train_ckpt_load_state(Trainer *t, const char *dir, Err *err) {
    char path[PATH_CAP];
    CkptMeta meta;
    if (path_join(path, sizeof path, dir, "meta.json", err) || meta_load(&meta, path, err))
        return -1;
    t->epoch = meta.epoch;
    t->consumed_samples = meta.consumed_samples;
    const char *step_from;
    int rc = load_step(t, &meta, dir, &step_from, err);
    meta_free(&meta);
    if (rc || load_sampler_position(t, dir, err) || load_optimizer(t, dir, err) ||
        load_scaler(t, dir, err))
        return -1;
    if (path_join(path, sizeof path, dir, "metric.jsonl", err)) return -1;
    if (fs_is_file(path) && metric_log_load(&t->metrics, path, t->step, err)) return -1;
    fprintf(stderr, "resuming from %s: step %ld (from %s), epoch %ld, %ld samples consumed\n", dir,
            t->step, step_from, t->epoch, t->consumed_samples);
    return 0;
}
