// hf.h: Hugging Face checkpoints in and out (docs/huggingface.md, docs/design.md §16).
//
// A conversion maps one directory's config.json and weights to the other side's:
//
//   import  HF dir (config.json with model_type llama/mistral/mixtral/qwen2/qwen3,
//           model.safetensors or the sharded set model.safetensors.index.json names) -> an
//           AstrAI model
//   export  AstrAI model or checkpoint dir (config.json, model weights in either layout) -> HF
//
// Tensors are renamed, and the rows of q_proj and k_proj (their biases, the qk-norm weights)
// permuted per head between HF's RoPE layout (halves i, i+D/2) and AstrAI's (pairs 2i, 2i+1);
// nothing else changes but an optional dtype cast. Everything is validated when the conversion
// is opened (the config's keys, every tensor's presence, shape and dtype, no extra tensor),
// before anything is written; the weights are then converted one tensor at a time from the
// mmap'd source straight into the output file.
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "ckpt/safetensors.h"
#include "common/dtype.h"
#include "common/error.h"
#include "model/config.h"

struct cJSON;

// The shapes a config implies (either side's), and the features that add or drop tensors.
typedef struct {
    int vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads;
    int intermediate_size, max_position_embeddings, head_dim;
    bool tie_word_embeddings; // no lm_head tensor
    bool attention_bias;      // q/k/v_proj biases (qwen2; llama's attention_bias)
    bool o_proj_bias;         // an o_proj bias too (llama's attention_bias)
    bool qk_norm;             // q_norm/k_norm, applied before RoPE (qwen3)
    int sliding_window;       // 0: none (mistral's and mixtral's sliding_window)
    int n_routed_experts;     // 0: one MLP; else mixtral's experts, DeepSeekMoE without shared
} HfShape;

// HF config.json (path) -> the AstrAI config: the mapped keys, "hf_model_type" and "hf_config"
// (the HF object verbatim, for export), checked by the engine's parser. Unknown keys and
// unsupported values are refused naming path and the key.
int hf_config_import(const char *path, struct cJSON **astrai, HfShape *shape, Err *err);

// AstrAI config.json (path) -> an HF config with torch_dtype `dtype`: its hf_config with the
// mapped keys updated when it has one, else a llama, mistral, mixtral, qwen2 or qwen3 config by
// its features.
int hf_config_export(const char *path, DType dtype, struct cJSON **hf, HfShape *shape, Err *err);

// *hf: whether dir/config.json names an HF model_type (anything but AstrAI's
// "autoregressive_lm"); false when it cannot be read or parsed (the AstrAI loader says why).
// -1 only for want of memory.
int hf_is_model_dir(const char *dir, bool *hf, Err *err);

// An opened conversion: the source weights, what each output tensor is made of, the output
// config. Output tensors are split into shards of at most max_shard_bytes each (0: one file).
typedef struct HfConversion HfConversion;

// dtype: the output dtype of every tensor, or DT_N to keep each source tensor's.
int hf_open_import(HfConversion **c, const char *hf_dir, DType dtype, Err *err);
int hf_open_export(HfConversion **c, const char *astrai_dir, DType dtype, Err *err);
void hf_close(HfConversion *c);

// The output config (owned by c).
const struct cJSON *hf_output_config(const HfConversion *c);

// Groups the output tensors, in order, into files of at most max_shard_bytes (a tensor larger
// than that alone in its file); returns the number of files (1 when max_shard_bytes is 0).
int hf_plan_shards(HfConversion *c, uint64_t max_shard_bytes);

// The index of a sharded output (hf_plan_shards said more than one file): {"metadata":
// {"total_size": BYTES}, "weight_map": {tensor: "model-0000K-of-0000N.safetensors"}}, malloc'd.
char *hf_index_json(const HfConversion *c);

// Writes output file k (0-based, of hf_plan_shards's; 0 when never planned) to path, fsynced.
int hf_write_shard(const HfConversion *c, int k, const char *path, Err *err);

// An HF dir's model as AstrAI's, without writing anything: *cfg from its config.json, *f the
// converted weights (source dtypes kept) in an anonymous memory file. st_close frees it.
int hf_load_config(ModelConfig *cfg, const char *hf_dir, Err *err);
int hf_open_weights(StFile *f, const char *hf_dir, Err *err);
