// test_cpu_lowp.c: the bf16 and fp16 CPU backends (backend_cpu_dtype: engine/cpu/lowp.c,
// gemm.c) against the fp32 one, every op of the Backend table.
//
// Both run from the same inputs: compute-dtype inputs are drawn in fp32 and rounded to the
// dtype (the fp32 backend gets the rounded values), fp32 inputs are shared. The reference is
// the fp32 backend's output rounded to the dtype:
// - staged ops (all but the matmuls; the same fp32 kernel on the same values): within
//   MAX_ULP of the dtype, fp32 outputs (lse, rstd, loss, gradients) bit-exact;
// - matmuls on the portable path (the fp32 backend's own sgemm call): bit-exact; on oneDNN
//   within the GEMM tolerance: 1 ulp of the output plus 2 (K+1) 2^-24 sum_k |a_k b_k| (products of
//   2-byte floats are exact in fp32, so two fp32 sums of the same K terms and the old value,
//   in different orders, differ by at most that; fp32 dweight gets the same bound).
// Also: the accumulate flags, odd shapes, fp16 overflow to inf, oneDNN against the portable
// path (backend_cpu_set_gemm_path; ASTRAI_CPU_GEMM=portable), reruns bit-identical, the converters
// at every rounding boundary of fp16 and against an independent bf16 rounding.
//
// Modes: no argument: the checks. --dump FILE: the checks, writing every reduced-dtype
// output to FILE (test_cpu_lowp.py compares two runs). --convert IN OUT: OUT = the fp16 bits
// then the bf16 bits of IN's fp32 values, then the fp32 of all 65536 fp16 patterns
// (test_cpu_lowp.py checks them against numpy and torch).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "ckpt/safetensors.h"
#include "common/splitmix64.h"
#include "engine/backend.h"
#include "engine/cpu/lowp.h"

enum { MAX_ULP = 0 }; // staged ops: what the test allows (they are exact)

static const Backend *f32; // the reference
static const Backend *lp;  // the backend under test
static DType dt;
static FILE *dump;
static uint64_t rng = 42;

static float uniform(float scale) {
    return scale * (float)((double)(splitmix64_next(&rng) >> 11) * 0x1p-52 - 1.0);
}

static float lowp_value(uint16_t h) {
    return dt == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

static uint16_t lowp_round(float f) {
    return dt == DT_BF16 ? f32_to_bf16(f) : f32_to_f16(f);
}

// ---------------------------------------------------------------- tensors

// A compute-dtype tensor on both backends: f the fp32 backend's, h the reduced one's.
typedef struct {
    size_t n;
    float *f;
    uint16_t *h;
} Act;

// Uniform in [-scale, scale], rounded to the dtype.
static Act act(size_t n, float scale) {
    Act a = {n, malloc(n * sizeof(float) + 1), malloc(n * sizeof(uint16_t) + 1)};
    for (size_t i = 0; i < n; i++) {
        a.h[i] = lowp_round(uniform(scale));
        a.f[i] = lowp_value(a.h[i]);
    }
    return a;
}

static void act_free(Act *a) {
    free(a->f);
    free(a->h);
}

static float *floats(size_t n, float scale) {
    float *x = malloc(n * sizeof *x + 1);
    for (size_t i = 0; i < n; i++)
        x[i] = uniform(scale);
    return x;
}

static float *copy_floats(const float *x, size_t n) {
    return memcpy(malloc(n * sizeof *x + 1), x, n * sizeof *x);
}

// Ulps between two 2-byte floats of the dtype (both NaN: 0).
static int ulps(uint16_t a, uint16_t b) {
    float fa = lowp_value(a), fb = lowp_value(b);
    if (fa != fa || fb != fb) return fa != fa && fb != fb ? 0 : 1 << 16;
    int oa = a & 0x8000 ? -(a & 0x7FFF) : a & 0x7FFF, ob = b & 0x8000 ? -(b & 0x7FFF) : b & 0x7FFF;
    return abs(oa - ob);
}

static void dump_bytes(const void *p, size_t bytes) {
    if (dump) fwrite(p, 1, bytes, dump);
}

// a's reduced output against its fp32 output rounded: within max_ulp. Then the fp32 copy
// takes the reduced values, so that the next op starts both from the same inputs.
static void check_act(const char *what, Act *a, int max_ulp) {
    int worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < a->n; i++) {
        int u = ulps(a->h[i], lowp_round(a->f[i]));
        if (u > worst) worst = u, at = i;
    }
    CHECK_MSG(worst <= max_ulp, "%s %s: %d ulps at %zu (%g vs %g)", dtype_name(dt), what, worst, at,
              lowp_value(a->h[at]), a->f[at]);
    dump_bytes(a->h, a->n * sizeof *a->h);
    for (size_t i = 0; i < a->n; i++)
        a->f[i] = lowp_value(a->h[i]);
}

