// shard_writer.h: writes one shard directory (docs/design.md §8, docs/data.md): dir/meta.json
// {"<key>": {"shape": [n], "dtype": "int32"|"float32"}, ...} and one little-endian file
// dir/<key>.bin per key. AstrAI's token shards have int32 keys all of one length; record shards
// (data/records.h) have keys of their own lengths, a float32 key and header members.
#pragma once
#include <stdint.h>

#include "common/dtype.h"
#include "common/error.h"

// A key of a token shard: int32, as long as every other key of the shard.
typedef struct {
    const char *key;     // "sequence", "loss_mask", "position_ids"
    const int32_t *data; // (n,)
} ShardArray;

// A key of any length and dtype.
typedef struct {
    const char *key;  // "prompt", "reward", ...
    const void *data; // (n,) int32_t or float, as dtype says
    int64_t n;
    DType dtype; // DT_I32 or DT_F32
} ShardKey;

// A token shard: every array holds n int32 elements.
int shard_write(const char *dir, const ShardArray *arrays, int n_arrays, int64_t n, Err *err);

// The general form: keys of their own length and dtype; `head` (NULL: none) holds JSON members
// written first in meta.json ("\"format\": \"dpo\", \"records\": 3").
//
// Writes the shard atomically: the files go into the hidden temporary sibling
// .<name>.tmp.<pid> (dataset readers skip hidden entries), are fsynced, and the directory is
// renamed to dir (then the parent is fsynced), so a crash leaves either no shard or a whole one.
// The parent is created if needed; dir itself must not exist yet.
int shard_write_keys(const char *dir, const char *head, const ShardKey *keys, int n_keys, Err *err);
