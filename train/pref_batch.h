// pref_batch.h: a DPO/GRPO micro-batch of records (data/records.h) as the model rows of
// engine/preference.h: DPO rows [0,n) the chosen responses of the n records and [n,2n) their
// rejected ones; GRPO record b's response j at row b*G + j. T is the longest row's length;
// shorter rows end in padding that is neither attended to by real tokens (attention is causal
// and the padding comes last) nor counted.
#pragma once
#include <stdint.h>

#include "common/error.h"
#include "data/records.h"
#include "engine/preference.h"

typedef struct {
    int rows, T;         // the batch in flight: rows of T tokens
    int counted;         // its response tokens (targets the loss covers)
    long tokens;         // its real tokens (the sum of the row lengths)
    double reward_sum;   // GRPO: the sum of its records' rewards
    int32_t *inputs;     // (max_rows * window) (rows, T) once filled
    int32_t *targets;    // likewise
    int32_t *loss_mask;  // likewise: 1 on response targets
    float *advantages;   // (max_rows) GRPO: each row's group-normalised advantage
    int max_rows, group; // rows per record: 2 (DPO) or G (GRPO)
    int64_t window;
} PrefBatch;

// Room for max_records records of rs's kind and group size in `window` input positions.
int pref_batch_init(PrefBatch *b, const RecordSet *rs, int max_records, int64_t window, Err *err);
void pref_batch_free(PrefBatch *b);

// Fills the batch with the n records ids[0], ids[stride], ..., ids[(n-1)*stride].
void pref_batch_fill(PrefBatch *b, const RecordSet *rs, const int64_t *ids, int64_t stride, int n);
