#include "proto/train_spec.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "common/flags.h"
#include "common/json.h"

typedef enum { KEY_STR, KEY_INT, KEY_FLOAT, KEY_BOOL } KeyType;

typedef struct {
    const char *name;
    KeyType type;
    size_t offset;
    const char *def;     // default as text ("" for an empty string)
    double min, max;     // numeric range (inclusive)
    const char *choices; // "a|b|c" for enumerated strings, NULL for free text
    const char *help;
    const char *group; // --help section and AstrAI YAML section
} KeyDef;

_Static_assert(offsetof(KeyDef, name) == 0, "flags_nearest reads the name first");

#define F(field) offsetof(TrainSpec, field)
#define NOLIM -DBL_MAX, DBL_MAX

// clang-format off
static const KeyDef KEYS[] = {
    {"train_type", KEY_STR, F(train_type), "", 0, 0, "seq|sft|dpo|grpo|online_grpo|online_dpo", "training type (required; online_*: prompts in data_root_path, rewards from reward_command or reward_url)", "data"},
    {"param_path", KEY_STR, F(param_path), "", 0, 0, NULL, "model or checkpoint directory (required)", "model"},
    {"data_root_path", KEY_STR, F(data_root_path), "", 0, 0, NULL, "bin dataset root, or (dpo, grpo) record shards or a .jsonl file (required)", "data"},
    {"tokenizer", KEY_STR, F(tokenizer), "", 0, 0, NULL, "bytes, or a tokenizer.json (or its directory) for the text a run reads or writes (online prompts, samples); default: param_path's tokenizer.json, else bytes", "data"},
    {"skip_bad_records", KEY_BOOL, F(skip_bad_records), "false", 0, 0, NULL, "dpo, grpo from .jsonl: skip and count bad records instead of failing", "data"},
    {"resume", KEY_BOOL, F(resume), "false", 0, 0, NULL, "continue from the checkpoint in param_path, else the latest in ckpt_dir", "training"},
    {"n_epoch", KEY_INT, F(n_epoch), "1", 1, 1e9, NULL, "number of epochs", "training"},
    {"batch_per_device", KEY_INT, F(batch_per_device), "1", 1, 65536, NULL, "micro-batch size per rank", "training"},
    {"grad_accum_steps", KEY_INT, F(grad_accum_steps), "1", 1, 1e6, NULL, "micro-steps per optimizer step", "training"},
    {"window_size", KEY_INT, F(window_size), "0", 0, 1e7, NULL, "tokens per sample (0: max_position_embeddings)", "data"},
    {"stride", KEY_INT, F(stride), "0", 0, 1e9, NULL, "window stride (0: window_size)", "data"},
    {"shuffle", KEY_BOOL, F(shuffle), "true", 0, 0, NULL, "shuffle samples each epoch (seed random_seed+epoch)", "data"},
    {"random_seed", KEY_INT, F(random_seed), "3407", 0, 9.2e18, NULL, "random seed", "training"},
    {"optimizer", KEY_STR, F(optimizer), "muon", 0, 0, "muon|adamw", "optimizer", "training"},
    {"max_lr", KEY_FLOAT, F(max_lr), "3e-4", 0, 10, NULL, "peak learning rate", "training"},
    {"weight_decay", KEY_FLOAT, F(weight_decay), "0.1", 0, 1, NULL, "decoupled weight decay (Muon part, or every AdamW parameter)", "training"},
    {"max_grad_norm", KEY_FLOAT, F(max_grad_norm), "1.0", 0, 1e9, NULL, "gradient clipping norm (0: off)", "training"},
    {"label_smoothing", KEY_FLOAT, F(label_smoothing), "0.0", 0, 1, NULL, "cross-entropy label smoothing", "training"},
    {"schedule_type", KEY_STR, F(schedule_type), "cosine", 0, 0, "cosine|wsd|sgdr", "learning-rate schedule", "training"},
    {"warmup_ratio", KEY_FLOAT, F(warmup_ratio), "0.05", 0, 1, NULL, "fraction of steps for warmup", "training"},
    {"min_rate", KEY_FLOAT, F(min_rate), "0.01", 0, 1, NULL, "minimum lr as a fraction of max_lr", "training"},
    {"stable_steps", KEY_INT, F(stable_steps), "0", 0, 1e12, NULL, "wsd plateau steps (0: 80% of the post-warmup steps)", "training"},
    {"decay_steps", KEY_INT, F(decay_steps), "0", 0, 1e12, NULL, "wsd decay steps (0: the rest)", "training"},
    {"cycle_length", KEY_INT, F(cycle_length), "0", 0, 1e12, NULL, "sgdr first cycle (0: the post-warmup steps)", "training"},
    {"t_mult", KEY_INT, F(t_mult), "2", 1, 1e6, NULL, "sgdr cycle length multiplier", "training"},
    {"ckpt_interval", KEY_INT, F(ckpt_interval), "5000", 1, 1e12, NULL, "optimizer steps between checkpoints", "ckpt"},
    {"ckpt_dir", KEY_STR, F(ckpt_dir), "checkpoint", 0, 0, NULL, "checkpoint directory (also holds progress.db)", "ckpt"},
    {"ckpt_dtype", KEY_STR, F(ckpt_dtype), "fp32", 0, 0, "fp32|bf16", "dtype of model.safetensors in checkpoints", "ckpt"},
    {"ckpt_format", KEY_STR, F(ckpt_format), "full", 0, 0, "full|sharded", "checkpoint layout: full (AstrAI's files, gathered on rank 0) or sharded (each rank writes the tensors it owns: model-RRRRR-of-NNNNN.safetensors + index, no gather)", "ckpt"},
    {"async_checkpoint", KEY_BOOL, F(async_checkpoint), "false", 0, 0, NULL, "rank 0 writes checkpoints in the background: training blocks only for the copy to host memory (one write in flight; a checkpoint counts once committed)", "ckpt"},
    {"checkpoint_keep_last", KEY_INT, F(checkpoint_keep_last), "0", 0, 1e9, NULL, "after each checkpoint delete this run's older ones beyond the newest N (0: keep all); never the one resumed from, never one astrai did not write", "ckpt"},
    {"checkpoint_keep_best", KEY_INT, F(checkpoint_keep_best), "0", 0, 1e9, NULL, "with checkpoint_keep_last: also keep the N of lowest val_loss (validated at their step)", "ckpt"},
    {"max_steps", KEY_INT, F(max_steps), "0", 0, 1e12, NULL, "stop after this many optimizer steps, with a checkpoint (0: run all epochs; the schedule still spans them)", "training"},
    {"log_interval", KEY_INT, F(log_interval), "10", 1, 1e12, NULL, "optimizer steps between progress lines", "log"},
    {"sample_interval", KEY_INT, F(sample_interval), "0", 0, 1e12, NULL, "generate from the current weights for each of sample_prompts every N optimizer steps and at the end, into progress.db (0: off)", "log"},
    {"sample_prompts", KEY_STR, F(sample_prompts), "", 0, 0, NULL, "the samples' prompts: one {\"prompt\": TEXT} or {\"messages\": [...]} a line (required with sample_interval)", "log"},
    {"sample_max_tokens", KEY_INT, F(sample_max_tokens), "64", 1, 1048576, NULL, "the most tokens generated per sample", "log"},
    {"sample_temperature", KEY_FLOAT, F(sample_temperature), "0", 0, 1e6, NULL, "the samples' temperature (0: greedy, so successive samples compare; else seeded by random_seed)", "log"},
    {"sample_top_k", KEY_INT, F(sample_top_k), "0", 0, 1e9, NULL, "the samples' top-k (0: off)", "log"},
    {"sample_top_p", KEY_FLOAT, F(sample_top_p), "1", 0, 1, NULL, "the samples' top-p, in (0, 1] (1: off)", "log"},
    {"chat_template", KEY_STR, F(chat_template), "", 0, 0, NULL, "a Jinja chat template FILE that renders the \"messages\" of sample_prompts and of online prompts (default: the tokenizer's chat_template)", "data"},
    {"parallel_mode", KEY_STR, F(parallel_mode), "fsdp", 0, 0, "none|ddp|fsdp", "parallel executor (with one rank any mode runs as none)", "parallel"},
    {"nprocs", KEY_INT, F(nprocs), "1", 1, 4096, NULL, "number of ranks (of this node, with nnodes)", "parallel"},
    {"nnodes", KEY_INT, F(nnodes), "1", 1, 4096, NULL, "nodes of a multi-node launch (torchrun's --nnodes): each node's astrai-train starts nproc_per_node ranks of the job's nnodes x nproc_per_node, meeting at master_addr:master_port (node 0)", "parallel"},
    {"node_rank", KEY_INT, F(node_rank), "0", 0, 4095, NULL, "this node's place in a multi-node launch: its ranks are node_rank x nproc_per_node and on", "parallel"},
    {"nproc_per_node", KEY_INT, F(nproc_per_node), "0", 0, 4096, NULL, "ranks started on this node (torchrun's name; 0: nprocs)", "parallel"},
    {"bucket_mb", KEY_FLOAT, F(bucket_mb), "0", 0, 1e6, NULL, "ddp/fsdp: MiB of gradients reduced together while backward goes on (0: 25 with nccl, one bucket on CPU ranks)", "parallel"},
    {"comm_timeout", KEY_INT, F(comm_timeout), "600", 1, 86400, NULL, "seconds a collective may wait for the other ranks", "parallel"},
    {"threads", KEY_INT, F(threads), "0", 0, 4096, NULL, "CPU threads per rank (0: cores / local ranks)", "parallel"},
    {"device_type", KEY_STR, F(device_type), "auto", 0, 0, "auto|cpu|cuda", "where ranks compute (auto: cuda when built with CUDA and a GPU is visible, else cpu); rank r uses visible GPU LOCAL_RANK", "parallel"},
    {"dtype", KEY_STR, F(dtype), "auto", 0, 0, "auto|bf16|fp16|fp32", "compute dtype of weights and activations, with fp32 master weights and optimizer state (auto: bf16 on cuda, fp32 on cpu)", "model"},
    {"loss_scale", KEY_STR, F(loss_scale), "auto", 0, 0, NULL, "loss scaling: dynamic (PyTorch GradScaler's rule), none, or a fixed positive VALUE (auto: dynamic with dtype fp16, else none)", "model"},
    {"init_loss_scale", KEY_FLOAT, F(init_loss_scale), "65536", 1e-30, 1e300, NULL, "the dynamic loss scale's start", "model"},
    {"loss_scale_growth_interval", KEY_INT, F(loss_scale_growth_interval), "2000", 1, 1e9, NULL, "steps without an overflow after which the dynamic loss scale doubles", "model"},
    {"gradient_checkpointing", KEY_BOOL, F(gradient_checkpointing), "false", 0, 0, NULL, "keep only each block's input and recompute the block in backward (less memory, same numbers)", "model"},
    {"muon_momentum", KEY_FLOAT, F(muon_momentum), "0.95", 0, 0.999999, NULL, "Muon momentum factor", "training"},
    {"muon_nesterov", KEY_BOOL, F(muon_nesterov), "true", 0, 0, NULL, "Muon Nesterov momentum (--no-muon_nesterov: plain momentum)", "training"},
    {"muon_ns_steps", KEY_INT, F(muon_ns_steps), "5", 1, 100, NULL, "Muon Newton-Schulz steps", "training"},
    {"muon_adjust_lr", KEY_STR, F(muon_adjust_lr), "match_rms_adamw", 0, 0, "original|match_rms_adamw", "Muon lr adjustment (torch.optim.Muon adjust_lr_fn)", "training"},
    {"start_epoch", KEY_INT, F(start_epoch), "0", 0, 1e9, NULL, "fresh run: epoch to start in", "training"},
    {"start_samples", KEY_INT, F(start_samples), "0", 0, 1e15, NULL, "fresh run: samples per rank already consumed in start_epoch", "training"},
    {"master_addr", KEY_STR, F(master_addr), "localhost", 0, 0, NULL, "rendezvous address (MASTER_ADDR): where rank 0 of a local multi-rank launch listens when given (else 127.0.0.1); with nnodes, node 0's address", "parallel"},
    {"master_port", KEY_STR, F(master_port), "29500", 0, 0, NULL, "rendezvous port (MASTER_PORT) rank 0 of a local launch listens on when given (the default lets it pick a free one; with nnodes: 29500)", "parallel"},
    {"backend", KEY_STR, F(backend), "nccl", 0, 0, "nccl|gloo", "collectives: nccl (GPUs) or gloo (CPUs: given explicitly, Gloo over TCP even on one host; by default CPU ranks use shared memory on one host and Gloo across hosts); given explicitly it picks device_type auto's device", "parallel"},
    {"val_split", KEY_FLOAT, F(val_split), "0", 0, 0.999999, NULL, "fraction of the windows held out for validation (0: None; a seeded split, docs/training.md)", "data"},
    {"val_step", KEY_INT, F(val_step), "1000", 1, 1e12, NULL, "steps between validation runs (used with val_split)", "log"},
    {"metrics", KEY_STR, F(metrics), "loss,lr,grad_norm", 0, 0, NULL, "keys of metric.jsonl's step rows among loss|lr|grad_norm, repeatable or comma-separated (val_loss: validation rows are written whenever validation runs)", "log"},
    {"neftune_alpha", KEY_FLOAT, F(neftune_alpha), "0.0", 0, 1e6, NULL, "NEFTune: noise of std alpha/sqrt(T) on the input embeddings in training (0: off)", "model"},
    {"dpo_beta", KEY_FLOAT, F(dpo_beta), "0.1", 0, 1e6, NULL, "DPO: beta of -logsigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))", "training"},
    {"group_size", KEY_INT, F(group_size), "4", 1, 1e6, NULL, "GRPO: responses per prompt", "training"},
    {"grpo_clip_eps", KEY_FLOAT, F(grpo_clip_eps), "0.2", 0, 1e6, NULL, "GRPO: ratio clip epsilon", "training"},
    {"grpo_kl_coef", KEY_FLOAT, F(grpo_kl_coef), "0.01", 0, 1e6, NULL, "GRPO: coefficient of the KL penalty to the reference", "training"},
    {"rollout_interval", KEY_INT, F(rollout_interval), "512", 1, 1e12, NULL, "steps between rollouts (online_*)", "training"},
    {"rollout_temperature", KEY_FLOAT, F(rollout_temperature), "0.7", 0, 1e6, NULL, "rollout temperature (online_*)", "training"},
    {"rollout_top_k", KEY_INT, F(rollout_top_k), "0", 0, 1e9, NULL, "rollout top-k (0: off) (online_*)", "training"},
    {"rollout_top_p", KEY_FLOAT, F(rollout_top_p), "0.9", 0, 1, NULL, "rollout top-p (online_*)", "training"},
    {"rollout_max_tokens", KEY_INT, F(rollout_max_tokens), "1024", 1, 1e9, NULL, "max tokens per rollout (online_*)", "training"},
    {"reward_command", KEY_STR, F(reward_command), "", 0, 0, NULL, "online_*: the reward program, 'CMD ARGS' split into argv (no shell), one per rank, JSON lines on stdin/stdout", "training"},
    {"reward_url", KEY_STR, F(reward_url), "", 0, 0, NULL, "online_*: an http://HOST[:PORT]/PATH endpoint taking the reward command's request as a POST and answering its reply", "training"},
    {"reward_timeout_s", KEY_FLOAT, F(reward_timeout_s), "60", 0.001, 1e6, NULL, "online_*: seconds a reply may take before the step fails", "training"},
    {"reward_restarts", KEY_INT, F(reward_restarts), "3", 0, 1000, NULL, "online_*: restarts of a reward command that died, in a row, before the step fails", "training"},
    {"num_workers", KEY_INT, F(num_workers), "4", 0, 4096, NULL, "DataLoader workers (accepted; no effect: windows are read from memory)", "data"},
    {"pin_memory", KEY_BOOL, F(pin_memory), "true", 0, 0, NULL, "pin memory (accepted; no effect: no DataLoader)", "data"},
    {"start_method", KEY_STR, F(start_method), "spawn", 0, 0, "spawn|fork|forkserver", "multiprocessing start method (accepted; no effect: ranks are fork+exec'd)", "parallel"},
    {"compile", KEY_STR, F(compile), "", 0, 0, "default|reduce-overhead|max-autotune", "torch.compile mode (accepted; no effect: the kernels are compiled C)", "model"},
    {"tp_size", KEY_INT, F(tp_size), "0", 0, 4096, NULL, "tensor parallelism (0: None; > 1 refused)", "parallel"},
    {"pp_size", KEY_INT, F(pp_size), "1", 1, 4096, NULL, "pipeline stages: nprocs = pp_size x data-parallel replicas, parallel_mode spans each stage's replicas", "parallel"},
    {"ep_size", KEY_INT, F(ep_size), "1", 1, 4096, NULL, "expert parallelism: each MoE layer's routed experts split over ep_size of a stage's data-parallel replicas", "parallel"},
    {"pp_schedule", KEY_STR, F(pp_schedule), "1f1b", 0, 0, "1f1b|gpipe", "pipeline schedule of an optimizer step's grad_accum_steps micro-batches", "parallel"},
};
// clang-format on
#define N_KEYS (sizeof KEYS / sizeof KEYS[0])
_Static_assert(N_KEYS <= 8 * sizeof((TrainSpec *)0)->given, "TrainSpec.given: too few bits");

