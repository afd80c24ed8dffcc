// counter_rng.h: counter-based normal draws, a pure function of (seed, index), for noise
// added inside a kernel (NEFTune): every element draws on its own, so the numbers do not
// depend on the thread count, the backend's launch layout or the order of the work. The
// same header compiles as C (engine/cpu/) and as CUDA (engine/cuda/); the two agree up to the
// rounding of their logf/cosf.
#pragma once
#include <math.h>
#include <stdint.h>

#include "common/splitmix64.h"

// A standard normal for element i of the stream `seed` (Box-Muller on two 24-bit uniforms;
// u1 in (0, 1], so the logarithm is finite).
HD_FN float counter_normal(uint64_t seed, uint64_t i) {
    uint64_t bits = splitmix64_mix(splitmix64_mix(seed) + SPLITMIX64_GAMMA * (i + 1));
    float u1 = ((float)(bits >> 40) + 1.0f) * 0x1.0p-24f;
    float u2 = (float)((bits >> 16) & 0xffffffu) * 0x1.0p-24f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795865f * u2);
}
