// test_gpu_ops.c: per-op conformance of the CUDA backend against the CPU backend
// (engine/backend.h), every op of the Backend table, on random inputs from a fixed seed, in
// the three compute dtypes (fp32, bf16, fp16); and the determinism of the ops whose
// reductions could be reordered. The memory ops (upload, download, copy, zero, cast_from_f32,
// download_f32) must be exact. Generation's attention_decode too (after the others).
//
// Metric, per output tensor: max|cuda - cpu| / max(1e-6, max|cpu|), the largest error
// relative to the tensor's scale (so elements near 0 do not dominate), the CPU being the
// reference. fp32 mode (DT_F32, TF32 off) must be within 1e-5 for every op. bf16 and fp16
// modes: the inputs in the compute dtype are the CPU inputs rounded to it (fp32 inputs stay
// fp32) and the CPU computes in fp32 on those rounded values, so what is measured is the CUDA
// compute error alone (16-bit outputs, 16-bit intermediates); TOLERANCES below states each
// op's bound. fp16 mode also checks that outputs past fp16's range are inf, not clamped
// (f16_overflow: the trainer's loss scaling finds an overflowed gradient by its inf).
//
// The mixture of experts' router (moe_route) rounds its probabilities to the compute dtype
// before its top-k, so that rounding is part of what it computes: it is compared with the CPU
// backend in the same dtype (backend_cpu_dtype), its integer outputs (experts, counts, pair
// order) exactly, on logits whose choices are decisive on both backends whatever the last bit
// of their expf (exact ties included, which torch.topk's order decides: engine/topk.h); on
// continuous logits, where that last bit may decide a near tie, the GPU's routing must be the
// CPU's routing of the GPU's own probabilities.
//
// Prints one line per output tensor (name, case, dtype, max rel err, tolerance, PASS/FAIL),
// a "test_gpu_ops: DTYPE: ..." line per dtype and a total; when ASTRAI_GPU_REPORT_DIR is set,
// writes the same as JSON to $ASTRAI_GPU_REPORT_DIR/ops.json. Exit 0 all passed, 1 any
// failed, 77 skipped (no GPU visible, or built without CUDA: ctest's SKIP_RETURN_CODE).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/splitmix64.h"
#include "engine/backend.h"
#include "engine/topk.h" // the CPU's top-k, for routings computed on the host
#ifdef ASTRAI_HAVE_CUDA
#include "engine/cuda/cuda_backend.h" // cuda_attention_kernels: which kernels ran
#endif

// ---------------------------------------------------------------- tolerances
// bf16 rounding of an output is at most 2^-9 (0.2%) of the element, so of max|cpu|: ops with
// bf16 outputs computed in fp32 registers get 1e-2 (5x that, for the fp32 work before the
// rounding); flash attention also rounds P (forward) and P, dS (backward) to bf16 for its
// GEMMs, 2e-2 / 3e-2. fp16 keeps 3 more significand bits (its rounding is at most 2^-11 of
// the element, 8x less): a quarter of the bf16 bounds (2.5e-3; attention 5e-3 / 8e-3), twice
// what the 8x alone would allow, as the inputs' spread (fp16 subnormals below 6e-5) is not
// bf16's. fp32 outputs computed from 16-bit-exact inputs differ from the CPU only in the
// order of fp32 additions (and exp/rsqrt approximations), a few 1e-7: 1e-4 or tighter, so a
// 16-bit intermediate (>= 2e-4) would fail them. Gradient accumulators (fp32 +=) get 5e-4.
typedef struct {
    const char *name; // an output ("matmul_bwd.dweight") or a whole op ("rope_fwd")
    double f32, bf16, f16;
    const char *why;
} Tolerance;

static const Tolerance TOLERANCES[] = {
    {"matmul_fwd", 1e-5, 1e-2, 2.5e-3, "16-bit output of an fp32-accumulated GEMM"},
    {"matmul_bwd.dinp", 1e-5, 1e-2, 2.5e-3, "16-bit output of an fp32-accumulated GEMM"},
    {"matmul_bwd.dweight", 1e-5, 5e-4, 5e-4, "fp32 += of exact 16-bit products: order only"},
    {"embedding_fwd", 0, 0, 0, "a row copy: bit-exact"},
    {"embedding_bwd", 1e-5, 1e-5, 1e-5, "fp32 sums of 16-bit-exact rows in the same order"},
    {"rmsnorm_fwd.out", 1e-5, 1e-2, 2.5e-3, "16-bit output, fp32 math"},
    {"rmsnorm_fwd.rstd", 1e-5, 1e-5, 1e-5, "fp32 output from 16-bit-exact inputs"},
    {"rmsnorm_bwd.dinp", 1e-5, 1e-2, 2.5e-3, "16-bit output, fp32 math"},
    {"rmsnorm_bwd.dweight", 1e-5, 5e-4, 5e-4, "fp32 += over rows: summation order only"},
    {"rope_fwd", 1e-5, 1e-2, 2.5e-3, "16-bit output of an fp32 rotation"},
    {"rope_bwd", 1e-5, 1e-2, 2.5e-3, "16-bit output of an fp32 rotation"},
    {"attention_fwd.out", 1e-5, 2e-2, 5e-3, "16-bit output; P rounded to 16 bits for PV"},
    {"attention_fwd.lse", 1e-5, 1e-3, 1e-3, "fp32 logsumexp of fp32-accumulated exact products"},
    {"attention_bwd", 1e-5, 3e-2, 8e-3, "16-bit outputs; P and dS rounded to 16 bits for GEMMs"},
    {"attention_kernels", 0, 0, 0, "16-bit at D=64/128: the tensor-core kernels ran (fp32: SIMT)"},
    {"attention_decode", 1e-5, 1e-2, 2.5e-3, "16-bit output, fp32 math (P stays fp32)"},
    {"swiglu_fwd", 1e-5, 1e-2, 2.5e-3, "16-bit output, fp32 math"},
    {"swiglu_bwd", 1e-5, 1e-2, 2.5e-3, "16-bit output, fp32 math"},
    {"copy_rows", 0, 0, 0, "a strided row copy: bit-exact"},
    {"moe_route", 0, 0, 0, "experts, counts, token_of, slot: integers, exact"},
    // Against the CPU in the same dtype: both round; a last-ulp expf difference may move an
    // element across a rounding boundary: one 16-bit ulp, 2^-7 (bf16) or 2^-10 (fp16) of it.
    {"moe_route.probs", 1e-5, 1e-2, 2.5e-3, "fp32 softmax rounded to 16 bits on both sides"},
    {"moe_route.weight", 1e-5, 1e-2, 2.5e-3, "p / sum of the chosen, rounded on both sides"},
    {"moe_route_bwd", 1e-5, 1e-2, 2.5e-3, "16-bit dlogits, fp32 math"},
    {"moe_combine", 1e-5, 1e-2, 2.5e-3, "16-bit output, fp32 sums in the CPU's order"},
    {"moe_combine_bwd.drows", 1e-5, 1e-2, 2.5e-3, "16-bit output of one product"},
    {"moe_combine_bwd.dshared", 1e-5, 1e-2, 2.5e-3, "16-bit output of one product"},
    {"moe_combine_bwd.dweight", 1e-5, 1e-4, 1e-4, "fp32 dots of 16-bit-exact rows: tree order"},
    {"sigmoid_gate_fwd", 1e-5, 1e-2, 2.5e-3, "16-bit output, fp32 math"},
    {"sigmoid_gate_bwd", 1e-5, 1e-2, 2.5e-3, "16-bit output, fp32 math"},
    {"cross_entropy_fwd", 1e-5, 1e-4, 1e-4, "fp32 outputs from 16-bit-exact logits: order of sums"},
    {"cross_entropy_bwd", 1e-5, 1e-2, 2.5e-3, "16-bit dlogits, fp32 math"},
    {"loss_mean_add", 1e-5, 1e-5, 1e-5, "fp32/double reduction, dtype-free"},
    {"dpo_loss", 1e-5, 1e-5, 1e-5, "double sums of fp32 NLLs, dtype-free"},
    {"grpo_loss", 1e-5, 1e-5, 1e-5, "fp32 per-token math, double sums, dtype-free"},
    {"gaussian_noise_add", 1e-5, 1e-2, 2.5e-3, "device logf/cosf vs the host's; 16-bit output"},
    {"sum_squares", 1e-5, 1e-5, 1e-5, "double reduction, dtype-free"},
    {"scale", 1e-5, 1e-5, 1e-5, "fp32, dtype-free"},
    {"adamw", 1e-5, 1e-5, 1e-5, "fp32, dtype-free (FMA contraction differs by an ulp)"},
    {"muon.w", 1e-5, 1e-5, 1e-5, "fp32 weights after the step"},
    {"muon.buf", 1e-5, 1e-5, 1e-5, "fp32 momentum lerp"},
    // The update alone (w_new - w_old), stricter than w: 5 chained Newton-Schulz GEMMs whose
    // quintic amplifies rounding differences of small singular values (up to ~3.4x a step);
    // in 16-bit modes the implementation may run them in bf16/TF32, as torch's Muon does.
    {"muon.update", 1e-4, 1e-2, 1e-2, "Newton-Schulz: 5 chained GEMMs amplify GEMM rounding"},
    {"memory", 0, 0, 0, "copies and the 16-bit rounding (to nearest even) are exact"},
    {"determinism", 0, 0, 0, "two runs on the GPU: bit-identical"},
    // fp16 only: the fraction of elements whose fp16 overflow (+-inf, from the CPU's fp32
    // result past 65504) the GPU did not reproduce; 1 when nothing overflowed.
    {"f16_overflow", 0, 0, 0, "outputs past 65504 are +-inf, never clamped to 65504"},
};

static const Tolerance *tolerance_of(const char *name) {
    const Tolerance *best = NULL;
    size_t best_len = 0;
    for (size_t i = 0; i < sizeof TOLERANCES / sizeof TOLERANCES[0]; i++) {
        size_t len = strlen(TOLERANCES[i].name);
        int match =
            strncmp(name, TOLERANCES[i].name, len) == 0 && (name[len] == '\0' || name[len] == '.');
        if (match && len > best_len) best = &TOLERANCES[i], best_len = len;
    }
    if (!best) {
        fprintf(stderr, "test_gpu_ops: no tolerance for '%s'\n", name);
        exit(1);
    }
    return best;
}

// ---------------------------------------------------------------- results
typedef struct {
    char name[48], shape[80];
    const char *dtype;
    double err, tol;
    int pass;
} Result;

enum { MAX_RESULTS = 1024 };
static Result results[MAX_RESULTS];
static int n_results, n_failed;

static void record(DType dt, const char *name, const char *shape, double err) {
    if (n_results == MAX_RESULTS) {
        fprintf(stderr, "test_gpu_ops: more than %d results\n", MAX_RESULTS);
        exit(1);
    }
    const Tolerance *t = tolerance_of(name);
    Result *r = &results[n_results++];
    snprintf(r->name, sizeof r->name, "%s", name);
    snprintf(r->shape, sizeof r->shape, "%s", shape);
    r->dtype = dtype_name(dt);
    r->tol = dt == DT_BF16 ? t->bf16 : dt == DT_F16 ? t->f16 : t->f32;
    r->err = err;
    r->pass = err <= r->tol; // false for NaN
    n_failed += !r->pass;
    printf("%-34s %-40s %-4s %11.3e %9.1e %s\n", r->name, r->shape, r->dtype, r->err, r->tol,
           r->pass ? "PASS" : "FAIL");
    fflush(stdout);
}

static void json_number(FILE *f, double v) {
    if (isfinite(v))
        fprintf(f, "%.6g", v);
    else
        fprintf(f, "null"); // NaN / inf: not JSON numbers
}

