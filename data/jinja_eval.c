// jinja_eval.c: runs a parsed template (data/jinja.h) with Jinja2's semantics: scopes (a loop
// iteration is a scope of its own, `if` is not), Undefined, access and Python's operators;
// the filters, tests, methods and functions are jinja_builtins.c's.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/jinja.h"

typedef struct Scope Scope;
struct Scope {
    Scope *parent;
    Dict vars;
};

enum { FLOW_OK = 0, FLOW_BREAK = 1, FLOW_CONTINUE = 2 };

// The longest string `*` makes: a bound on what a template can ask for in one step.
enum { MAX_TEXT = 1 << 30 };

int jinja_error(const JinjaCtx *C, int line, const char *fmt, ...) {
    char msg[ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return err_set(C->err, "%s:%d: %s", C->name, line, msg);
}

int jinja_oom(const JinjaCtx *C) {
    if (C->a->over)
        return jinja_error(C, C->budget->line,
                           "template budget exceeded: memory (more than %ld bytes of values; "
                           "--template_max_memory raises it)",
                           C->budget->lim.max_memory);
    return err_resource(C->err, "%s: out of memory rendering the template", C->name);
}

int jinja_check_size(const JinjaCtx *C, int line, size_t n) {
    if (n <= (size_t)C->budget->lim.max_bytes) return 0;
    return jinja_error(C, line,
                       "template budget exceeded: bytes (a string or output of %zu bytes, more "
                       "than %ld; --template_max_bytes raises it)",
                       n, C->budget->lim.max_bytes);
}

// One more operation (an expression, a loop iteration) of the rendering's budget.
static int spend_op(const JinjaCtx *C, int line) {
    if (++C->budget->ops <= C->budget->lim.max_ops) return 0;
    return jinja_error(C, line,
                       "template budget exceeded: operations (more than %ld expressions and loop "
                       "iterations; --template_max_ops raises it)",
                       C->budget->lim.max_ops);
}

int jinja_at_line(const JinjaCtx *C, int line) {
    return C->err->resource ? -1 : err_prefix(C->err, "%s:%d", C->name, line);
}

int jinja_undefined(const JinjaCtx *C, int line, Value v) {
    return jinja_error(C, line, "'%s' is undefined", v.undef_name ? v.undef_name : "value");
}

// ------------------------------------------------------------ building values

List *jinja_new_list(const JinjaCtx *C, size_t n) {
    List *l = arena_alloc(C->a, sizeof *l);
    if (!l) return NULL;
    l->n = n;
    l->v = arena_alloc(C->a, (n ? n : 1) * sizeof *l->v);
    return l->v ? l : NULL;
}

int jinja_make_str(const JinjaCtx *C, const char *s, size_t n, Value *out) {
    if (jinja_check_size(C, C->budget->line, n)) return -1;
    char *copy = arena_strndup(C->a, s, n);
    if (!copy) return jinja_oom(C);
    *out = v_str(copy, n);
    return 0;
}

int jinja_to_str(const JinjaCtx *C, int line, Value v, Value *out) {
    if (v.t == V_STR) {
        *out = v;
        return 0;
    }
    Buf b = {0};
    int rc = value_print(&b, v, C->err) ? jinja_at_line(C, line)
                                        : jinja_make_str(C, b.data ? b.data : "", b.len, out);
    buf_free(&b);
    return rc;
}

// ------------------------------------------------------------ scopes

static Value lookup(const JinjaCtx *C, const Scope *s, const char *name) {
    size_t n = strlen(name);
    for (; s; s = s->parent) {
        const Value *v = dict_get(&s->vars, name, n);
        if (v) return *v;
    }
    for (int i = 0; i < C->g->n; i++)
        if (strcmp(C->g->names[i], name) == 0) return C->g->values[i];
    if (jinja_is_function(name)) return (Value){.t = V_FUNC, .func = name};
    return v_undef(name);
}

static int scope_set(const JinjaCtx *C, Scope *s, const char *name, Value v) {
    return dict_set(C->a, &s->vars, value_key(name), v) ? jinja_oom(C) : 0;
}

// ------------------------------------------------------------ access

static int64_t py_index(int64_t i, size_t n) {
    return i < 0 ? i + (int64_t)n : i;
}

// One code point of a string, as a string.
static Value str_char(Value s, size_t index) {
    size_t at = utf8_offset(s.str.s, s.str.n, index);
    size_t end = utf8_offset(s.str.s, s.str.n, index + 1);
    return v_str(s.str.s + at, end - at);
}

// obj[key] or obj.key: a missing one is undefined, as Jinja2's getitem/getattr make it.
int jinja_get_item(const JinjaCtx *C, int line, Value obj, Value key, Value *out) {
    if (obj.t == V_UNDEF) return jinja_undefined(C, line, obj);
    *out = v_undef(key.t == V_STR ? key.str.s : "element");
    if (value_is_int(key)) { // names it "element N" for the error that may use it
        char *name = arena_alloc(C->a, 32);
        if (!name) return jinja_oom(C);
        snprintf(name, 32, "element %lld", (long long)key.i);
        out->undef_name = name;
    }
    if (obj.t == V_DICT && key.t == V_STR) {
        const Value *v = dict_get(obj.dict, key.str.s, key.str.n);
        if (v) *out = *v;
    } else if ((obj.t == V_LIST || obj.t == V_STR) && (key.t == V_INT || key.t == V_BOOL)) {
        size_t n = obj.t == V_LIST ? obj.list->n : utf8_length(obj.str.s, obj.str.n);
        int64_t i = py_index(key.i, n);
        if (i >= 0 && (size_t)i < n)
            *out = obj.t == V_LIST ? obj.list->v[i] : str_char(obj, (size_t)i);
    }
    return 0;
}

// Python's slice index rules (PySlice_AdjustIndices) for n items.
static int slice_bounds(const JinjaCtx *C, int line, const Value part[3], size_t n, int64_t *start,
                        int64_t *stop, int64_t *step) {
    for (int k = 0; k < 3; k++)
        if (part[k].t != V_NONE && part[k].t != V_INT && part[k].t != V_BOOL)
            return jinja_error(C, line, "slice indices must be integers or none, not %s",
                               value_type_name(part[k]));
    *step = part[2].t == V_NONE ? 1 : part[2].i;
    if (*step == 0) return jinja_error(C, line, "slice step cannot be zero");
    int64_t len = (int64_t)n, lo = *step < 0 ? -1 : 0, hi = *step < 0 ? len - 1 : len;
    int64_t *ends[2] = {start, stop};
    for (int k = 0; k < 2; k++) {
        if (part[k].t == V_NONE) {
            *ends[k] = (*step < 0) == (k == 0) ? hi : lo;
            continue;
        }
        int64_t v = part[k].i < 0 ? part[k].i + len : part[k].i;
        *ends[k] = v < lo ? lo : v > hi ? hi : v;
    }
    return 0;
}

static int slice(const JinjaCtx *C, int line, Value obj, const Value part[3], Value *out) {
    if (obj.t == V_UNDEF) return jinja_undefined(C, line, obj);
    if (obj.t != V_LIST && obj.t != V_STR)
        return jinja_error(C, line, "'%s' object is not subscriptable", value_type_name(obj));
    size_t n = obj.t == V_LIST ? obj.list->n : utf8_length(obj.str.s, obj.str.n);
    int64_t start = 0, stop = 0, step = 1;
    if (slice_bounds(C, line, part, n, &start, &stop, &step)) return -1;
    size_t count = 0;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
        count++;
    if (obj.t == V_LIST) {
        List *l = jinja_new_list(C, count);
        if (!l) return jinja_oom(C);
        for (size_t k = 0; k < count; k++)
            l->v[k] = obj.list->v[start + (int64_t)k * step];
        *out = (Value){.t = V_LIST, .list = l};
        return 0;
    }
    Buf b = {0};
    int rc = 0;
    for (size_t k = 0; rc == 0 && k < count; k++) {
        Value c = str_char(obj, (size_t)(start + (int64_t)k * step));
        rc = buf_append(&b, c.str.s, c.str.n);
    }
    rc = rc ? jinja_oom(C) : jinja_make_str(C, b.data ? b.data : "", b.len, out);
    buf_free(&b);
    return rc;
}

// The items a for loop or a filter walks: a list's elements, a dict's keys, a string's code
// points; undefined is empty (Jinja2's Undefined iterates as nothing).
int jinja_iterate(const JinjaCtx *C, int line, Value v, List **out) {
    if (v.t == V_LIST) {
        *out = v.list;
        return 0;
    }
    size_t n = v.t == V_DICT && !v.dict->is_namespace ? v.dict->n
               : v.t == V_STR                         ? utf8_length(v.str.s, v.str.n)
               : v.t == V_UNDEF                       ? 0
                                                      : SIZE_MAX;
    if (n == SIZE_MAX)
        return jinja_error(C, line, "'%s' object is not iterable", value_type_name(v));
    if (!(*out = jinja_new_list(C, n))) return jinja_oom(C);
    for (size_t i = 0; i < n; i++)
        (*out)->v[i] = v.t == V_DICT ? v.dict->keys[i] : str_char(v, i);
    return 0;
}

// ------------------------------------------------------------ operators

static int concat_values(const JinjaCtx *C, int line, Value a, Value b, Value *out) {
    Value sa = {0}, sb = {0};
    if (jinja_to_str(C, line, a, &sa) || jinja_to_str(C, line, b, &sb) ||
        jinja_check_size(C, line, sa.str.n + sb.str.n))
        return -1;
    char *s = arena_alloc(C->a, sa.str.n + sb.str.n + 1);
    if (!s) return jinja_oom(C);
    memcpy(s, sa.str.s, sa.str.n);
    memcpy(s + sa.str.n, sb.str.s, sb.str.n);
    *out = v_str(s, sa.str.n + sb.str.n);
    return 0;
}

static int join_lists(const JinjaCtx *C, Value a, Value b, Value *out) {
    List *l = jinja_new_list(C, a.list->n + b.list->n);
    if (!l) return jinja_oom(C);
    if (a.list->n) memcpy(l->v, a.list->v, a.list->n * sizeof *l->v);
    if (b.list->n) memcpy(l->v + a.list->n, b.list->v, b.list->n * sizeof *l->v);
    *out = (Value){.t = V_LIST, .list = l};
    return 0;
}

static int repeat(const JinjaCtx *C, int line, Value s, int64_t times, Value *out) {
    if (times > 0 && s.str.n > (size_t)(MAX_TEXT / times))
        return jinja_error(C, line, "string repetition past %d bytes", MAX_TEXT);
    if (times > 0 && jinja_check_size(C, line, s.str.n * (size_t)times)) return -1;
    Buf b = {0};
    int rc = 0;
    for (int64_t k = 0; rc == 0 && k < times; k++)
        rc = buf_append(&b, s.str.s, s.str.n);
    rc = rc ? jinja_oom(C) : jinja_make_str(C, b.data ? b.data : "", b.len, out);
    buf_free(&b);
    return rc;
}

static int arithmetic(const JinjaCtx *C, int line, int op, Value a, Value b, Value *out) {
    static const char SYM[][3] = {"", "+", "-", "*", "//", "%"};
    if (op == OP_ADD && a.t == V_STR && b.t == V_STR) return concat_values(C, line, a, b, out);
    if (op == OP_ADD && a.t == V_LIST && b.t == V_LIST) return join_lists(C, a, b, out);
    if (op == OP_MUL && a.t == V_STR && value_is_int(b)) return repeat(C, line, a, b.i, out);
    if (op == OP_MUL && value_is_int(a) && b.t == V_STR) return repeat(C, line, b, a.i, out);
    if (!value_is_int(a) || !value_is_int(b))
        return jinja_error(C, line, "unsupported operand types for %s: '%s' and '%s'", SYM[op],
                           value_type_name(a), value_type_name(b));
    int64_t x = a.i, y = b.i, r = 0;
    int overflow = 0;
    if (op == OP_ADD) overflow = __builtin_add_overflow(x, y, &r);
    if (op == OP_SUB) overflow = __builtin_sub_overflow(x, y, &r);
    if (op == OP_MUL) overflow = __builtin_mul_overflow(x, y, &r);
    if (op == OP_FLOORDIV || op == OP_MOD) {
        if (y == 0) return jinja_error(C, line, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1)
            overflow = 1;
        else if (op == OP_FLOORDIV)
            r = x / y - ((x % y != 0) && ((x < 0) != (y < 0)));
        else
            r = x % y + ((x % y != 0) && ((x < 0) != (y < 0)) ? y : 0);
    }
    if (overflow) return jinja_error(C, line, "integer overflow in %s", SYM[op]);
    *out = v_int(r);
    return 0;
}

static int compare(const JinjaCtx *C, int line, int op, Value a, Value b, Value *out) {
    static const char *const SYM[] = {"<", "<=", ">", ">="};
    int c;
    if (value_is_int(a) && value_is_int(b)) {
        c = (a.i > b.i) - (a.i < b.i);
    } else if (a.t == V_STR && b.t == V_STR) {
        size_t n = a.str.n < b.str.n ? a.str.n : b.str.n;
        c = memcmp(a.str.s, b.str.s, n); // UTF-8 byte order is code point order
        if (c == 0) c = (a.str.n > b.str.n) - (a.str.n < b.str.n);
    } else {
        return jinja_error(C, line, "'%s' not supported between '%s' and '%s'", SYM[op - OP_LT],
                           value_type_name(a), value_type_name(b));
    }
    *out = v_bool(op == OP_LT ? c < 0 : op == OP_LE ? c <= 0 : op == OP_GT ? c > 0 : c >= 0);
    return 0;
}

// a in b: a substring, a list element, a dict key.
int jinja_contains(const JinjaCtx *C, int line, Value a, Value b, int *found) {
    *found = 0;
    if (b.t == V_UNDEF) return jinja_undefined(C, line, b);
    if (b.t == V_STR) {
        if (a.t != V_STR)
            return jinja_error(C, line, "'in <string>' requires a string, not %s",
                               value_type_name(a));
        *found = a.str.n == 0 || memmem(b.str.s, b.str.n, a.str.s, a.str.n) != NULL;
    } else if (b.t == V_LIST) {
        for (size_t i = 0; i < b.list->n && !*found; i++)
            *found = value_equal(a, b.list->v[i]);
    } else if (b.t == V_DICT && !b.dict->is_namespace) {
        *found = a.t == V_STR && dict_get(b.dict, a.str.s, a.str.n) != NULL;
    } else {
        return jinja_error(C, line, "argument of type '%s' is not iterable", value_type_name(b));
    }
    return 0;
}

static int binary(const JinjaCtx *C, int line, int op, Value a, Value b, Value *out) {
    if (op == OP_CONCAT) return concat_values(C, line, a, b, out);
    if (op == OP_EQ || op == OP_NE) {
        *out = v_bool(value_equal(a, b) == (op == OP_EQ));
        return 0;
    }
    if (op == OP_IN || op == OP_NOT_IN) {
        int found;
        if (jinja_contains(C, line, a, b, &found)) return -1;
        *out = v_bool(found == (op == OP_IN));
        return 0;
    }
    if (a.t == V_UNDEF) return jinja_undefined(C, line, a);
    if (b.t == V_UNDEF) return jinja_undefined(C, line, b);
    if (op >= OP_LT) return compare(C, line, op, a, b, out);
    return arithmetic(C, line, op, a, b, out);
}

// ------------------------------------------------------------ expressions

static int eval(const JinjaCtx *C, Scope *s, const Expr *e, Value *out);

static int eval_args(const JinjaCtx *C, Scope *s, const Expr *e, JinjaArgs *args) {
    if (e->n_args > 8) return jinja_error(C, e->line, "more than 8 arguments to '%s'", e->name);
    args->n = e->n_args;
    for (int i = 0; i < e->n_args; i++) {
        args->kw[i] = e->kw ? e->kw[i] : NULL;
        if (eval(C, s, e->args[i], &args->v[i])) return -1;
    }
    return 0;
}

static int eval_collection(const JinjaCtx *C, Scope *s, const Expr *e, Value *out) {
    if (e->kind == E_LIST) {
        List *l = jinja_new_list(C, (size_t)e->n_args);
        if (!l) return jinja_oom(C);
        for (int i = 0; i < e->n_args; i++)
            if (eval(C, s, e->args[i], &l->v[i])) return -1;
        *out = (Value){.t = V_LIST, .list = l};
        return 0;
    }
    Dict *d = arena_alloc(C->a, sizeof *d);
    if (!d) return jinja_oom(C);
    for (int i = 0; i < e->n_args; i += 2) {
        Value k, v;
        if (eval(C, s, e->args[i], &k) || eval(C, s, e->args[i + 1], &v)) return -1;
        if (k.t != V_STR)
            return jinja_error(C, e->line, "dict keys must be strings, not %s", value_type_name(k));
        if (dict_set(C->a, d, k, v)) return jinja_oom(C);
    }
    *out = (Value){.t = V_DICT, .dict = d};
    return 0;
}

static int eval_slice(const JinjaCtx *C, Scope *s, const Expr *e, Value *out) {
    Value obj, part[3] = {v_none(), v_none(), v_none()};
    const Expr *parts[3] = {e->b, e->c, e->d};
    if (eval(C, s, e->a, &obj)) return -1;
    for (int k = 0; k < 3; k++)
        if (parts[k] && eval(C, s, parts[k], &part[k])) return -1;
    return slice(C, e->line, obj, part, out);
}

static int eval(const JinjaCtx *C, Scope *s, const Expr *e, Value *out) {
    Value a, b;
    JinjaArgs args;
    if (spend_op(C, e->line)) return -1;
    switch (e->kind) {
    case E_LITERAL:
        *out = e->lit;
        return 0;
    case E_NAME:
        *out = lookup(C, s, e->name);
        return 0;
    case E_LIST:
    case E_DICT:
        return eval_collection(C, s, e, out);
    case E_ATTR:
        return eval(C, s, e->a, &a) ? -1 : jinja_get_item(C, e->line, a, value_key(e->name), out);
    case E_INDEX:
        return eval(C, s, e->a, &a) || eval(C, s, e->b, &b) ? -1
                                                            : jinja_get_item(C, e->line, a, b, out);
    case E_SLICE:
        return eval_slice(C, s, e, out);
    case E_NOT:
        if (eval(C, s, e->a, &a)) return -1;
        *out = v_bool(!value_truthy(a));
        return 0;
    case E_NEG:
        if (eval(C, s, e->a, &a)) return -1;
        return arithmetic(C, e->line, OP_SUB, v_int(0), a, out);
    case E_BINARY:
        return eval(C, s, e->a, &a) || eval(C, s, e->b, &b) ? -1
                                                            : binary(C, e->line, e->op, a, b, out);
    case E_AND:
    case E_OR:
        if (eval(C, s, e->a, &a)) return -1;
        if (value_truthy(a) == (e->kind == E_OR)) return *out = a, 0;
        return eval(C, s, e->b, out);
    case E_COND:
        if (eval(C, s, e->a, &a)) return -1;
        if (value_truthy(a)) return eval(C, s, e->b, out);
        if (e->c) return eval(C, s, e->c, out);
        *out = v_undef("the conditional expression's else");
        return 0;
    case E_FILTER:
        return eval(C, s, e->a, &a) || eval_args(C, s, e, &args)
                   ? -1
                   : jinja_filter(C, e->line, e->name, a, &args, out);
    case E_TEST: {
        int ok;
        if (eval(C, s, e->a, &a) || eval_args(C, s, e, &args) ||
            jinja_test(C, e->line, e->name, a, &args, &ok))
            return -1;
        *out = v_bool(ok != e->op);
        return 0;
    }
    case E_CALL:
        if (eval_args(C, s, e, &args)) return -1;
        b = lookup(C, s, e->name);
        if (b.t != V_FUNC) return jinja_error(C, e->line, "'%s' is not callable", e->name);
        return jinja_function(C, e->line, e->name, &args, out);
    case E_METHOD:
        return eval(C, s, e->a, &a) || eval_args(C, s, e, &args)
                   ? -1
                   : jinja_method(C, e->line, e->name, a, &args, out);
    }
    return jinja_error(C, e->line, "unknown expression");
}

// ------------------------------------------------------------ statements

static int exec_body(const JinjaCtx *C, Scope *s, const Stmt *st);

static int bind_targets(const JinjaCtx *C, Scope *s, const Stmt *st, Value item) {
    if (st->n_targets == 1) return scope_set(C, s, st->targets[0], item);
    if (item.t != V_LIST || item.list->n != (size_t)st->n_targets)
        return jinja_error(C, st->line, "cannot unpack %s into %d loop variables",
                           value_type_name(item), st->n_targets);
    for (int k = 0; k < st->n_targets; k++)
        if (scope_set(C, s, st->targets[k], item.list->v[k])) return -1;
    return 0;
}

// The loop variable of iteration i of n items, into *loop (made at the first iteration, its
// fields overwritten at the next ones).
static int loop_value(const JinjaCtx *C, const List *items, size_t i, Dict **loop) {
    Dict *d = *loop ? *loop : (*loop = arena_alloc(C->a, sizeof *d));
    if (!d) return jinja_oom(C);
    int64_t n = (int64_t)items->n, k = (int64_t)i;
    const struct {
        const char *name;
        Value v;
    } fields[] = {
        {"index", v_int(k + 1)},
        {"index0", v_int(k)},
        {"revindex", v_int(n - k)},
        {"revindex0", v_int(n - k - 1)},
        {"first", v_bool(k == 0)},
        {"last", v_bool(k == n - 1)},
        {"length", v_int(n)},
        {"depth", v_int(1)},
        {"depth0", v_int(0)},
        {"previtem", k > 0 ? items->v[k - 1] : v_undef("loop.previtem")},
        {"nextitem", k + 1 < n ? items->v[k + 1] : v_undef("loop.nextitem")},
    };
    for (size_t f = 0; f < sizeof fields / sizeof *fields; f++)
        if (dict_set(C->a, d, value_key(fields[f].name), fields[f].v)) return jinja_oom(C);
    return 0;
}

// `for x in y if cond`: the items cond keeps (evaluated with x bound, without loop).
static int filter_items(const JinjaCtx *C, Scope *s, const Stmt *st, List **items) {
    List *kept = jinja_new_list(C, (*items)->n);
    if (!kept) return jinja_oom(C);
    kept->n = 0;
    for (size_t i = 0; i < (*items)->n; i++) {
        Scope inner = {.parent = s};
        Value ok;
        if (bind_targets(C, &inner, st, (*items)->v[i]) || eval(C, &inner, st->cond, &ok))
            return -1;
        if (value_truthy(ok)) kept->v[kept->n++] = (*items)->v[i];
    }
    *items = kept;
    return 0;
}

static int exec_for(const JinjaCtx *C, Scope *s, const Stmt *st) {
    Value it;
    List *items;
    if (eval(C, s, st->expr, &it) || jinja_iterate(C, st->line, it, &items)) return -1;
    if (st->cond && filter_items(C, s, st, &items)) return -1;
    // One scope and one loop object for every iteration, emptied and refilled (an iteration's
    // sets do not outlive it): an iteration allocates nothing, so an empty loop costs no memory.
    Scope inner = {.parent = s};
    Dict *loop = NULL;
    for (size_t i = 0; i < items->n; i++) {
        if (++C->budget->iterations > C->budget->lim.max_iterations)
            return jinja_error(C, st->line,
                               "template budget exceeded: iterations (more than %ld loop "
                               "iterations; --template_max_iterations raises it)",
                               C->budget->lim.max_iterations);
        inner.vars.n = 0;
        if (spend_op(C, st->line) || bind_targets(C, &inner, st, items->v[i]) ||
            loop_value(C, items, i, &loop) ||
            scope_set(C, &inner, "loop", (Value){.t = V_DICT, .dict = loop}))
            return -1;
        int rc = exec_body(C, &inner, st->body);
        if (rc < 0) return -1;
        if (rc == FLOW_BREAK) break;
    }
    if (items->n == 0 && st->orelse) {
        Scope inner = {.parent = s};
        return exec_body(C, &inner, st->orelse) < 0 ? -1 : 0;
    }
    return 0;
}

static int exec_set(const JinjaCtx *C, Scope *s, const Stmt *st) {
    Value v;
    if (eval(C, s, st->expr, &v)) return -1;
    if (!st->attr) return scope_set(C, s, st->targets[0], v);
    Value ns = lookup(C, s, st->targets[0]);
    if (ns.t != V_DICT || !ns.dict->is_namespace)
        return jinja_error(C, st->line, "cannot assign attribute on non-namespace object '%s'",
                           st->targets[0]);
    return dict_set(C->a, ns.dict, value_key(st->attr), v) ? jinja_oom(C) : 0;
}

static int exec_stmt(const JinjaCtx *C, Scope *s, const Stmt *st) {
    Value v;
    C->budget->line = st->line;
    switch (st->kind) {
    case S_DATA:
        return buf_append(C->out, st->text, st->len) ? jinja_oom(C)
                                                     : jinja_check_size(C, st->line, C->out->len);
    case S_OUTPUT:
        if (eval(C, s, st->expr, &v)) return -1;
        return value_print(C->out, v, C->err) ? jinja_at_line(C, st->line)
                                              : jinja_check_size(C, st->line, C->out->len);
    case S_IF:
        if (eval(C, s, st->expr, &v)) return -1;
        return exec_body(C, s, value_truthy(v) ? st->body : st->orelse);
    case S_FOR:
        return exec_for(C, s, st);
    case S_SET:
        return exec_set(C, s, st);
    case S_BREAK:
        return FLOW_BREAK;
    case S_CONTINUE:
        return FLOW_CONTINUE;
    }
    return jinja_error(C, st->line, "unknown statement");
}

// FLOW_BREAK / FLOW_CONTINUE stop the body and travel up to the loop.
static int exec_body(const JinjaCtx *C, Scope *s, const Stmt *st) {
    for (; st; st = st->next) {
        int rc = exec_stmt(C, s, st);
        if (rc != FLOW_OK) return rc;
    }
    return FLOW_OK;
}

static long or_default(long v, long fallback) {
    return v > 0 ? v : fallback;
}

int jinja_render(Arena *a, const Stmt *prog, const char *name, const JinjaGlobals *g,
                 const ChatLimits *lim, Buf *out, Err *err) {
    ChatLimits given = lim ? *lim : (ChatLimits){0};
    JinjaBudget budget = {
        .lim = {.max_iterations = or_default(given.max_iterations, CHAT_DEFAULT_ITERATIONS),
                .max_bytes = or_default(given.max_bytes, CHAT_DEFAULT_BYTES),
                .max_memory = or_default(given.max_memory, CHAT_DEFAULT_MEMORY),
                .max_ops = or_default(given.max_ops, CHAT_DEFAULT_OPS)}};
    a->limit = (size_t)budget.lim.max_memory;
    JinjaCtx C = {.a = a, .name = name, .g = g, .out = out, .err = err, .budget = &budget};
    Scope top = {0};
    return exec_body(&C, &top, prog) < 0 ? -1 : 0;
}
