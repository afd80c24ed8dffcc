// backend.c: the CPU backend table (engine/backend.h), memory ops and the sgemm matmuls.
// Backend memory is host memory: upload and download are copies, compute is fp32 (the bf16 and
// fp16 tables: lowp.c).
#include <cblas.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "engine/backend.h"
#include "engine/cpu/cpu_kernels.h"

// Buffers from this size on (weights, gradients, activations) are backed by transparent
// huge pages: far fewer page faults when first touched (costly here, ~20 us each under a
// hypervisor) and fewer TLB misses in the matmuls.
enum { HUGE_PAGE = 2 << 20 };

static void *cpu_alloc(size_t bytes, Err *err) {
    // 64-byte alignment for AVX loads, 2 MiB for huge pages; calloc semantics (zeroed).
    size_t align = bytes >= HUGE_PAGE ? HUGE_PAGE : 64;
    size_t rounded = bytes ? (bytes + align - 1) / align * align : align;
    void *p = rounded >= bytes ? aligned_alloc(align, rounded) : NULL;
    if (!p) {
        err_resource(err, "out of memory allocating %.1f MiB", (double)bytes / (1 << 20));
        return NULL;
    }
    if (align == HUGE_PAGE) madvise(p, rounded, MADV_HUGEPAGE); // a hint: failure is harmless
    memset(p, 0, rounded);
    return p;
}

static void cpu_zero(void *p, size_t bytes) {
    memset(p, 0, bytes);
}
static void cpu_copy(void *dst, const void *src, size_t bytes) {
    memcpy(dst, src, bytes);
}
static void cpu_free(void *p) {
    free(p);
}

static void *cpu_host_alloc(size_t bytes, Err *err) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        err_resource(err, "out of memory allocating %.1f MiB of host memory",
                     (double)bytes / (1 << 20));
    return p;
}
static void cpu_cast_from_f32(void *dst, const float *src, size_t n) {
    memcpy(dst, src, n * sizeof(float)); // the compute dtype is fp32
}
static void cpu_download_f32(float *host, const void *src, size_t n) {
    memcpy(host, src, n * sizeof(float));
}
static void cpu_sync(void) {}
static void *cpu_stream(void) {
    return NULL;
}

// Every CPU table's (fp32, bf16, fp16): one process trains in one dtype.
FirstFailure cpu_failures;

int cpu_failure(Err *err) {
    return first_failure_check(&cpu_failures, err);
}

void cpu_matmul_fwd(void *out_, const void *inp_, const void *weight_, int N, int C, int OC,
                    int accumulate) {
    float *out = out_;
    const float *inp = inp_;
    const float *weight = weight_;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C,
                accumulate ? 1.0f : 0.0f, out, OC);
}

void cpu_matmul_bwd(void *dinp_, float *dweight, const void *dout_, const void *inp_,
                    const void *weight_, int N, int C, int OC, int accumulate_dinp) {
    float *dinp = dinp_;
    const float *dout = dout_;
    const float *inp = inp_;
    const float *weight = weight_;
    // dinp: (N,C) = dout: (N,OC) @ weight: (OC,C)
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
                    accumulate_dinp ? 1.0f : 0.0f, dinp, C);
    // dweight: (OC,C) += dout^T: (OC,N) @ inp: (N,C)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
                dweight, C);
}

static const Backend cpu_backend = {
    .name = "cpu",
    .dtype = DT_F32,
    .device = -1,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .zero = cpu_zero,
    .copy = cpu_copy,
    .upload = cpu_copy,
    .download = cpu_copy,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_free,
    .cast_from_f32 = cpu_cast_from_f32,
    .download_f32 = cpu_download_f32,
    .sync = cpu_sync,
    .stream = cpu_stream,
    .failure = cpu_failure,
    .matmul_fwd = cpu_matmul_fwd,
    .matmul_bwd = cpu_matmul_bwd,
    .copy_rows = cpu_copy_rows,
    .embedding_fwd = cpu_embedding_fwd,
    .embedding_bwd = cpu_embedding_bwd,
    .rmsnorm_fwd = cpu_rmsnorm_fwd,
    .rmsnorm_bwd = cpu_rmsnorm_bwd,
    .rope_fwd = cpu_rope_fwd,
    .rope_bwd = cpu_rope_bwd,
    .attention_reserve = cpu_attention_reserve,
    .attention_fwd = cpu_attention_fwd,
    .attention_bwd = cpu_attention_bwd,
    .attention_decode = cpu_attention_decode,
    .moe_route = cpu_moe_route,
    .moe_route_bwd = cpu_moe_route_bwd,
    .moe_combine = cpu_moe_combine,
    .moe_combine_bwd = cpu_moe_combine_bwd,
    .swiglu_fwd = cpu_swiglu_fwd,
    .swiglu_bwd = cpu_swiglu_bwd,
    .sigmoid_gate_fwd = cpu_sigmoid_gate_fwd,
    .sigmoid_gate_bwd = cpu_sigmoid_gate_bwd,
    .cross_entropy_fwd = cpu_cross_entropy_fwd,
    .cross_entropy_bwd = cpu_cross_entropy_bwd,
    .loss_mean_add = cpu_loss_mean_add,
    .dpo_loss = cpu_dpo_loss,
    .grpo_loss = cpu_grpo_loss,
    .gaussian_noise_add = cpu_gaussian_noise_add,
    .sum_squares = cpu_sum_squares,
    .scale = cpu_scale,
    .adamw = cpu_adamw,
    .muon = cpu_muon,
};

const Backend *backend_cpu(void) {
    return &cpu_backend;
}