static void check_exact(const char *what, const float *got, const float *want, size_t n) {
    size_t bad = 0;
    while (bad < n && !memcmp(&got[bad], &want[bad], sizeof *got))
        bad++;
    CHECK_MSG(bad == n, "%s %s: element %zu %.9g vs %.9g", dtype_name(dt), what, bad,
              bad < n ? got[bad] : 0, bad < n ? want[bad] : 0);
    dump_bytes(got, n * sizeof *got);
}

// ---------------------------------------------------------------- matmuls

static int gemm_portable(void) {
    return !strncmp(backend_cpu_gemm_path(dt), "portable", 8);
}

// mag: (M,N) = sum_k |A(m,k) B(k,n)| (+ |C(m,n)| unless C is NULL), A(m,k) = A[m*am + k*ak],
// B(k,n) = B[k*bk + n*bn]: the terms whose fp32 sum the summation order may change.
static double *magnitudes(int M, int N, int K, const float *A, size_t am, size_t ak, const float *B,
                          size_t bk, size_t bn, const float *C) {
    double *mag = malloc((size_t)M * N * sizeof *mag);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = C ? fabs(C[(size_t)m * N + n]) : 0.0;
            for (int k = 0; k < K; k++)
                s += fabs((double)A[m * am + k * ak] * B[k * bk + n * bn]);
            mag[(size_t)m * N + n] = s;
        }
    return mag;
}

// The spacing of the dtype's values (ulp) at |x|, or fp32's when in_f32.
static double ulp_at(double x, int in_f32) {
    int e;
    frexp(fabs(x), &e);
    int bits = in_f32 ? 24 : dt == DT_BF16 ? 8 : 11;
    double ulp = ldexp(1.0, e - bits), tiny = in_f32          ? 0x1p-149
                                              : dt == DT_BF16 ? 0x1p-133
                                                              : 0x1p-24;
    return ulp > tiny ? ulp : tiny;
}

// GEMM outputs got against want (n elements, sums of K products): within the GEMM tolerance
// (header), or bit-exact when exact.
static void check_gemm(const char *what, const float *got, const float *want, const double *mag,
                       size_t n, int K, int in_f32, int exact) {
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (!memcmp(&got[i], &want[i], sizeof *got)) continue;
        double tol = exact ? 0
                           : ulp_at(fmax(fabs(got[i]), fabs(want[i])), in_f32) +
                                 2.0 * (K + 1) * 0x1p-24 * mag[i];
        double r = fabs((double)got[i] - want[i]) / (tol > 0 ? tol : 1e-300);
        if (!(r <= worst)) worst = r, at = i;
    }
    CHECK_MSG(worst <= 1, "%s %s: error %.3g x the tolerance at %zu (%.9g vs %.9g)", dtype_name(dt),
              what, worst, at, got[at], want[at]);
}

// A reduced GEMM output against the fp32 backend's rounded; then both hold the reduced one.
static void check_gemm_act(const char *what, Act *out, const double *mag, int K) {
    float *got = malloc(out->n * sizeof *got + 1), *want = malloc(out->n * sizeof *want + 1);
    for (size_t i = 0; i < out->n; i++) {
        got[i] = lowp_value(out->h[i]);
        want[i] = lowp_value(lowp_round(out->f[i]));
    }
    check_gemm(what, got, want, mag, out->n, K, 0, gemm_portable());
    dump_bytes(out->h, out->n * sizeof *out->h);
    memcpy(out->f, got, out->n * sizeof *got);
    free(got);
    free(want);
}