static void write_json(const char *skipped) {
    const char *dir = getenv("ASTRAI_GPU_REPORT_DIR");
    if (!dir || !*dir) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/ops.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        return;
    }
    fprintf(f, "{\n  \"metric\": \"max|cuda - cpu| / max(1e-6, max|cpu|) per output tensor\",\n");
    if (skipped) fprintf(f, "  \"skipped\": \"%s\",\n", skipped);
    fprintf(f, "  \"failed\": %d,\n  \"results\": [", n_failed);
    for (int i = 0; i < n_results; i++) {
        const Result *r = &results[i];
        fprintf(f,
                "%s\n    {\"op\": \"%s\", \"case\": \"%s\", \"dtype\": \"%s\", \"max_rel_err\": ",
                i ? "," : "", r->name, r->shape, r->dtype);
        json_number(f, r->err);
        fprintf(f, ", \"tol\": ");
        json_number(f, r->tol);
        fprintf(f, ", \"pass\": %s}", r->pass ? "true" : "false");
    }
    fprintf(f, "\n  ],\n  \"tolerances\": [");
    for (size_t i = 0; i < sizeof TOLERANCES / sizeof TOLERANCES[0]; i++)
        fprintf(f,
                "%s\n    {\"op\": \"%s\", \"fp32\": %g, \"bf16\": %g, \"fp16\": %g, \"why\": "
                "\"%s\"}",
                i ? "," : "", TOLERANCES[i].name, TOLERANCES[i].f32, TOLERANCES[i].bf16,
                TOLERANCES[i].f16, TOLERANCES[i].why);
    fprintf(f, "\n  ]\n}\n");
    fclose(f);
}

// ---------------------------------------------------------------- host data
static uint64_t rng_state = 0x5eed5eed12345678ull;

static uint64_t rng_next(void) {
    return splitmix64_next(&rng_state);
}

static float rng_uniform(float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(rng_next() >> 11) / 9007199254740992.0);
}

static int rng_int(int n) {
    return (int)(rng_next() % (uint64_t)n);
}

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "test_gpu_ops: out of host memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static float *host_rand(size_t n, float lo, float hi) {
    float *x = xmalloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++)
        x[i] = rng_uniform(lo, hi);
    return x;
}

// fp32 -> bf16 -> fp32, round to nearest even (finite inputs).
static float bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, 4);
    return x;
}

// fp32 -> fp16 bits, round to nearest even (the default rounding mode of nearbyint): +-inf
// from 65520 (halfway from the largest finite 65504 to 2^16) on, gradual underflow
// (subnormals 2^-24 apart). |x| = m 2^q with q its ulp's exponent, m < 2^11 (2^11 after a
// carry, which the encoding takes as the next exponent): bits ((q + 24) << 10) + m.
static uint16_t f16_bits(float x) {
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs((double)x);
    if (isnan(x)) return 0x7e00;
    if (a >= 65520.0) return sign | 0x7c00;
    if (a == 0) return sign;
    int e;
    frexp(a, &e); // a in [2^(e-1), 2^e): its ulp is 2^(e-11), 2^-24 at least (subnormals)
    int q = e - 11 < -24 ? -24 : e - 11;
    return (uint16_t)(sign | (((q + 24) << 10) + (int)nearbyint(ldexp(a, -q))));
}

static float f16_value(uint16_t h) {
    int e = h >> 10 & 0x1f, m = h & 0x3ff;
    double v = e == 0x1f ? (m ? NAN : INFINITY) : e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return (float)(h & 0x8000 ? -v : v);
}

// x as the compute dtype dt holds it (finite x for bf16).
static float dtype_round(DType dt, float x) {
    return dt == DT_BF16 ? bf16_round(x) : dt == DT_F16 ? f16_value(f16_bits(x)) : x;
}

// max|a - b| / max(1e-6, max|b|); infinite when a has a NaN/inf where b is finite.
static double rel_err(const float *a, const float *b, size_t n) {
    double diff = 0, ref = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i]) || !isfinite(b[i])) return INFINITY;
        double d = fabs((double)a[i] - (double)b[i]);
        if (d > diff) diff = d;
        if (fabs((double)b[i]) > ref) ref = fabs((double)b[i]);
    }
    return diff / fmax(1e-6, ref);
}

// ---------------------------------------------------------------- backend buffers
// A tensor on both backends with the same contents. act: in the compute dtype (bf16 or fp16 on
// the GPU in those modes); otherwise fp32 or raw bytes (int32, double) on both.
typedef struct {
    void *cpu, *gpu;
    size_t n;
    int act;
} Pair;

typedef struct {
    const Backend *cpu, *gpu;
    const Backend *cpu_dt; // the CPU backend in the compute dtype (moe_route's reference)
    DType dt;
    // Buffers to free at the end of a case (after a sync: the GPU may still be using them).
    struct {
        const Backend *be;
        void *p;
    } owned[256];
    int n_owned;
} Ctx;

static void *be_alloc(Ctx *c, const Backend *be, size_t bytes) {
    Err err = {0};
    void *p = be->alloc(bytes ? bytes : 4, &err);
    if (!p) {
        fprintf(stderr, "test_gpu_ops: %s alloc of %zu bytes: %s\n", be->name, bytes, err.msg);
        exit(1);
    }
    if (c->n_owned == (int)(sizeof c->owned / sizeof c->owned[0])) {
        fprintf(stderr, "test_gpu_ops: too many buffers in one case\n");
        exit(1);
    }
    c->owned[c->n_owned].be = be;
    c->owned[c->n_owned++].p = p;
    return p;
}

static void release(Ctx *c) {
    c->gpu->sync();
    for (int i = 0; i < c->n_owned; i++)
        c->owned[i].be->free(c->owned[i].p);
    c->n_owned = 0;
}

// A compute-dtype tensor from host fp32 values; in bf16 and fp16 modes the host values are
// rounded first (in place, so the caller's array is the effective input of both sides).
static Pair pair_act(Ctx *c, float *host, size_t n) {
    if (c->dt != DT_F32)
        for (size_t i = 0; i < n; i++)
            host[i] = dtype_round(c->dt, host[i]);
    Pair p = {be_alloc(c, c->cpu, n * 4), be_alloc(c, c->gpu, n * dtype_size(c->dt)), n, 1};
    c->cpu->upload(p.cpu, host, n * 4);
    if (c->dt == DT_F32) {
        c->gpu->upload(p.gpu, host, n * 4);
    } else {
        float *staging = be_alloc(c, c->gpu, n * 4);
        c->gpu->upload(staging, host, n * 4);
        c->gpu->cast_from_f32(p.gpu, staging, n); // exact: the values are 16-bit already
    }
    return p;
}

// Raw bytes on both (fp32, int32, double tensors).
static Pair pair_raw(Ctx *c, const void *host, size_t n, size_t elem) {
    Pair p = {be_alloc(c, c->cpu, n * elem), be_alloc(c, c->gpu, n * elem), n, 0};
    c->cpu->upload(p.cpu, host, n * elem);
    c->gpu->upload(p.gpu, host, n * elem);
    return p;
}

static Pair pair_f32(Ctx *c, const float *host, size_t n) {
    return pair_raw(c, host, n, 4);
}

static Pair pair_i32(Ctx *c, const int32_t *host, size_t n) {
    return pair_raw(c, host, n, 4);
}

// The element at offset `elems` of a backend tensor in the compute dtype.
static void *at(const Backend *be, void *p, size_t elems) {
    return (char *)p + elems * dtype_size(be->dtype);
}

// Both sides of a pair as host fp32 arrays (caller frees).
static void pair_read(Ctx *c, const Pair *p, float **cpu_out, float **gpu_out) {
    *cpu_out = xmalloc(p->n * 4);
    *gpu_out = xmalloc(p->n * 4);
    c->cpu->download(*cpu_out, p->cpu, p->n * 4);
    if (p->act && c->dt != DT_F32)
        c->gpu->download_f32(*gpu_out, p->gpu, p->n);
    else
        c->gpu->download(*gpu_out, p->gpu, p->n * 4);
}

static void compare(Ctx *c, const char *name, const char *shape, const Pair *p) {
    float *a, *b;
    pair_read(c, p, &b, &a);
    record(c->dt, name, shape, rel_err(a, b, p->n));
    free(a);
    free(b);
}

// Compares columns [c0, c1) of an (rows, cols) pair.
static void compare_cols(Ctx *c, const char *name, const char *shape, const Pair *p, size_t rows,
                         size_t cols, size_t c0, size_t c1) {
    float *a, *b;
    pair_read(c, p, &b, &a);
    size_t w = c1 - c0;
    float *sa = xmalloc(rows * w * 4), *sb = xmalloc(rows * w * 4);
    for (size_t r = 0; r < rows; r++) {
        memcpy(sa + r * w, a + r * cols + c0, w * 4);
        memcpy(sb + r * w, b + r * cols + c0, w * 4);
    }
    record(c->dt, name, shape, rel_err(sa, sb, rows * w));
    free(sa);
    free(sb);
    free(a);
    free(b);
}

static void compare_double(Ctx *c, const char *name, const char *shape, const Pair *p) {
    double a, b;
    c->cpu->download(&b, p->cpu, sizeof b);
    c->gpu->download(&a, p->gpu, sizeof a);
    double err = isfinite(a) ? fabs(a - b) / fmax(1e-6, fabs(b)) : INFINITY;
    record(c->dt, name, shape, err);
}

// ---------------------------------------------------------------- shared inputs
// Masks of test_attention: causal, packed documents, and documents with a sliding window.
enum { CAUSAL, DOCS, DOCS_WINDOW, WINDOW = 100 };

// doc_start: (B,T) for documents of batch row b starting at the given offsets (0 first), each
// query's first key moved up to its sliding window's (t - WINDOW + 1) with DOCS_WINDOW.
static int32_t *doc_starts(int B, int T, int docs) {
    // Edge cases: one-token documents in the middle (150) and at the end (T-1).
    static const int starts0[] = {0, 37, 150, 151, -1}, starts1[] = {0, 64, 200};
    int32_t *d = xmalloc((size_t)B * T * 4);
    for (int b = 0; b < B; b++) {
        const int *s = b % 2 ? starts1 : starts0;
        int ns = b % 2 ? 3 : 5;
        for (int t = 0; t < T; t++) {
            int start = 0;
            for (int i = 0; docs && i < ns; i++) {
                int si = s[i] < 0 ? T - 1 : s[i];
                if (si <= t && si < T) start = si;
            }
            if (docs == DOCS_WINDOW && t - WINDOW + 1 > start) start = t - WINDOW + 1;
            d[(size_t)b * T + t] = start;
        }
    }
    return d;
}

// ---------------------------------------------------------------- ops
static void test_matmul(Ctx *c, int N, int C, int OC) {
    for (int acc = 0; acc <= 1; acc++) {
        char sh[80];
        snprintf(sh, sizeof sh, "N=%d C=%d OC=%d acc=%d", N, C, OC, acc);
        float *inp = host_rand((size_t)N * C, -1, 1), *w = host_rand((size_t)OC * C, -0.1f, 0.1f);
        float *out0 = host_rand((size_t)N * OC, -1, 1), *dout = host_rand((size_t)N * OC, -1, 1);
        float *dinp0 = host_rand((size_t)N * C, -1, 1), *dw0 = host_rand((size_t)OC * C, -1, 1);
        Pair pi = pair_act(c, inp, (size_t)N * C), pw = pair_act(c, w, (size_t)OC * C);
        Pair po = pair_act(c, out0, (size_t)N * OC), pd = pair_act(c, dout, (size_t)N * OC);
        Pair pdi = pair_act(c, dinp0, (size_t)N * C), pdw = pair_f32(c, dw0, (size_t)OC * C);
        c->cpu->matmul_fwd(po.cpu, pi.cpu, pw.cpu, N, C, OC, acc);
        c->gpu->matmul_fwd(po.gpu, pi.gpu, pw.gpu, N, C, OC, acc);
        compare(c, "matmul_fwd.out", sh, &po);
        c->cpu->matmul_bwd(pdi.cpu, pdw.cpu, pd.cpu, pi.cpu, pw.cpu, N, C, OC, acc);
        c->gpu->matmul_bwd(pdi.gpu, pdw.gpu, pd.gpu, pi.gpu, pw.gpu, N, C, OC, acc);
        compare(c, "matmul_bwd.dinp", sh, &pdi);
        compare(c, "matmul_bwd.dweight", sh, &pdw);
        release(c);
        free(inp), free(w), free(out0), free(dout), free(dinp0), free(dw0);
    }
}

