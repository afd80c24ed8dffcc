// test_pp_schedule.c: the pipeline schedules (train/pp_schedule.c) as a unit (issue 19):
// hand-written reference orders compared op by op; for P = 1..4 and M = 1..8, both kinds and
// the forward-only pass, every stage's order rules; no deadlock, by simulating all P stages with
// rendezvous transfers; the k-th send and the k-th receive of every link naming the same
// micro-batch; the peak of held activations; the simulated bubble against pp_bubble_fraction;
// the device waits of pp_schedule_waits (no read before its receive, no write of a set being
// sent, and sends that do overlap computations).
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "train/pp_schedule.h"

#define MAX_P 4
#define MAX_M 8
#define MAX_OPS PP_MAX_OPS(MAX_M)
#define FORWARD_ONLY 2 // a third "kind" of this test: pp_schedule_forward_only

// All P stages' op lists of one schedule.
typedef struct {
    int stages, micro;
    PpOp ops[MAX_P][MAX_OPS];
    int n[MAX_P];
} Pipe;

static void build_pipe(Pipe *p, int kind, int stages, int micro) {
    p->stages = stages;
    p->micro = micro;
    for (int s = 0; s < stages; s++)
        p->n[s] = kind == FORWARD_ONLY ? pp_schedule_forward_only(s, stages, micro, p->ops[s])
                                       : pp_schedule_build(kind, s, stages, micro, p->ops[s]);
}

static const char *kind_name(int kind) {
    return kind == PP_1F1B ? "1f1b" : kind == PP_GPIPE ? "gpipe" : "forward-only";
}

// ---------------------------------------------------------------- ops as text

// "F3" forward, "B3" backward, "ra3"/"sa3" receive/send activation, "rg3"/"sg3" gradient.
static const char *op_code(PpOpKind kind) {
    static const char *codes[] = {"F", "B", "ra", "sa", "rg", "sg"};
    return codes[kind];
}

static void ops_text(const PpOp *ops, int n, char *buf, size_t cap) {
    size_t len = 0;
    buf[0] = '\0';
    for (int k = 0; k < n && len < cap; k++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%s%d", k ? " " : "", op_code(ops[k].kind),
                                ops[k].micro);
}

static void check_order(int kind, int stage, int stages, int micro, const char *want) {
    PpOp ops[MAX_OPS];
    char got[1024];
    int n = kind == FORWARD_ONLY ? pp_schedule_forward_only(stage, stages, micro, ops)
                                 : pp_schedule_build(kind, stage, stages, micro, ops);
    ops_text(ops, n, got, sizeof got);
    CHECK_MSG(!strcmp(got, want), "%s P=%d M=%d stage %d:\n  got  %s\n  want %s", kind_name(kind),
              stages, micro, stage, got, want);
}

// ---------------------------------------------------------------- reference orders

