// context.cu: the process-wide CUDA context of a rank: its device, the compute stream, the
// cuBLASLt handle and workspace, the ops' scratch buffer, and the fatal-error path.
//
// One rank drives one GPU, so this state is global and set up once (cuda_context_open); the
// ops reach it through cuda_stream(), cuda_scratch() and the cuda_lt_* accessors below. It
// is never torn down: the driver reclaims everything at process exit, and tearing down while
// NCCL or a late op still uses the stream would only add failure modes.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/cuda/cuda_backend.h"

// cuBLASLt's workspace: enough for every algorithm the heuristics pick for our shapes on
// Hopper (NVIDIA recommends 32 MiB there).
#define CUDA_LT_WORKSPACE_BYTES ((size_t)32 << 20)
// bf16 tensor cores and the code we ship (sm_80, sm_90a, compute_90 PTX) need 8.0.
#define CUDA_MIN_MAJOR 8

static struct {
    int open;
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *workspace; // (CUDA_LT_WORKSPACE_BYTES)
    void *scratch;   // (CUDA_SCRATCH_BYTES)
} ctx = {0, -1, NULL, NULL, NULL, NULL};

extern "C" {

int cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); // no driver / no GPU: clear it so later checks do not see it
        return 0;
    }
    return n;
}

int cuda_current_device(void) {
    return ctx.open ? ctx.device : -1;
}

FirstFailure cuda_failures;

int cuda_failure(Err *err) {
    if (ctx.open) CUDA_CHECK(cudaStreamSynchronize(ctx.stream)); // what the ops left to run
    return first_failure_check(&cuda_failures, err);
}

void cuda_check_fail(int code, const char *call, const char *file, int line) {
    int device = ctx.device;
    if (device < 0 && cudaGetDevice(&device) != cudaSuccess) device = -1;
    first_failure_record(&cuda_failures, "cuda backend: CUDA error on device %d: %s in %s (%s:%d)",
                         device, cudaGetErrorString((cudaError_t)code), call, file, line);
}

void cuda_cublas_fail(int status, const char *call, const char *file, int line) {
    first_failure_record(&cuda_failures,
                         "cuda backend: cuBLASLt error on device %d: %s in %s (%s:%d)", ctx.device,
                         cublasLtGetStatusString((cublasStatus_t)status), call, file, line);
}

void *cuda_stream(void) {
    return (void *)ctx.stream;
}

void *cuda_scratch(size_t bytes) {
    if (!ctx.open) {
        first_failure_record(&cuda_failures,
                             "cuda backend: cuda_scratch(%zu) called before cuda_context_open",
                             bytes);
        return NULL;
    }
    if (bytes > CUDA_SCRATCH_BYTES) {
        first_failure_record(
            &cuda_failures,
            "cuda backend: device %d: an op asked for %zu bytes of scratch, more than the %zu "
            "of CUDA_SCRATCH_BYTES (a bug: raise it or split the op)",
            ctx.device, bytes, CUDA_SCRATCH_BYTES);
        return NULL;
    }
    return ctx.scratch;
}

void *cuda_lt_handle(void) {
    return (void *)ctx.lt;
}

void *cuda_lt_workspace(size_t *bytes) {
    *bytes = CUDA_LT_WORKSPACE_BYTES;
    return ctx.workspace;
}

int cuda_mem_info(size_t *free_b, size_t *total_b) {
    *free_b = *total_b = 0;
    if (cudaMemGetInfo(free_b, total_b) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return 0;
}

} // extern "C"

// Frees what a failed cuda_context_open created, clears the error, returns -1.
static int open_failed(void) {
    if (ctx.scratch) cudaFree(ctx.scratch);
    if (ctx.workspace) cudaFree(ctx.workspace);
    if (ctx.lt) cublasLtDestroy(ctx.lt);
    if (ctx.stream) cudaStreamDestroy(ctx.stream);
    ctx.scratch = ctx.workspace = NULL;
    ctx.lt = NULL;
    ctx.stream = NULL;
    ctx.device = -1;
    cudaGetLastError();
    return -1;
}

// Checks that `device` exists and can run our code; fills err otherwise.
static int check_device(int device, Err *err) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) cudaGetLastError();
    if (e == cudaErrorNoDevice || (e == cudaSuccess && n == 0))
        return err_resource(err, "CUDA device %d: no CUDA GPU is visible", device);
    if (e == cudaErrorInsufficientDriver) {
        int runtime = 0;
        cudaRuntimeGetVersion(&runtime);
        return err_resource(
            err,
            "CUDA device %d: no usable NVIDIA driver (none is loaded, or it is older "
            "than this CUDA %d.%d runtime)",
            device, runtime / 1000, runtime % 1000 / 10);
    }
    if (e != cudaSuccess)
        return err_resource(err, "CUDA device %d: no usable GPU: %s", device,
                            cudaGetErrorString(e));
    if (device < 0 || device >= n)
        return err_resource(err, "CUDA device %d: out of range, %d GPU%s visible (devices 0..%d)",
                            device, n, n == 1 ? " is" : "s are", n - 1);
    cudaDeviceProp prop;
    e = cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return err_resource(err, "CUDA device %d: cannot read its properties: %s", device,
                            cudaGetErrorString(e));
    }
    if (prop.major < CUDA_MIN_MAJOR)
        return err_resource(err,
                            "CUDA device %d (%s): compute capability %d.%d, astrai needs %d.0 or "
                            "newer (bf16 tensor cores)",
                            device, prop.name, prop.major, prop.minor, CUDA_MIN_MAJOR);
    return 0;
}

extern "C" int cuda_context_open(int device, Err *err) {
    if (ctx.open) {
        if (device == ctx.device) return 0;
        return err_resource(err, "CUDA device %d: this process already drives device %d", device,
                            ctx.device);
    }
    if (check_device(device, err)) return -1;
    ctx.device = device;
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        err_resource(err, "CUDA device %d: cannot select it: %s", device, cudaGetErrorString(e));
        return open_failed();
    }
    // Non-blocking: no implicit synchronisation with the legacy default stream, which
    // libraries (or cudaMemcpy without a stream) might use.
    cudaStream_t stream = NULL;
    e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) ctx.stream = stream;
    if (e != cudaSuccess) {
        err_resource(err, "CUDA device %d: cannot create a stream: %s", device,
                     cudaGetErrorString(e));
        return open_failed();
    }
    cublasLtHandle_t lt = NULL;
    cublasStatus_t st = cublasLtCreate(&lt);
    if (st == CUBLAS_STATUS_SUCCESS) ctx.lt = lt;
    if (st != CUBLAS_STATUS_SUCCESS) {
        err_resource(err, "CUDA device %d: cannot create the cuBLASLt handle: %s", device,
                     cublasLtGetStatusString(st));
        return open_failed();
    }
    void *workspace = NULL, *scratch = NULL;
    e = cudaMalloc(&workspace, CUDA_LT_WORKSPACE_BYTES);
    if (e == cudaSuccess) ctx.workspace = workspace;
    if (e == cudaSuccess) e = cudaMalloc(&scratch, CUDA_SCRATCH_BYTES);
    if (e == cudaSuccess) ctx.scratch = scratch;
    if (e != cudaSuccess) {
        err_resource(err,
                     "CUDA device %d: cannot allocate the %zu MiB of cuBLASLt workspace and "
                     "scratch: %s",
                     device, (CUDA_LT_WORKSPACE_BYTES + CUDA_SCRATCH_BYTES) >> 20,
                     cudaGetErrorString(e));
        return open_failed();
    }
    ctx.open = 1;
    return 0;
}
