// jinja_builtins.c: the filters, tests, methods (of str and dict) and global functions of the
// template engine's subset (docs/data.md), each as Jinja2 (or Python, for methods) defines it.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "data/jinja.h"

// ------------------------------------------------------------ arguments

// Argument `pos` (positional index) or keyword `kw` of a call, or NULL when not given.
static const Value *arg(const JinjaArgs *a, int pos, const char *kw) {
    int positional = 0;
    for (int i = 0; i < a->n; i++) {
        if (a->kw[i] ? kw && strcmp(a->kw[i], kw) == 0 : positional++ == pos) return &a->v[i];
    }
    return NULL;
}

// Refuses arguments beyond `max_pos` positional ones and keywords outside `kws`.
static int check_args(const JinjaCtx *C, int line, const char *what, const JinjaArgs *a,
                      int max_pos, const char *const *kws) {
    int positional = 0;
    for (int i = 0; i < a->n; i++) {
        if (!a->kw[i]) {
            if (++positional > max_pos) return jinja_error(C, line, "%s: too many arguments", what);
            continue;
        }
        int known = 0;
        for (const char *const *k = kws; k && *k && !known; k++)
            known = strcmp(*k, a->kw[i]) == 0;
        if (!known) return jinja_error(C, line, "%s: unexpected argument '%s'", what, a->kw[i]);
    }
    return 0;
}

static int want_str(const JinjaCtx *C, int line, const char *what, const Value *v) {
    if (!v || v->t != V_STR) return jinja_error(C, line, "%s: expected a string argument", what);
    return 0;
}

// ------------------------------------------------------------ tests

int jinja_test(const JinjaCtx *C, int line, const char *name, Value v, const JinjaArgs *a,
               int *ok) {
    const Value *x = arg(a, 0, NULL);
    int needs_arg = !strcmp(name, "divisibleby") || !strcmp(name, "equalto") ||
                    !strcmp(name, "eq") || !strcmp(name, "ne") || !strcmp(name, "in") ||
                    !strcmp(name, "==") || !strcmp(name, "!=");
    if (check_args(C, line, name, a, needs_arg, NULL)) return -1;
    if (needs_arg && !x) return jinja_error(C, line, "test '%s' needs an argument", name);
    if (!strcmp(name, "defined"))
        *ok = v.t != V_UNDEF;
    else if (!strcmp(name, "undefined"))
        *ok = v.t == V_UNDEF;
    else if (!strcmp(name, "none"))
        *ok = v.t == V_NONE;
    else if (!strcmp(name, "string"))
        *ok = v.t == V_STR;
    else if (!strcmp(name, "mapping"))
        *ok = v.t == V_DICT && !v.dict->is_namespace;
    else if (!strcmp(name, "iterable") || !strcmp(name, "sequence"))
        *ok = v.t == V_STR || v.t == V_LIST || v.t == V_UNDEF ||
              (v.t == V_DICT && !v.dict->is_namespace);
    else if (!strcmp(name, "number"))
        *ok = value_is_int(v);
    else if (!strcmp(name, "integer"))
        *ok = v.t == V_INT;
    else if (!strcmp(name, "boolean"))
        *ok = v.t == V_BOOL;
    else if (!strcmp(name, "true") || !strcmp(name, "false"))
        *ok = v.t == V_BOOL && v.i == (name[0] == 't');
    else if (!strcmp(name, "equalto") || !strcmp(name, "eq") || !strcmp(name, "=="))
        *ok = value_equal(v, *x);
    else if (!strcmp(name, "ne") || !strcmp(name, "!="))
        *ok = !value_equal(v, *x);
    else if (!strcmp(name, "in"))
        return jinja_contains(C, line, v, *x, ok);
    else { // odd, even, divisibleby
        if (!value_is_int(v) || (x && !value_is_int(*x)))
            return jinja_error(C, line, "test '%s' needs integers, got %s", name,
                               value_type_name(v));
        if (x && x->i == 0) return jinja_error(C, line, "divisibleby 0");
        *ok = name[0] == 'o' ? v.i % 2 != 0 : name[0] == 'e' ? v.i % 2 == 0 : v.i % x->i == 0;
    }
    return 0;
}

