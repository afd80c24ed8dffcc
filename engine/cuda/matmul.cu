// matmul.cu: the linear layers' GEMMs (matmul_fwd, matmul_bwd in _f32, _bf16 and _f16) and an
// fp32 row-major GEMM for Muon's Newton-Schulz (cuda_sgemm_rm), all on cuBLASLt.
//
// Precision: compute CUBLAS_COMPUTE_32F with fp32 alpha/beta in every mode. fp32 mode has
// every matrix fp32 and no TF32 (COMPUTE_32F never uses it; _FAST_TF32 would), so it is
// comparable with the CPU's sgemm. bf16 (fp16) mode reads bf16 (fp16) A/B, accumulates in
// fp32 and writes bf16 (fp16) out/dinp; dweight stays fp32 (A/B 16BF or 16F with C/D 32F
// are among cuBLASLt's supported type combinations), so weight gradients accumulate across
// micro-steps in fp32. fp16 out/dinp past 65504 must be inf, not clamped to the largest
// finite value, for the trainer's loss scaling to see the overflow: no saturating epilogue
// is asked for, and tests/test_gpu_ops.c checks the infs on the GPU.
//
// Plans: a matmul descriptor, three layouts and the algorithm picked by the heuristic are
// cached per shape (types, transposes, sizes, leading dimensions, pointer alignment) in a
// small table, so steady-state calls go straight to cublasLtMatmul.
//
// Determinism: cuBLASLt gives the same bits for the same algorithm, inputs and device when
// one stream is used and the workspace is ours. Here the algorithm of a shape is chosen
// once and reused (the heuristic is itself deterministic for a given shape, device and
// workspace size), everything runs on the one compute stream with the one workspace, and
// the heuristic is restricted to CUBLASLT_REDUCTION_SCHEME_NONE: no split-K, so every
// output element is one dot product accumulated in a fixed order by one CTA (no partial
// sums whose combination could depend on timing). The alignment classes are capped at 16
// bytes, so a shape gets the same algorithm whichever (16-byte aligned) buffer it runs on.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cuda/cuda_backend.h"

#define LT_CHECK(call)                                                                             \
    do {                                                                                           \
        cublasStatus_t lt_check_status_ = (call);                                                  \
        if (lt_check_status_ != CUBLAS_STATUS_SUCCESS)                                             \
            cuda_cublas_fail((int)lt_check_status_, #call, __FILE__, __LINE__);                    \
    } while (0)

// ---------------------------------------------------------------- plans

// Everything the algorithm choice depends on; all ints, so no padding and memcmp works.
typedef struct {
    int ab_type, c_type; // cudaDataType_t of A, B and of C = D
    int op_a, op_b;      // cublasOperation_t of the column-major call
    int m, n, k;         // column-major sizes: D (m,n) = op(A) (m,k) @ op(B) (k,n)
    int lda, ldb, ldc;
    int align; // bytes every pointer is aligned to, capped at 16
} PlanKey;

typedef struct {
    PlanKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c; // c serves as the layout of C and of D (in place)
    cublasLtMatmulAlgo_t algo;
} Plan;

// Distinct shapes of a training run: ~4 per linear layer kind (fwd, dinp, dweight, and an
// eval batch), plus 3 per Muon matrix shape. Past this, plans are built per call.
#define PLAN_CACHE 256
static Plan plans[PLAN_CACHE];
static int n_plans;

// The largest power of two (up to 16) dividing the address.
static int align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int align = 16;
    while (align > 1 && a % (uintptr_t)align)
        align >>= 1;
    return align;
}

static const char *type_name(int t) {
    return t == CUDA_R_16BF ? "bf16" : t == CUDA_R_16F ? "fp16" : t == CUDA_R_32F ? "fp32" : "?";
}

// Asks the heuristic for the best algorithm of p's shape; `mask` filters reduction schemes.
static int pick_algo(Plan *p, uint32_t mask) {
    size_t ws_bytes;
    cuda_lt_workspace(&ws_bytes);
    uint64_t ws = ws_bytes;
    uint32_t align = (uint32_t)p->key.align;
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &ws, sizeof ws));
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                  &mask, sizeof mask));
    const cublasLtMatmulPreferenceAttributes_t aligns[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; i++)
        LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &align, sizeof align));
    cublasLtMatmulHeuristicResult_t result;
    memset(&result, 0, sizeof result);
    int found = 0;
    cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)cuda_lt_handle(), p->desc, p->a, p->b,
                                       p->c, p->c, pref, 1, &result, &found);
    LT_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (st != CUBLAS_STATUS_SUCCESS || found < 1 || result.state != CUBLAS_STATUS_SUCCESS)
        return -1;
    p->algo = result.algo;
    return 0;
}