// ids with many repeats (half the tokens share 50 ids); by_id: stable counting sort.
static void embedding_ids(int N, int V, int32_t *ids, int32_t *by_id) {
    for (int n = 0; n < N; n++)
        ids[n] = rng_int(2) ? rng_int(50) : rng_int(V);
    ids[N - 1] = V - 1;
    int32_t *start = calloc((size_t)V + 1, 4);
    if (!start) exit(1);
    for (int n = 0; n < N; n++)
        start[ids[n] + 1]++;
    for (int v = 0; v < V; v++)
        start[v + 1] += start[v];
    for (int n = 0; n < N; n++)
        by_id[start[ids[n]]++] = n;
    free(start);
}

static void test_embedding(Ctx *c, int N, int V, int C) {
    char sh[80];
    snprintf(sh, sizeof sh, "N=%d V=%d C=%d", N, V, C);
    int32_t *ids = xmalloc((size_t)N * 4), *by_id = xmalloc((size_t)N * 4);
    embedding_ids(N, V, ids, by_id);
    float *table = host_rand((size_t)V * C, -1, 1), *out0 = host_rand((size_t)N * C, -1, 1);
    float *dout = host_rand((size_t)N * C, -1, 1), *dt0 = host_rand((size_t)V * C, -1, 1);
    Pair pids = pair_i32(c, ids, N), pby = pair_i32(c, by_id, N);
    Pair pt = pair_act(c, table, (size_t)V * C), po = pair_act(c, out0, (size_t)N * C);
    Pair pd = pair_act(c, dout, (size_t)N * C), pdt = pair_f32(c, dt0, (size_t)V * C);
    c->cpu->embedding_fwd(po.cpu, pids.cpu, pt.cpu, N, C);
    c->gpu->embedding_fwd(po.gpu, pids.gpu, pt.gpu, N, C);
    compare(c, "embedding_fwd.out", sh, &po);
    c->cpu->embedding_bwd(pdt.cpu, pd.cpu, pids.cpu, pby.cpu, N, C);
    c->gpu->embedding_bwd(pdt.gpu, pd.gpu, pids.gpu, pby.gpu, N, C);
    compare(c, "embedding_bwd.dtable", sh, &pdt);
    release(c);
    free(ids), free(by_id), free(table), free(out0), free(dout), free(dt0);
}

// Groups g of C elements at x[n*stride + offset + g*C + c] (offset: where the group block
// starts in the token's row, e.g. k heads after q heads in the fused q|k|v row).
static void test_rmsnorm(Ctx *c, int N, int G, int C, int stride, int offset) {
    size_t total = (size_t)N * stride;
    const float eps = 1e-5f;
    for (int acc = 0; acc <= 1; acc++) {
        char sh[80];
        snprintf(sh, sizeof sh, "N=%d G=%d C=%d stride=%d off=%d acc=%d", N, G, C, stride, offset,
                 acc);
        float *inp = host_rand(total, -2, 2), *w = host_rand((size_t)C, 0.5f, 1.5f);
        float *out0 = host_rand(total, -1, 1), *rstd0 = host_rand((size_t)N * G, 0, 1);
        Pair pin = pair_act(c, inp, total), pw = pair_act(c, w, C);
        Pair pout = pair_act(c, out0, total), prstd = pair_f32(c, rstd0, (size_t)N * G);
        // The whole buffers are compared: elements outside the groups must stay untouched.
        c->cpu->rmsnorm_fwd(at(c->cpu, pout.cpu, offset), prstd.cpu, at(c->cpu, pin.cpu, offset),
                            pw.cpu, N, G, C, stride, eps);
        c->gpu->rmsnorm_fwd(at(c->gpu, pout.gpu, offset), prstd.gpu, at(c->gpu, pin.gpu, offset),
                            pw.gpu, N, G, C, stride, eps);
        if (!acc) { // the forward has no accumulate flag: compare it once
            compare(c, "rmsnorm_fwd.out", sh, &pout);
            compare(c, "rmsnorm_fwd.rstd", sh, &prstd);
        }
        // Backward from the CPU's rstd on both sides.
        float *rstd = xmalloc((size_t)N * G * 4);
        c->cpu->download(rstd, prstd.cpu, (size_t)N * G * 4);
        float *dout = host_rand(total, -1, 1), *dinp0 = host_rand(total, -1, 1);
        float *dw0 = host_rand((size_t)C, -1, 1);
        Pair prs = pair_f32(c, rstd, (size_t)N * G), pd = pair_act(c, dout, total);
        Pair pdi = pair_act(c, dinp0, total), pdw = pair_f32(c, dw0, C);
        c->cpu->rmsnorm_bwd(at(c->cpu, pdi.cpu, offset), pdw.cpu, at(c->cpu, pd.cpu, offset),
                            at(c->cpu, pin.cpu, offset), pw.cpu, prs.cpu, N, G, C, stride, acc);
        c->gpu->rmsnorm_bwd(at(c->gpu, pdi.gpu, offset), pdw.gpu, at(c->gpu, pd.gpu, offset),
                            at(c->gpu, pin.gpu, offset), pw.gpu, prs.gpu, N, G, C, stride, acc);
        compare(c, "rmsnorm_bwd.dinp", sh, &pdi);
        compare(c, "rmsnorm_bwd.dweight", sh, &pdw);
        release(c);
        free(inp), free(w), free(out0), free(rstd0), free(rstd), free(dout), free(dinp0), free(dw0);
    }
}

// cos_sin: (P, D/2, 2), angle = p * 10000^(-2i/D) as engine/model.c builds it.
static float *rope_table(int P, int D) {
    float *t = xmalloc((size_t)P * D * 4);
    for (int p = 0; p < P; p++)
        for (int i = 0; i < D / 2; i++) {
            float angle = (float)(p * pow(10000.0, -2.0 * i / D));
            t[(size_t)p * D + 2 * i] = (float)cos(angle);
            t[(size_t)p * D + 2 * i + 1] = (float)sin(angle);
        }
    return t;
}

static void test_rope(Ctx *c, int B, int T, int G, int D, int stride) {
    int N = B * T;
    size_t total = (size_t)N * stride;
    char sh[80];
    snprintf(sh, sizeof sh, "B=%d T=%d G=%d D=%d stride=%d docs", B, T, G, D, stride);
    int32_t *ds = doc_starts(B, T, 1), *pos = xmalloc((size_t)N * 4);
    for (int n = 0; n < N; n++)
        pos[n] = n % T - ds[n]; // SFT positions restart with each document
    float *table = rope_table(T, D), *x = host_rand(total, -2, 2), *dx = host_rand(total, -2, 2);
    Pair ppos = pair_i32(c, pos, N), ptab = pair_f32(c, table, (size_t)T * D);
    Pair px = pair_act(c, x, total), pdx = pair_act(c, dx, total);
    c->cpu->rope_fwd(px.cpu, ppos.cpu, ptab.cpu, N, G, D, stride);
    c->gpu->rope_fwd(px.gpu, ppos.gpu, ptab.gpu, N, G, D, stride);
    compare(c, "rope_fwd.x", sh, &px);
    c->cpu->rope_bwd(pdx.cpu, ppos.cpu, ptab.cpu, N, G, D, stride);
    c->gpu->rope_bwd(pdx.gpu, ppos.gpu, ptab.gpu, N, G, D, stride);
    compare(c, "rope_bwd.dx", sh, &pdx);
    release(c);
    free(ds), free(pos), free(table), free(x), free(dx);
}

// bf16 and fp16 at D = 64, 128 (test_attention's rows are aligned) take the tensor cores: a
// silent fallback to the SIMT kernels would pass every comparison. 1 = the other ones ran.
static void check_attention_kernels(Ctx *c, const char *name, const char *shape, int D) {
#ifdef ASTRAI_HAVE_CUDA
    int mma = c->dt != DT_F32 && (D == 64 || D == 128);
    const char *want = mma ? "tensor-core" : "simt", *got = cuda_attention_kernels();
    if (strcmp(got, want)) printf("%s: the %s kernels ran, not %s\n", name, got, want);
    record(c->dt, name, shape, strcmp(got, want) != 0);
#else
    (void)c, (void)name, (void)shape, (void)D; // never reached: no CUDA backend to open
#endif
}

static void test_attention(Ctx *c, int B, int T, int H, int KVH, int D, int docs) {
    int N = B * T, stride = (H + 2 * KVH) * D;
    size_t total = (size_t)N * stride, nout = (size_t)N * H * D, nlse = (size_t)B * H * T;
    char sh[80];
    snprintf(sh, sizeof sh, "B=%d T=%d H=%d KVH=%d D=%d %s", B, T, H, KVH, D,
             docs == DOCS_WINDOW ? "docs window 100"
             : docs              ? "docs"
                                 : "causal");
    int32_t *ds = doc_starts(B, T, docs);
    // Scores of std ~1.3: softmax rows neither flat nor one-hot.
    float *qkv = host_rand(total, -2, 2), *out0 = host_rand(nout, -1, 1);
    float *lse0 = host_rand(nlse, -1, 1), *dout = host_rand(nout, -1, 1);
    float *dqkv0 = host_rand(total, -1, 1);
    Pair pds = pair_i32(c, ds, N), pq = pair_act(c, qkv, total), po = pair_act(c, out0, nout);
    Pair pl = pair_f32(c, lse0, nlse);
    size_t ko = (size_t)H * D, vo = (size_t)(H + KVH) * D;
    Err err = {0};
    if (c->cpu->attention_reserve(T, D, &err)) {
        fprintf(stderr, "test_gpu_ops: %s\n", err.msg);
        exit(1);
    }
    c->cpu->attention_fwd(po.cpu, pl.cpu, pq.cpu, at(c->cpu, pq.cpu, ko), at(c->cpu, pq.cpu, vo),
                          pds.cpu, B, T, H, KVH, D, stride);
    c->gpu->attention_fwd(po.gpu, pl.gpu, pq.gpu, at(c->gpu, pq.gpu, ko), at(c->gpu, pq.gpu, vo),
                          pds.gpu, B, T, H, KVH, D, stride);
    check_attention_kernels(c, "attention_kernels.fwd", sh, D);
    compare(c, "attention_fwd.out", sh, &po);
    compare(c, "attention_fwd.lse", sh, &pl);
    // Backward from the CPU's out and lse on both sides.
    float *out = xmalloc(nout * 4), *lse = xmalloc(nlse * 4);
    c->cpu->download(out, po.cpu, nout * 4);
    c->cpu->download(lse, pl.cpu, nlse * 4);
    Pair pout = pair_act(c, out, nout), plse = pair_f32(c, lse, nlse);
    Pair pd = pair_act(c, dout, nout), pdq = pair_act(c, dqkv0, total);
    c->cpu->attention_bwd(pdq.cpu, at(c->cpu, pdq.cpu, ko), at(c->cpu, pdq.cpu, vo), pd.cpu,
                          pout.cpu, plse.cpu, pq.cpu, at(c->cpu, pq.cpu, ko),
                          at(c->cpu, pq.cpu, vo), pds.cpu, B, T, H, KVH, D, stride);
    c->gpu->attention_bwd(pdq.gpu, at(c->gpu, pdq.gpu, ko), at(c->gpu, pdq.gpu, vo), pd.gpu,
                          pout.gpu, plse.gpu, pq.gpu, at(c->gpu, pq.gpu, ko),
                          at(c->gpu, pq.gpu, vo), pds.gpu, B, T, H, KVH, D, stride);
    check_attention_kernels(c, "attention_kernels.bwd", sh, D);
    compare_cols(c, "attention_bwd.dq", sh, &pdq, N, stride, 0, ko);
    compare_cols(c, "attention_bwd.dk", sh, &pdq, N, stride, ko, vo);
    compare_cols(c, "attention_bwd.dv", sh, &pdq, N, stride, vo, stride);
    release(c);
    free(ds), free(qkv), free(out0), free(lse0), free(dout), free(dqkv0), free(out), free(lse);
}

static void test_swiglu(Ctx *c, int N, int FF) {
    char sh[80];
    snprintf(sh, sizeof sh, "N=%d FF=%d", N, FF);
    size_t nh = (size_t)N * 2 * FF, no = (size_t)N * FF;
    float *h = host_rand(nh, -3, 3), *out0 = host_rand(no, -1, 1), *dout = host_rand(no, -1, 1);
    float *dh0 = host_rand(nh, -1, 1);
    Pair ph = pair_act(c, h, nh), po = pair_act(c, out0, no), pd = pair_act(c, dout, no);
    Pair pdh = pair_act(c, dh0, nh);
    c->cpu->swiglu_fwd(po.cpu, ph.cpu, N, FF);
    c->gpu->swiglu_fwd(po.gpu, ph.gpu, N, FF);
    compare(c, "swiglu_fwd.out", sh, &po);
    c->cpu->swiglu_bwd(pdh.cpu, pd.cpu, ph.cpu, N, FF);
    c->gpu->swiglu_bwd(pdh.gpu, pd.gpu, ph.gpu, N, FF);
    compare(c, "swiglu_bwd.dh", sh, &pdh);
    release(c);
    free(h), free(out0), free(dout), free(dh0);
}

