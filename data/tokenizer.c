// tokenizer.c: the tokenizer API (tokenizer.h): "bytes", and tokenizer.json's pipeline as
// tokenizers 0.20 runs it for encode(text, add_special_tokens=False):
//   1. added tokens with normalized=false are cut out of the raw text (leftmost, then
//      longest, as its AddedVocabulary's Aho-Corasick; lstrip/rstrip/single_word applied);
//   2. each remaining part is normalized, and the normalized=true added tokens are cut out;
//   3. each remaining part is pre-tokenized, and each pre-token is given to the BPE model.
// Decoding maps ids to their tokens and runs the decoder over them.
#include "data/tokenizer.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"
#include "data/tok_internal.h"

typedef struct {
    char *content;
    size_t len;
    char *pattern; // what is matched: content, normalized if `normalized`
    size_t pattern_len;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
} AddedToken;

// The added tokens of one kind (normalized or not), by first byte, longest first.
typedef struct {
    int *order; // indices into Tokenizer.added
    int start[257];
} Matcher;

// Encoding's buffers, reused from call to call.
typedef struct {
    Buf normalized;
    Pieces pieces, tmp;
} Scratch;

struct Tokenizer {
    bool bytes;
    int vocab_size;
    Bpe bpe;
    Normalizer *normalizer;
    PreTok *pretok;
    Decoder *decoder;
    AddedToken *added;
    int n_added;
    size_t added_cap;
    int32_t max_added_id; // -1: none yet
    StrMap added_ids;     // content -> index in added
    int32_t *added_of_id; // (vocab_size,) index in added, -1
    Matcher raw, norm;
    cJSON *config; // tokenizer_config.json, or NULL
    Scratch *scratch;
};

// ------------------------------------------------------------ added tokens

// tokenizers' AddedVocabulary::add_tokens: a token already in the vocabulary keeps its id;
// a new one gets the next id past the vocabulary and the added tokens.
static int32_t next_added_id(const Tokenizer *t, const char *content) {
    int32_t id = strmap_get(&t->bpe.vocab, content, strlen(content));
    if (id >= 0) return id;
    int32_t model_size = (int32_t)t->bpe.vocab.n, max = t->max_added_id;
    if (max < 0) return model_size;
    return max >= model_size || model_size == 0 ? max + 1 : model_size;
}

static int add_token(Tokenizer *t, const cJSON *j, const char *where, Err *err) {
    const char *content;
    AddedToken a = {0};
    if (!cJSON_IsObject(j)) return err_set(err, "%s: must be an object", where);
    if (json_string(j, "content", where, true, NULL, &content, err) != 0 ||
        json_bool(j, "special", where, false, &a.special, err) != 0 ||
        json_bool(j, "lstrip", where, false, &a.lstrip, err) != 0 ||
        json_bool(j, "rstrip", where, false, &a.rstrip, err) != 0 ||
        json_bool(j, "single_word", where, false, &a.single_word, err) != 0 ||
        json_bool(j, "normalized", where, !a.special, &a.normalized, err) != 0)
        return -1;
    a.len = strlen(content);
    if (!a.len || strmap_get(&t->added_ids, content, a.len) >= 0) return 0; // ignored, as there
    a.id = next_added_id(t, content);
    if (a.id < 0) return err_set(err, "%s: too many tokens", where);
    a.content = strdup(content);
    if (!a.content ||
        buf_reserve(&t->added, &t->added_cap, (size_t)t->n_added + 1, sizeof a) != 0 ||
        strmap_put(&t->added_ids, content, a.len, t->n_added) != 0) {
        free(a.content);
        return err_resource(err, "%s: out of memory", where);
    }
    t->added[t->n_added++] = a;
    if (a.id > t->max_added_id) t->max_added_id = a.id;
    return 0;
}

static int parse_added_tokens(Tokenizer *t, const cJSON *list, Err *err) {
    if (!list || cJSON_IsNull(list)) return 0;
    if (!cJSON_IsArray(list)) return err_set(err, "added_tokens: must be an array");
    int i = 0;
    for (const cJSON *e = list->child; e; e = e->next, i++) {
        char where[64];
        snprintf(where, sizeof where, "added_tokens[%d]", i);
        if (add_token(t, e, where, err) != 0) return -1;
        if (!cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(e, "id")))
            return err_set(err, "%s.id: missing or not a number", where);
    }
    return 0;
}