static void plan_destroy(Plan *p);

// -1 when cuBLASLt has no algorithm for the shape (the backend's failure, recorded).
static int plan_build(Plan *p, const PlanKey *key) {
    memset(p, 0, sizeof *p); // handles a failed create leaves NULL, which destroy takes
    p->key = *key;
    cublasOperation_t op_a = (cublasOperation_t)key->op_a, op_b = (cublasOperation_t)key->op_b;
    LT_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    LT_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    // Stored (pre-op) shapes, column-major: op(A) is (m,k), op(B) is (k,n).
    int a_rows = op_a == CUBLAS_OP_N ? key->m : key->k;
    int a_cols = op_a == CUBLAS_OP_N ? key->k : key->m;
    int b_rows = op_b == CUBLAS_OP_N ? key->k : key->n;
    int b_cols = op_b == CUBLAS_OP_N ? key->n : key->k;
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->a, (cudaDataType_t)key->ab_type, (uint64_t)a_rows,
                                        (uint64_t)a_cols, key->lda));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->b, (cudaDataType_t)key->ab_type, (uint64_t)b_rows,
                                        (uint64_t)b_cols, key->ldb));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p->c, (cudaDataType_t)key->c_type, (uint64_t)key->m,
                                        (uint64_t)key->n, key->ldc));
    // No split-K first (see the header); should no such algorithm exist for a shape, any
    // scheme is still deterministic for a fixed algorithm (cuBLASLt's in-place reduction is
    // serialised by counters, the out-of-place ones reduce in a separate fixed pass).
    if (pick_algo(p, CUBLASLT_REDUCTION_SCHEME_NONE) &&
        pick_algo(p, CUBLASLT_REDUCTION_SCHEME_MASK)) {
        first_failure_record(
            &cuda_failures,
            "cuda backend: cuBLASLt has no algorithm for a GEMM on this GPU: A/B %s, C/D %s, "
            "op %c%c, m=%d n=%d k=%d, ld %d/%d/%d, %d-byte aligned",
            type_name(key->ab_type), type_name(key->c_type), key->op_a ? 'T' : 'N',
            key->op_b ? 'T' : 'N', key->m, key->n, key->k, key->lda, key->ldb, key->ldc,
            key->align);
        plan_destroy(p);
        return -1;
    }
    return 0;
}

static void plan_destroy(Plan *p) {
    cublasLtMatrixLayoutDestroy(p->c);
    cublasLtMatrixLayoutDestroy(p->b);
    cublasLtMatrixLayoutDestroy(p->a);
    cublasLtMatmulDescDestroy(p->desc);
}

// The cached plan of key, built on first use (NULL: none can be, recorded). Ops are issued
// from one thread (one rank, one GPU, one stream), so the table needs no lock.
static const Plan *plan_get(const PlanKey *key, Plan *spare, int *is_spare) {
    for (int i = 0; i < n_plans; i++)
        if (!memcmp(&plans[i].key, key, sizeof *key)) {
            *is_spare = 0;
            return &plans[i];
        }
    Plan *p = n_plans < PLAN_CACHE ? &plans[n_plans] : spare;
    if (plan_build(p, key)) return NULL;
    *is_spare = p == spare;
    if (!*is_spare) n_plans++;
    return p;
}

// ---------------------------------------------------------------- the one GEMM