static const KeyDef *find_key(const char *name) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(KEYS[i].name, name) == 0) return &KEYS[i];
    return NULL;
}

static int unknown_key(const char *name, Err *err) {
    const char *best = flags_nearest(name, KEYS, N_KEYS, sizeof *KEYS);
    if (best) return err_set(err, "unknown key '%s' (did you mean '%s'?)", name, best);
    return err_set(err, "unknown key '%s' (see --help for the valid keys)", name);
}

// The position of value in choices ("a|b|c": b is 1); -1 when it is not one (the unset "").
static int choice_index(const char *choices, const char *value) {
    size_t n = strlen(value);
    int i = 0;
    for (const char *p = choices; *p; i++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, value, n) == 0) return i;
        p += len + (bar != NULL);
    }
    return -1;
}

static int choice_ok(const char *choices, const char *value) {
    return choice_index(choices, value) >= 0;
}

static int check_range(const KeyDef *k, double v, const char *text, Err *err) {
    if (v < k->min || v > k->max || isnan(v))
        return err_set(err, "%s: value %s is out of range [%g, %g]", k->name, text, k->min, k->max);
    return 0;
}

static int set_bool(const KeyDef *k, bool *dst, const char *value, Err *err) {
    if (!strcasecmp(value, "true") || !strcmp(value, "1") || !strcasecmp(value, "yes") ||
        !strcasecmp(value, "on"))
        *dst = true;
    else if (!strcasecmp(value, "false") || !strcmp(value, "0") || !strcasecmp(value, "no") ||
             !strcasecmp(value, "off"))
        *dst = false;
    else
        return err_set(err, "%s: '%s' is not a boolean (true|false)", k->name, value);
    return 0;
}