static void test_reference_orders(void) {
    // P=2 M=4 1f1b: stage 0 warms up with one forward, the last stage none.
    check_order(PP_1F1B, 0, 2, 4, "F0 sa0 F1 sa1 rg0 B0 F2 sa2 rg1 B1 F3 sa3 rg2 B2 rg3 B3");
    check_order(PP_1F1B, 1, 2, 4, "ra0 F0 B0 sg0 ra1 F1 B1 sg1 ra2 F2 B2 sg2 ra3 F3 B3 sg3");
    // P=3 M=2 1f1b: stage 0's two warm-up forwards are all of them; no steady step.
    check_order(PP_1F1B, 0, 3, 2, "F0 sa0 F1 sa1 rg0 B0 rg1 B1");
    check_order(PP_1F1B, 1, 3, 2, "ra0 F0 sa0 ra1 F1 sa1 rg0 B0 sg0 rg1 B1 sg1");
    check_order(PP_1F1B, 2, 3, 2, "ra0 F0 B0 sg0 ra1 F1 B1 sg1");
    // P=3 M=1 1f1b: stage 0's P-s-1 = 2 warm-up forwards clamped to M = 1.
    check_order(PP_1F1B, 0, 3, 1, "F0 sa0 rg0 B0");
    check_order(PP_1F1B, 1, 3, 1, "ra0 F0 sa0 rg0 B0 sg0");
    check_order(PP_1F1B, 2, 3, 1, "ra0 F0 B0 sg0");
    // P=4 M=8 1f1b stage 1: 2 warm-up forwards, 6 steady steps, 2 cool-down backwards.
    check_order(PP_1F1B, 1, 4, 8,
                "ra0 F0 sa0 ra1 F1 sa1 "
                "ra2 F2 sa2 rg0 B0 sg0 ra3 F3 sa3 rg1 B1 sg1 ra4 F4 sa4 rg2 B2 sg2 "
                "ra5 F5 sa5 rg3 B3 sg3 ra6 F6 sa6 rg4 B4 sg4 ra7 F7 sa7 rg5 B5 sg5 "
                "rg6 B6 sg6 rg7 B7 sg7");
    // P=2 M=3 gpipe: all forwards, then the backwards in micro-batch order.
    check_order(PP_GPIPE, 0, 2, 3, "F0 sa0 F1 sa1 F2 sa2 rg0 B0 rg1 B1 rg2 B2");
    check_order(PP_GPIPE, 1, 2, 3, "ra0 F0 ra1 F1 ra2 F2 B0 sg0 B1 sg1 B2 sg2");
    // One stage: no transfers.
    check_order(PP_1F1B, 0, 1, 3, "F0 B0 F1 B1 F2 B2");
    check_order(PP_GPIPE, 0, 1, 3, "F0 F1 F2 B0 B1 B2");
    // Forward only.
    check_order(FORWARD_ONLY, 0, 3, 2, "F0 sa0 F1 sa1");
    check_order(FORWARD_ONLY, 1, 3, 2, "ra0 F0 sa0 ra1 F1 sa1");
    check_order(FORWARD_ONLY, 2, 3, 2, "ra0 F0 ra1 F1");
}

// ---------------------------------------------------------------- order rules of one stage

// Where each kind of op of each micro-batch sits in a stage's list (-1: absent).
typedef struct {
    int at[6][MAX_M];
    int twice; // some kind appears more than once for a micro-batch
} Positions;

static int positions(const PpOp *ops, int n, int micro, Positions *q) {
    memset(q->at, -1, sizeof q->at);
    q->twice = 0;
    for (int k = 0; k < n; k++) {
        if (ops[k].micro < 0 || ops[k].micro >= micro) return -1;
        int *at = &q->at[ops[k].kind][ops[k].micro];
        if (*at >= 0) q->twice = 1;
        *at = k;
    }
    return 0;
}

// A transfer of the first (last) stage must be absent; of any other stage present and on the
// right side of its computation.
static void check_transfer(int edge, int transfer, int comp, int before, const char *what,
                           const char *ctx, int i) {
    if (edge)
        CHECK_MSG(transfer < 0, "%s: %s%d on an edge stage", ctx, what, i);
    else
        CHECK_MSG(transfer >= 0 && comp >= 0 && (before ? transfer < comp : transfer > comp),
                  "%s: %s%d at %d, its computation at %d", ctx, what, i, transfer, comp);
}

static void check_rules(int kind, int stage, const Pipe *p) {
    const PpOp *ops = p->ops[stage];
    int n = p->n[stage], m = p->micro, first = stage == 0, last = stage == p->stages - 1;
    char ctx[64];
    snprintf(ctx, sizeof ctx, "%s P=%d M=%d stage %d", kind_name(kind), p->stages, m, stage);
    Positions q;
    CHECK_MSG(n > 0 && n <= PP_MAX_OPS(m), "%s: %d ops", ctx, n);
    if (n <= 0) return;
    if (positions(ops, n, m, &q)) {
        CHECK_MSG(0, "%s: a micro-batch outside 0..%d", ctx, m - 1);
        return;
    }
    CHECK_MSG(!q.twice, "%s: an op twice for one micro-batch", ctx);
    int(*at)[MAX_M] = q.at;
    for (int i = 0; i < m; i++) {
        CHECK_MSG(at[PP_FORWARD][i] >= 0, "%s: F%d missing", ctx, i);
        check_transfer(first, at[PP_RECV_ACT][i], at[PP_FORWARD][i], 1, "ra", ctx, i);
        check_transfer(last, at[PP_SEND_ACT][i], at[PP_FORWARD][i], 0, "sa", ctx, i);
        if (kind == FORWARD_ONLY) {
            CHECK_MSG(at[PP_BACKWARD][i] < 0 && at[PP_RECV_GRAD][i] < 0 && at[PP_SEND_GRAD][i] < 0,
                      "%s: a backward op of micro-batch %d", ctx, i);
            continue;
        }
        CHECK_MSG(at[PP_BACKWARD][i] > at[PP_FORWARD][i], "%s: B%d before F%d", ctx, i, i);
        CHECK_MSG(i == 0 || at[PP_BACKWARD][i] > at[PP_BACKWARD][i - 1], "%s: B%d before B%d", ctx,
                  i, i - 1);
        check_transfer(last, at[PP_RECV_GRAD][i], at[PP_BACKWARD][i], 1, "rg", ctx, i);
        check_transfer(first, at[PP_SEND_GRAD][i], at[PP_BACKWARD][i], 0, "sg", ctx, i);
    }
}

