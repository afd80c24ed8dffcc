// chat_template.h: Hugging Face chat templates (tokenizer_config.json "chat_template"), a
// Jinja2 subset rendered as transformers' apply_chat_template renders it (the subset, the
// variables and the assistant-span rule: docs/data.md, "Conversations and chat templates").
#pragma once
#include <stddef.h>
#include <time.h>

#include "common/error.h"

typedef struct ChatTemplate ChatTemplate;

// Parses template text; `name` (a file name) prefixes every message ("chat.jinja:3: filter
// 'wordwrap' is not supported"). A construct outside the subset is refused here.
int chat_template_parse(const char *source, const char *name, ChatTemplate **out, Err *err);

typedef struct {
    const char *role;
    const char *content;
} ChatMessage;

// Budgets of one rendering (docs/data.md "Template budgets"): exceeding one is bad input (exit
// 2) naming the budget, its limit and the template line. Counts, never time: operations (every
// expression evaluated and every loop iteration) bound the time, deterministically. A field <= 0
// takes its default (CHAT_DEFAULT_*).
typedef struct {
    long max_iterations; // loop iterations, all loops together
    long max_bytes;      // the output, and any one string built
    long max_memory;     // bytes of values held by the rendering
    long max_ops;        // expressions evaluated + loop iterations
} ChatLimits;
#define CHAT_DEFAULT_ITERATIONS 10000000L
#define CHAT_DEFAULT_BYTES (64L << 20)
#define CHAT_DEFAULT_MEMORY (1L << 30)
#define CHAT_DEFAULT_OPS 100000000L

// The template's variables besides messages. A NULL token or date_string is undefined in the
// template (as a special token tokenizer_config.json does not set); tools and documents are
// none, as transformers passes them without tools.
typedef struct {
    const char *bos_token, *eos_token, *pad_token, *unk_token;
    int add_generation_prompt;
    const char *date_string;
    time_t now;               // what strftime_now(format) formats, in UTC
    const ChatLimits *limits; // NULL: the defaults
} ChatVars;

// Renders msgs into *out (malloc'd, NUL-terminated, *len bytes). A template's
// raise_exception(msg) fails with msg; so does any runtime error, naming its line.
int chat_template_render(const ChatTemplate *t, const ChatMessage *msgs, int n_msgs,
                         const ChatVars *vars, char **out, size_t *len, Err *err);

// A byte range [begin, end) of a rendered conversation.
typedef struct {
    size_t begin, end;
} ChatSpan;

// Renders msgs (add_generation_prompt false, whatever vars says) into *out and finds, for each
// assistant message i in order, its span: with P = the rendering of msgs[:i] with
// add_generation_prompt true and Q = that of msgs[:i+1] without, P must be a prefix of Q and Q
// of the whole text; the span is Q[len(P):] (the reply and what the template closes it with).
// A template for which that fails is refused naming the message. *spans is malloc'd (NULL
// when there is no assistant message), *n_spans of them.
int chat_template_assistant_spans(const ChatTemplate *t, const ChatMessage *msgs, int n_msgs,
                                  const ChatVars *vars, char **out, size_t *len, ChatSpan **spans,
                                  int *n_spans, Err *err);

void chat_template_free(ChatTemplate *t);