// ------------------------------------------------------------ filters and methods

static int is_ascii(Value s) {
    for (size_t i = 0; i < s.str.n; i++)
        if ((unsigned char)s.str.s[i] >= 0x80) return 0;
    return 1;
}

// upper (mode 'u'), lower ('l'), capitalize ('c'): ASCII letters only.
static int change_case(const JinjaCtx *C, int line, const char *what, Value v, char mode,
                       Value *out) {
    Value s;
    if (jinja_to_str(C, line, v, &s)) return -1;
    if (!is_ascii(s)) return jinja_error(C, line, "%s: non-ASCII text is not supported", what);
    char *t = arena_strndup(C->a, s.str.s, s.str.n);
    if (!t) return jinja_oom(C);
    for (size_t i = 0; i < s.str.n; i++) {
        int up = mode == 'u' || (mode == 'c' && i == 0);
        if (up && t[i] >= 'a' && t[i] <= 'z') t[i] = (char)(t[i] - 32);
        if (!up && t[i] >= 'A' && t[i] <= 'Z') t[i] = (char)(t[i] + 32);
    }
    *out = v_str(t, s.str.n);
    return 0;
}

// Python's str.strip/lstrip/rstrip: whitespace, or the code points of `chars`.
static int strip(const JinjaCtx *C, int line, Value v, const Value *chars, int left, int right,
                 Value *out) {
    Value s;
    if (jinja_to_str(C, line, v, &s)) return -1;
    if (chars && chars->t != V_STR && chars->t != V_NONE)
        return jinja_error(C, line, "strip: chars must be a string or none");
    if (chars && chars->t == V_NONE) chars = NULL;
    const char *p = s.str.s;
    size_t n = s.str.n;
    for (;;) { // one code point at a time from the chosen ends
        size_t k = 0;
        if (left && n) {
            k = chars ? utf8_offset(p, n, 1) : py_space_len(p, n);
            if (chars && !memmem(chars->str.s, chars->str.n, p, k)) k = 0;
            p += k, n -= k;
        }
        size_t r = 0;
        if (right && n) {
            size_t start = utf8_offset(p, n, utf8_length(p, n) - 1);
            r = chars ? n - start : py_space_len_back(p, n);
            if (chars && !memmem(chars->str.s, chars->str.n, p + start, r)) r = 0;
            n -= r;
        }
        if (!k && !r) break;
    }
    *out = v_str(p, n);
    return 0;
}

static int replace(const JinjaCtx *C, int line, Value v, const JinjaArgs *a, Value *out) {
    const Value *old = arg(a, 0, NULL), *new = arg(a, 1, NULL), *count = arg(a, 2, "count");
    Value s;
    if (check_args(C, line, "replace", a, 3, (const char *const[]){"count", NULL}) ||
        want_str(C, line, "replace", old) || want_str(C, line, "replace", new) ||
        jinja_to_str(C, line, v, &s))
        return -1;
    if (count && !value_is_int(*count))
        return jinja_error(C, line, "replace: count must be an integer");
    if (old->str.n == 0)
        return jinja_error(C, line, "replace: replacing the empty string is not supported");
    int64_t left = count && count->i >= 0 ? count->i : INT64_MAX;
    Buf b = {0};
    int rc = 0;
    const char *p = s.str.s, *end = s.str.s + s.str.n, *hit;
    while (rc == 0 && left-- > 0 && (hit = memmem(p, (size_t)(end - p), old->str.s, old->str.n))) {
        rc = buf_append(&b, p, (size_t)(hit - p)) || buf_append(&b, new->str.s, new->str.n);
        p = hit + old->str.n;
    }
    if (rc == 0) rc = buf_append(&b, p, (size_t)(end - p));
    rc = rc ? jinja_oom(C) : jinja_make_str(C, b.data ? b.data : "", b.len, out);
    buf_free(&b);
    return rc;
}

