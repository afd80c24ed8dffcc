// tokenizer.h: text -> token ids for astrai-data. Only the "bytes" tokenizer
// exists (vocab 256, token id = byte value), enough to train on raw text
// without a vocabulary file.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef struct {
    const char *name;
    int vocab_size;
} Tokenizer;

// Finds a tokenizer by name ("bytes"); an unknown name is an error naming it.
int tokenizer_lookup(const char *name, Tokenizer *tok, Err *err);

// Encodes text[0..len) into a malloc'd array *ids of *n_ids token ids.
int tokenizer_encode(const Tokenizer *tok, const char *text, size_t len, int32_t **ids,
                     int64_t *n_ids, Err *err);