// out: (N,OC) = inp: (N,C) @ w^T (+ out); rerun on the same inputs: the same bits.
static void test_matmul_fwd(int N, int C, int OC, int accumulate) {
    Act inp = act((size_t)N * C, 1), w = act((size_t)OC * C, 1), out = act((size_t)N * OC, 1);
    uint16_t *again = memcpy(malloc(out.n * 2), out.h, out.n * 2);
    double *mag = magnitudes(N, OC, C, inp.f, C, 1, w.f, 1, C, accumulate ? out.f : NULL);
    lp->matmul_fwd(out.h, inp.h, w.h, N, C, OC, accumulate);
    lp->matmul_fwd(again, inp.h, w.h, N, C, OC, accumulate);
    f32->matmul_fwd(out.f, inp.f, w.f, N, C, OC, accumulate);
    CHECK_MSG(!memcmp(again, out.h, out.n * 2), "%s matmul_fwd %dx%dx%d: a rerun differs",
              dtype_name(dt), N, C, OC);
    check_gemm_act(accumulate ? "matmul_fwd accumulate" : "matmul_fwd", &out, mag, C);
    free(again);
    free(mag);
    act_free(&inp);
    act_free(&w);
    act_free(&out);
}

// dinp: (N,C) = dout @ w (+ dinp); dweight: (OC,C) fp32 += dout^T @ inp.
static void test_matmul_bwd(int N, int C, int OC, int accumulate) {
    Act dout = act((size_t)N * OC, 1), inp = act((size_t)N * C, 1), w = act((size_t)OC * C, 1),
        dinp = act((size_t)N * C, 1);
    float *dw = floats((size_t)OC * C, 1), *dw_ref = copy_floats(dw, (size_t)OC * C);
    double *mag_in = magnitudes(N, C, OC, dout.f, OC, 1, w.f, C, 1, accumulate ? dinp.f : NULL);
    double *mag_w = magnitudes(OC, C, N, dout.f, 1, OC, inp.f, C, 1, dw);
    lp->matmul_bwd(dinp.h, dw, dout.h, inp.h, w.h, N, C, OC, accumulate);
    f32->matmul_bwd(dinp.f, dw_ref, dout.f, inp.f, w.f, N, C, OC, accumulate);
    check_gemm_act(accumulate ? "matmul_bwd.dinp accumulate" : "matmul_bwd.dinp", &dinp, mag_in,
                   OC);
    check_gemm("matmul_bwd.dweight", dw, dw_ref, mag_w, (size_t)OC * C, N, 1, gemm_portable());
    dump_bytes(dw, (size_t)OC * C * sizeof *dw);
    free(dw);
    free(dw_ref);
    free(mag_in);
    free(mag_w);
    act_free(&dout);
    act_free(&inp);
    act_free(&w);
    act_free(&dinp);
}

// oneDNN against the portable path on the same inputs (a no-op comparison where the
// portable path is the only one).
static void test_gemm_paths(int N, int C, int OC) {
    // back to the path this run chose after the comparison (test_cpu_lowp_portable sets the
    // environment's override)
    const char *env = getenv("ASTRAI_CPU_GEMM");
    int portable_env = env && !strcmp(env, "portable");
    Act inp = act((size_t)N * C, 1), w = act((size_t)OC * C, 1);
    uint16_t *h[2];
    float *v[2];
    for (int p = 0; p < 2; p++) {
        backend_cpu_set_gemm_path(p ? CPU_GEMM_PORTABLE : CPU_GEMM_AUTO);
        printf("%s %dx%dx%d: %s\n", dtype_name(dt), N, C, OC, backend_cpu_gemm_path(dt));
        h[p] = calloc((size_t)N * OC, 2);
        v[p] = malloc((size_t)N * OC * sizeof(float));
        lp->matmul_fwd(h[p], inp.h, w.h, N, C, OC, 0);
        lp->download_f32(v[p], h[p], (size_t)N * OC);
    }
    backend_cpu_set_gemm_path(portable_env ? CPU_GEMM_PORTABLE : CPU_GEMM_AUTO);
    double *mag = magnitudes(N, OC, C, inp.f, C, 1, w.f, 1, C, NULL);
    check_gemm("matmul_fwd fast vs portable", v[0], v[1], mag, (size_t)N * OC, C, 0, 0);
    int worst = 0;
    for (size_t i = 0; i < (size_t)N * OC; i++)
        worst = ulps(h[0][i], h[1][i]) > worst ? ulps(h[0][i], h[1][i]) : worst;
    printf("%s %dx%dx%d: the two paths differ by %d ulp at most\n", dtype_name(dt), N, C, OC,
           worst);
    for (int p = 0; p < 2; p++)
        free(h[p]), free(v[p]);
    free(mag);
    act_free(&inp);
    act_free(&w);
}