// The micro-batches of a stage's ops of one kind, in order.
static int micros_of(const Pipe *p, int stage, PpOpKind kind, int *out) {
    int c = 0;
    for (int k = 0; k < p->n[stage]; k++)
        if (p->ops[stage][k].kind == kind) out[c++] = p->ops[stage][k].micro;
    return c;
}

// Transfers match by order on a link (as NCCL's do): the k-th send and the k-th receive of a
// directed link must carry the same micro-batch.
static void check_link(const Pipe *p, int from, PpOpKind send, int to, PpOpKind recv,
                       const char *ctx) {
    int a[MAX_OPS], b[MAX_OPS];
    int na = micros_of(p, from, send, a), nb = micros_of(p, to, recv, b);
    CHECK_MSG(na == nb, "%s: %d %s on stage %d, %d %s on stage %d", ctx, na, op_code(send), from,
              nb, op_code(recv), to);
    for (int k = 0; k < na && k < nb; k++)
        CHECK_MSG(a[k] == b[k], "%s: link %d->%d transfer %d: %s%d vs %s%d", ctx, from, to, k,
                  op_code(send), a[k], op_code(recv), b[k]);
}

static void check_links(int kind, const Pipe *p) {
    char ctx[64];
    snprintf(ctx, sizeof ctx, "%s P=%d M=%d", kind_name(kind), p->stages, p->micro);
    for (int s = 0; s + 1 < p->stages; s++) {
        check_link(p, s, PP_SEND_ACT, s + 1, PP_RECV_ACT, ctx);
        check_link(p, s + 1, PP_SEND_GRAD, s, PP_RECV_GRAD, ctx);
    }
}

// ---------------------------------------------------------------- simulation of all stages

// The strictest semantics a runner may meet (NCCL's grouped p2p, no buffering): a stage issues
// the transfers between two computations as one group and waits until every one of them has
// met its counterpart, the same-numbered opposite transfer of that link, posted in the peer's
// current group at the same time; a transfer that met its counterpart stays done while the
// rest of its group waits. A computation always completes. Time: a computation takes its cost,
// a transfer none, but it happens no earlier than both groups were issued.
typedef struct {
    int pos;     // next op
    long clock;  // this stage's time
    long posted; // when the current group was issued
    int done[MAX_OPS];
    int seq[MAX_OPS]; // the k-th transfer of its kind on this stage
    long at[MAX_OPS]; // when a transfer met its counterpart
} SimStage;

static int is_transfer(PpOpKind kind) {
    return pp_is_transfer(kind);
}

static int peer_of(PpOpKind kind, int stage) {
    return kind == PP_RECV_ACT || kind == PP_SEND_GRAD ? stage - 1 : stage + 1;
}

static PpOpKind counterpart(PpOpKind kind) {
    static const PpOpKind other[] = {PP_FORWARD,  PP_BACKWARD,  PP_SEND_ACT,
                                     PP_RECV_ACT, PP_SEND_GRAD, PP_RECV_GRAD};
    return other[kind];
}

// The end of the group at pos: the next computation, or the end of the list.
static int group_end(const Pipe *p, int s, int pos) {
    while (pos < p->n[s] && is_transfer(p->ops[s][pos].kind))
        pos++;
    return pos;
}

static int at_group(const Pipe *p, const SimStage *st, int s) {
    return st[s].pos < p->n[s] && is_transfer(p->ops[s][st[s].pos].kind);
}

