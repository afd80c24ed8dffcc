// test_attention_decode.c: the CPU backend's attention_decode (one query per sequence over a
// KV cache) against attention_fwd: the cache holds a batch's k, v rows, and the query of
// position t, decoded over keys [first key of t, t], must give forward's output row t bit for
// bit (the same tiles and arithmetic per row), for every t; causal and with a sliding window,
// GQA groups of 1 to more than a tile's rows, sequences shorter and longer than a key block.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/splitmix64.h"
#include "engine/backend.h"

static uint64_t rng = 7;

static float *uniform(size_t n) {
    float *x = malloc(n * sizeof *x + 1);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((double)(splitmix64_next(&rng) >> 11) * 0x1p-52 - 1.0);
    return x;
}

// B sequences of T tokens; window W (0: causal).
static void check_rows(int B, int T, int H, int KVH, int D, int W) {
    const Backend *be = backend_cpu();
    int S = (H + 2 * KVH) * D, KVD = KVH * D;
    size_t N = (size_t)B * T;
    float *qkv = uniform(N * S), *out = uniform(N * H * D), *lse = uniform(N * H),
          *kc = malloc(N * KVD * sizeof *kc), *vc = malloc(N * KVD * sizeof *vc),
          *q = malloc((size_t)B * S * sizeof *q), *dec = malloc((size_t)B * H * D * sizeof *dec);
    int32_t *doc = malloc(N * sizeof *doc), *span = malloc(2 * (size_t)B * sizeof *span);
    for (size_t n = 0; n < N; n++) {
        int t = (int)(n % T), first = W ? t - W + 1 : 0;
        doc[n] = first > 0 ? first : 0;
    }
    // the cache (B, T, KVH, D): each sequence's k and v rows
    be->copy_rows(kc, KVD, qkv + H * D, S, (int)N, KVD);
    be->copy_rows(vc, KVD, qkv + (H + KVH) * D, S, (int)N, KVD);
    Err err = {0};
    CHECK(!be->attention_reserve(T, D, &err));
    be->attention_fwd(out, lse, qkv, qkv + H * D, qkv + (H + KVH) * D, doc, B, T, H, KVH, D, S);
    int bad = 0;
    for (int t = 0; t < T; t++) {
        for (int b = 0; b < B; b++) { // sequence b's query of position t
            memcpy(q + (size_t)b * S, qkv + ((size_t)b * T + t) * S, (size_t)H * D * sizeof *q);
            span[b] = doc[(size_t)b * T + t];
            span[B + b] = t + 1;
        }
        be->attention_decode(dec, q, kc, vc, span, B, H, KVH, D, S, T);
        for (int b = 0; b < B; b++)
            bad += memcmp(dec + (size_t)b * H * D, out + ((size_t)b * T + t) * H * D,
                          (size_t)H * D * sizeof *dec) != 0;
    }
    CHECK_MSG(!bad, "B=%d T=%d H=%d KVH=%d D=%d W=%d: %d rows differ from attention_fwd's", B, T, H,
              KVH, D, W, bad);
    CHECK(!be->failure(&err));
    free(qkv), free(out), free(lse), free(kc), free(vc), free(q), free(dec), free(doc), free(span);
}

int main(void) {
    check_rows(2, 5, 4, 2, 8, 0);
    check_rows(3, 40, 8, 1, 16, 0);   // a group of 8 query heads: two tiles of rows
    check_rows(2, 37, 6, 2, 24, 0);   // a group of 3: a short tile
    check_rows(2, 70, 4, 4, 8, 21);   // a window past several key blocks
    check_rows(1, 33, 2, 1, 32, 1);   // each query sees itself only
    check_rows(4, 17, 2, 2, 12, 100); // a window longer than the sequences
    CHECK_DONE();
}