// The matched pattern of each added token: normalized=true ones through the normalizer.
static int added_patterns(Tokenizer *t, Err *err) {
    Buf b = {0};
    for (int i = 0; i < t->n_added; i++) {
        AddedToken *a = &t->added[i];
        if (a->normalized && t->normalizer) {
            if (normalize(t->normalizer, a->content, a->len, &b, err) != 0) {
                buf_free(&b);
                return err_prefix(err, "added token '%s'", a->content);
            }
            a->pattern_len = b.len;
            a->pattern = buf_take(&b);
        } else {
            a->pattern_len = a->len;
            a->pattern = strdup(a->content);
        }
        if (a->pattern_len && !a->pattern) return err_resource(err, "added tokens: out of memory");
    }
    buf_free(&b);
    return 0;
}

typedef struct {
    const AddedToken *a;
    int index;
} Ranked;

static int by_first_byte_longest(const void *x_, const void *y_) {
    const Ranked *x = x_, *y = y_;
    unsigned char fa = (unsigned char)x->a->pattern[0], fb = (unsigned char)y->a->pattern[0];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (x->a->pattern_len != y->a->pattern_len)
        return x->a->pattern_len > y->a->pattern_len ? -1 : 1;
    return x->index - y->index;
}

static int build_matcher(Tokenizer *t, Matcher *m, bool normalized, Err *err) {
    m->order = malloc(((size_t)t->n_added + 1) * sizeof *m->order);
    Ranked *r = malloc(((size_t)t->n_added + 1) * sizeof *r);
    if (!m->order || !r) {
        free(r);
        return err_resource(err, "added tokens: out of memory");
    }
    int n = 0;
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].normalized == normalized && t->added[i].pattern_len)
            r[n++] = (Ranked){&t->added[i], i};
    qsort(r, (size_t)n, sizeof *r, by_first_byte_longest);
    for (int i = 0; i < n; i++)
        m->order[i] = r[i].index;
    free(r);
    for (int c = 0, k = 0; c <= 256; c++) {
        m->start[c] = k;
        while (c < 256 && k < n && (unsigned char)t->added[m->order[k]].pattern[0] == c)
            k++;
    }
    return 0;
}

// The leftmost-longest added token of m in s[from..n): its index, or -1; *at its start.
static int find_added(const Tokenizer *t, const Matcher *m, const char *s, size_t n, size_t from,
                      size_t *at) {
    if (m->start[256] == 0) return -1;
    for (size_t i = from; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        for (int k = m->start[c]; k < m->start[c + 1]; k++) {
            const AddedToken *a = &t->added[m->order[k]];
            if (a->pattern_len <= n - i && memcmp(s + i, a->pattern, a->pattern_len) == 0) {
                *at = i;
                return m->order[k];
            }
        }
    }
    return -1;
}

static uint32_t char_before(const char *s, size_t at) {
    size_t c = at - 1;
    while (c > 0 && ((unsigned char)s[c] & 0xC0) == 0x80)
        c--;
    uint32_t cp = 0;
    utf8_decode(s + c, at - c, &cp);
    return cp;
}

static uint32_t char_at(const char *s, size_t n, size_t at) {
    uint32_t cp = 0;
    utf8_decode(s + at, n - at, &cp);
    return cp;
}

// ------------------------------------------------------------ encode

static int encode_words(const Tokenizer *t, const char *s, size_t n, bool at_origin, Ids *out,
                        Err *err) {
    Scratch *sc = t->scratch;
    pieces_reset(&sc->pieces);
    if (pieces_add(&sc->pieces, s, n, at_origin) != 0)
        return err_resource(err, "out of memory for pre-tokens");
    if (t->pretok && pretokenize(t->pretok, &sc->pieces, &sc->tmp, err) != 0) return -1;
    for (size_t i = 0; i < sc->pieces.n; i++)
        if (bpe_encode(&t->bpe, piece_text(&sc->pieces, i), sc->pieces.p[i].len, out, err) != 0)
            return -1;
    return 0;
}

static int encode_gap(const Tokenizer *t, int level, const char *s, size_t n, bool at_origin,
                      Ids *out, Err *err);

