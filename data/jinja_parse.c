// jinja_parse.c: tokens -> syntax tree, Jinja2's grammar (jinja2/parser.py) for the subset of
// docs/data.md; a construct outside it is refused here, naming it and its line.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data/jinja.h"

typedef struct {
    Arena *a;
    const Token *t; // the current token
    const char *name;
    int loop_depth; // for break/continue
    int depth; // of nested expressions and blocks, bounded so that no input overflows the stack
    Err *err;
} Parser;

enum { MAX_DEPTH = 200 };
static const char TOO_DEEP[] = "blocks and expressions nested too deeply";

// What the evaluator implements; anything else is refused at parse time.
static const char *const FILTERS[] = {
    "trim",       "length", "count",  "tojson", "upper",   "lower",      "default", "d",
    "join",       "first",  "last",   "items",  "string",  "capitalize", "list",    "selectattr",
    "rejectattr", "select", "reject", "map",    "replace", "safe",       NULL};
static const char *const TESTS[] = {"defined",  "undefined", "none",   "string",  "mapping",
                                    "iterable", "sequence",  "number", "integer", "boolean",
                                    "true",     "false",     "odd",    "even",    "divisibleby",
                                    "equalto",  "eq",        "ne",     "in",      NULL};
static const char *const FUNCTIONS[] = {"raise_exception", "namespace", "strftime_now", "range",
                                        NULL};
static const char *const METHODS[] = {"items",  "keys",   "values",  "get",        "strip",
                                      "lstrip", "rstrip", "split",   "startswith", "endswith",
                                      "upper",  "lower",  "replace", NULL};

static int in_list(const char *const *list, const char *s) {
    for (; *list; list++)
        if (strcmp(*list, s) == 0) return 1;
    return 0;
}

int jinja_is_function(const char *name) {
    return in_list(FUNCTIONS, name);
}

static int perr(Parser *P, const char *fmt, const char *what) {
    err_set(P->err, "%s:%d: ", P->name, P->t->line);
    size_t n = strlen(P->err->msg);
    snprintf(P->err->msg + n, sizeof P->err->msg - n, fmt, what);
    return -1;
}

static int oom(Parser *P) {
    return err_resource(P->err, "%s: out of memory parsing the template", P->name);
}

static const char *tok_text(const Token *t) {
    return t->kind == T_EOF           ? "the end of the template"
           : t->kind == T_BLOCK_END   ? "%}"
           : t->kind == T_VAR_END     ? "}}"
           : t->kind == T_DATA        ? "text"
           : t->kind == T_STRING      ? "a string"
           : t->kind == T_BLOCK_BEGIN ? "{%"
           : t->kind == T_VAR_BEGIN   ? "{{"
                                      : t->s;
}

static int is_op(const Parser *P, const char *op) {
    return P->t->kind == T_OP && strcmp(P->t->s, op) == 0;
}

static int is_name(const Parser *P, const char *name) {
    return P->t->kind == T_NAME && strcmp(P->t->s, name) == 0;
}

static int expect_op(Parser *P, const char *op) {
    if (!is_op(P, op)) {
        char what[96];
        snprintf(what, sizeof what, "expected '%s', got '%s'", op, tok_text(P->t));
        return perr(P, "%s", what);
    }
    P->t++;
    return 0;
}

static int expect_name(Parser *P, const char **out) {
    if (P->t->kind != T_NAME) return perr(P, "expected a name, got '%s'", tok_text(P->t));
    *out = P->t->s;
    P->t++;
    return 0;
}

// A node at the current line; NULL (with the error set) when out of memory.
static Expr *new_expr(Parser *P, ExprKind kind) {
    Expr *e = arena_alloc(P->a, sizeof *e);
    if (!e) return oom(P), NULL;
    e->kind = kind;
    e->line = P->t->line;
    return e;
}

// ------------------------------------------------------------ expressions

static Expr *parse_expr(Parser *P);
static Expr *parse_unary(Parser *P, int with_filter);
static Expr *parse_not(Parser *P);
static Expr *parse_condexpr(Parser *P, int allow_if);

#define TRY(x)                                                                                     \
    do {                                                                                           \
        if (!(x)) return NULL;                                                                     \
    } while (0)

