// sgemm_peak: the "peak" that bench_train.py measures MFU against.
//
// Runs OpenBLAS cblas_sgemm on the shapes of the model's big matmuls (the forward
// of a linear layer: C(M,N) = A(M,K) · W(N,K)^T, row-major, as engine/cpu does it)
// for a few seconds each on --threads threads, and prints one JSON object with the
// best and mean GFLOP/s per shape and the best of all ("peak_gflops").
//
//   bench_sgemm_peak [--threads N] [--seconds S] [--shape M,N,K]...
//
// Default shapes: B*T = 2048 rows of the bench config (hidden 512, KV dim 128,
// intermediate 1408, vocab 8192). Exit 2 on bad flags.
#include <cblas.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"

#define MAX_SHAPES 16

typedef struct {
    int m, n, k;
} Shape;

typedef struct {
    int threads; // 0: OpenBLAS's default
    double seconds;
    Shape shapes[MAX_SHAPES];
    int n_shapes;
} Options;

typedef struct {
    double best_gflops, mean_gflops;
    long calls;
} ShapeResult;

static const Shape DEFAULT_SHAPES[] = {
    {2048, 512, 512},  // q_proj, o_proj
    {2048, 128, 512},  // k_proj, v_proj (2 KV heads x 64)
    {2048, 1408, 512}, // mlp up, gate
    {2048, 512, 1408}, // mlp down
    {2048, 8192, 512}, // lm_head
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int parse_long(const char *flag, const char *text, long lo, long hi, long *out, Err *err) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < lo || v > hi)
        return err_set(err, "%s: '%s' is not an integer in [%ld, %ld]", flag, text, lo, hi);
    *out = v;
    return 0;
}

// "M,N,K" with each dimension in [1, 65536].
static int parse_shape(const char *text, Shape *out, Err *err) {
    int m, n, k, used = 0;
    if (sscanf(text, "%d,%d,%d%n", &m, &n, &k, &used) != 3 || text[used] || m < 1 || n < 1 ||
        k < 1 || m > 65536 || n > 65536 || k > 65536)
        return err_set(err, "--shape: '%s' is not M,N,K with each in [1, 65536]", text);
    *out = (Shape){m, n, k};
    return 0;
}

static int parse_seconds(const char *text, double *out, Err *err) {
    char *end;
    double v = strtod(text, &end);
    if (end == text || *end || !(v > 0 && v <= 600))
        return err_set(err, "--seconds: '%s' is not a number in (0, 600]", text);
    *out = v;
    return 0;
}

static int parse_flag(Options *o, const char *flag, const char *value, Err *err) {
    long v = 0;
    if (strcmp(flag, "--threads") == 0) {
        if (parse_long(flag, value, 0, 4096, &v, err)) return -1;
        o->threads = (int)v;
        return 0;
    }
    if (strcmp(flag, "--seconds") == 0) return parse_seconds(value, &o->seconds, err);
    if (strcmp(flag, "--shape") == 0) {
        if (o->n_shapes == MAX_SHAPES) return err_set(err, "--shape: at most %d", MAX_SHAPES);
        return parse_shape(value, &o->shapes[o->n_shapes++], err);
    }
    return err_set(err, "unknown flag '%s' (--threads N, --seconds S, --shape M,N,K)", flag);
}

static int parse_options(Options *o, int argc, char **argv, Err *err) {
    *o = (Options){.threads = 0, .seconds = 2.0};
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) return err_set(err, "%s: missing value", argv[i]);
        if (parse_flag(o, argv[i], argv[i + 1], err)) return -1;
    }
    if (o->n_shapes == 0) {
        o->n_shapes = (int)(sizeof DEFAULT_SHAPES / sizeof DEFAULT_SHAPES[0]);
        memcpy(o->shapes, DEFAULT_SHAPES, sizeof DEFAULT_SHAPES);
    }
    return 0;
}

static void fill_uniform(float *x, size_t n, unsigned *state) {
    for (size_t i = 0; i < n; i++) {
        *state = *state * 1664525u + 1013904223u;
        x[i] = (float)(*state >> 8) / (float)(1u << 24) - 0.5f;
    }
}

// Times C = A · W^T repeatedly for `seconds` (after one untimed warm-up call).
static int time_shape(Shape s, double seconds, ShapeResult *r, Err *err) {
    size_t na = (size_t)s.m * s.k, nw = (size_t)s.n * s.k, nc = (size_t)s.m * s.n;
    float *a = malloc(na * sizeof *a), *w = malloc(nw * sizeof *w), *c = malloc(nc * sizeof *c);
    if (!a || !w || !c) {
        free(a), free(w), free(c);
        return err_resource(err, "out of memory for shape %d,%d,%d", s.m, s.n, s.k);
    }
    unsigned seed = 12345;
    fill_uniform(a, na, &seed);
    fill_uniform(w, nw, &seed);
    double flops = 2.0 * s.m * s.n * s.k, best = 1e30, total = 0;
    *r = (ShapeResult){0};
    for (long call = -1; total < seconds; call++) {
        double t0 = now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.m, s.n, s.k, 1.0f, a, s.k, w, s.k,
                    0.0f, c, s.n);
        double dt = now_s() - t0;
        if (call < 0) continue; // warm-up: thread start, page faults
        total += dt;
        best = dt < best ? dt : best;
        r->calls++;
    }
    r->best_gflops = flops / best * 1e-9;
    r->mean_gflops = flops * (double)r->calls / total * 1e-9;
    free(a), free(w), free(c);
    return 0;
}

static void print_json(const Options *o, const ShapeResult *results) {
    printf("{\"threads\": %d, \"seconds_per_shape\": %g, \"shapes\": [", openblas_get_num_threads(),
           o->seconds);
    double peak = 0;
    for (int i = 0; i < o->n_shapes; i++) {
        const ShapeResult *r = &results[i];
        printf("%s{\"m\": %d, \"n\": %d, \"k\": %d, \"best_gflops\": %.2f, \"mean_gflops\": %.2f, "
               "\"calls\": %ld}",
               i ? ", " : "", o->shapes[i].m, o->shapes[i].n, o->shapes[i].k, r->best_gflops,
               r->mean_gflops, r->calls);
        peak = r->best_gflops > peak ? r->best_gflops : peak;
    }
    printf("], \"peak_gflops\": %.2f}\n", peak);
}

int main(int argc, char **argv) {
    Options o;
    Err err = {0};
    if (parse_options(&o, argc, argv, &err)) {
        fprintf(stderr, "bench_sgemm_peak: %s\n", err.msg);
        return EXIT_BAD_INPUT;
    }
    if (o.threads > 0) openblas_set_num_threads(o.threads);
    ShapeResult results[MAX_SHAPES] = {{0}};
    for (int i = 0; i < o.n_shapes; i++) {
        if (time_shape(o.shapes[i], o.seconds, &results[i], &err)) {
            fprintf(stderr, "bench_sgemm_peak: %s\n", err.msg);
            return 1;
        }
    }
    print_json(&o, results);
    return 0;
}