static void test_sigmoid_gate(Ctx *c, size_t n) {
    char sh[80];
    snprintf(sh, sizeof sh, "n=%zu", n);
    float *x = host_rand(n, -3, 3), *g = host_rand(n, -6, 6), *out0 = host_rand(n, -1, 1);
    float *dout = host_rand(n, -1, 1), *dx0 = host_rand(n, -1, 1), *dg0 = host_rand(n, -1, 1);
    Pair px = pair_act(c, x, n), pg = pair_act(c, g, n), po = pair_act(c, out0, n);
    Pair pd = pair_act(c, dout, n), pdx = pair_act(c, dx0, n), pdg = pair_act(c, dg0, n);
    c->cpu->sigmoid_gate_fwd(po.cpu, px.cpu, pg.cpu, n);
    c->gpu->sigmoid_gate_fwd(po.gpu, px.gpu, pg.gpu, n);
    compare(c, "sigmoid_gate_fwd.out", sh, &po);
    c->cpu->sigmoid_gate_bwd(pdx.cpu, pdg.cpu, pd.cpu, px.cpu, pg.cpu, n);
    c->gpu->sigmoid_gate_bwd(pdx.gpu, pdg.gpu, pd.gpu, px.gpu, pg.gpu, n);
    compare(c, "sigmoid_gate_bwd.dx", sh, &pdx);
    compare(c, "sigmoid_gate_bwd.dg", sh, &pdg);
    release(c);
    free(x), free(g), free(out0), free(dout), free(dx0), free(dg0);
}

// ---------------------------------------------------------------- MLA and MoE
// copy_rows: rows of cols elements from a wider source row to a wider destination row, each
// at an offset (MLA's per-head k, v into the q|k|v rows and out of them). The whole
// destination is compared: what lies between the rows stays untouched.
static void test_copy_rows(Ctx *c, int rows, int cols, int dst_stride, int dst_off, int src_stride,
                           int src_off) {
    char sh[80];
    snprintf(sh, sizeof sh, "rows=%d cols=%d dst=%d+%d src=%d+%d", rows, cols, dst_stride, dst_off,
             src_stride, src_off);
    size_t nd = (size_t)rows * dst_stride, ns = (size_t)rows * src_stride;
    float *dst = host_rand(nd, -1, 1), *src = host_rand(ns, -2, 2);
    Pair pd = pair_act(c, dst, nd), ps = pair_act(c, src, ns);
    c->cpu->copy_rows(at(c->cpu, pd.cpu, dst_off), dst_stride, at(c->cpu, ps.cpu, src_off),
                      src_stride, rows, cols);
    c->gpu->copy_rows(at(c->gpu, pd.gpu, dst_off), dst_stride, at(c->gpu, ps.gpu, src_off),
                      src_stride, rows, cols);
    compare(c, "copy_rows", sh, &pd);
    release(c);
    free(dst), free(src);
}

// Integer outputs: err = the fraction of elements of got that differ from want, the first
// difference printed.
static void record_i32(Ctx *c, const char *name, const char *shape, const int32_t *got,
                       const int32_t *want, size_t n) {
    size_t diff = 0, first = n;
    for (size_t i = 0; i < n; i++)
        if (got[i] != want[i]) diff++, first = first < n ? first : i;
    if (diff)
        printf("%s %s: element %zu is %d, want %d\n", name, shape, first, (int)got[first],
               (int)want[first]);
    record(c->dt, name, shape, (double)diff / (double)(n ? n : 1));
}

static int32_t *download_i32(const Backend *be, const void *p, size_t n) {
    int32_t *x = xmalloc(n * 4);
    be->download(x, p, n * 4);
    return x;
}

static void compare_i32(Ctx *c, const char *name, const char *shape, const Pair *p) {
    int32_t *a = download_i32(c->gpu, p->gpu, p->n), *b = download_i32(c->cpu, p->cpu, p->n);
    record_i32(c, name, shape, a, b, p->n);
    free(a), free(b);
}

static int32_t *i32_filled(size_t n, int32_t v) {
    int32_t *x = xmalloc(n * 4);
    for (size_t i = 0; i < n; i++)
        x[i] = v;
    return x;
}

// The CPU backend's routing (engine/cpu/moe.c) of given probabilities (N,E), on the host:
// torch.topk's choice (engine/topk.h) listed by expert index, the weights p / (their sum in
// torch.topk's order) rounded to dt, and the (token, choice) pairs grouped by expert in token
// order.
static void host_route(DType dt, const float *probs, int N, int E, int k, float *weight,
                       int32_t *expert, int32_t *counts, int32_t *token_of, int32_t *slot) {
    TopkPair *scratch = xmalloc((size_t)E * sizeof *scratch);
    for (int n = 0; n < N; n++) {
        const float *p = probs + (size_t)n * E;
        int32_t *ex = expert + (size_t)n * k;
        topk_torch_cpu(p, E, k, scratch, ex);
        float total = 0.0f;
        for (int j = 0; j < k; j++)
            total += p[ex[j]];
        topk_by_index(ex, k);
        for (int j = 0; j < k; j++)
            weight[(size_t)n * k + j] = dtype_round(dt, p[ex[j]] / total);
    }
    int32_t *next = xmalloc((size_t)E * 4);
    memset(counts, 0, (size_t)E * 4);
    for (size_t p = 0; p < (size_t)N * k; p++)
        counts[expert[p]]++;
    for (int e = 0, sum = 0; e < E; e++)
        next[e] = sum, sum += counts[e];
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            int32_t p = next[expert[(size_t)n * k + j]]++;
            token_of[p] = n;
            slot[(size_t)n * k + j] = p;
        }
    free(scratch), free(next);
}

// Router logits: ROUTE_LEVELS takes 8 levels 0.5 apart (probabilities a factor e^0.5 apart,
// far past any rounding), so a token's experts tie exactly in groups, whose order torch.topk's
// algorithm decides, and every other comparison is decisive on both backends whatever the last
// bit of their expf; ONE_EXPERT: the levels with expert E/2 8 higher (every token's first
// choice, the others left with the rest or none); EMPTY_EXPERT: expert E-1 8 lower (no token
// chooses it while k < E); TIED: all equal (every probability 1/E); RANDOM: uniform in [-4, 4].
enum { ROUTE_RANDOM, ROUTE_LEVELS, ROUTE_ONE_EXPERT, ROUTE_EMPTY_EXPERT, ROUTE_TIED };
static const char *const ROUTE_CASE[] = {"random", "tied levels", "one expert for all",
                                         "an empty expert", "all tied"};

static float *route_logits(int kind, int N, int E) {
    float *z = xmalloc((size_t)N * E * 4);
    for (int n = 0; n < N; n++)
        for (int e = 0; e < E; e++) {
            float v = kind == ROUTE_RANDOM ? rng_uniform(-4, 4)
                      : kind == ROUTE_TIED ? 0.25f
                                           : 0.5f * (float)rng_int(8) - 2.0f;
            if (kind == ROUTE_ONE_EXPERT && e == E / 2) v += 8.0f;
            if (kind == ROUTE_EMPTY_EXPERT && e == E - 1) v -= 8.0f;
            z[(size_t)n * E + e] = v; // exact in bf16 and fp16 but for RANDOM
        }
    return z;
}

// moe_route against the CPU backend in the compute dtype (see the top of the file): probs and
// weight within tolerance, experts, counts, token_of and slot exactly (every output starts as
// garbage, so one left unwritten fails); on RANDOM logits the integer outputs and weights
// against the host's routing of the GPU's probabilities. Then moe_route_bwd from the CPU's
// probs and experts on both sides, against the fp32 CPU.
static void test_moe_route(Ctx *c, int N, int E, int k, int kind) {
    char sh[80];
    snprintf(sh, sizeof sh, "N=%d E=%d k=%d %s", N, E, k, ROUTE_CASE[kind]);
    size_t ne = (size_t)N * E, nk = (size_t)N * k;
    float *z = route_logits(kind, N, E), *probs0 = host_rand(ne, -1, 1);
    float *w0 = host_rand(nk, -1, 1);
    int32_t *garbage = i32_filled(nk > (size_t)E ? nk : (size_t)E, -7);
    Pair pz = pair_act(c, z, ne); // rounds z to the compute dtype
    void *zc = be_alloc(c, c->cpu_dt, ne * dtype_size(c->dt));
    c->cpu_dt->cast_from_f32(zc, z, ne); // exact: z is in the compute dtype already
    Pair pp = pair_f32(c, probs0, ne), pw = pair_f32(c, w0, nk);
    Pair pe = pair_i32(c, garbage, nk), pc = pair_i32(c, garbage, E);
    Pair pt = pair_i32(c, garbage, nk), ps = pair_i32(c, garbage, nk);
    // The CPU tables share their memory ops, so pp.cpu etc. serve c->cpu_dt as well.
    c->cpu_dt->moe_route(pp.cpu, pw.cpu, pe.cpu, pc.cpu, pt.cpu, ps.cpu, zc, N, E, k);
    c->gpu->moe_route(pp.gpu, pw.gpu, pe.gpu, pc.gpu, pt.gpu, ps.gpu, pz.gpu, N, E, k);
    compare(c, "moe_route.probs", sh, &pp);
    if (kind != ROUTE_RANDOM) {
        compare(c, "moe_route.weight", sh, &pw);
        compare_i32(c, "moe_route.expert", sh, &pe);
        compare_i32(c, "moe_route.counts", sh, &pc);
        compare_i32(c, "moe_route.token_of", sh, &pt);
        compare_i32(c, "moe_route.slot", sh, &ps);
    } else { // a last-ulp expf difference may decide a near tie: the GPU's probs, routed here
        char rsh[80];
        snprintf(rsh, sizeof rsh, "N=%d E=%d k=%d random, of its probs", N, E, k);
        float *gp = xmalloc(ne * 4), *gw = xmalloc(nk * 4), *hw = xmalloc(nk * 4);
        c->gpu->download(gp, pp.gpu, ne * 4);
        c->gpu->download(gw, pw.gpu, nk * 4);
        int32_t *he = xmalloc(nk * 4), *hc = xmalloc((size_t)E * 4), *ht = xmalloc(nk * 4),
                *hs = xmalloc(nk * 4);
        host_route(c->dt, gp, N, E, k, hw, he, hc, ht, hs);
        record(c->dt, "moe_route.weight", rsh, rel_err(gw, hw, nk));
        const int32_t *want[] = {he, hc, ht, hs};
        const Pair *got[] = {&pe, &pc, &pt, &ps};
        static const char *const NAME[] = {"moe_route.expert", "moe_route.counts",
                                           "moe_route.token_of", "moe_route.slot"};
        for (int i = 0; i < 4; i++) {
            int32_t *g = download_i32(c->gpu, got[i]->gpu, got[i]->n);
            record_i32(c, NAME[i], rsh, g, want[i], got[i]->n);
            free(g);
        }
        free(gp), free(gw), free(hw), free(he), free(hc), free(ht), free(hs);
    }
    // The inputs make the case: one expert has every token, or one has none.
    if (kind == ROUTE_ONE_EXPERT || kind == ROUTE_EMPTY_EXPERT) {
        int32_t *counts = download_i32(c->cpu, pc.cpu, E);
        int e = kind == ROUTE_ONE_EXPERT ? E / 2 : E - 1, want = kind == ROUTE_ONE_EXPERT ? N : 0;
        if (counts[e] != want)
            printf("moe_route %s: expert %d has %d pairs, want %d\n", sh, e, (int)counts[e], want);
        record(c->dt, "moe_route.case", sh, counts[e] != want);
        free(counts);
    }

    float *probs = xmalloc(ne * 4), *dw = host_rand(nk, -1, 1), *dz0 = host_rand(ne, -1, 1);
    int32_t *expert = download_i32(c->cpu, pe.cpu, nk);
    c->cpu->download(probs, pp.cpu, ne * 4);
    Pair pbp = pair_f32(c, probs, ne), pbe = pair_i32(c, expert, nk);
    Pair pdw = pair_f32(c, dw, nk), pdz = pair_act(c, dz0, ne);
    c->cpu->moe_route_bwd(pdz.cpu, pdw.cpu, pbp.cpu, pbe.cpu, N, E, k);
    c->gpu->moe_route_bwd(pdz.gpu, pdw.gpu, pbp.gpu, pbe.gpu, N, E, k);
    compare(c, "moe_route_bwd.dlogits", sh, &pdz);
    release(c);
    free(z), free(probs0), free(w0), free(garbage), free(probs), free(dw), free(dz0), free(expert);
}

