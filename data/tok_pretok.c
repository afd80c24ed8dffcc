// tok_pretok.c: normalizers (NFC/NFD/NFKC/NFKD by utf8proc, Lowercase, Strip, Replace,
// Prepend, Sequence) and pre-tokenizers (ByteLevel, Split, Metaspace, Digits, Sequence) of
// tokenizer.json, as tokenizers 0.20 applies them; regexes are PCRE2's.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "data/tok_internal.h"

// ------------------------------------------------------------ normalizers

typedef enum { N_UNICODE, N_LOWERCASE, N_STRIP, N_REPLACE, N_PREPEND, N_SEQUENCE } NormKind;

struct Normalizer {
    NormKind kind;
    utf8proc_option_t unicode; // N_UNICODE: the utf8proc options of NFC, NFD, NFKC or NFKD
    bool left, right;          // N_STRIP
    Pattern pattern;           // N_REPLACE
    char *content;             // N_REPLACE: the replacement; N_PREPEND: the prefix
    Normalizer **sub;          // N_SEQUENCE
    int n_sub;
};

static const struct {
    const char *name;
    utf8proc_option_t options;
} UNICODE_FORMS[] = {
    {"NFC", UTF8PROC_STABLE | UTF8PROC_COMPOSE},
    {"NFD", UTF8PROC_STABLE | UTF8PROC_DECOMPOSE},
    {"NFKC", UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT},
    {"NFKD", UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT},
};

static int copy_string(const cJSON *o, const char *key, const char *where, char **out, Err *err) {
    const char *s;
    if (json_string(o, key, where, true, NULL, &s, err) != 0) return -1;
    *out = strdup(s);
    return *out ? 0 : err_resource(err, "%s: out of memory", where);
}

// Parses the array j[key] of components with `parse` into (*sub, *n).
static int parse_list(const cJSON *j, const char *key, const char *where, void ***sub, int *n,
                      int (*parse)(const cJSON *, const char *, void **, Err *), Err *err) {
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!cJSON_IsArray(arr)) return err_set(err, "%s.%s: missing or not an array", where, key);
    *sub = calloc((size_t)cJSON_GetArraySize(arr) + 1, sizeof **sub);
    if (!*sub) return err_resource(err, "%s: out of memory", where);
    for (const cJSON *e = arr->child; e; e = e->next) {
        char at[256];
        snprintf(at, sizeof at, "%s.%s[%d]", where, key, *n);
        int rc = parse(e, at, &(*sub)[*n], err);
        if (!(*sub)[*n]) return rc ? -1 : err_set(err, "%s: must be an object", at);
        (*n)++; // freed with the list, parsed in full or not
        if (rc != 0) return -1;
    }
    return 0;
}

static int parse_normalizer_any(const cJSON *j, const char *where, void **out, Err *err) {
    return normalizer_parse(j, where, (Normalizer **)out, err);
}

static int parse_normalizer_body(const cJSON *j, const char *where, const char *type, Normalizer *n,
                                 Err *err) {
    for (size_t i = 0; i < sizeof UNICODE_FORMS / sizeof *UNICODE_FORMS; i++)
        if (strcmp(type, UNICODE_FORMS[i].name) == 0) {
            n->kind = N_UNICODE;
            n->unicode = UNICODE_FORMS[i].options;
            return 0;
        }
    if (strcmp(type, "Lowercase") == 0) {
        n->kind = N_LOWERCASE;
        return 0;
    }
    if (strcmp(type, "Strip") == 0) {
        n->kind = N_STRIP;
        return json_bool(j, "strip_left", where, true, &n->left, err) ||
               json_bool(j, "strip_right", where, true, &n->right, err);
    }
    if (strcmp(type, "Prepend") == 0) {
        n->kind = N_PREPEND;
        return copy_string(j, "prepend", where, &n->content, err);
    }
    if (strcmp(type, "Replace") == 0) {
        n->kind = N_REPLACE;
        char at[300];
        snprintf(at, sizeof at, "%s.pattern", where);
        return pattern_parse(cJSON_GetObjectItemCaseSensitive(j, "pattern"), at, &n->pattern,
                             err) ||
               copy_string(j, "content", where, &n->content, err);
    }
    if (strcmp(type, "Sequence") == 0) {
        n->kind = N_SEQUENCE;
        return parse_list(j, "normalizers", where, (void ***)&n->sub, &n->n_sub,
                          parse_normalizer_any, err);
    }
    return unsupported(where, type, err);
}