// Arguments up to `close` (after the opener): positional, or `name=value` when allow_kw.
static int parse_args(Parser *P, Expr *e, const char *close, int allow_kw) {
    Expr **args = NULL;
    const char **kw = NULL;
    size_t cap = 0, kcap = 0;
    int n = 0, rc = 0;
    while (rc == 0 && !is_op(P, close)) {
        if (n && expect_op(P, ",") != 0) {
            rc = -1;
            break;
        }
        if (is_op(P, close)) break; // a trailing comma
        const char *key = NULL;
        if (allow_kw && P->t->kind == T_NAME && P->t[1].kind == T_OP &&
            strcmp(P->t[1].s, "=") == 0) {
            key = P->t->s;
            P->t += 2;
        }
        Expr *v = parse_expr(P);
        if (!v) {
            rc = -1;
        } else if (buf_reserve(&args, &cap, (size_t)n + 1, sizeof *args) ||
                   buf_reserve(&kw, &kcap, (size_t)n + 1, sizeof *kw)) {
            rc = oom(P);
        } else {
            args[n] = v;
            kw[n++] = key;
        }
    }
    if (rc == 0 && expect_op(P, close) != 0) rc = -1;
    if (rc == 0 && n) {
        e->args = arena_alloc(P->a, (size_t)n * sizeof *e->args);
        e->kw = arena_alloc(P->a, (size_t)n * sizeof *e->kw);
        if (!e->args || !e->kw) {
            rc = oom(P);
        } else {
            memcpy(e->args, args, (size_t)n * sizeof *args);
            memcpy(e->kw, kw, (size_t)n * sizeof *kw);
            e->n_args = n;
        }
    }
    free(args);
    free(kw);
    return rc;
}

static Expr *parse_literal_or_name(Parser *P) {
    Expr *e = new_expr(P, E_LITERAL);
    TRY(e);
    const char *s = P->t->s;
    if (!strcmp(s, "true") || !strcmp(s, "True") || !strcmp(s, "false") || !strcmp(s, "False"))
        e->lit = v_bool(s[0] == 't' || s[0] == 'T');
    else if (!strcmp(s, "none") || !strcmp(s, "None"))
        e->lit = v_none();
    else
        *e = (Expr){.kind = E_NAME, .line = e->line, .name = s};
    P->t++;
    return e;
}

// Adjacent string literals are one string, as in Python.
static Expr *parse_string(Parser *P) {
    Expr *e = new_expr(P, E_LITERAL);
    TRY(e);
    Buf b = {0};
    int rc = 0;
    for (; rc == 0 && P->t->kind == T_STRING; P->t++)
        rc = buf_append(&b, P->t->s, P->t->n);
    char *s = rc ? NULL : arena_strndup(P->a, b.data ? b.data : "", b.len);
    size_t n = b.len;
    buf_free(&b);
    if (!s) return oom(P), NULL;
    e->lit = v_str(s, n);
    return e;
}

static Expr *parse_primary(Parser *P) {
    const Token *t = P->t;
    if (t->kind == T_NAME) return parse_literal_or_name(P);
    if (t->kind == T_STRING) return parse_string(P);
    if (t->kind == T_INT) {
        Expr *e = new_expr(P, E_LITERAL);
        TRY(e);
        e->lit = v_int(t->i);
        P->t++;
        return e;
    }
    if (is_op(P, "(")) {
        P->t++;
        Expr *e = parse_expr(P);
        TRY(e);
        if (is_op(P, ",")) return perr(P, "%s", "tuples are not supported"), NULL;
        return expect_op(P, ")") ? NULL : e;
    }
    if (is_op(P, "[") || is_op(P, "{")) {
        int is_list = is_op(P, "[");
        Expr *e = new_expr(P, is_list ? E_LIST : E_DICT);
        TRY(e);
        P->t++;
        if (is_list) return parse_args(P, e, "]", 0) ? NULL : e;
        // a dict: key: value pairs, kept as args key, value, ...
        Expr tmp = {0};
        Expr **pairs = NULL;
        size_t cap = 0;
        int n = 0, rc = 0;
        while (rc == 0 && !is_op(P, "}")) {
            if (n && expect_op(P, ",")) {
                rc = -1;
                break;
            }
            if (is_op(P, "}")) break;
            Expr *k = parse_expr(P), *v = k && !expect_op(P, ":") ? parse_expr(P) : NULL;
            if (!v)
                rc = -1;
            else if (buf_reserve(&pairs, &cap, (size_t)n + 2, sizeof *pairs))
                rc = oom(P);
            else
                pairs[n] = k, pairs[n + 1] = v, n += 2;
        }
        if (rc == 0 && expect_op(P, "}")) rc = -1;
        if (rc == 0 && n) {
            tmp.args = arena_alloc(P->a, (size_t)n * sizeof *pairs);
            if (tmp.args)
                memcpy(tmp.args, pairs, (size_t)n * sizeof *pairs);
            else
                rc = oom(P);
        }
        free(pairs);
        e->args = tmp.args;
        e->n_args = n;
        return rc ? NULL : e;
    }
    return perr(P, "unexpected '%s'", tok_text(t)), NULL;
}

