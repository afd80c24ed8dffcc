// optim.c: AdamW and AstrAI's MuonMix over the model's flat parameter buffer, gradient
// clipping, and the optimizer state as safetensors (DESIGN §8).
//
// Numerics follow PyTorch: torch.optim.AdamW (single-tensor path) and torch.optim.Muon
// (torch >= 2.9, _single_tensor_muon), except that Newton-Schulz runs in fp32 (torch: bf16).
// Reductions add fixed blocks in a fixed order, so a step is bitwise reproducible and a run
// resumed from optim_save/optim_load continues exactly.
//
// State file: exp_avg.<param> and exp_avg_sq.<param> for AdamW-owned parameters,
// momentum_buffer.<param> for Muon-owned ones (fp32, the parameter's shape), and "step": a
// 1-element fp32 tensor holding the step count, exact up to 2^24 (saving beyond that fails).
// An adamw optimizer has no momentum_buf (NULL).
#include "engine/optim.h"

#include <cblas.h>
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
// Element loops smaller than this run on one thread (an OpenMP region costs microseconds).
#define PARALLEL_MIN 16384
// The fp32 "step" tensor holds integers exactly up to 2^24.
#define STEP_MAX_EXACT 16777216L

// ---------------------------------------------------------------- parameter ownership

// MuonMix: Muon for 2-D weights whose names contain none of norm/bias/embed/lm_head.
static bool muon_owns(const ParamSpec *p) {
    return p->ndim == 2 && !strstr(p->name, "norm") && !strstr(p->name, "bias") &&
           !strstr(p->name, "embed") && !strstr(p->name, "lm_head");
}

// Newton-Schulz workspace for a (rows, cols) matrix: X and the next X as (r, c), the
// Gram matrix A and the polynomial B as (r, r), with r = min(rows, cols).
static size_t ns_scratch_floats(const ParamSpec *p) {
    size_t rows = (size_t)p->shape[0], cols = (size_t)p->shape[1];
    size_t r = rows < cols ? rows : cols;
    return 2 * rows * cols + 2 * r * r;
}

static int check_param_table(const Model *m, Err *err) {
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

int optim_create(Optimizer *o, OptimizerKind kind, const Model *m, float weight_decay, Err *err) {
    *o = (Optimizer){.kind = kind,
                     .weight_decay = weight_decay,
                     .beta1 = ADAMW_BETA1,
                     .beta2 = ADAMW_BETA2,
                     .eps = ADAMW_EPS,
                     .momentum = MUON_MOMENTUM,
                     .ns_steps = MUON_NS_STEPS};
    if (kind != OPT_ADAMW && kind != OPT_MUON)
        return err_set(err, "optimizer: unknown kind %d", (int)kind);
    if (check_param_table(m, err)) return -1;

    size_t n = m->num_floats > 0 ? m->num_floats : 1;
    o->exp_avg = calloc(n, sizeof(float));
    o->exp_avg_sq = calloc(n, sizeof(float));
    o->is_muon = calloc(m->n_params > 0 ? (size_t)m->n_params : 1, 1);
    bool ok = o->exp_avg && o->exp_avg_sq && o->is_muon;
    if (ok && kind == OPT_MUON) {
        for (int i = 0; i < m->n_params; i++) {
            o->is_muon[i] = muon_owns(&m->params[i]);
            size_t need = o->is_muon[i] ? ns_scratch_floats(&m->params[i]) : 0;
            if (need > o->scratch_floats) o->scratch_floats = need;
        }
        o->momentum_buf = calloc(n, sizeof(float));
        o->scratch = o->scratch_floats ? malloc(o->scratch_floats * sizeof(float)) : NULL;
        ok = o->momentum_buf && (o->scratch || !o->scratch_floats);
    }
    if (!ok) {
        optim_free(o);
        return err_set(err, "optimizer: out of memory for the state of %zu parameters",
                       m->num_floats);
    }
    return 0;
}

void optim_free(Optimizer *o) {
    free(o->exp_avg);
    free(o->exp_avg_sq);
    free(o->momentum_buf);
    free(o->is_muon);
    free(o->scratch);
    *o = (Optimizer){0};
}

// ---------------------------------------------------------------- reductions

#define SUM_BLOCKS 256

// Sum of x[i]^2 in double, over fixed blocks added in a fixed order, so the result does
// not depend on the thread count or scheduling (bitwise-reproducible resumes).
static double sum_squares(const float *x, size_t n) {
    double partial[SUM_BLOCKS];
    size_t block = (n + SUM_BLOCKS - 1) / SUM_BLOCKS;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int b = 0; b < SUM_BLOCKS; b++) {
        size_t lo = (size_t)b * block, hi = lo + block < n ? lo + block : n;
        double s = 0.0;
        for (size_t i = lo; i < hi; i++)
            s += (double)x[i] * (double)x[i];
        partial[b] = s;
    }
    double total = 0.0;
    for (int b = 0; b < SUM_BLOCKS; b++)
        total += partial[b];
    return total;
}