// The flags of a moe_combine case; UNALIGNED moves every compute-dtype tensor one element off
// its allocation (the kernels' scalar path).
enum { MOE_RESID = 1, MOE_SHARED = 2, MOE_WEIGHT = 4, MOE_IN_PLACE = 8, MOE_UNALIGNED = 16 };
enum { MOE_ALL = MOE_RESID | MOE_SHARED | MOE_WEIGHT };

// moe_combine over the CPU's routing of N tokens to k of E experts (rows: (N*k, C) the
// experts' outputs in pair order), and with weights its backward: drows and dweight of every
// pair, dshared (or, without shared, dshared untouched).
static void test_moe_combine(Ctx *c, int N, int E, int k, int C, int flags) {
    char sh[80];
    snprintf(sh, sizeof sh, "N=%d k=%d C=%d%s%s%s%s%s", N, k, C, flags & MOE_RESID ? " resid" : "",
             flags & MOE_SHARED ? " shared" : "", flags & MOE_WEIGHT ? " weighted" : "",
             flags & MOE_IN_PLACE ? " in-place" : "", flags & MOE_UNALIGNED ? " unaligned" : "");
    const int off = flags & MOE_UNALIGNED ? 1 : 0;
    const size_t nc = (size_t)N * C + off, rc = (size_t)N * k * C + off, nk = (size_t)N * k;
    const float scale = 0.5f; // 1 / n_shared_experts
    // The routing: the fp32 CPU's of random logits, on the host.
    float *z = route_logits(ROUTE_RANDOM, N, E), *probs = xmalloc((size_t)N * E * 4);
    float *weight = xmalloc(nk * 4);
    int32_t *expert = xmalloc(nk * 4), *counts = xmalloc((size_t)E * 4);
    int32_t *token_of = xmalloc(nk * 4), *slot = xmalloc(nk * 4);
    c->cpu->moe_route(probs, weight, expert, counts, token_of, slot, z, N, E, k);
    float *rows = host_rand(rc, -2, 2), *resid = host_rand(nc, -2, 2);
    float *shared = host_rand(nc, -2, 2), *out0 = host_rand(nc, -1, 1);
    Pair pw = pair_f32(c, weight, nk), pslot = pair_i32(c, slot, nk);
    Pair prows = pair_act(c, rows, rc), pr = pair_act(c, resid, nc);
    Pair pshared = pair_act(c, shared, nc), pout = pair_act(c, out0, nc);
    const Pair *po = flags & MOE_IN_PLACE ? &pr : &pout;
    const int has_r = flags & MOE_RESID, has_s = flags & MOE_SHARED, has_w = flags & MOE_WEIGHT;
    c->cpu->moe_combine(at(c->cpu, po->cpu, off), has_r ? at(c->cpu, pr.cpu, off) : NULL,
                        has_s ? at(c->cpu, pshared.cpu, off) : NULL, scale,
                        at(c->cpu, prows.cpu, off), has_w ? pw.cpu : NULL, pslot.cpu, N, k, C);
    c->gpu->moe_combine(at(c->gpu, po->gpu, off), has_r ? at(c->gpu, pr.gpu, off) : NULL,
                        has_s ? at(c->gpu, pshared.gpu, off) : NULL, scale,
                        at(c->gpu, prows.gpu, off), has_w ? pw.gpu : NULL, pslot.gpu, N, k, C);
    compare(c, "moe_combine.out", sh, po);
    if (has_w) { // the gather-sum (weight NULL) has no backward of its own
        float *dout = host_rand(nc, -1, 1), *drows0 = host_rand(rc, -1, 1);
        float *dshared0 = host_rand(nc, -1, 1), *dw0 = host_rand(nk, -1, 1);
        Pair pd = pair_act(c, dout, nc), pdr = pair_act(c, drows0, rc);
        Pair pds = pair_act(c, dshared0, nc), pdw = pair_f32(c, dw0, nk);
        c->cpu->moe_combine_bwd(at(c->cpu, pdr.cpu, off), pdw.cpu,
                                has_s ? at(c->cpu, pds.cpu, off) : NULL, at(c->cpu, pd.cpu, off),
                                at(c->cpu, prows.cpu, off), pw.cpu, pslot.cpu, scale, N, k, C);
        c->gpu->moe_combine_bwd(at(c->gpu, pdr.gpu, off), pdw.gpu,
                                has_s ? at(c->gpu, pds.gpu, off) : NULL, at(c->gpu, pd.gpu, off),
                                at(c->gpu, prows.gpu, off), pw.gpu, pslot.gpu, scale, N, k, C);
        compare(c, "moe_combine_bwd.drows", sh, &pdr);
        compare(c, "moe_combine_bwd.dweight", sh, &pdw);
        compare(c, "moe_combine_bwd.dshared", sh, &pds);
        free(dout), free(drows0), free(dshared0), free(dw0);
    }
    release(c);
    free(z), free(probs), free(weight), free(expert), free(counts), free(token_of), free(slot);
    free(rows), free(resid), free(shared), free(out0);
}

static void test_moe(Ctx *c) {
    test_copy_rows(c, 600, 64, 768, 512, 192, 128); // a head's k or v: 16-byte words
    test_copy_rows(c, 600, 512, 768, 0, 512, 0);    // the q rows of an MLA projection
    test_copy_rows(c, 300, 37, 101, 3, 40, 1);      // odd sizes: the element path
    test_copy_rows(c, 600, 64, 768, 1, 192, 0);     // a destination off 16 bytes
    test_copy_rows(c, 5, 64, 64, 0, 64, 0);         // contiguous rows

    test_moe_route(c, 300, 16, 4, ROUTE_LEVELS);  // N past a block, pairs past a chunk
    test_moe_route(c, 130, 64, 6, ROUTE_LEVELS);  // nth_element + sort (k * 64 > E)
    test_moe_route(c, 40, 200, 3, ROUTE_LEVELS);  // partial_sort (k * 64 <= E)
    test_moe_route(c, 17, 512, 8, ROUTE_LEVELS);  // the largest E
    test_moe_route(c, 2048, 64, 6, ROUTE_RANDOM); // a training batch, continuous logits
    test_moe_route(c, 300, 16, 2, ROUTE_RANDOM);
    test_moe_route(c, 50, 8, 1, ROUTE_ONE_EXPERT);   // every token to one expert, alone
    test_moe_route(c, 50, 8, 2, ROUTE_ONE_EXPERT);   // ... and one more each
    test_moe_route(c, 70, 8, 2, ROUTE_EMPTY_EXPERT); // an expert no token chooses
    test_moe_route(c, 9, 16, 3, ROUTE_TIED);         // all tied: torch's order decides
    test_moe_route(c, 5, 300, 2, ROUTE_TIED);        // ties through partial_sort's heap
    test_moe_route(c, 33, 4, 4, ROUTE_LEVELS);       // k == E
    test_moe_route(c, 1, 3, 1, ROUTE_LEVELS);

    test_moe_combine(c, 256, 8, 2, 768, MOE_ALL); // the model's: resid + shared + experts
    test_moe_combine(c, 37, 6, 3, 100, MOE_ALL);  // C % 8 != 0: the scalar path for 16 bits
    test_moe_combine(c, 64, 8, 2, 768, MOE_ALL | MOE_IN_PLACE);
    test_moe_combine(c, 64, 8, 2, 768, MOE_WEIGHT);             // no resid, no shared
    test_moe_combine(c, 64, 8, 2, 768, 0);                      // the gather-sum (weights 1)
    test_moe_combine(c, 9, 8, 2, 2100, MOE_RESID | MOE_WEIGHT); // rows past a block's vectors
    test_moe_combine(c, 33, 4, 4, 99, MOE_ALL);                 // k == E, odd C
    test_moe_combine(c, 40, 8, 2, 256, MOE_ALL | MOE_UNALIGNED);
}

// Logits uniform in [-4, 4], every 5th row confident (+12 on its target); every 7th row
// (n % 7 == 3) masked out.
static float *ce_inputs(int N, int V, int32_t *targets, int32_t *mask, int *counted) {
    float *logits = host_rand((size_t)N * V, -4, 4);
    *counted = 0;
    for (int n = 0; n < N; n++) {
        targets[n] = rng_int(V);
        mask[n] = n % 7 != 3;
        *counted += mask[n];
        if (n % 5 == 0) logits[(size_t)n * V + targets[n]] += 12;
    }
    return logits;
}

static void test_cross_entropy(Ctx *c, int N, int V, float ls) {
    char sh[80];
    snprintf(sh, sizeof sh, "N=%d V=%d ls=%g masked", N, V, ls);
    int32_t *targets = xmalloc((size_t)N * 4), *mask = xmalloc((size_t)N * 4);
    int counted;
    float *logits = ce_inputs(N, V, targets, mask, &counted);
    float *loss0 = host_rand(N, -1, 1), *lse0 = host_rand(N, -1, 1);
    float *dl0 = host_rand((size_t)N * V, -1, 1);
    Pair pt = pair_i32(c, targets, N), pm = pair_i32(c, mask, N);
    Pair plg = pair_act(c, logits, (size_t)N * V), ploss = pair_f32(c, loss0, N);
    Pair plse = pair_f32(c, lse0, N);
    c->cpu->cross_entropy_fwd(ploss.cpu, plse.cpu, plg.cpu, pt.cpu, pm.cpu, N, V, ls);
    c->gpu->cross_entropy_fwd(ploss.gpu, plse.gpu, plg.gpu, pt.gpu, pm.gpu, N, V, ls);
    compare(c, "cross_entropy_fwd.loss", sh, &ploss);
    compare(c, "cross_entropy_fwd.lse", sh, &plse);
    float *lse = xmalloc((size_t)N * 4);
    c->cpu->download(lse, plse.cpu, (size_t)N * 4);
    Pair plin = pair_f32(c, lse, N), pdl = pair_act(c, dl0, (size_t)N * V);
    float dloss = 1.0f / (float)counted;
    c->cpu->cross_entropy_bwd(pdl.cpu, plg.cpu, plin.cpu, pt.cpu, pm.cpu, NULL, N, V, ls, dloss);
    c->gpu->cross_entropy_bwd(pdl.gpu, plg.gpu, plin.gpu, pt.gpu, pm.gpu, NULL, N, V, ls, dloss);
    compare(c, "cross_entropy_bwd.dlogits", sh, &pdl);
    // Per-row factors (DPO/GRPO token weights), some negative.
    float *scale = host_rand(N, -2, 2);
    Pair pscale = pair_f32(c, scale, N);
    c->cpu->cross_entropy_bwd(pdl.cpu, plg.cpu, plin.cpu, pt.cpu, pm.cpu, pscale.cpu, N, V, ls,
                              dloss);
    c->gpu->cross_entropy_bwd(pdl.gpu, plg.gpu, plin.gpu, pt.gpu, pm.gpu, pscale.gpu, N, V, ls,
                              dloss);
    compare(c, "cross_entropy_bwd.dlogits row-scaled", sh, &pdl);
    release(c);
    free(targets), free(mask), free(logits), free(loss0), free(lse0), free(dl0), free(lse);
    free(scale);
}