// The parts of v split at sep, or (sep none) at runs of whitespace with none at the ends;
// parts NULL: only counts them.
static size_t split_parts(Value v, const Value *sep, Value *parts) {
    const char *p = v.str.s, *end = v.str.s + v.str.n;
    size_t n = 0;
    for (;;) {
        if (!sep) {
            for (size_t k; p < end && (k = py_space_len(p, (size_t)(end - p))) != 0;)
                p += k;
            if (p == end) return n;
        }
        const char *q = p;
        while (q < end &&
               (sep ? (size_t)(end - q) < sep->str.n || memcmp(q, sep->str.s, sep->str.n) != 0
                    : py_space_len(q, (size_t)(end - q)) == 0))
            q++;
        if (parts) parts[n] = v_str(p, (size_t)(q - p));
        n++;
        if (q == end) return n;
        p = q + (sep ? sep->str.n : 0);
    }
}

static int split(const JinjaCtx *C, int line, Value v, const JinjaArgs *a, Value *out) {
    const Value *sep = arg(a, 0, "sep");
    if (check_args(C, line, "split", a, 1, (const char *const[]){"sep", NULL})) return -1;
    if (sep && sep->t != V_NONE && (sep->t != V_STR || sep->str.n == 0))
        return jinja_error(C, line, "split: sep must be a non-empty string or none");
    if (sep && sep->t == V_NONE) sep = NULL;
    List *l = jinja_new_list(C, split_parts(v, sep, NULL));
    if (!l) return jinja_oom(C);
    split_parts(v, sep, l->v);
    *out = (Value){.t = V_LIST, .list = l};
    return 0;
}

static int items_of(const JinjaCtx *C, Value v, int what, Value *out) { // 0 items, 1 keys, 2 values
    List *l = jinja_new_list(C, v.dict->n);
    if (!l) return jinja_oom(C);
    for (size_t i = 0; i < v.dict->n; i++) {
        if (what == 1 || what == 2) {
            l->v[i] = what == 1 ? v.dict->keys[i] : v.dict->vals[i];
            continue;
        }
        List *pair = jinja_new_list(C, 2);
        if (!pair) return jinja_oom(C);
        pair->is_tuple = 1;
        pair->v[0] = v.dict->keys[i];
        pair->v[1] = v.dict->vals[i];
        l->v[i] = (Value){.t = V_LIST, .list = pair};
    }
    *out = (Value){.t = V_LIST, .list = l};
    return 0;
}

static int join(const JinjaCtx *C, int line, Value v, const JinjaArgs *a, Value *out) {
    const Value *sep = arg(a, 0, "d"), *attr = arg(a, 1, "attribute");
    List *l;
    if (check_args(C, line, "join", a, 2, (const char *const[]){"d", "attribute", NULL}) ||
        (sep && want_str(C, line, "join", sep)) || jinja_iterate(C, line, v, &l))
        return -1;
    Buf b = {0};
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < l->n; i++) {
        Value item = l->v[i], s;
        if (attr && jinja_get_item(C, line, item, *attr, &item))
            rc = -1;
        else if (jinja_to_str(C, line, item, &s))
            rc = -1;
        else if ((i && sep && buf_append(&b, sep->str.s, sep->str.n)) ||
                 buf_append(&b, s.str.s, s.str.n))
            rc = jinja_oom(C);
    }
    if (rc == 0) rc = jinja_make_str(C, b.data ? b.data : "", b.len, out);
    buf_free(&b);
    return rc;
}

