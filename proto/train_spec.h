// train_spec.h: the training spec — every astrai-train flag, which is also a key of
// a job's JSON spec (docs/design.md §4). One table describes each key's type, default and
// valid range; the same validator serves command lines (astrai-train) and JSON
// objects (astraictl, astraid).
#pragma once
#include <stdbool.h>
#include <stdio.h>

#include "common/error.h"

typedef struct cJSON cJSON;

// The choices of the enumerated keys, decoded as each is set (train_spec_set, the defaults):
// what code switches on, never the strings, which are what is shown and written. Each enum
// lists its key's values in the order of the key's choices (tests/test_job_spec.c checks).
typedef enum {
    TRAIN_UNSET = -1, // train_type not given yet
    TRAIN_SEQ,
    TRAIN_SFT,
    TRAIN_DPO,
    TRAIN_GRPO,
    TRAIN_ONLINE_GRPO,
    TRAIN_ONLINE_DPO
} TrainType;
typedef enum { OPTIMIZER_MUON, OPTIMIZER_ADAMW } OptimizerChoice;
typedef enum { SCHEDULE_COSINE, SCHEDULE_WSD, SCHEDULE_SGDR } ScheduleChoice;
typedef enum { CKPT_FP32, CKPT_BF16 } CkptDtypeChoice;
typedef enum { CKPT_FULL, CKPT_SHARDED } CkptFormatChoice;
typedef enum { PARALLEL_NONE, PARALLEL_DDP, PARALLEL_FSDP } ParallelChoice;
typedef enum { DEVICE_AUTO, DEVICE_CPU, DEVICE_CUDA } DeviceChoice;
typedef enum { DTYPE_AUTO, DTYPE_BF16, DTYPE_FP16, DTYPE_FP32 } DtypeChoice;
typedef enum { MUON_LR_ORIGINAL, MUON_LR_MATCH_RMS_ADAMW } MuonLrChoice;
typedef enum { COLLECTIVES_NCCL, COLLECTIVES_GLOO } CollectivesChoice;
typedef enum { PIPELINE_1F1B, PIPELINE_GPIPE } PipelineChoice;

typedef struct {
    TrainType train_type;
    OptimizerChoice optimizer;
    ScheduleChoice schedule_type;
    CkptDtypeChoice ckpt_dtype;
    CkptFormatChoice ckpt_format;
    ParallelChoice parallel_mode;
    DeviceChoice device_type;
    DtypeChoice dtype;
    MuonLrChoice muon_adjust_lr;
    CollectivesChoice backend;
    PipelineChoice pp_schedule;
} TrainChoices;

typedef struct {
    // what to train
    char *train_type;      // seq | sft | dpo | grpo | online_grpo | online_dpo
    char *param_path;      // model directory or checkpoint directory
    char *data_root_path;  // bin dataset root; dpo/grpo: record shards or a .jsonl file
    bool skip_bad_records; // dpo/grpo .jsonl: skip bad records (counted) instead of failing
    bool resume;           // continue from param_path's (or ckpt_dir's latest) checkpoint
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
    char *ckpt_dtype;  // fp32 | bf16 (model.safetensors in checkpoints)
    char *ckpt_format; // full | sharded (docs/design.md §14)
    long log_interval;
    long max_steps; // 0: run every epoch; else stop (with a checkpoint) after this many steps
    // samples during training (train/samples.h)
    long sample_interval;      // 0: none; else generate every N optimizer steps and at the end
    char *sample_prompts;      // the prompts' .jsonl ("": none)
    long sample_max_tokens;    // the most tokens of a sample
    double sample_temperature; // 0: greedy
    long sample_top_k;         // 0: off
    double sample_top_p;       // 1: off
    char *tokenizer;           // bytes, or a tokenizer.json (or its directory); "": param_path's
    char *chat_template;       // renders the prompts' "messages" ("": the tokenizer's template)
    // parallelism
    char *parallel_mode; // none | ddp | fsdp
    long nprocs;                 // ranks (of this node, with nnodes > 1)
    long nnodes, node_rank;      // a multi-node launch (torchrun's names)
    long nproc_per_node;         // 0: nprocs
    long threads;      // 0: cores / local ranks
    long comm_timeout; // seconds a collective may wait for the other ranks
    double bucket_mb;  // ddp/fsdp gradient bucket size (0: by backend)
    // devices and numerics
    char *device_type;      // auto | cpu | cuda
    char *dtype;            // auto | bf16 | fp16 | fp32 (compute dtype)
    char *loss_scale;       // auto | dynamic | none | VALUE (docs/design.md §15)
    double init_loss_scale; // the dynamic scale's start
    long loss_scale_growth_interval;
    bool gradient_checkpointing; // recompute each block in backward
    // AstrAI train.py flags (issue 8)
    double muon_momentum;
    bool muon_nesterov;
    long muon_ns_steps;
    char *muon_adjust_lr; // match_rms_adamw | original
    long start_epoch;     // fresh run: the epoch it starts in
    long start_samples;   // fresh run: samples per rank already consumed (AstrAI's sampler)
    char *master_addr;    // rendezvous address (a local launch listens there; MASTER_ADDR)
    char *master_port;    // rendezvous port (MASTER_PORT)
    char *backend;        // nccl | gloo (gloo: our CPU collectives)
    double val_split;     // fraction of samples held out for validation (0: none)
    long val_step;
    char *metrics;        // comma-separated columns of metric.jsonl step rows
    double neftune_alpha; // NEFTune noise alpha (0: off)
    double dpo_beta;      // dpo/grpo knobs (engine/preference.h)
    long group_size;
    double grpo_clip_eps;
    double grpo_kl_coef;
    long rollout_interval; // rollout_*: online only (engine/sample.h)
    double rollout_temperature;
    long rollout_top_k;
    double rollout_top_p;
    long rollout_max_tokens;
    char *reward_command; // online: "CMD ARGS" (train/reward.h)
    char *reward_url;     // online: http://HOST[:PORT]/PATH
    double reward_timeout_s;
    long reward_restarts;
    long num_workers;   // accepted, no effect (warning)
    bool pin_memory;    // accepted, no effect (warning)
    char *start_method; // accepted, no effect (warning)
    char *compile;      // accepted, no effect (warning); "" = off
    long tp_size;       // 0 (None) or 1; > 1 refused
    long pp_size;       // pipeline stages (1: none), docs/design.md §13
    long ep_size;       // expert parallelism (1: none), docs/design.md §7a
    bool async_checkpoint;     // rank 0 writes checkpoints on a background thread
    long checkpoint_keep_last; // retention: the newest N checkpoints (0: all)
    long checkpoint_keep_best; // and the N of lowest val_loss
    char *pp_schedule;         // 1f1b | gpipe
    TrainChoices is;           // the enumerated keys above, decoded
    // command line only (not keys of the table)
    bool dry_run;                 // --dry-run: validate and print, do not train
    unsigned char given[128 / 8]; // bit i: key i of the table was set (flag, YAML or JSON)
} TrainSpec;

