// lowp.c: the bf16 and fp16 CPU backends (engine/backend.h, backend_cpu_dtype): the fp32
// table's memory ops (byte copies) and dtype-free ops, and every op on compute-dtype tensors
// staged through fp32 (lowp.h): fp32 math and accumulation, each output rounded once.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/lowp.h"

// ---------------------------------------------------------------- conversions

// Elements one task converts: large views spread over the threads, small ones stay on one.
enum { CONVERT_BLOCK = 1 << 14 };

static void run_to_f32(DType dtype, float *dst, const uint16_t *src, size_t n) {
    if (dtype == DT_BF16) {
#pragma omp simd
        for (size_t i = 0; i < n; i++)
            dst[i] = bf16_to_f32(src[i]);
    } else {
        for (size_t i = 0; i < n; i++)
            dst[i] = f16_to_f32(src[i]);
    }
}

static void run_from_f32(DType dtype, uint16_t *dst, const float *src, size_t n) {
    if (dtype == DT_BF16) {
#pragma omp simd
        for (size_t i = 0; i < n; i++)
            dst[i] = f32_to_bf16(src[i]);
    } else {
        for (size_t i = 0; i < n; i++)
            dst[i] = f32_to_f16(src[i]);
    }
}

// The view v of src, converted into the same elements of dst: to fp32 (to_f32) or from it.
static void convert_view(DType dtype, int to_f32, void *dst, const void *src, LowpView v) {
    size_t per_row = (v.width + CONVERT_BLOCK - 1) / CONVERT_BLOCK, tasks = v.rows * per_row;
#pragma omp parallel for if (tasks > 1)
    for (size_t t = 0; t < tasks; t++) {
        size_t c0 = t % per_row * CONVERT_BLOCK, at = t / per_row * v.stride + c0;
        size_t n = v.width - c0 < CONVERT_BLOCK ? v.width - c0 : CONVERT_BLOCK;
        if (to_f32)
            run_to_f32(dtype, (float *)dst + at, (const uint16_t *)src + at, n);
        else
            run_from_f32(dtype, (uint16_t *)dst + at, (const float *)src + at, n);
    }
}

void lowp_to_f32(DType dtype, float *dst, const void *src, size_t n) {
    convert_view(dtype, 1, dst, src, lowp_flat(n));
}

void lowp_from_f32(DType dtype, void *dst, const float *src, size_t n) {
    convert_view(dtype, 0, dst, src, lowp_flat(n));
}

// ---------------------------------------------------------------- staging

// The most tensors one op stages (attention backward: dout, out, q, k, v, dq, dk, dv).
enum { SLOTS = 8 };

// This thread's scratch: an op runs on the thread that called it (one per rank), so buffers
// of other threads are never touched; each keeps the largest size asked of it.
static _Thread_local struct {
    float *at;
    size_t floats;
} slots[SLOTS];

static float *take_slot(LowpStage *s, LowpView v) {
    size_t floats = v.rows ? (v.rows - 1) * v.stride + v.width : 0;
    if (s->failed) return NULL;
    if (s->used == SLOTS) { // a bug of this file: every op stages a fixed number
        first_failure_record(&cpu_failures, "cpu %s backend: %s staged more than %d tensors",
                             dtype_name(s->dtype), s->op, SLOTS);
        s->failed = 1;
        return NULL;
    }
    int i = s->used++;
    if (floats > slots[i].floats) {
        size_t bytes = (floats * sizeof(float) + 63) / 64 * 64; // 64-byte aligned, as cpu_alloc
        float *at = aligned_alloc(64, bytes);
        if (!at) { // nothing to compute with: the backend's failure (engine/backend.h)
            first_failure_record(&cpu_failures,
                                 "cpu %s backend: %s: out of memory for %.1f MiB of fp32 scratch",
                                 dtype_name(s->dtype), s->op, (double)bytes / (1 << 20));
            s->failed = 1;
            return NULL;
        }
        free(slots[i].at);
        slots[i].at = at;
        slots[i].floats = floats;
    }
    return slots[i].at;
}

const float *lowp_in(LowpStage *s, const void *src, LowpView v) {
    float *at = take_slot(s, v);
    if (at) convert_view(s->dtype, 1, at, src, v);
    return at;
}

float *lowp_out(LowpStage *s, const void *dst, LowpView v, int load) {
    float *at = take_slot(s, v);
    if (at && load) convert_view(s->dtype, 1, at, dst, v);
    return at;
}

void lowp_store(const LowpStage *s, void *dst, const float *src, LowpView v) {
    if (!s->failed) convert_view(s->dtype, 0, dst, src, v);
}

// ---------------------------------------------------------------- the tables

#define LOWP_DT DT_BF16
#define LOWP_FN(op) bf16_##op
#include "engine/cpu/lowp_table.h"
#undef LOWP_DT
#undef LOWP_FN

#define LOWP_DT DT_F16
#define LOWP_FN(op) f16_##op
#include "engine/cpu/lowp_table.h"
#undef LOWP_DT
#undef LOWP_FN

static Backend tables[2]; // bf16, fp16
static pthread_once_t tables_filled = PTHREAD_ONCE_INIT;

// Each starts as the fp32 table (memory, dtype-free ops) and replaces the dtype's ops.
static void fill_tables(void) {
    tables[0] = tables[1] = *backend_cpu();
    bf16_fill(&tables[0]);
    f16_fill(&tables[1]);
}

const Backend *backend_cpu_dtype(DType dtype) {
    if (dtype == DT_F32) return backend_cpu();
    if (dtype != DT_BF16 && dtype != DT_F16) return NULL;
    pthread_once(&tables_filled, fill_tables);
    return &tables[dtype == DT_F16];
}
