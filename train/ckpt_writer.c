// ckpt_writer.c: a checkpoint's files and commit, synchronous or on rank 0's background thread
// (train/ckpt_writer.h).
#include "train/ckpt_writer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ckpt/checkpoint.h"
#include "common/fsutil.h"
#include "common/path.h"
#include "engine/backend.h"
#include "train/test_seam.h"

const char *const CKPT_TEXT_NAMES[CKPT_N_TEXTS] = {"meta.json", "config.json", "scheduler.json",
                                                   "sampler.json", "metric.jsonl"};

// ---------------------------------------------------------------- the files

int ckpt_write_texts(char *const *texts, const char *dir, Err *err) {
    char path[4096];
    for (int k = 0; k < CKPT_N_TEXTS; k++) {
        if (!texts[k]) return err_resource(err, "%s/%s: out of memory", dir, CKPT_TEXT_NAMES[k]);
        if (path_join(path, sizeof path, dir, CKPT_TEXT_NAMES[k], err) ||
            fs_write_file_synced(path, texts[k], strlen(texts[k]), err))
            return -1;
    }
    return 0;
}

// c's weights and optimizer state as dir/model_file and dir/optim_file.
static int write_tensors(const CkptContent *c, const char *dir, const char *model_file,
                         const char *optim_file, Err *err) {
    char path[4096];
    return path_join(path, sizeof path, dir, model_file, err) ||
           model_save_views(c->views, c->n_parts, path, c->dtype, err) ||
           path_join(path, sizeof path, dir, optim_file, err) ||
           optim_save_parts(c->opts, c->views, c->n_parts, path, err);
}

static int write_files(const CkptContent *c, const char *tmp, Err *err) {
    return ckpt_write_texts(c->texts, tmp, err) ||
           write_tensors(c, tmp, "model.safetensors", "optimizer.safetensors", err);
}

int ckpt_write(const CkptContent *c, Err *err) {
    if (c->shard_tmp) return write_tensors(c, c->shard_tmp, c->model_file, c->optim_file, err);
    char tmp[4096];
    if (ckpt_begin(c->ckpt_dir, c->name, tmp, sizeof tmp, err)) return -1;
    if (write_files(c, tmp, err) || ckpt_commit(c->ckpt_dir, tmp, c->name, err)) {
        Err ignored;
        ckpt_abort(tmp, &ignored);
        return err_prefix(err, "checkpoint %s/%s", c->ckpt_dir, c->name);
    }
    return 0;
}

// ---------------------------------------------------------------- the host copy

// The state's backend's host memory (pinned on GPUs), which w->host frees.
static float *host_copy(CkptWriter *w, const float *src, size_t n, Err *err) {
    float *dst = w->host->host_alloc(n * sizeof *dst, err);
    if (!dst) {
        err_prefix(err, "checkpoint: a host copy of %zu floats", n);
        return NULL;
    }
    if (n) w->host->download(dst, src, n * sizeof *dst);
    return dst;
}

static void free_copy(CkptWriter *w) {
    for (int k = 0; k < CKPT_N_TEXTS; k++)
        free(w->texts[k]), w->texts[k] = NULL;
    for (int v = 0; v < w->n_parts; v++) {
        w->host->host_free(w->views[v].master);
        free((void *)w->views[v].params);
        w->host->host_free(w->opts[v].exp_avg);
        w->host->host_free(w->opts[v].exp_avg_sq);
        w->host->host_free(w->opts[v].momentum_buf);
        free(w->opts[v].is_muon);
    }
    free(w->views);
    free(w->opts);
    free(w->opt_ptrs);
    w->views = NULL;
    w->opts = NULL;
    w->opt_ptrs = NULL;
    w->n_parts = 0;
}

// Part v of c into host memory: the view (its table too) and the optimizer's state arrays.
static int copy_part(CkptWriter *w, const CkptContent *c, int v, Err *err) {
    const ParamView *src = &c->views[v];
    const Optimizer *o = c->opts[v];
    ParamView *dst = &w->views[v];
    Optimizer *od = &w->opts[v];
    size_t n = src->num_floats;
    *dst = (ParamView){.be = backend_cpu(), .n_params = src->n_params, .num_floats = n};
    *od = *o;
    od->be = backend_cpu();
    od->exp_avg = od->exp_avg_sq = od->momentum_buf = od->scratch = NULL;
    od->is_muon = NULL;
    ParamSpec *params = malloc((size_t)(src->n_params ? src->n_params : 1) * sizeof *params);
    unsigned char *muon = malloc((size_t)(src->n_params ? src->n_params : 1));
    dst->params = params;
    od->is_muon = muon;
    if (!params || !muon) return err_resource(err, "checkpoint: out of memory");
    memcpy(params, src->params, (size_t)src->n_params * sizeof *params);
    memcpy(muon, o->is_muon, (size_t)src->n_params);
    if (!(dst->master = host_copy(w, src->master, n, err)) ||
        (o->exp_avg && !(od->exp_avg = host_copy(w, o->exp_avg, n, err))) ||
        (o->exp_avg_sq && !(od->exp_avg_sq = host_copy(w, o->exp_avg_sq, n, err))) ||
        (o->momentum_buf && !(od->momentum_buf = host_copy(w, o->momentum_buf, n, err))))
        return -1;
    w->opt_ptrs[v] = od;
    return 0;
}

