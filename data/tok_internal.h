// tok_internal.h: the parts of the tokenizer.json tokenizer (data/tokenizer.h), shared by
// tokenizer.c (open, added tokens, encode/decode), tok_bpe.c (the BPE model), tok_pretok.c
// (normalizers, pre-tokenizers), tok_decode.c (decoders), tok_map.c (hash maps) and
// tok_text.c (UTF-8, piece lists, regexes, JSON getters). Each reproduces the component of
// Hugging Face tokenizers 0.20 of the same name; what it cannot reproduce is refused.
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "common/error.h"

// ------------------------------------------------------------ hash maps (tok_map.c)

typedef struct {
    size_t off;   // the key's bytes in keys.data
    uint32_t len; // bytes
    int32_t val;
} StrEntry;

// Byte string -> int32, open addressing. Keys are copied.
typedef struct {
    uint32_t *slots; // (cap,) entry index + 1; 0: empty
    size_t cap;      // a power of two, or 0
    StrEntry *entries;
    size_t n, entries_cap;
    Buf keys;
} StrMap;

// Sets key's value (replacing an earlier one): 0, or -1 out of memory.
int strmap_put(StrMap *m, const char *key, size_t len, int32_t val);
// The value of key, or -1 when absent.
int32_t strmap_get(const StrMap *m, const char *key, size_t len);
// Empties the map, keeping its memory.
void strmap_clear(StrMap *m);
void strmap_free(StrMap *m);

// (id a, id b) -> (rank, new id): BPE merges.
typedef struct {
    uint64_t *keys; // (cap,) a << 32 | b; UINT64_MAX: empty
    uint32_t *rank;
    int32_t *new_id;
    size_t cap, n;
} PairMap;

int pairmap_put(PairMap *m, int32_t a, int32_t b, uint32_t rank, int32_t new_id);
// 1 and (*rank, *new_id) when (a, b) is a merge, else 0.
int pairmap_get(const PairMap *m, int32_t a, int32_t b, uint32_t *rank, int32_t *new_id);
void pairmap_free(PairMap *m);

// ------------------------------------------------------------ text (tok_text.c)

// The code point at s[0..n) (n >= 1) into *cp: its length in bytes, or 0 when s does not
// start with a valid UTF-8 sequence (overlong forms and surrogates are invalid, as in Rust).
int utf8_decode(const char *s, size_t n, uint32_t *cp);
// The UTF-8 bytes of cp (a scalar value) into out: their count.
int utf8_encode(uint32_t cp, char out[4]);
// Length of the UTF-8 character starting at s (s valid).
static inline size_t utf8_char_len(const char *s) {
    unsigned char c = (unsigned char)*s;
    return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}
// Unicode White_Space (Rust's char::is_whitespace, regex's \s).
int is_white_space(uint32_t cp);
// Rust regex's \w: letters, marks, decimal and letter numbers, connector punctuation, ZWNJ/ZWJ.
int is_word_char(uint32_t cp);
// Appends s[0..n) to out with each invalid sequence replaced by U+FFFD, one per maximal
// subpart (Rust's String::from_utf8_lossy).
int utf8_lossy(const char *s, size_t n, Buf *out);

// A list of strings held back to back in one buffer: pre-tokens, or tokens being decoded.
typedef struct {
    size_t off, len;
    bool at_origin; // the piece starts at offset 0 of the original text (Metaspace "first")
} Piece;

typedef struct {
    Buf text;
    Piece *p;
    size_t n, cap;
    bool keep_empty; // tokens being decoded keep their place even when empty
} Pieces;

// Appends a piece holding a copy of s[0..len): 0, or -1 out of memory.
int pieces_add(Pieces *ps, const char *s, size_t len, bool at_origin);
// Starts a piece to fill with buf_append(&ps->text, ...) then end with pieces_end.
int pieces_begin(Pieces *ps, bool at_origin);
void pieces_end(Pieces *ps);
static inline const char *piece_text(const Pieces *ps, size_t i) {
    return ps->text.data + ps->p[i].off;
}
void pieces_reset(Pieces *ps);
void pieces_free(Pieces *ps);

// A PCRE2 regex (UTF + UCP: \p{L}, \s and case folding over Unicode, as onig's).
typedef struct {
    pcre2_code *code;
    pcre2_match_data *md;
} Regex;

