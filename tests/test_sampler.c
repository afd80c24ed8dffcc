// test_sampler.c: the RDSampler semantics (docs/design.md §8, docs/sampler.md).
// With arguments it prints orders for tests/test_astrai_data.py, which checks
// them against tests/ref/sampler.py:
//   test_sampler perm N SEED SHUFFLE                  -> the epoch permutation
//   test_sampler order N WORLD RANK SEED EPOCH SHUFFLE -> one rank's order
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "data/sampler.h"

static int is_permutation(const int64_t *p, int64_t n) {
    char *seen = calloc((size_t)n + 1, 1);
    int ok = seen != NULL;
    for (int64_t i = 0; ok && i < n; i++) {
        ok = p[i] >= 0 && p[i] < n && !seen[p[i]];
        if (ok) seen[p[i]] = 1;
    }
    free(seen);
    return ok;
}

static void test_init_errors(void) {
    Sampler s;
    Err err = {0};
    CHECK(sampler_init(&s, 0, 1, 0, 1, 1, &err) == -1 && strstr(err.msg, "0 samples"));
    CHECK(sampler_init(&s, 5, 0, 0, 1, 1, &err) == -1 && strstr(err.msg, "world_size 0"));
    CHECK(sampler_init(&s, 5, 2, 2, 1, 1, &err) == -1 && strstr(err.msg, "rank 2"));
    CHECK(sampler_init(&s, 5, 2, -1, 1, 1, &err) == -1 && strstr(err.msg, "rank -1"));
}

static void test_permutations(void) {
    int64_t p[257], q[257];
    for (int64_t n = 1; n <= 257; n += 16) {
        for (uint64_t seed = 0; seed < 4; seed++) {
            sampler_permutation(n, seed, 1, p);
            CHECK_MSG(is_permutation(p, n), "n=%" PRId64 " seed=%" PRIu64, n, seed);
            sampler_permutation(n, seed, 1, q);
            CHECK(memcmp(p, q, (size_t)n * sizeof *p) == 0); // deterministic
        }
        sampler_permutation(n, 99, 0, p);
        for (int64_t i = 0; i < n; i++)
            CHECK(p[i] == i); // shuffle off: identity
    }
    sampler_permutation(100, 1, 1, p);
    sampler_permutation(100, 2, 1, q);
    CHECK(memcmp(p, q, 100 * sizeof *p) != 0);
    int64_t fixed = 0;
    for (int i = 0; i < 100; i++)
        fixed += p[i] == i;
    CHECK_MSG(fixed < 10, "%" PRId64 " fixed points: not shuffled", fixed);
}

// Each of the 6 orders of 3 elements is equally likely: chi-square over
// 6000 seeds stays below the 0.1% critical value for 5 degrees of freedom.
static void test_uniform(void) {
    int64_t p[3];
    int by_order[6] = {0}; // indexed by (first element, whether the last two are swapped)
    for (uint64_t seed = 0; seed < 6000; seed++) {
        sampler_permutation(3, seed, 1, p);
        by_order[p[0] * 2 + (p[1] > p[2])]++;
    }
    double chi2 = 0;
    for (int k = 0; k < 6; k++)
        chi2 += (by_order[k] - 1000.0) * (by_order[k] - 1000.0) / 1000.0;
    CHECK_MSG(chi2 < 20.5, "chi2 %.2f", chi2);
}

// AstrAI's padding: the permutation followed by its head up to a multiple of
// world, then rank r takes every world-th entry starting at r.
static void expected_order(const int64_t *perm, int64_t n, int world, int rank, int64_t *out) {
    int64_t per = (n + world - 1) / world, total = per * world;
    int64_t *padded = malloc((size_t)total * sizeof *padded);
    memcpy(padded, perm, (size_t)n * sizeof *perm);
    for (int64_t i = n; i < total; i++)
        padded[i] = padded[i - n];
    for (int64_t k = 0; k < per; k++)
        out[k] = padded[rank + k * world];
    free(padded);
}

