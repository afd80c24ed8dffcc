// attention.c: causal GQA attention with document masks (CPU).
//
// Forward takes QBLOCK query rows of one head at a time: their scores against the visible
// keys come from a register-blocked product with the keys transposed (D, Tp), so the inner
// loop runs over consecutive keys (no horizontal sums), and their outputs from one pass over
// the value rows. Only each row's logsumexp is kept; no (T,T) score matrix exists. Backward
// works on the same tiles: it recomputes the probabilities p = exp(s - lse) from that
// logsumexp and adds the whole tile's dk and dv to each key row in one pass. Decoding (one
// query per sequence over its KV cache) runs forward's tiles with the query heads that share a
// kv head as the rows.
//
// The ops allocate nothing: each thread's scratch is a slice of one block that
// cpu_attention_reserve allocated ahead (the model reserves before each forward), and the
// parallel regions run no more threads than it has slices; a call past the reservation is the
// backend's recorded failure (engine/backend.h), never a write past it.
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cpu/cpu_kernels.h"

// Query rows per forward tile and the vector width of the register-blocked kernels (keys,
// or head dims): QBLOCK x LANES accumulators stay in registers.
enum { QBLOCK = 4, LANES = 16 };

static inline int round_up(int n, int m) {
    return (n + m - 1) / m * m;
}

static inline float dot(const float *a, const float *b, int D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; d++)
        s += a[d] * b[d];
    return s;
}

// Visible keys of query i: [first, i].
static inline int first_key(const int32_t *doc_start, int b, int T, int i) {
    return doc_start ? doc_start[(size_t)b * T + i] : 0;
}

// ---------------------------------------------------------------- scratch

// Per-thread backward scratch. (D, Tp): keys and values transposed; (T, Dp): keys padded,
// the dk and dv accumulators; (QBLOCK, Tp): one tile's p and ds; (QBLOCK, Dp): its q and
// dout rows padded, its dq. The forward's (below) is smaller.
typedef struct {
    int Tp, Dp;
    float *kt, *vt, *kp, *dkp, *dvp, *p, *ds, *xq, *xdo, *dqt;
} BwdScratch;

enum { BWD_PARTS = 10 };

// The floats of each part of BwdScratch for T tokens of dimension D; returns their sum.
static size_t bwd_parts(int T, int D, size_t sizes[BWD_PARTS]) {
    size_t Tp = (size_t)round_up(T, LANES), Dp = (size_t)round_up(D, LANES);
    size_t dt = (size_t)D * Tp, td = (size_t)T * Dp, qt = QBLOCK * Tp, qd = QBLOCK * Dp;
    size_t parts[BWD_PARTS] = {dt, dt, td, td, td, qt, qt, qd, qd, qd}, total = 0;
    for (int i = 0; i < BWD_PARTS; i++)
        total += sizes[i] = parts[i];
    return total;
}

// threads slices of per_thread floats, for up to T tokens of head dimension D.
static struct {
    float *at;
    size_t per_thread;
    int threads, T, D;
} scratch;

int cpu_attention_reserve(int T, int D, Err *err) {
    int threads = omp_get_max_threads();
    if (T <= scratch.T && D <= scratch.D && threads == scratch.threads) return 0;
    T = T > scratch.T ? T : scratch.T;
    D = D > scratch.D ? D : scratch.D;
    size_t sizes[BWD_PARTS], per_thread = bwd_parts(T, D, sizes);
    float *at = malloc(per_thread * (size_t)threads * sizeof *at);
    if (!at)
        return err_resource(
            err, "attention: out of memory for the scratch of %d threads (%d tokens)", threads, T);
    free(scratch.at);
    scratch.at = at;
    scratch.per_thread = per_thread;
    scratch.threads = threads;
    scratch.T = T;
    scratch.D = D;
    return 0;
}

