// grad_scaler.c: PyTorch GradScaler's update rule (train/grad_scaler.h): backoff 0.5, growth 2.
#include "train/grad_scaler.h"

int grad_scaler_init(GradScaler *g, const TrainSpec *s, Err *err) {
    double fixed = 1.0;
    int mode = train_spec_loss_scale(s, &fixed, err);
    if (mode < 0) return -1;
    *g = (GradScaler){.mode = mode,
                      .scale = mode == LOSS_SCALE_DYNAMIC ? s->init_loss_scale
                               : mode == LOSS_SCALE_FIXED ? fixed
                                                          : 1.0,
                      .growth_interval = s->loss_scale_growth_interval};
    return 0;
}

bool grad_scaler_on(const GradScaler *g) {
    return g->mode != LOSS_SCALE_NONE;
}

bool grad_scaler_update(GradScaler *g, bool overflow, long step, Err *err) {
    if (g->mode != LOSS_SCALE_DYNAMIC) return true;
    if (overflow) {
        g->scale *= 0.5;
        g->growth_tracker = 0;
    } else if (++g->growth_tracker == g->growth_interval) {
        g->scale *= 2.0;
        g->growth_tracker = 0;
    }
    if (g->scale >= GRAD_SCALER_FLOOR) return true;
    err_set(err,
            "step %ld: the gradients are not finite even with the loss scale backed off to %g "
            "(below %g): the run diverged (lower max_lr?)",
            step, g->scale, GRAD_SCALER_FLOOR);
    return false;
}
