// half.h: the 2-byte floats' conversions to and from fp32 (bf16, fp16: common/dtype.h), the one
// implementation that the CPU backend's reduced dtypes (engine/cpu/lowp.c), the safetensors
// reader and writer (ckpt/) and the tests use. Decoding is exact; encoding rounds to nearest,
// ties to even, and keeps a NaN a NaN.
#pragma once
#include <stdint.h>
#include <string.h>

static inline uint32_t half_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float half_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    return half_float((uint32_t)h << 16);
}

// Round to nearest, ties to even.
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = half_bits(f);
    // A NaN whose payload sits in the low half would round to infinity: keep it a quiet NaN.
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

// Exact (every fp16 is an fp32); NaN keeps its sign and payload.
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    if (exp == 0x1F) return half_float(sign | 0x7F800000u | mant << 13); // inf, NaN
    if (exp) return half_float(sign | (exp + 112) << 23 | mant << 13);   // rebias 15 -> 127
    return half_float(sign | half_bits((float)mant * 0x1p-24f)); // zero, subnormal: mant 2^-24
}

// Round to nearest, ties to even: |f| from 65520 on (half way past the largest fp16, 65504)
// is inf, below 2^-14 a subnormal (multiples of 2^-24), 2^-25 and less 0; NaN stays a NaN
// (quiet, sign and the payload's top bits kept).
static inline uint16_t f32_to_f16(float f) {
    uint32_t u = half_bits(f), a = u & 0x7FFFFFFFu;
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