// Whether a call of T tokens of dimension D fits the reserved scratch; if not (the caller's
// bug: nothing to compute with), the backend's failure (engine/backend.h), naming the op.
static int scratch_fits(const char *op, int T, int D) {
    if (T <= scratch.T && D <= scratch.D) return 1;
    first_failure_record(&cpu_failures,
                         "cpu backend: %s: %d tokens of dimension %d, scratch reserved for %d x %d",
                         op, T, D, scratch.T, scratch.D);
    return 0;
}

// This thread's slice (scratch_fits checked the call).
static float *thread_scratch(void) {
    return scratch.at + (size_t)omp_get_thread_num() * scratch.per_thread;
}

// dst: (D, ld) = the T rows of src (token stride `stride`) transposed, zero-padded from T to
// ld keys, so that the scores of one query against consecutive keys vectorise over keys.
static void transpose_rows(float *dst, int ld, const float *src, int T, int D, int stride) {
    for (int d = 0; d < D; d++)
        memset(dst + (size_t)d * ld + T, 0, (size_t)(ld - T) * sizeof *dst);
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++)
            dst[(size_t)d * ld + t] = src[(size_t)t * stride + d];
}

// dst: (T, ld) = the T rows of src (token stride `stride`), D values each, zero-padded to ld.
static void copy_rows_padded(float *dst, int ld, const float *src, int T, int D, int stride) {
    for (int t = 0; t < T; t++) {
        memcpy(dst + (size_t)t * ld, src + (size_t)t * stride, (size_t)D * sizeof *dst);
        memset(dst + (size_t)t * ld + D, 0, (size_t)(ld - D) * sizeof *dst);
    }
}

// s: (QBLOCK, ld), s[r][j] = x[r] . key j for j in [j_begin, j_end) rounded out to LANES;
// kt: (D, ld) the transposed keys; x[r]: D floats each (a short tile repeats a row).
static void tile_scores(float *s, int ld, const float *const x[QBLOCK], const float *kt, int D,
                        int j_begin, int j_end) {
    for (int j = j_begin / LANES * LANES; j < j_end; j += LANES) {
        float acc[QBLOCK][LANES] = {{0}};
        for (int d = 0; d < D; d++) {
            const float *col = kt + (size_t)d * ld + j;
            for (int r = 0; r < QBLOCK; r++) {
                float xd = x[r][d];
#pragma omp simd
                for (int jj = 0; jj < LANES; jj++)
                    acc[r][jj] += xd * col[jj];
            }
        }
        for (int r = 0; r < QBLOCK; r++)
            memcpy(s + (size_t)r * ld + j, acc[r], sizeof acc[r]);
    }
}

// o: (QBLOCK, ld) = p[:, j_begin:j_end] @ v[j_begin:j_end]; p: (QBLOCK, ld_p), 0 where a row
// does not see the key; v: (T, ld) value rows zero-padded to ld, a multiple of LANES.
static void tile_weighted_values(float *o, int ld, const float *p, int ld_p, const float *v,
                                 int j_begin, int j_end) {
    for (int d = 0; d < ld; d += LANES) {
        float acc[QBLOCK][LANES] = {{0}};
        for (int j = j_begin; j < j_end; j++) {
            const float *vj = v + (size_t)j * ld + d;
            for (int r = 0; r < QBLOCK; r++) {
                float prj = p[(size_t)r * ld_p + j];
#pragma omp simd
                for (int dd = 0; dd < LANES; dd++)
                    acc[r][dd] += prj * vj[dd];
            }
        }
        for (int r = 0; r < QBLOCK; r++)
            memcpy(o + (size_t)r * ld + d, acc[r], sizeof acc[r]);
    }
}

