// optim_step.c: drives engine/optim.c for tests/test_optim_ref.py on a hand-built parameter
// view over CPU backend buffers.
//
// DIR holds spec.txt (one "name ndim d0 [d1]" line per parameter, in buffer order),
// weights.bin (num_floats fp32), grads.bin (N x num_floats fp32) and lrs.txt (N learning rates).
//
//   optim_step run  DIR KIND WD MAX_NORM RESUME_AT TAG
//       N steps of: grads = grads[s]; norm = sqrt(sum_squares(grads)); clip_grads;
//       optim_step(lr[s]). Writes
//       DIR/TAG.weights.bin (N x num_floats, after each step), DIR/TAG.norms.txt and
//       DIR/TAG.state.safetensors (final state). With RESUME_AT > 0 the optimizer is saved after
//       that step, freed, and a fresh one loaded from the file continues.
//   optim_step load DIR KIND FILE
//       Loads FILE into a fresh optimizer of the spec's model; prints "ok" or the error (exit 2).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/optim.h"

static int read_spec(ParamView *m, const char *dir, Err *err) {
    char path[1024];
    snprintf(path, sizeof path, "%s/spec.txt", dir);
    FILE *f = fopen(path, "r");
    if (!f) return err_set(err, "%s: cannot open", path);
    *m = (ParamView){.be = backend_cpu()};
    ParamSpec p = {0}, *params = NULL;
    while (fscanf(f, "%95s %d %lld", p.name, &p.ndim, (long long *)&p.shape[0]) == 3) {
        p.shape[1] = 1;
        if (p.ndim == 2 && fscanf(f, "%lld", (long long *)&p.shape[1]) != 1) break;
        p.numel = (size_t)(p.shape[0] * p.shape[1]);
        p.offset = m->num_floats;
        m->num_floats += p.numel;
        ParamSpec *grown = realloc(params, (size_t)(m->n_params + 1) * sizeof *grown);
        if (!grown) break;
        params = grown;
        params[m->n_params++] = p;
    }
    fclose(f);
    m->params = params;
    m->master = calloc(m->num_floats, sizeof(float));
    m->grads = calloc(m->num_floats, sizeof(float));
    if (!m->master || !m->grads) return err_resource(err, "%s: out of memory", path);
    return 0;
}

static void free_model(ParamView *m) {
    free((void *)m->params);
    free(m->master);
    free(m->grads);
}

// The --muon_* knobs, from $MUON_MOMENTUM, $MUON_NS_STEPS, $MUON_NESTEROV (0|1) and
// $MUON_ADJUST_LR (original|match_rms_adamw) when set.
static void set_muon_knobs(Optimizer *o) {
    const char *v;
    if ((v = getenv("MUON_MOMENTUM"))) o->momentum = strtof(v, NULL);
    if ((v = getenv("MUON_NS_STEPS"))) o->ns_steps = atoi(v);
    if ((v = getenv("MUON_NESTEROV"))) o->nesterov = atoi(v) != 0;
    if ((v = getenv("MUON_ADJUST_LR"))) o->adjust_lr_original = !strcmp(v, "original");
}

// torch's clip_grad_norm_: the norm, then the clipping; returns the norm.
static float clip(const ParamView *m, float max_norm) {
    double sq;
    m->be->sum_squares(&sq, m->grads, m->num_floats);
    clip_grads(m, sqrt(sq), max_norm);
    return (float)sqrt(sq);
}

static int read_floats(const char *dir, const char *file, float **out, size_t *n, Err *err) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    FILE *f = fopen(path, "rb");
    if (!f) return err_set(err, "%s: cannot open", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f) / sizeof(float);
    fseek(f, 0, SEEK_SET);
    *out = malloc(*n * sizeof(float) + 1);
    size_t got = *out ? fread(*out, sizeof(float), *n, f) : 0;
    fclose(f);
    return got == *n ? 0 : err_set(err, "%s: short read", path);
}

static int parse_kind(const char *s, OptimizerKind *kind, Err *err) {
    if (!strcmp(s, "adamw"))
        *kind = OPT_ADAMW;
    else if (!strcmp(s, "muon"))
        *kind = OPT_MUON;
    else
        return err_set(err, "unknown optimizer '%s'", s);
    return 0;
}

static int save_and_reload(Optimizer *o, const ParamView *m, OptimizerKind kind, float wd,
                           const char *dir, const char *tag, Err *err) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.resume.safetensors", dir, tag);
    if (optim_save(o, m, path, err)) return -1;
    optim_free(o);
    if (optim_create(o, kind, m, wd, err)) return -1;
    set_muon_knobs(o);
    return optim_load(o, m, path, false, err);
}

