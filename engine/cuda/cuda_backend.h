// cuda_backend.h: the CUDA backend's internals (engine/cuda/ only; the rest of astrai
// sees engine/backend.h). C linkage, so engine/backend_open.c (C) can reach it.
//
// One rank drives one GPU: the context (device, the compute stream, the cuBLASLt handle
// and workspace, a scratch buffer) is process-wide, set up once by cuda_context_open.
// Every op of the Backend table is declared here in three variants, _f32, _bf16 and _f16,
// for the compute dtype of `void *` tensors (float, __nv_bfloat16 or __half); fp32 tensors
// are `float *` in all. Ops enqueue on cuda_stream() and return at once.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "common/error.h"
#include "engine/backend.h"

// ---------------------------------------------------------------- context (context.cu)
// Selects the device, creates the stream, the cuBLASLt handle, its workspace and the
// scratch buffer. A second call with the same device is a no-op; another device fails.
int cuda_context_open(int device, Err *err);
int cuda_device_count(void);   // 0 when no driver or no GPU (never fails loudly)
int cuda_current_device(void); // -1 until cuda_context_open succeeded
// Free and total bytes of the device: 0, or -1 (and 0/0) when it cannot tell.
int cuda_mem_info(size_t *free_b, size_t *total_b);
void *cuda_lt_handle(void);             // cublasLtHandle_t
void *cuda_lt_workspace(size_t *bytes); // the cuBLASLt workspace and its size
// As cuda_check_fail, for cuBLAS status codes (they overlap cudaError_t's numbers).
void cuda_cublas_fail(int status, const char *call, const char *file, int line);
void *cuda_stream(void); // the compute stream (cudaStream_t), for NCCL ordering
// A device scratch buffer of at least `bytes` (CUDA_SCRATCH_BYTES at most), shared by the
// ops (they run in stream order, so one at a time). NULL, recorded as the backend's failure,
// past CUDA_SCRATCH_BYTES or before cuda_context_open (bugs).
#define CUDA_SCRATCH_BYTES ((size_t)64 << 20)
void *cuda_scratch(size_t bytes);
// engine/backend.h's failure rule on the GPU: the first failure of an op, recorded with
// first_failure_record ("cuda backend: CUDA error on device 0: an illegal memory access in
// cudaMemcpyAsync (matmul.cu:180)"), the op going on as far as it can; cuda_failure (the
// table's `failure`) reports it after waiting for the stream.
extern FirstFailure cuda_failures;
int cuda_failure(Err *err);
// The failure of a CUDA error, recorded: the device, the call and the error (a launch failure is
// a bug or a dead GPU, not bad input).
void cuda_check_fail(int code, const char *call, const char *file, int line);
#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        int cuda_check_code_ = (int)(call);                                                        \
        if (cuda_check_code_) cuda_check_fail(cuda_check_code_, #call, __FILE__, __LINE__);        \
    } while (0)

// The kernels the last attention op ran: "tensor-core", "simt" (the fallback is logged
// once per reason; attention_decode is always "simt"), "none" before the first (attention.cu;
// for tests and benchmarks).
const char *cuda_attention_kernels(void);

// The Backend table of a compute dtype: DT_BF16, DT_F16, else fp32 (backend.cu); NULL
// until cuda_context_open succeeded.
const Backend *cuda_backend(DType dtype);