// Row-major, in cblas_sgemm's terms: C: (M,N) = alpha * op(A): (M,K) @ op(B): (K,N)
// + beta * C, with A, B of ab_type and C of c_type. Column-major cuBLASLt sees each
// row-major matrix as its transpose, so this is C^T = op(B)^T @ op(A)^T: the operands swap
// and keep their transpose flags. K == 0 with beta == 0 clears C (beta == 1 leaves it).
static void gemm(cudaDataType_t ab_type, cudaDataType_t c_type, int trans_a, int trans_b, int M,
                 int N, int K, float alpha, const void *A, int lda, const void *B, int ldb,
                 float beta, void *C, int ldc) {
    if (M <= 0 || N <= 0) return;
    cudaStream_t stream = (cudaStream_t)cuda_stream();
    if (K <= 0) {
        size_t es = c_type == CUDA_R_16BF || c_type == CUDA_R_16F ? 2 : 4;
        if (beta == 0.0f)
            CUDA_CHECK(
                cudaMemset2DAsync(C, (size_t)ldc * es, 0, (size_t)N * es, (size_t)M, stream));
        return;
    }
    PlanKey key;
    memset(&key, 0, sizeof key);
    key.ab_type = ab_type;
    key.c_type = c_type;
    key.op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N; // cuBLASLt's A is our B
    key.op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N; // and its B our A
    key.m = N;
    key.n = M;
    key.k = K;
    key.lda = ldb;
    key.ldb = lda;
    key.ldc = ldc;
    int align = align_of(A);
    if (align_of(B) < align) align = align_of(B);
    if (align_of(C) < align) align = align_of(C);
    key.align = align;

    Plan spare;
    int is_spare;
    const Plan *p = plan_get(&key, &spare, &is_spare);
    if (!p) return; // the GEMM is skipped: its failure is recorded
    size_t ws_bytes;
    void *ws = cuda_lt_workspace(&ws_bytes);
    LT_CHECK(cublasLtMatmul((cublasLtHandle_t)cuda_lt_handle(), p->desc, &alpha, B, p->a, A, p->b,
                            &beta, C, p->c, C, p->c, &p->algo, ws, ws_bytes, stream));
    // The descriptors are host-side and read by the call, so an uncached plan can go now.
    if (is_spare) plan_destroy(&spare);
}

// fp32 row-major GEMM for Muon (optim.cu): cblas_sgemm(CblasRowMajor, ...) on the device.
extern "C" void cuda_sgemm_rm(int trans_a, int trans_b, int M, int N, int K, float alpha,
                              const float *A, int lda, const float *B, int ldb, float beta,
                              float *C, int ldc) {
    gemm(CUDA_R_32F, CUDA_R_32F, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// ---------------------------------------------------------------- the Backend ops

// out: (N,OC) = inp: (N,C) @ weight: (OC,C)^T (+ out if accumulate).
static void matmul_fwd(cudaDataType_t t, void *out, const void *inp, const void *weight, int N,
                       int C, int OC, int accumulate) {
    gemm(t, t, 0, 1, N, OC, C, 1.0f, inp, C, weight, C, accumulate ? 1.0f : 0.0f, out, OC);
}

// dinp: (N,C) = dout: (N,OC) @ weight: (OC,C) (+ dinp if accumulate_dinp);
// dweight: (OC,C) fp32 += dout^T: (OC,N) @ inp: (N,C). A NULL output is skipped.
static void matmul_bwd(cudaDataType_t t, void *dinp, float *dweight, const void *dout,
                       const void *inp, const void *weight, int N, int C, int OC,
                       int accumulate_dinp) {
    if (dinp)
        gemm(t, t, 0, 0, N, C, OC, 1.0f, dout, OC, weight, C, accumulate_dinp ? 1.0f : 0.0f, dinp,
             C);
    if (dweight) gemm(t, CUDA_R_32F, 1, 0, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
}

#define MATMUL_OPS(S, TYPE)                                                                        \
    void cuda_matmul_fwd_##S(void *out, const void *inp, const void *weight, int N, int C, int OC, \
                             int accumulate) {                                                     \
        matmul_fwd(TYPE, out, inp, weight, N, C, OC, accumulate);                                  \
    }                                                                                              \
    void cuda_matmul_bwd_##S(void *dinp, float *dweight, const void *dout, const void *inp,        \
                             const void *weight, int N, int C, int OC, int accumulate_dinp) {      \
        matmul_bwd(TYPE, dinp, dweight, dout, inp, weight, N, C, OC, accumulate_dinp);             \
    }

extern "C" {
MATMUL_OPS(f32, CUDA_R_32F)
MATMUL_OPS(bf16, CUDA_R_16BF)
MATMUL_OPS(f16, CUDA_R_16F)
} // extern "C"
