// optim.c: AdamW and AstrAI's MuonMix over a parameter view, gradient clipping, and the
// optimizer state as safetensors (docs/design.md §8). The arithmetic is the backend's (adamw,
// muon, scale ops: engine/cpu/optim.c, engine/cuda/optim.cu); this file owns which
// tensor gets which update with which scalars, and the state files.
//
// Numerics follow PyTorch: torch.optim.AdamW (single-tensor path) and torch.optim.Muon
// (torch >= 2.9, _single_tensor_muon), except that Newton-Schulz runs in fp32 (torch: bf16).
// The backend ops are bitwise reproducible, so a run resumed from optim_save/optim_load
// continues exactly.
//
// State file: exp_avg.<param> and exp_avg_sq.<param> for AdamW-owned parameters,
// momentum_buffer.<param> for Muon-owned ones (fp32, the parameter's shape), and "step": a
// 1-element fp32 tensor holding the step count, exact up to 2^24 (saving beyond that fails).
// An adamw optimizer has no momentum_buf (NULL).
#include "engine/optim.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/safetensors.h"

#define ADAMW_BETA1 0.9f
#define ADAMW_BETA2 0.95f
#define ADAMW_EPS 1e-8f
#define MUON_MOMENTUM 0.95f
#define MUON_NS_STEPS 5
#define MUON_NS_A 3.4445f
#define MUON_NS_B -4.7750f
#define MUON_NS_C 2.0315f
#define MUON_NORM_EPS 1e-7f
// The fp32 "step" tensor holds integers exactly up to 2^24.
#define STEP_MAX_EXACT 16777216L

// ---------------------------------------------------------------- parameter ownership

static int check_param_table(const ParamView *m, Err *err) {
    if (m->n_params > 0 && !m->params)
        return err_set(err, "optimizer: model has %d parameters but no table", m->n_params);
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        if (p->ndim != 1 && p->ndim != 2)
            return err_set(err, "optimizer: parameter '%s' has %d dims (expected 1 or 2)", p->name,
                           p->ndim);
        int64_t numel = p->ndim == 1 ? p->shape[0] : p->shape[0] * p->shape[1];
        if (p->shape[0] < 1 || (p->ndim == 2 && p->shape[1] < 1) || (size_t)numel != p->numel)
            return err_set(err, "optimizer: parameter '%s' has numel %zu but its shape holds %lld",
                           p->name, p->numel, (long long)numel);
        if (p->offset > m->num_floats || p->numel > m->num_floats - p->offset)
            return err_set(err,
                           "optimizer: parameter '%s' [%zu, %zu) lies outside the %zu-float "
                           "buffer",
                           p->name, p->offset, p->offset + p->numel, m->num_floats);
    }
    return 0;
}

static size_t largest_muon_scratch(const Optimizer *o, const ParamView *v) {
    size_t most = 0;
    for (int i = 0; i < v->n_params; i++) {
        size_t need = o->is_muon[i] ? muon_scratch_floats((int)v->params[i].shape[0],
                                                          (int)v->params[i].shape[1])
                                    : 0;
        if (need > most) most = need;
    }
    return most;
}

static int alloc_state(Optimizer *o, const ParamView *v, Err *err) {
    const Backend *be = v->be;
    size_t bytes = (v->num_floats > 0 ? v->num_floats : 1) * sizeof(float);
    o->is_muon = calloc(v->n_params > 0 ? (size_t)v->n_params : 1, 1);
    if (!o->is_muon)
        return err_resource(err, "optimizer: out of memory for %d parameters", v->n_params);
    for (int i = 0; o->kind == OPT_MUON && i < v->n_params; i++)
        o->is_muon[i] = optim_muon_owns(&v->params[i]);
    if (!(o->exp_avg = be->alloc(bytes, err)) || !(o->exp_avg_sq = be->alloc(bytes, err)))
        return -1;
    if (o->kind != OPT_MUON) return 0;
    size_t scratch = largest_muon_scratch(o, v);
    if (!(o->momentum_buf = be->alloc(bytes, err))) return -1;
    if (scratch && !(o->scratch = be->alloc(scratch * sizeof(float), err))) return -1;
    return 0;
}

