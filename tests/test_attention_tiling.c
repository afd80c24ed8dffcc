// test_attention_tiling.c: replays, on the CPU in fp32, the tiling schedule of the CUDA
// attention kernels (engine/cuda/attention.cu) and checks it against a naive O(T^2)
// attention (double) on random inputs with packed documents, sliding windows, GQA and a fused
// qkv layout.
//
// No GPU is needed: what is checked is the schedule, the part of the kernels that the
// tensor-core fragment layouts do not touch: the tile sizes, the key-tile range of a query
// tile (doc_start skipping), the query tiles a key tile visits, the per-element mask, the
// online-softmax update order (running max, rescale, per-lane partial sums), the dk/dv-by-key
// -tile and dq-by-query-tile split with the heads of a GQA group, the delta pre-pass, the
// batch chunking of the backward and the overwrite of every dq, dk, dv element. Each emu_*
// function below mirrors the kernel of the same name (a "block" is one call of the body);
// both configurations are replayed: SIMT (natural exp) and tensor cores (exp2 units).
//
// Exits non-zero when a max error exceeds 1e-4 or an output element was not written.
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
static const double kTol = 1e-4;

// ---------------------------------------------------------------- problem

typedef struct {
    int B, T, H, KVH, D, stride; // stride = (H + 2 KVH) D: the fused qkv row
    float *qkv;                  // (B*T, stride): [q | k | v]
    float *dout;                 // (B*T, H, D)
    int32_t *doc_start;          // (B, T)
    int window;                  // the sliding window folded into doc_start (0: none)
} Problem;

typedef struct {
    float *out, *lse; // (B*T, H*D), (B, H, T)
    float *dqkv;      // (B*T, stride): [dq | dk | dv]
    long tiles_run;   // key tiles walked by query tiles + query tiles walked by key tiles
    long tiles_all;   // the same without any doc_start skipping (causal bound only)
} Result;

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float frand(void) { // uniform in [-1, 1)
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}
static int irand(int n) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (int)((rng_state >> 33) % (uint64_t)n);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

// Batch row 0: documents of random lengths 1..max_doc; the others: one causal document. A
// sliding window (> 0) hides keys j <= i - window from query i as well (the model folds it into
// doc_start the same way).
static Problem problem_make(int B, int T, int H, int KVH, int D, int max_doc, int window) {
    Problem p = {B, T, H, KVH, D, (H + 2 * KVH) * D, NULL, NULL, NULL, window};
    size_t N = (size_t)B * T;
    p.qkv = xmalloc(N * p.stride * sizeof(float));
    p.dout = xmalloc(N * H * D * sizeof(float));
    p.doc_start = xmalloc(N * sizeof(int32_t));
    for (size_t i = 0; i < N * p.stride; i++)
        p.qkv[i] = frand();
    for (size_t i = 0; i < N * H * D; i++)
        p.dout[i] = frand();
    for (int b = 0; b < B; b++) {
        int start = 0, left = 0;
        for (int t = 0; t < T; t++) {
            if (b == 0 && left == 0) {
                start = t;
                left = 1 + irand(max_doc);
            }
            if (b == 0) left--;
            int window_start = window ? t - window + 1 : 0;
            p.doc_start[(size_t)b * T + t] = start > window_start ? start : window_start;
        }
    }
    return p;
}

static const float *q_row(const Problem *p, int b, int t, int h) {
    return p->qkv + ((size_t)b * p->T + t) * p->stride + (size_t)h * p->D;
}
static const float *k_row(const Problem *p, int b, int t, int kvh) {
    return p->qkv + ((size_t)b * p->T + t) * p->stride + (size_t)(p->H + kvh) * p->D;
}
static const float *v_row(const Problem *p, int b, int t, int kvh) {
    return p->qkv + ((size_t)b * p->T + t) * p->stride + (size_t)(p->H + p->KVH + kvh) * p->D;
}
static const float *dout_row(const Problem *p, int b, int t, int h) {
    return p->dout + (((size_t)b * p->T + t) * p->H + h) * p->D;
}