// select/reject (attr NULL) and selectattr/rejectattr: the items whose (attribute) passes the
// test named by the next argument (truthiness without one).
static int select_items(const JinjaCtx *C, int line, Value v, const JinjaArgs *a, int by_attr,
                        int keep, Value *out) {
    JinjaArgs rest = {.n = 0};
    const Value *attr = by_attr ? arg(a, 0, NULL) : NULL;
    const Value *test = arg(a, by_attr, NULL);
    if (by_attr && want_str(C, line, "selectattr", attr)) return -1;
    if (test && want_str(C, line, "select", test)) return -1;
    for (int i = by_attr + 1; i < a->n; i++)
        rest.v[rest.n++] = a->v[i];
    List *l, *r;
    if (jinja_iterate(C, line, v, &l)) return -1;
    if (!(r = jinja_new_list(C, l->n))) return jinja_oom(C);
    r->n = 0;
    for (size_t i = 0; i < l->n; i++) {
        Value x = l->v[i];
        int ok;
        if (attr && jinja_get_item(C, line, x, *attr, &x)) return -1;
        if (!test)
            ok = value_truthy(x);
        else if (jinja_test(C, line, test->str.s, x, &rest, &ok))
            return -1;
        if (ok == keep) r->v[r->n++] = l->v[i];
    }
    *out = (Value){.t = V_LIST, .list = r};
    return 0;
}

static int map_attribute(const JinjaCtx *C, int line, Value v, const JinjaArgs *a, Value *out) {
    const Value *attr = arg(a, 99, "attribute"), *dflt = arg(a, 99, "default");
    List *l, *r;
    if (check_args(C, line, "map", a, 0, (const char *const[]){"attribute", "default", NULL}))
        return -1;
    if (!attr) return jinja_error(C, line, "map: only map(attribute=...) is supported");
    if (jinja_iterate(C, line, v, &l)) return -1;
    if (!(r = jinja_new_list(C, l->n))) return jinja_oom(C);
    for (size_t i = 0; i < l->n; i++) {
        if (jinja_get_item(C, line, l->v[i], *attr, &r->v[i])) return -1;
        if (dflt && r->v[i].t == V_UNDEF) r->v[i] = *dflt;
    }
    *out = (Value){.t = V_LIST, .list = r};
    return 0;
}

static int tojson(const JinjaCtx *C, int line, Value v, const JinjaArgs *a, Value *out) {
    const Value *indent = arg(a, 0, "indent");
    if (check_args(C, line, "tojson", a, 1, (const char *const[]){"indent", NULL})) return -1;
    if (indent && indent->t != V_NONE && (indent->t != V_INT || indent->i < 0 || indent->i > 64))
        return jinja_error(C, line, "tojson: indent must be an integer in [0, 64] or none");
    Buf b = {0};
    int rc = value_to_json(&b, v, indent && indent->t == V_INT ? (int)indent->i : -1, C->err)
                 ? jinja_at_line(C, line)
                 : jinja_make_str(C, b.data ? b.data : "", b.len, out);
    buf_free(&b);
    return rc;
}

static int first_last(const JinjaCtx *C, int line, Value v, int last, Value *out) {
    List *l;
    if (jinja_iterate(C, line, v, &l)) return -1;
    *out = l->n ? l->v[last ? l->n - 1 : 0] : v_undef(last ? "last" : "first");
    return 0;
}

static int length(const JinjaCtx *C, int line, Value v, Value *out) {
    if (v.t == V_STR)
        *out = v_int((int64_t)utf8_length(v.str.s, v.str.n));
    else if (v.t == V_LIST)
        *out = v_int((int64_t)v.list->n);
    else if (v.t == V_DICT && !v.dict->is_namespace)
        *out = v_int((int64_t)v.dict->n);
    else if (v.t == V_UNDEF)
        *out = v_int(0);
    else
        return jinja_error(C, line, "object of type '%s' has no len()", value_type_name(v));
    return 0;
}

