// gemm.c: the matmuls of the bf16 and fp16 CPU backends (engine/backend.h's matmul_fwd and
// matmul_bwd; products accumulated in fp32, each compute-dtype output rounded once).
//
// Two paths, chosen per dtype at run time (one binary serves every CPU):
// - oneDNN (a build that found it: ASTRAI_HAVE_DNNL) where cpuid reports the dtype's own
//   instructions (bf16: avx512_bf16 or amx_bf16; fp16: avx512_fp16 or amx_fp16) and oneDNN
//   has more than its reference kernel for them: operands in the dtype, fp32 accumulation
//   into an fp32 dst, which is rounded here;
// - portable: the operands converted to fp32, then the fp32 backend's very sgemm call, so
//   its results are the fp32 backend's on the same rounded inputs, bit for bit.
// backend_cpu_set_gemm_path(CPU_GEMM_PORTABLE) forces the portable path (tests compare both in
// one process); ASTRAI_CPU_GEMM=portable in the environment does the same, read once, when the
// paths are first probed.
//
// Determinism: oneDNN gives the same bits run after run on the same machine with the same
// thread count (its reproducibility guarantee). Debian's build threads with OpenMP: its
// threads are the process's OpenMP threads (the trainer's omp_set_num_threads, --threads),
// the pool sgemm and the kernels use, so the count is fixed per run.
#include <cblas.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#ifdef ASTRAI_HAVE_DNNL
#include <dnnl.h>
#include <dnnl_debug.h>
#endif

#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/lowp.h"

// C: (M,N) fp32 = A: (M,K) @ B: (K,N), plus the old C if accumulate; A and B in the dtype
// of s, A stored as (K,M) row-major when a_t, B as (N,K) when b_t.
typedef void GemmFn(LowpStage *s, int M, int N, int K, const void *A, int a_t, const void *B,
                    int b_t, float *C, int accumulate);

static void portable_gemm(LowpStage *s, int M, int N, int K, const void *A, int a_t, const void *B,
                          int b_t, float *C, int accumulate) {
    const float *a = lowp_in(s, A, lowp_flat((size_t)M * K));
    const float *b = lowp_in(s, B, lowp_flat((size_t)K * N));
    if (s->failed) return;
    cblas_sgemm(CblasRowMajor, a_t ? CblasTrans : CblasNoTrans, b_t ? CblasTrans : CblasNoTrans, M,
                N, K, 1.0f, a, a_t ? M : K, b, b_t ? K : N, accumulate ? 1.0f : 0.0f, C, N);
}

// Whether the CPU has dtype's own GEMM instructions (cpuid leaf 7, subleaves 0 and 1).
static int cpu_has_lowp_gemm(DType dtype) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned a0, b0, c0, d0, a1 = 0, b1, c1, d1;
    if (!__get_cpuid_count(7, 0, &a0, &b0, &c0, &d0)) return 0;
    if (a0 >= 1) __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
    int amx_tile = d0 >> 24 & 1;
    if (dtype == DT_BF16) return (a1 >> 5 & 1) || (amx_tile && (d0 >> 22 & 1));
    return (d0 >> 23 & 1) || (amx_tile && (a1 >> 21 & 1));
#else
    (void)dtype;
    return 0;
#endif
}

// Per dtype (bf16, fp16), found once: whether oneDNN runs it, and each path's name.
static struct {
    int onednn;
    char fast[96], portable[96];
} paths[2];
static pthread_once_t probed = PTHREAD_ONCE_INIT;

#ifdef ASTRAI_HAVE_DNNL
static dnnl_engine_t engine;
static dnnl_stream_t stream;

// A failure here is a failed allocation inside oneDNN (the shapes were probed): the
// backend's failure (engine/backend.h), naming the op, the call and oneDNN's reason; the GEMM
// is skipped. Returns whether it failed.
static int dnnl_failed(LowpStage *s, dnnl_status_t status, const char *call) {
    if (status == dnnl_success) return 0;
    first_failure_record(&cpu_failures, "cpu %s backend: %s: oneDNN %s failed: %s",
                         dtype_name(s->dtype), s->op, call, dnnl_status2str(status));
    s->failed = 1;
    return 1;
}
#define DNNL_FAILED(call) dnnl_failed(s, (call), #call)

