// rollout.h: the online strategies' rollouts (docs/design.md §17; AstrAI's RolloutGenerator and
// RolloutRunner): a training micro-batch's prompts, group_size responses each from the current
// policy, scored by the reward source (train/reward.h), as the records of offline DPO/GRPO
// (data/records.h): GRPO's G responses with their rewards; DPO's best (chosen) and worst
// (rejected) response by reward.
//
// As AstrAI's RolloutRunner caches one rollout and regenerates it when its prompt batch changes
// or rollout_interval optimizer steps have passed, each micro-batch slot of a step keeps its
// rollout while its prompts are the same ones (a dataset that repeats its batches) for fewer
// than rollout_interval steps; a new rollout makes the policy of that moment the behaviour
// ("old") policy of GRPO's ratio.
//
// Responses are keyed by (random_seed, step, prompt index, response j): a prompt's responses do
// not depend on the rank that generates them, so a resumed run regenerates the rollout of its
// step exactly (the rollout itself is not in the checkpoint; a kept rollout, of repeated
// prompts, is regenerated at the resumed step).
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "common/error.h"
#include "data/records.h"
#include "proto/train_spec.h"
#include "train/executor.h"
#include "train/objective.h"

typedef struct Rollout Rollout;

typedef struct {
    const TrainSpec *spec; // data_root_path (the prompts), tokenizer, rollout_*, reward_*, seed
    const ModelConfig *cfg; // read by rollout_open only
    RecordKind kind; // of the records made: GRPO (group_size responses), DPO (chosen, rejected)
    int slots;       // micro-batches per step (grad_accum_steps)
    int rank;        // in the job (requests' meta, warnings)
    Executor *exec;  // the policy, generated from (used from the first rollout on)
    Model *model;
} RolloutSetup;

// The statistics of a step's micro-batches, summed over them (each micro-batch's own numbers),
// and the seconds this rank spent generating and waiting for rewards.
typedef struct {
    double reward_mean, reward_std; // over a micro-batch's B x G rewards
    double response_len;            // its mean response tokens
    double equal_groups;            // the share of its prompts whose G rewards are all equal
    double generate_s, reward_s;
} RolloutStats;

// Reads the prompts (*n_prompts of them: the samples the sampler deals) and starts the reward
// source.
int rollout_open(Rollout **r, const RolloutSetup *s, int64_t *n_prompts, Err *err);
void rollout_close(Rollout *r);

// The records of training micro-batch mb (its nb prompt ids), slot mb->index of step mb->step:
// the slot's kept rollout, or a new one (*fresh). Every rank calls it for every micro-batch
// in the same order: a new rollout's generation is collective under fsdp, and the ranks agree
// on whether every rank's rewards came. A failure leaves the run's state as it was before the
// step (nothing trained on): the trainer checkpoints it.
int rollout_records(Rollout *r, const MicroBatch *mb, const RecordSet **records, bool *fresh,
                    Err *err);

// The statistics of the micro-batches since the last call; they start again.
void rollout_take_stats(Rollout *r, RolloutStats *out);
