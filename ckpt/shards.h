// shards.h: tensors spread over several safetensors files in Hugging Face's sharded layout
// (docs/design.md §14), the form of `--ckpt_format sharded` checkpoints:
//
//   STEM-00001-of-0000N.safetensors ... STEM-0000N-of-0000N.safetensors
//   STEM.safetensors.index.json  {"metadata": {"total_size": BYTES},
//                                 "weight_map": {"tensor name": "STEM-0000K-of-0000N.safetensors"}}
//
// STEM is "model" or "optimizer". A tensor lives whole in one file; when several files hold a
// tensor of the same name (each optimizer file has its own "step"), the index maps it to the
// first. total_size counts the bytes of the tensors the index maps.
#pragma once
#include <stddef.h>

#include "ckpt/safetensors.h"
#include "common/error.h"

// "STEM-0000K-of-0000N.safetensors" for file k (1-based) of n.
void shards_file_name(char *out, size_t cap, const char *stem, int k, int n);

// Whether dir holds STEM in either layout (STEM.safetensors or STEM.safetensors.index.json).
int shards_present(const char *dir, const char *stem);

// Opens dir/STEM.safetensors, else the set dir/STEM.safetensors.index.json names, as one StFile
// whose tensors are those of the index's weight_map (mmap: a reader touches only the tensors it
// reads). The index is validated before any file is opened: a weight_map of strings naming
// plain file names in dir ending in .safetensors; then every mapped tensor must be in its file.
// Errors name the index, the file and the tensor at fault. st_close frees the set. path (cap
// bytes) gets what was opened, for messages: the file, or the index of the set.
int shards_open(StFile *f, const char *dir, const char *stem, char *path, size_t cap, Err *err);

// Writes dir/STEM.safetensors.index.json (fsynced) for the n files STEM-*-of-n in dir, from
// their headers.
int shards_write_index(const char *dir, const char *stem, int n, Err *err);
