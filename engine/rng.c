// rng.c: xoshiro256** (Blackman & Vigna) seeded with splitmix64; Box-Muller normals.
#include "engine/rng.h"

#include <math.h>

#include "common/splitmix64.h"

static uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

void rng_seed(Rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64_next(&seed);
    r->has_spare = 0;
    r->spare = 0.0f;
}

uint64_t rng_next_u64(Rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double rng_uniform(Rng *r) {
    return (double)(rng_next_u64(r) >> 11) * 0x1.0p-53;
}

float rng_normal(Rng *r, float mean, float std) {
    if (r->has_spare) {
        r->has_spare = 0;
        return mean + std * r->spare;
    }
    double u1 = 1.0 - rng_uniform(r), u2 = rng_uniform(r); // u1 in (0,1]: log is finite
    double radius = sqrt(-2.0 * log(u1)), angle = 2.0 * M_PI * u2;
    r->spare = (float)(radius * sin(angle));
    r->has_spare = 1;
    return mean + std * (float)(radius * cos(angle));
}
