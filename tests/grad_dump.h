// grad_dump.h: writes what a test program computed, plus `grad.<param>` for every parameter of
// the model, into one safetensors file for the PyTorch reference tests (model_dump, pref_dump).
#pragma once
#include <stdio.h>
#include <stdlib.h>

#include "ckpt/safetensors.h"
#include "engine/model.h"

static int dump_with_grads(const Model *m, const char *path, const StWriteTensor *extra,
                           int n_extra, Err *err) {
    int n = m->n_params + n_extra;
    StWriteTensor *w = calloc((size_t)n, sizeof *w);
    char(*names)[128] = calloc((size_t)m->n_params, sizeof *names);
    if (!w || !names) return free(w), free(names), err_set(err, "out of memory");
    for (int i = 0; i < n_extra; i++)
        w[i] = extra[i];
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        snprintf(names[i], sizeof names[i], "grad.%s", p->name);
        w[n_extra + i] = (StWriteTensor){.name = names[i],
                                         .ndim = p->ndim,
                                         .data = m->grads + p->offset,
                                         .fetch = m->be->download};
        w[n_extra + i].shape[0] = p->shape[0], w[n_extra + i].shape[1] = p->shape[1];
    }
    int rc = st_write(path, w, n, DT_F32, err);
    free(w);
    free(names);
    return rc;
}
