// records.h: the record sets of offline DPO and GRPO (docs/data.md "DPO and GRPO records").
//
// A record is a prompt and a group of G responses: DPO's chosen and rejected (G = 2), GRPO's
// G responses with one reward each. Records come from JSONL (AstrAI's record shapes) or from
// record shards written by astrai-data prep (root/**/meta.json with "format": "dpo"|"grpo").
// Each (record, response) pair becomes one model row: records_row.
#pragma once
#include <stdint.h>

#include "common/error.h"
#include "data/tokenizer.h"

typedef enum { RECORDS_DPO, RECORDS_GRPO } RecordKind;

typedef struct {
    RecordKind kind;
    int group_size; // responses per record: 2 for DPO (chosen, rejected), G for GRPO
    int64_t n_records;
    int32_t *prompt; // every prompt's tokens, concatenated
    int64_t
        *prompt_off;   // (n_records+1): record r's prompt is prompt[prompt_off[r], prompt_off[r+1])
    int32_t *response; // every response's tokens, concatenated
    int64_t *response_off; // (n_records*G+1): response j of record r is number r*G+j
                           // (DPO: j 0 = chosen, 1 = rejected)
    float *reward;         // (n_records*G) GRPO; NULL for DPO
    int64_t skipped;       // bad records skipped (skip_bad)
    Err first_skipped;     // the first skipped record's message (when skipped > 0)
    int n_shards;          // shards read by records_open (0 for a .jsonl file)
    // Bookkeeping: allocated records (prompt_off, response_off, reward) and tokens. The arrays
    // are NULL until the first record.
    int64_t record_cap, prompt_cap, response_cap;
} RecordSet;

// "dpo" or "grpo": the --train_type, --format prefix and meta.json "format" of a kind.
const char *records_kind_name(RecordKind kind);

// An empty set. group_size is GRPO's G (checked, >= 1, when records are added); DPO's is 2
// whatever is given.
void records_init(RecordSet *rs, RecordKind kind, int group_size);

// Appends the records of a JSONL file (one object per line, blank lines skipped):
// DPO {"prompt"|"input": P, "chosen": C, "rejected": R}, GRPO {"prompt": P, "responses":
// [R1..RG], "rewards": [r1..rG]}; each text field as data/jsonl.h reads it. A bad record (the
// message names path:LINE and the key) is an error, or with skip_bad counted in rs->skipped.
// vocab_size 0: ids are not checked against a vocab.
int records_parse_jsonl(RecordSet *rs, const char *path, const Tokenizer *tok, int vocab_size,
                        int skip_bad, Err *err);

// Appends one record made elsewhere (an online rollout): the prompt's n_prompt ids, the group's
// responses (group_size of them, each n_responses[j] ids: DPO's chosen then rejected) and, GRPO,
// their rewards; checked as a parsed record is (ids against vocab_size when > 0).
int records_add(RecordSet *rs, const int32_t *prompt, int64_t n_prompt,
                const int32_t *const *responses, const int64_t *n_responses, const float *rewards,
                int vocab_size, Err *err);
// Empties the set, keeping its buffers for the records that come next.
void records_clear(RecordSet *rs);

// Writes records [first, first+n) as one shard directory, atomically (data/shard_writer.h).
int records_write_shard(const RecordSet *rs, int64_t first, int64_t n, const char *dir, Err *err);

// Whether the dataset directory root holds record shards (its first shard's meta.json has a
// "format"), and then their kind and group size (*kind, *group_size untouched otherwise).
int records_probe(const char *root, int *is_records, RecordKind *kind, int *group_size, Err *err);

// Loads a record set for training: `path` is either a directory of record shards
// (root/**/meta.json, sorted as data/dataset.c does) or a .jsonl file (parsed with the byte
// tokenizer). kind and group_size are what the run asks for: a mismatch (a dpo set for grpo, a
// group size other than the shards', a token-window dataset given to dpo) is an error naming
// the path and both values. vocab_size > 0 checks every id (the error names the shard or
// file:line and the record); skip_bad skips and counts bad records. No record at all is an error.
int records_open(RecordSet *rs, const char *path, RecordKind kind, int group_size, int vocab_size,
                 int skip_bad, Err *err);
void records_free(RecordSet *rs);

// The model row of response j of record r in `window` input positions: s = the prompt's last
// p tokens then the response's first q tokens, q = min(R, window), p = min(P, window + 1 - q)
// (the response is what the loss covers, so it is kept first; at least one prompt token
// always precedes it); inputs[t] = s[t], targets[t] = s[t+1], loss_mask[t] = 1 iff s[t+1] is a
// response token, for t < len = p + q - 1. Returns len (>= 1). Buffers hold `window` entries;
// those from len on are set to 0.
int records_row(const RecordSet *rs, int64_t r, int j, int64_t window, int32_t *inputs,
                int32_t *targets, int32_t *loss_mask);
