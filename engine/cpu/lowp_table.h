// lowp_table.h: the ops of one reduced compute dtype, included by lowp.c once per dtype with
// LOWP_DT (DT_BF16 or DT_F16) and LOWP_FN(op) (the dtype's name for op) defined; it defines
// LOWP_FN(fill), which puts them in a Backend table. Each op stages its compute-dtype tensors
// in fp32 (lowp.h), runs the fp32 kernel (cpu_kernels.h) and rounds its outputs back; fp32
// tensors (`float *`) pass through; a stage that failed skips the kernel (engine/backend.h's
// rule). Shapes: engine/backend.h.
//
// No include guard: the second inclusion makes the other dtype's functions.

static void LOWP_FN(cast_from_f32)(void *dst, const float *src, size_t n) {
    lowp_from_f32(LOWP_DT, dst, src, n);
}

static void LOWP_FN(download_f32)(float *host, const void *src, size_t n) {
    lowp_to_f32(LOWP_DT, host, src, n);
}

static void LOWP_FN(matmul_fwd)(void *out, const void *inp, const void *weight, int N, int C,
                                int OC, int accumulate) {
    cpu_lowp_matmul_fwd(LOWP_DT, out, inp, weight, N, C, OC, accumulate);
}

static void LOWP_FN(matmul_bwd)(void *dinp, float *dweight, const void *dout, const void *inp,
                                const void *weight, int N, int C, int OC, int accumulate_dinp) {
    cpu_lowp_matmul_bwd(LOWP_DT, dinp, dweight, dout, inp, weight, N, C, OC, accumulate_dinp);
}

// A copy of table rows: no arithmetic to stage (and the table's row count is not passed).
static void LOWP_FN(embedding_fwd)(void *out, const int32_t *ids, const void *table, int N, int C) {
    cpu_embedding_gather(out, ids, table, N, (size_t)C * dtype_size(LOWP_DT));
}

static void LOWP_FN(embedding_bwd)(float *dtable, const void *dout, const int32_t *ids,
                                   const int32_t *by_id, int N, int C) {
    LowpStage s = LOWP_STAGE;
    const float *d = lowp_in(&s, dout, lowp_flat((size_t)N * C));
    if (!s.failed) cpu_embedding_bwd(dtable, d, ids, by_id, N, C);
}

static void LOWP_FN(rmsnorm_fwd)(void *out, float *rstd, const void *inp, const void *weight, int N,
                                 int G, int C, int stride, float eps) {
    LowpStage s = LOWP_STAGE;
    LowpView x = lowp_rows(N, G * C, stride);
    float *o = lowp_out(&s, out, x, 0);
    const float *in = lowp_in(&s, inp, x), *w = lowp_in(&s, weight, lowp_flat((size_t)C));
    if (!s.failed) cpu_rmsnorm_fwd(o, rstd, in, w, N, G, C, stride, eps);
    lowp_store(&s, out, o, x);
}

static void LOWP_FN(rmsnorm_bwd)(void *dinp, float *dweight, const void *dout, const void *inp,
                                 const void *weight, const float *rstd, int N, int G, int C,
                                 int stride, int accumulate_dinp) {
    LowpStage s = LOWP_STAGE;
    LowpView x = lowp_rows(N, G * C, stride);
    float *dx = lowp_out(&s, dinp, x, accumulate_dinp);
    const float *d = lowp_in(&s, dout, x), *in = lowp_in(&s, inp, x),
                *w = lowp_in(&s, weight, lowp_flat((size_t)C));
    if (!s.failed) cpu_rmsnorm_bwd(dx, dweight, d, in, w, rstd, N, G, C, stride, accumulate_dinp);
    lowp_store(&s, dinp, dx, x);
}

// In place: x is read and rewritten.
static void LOWP_FN(rope_fwd)(void *x, const int32_t *pos, const float *cos_sin, int N, int G,
                              int D, int stride) {
    LowpStage s = LOWP_STAGE;
    LowpView v = lowp_rows(N, G * D, stride);
    float *t = lowp_out(&s, x, v, 1);
    if (!s.failed) cpu_rope_fwd(t, pos, cos_sin, N, G, D, stride);
    lowp_store(&s, x, t, v);
}