// ---------------------------------------------------------------- naive reference (double)

typedef struct {
    double *out, *lse, *dqkv;
} Reference;

static Reference reference(const Problem *p) {
    int B = p->B, T = p->T, H = p->H, D = p->D, group = p->H / p->KVH;
    size_t N = (size_t)B * T;
    Reference r = {xmalloc(N * H * D * sizeof(double)), xmalloc(N * H * sizeof(double)),
                   calloc(N * p->stride, sizeof(double))};
    double scale = 1.0 / sqrt((double)D), *pr = xmalloc((size_t)T * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < T; i++) {
                int kvh = h / group, j0 = p->doc_start[(size_t)b * T + i];
                const float *qi = q_row(p, b, i, h), *doi = dout_row(p, b, i, h);
                double mx = -INFINITY, sum = 0.0;
                for (int j = j0; j <= i; j++) {
                    double s = 0.0;
                    for (int d = 0; d < D; d++)
                        s += (double)qi[d] * k_row(p, b, j, kvh)[d];
                    pr[j] = s * scale;
                    mx = pr[j] > mx ? pr[j] : mx;
                }
                for (int j = j0; j <= i; j++)
                    sum += exp(pr[j] - mx);
                double *o = r.out + (((size_t)b * T + i) * H + h) * D;
                for (int d = 0; d < D; d++)
                    o[d] = 0.0;
                for (int j = j0; j <= i; j++) {
                    pr[j] = exp(pr[j] - mx) / sum;
                    for (int d = 0; d < D; d++)
                        o[d] += pr[j] * v_row(p, b, j, kvh)[d];
                }
                r.lse[((size_t)b * H + h) * T + i] = mx + log(sum);
                // backward of this row: dp_j = dout.v_j, delta = sum_j p_j dp_j
                double delta = 0.0;
                for (int d = 0; d < D; d++)
                    delta += (double)doi[d] * o[d];
                double *dq = r.dqkv + ((size_t)b * T + i) * p->stride + (size_t)h * D;
                for (int j = j0; j <= i; j++) {
                    double dp = 0.0;
                    for (int d = 0; d < D; d++)
                        dp += (double)doi[d] * v_row(p, b, j, kvh)[d];
                    double dsv = pr[j] * (dp - delta) * scale;
                    double *row = r.dqkv + ((size_t)b * T + j) * p->stride;
                    double *dk = row + (size_t)(H + kvh) * D,
                           *dv = row + (size_t)(H + p->KVH + kvh) * D;
                    for (int d = 0; d < D; d++) {
                        dq[d] += dsv * k_row(p, b, j, kvh)[d];
                        dk[d] += dsv * qi[d];
                        dv[d] += pr[j] * doi[d];
                    }
                }
            }
    free(pr);
    return r;
}

// ---------------------------------------------------------------- the kernels' schedule

// Tile sizes and exp units of one implementation (attention.cu: kSimt*, kFwd*, kKv*).
typedef struct {
    const char *name;
    int fwd_bq, fwd_bk; // attn_fwd_*: query tile, key tile
    int dq_bq, dq_bk;   // attn_bwd_dq_*
    int kv_bk, kv_bq;   // attn_bwd_dkdv_*: key tile, query tile
    int mma;            // 1: exp2 units, per-lane partial row sums (4 lanes per row, 8-column
                        // n-tiles, lane t owns columns 2t, 2t+1 of each); 0: natural exp,
                        // warp butterfly sum over 32 lanes, lane c holding column c
} Config;

static const Config kSimt = {"simt", 32, 16, 32, 16, 16, 32, 0};
static const Config kMma = {"mma", 64, 64, 64, 64, 64, 32, 1};

