// lowp.h: bf16 and fp16 on the CPU: how the reduced-dtype backend (lowp.c, gemm.c) stages its
// tensors in fp32 (the element conversions are common/half.h's).
//
// The reduced-dtype ops read every compute-dtype tensor into fp32 scratch, run the fp32
// kernel on it (math in fp32 registers, fp32 accumulation) and round each output back to
// nearest even, once.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/dtype.h"
#include "common/half.h"

// dst: (n) fp32 = src: (n) in dtype (DT_BF16 or DT_F16); exact.
void lowp_to_f32(DType dtype, float *dst, const void *src, size_t n);
// dst: (n) in dtype = src: (n) fp32, rounded to nearest even.
void lowp_from_f32(DType dtype, void *dst, const float *src, size_t n);

// ---------------------------------------------------------------- fp32 staging (lowp.c)

// The part of a tensor an op reads or writes: `rows` rows of `width` elements, `stride`
// elements apart (the grouped rows of engine/backend.h, or one flat row).
typedef struct {
    size_t rows, width, stride;
} LowpView;

static inline LowpView lowp_flat(size_t n) {
    return (LowpView){1, n, n};
}

static inline LowpView lowp_rows(int rows, int width, int stride) {
    return (LowpView){(size_t)rows, (size_t)width, (size_t)stride};
}

// One op's fp32 copies of its reduced-dtype tensors, each in the next of this thread's
// scratch buffers (kept and grown across ops). A copy has its tensor's layout: element i of
// the tensor is element i of the copy, so the fp32 kernels run on the copies unchanged. A
// growth that fails is the backend's failure (engine/backend.h: cpu_fail, naming op and
// size): the stage is `failed`, lowp_in and lowp_out then return NULL, lowp_store does
// nothing, and the op skips its kernel.
typedef struct {
    DType dtype;
    int used;       // scratch buffers taken so far
    const char *op; // for the failure's message (the op's function name)
    int failed;
} LowpStage;

// The stage of an op of lowp_table.h (LOWP_DT: its dtype).
#define LOWP_STAGE                                                                                 \
    { LOWP_DT, 0, __func__, 0 }

// An fp32 copy of the view v of src (NULL once the stage failed).
const float *lowp_in(LowpStage *s, const void *src, LowpView v);
// fp32 scratch for the view v of an output: its current values when load (accumulation or
// in-place ops), else undefined (the kernel writes all of v).
float *lowp_out(LowpStage *s, const void *dst, LowpView v, int load);
// The view v of dst = src rounded (nothing once the stage failed).
void lowp_store(const LowpStage *s, void *dst, const float *src, LowpView v);

// ---------------------------------------------------------------- matmuls (gemm.c)
// engine/backend.h's matmul_fwd and matmul_bwd in dtype.
void cpu_lowp_matmul_fwd(DType dtype, void *out, const void *inp, const void *weight, int N, int C,
                         int OC, int accumulate);
void cpu_lowp_matmul_bwd(DType dtype, void *dinp, float *dweight, const void *dout, const void *inp,
                         const void *weight, int N, int C, int OC, int accumulate_dinp);
