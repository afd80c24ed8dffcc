// sampler.c: the resumable distributed sampler (AstrAI RDSampler, docs/design.md §8).
// torch.randperm cannot be reproduced outside torch, so the permutation is our
// own, specified in docs/sampler.md and re-implemented in tests/ref/sampler.py:
// Fisher-Yates driven by splitmix64, with an unbiased bounded draw.
#include "data/sampler.h"

#include <inttypes.h>
#include <stdlib.h>

#include "common/splitmix64.h"

// Uniform in [0, bound) without modulo bias: draws below 2^64 mod bound are
// rejected, so the accepted range is a whole multiple of bound.
static uint64_t uniform_below(uint64_t *state, uint64_t bound) {
    uint64_t threshold = (0 - bound) % bound; // == 2^64 mod bound
    for (;;) {
        uint64_t x = splitmix64_next(state);
        if (x >= threshold) return x % bound;
    }
}

void sampler_permutation(int64_t n, uint64_t seed_plus_epoch, int shuffle, int64_t *perm) {
    for (int64_t i = 0; i < n; i++)
        perm[i] = i;
    if (!shuffle) return;
    uint64_t state = seed_plus_epoch;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)uniform_below(&state, (uint64_t)i + 1);
        int64_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
}

int sampler_init(Sampler *s, int64_t n, int world_size, int rank, uint64_t seed, int shuffle,
                 Err *err) {
    *s = (Sampler){0};
    if (n <= 0) return err_set(err, "sampler: the dataset has %" PRId64 " samples", n);
    if (world_size < 1) return err_set(err, "sampler: world_size %d is not >= 1", world_size);
    if (rank < 0 || rank >= world_size)
        return err_set(err, "sampler: rank %d is outside [0, %d)", rank, world_size);
    s->n = n;
    s->world_size = world_size;
    s->rank = rank;
    s->seed = seed;
    s->shuffle = shuffle;
    s->per_replica = (n + world_size - 1) / world_size;
    s->order = malloc((size_t)s->per_replica * sizeof *s->order);
    s->perm = malloc((size_t)n * sizeof *s->perm);
    if (!s->order || !s->perm) {
        sampler_free(s);
        return err_resource(err, "sampler: out of memory for %" PRId64 " samples", n);
    }
    s->epoch = -1;
    sampler_set_epoch(s, 0);
    return 0;
}

int sampler_init_split(Sampler *s, int64_t n_total, double val_split, int world_size, int rank,
                       uint64_t seed, int shuffle, Err *err) {
    if (val_split <= 0 || n_total <= 0)
        return sampler_init(s, n_total, world_size, rank, seed, shuffle, err);
    int64_t n_val = (int64_t)((double)n_total * val_split);
    if (n_val < 1) n_val = 1;
    int64_t n_train = n_total - n_val;
    if (n_train < 1)
        return err_set(err, "val_split: %g of %" PRId64 " windows leaves no training window",
                       val_split, n_total);
    int64_t *split = malloc((size_t)n_total * sizeof *split);
    if (!split) return err_resource(err, "sampler: out of memory for %" PRId64 " samples", n_total);
    // AstrAI's random_split(generator seeded random_seed): a seeded permutation, its head
    // for training and its tail held out, whatever --shuffle says.
    sampler_permutation(n_total, seed, 1, split);
    if (sampler_init(s, n_train, world_size, rank, seed, shuffle, err)) {
        free(split);
        return -1;
    }
    s->train_ids = split;
    s->val_ids = split + n_train;
    s->n_val = n_val;
    s->epoch = -1;
    sampler_set_epoch(s, 0); // again, now through train_ids
    return 0;
}

void sampler_free(Sampler *s) {
    free(s->train_ids); // val_ids is its tail
    free(s->order);
    free(s->perm);
    *s = (Sampler){0};
}

// Padded position p (0 <= p < per_replica*world) holds perm[p % n]: the head
// of the permutation repeated, as RDSampler's `indices += indices[:pad]`.
// Rank r takes padded positions r, r+world, r+2*world, ...
void sampler_set_epoch(Sampler *s, long epoch) {
    if (epoch == s->epoch) return;
    sampler_permutation(s->n, s->seed + (uint64_t)epoch, s->shuffle, s->perm);
    for (int64_t k = 0; k < s->per_replica; k++)
        s->order[k] = s->perm[(k * s->world_size + s->rank) % s->n];
    if (s->train_ids)
        for (int64_t k = 0; k < s->per_replica; k++)
            s->order[k] = s->train_ids[s->order[k]];
    s->epoch = epoch;
}