static int copy_content(CkptWriter *w, const CkptContent *c, Err *err) {
    w->host = c->views[0].be; // every part's, which the optimizer states share
    snprintf(w->ckpt_dir, sizeof w->ckpt_dir, "%s", c->ckpt_dir);
    snprintf(w->name, sizeof w->name, "%s", c->name);
    snprintf(w->shard_tmp, sizeof w->shard_tmp, "%s", c->shard_tmp ? c->shard_tmp : "");
    snprintf(w->model_file, sizeof w->model_file, "%s", c->shard_tmp ? c->model_file : "");
    snprintf(w->optim_file, sizeof w->optim_file, "%s", c->shard_tmp ? c->optim_file : "");
    w->dtype = c->dtype;
    for (int k = 0; k < CKPT_N_TEXTS && c->texts; k++)
        if (c->texts[k] && !(w->texts[k] = strdup(c->texts[k])))
            return err_resource(err, "checkpoint: out of memory");
    w->views = calloc((size_t)c->n_parts, sizeof *w->views);
    w->opts = calloc((size_t)c->n_parts, sizeof *w->opts);
    w->opt_ptrs = calloc((size_t)c->n_parts, sizeof *w->opt_ptrs);
    if (!w->views || !w->opts || !w->opt_ptrs)
        return err_resource(err, "checkpoint: out of memory");
    for (int v = 0; v < c->n_parts; v++) {
        w->n_parts = v + 1;
        if (copy_part(w, c, v, err)) return -1;
    }
    return 0;
}

// ---------------------------------------------------------------- the thread

static void *write_in_background(void *arg) {
    CkptWriter *w = arg;
    char *texts[CKPT_N_TEXTS];
    memcpy(texts, w->texts, sizeof texts);
    CkptContent c = {.ckpt_dir = w->ckpt_dir,
                     .name = w->name,
                     .dtype = w->dtype,
                     .texts = texts,
                     .n_parts = w->n_parts,
                     .views = w->views,
                     .opts = w->opt_ptrs,
                     .shard_tmp = w->shard_tmp[0] ? w->shard_tmp : NULL,
                     .model_file = w->model_file,
                     .optim_file = w->optim_file};
    test_seam_ckpt_hold();
    w->rc = ckpt_write(&c, &w->err);
    if (!w->rc) w->rc = path_join(w->dir, sizeof w->dir, w->ckpt_dir, w->name, &w->err);
    atomic_store(&w->finished, true); // after rc: a reader that sees it finished sees rc
    return NULL;
}

int ckpt_writer_start(CkptWriter *w, const CkptContent *c, long step, long epoch, Err *err) {
    if (w->running) return err_set(err, "checkpoint: a write is already in flight");
    w->step = step;
    w->epoch = epoch;
    w->rc = 0;
    w->err = (Err){0};
    w->dir[0] = 0;
    atomic_store(&w->finished, false);
    if (copy_content(w, c, err)) {
        free_copy(w);
        return err_prefix(err, "checkpoint %s/%s", c->ckpt_dir, c->name);
    }
    int rc = pthread_create(&w->thread, NULL, write_in_background, w);
    if (rc) {
        free_copy(w);
        return err_errno(err, rc, "checkpoint %s/%s: no writer thread", c->ckpt_dir, c->name);
    }
    w->running = true;
    return 0;
}

bool ckpt_writer_done(const CkptWriter *w, bool *failed) {
    bool done = w->running && atomic_load(&w->finished);
    *failed = done && w->rc != 0;
    return done;
}

int ckpt_writer_collect(CkptWriter *w, Err *err) {
    if (!w->running) return 0;
    pthread_join(w->thread, NULL);
    w->running = false;
    free_copy(w);
    if (!w->rc) return 0;
    *err = w->err;
    err_prefix(err, "the checkpoint of step %ld, written in the background", w->step);
    return -1;
}

void ckpt_writer_free(CkptWriter *w) {
    Err ignored;
    ckpt_writer_collect(w, &ignored);
}