int normalizer_parse(const cJSON *j, const char *where, Normalizer **out, Err *err) {
    *out = NULL;
    if (!j || cJSON_IsNull(j)) return 0;
    const char *type;
    if (json_type(j, where, &type, err) != 0) return -1;
    Normalizer *n = calloc(1, sizeof *n);
    if (!n) return err_resource(err, "%s: out of memory", where);
    *out = n;
    return parse_normalizer_body(j, where, type, n, err);
}

void normalizer_free(Normalizer *n) {
    if (!n) return;
    for (int i = 0; i < n->n_sub; i++)
        normalizer_free(n->sub[i]);
    free(n->sub);
    pattern_free(&n->pattern);
    free(n->content);
    free(n);
}

static int utf8proc_form(utf8proc_option_t options, const char *s, size_t len, Buf *out, Err *err) {
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t n =
        utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &dst, options);
    if (n < 0)
        return n == UTF8PROC_ERROR_NOMEM ? err_resource(err, "normalizer: out of memory")
                                         : err_set(err, "normalizer: %s", utf8proc_errmsg(n));
    int rc = buf_append(out, dst, (size_t)n);
    free(dst);
    return rc == 0 ? 0 : err_resource(err, "normalizer: out of memory");
}

// The end of the stretch that starts at s[from] (not ASCII): where a run of 32 ASCII bytes
// begins, or len.
static size_t stretch_end(const char *s, size_t from, size_t len) {
    for (size_t k = from, run = 0; k < len; k++)
        if ((unsigned char)s[k] >= 0x80)
            run = 0;
        else if (++run == 32)
            return k - 31;
    return len;
}

// A Unicode normal form. ASCII is its own normal form in all four, and nothing composes with
// an ASCII character that follows it, so only the stretches between long ASCII runs go
// through utf8proc (each with the ASCII character before it, which may compose with them).
static int unicode_form(utf8proc_option_t options, const char *s, size_t len, Buf *out, Err *err) {
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && (unsigned char)s[j] < 0x80)
            j++;
        size_t start = j > i && j < len ? j - 1 : j;
        if (buf_append(out, s + i, start - i) != 0)
            return err_resource(err, "normalizer: out of memory");
        if (start == len) break;
        i = stretch_end(s, j, len);
        if (utf8proc_form(options, s + start, i - start, out, err) != 0) return -1;
    }
    return 0;
}

// Rust's char::to_lowercase per character: Unicode's lowercase mapping, whose only
// multi-character case is U+0130 (i + combining dot above).
static int lowercase(const char *s, size_t len, Buf *out) {
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        int k = utf8_decode(s + i, len - i, &cp);
        i += (size_t)k;
        char u[8];
        int m = cp == 0x130 ? (memcpy(u, "i\xCC\x87", 3), 3)
                            : utf8_encode((uint32_t)utf8proc_tolower((utf8proc_int32_t)cp), u);
        if (buf_append(out, u, (size_t)m) != 0) return -1;
    }
    return 0;
}

static int strip(const Normalizer *n, const char *s, size_t len, Buf *out) {
    size_t a = 0, b = len;
    uint32_t cp;
    int k;
    while (n->left && a < b && (k = utf8_decode(s + a, b - a, &cp)) && is_white_space(cp))
        a += (size_t)k;
    while (n->right && b > a) {
        size_t c = b - 1;
        while (c > a && ((unsigned char)s[c] & 0xC0) == 0x80)
            c--;
        if (!utf8_decode(s + c, b - c, &cp) || !is_white_space(cp)) break;
        b = c;
    }
    return buf_append(out, s + a, b - a);
}

static int normalize_sequence(const Normalizer *n, const char *s, size_t len, Buf *out, Err *err) {
    if (buf_append(out, s, len) != 0) return err_resource(err, "normalizer: out of memory");
    Buf tmp = {0};
    int rc = 0;
    for (int i = 0; rc == 0 && i < n->n_sub; i++) {
        rc = normalize(n->sub[i], out->data ? out->data : "", out->len, &tmp, err);
        Buf t = *out;
        *out = tmp;
        tmp = t;
    }
    buf_free(&tmp);
    return rc;
}

int normalize(const Normalizer *n, const char *s, size_t len, Buf *out, Err *err) {
    out->len = 0;
    int rc = 0;
    switch (n->kind) {
    case N_UNICODE:
        return unicode_form(n->unicode, s, len, out, err);
    case N_LOWERCASE:
        rc = lowercase(s, len, out);
        break;
    case N_STRIP:
        rc = strip(n, s, len, out);
        break;
    case N_REPLACE:
        return pattern_replace(&n->pattern, s, len, n->content, out, err);
    case N_PREPEND:
        rc = (len && buf_append(out, n->content, strlen(n->content))) || buf_append(out, s, len);
        break;
    case N_SEQUENCE:
        return normalize_sequence(n, s, len, out, err);
    }
    return rc == 0 ? 0 : err_resource(err, "normalizer: out of memory");
}