// ---------------------------------------------------------------- staged ops

static void test_embedding(int V, int N, int C) {
    Act table = act((size_t)V * C, 1), out = act((size_t)N * C, 1), dout = act((size_t)N * C, 1);
    int32_t *ids = malloc(N * sizeof *ids), *by_id = malloc(N * sizeof *by_id);
    int k = 0;
    for (int n = 0; n < N; n++)
        ids[n] = (int32_t)(splitmix64_next(&rng) % (uint64_t)V);
    for (int v = 0; v < V; v++) // the tokens stably sorted by id
        for (int n = 0; n < N; n++)
            if (ids[n] == v) by_id[k++] = n;
    float *dt_l = floats((size_t)V * C, 1), *dt_f = copy_floats(dt_l, (size_t)V * C);
    lp->embedding_fwd(out.h, ids, table.h, N, C);
    f32->embedding_fwd(out.f, ids, table.f, N, C);
    check_act("embedding_fwd", &out, 0);
    lp->embedding_bwd(dt_l, dout.h, ids, by_id, N, C);
    f32->embedding_bwd(dt_f, dout.f, ids, by_id, N, C);
    check_exact("embedding_bwd", dt_l, dt_f, (size_t)V * C);
    free(ids), free(by_id), free(dt_l), free(dt_f);
    act_free(&table), act_free(&out), act_free(&dout);
}

// G groups of C per row, rows `stride` apart (the elements between groups must survive).
static void test_rmsnorm(int N, int G, int C, int stride, int accumulate) {
    size_t n = (size_t)N * stride, rows = (size_t)N * G;
    Act x = act(n, 2), w = act((size_t)C, 1), out = act(n, 1), dout = act(n, 1), dinp = act(n, 1);
    float *rs_l = floats(rows, 1), *rs_f = floats(rows, 1);
    float *dw_l = floats((size_t)C, 1), *dw_f = copy_floats(dw_l, (size_t)C);
    lp->rmsnorm_fwd(out.h, rs_l, x.h, w.h, N, G, C, stride, 1e-5f);
    f32->rmsnorm_fwd(out.f, rs_f, x.f, w.f, N, G, C, stride, 1e-5f);
    check_act("rmsnorm_fwd.out", &out, MAX_ULP);
    check_exact("rmsnorm_fwd.rstd", rs_l, rs_f, rows);
    lp->rmsnorm_bwd(dinp.h, dw_l, dout.h, x.h, w.h, rs_l, N, G, C, stride, accumulate);
    f32->rmsnorm_bwd(dinp.f, dw_f, dout.f, x.f, w.f, rs_f, N, G, C, stride, accumulate);
    check_act(accumulate ? "rmsnorm_bwd.dinp accumulate" : "rmsnorm_bwd.dinp", &dinp, MAX_ULP);
    check_exact("rmsnorm_bwd.dweight", dw_l, dw_f, (size_t)C);
    free(rs_l), free(rs_f), free(dw_l), free(dw_f);
    act_free(&x), act_free(&w), act_free(&out), act_free(&dout), act_free(&dinp);
}

// In place on G heads of D from element `offset` of rows `stride` apart.
static void test_rope(int N, int G, int D, int stride, int offset) {
    enum { P = 50 };
    Act x = act((size_t)N * stride, 1);
    float *cs = malloc((size_t)P * D * sizeof *cs);
    for (int p = 0; p < P; p++)
        for (int i = 0; i < D / 2; i++) {
            double angle = p * pow(10000.0, -2.0 * i / D);
            cs[(size_t)p * D + 2 * i] = (float)cos(angle);
            cs[(size_t)p * D + 2 * i + 1] = (float)sin(angle);
        }
    int32_t *pos = malloc(N * sizeof *pos);
    for (int n = 0; n < N; n++)
        pos[n] = (int32_t)(splitmix64_next(&rng) % P);
    lp->rope_fwd(x.h + offset, pos, cs, N, G, D, stride);
    f32->rope_fwd(x.f + offset, pos, cs, N, G, D, stride);
    check_act("rope_fwd", &x, MAX_ULP);
    lp->rope_bwd(x.h + offset, pos, cs, N, G, D, stride);
    f32->rope_bwd(x.f + offset, pos, cs, N, G, D, stride);
    check_act("rope_bwd", &x, MAX_ULP);
    free(cs), free(pos);
    act_free(&x);
}

