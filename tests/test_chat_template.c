// test_chat_template.c: data/chat_template.h's refusals: constructs outside the subset
// refused at parse time naming them and their line, runtime errors naming theirs,
// raise_exception's message, and templates whose assistant spans are not prefixes. (What
// renderings equal is checked against transformers in tests/test_chat_template.py.)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/buf.h"
#include "data/chat_template.h"

// Parsing src fails with a message holding want.
static void parse_fails(const char *src, const char *want) {
    ChatTemplate *t = NULL;
    Err err = {0};
    int rc = chat_template_parse(src, "t.jinja", &t, &err);
    CHECK_MSG(rc != 0 && strstr(err.msg, want), "%.60s -> rc %d '%s' (want '%s')", src, rc, err.msg,
              want);
    chat_template_free(rc == 0 ? t : NULL);
    printf("parse refused: %s\n", err.msg);
}

static const ChatMessage CONV[] = {{"user", "hi"}, {"assistant", "hello"}, {"user", "bye"}};

// Rendering src over CONV fails with a message holding want.
static void render_fails(const char *src, int n_msgs, const char *want) {
    ChatTemplate *t = NULL;
    Err err = {0};
    CHECK_MSG(chat_template_parse(src, "t.jinja", &t, &err) == 0, "%s: %s", src, err.msg);
    if (!t) return;
    ChatVars vars = {.bos_token = "<s>", .eos_token = "</s>"};
    char *out = NULL;
    size_t len;
    int rc = chat_template_render(t, CONV, n_msgs, &vars, &out, &len, &err);
    CHECK_MSG(rc != 0 && strstr(err.msg, want), "%s -> rc %d '%s' (want '%s')", src, rc, err.msg,
              want);
    if (rc == 0) free(out);
    chat_template_free(t);
    printf("render refused: %s\n", err.msg);
}

static void spans_fail(const char *src, const char *want) {
    ChatTemplate *t = NULL;
    Err err = {0};
    CHECK_MSG(chat_template_parse(src, "t.jinja", &t, &err) == 0, "%s: %s", src, err.msg);
    if (!t) return;
    ChatVars vars = {0};
    char *out = NULL;
    size_t len;
    ChatSpan *spans = NULL;
    int n = 0;
    int rc = chat_template_assistant_spans(t, CONV, 3, &vars, &out, &len, &spans, &n, &err);
    CHECK_MSG(rc != 0 && strstr(err.msg, want), "%s -> rc %d '%s' (want '%s')", src, rc, err.msg,
              want);
    if (rc == 0) free(out), free(spans);
    chat_template_free(t);
    printf("spans refused: %s\n", err.msg);
}

static void test_parse_errors(void) {
    parse_fails("a\nb\n{{ x | wordwrap }}", "t.jinja:3: filter 'wordwrap' is not supported");
    parse_fails("{% macro m() %}{% endmacro %}", "t.jinja:1: tag 'macro' is not supported");
    parse_fails("\n{% if x is divisibleby3 %}{% endif %}", "t.jinja:2: test 'divisibleby3'");
    parse_fails("{{ x.format(1) }}", "t.jinja:1: method 'format' is not supported");
    parse_fails("{{ cycler(1) }}", "function 'cycler' is not supported");
    parse_fails("{{ 1.5 }}", "float literals are not supported");
    parse_fails("{{ 3 / 2 }}", "operator '/' is not supported");
    parse_fails("{{ (1, 2) }}", "tuples are not supported");
    parse_fails("{{ 1 < 2 < 3 }}", "chained comparisons are not supported");
    parse_fails("{% if x %}", "missing {% endif %}");
    parse_fails("{% for x in y %}{% endif %}", "unexpected 'endif'");
    parse_fails("{% break %}", "'break' outside a loop");
    parse_fails("{% set x %}a{% endset %}", "block set");
    parse_fails("{{ 'abc }}", "unterminated string literal");
    parse_fails("{{ x ", "missing }}");
    parse_fails("{# no end", "missing end of comment tag");
    parse_fails("{{ x ) }}", "unexpected )");
    parse_fails("{{ x @ y }}", "unexpected character @");
    parse_fails("{% raw %}{% endraw %}", "tag 'raw' is not supported");
}

// prefix, unit n times, middle, close n times, suffix.
static char *nested(const char *prefix, const char *unit, const char *middle, const char *close,
                    const char *suffix, int n) {
    Buf b = {0};
    int rc = buf_append(&b, prefix, strlen(prefix));
    for (int i = 0; i < n; i++)
        rc |= buf_append(&b, unit, strlen(unit));
    rc |= buf_append(&b, middle, strlen(middle));
    for (int i = 0; i < n; i++)
        rc |= buf_append(&b, close, strlen(close));
    rc |= buf_append(&b, suffix, strlen(suffix));
    CHECK(rc == 0);
    return buf_take(&b);
}

// Nesting deep enough to overflow the stack of a parser without bounds is refused.
static void test_deep_nesting(void) {
    const struct {
        const char *prefix, *unit, *middle, *close, *suffix, *want;
    } cases[] = {
        {"{{ ", "(", "1", ")", " }}", "nested too deeply"},
        {"{{ ", "not ", "1", "", " }}", "nested too deeply"},
        {"{{ ", "-", "1", "", " }}", "nested too deeply"},
        {"{{ ", "1 if 1 else ", "1", "", " }}", "nested too deeply"},
        {"{{ ", "[", "1", "]", " }}", "nested too deeply"},
        {"", "{% if 1 %}", "x", "{% endif %}", "", "nested too deeply"},
        {"", "{% for x in y %}", "{{ 1 }}", "{% endfor %}", "", "nested too deeply"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *src = nested(cases[i].prefix, cases[i].unit, cases[i].middle, cases[i].close,
                           cases[i].suffix, 100000);
        if (src) parse_fails(src, cases[i].want);
        free(src);
    }
}

static void test_render_errors(void) {
    render_fails("{{ raise_exception('roles must alternate') }}", 3,
                 "t.jinja:1: the template raised an error: roles must alternate");
    render_fails("\n{{ nothing.attr }}", 3, "t.jinja:2: 'nothing' is undefined");
    render_fails("{{ messages[0].content + 1 }}", 3,
                 "unsupported operand types for +: 'str' and 'int'");
    render_fails("{{ 1 // 0 }}", 3, "division or modulo by zero");
    render_fails("{{ 5 in 3 }}", 3, "argument of type 'int' is not iterable");
    render_fails("{% for x in 3 %}{% endfor %}", 3, "'int' object is not iterable");
    render_fails("{% set ns = namespace(a=1) %}{{ ns }}", 3, "a namespace has no printed form");
    render_fails("{% set x = 1 %}{% set x.a = 2 %}", 3, "non-namespace object 'x'");
    render_fails("{{ messages | tojson }}{{ u | tojson }}", 3, "tojson: 'u' is undefined");
    render_fails("{{ 'é' | upper }}", 3, "upper: non-ASCII text is not supported");
}

static void test_span_errors(void) {
    // the generation prompt is not what the template puts before a reply
    spans_fail("{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
               "GEN{% endif %}",
               "message 1 (assistant): the rendering before it with the generation prompt is "
               "not a prefix");
    // what follows the reply depends on the number of messages
    spans_fail("{% for m in messages %}{{ m.content }}{% endfor %}"
               "{% if messages | length == 2 %}X{% endif %}",
               "the rendering up to it is not a prefix of the whole conversation's");
}

int main(void) {
    test_parse_errors();
    test_deep_nesting();
    test_render_errors();
    test_span_errors();
    CHECK_DONE();
}
