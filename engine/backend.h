// backend.h: the numerics of the model and the optimizer (docs/design.md §7, §8, §10) behind
// function pointers, and the memory they work on.
//
// engine/model.c and engine/optim.c orchestrate and call only these ops, so the CPU
// backend (engine/cpu/) and the CUDA backend (engine/cuda/) serve the same model code.
// A backend is chosen when the model is created (backend_open) and owns every buffer
// the trainer touches: weights, gradients, fp32 master weights, optimizer state,
// activations, the batch. Pointers below are the backend's (host memory for the CPU,
// device memory for CUDA). Host and backend memory meet only through upload/download.
//
// Types: `void *` / `const void *` tensors are in the backend's compute dtype `dtype`
// (fp32, bf16 or fp16, common/dtype.h); `float *` tensors are always fp32; `double *` are
// single backend-resident accumulators (loss, sum of squares) read back once per
// optimizer step. All tensors are row-major; N = B*T token rows.
//
// Ordering: ops run in issue order (the CUDA backend enqueues them on one stream and
// returns at once; download waits for what came before). Ops return nothing: shapes are
// checked by the caller, and memory comes from alloc and attention_reserve, which return
// their failures (for want of memory: err_resource). One rule for what an op still cannot do
// (no memory for its own scratch, a library or device error, a caller's bug it detects): the
// backend records the first such failure, with the op and the reason, skips what it cannot
// compute (its outputs are then unspecified; nothing crashes), and `failure` reports it. The
// trainer checks once per optimizer step, before anything of that step is applied or written,
// and exits 1 with the message.
//
// Determinism: every op gives the same bits for the same inputs, run after run (no
// floating-point atomics whose order varies); reductions add in a fixed order.
//
// Grouped rows: rmsnorm and rope work in place on the fused q|k|v projection output:
// token n, group g, element c lives at x[n*stride + g*C + c] (G groups of C elements per
// token, tokens `stride` elements apart).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/error.h"

// The scalars of one AdamW update, computed on the host (torch.optim.AdamW, single tensor):
// w = w*decay; m = m*beta1 + g*one_minus_beta1; v = v*beta2 + g*g*one_minus_beta2;
// w += -step_size * m / (sqrt(v)/bc2_sqrt + eps).
typedef struct {
    float decay, step_size, bc2_sqrt, beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
} AdamwArgs;

// One Muon update of a (rows, cols) weight (torch.optim.Muon):
// buf = lerp(buf, g, 1-momentum); u = lerp(g, buf, momentum) (nesterov) or buf; x = u
// (transposed when rows > cols, so x is (r, c) with r <= c); x /= max(||x||_F, 1e-7); ns_steps
// times:
// A = x x^T, B = ns_b*A + ns_c*A@A, x = ns_a*x + B@x; then w = w*decay - adjusted_lr*x
// (transposed back).
typedef struct {
    int rows, cols, ns_steps;
    int nesterov; // 0: u = buf (plain momentum)
    float momentum, one_minus_momentum, decay, adjusted_lr, ns_a, ns_b, ns_c, norm_eps;
} MuonArgs;

typedef struct Backend Backend;
struct Backend {
    const char *name; // "cpu" | "cuda"
    DType dtype;      // compute dtype of weights and activations
    int device;       // CUDA device ordinal (-1 on the CPU)

