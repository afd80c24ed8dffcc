// context_stub.cpp: stand-ins for the parts of the CUDA backend that the emulated files
// call but that are not emulated themselves: the context (engine/cuda/context.cu: stream,
// scratch buffer, failures) and Muon's GEMM (engine/cuda/matmul.cu: cuBLASLt), here
// cblas_sgemm, the GEMM the CPU reference runs.
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cuda/cuda_backend.h"
#include "tests/cuda_emu/emu.h"

// The compute stream: any distinct non-NULL value; emu.cpp checks every launch and copy
// against it (ops must not use the legacy default stream).
static char stream_tag;
void *cuda_stream(void) {
    return &stream_tag;
}

size_t emu_scratch_peak; // the most bytes an op asked for (reported by the test)

// Like the device buffer: 256-byte aligned, and its contents left by earlier ops are
// garbage to the next: every call fills the bytes asked for with 0xff (NaN as float or
// double), so an op that reads scratch before writing it gets NaNs.
void *cuda_scratch(size_t bytes) {
    static void *buf;
    static size_t have;
    if (bytes > CUDA_SCRATCH_BYTES) {
        fprintf(stderr, "cuda_emu: cuda_scratch(%zu) over CUDA_SCRATCH_BYTES\n", bytes);
        abort();
    }
    if (bytes > have) {
        free(buf);
        have = (bytes + 255) & ~(size_t)255;
        buf = aligned_alloc(256, have);
        if (!buf) abort();
    }
    if (bytes > emu_scratch_peak) emu_scratch_peak = bytes;
    memset(buf, 0xff, bytes);
    return buf;
}

// engine/backend.h's failure rule, as context.cu keeps it (without a stream to wait for).
FirstFailure cuda_failures;
int cuda_failure(Err *err) {
    return first_failure_check(&cuda_failures, err);
}

// A CUDA error in the emulator is a bug of the emulated code or of emu.cpp: abort at once.
void cuda_check_fail(int code, const char *call, const char *file, int line) {
    fprintf(stderr, "cuda_emu: %s failed at %s:%d: %s (%d)\n", call, file, line,
            cudaGetErrorString(code), code);
    abort();
}

// Row-major C = alpha op(A) op(B) + beta C, as matmul.cu's cuBLASLt version.
extern "C" void cuda_sgemm_rm(int trans_a, int trans_b, int M, int N, int K, float alpha,
                              const float *A, int lda, const float *B, int ldb, float beta,
                              float *C, int ldc) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