// q|k|v fused rows as the model has them; batch row 1 holds two documents.
static void test_attention(int B, int T, int H, int KVH, int D) {
    int S = (H + 2 * KVH) * D;
    size_t nq = (size_t)B * T * S, no = (size_t)B * T * H * D, hd = (size_t)H * D,
           vd = (size_t)(H + KVH) * D;
    Act qkv = act(nq, 1), out = act(no, 1), dout = act(no, 1), dqkv = act(nq, 1);
    float *lse_l = floats((size_t)B * H * T, 1), *lse_f = floats((size_t)B * H * T, 1);
    int32_t *doc = malloc((size_t)B * T * sizeof *doc);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            doc[b * T + t] = b == 1 && t >= T / 3 ? T / 3 : 0;
    Err err = {0};
    CHECK(!lp->attention_reserve(T, D, &err));
    lp->attention_fwd(out.h, lse_l, qkv.h, qkv.h + hd, qkv.h + vd, doc, B, T, H, KVH, D, S);
    f32->attention_fwd(out.f, lse_f, qkv.f, qkv.f + hd, qkv.f + vd, doc, B, T, H, KVH, D, S);
    check_act("attention_fwd.out", &out, MAX_ULP);
    check_exact("attention_fwd.lse", lse_l, lse_f, (size_t)B * H * T);
    lp->attention_bwd(dqkv.h, dqkv.h + hd, dqkv.h + vd, dout.h, out.h, lse_l, qkv.h, qkv.h + hd,
                      qkv.h + vd, doc, B, T, H, KVH, D, S);
    f32->attention_bwd(dqkv.f, dqkv.f + hd, dqkv.f + vd, dout.f, out.f, lse_f, qkv.f, qkv.f + hd,
                       qkv.f + vd, doc, B, T, H, KVH, D, S);
    check_act("attention_bwd", &dqkv, MAX_ULP);
    free(lse_l), free(lse_f), free(doc);
    act_free(&qkv), act_free(&out), act_free(&dout), act_free(&dqkv);
}

// Sequence b of B sees the keys [b, 3b + 2) of its cache of max_len (at most its end).
static void test_attention_decode(int B, int H, int KVH, int D, int max_len) {
    int S = (H + 2 * KVH) * D;
    size_t nc = (size_t)B * max_len * KVH * D, no = (size_t)B * H * D;
    Act q = act((size_t)B * S, 1), k = act(nc, 1), v = act(nc, 1), out = act(no, 1);
    int32_t span[2 * 8];
    for (int b = 0; b < B; b++) {
        span[b] = b;
        span[B + b] = 3 * b + 2 < max_len ? 3 * b + 2 : max_len;
    }
    Err err = {0};
    CHECK(!lp->attention_reserve(max_len, D, &err));
    lp->attention_decode(out.h, q.h, k.h, v.h, span, B, H, KVH, D, S, max_len);
    f32->attention_decode(out.f, q.f, k.f, v.f, span, B, H, KVH, D, S, max_len);
    check_act("attention_decode", &out, MAX_ULP);
    act_free(&q), act_free(&k), act_free(&v), act_free(&out);
}

static void test_swiglu(int N, int FF) {
    size_t n = (size_t)N * FF;
    Act h = act(2 * n, 3), out = act(n, 1), dout = act(n, 1), dh = act(2 * n, 1);
    lp->swiglu_fwd(out.h, h.h, N, FF);
    f32->swiglu_fwd(out.f, h.f, N, FF);
    check_act("swiglu_fwd", &out, MAX_ULP);
    lp->swiglu_bwd(dh.h, dout.h, h.h, N, FF);
    f32->swiglu_bwd(dh.f, dout.f, h.f, N, FF);
    check_act("swiglu_bwd", &dh, MAX_ULP);
    act_free(&h), act_free(&out), act_free(&dout), act_free(&dh);
}