    // ---------------------------------------------------------------- memory
    // Zeroed memory, or NULL with err naming the size asked for and (GPU) what was free.
    void *(*alloc)(size_t bytes, Err *err);
    // Ordered after every op issued so far, so p may still be in use by them (CUDA: it
    // waits for the compute stream). Memory another stream used (the comm's, comm/nccl.c)
    // is freed only after its owner waited for that stream (comm_wait).
    void (*free)(void *p);
    void (*zero)(void *p, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes);      // backend to backend
    void (*upload)(void *dst, const void *host, size_t bytes);   // host to backend
    void (*download)(void *host, const void *src, size_t bytes); // backend to host, waits
    // Host memory that download fills fastest (CUDA: pinned, cudaMallocHost; the CPU: malloc),
    // not zeroed; NULL with err naming the size. host_free takes NULL.
    void *(*host_alloc)(size_t bytes, Err *err);
    void (*host_free)(void *p);
    // dst: (n) compute dtype = src: (n) fp32 (round to nearest even): the weights from the master
    // after an optimizer step (model_refresh_weights), unused in fp32.
    void (*cast_from_f32)(void *dst, const float *src, size_t n);
    // host: (n) fp32 = src: (n) compute dtype; waits (tests, logits, checkpoints of bf16).
    void (*download_f32)(float *host, const void *src, size_t n);
    void (*sync)(void);    // waits for every op issued so far (before timing, before exit)
    void *(*stream)(void); // the CUDA stream (cudaStream_t) the ops run on; NULL on the CPU
    // -1 with the first failure an op recorded since the process started (see Ordering), else
    // 0. CUDA: the ops before it are waited for first.
    int (*failure)(Err *err);

    // ---------------------------------------------------------------- matmul
    // out: (N,OC) = inp: (N,C) @ weight: (OC,C)^T, plus the old out if accumulate.
    void (*matmul_fwd)(void *out, const void *inp, const void *weight, int N, int C, int OC,
                       int accumulate);
    // dinp: (N,C) = dout: (N,OC) @ weight (or += if accumulate_dinp), skipped when dinp is
    // NULL; dweight: (OC,C) fp32 += dout^T @ inp.
    void (*matmul_bwd)(void *dinp, float *dweight, const void *dout, const void *inp,
                       const void *weight, int N, int C, int OC, int accumulate_dinp);

    // ---------------------------------------------------------------- strided copy
    // dst[r*dst_stride + c] = src[r*src_stride + c] for r < rows, c < cols (compute dtype):
    // MLA's q and per-head k, v moved between their projections and the q|k|v rows.
    void (*copy_rows)(void *dst, int dst_stride, const void *src, int src_stride, int rows,
                      int cols);

    // ---------------------------------------------------------------- embedding
    // out: (N,C) = table[ids[n]]; table: (V,C). Also the gather of a mixture of experts'
    // tokens into their experts' groups (ids = token_of of moe_route).
    void (*embedding_fwd)(void *out, const int32_t *ids, const void *table, int N, int C);
    // dtable[ids[n]] += dout[n]. by_id: (N) the token indices 0..N-1 stably sorted by
    // ids[n] (built on the host with the batch), so each table row is summed by one
    // thread in token order: deterministic without atomics.
    void (*embedding_bwd)(float *dtable, const void *dout, const int32_t *ids, const int32_t *by_id,
                          int N, int C);

    // ---------------------------------------------------------------- rmsnorm (grouped rows)
    // out = inp * rsqrt(mean(inp^2) + eps) * weight over each row of C;
    // rstd: (N*G) fp32, the per-row rsqrt kept for backward. out and inp share the layout.
    void (*rmsnorm_fwd)(void *out, float *rstd, const void *inp, const void *weight, int N, int G,
                        int C, int stride, float eps);
    // dinp (= or += if accumulate_dinp) same layout as inp; dweight: (C) fp32 += sum over
    // rows (fixed order).
    void (*rmsnorm_bwd)(void *dinp, float *dweight, const void *dout, const void *inp,
                        const void *weight, const float *rstd, int N, int G, int C, int stride,
                        int accumulate_dinp);

    // ---------------------------------------------------------------- rope (grouped rows)
    // In place on x: (N, G heads of D) rotating interleaved pairs (2i,2i+1) by the angle
    // of position pos[n]; cos_sin: (P, D/2, 2) fp32 table of (cos, sin) for positions
    // 0..P-1. rope_bwd rotates by the negative angle (the transpose of the rotation).
    void (*rope_fwd)(void *x, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                     int stride);
    void (*rope_bwd)(void *dx, const int32_t *pos, const float *cos_sin, int N, int G, int D,
                     int stride);

