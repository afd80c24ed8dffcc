// tok_bpe.c: the BPE model of tokenizer.json (tokenizers' models/bpe): characters to ids
// (with continuing_subword_prefix, end_of_word_suffix, byte_fallback, unk_token, fuse_unk),
// then the merges applied lowest rank first, leftmost first among equal ranks, with a
// min-heap as tokenizers' Word::merge_all does. Results are cached per pre-token.
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/tok_internal.h"

typedef struct {
    int32_t id;
    int32_t prev, next; // neighbouring live symbols, -1 none
    uint32_t len;       // bytes covered; 0 once merged into its left neighbour
} Symbol;

typedef struct {
    uint32_t rank, pos;
    int32_t new_id;
} Merge;

// The cache and the buffers of one word's merging (reused across words).
typedef struct BpeScratch {
    StrMap cache; // pre-token -> offset in pool: pool[off] = count, then the ids
    Ids pool;
    Symbol *sym;
    size_t sym_cap, n_sym;
    Merge *heap;
    size_t heap_cap, heap_n;
    Buf piece; // a character with the prefix / suffix around it
} BpeScratch;

// The cache is dropped whole past these sizes (a cache never changes the result).
#define CACHE_MAX_WORDS (1u << 18)
#define CACHE_MAX_IDS (1u << 22)

// ------------------------------------------------------------ parse

static int parse_vocab(const cJSON *v, Bpe *b, Err *err) {
    if (!cJSON_IsObject(v)) return err_set(err, "model.vocab: missing or not an object");
    int32_t max_id = -1, n = cJSON_GetArraySize(v);
    for (const cJSON *e = v->child; e; e = e->next) {
        double d = e->valuedouble;
        if (!cJSON_IsNumber(e) || !(d >= 0 && d < INT32_MAX) || d != (double)(int32_t)d)
            return err_set(err, "model.vocab[\"%s\"]: the id must be an integer in [0, 2^31-1)",
                           e->string);
        if (strmap_put(&b->vocab, e->string, strlen(e->string), (int32_t)d) != 0)
            return err_resource(err, "model.vocab: out of memory");
        if ((int32_t)d > max_id) max_id = (int32_t)d;
        // ids index arrays: a sparse one would make them huge (the bound leaves room for holes)
        if ((size_t)max_id > 4 * (size_t)n + 65536)
            return err_set(err, "model.vocab[\"%s\"]: id %d is far past the vocab's %d tokens",
                           e->string, max_id, n);
    }
    b->n_ids = max_id + 1;
    b->token = calloc((size_t)b->n_ids + 1, sizeof *b->token);
    b->tok_len = calloc((size_t)b->n_ids + 1, sizeof *b->tok_len);
    if (!b->token || !b->tok_len) return err_resource(err, "model.vocab: out of memory");
    for (size_t i = 0; i < b->vocab.n; i++) { // keys no longer move: the map is complete
        const StrEntry *x = &b->vocab.entries[i];
        const char *other = b->token[x->val];
        // One id for two tokens: decoding could give only one of them back.
        if (other)
            return err_set(err, "model.vocab: tokens \"%.*s\" and \"%.*s\" both have id %d",
                           (int)b->tok_len[x->val], other, (int)x->len, b->vocab.keys.data + x->off,
                           x->val);
        b->token[x->val] = b->vocab.keys.data + x->off;
        b->tok_len[x->val] = x->len;
    }
    return 0;
}

static int32_t vocab_id(const Bpe *b, const char *s, size_t len) {
    return strmap_get(&b->vocab, s, len);
}

// One merge: "a b" (split at the first space) or ["a", "b"].
static int merge_parts(const cJSON *m, size_t i, const char **a, size_t *a_len, const char **bp,
                       Err *err) {
    if (cJSON_IsString(m)) {
        const char *sp = strchr(m->valuestring, ' ');
        if (!sp) return err_set(err, "model.merges[%zu]: \"%s\" is not \"a b\"", i, m->valuestring);
        *a = m->valuestring;
        *a_len = (size_t)(sp - m->valuestring);
        *bp = sp + 1;
        return 0;
    }
    if (cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) && cJSON_IsString(m->child->next)) {
        *a = m->child->valuestring;
        *a_len = strlen(*a);
        *bp = m->child->next->valuestring;
        return 0;
    }
    return err_set(err, "model.merges[%zu]: must be \"a b\" or [\"a\", \"b\"]", i);
}