// Scores s over the row's keys [j0, j1) -> softmax(scale * s) in place, 0 over the rest of
// the tile's span [j_begin, j_end); returns the logsumexp of scale * s over [j0, j1).
static float softmax_row(float *s, int j_begin, int j_end, int j0, int j1, float scale) {
    float mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
    for (int j = j0; j < j1; j++)
        mx = s[j] > mx ? s[j] : mx;
#pragma omp simd reduction(+ : sum)
    for (int j = j0; j < j1; j++) {
        s[j] = cpu_expf(scale * (s[j] - mx));
        sum += s[j];
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (int j = j0; j < j1; j++)
        s[j] *= inv;
    for (int j = j_begin; j < j0; j++)
        s[j] = 0.0f;
    for (int j = j1; j < j_end; j++)
        s[j] = 0.0f;
    return scale * mx + logf(sum);
}

// Per-thread forward scratch: keys transposed (D, Tp), values padded (T, Dp), one tile's
// scores then probabilities (QBLOCK, Tp) and outputs (QBLOCK, Dp).
typedef struct {
    int Tp, Dp;
    float *kt, *vp, *p, *o;
} FwdScratch;

// Query head h of batch row b. out: (B*T, H, D), lse: (B, H, T).
static void attention_fwd_head(float *out, float *lse, const float *q, const float *k,
                               const float *v, const int32_t *doc_start, int b, int h, int T, int H,
                               int group, int D, int stride, const FwdScratch *w) {
    float scale = 1.0f / sqrtf((float)D);
    size_t kv_at = (size_t)b * T * stride + (size_t)(h / group) * D;
    transpose_rows(w->kt, w->Tp, k + kv_at, T, D, stride);
    copy_rows_padded(w->vp, w->Dp, v + kv_at, T, D, stride);
    for (int i0 = 0; i0 < T; i0 += QBLOCK) {
        int rows = T - i0 < QBLOCK ? T - i0 : QBLOCK;
        const float *x[QBLOCK];
        int last[QBLOCK]; // query row of tile row r (a short tile repeats its last row)
        for (int r = 0; r < QBLOCK; r++) {
            last[r] = i0 + (r < rows ? r : rows - 1);
            x[r] = q + ((size_t)b * T + last[r]) * stride + (size_t)h * D;
        }
        // keys any row of the tile sees (first keys never decrease along a sequence)
        int j_begin = first_key(doc_start, b, T, i0), j_end = i0 + rows;
        tile_scores(w->p, w->Tp, x, w->kt, D, j_begin, j_end);
        for (int r = 0; r < QBLOCK; r++) {
            int i = last[r];
            float row_lse = softmax_row(w->p + (size_t)r * w->Tp, j_begin, j_end,
                                        first_key(doc_start, b, T, i), i + 1, scale);
            if (r < rows) lse[((size_t)b * H + h) * T + i] = row_lse;
        }
        tile_weighted_values(w->o, w->Dp, w->p, w->Tp, w->vp, j_begin, j_end);
        for (int r = 0; r < rows; r++)
            memcpy(out + (((size_t)b * T + i0 + r) * H + h) * D, w->o + (size_t)r * w->Dp,
                   (size_t)D * sizeof *out);
    }
}

void cpu_attention_fwd(void *out_, float *lse, const void *q_, const void *k_, const void *v_,
                       const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                       int qkv_stride) {
    float *out = out_;
    const float *q = q_;
    const float *k = k_;
    const float *v = v_;
    if (!scratch_fits("attention_fwd", T, D)) return;
#pragma omp parallel num_threads(scratch.threads ? scratch.threads : 1)
    {
        FwdScratch w = {.Tp = round_up(T, LANES), .Dp = round_up(D, LANES)};
        size_t kt = (size_t)D * w.Tp, vp = (size_t)T * w.Dp, p = (size_t)QBLOCK * w.Tp;
        w.kt = thread_scratch();
        w.vp = w.kt + kt;
        w.p = w.vp + vp;
        w.o = w.p + p;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                attention_fwd_head(out, lse, q, k, v, doc_start, b, h, T, H, H / KVH, D, qkv_stride,
                                   &w);
    }
}

// ---------------------------------------------------------------- decoding

// The query heads of kv head kvh of sequence b over its cached keys [j0, j1): the forward's
// tiles with the group's query heads as the tile's rows (they share the keys), so each row
// gets attention_fwd's arithmetic for that query. kv: (max_len, KVH, D) of sequence b.
static void attention_decode_kv_head(float *out, const float *q, const float *kc, const float *vc,
                                     int j0, int j1, int kvh, int H, int KVH, int D,
                                     const FwdScratch *w) {
    float scale = 1.0f / sqrtf((float)D);
    int group = H / KVH, stride = KVH * D;
    transpose_rows(w->kt, w->Tp, kc + (size_t)kvh * D, j1, D, stride);
    copy_rows_padded(w->vp + (size_t)j0 * w->Dp, w->Dp, vc + (size_t)j0 * stride + (size_t)kvh * D,
                     j1 - j0, D, stride);
    for (int h0 = kvh * group; h0 < (kvh + 1) * group; h0 += QBLOCK) {
        int rows = (kvh + 1) * group - h0 < QBLOCK ? (kvh + 1) * group - h0 : QBLOCK;
        const float *x[QBLOCK]; // a short tile repeats its last head
        for (int r = 0; r < QBLOCK; r++)
            x[r] = q + (size_t)(h0 + (r < rows ? r : rows - 1)) * D;
        tile_scores(w->p, w->Tp, x, w->kt, D, j0, j1);
        for (int r = 0; r < QBLOCK; r++)
            softmax_row(w->p + (size_t)r * w->Tp, j0, j1, j0, j1, scale);
        tile_weighted_values(w->o, w->Dp, w->p, w->Tp, w->vp, j0, j1);
        for (int r = 0; r < rows; r++)
            memcpy(out + (size_t)(h0 + r) * D, w->o + (size_t)r * w->Dp, (size_t)D * sizeof *out);
    }
}

void cpu_attention_decode(void *out_, const void *q_, const void *k_cache, const void *v_cache,
                          const int32_t *span, int B, int H, int KVH, int D, int q_stride,
                          int max_len) {
    float *out = out_;
    const float *q = q_;
    const float *kc = k_cache;
    const float *vc = v_cache;
    if (!scratch_fits("attention_decode", max_len, D)) return;
    size_t seq = (size_t)max_len * KVH * D;
#pragma omp parallel num_threads(scratch.threads ? scratch.threads : 1)
    {
        FwdScratch w = {.Tp = round_up(max_len, LANES), .Dp = round_up(D, LANES)};
        w.kt = thread_scratch();
        w.vp = w.kt + (size_t)D * w.Tp;
        w.p = w.vp + (size_t)max_len * w.Dp;
        w.o = w.p + (size_t)QBLOCK * w.Tp;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int kvh = 0; kvh < KVH; kvh++)
                attention_decode_kv_head(out + (size_t)b * H * D, q + (size_t)b * q_stride,
                                         kc + b * seq, vc + b * seq, span[b], span[B + b], kvh, H,
                                         KVH, D, &w);
    }
}

