// test_pipeline_partition.c: the pipeline's split of the decoder blocks into stages
// (train/pipeline.h pipeline_partition) against every split there is: contiguous, every stage at
// least one block, and no other split has a smaller largest stage (a block costs the same
// everywhere; the last stage adds the head). Configs from one block per stage to 12 blocks in 4
// stages, with heads from negligible to several blocks' worth.
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "train/pipeline.h"

static ModelConfig config(int layers, int vocab) {
    ModelConfig c = {.vocab_size = vocab,
                     .hidden_size = 64,
                     .num_hidden_layers = layers,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2,
                     .intermediate_size = 160,
                     .max_position_embeddings = 64};
    c.head_dim = 16;
    return c;
}

// The largest stage's cost of a split, in units where a block costs `block` and the head `head`.
static double worst(const int *blocks, int P, double block, double head) {
    double w = 0;
    for (int s = 0; s < P; s++) {
        double cost = (blocks[s + 1] - blocks[s]) * block + (s == P - 1 ? head : 0);
        if (cost > w) w = cost;
    }
    return w;
}

// The best largest-stage cost over every split of L blocks into P non-empty runs.
static double best_split(int L, int P, int s, int first, int *blocks, double block, double head) {
    if (s == P - 1) {
        blocks[P - 1] = first;
        blocks[P] = L;
        return first < L ? worst(blocks, P, block, head) : 1e300;
    }
    double best = 1e300;
    for (int end = first + 1; end <= L - (P - 1 - s); end++) {
        blocks[s] = first;
        double w = best_split(L, P, s + 1, end, blocks, block, head);
        if (w < best) best = w;
    }
    return best;
}

static void check_case(int L, int P, int vocab, long window) {
    ModelConfig c = config(L, vocab);
    int blocks[16], scratch[16];
    Err err = {0};
    CHECK(pipeline_partition(&c, P, window, blocks, &err) == 0);
    CHECK(blocks[0] == 0 && blocks[P] == L);
    for (int s = 0; s < P; s++)
        CHECK_MSG(blocks[s + 1] > blocks[s], "L=%d P=%d: stage %d is empty", L, P, s);
    // The costs pipeline.c uses, per token: a block's projections and attention, the head.
    double C = 64, FF = 160, QKV = (4 + 2 * 2) * 16;
    double block = C * QKV + C * C + 3 * C * FF + window * C, head = C * vocab;
    double got = worst(blocks, P, block, head), want = best_split(L, P, 0, 0, scratch, block, head);
    CHECK_MSG(got <= want * (1 + 1e-12), "L=%d P=%d vocab=%d: largest stage %.0f, best %.0f", L, P,
              vocab, got, want);
}

int main(void) {
    const int vocabs[] = {16, 256, 4096, 32000};
    for (int L = 1; L <= 12; L++)
        for (int P = 1; P <= 4 && P <= L; P++)
            for (int v = 0; v < 4; v++)
                check_case(L, P, vocabs[v], 64);
    // A head of about three blocks' cost: the last stage gets fewer blocks than the others.
    ModelConfig c = config(8, 32000);
    int blocks[3];
    Err err = {0};
    CHECK(pipeline_partition(&c, 2, 64, blocks, &err) == 0);
    CHECK_MSG(blocks[1] >= 5, "8 blocks, a heavy head: stage 0 holds %d blocks", blocks[1]);
    CHECK_DONE();
}