static void test_sigmoid_gate(size_t n) {
    Act x = act(n, 2), g = act(n, 4), out = act(n, 1), dout = act(n, 1), dx = act(n, 1),
        dg = act(n, 1);
    lp->sigmoid_gate_fwd(out.h, x.h, g.h, n);
    f32->sigmoid_gate_fwd(out.f, x.f, g.f, n);
    check_act("sigmoid_gate_fwd", &out, MAX_ULP);
    lp->sigmoid_gate_bwd(dx.h, dg.h, dout.h, x.h, g.h, n);
    f32->sigmoid_gate_bwd(dx.f, dg.f, dout.f, x.f, g.f, n);
    check_act("sigmoid_gate_bwd.dx", &dx, MAX_ULP);
    check_act("sigmoid_gate_bwd.dg", &dg, MAX_ULP);
    act_free(&x), act_free(&g), act_free(&out), act_free(&dout), act_free(&dx), act_free(&dg);
}

// Rows 0 mod 4 masked out; with and without row_scale.
static void test_cross_entropy(int N, int V, float smoothing, int scaled) {
    Act z = act((size_t)N * V, 6), dz = act((size_t)N * V, 1);
    float loss[2][64], lse[2][64], *row_scale = floats((size_t)N, 2);
    int32_t targets[64], mask[64];
    for (int n = 0; n < N; n++) {
        targets[n] = (int32_t)(splitmix64_next(&rng) % (uint64_t)V);
        mask[n] = n % 4 != 0;
    }
    lp->cross_entropy_fwd(loss[0], lse[0], z.h, targets, mask, N, V, smoothing);
    f32->cross_entropy_fwd(loss[1], lse[1], z.f, targets, mask, N, V, smoothing);
    check_exact("cross_entropy_fwd.loss", loss[0], loss[1], (size_t)N);
    check_exact("cross_entropy_fwd.lse", lse[0], lse[1], (size_t)N);
    const float *rs = scaled ? row_scale : NULL;
    lp->cross_entropy_bwd(dz.h, z.h, lse[0], targets, mask, rs, N, V, smoothing, 0.37f);
    f32->cross_entropy_bwd(dz.f, z.f, lse[1], targets, mask, rs, N, V, smoothing, 0.37f);
    check_act("cross_entropy_bwd", &dz, MAX_ULP);
    free(row_scale);
    act_free(&z), act_free(&dz);
}

static void test_noise(size_t n) {
    Act x = act(n, 1);
    lp->gaussian_noise_add(x.h, n, 0.3f, 1234);
    f32->gaussian_noise_add(x.f, n, 0.3f, 1234);
    check_act("gaussian_noise_add", &x, MAX_ULP);
    act_free(&x);
}

// fp16 tops out at 65504: a GEMM past it is inf in the dtype, as the reference rounds it.
static void test_f16_overflow(void) {
    uint16_t inp[2 * 2], w[2 * 2], out[2 * 2];
    float big[4] = {300.0f, 300.0f, -300.0f, -300.0f};
    lp->cast_from_f32(inp, big, 4); // rows (300, 300), (-300, -300)
    lp->cast_from_f32(w, big, 4);
    lp->matmul_fwd(out, inp, w, 2, 2, 2, 0); // +-180000
    CHECK(out[0] == 0x7C00 && out[1] == 0xFC00 && out[2] == 0xFC00 && out[3] == 0x7C00);
    float edge[6] = {65504.0f, 65519.996f, 65520.0f, -1e5f, 1e-8f, 3e-8f}, back[6];
    uint16_t h[6], want[6] = {0x7BFF, 0x7BFF, 0x7C00, 0xFC00, 0x0000, 0x0001};
    lp->cast_from_f32(h, edge, 6);
    CHECK(!memcmp(h, want, sizeof h));
    lp->download_f32(back, h, 6);
    CHECK(back[2] == INFINITY && back[3] == -INFINITY && back[5] == 0x1p-24f);
}

// ---------------------------------------------------------------- table, converters