// key_tiles: [x, y) of the key tiles query rows [i0, min(i0+BQ,T)) see.
static void emu_key_tiles(const int32_t *ds, int i0, int T, int BQ, int BK, int *x, int *y) {
    int lo = INT_MAX;
    for (int r = 0; r < BQ; r++)
        if (i0 + r < T && ds[i0 + r] < lo) lo = ds[i0 + r];
    lo = lo < 0 ? 0 : lo;
    int last = (i0 + BQ < T ? i0 + BQ : T) - 1;
    *x = lo / BK;
    *y = last / BK + 1;
}

// The key tiles a query tile walks, counted in res against all its causal bound allows.
static void walk_key_tiles(const int32_t *ds, int i0, int T, int BQ, int BK, Result *res, int *x,
                           int *y) {
    emu_key_tiles(ds, i0, T, BQ, BK, x, y);
    res->tiles_run += *y - *x;
    res->tiles_all += ((i0 + BQ < T ? i0 + BQ : T) - 1) / BK + 1;
}

// q_tile_sees: some row i of [i0, i0+BQ) with i >= j0, ds[i] < j_end, ds[i] <= i.
static int emu_q_tile_sees(const int32_t *ds, int i0, int T, int BQ, int j0, int j_end) {
    int sees = 0;
    for (int r = 0; r < BQ; r++) {
        int i = i0 + r;
        sees |= i < T && i >= j0 && ds[i] < j_end && ds[i] <= i;
    }
    return sees;
}

static int emu_next_q_tile(const int32_t *ds, int qt, int nqt, int T, int BQ, int j0, int j_end) {
    while (qt < nqt && !emu_q_tile_sees(ds, qt * BQ, T, BQ, j0, j_end))
        qt++;
    return qt;
}

static float warp_sum_butterfly(float v[32]) { // warp_reduce: xor 16, 8, 4, 2, 1; lane 0
    float w[32];
    for (int o = 16; o > 0; o >>= 1) {
        for (int a = 0; a < 32; a++)
            w[a] = v[a] + v[a ^ o];
        memcpy(v, w, sizeof w);
    }
    return v[0];
}

static float dotf(const float *a, const float *b, int D) {
    float s = 0.0f;
    for (int d = 0; d < D; d++)
        s = fmaf(a[d], b[d], s);
    return s;
}