int optim_create(Optimizer *o, OptimizerKind kind, const ParamView *v, float weight_decay,
                 Err *err) {
    *o = (Optimizer){.kind = kind,
                     .be = v->be,
                     .weight_decay = weight_decay,
                     .beta1 = ADAMW_BETA1,
                     .beta2 = ADAMW_BETA2,
                     .eps = ADAMW_EPS,
                     .momentum = MUON_MOMENTUM,
                     .ns_steps = MUON_NS_STEPS,
                     .nesterov = true};
    if (kind != OPT_ADAMW && kind != OPT_MUON)
        return err_set(err, "optimizer: unknown kind %d", (int)kind);
    if (check_param_table(v, err)) return -1;
    if (alloc_state(o, v, err)) {
        optim_free(o);
        return err_prefix(err, "optimizer: the state of %zu parameters", v->num_floats);
    }
    return 0;
}

int optim_state_arrays(const Optimizer *o, float *arrays[3]) {
    int n = 0;
    if (o->exp_avg) arrays[n++] = o->exp_avg;
    if (o->exp_avg_sq) arrays[n++] = o->exp_avg_sq;
    if (o->momentum_buf) arrays[n++] = o->momentum_buf;
    return n;
}

void optim_free(Optimizer *o) {
    if (o->be) {
        o->be->free(o->exp_avg);
        o->be->free(o->exp_avg_sq);
        o->be->free(o->momentum_buf);
        o->be->free(o->scratch);
    }
    free(o->is_muon);
    *o = (Optimizer){0};
}

void clip_grads(const ParamView *v, double norm, float max_norm) {
    // torch clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1. A NaN norm
    // leaves the grads alone; the caller sees it.
    double coef = (double)max_norm / (norm + 1e-6);
    if (max_norm > 0 && coef < 1.0) v->be->scale(v->grads, v->num_floats, (float)coef);
}

// torch.optim.AdamW's scalars for one tensor at o->step (already incremented).
static AdamwArgs adamw_args(const Optimizer *o, float lr, float weight_decay) {
    double bias_correction1 = 1.0 - pow(o->beta1, (double)o->step);
    double bias_correction2 = 1.0 - pow(o->beta2, (double)o->step);
    return (AdamwArgs){.decay = (float)(1.0 - (double)lr * weight_decay),
                       .step_size = (float)(lr / bias_correction1),
                       .bc2_sqrt = (float)sqrt(bias_correction2),
                       .beta1 = o->beta1,
                       .beta2 = o->beta2,
                       .one_minus_beta1 = (float)(1.0 - (double)o->beta1),
                       .one_minus_beta2 = (float)(1.0 - (double)o->beta2),
                       .eps = o->eps};
}

// torch.optim.Muon's scalars for one weight. adjust_lr_fn: "match_rms_adamw" scales lr by
// 0.2*sqrt(max(A, B)), "original" by sqrt(max(1, A/B)) (A, B = rows, cols).
static MuonArgs muon_args(const Optimizer *o, const ParamSpec *p, float lr) {
    int rows = (int)p->shape[0], cols = (int)p->shape[1];
    double longer = rows > cols ? rows : cols;
    double ratio =
        o->adjust_lr_original ? sqrt(fmax(1.0, (double)rows / (double)cols)) : 0.2 * sqrt(longer);
    return (MuonArgs){.rows = rows,
                      .cols = cols,
                      .ns_steps = o->ns_steps,
                      .nesterov = o->nesterov,
                      .momentum = o->momentum,
                      .one_minus_momentum = (float)(1.0 - (double)o->momentum),
                      .decay = (float)(1.0 - (double)lr * o->weight_decay), // unadjusted lr
                      .adjusted_lr = (float)((double)lr * ratio),
                      .ns_a = MUON_NS_A,
                      .ns_b = MUON_NS_B,
                      .ns_c = MUON_NS_C,
                      .norm_eps = MUON_NORM_EPS};
}

void optim_step(Optimizer *o, const ParamView *v, float lr) {
    o->step++;
    // MuonMix gives its AdamW part no weight decay.
    AdamwArgs adamw = adamw_args(o, lr, o->kind == OPT_ADAMW ? o->weight_decay : 0.0f);
    for (int i = 0; i < v->n_params; i++) {
        const ParamSpec *p = &v->params[i];
        float *w = v->master + p->offset;
        const float *g = v->grads + p->offset;
        if (o->is_muon[i]) {
            MuonArgs muon = muon_args(o, p, lr);
            o->be->muon(w, g, o->momentum_buf + p->offset, o->scratch, &muon);
        } else {
            o->be->adamw(w, g, o->exp_avg + p->offset, o->exp_avg_sq + p->offset, p->numel, &adamw);
        }
    }
}

// ---------------------------------------------------------------- state files

#define STATE_NAME_MAX 128

static const char *kind_name(OptimizerKind kind) {
    return kind == OPT_MUON ? "muon" : "adamw";
}