static int parse_merges(const cJSON *v, Bpe *b, Err *err) {
    if (!cJSON_IsArray(v)) return err_set(err, "model.merges: missing or not an array");
    Buf joined = {0};
    size_t i = 0;
    int rc = 0;
    for (const cJSON *m = v->child; rc == 0 && m; m = m->next, i++) {
        const char *a = NULL, *bs = NULL;
        size_t a_len = 0;
        if ((rc = merge_parts(m, i, &a, &a_len, &bs, err)) != 0) break;
        size_t b_len = strlen(bs);
        int32_t a_id = vocab_id(b, a, a_len), b_id = vocab_id(b, bs, b_len);
        if (a_id < 0 || b_id < 0) {
            rc = err_set(err, "model.merges[%zu]: '%.*s' is not in model.vocab", i,
                         a_id < 0 ? (int)a_len : (int)b_len, a_id < 0 ? a : bs);
            break;
        }
        if (b->prefix_len > b_len) {
            rc = err_set(err, "model.merges[%zu]: '%s' is shorter than continuing_subword_prefix",
                         i, bs);
            break;
        }
        joined.len = 0; // a ++ b without the prefix, as tokenizers builds the merged token
        if (buf_append(&joined, a, a_len) != 0 ||
            buf_append(&joined, bs + b->prefix_len, b_len - b->prefix_len) != 0) {
            rc = err_resource(err, "model.merges: out of memory");
            break;
        }
        int32_t new_id = vocab_id(b, joined.data, joined.len);
        if (new_id < 0)
            rc = err_set(err, "model.merges[%zu]: the merged token '%s' is not in model.vocab", i,
                         joined.data);
        else if (pairmap_put(&b->merges, a_id, b_id, (uint32_t)i, new_id) != 0)
            rc = err_resource(err, "model.merges: out of memory");
    }
    buf_free(&joined);
    return rc;
}

// The model's options; *unk: the unk_token (NULL none), looked up once the vocab is read.
static int parse_options(const cJSON *model, Bpe *b, const char **unk, Err *err) {
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout && !cJSON_IsNull(dropout) &&
        !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0))
        return err_set(err, "model.dropout: BPE dropout is not supported (must be null)");
    const char *prefix, *suffix;
    if (json_string(model, "unk_token", "model", false, NULL, unk, err) != 0 ||
        json_string(model, "continuing_subword_prefix", "model", false, "", &prefix, err) != 0 ||
        json_string(model, "end_of_word_suffix", "model", false, "", &suffix, err) != 0 ||
        json_bool(model, "fuse_unk", "model", false, &b->fuse_unk, err) != 0 ||
        json_bool(model, "byte_fallback", "model", false, &b->byte_fallback, err) != 0 ||
        json_bool(model, "ignore_merges", "model", false, &b->ignore_merges, err) != 0)
        return -1;
    b->prefix_len = strlen(prefix);
    b->suffix_len = strlen(suffix);
    b->strings = malloc(b->prefix_len + b->suffix_len + 2);
    if (!b->strings) return err_resource(err, "model: out of memory");
    memcpy(b->strings, prefix, b->prefix_len + 1);
    memcpy(b->strings + b->prefix_len + 1, suffix, b->suffix_len + 1);
    b->prefix = b->strings;
    b->suffix = b->strings + b->prefix_len + 1;
    return 0;
}

int bpe_parse(const cJSON *model, Bpe *b, Err *err) {
    *b = (Bpe){.unk = -1};
    const char *type;
    if (!cJSON_IsObject(model)) return err_set(err, "model: missing or not an object");
    if (json_string(model, "type", "model", false, "BPE", &type, err) != 0) return -1;
    if (strcmp(type, "BPE") != 0) return unsupported("model", type, err);
    b->scratch = calloc(1, sizeof *b->scratch);
    if (!b->scratch) return err_resource(err, "model: out of memory");
    const char *unk;
    if (parse_options(model, b, &unk, err) != 0 ||
        parse_vocab(cJSON_GetObjectItemCaseSensitive(model, "vocab"), b, err) != 0 ||
        parse_merges(cJSON_GetObjectItemCaseSensitive(model, "merges"), b, err) != 0)
        return -1;
    if (unk && (b->unk = vocab_id(b, unk, strlen(unk))) < 0)
        return err_set(err, "model.unk_token: '%s' is not in model.vocab", unk);
    for (int c = 0; c < 256; c++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", c);
        b->byte_id[c] = vocab_id(b, name, 6);
    }
    return 0;
}

