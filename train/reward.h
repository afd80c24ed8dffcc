// reward.h: the online strategies' rewards (docs/design.md §17) from the user's own program:
// --reward_command "CMD ARGS" (split as sh would, common/words.h, but never run by a shell: the
// prompts and responses reach it only as JSON data), started once per rank as a child that
// reads requests on its stdin and answers on its stdout, one JSON line each, in order; its
// stderr is the rank's (the job's log). Or --reward_url: each request POSTed to an HTTP
// endpoint, the reply its body.
//
//   request: {"id": n, "prompt": text, "responses": [text x G], "meta": {...}}
//   reply:   {"id": n, "rewards": [number x G]}
//
// A command that dies (EOF on its stdout, a broken pipe) is restarted and asked again, up to
// --reward_restarts times in a row; one that does not answer within --reward_timeout_s is killed.
// A reply that is not one JSON object, names another id, or holds other than G finite numbers
// fails the request: nothing is guessed.
#pragma once
#include <cjson/cJSON.h>

#include "common/error.h"

typedef struct Reward Reward;

typedef struct {
    const char *command; // "CMD ARGS", or NULL
    const char *url;     // http://HOST[:PORT]/PATH, or NULL (exactly one of the two)
    double timeout_s;    // the most a reply may take
    int restarts;        // a dead command's restarts in a row before a request fails
} RewardOptions;

typedef struct {
    long id;                      // the request's number (the caller's, distinct in the run)
    long prompt;                  // the prompt's index in the prompts file, for messages
    const char *prompt_text;      // as the model saw it (the chat template's rendering)
    const char *const *responses; // (G) the completions' texts
    int G;
    const cJSON *meta; // the request's "meta" object (borrowed); NULL: {}
} RewardRequest;

// Starts the command (or checks the URL). A command that cannot be run (not found, not
// executable) or a URL that is not http://HOST[:PORT]/PATH is bad input.
int reward_open(Reward **r, const RewardOptions *o, Err *err);
// The G rewards of one request into rewards. Errors name the request's id and prompt, and the
// reply line at fault.
int reward_score(Reward *r, const RewardRequest *q, float *rewards, Err *err);
// Closes the command's stdin and waits for it, killing it if it does not exit at once.
void reward_close(Reward *r);