static void test_reductions(Ctx *c) {
    // loss_mean_add: acc += (float)(sum / counted), on top of an earlier micro-step's 1.5.
    int N = 1000, counted = 900;
    float *loss = host_rand(N, 0, 8);
    for (int n = 0; n < N; n += 10)
        loss[n] = 0; // rows not counted
    double acc = 1.5;
    Pair pl = pair_f32(c, loss, N), pacc = pair_raw(c, &acc, 1, sizeof acc);
    c->cpu->loss_mean_add(pacc.cpu, pl.cpu, N, counted);
    c->gpu->loss_mean_add(pacc.gpu, pl.gpu, N, counted);
    compare_double(c, "loss_mean_add", "N=1000 counted=900", &pacc);
    // sum_squares over an odd, large n.
    size_t n = 3000017;
    float *x = host_rand(n, -1, 1);
    double zero = -1;
    Pair px = pair_f32(c, x, n), ps = pair_raw(c, &zero, 1, sizeof zero);
    c->cpu->sum_squares(ps.cpu, px.cpu, n);
    c->gpu->sum_squares(ps.gpu, px.gpu, n);
    compare_double(c, "sum_squares", "n=3000017", &ps);
    // scale (gradient clipping).
    c->cpu->scale(px.cpu, n, 0.37f);
    c->gpu->scale(px.gpu, n, 0.37f);
    compare(c, "scale.x", "n=3000017 factor=0.37", &px);
    release(c);
    free(loss), free(x);
}

// The accumulators of a preference loss (acc[0], acc[2], acc[3]) compared one by one.
static void compare_pref_acc(Ctx *c, const char *name, const char *shape, const Pair *acc) {
    static const char *const SLOT[] = {"loss", "", "metric_a", "metric_b"};
    for (int k = 0; k < 4; k++) {
        if (!*SLOT[k]) continue;
        char full[64];
        snprintf(full, sizeof full, "%s.%s", name, SLOT[k]);
        Pair one = {(double *)acc->cpu + k, (double *)acc->gpu + k, 1, 0};
        compare_double(c, full, shape, &one);
    }
}

// dpo_loss and grpo_loss on per-token NLLs (0 where a token does not count), GRPO's policy
// far enough from its reference that some ratios clip; NEFTune's noise on activations.
static void test_preference(Ctx *c) {
    const int P = 4, T = 300, R = 2 * P, N = R * T;
    float *nll = host_rand(N, 0, 3), *ref = host_rand(N, 0, 3), *adv = host_rand(R, -1.5f, 1.5f);
    int32_t *mask = xmalloc((size_t)N * 4);
    int counted = 0;
    for (int n = 0; n < N; n++) {
        mask[n] = n % 7 != 0;
        counted += mask[n];
        if (!mask[n]) nll[n] = ref[n] = 0;
    }
    double acc0[4] = {0.5, 0, 0.25, 0.125};
    float *scale0 = host_rand(N, -1, 1);
    Pair pn = pair_f32(c, nll, N), pr = pair_f32(c, ref, N), pa = pair_f32(c, adv, R);
    Pair pm = pair_i32(c, mask, N), ps = pair_f32(c, scale0, N);
    Pair pacc = pair_raw(c, acc0, 4, sizeof(double));
    c->cpu->dpo_loss(pacc.cpu, ps.cpu, pn.cpu, pr.cpu, P, T, 0.1f, 0.5f);
    c->gpu->dpo_loss(pacc.gpu, ps.gpu, pn.gpu, pr.gpu, P, T, 0.1f, 0.5f);
    compare_pref_acc(c, "dpo_loss", "P=4 T=300", &pacc);
    compare(c, "dpo_loss.scale", "P=4 T=300", &ps);
    Pair pacc2 = pair_raw(c, acc0, 4, sizeof(double));
    c->cpu->grpo_loss(pacc2.cpu, ps.cpu, pn.cpu, pr.cpu, pr.cpu, pa.cpu, pm.cpu, R, T,
                      (float)counted, 0.2f, 0.05f, 0.25f);
    c->gpu->grpo_loss(pacc2.gpu, ps.gpu, pn.gpu, pr.gpu, pr.gpu, pa.gpu, pm.gpu, R, T,
                      (float)counted, 0.2f, 0.05f, 0.25f);
    compare_pref_acc(c, "grpo_loss", "R=8 T=300", &pacc2);
    compare(c, "grpo_loss.scale", "R=8 T=300", &ps);
    size_t n = 1 << 20;
    float *x = host_rand(n, -1, 1);
    Pair px = pair_act(c, x, n);
    c->cpu->gaussian_noise_add(px.cpu, n, 0.3f, 77);
    c->gpu->gaussian_noise_add(px.gpu, n, 0.3f, 77);
    compare(c, "gaussian_noise_add", "n=1M std=0.3", &px);
    release(c);
    free(nll), free(ref), free(adv), free(mask), free(scale0), free(x);
}

static void test_adamw(Ctx *c, size_t n) {
    char sh[80];
    snprintf(sh, sizeof sh, "n=%zu step=3", n);
    // Weights of init scale so the lr-sized update is visible at 1e-5 of max|w|.
    float *w = host_rand(n, -0.02f, 0.02f), *g = host_rand(n, -1e-2f, 1e-2f);
    float *m = host_rand(n, -1e-3f, 1e-3f), *v = host_rand(n, 0, 1e-5f);
    const double lr = 1e-3, wd = 0.1, b1 = 0.9, b2 = 0.95;
    const int step = 3;
    AdamwArgs a = {.decay = (float)(1 - lr * wd),
                   .step_size = (float)(lr / (1 - pow(b1, step))),
                   .bc2_sqrt = (float)sqrt(1 - pow(b2, step)),
                   .beta1 = (float)b1,
                   .beta2 = (float)b2,
                   .one_minus_beta1 = (float)(1 - b1),
                   .one_minus_beta2 = (float)(1 - b2),
                   .eps = 1e-8f};
    Pair pw = pair_f32(c, w, n), pg = pair_f32(c, g, n), pm = pair_f32(c, m, n);
    Pair pv = pair_f32(c, v, n);
    c->cpu->adamw(pw.cpu, pg.cpu, pm.cpu, pv.cpu, n, &a);
    c->gpu->adamw(pw.gpu, pg.gpu, pm.gpu, pv.gpu, n, &a);
    compare(c, "adamw.w", sh, &pw);
    compare(c, "adamw.exp_avg", sh, &pm);
    compare(c, "adamw.exp_avg_sq", sh, &pv);
    release(c);
    free(w), free(g), free(m), free(v);
}

static void test_muon(Ctx *c, int rows, int cols) {
    char sh[80];
    snprintf(sh, sizeof sh, "rows=%d cols=%d ns=5", rows, cols);
    size_t n = (size_t)rows * cols;
    const double lr = 0.02, wd = 0.1;
    int big = rows > cols ? rows : cols;
    MuonArgs a = {.rows = rows,
                  .cols = cols,
                  .ns_steps = 5,
                  .nesterov = 1,
                  .momentum = 0.95f,
                  .one_minus_momentum = 0.05f,
                  .decay = (float)(1 - lr * wd),
                  .adjusted_lr = (float)(lr * 0.2 * sqrt((double)big)),
                  .ns_a = 3.4445f,
                  .ns_b = -4.7750f,
                  .ns_c = 2.0315f,
                  .norm_eps = 1e-7f};
    float *w = host_rand(n, -0.02f, 0.02f), *g = host_rand(n, -1e-2f, 1e-2f);
    float *buf = host_rand(n, -1e-2f, 1e-2f);
    size_t ns = muon_scratch_floats(rows, cols);
    Pair pw = pair_f32(c, w, n), pg = pair_f32(c, g, n), pb = pair_f32(c, buf, n);
    float *scratch_cpu = be_alloc(c, c->cpu, ns * 4), *scratch_gpu = be_alloc(c, c->gpu, ns * 4);
    c->cpu->muon(pw.cpu, pg.cpu, pb.cpu, scratch_cpu, &a);
    c->gpu->muon(pw.gpu, pg.gpu, pb.gpu, scratch_gpu, &a);
    compare(c, "muon.w", sh, &pw);
    compare(c, "muon.buf", sh, &pb);
    float *wc, *wg;
    pair_read(c, &pw, &wc, &wg);
    for (size_t i = 0; i < n; i++) // the update alone, from the same w_old
        wc[i] = (float)((double)wc[i] - w[i]), wg[i] = (float)((double)wg[i] - w[i]);
    record(c->dt, "muon.update", sh, rel_err(wg, wc, n));
    release(c);
    free(wc), free(wg), free(w), free(g), free(buf);
}

// ---------------------------------------------------------------- memory ops (GPU only)
// err: the fraction of differing bytes.
static double bytes_differ(const void *a, const void *b, size_t bytes) {
    size_t diff = 0;
    for (size_t i = 0; i < bytes; i++)
        diff += ((const unsigned char *)a)[i] != ((const unsigned char *)b)[i];
    return (double)diff / (double)bytes;
}

// upload/download, copy and zero are bit-exact; cast_from_f32 rounds to nearest even (a copy
// in fp32 mode; fp16: inf past its range, subnormals below 2^-14) and download_f32 widens
// exactly.
static void test_memory(Ctx *c) {
    const size_t n = 1000003, bytes = n * 4;
    float *x = host_rand(n, -1, 1), *back = xmalloc(bytes);
    for (size_t i = 0; i < n; i++) // every exponent from 2^-60 to 2^60, both signs
        x[i] = ldexpf(x[i], (int)(i % 121) - 60);
    // Exact ties between two bf16 values (1 + 2^-8 and 1 + 3 * 2^-8): even, then up.
    x[0] = 1.0f + 0x1p-8f, x[1] = 1.0f + 0x3p-8f, x[2] = -(1.0f + 0x1p-8f), x[3] = 0.0f;
    x[4] = -0.0f;
    if (c->dt == DT_F16) { // fp16's: ties, the overflow threshold 65520 (a tie: inf), just
                           // below it, the subnormal ties 2^-25 (to 0) and 3 * 2^-25 (up)
        const float edges[] = {1.0f + 0x1p-11f, 1.0f + 0x3p-11f, 65504.0f, 65520.0f - 0x1p-8f,
                               65520.0f,        -65520.0f,       0x1p-25f, 0x3p-25f};
        memcpy(x + 5, edges, sizeof edges);
    }
    float *d1 = be_alloc(c, c->gpu, bytes), *d2 = be_alloc(c, c->gpu, bytes);
    c->gpu->upload(d1, x, bytes);
    c->gpu->copy(d2, d1, bytes);
    c->gpu->download(back, d2, bytes);
    record(c->dt, "memory.upload_copy_download", "n=1000003 fp32", bytes_differ(back, x, bytes));
    c->gpu->zero(d2, bytes);
    c->gpu->download(back, d2, bytes);
    float *zeros = calloc(n, 4);
    if (!zeros) exit(1);
    record(c->dt, "memory.zero", "n=1000003 fp32", bytes_differ(back, zeros, bytes));
    // cast_from_f32 against the host's rounding, then download_f32 of the result.
    size_t es = dtype_size(c->dt);
    void *act = be_alloc(c, c->gpu, n * es);
    c->gpu->cast_from_f32(act, d1, n);
    unsigned char *raw = xmalloc(n * es), *want = xmalloc(n * es);
    c->gpu->download(raw, act, n * es);
    for (size_t i = 0; i < n; i++) {
        float r = dtype_round(c->dt, x[i]);
        uint32_t u;
        memcpy(&u, &r, 4);
        if (c->dt == DT_BF16) {
            uint16_t h = (uint16_t)(u >> 16);
            memcpy(want + 2 * i, &h, 2);
        } else if (c->dt == DT_F16) {
            uint16_t h = f16_bits(x[i]);
            memcpy(want + 2 * i, &h, 2);
        } else {
            memcpy(want + 4 * i, &u, 4);
        }
    }
    record(c->dt, "memory.cast_from_f32",
           c->dt == DT_F16 ? "n=1000003, ties, +-0, inf, subnormals" : "n=1000003, ties, +-0",
           bytes_differ(raw, want, n * es));
    c->gpu->download_f32(back, act, n);
    for (size_t i = 0; i < n; i++)
        x[i] = dtype_round(c->dt, x[i]);
    record(c->dt, "memory.download_f32", "n=1000003", bytes_differ(back, x, bytes));
    release(c);
    free(x), free(back), free(zeros), free(raw), free(want);
}