// The dtype's table: the dtype, the fp32 table's memory and dtype-free ops; backend_open.
static void test_table(void) {
    const Backend *be = NULL;
    Err err = {0};
    CHECK(!backend_open(&be, BACKEND_CPU, -1, dt, &err) && be == lp && lp->dtype == dt);
    CHECK(!strcmp(lp->name, "cpu") && lp->device == -1);
    CHECK(lp->alloc == f32->alloc && lp->copy == f32->copy && lp->download == f32->download);
    CHECK(lp->sum_squares == f32->sum_squares && lp->adamw == f32->adamw && lp->muon == f32->muon);
    CHECK(lp->scale == f32->scale && lp->loss_mean_add == f32->loss_mean_add);
    CHECK(lp->dpo_loss == f32->dpo_loss && lp->grpo_loss == f32->grpo_loss);
    CHECK(lp->attention_reserve == f32->attention_reserve);
    CHECK(lp->matmul_fwd != f32->matmul_fwd && lp->cast_from_f32 != f32->cast_from_f32);
}

// cast_from_f32 / download_f32 (the parallel conversions) against the scalar ones.
static void test_bulk_convert(size_t n) {
    float *x = floats(n, 70000.0f), *back = malloc(n * sizeof *back);
    uint16_t *h = malloc(n * sizeof *h);
    size_t bad = 0;
    lp->cast_from_f32(h, x, n);
    lp->download_f32(back, h, n);
    for (size_t i = 0; i < n; i++)
        bad += h[i] != lowp_round(x[i]) || memcmp(&back[i], &(float){lowp_value(h[i])}, 4);
    CHECK_MSG(!bad, "%s: %zu conversions differ from the scalar ones", dtype_name(dt), bad);
    free(x), free(back), free(h);
}

// Every fp16 pattern back and forth; every rounding boundary: the midpoint of two
// neighbours rounds to the even one, a float either side of it to that side.
static void test_f16_converter(void) {
    size_t bad = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = f16_to_f32((uint16_t)h);
        int nan = (h & 0x7C00) == 0x7C00 && (h & 0x3FF);
        bad += f32_to_f16(f) != (nan ? (h | 0x200) : h); // NaN: made quiet
        if ((h & 0x7FFF) >= 0x7C00) continue;
        // the next magnitude up (past 65504: inf, 65536 for the arithmetic)
        float lo = fabsf(f), hi = (h & 0x7FFF) == 0x7BFF ? 65536.0f : fabsf(f16_to_f32(h + 1));
        float mid = (lo + hi) / 2, sign = h & 0x8000 ? -1.0f : 1.0f;
        uint16_t s = (uint16_t)(h & 0x8000), up = (uint16_t)((h & 0x7FFF) + 1);
        bad += f32_to_f16(sign * mid) != (h & 1 ? (s | up) : h);
        bad += f32_to_f16(sign * nextafterf(mid, 0)) != h;
        bad += f32_to_f16(sign * nextafterf(mid, INFINITY)) != (s | up);
    }
    CHECK_MSG(!bad, "fp16 converter: %zu wrong conversions", bad);
    CHECK(f32_to_f16(1.0f) == 0x3C00 && f32_to_f16(-2.0f) == 0xC000);
    CHECK(f32_to_f16(0x1p-25f) == 0 && f32_to_f16(0x1.8p-25f) == 1);
    CHECK(f32_to_f16(INFINITY) == 0x7C00 && f32_to_f16(-NAN) == 0xFE00);
    CHECK(f32_to_f16(1e-30f) == 0 && f32_to_f16(-0.0f) == 0x8000);
}

// An independent bf16 rounding: of the two bf16 values around f, the nearer by the exact
// (double) distance, the even one on a tie; past the largest finite, 2^128 stands for inf.
static uint16_t bf16_reference(float f) {
    uint32_t u = half_bits(f);
    if (isnan(f)) return (uint16_t)((u >> 16) | 0x0040);
    uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1); // toward zero, away from it
    if (!(u & 0xFFFF)) return lo;
    double a = fabs((double)bf16_to_f32(lo)), x = fabs((double)f);
    double b = (hi & 0x7FFF) == 0x7F80 ? ldexp(1.0, 128) : fabs((double)bf16_to_f32(hi));
    return x - a < b - x ? lo : x - a > b - x ? hi : (lo & 1 ? hi : lo);
}