static void scale(float *x, size_t n, float factor) {
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (size_t i = 0; i < n; i++)
        x[i] *= factor;
}

double grad_sq_sum(const Model *m) {
    return sum_squares(m->grads, m->num_floats);
}

void clip_grads_to(Model *m, double norm, float max_norm) {
    // torch clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1. A NaN norm
    // leaves the grads alone; the caller sees it in the returned value.
    double coef = (double)max_norm / (norm + 1e-6);
    if (max_norm > 0 && coef < 1.0) scale(m->grads, m->num_floats, (float)coef);
}

float clip_grad_norm(Model *m, float max_norm) {
    double norm = sqrt(grad_sq_sum(m));
    clip_grads_to(m, norm, max_norm);
    return (float)norm;
}

// ---------------------------------------------------------------- AdamW

// torch.optim.AdamW on one tensor of n floats, at o->step (already incremented).
static void adamw_update(const Optimizer *o, float *w, const float *g, float *exp_avg,
                         float *exp_avg_sq, size_t n, float lr, float weight_decay) {
    double bias_correction1 = 1.0 - pow(o->beta1, (double)o->step);
    double bias_correction2 = 1.0 - pow(o->beta2, (double)o->step);
    const float decay = (float)(1.0 - (double)lr * weight_decay);
    const float step_size = (float)(lr / bias_correction1);
    const float bc2_sqrt = (float)sqrt(bias_correction2);
    const float b1 = o->beta1, b2 = o->beta2, eps = o->eps;
    const float one_minus_b1 = (float)(1.0 - (double)b1), one_minus_b2 = (float)(1.0 - (double)b2);
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (size_t i = 0; i < n; i++) {
        w[i] *= decay;
        exp_avg[i] = exp_avg[i] * b1 + g[i] * one_minus_b1;
        exp_avg_sq[i] = exp_avg_sq[i] * b2 + g[i] * g[i] * one_minus_b2;
        float denom = sqrtf(exp_avg_sq[i]) / bc2_sqrt + eps;
        w[i] += -step_size * (exp_avg[i] / denom);
    }
}

// ---------------------------------------------------------------- Muon

// torch.lerp's formula (two branches for accuracy), so our numbers track torch's.
static inline float lerp(float start, float end, float weight) {
    return weight < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

// Newton-Schulz orthogonalisation of x: (r, c), r <= c, in place of the scratch.
// Returns the buffer (x or next) that holds the result.
static float *newton_schulz(float *x, float *next, float *gram, float *poly, int r, int c,
                            int steps) {
    size_t n = (size_t)r * c;
    float norm = (float)sqrt(sum_squares(x, n));
    float divisor = norm > MUON_NORM_EPS ? norm : MUON_NORM_EPS;
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (size_t i = 0; i < n; i++)
        x[i] /= divisor;
    for (int k = 0; k < steps; k++) {
        // gram = x x^T: (r, r)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, r, c, 1.0f, x, c, x, c, 0.0f, gram,
                    r);
        // poly = b*gram + c*gram@gram
        memcpy(poly, gram, (size_t)r * r * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, r, r, MUON_NS_C, gram, r, gram, r,
                    MUON_NS_B, poly, r);
        // next = a*x + poly@x: (r, c)
        memcpy(next, x, n * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, c, r, 1.0f, poly, r, x, c,
                    MUON_NS_A, next, c);
        float *t = x;
        x = next;
        next = t;
    }
    return x;
}