static int set_int(const KeyDef *k, long *dst, const char *value, Err *err) {
    char *end;
    errno = 0;
    long v = strtol(value, &end, 10);
    if (errno || end == value || *end)
        return err_set(err, "%s: '%s' is not an integer", k->name, value);
    if (check_range(k, (double)v, value, err)) return -1;
    *dst = v;
    return 0;
}

static int set_float(const KeyDef *k, double *dst, const char *value, Err *err) {
    char *end;
    errno = 0;
    double v = strtod(value, &end);
    if (errno || end == value || *end || !isfinite(v))
        return err_set(err, "%s: '%s' is not a number", k->name, value);
    if (check_range(k, v, value, err)) return -1;
    *dst = v;
    return 0;
}

// The enumerated keys and their decoded fields (TrainChoices).
#define C(field) offsetof(TrainSpec, is.field)
static const struct {
    const char *key;
    size_t offset;
} CHOICE_FIELDS[] = {
    {"train_type", C(train_type)},         {"optimizer", C(optimizer)},
    {"schedule_type", C(schedule_type)},   {"ckpt_dtype", C(ckpt_dtype)},
    {"ckpt_format", C(ckpt_format)},       {"parallel_mode", C(parallel_mode)},
    {"device_type", C(device_type)},       {"dtype", C(dtype)},
    {"muon_adjust_lr", C(muon_adjust_lr)}, {"backend", C(backend)},
    {"pp_schedule", C(pp_schedule)},
};
#undef C