// ------------------------------------------------------------ pre-tokenizers

typedef enum { P_BYTE_LEVEL, P_SPLIT, P_METASPACE, P_SEQUENCE } PreKind;
typedef enum { ISOLATED, REMOVED, MERGED_PREVIOUS, MERGED_NEXT, CONTIGUOUS } Behavior;
typedef enum { PREPEND_NEVER, PREPEND_FIRST, PREPEND_ALWAYS } PrependScheme;

typedef struct {
    size_t s, e;
    bool m; // a match of the pattern
} Seg;

typedef struct {
    Seg *g;
    size_t n, cap;
    Buf text; // a piece with its prefix
} PreScratch;

struct PreTok {
    PreKind kind;
    bool add_prefix_space, use_regex; // ByteLevel
    Pattern pattern;                  // Split, Digits; ByteLevel's regex; Metaspace's replacement
    Behavior behavior;
    bool invert;
    PrependScheme prepend; // Metaspace
    bool split;            // Metaspace
    PreTok **sub;
    int n_sub;
    PreScratch *scratch;
};

// ByteLevel's regex (GPT-2's).
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int parse_pretok_any(const cJSON *j, const char *where, void **out, Err *err) {
    return pretok_parse(j, where, (PreTok **)out, err);
}

static int parse_behavior(const cJSON *j, const char *where, Behavior *b, Err *err) {
    static const char *const NAMES[] = {"Isolated", "Removed", "MergedWithPrevious",
                                        "MergedWithNext", "Contiguous"};
    const char *name;
    if (json_string(j, "behavior", where, true, NULL, &name, err) != 0) return -1;
    for (int i = 0; i < 5; i++)
        if (strcmp(name, NAMES[i]) == 0) {
            *b = (Behavior)i;
            return 0;
        }
    return err_set(err,
                   "%s.behavior: '%s' is not Isolated, Removed, MergedWithPrevious, "
                   "MergedWithNext or Contiguous",
                   where, name);
}

static int parse_metaspace(const cJSON *j, const char *where, PreTok *p, Err *err) {
    const char *rep, *scheme;
    bool add_prefix_space;
    if (json_string(j, "replacement", where, true, NULL, &rep, err) != 0 ||
        json_string(j, "prepend_scheme", where, false, NULL, &scheme, err) != 0 ||
        json_bool(j, "add_prefix_space", where, true, &add_prefix_space, err) != 0 ||
        json_bool(j, "split", where, true, &p->split, err) != 0)
        return -1;
    uint32_t cp;
    size_t len = strlen(rep);
    if (!len || (size_t)utf8_decode(rep, len, &cp) != len)
        return err_set(err, "%s.replacement: '%s' is not one character", where, rep);
    p->prepend = !scheme                     ? (add_prefix_space ? PREPEND_ALWAYS : PREPEND_NEVER)
                 : !strcmp(scheme, "always") ? PREPEND_ALWAYS
                 : !strcmp(scheme, "first")  ? PREPEND_FIRST
                 : !strcmp(scheme, "never")  ? PREPEND_NEVER
                                             : (PrependScheme)-1;
    if ((int)p->prepend < 0)
        return err_set(err, "%s.prepend_scheme: '%s' is not first, always or never", where, scheme);
    p->pattern.literal = strdup(rep); // split on the replacement (MergedWithNext)
    p->pattern.literal_len = len;
    return p->pattern.literal ? 0 : err_resource(err, "%s: out of memory", where);
}

