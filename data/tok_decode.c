// tok_decode.c: the decoders of tokenizer.json (ByteLevel, Metaspace, Replace, ByteFallback,
// Fuse, Strip, Sequence), each a step over the list of token strings as tokenizers 0.20's
// decode_chain; the result is the list joined.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/tok_internal.h"

typedef enum {
    D_BYTE_LEVEL,
    D_METASPACE,
    D_REPLACE,
    D_BYTE_FALLBACK,
    D_FUSE,
    D_STRIP,
    D_SEQUENCE
} DecKind;

struct Decoder {
    DecKind kind;
    Pattern pattern; // D_REPLACE
    char *content;   // D_REPLACE: the replacement
    uint32_t ch;     // D_METASPACE: the replacement; D_STRIP: the character stripped
    bool prepend;    // D_METASPACE: prepend_scheme is not "never"
    int start, stop; // D_STRIP
    Decoder **sub;
    int n_sub;
};

static int parse_char(const cJSON *j, const char *key, const char *where, uint32_t *ch, Err *err) {
    const char *s;
    if (json_string(j, key, where, true, NULL, &s, err) != 0) return -1;
    size_t n = strlen(s);
    if (!n || (size_t)utf8_decode(s, n, ch) != n)
        return err_set(err, "%s.%s: '%s' is not one character", where, key, s);
    return 0;
}

static int parse_metaspace(const cJSON *j, const char *where, Decoder *d, Err *err) {
    const char *scheme;
    bool add_prefix_space;
    if (parse_char(j, "replacement", where, &d->ch, err) != 0 ||
        json_string(j, "prepend_scheme", where, false, NULL, &scheme, err) != 0 ||
        json_bool(j, "add_prefix_space", where, true, &add_prefix_space, err) != 0)
        return -1;
    if (scheme && strcmp(scheme, "always") && strcmp(scheme, "first") && strcmp(scheme, "never"))
        return err_set(err, "%s.prepend_scheme: '%s' is not first, always or never", where, scheme);
    d->prepend = scheme ? strcmp(scheme, "never") != 0 : add_prefix_space;
    return 0;
}

static int parse_sequence(const cJSON *j, const char *where, Decoder *d, Err *err) {
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(j, "decoders");
    if (!cJSON_IsArray(arr)) return err_set(err, "%s.decoders: missing or not an array", where);
    d->sub = calloc((size_t)cJSON_GetArraySize(arr) + 1, sizeof *d->sub);
    if (!d->sub) return err_resource(err, "%s: out of memory", where);
    for (const cJSON *e = arr->child; e; e = e->next) {
        char at[256];
        snprintf(at, sizeof at, "%s.decoders[%d]", where, d->n_sub);
        int rc = decoder_parse(e, at, &d->sub[d->n_sub], err);
        if (!d->sub[d->n_sub]) return rc ? -1 : err_set(err, "%s: must be a decoder", at);
        d->n_sub++; // freed with the sequence, parsed in full or not
        if (rc != 0) return -1;
    }
    return 0;
}

static int parse_body(const cJSON *j, const char *where, const char *type, Decoder *d, Err *err) {
    static const struct {
        const char *name;
        DecKind kind;
    } KINDS[] = {
        {"ByteLevel", D_BYTE_LEVEL},       {"Metaspace", D_METASPACE}, {"Replace", D_REPLACE},
        {"ByteFallback", D_BYTE_FALLBACK}, {"Fuse", D_FUSE},           {"Strip", D_STRIP},
        {"Sequence", D_SEQUENCE}};
    size_t k = 0, n_kinds = sizeof KINDS / sizeof *KINDS;
    while (k < n_kinds && strcmp(type, KINDS[k].name) != 0)
        k++;
    if (k == n_kinds) return unsupported(where, type, err);
    d->kind = KINDS[k].kind;
    char at[300];
    snprintf(at, sizeof at, "%s.pattern", where);
    switch (d->kind) {
    case D_METASPACE:
        return parse_metaspace(j, where, d, err);
    case D_REPLACE: {
        const char *content;
        if (pattern_parse(cJSON_GetObjectItemCaseSensitive(j, "pattern"), at, &d->pattern, err) ||
            json_string(j, "content", where, true, NULL, &content, err))
            return -1;
        d->content = strdup(content);
        return d->content ? 0 : err_resource(err, "%s: out of memory", where);
    }
    case D_STRIP:
        return parse_char(j, "content", where, &d->ch, err) ||
               json_int(j, "start", where, 0, &d->start, err) ||
               json_int(j, "stop", where, 0, &d->stop, err);
    case D_SEQUENCE:
        return parse_sequence(j, where, d, err);
    default:
        return 0;
    }
}