_Static_assert(sizeof(TrainType) == sizeof(int) && sizeof(PipelineChoice) == sizeof(int),
               "decode_choice stores an int");

// Keeps the decoded choice of an enumerated key that has a TrainChoices field.
static void decode_choice(TrainSpec *s, const KeyDef *k, const char *value) {
    for (size_t i = 0; i < sizeof CHOICE_FIELDS / sizeof *CHOICE_FIELDS; i++)
        if (!strcmp(CHOICE_FIELDS[i].key, k->name)) {
            int at = choice_index(k->choices, value);
            memcpy((char *)s + CHOICE_FIELDS[i].offset, &at, sizeof at);
        }
}

static int set_str(TrainSpec *s, const KeyDef *k, char **dst, const char *value, Err *err) {
    // "" is the unset value of a key whose default is "" (job_spec_argv passes it on).
    if (k->choices && !(!*value && !*k->def) && !choice_ok(k->choices, value))
        return err_set(err, "%s: '%s' is not one of %s", k->name, value, k->choices);
    char *copy = strdup(value);
    if (!copy) return err_resource(err, "%s: out of memory", k->name);
    free(*dst);
    *dst = copy;
    if (k->choices) decode_choice(s, k, value);
    return 0;
}

static int set_key(TrainSpec *s, const KeyDef *k, const char *value, Err *err) {
    char *field = (char *)s + k->offset;
    switch (k->type) {
    case KEY_BOOL:
        return set_bool(k, (bool *)field, value, err);
    case KEY_INT:
        return set_int(k, (long *)field, value, err);
    case KEY_FLOAT:
        return set_float(k, (double *)field, value, err);
    case KEY_STR:
        return set_str(s, k, (char **)field, value, err);
    }
    return err_set(err, "%s: unknown key type", k->name);
}

int train_spec_defaults(TrainSpec *s, Err *err) {
    memset(s, 0, sizeof *s);
    for (size_t i = 0; i < N_KEYS; i++)
        if (set_key(s, &KEYS[i], KEYS[i].def, err)) {
            train_spec_free(s);
            return -1;
        }
    return 0;
}

void train_spec_free(TrainSpec *s) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (KEYS[i].type == KEY_STR) free(*(char **)((char *)s + KEYS[i].offset));
    memset(s, 0, sizeof *s);
}

static void mark_given(TrainSpec *s, const KeyDef *k) {
    size_t i = (size_t)(k - KEYS);
    s->given[i / 8] |= (unsigned char)(1u << (i % 8));
}

static bool at_default(const TrainSpec *s, const KeyDef *k);

// A key set to its default counts as not given: astraid passes every key of a job's spec
// to astrai-train, defaults included.
bool train_spec_given(const TrainSpec *s, const char *name) {
    const KeyDef *k = find_key(name);
    if (!k) return false;
    size_t i = (size_t)(k - KEYS);
    return ((s->given[i / 8] >> (i % 8)) & 1) && !at_default(s, k);
}