static void LOWP_FN(rope_bwd)(void *dx, const int32_t *pos, const float *cos_sin, int N, int G,
                              int D, int stride) {
    LowpStage s = LOWP_STAGE;
    LowpView v = lowp_rows(N, G * D, stride);
    float *t = lowp_out(&s, dx, v, 1);
    if (!s.failed) cpu_rope_bwd(t, pos, cos_sin, N, G, D, stride);
    lowp_store(&s, dx, t, v);
}

// q: (B*T rows of H*D), k, v: (B*T rows of KVH*D), qkv_stride apart; out: (B*T*H*D).
static void LOWP_FN(attention_fwd)(void *out, float *lse, const void *q, const void *k,
                                   const void *v, const int32_t *doc_start, int B, int T, int H,
                                   int KVH, int D, int qkv_stride) {
    LowpStage s = LOWP_STAGE;
    LowpView vq = lowp_rows(B * T, H * D, qkv_stride), vkv = lowp_rows(B * T, KVH * D, qkv_stride),
             vo = lowp_flat((size_t)B * T * H * D);
    float *o = lowp_out(&s, out, vo, 0);
    const float *fq = lowp_in(&s, q, vq), *fk = lowp_in(&s, k, vkv), *fv = lowp_in(&s, v, vkv);
    if (!s.failed) cpu_attention_fwd(o, lse, fq, fk, fv, doc_start, B, T, H, KVH, D, qkv_stride);
    lowp_store(&s, out, o, vo);
}

static void LOWP_FN(attention_bwd)(void *dq, void *dk, void *dv, const void *dout, const void *out,
                                   const float *lse, const void *q, const void *k, const void *v,
                                   const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                                   int qkv_stride) {
    LowpStage s = LOWP_STAGE;
    LowpView vq = lowp_rows(B * T, H * D, qkv_stride), vkv = lowp_rows(B * T, KVH * D, qkv_stride),
             vo = lowp_flat((size_t)B * T * H * D);
    float *fdq = lowp_out(&s, dq, vq, 0), *fdk = lowp_out(&s, dk, vkv, 0),
          *fdv = lowp_out(&s, dv, vkv, 0);
    const float *fdo = lowp_in(&s, dout, vo), *fo = lowp_in(&s, out, vo), *fq = lowp_in(&s, q, vq),
                *fk = lowp_in(&s, k, vkv), *fv = lowp_in(&s, v, vkv);
    if (!s.failed)
        cpu_attention_bwd(fdq, fdk, fdv, fdo, fo, lse, fq, fk, fv, doc_start, B, T, H, KVH, D,
                          qkv_stride);
    lowp_store(&s, dq, fdq, vq);
    lowp_store(&s, dk, fdk, vkv);
    lowp_store(&s, dv, fdv, vkv);
}

// Only the cached keys some query sees are staged: each sequence's first max(end) positions.
static void LOWP_FN(attention_decode)(void *out, const void *q, const void *k_cache,
                                      const void *v_cache, const int32_t *span, int B, int H,
                                      int KVH, int D, int q_stride, int max_len) {
    LowpStage s = LOWP_STAGE;
    int end = 0;
    for (int b = 0; b < B; b++)
        end = span[B + b] > end ? span[B + b] : end;
    LowpView vq = lowp_rows(B, H * D, q_stride),
             vkv = lowp_rows(B, end * KVH * D, max_len * KVH * D),
             vo = lowp_flat((size_t)B * H * D);
    float *o = lowp_out(&s, out, vo, 0);
    const float *fq = lowp_in(&s, q, vq), *fk = lowp_in(&s, k_cache, vkv),
                *fv = lowp_in(&s, v_cache, vkv);
    if (!s.failed) cpu_attention_decode(o, fq, fk, fv, span, B, H, KVH, D, q_stride, max_len);
    lowp_store(&s, out, o, vo);
}

// A strided copy: no arithmetic to stage.
static void LOWP_FN(copy_rows)(void *dst, int dst_stride, const void *src, int src_stride, int rows,
                               int cols) {
    size_t a = dtype_size(LOWP_DT);
    cpu_copy_rows_bytes(dst, (size_t)dst_stride * a, src, (size_t)src_stride * a, rows,
                        (size_t)cols * a);
}