// The matmul of GemmFn in dtype: plain strided operands (no reordering), dst fp32, the old
// dst added by a sum post-op when accumulate.
static dnnl_status_t matmul_pd(dnnl_primitive_desc_t *pd, DType dtype, int M, int N, int K, int a_t,
                               int b_t, int accumulate) {
    dnnl_data_type_t t = dtype == DT_BF16 ? dnnl_bf16 : dnnl_f16;
    dnnl_dims_t da = {M, K}, db = {K, N}, dc = {M, N};
    dnnl_dims_t sa = {a_t ? 1 : K, a_t ? M : 1}, sb = {b_t ? 1 : N, b_t ? K : 1}, sc = {N, 1};
    dnnl_memory_desc_t ma, mb, mc;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t post = NULL;
    dnnl_status_t st;
    if ((st = dnnl_memory_desc_init_by_strides(&ma, 2, da, t, sa)) ||
        (st = dnnl_memory_desc_init_by_strides(&mb, 2, db, t, sb)) ||
        (st = dnnl_memory_desc_init_by_strides(&mc, 2, dc, dnnl_f32, sc)) ||
        (st = dnnl_matmul_desc_init(&desc, &ma, &mb, NULL, &mc)) ||
        (st = dnnl_primitive_attr_create(&attr)) || (st = dnnl_post_ops_create(&post)) ||
        (accumulate && (st = dnnl_post_ops_append_sum(post, 1.0f))) ||
        (st = dnnl_primitive_attr_set_post_ops(attr, post)))
        *pd = NULL;
    else
        st = dnnl_primitive_desc_create(pd, &desc, attr, engine, NULL);
    dnnl_post_ops_destroy(post);
    dnnl_primitive_attr_destroy(attr);
    return st;
}

// oneDNN caches the compiled kernels by shape (its primitive cache): a descriptor and a
// primitive per call cost microseconds.
static void onednn_gemm(LowpStage *s, int M, int N, int K, const void *A, int a_t, const void *B,
                        int b_t, float *C, int accumulate) {
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t prim = NULL;
    const dnnl_query_t what[3] = {dnnl_query_src_md, dnnl_query_weights_md, dnnl_query_dst_md};
    const int arg[3] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST};
    void *data[3] = {(void *)A, (void *)B, C}; // oneDNN only reads src and weights
    dnnl_exec_arg_t args[3] = {{0}};
    int made = 0; // memories created
    if (s->failed || DNNL_FAILED(matmul_pd(&pd, s->dtype, M, N, K, a_t, b_t, accumulate)) ||
        DNNL_FAILED(dnnl_primitive_create(&prim, pd)))
        goto done;
    for (; made < 3; made++) {
        args[made].arg = arg[made];
        if (DNNL_FAILED(dnnl_memory_create(&args[made].memory,
                                           dnnl_primitive_desc_query_md(pd, what[made], 0), engine,
                                           data[made])))
            goto done;
    }
    if (!DNNL_FAILED(dnnl_primitive_execute(prim, stream, 3, args)))
        DNNL_FAILED(dnnl_stream_wait(stream));
done:
    for (int i = 0; i < made; i++)
        dnnl_memory_destroy(args[i].memory);
    if (prim) dnnl_primitive_destroy(prim);
    if (pd) dnnl_primitive_desc_destroy(pd);
}

// Whether oneDNN runs dtype's GEMMs on more than its reference kernel; names the kernel in
// fast, or why not in portable.
static int onednn_probe(DType dtype, char *fast, char *portable, size_t size) {
    if (!engine && (dnnl_engine_create(&engine, dnnl_cpu, 0) ||
                    dnnl_stream_create(&stream, engine, dnnl_stream_default_flags))) {
        snprintf(portable, size, "portable (convert, then sgemm): no oneDNN CPU engine");
        return 0;
    }
    dnnl_primitive_desc_t pd;
    const char *impl = NULL;
    if (matmul_pd(&pd, dtype, 64, 64, 64, 0, 1, 0)) {
        snprintf(portable, size, "portable (convert, then sgemm): no %s matmul in oneDNN",
                 dtype_name(dtype));
        return 0;
    }
    dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    int ok = impl && strncmp(impl, "ref", 3);
    if (ok)
        snprintf(fast, size, "onednn %s", impl);
    else
        snprintf(portable, size, "portable (convert, then sgemm): oneDNN's %s matmul is %s",
                 dtype_name(dtype), impl ? impl : "unnamed");
    dnnl_primitive_desc_destroy(pd);
    return ok;
}
#endif