// [a], [a:b], [a:b:c] with each part optional (after the '[').
static Expr *parse_subscript(Parser *P, Expr *obj) {
    Expr *e = new_expr(P, E_INDEX);
    TRY(e);
    e->a = obj;
    Expr *parts[3] = {NULL, NULL, NULL};
    int colons = 0;
    for (;;) {
        if (!is_op(P, ":") && !is_op(P, "]")) TRY(parts[colons] = parse_expr(P));
        if (!is_op(P, ":") || colons == 2) break;
        colons++;
        P->t++;
    }
    if (expect_op(P, "]")) return NULL;
    if (colons == 0 && !parts[0]) return perr(P, "%s", "empty subscript"), NULL;
    if (colons) e->kind = E_SLICE;
    e->b = parts[0];
    e->c = parts[1];
    e->d = parts[2];
    return e;
}

static Expr *parse_call(Parser *P, Expr *callee) {
    Expr *e = new_expr(P, E_CALL);
    TRY(e);
    if (callee->kind == E_NAME) {
        if (!in_list(FUNCTIONS, callee->name))
            return perr(P, "function '%s' is not supported", callee->name), NULL;
        e->name = callee->name;
    } else if (callee->kind == E_ATTR) {
        if (!in_list(METHODS, callee->name))
            return perr(P, "method '%s' is not supported", callee->name), NULL;
        e->kind = E_METHOD;
        e->name = callee->name;
        e->a = callee->a;
    } else {
        return perr(P, "%s", "only functions and methods can be called"), NULL;
    }
    P->t++;
    return parse_args(P, e, ")", 1) ? NULL : e;
}

// .name, .0, [subscript] and calls after a primary.
static Expr *parse_postfix(Parser *P, Expr *e) {
    for (;;) {
        if (is_op(P, ".")) {
            P->t++;
            Expr *x = new_expr(P, E_ATTR);
            TRY(x);
            x->a = e;
            if (P->t->kind == T_INT) {
                Expr *index = new_expr(P, E_LITERAL);
                TRY(index);
                index->lit = v_int(P->t->i);
                *x = (Expr){.kind = E_INDEX, .line = x->line, .a = e, .b = index};
                P->t++;
            } else if (expect_name(P, &x->name)) {
                return NULL;
            }
            e = x;
        } else if (is_op(P, "[")) {
            P->t++;
            TRY(e = parse_subscript(P, e));
        } else if (is_op(P, "(")) {
            TRY(e = parse_call(P, e));
        } else {
            return e;
        }
    }
}

static Expr *parse_filter(Parser *P, Expr *obj) {
    P->t++; // '|'
    Expr *e = new_expr(P, E_FILTER);
    TRY(e);
    e->a = obj;
    if (expect_name(P, &e->name)) return NULL;
    if (!in_list(FILTERS, e->name)) {
        P->t--;
        return perr(P, "filter '%s' is not supported", e->name), NULL;
    }
    if (!is_op(P, "(")) return e;
    P->t++;
    return parse_args(P, e, ")", 1) ? NULL : e;
}

static Expr *parse_test(Parser *P, Expr *obj) {
    P->t++; // 'is'
    Expr *e = new_expr(P, E_TEST);
    TRY(e);
    e->a = obj;
    if (is_name(P, "not")) {
        e->op = 1;
        P->t++;
    }
    if (is_name(P, "none") || is_name(P, "true") || is_name(P, "false")) {
        e->name = P->t->s;
        P->t++;
    } else if (expect_name(P, &e->name)) {
        return NULL;
    }
    if (!in_list(TESTS, e->name)) {
        P->t--;
        return perr(P, "test '%s' is not supported", e->name), NULL;
    }
    if (is_op(P, "(")) {
        P->t++;
        return parse_args(P, e, ")", 0) ? NULL : e;
    }
    // `is divisibleby 3`: one argument without parentheses
    int arg_follows = (P->t->kind == T_NAME && !is_name(P, "else") && !is_name(P, "or") &&
                       !is_name(P, "and") && !is_name(P, "if") && !is_name(P, "is")) ||
                      P->t->kind == T_STRING || P->t->kind == T_INT || is_op(P, "[") ||
                      is_op(P, "{");
    if (!arg_follows) return e;
    Expr *arg = parse_primary(P);
    TRY(arg);
    TRY(arg = parse_postfix(P, arg));
    e->args = arena_alloc(P->a, sizeof *e->args);
    e->kw = arena_alloc(P->a, sizeof *e->kw);
    if (!e->args || !e->kw) return oom(P), NULL;
    e->args[0] = arg;
    e->n_args = 1;
    return e;
}

