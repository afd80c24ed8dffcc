// jinja_lex.c: template text -> tokens, as Jinja2's lexer cuts it with transformers' settings
// (trim_blocks, lstrip_blocks, keep_trailing_newline off; jinja2/lexer.py's rules).
#include <stdlib.h>
#include <string.h>

#include "data/jinja.h"

typedef struct {
    Arena *a;
    const char *name;
    const char *s; // the source, newlines normalized
    size_t n, pos;
    int line;
    int line_starting; // the text before pos ended a line (or is the start)
    Token *toks;
    size_t n_toks, cap;
    Err *err;
} Lexer;

static int lex_error(Lexer *L, const char *msg, const char *detail) {
    return err_set(L->err, "%s:%d: %s%s", L->name, L->line, msg, detail ? detail : "");
}

static int emit(Lexer *L, TokKind kind, const char *s, size_t n, int64_t i) {
    if (buf_reserve(&L->toks, &L->cap, L->n_toks + 1, sizeof *L->toks))
        return err_resource(L->err, "%s: out of memory for tokens", L->name);
    char *copy = arena_strndup(L->a, s, n);
    if (!copy) return err_resource(L->err, "%s: out of memory for tokens", L->name);
    L->toks[L->n_toks++] = (Token){kind, L->line, copy, n, i};
    return 0;
}

static void count_lines(Lexer *L, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        L->line += s[i] == '\n';
}

// Skips Python whitespace from pos; returns whether the last character skipped is a newline.
static int skip_space(Lexer *L) {
    int newline = 0;
    for (size_t k; (k = py_space_len(L->s + L->pos, L->n - L->pos)) != 0; L->pos += k) {
        newline = L->s[L->pos] == '\n';
        L->line += newline;
    }
    return newline;
}

// ------------------------------------------------------------ data and tag openers

// The text before a tag opener, with the opener's whitespace control applied: '-' strips all
// whitespace before it; otherwise (lstrip_blocks, not for {{ and not with '+') the spaces
// from the line's start to the tag when nothing else is on that line before it.
static size_t data_before_tag(const Lexer *L, const char *text, size_t n, char kind, char sign) {
    if (sign == '-') {
        for (size_t k; (k = py_space_len_back(text, n)) != 0;)
            n -= k;
        return n;
    }
    if (sign == '+' || kind == '{') return n;
    size_t line_start = n;
    while (line_start > 0 && text[line_start - 1] != '\n')
        line_start--;
    if (line_start == 0 && !L->line_starting) return n;
    size_t p = line_start;
    for (size_t k; p < n && (k = py_space_len(text + p, n - p)) != 0;)
        p += k;
    return p == n ? line_start : n;
}

// After a block or comment end: '-' strips all whitespace, '+' nothing, else one newline
// (trim_blocks).
static void after_block_end(Lexer *L, char sign) {
    if (sign == '-') {
        L->line_starting = skip_space(L);
    } else if (sign != '+' && L->pos < L->n && L->s[L->pos] == '\n') {
        L->pos++;
        L->line++;
        L->line_starting = 1;
    } else {
        L->line_starting = 0;
    }
}

static int lex_comment(Lexer *L) {
    const char *end = strstr(L->s + L->pos, "#}");
    if (!end) return lex_error(L, "missing end of comment tag", NULL);
    size_t at = (size_t)(end - L->s);
    char sign = at > L->pos && (end[-1] == '-' || end[-1] == '+') ? end[-1] : 0;
    count_lines(L, L->s + L->pos, at - L->pos);
    L->pos = at + 2;
    after_block_end(L, sign);
    return 0;
}

// ------------------------------------------------------------ inside tags