// dst: (T, ld) += for each key j in [j_begin, j_end): sum_r coef[r][j] * x[r];
// coef: (QBLOCK, ld_c); x: (QBLOCK, ld) rows zero-padded to ld, a multiple of LANES.
static void tile_accumulate_keys(float *dst, int ld, const float *coef, int ld_c, const float *x,
                                 int j_begin, int j_end) {
    for (int d = 0; d < ld; d += LANES) {
        float xr[QBLOCK][LANES]; // the tile's rows, this slice: held in registers over all keys
        for (int r = 0; r < QBLOCK; r++)
            memcpy(xr[r], x + (size_t)r * ld + d, sizeof xr[r]);
        for (int j = j_begin; j < j_end; j++) {
            float *out = dst + (size_t)j * ld + d;
            for (int r = 0; r < QBLOCK; r++) {
                float c = coef[(size_t)r * ld_c + j];
#pragma omp simd
                for (int dd = 0; dd < LANES; dd++)
                    out[dd] += c * xr[r][dd];
            }
        }
    }
}

// w's parts, carved from this thread's scratch.
static void bwd_scratch_carve(BwdScratch *w, int T, int D) {
    w->Tp = round_up(T, LANES);
    w->Dp = round_up(D, LANES);
    float **parts[BWD_PARTS] = {&w->kt, &w->vt, &w->kp, &w->dkp, &w->dvp,
                                &w->p,  &w->ds, &w->xq, &w->xdo, &w->dqt};
    size_t sizes[BWD_PARTS];
    bwd_parts(T, D, sizes);
    float *at = thread_scratch();
    for (int i = 0; i < BWD_PARTS; i++) {
        *parts[i] = at;
        at += sizes[i];
    }
}

