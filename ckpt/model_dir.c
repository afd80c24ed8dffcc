// model_dir.c: the model config of a model directory, a checkpoint or an HF directory.
#include "ckpt/model_dir.h"

#include <limits.h>
#include <stdbool.h>

#include "ckpt/hf.h"
#include "common/path.h"

int ckpt_model_config(ModelConfig *cfg, const char *dir, Err *err) {
    char path[PATH_MAX];
    bool hf;
    if (hf_is_model_dir(dir, &hf, err)) return -1;
    if (hf) return hf_load_config(cfg, dir, err);
    return path_join(path, sizeof path, dir, "config.json", err) ||
           model_config_load(cfg, path, err);
}