void bpe_free(Bpe *b) {
    if (b->scratch) {
        strmap_free(&b->scratch->cache);
        free(b->scratch->pool.v);
        free(b->scratch->sym);
        free(b->scratch->heap);
        buf_free(&b->scratch->piece);
        free(b->scratch);
    }
    strmap_free(&b->vocab);
    pairmap_free(&b->merges);
    free(b->token);
    free(b->tok_len);
    free(b->strings);
    *b = (Bpe){0};
}

// ------------------------------------------------------------ encode

static int add_symbol(BpeScratch *w, int32_t id, uint32_t len) {
    if (buf_reserve(&w->sym, &w->sym_cap, w->n_sym + 1, sizeof *w->sym) != 0) return -1;
    int32_t i = (int32_t)w->n_sym;
    if (i > 0) w->sym[i - 1].next = i;
    w->sym[w->n_sym++] = (Symbol){id, i - 1, -1, len};
    return 0;
}

static int merge_less(const Merge *x, const Merge *y) {
    return x->rank != y->rank ? x->rank < y->rank : x->pos < y->pos;
}

static int heap_push(BpeScratch *w, Merge m) {
    if (buf_reserve(&w->heap, &w->heap_cap, w->heap_n + 1, sizeof *w->heap) != 0) return -1;
    size_t i = w->heap_n++;
    for (; i > 0 && merge_less(&m, &w->heap[(i - 1) / 2]); i = (i - 1) / 2)
        w->heap[i] = w->heap[(i - 1) / 2];
    w->heap[i] = m;
    return 0;
}

