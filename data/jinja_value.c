// jinja_value.c: the arena and the value type of the template engine: equality, truth,
// Python's str() and transformers' tojson, UTF-8 code points and Python whitespace.
#include <stdalign.h>
#include <stdlib.h>
#include <string.h>

#include "data/jinja.h"

// ------------------------------------------------------------ arena

struct ArenaBlock {
    ArenaBlock *next;
    size_t used, cap;
    alignas(max_align_t) unsigned char data[];
};

enum { ARENA_BLOCK = 64 * 1024 };

void *arena_alloc(Arena *a, size_t size) {
    size = (size + alignof(max_align_t) - 1) / alignof(max_align_t) * alignof(max_align_t);
    if (a->limit && (size > a->limit || a->used > a->limit - size)) {
        a->over = true;
        return NULL;
    }
    a->used += size;
    ArenaBlock *b = a->head;
    if (!b || b->cap - b->used < size) {
        size_t cap = size > ARENA_BLOCK ? size : ARENA_BLOCK;
        b = malloc(sizeof *b + cap);
        if (!b) return NULL;
        *b = (ArenaBlock){.next = a->head, .cap = cap};
        a->head = b;
    }
    void *p = b->data + b->used;
    b->used += size;
    return memset(p, 0, size);
}

char *arena_strndup(Arena *a, const char *s, size_t n) {
    char *p = arena_alloc(a, n + 1);
    if (p && n) memcpy(p, s, n);
    return p;
}

void arena_free(Arena *a) {
    while (a->head) {
        ArenaBlock *next = a->head->next;
        free(a->head);
        a->head = next;
    }
}

// ------------------------------------------------------------ values

const char *value_type_name(Value v) {
    static const char *const NAMES[] = {"undefined", "none", "bool", "int",
                                        "str",       "list", "dict", "function"};
    return v.t == V_DICT && v.dict->is_namespace ? "namespace" : NAMES[v.t];
}

int value_truthy(Value v) {
    switch (v.t) {
    case V_UNDEF:
    case V_NONE:
        return 0;
    case V_BOOL:
    case V_INT:
        return v.i != 0;
    case V_STR:
        return v.str.n != 0;
    case V_LIST:
        return v.list->n != 0;
    case V_DICT:
        return v.dict->is_namespace || v.dict->n != 0;
    case V_FUNC:
        return 1;
    }
    return 0;
}

Value *dict_get(const Dict *d, const char *key, size_t n) {
    for (size_t i = 0; i < d->n; i++)
        if (d->keys[i].str.n == n && memcmp(d->keys[i].str.s, key, n) == 0) return &d->vals[i];
    return NULL;
}

int dict_set(Arena *a, Dict *d, Value key, Value v) {
    Value *old = dict_get(d, key.str.s, key.str.n);
    if (old) {
        *old = v;
        return 0;
    }
    if (d->n == d->cap) { // arena arrays are not freed one by one: the old ones stay until the end
        size_t cap = d->cap ? d->cap * 2 : 4;
        Value *keys = arena_alloc(a, cap * sizeof *keys),
              *vals = arena_alloc(a, cap * sizeof *vals);
        if (!keys || !vals) return -1;
        if (d->n) {
            memcpy(keys, d->keys, d->n * sizeof *keys);
            memcpy(vals, d->vals, d->n * sizeof *vals);
        }
        d->keys = keys;
        d->vals = vals;
        d->cap = cap;
    }
    d->keys[d->n] = key;
    d->vals[d->n++] = v;
    return 0;
}

static int is_number(Value v) {
    return v.t == V_INT || v.t == V_BOOL;
}

static int dict_equal(const Dict *a, const Dict *b) {
    if (a->n != b->n || a->is_namespace || b->is_namespace) return a == b;
    for (size_t i = 0; i < a->n; i++) {
        const Value *w = dict_get(b, a->keys[i].str.s, a->keys[i].str.n);
        if (!w || !value_equal(a->vals[i], *w)) return 0;
    }
    return 1;
}

