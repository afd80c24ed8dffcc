// backend.h: the numerics ops of the model (DESIGN §7, §10) behind function pointers.
//
// engine/model.c orchestrates the layers and calls only these ops, so a CUDA
// backend can sit beside the CPU one (engine/cpu/) without touching the model.
// All tensors are fp32, row-major; N = B*T token rows. Pointers are device
// pointers of the backend (host memory for the CPU backend).
//
// Several ops take a "grouped rows" layout so they can work in place on the
// fused q|k|v projection output: token n, group g, element c lives at
// x[n*stride + g*C + c] (G groups of C floats per token, tokens `stride` apart).
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name;

    // ---------------------------------------------------------------- memory
    void *(*alloc)(size_t bytes); // NULL on failure; memory is zeroed
    void (*zero)(void *p, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes);
    void (*free)(void *p);

    // ---------------------------------------------------------------- matmul (sgemm)
    // out: (N,OC) = inp: (N,C) @ weight: (OC,C)^T, plus the old out if accumulate.
    void (*matmul_fwd)(float *out, const float *inp, const float *weight, int N, int C, int OC,
                       int accumulate);
    // dinp: (N,C) = dout: (N,OC) @ weight (or += if accumulate_dinp);
    // dweight: (OC,C) += dout^T @ inp.
    void (*matmul_bwd)(float *dinp, float *dweight, const float *dout, const float *inp,
                       const float *weight, int N, int C, int OC, int accumulate_dinp);

    // ---------------------------------------------------------------- embedding
    // out: (N,C) = table[ids[n]]; table: (V,C).
    void (*embedding_fwd)(float *out, const int32_t *ids, const float *table, int N, int C);
    // dtable[ids[n]] += dout[n].
    void (*embedding_bwd)(float *dtable, const float *dout, const int32_t *ids, int N, int C);

    // ---------------------------------------------------------------- rmsnorm (grouped rows)
    // out = inp * rsqrt(mean(inp^2) + eps) * weight over each row of C;
    // rstd: (N*G) the per-row rsqrt, kept for backward. out and inp share the layout.
    void (*rmsnorm_fwd)(float *out, float *rstd, const float *inp, const float *weight, int N,
                        int G, int C, int stride, float eps);
    // dinp (= or += if accumulate_dinp) and dweight: (C) += from dout, same layout as inp.
    void (*rmsnorm_bwd)(float *dinp, float *dweight, const float *dout, const float *inp,
                        const float *weight, const float *rstd, int N, int G, int C, int stride,
                        int accumulate_dinp);

    // ---------------------------------------------------------------- rope (grouped rows)
    // In place on x: (N, G heads of D) rotating interleaved pairs (2i,2i+1) by the angle
    // of position pos[n]; cos_sin: (P, D/2, 2) table of (cos, sin) for positions 0..P-1.
    // rope_bwd rotates by the negative angle (the transpose of the rotation).
    void (*rope_fwd)(float *x, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                     int stride);
    void (*rope_bwd)(float *dx, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                     int stride);

    // ---------------------------------------------------------------- causal attention
    // q: (B,T,H,D), k,v: (B,T,KVH,D), all with token stride qkv_stride (floats);
    // out: (B,T,H,D) contiguous; lse: (B,H,T) logsumexp of each query row's scaled scores.
    // Query head h reads kv head h / (H/KVH). Key j is visible to query i iff
    // doc_start[b,i] <= j <= i; doc_start: (B,T) or NULL (one document per row).
    void (*attention_fwd)(float *out, float *lse, const float *q, const float *k, const float *v,
                          const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                          int qkv_stride);
    // dq, dk, dv: same layout as q, k, v (overwritten); recomputes the probabilities.
    void (*attention_bwd)(float *dq, float *dk, float *dv, const float *dout, const float *out,
                          const float *lse, const float *q, const float *k, const float *v,
                          const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                          int qkv_stride);

    // ---------------------------------------------------------------- swiglu
    // h: (N, 2FF) = [up | gate] per row; out: (N,FF) = up * silu(gate).
    void (*swiglu_fwd)(float *out, const float *h, int N, int FF);
    // dh: (N, 2FF) from dout: (N,FF).
    void (*swiglu_bwd)(float *dh, const float *dout, const float *h, int N, int FF);

    // ---------------------------------------------------------------- sigmoid gate
    // out = x * sigmoid(g), all (n) elements.
    void (*sigmoid_gate_fwd)(float *out, const float *x, const float *g, size_t n);
    void (*sigmoid_gate_bwd)(float *dx, float *dg, const float *dout, const float *x,
                             const float *g, size_t n);

    // ---------------------------------------------------------------- cross entropy
    // logits: (N,V); targets: (N); mask: (N) or NULL. Row n counts iff mask[n] != 0.
    // loss[n] = torch's label-smoothed CE of row n (0 when not counted); lse: (N).
    void (*cross_entropy_fwd)(float *loss, float *lse, const float *logits, const int32_t *targets,
                              const int32_t *mask, int N, int V, float label_smoothing);
    // dlogits: (N,V) = dloss * (softmax - smoothed one-hot) on counted rows, 0 elsewhere.
    void (*cross_entropy_bwd)(float *dlogits, const float *logits, const float *lse,
                              const int32_t *targets, const int32_t *mask, int N, int V,
                              float label_smoothing, float dloss);
} Backend;

const Backend *backend_cpu(void);
