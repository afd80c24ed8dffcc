// tokenizer.h: text <-> token ids for astrai-data. Two kinds:
//   "bytes"                     token id = byte value, vocabulary 256;
//   a Hugging Face tokenizer.json (or the directory holding it, with tokenizer_config.json
//   optionally beside it): its BPE model, normalizer, pre-tokenizer, added tokens and decoder,
//   giving the ids of tokenizers' encode(text, add_special_tokens=False) exactly. A component
//   that cannot be reproduced exactly is refused when opened (docs/data.md, Tokenizers).
// A Tokenizer is not for concurrent use: encoding caches words in it.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef struct Tokenizer Tokenizer;

// Opens spec: "bytes", a tokenizer.json file, or a directory holding tokenizer.json. Errors
// (bad input) name the file and the key at fault.
int tokenizer_open(const char *spec, Tokenizer **out, Err *err);

// The number of ids: max id + 1 over the vocabulary and the added tokens.
int tokenizer_vocab_size(const Tokenizer *t);

// Encodes text[0..len) (UTF-8 unless "bytes") into a malloc'd array *ids of *n_ids token ids.
// Special tokens in the text are matched; no BOS/EOS is added.
int tokenizer_encode(const Tokenizer *t, const char *text, size_t len, int32_t **ids,
                     int64_t *n_ids, Err *err);

// Decodes ids into a malloc'd, NUL-terminated *text of *len bytes (tokenizers' decode);
// skip_special drops the special added tokens. An id outside the vocabulary is an error.
int tokenizer_decode(const Tokenizer *t, const int32_t *ids, int64_t n, int skip_special,
                     char **text, size_t *len, Err *err);

// A string of tokenizer_config.json ("chat_template", "bos_token", "eos_token", ...; a token
// given as {"content": ...} too), or NULL if absent.
const char *tokenizer_config_string(const Tokenizer *t, const char *key);

// A boolean of tokenizer_config.json ("add_bos_token", "add_eos_token"), or dflt if absent.
bool tokenizer_config_bool(const Tokenizer *t, const char *key, bool dflt);

// The id of an added token or a vocabulary token, or -1.
int tokenizer_token_id(const Tokenizer *t, const char *token);

void tokenizer_free(Tokenizer *t);
