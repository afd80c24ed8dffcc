// tok_text.c: UTF-8, piece lists, PCRE2 regexes and patterns, and the JSON getters of the
// tokenizer's components (tok_internal.h).
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "data/tok_internal.h"

// ------------------------------------------------------------ UTF-8

int utf8_decode(const char *s_, size_t n, uint32_t *cp) {
    const unsigned char *s = (const unsigned char *)s_;
    unsigned char c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int len = c >= 0xC2 && c <= 0xDF   ? 2
              : c >= 0xE0 && c <= 0xEF ? 3
              : c >= 0xF0 && c <= 0xF4 ? 4
                                       : 0;
    if (!len || (size_t)len > n) return 0;
    // The second byte's range excludes overlong forms, surrogates and values past U+10FFFF.
    unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
    unsigned char hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
    if (s[1] < lo || s[1] > hi) return 0;
    uint32_t v = c & (0x7F >> len);
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = v << 6 | (s[i] & 0x3F);
    }
    *cp = v;
    return len;
}

int utf8_encode(uint32_t cp, char out[4]) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12);
        out[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18);
    out[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

int is_white_space(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
           cp == 0x205F || cp == 0x3000;
}

int is_word_char(uint32_t cp) {
    if (cp == 0x200C || cp == 0x200D) return 1;
    switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
        return 1;
    default:
        return 0;
    }
}

// The length of the maximal subpart of an invalid sequence at s: the lead byte and the
// continuation bytes that could still have completed it (at least 1).
static size_t maximal_subpart(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    int len = c >= 0xC2 && c <= 0xDF   ? 2
              : c >= 0xE0 && c <= 0xEF ? 3
              : c >= 0xF0 && c <= 0xF4 ? 4
                                       : 0;
    if (!len) return 1;
    unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
    unsigned char hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
    size_t i = 1;
    if (i < n && s[1] >= lo && s[1] <= hi)
        for (i = 2; i < (size_t)len && i < n && (s[i] & 0xC0) == 0x80;)
            i++;
    return i;
}

int utf8_lossy(const char *s, size_t n, Buf *out) {
    size_t start = 0, i = 0;
    while (i < n) {
        uint32_t cp;
        int k = utf8_decode(s + i, n - i, &cp);
        if (k) {
            i += (size_t)k;
            continue;
        }
        if (buf_append(out, s + start, i - start) != 0 || buf_append(out, "\xEF\xBF\xBD", 3) != 0)
            return -1;
        i += maximal_subpart((const unsigned char *)s + i, n - i);
        start = i;
    }
    return buf_append(out, s + start, n - start);
}

// ------------------------------------------------------------ pieces

int pieces_begin(Pieces *ps, bool at_origin) {
    if (buf_reserve(&ps->p, &ps->cap, ps->n + 1, sizeof *ps->p) != 0) return -1;
    ps->p[ps->n] = (Piece){ps->text.len, 0, at_origin};
    return 0;
}

void pieces_end(Pieces *ps) {
    Piece *p = &ps->p[ps->n];
    p->len = ps->text.len - p->off;
    if (p->len || ps->keep_empty) ps->n++;
}

int pieces_add(Pieces *ps, const char *s, size_t len, bool at_origin) {
    if (pieces_begin(ps, at_origin) != 0 || buf_append(&ps->text, s, len) != 0) return -1;
    pieces_end(ps);
    return 0;
}

void pieces_reset(Pieces *ps) {
    ps->n = 0;
    ps->text.len = 0;
}

void pieces_free(Pieces *ps) {
    buf_free(&ps->text);
    free(ps->p);
    *ps = (Pieces){0};
}

int ids_push(Ids *ids, const int32_t *v, size_t n) {
    if (buf_reserve(&ids->v, &ids->cap, ids->n + n, sizeof *ids->v) != 0) return -1;
    memcpy(ids->v + ids->n, v, n * sizeof *v);
    ids->n += n;
    return 0;
}

// ------------------------------------------------------------ regexes

// onig's (tokenizers') \s is Unicode White_Space and its \w is Alphabetic, marks, decimal
// digits, connector punctuation and Join_Control; PCRE2's UCP \s also takes U+180E and its
// \w differs too. So these escapes are spelled out as the properties before compiling.
#define ONIG_WORD "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}"

static int translate_escapes(const char *p, const char *where, Buf *out, Err *err) {
    bool in_class = false;
    int rc = 0;
    for (; rc == 0 && *p; p++) {
        if (*p == '\\' && p[1]) {
            char c = *++p;
            if (c == 'W' && in_class)
                return err_set(err, "%s: \\W inside a character class is not supported", where);
            const char *rep = c == 's'   ? "\\p{White_Space}"
                              : c == 'S' ? "\\P{White_Space}"
                              : c == 'w' ? (in_class ? ONIG_WORD : "[" ONIG_WORD "]")
                              : c == 'W' ? "[^" ONIG_WORD "]"
                                         : NULL;
            char esc[2] = {'\\', c};
            rc = rep ? buf_append(out, rep, strlen(rep)) : buf_append(out, esc, 2);
            continue;
        }
        if (!in_class && *p == '[') { // "[]..." and "[^]...": the ']' is a member
            in_class = true;
            size_t n = 1 + (p[1] == '^');
            n += p[n] == ']';
            rc = buf_append(out, p, n);
            p += n - 1;
            continue;
        }
        if (in_class && p[0] == '[' && p[1] == ':') { // a POSIX class inside: copied whole
            const char *end = strstr(p + 2, ":]");
            size_t n = end ? (size_t)(end + 2 - p) : 1;
            rc = buf_append(out, p, n);
            p += n - 1;
            continue;
        }
        if (in_class && *p == ']') in_class = false;
        rc = buf_append(out, p, 1);
    }
    return rc == 0 ? 0 : err_resource(err, "%s: out of memory", where);
}