// Cuts the added tokens of level's matcher (0: raw, 1: normalized) out of s[0..n) and
// encodes the gaps (tokenizers' AddedVocabulary::find_matches).
static int split_added(const Tokenizer *t, int level, const char *s, size_t n, bool at_origin,
                       Ids *out, Err *err) {
    const Matcher *m = level == 0 ? &t->raw : &t->norm;
    size_t done = 0, from = 0, ms;
    int k;
    while ((k = find_added(t, m, s, n, from, &ms)) >= 0) {
        const AddedToken *a = &t->added[k];
        size_t me = ms + a->pattern_len;
        from = me;
        if (a->single_word && ((ms > 0 && is_word_char(char_before(s, ms))) ||
                               (me < n && is_word_char(char_at(s, n, me)))))
            continue;
        while (a->lstrip && ms > done && is_white_space(char_before(s, ms)))
            do // back over one character
                ms--;
            while (ms > done && ((unsigned char)s[ms] & 0xC0) == 0x80);
        while (a->rstrip && me < n && is_white_space(char_at(s, n, me)))
            me += utf8_char_len(s + me);
        if (done < ms &&
            encode_gap(t, level, s + done, ms - done, at_origin && done == 0, out, err) != 0)
            return -1;
        if (ids_push(out, &a->id, 1) != 0) return err_resource(err, "out of memory for ids");
        done = me;
    }
    if (done < n) return encode_gap(t, level, s + done, n - done, at_origin && done == 0, out, err);
    return 0;
}

static int encode_gap(const Tokenizer *t, int level, const char *s, size_t n, bool at_origin,
                      Ids *out, Err *err) {
    if (level == 1) return encode_words(t, s, n, at_origin, out, err);
    if (!t->normalizer) return split_added(t, 1, s, n, at_origin, out, err);
    Buf *nb = &t->scratch->normalized; // level 1 does not normalize: nb stays as it is
    if (normalize(t->normalizer, s, n, nb, err) != 0) return -1;
    return split_added(t, 1, nb->data ? nb->data : "", nb->len, at_origin, out, err);
}

// The offset of the first invalid UTF-8 sequence in s[0..n), or n.
static size_t utf8_invalid_at(const char *s, size_t n) {
    size_t i = 0;
    uint32_t cp;
    for (int k; i < n && (k = utf8_decode(s + i, n - i, &cp)); i += (size_t)k)
        ;
    return i;
}

int tokenizer_encode(const Tokenizer *t, const char *text, size_t len, int32_t **ids,
                     int64_t *n_ids, Err *err) {
    Ids out = {0};
    int rc = 0;
    if (t->bytes) {
        out.v = malloc((len ? len : 1) * sizeof *out.v);
        if (!out.v) return err_resource(err, "tokenizer bytes: out of memory for %zu bytes", len);
        for (size_t i = 0; i < len; i++)
            out.v[i] = (unsigned char)text[i];
        out.n = len;
    } else {
        size_t bad = utf8_invalid_at(text, len);
        if (bad < len) return err_set(err, "the text is not UTF-8 (at byte %zu)", bad);
        rc = len ? split_added(t, 0, text, len, true, &out, err) : 0;
        if (rc == 0 && !out.v && !(out.v = malloc(sizeof *out.v)))
            rc = err_resource(err, "out of memory for token ids");
    }
    if (rc != 0) {
        free(out.v);
        return -1;
    }
    *ids = out.v;
    *n_ids = (int64_t)out.n;
    return 0;
}

// ------------------------------------------------------------ decode

// The token of id, NULL when there is none; *skip when skip_special drops it.
static const char *id_token(const Tokenizer *t, int32_t id, int skip_special, size_t *len,
                            bool *skip) {
    *skip = false;
    if (id < 0 || id >= t->vocab_size) return NULL;
    int k = t->added_of_id[id];
    if (k >= 0) {
        *skip = skip_special && t->added[k].special;
        *len = t->added[k].len;
        return t->added[k].content;
    }
    if (id >= t->bpe.n_ids || !t->bpe.token[id]) return NULL;
    *len = t->bpe.tok_len[id];
    return t->bpe.token[id];
}

static int decode_bytes(const int32_t *ids, int64_t n, Buf *out, Err *err) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] > 255)
            return err_set(err, "token id %d at %lld is not a byte (tokenizer bytes)", ids[i],
                           (long long)i);
        unsigned char c = (unsigned char)ids[i];
        if (buf_append(out, &c, 1) != 0) return err_resource(err, "decode: out of memory");
    }
    return 0;
}