// ---------------------------------------------------------------- fp16 overflow (GPU only)
// Records the fraction of elements of an fp16 output whose overflow the GPU did not
// reproduce: where the CPU's fp32 result rounds to +-inf in fp16 (|x| >= 65520) the GPU must
// give that inf, and no inf elsewhere (a clamped 65504 would hide the overflow from the
// trainer's loss scaling). 1 when nothing overflowed: the case would test nothing.
static void compare_overflow(Ctx *c, const char *name, const char *shape, const Pair *p) {
    float *a, *b;
    pair_read(c, p, &b, &a);
    size_t infs = 0, wrong = 0;
    for (size_t i = 0; i < p->n; i++) {
        float want = f16_value(f16_bits(b[i]));
        infs += isinf(want) != 0;
        wrong += isinf(want) ? a[i] != want : !isfinite(a[i]);
    }
    record(c->dt, name, shape, infs ? (double)wrong / (double)p->n : 1.0);
    free(a), free(b);
}

// Outputs that overflow fp16 in some elements and not in others: a GEMM (cuBLASLt's fp16
// epilogue) forward and backward, swiglu, and cross-entropy's gradient at a loss scale of 2e5
// (its target column, 2e5 * (p - 1), is past the range). The large inputs are fp16-exact and
// far from the threshold: every product is many times 65520 or well below it.
static void test_f16_overflow(Ctx *c) {
    const int N = 64, C = 256, OC = 96;
    char sh[80];
    snprintf(sh, sizeof sh, "N=%d C=%d OC=%d", N, C, OC);
    float *inp = host_rand((size_t)N * C, -1, 1), *w = host_rand((size_t)OC * C, -0.1f, 0.1f);
    float *dout = host_rand((size_t)N * OC, -1, 1), *dw = calloc((size_t)OC * C, 4);
    if (!dw) exit(1);
    for (int n = 0; n < N; n += 4) // rows of +-100 times the weight rows of 10: +-256 000
        for (int k = 0; k < C; k++)
            inp[(size_t)n * C + k] = n % 8 ? -100 : 100;
    for (int o = 0; o < OC; o += 3)
        for (int k = 0; k < C; k++)
            w[(size_t)o * C + k] = 10;
    for (int n = 0; n < N; n += 5) // dinp: +-1000 * 10, 32 times: +-320 000 (+ a few tens)
        for (int o = 0; o < OC; o += 3)
            dout[(size_t)n * OC + o] = n % 2 ? -1000 : 1000;
    Pair pi = pair_act(c, inp, (size_t)N * C), pw = pair_act(c, w, (size_t)OC * C);
    Pair pd = pair_act(c, dout, (size_t)N * OC), po = pair_act(c, dout, (size_t)N * OC);
    Pair pdi = pair_act(c, inp, (size_t)N * C), pdw = pair_f32(c, dw, (size_t)OC * C);
    c->cpu->matmul_fwd(po.cpu, pi.cpu, pw.cpu, N, C, OC, 0);
    c->gpu->matmul_fwd(po.gpu, pi.gpu, pw.gpu, N, C, OC, 0);
    compare_overflow(c, "f16_overflow.matmul_fwd", sh, &po);
    c->cpu->matmul_bwd(pdi.cpu, pdw.cpu, pd.cpu, pi.cpu, pw.cpu, N, C, OC, 0);
    c->gpu->matmul_bwd(pdi.gpu, pdw.gpu, pd.gpu, pi.gpu, pw.gpu, N, C, OC, 0);
    compare_overflow(c, "f16_overflow.matmul_bwd.dinp", sh, &pdi);
    release(c);
    free(inp), free(w), free(dout), free(dw);

    const int FF = 1408;
    float *h = host_rand((size_t)N * 2 * FF, -3, 3);
    for (int n = 0; n < N; n++) // up and gate of 300 in every 4th column: up * gate 90 000
        for (int k = 0; k < FF; k += 4) {
            h[(size_t)n * 2 * FF + k] = n % 2 ? -300 : 300;
            h[(size_t)n * 2 * FF + FF + k] = 300;
        }
    Pair ph = pair_act(c, h, (size_t)N * 2 * FF);
    Pair pso = pair_act(c, h, (size_t)N * FF); // any initial contents: overwritten
    c->cpu->swiglu_fwd(pso.cpu, ph.cpu, N, FF);
    c->gpu->swiglu_fwd(pso.gpu, ph.gpu, N, FF);
    snprintf(sh, sizeof sh, "N=%d FF=%d", N, FF);
    compare_overflow(c, "f16_overflow.swiglu_fwd", sh, &pso);
    release(c);
    free(h);

    const int V = 32000;
    int counted;
    int32_t *targets = xmalloc((size_t)N * 4), *mask = xmalloc((size_t)N * 4);
    float *logits = ce_inputs(N, V, targets, mask, &counted);
    float *lse = calloc((size_t)N, 4);
    if (!lse) exit(1);
    Pair pt = pair_i32(c, targets, N), pm = pair_i32(c, mask, N);
    Pair plg = pair_act(c, logits, (size_t)N * V), plse = pair_f32(c, lse, N);
    Pair ploss = pair_f32(c, lse, N), pdl = pair_act(c, logits, (size_t)N * V);
    c->cpu->cross_entropy_fwd(ploss.cpu, plse.cpu, plg.cpu, pt.cpu, pm.cpu, N, V, 0.1f);
    c->cpu->download(lse, plse.cpu, (size_t)N * 4);
    Pair plin = pair_f32(c, lse, N); // the CPU's lse on both sides
    c->cpu->cross_entropy_bwd(pdl.cpu, plg.cpu, plin.cpu, pt.cpu, pm.cpu, NULL, N, V, 0.1f, 2e5f);
    c->gpu->cross_entropy_bwd(pdl.gpu, plg.gpu, plin.gpu, pt.gpu, pm.gpu, NULL, N, V, 0.1f, 2e5f);
    snprintf(sh, sizeof sh, "N=%d V=%d ls=0.1 dloss=2e5", N, V);
    compare_overflow(c, "f16_overflow.cross_entropy_bwd", sh, &pdl);
    release(c);
    free(targets), free(mask), free(logits), free(lse);

    // moe_combine as the backward's gather-sum of the experts' input gradients (weights 1):
    // both rows of every 3rd token +-40000 (fp16-exact), summing to +-80000; the others small.
    const int K = 2, MC = 256;
    size_t nk = (size_t)N * K;
    int32_t *slot = xmalloc(nk * 4);
    for (size_t p = 0; p < nk; p++) // pair p of token p / K, the last first: a permutation
        slot[p] = (int32_t)(nk - 1 - p);
    float *rows = host_rand(nk * MC, -1, 1);
    for (size_t p = 0; p < nk; p++)
        if (((nk - 1 - p) / K) % 3 == 0)
            for (int k = 0; k < MC; k++)
                rows[p * MC + k] = ((nk - 1 - p) / K) % 2 ? -40000.0f : 40000.0f;
    Pair pslot = pair_i32(c, slot, nk), prows = pair_act(c, rows, nk * MC);
    Pair pmo = pair_act(c, rows, (size_t)N * MC); // any initial contents: overwritten
    c->cpu->moe_combine(pmo.cpu, NULL, NULL, 0.0f, prows.cpu, NULL, pslot.cpu, N, K, MC);
    c->gpu->moe_combine(pmo.gpu, NULL, NULL, 0.0f, prows.gpu, NULL, pslot.gpu, N, K, MC);
    snprintf(sh, sizeof sh, "N=%d k=%d C=%d gather-sum", N, K, MC);
    compare_overflow(c, "f16_overflow.moe_combine", sh, &pmo);
    release(c);
    free(slot), free(rows);
}

// ---------------------------------------------------------------- determinism (GPU only)
// Downloads n bytes of two GPU buffers and records whether they are bit-identical
// (err = the fraction of differing bytes).
static void same_bits(Ctx *c, const char *name, const char *shape, const void *a, const void *b,
                      size_t bytes) {
    unsigned char *x = xmalloc(bytes), *y = xmalloc(bytes);
    c->gpu->download(x, a, bytes);
    c->gpu->download(y, b, bytes);
    size_t diff = 0;
    for (size_t i = 0; i < bytes; i++)
        diff += x[i] != y[i];
    record(c->dt, name, shape, (double)diff / (double)bytes);
    free(x), free(y);
}

// A GPU buffer with the given bytes (the same host data for both runs).
static void *gpu_with(Ctx *c, const void *host, size_t bytes) {
    void *p = be_alloc(c, c->gpu, bytes);
    c->gpu->upload(p, host, bytes);
    return p;
}