// ---------------------------------------------------------------- ops, per compute dtype
// Shapes and semantics: the Backend fields of the same name in engine/backend.h.
#define CUDA_DTYPE_OPS(S)                                                                          \
    /* matmul.cu */                                                                                \
    void cuda_matmul_fwd_##S(void *out, const void *inp, const void *weight, int N, int C, int OC, \
                             int accumulate);                                                      \
    void cuda_matmul_bwd_##S(void *dinp, float *dweight, const void *dout, const void *inp,        \
                             const void *weight, int N, int C, int OC, int accumulate_dinp);       \
    /* embedding.cu */                                                                             \
    void cuda_embedding_fwd_##S(void *out, const int32_t *ids, const void *table, int N, int C);   \
    void cuda_embedding_bwd_##S(float *dtable, const void *dout, const int32_t *ids,               \
                                const int32_t *by_id, int N, int C);                               \
    /* rmsnorm.cu */                                                                               \
    void cuda_rmsnorm_fwd_##S(void *out, float *rstd, const void *inp, const void *weight, int N,  \
                              int G, int C, int stride, float eps);                                \
    void cuda_rmsnorm_bwd_##S(void *dinp, float *dweight, const void *dout, const void *inp,       \
                              const void *weight, const float *rstd, int N, int G, int C,          \
                              int stride, int accumulate_dinp);                                    \
    /* rope.cu */                                                                                  \
    void cuda_rope_fwd_##S(void *x, const int32_t *pos, const float *cos_sin, int N, int G, int D, \
                           int stride);                                                            \
    void cuda_rope_bwd_##S(void *dx, const int32_t *pos, const float *cos_sin, int N, int G,       \
                           int D, int stride);                                                     \
    /* attention.cu */                                                                             \
    void cuda_attention_fwd_##S(void *out, float *lse, const void *q, const void *k,               \
                                const void *v, const int32_t *doc_start, int B, int T, int H,      \
                                int KVH, int D, int qkv_stride);                                   \
    void cuda_attention_bwd_##S(void *dq, void *dk, void *dv, const void *dout, const void *out,   \
                                const float *lse, const void *q, const void *k, const void *v,     \
                                const int32_t *doc_start, int B, int T, int H, int KVH, int D,     \
                                int qkv_stride);                                                   \
    void cuda_attention_decode_##S(void *out, const void *q, const void *k_cache,                  \
                                   const void *v_cache, const int32_t *span, int B, int H,         \
                                   int KVH, int D, int q_stride, int max_len);                     \
    /* moe.cu */                                                                                   \
    void cuda_copy_rows_##S(void *dst, int dst_stride, const void *src, int src_stride, int rows,  \
                            int cols);                                                             \
    void cuda_moe_route_##S(float *probs, float *weight, int32_t *expert, int32_t *counts,         \
                            int32_t *token_of, int32_t *slot, const void *logits, int N, int E,    \
                            int k);                                                                \
    void cuda_moe_route_bwd_##S(void *dlogits, const float *dweight, const float *probs,           \
                                const int32_t *expert, int N, int E, int k);                       \
    void cuda_moe_combine_##S(void *out, const void *resid, const void *shared,                    \
                              float shared_scale, const void *rows, const float *weight,           \
                              const int32_t *slot, int N, int k, int C);                           \
    void cuda_moe_combine_bwd_##S(void *drows, float *dweight, void *dshared, const void *dout,    \
                                  const void *rows, const float *weight, const int32_t *slot,      \
                                  float shared_scale, int N, int k, int C);                        \
    /* elementwise.cu */                                                                           \
    void cuda_swiglu_fwd_##S(void *out, const void *h, int N, int FF);                             \
    void cuda_swiglu_bwd_##S(void *dh, const void *dout, const void *h, int N, int FF);            \
    void cuda_sigmoid_gate_fwd_##S(void *out, const void *x, const void *g, size_t n);             \
    void cuda_sigmoid_gate_bwd_##S(void *dx, void *dg, const void *dout, const void *x,            \
                                   const void *g, size_t n);                                       \
    void cuda_cast_from_f32_##S(void *dst, const float *src, size_t n);                            \
    void cuda_download_f32_##S(float *host, const void *src, size_t n);                            \
    /* cross_entropy.cu */                                                                         \
    void cuda_cross_entropy_fwd_##S(float *loss, float *lse, const void *logits,                   \
                                    const int32_t *targets, const int32_t *mask, int N, int V,     \
                                    float label_smoothing);                                        \
    void cuda_cross_entropy_bwd_##S(void *dlogits, const void *logits, const float *lse,           \
                                    const int32_t *targets, const int32_t *mask,                   \
                                    const float *row_scale, int N, int V, float label_smoothing,   \
                                    float dloss);                                                  \
    /* preference.cu */                                                                            \
    void cuda_gaussian_noise_add_##S(void *x, size_t n, float std, uint64_t seed);

CUDA_DTYPE_OPS(f32)
CUDA_DTYPE_OPS(bf16)
CUDA_DTYPE_OPS(f16)
#undef CUDA_DTYPE_OPS

// ---------------------------------------------------------------- dtype-free ops
// cross_entropy.cu
void cuda_loss_mean_add(double *acc, const float *loss, int N, int counted);
// preference.cu
void cuda_dpo_loss(double *acc, float *scale, const float *nll, const float *ref_nll, int P, int T,
                   float beta, float loss_scale);
void cuda_grpo_loss(double *acc, float *scale, const float *nll, const float *old_nll,
                    const float *ref_nll, const float *adv, const int32_t *mask, int R, int T,
                    float norm, float clip_eps, float kl_coef, float loss_scale);
// matmul.cu: C: (M,N) = alpha * op(A) @ op(B) + beta * C, row-major fp32 (op: transpose when
// trans_*), TF32 off: Newton-Schulz's GEMMs.
void cuda_sgemm_rm(int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A,
                   int lda, const float *B, int ldb, float beta, float *C, int ldc);
// optim.cu
void cuda_sum_squares(double *out, const float *x, size_t n);
void cuda_scale(float *x, size_t n, float factor);
void cuda_adamw(float *w, const float *g, float *exp_avg, float *exp_avg_sq, size_t n,
                const AdamwArgs *a);
void cuda_muon(float *w, const float *g, float *buf, float *scratch, const MuonArgs *a);

#ifdef __cplusplus
}
#endif