// Meets every transfer of stage s's current group whose counterpart is in the peer's current
// group; returns how many met.
static int meet(const Pipe *p, SimStage *st, int s) {
    int met = 0;
    if (!at_group(p, st, s)) return 0;
    for (int k = st[s].pos; k < group_end(p, s, st[s].pos); k++) {
        PpOpKind kind = p->ops[s][k].kind;
        int r = peer_of(kind, s);
        if (st[s].done[k] || r < 0 || r >= p->stages || !at_group(p, st, r)) continue;
        for (int q = st[r].pos; q < group_end(p, r, st[r].pos); q++) {
            if (st[r].done[q] || p->ops[r][q].kind != counterpart(kind) ||
                st[r].seq[q] != st[s].seq[k])
                continue;
            long t = st[s].posted > st[r].posted ? st[s].posted : st[r].posted;
            st[s].done[k] = st[r].done[q] = 1;
            st[s].at[k] = st[r].at[q] = t;
            met++;
            break;
        }
    }
    return met;
}

// One step of stage s: a computation, or leaving a group all of whose transfers met; returns
// whether it moved.
static int advance(const Pipe *p, SimStage *st, int s, long fwd, long bwd) {
    SimStage *x = &st[s];
    if (x->pos >= p->n[s]) return 0;
    PpOpKind kind = p->ops[s][x->pos].kind;
    if (!is_transfer(kind)) {
        x->clock += kind == PP_FORWARD ? fwd : bwd;
        x->pos++;
    } else {
        int end = group_end(p, s, x->pos);
        for (int k = x->pos; k < end; k++) {
            if (!x->done[k]) return 0;
            if (x->at[k] > x->clock) x->clock = x->at[k];
        }
        x->pos = end;
    }
    if (at_group(p, st, s)) x->posted = x->clock;
    return 1;
}

static void sim_init(const Pipe *p, SimStage *st) {
    memset(st, 0, sizeof(SimStage) * (size_t)p->stages);
    for (int s = 0; s < p->stages; s++) {
        int count[6] = {0};
        for (int k = 0; k < p->n[s]; k++)
            st[s].seq[k] = count[p->ops[s][k].kind]++;
    }
}

static void print_stuck(const Pipe *p, const SimStage *st) {
    for (int s = 0; s < p->stages; s++) {
        char text[256];
        int pos = st[s].pos, end = group_end(p, s, pos);
        ops_text(p->ops[s] + pos, end - pos, text, sizeof text);
        fprintf(stderr, "  stage %d stuck at op %d of %d: {%s}\n", s, pos, p->n[s],
                pos < p->n[s] ? text : "done");
    }
}

// Runs all stages in rounds until all are done; returns the makespan, or -1 on a deadlock (a
// round where nobody moves before all are done), printing where each stage is stuck.
static long simulate(const Pipe *p, long fwd, long bwd) {
    SimStage st[MAX_P];
    sim_init(p, st);
    for (;;) {
        int moved = 0, left = 0;
        for (int s = 0; s < p->stages; s++)
            moved += meet(p, st, s);
        for (int s = 0; s < p->stages; s++)
            moved += advance(p, st, s, fwd, bwd);
        for (int s = 0; s < p->stages; s++)
            left += st[s].pos < p->n[s];
        if (!left) break;
        if (!moved) {
            print_stuck(p, st);
            return -1;
        }
    }
    long span = 0;
    for (int s = 0; s < p->stages; s++)
        if (st[s].clock > span) span = st[s].clock;
    return span;
}

// ---------------------------------------------------------------- every P, M, kind

// With unit costs every stage is busy M (fwd + bwd) of a makespan of (M+P-1)(fwd + bwd) in
// theory: the idle share (P-1)/(M+P-1) of pp_bubble_fraction. Checked for backward = forward
// and backward = 2 forward (the usual ratio).
static void check_bubble(int kind, const Pipe *p) {
    static const long costs[][2] = {{1, 1}, {1, 2}};
    for (int c = 0; c < 2; c++) {
        long fwd = costs[c][0], bwd = costs[c][1], span = simulate(p, fwd, bwd);
        double idle = (double)(span - p->micro * (fwd + bwd)) / (double)span;
        CHECK_MSG(span > 0 && idle == pp_bubble_fraction(p->stages, p->micro),
                  "%s P=%d M=%d F=%ld B=%ld: makespan %ld, idle %.6f, want %.6f", kind_name(kind),
                  p->stages, p->micro, fwd, bwd, span, idle,
                  pp_bubble_fraction(p->stages, p->micro));
    }
}