static int is_name_start(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static int is_digit(char c) {
    return c >= '0' && c <= '9';
}

static int lex_number(Lexer *L) {
    int64_t v = 0;
    size_t p = L->pos;
    for (; p < L->n && (is_digit(L->s[p]) || L->s[p] == '_'); p++) {
        if (L->s[p] == '_') continue;
        if (v > (INT64_MAX - 9) / 10) return lex_error(L, "integer literal too large", NULL);
        v = v * 10 + (L->s[p] - '0');
    }
    if (p + 1 < L->n && (L->s[p] == '.' || L->s[p] == 'e') && is_digit(L->s[p + 1]))
        return lex_error(L, "float literals are not supported", NULL);
    int rc = emit(L, T_INT, L->s + L->pos, p - L->pos, v);
    L->pos = p;
    return rc;
}

static int hex_value(const char *s, int digits, uint32_t *out) {
    *out = 0;
    for (int i = 0; i < digits; i++) {
        char c = s[i];
        int d = is_digit(c)            ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return -1;
        *out = *out << 4 | (uint32_t)d;
    }
    return 0;
}

static int put_utf8(Buf *b, uint32_t cp) {
    char u[4];
    size_t n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    static const unsigned char LEAD[] = {0, 0, 0xc0, 0xe0, 0xf0};
    for (size_t i = n - 1; i > 0; i--, cp >>= 6)
        u[i] = (char)(0x80 | (cp & 0x3f));
    u[0] = (char)(n == 1 ? cp : LEAD[n] | cp);
    return buf_append(b, u, n);
}

// One backslash escape at s (after the backslash), Python's unicode-escape: decoded into b;
// *used: the characters it took. Unknown escapes stay as they are.
static int unescape(Lexer *L, const char *s, size_t left, Buf *b, size_t *used) {
    static const char SIMPLE[] = "\\'\"abfnrtv", VALUE[] = "\\'\"\a\b\f\n\r\t\v";
    const char *e = left ? memchr(SIMPLE, s[0], sizeof SIMPLE - 1) : NULL;
    *used = 1;
    if (e) return buf_append(b, &VALUE[e - SIMPLE], 1);
    if (left && s[0] == '\n') return 0; // a line continuation
    if (left && s[0] >= '0' && s[0] <= '7') {
        uint32_t v = 0;
        for (*used = 0; *used < 3 && *used < left && s[*used] >= '0' && s[*used] <= '7'; ++*used)
            v = v * 8 + (uint32_t)(s[*used] - '0');
        return put_utf8(b, v);
    }
    int digits = !left ? 0 : s[0] == 'x' ? 2 : s[0] == 'u' ? 4 : s[0] == 'U' ? 8 : 0;
    if (!digits) return buf_append(b, "\\", 1) || (left && buf_append(b, s, 1)) ? -1 : 0;
    uint32_t cp;
    if ((size_t)digits >= left || hex_value(s + 1, digits, &cp) || cp > 0x10ffff ||
        (cp >= 0xd800 && cp < 0xe000)) {
        lex_error(L, "bad escape \\", s[0] == 'x' ? "x" : s[0] == 'u' ? "u" : "U");
        return 1;
    }
    *used = 1 + (size_t)digits;
    return put_utf8(b, cp);
}

static int lex_string(Lexer *L) {
    char quote = L->s[L->pos];
    size_t p = L->pos + 1;
    int line = L->line;
    Buf b = {0};
    int rc = 0;
    while (rc == 0 && p < L->n && L->s[p] != quote) {
        size_t used = 1;
        if (L->s[p] == '\\')
            rc = unescape(L, L->s + p + 1, L->n - p - 1, &b, &used), used++;
        else
            rc = buf_append(&b, L->s + p, 1);
        count_lines(L, L->s + p, used);
        p += used;
    }
    if (rc == 0 && p >= L->n) {
        L->line = line;
        rc = lex_error(L, "unterminated string literal", NULL);
    } else if (rc < 0) {
        rc = err_resource(L->err, "%s: out of memory for a string literal", L->name);
    } else if (rc == 0) {
        int end_line = L->line;
        L->line = line;
        rc = emit(L, T_STRING, b.data ? b.data : "", b.len, 0);
        L->line = end_line;
        L->pos = p + 1;
    }
    buf_free(&b);
    return rc ? -1 : 0;
}

static int lex_operator(Lexer *L, int *depth) {
    static const char *const TWO[] = {"//", "**", "==", "!=", "<=", ">="};
    const char *p = L->s + L->pos;
    for (size_t i = 0; i < sizeof TWO / sizeof *TWO; i++)
        if (L->n - L->pos >= 2 && memcmp(p, TWO[i], 2) == 0) {
            L->pos += 2;
            return emit(L, T_OP, p, 2, 0);
        }
    if (!*p || !strchr("+-*/%~<>=.:|,()[]{}", *p)) {
        char c[2] = {*p, 0};
        return lex_error(L, "unexpected character ", c);
    }
    if (strchr("([{", *p)) ++*depth;
    if (strchr(")]}", *p) && (*depth)-- == 0) {
        char c[2] = {*p, 0};
        return lex_error(L, "unexpected ", c);
    }
    L->pos++;
    return emit(L, T_OP, p, 1, 0);
}

// The tokens of a {{ }} or {% %} tag, up to and with its end.
static int lex_tag(Lexer *L, int is_block) {
    int depth = 0;
    for (;;) {
        skip_space(L);
        const char *p = L->s + L->pos;
        if (L->pos >= L->n) return lex_error(L, is_block ? "missing %}" : "missing }}", NULL);
        char close = is_block ? '%' : '}';
        char sign = *p == '-' || (*p == '+' && is_block) ? *p : 0;
        if (depth == 0 && p[sign != 0] == close && p[(sign != 0) + 1] == '}') {
            if (emit(L, is_block ? T_BLOCK_END : T_VAR_END, p, 0, 0)) return -1;
            L->pos += (sign != 0) + 2;
            if (is_block)
                after_block_end(L, sign);
            else
                L->line_starting = sign == '-' ? skip_space(L) : 0;
            return 0;
        }
        int rc = is_name_start(*p)         ? 0
                 : is_digit(*p)            ? lex_number(L)
                 : *p == '\'' || *p == '"' ? lex_string(L)
                                           : lex_operator(L, &depth);
        if (is_name_start(*p)) {
            size_t k = 1;
            while (is_name_start(p[k]) || is_digit(p[k]))
                k++;
            rc = emit(L, T_NAME, p, k, 0);
            L->pos += k;
        }
        if (rc) return -1;
    }
}

// ------------------------------------------------------------ the whole source

// The next tag opener at or after pos ("{{", "{%", "{#"), or NULL.
static const char *next_opener(const Lexer *L) {
    for (const char *p = L->s + L->pos; (p = strchr(p, '{')) != NULL; p++)
        if (p[1] == '{' || p[1] == '%' || p[1] == '#') return p;
    return NULL;
}

static int lex_all(Lexer *L) {
    for (;;) {
        const char *open = next_opener(L);
        const char *text = L->s + L->pos;
        size_t n = open ? (size_t)(open - text) : L->n - L->pos;
        char kind = open ? open[1] : 0,
             sign = open && (open[2] == '-' || open[2] == '+') ? open[2] : 0;
        size_t keep = open ? data_before_tag(L, text, n, kind, sign) : n;
        if (keep && emit(L, T_DATA, text, keep, 0)) return -1;
        count_lines(L, text, n);
        if (!open) return emit(L, T_EOF, "", 0, 0);
        L->pos += n + 2 + (sign != 0);
        L->line_starting = 0;
        int rc = kind == '#' ? lex_comment(L)
                             : emit(L, kind == '%' ? T_BLOCK_BEGIN : T_VAR_BEGIN, open, 0, 0) ||
                                   lex_tag(L, kind == '%');
        if (rc) return -1;
    }
}

// \r\n and \r become \n; one trailing newline is dropped (keep_trailing_newline off).
static char *normalize(Arena *a, const char *source, size_t *n) {
    size_t len = strlen(source);
    char *s = arena_alloc(a, len + 1);
    if (!s) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        s[o++] = source[i] == '\r' ? '\n' : source[i];
        if (source[i] == '\r' && source[i + 1] == '\n') i++;
    }
    if (o && s[o - 1] == '\n') o--;
    s[o] = 0;
    *n = o;
    return s;
}

int jinja_lex(Arena *a, const char *source, const char *name, Token **toks, size_t *n, Err *err) {
    Lexer L = {.a = a, .name = name, .line = 1, .line_starting = 1, .err = err};
    L.s = normalize(a, source, &L.n);
    if (!L.s) return err_resource(err, "%s: out of memory for the template", name);
    int rc = lex_all(&L);
    if (rc == 0) {
        *toks = arena_alloc(a, L.n_toks * sizeof **toks);
        if (*toks)
            memcpy(*toks, L.toks, L.n_toks * sizeof **toks);
        else
            rc = err_resource(err, "%s: out of memory for tokens", name);
        *n = L.n_toks;
    }
    free(L.toks);
    return rc;
}
