// grad_scaler.h: loss scaling (--loss_scale, docs/design.md §15), PyTorch GradScaler's rule.
//
// fp16's narrow range underflows small gradients: the loss is multiplied by S before backward
// (the backward seed), the gradients are divided by S before clipping, and a step whose
// gradients hold inf or NaN on any rank (the agreed global norm is not finite) is skipped on
// every rank. Dynamic S: an overflow halves it and restarts the count; growth_interval steps in
// a row without one double it. A fixed S never changes. A scale that falls below
// GRAD_SCALER_FLOOR means the numbers are not finite even unscaled: the run fails there.
#pragma once
#include <stdbool.h>

#include "common/error.h"
#include "proto/train_spec.h"

#define GRAD_SCALER_FLOOR 1.0

typedef struct {
    int mode;             // LOSS_SCALE_NONE, LOSS_SCALE_DYNAMIC, LOSS_SCALE_FIXED
    double scale;         // S (1 without scaling)
    long growth_tracker;  // steps in a row without an overflow since S last changed
    long growth_interval; // --loss_scale_growth_interval
} GradScaler;

// From the spec's --loss_scale, --init_loss_scale and --loss_scale_growth_interval.
int grad_scaler_init(GradScaler *g, const TrainSpec *s, Err *err);
bool grad_scaler_on(const GradScaler *g);
// After a step's agreement: applies the rule for a step that overflowed or not (no-op without
// scaling). Returns false (with err naming step and scale) when S fell below the floor.
bool grad_scaler_update(GradScaler *g, bool overflow, long step, Err *err);
