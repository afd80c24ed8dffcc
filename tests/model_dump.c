// model_dump: runs the C model on a batch and dumps what the PyTorch reference checks.
//
//   model_dump MODEL_DIR INPUTS.safetensors OUT.safetensors [LABEL_SMOOTHING]
//
// INPUTS holds int32 (B,T) tensors `inputs`, `targets` and optionally `loss_mask`,
// `position_ids`. OUT gets `logits` (B,T,V), `loss` (1) and `grad.<param>` for every
// parameter. The gradients come from two backward passes of 0.5 each, so the dump also
// checks that model_backward accumulates (+=) and can be replayed after one forward.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model.h"
#include "tests/grad_dump.h"

// The int32 (B,T) tensor `name`, or NULL when absent and optional.
static int32_t *read_i32(const StFile *f, const char *name, int optional, int *B, int *T,
                         Err *err) {
    const StTensor *t = st_find(f, name);
    if (!t) {
        if (!optional) err_set(err, "inputs: missing tensor '%s'", name);
        return NULL;
    }
    if (t->dtype != DT_I32 || t->ndim != 2 || (*B && (t->shape[0] != *B || t->shape[1] != *T))) {
        err_set(err, "inputs: tensor '%s' must be int32 (B,T)", name);
        return NULL;
    }
    *B = (int)t->shape[0];
    *T = (int)t->shape[1];
    int32_t *out = malloc(t->end - t->begin);
    if (out) memcpy(out, t->bytes, t->end - t->begin);
    return out;
}

static int dump_grads(const Model *m, const char *path, float loss, int B, int T, Err *err) {
    float *logits = malloc((size_t)B * T * m->cfg.vocab_size * sizeof *logits);
    if (!logits) return err_resource(err, "%s: out of memory for the logits", path);
    model_logits(m, logits);
    StWriteTensor w[2] = {{.name = "logits", .ndim = 3, .data = logits},
                          {.name = "loss", .ndim = 1, .shape = {1}, .data = &loss}};
    w[0].shape[0] = B, w[0].shape[1] = T, w[0].shape[2] = m->cfg.vocab_size;
    int rc = dump_with_grads(m, path, w, 2, err);
    free(logits);
    return rc;
}

static int run(const char *dir, const char *inputs_path, const char *out_path, float smoothing,
               Err *err) {
    char path[4096];
    ModelConfig cfg;
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (model_config_load(&cfg, path, err)) return -1;
    Model m;
    if (model_create(&m, &cfg, backend_cpu(), err)) return -1;
    StFile f;
    int rc = -1, B = 0, T = 0;
    int32_t *inputs = NULL, *targets = NULL, *mask = NULL, *pos = NULL;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (model_load(&m, path, err) || st_open(&f, inputs_path, err)) goto done;
    inputs = read_i32(&f, "inputs", 0, &B, &T, err);
    targets = inputs ? read_i32(&f, "targets", 0, &B, &T, err) : NULL;
    mask = read_i32(&f, "loss_mask", 1, &B, &T, err);
    pos = read_i32(&f, "position_ids", 1, &B, &T, err);
    st_close(&f);
    if (!inputs || !targets) goto done;
    float loss = model_forward(&m, inputs, targets, mask, pos, B, T, smoothing, err);
    if (loss != loss) goto done;
    model_zero_grad(&m);
    model_backward(&m, 0.5f);
    model_backward(&m, 0.5f);
    rc = dump_grads(&m, out_path, loss, B, T, err);
done:
    free(inputs), free(targets), free(mask), free(pos);
    model_free(&m);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s MODEL_DIR INPUTS.safetensors OUT.safetensors [SMOOTHING]\n",
                argv[0]);
        return EXIT_BAD_INPUT;
    }
    Err err = {0};
    if (run(argv[1], argv[2], argv[3], argc == 5 ? strtof(argv[4], NULL) : 0.0f, &err)) {
        fprintf(stderr, "model_dump: %s\n", err.msg);
        return EXIT_BAD_INPUT;
    }
    return 0;
}
