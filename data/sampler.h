// sampler.h: the resumable distributed sampler (AstrAI RDSampler, DESIGN §8).
//
// Epoch e's order is a permutation of 0..n-1 seeded with seed+e (shuffle) or the
// identity, padded by repeating its head to a multiple of world_size, and
// strided by rank: rank r takes positions r, r+world, r+2*world, ...
// The permutation algorithm is documented in docs/sampler.md.
#pragma once
#include <stdint.h>

#include "common/error.h"

typedef struct {
    int64_t n; // dataset windows
    int world_size, rank;
    uint64_t seed;
    int shuffle;
    int64_t per_replica; // ceil(n / world_size)
    int64_t *order;      // (per_replica,) this rank's indices for the current epoch
    int64_t *perm;       // (n,) scratch: the current epoch's full permutation
    long epoch;          // epoch whose order is in `order`
} Sampler;

int sampler_init(Sampler *s, int64_t n, int world_size, int rank, uint64_t seed, int shuffle,
                 Err *err);
void sampler_free(Sampler *s);
// Computes this rank's order for epoch (no-op if already current).
void sampler_set_epoch(Sampler *s, long epoch);
// Fills perm[0..n) with epoch's full permutation (before padding/striding).
void sampler_permutation(int64_t n, uint64_t seed_plus_epoch, int shuffle, int64_t *perm);