int regex_compile(Regex *re, const char *pattern, const char *where, Err *err) {
    int code;
    PCRE2_SIZE at;
    *re = (Regex){0};
    Buf pcre = {0};
    if (translate_escapes(pattern, where, &pcre, err) != 0) {
        buf_free(&pcre);
        return -1;
    }
    re->code = pcre2_compile((PCRE2_SPTR)(pcre.data ? pcre.data : ""), pcre.len,
                             PCRE2_UTF | PCRE2_UCP, &code, &at, NULL);
    buf_free(&pcre);
    if (!re->code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        return err_set(err, "%s: regex /%s/: %s", where, pattern, (const char *)msg);
    }
    pcre2_jit_compile(re->code, PCRE2_JIT_COMPLETE); // without JIT, the interpreter matches
    re->md = pcre2_match_data_create_from_pattern(re->code, NULL);
    if (!re->md) {
        regex_free(re);
        return err_resource(err, "%s: out of memory for a regex", where);
    }
    return 0;
}

int regex_next(const Regex *re, const char *s, size_t n, size_t from, size_t *ms, size_t *me,
               Err *err) {
    int rc = pcre2_match(re->code, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK, re->md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return rc == PCRE2_ERROR_NOMEMORY ? err_resource(err, "regex: %s", (const char *)msg)
                                          : err_set(err, "regex: %s", (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(re->md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}

void regex_free(Regex *re) {
    pcre2_match_data_free(re->md);
    pcre2_code_free(re->code);
    *re = (Regex){0};
}

int pattern_parse(const cJSON *j, const char *where, Pattern *p, Err *err) {
    *p = (Pattern){0};
    const cJSON *lit = cJSON_GetObjectItemCaseSensitive(j, "String");
    const cJSON *rx = cJSON_GetObjectItemCaseSensitive(j, "Regex");
    if (cJSON_IsString(lit) && !rx) {
        p->literal_len = strlen(lit->valuestring);
        if (!p->literal_len) return err_set(err, "%s: an empty String pattern", where);
        p->literal = strdup(lit->valuestring);
        return p->literal ? 0 : err_resource(err, "%s: out of memory", where);
    }
    if (cJSON_IsString(rx) && !lit) return regex_compile(&p->re, rx->valuestring, where, err);
    return err_set(err, "%s: must be {\"String\": s} or {\"Regex\": r}", where);
}

int pattern_next(const Pattern *p, const char *s, size_t n, size_t from, size_t *ms, size_t *me,
                 Err *err) {
    if (!p->literal) return regex_next(&p->re, s, n, from, ms, me, err);
    const char *hit = from <= n ? memmem(s + from, n - from, p->literal, p->literal_len) : NULL;
    if (!hit) return 0;
    *ms = (size_t)(hit - s);
    *me = *ms + p->literal_len;
    return 1;
}

void pattern_free(Pattern *p) {
    free(p->literal);
    regex_free(&p->re);
}

int pattern_replace(const Pattern *p, const char *s, size_t n, const char *content, Buf *out,
                    Err *err) {
    size_t at = 0, from = 0, ms, me, clen = strlen(content);
    int rc;
    while (from <= n && (rc = pattern_next(p, s, n, from, &ms, &me, err)) == 1) {
        if (buf_append(out, s + at, ms - at) != 0 || buf_append(out, content, clen) != 0)
            return err_resource(err, "out of memory replacing a pattern");
        at = me;
        from = me > ms ? me : me < n ? me + utf8_char_len(s + me) : n + 1;
        if (me == ms && me < n) { // an empty match: the character after it stays
            if (buf_append(out, s + me, from - me) != 0)
                return err_resource(err, "out of memory replacing a pattern");
            at = from;
        }
    }
    if (rc < 0) return -1;
    if (at < n && buf_append(out, s + at, n - at) != 0)
        return err_resource(err, "out of memory replacing a pattern");
    return 0;
}

// ------------------------------------------------------------ JSON getters

int json_string(const cJSON *o, const char *key, const char *where, bool required, const char *dflt,
                const char **out, Err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) {
        if (required) return err_set(err, "%s.%s: missing", where, key);
        *out = dflt;
        return 0;
    }
    if (!cJSON_IsString(v)) return err_set(err, "%s.%s: must be a string", where, key);
    *out = v->valuestring;
    return 0;
}

int json_bool(const cJSON *o, const char *key, const char *where, bool dflt, bool *out, Err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) {
        *out = dflt;
        return 0;
    }
    if (!cJSON_IsBool(v)) return err_set(err, "%s.%s: must be true or false", where, key);
    *out = cJSON_IsTrue(v);
    return 0;
}

int json_int(const cJSON *o, const char *key, const char *where, int dflt, int *out, Err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v || cJSON_IsNull(v)) {
        *out = dflt;
        return 0;
    }
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble <= INT_MAX) ||
        v->valuedouble != (double)(int)v->valuedouble)
        return err_set(err, "%s.%s: must be an integer >= 0", where, key);
    *out = (int)v->valuedouble;
    return 0;
}

int json_type(const cJSON *o, const char *where, const char **type, Err *err) {
    if (!cJSON_IsObject(o)) return err_set(err, "%s: must be an object", where);
    return json_string(o, "type", where, true, NULL, type, err);
}

int unsupported(const char *where, const char *type, Err *err) {
    return err_set(err, "%s type '%s' is not supported", where, type);
}
