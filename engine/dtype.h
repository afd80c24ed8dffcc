// dtype.h: the element types of backend buffers.
//
// Weights and activations are in the backend's compute dtype (fp32 on the CPU; bf16 by
// default on the GPU, fp32 with --dtype fp32); gradients, fp32 master weights, optimizer
// state and per-row statistics (rstd, logsumexp, losses) are always fp32.
#pragma once
#include <stddef.h>

typedef enum { DT_F32, DT_BF16 } DType;

static inline size_t dtype_size(DType t) {
    return t == DT_BF16 ? 2 : 4;
}

static inline const char *dtype_name(DType t) {
    return t == DT_BF16 ? "bf16" : "fp32";
}