static int parse_pretok_body(const cJSON *j, const char *where, const char *type, PreTok *p,
                             Err *err) {
    char at[300];
    snprintf(at, sizeof at, "%s.pattern", where);
    if (strcmp(type, "ByteLevel") == 0) {
        p->kind = P_BYTE_LEVEL;
        return json_bool(j, "add_prefix_space", where, true, &p->add_prefix_space, err) ||
               json_bool(j, "use_regex", where, true, &p->use_regex, err) ||
               (p->use_regex && regex_compile(&p->pattern.re, GPT2_PATTERN, where, err));
    }
    if (strcmp(type, "Split") == 0) {
        p->kind = P_SPLIT;
        return pattern_parse(cJSON_GetObjectItemCaseSensitive(j, "pattern"), at, &p->pattern,
                             err) ||
               parse_behavior(j, where, &p->behavior, err) ||
               json_bool(j, "invert", where, false, &p->invert, err);
    }
    if (strcmp(type, "Digits") == 0) { // char::is_numeric: the N categories
        bool individual;
        p->kind = P_SPLIT;
        if (json_bool(j, "individual_digits", where, false, &individual, err) != 0) return -1;
        p->behavior = individual ? ISOLATED : CONTIGUOUS;
        return regex_compile(&p->pattern.re, "\\p{N}", where, err);
    }
    if (strcmp(type, "Metaspace") == 0) {
        p->kind = P_METASPACE;
        return parse_metaspace(j, where, p, err);
    }
    if (strcmp(type, "Sequence") == 0) {
        p->kind = P_SEQUENCE;
        return parse_list(j, "pretokenizers", where, (void ***)&p->sub, &p->n_sub, parse_pretok_any,
                          err);
    }
    return unsupported(where, type, err);
}

int pretok_parse(const cJSON *j, const char *where, PreTok **out, Err *err) {
    *out = NULL;
    if (!j || cJSON_IsNull(j)) return 0;
    const char *type;
    if (json_type(j, where, &type, err) != 0) return -1;
    PreTok *p = calloc(1, sizeof *p);
    if (p) p->scratch = calloc(1, sizeof *p->scratch);
    if (!p || !p->scratch) {
        free(p);
        return err_resource(err, "%s: out of memory", where);
    }
    *out = p;
    return parse_pretok_body(j, where, type, p, err);
}

void pretok_free(PreTok *p) {
    if (!p) return;
    for (int i = 0; i < p->n_sub; i++)
        pretok_free(p->sub[i]);
    free(p->sub);
    pattern_free(&p->pattern);
    free(p->scratch->g);
    buf_free(&p->scratch->text);
    free(p->scratch);
    free(p);
}

static int seg_add(PreScratch *sc, size_t s, size_t e, bool m) {
    if (buf_reserve(&sc->g, &sc->cap, sc->n + 1, sizeof *sc->g) != 0) return -1;
    sc->g[sc->n++] = (Seg){s, e, m};
    return 0;
}

// The matches of pat in s[0..n) and the gaps between them, in order (tokenizers'
// Pattern::find_matches); an empty match moves the search on by one character.
static int find_segments(const Pattern *pat, const char *s, size_t n, PreScratch *sc, Err *err) {
    sc->n = 0;
    size_t prev = 0, from = 0, ms, me;
    int rc;
    while (from <= n && (rc = pattern_next(pat, s, n, from, &ms, &me, err)) == 1) {
        if ((prev != ms && seg_add(sc, prev, ms, false)) || seg_add(sc, ms, me, true))
            return err_resource(err, "pre-tokenizer: out of memory");
        prev = me;
        from = me > ms ? me : me < n ? me + utf8_char_len(s + me) : n + 1;
    }
    if (rc < 0) return -1;
    if (prev != n && seg_add(sc, prev, n, false) != 0)
        return err_resource(err, "pre-tokenizer: out of memory");
    return 0;
}

// Appends s[0..n) as a piece, each byte mapped to its ByteLevel character if `map`.
static int add_piece(Pieces *out, const char *s, size_t n, bool at_origin, bool map) {
    if (!map) return pieces_add(out, s, n, at_origin);
    Buf *t = &out->text; // each byte becomes 1 or 2 bytes of UTF-8
    if (pieces_begin(out, at_origin) != 0 || buf_reserve(&t->data, &t->cap, t->len + 2 * n + 1, 1))
        return -1;
    for (size_t k = 0; k < n; k++)
        t->len += (size_t)utf8_encode(byte_level_char((unsigned char)s[k]), t->data + t->len);
    t->data[t->len] = 0;
    pieces_end(out);
    return 0;
}

// Emits the segments of s as pieces, grouped by behavior (NormalizedString::split).
static int emit_segments(const PreScratch *sc, Behavior b, bool invert, const char *s,
                         bool at_origin, bool map, Pieces *out) {
    const Seg *g = sc->g;
    for (size_t i = 0; i < sc->n; i++) {
        bool m = g[i].m != invert;
        size_t a = g[i].s, e = g[i].e;
        if (b == REMOVED && m) continue;
        if (b == MERGED_NEXT && m && i + 1 < sc->n && (g[i + 1].m == invert)) e = g[++i].e;
        if (b == MERGED_PREVIOUS && i + 1 < sc->n && g[i + 1].m != invert && !m) e = g[++i].e;
        while (b == CONTIGUOUS && i + 1 < sc->n && (g[i + 1].m != invert) == m)
            e = g[++i].e;
        if (add_piece(out, s + a, e - a, at_origin && a == 0, map) != 0) return -1;
    }
    return 0;
}