// The state tensors of parameter `param` (name prefixes): AdamW's two moments, or Muon's
// momentum buffer. Returns how many.
static int state_fields(const Optimizer *o, int param, const char *prefixes[2]) {
    if (o->is_muon[param]) {
        prefixes[0] = "momentum_buffer.";
        return 1;
    }
    prefixes[0] = "exp_avg.";
    prefixes[1] = "exp_avg_sq.";
    return 2;
}

static float *state_buffer(const Optimizer *o, const char *prefix) {
    if (!strcmp(prefix, "momentum_buffer.")) return o->momentum_buf;
    if (!strcmp(prefix, "exp_avg.")) return o->exp_avg;
    return o->exp_avg_sq;
}

static int state_tensor_count(const Optimizer *o, const ParamView *m) {
    int count = 1; // step
    const char *prefixes[2];
    for (int i = 0; i < m->n_params; i++)
        count += state_fields(o, i, prefixes);
    return count;
}

int optim_save_parts(const Optimizer *const *opts, const ParamView *views, int n_parts,
                     const char *path, Err *err) {
    int n = 1; // step
    for (int v = 0; v < n_parts; v++) {
        if (opts[v]->step > STEP_MAX_EXACT)
            return err_set(err, "%s: step %ld exceeds 2^24, the largest exact fp32 'step'", path,
                           opts[v]->step);
        n += state_tensor_count(opts[v], &views[v]) - 1;
    }
    StWriteTensor *tensors = calloc((size_t)n, sizeof *tensors);
    char *names = calloc((size_t)n, STATE_NAME_MAX);
    if (!tensors || !names) {
        free(tensors);
        free(names);
        return err_resource(err, "%s: out of memory for %d state tensors", path, n);
    }
    float step = (float)opts[0]->step;
    int t = 0;
    for (int v = 0; v < n_parts; v++)
        for (int i = 0; i < views[v].n_params; i++) {
            const Optimizer *o = opts[v];
            const ParamSpec *p = &views[v].params[i];
            const char *prefixes[2];
            int k = state_fields(o, i, prefixes);
            for (int f = 0; f < k; f++) {
                char *name = names + (size_t)t * STATE_NAME_MAX;
                snprintf(name, STATE_NAME_MAX, "%s%s", prefixes[f], p->name);
                bool written = false; // a tied head's copy: the embedding's state, once
                for (int j = 0; j < t && !written; j++)
                    written = !strcmp(tensors[j].name, name);
                if (written) continue;
                tensors[t++] = (StWriteTensor){.name = name,
                                               .ndim = p->ndim,
                                               .shape = {p->shape[0], p->shape[1]},
                                               .data = state_buffer(o, prefixes[f]) + p->offset,
                                               .fetch = o->be->download};
            }
        }
    tensors[t++] = (StWriteTensor){.name = "step", .ndim = 1, .shape = {1}, .data = &step};
    int rc = st_write(path, tensors, t, DT_F32, err);
    free(tensors);
    free(names);
    return rc;
}

int optim_save(const Optimizer *o, const ParamView *m, const char *path, Err *err) {
    return optim_save_parts(&o, m, 1, path, err);
}

static bool same_shape(const StTensor *t, const ParamSpec *p) {
    if (t->ndim != p->ndim) return false;
    for (int d = 0; d < p->ndim; d++)
        if (t->shape[d] != p->shape[d]) return false;
    return true;
}

