// meta.h: meta.json of a checkpoint directory (docs/design.md §6).
//
// AstrAI writes {"epoch", "consumed_samples", "timestamp", ...the training
// config keys...} (astrai/serialization/checkpoint.py). We add "step", the
// number of optimizer steps done; AstrAI-written files lack it (step = -1, the
// caller derives it from the directory name epoch_E_step_S).
#pragma once
#include <cjson/cJSON.h>

#include "common/error.h"

typedef struct {
    long epoch;
    long consumed_samples;
    long step;          // -1 when absent
    char timestamp[32]; // "YYYY-MM-DDTHH:MM:SS" (local time, like AstrAI); "" when absent
    cJSON *config;      // the remaining keys (an object, owned; never NULL after parse)
} CkptMeta;

// Parses meta.json text; `source` names the origin in messages
// ("ck/epoch_0_step_8/meta.json: \"epoch\" must be a non-negative integer, got \"x\"").
// epoch and consumed_samples are required; on failure m holds nothing to free.
int meta_parse(CkptMeta *m, const char *json, const char *source, Err *err);

// Reads and parses the file at path.
int meta_load(CkptMeta *m, const char *path, Err *err);

// Sets timestamp to the current local time in AstrAI's format.
void meta_stamp_now(CkptMeta *m);

// meta.json text: epoch, consumed_samples, timestamp, step (when >= 0), then
// the config keys; malloc'd, NULL when out of memory.
char *meta_to_json(const CkptMeta *m);

void meta_free(CkptMeta *m);