// attn_fwd_simt / attn_fwd_mma: one call per block (query tile bx of head h, batch row b).
static void emu_fwd_block(const Config *c, const Problem *p, Result *res, int bx, int h, int b) {
    const int BQ = c->fwd_bq, BK = c->fwd_bk, T = p->T, H = p->H, D = p->D;
    const int nqt = (T + BQ - 1) / BQ, i0 = (nqt - 1 - bx) * BQ, kvh = h / (H / p->KVH);
    const float scale = 1.0f / sqrtf((float)D), c2 = scale * kLog2e;
    const int32_t *ds = p->doc_start + (size_t)b * T;
    float *o = calloc((size_t)BQ * D, sizeof(float)), *m = xmalloc(BQ * sizeof(float));
    float *l = calloc((size_t)BQ * 4, sizeof(float)); // mma: 4 lane partials; simt: [0]
    float *s = xmalloc((size_t)BQ * BK * sizeof(float));
    int *row_ds = xmalloc(BQ * sizeof(int));
    for (int r = 0; r < BQ; r++) {
        m[r] = -INFINITY;
        row_ds[r] = i0 + r < T ? ds[i0 + r] : INT_MAX;
    }
    int kx, ky;
    walk_key_tiles(ds, i0, T, BQ, BK, res, &kx, &ky);
    for (int kt = kx; kt < ky; kt++) {
        const int j0 = kt * BK;
        for (int r = 0; r < BQ; r++)
            for (int cc = 0; cc < BK; cc++) {
                int i = i0 + r, j = j0 + cc;
                int vis = row_ds[r] <= j && j <= i; // j <= i < T: a real key
                float dot = vis ? dotf(q_row(p, b, i, h), k_row(p, b, j, kvh), D) : 0.0f;
                s[r * BK + cc] = vis ? dot * (c->mma ? c2 : scale) : -INFINITY;
            }
        for (int r = 0; r < BQ; r++) {
            float *sr = s + r * BK, mx = -INFINITY;
            for (int cc = 0; cc < BK; cc++)
                mx = fmaxf(mx, sr[cc]);
            float m_new = fmaxf(m[r], mx), base = m_new == -INFINITY ? 0.0f : m_new;
            float alpha = c->mma ? exp2f(m[r] - base) : expf(m[r] - base);
            m[r] = m_new;
            if (c->mma) {
                for (int t = 0; t < 4; t++)
                    l[r * 4 + t] *= alpha;
                for (int nt = 0; nt < BK / 8; nt++) // lane t: columns 8nt + 2t + {0, 1}
                    for (int t = 0; t < 4; t++)
                        for (int e = 0; e < 2; e++) {
                            float *x = sr + nt * 8 + 2 * t + e;
                            *x = exp2f(*x - base);
                            l[r * 4 + t] += *x;
                        }
            } else {
                float lanes[32];
                for (int lane = 0; lane < 32; lane++)
                    lanes[lane] = lane < BK ? expf(sr[lane] - base) : 0.0f;
                for (int cc = 0; cc < BK; cc++)
                    sr[cc] = lanes[cc];
                l[r * 4] = l[r * 4] * alpha + warp_sum_butterfly(lanes);
            }
            for (int d = 0; d < D; d++) { // O = O * alpha + P V, keys in order
                float acc = o[r * D + d] * alpha;
                for (int cc = 0; cc < BK; cc++) {
                    int j = j0 + cc;
                    float vv = j < T ? v_row(p, b, j, kvh)[d] : 0.0f; // zero-filled rows
                    acc = fmaf(sr[cc], vv, acc);
                }
                o[r * D + d] = acc;
            }
        }
    }
    for (int r = 0; r < BQ; r++) {
        int i = i0 + r;
        if (i >= T) continue;
        float lr = c->mma ? (l[r * 4] + l[r * 4 + 1]) + (l[r * 4 + 2] + l[r * 4 + 3]) : l[r * 4];
        float *dst = res->out + (((size_t)b * T + i) * H + h) * D;
        for (int d = 0; d < D; d++)
            dst[d] = c->mma ? o[r * D + d] * (lr > 0.0f ? 1.0f / lr : 0.0f)
                            : (lr > 0.0f ? o[r * D + d] / lr : 0.0f);
        res->lse[((size_t)b * H + h) * T + i] =
            c->mma ? (m[r] + log2f(lr)) * kLn2 : m[r] + logf(lr);
    }
    free(o);
    free(m);
    free(l);
    free(s);
    free(row_ds);
}

// attn_delta over batch rows [b0, b0+nb): delta (nb, H, T).
static void emu_delta(float *delta, const Problem *p, const float *out, int b0, int nb) {
    for (int b = 0; b < nb; b++)
        for (int t = 0; t < p->T; t++)
            for (int h = 0; h < p->H; h++) {
                const float *a = dout_row(p, b0 + b, t, h);
                const float *o = out + (((size_t)(b0 + b) * p->T + t) * p->H + h) * p->D;
                float lanes[32] = {0};
                for (int d = 0; d < p->D; d++)
                    lanes[d % 32] = fmaf(a[d], o[d], lanes[d % 32]);
                delta[((size_t)b * p->H + h) * p->T + t] = warp_sum_butterfly(lanes);
            }
}

