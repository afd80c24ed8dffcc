// train_spec.h: the training spec — every astrai-train flag, which is also a key of
// a job's JSON spec (DESIGN §4). One table describes each key's type, default and
// valid range; the same validator serves command lines (astrai-train) and JSON
// objects (astraictl, astraid).
#pragma once
#include <stdbool.h>

#include "common/error.h"

typedef struct cJSON cJSON;

typedef struct {
    // what to train
    char *train_type;     // seq | sft
    char *param_path;     // model directory or checkpoint directory
    char *data_root_path; // bin dataset root
    bool resume;          // continue from param_path's (or ckpt_dir's latest) checkpoint
    // batches
    long n_epoch;
    long batch_per_device;
    long grad_accum_steps;
    long window_size; // 0: max_position_embeddings
    long stride;      // 0: window_size
    bool shuffle;
    long random_seed;
    // optimisation
    char *optimizer; // muon | adamw
    double max_lr;
    double weight_decay;
    double max_grad_norm;
    double label_smoothing;
    char *schedule_type; // cosine | wsd | sgdr
    double warmup_ratio;
    double min_rate;
    long stable_steps; // 0: default
    long decay_steps;  // 0: default
    long cycle_length; // 0: default
    long t_mult;
    // checkpoints and progress
    long ckpt_interval;
    char *ckpt_dir;
    char *ckpt_dtype; // fp32 | bf16 (model.safetensors in checkpoints)
    long log_interval;
    long max_steps; // 0: run every epoch; else stop (with a checkpoint) after this many steps
    // parallelism
    char *parallel_mode; // none | ddp | fsdp
    long nprocs;
    long threads;      // 0: cores / local ranks
    long comm_timeout; // seconds a collective may wait for the other ranks
    double bucket_mb;  // ddp/fsdp gradient bucket size (0: by backend)
    // devices and numerics
    char *device_type;           // auto | cpu | cuda
    char *dtype;                 // auto | bf16 | fp32 (compute dtype)
    bool gradient_checkpointing; // recompute each block in backward
} TrainSpec;

// Fills every field with its default.
void train_spec_defaults(TrainSpec *s);
void train_spec_free(TrainSpec *s);

// Sets one key from its text value ("--max_lr=3e-4" gives key "max_lr", value "3e-4").
// Unknown key → error suggesting the nearest valid key; bad value → error naming it.
int train_spec_set(TrainSpec *s, const char *key, const char *value, Err *err);

// Parses astrai-train's argv (--flag=value, --flag value, boolean --flag).
// Sets *help when --help/-h is given.
int train_spec_parse_args(TrainSpec *s, int argc, char **argv, bool *help, Err *err);

// Applies the keys of a JSON object (job spec). Keys in `ignore` (NULL-terminated,
// e.g. the job keys name/devices/priority) are skipped.
int train_spec_apply_json(TrainSpec *s, const cJSON *obj, const char *const *ignore, Err *err);

// Cross-field checks (required paths present, nprocs vs parallel_mode, ...).
int train_spec_validate(const TrainSpec *s, Err *err);

// The spec as a JSON object (every key), for meta.json.
cJSON *train_spec_to_json(const TrainSpec *s);

// Writes the --help text.
void train_spec_print_help(const char *prog);