int jinja_filter(const JinjaCtx *C, int line, const char *f, Value v, const JinjaArgs *a,
                 Value *out) {
    int no_args = !strcmp(f, "length") || !strcmp(f, "count") || !strcmp(f, "upper") ||
                  !strcmp(f, "lower") || !strcmp(f, "capitalize") || !strcmp(f, "first") ||
                  !strcmp(f, "last") || !strcmp(f, "items") || !strcmp(f, "string") ||
                  !strcmp(f, "list") || !strcmp(f, "safe");
    if (no_args && check_args(C, line, f, a, 0, NULL)) return -1;
    if (!strcmp(f, "trim")) {
        if (check_args(C, line, f, a, 1, (const char *const[]){"chars", NULL})) return -1;
        return strip(C, line, v, arg(a, 0, "chars"), 1, 1, out);
    }
    if (!strcmp(f, "length") || !strcmp(f, "count")) return length(C, line, v, out);
    if (!strcmp(f, "tojson")) return tojson(C, line, v, a, out);
    if (!strcmp(f, "upper") || !strcmp(f, "lower") || !strcmp(f, "capitalize"))
        return change_case(C, line, f, v, f[0], out);
    if (!strcmp(f, "default") || !strcmp(f, "d")) {
        const Value *d = arg(a, 0, "default_value"), *boolean = arg(a, 1, "boolean");
        if (check_args(C, line, f, a, 2, (const char *const[]){"default_value", "boolean", NULL}))
            return -1;
        int use = v.t == V_UNDEF || (boolean && value_truthy(*boolean) && !value_truthy(v));
        *out = use ? (d ? *d : v_str("", 0)) : v;
        return 0;
    }
    if (!strcmp(f, "join")) return join(C, line, v, a, out);
    if (!strcmp(f, "first") || !strcmp(f, "last")) return first_last(C, line, v, f[0] == 'l', out);
    if (!strcmp(f, "items")) {
        Dict empty = {0};
        if (v.t == V_UNDEF) v = (Value){.t = V_DICT, .dict = &empty}; // of undefined: nothing
        if (v.t != V_DICT || v.dict->is_namespace)
            return jinja_error(C, line, "items: expected a mapping, got %s", value_type_name(v));
        return items_of(C, v, 0, out);
    }
    if (!strcmp(f, "string")) return jinja_to_str(C, line, v, out);
    if (!strcmp(f, "list")) {
        List *l;
        if (jinja_iterate(C, line, v, &l)) return -1;
        *out = (Value){.t = V_LIST, .list = l};
        return 0;
    }
    if (!strcmp(f, "selectattr") || !strcmp(f, "rejectattr") || !strcmp(f, "select") ||
        !strcmp(f, "reject")) {
        for (int i = 0; i < a->n; i++)
            if (a->kw[i]) return jinja_error(C, line, "%s: unexpected argument '%s'", f, a->kw[i]);
        return select_items(C, line, v, a, strstr(f, "attr") != NULL, f[0] == 's', out);
    }
    if (!strcmp(f, "map")) return map_attribute(C, line, v, a, out);
    if (!strcmp(f, "replace")) return replace(C, line, v, a, out);
    *out = v; // safe: autoescaping is off, so it changes nothing
    return 0;
}

