// model_dir.h: the model config of a directory astrai reads a model from: a model directory or
// a checkpoint (AstrAI's config.json), or a Hugging Face directory (its config mapped as
// import-hf maps it, docs/huggingface.md).
#pragma once
#include "common/error.h"
#include "model/config.h"

// *cfg of dir; errors name the file and key. The directory is never written.
int ckpt_model_config(ModelConfig *cfg, const char *dir, Err *err);
