// pref_batch.c: records -> model rows (train/pref_batch.h).
#include "train/pref_batch.h"

#include <stdlib.h>
#include <string.h>

int pref_batch_init(PrefBatch *b, const RecordSet *rs, int max_records, int64_t window, Err *err) {
    memset(b, 0, sizeof *b);
    b->group = rs->group_size;
    b->max_rows = max_records * b->group;
    b->window = window;
    size_t n = (size_t)b->max_rows * (size_t)window;
    b->inputs = malloc(n * sizeof(int32_t));
    b->targets = malloc(n * sizeof(int32_t));
    b->loss_mask = malloc(n * sizeof(int32_t));
    b->advantages = calloc((size_t)b->max_rows, sizeof(float));
    if (!b->inputs || !b->targets || !b->loss_mask || !b->advantages)
        return err_resource(err, "batch of %d rows of %lld tokens: out of memory", b->max_rows,
                            (long long)window);
    return 0;
}

void pref_batch_free(PrefBatch *b) {
    free(b->inputs);
    free(b->targets);
    free(b->loss_mask);
    free(b->advantages);
    memset(b, 0, sizeof *b);
}

// Where the batch puts response j of its k-th record.
static int row_of(const PrefBatch *b, const RecordSet *rs, int k, int j, int n) {
    return rs->kind == RECORDS_DPO ? j * n + k : k * b->group + j;
}

// Moves the rows from a stride of `window` to a stride of T (T <= window, rows in increasing
// order: a row's new place never overlaps a row not moved yet).
static void compact_rows(PrefBatch *b) {
    for (int r = 1; r < b->rows; r++) {
        size_t from = (size_t)r * b->window, to = (size_t)r * b->T, bytes = b->T * sizeof(int32_t);
        memmove(b->inputs + to, b->inputs + from, bytes);
        memmove(b->targets + to, b->targets + from, bytes);
        memmove(b->loss_mask + to, b->loss_mask + from, bytes);
    }
}

void pref_batch_fill(PrefBatch *b, const RecordSet *rs, const int64_t *ids, int64_t stride, int n) {
    b->rows = n * b->group;
    b->T = 1;
    b->counted = 0;
    b->tokens = 0;
    b->reward_sum = 0;
    for (int k = 0; k < n; k++) {
        int64_t r = ids[k * stride];
        for (int j = 0; j < b->group; j++) {
            size_t at = (size_t)row_of(b, rs, k, j, n) * b->window;
            int len = records_row(rs, r, j, b->window, b->inputs + at, b->targets + at,
                                  b->loss_mask + at);
            if (len > b->T) b->T = len;
            b->tokens += len;
            for (int t = 0; t < len; t++)
                b->counted += b->loss_mask[at + t] != 0;
        }
        if (rs->reward) {
            const float *rewards = rs->reward + r * b->group;
            pref_group_advantages(rewards, b->group, b->advantages + (size_t)k * b->group);
            for (int j = 0; j < b->group; j++)
                b->reward_sum += rewards[j];
        }
    }
    compact_rows(b);
}