static _Atomic int gemm_path = -1; // CpuGemmPath; -1: not set yet (the environment decides)

void backend_cpu_set_gemm_path(CpuGemmPath path) {
    gemm_path = (int)path;
}

static void probe(void) {
    const char *force = getenv("ASTRAI_CPU_GEMM");
    int unset = -1;
    atomic_compare_exchange_strong(&gemm_path, &unset,
                                   force && !strcmp(force, "portable") ? CPU_GEMM_PORTABLE
                                                                       : CPU_GEMM_AUTO);
    for (int i = 0; i < 2; i++) {
        DType dtype = i ? DT_F16 : DT_BF16;
        snprintf(paths[i].portable, sizeof paths[i].portable,
                 "portable (convert, then sgemm): no %s GEMM instructions on this CPU (%s)",
                 dtype_name(dtype), i ? "avx512_fp16, amx_fp16" : "avx512_bf16, amx_bf16");
        if (!cpu_has_lowp_gemm(dtype)) continue;
#ifdef ASTRAI_HAVE_DNNL
        paths[i].onednn =
            onednn_probe(dtype, paths[i].fast, paths[i].portable, sizeof paths[i].portable);
#else
        snprintf(paths[i].portable, sizeof paths[i].portable,
                 "portable (convert, then sgemm): built without oneDNN");
#endif
    }
}

static int forced_portable(void) {
    pthread_once(&probed, probe);
    return gemm_path == CPU_GEMM_PORTABLE;
}

static int use_onednn(DType dtype) {
    return !forced_portable() && paths[dtype == DT_F16].onednn;
}

static GemmFn *gemm_of(DType dtype) {
#ifdef ASTRAI_HAVE_DNNL
    if (use_onednn(dtype)) return onednn_gemm;
#else
    (void)dtype;
#endif
    return portable_gemm;
}

const char *backend_cpu_gemm_path(DType dtype) {
    if (dtype == DT_F32) return "sgemm (OpenBLAS)";
    if (use_onednn(dtype)) return paths[dtype == DT_F16].fast;
    if (forced_portable())
        return "portable (convert, then sgemm): forced (ASTRAI_CPU_GEMM=portable)";
    return paths[dtype == DT_F16].portable;
}

void cpu_lowp_matmul_fwd(DType dtype, void *out, const void *inp, const void *weight, int N, int C,
                         int OC, int accumulate) {
    LowpStage s = {dtype, 0, "matmul_fwd", 0};
    LowpView vo = lowp_flat((size_t)N * OC);
    float *acc = lowp_out(&s, out, vo, accumulate);
    gemm_of(dtype)(&s, N, OC, C, inp, 0, weight, 1, acc, accumulate); // inp @ weight^T
    lowp_store(&s, out, acc, vo);
}

void cpu_lowp_matmul_bwd(DType dtype, void *dinp, float *dweight, const void *dout, const void *inp,
                         const void *weight, int N, int C, int OC, int accumulate_dinp) {
    LowpStage s = {dtype, 0, "matmul_bwd", 0};
    GemmFn *gemm = gemm_of(dtype);
    if (dinp) {
        LowpView vi = lowp_flat((size_t)N * C);
        float *acc = lowp_out(&s, dinp, vi, accumulate_dinp);
        gemm(&s, N, C, OC, dout, 0, weight, 0, acc, accumulate_dinp); // dinp = dout @ weight
        lowp_store(&s, dinp, acc, vi);
    }
    gemm(&s, OC, C, N, dout, 1, inp, 0, dweight, 1); // dweight: (OC,C) += dout^T @ inp
}