    // ---------------------------------------------------------------- causal attention
    // q: (B,T,H,D), k,v: (B,T,KVH,D), all with token stride qkv_stride (elements);
    // out: (B,T,H,D) contiguous; lse: (B,H,T) fp32 logsumexp of each query row's scaled
    // scores (scale 1/sqrt(D)). Query head h reads kv head h / (H/KVH). Key j is visible
    // to query i iff doc_start[b*T+i] <= j <= i; doc_start: (B,T), never NULL, the first key
    // each query sees (its document's start, or its sliding window's), non-decreasing along a
    // sequence.
    void (*attention_fwd)(void *out, float *lse, const void *q, const void *k, const void *v,
                          const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                          int qkv_stride);
    // Reserves the scratch the attention ops need for up to T tokens (attention_decode: cached
    // keys) of head dimension D (kept for later calls): before them, since they cannot fail.
    // NULL where they need none (CUDA).
    int (*attention_reserve)(int T, int D, Err *err);
    // dq, dk, dv: same layout as q, k, v (overwritten); recomputes the probabilities.
    void (*attention_bwd)(void *dq, void *dk, void *dv, const void *dout, const void *out,
                          const float *lse, const void *q, const void *k, const void *v,
                          const int32_t *doc_start, int B, int T, int H, int KVH, int D,
                          int qkv_stride);
    // Generation's step (engine/generate.h): one new query per sequence over its KV cache.
    // q: (B,H,D) with row stride q_stride (elements); k_cache, v_cache: (B, max_len, KVH, D)
    // contiguous; span: (2,B), query b sees the keys [span[b], span[B+b]) of its sequence
    // (0 <= span[b] < span[B+b] <= max_len); out: (B,H,D) contiguous. Scale and head sharing as
    // attention_fwd's, the same arithmetic per query row. attention_reserve(max_len, D) first.
    // NULL where generation is not implemented: the model refuses to generate there.
    void (*attention_decode)(void *out, const void *q, const void *k_cache, const void *v_cache,
                             const int32_t *span, int B, int H, int KVH, int D, int q_stride,
                             int max_len);

    // ---------------------------------------------------------------- mixture of experts
    // DeepSeekMoE's routing of N tokens to k of E experts (docs/design.md §7a). logits: (N,E)
    // compute dtype, the router's output. probs: (N,E) fp32 = softmax(logits) in fp32, rounded
    // to the compute dtype (kept for moe_route_bwd). Token n's experts: the k largest probs,
    // chosen as torch.topk chooses them on the CPU (ties included: engine/topk.h), listed by
    // increasing expert index in expert: (N*k) int32; weight: (N*k) fp32 = those probs / their
    // sum (the sum, in fp32 in torch.topk's order, and each quotient rounded to the compute
    // dtype). The (token, choice) pairs grouped by expert, in token order within an expert:
    // counts: (E) int32, pairs per expert; token_of: (N*k) int32, the token of the p-th pair;
    // slot: (N*k) int32, the pair index p of (n, j) (so token_of[slot[n*k+j]] = n).
    void (*moe_route)(float *probs, float *weight, int32_t *expert, int32_t *counts,
                      int32_t *token_of, int32_t *slot, const void *logits, int N, int E, int k);
    // dlogits: (N,E) compute dtype = d loss / d logits from dweight: (N*k) fp32, d loss / d
    // weight, through the renormalisation and the softmax (the roundings pass gradients
    // unchanged); probs and expert as moe_route wrote them.
    void (*moe_route_bwd)(void *dlogits, const float *dweight, const float *probs,
                          const int32_t *expert, int N, int E, int k);
    // out: (N,C) = resid + (shared_scale * shared + sum over j = 0..k-1 of weight[n*k+j] *
    // rows[slot[n*k+j]]), in fp32, rounded once; rows: (N*k, C) the experts' outputs in pair
    // order. resid and shared may be NULL (0), weight NULL (1s: the gather-sum of the tokens'
    // gradients); out may be resid.
    void (*moe_combine)(void *out, const void *resid, const void *shared, float shared_scale,
                        const void *rows, const float *weight, const int32_t *slot, int N, int k,
                        int C);
    // moe_combine's transpose for dout: (N,C): drows: (N*k, C), row slot[n*k+j] = weight[n*k+j] *
    // dout[n] (every row written); dweight: (N*k) fp32 = <dout[n], rows[slot[n*k+j]]> (fixed
    // order); dshared: (N,C) = shared_scale * dout, skipped when NULL.
    void (*moe_combine_bwd)(void *drows, float *dweight, void *dshared, const void *dout,
                            const void *rows, const float *weight, const int32_t *slot,
                            float shared_scale, int N, int k, int C);

