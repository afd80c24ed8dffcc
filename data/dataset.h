// dataset.h: AstrAI "bin" datasets and their windows (docs/design.md §8).
//
// root/**/meta.json describe shards; each key (sequence, loss_mask,
// position_ids) is a little-endian int32 array file <key>.bin with meta.json
// {"<key>": {"shape":[N],"dtype":"int32"}, ...}. Shards are concatenated per key
// in sorted path order.
#pragma once
#include <stdint.h>

#include "common/error.h"

typedef struct {
    int32_t *sequence;     // (n_tokens,)
    int32_t *loss_mask;    // (n_tokens,) or NULL when not loaded
    int32_t *position_ids; // (n_tokens,) or NULL when not loaded
    int64_t n_tokens;
    int n_shards;
} Dataset;

// The shards under root: every meta.json below it (hidden entries skipped, symlinked
// directories not followed), sorted by path (byte-wise). *paths: a malloc'd array of *n malloc'd
// strings (dataset_free_shards). A root that is not a directory or holds no meta.json is an
// error naming it. (data/records.c lists record shards with it too.)
int dataset_find_shards(const char *root, char ***paths, int *n, Err *err);
void dataset_free_shards(char **paths, int n);

// Loads every shard under root; a record shard (data/records.h) is refused naming its format.
// need_sft: loss_mask and position_ids are required. Errors name the shard file and key
// ("d/part0/meta.json: key 'loss_mask' missing").
int dataset_open(Dataset *d, const char *root, int need_sft, Err *err);
void dataset_close(Dataset *d);

// Fails naming the first token id >= vocab_size (or < 0) and its position.
int dataset_check_vocab(const Dataset *d, int vocab_size, Err *err);

// Fails naming the first position id >= max_positions (or < 0), its value and token index
// (position_ids only; a no-op when they are not loaded).
int dataset_check_positions(const Dataset *d, int max_positions, Err *err);

// n = (T-1-w)//stride + 1 if T > w else 0
int64_t dataset_num_windows(int64_t n_tokens, int64_t window, int64_t stride);

// Window i: begin = min(i*stride, T-1-w), end = min(begin+w, T-1).
// Fills inputs[0..w), targets[0..w); loss_mask / position_ids when non-NULL
// (from loss_mask[begin+1:end+1] and position_ids[begin:end]).
void dataset_window(const Dataset *d, int64_t i, int64_t window, int64_t stride, int32_t *inputs,
                    int32_t *targets, int32_t *loss_mask, int32_t *position_ids);