static int decode_ids(const Tokenizer *t, const int32_t *ids, int64_t n, int skip_special, Buf *out,
                      Err *err) {
    Pieces toks = {.keep_empty = true}, tmp = {0};
    int rc = 0;
    for (int64_t i = 0; rc == 0 && i < n; i++) {
        size_t len;
        bool skip;
        const char *tok = id_token(t, ids[i], skip_special, &len, &skip);
        if (!tok)
            rc = err_set(err, "token id %d at %lld is not in the vocabulary (size %d)", ids[i],
                         (long long)i, t->vocab_size);
        else if (!skip && pieces_add(&toks, tok, len, false) != 0)
            rc = err_resource(err, "decode: out of memory");
    }
    if (rc == 0 && t->decoder) rc = decode_tokens(t->decoder, &toks, &tmp, out, err);
    for (size_t i = 0; rc == 0 && !t->decoder && i < toks.n; i++) // no decoder: joined by spaces
        if ((i && buf_append(out, " ", 1)) || buf_append(out, piece_text(&toks, i), toks.p[i].len))
            rc = err_resource(err, "decode: out of memory");
    pieces_free(&toks);
    pieces_free(&tmp);
    return rc;
}

int tokenizer_decode(const Tokenizer *t, const int32_t *ids, int64_t n, int skip_special,
                     char **text, size_t *len, Err *err) {
    Buf out = {0};
    int rc =
        t->bytes ? decode_bytes(ids, n, &out, err) : decode_ids(t, ids, n, skip_special, &out, err);
    if (rc == 0 && buf_append(&out, "", 0) != 0) rc = err_resource(err, "decode: out of memory");
    if (rc != 0) {
        buf_free(&out);
        return -1;
    }
    *len = out.len;
    *text = buf_take(&out);
    return 0;
}

// ------------------------------------------------------------ open

// tokenizer_config.json's added_tokens_decoder: the tokens whose id is not an added token's
// yet are added, in id order, as transformers does.
static int config_added_tokens(Tokenizer *t, const char *path, Err *err) {
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(t->config, "added_tokens_decoder");
    if (!dec) return 0;
    if (!cJSON_IsObject(dec)) return err_set(err, "%s: added_tokens_decoder: not an object", path);
    for (long want = 0, next; want >= 0; want = next) { // ascending ids, each once
        next = -1;
        const cJSON *pick = NULL;
        for (const cJSON *e = dec->child; e; e = e->next) {
            char *end;
            long id = strtol(e->string, &end, 10);
            if (*end || id < 0 || id > INT32_MAX)
                return err_set(err, "%s: added_tokens_decoder: '%s' is not an id", path, e->string);
            if (id == want) pick = e;
            if (id > want && (next < 0 || id < next)) next = id;
        }
        bool taken = false;
        for (int i = 0; pick && i < t->n_added; i++)
            taken |= t->added[i].id == want;
        char where[96];
        snprintf(where, sizeof where, "added_tokens_decoder[\"%ld\"]", want);
        if (pick && !taken && add_token(t, pick, where, err) != 0)
            return err_prefix(err, "%s", path);
    }
    return 0;
}

static int read_config(Tokenizer *t, const char *dir, Err *err) {
    char path[PATH_MAX];
    if (path_join(path, sizeof path, dir, "tokenizer_config.json", err) != 0) return -1;
    if (!fs_is_file(path)) return 0;
    if (json_read_file(path, &t->config, err) != 0) return -1;
    if (!cJSON_IsObject(t->config)) return err_set(err, "%s: not a JSON object", path);
    return config_added_tokens(t, path, err);
}

static int index_ids(Tokenizer *t, Err *err) {
    int32_t max = t->bpe.n_ids - 1;
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].id > max) max = t->added[i].id;
    t->vocab_size = max + 1;
    t->added_of_id = malloc(((size_t)t->vocab_size + 1) * sizeof *t->added_of_id);
    if (!t->added_of_id) return err_resource(err, "out of memory for %d ids", t->vocab_size);
    for (int32_t i = 0; i < t->vocab_size; i++)
        t->added_of_id[i] = -1;
    for (int i = 0; i < t->n_added; i++)
        t->added_of_id[t->added[i].id] = i;
    return 0;
}