    // ---------------------------------------------------------------- swiglu
    // h: (N, 2FF) = [up | gate] per row; out: (N,FF) = up * silu(gate).
    void (*swiglu_fwd)(void *out, const void *h, int N, int FF);
    // dh: (N, 2FF) from dout: (N,FF).
    void (*swiglu_bwd)(void *dh, const void *dout, const void *h, int N, int FF);

    // ---------------------------------------------------------------- sigmoid gate
    // out = x * sigmoid(g), all (n) elements.
    void (*sigmoid_gate_fwd)(void *out, const void *x, const void *g, size_t n);
    void (*sigmoid_gate_bwd)(void *dx, void *dg, const void *dout, const void *x, const void *g,
                             size_t n);

    // ---------------------------------------------------------------- cross entropy
    // logits: (N,V); targets: (N); mask: (N), never NULL. Row n counts iff mask[n] != 0.
    // loss[n] = torch's label-smoothed CE of row n (0 when not counted); lse: (N). Both fp32.
    // The probabilities are never written.
    void (*cross_entropy_fwd)(float *loss, float *lse, const void *logits, const int32_t *targets,
                              const int32_t *mask, int N, int V, float label_smoothing);
    // dlogits: (N,V) = dloss * row_scale[n] * (softmax - smoothed one-hot) on counted rows, 0
    // elsewhere; row_scale: (N) fp32, or NULL for 1 (the mean loss; DPO and GRPO weigh each
    // token by the derivative of their loss, engine/preference.h).
    void (*cross_entropy_bwd)(void *dlogits, const void *logits, const float *lse,
                              const int32_t *targets, const int32_t *mask, const float *row_scale,
                              int N, int V, float label_smoothing, float dloss);
    // acc[0] += (double)(float)(sum over n of loss[n], in double / counted); counted > 0.
    void (*loss_mean_add)(double *acc, const float *loss, int N, int counted);

    // ---------------------------------------------------------------- preference losses
    // docs/design.md §8, AstrAI's DPOStrategy and GRPOStrategy, over per-token negative
    // log-likelihoods (cross_entropy_fwd's loss without smoothing: nll[n] = -log p(target n), 0 on
    // tokens not counted). Each adds its loss to acc[0] and two metrics to acc[2], acc[3], and
    // writes scale: (rows*T) = loss_scale * d loss / d nll[n], the row_scale of cross_entropy_bwd.
    //
    // DPO over P pairs, rows of T tokens: [0,P) chosen, [P,2P) rejected. A row's log-prob is
    // minus the sum of its nll; Δ_p = (π_c - π_r) - (ref_c - ref_r) (ref: from ref_nll);
    // loss = mean_p -logsigmoid(β Δ_p); acc[2] += mean_p β Δ_p (reward margin), acc[3] +=
    // mean_p [Δ_p > 0] (reward accuracy).
    void (*dpo_loss)(double *acc, float *scale, const float *nll, const float *ref_nll, int P,
                     int T, float beta, float loss_scale);
    // GRPO over R rows of T tokens; mask: (R*T) the response tokens; adv: (R) each row's
    // advantage A; norm (> 0): what the sums are divided by (the response tokens of the batch
    // here, or its share of a batch spread over ranks, engine/preference.h). Per counted token: ρ =
    // exp(old_nll - nll) (the ratio to the behaviour policy), policy = -min(ρA, clamp(ρ, 1-ε, 1+ε)
    // A); r = exp(nll - ref_nll), k = r - log(r + 1e-8) - 1 (the KL estimate to the reference).
    // loss = (Σ policy + kl_coef Σ k) / norm; acc[2] += Σ k / norm (KL), acc[3] += #{|ρ - 1| > ε} /
    // norm (clip fraction). Gradients follow torch: min's tie splits, clamp passes inside [1-ε,
    // 1+ε].
    void (*grpo_loss)(double *acc, float *scale, const float *nll, const float *old_nll,
                      const float *ref_nll, const float *adv, const int32_t *mask, int R, int T,
                      float norm, float clip_eps, float kl_coef, float loss_scale);
    // NEFTune (AstrAI's Embedding): x: (n) += std * N(0,1), the normal draws a function of
    // (seed, i) only (counter-based: the same numbers on every backend and any thread count).
    void (*gaussian_noise_add)(void *x, size_t n, float std, uint64_t seed);