// p and ds of query row i (head h) and key j, as every backward kernel computes them.
static void grad_entry(const Config *c, const Problem *p, int b, int h, int i, int j, int vis,
                       float lse, float delta, float *p_out, float *ds_out) {
    const int D = p->D, kvh = h / (p->H / p->KVH);
    const float scale = 1.0f / sqrtf((float)D), c2 = scale * kLog2e;
    float pv = 0.0f, dsv = 0.0f;
    if (vis) {
        float s = dotf(q_row(p, b, i, h), k_row(p, b, j, kvh), D);
        pv = c->mma ? exp2f(s * c2 - lse * kLog2e) : expf(s * scale - lse);
        float dp = dotf(dout_row(p, b, i, h), v_row(p, b, j, kvh), D);
        dsv = pv * (dp - delta) * scale;
    }
    *p_out = pv;
    *ds_out = dsv;
}

// attn_bwd_dkdv_*: one call per block (key tile bx, kv head kvh, batch row b of the chunk
// starting at b0); delta: the chunk's (nb, H, T).
static void emu_dkdv_block(const Config *c, const Problem *p, Result *res, const float *delta,
                           int b0, int bx, int kvh, int bl) {
    const int BK = c->kv_bk, BQ = c->kv_bq, T = p->T, H = p->H, D = p->D, b = b0 + bl;
    const int j0 = bx * BK, j_end = j0 + BK < T ? j0 + BK : T, group = H / p->KVH;
    const int h_first = kvh * group, nqt = (T + BQ - 1) / BQ;
    const int32_t *ds = p->doc_start + (size_t)b * T;
    float *dk = calloc((size_t)BK * D, sizeof(float)), *dv = calloc((size_t)BK * D, sizeof(float));
    float *pt = xmalloc((size_t)BQ * BK * sizeof(float)),
          *st = xmalloc((size_t)BQ * BK * sizeof(float));
    int qt = emu_next_q_tile(ds, j0 / BQ, nqt, T, BQ, j0, j_end), h = h_first;
    for (int t = j0 / BQ; t < nqt; t++)
        res->tiles_all++;
    while (qt < nqt) { // the kernel's item loop: query tiles outer, heads of the group inner
        int next_h = h + 1, next_qt = qt;
        if (next_h == h_first + group) {
            next_h = h_first;
            next_qt = emu_next_q_tile(ds, qt + 1, nqt, T, BQ, j0, j_end);
            res->tiles_run++;
        }
        const int i0 = qt * BQ;
        for (int r = 0; r < BQ; r++) // r: query column, cc: key row
            for (int cc = 0; cc < BK; cc++) {
                int i = i0 + r, j = j0 + cc;
                int vis = i < T && ds[i] <= j && j <= i;
                float lse = i < T ? res->lse[((size_t)b * H + h) * T + i] : 0.0f;
                float dl = i < T ? delta[((size_t)bl * H + h) * T + i] : 0.0f;
                grad_entry(c, p, b, h, i, j, vis, lse, dl, pt + r * BK + cc, st + r * BK + cc);
            }
        for (int cc = 0; cc < BK; cc++) // dV += P^T dO, dK += dS^T Q; query rows in order
            for (int d = 0; d < D; d++)
                for (int r = 0; r < BQ; r++) {
                    int i = i0 + r;
                    float qv = i < T ? q_row(p, b, i, h)[d] : 0.0f;
                    float ov = i < T ? dout_row(p, b, i, h)[d] : 0.0f;
                    dv[cc * D + d] = fmaf(pt[r * BK + cc], ov, dv[cc * D + d]);
                    dk[cc * D + d] = fmaf(st[r * BK + cc], qv, dk[cc * D + d]);
                }
        qt = next_qt;
        h = next_h;
    }
    for (int cc = 0; cc < BK; cc++) {
        int j = j0 + cc;
        if (j >= T) continue;
        float *row = res->dqkv + ((size_t)b * T + j) * p->stride;
        memcpy(row + (size_t)(H + kvh) * D, dk + cc * D, D * sizeof(float));
        memcpy(row + (size_t)(H + p->KVH + kvh) * D, dv + cc * D, D * sizeof(float));
    }
    free(dk);
    free(dv);
    free(pt);
    free(st);
}