static int parse_tokenizer(Tokenizer *t, const cJSON *root, Err *err) {
    if (!cJSON_IsObject(root)) return err_set(err, "not a JSON object");
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!model) return err_set(err, "model: missing");
    return bpe_parse(model, &t->bpe, err) ||
           normalizer_parse(cJSON_GetObjectItemCaseSensitive(root, "normalizer"), "normalizer",
                            &t->normalizer, err) ||
           pretok_parse(cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), "pre_tokenizer",
                        &t->pretok, err) ||
           decoder_parse(cJSON_GetObjectItemCaseSensitive(root, "decoder"), "decoder", &t->decoder,
                         err) ||
           parse_added_tokens(t, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), err);
}

// spec -> the tokenizer.json path and the directory of tokenizer_config.json.
static int locate(const char *spec, char *json, char *dir, Err *err) {
    if (fs_is_dir(spec)) {
        if (snprintf(dir, PATH_MAX, "%s", spec) >= PATH_MAX)
            return err_set(err, "%s: too long", spec);
        return path_join(json, PATH_MAX, spec, "tokenizer.json", err);
    }
    if (!fs_is_file(spec))
        return err_set(err, "unknown tokenizer '%s' (not bytes, a tokenizer.json or a directory)",
                       spec);
    if (snprintf(json, PATH_MAX, "%s", spec) >= PATH_MAX) return err_set(err, "%s: too long", spec);
    const char *slash = strrchr(spec, '/');
    snprintf(dir, PATH_MAX, "%.*s", slash ? (int)(slash - spec) : 1, slash ? spec : ".");
    return 0;
}

static int open_json(Tokenizer *t, const char *spec, Err *err) {
    char json[PATH_MAX], dir[PATH_MAX];
    cJSON *root = NULL;
    if (locate(spec, json, dir, err) != 0 || json_read_file(json, &root, err) != 0) return -1;
    int rc = parse_tokenizer(t, root, err);
    cJSON_Delete(root);
    if (rc != 0) return err_prefix(err, "%s", json);
    if (read_config(t, dir, err) != 0) return -1; // its errors name tokenizer_config.json
    if (added_patterns(t, err) != 0 || build_matcher(t, &t->raw, false, err) != 0 ||
        build_matcher(t, &t->norm, true, err) != 0 || index_ids(t, err) != 0)
        return err_prefix(err, "%s", json);
    t->scratch = calloc(1, sizeof *t->scratch);
    return t->scratch ? 0 : err_resource(err, "out of memory");
}

int tokenizer_open(const char *spec, Tokenizer **out, Err *err) {
    *out = NULL;
    Tokenizer *t = calloc(1, sizeof *t);
    if (!t) return err_resource(err, "tokenizer: out of memory");
    t->max_added_id = -1;
    if (strcmp(spec, "bytes") == 0) {
        t->bytes = true;
        t->vocab_size = 256;
    } else if (open_json(t, spec, err) != 0) {
        tokenizer_free(t);
        return -1;
    }
    *out = t;
    return 0;
}

// ------------------------------------------------------------ queries

int tokenizer_vocab_size(const Tokenizer *t) {
    return t->vocab_size;
}

const char *tokenizer_config_string(const Tokenizer *t, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(t->config, key);
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

bool tokenizer_config_bool(const Tokenizer *t, const char *key, bool dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(t->config, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

int tokenizer_token_id(const Tokenizer *t, const char *token) {
    size_t len = strlen(token);
    if (t->bytes) return len == 1 ? (unsigned char)token[0] : -1;
    int k = strmap_get(&t->added_ids, token, len);
    return k >= 0 ? t->added[k].id : strmap_get(&t->bpe.vocab, token, len);
}

void tokenizer_free(Tokenizer *t) {
    if (!t) return;
    bpe_free(&t->bpe);
    normalizer_free(t->normalizer);
    pretok_free(t->pretok);
    decoder_free(t->decoder);
    for (int i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].pattern);
    }
    free(t->added);
    strmap_free(&t->added_ids);
    free(t->added_of_id);
    free(t->raw.order);
    free(t->norm.order);
    cJSON_Delete(t->config);
    if (t->scratch) {
        buf_free(&t->scratch->normalized);
        pieces_free(&t->scratch->pieces);
        pieces_free(&t->scratch->tmp);
        free(t->scratch);
    }
    free(t);
}