// Sets a key from a flag, the YAML or JSON, remembering that it was given.
static int set_given(TrainSpec *s, const KeyDef *k, const char *value, Err *err) {
    if (set_key(s, k, value, err)) return -1;
    mark_given(s, k);
    return 0;
}

int train_spec_set(TrainSpec *s, const char *key, const char *value, Err *err) {
    const KeyDef *k = find_key(key);
    if (!k) return unknown_key(key, err);
    return set_given(s, k, value, err);
}

// --metrics is repeatable (click multiple=True): a second one on the command line adds.
static int append_metric(TrainSpec *s, const KeyDef *k, const char *value, Err *err) {
    size_t n = strlen(s->metrics) + strlen(value) + 2;
    char *joined = malloc(n);
    if (!joined) return err_resource(err, "metrics: out of memory");
    snprintf(joined, n, "%s,%s", s->metrics, value);
    int rc = set_given(s, k, joined, err);
    free(joined);
    return rc;
}

// ---------------------------------------------------------------- astrai-train's command line

// What the entries of astrai-train's flag table write to. argv is read twice: the first pass
// applies -c/--config's YAML wherever it stands, the second every other flag over it.
typedef struct {
    TrainSpec *spec;
    bool yaml_pass;     // the first pass
    bool metrics_given; // a --metrics already read: the next one adds to it
    bool help;
} ArgsPass;

// --KEY=VALUE (f->data: its KeyDef).
static int parse_key_flag(const Flag *f, const char *value, Err *err) {
    ArgsPass *p = f->target;
    const KeyDef *k = f->data;
    if (p->yaml_pass) return 0;
    if (k->offset == F(metrics) && p->metrics_given) return append_metric(p->spec, k, value, err);
    if (k->offset == F(metrics)) p->metrics_given = true;
    return set_given(p->spec, k, value, err);
}

static int parse_config_flag(const Flag *f, const char *path, Err *err) {
    ArgsPass *p = f->target;
    if (!p->yaml_pass) return 0;
    if (!*path) return err_set(err, "--config: missing file name");
    return train_spec_apply_yaml(p->spec, path, err);
}

// A flag no key names ("name" or "name=value"): the same error as a JSON or YAML key.
static int parse_unknown_flag(const Flag *f, const char *arg, Err *err) {
    (void)f;
    char name[128];
    snprintf(name, sizeof name, "%.*s", (int)strcspn(arg, "="), arg);
    return unknown_key(name, err);
}

#define N_EXTRA_FLAGS 4
#define N_FLAGS (N_EXTRA_FLAGS + N_KEYS)

// astrai-train's flag table: -c/--config, --dry-run, -h/--help, then one flag per key
// (booleans: --key alone, --no-key, --key=true|false), and the unknown-flag error.
static void args_flags(ArgsPass *p, Flag flags[N_FLAGS]) {
    flags[0] = (Flag){.name = "config",
                      .kind = FLAG_PARSED,
                      .target = p,
                      .parse = parse_config_flag,
                      .short_name = 'c',
                      .value_name = "FILE",
                      .help = "AstrAI's YAML config (sections model, data, parallel, training, "
                              "ckpt, log); flags on the command line win"};
    flags[1] = (Flag){.name = "dry-run",
                      .kind = FLAG_SWITCH,
                      .target = &p->spec->dry_run,
                      .help = "validate everything (files too), print the resolved "
                              "configuration, do not train"};
    flags[2] = (Flag){.name = "help", .kind = FLAG_SWITCH, .target = &p->help, .short_name = 'h'};
    flags[3] = (Flag){.name = "KEY", .kind = FLAG_UNKNOWN, .parse = parse_unknown_flag};
    for (size_t i = 0; i < N_KEYS; i++)
        flags[N_EXTRA_FLAGS + i] = (Flag){.name = KEYS[i].name,
                                          .kind = FLAG_PARSED,
                                          .target = p,
                                          .parse = parse_key_flag,
                                          .data = &KEYS[i],
                                          .negatable = KEYS[i].type == KEY_BOOL,
                                          .value_optional = KEYS[i].type == KEY_BOOL};
}

int train_spec_parse_args(TrainSpec *s, int argc, char **argv, bool *help, Err *err) {
    ArgsPass p = {.spec = s, .yaml_pass = true};
    Flag flags[N_FLAGS];
    args_flags(&p, flags);
    // flags_parse leaves argv as it was without arguments allowed: the second pass reads it.
    int rc = flags_parse(flags, N_FLAGS, argc - 1, argv + 1, NULL, err);
    if (!rc) {
        p.yaml_pass = false;
        rc = flags_parse(flags, N_FLAGS, argc - 1, argv + 1, NULL, err);
    }
    *help = p.help;
    return rc;
}

// ---------------------------------------------------------------- AstrAI's YAML config

static const char *const YAML_SECTIONS[] = {"model", "data", "parallel", "training", "ckpt", "log"};

static bool yaml_section(const char *name) {
    for (size_t i = 0; i < sizeof YAML_SECTIONS / sizeof *YAML_SECTIONS; i++)
        if (!strcmp(YAML_SECTIONS[i], name)) return true;
    return false;
}

static bool yaml_null(const yaml_node_t *v) {
    const char *t = (const char *)v->data.scalar.value;
    return v->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
           (!*t || !strcmp(t, "~") || !strcasecmp(t, "null"));
}