static Expr *parse_unary_at(Parser *P, int with_filter) {
    Expr *e;
    if (is_op(P, "-") || is_op(P, "+")) {
        int neg = is_op(P, "-");
        Expr *x = new_expr(P, E_NEG);
        TRY(x);
        P->t++;
        TRY(x->a = parse_unary(P, 0));
        e = neg ? x : x->a;
    } else {
        TRY(e = parse_primary(P));
    }
    TRY(e = parse_postfix(P, e));
    while (with_filter) {
        if (is_op(P, "|"))
            TRY(e = parse_filter(P, e));
        else if (is_name(P, "is"))
            TRY(e = parse_test(P, e));
        else
            break;
    }
    return e;
}

static Expr *parse_unary(Parser *P, int with_filter) {
    if (++P->depth > MAX_DEPTH) return perr(P, "%s", TOO_DEEP), NULL;
    Expr *e = parse_unary_at(P, with_filter);
    P->depth--;
    return e;
}

static Expr *binary(Parser *P, int op, Expr *a, Expr *b) {
    Expr *e = new_expr(P, E_BINARY);
    if (e) {
        e->op = op;
        e->a = a;
        e->b = b;
    }
    return e;
}

typedef Expr *(*ParseFn)(Parser *P);

static Expr *parse_unary_f(Parser *P) {
    return parse_unary(P, 1);
}

// One precedence level: operand (op operand)*, ops[i] a token and opcodes[i] its operator.
static Expr *parse_level(Parser *P, ParseFn operand, const char *const *ops, const int *codes) {
    Expr *e = operand(P);
    TRY(e);
    for (;;) {
        int k = 0;
        while (ops[k] && !is_op(P, ops[k]))
            k++;
        if (!ops[k]) return e;
        if (codes[k] < 0) return perr(P, "operator '%s' is not supported", ops[k]), NULL;
        int line = P->t->line;
        P->t++;
        Expr *b = operand(P);
        TRY(b);
        TRY(e = binary(P, codes[k], e, b));
        e->line = line;
    }
}

static Expr *parse_math2(Parser *P) {
    static const char *const OPS[] = {"*", "//", "%", "/", "**", NULL};
    static const int CODES[] = {OP_MUL, OP_FLOORDIV, OP_MOD, -1, -1};
    return parse_level(P, parse_unary_f, OPS, CODES);
}

static Expr *parse_concat(Parser *P) {
    static const char *const OPS[] = {"~", NULL};
    static const int CODES[] = {OP_CONCAT};
    return parse_level(P, parse_math2, OPS, CODES);
}

static Expr *parse_math1(Parser *P) {
    static const char *const OPS[] = {"+", "-", NULL};
    static const int CODES[] = {OP_ADD, OP_SUB};
    return parse_level(P, parse_concat, OPS, CODES);
}

static int compare_op(Parser *P) {
    static const char *const OPS[] = {"==", "!=", "<", "<=", ">", ">=", NULL};
    static const int CODES[] = {OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE};
    for (int k = 0; OPS[k]; k++)
        if (is_op(P, OPS[k])) return P->t++, CODES[k];
    if (is_name(P, "in")) return P->t++, OP_IN;
    if (is_name(P, "not") && P->t[1].kind == T_NAME && strcmp(P->t[1].s, "in") == 0)
        return P->t += 2, OP_NOT_IN;
    return 0;
}

static Expr *parse_compare(Parser *P) {
    Expr *e = parse_math1(P);
    TRY(e);
    int line = P->t->line, op = compare_op(P);
    if (!op) return e;
    Expr *b = parse_math1(P);
    TRY(b);
    TRY(e = binary(P, op, e, b));
    e->line = line;
    if (compare_op(P)) return perr(P, "%s", "chained comparisons are not supported"), NULL;
    return e;
}