static void test_determinism(Ctx *c) {
    size_t es = dtype_size(c->dt);
    // attention_bwd, D=128 with documents.
    {
        int B = 2, T = 300, H = 8, KVH = 2, D = 128, N = B * T, stride = (H + 2 * KVH) * D;
        size_t total = (size_t)N * stride, nout = (size_t)N * H * D, nlse = (size_t)B * H * T;
        int32_t *ds = doc_starts(B, T, 1);
        float *qkv = host_rand(total, -2, 2), *dout = host_rand(nout, -1, 1);
        Pair pds = pair_i32(c, ds, N), pq = pair_act(c, qkv, total), pd = pair_act(c, dout, nout);
        void *out = be_alloc(c, c->gpu, nout * es);
        float *lse = be_alloc(c, c->gpu, nlse * 4);
        size_t ko = (size_t)H * D, vo = (size_t)(H + KVH) * D;
        c->gpu->attention_fwd(out, lse, pq.gpu, at(c->gpu, pq.gpu, ko), at(c->gpu, pq.gpu, vo),
                              pds.gpu, B, T, H, KVH, D, stride);
        void *d[2];
        for (int r = 0; r < 2; r++) {
            d[r] = be_alloc(c, c->gpu, total * es);
            c->gpu->attention_bwd(d[r], at(c->gpu, d[r], ko), at(c->gpu, d[r], vo), pd.gpu, out,
                                  lse, pq.gpu, at(c->gpu, pq.gpu, ko), at(c->gpu, pq.gpu, vo),
                                  pds.gpu, B, T, H, KVH, D, stride);
        }
        same_bits(c, "determinism.attention_bwd", "B=2 T=300 H=8 KVH=2 D=128 docs", d[0], d[1],
                  total * es);
        release(c);
        free(ds), free(qkv), free(dout);
    }
    // embedding_bwd with repeated ids.
    {
        int N = 4096, V = 1000, C = 768;
        int32_t *ids = xmalloc((size_t)N * 4), *by_id = xmalloc((size_t)N * 4);
        embedding_ids(N, V, ids, by_id);
        float *dout = host_rand((size_t)N * C, -1, 1), *dt0 = host_rand((size_t)V * C, -1, 1);
        Pair pids = pair_i32(c, ids, N), pby = pair_i32(c, by_id, N);
        Pair pd = pair_act(c, dout, (size_t)N * C);
        void *dt[2];
        for (int r = 0; r < 2; r++) {
            dt[r] = gpu_with(c, dt0, (size_t)V * C * 4);
            c->gpu->embedding_bwd(dt[r], pd.gpu, pids.gpu, pby.gpu, N, C);
        }
        same_bits(c, "determinism.embedding_bwd", "N=4096 V=1000 C=768", dt[0], dt[1],
                  (size_t)V * C * 4);
        release(c);
        free(ids), free(by_id), free(dout), free(dt0);
    }
    // rmsnorm_bwd, grouped (q-norm layout).
    {
        int N = 600, G = 8, C = 64, stride = 768;
        size_t total = (size_t)N * stride;
        float *inp = host_rand(total, -2, 2), *w = host_rand(C, 0.5f, 1.5f);
        float *dout = host_rand(total, -1, 1), *dw0 = host_rand(C, -1, 1);
        Pair pin = pair_act(c, inp, total), pw = pair_act(c, w, C), pd = pair_act(c, dout, total);
        void *out = be_alloc(c, c->gpu, total * es);
        float *rstd = be_alloc(c, c->gpu, (size_t)N * G * 4);
        c->gpu->rmsnorm_fwd(out, rstd, pin.gpu, pw.gpu, N, G, C, stride, 1e-5f);
        void *di[2], *dw[2];
        for (int r = 0; r < 2; r++) {
            di[r] = be_alloc(c, c->gpu, total * es);
            dw[r] = gpu_with(c, dw0, (size_t)C * 4);
            c->gpu->rmsnorm_bwd(di[r], dw[r], pd.gpu, pin.gpu, pw.gpu, rstd, N, G, C, stride, 0);
        }
        same_bits(c, "determinism.rmsnorm_bwd.dinp", "N=600 G=8 C=64 stride=768", di[0], di[1],
                  total * es);
        same_bits(c, "determinism.rmsnorm_bwd.dweight", "N=600 G=8 C=64 stride=768", dw[0], dw[1],
                  (size_t)C * 4);
        release(c);
        free(inp), free(w), free(dout), free(dw0);
    }
    // cross entropy forward and backward, label smoothing 0.1.
    {
        int N = 128, V = 32000, counted;
        int32_t *targets = xmalloc((size_t)N * 4), *mask = xmalloc((size_t)N * 4);
        float *logits = ce_inputs(N, V, targets, mask, &counted);
        Pair pt = pair_i32(c, targets, N), pm = pair_i32(c, mask, N);
        Pair plg = pair_act(c, logits, (size_t)N * V);
        float *loss[2], *lse[2];
        void *dl[2];
        for (int r = 0; r < 2; r++) {
            loss[r] = be_alloc(c, c->gpu, (size_t)N * 4);
            lse[r] = be_alloc(c, c->gpu, (size_t)N * 4);
            dl[r] = be_alloc(c, c->gpu, (size_t)N * V * es);
            c->gpu->cross_entropy_fwd(loss[r], lse[r], plg.gpu, pt.gpu, pm.gpu, N, V, 0.1f);
            c->gpu->cross_entropy_bwd(dl[r], plg.gpu, lse[r], pt.gpu, pm.gpu, NULL, N, V, 0.1f,
                                      1.0f / (float)counted);
        }
        const char *sh = "N=128 V=32000 ls=0.1";
        same_bits(c, "determinism.cross_entropy_fwd.loss", sh, loss[0], loss[1], (size_t)N * 4);
        same_bits(c, "determinism.cross_entropy_fwd.lse", sh, lse[0], lse[1], (size_t)N * 4);
        same_bits(c, "determinism.cross_entropy_bwd", sh, dl[0], dl[1], (size_t)N * V * es);
        release(c);
        free(targets), free(mask), free(logits);
    }
    // moe_route (the rank scan's pair order) and moe_combine_bwd (dweight: a block tree).
    {
        int N = 2048, E = 64, k = 6, C = 768;
        size_t ne = (size_t)N * E, nk = (size_t)N * k;
        float *z = route_logits(ROUTE_RANDOM, N, E), *rows = host_rand(nk * C, -1, 1);
        float *dout = host_rand((size_t)N * C, -1, 1);
        Pair pz = pair_act(c, z, ne), py = pair_act(c, rows, nk * C);
        Pair pd = pair_act(c, dout, (size_t)N * C);
        float *probs[2], *weight[2], *dw[2];
        int32_t *expert[2], *counts[2], *token_of[2], *slot[2];
        void *drows[2];
        for (int r = 0; r < 2; r++) {
            probs[r] = be_alloc(c, c->gpu, ne * 4);
            weight[r] = be_alloc(c, c->gpu, nk * 4);
            expert[r] = be_alloc(c, c->gpu, nk * 4);
            counts[r] = be_alloc(c, c->gpu, (size_t)E * 4);
            token_of[r] = be_alloc(c, c->gpu, nk * 4);
            slot[r] = be_alloc(c, c->gpu, nk * 4);
            c->gpu->moe_route(probs[r], weight[r], expert[r], counts[r], token_of[r], slot[r],
                              pz.gpu, N, E, k);
            drows[r] = be_alloc(c, c->gpu, nk * C * es);
            dw[r] = be_alloc(c, c->gpu, nk * 4);
            c->gpu->moe_combine_bwd(drows[r], dw[r], NULL, pd.gpu, py.gpu, weight[0], slot[0], 0.0f,
                                    N, k, C);
        }
        const char *sh = "N=2048 E=64 k=6 random", *shc = "N=2048 k=6 C=768";
        same_bits(c, "determinism.moe_route.probs", sh, probs[0], probs[1], ne * 4);
        same_bits(c, "determinism.moe_route.weight", sh, weight[0], weight[1], nk * 4);
        same_bits(c, "determinism.moe_route.expert", sh, expert[0], expert[1], nk * 4);
        same_bits(c, "determinism.moe_route.counts", sh, counts[0], counts[1], (size_t)E * 4);
        same_bits(c, "determinism.moe_route.token_of", sh, token_of[0], token_of[1], nk * 4);
        same_bits(c, "determinism.moe_route.slot", sh, slot[0], slot[1], nk * 4);
        same_bits(c, "determinism.moe_combine_bwd.dweight", shc, dw[0], dw[1], nk * 4);
        release(c);
        free(z), free(rows), free(dout);
    }
    // sum_squares and loss_mean_add: reductions in a fixed order.
    {
        size_t n = 3000017;
        float *x = host_rand(n, -1, 1);
        Pair px = pair_f32(c, x, n);
        double *s[2], *acc[2], zero = 0;
        for (int r = 0; r < 2; r++) {
            s[r] = be_alloc(c, c->gpu, sizeof(double));
            acc[r] = gpu_with(c, &zero, sizeof zero);
            c->gpu->sum_squares(s[r], px.gpu, n);
            c->gpu->loss_mean_add(acc[r], px.gpu, 100000, 99999);
        }
        same_bits(c, "determinism.sum_squares", "n=3000017", s[0], s[1], sizeof(double));
        same_bits(c, "determinism.loss_mean_add", "N=100000", acc[0], acc[1], sizeof(double));
        release(c);
        free(x);
    }
}

// ---------------------------------------------------------------- generation
// attention_decode: one query per sequence and head over a KV cache (B, max_len, KVH, D);
// sequence b sees keys [end - window, end) (window 0: [0, end)) with end the full cache, one
// key, 33 keys (one past the CUDA kernel's 32-key tile) or about half of it, in turn; every
// other cached key is random (it must be ignored). q rows strided as the model's qkv rows.
// Against the CPU, then twice on the GPU: the same bits.
static void test_attention_decode(Ctx *c, int B, int H, int KVH, int D, int max_len, int window) {
    int S = (H + 2 * KVH) * D;
    size_t nq = (size_t)B * S, nc = (size_t)B * max_len * KVH * D, no = (size_t)B * H * D;
    char sh[80];
    snprintf(sh, sizeof sh, "B=%d H=%d KVH=%d D=%d max_len=%d window %d", B, H, KVH, D, max_len,
             window);
    int32_t *span = xmalloc(2 * (size_t)B * sizeof *span);
    for (int b = 0; b < B; b++) {
        int ends[4] = {max_len, 1, 33 < max_len ? 33 : max_len, max_len / 2 + 1};
        int end = ends[b % 4], first = window ? end - window : 0;
        span[b] = first > 0 ? first : 0;
        span[B + b] = end;
    }
    float *q = host_rand(nq, -2, 2), *k = host_rand(nc, -2, 2), *v = host_rand(nc, -1, 1);
    float *out0 = host_rand(no, -1, 1);
    Pair pq = pair_act(c, q, nq), pk = pair_act(c, k, nc), pv = pair_act(c, v, nc);
    Pair po = pair_act(c, out0, no), ps = pair_i32(c, span, 2 * (size_t)B);
    Err err = {0};
    if (c->cpu->attention_reserve(max_len, D, &err)) {
        fprintf(stderr, "test_gpu_ops: %s\n", err.msg);
        exit(1);
    }
    c->cpu->attention_decode(po.cpu, pq.cpu, pk.cpu, pv.cpu, ps.cpu, B, H, KVH, D, S, max_len);
    c->gpu->attention_decode(po.gpu, pq.gpu, pk.gpu, pv.gpu, ps.gpu, B, H, KVH, D, S, max_len);
    compare(c, "attention_decode", sh, &po);
    size_t bytes = no * dtype_size(c->dt);
    void *again = be_alloc(c, c->gpu, bytes);
    c->gpu->attention_decode(again, pq.gpu, pk.gpu, pv.gpu, ps.gpu, B, H, KVH, D, S, max_len);
    same_bits(c, "determinism.attention_decode", sh, po.gpu, again, bytes);
    release(c);
    free(span), free(q), free(k), free(v), free(out0);
}

static void test_generation_ops(Ctx *c) {
    for (int D = 64; D <= 128; D *= 2) {
        test_attention_decode(c, 4, 8, 2, D, 300, 0);   // groups of 4, causal
        test_attention_decode(c, 4, 8, 1, D, 300, 100); // a group of 8, a sliding window
    }
    test_attention_decode(c, 3, 12, 1, 96, 130, 0); // a group of 12: two chunks of heads
    test_attention_decode(c, 2, 6, 6, 37, 70, 20);  // no sharing, an odd head_dim
}

// ---------------------------------------------------------------- main
static void run_all(Ctx *c) {
    test_memory(c);
    test_matmul(c, 257, 384, 320);
    test_embedding(c, 2048, 1000, 768);
    test_rmsnorm(c, 300, 1, 768, 768, 0);     // hidden-size norm, contiguous rows
    test_rmsnorm(c, 600, 8, 64, 768, 0);      // q-norm: H=8 heads of 64 in a q|k|v row
    test_rmsnorm(c, 600, 2, 128, 1536, 1024); // k-norm: KVH=2 heads of 128 after 8 q heads
    test_rope(c, 2, 300, 10, 64, 768);        // q and k heads (8 + 2) of a q|k|v row
    test_rope(c, 2, 300, 10, 128, 1536);
    for (int D = 64; D <= 128; D *= 2)
        for (int docs = CAUSAL; docs <= DOCS_WINDOW; docs++)
            test_attention(c, 2, 300, 8, 2, D, docs);
    test_attention(c, 1, 70, 4, 2, 96, DOCS); // SIMT in every dtype (the 16-bit fallback is logged)
    test_swiglu(c, 300, 1408);
    test_sigmoid_gate(c, (size_t)300 * 768 + 5);
    test_moe(c);
    test_cross_entropy(c, 128, 32000, 0.0f);
    test_cross_entropy(c, 128, 32000, 0.1f);
    test_reductions(c);
    test_preference(c);
    test_adamw(c, 1000003);
    test_muon(c, 256, 768); // rows < cols
    test_muon(c, 768, 256); // rows > cols: transposed
    test_determinism(c);
    if (c->dt == DT_F16) test_f16_overflow(c); // last: the other modes' inputs stay as they were
    test_generation_ops(c); // after all: the inputs before are those they always were
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (!backend_cuda_available()) {
#ifdef ASTRAI_HAVE_CUDA
        const char *reason = "no GPU visible";
#else
        const char *reason = "built without CUDA";
#endif
        printf("test_gpu_ops: SKIPPED (%s)\n", reason);
        write_json(reason);
        return 77;
    }
    printf("%-34s %-40s %-4s %11s %9s %s\n", "op", "case", "type", "max_rel_err", "tol", "result");
    const Backend *cpu = backend_cpu();
    const DType dtypes[] = {DT_F32, DT_BF16, DT_F16};
    for (int i = 0; i < 3; i++) {
        Err err = {0};
        const Backend *gpu = NULL;
        if (backend_open(&gpu, BACKEND_CUDA, 0, dtypes[i], &err)) {
            fprintf(stderr, "test_gpu_ops: backend_open(cuda, %s): %s\n", dtype_name(dtypes[i]),
                    err.msg);
            n_failed++;
            continue;
        }
        Ctx *c = calloc(1, sizeof *c);
        if (!c) return 1;
        c->cpu = cpu, c->gpu = gpu, c->dt = dtypes[i];
        c->cpu_dt = backend_cpu_dtype(dtypes[i]);
        rng_state = 0x5eed5eed12345678ull; // the same inputs in every mode
        int results0 = n_results, failed0 = n_failed;
        run_all(c);
        // One line per dtype (tests/gpu/run.sh reports them, and requires the fp16 one).
        printf("test_gpu_ops: %s: %d of %d checks failed\n", dtype_name(dtypes[i]),
               n_failed - failed0, n_results - results0);
        free(c);
    }
    printf("test_gpu_ops: %d of %d checks failed\n", n_failed, n_results);
    write_json(NULL);
    return n_failed ? 1 : 0;
}