// bf16 rounding against bf16_reference on the specials (zeros, infs, NaNs, ties, the largest
// finite) and random bit patterns; decoding is the bits' top half.
static void test_bf16_converter(void) {
    static const uint32_t SPECIAL[] = {0,           0x80000000u, 0x7F800000u, 0xFF800000u,
                                       0x7FC00000u, 0x7F800001u, 0x7FFFFFFFu, 1,
                                       0x7F7FFFFFu, 0x3F808000u, 0x3F818000u, 0x3F80FFFFu,
                                       0x00008000u, 0x80018000u, 0x7F7F8000u, 0xFFFFFFFFu};
    size_t bad = 0, n_special = sizeof SPECIAL / sizeof *SPECIAL;
    for (size_t i = 0; i < (1 << 20); i++) {
        uint32_t u = i < n_special ? SPECIAL[i] : (uint32_t)splitmix64_next(&rng);
        float f = half_float(u);
        bad += f32_to_bf16(f) != bf16_reference(f) ||
               half_bits(bf16_to_f32((uint16_t)u)) != (u & 0xFFFFu) << 16;
    }
    CHECK_MSG(!bad, "bf16 converter: %zu conversions differ from the reference rounding", bad);
}

static void run_dtype(DType d) {
    dt = d;
    lp = backend_cpu_dtype(d);
    printf("%s: GEMM path %s\n", dtype_name(d), backend_cpu_gemm_path(d));
    test_table();
    test_bulk_convert(100003);
    // odd shapes (none a multiple of 8), square, a single row; accumulate both ways
    int shapes[][3] = {{37, 45, 67}, {64, 64, 64}, {1, 13, 3}, {130, 96, 50}, {5, 200, 17}};
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int acc = 0; acc < 2; acc++) {
            test_matmul_fwd(shapes[i][0], shapes[i][1], shapes[i][2], acc);
            test_matmul_bwd(shapes[i][0], shapes[i][1], shapes[i][2], acc);
        }
    test_gemm_paths(67, 129, 93);
    test_embedding(29, 41, 19);
    for (int acc = 0; acc < 2; acc++) {
        test_rmsnorm(7, 3, 10, 37, acc); // groups with gaps between them
        test_rmsnorm(9, 1, 45, 45, acc);
    }
    test_rope(9, 3, 8, 40, 0);
    test_rope(11, 2, 6, 30, 12); // k's heads, further along the row
    test_attention(2, 13, 4, 2, 8);
    test_attention(1, 37, 2, 1, 24);
    test_attention_decode(3, 4, 2, 8, 9);
    test_attention_decode(8, 6, 1, 24, 40);
    test_swiglu(7, 23);
    test_sigmoid_gate(101);
    test_sigmoid_gate(70001);
    test_cross_entropy(9, 37, 0.1f, 1);
    test_cross_entropy(13, 50, 0.0f, 0);
    test_noise(1001);
    if (d == DT_F16) test_f16_overflow();
}

// --convert IN OUT (header).
static int convert_file(const char *in, const char *out) {
    FILE *fi = fopen(in, "rb"), *fo = fopen(out, "wb");
    if (!fi || !fo) return fprintf(stderr, "cannot open %s or %s\n", in, out), 1;
    fseek(fi, 0, SEEK_END);
    size_t n = (size_t)ftell(fi) / sizeof(float);
    rewind(fi);
    float *x = malloc(n * sizeof *x + 1);
    uint16_t *h = malloc(2 * n * sizeof *h + 1);
    int ok = fread(x, sizeof *x, n, fi) == n;
    for (size_t i = 0; i < n; i++)
        h[i] = f32_to_f16(x[i]), h[n + i] = f32_to_bf16(x[i]);
    ok = ok && fwrite(h, sizeof *h, 2 * n, fo) == 2 * n;
    for (uint32_t i = 0; i < 0x10000 && ok; i++)
        ok = fwrite(&(float){f16_to_f32((uint16_t)i)}, sizeof(float), 1, fo) == 1;
    free(x), free(h);
    fclose(fi);
    return fclose(fo) || !ok;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--convert")) return convert_file(argv[2], argv[3]);
    if (argc == 3 && !strcmp(argv[1], "--dump") && !(dump = fopen(argv[2], "wb"))) return 1;
    f32 = backend_cpu();
    CHECK(backend_cpu_dtype(DT_F32) == f32 && !backend_cpu_dtype(DT_I32));
    const Backend *be;
    Err err = {0};
    CHECK(backend_open(&be, BACKEND_CPU, -1, DT_I32, &err) && strstr(err.msg, "int32"));
    test_f16_converter();
    test_bf16_converter();
    run_dtype(DT_BF16);
    run_dtype(DT_F16);
    if (dump && fclose(dump)) return 1;
    CHECK_DONE();
}