// One backward task: batch row b, kv head kvh, and the tensors' geometry.
typedef struct {
    int b, kvh, T, H, KVH, D, stride;
    const int32_t *doc_start;
} BwdTask;

// Tile row r of query row i (r < rows) -> p = exp(scale*s - lse), ds = p * (dp - delta) *
// scale over its keys [j0, i]; 0 over the rest of [j_begin, j_end) and on padding rows.
static void tile_row_grads(float *p, float *ds, int j_begin, int j_end, int j0, int j1,
                           float row_lse, float delta, float scale) {
    for (int j = j_begin; j < j0; j++)
        p[j] = ds[j] = 0.0f;
#pragma omp simd
    for (int j = j0; j < j1; j++) {
        p[j] = cpu_expf(scale * p[j] - row_lse);
        ds[j] = p[j] * (ds[j] - delta) * scale;
    }
    for (int j = j1 > j0 ? j1 : j0; j < j_end; j++)
        p[j] = ds[j] = 0.0f;
}

// Query rows [i0, i0+rows) of head h: their dq, and their part of dk, dv (accumulated).
static void attention_bwd_tile(float *dq, const float *dout, const float *out, const float *lse,
                               const float *q, const BwdTask *t, int h, int i0, int rows,
                               const BwdScratch *w) {
    int T = t->T, D = t->D, H = t->H;
    float scale = 1.0f / sqrtf((float)D);
    const float *xq[QBLOCK], *xdo[QBLOCK];
    for (int r = 0; r < QBLOCK; r++) {
        size_t row = (size_t)t->b * T + i0 + (r < rows ? r : rows - 1);
        xq[r] = q + row * t->stride + (size_t)h * D;
        xdo[r] = dout + (row * H + h) * D;
        float *pq = w->xq + (size_t)r * w->Dp, *pdo = w->xdo + (size_t)r * w->Dp;
        memset(pq, 0, (size_t)w->Dp * sizeof *pq);
        memset(pdo, 0, (size_t)w->Dp * sizeof *pdo);
        if (r < rows) {
            memcpy(pq, xq[r], (size_t)D * sizeof *pq);
            memcpy(pdo, xdo[r], (size_t)D * sizeof *pdo);
        }
    }
    // keys any row of the tile sees (first keys never decrease along a sequence)
    int j_begin = first_key(t->doc_start, t->b, T, i0), j_end = i0 + rows;
    tile_scores(w->p, w->Tp, xq, w->kt, D, j_begin, j_end);   // s = q.k
    tile_scores(w->ds, w->Tp, xdo, w->vt, D, j_begin, j_end); // dp = dout.v
    for (int r = 0; r < QBLOCK; r++) {
        int i = i0 + r, real = r < rows;
        size_t row = (size_t)t->b * T + i;
        float row_lse = real ? lse[((size_t)t->b * H + h) * T + i] : 0.0f,
              delta = real ? dot(xdo[r], out + (row * H + h) * D, D) : 0.0f; // sum_j p_j dp_j
        tile_row_grads(w->p + (size_t)r * w->Tp, w->ds + (size_t)r * w->Tp, j_begin, j_end,
                       real ? first_key(t->doc_start, t->b, T, i) : j_end, real ? i + 1 : j_end,
                       row_lse, delta, scale);
    }
    tile_weighted_values(w->dqt, w->Dp, w->ds, w->Tp, w->kp, j_begin, j_end); // dq = ds @ k
    for (int r = 0; r < rows; r++)
        memcpy(dq + ((size_t)t->b * T + i0 + r) * t->stride + (size_t)h * D,
               w->dqt + (size_t)r * w->Dp, (size_t)D * sizeof *dq);
    tile_accumulate_keys(w->dkp, w->Dp, w->ds, w->Tp, w->xq, j_begin, j_end); // dk += ds^T q
    tile_accumulate_keys(w->dvp, w->Dp, w->p, w->Tp, w->xdo, j_begin, j_end); // dv += p^T dout
}