int decoder_parse(const cJSON *j, const char *where, Decoder **out, Err *err) {
    *out = NULL;
    if (!j || cJSON_IsNull(j)) return 0;
    const char *type;
    if (json_type(j, where, &type, err) != 0) return -1;
    Decoder *d = calloc(1, sizeof *d);
    if (!d) return err_resource(err, "%s: out of memory", where);
    *out = d;
    return parse_body(j, where, type, d, err);
}

void decoder_free(Decoder *d) {
    if (!d) return;
    for (int i = 0; i < d->n_sub; i++)
        decoder_free(d->sub[i]);
    free(d->sub);
    pattern_free(&d->pattern);
    free(d->content);
    free(d);
}

// ------------------------------------------------------------ steps

static int hex_digit(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

// The byte of a token "<0xHH>" (u8::from_str_radix of HH, which also takes "+H"), or -1.
static int fallback_byte(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int hi = s[3] == '+' ? 0 : hex_digit(s[3]), lo = hex_digit(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// The pending bytes as one token if they are UTF-8, else one U+FFFD per byte.
static int flush_bytes(Buf *bytes, Pieces *out) {
    if (!bytes->len) return 0;
    int rc = 0;
    size_t i = 0;
    uint32_t cp;
    for (int k; i < bytes->len && (k = utf8_decode(bytes->data + i, bytes->len - i, &cp));)
        i += (size_t)k;
    if (i == bytes->len) rc = pieces_add(out, bytes->data, bytes->len, false);
    for (size_t b = 0; rc == 0 && i < bytes->len && b < bytes->len; b++)
        rc = pieces_add(out, "\xEF\xBF\xBD", 3, false);
    bytes->len = 0;
    return rc;
}

static int byte_fallback(const Pieces *in, Pieces *out) {
    Buf bytes = {0};
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < in->n; i++) {
        int b = fallback_byte(piece_text(in, i), in->p[i].len);
        unsigned char c = (unsigned char)b;
        if (b >= 0)
            rc = buf_append(&bytes, &c, 1);
        else
            rc =
                flush_bytes(&bytes, out) || pieces_add(out, piece_text(in, i), in->p[i].len, false);
    }
    if (rc == 0) rc = flush_bytes(&bytes, out);
    buf_free(&bytes);
    return rc;
}

// Every token's ByteLevel characters back to bytes (a token with another character stays as
// it is), all joined into one token, made valid UTF-8 by U+FFFD.
static int byte_level(const Pieces *in, Pieces *out) {
    Buf raw = {0};
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < in->n; i++) {
        const char *s = piece_text(in, i);
        size_t n = in->p[i].len, at = raw.len;
        uint32_t cp;
        int k = 1, b = 0;
        for (size_t j = 0; j < n && b >= 0; j += (size_t)k) {
            k = utf8_decode(s + j, n - j, &cp);
            b = k ? byte_level_byte(cp) : -1;
            unsigned char c = (unsigned char)b;
            if (b >= 0) rc = buf_append(&raw, &c, 1);
        }
        if (b < 0) {
            raw.len = at;
            rc = buf_append(&raw, s, n);
        }
    }
    Buf text = {0};
    if (rc == 0) rc = utf8_lossy(raw.data ? raw.data : "", raw.len, &text);
    if (rc == 0) rc = pieces_add(out, text.data ? text.data : "", text.len, false);
    buf_free(&raw);
    buf_free(&text);
    return rc;
}

// Token i with each replacement character a space (dropped in the first token).
static int metaspace(const Decoder *d, const char *s, size_t n, size_t i, Pieces *out) {
    if (pieces_begin(out, false) != 0) return -1;
    for (size_t j = 0; j < n;) {
        uint32_t cp;
        size_t k = utf8_char_len(s + j);
        utf8_decode(s + j, n - j, &cp);
        int rc = cp != d->ch            ? buf_append(&out->text, s + j, k)
                 : i == 0 && d->prepend ? 0
                                        : buf_append(&out->text, " ", 1);
        if (rc != 0) return -1;
        j += k;
    }
    pieces_end(out);
    return 0;
}

// tokenizers' Strip: up to `start` leading and `stop` trailing characters ch removed. Where
// tokenizers panics (the cuts cross, or `stop` passes a token made of ch), this is an error.
static int strip(const Decoder *d, const char *s, size_t n, Pieces *out, Err *err) {
    size_t a = 0, b = n, n_start = 0, n_stop = 0;
    uint32_t cp;
    while ((int)n_start < d->start && a < n && utf8_decode(s + a, n - a, &cp) && cp == d->ch) {
        a += utf8_char_len(s + a);
        n_start++;
    }
    for (; (int)n_stop < d->stop; n_stop++) {
        if (b == 0) return err_set(err, "decoder Strip: stop %d passes the token", d->stop);
        size_t c = b - 1;
        while (c > 0 && ((unsigned char)s[c] & 0xC0) == 0x80)
            c--;
        if (!utf8_decode(s + c, b - c, &cp) || cp != d->ch) break;
        b = c;
    }
    if (b < a) return err_set(err, "decoder Strip: start and stop cuts cross in a token");
    return pieces_add(out, s + a, b - a, false) == 0 ? 0 : err_resource(err, "out of memory");
}

static int step(const Decoder *d, const Pieces *in, Pieces *out, Err *err) {
    int rc = 0;
    switch (d->kind) {
    case D_BYTE_LEVEL:
        rc = byte_level(in, out);
        break;
    case D_BYTE_FALLBACK:
        rc = byte_fallback(in, out);
        break;
    case D_FUSE:
        rc = pieces_add(out, in->text.data ? in->text.data : "", in->text.len, false);
        break;
    case D_REPLACE:
        for (size_t i = 0; rc == 0 && i < in->n; i++) {
            if (pieces_begin(out, false) != 0) return err_resource(err, "decode: out of memory");
            if (pattern_replace(&d->pattern, piece_text(in, i), in->p[i].len, d->content,
                                &out->text, err) != 0)
                return -1;
            pieces_end(out);
        }
        break;
    case D_METASPACE:
        for (size_t i = 0; rc == 0 && i < in->n; i++)
            rc = metaspace(d, piece_text(in, i), in->p[i].len, i, out);
        break;
    case D_STRIP:
        for (size_t i = 0; i < in->n; i++)
            if (strip(d, piece_text(in, i), in->p[i].len, out, err) != 0) return -1;
        break;
    case D_SEQUENCE:
        break;
    }
    return rc == 0 ? 0 : err_resource(err, "decode: out of memory");
}

// Fuse assumes the pieces are back to back in the text, as every step writes them.
static int chain(const Decoder *d, Pieces *toks, Pieces *tmp, Err *err) {
    if (d->kind == D_SEQUENCE) {
        for (int i = 0; i < d->n_sub; i++)
            if (chain(d->sub[i], toks, tmp, err) != 0) return -1;
        return 0;
    }
    pieces_reset(tmp);
    tmp->keep_empty = true;
    if (step(d, toks, tmp, err) != 0) return -1;
    Pieces t = *toks;
    *toks = *tmp;
    *tmp = t;
    return 0;
}

int decode_tokens(const Decoder *d, Pieces *toks, Pieces *tmp, Buf *out, Err *err) {
    if (chain(d, toks, tmp, err) != 0) return -1;
    for (size_t i = 0; i < toks->n; i++)
        if (buf_append(out, piece_text(toks, i), toks->p[i].len) != 0)
            return err_resource(err, "decode: out of memory");
    return 0;
}