static Merge heap_pop(BpeScratch *w) {
    Merge top = w->heap[0], last = w->heap[--w->heap_n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= w->heap_n) break;
        if (c + 1 < w->heap_n && merge_less(&w->heap[c + 1], &w->heap[c])) c++;
        if (!merge_less(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (w->heap_n) w->heap[i] = last;
    return top;
}

// Queues the merge of the live symbols at pos and its next, if they form one.
static int queue_pair(const Bpe *b, BpeScratch *w, int32_t pos) {
    if (pos < 0 || w->sym[pos].next < 0) return 0;
    uint32_t rank;
    int32_t new_id;
    if (!pairmap_get(&b->merges, w->sym[pos].id, w->sym[w->sym[pos].next].id, &rank, &new_id))
        return 0;
    return heap_push(w, (Merge){rank, (uint32_t)pos, new_id});
}

static int merge_all(const Bpe *b, BpeScratch *w) {
    w->heap_n = 0;
    for (size_t i = 0; i + 1 < w->n_sym; i++)
        if (queue_pair(b, w, (int32_t)i) != 0) return -1;
    while (w->heap_n) {
        Merge top = heap_pop(w);
        Symbol *s = &w->sym[top.pos];
        if (s->len == 0 || s->next < 0) continue;
        uint32_t rank;
        int32_t new_id;
        Symbol right = w->sym[s->next];
        if (!pairmap_get(&b->merges, s->id, right.id, &rank, &new_id) || new_id != top.new_id)
            continue; // an expired entry
        w->sym[s->next].len = 0;
        s->id = new_id;
        s->len += right.len;
        s->next = right.next;
        if (right.next >= 0) w->sym[right.next].prev = (int32_t)top.pos;
        if (queue_pair(b, w, s->prev) != 0 || queue_pair(b, w, (int32_t)top.pos) != 0) return -1;
    }
    return 0;
}

// The id of the character c (k bytes) as the model names it: with the prefix unless first,
// the suffix if last; -1 if absent. *s, *n: the string looked up.
static int32_t char_id(const Bpe *b, BpeScratch *w, const char *c, size_t k, bool first, bool last,
                       const char **s, size_t *n) {
    if ((first || !b->prefix_len) && (!last || !b->suffix_len)) {
        *s = c;
        *n = k;
        return vocab_id(b, c, k);
    }
    w->piece.len = 0;
    if ((!first && buf_append(&w->piece, b->prefix, b->prefix_len) != 0) ||
        buf_append(&w->piece, c, k) != 0 ||
        (last && buf_append(&w->piece, b->suffix, b->suffix_len) != 0))
        return -2;
    *s = w->piece.data;
    *n = w->piece.len;
    return vocab_id(b, *s, *n);
}

// The byte-fallback ids of s[0..n) as symbols: 1 if every byte has one, else 0 (none added).
static int add_byte_fallback(const Bpe *b, BpeScratch *w, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (b->byte_id[(unsigned char)s[i]] < 0) return 0;
    for (size_t i = 0; i < n; i++)
        if (add_symbol(w, b->byte_id[(unsigned char)s[i]], 1) != 0) return -1;
    return 1;
}

// tokenizers' BPE::merge_word: the word's symbols, merged.
static int merge_word(const Bpe *b, BpeScratch *w, const char *word, size_t n) {
    w->n_sym = 0;
    int32_t unk_id = -1; // a pending unknown run
    uint32_t unk_len = 0;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_char_len(word + i);
        const char *s;
        size_t s_len;
        int32_t id = char_id(b, w, word + i, k, i == 0, i + k == n, &s, &s_len);
        if (id == -2) return -1;
        int fb = 0;
        if (id >= 0) {
            if (unk_id >= 0 && add_symbol(w, unk_id, unk_len) != 0) return -1;
            unk_id = -1;
            if (add_symbol(w, id, (uint32_t)k) != 0) return -1;
        } else if (b->byte_fallback && (fb = add_byte_fallback(b, w, s, s_len)) != 0) {
            if (fb < 0) return -1;
        } else if (b->unk >= 0) {
            if (unk_id >= 0 && b->fuse_unk) {
                unk_len += (uint32_t)k;
            } else {
                if (unk_id >= 0 && add_symbol(w, unk_id, unk_len) != 0) return -1;
                unk_id = b->unk;
                unk_len = (uint32_t)k;
            }
        }
        i += k;
    }
    if (unk_id >= 0 && add_symbol(w, unk_id, unk_len) != 0) return -1;
    return merge_all(b, w);
}

// Caches the live symbols of the merged word and appends their ids to out.
static int emit_word(BpeScratch *w, const char *word, size_t n, Ids *out) {
    if (w->cache.n >= CACHE_MAX_WORDS || w->pool.n >= CACHE_MAX_IDS) {
        strmap_clear(&w->cache);
        w->pool.n = 0;
    }
    size_t off = w->pool.n;
    int32_t count = 0;
    if (ids_push(&w->pool, &count, 1) != 0) return -1;
    for (size_t i = 0; i < w->n_sym; i++)
        if (w->sym[i].len && ids_push(&w->pool, &w->sym[i].id, 1) != 0) return -1;
    w->pool.v[off] = (int32_t)(w->pool.n - off - 1);
    if (strmap_put(&w->cache, word, n, (int32_t)off) != 0) return -1;
    return ids_push(out, w->pool.v + off + 1, (size_t)w->pool.v[off]);
}

int bpe_encode(const Bpe *b, const char *s, size_t n, Ids *out, Err *err) {
    if (b->ignore_merges) {
        int32_t id = vocab_id(b, s, n);
        if (id >= 0) return ids_push(out, &id, 1) == 0 ? 0 : err_resource(err, "out of memory");
    }
    BpeScratch *w = b->scratch;
    int32_t off = strmap_get(&w->cache, s, n);
    if (off >= 0) {
        if (ids_push(out, w->pool.v + off + 1, (size_t)w->pool.v[off]) != 0)
            return err_resource(err, "out of memory for token ids");
        return 0;
    }
    if (merge_word(b, w, s, n) != 0 || emit_word(w, s, n, out) != 0)
        return err_resource(err, "BPE: out of memory merging a %zu-byte word", n);
    return 0;
}
