// ckpt_calls_up.c: a unit that claims ckpt's layer (it links only what ckpt declares: model,
// common) and calls up into the engine and train layers. Its layer check must not link
// (tests/test_layering.py); it is built only by that test.
#include "engine/param_table.h"
#include "train/pp_schedule.h"

int ckpt_calls_up(void);

int ckpt_calls_up(void) {
    ParamSpec p = {.ndim = 2};
    return optim_muon_owns(&p) + pp_schedule_peak_held(NULL, 0);
}
