// lowp.h: bf16 and fp16 on the CPU: the element conversions (any folder may use them; they
// belong in common/ next to dtype.h) and how the reduced-dtype backend (lowp.c, gemm.c) stages
// its tensors in fp32.
//
// The reduced-dtype ops read every compute-dtype tensor into fp32 scratch, run the fp32
// kernel on it (math in fp32 registers, fp32 accumulation) and round each output back to
// nearest even, once.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/dtype.h"

static inline uint32_t lowp_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float lowp_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float lowp_bf16_to_f32(uint16_t h) {
    return lowp_float((uint32_t)h << 16);
}

// Round to nearest, ties to even; the same bits as ckpt's st_f32_to_bf16.
static inline uint16_t lowp_f32_to_bf16(float f) {
    uint32_t u = lowp_bits(f);
    // A NaN whose payload sits in the low half would round to infinity: keep it a quiet NaN.
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

// Exact (every fp16 is an fp32); NaN keeps its sign and payload.
static inline float lowp_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0x1F) return lowp_float(sign | 0x7F800000u | mant << 13); // inf, NaN
    if (exp) return lowp_float(sign | (exp + 112) << 23 | mant << 13);   // rebias 15 -> 127
    return lowp_float(sign | lowp_bits((float)mant * 0x1p-24f)); // zero, subnormal: mant 2^-24
}

// Round to nearest, ties to even: |f| from 65520 on (half way past the largest fp16, 65504)
// is inf, below 2^-14 a subnormal (multiples of 2^-24), 2^-25 and less 0; NaN stays a NaN
// (quiet, sign and the payload's top bits kept).
static inline uint16_t lowp_f32_to_f16(float f) {
    uint32_t u = lowp_bits(f), a = u & 0x7FFFFFFFu;
    uint16_t sign = (uint16_t)(u >> 16 & 0x8000);
    if (a > 0x7F800000u) return sign | 0x7E00 | (uint16_t)(a >> 13 & 0x3FF);
    if (a >= 0x477FF000u) return sign | 0x7C00;
    if (a >= 0x38800000u) // normal: drop 13 mantissa bits, rebias the exponent 127 -> 15
        return sign | (uint16_t)((a + 0xFFFu + ((a >> 13) & 1) - 0x38000000u) >> 13);
    int shift = 126 - (int)(a >> 23); // the value in units of 2^-24: mant >> shift
    if (shift > 24) return sign;      // below 2^-25, or exactly 2^-25: a tie, to even 0
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u, half = 1u << (shift - 1);
    uint32_t q = mant >> shift, rest = mant & ((half << 1) - 1);
    // rounding up to 0x400 is the smallest normal, as it should be
    return sign | (uint16_t)(q + (rest > half || (rest == half && (q & 1))));
}

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
// scratch buffers (kept and grown across ops; a failed growth aborts naming the size, as the
// ops cannot fail). A copy has its tensor's layout: element i of the tensor is element i of
// the copy, so the fp32 kernels run on the copies unchanged.
typedef struct {
    DType dtype;
    int used; // scratch buffers taken so far
} LowpStage;

// An fp32 copy of the view v of src.
const float *lowp_in(LowpStage *s, const void *src, LowpView v);
// fp32 scratch for the view v of an output: its current values when load (accumulation or
// in-place ops), else undefined (the kernel writes all of v).
float *lowp_out(LowpStage *s, const void *dst, LowpView v, int load);
// The view v of dst = src rounded.
void lowp_store(const LowpStage *s, void *dst, const float *src, LowpView v);

// ---------------------------------------------------------------- matmuls (gemm.c)
// engine/backend.h's matmul_fwd and matmul_bwd in dtype.
void cpu_lowp_matmul_fwd(DType dtype, void *out, const void *inp, const void *weight, int N, int C,
                         int OC, int accumulate);
void cpu_lowp_matmul_bwd(DType dtype, void *dinp, float *dweight, const void *dout, const void *inp,
                         const void *weight, int N, int C, int OC, int accumulate_dinp);