static void format_shape(char *out, size_t size, int ndim, const int64_t *shape) {
    int len = snprintf(out, size, "[");
    for (int d = 0; d < ndim && len > 0 && (size_t)len < size; d++)
        len += snprintf(out + len, size - (size_t)len, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (len > 0 && (size_t)len < size) snprintf(out + len, size - (size_t)len, "]");
}

// The other optimizer's tensor for parameter i, if the file has it (a kind mismatch): Muon
// state in an adamw run, AdamW state of a Muon-owned matrix in a muon run.
static const char *foreign_state(const Optimizer *o, const StFile *f, const ParamSpec *p, int i) {
    static const char *muon_prefix = "momentum_buffer.", *adamw_prefix = "exp_avg.";
    if (o->kind == OPT_MUON && !o->is_muon[i]) return NULL; // AdamW-owned in both kinds
    char name[STATE_NAME_MAX];
    const char *prefix = o->is_muon[i] ? adamw_prefix : muon_prefix;
    snprintf(name, sizeof name, "%s%s", prefix, p->name);
    const StTensor *t = st_find(f, name);
    return t ? t->name : NULL;
}

// Checks that f holds the state tensors of o for m, with matching shapes; exactly those unless
// `part` (m is a part of the model the file holds: a pipeline stage's).
static int check_state_file(const Optimizer *o, const ParamView *m, const StFile *f,
                            const char *path, bool part, Err *err) {
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        const char *foreign = foreign_state(o, f, p, i);
        if (foreign)
            return err_set(err,
                           "%s: tensor '%s' is %s state: the file was written by the '%s' "
                           "optimizer, this run uses '%s'",
                           path, foreign, o->is_muon[i] ? "AdamW" : "Muon",
                           kind_name(o->kind == OPT_MUON ? OPT_ADAMW : OPT_MUON),
                           kind_name(o->kind));
        const char *prefixes[2];
        int k = state_fields(o, i, prefixes);
        for (int fi = 0; fi < k; fi++) {
            char name[STATE_NAME_MAX];
            snprintf(name, sizeof name, "%s%s", prefixes[fi], p->name);
            const StTensor *t = st_find(f, name);
            if (!t) return err_set(err, "%s: missing tensor '%s'", path, name);
            if (t->dtype != DT_F32 && t->dtype != DT_BF16 && t->dtype != DT_F16)
                return err_set(err, "%s: tensor '%s' is not a float tensor", path, name);
            if (!same_shape(t, p)) {
                char got[64], want[64];
                format_shape(got, sizeof got, t->ndim, t->shape);
                format_shape(want, sizeof want, p->ndim, p->shape);
                return err_set(err, "%s: tensor '%s' has shape %s, expected %s", path, name, got,
                               want);
            }
        }
    }
    const StTensor *step = st_find(f, "step");
    if (!step) return err_set(err, "%s: missing tensor 'step'", path);
    if (step->ndim != 1 || step->shape[0] != 1)
        return err_set(err, "%s: tensor 'step' must have shape [1]", path);
    if (!part && f->n_tensors != state_tensor_count(o, m)) {
        // Name one tensor that is not ours: it comes from another model or optimizer.
        for (int j = 0; j < f->n_tensors; j++) {
            const char *name = f->tensors[j].name, *dot = strchr(name, '.');
            bool ours = !strcmp(name, "step");
            for (int i = 0; dot && !ours && i < m->n_params; i++) {
                const char *prefixes[2];
                int k = state_fields(o, i, prefixes);
                for (int fi = 0; fi < k && !ours; fi++)
                    ours = !strncmp(name, prefixes[fi], strlen(prefixes[fi])) &&
                           !strcmp(name + strlen(prefixes[fi]), m->params[i].name);
            }
            if (!ours)
                return err_set(err, "%s: unexpected tensor '%s' (not %s state of this model)", path,
                               name, kind_name(o->kind));
        }
    }
    return 0;
}

static int read_state(Optimizer *o, const ParamView *m, const StFile *f, const char *path,
                      float *host, Err *err) {
    float step;
    const int64_t one = 1;
    if (st_read_f32(f, "step", 1, &one, &step, err)) return err_prefix(err, "%s", path);
    if (!(step >= 0.0f && step <= (float)STEP_MAX_EXACT && step == floorf(step)))
        return err_set(err, "%s: tensor 'step' holds %g, not a step count in [0, 2^24]", path,
                       (double)step);
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        const char *prefixes[2];
        int k = state_fields(o, i, prefixes);
        for (int fi = 0; fi < k; fi++) {
            char name[STATE_NAME_MAX];
            snprintf(name, sizeof name, "%s%s", prefixes[fi], p->name);
            if (st_read_f32(f, name, p->ndim, p->shape, host, err))
                return err_prefix(err, "%s", path);
            o->be->upload(state_buffer(o, prefixes[fi]) + p->offset, host, p->numel * sizeof *host);
        }
    }
    o->step = (long)step;
    return 0;
}

int optim_load_st(Optimizer *o, const ParamView *m, const StFile *f, const char *path, bool part,
                  Err *err) {
    // Validate everything before touching the state, so a bad file leaves it intact.
    size_t largest = 1;
    for (int i = 0; i < m->n_params; i++)
        if (m->params[i].numel > largest) largest = m->params[i].numel;
    float *host = malloc(largest * sizeof *host);
    int rc = host ? check_state_file(o, m, f, path, part, err)
                  : err_resource(err, "%s: out of memory for the staging buffer", path);
    if (!rc) rc = read_state(o, m, f, path, host, err);
    free(host);
    return rc;
}

int optim_load(Optimizer *o, const ParamView *m, const char *path, bool part, Err *err) {
    StFile f;
    if (st_open(&f, path, err)) return -1;
    int rc = optim_load_st(o, m, &f, path, part, err);
    st_close(&f);
    return rc;
}