static int split_piece(const PreTok *p, const Pattern *pat, Behavior b, const char *s, size_t n,
                       bool at_origin, bool map, Pieces *out, Err *err) {
    if (find_segments(pat, s, n, p->scratch, err) != 0) return -1;
    if (emit_segments(p->scratch, b, p->invert, s, at_origin, map, out) != 0)
        return err_resource(err, "pre-tokenizer: out of memory");
    return 0;
}

// GPT-2's bytes_to_unicode: the printable Latin-1 bytes are their own character, the others
// (0-32, 127-160, 173) take U+0100 onwards in byte order.
uint32_t byte_level_char(unsigned char b) {
    return b <= 32 ? 256u + b : b >= 127 && b <= 160 ? 289u + (b - 127u) : b == 173 ? 323u : b;
}

int byte_level_byte(uint32_t cp) {
    if (cp < 256) return byte_level_char((unsigned char)cp) == cp ? (int)cp : -1;
    return cp <= 288 ? (int)cp - 256 : cp <= 322 ? (int)cp - 289 + 127 : cp == 323 ? 173 : -1;
}

static int byte_level(const PreTok *p, const char *s, size_t n, bool at_origin, Pieces *out,
                      Err *err) {
    Buf *t = &p->scratch->text;
    t->len = 0;
    if ((p->add_prefix_space && s[0] != ' ' && buf_append(t, " ", 1)) || buf_append(t, s, n))
        return err_resource(err, "pre-tokenizer: out of memory");
    if (p->use_regex)
        return split_piece(p, &p->pattern, ISOLATED, t->data, t->len, at_origin, true, out, err);
    if (add_piece(out, t->data, t->len, at_origin, true) != 0)
        return err_resource(err, "pre-tokenizer: out of memory");
    return 0;
}

static int metaspace(const PreTok *p, const char *s, size_t n, bool at_origin, Pieces *out,
                     Err *err) {
    const char *rep = p->pattern.literal;
    size_t rep_len = p->pattern.literal_len;
    Buf *t = &p->scratch->text;
    t->len = 0;
    // Spaces become the replacement first: a leading one counts as starting with it.
    bool starts = s[0] == ' ' || (n >= rep_len && memcmp(s, rep, rep_len) == 0);
    bool prepend =
        !starts && (p->prepend == PREPEND_ALWAYS || (p->prepend == PREPEND_FIRST && at_origin));
    int rc = prepend ? buf_append(t, rep, rep_len) : 0;
    for (size_t i = 0; rc == 0 && i < n; i++)
        rc = s[i] == ' ' ? buf_append(t, rep, rep_len) : buf_append(t, s + i, 1);
    if (rc != 0) return err_resource(err, "pre-tokenizer: out of memory");
    if (!p->split)
        return pieces_add(out, t->data, t->len, at_origin) == 0
                   ? 0
                   : err_resource(err, "pre-tokenizer: out of memory");
    return split_piece(p, &p->pattern, MERGED_NEXT, t->data, t->len, at_origin, false, out, err);
}

static int pretok_piece(const PreTok *p, const char *s, size_t n, bool at_origin, Pieces *out,
                        Err *err) {
    switch (p->kind) {
    case P_BYTE_LEVEL:
        return byte_level(p, s, n, at_origin, out, err);
    case P_SPLIT:
        return split_piece(p, &p->pattern, p->behavior, s, n, at_origin, false, out, err);
    case P_METASPACE:
        return metaspace(p, s, n, at_origin, out, err);
    case P_SEQUENCE:
        break;
    }
    return 0;
}

int pretokenize(const PreTok *p, Pieces *ps, Pieces *tmp, Err *err) {
    if (p->kind == P_SEQUENCE) {
        for (int i = 0; i < p->n_sub; i++)
            if (pretokenize(p->sub[i], ps, tmp, err) != 0) return -1;
        return 0;
    }
    pieces_reset(tmp);
    for (size_t i = 0; i < ps->n; i++)
        if (pretok_piece(p, piece_text(ps, i), ps->p[i].len, ps->p[i].at_origin, tmp, err) != 0)
            return -1;
    Pieces t = *ps;
    *ps = *tmp;
    *tmp = t;
    return 0;
}
