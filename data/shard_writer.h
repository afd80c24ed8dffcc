// shard_writer.h: writes one AstrAI "bin" shard directory (DESIGN §8):
// dir/meta.json {"<key>": {"shape": [N], "dtype": "int32"}, ...} and one
// little-endian int32 file dir/<key>.bin per key, all keys of length N.
#pragma once
#include <stdint.h>

#include "common/error.h"

typedef struct {
    const char *key;     // "sequence", "loss_mask", "position_ids"
    const int32_t *data; // (n,)
} ShardArray;

// Writes the shard atomically: the files go into the hidden temporary sibling
// .<name>.tmp.<pid> (dataset readers skip hidden entries), are fsynced, and the directory is
// renamed to dir (then the parent is fsynced), so a crash leaves either no shard or a whole one.
// The parent is created if needed; dir itself must not exist yet.
int shard_write(const char *dir, const ShardArray *arrays, int n_arrays, int64_t n, Err *err);
