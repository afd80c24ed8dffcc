// pp_schedule.h: the order of work of one pipeline stage (issue 19; the pipeline section, §13, of
// the design): which micro-batch it forwards, backwards, sends and receives, and when. The
// schedule is pure data, built ahead of a step, so the pipeline runner only walks the list and
// the test can check every rank's order, and the absence of deadlock, without a device.
//
// P stages, M micro-batches (the grad_accum_steps of an optimizer step), stage s in [0, P).
// - 1F1B (Megatron-LM's non-interleaved schedule): P-s-1 warm-up forwards, then one forward and
//   one backward alternately, then the remaining backwards; a stage holds the activations of at
//   most min(P-s, M) micro-batches.
// - GPipe: all M forwards, then all M backwards; a stage holds all M.
// Both run the backwards in micro-batch order, so the gradients are the same bits.
#pragma once
#include <stdbool.h>

typedef enum { PP_1F1B, PP_GPIPE } PpScheduleKind;
typedef enum {
    PP_FORWARD,   // forward of micro-batch `micro` on this stage
    PP_BACKWARD,  // backward of micro-batch `micro`
    PP_RECV_ACT,  // receive micro's input activation from stage-1
    PP_SEND_ACT,  // send micro's output activation to stage+1
    PP_RECV_GRAD, // receive the gradient of micro's output from stage+1
    PP_SEND_GRAD, // send the gradient of micro's input to stage-1
} PpOpKind;
typedef struct {
    PpOpKind kind;
    int micro;
} PpOp;

// Capacity of an op list for M micro-batches (every kind at most once per micro-batch).
#define PP_MAX_OPS(M) (6 * (M))
// The ops of stage `stage` of `stages` over `micro` micro-batches, in execution order; returns
// their number (-1 for an unknown kind, stages < 1, a stage outside [0, stages) or micro < 1).
// Rules the runner relies on:
//  - the first stage has no RECV_ACT/SEND_GRAD, the last no SEND_ACT/RECV_GRAD; one stage: F0 B0 F1
//  B1 ...
//  - backwards run in micro-batch order 0..M-1 in both schedules (so gradients accumulate in the
//    same order as without a pipeline: the same bits);
//  - consecutive transfers (ops between two computations) form one group, issued together;
//  - 1F1B follows Megatron-LM's non-interleaved schedule: w = min(P-s-1, M) warm-up forwards
//    (RECV_ACT i, FORWARD i, SEND_ACT i), then for each of the M-w steady micro-batches: RECV_ACT,
//    FORWARD, {SEND_ACT i, RECV_GRAD j} together, BACKWARD j, {SEND_GRAD j, RECV_ACT i+1}
//    together, then the w cool-down backwards (RECV_GRAD, BACKWARD, SEND_GRAD).
//    (The steady RECV_ACT of micro-batch i > w is the one issued with SEND_GRAD of the step
//    before; each micro-batch is received once.)
int pp_schedule_build(PpScheduleKind kind, int stage, int stages, int micro, PpOp *ops);
// A forward-only pass (validation, a frozen reference model): RECV_ACT, FORWARD, SEND_ACT per
// micro-batch; -1 for arguments pp_schedule_build refuses.
int pp_schedule_forward_only(int stage, int stages, int micro, PpOp *ops);
// The most micro-batches whose activations are held at once (forwarded, not yet backwarded).
int pp_schedule_peak_held(const PpOp *ops, int n);
// Whether an op is a transfer (else a computation).
bool pp_is_transfer(PpOpKind kind);

// On GPUs a group of transfers runs on the comm stream while the host goes on; wait[i] says
// whether computation ops[i] must first wait (on the device) for every transfer started so far:
// when one of those since the last wait receives (what it may read), or sends from the
// activation set it uses (micro-batch k uses set k % sets; what it may overwrite). A send from
// another set goes on beside it. Entries of transfers are false.
void pp_schedule_waits(const PpOp *ops, int n, int sets, bool *wait);

// The idle share of a step in theory, (P-1)/(M+P-1).
double pp_bubble_fraction(int stages, int micro);
