// dtype.h: the element types of every folder, and their names in each file format: backend
// buffers (engine/: weights and activations in the compute dtype, fp32 or bf16; gradients,
// master weights, optimizer state and per-row statistics always fp32), the tensors of
// safetensors files (ckpt/) and the arrays of dataset shards (data/, numpy's names).
#pragma once
#include <stddef.h>
#include <string.h>

typedef enum { DT_F32, DT_BF16, DT_F16, DT_I64, DT_I32, DT_I16, DT_I8, DT_U8, DT_BOOL, DT_N } DType;

typedef struct {
    const char *name;        // in messages and flags: "fp32", "bf16", ...
    const char *safetensors; // a safetensors header's "dtype"
    const char *numpy;       // a shard's meta.json "dtype" (numpy's dtype names)
    unsigned char size;      // bytes of one element
    unsigned char is_int, is_signed;
} DTypeInfo;

static inline const DTypeInfo *dtype_info(DType t) {
    static const DTypeInfo INFO[DT_N] = {
        [DT_F32] = {"fp32", "F32", "float32", 4, 0, 1},
        [DT_BF16] = {"bf16", "BF16", "bfloat16", 2, 0, 1},
        [DT_F16] = {"fp16", "F16", "float16", 2, 0, 1},
        [DT_I64] = {"int64", "I64", "int64", 8, 1, 1},
        [DT_I32] = {"int32", "I32", "int32", 4, 1, 1},
        [DT_I16] = {"int16", "I16", "int16", 2, 1, 1},
        [DT_I8] = {"int8", "I8", "int8", 1, 1, 1},
        [DT_U8] = {"uint8", "U8", "uint8", 1, 1, 0},
        [DT_BOOL] = {"bool", "BOOL", "bool", 1, 1, 0},
    };
    return &INFO[t];
}

static inline size_t dtype_size(DType t) {
    return dtype_info(t)->size;
}

static inline const char *dtype_name(DType t) {
    return dtype_info(t)->name;
}

// The dtype whose safetensors (numpy = 0) or numpy (numpy = 1) name is `name`; -1 when none.
static inline int dtype_from_name(const char *name, int numpy, DType *out) {
    for (int t = 0; t < DT_N; t++) {
        const DTypeInfo *i = dtype_info((DType)t);
        if (!strcmp(numpy ? i->numpy : i->safetensors, name)) {
            *out = (DType)t;
            return 0;
        }
    }
    return -1;
}
