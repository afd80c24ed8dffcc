// jinja.h: the private parts of the chat template engine (data/chat_template.h): an arena,
// the value type, the token and syntax tree types, and the lexer (jinja_lex.c), parser
// (jinja_parse.c) and evaluator (jinja_eval.c, with the filters, tests, methods and functions
// in jinja_builtins.c) that pass them on. The subset and its semantics (Jinja2 as
// transformers configures it): docs/data.md, "Conversations and chat templates".
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "common/buf.h"
#include "common/error.h"
#include "data/chat_template.h"

// ------------------------------------------------------------ arena

// Everything a template or a rendering allocates lives in one arena, freed at once.
typedef struct ArenaBlock ArenaBlock;
typedef struct {
    ArenaBlock *head;
    size_t used, limit; // bytes handed out; limit 0: none (arena_alloc refuses past it)
    bool over;          // a request was refused for the limit, not for the system's memory
} Arena;

// size bytes, zeroed, aligned for any type; NULL when out of memory.
void *arena_alloc(Arena *a, size_t size);
// A copy of s[0..n) with a NUL after it; NULL when out of memory.
char *arena_strndup(Arena *a, const char *s, size_t n);
void arena_free(Arena *a);

// ------------------------------------------------------------ values

// Python's values as Jinja2 sees them; undefined is Jinja2's Undefined (a missing variable,
// key or attribute).
typedef enum { V_UNDEF, V_NONE, V_BOOL, V_INT, V_STR, V_LIST, V_DICT, V_FUNC } VType;

typedef struct List List;
typedef struct Dict Dict;

typedef struct {
    VType t;
    union {
        int64_t i; // V_BOOL, V_INT
        struct {
            const char *s; // UTF-8, NUL-terminated
            size_t n;      // bytes
        } str;
        List *list;
        Dict *dict;
        const char *undef_name; // V_UNDEF: what was missing, for the error that uses it
        const char *func;       // V_FUNC: a global function's name
    };
} Value;

struct List {
    Value *v;
    size_t n;
    int is_tuple; // (k, v) pairs of items(): printed as Python prints tuples
};

// Keys are strings. A namespace() is a dict its template can assign attributes of.
struct Dict {
    Value *keys, *vals; // V_STR keys
    size_t n, cap;
    int is_namespace;
};

static inline Value v_none(void) {
    return (Value){.t = V_NONE};
}
static inline Value v_bool(int b) {
    return (Value){.t = V_BOOL, .i = b != 0};
}
static inline Value v_int(int64_t i) {
    return (Value){.t = V_INT, .i = i};
}
static inline Value v_str(const char *s, size_t n) {
    return (Value){.t = V_STR, .str = {s, n}};
}
static inline Value v_undef(const char *name) {
    return (Value){.t = V_UNDEF, .undef_name = name};
}

const char *value_type_name(Value v);
// Python's truth value.
int value_truthy(Value v);
// Python's ==, as Jinja2 applies it (1 == true; undefined == undefined).
int value_equal(Value a, Value b);
// d[key], or NULL.
Value *dict_get(const Dict *d, const char *key, size_t n);
// Sets d[key] = v (key copied by reference: it must outlive d). -1 when out of memory.
int dict_set(Arena *a, Dict *d, Value key, Value v);
// str(v) appended to out: Python's str() (None, True, [1, 'a']); undefined prints nothing.
// -1 with err set for a value without a printed form (a namespace), or out of memory.
int value_print(Buf *out, Value v, Err *err);
// json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: none), as transformers' tojson.
int value_to_json(Buf *out, Value v, int indent, Err *err);
// The number of code points of UTF-8 text; code point i's byte offset.
size_t utf8_length(const char *s, size_t n);
size_t utf8_offset(const char *s, size_t n, size_t index);
// The byte length of the Python whitespace character (str.isspace) at s[0..n), or 0.
size_t py_space_len(const char *s, size_t n);
// The byte length of the Python whitespace character ending at s[n-1], or 0.
size_t py_space_len_back(const char *s, size_t n);

// ------------------------------------------------------------ tokens

typedef enum {
    T_DATA,        // text outside tags
    T_VAR_BEGIN,   // {{
    T_VAR_END,     // }}
    T_BLOCK_BEGIN, // {%
    T_BLOCK_END,   // %}
    T_NAME,
    T_STRING, // escapes decoded
    T_INT,
    T_OP, // + - * / // % ** ~ == != < <= > >= = . : | , ( ) [ ] { }
    T_EOF
} TokKind;

typedef struct {
    TokKind kind;
    int line;
    const char *s; // text (T_DATA, T_NAME, T_STRING, T_OP), NUL-terminated in the arena
    size_t n;
    int64_t i; // T_INT
} Token;

// source (with the template's name for messages) -> tokens ending in T_EOF, with Jinja2's
// trim_blocks and lstrip_blocks applied, comments dropped; all in a.
int jinja_lex(Arena *a, const char *source, const char *name, Token **toks, size_t *n, Err *err);

// ------------------------------------------------------------ syntax tree