// attn_bwd_dq_*: one call per block (query tile bx, head h, batch row bl of the chunk).
static void emu_dq_block(const Config *c, const Problem *p, Result *res, const float *delta, int b0,
                         int bx, int h, int bl) {
    const int BQ = c->dq_bq, BK = c->dq_bk, T = p->T, H = p->H, D = p->D, b = b0 + bl;
    const int nqt = (T + BQ - 1) / BQ, i0 = (nqt - 1 - bx) * BQ, kvh = h / (H / p->KVH);
    const int32_t *ds = p->doc_start + (size_t)b * T;
    float *dq = calloc((size_t)BQ * D, sizeof(float)),
          *dst = xmalloc((size_t)BQ * BK * sizeof(float));
    int kx, ky;
    walk_key_tiles(ds, i0, T, BQ, BK, res, &kx, &ky);
    for (int kt = kx; kt < ky; kt++) {
        const int j0 = kt * BK;
        for (int r = 0; r < BQ; r++)
            for (int cc = 0; cc < BK; cc++) {
                int i = i0 + r, j = j0 + cc;
                int vis = i < T && ds[i] <= j && j <= i;
                float lse = i < T ? res->lse[((size_t)b * H + h) * T + i] : 0.0f;
                float dl = i < T ? delta[((size_t)bl * H + h) * T + i] : 0.0f;
                float unused;
                grad_entry(c, p, b, h, i, j, vis, lse, dl, &unused, dst + r * BK + cc);
            }
        for (int r = 0; r < BQ; r++) // dQ += dS K, keys in order
            for (int d = 0; d < D; d++)
                for (int cc = 0; cc < BK; cc++) {
                    int j = j0 + cc;
                    float kv = j < T ? k_row(p, b, j, kvh)[d] : 0.0f;
                    dq[r * D + d] = fmaf(dst[r * BK + cc], kv, dq[r * D + d]);
                }
    }
    for (int r = 0; r < BQ; r++)
        if (i0 + r < T)
            memcpy(res->dqkv + ((size_t)b * T + i0 + r) * p->stride + (size_t)h * D, dq + r * D,
                   D * sizeof(float));
    free(dq);
    free(dst);
}

// attention_fwd + attention_bwd (host side): grids, and the backward's batch chunks when
// delta (H*T floats per batch row) exceeds the scratch (scratch_floats here, small on
// purpose so that chunking runs).
static Result emu_attention(const Config *c, const Problem *p, size_t scratch_floats) {
    size_t N = (size_t)p->B * p->T;
    Result res = {xmalloc(N * p->H * p->D * sizeof(float)), xmalloc(N * p->H * sizeof(float)),
                  xmalloc(N * p->stride * sizeof(float)), 0, 0};
    for (size_t i = 0; i < N * p->H * p->D; i++)
        res.out[i] = NAN;
    for (size_t i = 0; i < N * p->stride; i++)
        res.dqkv[i] = NAN; // every dq, dk, dv element must be overwritten
    for (int b = 0; b < p->B; b++)
        for (int h = 0; h < p->H; h++)
            for (int bx = 0; bx < (p->T + c->fwd_bq - 1) / c->fwd_bq; bx++)
                emu_fwd_block(c, p, &res, bx, h, b);

    size_t row_floats = (size_t)p->H * p->T;
    int chunk = (int)(scratch_floats / row_floats < (size_t)p->B ? scratch_floats / row_floats
                                                                 : (size_t)p->B);
    float *delta = xmalloc((size_t)chunk * row_floats * sizeof(float));
    for (int b0 = 0; b0 < p->B; b0 += chunk) {
        int nb = p->B - b0 < chunk ? p->B - b0 : chunk;
        emu_delta(delta, p, res.out, b0, nb);
        for (int bl = 0; bl < nb; bl++)
            for (int kvh = 0; kvh < p->KVH; kvh++)
                for (int bx = 0; bx < (p->T + c->kv_bk - 1) / c->kv_bk; bx++)
                    emu_dkdv_block(c, p, &res, delta, b0, bx, kvh, bl);
        for (int bl = 0; bl < nb; bl++)
            for (int h = 0; h < p->H; h++)
                for (int bx = 0; bx < (p->T + c->dq_bq - 1) / c->dq_bq; bx++)
                    emu_dq_block(c, p, &res, delta, b0, bx, h, bl);
    }
    free(delta);
    return res;
}