// One key: value of the YAML (value a scalar, or a list of scalars joined by commas).
static int yaml_apply_key(TrainSpec *s, yaml_document_t *doc, const char *path, const char *name,
                          yaml_node_t *v, Err *err) {
    const KeyDef *k = find_key(name);
    if (!k) {
        unknown_key(name, err);
        return err_prefix(err, "%s", path);
    }
    char text[4096] = "";
    if (v->type == YAML_SCALAR_NODE) {
        if (yaml_null(v)) return 0; // None: the default
        snprintf(text, sizeof text, "%s", (const char *)v->data.scalar.value);
    } else if (v->type == YAML_SEQUENCE_NODE) {
        for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top;
             it++) {
            yaml_node_t *e = yaml_document_get_node(doc, *it);
            if (!e || e->type != YAML_SCALAR_NODE)
                return err_set(err, "%s: %s: a list of scalars expected", path, name);
            size_t len = strlen(text);
            snprintf(text + len, sizeof text - len, "%s%s", len ? "," : "",
                     (const char *)e->data.scalar.value);
        }
    } else {
        return err_set(err, "%s: %s: a scalar value expected", path, name);
    }
    if (set_given(s, k, text, err)) return err_prefix(err, "%s", path);
    return 0;
}

static int yaml_apply_map(TrainSpec *s, yaml_document_t *doc, const char *path, yaml_node_t *map,
                          bool top, Err *err) {
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        yaml_node_t *kn = yaml_document_get_node(doc, p->key);
        yaml_node_t *vn = yaml_document_get_node(doc, p->value);
        if (!kn || !vn || kn->type != YAML_SCALAR_NODE)
            return err_set(err, "%s: keys must be plain names", path);
        const char *name = (const char *)kn->data.scalar.value;
        if (vn->type == YAML_MAPPING_NODE) {
            if (!top) return err_set(err, "%s: %s: sections do not nest", path, name);
            if (!yaml_section(name)) {
                fprintf(stderr,
                        "warning: %s: section '%s' ignored (AstrAI reads model, data, "
                        "parallel, training, ckpt, log)\n",
                        path, name);
                continue;
            }
            if (yaml_apply_map(s, doc, path, vn, false, err)) return -1;
            continue;
        }
        if (yaml_apply_key(s, doc, path, name, vn, err)) return -1;
    }
    return 0;
}

int train_spec_apply_yaml(TrainSpec *s, const char *path, Err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return err_set(err, "--config %s: cannot open: %s", path, strerror(errno));
    yaml_parser_t parser;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&parser)) {
        fclose(f);
        return err_resource(err, "--config %s: out of memory", path);
    }
    yaml_parser_set_input_file(&parser, f);
    int rc = 0, loaded = yaml_parser_load(&parser, &doc);
    if (!loaded && parser.error == YAML_MEMORY_ERROR) {
        rc = err_resource(err, "--config %s: out of memory", path);
    } else if (!loaded) {
        rc = err_set(err, "%s:%zu:%zu: YAML: %s", path, parser.problem_mark.line + 1,
                     parser.problem_mark.column + 1,
                     parser.problem ? parser.problem : "parse error");
    } else {
        yaml_node_t *root = yaml_document_get_root_node(&doc);
        if (root && root->type != YAML_MAPPING_NODE)
            rc = err_set(err, "%s: the config must be a mapping of sections", path);
        else if (root)
            rc = yaml_apply_map(s, &doc, path, root, true, err);
        yaml_document_delete(&doc);
    }
    yaml_parser_delete(&parser);
    fclose(f);
    return rc;
}

// Renders a JSON scalar as the text a flag would carry, checking the JSON type.
static int json_value_text(const KeyDef *k, const cJSON *v, char *buf, size_t cap, Err *err) {
    switch (k->type) {
    case KEY_BOOL:
        if (!cJSON_IsBool(v)) return err_set(err, "%s: expected true or false", k->name);
        snprintf(buf, cap, "%s", cJSON_IsTrue(v) ? "true" : "false");
        return 0;
    case KEY_INT:
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
            return err_set(err, "%s: expected an integer", k->name);
        snprintf(buf, cap, "%.0f", v->valuedouble);
        return 0;
    case KEY_FLOAT:
        if (!cJSON_IsNumber(v)) return err_set(err, "%s: expected a number", k->name);
        snprintf(buf, cap, "%.17g", v->valuedouble);
        return 0;
    case KEY_STR:
        if (!cJSON_IsString(v)) return err_set(err, "%s: expected a string", k->name);
        if (strlen(v->valuestring) >= cap) return err_set(err, "%s: value too long", k->name);
        snprintf(buf, cap, "%s", v->valuestring);
        return 0;
    }
    return err_set(err, "%s: unknown key type", k->name);
}

static int ignored(const char *key, const char *const *ignore) {
    for (; ignore && *ignore; ignore++)
        if (!strcmp(*ignore, key)) return 1;
    return 0;
}

int train_spec_apply_json(TrainSpec *s, const cJSON *obj, const char *const *ignore, Err *err) {
    if (!cJSON_IsObject(obj)) return err_set(err, "the spec must be a JSON object");
    const cJSON *item;
    cJSON_ArrayForEach(item, obj) {
        if (ignored(item->string, ignore)) continue;
        const KeyDef *k = find_key(item->string);
        if (!k) return unknown_key(item->string, err);
        char text[4096];
        if (json_value_text(k, item, text, sizeof text, err)) return -1;
        if (set_given(s, k, text, err)) return -1;
    }
    return 0;
}

// Whether key k of s holds its default value (read from the table: no allocation).
static bool at_default(const TrainSpec *s, const KeyDef *k) {
    const char *field = (const char *)s + k->offset;
    Err ignored;
    bool b;
    long i;
    double f;
    switch (k->type) {
    case KEY_BOOL:
        return !set_bool(k, &b, k->def, &ignored) && *(const bool *)field == b;
    case KEY_INT:
        return !set_int(k, &i, k->def, &ignored) && *(const long *)field == i;
    case KEY_FLOAT:
        return !set_float(k, &f, k->def, &ignored) && *(const double *)field == f;
    case KEY_STR:
        return !strcmp(*(char *const *)field, k->def);
    }
    return false;
}