static int run(const char *dir, OptimizerKind kind, float wd, float max_norm, long resume_at,
               const char *tag, Err *err) {
    ParamView m;
    Optimizer o = {0};
    float *grads = NULL, *lrs = NULL, *init = NULL, *trajectory = NULL;
    size_t n_grads = 0, n_init = 0;
    char path[1024];
    int rc = read_spec(&m, dir, err);
    if (!rc) rc = read_floats(dir, "weights.bin", &init, &n_init, err);
    if (!rc) rc = read_floats(dir, "grads.bin", &grads, &n_grads, err);
    size_t steps = m.num_floats ? n_grads / m.num_floats : 0;
    if (!rc && (n_init != m.num_floats || steps * m.num_floats != n_grads))
        rc = err_set(err, "%s: weights/grads do not match spec.txt", dir);
    snprintf(path, sizeof path, "%s/lrs.txt", dir);
    FILE *lr_file = rc ? NULL : fopen(path, "r");
    if (!rc && !lr_file) rc = err_set(err, "%s: cannot open", path);
    lrs = calloc(steps + 1, sizeof(float));
    for (size_t s = 0; !rc && s < steps; s++)
        if (fscanf(lr_file, "%f", &lrs[s]) != 1) rc = err_set(err, "%s: short", path);
    if (lr_file) fclose(lr_file);
    if (!rc) rc = optim_create(&o, kind, &m, wd, err);
    if (!rc) set_muon_knobs(&o);

    snprintf(path, sizeof path, "%s/%s.norms.txt", dir, tag);
    FILE *norms = rc ? NULL : fopen(path, "w");
    trajectory = malloc((steps * m.num_floats + 1) * sizeof(float));
    if (!rc) memcpy(m.master, init, m.num_floats * sizeof(float));
    for (size_t s = 0; !rc && s < steps; s++) {
        memcpy(m.grads, grads + s * m.num_floats, m.num_floats * sizeof(float));
        fprintf(norms, "%.9g\n", (double)clip(&m, max_norm));
        optim_step(&o, &m, lrs[s]);
        memcpy(trajectory + s * m.num_floats, m.master, m.num_floats * sizeof(float));
        if ((long)s + 1 == resume_at) rc = save_and_reload(&o, &m, kind, wd, dir, tag, err);
    }
    if (norms) fclose(norms);
    if (!rc) {
        snprintf(path, sizeof path, "%s/%s.weights.bin", dir, tag);
        FILE *f = fopen(path, "wb");
        if (!f ||
            fwrite(trajectory, sizeof(float), steps * m.num_floats, f) != steps * m.num_floats)
            rc = err_set(err, "%s: cannot write", path);
        if (f) fclose(f);
        snprintf(path, sizeof path, "%s/%s.state.safetensors", dir, tag);
        if (!rc) rc = optim_save(&o, &m, path, err);
    }
    optim_free(&o);
    free_model(&m);
    free(grads);
    free(lrs);
    free(init);
    free(trajectory);
    return rc;
}

static int load(const char *dir, OptimizerKind kind, const char *file, Err *err) {
    ParamView m;
    Optimizer o = {0};
    int rc = read_spec(&m, dir, err);
    if (!rc) rc = optim_create(&o, kind, &m, 0.1f, err);
    if (!rc) rc = optim_load(&o, &m, file, false, err);
    optim_free(&o);
    free_model(&m);
    return rc;
}

int main(int argc, char **argv) {
    Err err = {0};
    OptimizerKind kind;
    int rc;
    if (argc == 8 && !strcmp(argv[1], "run")) {
        rc = parse_kind(argv[3], &kind, &err);
        if (!rc)
            rc = run(argv[2], kind, strtof(argv[4], NULL), strtof(argv[5], NULL),
                     strtol(argv[6], NULL, 10), argv[7], &err);
    } else if (argc == 5 && !strcmp(argv[1], "load")) {
        rc = parse_kind(argv[3], &kind, &err);
        if (!rc) rc = load(argv[2], kind, argv[4], &err);
    } else {
        fprintf(stderr, "usage: optim_step run DIR KIND WD MAX_NORM RESUME_AT TAG\n"
                        "       optim_step load DIR KIND FILE\n");
        return EXIT_BAD_INPUT;
    }
    if (rc) {
        printf("%s\n", err.msg);
        return EXIT_BAD_INPUT;
    }
    printf("ok\n");
    return 0;
}