static void LOWP_FN(moe_route)(float *probs, float *weight, int32_t *expert, int32_t *counts,
                               int32_t *token_of, int32_t *slot, const void *logits, int N, int E,
                               int k) {
    LowpStage s = LOWP_STAGE;
    const float *z = lowp_in(&s, logits, lowp_flat((size_t)N * E));
    if (!s.failed)
        cpu_moe_route_dtype(LOWP_DT, probs, weight, expert, counts, token_of, slot, z, N, E, k);
}

static void LOWP_FN(moe_route_bwd)(void *dlogits, const float *dweight, const float *probs,
                                   const int32_t *expert, int N, int E, int k) {
    LowpStage s = LOWP_STAGE;
    LowpView v = lowp_flat((size_t)N * E);
    float *dz = lowp_out(&s, dlogits, v, 0);
    if (!s.failed) cpu_moe_route_bwd(dz, dweight, probs, expert, N, E, k);
    lowp_store(&s, dlogits, dz, v);
}

// out may be resid: both are staged before the kernel, and out is stored after it.
static void LOWP_FN(moe_combine)(void *out, const void *resid, const void *shared,
                                 float shared_scale, const void *rows, const float *weight,
                                 const int32_t *slot, int N, int k, int C) {
    LowpStage s = LOWP_STAGE;
    LowpView v = lowp_flat((size_t)N * C);
    float *o = lowp_out(&s, out, v, 0);
    const float *fr = resid ? lowp_in(&s, resid, v) : NULL,
                *fs = shared ? lowp_in(&s, shared, v) : NULL,
                *fy = lowp_in(&s, rows, lowp_flat((size_t)N * k * C));
    if (!s.failed) cpu_moe_combine(o, fr, fs, shared_scale, fy, weight, slot, N, k, C);
    lowp_store(&s, out, o, v);
}

static void LOWP_FN(moe_combine_bwd)(void *drows, float *dweight, void *dshared, const void *dout,
                                     const void *rows, const float *weight, const int32_t *slot,
                                     float shared_scale, int N, int k, int C) {
    LowpStage s = LOWP_STAGE;
    LowpView v = lowp_flat((size_t)N * C), vr = lowp_flat((size_t)N * k * C);
    float *fdr = lowp_out(&s, drows, vr, 0), *fds = dshared ? lowp_out(&s, dshared, v, 0) : NULL;
    const float *fd = lowp_in(&s, dout, v), *fy = lowp_in(&s, rows, vr);
    if (!s.failed)
        cpu_moe_combine_bwd(fdr, dweight, fds, fd, fy, weight, slot, shared_scale, N, k, C);
    lowp_store(&s, drows, fdr, vr);
    if (dshared) lowp_store(&s, dshared, fds, v);
}

static void LOWP_FN(swiglu_fwd)(void *out, const void *h, int N, int FF) {
    LowpStage s = LOWP_STAGE;
    LowpView vo = lowp_flat((size_t)N * FF);
    float *o = lowp_out(&s, out, vo, 0);
    const float *fh = lowp_in(&s, h, lowp_flat((size_t)N * 2 * FF));
    if (!s.failed) cpu_swiglu_fwd(o, fh, N, FF);
    lowp_store(&s, out, o, vo);
}

static void LOWP_FN(swiglu_bwd)(void *dh, const void *dout, const void *h, int N, int FF) {
    LowpStage s = LOWP_STAGE;
    LowpView vh = lowp_flat((size_t)N * 2 * FF);
    float *fdh = lowp_out(&s, dh, vh, 0);
    const float *fdo = lowp_in(&s, dout, lowp_flat((size_t)N * FF)), *fh = lowp_in(&s, h, vh);
    if (!s.failed) cpu_swiglu_bwd(fdh, fdo, fh, N, FF);
    lowp_store(&s, dh, fdh, vh);
}

static void LOWP_FN(sigmoid_gate_fwd)(void *out, const void *x, const void *g, size_t n) {
    LowpStage s = LOWP_STAGE;
    LowpView v = lowp_flat(n);
    float *o = lowp_out(&s, out, v, 0);
    const float *fx = lowp_in(&s, x, v), *fg = lowp_in(&s, g, v);
    if (!s.failed) cpu_sigmoid_gate_fwd(o, fx, fg, n);
    lowp_store(&s, out, o, v);
}