// ---------------------------------------------------------------- comparison

static double max_err(const float *got, const double *want, size_t n, size_t *unwritten) {
    double e = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(got[i])) {
            (*unwritten)++;
            continue;
        }
        double d = fabs((double)got[i] - want[i]);
        e = d > e ? d : e;
    }
    return e;
}

static int run_case(const Config *c, const Problem *p, const Reference *ref) {
    size_t N = (size_t)p->B * p->T, unwritten = 0;
    Result r = emu_attention(c, p, (size_t)p->H * p->T); // one batch row per chunk
    double e_out = max_err(r.out, ref->out, N * p->H * p->D, &unwritten);
    double e_lse = max_err(r.lse, ref->lse, N * p->H, &unwritten);
    double e_g[3] = {0, 0, 0}; // dq, dk, dv
    for (size_t n = 0; n < N; n++) {
        const float *g = r.dqkv + n * p->stride;
        const double *w = ref->dqkv + n * p->stride;
        size_t at[4] = {0, (size_t)p->H * p->D, (size_t)(p->H + p->KVH) * p->D, (size_t)p->stride};
        for (int x = 0; x < 3; x++) {
            double e = max_err(g + at[x], w + at[x], at[x + 1] - at[x], &unwritten);
            e_g[x] = e > e_g[x] ? e : e_g[x];
        }
    }
    int ok = e_out <= kTol && e_lse <= kTol && e_g[0] <= kTol && e_g[1] <= kTol && e_g[2] <= kTol &&
             unwritten == 0;
    printf("%-4s B=%d T=%d H=%d KVH=%d D=%d window=%d: max err out %.2e lse %.2e dq %.2e dk %.2e "
           "dv %.2e; "
           "unwritten %zu; tiles walked %ld of %ld  %s\n",
           c->name, p->B, p->T, p->H, p->KVH, p->D, p->window, e_out, e_lse, e_g[0], e_g[1], e_g[2],
           unwritten, r.tiles_run, r.tiles_all, ok ? "ok" : "FAIL");
    free(r.out);
    free(r.lse);
    free(r.dqkv);
    return ok;
}

int main(void) {
    struct {
        int B, T, H, KVH, D, max_doc, window;
    } cases[] = {
        {2, 100, 4, 2, 64, 30, 0},  {2, 100, 4, 2, 128, 30, 0},  {2, 300, 4, 1, 64, 40, 0},
        {3, 77, 2, 2, 128, 200, 0}, {2, 130, 6, 3, 64, 7, 0},    {1, 64, 2, 1, 64, 64, 0},
        {2, 45, 2, 1, 40, 10, 0},   {2, 300, 4, 2, 64, 120, 17}, {2, 200, 2, 1, 128, 500, 90},
        {1, 70, 2, 2, 64, 70, 1},
    };
    int ok = 1;
    for (size_t n = 0; n < sizeof cases / sizeof cases[0]; n++) {
        Problem p = problem_make(cases[n].B, cases[n].T, cases[n].H, cases[n].KVH, cases[n].D,
                                 cases[n].max_doc, cases[n].window);
        Reference ref = reference(&p);
        ok &= run_case(&kSimt, &p, &ref);
        if (p.D == 64 || p.D == 128) ok &= run_case(&kMma, &p, &ref); // the mma kernels' D
        free(ref.out);
        free(ref.lse);
        free(ref.dqkv);
        free(p.qkv);
        free(p.dout);
        free(p.doc_start);
    }
    printf(ok ? "all ok\n" : "FAILED\n");
    return ok ? 0 : 1;
}