static void test_padding_and_striding(void) {
    const int64_t ns[5] = {1, 3, 10, 12, 37};
    const int worlds[4] = {1, 2, 4, 5};
    int64_t perm[64], want[64];
    for (int a = 0; a < 5; a++) {
        for (int b = 0; b < 4; b++) {
            int64_t n = ns[a];
            int world = worlds[b], covered[64] = {0}, total = 0;
            for (int rank = 0; rank < world; rank++) {
                Sampler s;
                Err err = {0};
                CHECK_MSG(sampler_init(&s, n, world, rank, 42, 1, &err) == 0, "%s", err.msg);
                sampler_set_epoch(&s, 3);
                sampler_permutation(n, 45, 1, perm); // seed + epoch
                expected_order(perm, n, world, rank, want);
                CHECK(s.per_replica == (n + world - 1) / world && s.epoch == 3);
                for (int64_t k = 0; k < s.per_replica; k++) {
                    CHECK_MSG(s.order[k] == want[k], "n=%" PRId64 " world=%d rank=%d k=%" PRId64, n,
                              world, rank, k);
                    covered[s.order[k]]++;
                    total++;
                }
                sampler_free(&s);
            }
            CHECK(total == (n + world - 1) / world * world);
            for (int64_t i = 0; i < n; i++)
                CHECK_MSG(covered[i] >= 1, "index %" PRId64, i);
        }
    }
}

// An epoch's order depends only on (seed + epoch): recomputing it after other
// epochs, or in a fresh sampler after a restart, gives the same order.
static void test_resume(void) {
    Sampler s, t;
    Err err = {0};
    CHECK(sampler_init(&s, 50, 4, 1, 7, 1, &err) == 0);
    CHECK(sampler_init(&t, 50, 4, 1, 7, 1, &err) == 0);
    int64_t first[13], epoch0[13];
    memcpy(epoch0, s.order, sizeof epoch0);
    sampler_set_epoch(&s, 2);
    memcpy(first, s.order, sizeof first);
    CHECK(memcmp(first, epoch0, sizeof first) != 0);
    sampler_set_epoch(&s, 5);
    sampler_set_epoch(&s, 2);
    CHECK(memcmp(first, s.order, sizeof first) == 0);
    sampler_set_epoch(&t, 2);
    CHECK(memcmp(first, t.order, sizeof first) == 0);
    sampler_free(&t);
    CHECK(sampler_init(&t, 50, 4, 1, 9, 1, &err) == 0); // seed 9, epoch 0 == seed 7, epoch 2
    CHECK(memcmp(first, t.order, sizeof first) == 0);
    sampler_free(&t);
    sampler_free(&s);

    CHECK(sampler_init(&s, 6, 1, 0, 7, 0, &err) == 0); // shuffle off, one rank: 0..n-1
    sampler_set_epoch(&s, 4);
    for (int64_t i = 0; i < 6; i++)
        CHECK(s.order[i] == i);
    sampler_free(&s);
}

static int print_orders(int argc, char **argv) {
    int64_t n = strtoll(argv[2], NULL, 10);
    if (n <= 0) return 2;
    int64_t *out = malloc((size_t)n * sizeof *out);
    int64_t count = n;
    if (strcmp(argv[1], "perm") == 0 && argc == 5) {
        sampler_permutation(n, strtoull(argv[3], NULL, 10), atoi(argv[4]), out);
    } else if (strcmp(argv[1], "order") == 0 && argc == 8) {
        Sampler s;
        Err err;
        if (sampler_init(&s, n, atoi(argv[3]), atoi(argv[4]), strtoull(argv[5], NULL, 10),
                         atoi(argv[7]), &err) != 0) {
            fprintf(stderr, "%s\n", err.msg);
            free(out);
            return 2;
        }
        sampler_set_epoch(&s, atol(argv[6]));
        count = s.per_replica;
        memcpy(out, s.order, (size_t)count * sizeof *out);
        sampler_free(&s);
    } else {
        free(out);
        return 2;
    }
    for (int64_t i = 0; i < count; i++)
        printf("%" PRId64 "%c", out[i], i + 1 < count ? ' ' : '\n');
    free(out);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 2) return print_orders(argc, argv);
    test_init_errors();
    test_permutations();
    test_uniform();
    test_padding_and_striding();
    test_resume();
    CHECK_DONE();
}