int value_equal(Value a, Value b) {
    if (is_number(a) && is_number(b)) return a.i == b.i;
    if (a.t != b.t) return 0;
    switch (a.t) {
    case V_UNDEF:
    case V_NONE:
        return 1;
    case V_STR:
        return a.str.n == b.str.n && memcmp(a.str.s, b.str.s, a.str.n) == 0;
    case V_LIST:
        if (a.list->n != b.list->n || a.list->is_tuple != b.list->is_tuple) return 0;
        for (size_t i = 0; i < a.list->n; i++)
            if (!value_equal(a.list->v[i], b.list->v[i])) return 0;
        return 1;
    case V_DICT:
        return dict_equal(a.dict, b.dict);
    case V_FUNC:
        return strcmp(a.func, b.func) == 0;
    default:
        return 0;
    }
}

// ------------------------------------------------------------ str() and repr()

static int oom(Err *err) {
    return err_resource(err, "out of memory rendering the template");
}

// Python's repr() of a string: single quotes unless it holds ' and no ".
static int repr_string(Buf *out, Value v) {
    char q = memchr(v.str.s, '\'', v.str.n) && !memchr(v.str.s, '"', v.str.n) ? '"' : '\'';
    if (buf_append(out, &q, 1)) return -1;
    for (size_t i = 0; i < v.str.n; i++) {
        unsigned char c = (unsigned char)v.str.s[i];
        int rc = c == '\\' || c == (unsigned char)q ? buf_printf(out, "\\%c", c)
                 : c == '\n'                        ? buf_append(out, "\\n", 2)
                 : c == '\r'                        ? buf_append(out, "\\r", 2)
                 : c == '\t'                        ? buf_append(out, "\\t", 2)
                 : c < 0x20 || c == 0x7f            ? buf_printf(out, "\\x%02x", c)
                                                    : buf_append(out, &v.str.s[i], 1);
        if (rc) return -1;
    }
    return buf_append(out, &q, 1);
}

static int value_repr(Buf *out, Value v, Err *err);

// A list [a, b], a tuple (a, b) or (a,), a dict {'k': v}.
static int repr_items(Buf *out, Value v, Err *err) {
    int is_list = v.t == V_LIST, is_tuple = is_list && v.list->is_tuple;
    size_t n = is_list ? v.list->n : v.dict->n;
    if (buf_append(out, is_tuple ? "(" : is_list ? "[" : "{", 1)) return oom(err);
    for (size_t i = 0; i < n; i++) {
        if (i && buf_append(out, ", ", 2)) return oom(err);
        if (!is_list && (repr_string(out, v.dict->keys[i]) || buf_append(out, ": ", 2)))
            return oom(err);
        if (value_repr(out, is_list ? v.list->v[i] : v.dict->vals[i], err)) return -1;
    }
    if (is_tuple && n == 1 && buf_append(out, ",", 1)) return oom(err);
    return buf_append(out, is_tuple ? ")" : is_list ? "]" : "}", 1) ? oom(err) : 0;
}

static int value_repr(Buf *out, Value v, Err *err) {
    if (v.t == V_STR) return repr_string(out, v) ? oom(err) : 0;
    if (v.t == V_UNDEF) return buf_append(out, "Undefined", 9) ? oom(err) : 0;
    return value_print(out, v, err);
}

int value_print(Buf *out, Value v, Err *err) {
    int rc = 0;
    switch (v.t) {
    case V_UNDEF:
        return 0;
    case V_NONE:
        rc = buf_append(out, "None", 4);
        break;
    case V_BOOL:
        rc = v.i ? buf_append(out, "True", 4) : buf_append(out, "False", 5);
        break;
    case V_INT:
        rc = buf_printf(out, "%lld", (long long)v.i);
        break;
    case V_STR:
        rc = buf_append(out, v.str.s, v.str.n);
        break;
    case V_LIST:
        return repr_items(out, v, err);
    case V_DICT:
        if (v.dict->is_namespace) return err_set(err, "a namespace has no printed form");
        return repr_items(out, v, err);
    case V_FUNC:
        return err_set(err, "function '%s' has no printed form", v.func);
    }
    return rc ? oom(err) : 0;
}

// ------------------------------------------------------------ tojson

static int json_string(Buf *out, const char *s, size_t n) {
    if (buf_append(out, "\"", 1)) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        static const char ESC[] = "\"\\\b\f\n\r\t", NAME[] = "\"\\bfnrt";
        const char *e = c ? memchr(ESC, c, sizeof ESC - 1) : NULL;
        int rc = e          ? buf_printf(out, "\\%c", NAME[e - ESC])
                 : c < 0x20 ? buf_printf(out, "\\u%04x", c)
                            : buf_append(out, &s[i], 1);
        if (rc) return -1;
    }
    return buf_append(out, "\"", 1);
}

