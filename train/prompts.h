// prompts.h: the prompts of generation and what turns its tokens into text, shared by
// astrai-generate (--prompt, --prompts), training's samples (--sample_prompts) and the online
// strategies' rollouts (their prompt dataset).
//
// A prompts file is JSON lines, each one of
//   {"prompt": TEXT}                       the text as it is;
//   {"messages": [{"role", "content"}...]} rendered with the chat template and
//                                          add_generation_prompt;
//   {"instruction": I, "input": U, "output": O}  (allow_instruction) AstrAI's rollout mapping to
//                                          system / user / assistant messages, empty or absent
//                                          ones skipped, then rendered as "messages".
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "data/tokenizer.h"
#include "engine/generate.h"

// One prompt: the text it shows (a conversation's rendering) and its ids.
typedef struct {
    char *text;
    int32_t *ids;
    int n;
} Prompt;

typedef struct {
    Prompt *v;
    int n, cap;
} PromptList;

// What a prompt may hold: ids below the vocabulary, and room for max_tokens more in the
// model's context.
typedef struct {
    int vocab, context, max_tokens;
    const char *max_tokens_flag; // names max_tokens in errors ("--max_tokens")
} PromptLimits;

// Tokenizes text[0..len) as one more prompt; errors say why it cannot be generated from.
int prompts_add_text(PromptList *l, const Tokenizer *tok, const char *text, size_t len,
                     const PromptLimits *lim, Err *err);
// Appends the prompts of a JSON lines file (above). template_file: the chat template's file, NULL:
// the tokenizer's. Errors name path:LINE and the key; a file without prompts is one.
int prompts_read_jsonl(PromptList *l, const char *path, const Tokenizer *tok,
                       const char *template_file, int allow_instruction, const PromptLimits *lim,
                       Err *err);
void prompts_free(PromptList *l);

// The tokenizer of generation: spec ("bytes", a tokenizer.json or its directory), else
// model_dir's tokenizer.json (with its tokenizer_config.json), else bytes. Errors name `flag`
// (astrai-generate's "--tokenizer", the job key "tokenizer") with the spec.
int prompts_open_tokenizer(const char *spec, const char *model_dir, const char *flag,
                           Tokenizer **tok, Err *err);

enum { PROMPTS_MAX_STOP = 16 };

// The stop tokens of a model: its tokenizer's eos_token (tokenizer_config.json) and model_dir's
// generation_config.json "eos_token_id" (an id or a list: a chat model's end-of-turn tokens
// besides its EOS), when there are any: into stop[0..*n) (PROMPTS_MAX_STOP), every id checked
// against the vocabulary.
int prompts_stop_tokens(const Tokenizer *tok, const char *model_dir, int vocab, int32_t *stop,
                        int *n, Err *err);

// A completion's text: its tokens but a stop token that ended it, special tokens skipped, each
// NUL byte (which a C string cannot hold) as U+FFFD; malloc'd.
int prompts_completion_text(const Tokenizer *tok, const Generation *g, char **text, Err *err);
