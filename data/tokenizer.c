// tokenizer.c: the "bytes" tokenizer (token id = byte value, vocab 256).
#include "data/tokenizer.h"

#include <stdlib.h>
#include <string.h>

int tokenizer_lookup(const char *name, Tokenizer *tok, Err *err) {
    if (strcmp(name, "bytes") != 0)
        return err_set(err, "unknown tokenizer '%s' (known: bytes)", name);
    *tok = (Tokenizer){.name = "bytes", .vocab_size = 256};
    return 0;
}

int tokenizer_encode(const Tokenizer *tok, const char *text, size_t len, int32_t **ids,
                     int64_t *n_ids, Err *err) {
    *ids = malloc((len ? len : 1) * sizeof **ids);
    if (!*ids)
        return err_resource(err, "tokenizer %s: out of memory for %zu bytes", tok->name, len);
    for (size_t i = 0; i < len; i++)
        (*ids)[i] = (unsigned char)text[i];
    *n_ids = (int64_t)len;
    return 0;
}