static int json_newline(Buf *out, int indent, int depth) {
    if (indent < 0) return 0;
    if (buf_append(out, "\n", 1)) return -1;
    for (int i = 0; i < indent * depth; i++)
        if (buf_append(out, " ", 1)) return -1;
    return 0;
}

static int json_value(Buf *out, Value v, int indent, int depth, Err *err);

// A list or dict: Python's separators are ", " without indent, "," with it; ": " always.
static int json_items(Buf *out, Value v, int indent, int depth, Err *err) {
    int is_list = v.t == V_LIST;
    size_t n = is_list ? v.list->n : v.dict->n;
    if (buf_append(out, is_list ? "[" : "{", 1)) return oom(err);
    for (size_t i = 0; i < n; i++) {
        if (i && buf_append(out, indent < 0 ? ", " : ",", indent < 0 ? 2 : 1)) return oom(err);
        if (json_newline(out, indent, depth + 1)) return oom(err);
        if (!is_list && (json_string(out, v.dict->keys[i].str.s, v.dict->keys[i].str.n) ||
                         buf_append(out, ": ", 2)))
            return oom(err);
        if (json_value(out, is_list ? v.list->v[i] : v.dict->vals[i], indent, depth + 1, err))
            return -1;
    }
    if (n && json_newline(out, indent, depth)) return oom(err);
    return buf_append(out, is_list ? "]" : "}", 1) ? oom(err) : 0;
}

static int json_value(Buf *out, Value v, int indent, int depth, Err *err) {
    switch (v.t) {
    case V_NONE:
        return buf_append(out, "null", 4) ? oom(err) : 0;
    case V_BOOL:
        return (v.i ? buf_append(out, "true", 4) : buf_append(out, "false", 5)) ? oom(err) : 0;
    case V_INT:
        return buf_printf(out, "%lld", (long long)v.i) ? oom(err) : 0;
    case V_STR:
        return json_string(out, v.str.s, v.str.n) ? oom(err) : 0;
    case V_LIST:
        return json_items(out, v, indent, depth, err);
    case V_DICT:
        if (!v.dict->is_namespace) return json_items(out, v, indent, depth, err);
        return err_set(err, "tojson: a namespace is not JSON serializable");
    case V_FUNC:
        return err_set(err, "tojson: function '%s' is not JSON serializable", v.func);
    case V_UNDEF:
        break;
    }
    return err_set(err, "tojson: '%s' is undefined", v.undef_name);
}

int value_to_json(Buf *out, Value v, int indent, Err *err) {
    return json_value(out, v, indent, 0, err);
}

// ------------------------------------------------------------ UTF-8

static int is_continuation(unsigned char c) {
    return (c & 0xc0) == 0x80;
}

size_t utf8_length(const char *s, size_t n) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++)
        count += !is_continuation((unsigned char)s[i]);
    return count;
}

size_t utf8_offset(const char *s, size_t n, size_t index) {
    size_t i = 0;
    for (; i < n; i++)
        if (!is_continuation((unsigned char)s[i]) && index-- == 0) break;
    return i;
}

// The code point at s (n >= its length) and its byte length; 0 for a broken sequence.
static uint32_t decode(const char *s, size_t n, size_t *len) {
    unsigned char c = (unsigned char)s[0];
    *len = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
    if (*len == 0 || *len > n) return *len = 0;
    uint32_t cp = *len == 1 ? c : c & (0x7f >> *len);
    for (size_t i = 1; i < *len; i++) {
        if (!is_continuation((unsigned char)s[i])) return *len = 0;
        cp = cp << 6 | ((unsigned char)s[i] & 0x3f);
    }
    return cp;
}

// str.isspace(): ASCII \t-\r, \x1c-\x20, and the Unicode spaces.
static int py_is_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

size_t py_space_len(const char *s, size_t n) {
    size_t len;
    if (n == 0) return 0;
    uint32_t c = decode(s, n, &len);
    return len && py_is_space(c) ? len : 0;
}

size_t py_space_len_back(const char *s, size_t n) {
    size_t start = n;
    while (start > 0 && n - start < 4 && is_continuation((unsigned char)s[start - 1]))
        start--;
    if (start == 0) return 0;
    start--;
    return py_space_len(s + start, n - start) == n - start ? n - start : 0;
}