static void LOWP_FN(sigmoid_gate_bwd)(void *dx, void *dg, const void *dout, const void *x,
                                      const void *g, size_t n) {
    LowpStage s = LOWP_STAGE;
    LowpView v = lowp_flat(n);
    float *fdx = lowp_out(&s, dx, v, 0), *fdg = lowp_out(&s, dg, v, 0);
    const float *fdo = lowp_in(&s, dout, v), *fx = lowp_in(&s, x, v), *fg = lowp_in(&s, g, v);
    if (!s.failed) cpu_sigmoid_gate_bwd(fdx, fdg, fdo, fx, fg, n);
    lowp_store(&s, dx, fdx, v);
    lowp_store(&s, dg, fdg, v);
}

static void LOWP_FN(cross_entropy_fwd)(float *loss, float *lse, const void *logits,
                                       const int32_t *targets, const int32_t *mask, int N, int V,
                                       float label_smoothing) {
    LowpStage s = LOWP_STAGE;
    const float *z = lowp_in(&s, logits, lowp_flat((size_t)N * V));
    if (!s.failed) cpu_cross_entropy_fwd(loss, lse, z, targets, mask, N, V, label_smoothing);
}

static void LOWP_FN(cross_entropy_bwd)(void *dlogits, const void *logits, const float *lse,
                                       const int32_t *targets, const int32_t *mask,
                                       const float *row_scale, int N, int V, float label_smoothing,
                                       float dloss) {
    LowpStage s = LOWP_STAGE;
    LowpView v = lowp_flat((size_t)N * V);
    float *dz = lowp_out(&s, dlogits, v, 0);
    const float *z = lowp_in(&s, logits, v);
    if (!s.failed)
        cpu_cross_entropy_bwd(dz, z, lse, targets, mask, row_scale, N, V, label_smoothing, dloss);
    lowp_store(&s, dlogits, dz, v);
}

// In place on the activations x.
static void LOWP_FN(gaussian_noise_add)(void *x, size_t n, float std, uint64_t seed) {
    LowpStage s = LOWP_STAGE;
    float *t = lowp_out(&s, x, lowp_flat(n), 1);
    if (!s.failed) cpu_gaussian_noise_add(t, n, std, seed);
    lowp_store(&s, x, t, lowp_flat(n));
}

static void LOWP_FN(fill)(Backend *b) {
    b->dtype = LOWP_DT;
    b->cast_from_f32 = LOWP_FN(cast_from_f32);
    b->download_f32 = LOWP_FN(download_f32);
    b->matmul_fwd = LOWP_FN(matmul_fwd);
    b->matmul_bwd = LOWP_FN(matmul_bwd);
    b->copy_rows = LOWP_FN(copy_rows);
    b->embedding_fwd = LOWP_FN(embedding_fwd);
    b->embedding_bwd = LOWP_FN(embedding_bwd);
    b->rmsnorm_fwd = LOWP_FN(rmsnorm_fwd);
    b->rmsnorm_bwd = LOWP_FN(rmsnorm_bwd);
    b->rope_fwd = LOWP_FN(rope_fwd);
    b->rope_bwd = LOWP_FN(rope_bwd);
    b->attention_fwd = LOWP_FN(attention_fwd);
    b->attention_bwd = LOWP_FN(attention_bwd);
    b->attention_decode = LOWP_FN(attention_decode);
    b->moe_route = LOWP_FN(moe_route);
    b->moe_route_bwd = LOWP_FN(moe_route_bwd);
    b->moe_combine = LOWP_FN(moe_combine);
    b->moe_combine_bwd = LOWP_FN(moe_combine_bwd);
    b->swiglu_fwd = LOWP_FN(swiglu_fwd);
    b->swiglu_bwd = LOWP_FN(swiglu_bwd);
    b->sigmoid_gate_fwd = LOWP_FN(sigmoid_gate_fwd);
    b->sigmoid_gate_bwd = LOWP_FN(sigmoid_gate_bwd);
    b->cross_entropy_fwd = LOWP_FN(cross_entropy_fwd);
    b->cross_entropy_bwd = LOWP_FN(cross_entropy_bwd);
    b->gaussian_noise_add = LOWP_FN(gaussian_noise_add);
}