// Fills every field with its default; fails only for want of memory (s is then freed).
int train_spec_defaults(TrainSpec *s, Err *err);
void train_spec_free(TrainSpec *s);

// Sets one key from its text value ("--max_lr=3e-4" gives key "max_lr", value "3e-4").
// Unknown key → error suggesting the nearest valid key; bad value → error naming it.
int train_spec_set(TrainSpec *s, const char *key, const char *value, Err *err);

// Parses astrai-train's argv with common/flags, one flag per key of the table (--key=value,
// --key value, boolean --key, --no-key and --key=true|false; '-' and '_' alike), -c/--config
// FILE (AstrAI's YAML, applied first so that the other flags win) and --dry-run. An unknown
// flag is an unknown key, named with the nearest one. Sets *help when --help/-h is given.
int train_spec_parse_args(TrainSpec *s, int argc, char **argv, bool *help, Err *err);

// Applies the keys of a JSON object (job spec). Keys in `ignore` (NULL-terminated,
// e.g. the job keys name/devices/priority) are skipped.
int train_spec_apply_json(TrainSpec *s, const cJSON *obj, const char *const *ignore, Err *err);

// The job's ranks as the flags give them: nnodes x (nproc_per_node, else nprocs). Ranks of an
// external launcher (torchrun, srun) take theirs from the environment instead.
long train_spec_world(const TrainSpec *s);
// Cross-field checks (required paths present, nprocs vs parallel_mode, ...).
int train_spec_validate(const TrainSpec *s, Err *err);

// How the loss is scaled (--loss_scale; auto: dynamic when dtype is fp16): LOSS_SCALE_NONE,
// LOSS_SCALE_DYNAMIC, or LOSS_SCALE_FIXED with the value in *fixed (may be NULL); -1 with err
// naming the value when it is none of them.
enum { LOSS_SCALE_NONE, LOSS_SCALE_DYNAMIC, LOSS_SCALE_FIXED };
int train_spec_loss_scale(const TrainSpec *s, double *fixed, Err *err);

// Applies AstrAI's YAML config (train.py -c): the keys of its sections model, data,
// parallel, training, ckpt, log (and top-level scalar keys), flattened; null leaves a
// key at its default. train_spec_parse_args applies it before the other flags.
int train_spec_apply_yaml(TrainSpec *s, const char *path, Err *err);

// Whether key `name` was set explicitly (flag, YAML or JSON) to a value other than its
// default.
bool train_spec_given(const TrainSpec *s, const char *name);

// One line each on `out` for the flags that are accepted but change nothing here.
void train_spec_warn_ignored(const TrainSpec *s, FILE *out);

// Writes every key as "key = value" lines (the resolved configuration of --dry-run).
void train_spec_print(const TrainSpec *s, FILE *out);

// The spec as a JSON object (every key), for meta.json; NULL when out of memory (never a
// spec short of a key).
cJSON *train_spec_to_json(const TrainSpec *s);

// Writes the --help text.
void train_spec_print_help(const char *prog);