typedef enum {
    E_LITERAL, // lit
    E_NAME,    // name
    E_LIST,    // args
    E_DICT,    // args: key, value, key, value, ...
    E_ATTR,    // a.name
    E_INDEX,   // a[b]
    E_SLICE,   // a[b:c:d], each of b c d optional
    E_NOT,     // not a
    E_NEG,     // -a
    E_BINARY,  // a op b (arithmetic, ~, comparisons, in, not in)
    E_AND,     // a and b
    E_OR,      // a or b
    E_COND,    // b if a else c
    E_FILTER,  // a | name(args)
    E_TEST,    // a is [not] name(args); op != 0: negated
    E_CALL,    // name(args): a global function
    E_METHOD,  // a.name(args): a method of a str or dict
} ExprKind;

// Binary operators (E_BINARY op).
enum {
    OP_ADD = 1,
    OP_SUB,
    OP_MUL,
    OP_FLOORDIV,
    OP_MOD,
    OP_CONCAT,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOT_IN
};

typedef struct Expr Expr;
struct Expr {
    ExprKind kind;
    int line, op;
    Value lit;
    const char *name;
    Expr *a, *b, *c, *d;
    Expr **args;
    const char **kw; // kw[i]: the keyword of args[i], NULL for a positional one
    int n_args;
};

typedef enum { S_DATA, S_OUTPUT, S_IF, S_FOR, S_SET, S_BREAK, S_CONTINUE } StmtKind;

typedef struct Stmt Stmt;
struct Stmt {
    StmtKind kind;
    int line;
    Stmt *next;
    const char *text; // S_DATA
    size_t len;
    Expr *expr;           // S_OUTPUT, S_IF condition, S_FOR iterable, S_SET value
    Stmt *body, *orelse;  // S_IF, S_FOR (orelse: runs when the loop ran no iteration)
    const char **targets; // S_FOR loop variables, S_SET name
    int n_targets;
    Expr *cond;       // S_FOR: `for x in y if cond`
    const char *attr; // S_SET: `set ns.attr = ...`
};

// Whether name is a global function the evaluator implements (raise_exception, namespace, ...).
int jinja_is_function(const char *name);

// tokens -> the statement list of the template; unsupported constructs refused naming them.
int jinja_parse(Arena *a, const Token *toks, const char *name, Stmt **out, Err *err);

// ------------------------------------------------------------ evaluation

// The variables a rendering starts with (name -> value), and what strftime_now formats.
typedef struct {
    const char *const *names;
    const Value *values;
    int n;
    time_t now;
} JinjaGlobals;

// What a rendering has spent of its budgets (ChatLimits), and the line it is at.
typedef struct {
    ChatLimits lim;
    long iterations, ops;
    int line;
} JinjaBudget;

// Renders prog into out (its memory in a, bounded by lim's max_memory; lim NULL: the defaults).
int jinja_render(Arena *a, const Stmt *prog, const char *name, const JinjaGlobals *g,
                 const ChatLimits *lim, Buf *out, Err *err);

// ------------------------------------------------------------ evaluation internals
// Shared by jinja_eval.c (expressions, statements) and jinja_builtins.c (filters, tests,
// methods, functions). Every function returns 0, or -1 with C->err set.

typedef struct {
    Arena *a; // the rendering's values
    const char *name;
    const JinjaGlobals *g;
    Buf *out;
    Err *err;
    JinjaBudget *budget;
} JinjaCtx;

// A call's arguments: v[i] is positional when kw[i] is NULL.
typedef struct {
    Value v[8];
    const char *kw[8];
    int n;
} JinjaArgs;

static inline int value_is_int(Value v) { // bool counts, as in Python
    return v.t == V_INT || v.t == V_BOOL;
}
static inline Value value_key(const char *s) {
    return v_str(s, strlen(s));
}

// An error at a line of the template: "NAME:LINE: message".
int jinja_error(const JinjaCtx *C, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int jinja_oom(const JinjaCtx *C);
// A string of n bytes may be built (ChatLimits.max_bytes); else the budget's error at line.
int jinja_check_size(const JinjaCtx *C, int line, size_t n);
// A failure of a value_* helper (no location in its message) located at a line.
int jinja_at_line(const JinjaCtx *C, int line);
// The error of using an undefined value v.
int jinja_undefined(const JinjaCtx *C, int line, Value v);
// A list of n items in the arena (NULL when out of memory, the caller reports it).
List *jinja_new_list(const JinjaCtx *C, size_t n);
int jinja_make_str(const JinjaCtx *C, const char *s, size_t n, Value *out);
// str(v) as a string value.
int jinja_to_str(const JinjaCtx *C, int line, Value v, Value *out);
// obj[key] / obj.key; missing: undefined.
int jinja_get_item(const JinjaCtx *C, int line, Value obj, Value key, Value *out);
// The items a loop or filter walks (list elements, dict keys, string code points).
int jinja_iterate(const JinjaCtx *C, int line, Value v, List **out);
// a in b.
int jinja_contains(const JinjaCtx *C, int line, Value a, Value b, int *found);

// v is [not] name(args): *ok.
int jinja_test(const JinjaCtx *C, int line, const char *name, Value v, const JinjaArgs *a, int *ok);
// v | name(args).
int jinja_filter(const JinjaCtx *C, int line, const char *name, Value v, const JinjaArgs *a,
                 Value *out);
// v.name(args), a method of a str or dict.
int jinja_method(const JinjaCtx *C, int line, const char *name, Value v, const JinjaArgs *a,
                 Value *out);
// name(args), a global function.
int jinja_function(const JinjaCtx *C, int line, const char *name, const JinjaArgs *a, Value *out);
