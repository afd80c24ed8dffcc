// rng.h: a small seeded RNG (xoshiro256** seeded by splitmix64) for model init.
// The same seed gives the same numbers on every machine and thread count.
#pragma once
#include <stdint.h>

typedef struct {
    uint64_t s[4];
    int has_spare; // Box-Muller makes normals in pairs
    float spare;
} Rng;

void rng_seed(Rng *r, uint64_t seed);
uint64_t rng_next_u64(Rng *r);
// Uniform in [0, 1).
double rng_uniform(Rng *r);
// Normal with the given mean and standard deviation.
float rng_normal(Rng *r, float mean, float std);