static int check_metrics(const char *list, Err *err) {
    if (strspn(list, ",") == strlen(list))
        return err_set(err, "metrics: '%s' names no metric (loss|lr|grad_norm|val_loss)", list);
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *save, *m = strtok_r(buf, ",", &save); m; m = strtok_r(NULL, ",", &save))
        if (!choice_ok("loss|lr|grad_norm|val_loss", m))
            return err_set(err, "metrics: '%s' is not one of loss|lr|grad_norm|val_loss", m);
    return 0;
}

static int check_port(const char *port, Err *err) {
    char *end;
    long v = strtol(port, &end, 10);
    if (end == port || *end || v < 1 || v > 65535)
        return err_set(err, "master_port: '%s' is not a port (1..65535)", port);
    return 0;
}

int train_spec_loss_scale(const TrainSpec *s, double *fixed, Err *err) {
    const char *v = s->loss_scale;
    if (!strcmp(v, "dynamic") || (!strcmp(v, "auto") && s->is.dtype == DTYPE_FP16))
        return LOSS_SCALE_DYNAMIC;
    if (!strcmp(v, "none") || !strcmp(v, "auto")) return LOSS_SCALE_NONE;
    char *end;
    double x = strtod(v, &end);
    if (*v == '\0' || *end != '\0' || !(x > 0) || !isfinite(x))
        return err_set(err, "loss_scale: '%s' is not dynamic, none, auto or a positive number", v);
    if (fixed) *fixed = x;
    return LOSS_SCALE_FIXED;
}

// The online strategies' reward source (exactly one), and what their rollouts cannot run under.
static int check_online(const TrainSpec *s, Err *err) {
    bool online = s->is.train_type == TRAIN_ONLINE_GRPO || s->is.train_type == TRAIN_ONLINE_DPO;
    bool command = *s->reward_command, url = *s->reward_url;
    if (!online) {
        const char *k = command ? "reward_command" : url ? "reward_url" : NULL;
        return k ? err_set(err, "%s: rewards belong to online_grpo/online_dpo, not train_type %s",
                           k, s->train_type)
                 : 0;
    }
    if (command == url)
        return err_set(err,
                       "train_type %s: give the rewards' source, reward_command or "
                       "reward_url (one of them)",
                       s->train_type);
    if (s->pp_size > 1)
        return err_set(err,
                       "pp_size: %ld with train_type %s: rollouts generate with the whole "
                       "model, which a pipeline stage does not hold",
                       s->pp_size, s->train_type);
    if (s->ep_size > 1)
        return err_set(err,
                       "ep_size: %ld with train_type %s: rollouts' forwards would have to "
                       "exchange experts in step across ranks",
                       s->ep_size, s->train_type);
    if (s->val_split > 0)
        return err_set(err, "val_split: %g with train_type %s: validation has no rollout",
                       s->val_split, s->train_type);
    if (s->is.train_type == TRAIN_ONLINE_DPO && s->group_size < 2)
        return err_set(err,
                       "group_size: %ld with online_dpo: the chosen and rejected responses "
                       "are two of a prompt's group",
                       s->group_size);
    return 0;
}

// Samples during training (train/samples.h): the interval and the prompts come together, and
// generation runs whole forwards on one rank, which a pipeline's stages and the expert groups'
// exchanges do not have yet.
static int check_samples(const TrainSpec *s, Err *err) {
    if (s->sample_interval > 0 && !*s->sample_prompts)
        return err_set(err, "sample_interval: %ld needs sample_prompts (the prompts' .jsonl file)",
                       s->sample_interval);
    if (s->sample_interval == 0 && *s->sample_prompts)
        return err_set(err,
                       "sample_prompts: '%s' is given without sample_interval (the optimizer "
                       "steps between samples; 0 is off)",
                       s->sample_prompts);
    if (s->sample_interval == 0) return 0;
    if (s->pp_size > 1)
        return err_set(err,
                       "sample_interval: samples with pp_size %ld are not supported yet (rank 0 "
                       "generates with the whole model; a pipeline splits it over its stages)",
                       s->pp_size);
    if (s->ep_size > 1)
        return err_set(err,
                       "sample_interval: samples with ep_size %ld are not supported yet (rank 0 "
                       "generates alone; expert parallelism spreads each MoE layer over ranks)",
                       s->ep_size);
    if (!(s->sample_top_p > 0))
        return err_set(err, "sample_top_p: %g is not in (0, 1]", s->sample_top_p);
    return 0;
}

long train_spec_world(const TrainSpec *s) {
    return s->nnodes * (s->nproc_per_node > 0 ? s->nproc_per_node : s->nprocs);
}