// Gradients of the query heads sharing kv head t->kvh of batch row t->b; the only writer
// of dk/dv of that kv head, so tasks (b, kvh) run in parallel without races, and the sum
// order does not depend on the thread count.
static void attention_bwd_kv_head(float *dq, float *dk, float *dv, const float *dout,
                                  const float *out, const float *lse, const float *q,
                                  const float *k, const float *v, const BwdTask *t,
                                  const BwdScratch *w) {
    int T = t->T, D = t->D, group = t->H / t->KVH;
    size_t kv_at = (size_t)t->b * T * t->stride + (size_t)t->kvh * D;
    transpose_rows(w->kt, w->Tp, k + kv_at, T, D, t->stride);
    transpose_rows(w->vt, w->Tp, v + kv_at, T, D, t->stride);
    copy_rows_padded(w->kp, w->Dp, k + kv_at, T, D, t->stride);
    memset(w->dkp, 0, (size_t)T * w->Dp * sizeof *w->dkp);
    memset(w->dvp, 0, (size_t)T * w->Dp * sizeof *w->dvp);
    for (int h = t->kvh * group; h < (t->kvh + 1) * group; h++)
        for (int i0 = 0; i0 < T; i0 += QBLOCK)
            attention_bwd_tile(dq, dout, out, lse, q, t, h, i0, T - i0 < QBLOCK ? T - i0 : QBLOCK,
                               w);
    for (int j = 0; j < T; j++) {
        memcpy(dk + kv_at + (size_t)j * t->stride, w->dkp + (size_t)j * w->Dp,
               (size_t)D * sizeof *dk);
        memcpy(dv + kv_at + (size_t)j * t->stride, w->dvp + (size_t)j * w->Dp,
               (size_t)D * sizeof *dv);
    }
}

void cpu_attention_bwd(void *dq_, void *dk_, void *dv_, const void *dout_, const void *out_,
                       const float *lse, const void *q_, const void *k_, const void *v_,
                       const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                       int qkv_stride) {
    float *dq = dq_;
    float *dk = dk_;
    float *dv = dv_;
    const float *dout = dout_;
    const float *out = out_;
    const float *q = q_;
    const float *k = k_;
    const float *v = v_;
    if (!scratch_fits("attention_bwd", T, D)) return;
#pragma omp parallel num_threads(scratch.threads ? scratch.threads : 1)
    {
        BwdScratch w;
        bwd_scratch_carve(&w, T, D);
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int kvh = 0; kvh < KVH; kvh++) {
                BwdTask t = {.b = b,
                             .kvh = kvh,
                             .T = T,
                             .H = H,
                             .KVH = KVH,
                             .D = D,
                             .stride = qkv_stride,
                             .doc_start = doc_start};
                attention_bwd_kv_head(dq, dk, dv, dout, out, lse, q, k, v, &t, &w);
            }
    }
}