static void check_peak(int kind, const Pipe *p) {
    for (int s = 0; s < p->stages; s++) {
        int peak = pp_schedule_peak_held(p->ops[s], p->n[s]);
        int bound = p->stages - s < p->micro ? p->stages - s : p->micro;
        int want = kind == PP_1F1B ? bound : p->micro; // forward only: never released
        CHECK_MSG(peak == want, "%s P=%d M=%d stage %d: peak held %d, want %d", kind_name(kind),
                  p->stages, p->micro, s, peak, want);
    }
}

// The device's view of pp_schedule_waits (transfers run beside the compute until a computation
// waits for them): no computation reads its input activation or output gradient before the
// receive finished, none uses an activation set still being sent from. Returns how many
// computations ran beside a send (the overlap the waits allow).
static int check_waits(int kind, int stage, const Pipe *p) {
    const PpOp *ops = p->ops[stage];
    int n = p->n[stage], sets = kind == FORWARD_ONLY ? 1 : pp_schedule_peak_held(ops, n);
    bool wait[MAX_OPS];
    pp_schedule_waits(ops, n, sets, wait);
    int pending[MAX_OPS], n_pending = 0, beside = 0;
    for (int i = 0; i < n; i++) {
        if (is_transfer(ops[i].kind)) {
            CHECK(!wait[i]);
            pending[n_pending++] = i;
            continue;
        }
        if (wait[i]) n_pending = 0;
        PpOpKind needs = ops[i].kind == PP_FORWARD ? PP_RECV_ACT : PP_RECV_GRAD;
        for (int k = 0; k < n_pending; k++) {
            const PpOp *t = &ops[pending[k]];
            bool send = t->kind == PP_SEND_ACT || t->kind == PP_SEND_GRAD;
            CHECK_MSG(!(t->kind == needs && t->micro == ops[i].micro),
                      "%s P=%d M=%d stage %d op %d: reads micro-batch %d before its receive",
                      kind_name(kind), p->stages, p->micro, stage, i, ops[i].micro);
            CHECK_MSG(!(send && t->micro % sets == ops[i].micro % sets),
                      "%s P=%d M=%d stage %d op %d: writes set %d while it is being sent",
                      kind_name(kind), p->stages, p->micro, stage, i, ops[i].micro % sets);
            beside += send;
        }
    }
    return beside;
}

static void test_all_schedules(void) {
    static Pipe p;
    for (int kind = PP_1F1B; kind <= FORWARD_ONLY; kind++)
        for (int stages = 1; stages <= MAX_P; stages++)
            for (int micro = 1; micro <= MAX_M; micro++) {
                build_pipe(&p, kind, stages, micro);
                int beside = 0;
                for (int s = 0; s < stages; s++) {
                    check_rules(kind, s, &p);
                    beside += check_waits(kind, s, &p);
                }
                // 1F1B's first stage forwards micro-batch 1 while micro-batch 0 is being sent.
                if (kind == PP_1F1B && stages > 1 && micro > 1)
                    CHECK_MSG(beside > 0, "1f1b P=%d M=%d: no computation beside a send", stages,
                              micro);
                check_links(kind, &p);
                check_peak(kind, &p);
                if (kind == FORWARD_ONLY)
                    CHECK_MSG(simulate(&p, 1, 1) == micro + stages - 1,
                              "forward-only P=%d M=%d deadlocks or stalls", stages, micro);
                else
                    check_bubble(kind, &p);
            }
}

// ---------------------------------------------------------------- small functions

static void test_refusals_and_names(void) {
    PpOp ops[MAX_OPS];
    CHECK(pp_schedule_build(PP_1F1B, 2, 2, 4, ops) == -1);
    CHECK(pp_schedule_build(PP_GPIPE, -1, 2, 4, ops) == -1);
    CHECK(pp_schedule_build(PP_1F1B, 0, 2, 0, ops) == -1);
    CHECK(pp_schedule_build(PP_1F1B, 0, 0, 4, ops) == -1);
    CHECK(pp_schedule_build((PpScheduleKind)7, 0, 2, 4, ops) == -1);
    CHECK(pp_schedule_forward_only(3, 3, 2, ops) == -1);
    CHECK(pp_bubble_fraction(1, 8) == 0.0);
    CHECK(pp_bubble_fraction(4, 8) == 3.0 / 11.0);
}

int main(void) {
    test_reference_orders();
    test_all_schedules();
    test_refusals_and_names();
    CHECK_DONE();
}
