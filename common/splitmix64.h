// splitmix64.h: splitmix64 (Steele, Lea, Flood 2014), the one 64-bit mixer of the project:
// it seeds the init RNG (engine/rng.c), drives the sampler's shuffle (data/sampler.c, specified
// in docs/sampler.md) and, through its finaliser alone, the counter-based noise of
// engine/counter_rng.h. C and CUDA (common/hd.h).
#pragma once
#include <stdint.h>

#include "common/hd.h"

#define SPLITMIX64_GAMMA 0x9e3779b97f4a7c15ULL // the golden gamma the state advances by

// The finaliser: a bijection of 64-bit words whose outputs look independent.
HD_FN uint64_t splitmix64_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// The next output of the stream whose state is *state.
HD_FN uint64_t splitmix64_next(uint64_t *state) {
    return splitmix64_mix(*state += SPLITMIX64_GAMMA);
}
