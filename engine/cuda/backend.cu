// backend.cu: the CUDA Backend tables (engine/backend.h), one per compute dtype, and their
// memory ops: device allocation, zeroing, copies and host transfers on the compute stream.
//
// Every op is stream-ordered on cuda_stream(); only alloc, upload, download and sync wait
// (alloc so the memory is zeroed before any other stream, e.g. NCCL's, can touch it;
// upload and download so the host buffer is free, or filled, when they return).
#include <cuda_runtime.h>
#include <stdio.h>

#include "engine/cuda/cuda_backend.h"

#define MIB(bytes) ((double)(bytes) / (1024.0 * 1024.0))

static cudaStream_t stream(void) {
    return (cudaStream_t)cuda_stream();
}

// Zeroed device memory of `bytes` (at least 256, cudaMalloc's alignment), or NULL with err
// naming the GPU, the size and what was free.
static void *cuda_alloc(size_t bytes, Err *err) {
    int device = cuda_current_device();
    void *p = NULL;
    size_t asked = bytes ? bytes : 256;
    cudaError_t e = cudaMalloc(&p, asked);
    if (e != cudaSuccess) {
        cudaGetLastError(); // not sticky: clear it so later launch checks do not trip on it
        size_t free_b, total_b;
        if (e == cudaErrorMemoryAllocation && !cuda_mem_info(&free_b, &total_b))
            err_resource(err,
                         "GPU %d: out of memory allocating %.1f MiB (%.0f MiB free of %.0f MiB)",
                         device, MIB(bytes), MIB(free_b), MIB(total_b));
        else
            err_resource(err, "GPU %d: cannot allocate %.1f MiB: %s", device, MIB(bytes),
                         cudaGetErrorString(e));
        return NULL;
    }
    CUDA_CHECK(cudaMemsetAsync(p, 0, asked, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    return p;
}

// Ordered after the compute stream's last use of p (backend.h "free"): the stream is
// drained first, so the ordering holds with any allocator, not only through cudaFree's
// device-wide synchronisation (a caching or stream-ordered allocator would hand the
// block out again while a kernel still reads it).
static void cuda_free(void *p) {
    if (!p) return;
    CUDA_CHECK(cudaStreamSynchronize(stream()));
    CUDA_CHECK(cudaFree(p));
}

static void cuda_zero(void *p, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream()));
}

static void cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
}

// The caller may reuse `host` as soon as this returns: a copy from pinned memory would
// still be in flight without the sync (from pageable memory CUDA stages it anyway).
static void cuda_upload(void *dst, const void *host, size_t bytes) {
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
}

static void cuda_download(void *host, const void *src, size_t bytes) {
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream()));
    CUDA_CHECK(cudaStreamSynchronize(stream()));
}

// Pinned: a download into it runs at the bus's speed and needs no staging copy (the host copy
// of an asynchronous checkpoint, which training waits for).
static void *cuda_host_alloc(size_t bytes, Err *err) {
    void *p = NULL;
    cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        err_resource(err, "cannot allocate %.1f MiB of pinned host memory: %s", MIB(bytes),
                     cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cuda_host_free(void *p) {
    if (p) CUDA_CHECK(cudaFreeHost(p));
}

static void cuda_sync(void) {
    CUDA_CHECK(cudaStreamSynchronize(stream()));
}

// ---------------------------------------------------------------- the tables

#define FILL_DTYPE_OPS(b, S)                                                                       \
    do {                                                                                           \
        (b)->cast_from_f32 = cuda_cast_from_f32_##S;                                               \
        (b)->download_f32 = cuda_download_f32_##S;                                                 \
        (b)->matmul_fwd = cuda_matmul_fwd_##S;                                                     \
        (b)->matmul_bwd = cuda_matmul_bwd_##S;                                                     \
        (b)->embedding_fwd = cuda_embedding_fwd_##S;                                               \
        (b)->embedding_bwd = cuda_embedding_bwd_##S;                                               \
        (b)->rmsnorm_fwd = cuda_rmsnorm_fwd_##S;                                                   \
        (b)->rmsnorm_bwd = cuda_rmsnorm_bwd_##S;                                                   \
        (b)->rope_fwd = cuda_rope_fwd_##S;                                                         \
        (b)->rope_bwd = cuda_rope_bwd_##S;                                                         \
        (b)->attention_fwd = cuda_attention_fwd_##S;                                               \
        (b)->attention_bwd = cuda_attention_bwd_##S;                                               \
        (b)->attention_decode = cuda_attention_decode_##S;                                         \
        (b)->copy_rows = cuda_copy_rows_##S;                                                       \
        (b)->moe_route = cuda_moe_route_##S;                                                       \
        (b)->moe_route_bwd = cuda_moe_route_bwd_##S;                                               \
        (b)->moe_combine = cuda_moe_combine_##S;                                                   \
        (b)->moe_combine_bwd = cuda_moe_combine_bwd_##S;                                           \
        (b)->swiglu_fwd = cuda_swiglu_fwd_##S;                                                     \
        (b)->swiglu_bwd = cuda_swiglu_bwd_##S;                                                     \
        (b)->sigmoid_gate_fwd = cuda_sigmoid_gate_fwd_##S;                                         \
        (b)->sigmoid_gate_bwd = cuda_sigmoid_gate_bwd_##S;                                         \
        (b)->cross_entropy_fwd = cuda_cross_entropy_fwd_##S;                                       \
        (b)->cross_entropy_bwd = cuda_cross_entropy_bwd_##S;                                       \
        (b)->gaussian_noise_add = cuda_gaussian_noise_add_##S;                                     \
    } while (0)

static void fill_table(Backend *b, DType dtype, int device) {
    *b = Backend();
    b->name = "cuda";
    b->dtype = dtype;
    b->device = device;
    b->alloc = cuda_alloc;
    b->free = cuda_free;
    b->zero = cuda_zero;
    b->copy = cuda_copy;
    b->upload = cuda_upload;
    b->download = cuda_download;
    b->host_alloc = cuda_host_alloc;
    b->host_free = cuda_host_free;
    b->sync = cuda_sync;
    b->stream = cuda_stream;
    b->failure = cuda_failure;
    if (dtype == DT_BF16)
        FILL_DTYPE_OPS(b, bf16);
    else if (dtype == DT_F16)
        FILL_DTYPE_OPS(b, f16);
    else
        FILL_DTYPE_OPS(b, f32);
    b->loss_mean_add = cuda_loss_mean_add;
    b->dpo_loss = cuda_dpo_loss;
    b->grpo_loss = cuda_grpo_loss;
    b->sum_squares = cuda_sum_squares;
    b->scale = cuda_scale;
    b->adamw = cuda_adamw;
    b->muon = cuda_muon;
}

extern "C" const Backend *cuda_backend(DType dtype) {
    static Backend tables[3]; // fp32, bf16, fp16
    static int filled[3];
    int device = cuda_current_device();
    if (device < 0) return NULL; // cuda_context_open has not succeeded
    int i = dtype == DT_BF16 ? 1 : dtype == DT_F16 ? 2 : 0;
    if (!filled[i]) {
        fill_table(&tables[i], dtype, device);
        filled[i] = 1;
    }
    return &tables[i];
}