static Expr *parse_not_at(Parser *P) {
    if (!is_name(P, "not")) return parse_compare(P);
    Expr *e = new_expr(P, E_NOT);
    TRY(e);
    P->t++;
    TRY(e->a = parse_not(P));
    return e;
}

static Expr *parse_not(Parser *P) {
    if (++P->depth > MAX_DEPTH) return perr(P, "%s", TOO_DEEP), NULL;
    Expr *e = parse_not_at(P);
    P->depth--;
    return e;
}

static Expr *parse_bool(Parser *P, const char *word, ExprKind kind, ParseFn operand) {
    Expr *e = operand(P);
    TRY(e);
    while (is_name(P, word)) {
        Expr *x = new_expr(P, kind);
        TRY(x);
        P->t++;
        x->a = e;
        TRY(x->b = operand(P));
        e = x;
    }
    return e;
}

static Expr *parse_and(Parser *P) {
    return parse_bool(P, "and", E_AND, parse_not);
}

static Expr *parse_or(Parser *P) {
    return parse_bool(P, "or", E_OR, parse_and);
}

// a if cond [else b] (no else: undefined), right-nested as Jinja2 does.
static Expr *parse_condexpr_at(Parser *P, int allow_if) {
    Expr *e = parse_or(P);
    TRY(e);
    while (allow_if && is_name(P, "if")) {
        Expr *x = new_expr(P, E_COND);
        TRY(x);
        P->t++;
        x->b = e;
        TRY(x->a = parse_or(P));
        if (is_name(P, "else")) {
            P->t++;
            TRY(x->c = parse_condexpr(P, 1));
        }
        e = x;
    }
    return e;
}

static Expr *parse_condexpr(Parser *P, int allow_if) {
    if (++P->depth > MAX_DEPTH) return perr(P, "%s", TOO_DEEP), NULL;
    Expr *e = parse_condexpr_at(P, allow_if);
    P->depth--;
    return e;
}

static Expr *parse_expr(Parser *P) {
    return parse_condexpr(P, 1);
}

// ------------------------------------------------------------ statements

static int parse_body(Parser *P, Stmt **out, const char *const *ends);
static int parse_body_at(Parser *P, Stmt **out, const char *const *ends);

static Stmt *new_stmt(Parser *P, StmtKind kind) {
    Stmt *s = arena_alloc(P->a, sizeof *s);
    if (s) {
        s->kind = kind;
        s->line = P->t->line;
    }
    return s;
}

static int end_tag(Parser *P) {
    if (P->t->kind != T_BLOCK_END) return perr(P, "expected '%%}', got '%s'", tok_text(P->t));
    P->t++;
    return 0;
}

// After `if cond %}`: the body, then elif (a nested if in orelse), else, endif.
static int parse_if(Parser *P, Stmt *s) {
    static const char *const ENDS[] = {"elif", "else", "endif", NULL};
    if (!(s->expr = parse_expr(P)) || end_tag(P) || parse_body(P, &s->body, ENDS)) return -1;
    if (is_name(P, "elif")) {
        Stmt *e = new_stmt(P, S_IF);
        if (!e) return oom(P);
        P->t++;
        s->orelse = e;
        return parse_if(P, e);
    }
    if (is_name(P, "else")) {
        static const char *const ENDIF[] = {"endif", NULL};
        P->t++;
        if (end_tag(P) || parse_body(P, &s->orelse, ENDIF)) return -1;
    }
    P->t++; // endif
    return end_tag(P);
}

static int parse_for(Parser *P, Stmt *s) {
    const char *names[8];
    int n = 0;
    do {
        if (n == 8) return perr(P, "%s", "more than 8 loop variables");
        if (n && expect_op(P, ",")) return -1;
        if (expect_name(P, &names[n++])) return -1;
    } while (is_op(P, ","));
    if (!is_name(P, "in")) return perr(P, "expected 'in', got '%s'", tok_text(P->t));
    P->t++;
    if (!(s->expr = parse_condexpr(P, 0))) return -1;
    if (is_name(P, "if")) {
        P->t++;
        if (!(s->cond = parse_expr(P))) return -1;
    }
    if (is_name(P, "recursive")) return perr(P, "%s", "recursive loops are not supported");
    s->targets = arena_alloc(P->a, (size_t)n * sizeof *s->targets);
    if (!s->targets) return oom(P);
    memcpy(s->targets, names, (size_t)n * sizeof *names);
    s->n_targets = n;
    static const char *const ENDS[] = {"else", "endfor", NULL};
    P->loop_depth++;
    int rc = end_tag(P) || parse_body(P, &s->body, ENDS);
    P->loop_depth--;
    if (rc) return -1;
    if (is_name(P, "else")) {
        static const char *const ENDFOR[] = {"endfor", NULL};
        P->t++;
        if (end_tag(P) || parse_body(P, &s->orelse, ENDFOR)) return -1;
    }
    P->t++; // endfor
    return end_tag(P);
}