// torch.optim.Muon (nesterov, adjust_lr_fn "match_rms_adamw") on one (rows, cols) weight.
static void muon_update(Optimizer *o, const ParamSpec *p, float *w, const float *g, float *buf,
                        float lr) {
    const int rows = (int)p->shape[0], cols = (int)p->shape[1];
    // Work on the wide orientation: x = update^T when rows > cols, so x is (r, c), r <= c.
    const bool transposed = rows > cols;
    const int r = transposed ? cols : rows, c = transposed ? rows : cols;
    const size_t n = p->numel;
    float *x = o->scratch, *next = x + n, *gram = next + n, *poly = gram + (size_t)r * r;
    const float momentum = o->momentum, one_minus_momentum = (float)(1.0 - (double)momentum);

#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int i = 0; i < rows; i++) {
        for (int j = 0; j < cols; j++) {
            size_t k = (size_t)i * cols + j;
            buf[k] = lerp(buf[k], g[k], one_minus_momentum);
            float update = lerp(g[k], buf[k], momentum); // Nesterov
            x[transposed ? (size_t)j * rows + i : k] = update;
        }
    }
    float *ortho = newton_schulz(x, next, gram, poly, r, c, o->ns_steps);

    const float decay = (float)(1.0 - (double)lr * o->weight_decay);       // unadjusted lr
    const float adjusted_lr = (float)((double)lr * 0.2 * sqrt((double)c)); // c = max(rows, cols)
#pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int i = 0; i < rows; i++) {
        for (int j = 0; j < cols; j++) {
            size_t k = (size_t)i * cols + j;
            w[k] *= decay;
            w[k] += -adjusted_lr * ortho[transposed ? (size_t)j * rows + i : k];
        }
    }
}

void optim_step(Optimizer *o, Model *m, float lr) {
    o->step++;
    // MuonMix gives its AdamW part no weight decay.
    float adamw_decay = o->kind == OPT_ADAMW ? o->weight_decay : 0.0f;
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        float *w = m->weights + p->offset;
        const float *g = m->grads + p->offset;
        if (o->is_muon[i])
            muon_update(o, p, w, g, o->momentum_buf + p->offset, lr);
        else
            adamw_update(o, w, g, o->exp_avg + p->offset, o->exp_avg_sq + p->offset, p->numel, lr,
                         adamw_decay);
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

static int state_tensor_count(const Optimizer *o, const Model *m) {
    int count = 1; // step
    const char *prefixes[2];
    for (int i = 0; i < m->n_params; i++)
        count += state_fields(o, i, prefixes);
    return count;
}

int optim_save(const Optimizer *o, const Model *m, const char *path, Err *err) {
    if (o->step > STEP_MAX_EXACT)
        return err_set(err, "%s: step %ld exceeds 2^24, the largest exact fp32 'step'", path,
                       o->step);
    int n = state_tensor_count(o, m);
    StWriteTensor *tensors = calloc((size_t)n, sizeof *tensors);
    char *names = calloc((size_t)n, STATE_NAME_MAX);
    if (!tensors || !names) {
        free(tensors);
        free(names);
        return err_set(err, "%s: out of memory for %d state tensors", path, n);
    }
    float step = (float)o->step;
    int t = 0;
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        const char *prefixes[2];
        int k = state_fields(o, i, prefixes);
        for (int f = 0; f < k; f++, t++) {
            char *name = names + (size_t)t * STATE_NAME_MAX;
            snprintf(name, STATE_NAME_MAX, "%s%s", prefixes[f], p->name);
            tensors[t] = (StWriteTensor){.name = name,
                                         .ndim = p->ndim,
                                         .shape = {p->shape[0], p->shape[1]},
                                         .data = state_buffer(o, prefixes[f]) + p->offset};
        }
    }
    tensors[t] = (StWriteTensor){.name = "step", .ndim = 1, .shape = {1}, .data = &step};
    int rc = st_write(path, tensors, n, ST_F32, err);
    free(tensors);
    free(names);
    return rc;
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

// Checks that f holds exactly the state tensors of o for m, with matching shapes.
static int check_state_file(const Optimizer *o, const Model *m, const StFile *f, const char *path,
                            Err *err) {
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
            if (t->dtype != ST_F32 && t->dtype != ST_BF16 && t->dtype != ST_F16)
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
    if (f->n_tensors != state_tensor_count(o, m)) {
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

static int read_state(Optimizer *o, const Model *m, const StFile *f, const char *path, Err *err) {
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
            float *dst = state_buffer(o, prefixes[fi]) + p->offset;
            if (st_read_f32(f, name, p->ndim, p->shape, dst, err))
                return err_prefix(err, "%s", path);
        }
    }
    o->step = (long)step;
    return 0;
}

int optim_load(Optimizer *o, const Model *m, const char *path, Err *err) {
    StFile f;
    if (st_open(&f, path, err)) return -1;
    // Validate everything before touching the state, so a bad file leaves it intact.
    int rc = check_state_file(o, m, &f, path, err);
    if (!rc) rc = read_state(o, m, &f, path, err);
    st_close(&f);
    return rc;
}
