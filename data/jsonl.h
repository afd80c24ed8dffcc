// jsonl.h: JSONL record files (one JSON object per line, blank lines skipped) and their text
// fields, shared by astrai-data's sft-jsonl and the DPO/GRPO records of data/records.h.
#pragma once
#include <cjson/cJSON.h>
#include <stdint.h>

#include "common/error.h"
#include "data/tokenizer.h"

// Called with each record (a parsed line, any JSON value) and the caller's ctx.
typedef int (*JsonlRecordFn)(const cJSON *rec, void *ctx, Err *err);

// Calls fn on every non-blank line of path, in order. A line that is not one JSON value
// ("malformed JSON") or that fn fails on is an error prefixed "path:LINE: ". With skipped
// non-NULL such a line is counted in *skipped instead (its message kept in *first_skipped when
// it is the first) and reading goes on; a failure for want of a resource (err->resource) stops
// it either way.
int jsonl_each(const char *path, JsonlRecordFn fn, void *ctx, int64_t *skipped, Err *first_skipped,
               Err *err);

// The token ids of a record's text field v, into a malloc'd *ids of *n (0 for an empty field);
// `where` names the field in messages as a JSON path would ("\"prompt\"", "\"responses\"[2]"):
// - a string, tokenized with tok;
// - an array of token ids (integers in [0, INT32_MAX]), taken as they are;
// - a conversation list (an array of objects): the "content" strings joined, then tokenized
//   (AstrAI's _extract_text; an object without "content" adds nothing).
// An empty array is an empty field.
int jsonl_field_ids(const cJSON *v, const char *where, const Tokenizer *tok, int32_t **ids,
                    int64_t *n, Err *err);