    // ---------------------------------------------------------------- optimizer
    // out[0] = sum of x[i]^2 over (n), in double, fixed order (the global grad norm).
    void (*sum_squares)(double *out, const float *x, size_t n);
    // x: (n) *= factor (gradient clipping).
    void (*scale)(float *x, size_t n, float factor);
    // One AdamW step on a tensor of n floats: w, exp_avg, exp_avg_sq updated in place.
    void (*adamw)(float *w, const float *g, float *exp_avg, float *exp_avg_sq, size_t n,
                  const AdamwArgs *a);
    // One Muon step (see MuonArgs) on w, buf: (rows, cols); scratch: muon_scratch_floats.
    void (*muon)(float *w, const float *g, float *buf, float *scratch, const MuonArgs *a);
};

// A growable buffer of be: *buf holds at least `bytes` afterwards, grown (its contents not kept)
// when *cap, its size, is smaller. On failure *buf is NULL and *cap 0, with err.
int backend_reserve(const Backend *be, void **buf, size_t *cap, size_t bytes, Err *err);

// fp32 floats of Muon scratch for a (rows, cols) weight: X and the next X as (r, c), the
// Gram matrix and the polynomial as (r, r), r = min(rows, cols), and 2 doubles of norms.
size_t muon_scratch_floats(int rows, int cols);

// The devices a rank computes on.
typedef enum { BACKEND_CPU, BACKEND_CUDA } BackendKind;
// The backend of a rank: the CPU (dtype fp32, bf16 or fp16) or CUDA (the device ordinal
// `device`, dtype bf16 or fp32). Fails with a clear error when CUDA was not built in or no such
// GPU is usable.
int backend_open(const Backend **out, BackendKind kind, int device, DType dtype, Err *err);
// Whether this build has the CUDA backend and a GPU is visible (for --device_type auto).
int backend_cuda_available(void);

const Backend *backend_cpu(void);
// The CPU backend computing in dtype: DT_F32 is backend_cpu(); DT_BF16 and DT_F16 keep
// weights and activations (`void *`) in 2-byte elements, compute and accumulate in fp32 and
// round each output to nearest even (engine/cpu/lowp.h). NULL for any other dtype.
const Backend *backend_cpu_dtype(DType dtype);
// The path of the CPU backend's bf16/fp16 GEMMs: oneDNN on the CPU's own instructions where it
// has them (AUTO, the default), or PORTABLE (convert, then sgemm). Set before the GEMMs it
// should govern; ASTRAI_CPU_GEMM=portable in the environment sets PORTABLE when nothing set it
// first (read once, at the first GEMM or backend_cpu_gemm_path).
typedef enum { CPU_GEMM_AUTO, CPU_GEMM_PORTABLE } CpuGemmPath;
void backend_cpu_set_gemm_path(CpuGemmPath path);
// How the CPU backend's GEMMs run in dtype, for logs: "sgemm (OpenBLAS)" (fp32), "onednn
// <kernel>" (the CPU's own bf16/fp16 instructions), or "portable (convert, then sgemm): <why>"
// (ASTRAI_CPU_GEMM=portable forces that path). engine/cpu/gemm.c.
const char *backend_cpu_gemm_path(DType dtype);
