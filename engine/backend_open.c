// backend_open.c: choosing a rank's backend (engine/backend.h): the CPU one, or the CUDA
// one when it was built in (engine/cuda/, ASTRAI_HAVE_CUDA) and the GPU is usable.

#include "engine/backend.h"
#ifdef ASTRAI_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

int backend_reserve(const Backend *be, void **buf, size_t *cap, size_t bytes, Err *err) {
    if (bytes <= *cap) return 0;
    be->free(*buf);
    *cap = 0;
    if (!(*buf = be->alloc(bytes, err))) return err_prefix(err, "a %zu-byte buffer", bytes);
    *cap = bytes;
    return 0;
}

size_t muon_scratch_floats(int rows, int cols) {
    size_t r = (size_t)(rows < cols ? rows : cols);
    return 2 * (size_t)rows * (size_t)cols + 2 * r * r + 4; // + 2 doubles of norms
}

int backend_cuda_available(void) {
#ifdef ASTRAI_HAVE_CUDA
    return cuda_device_count() > 0;
#else
    return 0;
#endif
}

static int open_cuda(const Backend **out, int device, DType dtype, Err *err) {
#ifdef ASTRAI_HAVE_CUDA
    if (cuda_context_open(device, err)) return -1;
    *out = cuda_backend(dtype);
    return 0;
#else
    (void)out, (void)device, (void)dtype;
    return err_set(err, "device_type cuda: this astrai was built without the CUDA backend "
                        "(configure with -DASTRAI_CUDA=ON on a machine with the CUDA toolkit)");
#endif
}

int backend_open(const Backend **out, BackendKind kind, int device, DType dtype, Err *err) {
    if (kind == BACKEND_CUDA) return open_cuda(out, device, dtype, err);
    if (!(*out = backend_cpu_dtype(dtype)))
        return err_set(err, "dtype %s: the CPU backend computes in fp32, bf16 or fp16",
                       dtype_name(dtype));
    return 0;
}