int regex_compile(Regex *re, const char *pattern, const char *where, Err *err);
// The leftmost match in s[0..n) at or after `from` (s valid UTF-8): 1 and [*ms, *me), 0 none,
// -1 on a matching failure.
int regex_next(const Regex *re, const char *s, size_t n, size_t from, size_t *ms, size_t *me,
               Err *err);
void regex_free(Regex *re);

// The pattern of Split and Replace: {"String": s} (matched literally) or {"Regex": r}.
typedef struct {
    char *literal; // NULL for a regex
    size_t literal_len;
    Regex re;
} Pattern;

int pattern_parse(const cJSON *j, const char *where, Pattern *p, Err *err);
// Like regex_next, for either kind; an empty match is reported as such.
int pattern_next(const Pattern *p, const char *s, size_t n, size_t from, size_t *ms, size_t *me,
                 Err *err);
void pattern_free(Pattern *p);

// Appends s with every match of p replaced by content (Replace).
int pattern_replace(const Pattern *p, const char *s, size_t n, const char *content, Buf *out,
                    Err *err);

// JSON members of a component `where`: a string (required: error when absent or not a
// string; optional: *out = dflt when absent or null), a boolean, an integer.
int json_string(const cJSON *o, const char *key, const char *where, bool required, const char *dflt,
                const char **out, Err *err);
int json_bool(const cJSON *o, const char *key, const char *where, bool dflt, bool *out, Err *err);
int json_int(const cJSON *o, const char *key, const char *where, int dflt, int *out, Err *err);
// A component's "type" (required string).
int json_type(const cJSON *o, const char *where, const char **type, Err *err);
// The error for a component type that is not reproduced.
int unsupported(const char *where, const char *type, Err *err);

// ------------------------------------------------------------ ids

typedef struct {
    int32_t *v;
    size_t n, cap;
} Ids;

int ids_push(Ids *ids, const int32_t *v, size_t n);

// ------------------------------------------------------------ BPE (tok_bpe.c)

typedef struct {
    StrMap vocab;      // token -> id
    char **token;      // (n_ids,) id -> its token's bytes (in vocab's keys) or NULL
    uint32_t *tok_len; // (n_ids,)
    int32_t n_ids;     // max vocab id + 1
    PairMap merges;
    int32_t unk;                 // the unk_token's id, -1 none
    const char *prefix, *suffix; // continuing_subword_prefix, end_of_word_suffix (or "")
    size_t prefix_len, suffix_len;
    int32_t byte_id[256]; // byte_fallback: the id of "<0xXX>", -1 absent
    bool byte_fallback, fuse_unk, ignore_merges;
    char *strings;              // prefix and suffix
    struct BpeScratch *scratch; // the word cache and merge buffers (encode mutates them)
} Bpe;

int bpe_parse(const cJSON *model, Bpe *b, Err *err);
// Appends the ids of the pre-token s[0..n) (n >= 1) to out.
int bpe_encode(const Bpe *b, const char *s, size_t n, Ids *out, Err *err);
void bpe_free(Bpe *b);

// ------------------------------------------------------------ normalizers, pre-tokenizers

typedef struct Normalizer Normalizer;
typedef struct PreTok PreTok;

// j NULL or JSON null: *out = NULL (none).
int normalizer_parse(const cJSON *j, const char *where, Normalizer **out, Err *err);
// out = n(s[0..len)) (out is reset first).
int normalize(const Normalizer *n, const char *s, size_t len, Buf *out, Err *err);
void normalizer_free(Normalizer *n);

int pretok_parse(const cJSON *j, const char *where, PreTok **out, Err *err);
// Splits (and transforms) the pieces of *ps; *tmp is scratch. Empty pieces are dropped.
int pretokenize(const PreTok *p, Pieces *ps, Pieces *tmp, Err *err);
void pretok_free(PreTok *p);

// ByteLevel's character of byte b (GPT-2's bytes_to_unicode).
uint32_t byte_level_char(unsigned char b);
// The byte of a ByteLevel character, -1 when cp is not one.
int byte_level_byte(uint32_t cp);

// ------------------------------------------------------------ decoders (tok_decode.c)

typedef struct Decoder Decoder;

int decoder_parse(const cJSON *j, const char *where, Decoder **out, Err *err);
// out = the tokens of *toks decoded and joined; *toks and *tmp are scratch.
int decode_tokens(const Decoder *d, Pieces *toks, Pieces *tmp, Buf *out, Err *err);
void decoder_free(Decoder *d);
