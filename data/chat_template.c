// chat_template.c: the chat template API over the Jinja2 subset of data/jinja.h: parsing,
// rendering with transformers' variables, and the assistant spans of a conversation.
#include "data/chat_template.h"

#include <stdlib.h>
#include <string.h>

#include "data/jinja.h"

struct ChatTemplate {
    Arena arena; // the name, the tokens and the syntax tree
    const char *name;
    Stmt *prog;
};

int chat_template_parse(const char *source, const char *name, ChatTemplate **out, Err *err) {
    ChatTemplate *t = calloc(1, sizeof *t);
    if (!t) return err_resource(err, "%s: out of memory for the template", name);
    Token *toks;
    size_t n;
    t->name = arena_strndup(&t->arena, name, strlen(name));
    int rc = !t->name ? err_resource(err, "%s: out of memory for the template", name)
                      : jinja_lex(&t->arena, source, t->name, &toks, &n, err) ||
                            jinja_parse(&t->arena, toks, t->name, &t->prog, err);
    if (rc) {
        chat_template_free(t);
        return -1;
    }
    *out = t;
    return 0;
}

// messages as a list of {"role", "content"} dicts.
static int messages_value(Arena *a, const ChatMessage *msgs, int n, Value *out) {
    List *l = arena_alloc(a, sizeof *l);
    Value *items = arena_alloc(a, (size_t)(n ? n : 1) * sizeof *items);
    if (!l || !items) return -1;
    for (int i = 0; i < n; i++) {
        Dict *d = arena_alloc(a, sizeof *d);
        if (!d || dict_set(a, d, v_str("role", 4), v_str(msgs[i].role, strlen(msgs[i].role))) ||
            dict_set(a, d, v_str("content", 7), v_str(msgs[i].content, strlen(msgs[i].content))))
            return -1;
        items[i] = (Value){.t = V_DICT, .dict = d};
    }
    *l = (List){.v = items, .n = (size_t)n};
    *out = (Value){.t = V_LIST, .list = l};
    return 0;
}

static Value str_or_undef(const char *s, const char *name) {
    return s ? v_str(s, strlen(s)) : v_undef(name);
}

int chat_template_render(const ChatTemplate *t, const ChatMessage *msgs, int n_msgs,
                         const ChatVars *vars, char **out, size_t *len, Err *err) {
    static const char *const NAMES[] = {"messages",   "add_generation_prompt",
                                        "tools",      "documents",
                                        "bos_token",  "eos_token",
                                        "pad_token",  "unk_token",
                                        "date_string"};
    enum { N_GLOBALS = sizeof NAMES / sizeof *NAMES };
    Arena a = {0};
    Value values[N_GLOBALS] = {
        {0},
        v_bool(vars->add_generation_prompt),
        v_none(),
        v_none(),
        str_or_undef(vars->bos_token, "bos_token"),
        str_or_undef(vars->eos_token, "eos_token"),
        str_or_undef(vars->pad_token, "pad_token"),
        str_or_undef(vars->unk_token, "unk_token"),
        str_or_undef(vars->date_string, "date_string"),
    };
    // An undefined global is left out, so that `x is defined` and assignments see no x.
    const char *names[N_GLOBALS];
    Value defined[N_GLOBALS];
    int n = 0;
    for (int i = 0; i < N_GLOBALS; i++)
        if (i == 0 || values[i].t != V_UNDEF) names[n] = NAMES[i], defined[n++] = values[i];
    Buf b = {0};
    int rc = messages_value(&a, msgs, n_msgs, &defined[0])
                 ? err_resource(err, "%s: out of memory for the messages", t->name)
                 : 0;
    JinjaGlobals g = {names, defined, n, vars->now};
    if (rc == 0) rc = jinja_render(&a, t->prog, t->name, &g, vars->limits, &b, err);
    if (rc == 0 && !b.data && buf_append(&b, "", 0))
        rc = err_resource(err, "%s: out of memory for the rendering", t->name);
    arena_free(&a);
    if (rc) {
        buf_free(&b);
        return -1;
    }
    *len = b.len;
    *out = buf_take(&b);
    return 0;
}

// The span of assistant message i in the whole rendering full[0..n_full).
static int assistant_span(const ChatTemplate *t, const ChatMessage *msgs, int i,
                          const ChatVars *vars, const char *full, size_t n_full, ChatSpan *span,
                          Err *err) {
    ChatVars with_prompt = *vars, without = *vars;
    with_prompt.add_generation_prompt = 1;
    without.add_generation_prompt = 0;
    char *p = NULL, *q = NULL;
    size_t np = 0, nq = 0;
    int rc = chat_template_render(t, msgs, i, &with_prompt, &p, &np, err) ||
             chat_template_render(t, msgs, i + 1, &without, &q, &nq, err);
    if (rc)
        err_prefix(err, "message %d (assistant): rendering the conversation up to it", i);
    else if (np > nq || memcmp(p, q, np) != 0)
        rc = err_set(err,
                     "%s: message %d (assistant): the rendering before it with the generation "
                     "prompt is not a prefix of the rendering with it, so its span is unknown",
                     t->name, i);
    else if (nq > n_full || memcmp(q, full, nq) != 0)
        rc = err_set(err,
                     "%s: message %d (assistant): the rendering up to it is not a prefix of the "
                     "whole conversation's, so its span is unknown",
                     t->name, i);
    *span = (ChatSpan){np, nq};
    free(p);
    free(q);
    return rc ? -1 : 0;
}

int chat_template_assistant_spans(const ChatTemplate *t, const ChatMessage *msgs, int n_msgs,
                                  const ChatVars *vars, char **out, size_t *len, ChatSpan **spans,
                                  int *n_spans, Err *err) {
    ChatVars without = *vars;
    without.add_generation_prompt = 0;
    *spans = NULL;
    *n_spans = 0;
    if (chat_template_render(t, msgs, n_msgs, &without, out, len, err)) return -1;
    int n_assistant = 0;
    for (int i = 0; i < n_msgs; i++)
        n_assistant += strcmp(msgs[i].role, "assistant") == 0;
    if (n_assistant && !(*spans = malloc((size_t)n_assistant * sizeof **spans))) {
        err_resource(err, "out of memory for %d spans", n_assistant);
    } else {
        int k = 0;
        for (int i = 0; i < n_msgs; i++) {
            if (strcmp(msgs[i].role, "assistant") != 0) continue;
            if (assistant_span(t, msgs, i, vars, *out, *len, &(*spans)[k], err)) break;
            if (k && (*spans)[k].begin < (*spans)[k - 1].end) {
                err_set(err, "%s: message %d (assistant): its span overlaps the previous one's",
                        t->name, i);
                break;
            }
            k++;
        }
        if (k == n_assistant) {
            *n_spans = k;
            return 0;
        }
    }
    free(*out);
    free(*spans);
    *out = NULL;
    *spans = NULL;
    return -1;
}

void chat_template_free(ChatTemplate *t) {
    if (!t) return;
    arena_free(&t->arena);
    free(t);
}
