// conversation.h: a conversation record's {"messages": [{"role", "content"}...]} and what renders
// it (data/chat_template.h): the template of a tokenizer or a file, and the template's variables
// from the tokenizer. Shared by astrai-data's sft-jsonl and astrai-generate's prompts.
#pragma once
#include <cjson/cJSON.h>

#include "common/error.h"
#include "data/chat_template.h"
#include "data/tokenizer.h"

// The messages of list (a non-empty array of objects with a "role" of system, user or
// assistant and a string "content", nothing else), pointing into list (*msgs malloc'd).
// Errors name the message ("\"messages\"[2]: ...").
int conversation_messages(const cJSON *list, ChatMessage **msgs, int *n, Err *err);

// The template: file's text (a path, or NULL), else tok's tokenizer_config.json
// "chat_template". Errors name the file, or say that the tokenizer has none.
int conversation_template(const Tokenizer *tok, const char *file, ChatTemplate **out, Err *err);

// The template's variables: tok's special tokens, and the time strftime_now formats:
// $SOURCE_DATE_EPOCH if set, else now.
int conversation_vars(const Tokenizer *tok, ChatVars *vars, Err *err);
