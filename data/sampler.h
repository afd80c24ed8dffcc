// sampler.h: the resumable distributed sampler (AstrAI RDSampler, docs/design.md §8).
//
// Epoch e's order is a permutation of 0..n-1 seeded with seed+e (shuffle) or the
// identity, padded by repeating its head to a multiple of world_size, and
// strided by rank: rank r takes positions r, r+world, r+2*world, ...
// The permutation algorithm is documented in docs/sampler.md.
//
// With a validation split (--val_split, AstrAI's random_split seeded with random_seed)
// the dataset's windows are split once: p = permutation(n_total, seed, shuffled);
// training windows are p[0..n_train), validation windows p[n_train..n_total), with
// n_val = max(1, floor(n_total * val_split)). The sampler then runs over the n_train
// training windows and `order` holds dataset window indices.
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
    int64_t *train_ids;  // (n,) dataset window of training sample i; NULL: the identity
    int64_t n_val;       // held-out windows (0: no validation split)
    int64_t *val_ids;    // (n_val,) dataset windows held out for validation
} Sampler;

int sampler_init(Sampler *s, int64_t n, int world_size, int rank, uint64_t seed, int shuffle,
                 Err *err);
// As sampler_init over n_total windows of which a fraction val_split (0: none) is held out
// for validation (see above); an error when no training window would remain.
int sampler_init_split(Sampler *s, int64_t n_total, double val_split, int world_size, int rank,
                       uint64_t seed, int shuffle, Err *err);
void sampler_free(Sampler *s);
// Computes this rank's order for epoch (no-op if already current).
void sampler_set_epoch(Sampler *s, long epoch);
// Fills perm[0..n) with epoch's full permutation (before padding/striding).
void sampler_permutation(int64_t n, uint64_t seed_plus_epoch, int shuffle, int64_t *perm);
