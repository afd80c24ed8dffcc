// pp_schedule.c: the 1F1B and GPipe op lists of a pipeline stage (train/pp_schedule.h).
#include "train/pp_schedule.h"

#include <string.h>

// An op list being written for one stage; transfers with no peer (the first stage's from
// stage-1, the last stage's to stage+1) are dropped here, so the schedules below are written
// once for a stage in the middle.
typedef struct {
    PpOp *ops;
    int n;
    int first, last;
} Emit;

static void emit(Emit *e, PpOpKind kind, int micro) {
    if (e->first && (kind == PP_RECV_ACT || kind == PP_SEND_GRAD)) return;
    if (e->last && (kind == PP_SEND_ACT || kind == PP_RECV_GRAD)) return;
    e->ops[e->n++] = (PpOp){kind, micro};
}

static void forward(Emit *e, int i) {
    emit(e, PP_RECV_ACT, i);
    emit(e, PP_FORWARD, i);
    emit(e, PP_SEND_ACT, i);
}

static void backward(Emit *e, int j) {
    emit(e, PP_RECV_GRAD, j);
    emit(e, PP_BACKWARD, j);
    emit(e, PP_SEND_GRAD, j);
}

// Steady step k forwards i = w + k and backwards j = k: the activation of i goes out with the
// request for j's gradient, j's input gradient with the request for i+1's input, so on every
// link the two neighbours issue matching groups (stage s's {SEND_ACT, RECV_GRAD} is stage
// s+1's {SEND_GRAD, RECV_ACT}).
static void one_f_one_b(Emit *e, int stage, int stages, int micro) {
    int w = stages - stage - 1 < micro ? stages - stage - 1 : micro;
    for (int i = 0; i < w; i++)
        forward(e, i);
    if (w < micro) emit(e, PP_RECV_ACT, w);
    for (int k = 0; k < micro - w; k++) {
        int i = w + k;
        emit(e, PP_FORWARD, i);
        emit(e, PP_SEND_ACT, i);
        emit(e, PP_RECV_GRAD, k);
        emit(e, PP_BACKWARD, k);
        emit(e, PP_SEND_GRAD, k);
        if (i + 1 < micro) emit(e, PP_RECV_ACT, i + 1);
    }
    for (int j = micro - w; j < micro; j++)
        backward(e, j);
}

static void gpipe(Emit *e, int micro) {
    for (int i = 0; i < micro; i++)
        forward(e, i);
    for (int j = 0; j < micro; j++)
        backward(e, j);
}

static int valid(int stage, int stages, int micro) {
    return stages >= 1 && stage >= 0 && stage < stages && micro >= 1;
}

int pp_schedule_build(PpScheduleKind kind, int stage, int stages, int micro, PpOp *ops) {
    if (!valid(stage, stages, micro) || (kind != PP_1F1B && kind != PP_GPIPE)) return -1;
    Emit e = {ops, 0, stage == 0, stage == stages - 1};
    if (kind == PP_1F1B)
        one_f_one_b(&e, stage, stages, micro);
    else
        gpipe(&e, micro);
    return e.n;
}

int pp_schedule_forward_only(int stage, int stages, int micro, PpOp *ops) {
    if (!valid(stage, stages, micro)) return -1;
    Emit e = {ops, 0, stage == 0, stage == stages - 1};
    for (int i = 0; i < micro; i++)
        forward(&e, i);
    return e.n;
}

int pp_schedule_peak_held(const PpOp *ops, int n) {
    int held = 0, peak = 0;
    for (int k = 0; k < n; k++) {
        held += (ops[k].kind == PP_FORWARD) - (ops[k].kind == PP_BACKWARD);
        if (held > peak) peak = held;
    }
    return peak;
}

bool pp_is_transfer(PpOpKind kind) {
    return kind != PP_FORWARD && kind != PP_BACKWARD;
}

void pp_schedule_waits(const PpOp *ops, int n, int sets, bool *wait) {
    bool received = false;
    unsigned long long sending = 0; // bit k % 64: set k is being sent from
    for (int i = 0; i < n; i++) {
        int set = ops[i].micro % sets % 64;
        wait[i] = false;
        if (pp_is_transfer(ops[i].kind)) {
            bool send = ops[i].kind == PP_SEND_ACT || ops[i].kind == PP_SEND_GRAD;
            if (send) sending |= 1ull << set;
            received |= !send;
            continue;
        }
        wait[i] = received || (sending >> set & 1);
        if (wait[i]) received = false, sending = 0;
    }
}

double pp_bubble_fraction(int stages, int micro) {
    return (double)(stages - 1) / (double)(micro + stages - 1);
}