int train_spec_validate(const TrainSpec *s, Err *err) {
    if (!*s->train_type)
        return err_set(err, "train_type: required (seq|sft|dpo|grpo|online_grpo|online_dpo)");
    if (check_online(s, err)) return -1;
    if (!*s->param_path) return err_set(err, "param_path: required");
    if (!*s->data_root_path) return err_set(err, "data_root_path: required");
    if (!*s->ckpt_dir) return err_set(err, "ckpt_dir: must not be empty");
    if (train_spec_loss_scale(s, NULL, err) < 0) return -1;
    // (nprocs 1: one process, or ranks from torchrun's or srun's environment, which the
    // trainer checks)
    long world = train_spec_world(s);
    if (s->node_rank >= s->nnodes)
        return err_set(err, "node_rank: %ld is not below nnodes %ld", s->node_rank, s->nnodes);
    if (world > 1 && world % s->pp_size)
        return err_set(err, "pp_size: %ld does not divide nprocs %ld", s->pp_size, world);
    if (world / s->pp_size > 1 && s->is.parallel_mode == PARALLEL_NONE)
        return s->pp_size == 1
                   ? err_set(err, "nprocs: %ld ranks need parallel_mode ddp or fsdp", world)
                   : err_set(err,
                             "nprocs: %ld ranks are %ld replicas of a pipeline of pp_size %ld: "
                             "they need parallel_mode ddp or fsdp",
                             world, world / s->pp_size, s->pp_size);
    if (s->ep_size > 1 && s->is.parallel_mode == PARALLEL_NONE)
        return err_set(err,
                       "ep_size: %ld needs parallel_mode ddp or fsdp (the ranks that share the "
                       "experts are data-parallel replicas)",
                       s->ep_size);
    if (world > 1 && (world / s->pp_size) % s->ep_size)
        return err_set(err,
                       "ep_size: %ld does not divide the %ld data-parallel replicas (nprocs %ld / "
                       "pp_size %ld)",
                       s->ep_size, world / s->pp_size, world, s->pp_size);
    if (s->tp_size > 1)
        return err_set(err,
                       "tp_size: %ld is refused: tensor parallelism is not implemented "
                       "(AstrAI's train.py does not wire it either)",
                       s->tp_size);
    if (train_spec_given(s, "backend")) {
        bool gloo = s->is.backend == COLLECTIVES_GLOO;
        if (gloo && s->is.device_type == DEVICE_CUDA)
            return err_set(err, "backend: gloo means the CPU collectives here, but device_type "
                                "is cuda (use --backend=nccl, or --device_type=cpu)");
        if (!gloo && s->is.device_type == DEVICE_CPU)
            return err_set(err, "backend: nccl needs GPUs, but device_type is cpu (use "
                                "--backend=gloo for the CPU collectives)");
    }
    if (check_samples(s, err)) return -1;
    if (check_port(s->master_port, err) || check_metrics(s->metrics, err)) return -1;
    if (!*s->master_addr) return err_set(err, "master_addr: must not be empty");
    if (strlen(s->master_addr) > 253)
        return err_set(err, "master_addr: '%.40s...' is longer than a host name (253 characters)",
                       s->master_addr);
    return 0;
}

void train_spec_warn_ignored(const TrainSpec *s, FILE *out) {
    static const char *const WHY[][2] = {
        {"num_workers", "no DataLoader: windows are read straight from the shards in memory"},
        {"pin_memory", "no DataLoader: batches are copied to the device directly"},
        {"start_method", "ranks are started by fork+exec of astrai-train, never by Python"},
        {"compile", "there is no torch.compile: the kernels are compiled C/CUDA already"}};
    for (size_t i = 0; i < sizeof WHY / sizeof *WHY; i++)
        if (train_spec_given(s, WHY[i][0]))
            fprintf(out, "warning: --%s changes nothing in astrai: %s\n", WHY[i][0], WHY[i][1]);
    static const char *const ROLLOUT[] = {"rollout_interval", "rollout_temperature",
                                          "rollout_top_k", "rollout_top_p", "rollout_max_tokens"};
    bool online = s->is.train_type == TRAIN_ONLINE_GRPO || s->is.train_type == TRAIN_ONLINE_DPO;
    for (size_t i = 0; !online && i < sizeof ROLLOUT / sizeof *ROLLOUT; i++)
        if (train_spec_given(s, ROLLOUT[i]))
            fprintf(out,
                    "warning: --%s changes nothing for train_type %s: rollouts belong to "
                    "online_grpo/online_dpo\n",
                    ROLLOUT[i], s->train_type);
}

void train_spec_print(const TrainSpec *s, FILE *out) {
    for (size_t i = 0; i < N_KEYS; i++) {
        const KeyDef *k = &KEYS[i];
        const char *field = (const char *)s + k->offset;
        switch (k->type) {
        case KEY_BOOL:
            fprintf(out, "%s = %s\n", k->name, *(const bool *)field ? "true" : "false");
            break;
        case KEY_INT:
            fprintf(out, "%s = %ld\n", k->name, *(const long *)field);
            break;
        case KEY_FLOAT:
            fprintf(out, "%s = %.17g\n", k->name, *(const double *)field);
            break;
        case KEY_STR:
            fprintf(out, "%s = %s\n", k->name, *(char *const *)field);
            break;
        }
    }
}

cJSON *train_spec_to_json(const TrainSpec *s) {
    unsigned long failures = json_failures();
    cJSON *obj = cJSON_CreateObject();
    for (size_t i = 0; obj && i < N_KEYS; i++) {
        const KeyDef *k = &KEYS[i];
        const char *field = (const char *)s + k->offset;
        switch (k->type) {
        case KEY_BOOL:
            cJSON_AddBoolToObject(obj, k->name, *(const bool *)field);
            break;
        case KEY_INT:
            cJSON_AddNumberToObject(obj, k->name, (double)*(const long *)field);
            break;
        case KEY_FLOAT:
            cJSON_AddNumberToObject(obj, k->name, *(const double *)field);
            break;
        case KEY_STR:
            cJSON_AddStringToObject(obj, k->name, *(char *const *)field);
            break;
        }
    }
    if (json_failures() == failures) return obj;
    cJSON_Delete(obj); // a key lost for want of memory: no spec
    return NULL;
}

void train_spec_print_help(const char *prog) {
    printf("usage: %s --train_type=seq|sft --param_path=DIR --data_root_path=DIR [options]\n\n"
           "Flags take --key=value or --key value; booleans also --key alone and --no-key.\n",
           prog);
    TrainSpec unused;
    ArgsPass p = {.spec = &unused};
    Flag flags[N_FLAGS];
    args_flags(&p, flags);
    flags_usage(stdout, flags, N_EXTRA_FLAGS);
    for (size_t g = 0; g < sizeof YAML_SECTIONS / sizeof *YAML_SECTIONS; g++) {
        printf("\n%s:\n", YAML_SECTIONS[g]);
        for (size_t i = 0; i < N_KEYS; i++) {
            const KeyDef *k = &KEYS[i];
            if (strcmp(k->group, YAML_SECTIONS[g])) continue;
            char name[64];
            snprintf(name, sizeof name, "--%s", k->name);
            printf("  %-22s %s", name, k->help);
            if (k->choices) printf(" [%s]", k->choices);
            if (*k->def) printf(" (default %s)", k->def);
            putchar('\n');
        }
    }
}
