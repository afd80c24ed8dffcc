// objective_lm.c: language modelling (train/objective.h). A sample is a window of the token
// stream (data/dataset.h); seq counts every next token, sft only the response tokens of its
// loss mask, with positions restarting at each document of a packed window. The loss is the mean
// cross-entropy of the counted tokens, with AstrAI's label smoothing.
#include <stdlib.h>

#include "data/dataset.h"
#include "train/objective.h"

typedef struct {
    Dataset data;
    bool sft;
    int64_t window, stride;
    float label_smoothing;
    int nb; // the samples of the batch in flight
    // (batch, window) the batch: inputs, targets; sft: loss mask, position ids
    int32_t *inputs, *targets, *loss_mask, *position_ids;
} Lm;

static int lm_windows(Lm *lm, const ObjectiveSetup *s, Objective *o, Err *err) {
    const char *root = s->spec->data_root_path;
    if (dataset_open(&lm->data, root, lm->sft, err)) return -1;
    if (dataset_check_vocab(&lm->data, s->cfg->vocab_size, err) ||
        dataset_check_positions(&lm->data, s->cfg->max_position_embeddings, err))
        return err_prefix(err, "data_root_path %s", root);
    o->n_samples = dataset_num_windows(lm->data.n_tokens, lm->window, lm->stride);
    if (o->n_samples == 0)
        return err_set(err, "data_root_path %s: %lld tokens give no sample of window_size %lld",
                       root, (long long)lm->data.n_tokens, (long long)lm->window);
    return 0;
}

static int lm_open(Objective *o, const ObjectiveSetup *s, Err *err) {
    Lm *lm = calloc(1, sizeof *lm);
    if (!lm) return err_resource(err, "objective: out of memory");
    o->state = lm;
    *lm = (Lm){.sft = s->spec->is.train_type == TRAIN_SFT,
               .window = s->window,
               .stride = s->stride,
               .label_smoothing = (float)s->spec->label_smoothing};
    if (lm_windows(lm, s, o, err)) return -1;
    size_t n = (size_t)s->batch * (size_t)s->window;
    lm->inputs = malloc(n * sizeof(int32_t));
    lm->targets = malloc(n * sizeof(int32_t));
    lm->loss_mask = malloc(n * sizeof(int32_t));
    lm->position_ids = malloc(n * sizeof(int32_t));
    if (!lm->inputs || !lm->targets || !lm->loss_mask || !lm->position_ids)
        return err_resource(err, "batch buffers: out of memory");
    return 0;
}

static void lm_close(Objective *o) {
    Lm *lm = o->state;
    if (!lm) return;
    dataset_close(&lm->data);
    free(lm->inputs);
    free(lm->targets);
    free(lm->loss_mask);
    free(lm->position_ids);
    free(lm);
}

static long lm_fill(Objective *o, const MicroBatch *mb) {
    Lm *lm = o->state;
    int64_t w = lm->window;
    lm->nb = micro_samples(mb);
    for (int b = 0; b < lm->nb; b++)
        dataset_window(&lm->data, mb->ids[b * mb->stride], w, lm->stride, lm->inputs + b * w,
                       lm->targets + b * w, lm->sft ? lm->loss_mask + b * w : NULL,
                       lm->sft ? lm->position_ids + b * w : NULL);
    return (long)lm->nb * (long)w;
}

// Every window has window_size tokens: the micro-batch's count needs no filling.
static int lm_stage(Objective *o, MicroBatch *mb, bool last_stage, long *tokens, Err *err) {
    (void)last_stage, (void)err;
    mb->counted = 0;
    *tokens = (long)mb->nb * (long)((Lm *)o->state)->window;
    return 0;
}

static int lm_forward(Objective *o, Model *m, int k, PassKind pass, float weight, Err *err) {
    (void)k, (void)pass, (void)weight;
    Lm *lm = o->state;
    return model_forward_accumulate(m, lm->inputs, lm->targets, lm->sft ? lm->loss_mask : NULL,
                                    lm->sft ? lm->position_ids : NULL, lm->nb, (int)lm->window,
                                    lm->label_smoothing, err);
}

static void lm_backward(Objective *o, Model *m, int k, float weight) {
    (void)o, (void)k;
    model_backward(m, weight);
}

const ObjectiveOps OBJECTIVE_LM = {.open = lm_open,
                                   .close = lm_close,
                                   .fill = lm_fill,
                                   .stage = lm_stage,
                                   .forward = lm_forward,
                                   .backward = lm_backward};