int jinja_method(const JinjaCtx *C, int line, const char *m, Value v, const JinjaArgs *a,
                 Value *out) {
    if (v.t == V_UNDEF) return jinja_undefined(C, line, v);
    if (v.t == V_DICT && !v.dict->is_namespace) {
        if (!strcmp(m, "get")) {
            const Value *key = arg(a, 0, NULL), *d = arg(a, 1, NULL);
            if (check_args(C, line, m, a, 2, NULL) || want_str(C, line, "get", key)) return -1;
            const Value *found = dict_get(v.dict, key->str.s, key->str.n);
            *out = found ? *found : d ? *d : v_none();
            return 0;
        }
        int what = !strcmp(m, "items") ? 0 : !strcmp(m, "keys") ? 1 : !strcmp(m, "values") ? 2 : -1;
        if (what >= 0) return check_args(C, line, m, a, 0, NULL) ? -1 : items_of(C, v, what, out);
    }
    if (v.t == V_STR) {
        if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip"))
            return check_args(C, line, m, a, 1, NULL)
                       ? -1
                       : strip(C, line, v, arg(a, 0, NULL), m[0] != 'r', m[0] != 'l', out);
        if (!strcmp(m, "split")) return split(C, line, v, a, out);
        if (!strcmp(m, "upper") || !strcmp(m, "lower"))
            return check_args(C, line, m, a, 0, NULL) ? -1 : change_case(C, line, m, v, m[0], out);
        if (!strcmp(m, "replace")) return replace(C, line, v, a, out);
        if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
            const Value *x = arg(a, 0, NULL);
            if (check_args(C, line, m, a, 1, NULL) || want_str(C, line, m, x)) return -1;
            size_t n = x->str.n;
            const char *at = m[0] == 's' ? v.str.s : v.str.s + v.str.n - n;
            *out = v_bool(n <= v.str.n && memcmp(at, x->str.s, n) == 0);
            return 0;
        }
    }
    return jinja_error(C, line, "'%s' object has no method '%s'", value_type_name(v), m);
}

// ------------------------------------------------------------ global functions

int jinja_function(const JinjaCtx *C, int line, const char *f, const JinjaArgs *a, Value *out) {
    if (!strcmp(f, "raise_exception")) {
        Value msg = v_str("", 0);
        if (check_args(C, line, f, a, 1, NULL) || (a->n && jinja_to_str(C, line, a->v[0], &msg)))
            return -1;
        return jinja_error(C, line, "the template raised an error: %s", msg.str.s);
    }
    if (!strcmp(f, "namespace")) {
        Dict *d = arena_alloc(C->a, sizeof *d);
        if (!d) return jinja_oom(C);
        d->is_namespace = 1;
        for (int i = 0; i < a->n; i++) {
            if (!a->kw[i])
                return jinja_error(C, line, "namespace: only keyword arguments are supported");
            if (dict_set(C->a, d, value_key(a->kw[i]), a->v[i])) return jinja_oom(C);
        }
        *out = (Value){.t = V_DICT, .dict = d};
        return 0;
    }
    if (!strcmp(f, "strftime_now")) {
        const Value *fmt = arg(a, 0, NULL);
        if (check_args(C, line, f, a, 1, NULL) || want_str(C, line, f, fmt)) return -1;
        struct tm tm;
        char text[256];
        size_t n = gmtime_r(&C->g->now, &tm) ? strftime(text, sizeof text, fmt->str.s, &tm) : 0;
        if (n == 0 && fmt->str.n)
            return jinja_error(C, line, "strftime_now: cannot format '%s'", fmt->str.s);
        return jinja_make_str(C, text, n, out);
    }
    // range(stop) / range(start, stop[, step])
    if (check_args(C, line, f, a, 3, NULL)) return -1;
    for (int i = 0; i < a->n; i++)
        if (!value_is_int(a->v[i]))
            return jinja_error(C, line, "range: arguments must be integers");
    if (a->n == 0) return jinja_error(C, line, "range: expected at least 1 argument");
    int64_t start = a->n > 1 ? a->v[0].i : 0, stop = a->n > 1 ? a->v[1].i : a->v[0].i;
    int64_t step = a->n > 2 ? a->v[2].i : 1;
    if (step == 0) return jinja_error(C, line, "range: step must not be zero");
    size_t n = 0;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
        if (++n > 100000) return jinja_error(C, line, "range: more than 100000 items");
    List *l = jinja_new_list(C, n);
    if (!l) return jinja_oom(C);
    for (size_t k = 0; k < n; k++)
        l->v[k] = v_int(start + (int64_t)k * step);
    *out = (Value){.t = V_LIST, .list = l};
    return 0;
}