static int parse_set(Parser *P, Stmt *s) {
    s->targets = arena_alloc(P->a, sizeof *s->targets);
    if (!s->targets) return oom(P);
    s->n_targets = 1;
    if (expect_name(P, &s->targets[0])) return -1;
    if (is_op(P, ".")) {
        P->t++;
        if (expect_name(P, &s->attr)) return -1;
    }
    if (is_op(P, ",")) return perr(P, "%s", "set with several targets is not supported");
    if (P->t->kind == T_BLOCK_END)
        return perr(P, "%s", "block set ({% set x %}...) is not supported");
    if (expect_op(P, "=")) return -1;
    if (!(s->expr = parse_expr(P))) return -1;
    return end_tag(P);
}

// One {% ... %} statement (after the {%).
static int parse_block(Parser *P, Stmt **out) {
    const char *tag = P->t->kind == T_NAME ? P->t->s : "";
    Stmt *s = new_stmt(P, S_IF);
    if (!s) return oom(P);
    *out = s;
    if (!strcmp(tag, "if")) return P->t++, parse_if(P, s);
    if (!strcmp(tag, "for")) return s->kind = S_FOR, P->t++, parse_for(P, s);
    if (!strcmp(tag, "set")) return s->kind = S_SET, P->t++, parse_set(P, s);
    if (!strcmp(tag, "break") || !strcmp(tag, "continue")) {
        if (!P->loop_depth) return perr(P, "'%s' outside a loop", tag);
        s->kind = tag[0] == 'b' ? S_BREAK : S_CONTINUE;
        P->t++;
        return end_tag(P);
    }
    if (!*tag) return perr(P, "expected a tag name, got '%s'", tok_text(P->t));
    return perr(P, "tag '%s' is not supported", tag);
}

// Statements until the block tag named in ends (left current, at its name) or, with ends
// NULL, the end of the template.
static int parse_body(Parser *P, Stmt **out, const char *const *ends) {
    if (P->depth > MAX_DEPTH) return perr(P, "%s", TOO_DEEP);
    P->depth++;
    int rc = parse_body_at(P, out, ends);
    P->depth--;
    return rc;
}

static int parse_body_at(Parser *P, Stmt **out, const char *const *ends) {
    Stmt **tail = out;
    *out = NULL;
    for (;;) {
        const Token *t = P->t;
        Stmt *s = NULL;
        if (t->kind == T_EOF) {
            if (!ends) return 0;
            int last = 0;
            while (ends[last + 1])
                last++;
            return perr(P, "missing {%% %s %%}", ends[last]);
        }
        if (t->kind == T_DATA) {
            if (!(s = new_stmt(P, S_DATA))) return oom(P);
            s->text = t->s;
            s->len = t->n;
            P->t++;
        } else if (t->kind == T_VAR_BEGIN) {
            if (!(s = new_stmt(P, S_OUTPUT))) return oom(P);
            P->t++;
            if (!(s->expr = parse_expr(P))) return -1;
            if (P->t->kind != T_VAR_END) return perr(P, "expected '}}', got '%s'", tok_text(P->t));
            P->t++;
        } else { // T_BLOCK_BEGIN
            P->t++;
            if (ends && P->t->kind == T_NAME && in_list(ends, P->t->s)) return 0;
            if (P->t->kind == T_NAME && (!strncmp(P->t->s, "end", 3) || !strcmp(P->t->s, "elif") ||
                                         !strcmp(P->t->s, "else")))
                return perr(P, "unexpected '%s'", P->t->s);
            if (parse_block(P, &s)) return -1;
        }
        *tail = s;
        tail = &s->next;
    }
}

int jinja_parse(Arena *a, const Token *toks, const char *name, Stmt **out, Err *err) {
    Parser P = {.a = a, .t = toks, .name = name, .err = err};
    return parse_body(&P, out, NULL);
}
