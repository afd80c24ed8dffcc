// shm.c: the `shm` backend: CPU ranks on one host exchange data through one
// POSIX shared-memory segment (no copy through the kernel).
//
// Segment: a header (per-rank slots: state, pid, barrier counter) and a data
// area of two sets of `world` staging slots plus one result slot, of `chunk`
// bytes each. Every step of a collective stages at most one chunk per rank in
// one set, then waits at a barrier; steps alternate between the two sets, so a
// rank may stage step k+1 while a slower peer still reads step k.
//
// All-to-all: a first step stages every rank's send and receive sizes (each rank checks every
// pair, so all fail alike on a mismatch); then each step stages the next chunk of every rank's
// send buffer, its own part cut out, and each rank copies its parts out of the others' slots,
// located from the sizes. Steps follow the longest send buffer, not the largest part.
//
// Liveness: each rank holds an OFD write lock on byte `rank` of the segment.
// The kernel drops it when the process dies (even while it is an unreaped
// zombie, where kill(pid, 0) still succeeds), so "slot attached but lock free"
// means the rank died (a child forked without exec keeps the lock alive: then
// only the deadline catches it). Waits poll that, a group-wide abort word and the
// deadline every few milliseconds, and sleep on a futex in between.
//
// Point-to-point: a segment per pair of ranks that exchange ("<name>-p<lo>-<hi>"), made at
// their first transfer (the lower rank creates it, the other attaches and unlinks the name),
// holding one byte ring per direction of `chunk` bytes. A message is its 8-byte size, then its
// data, streamed through the ring; the receiver posts the size it expects, so that both sides
// see a mismatch. comm_p2p moves whatever fits of every transfer in turn, and sleeps on its
// rank's bell, which a peer rings whenever it moved something of ours.
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm_backend.h"

#define SHM_MAGIC 0x3173686d69617274ull // arbitrary tag, xor-ed with the nonce
#define POLL_NS 2000000                 // liveness / deadline checks every 2 ms
#define SPIN_ITERS 2000                 // busy-wait (~70 us) before yielding the core
#define YIELD_ITERS 16                  // sched_yield rounds before sleeping
#define REDUCE_BLOCK 1024               // floats summed per block (stays in L1)
#define ALIGN_FLOATS 16                 // slice boundaries on 64-byte lines
#define SHM_MAX_WORLD 1024              // one host

#define PAGE_BYTES 4096
#define PAIR_MAGIC 0x7032706d69617274ull // arbitrary tag, xor-ed with the group's nonce

enum { SLOT_EMPTY, SLOT_ATTACHED, SLOT_LEFT };
enum {
    OP_BARRIER,
    OP_ALL_REDUCE,
    OP_REDUCE_SCATTER,
    OP_ALL_GATHER,
    OP_BROADCAST,
    OP_CREATE,
    OP_SPLIT,
    OP_P2P,
    OP_ALL_TO_ALL,
    OP_COUNT
};
static const char *const OP_NAMES[OP_COUNT] = {"barrier",    "all_reduce", "reduce_scatter",
                                               "all_gather", "broadcast",  "comm_create",
                                               "comm_split", "p2p",        "all_to_all"};

// What a rank is doing in its current collective, compared across ranks.
typedef struct {
    uint32_t op, arg; // arg: CommOp or broadcast root
    uint64_t n;
} CallDesc;

typedef struct {
    _Alignas(64) _Atomic uint32_t state;
    _Atomic int32_t pid;
    _Atomic uint32_t arrived; // barriers passed; the futex word peers sleep on
    _Atomic uint32_t waiters; // peers sleeping on `arrived` (wake only if any)
    CallDesc desc[2];         // by call parity: a peer is at most one call ahead
    _Atomic uint32_t bell;    // rung by a peer that moved a transfer of this rank's
    _Atomic uint32_t bell_waiters;
} RankSlot;

typedef struct {
    uint64_t nonce;
    _Atomic uint64_t ready; // SHM_MAGIC ^ nonce once rank 0 initialised the header
    uint32_t world;
    uint64_t chunk_bytes;
    _Atomic int32_t abort_by; // -1, or the rank that failed the group first
    char abort_msg[ERR_MSG_MAX];
    RankSlot slots[];
} ShmHeader;

// One direction of a pair: the byte ring's counters (they only grow; one writer each) and
// the sizes the receiver posted, by parity: the sender checks message k before its receiver
// can post k + 2 (that needs message k + 1, which the sender starts after k).
typedef struct {
    _Alignas(64) _Atomic uint64_t head;   // bytes the sender wrote
    _Alignas(64) _Atomic uint64_t tail;   // bytes the receiver consumed
    _Alignas(64) _Atomic uint64_t posted; // receives the receiver started
    _Atomic uint64_t posted_bytes[2];
} Ring;

typedef struct {
    _Atomic uint64_t ready;    // PAIR_MAGIC ^ the group's nonce once the creator set it up
    _Atomic uint32_t attached; // the other rank mapped it (and unlinked the name)
    Ring ring[2];              // [0]: lower rank to higher, [1]: higher to lower
} PairHeader;                  // then the two rings' bytes, from PAGE_BYTES on
_Static_assert(sizeof(PairHeader) <= PAGE_BYTES, "pair header fits its page");

// This rank's side of a pair segment, and its message counts by direction (0 receive,
// 1 send): numbered so far, finished.
typedef struct {
    PairHeader *hdr; // NULL until created or attached
    Ring *out, *in;
    char *out_data, *in_data;
    uint64_t next[2], done[2];
    int creator;
} Peer;

typedef struct {
    char name[256];
    int fd;
    size_t size, chunk_floats;
    ShmHeader *hdr;
    float *data;    // 2 sets x (world staging slots + 1 result slot) x chunk
    uint32_t seq;   // barriers this rank passed
    uint32_t calls; // collectives this rank started
    int parity;     // the set the next step stages into
    int unlinked;   // rank 0: the name is gone
    struct timespec deadline;
    int op;      // the collective in progress (for messages)
    Peer *peers; // [world], at the first comm_p2p
} Shm;

// ---------------------------------------------------------------- small helpers

static Shm *shm_of(Comm *c) {
    return c->state;
}

static struct timespec deadline_after(int ms) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

static int past(struct timespec deadline) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec > deadline.tv_sec ||
           (t.tv_sec == deadline.tv_sec && t.tv_nsec >= deadline.tv_nsec);
}

static void sleep_ns(long ns) {
    struct timespec t = {0, ns};
    nanosleep(&t, NULL);
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static size_t min_size(size_t a, size_t b) {
    return a < b ? a : b;
}

static size_t segment_size(int world, size_t chunk) {
    size_t header = sizeof(ShmHeader) + (size_t)world * sizeof(RankSlot);
    return (header + PAGE_BYTES - 1) / PAGE_BYTES * PAGE_BYTES + 2 * ((size_t)world + 1) * chunk;
}

// Rank r's staging slot in set `parity`; r == world is the set's result slot.
static float *slot_data(Shm *s, int world, int parity, int rank) {
    return s->data + ((size_t)parity * (world + 1) + rank) * s->chunk_floats;
}

// Slice r of n floats split over `world` ranks, boundaries on cache lines.
static void slice_of(size_t n, int world, int r, size_t *lo, size_t *hi) {
    size_t per = ((n + world - 1) / world + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
    *lo = per * r < n ? per * r : n;
    *hi = per * (r + 1) < n ? per * (r + 1) : n;
}

// ---------------------------------------------------------------- liveness

static int lock_byte(int fd, int rank, short type, int cmd) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = rank, .l_len = 1};
    return fcntl(fd, cmd, &fl);
}

// 1 when some process holds rank's liveness lock.
static int lock_held(int fd, int rank) {
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = rank, .l_len = 1};
    if (fcntl(fd, F_OFD_GETLK, &fl))
        return 1; // cannot tell: assume alive, the deadline still holds
    return fl.l_type != F_UNLCK;
}

// Fails the whole group: the first failing rank's message is what peers report.
static void abort_group(Comm *c, const Err *err) {
    ShmHeader *h = shm_of(c)->hdr;
    int32_t none = -1;
    if (!atomic_compare_exchange_strong(&h->abort_by, &none, -2)) return;
    snprintf(h->abort_msg, sizeof h->abort_msg, "%s", err->msg);
    atomic_store(&h->abort_by, c->rank);
}

// The slow-path checks while waiting: an abort by another rank, a peer that died or left,
// the deadline (naming `peer`, the rank being waited for).
static int check_abort(Comm *c, Err *err) {
    ShmHeader *h = shm_of(c)->hdr;
    int32_t by = atomic_load(&h->abort_by);
    return by >= 0 ? err_set(err, "rank %d failed the group: %s", by, h->abort_msg) : 0;
}

static int check_alive(Comm *c, int r, Err *err) {
    Shm *s = shm_of(c);
    RankSlot *slot = &s->hdr->slots[r];
    uint32_t state = atomic_load(&slot->state);
    int pid = atomic_load(&slot->pid);
    if (state == SLOT_LEFT)
        return err_set(err, "rank %d (pid %d) left the group (comm_destroy) during %s", r, pid,
                       OP_NAMES[s->op]);
    if (state == SLOT_ATTACHED && !lock_held(s->fd, r))
        return err_set(err, "rank %d (pid %d) died during %s", r, pid, OP_NAMES[s->op]);
    return 0;
}

static int check_deadline(Comm *c, int peer, Err *err) {
    Shm *s = shm_of(c);
    const char *what = OP_NAMES[s->op];
    if (!past(s->deadline)) return 0;
    if (atomic_load(&s->hdr->slots[peer].state) == SLOT_EMPTY)
        return err_set(err, "timed out after %d ms waiting for rank %d to join (%s)", c->timeout_ms,
                       peer, what);
    return err_set(err, "timed out after %d ms waiting for rank %d (pid %d) in %s", c->timeout_ms,
                   peer, (int)atomic_load(&s->hdr->slots[peer].pid), what);
}

// A collective's check: every other rank takes part. ctx: the int rank waited for.
static int check_group(Comm *c, const void *ctx, Err *err) {
    if (check_abort(c, err)) return -1;
    for (int r = 0; r < c->world; r++)
        if (r != c->rank && check_alive(c, r, err)) return -1;
    return check_deadline(c, *(const int *)ctx, err);
}

// ---------------------------------------------------------------- barrier

static int passed(uint32_t arrived, uint32_t target) {
    return (int32_t)(arrived - target) >= 0;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t expected, long ns) {
    struct timespec t = {0, ns};
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &t, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

// What a wait is for: the futex word `word` (`waiters` counts its sleepers) to pass
// `target` (a barrier counter), or with `changed` to differ from it (a bell).
typedef struct {
    _Atomic uint32_t *word, *waiters;
    uint32_t target;
    int changed;
} Waitee;

static int reached(const Waitee *w, uint32_t now) {
    return w->changed ? now != w->target : passed(now, w->target);
}

// The slow-path check of a wait (check_group, check_p2p): -1 when it must end.
typedef int (*WaitCheck)(Comm *c, const void *ctx, Err *err);

// Spins briefly (the peer is usually microseconds behind), then yields, then
// sleeps on the word, running the check (liveness, abort, deadline) each round.
static int wait_on(Comm *c, const Waitee *w, WaitCheck check, const void *ctx, Err *err) {
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (reached(w, atomic_load_explicit(w->word, memory_order_acquire))) return 0;
        cpu_relax();
    }
    for (int i = 0;; i++) {
        uint32_t now = atomic_load(w->word);
        if (reached(w, now)) return 0;
        // A peer that left or exited may have done so legitimately, after it did what we
        // wait for: only a failure if the word has still not moved.
        if (check(c, ctx, err)) return reached(w, atomic_load(w->word)) ? 0 : -1;
        if (i < YIELD_ITERS) {
            sched_yield();
            continue;
        }
        // Dekker pair with arrive() / ring_bell(): either it sees our `waiters` or we see
        // its count.
        atomic_fetch_add(w->waiters, 1);
        futex_wait(w->word, now, POLL_NS);
        atomic_fetch_sub(w->waiters, 1);
    }
}

static int wait_for(Comm *c, int peer, uint32_t target, Err *err) {
    RankSlot *slot = &shm_of(c)->hdr->slots[peer];
    Waitee w = {&slot->arrived, &slot->waiters, target, 0};
    return wait_on(c, &w, check_group, &peer, err);
}

static void arrive(Comm *c) {
    Shm *s = shm_of(c);
    RankSlot *me = &s->hdr->slots[c->rank];
    atomic_store(&me->arrived, ++s->seq);
    if (atomic_load(&me->waiters)) futex_wake_all(&me->arrived);
}

static int barrier(Comm *c, Err *err) {
    arrive(c);
    Shm *s = shm_of(c);
    for (int r = 0; r < c->world; r++)
        if (r != c->rank && wait_for(c, r, s->seq, err)) {
            abort_group(c, err);
            return -1;
        }
    return 0;
}

// ---------------------------------------------------------------- calls and steps

// Starts a collective: the deadline, and the description peers compare.
static void begin_call(Comm *c, int op, uint32_t arg, size_t n) {
    Shm *s = shm_of(c);
    s->op = op;
    if (op != OP_CREATE) s->deadline = deadline_after(c->timeout_ms); // create keeps its own
    s->hdr->slots[c->rank].desc[s->calls & 1] = (CallDesc){(uint32_t)op, arg, n};
}

static void describe(char *out, size_t size, const CallDesc *d) {
    snprintf(out, size, "%s(n=%llu, %s=%u)", d->op < OP_COUNT ? OP_NAMES[d->op] : "?",
             (unsigned long long)d->n, d->op == OP_BROADCAST ? "root" : "op", d->arg);
}

// After the first barrier of a call every peer has published its description.
static int check_same_call(Comm *c, Err *err) {
    Shm *s = shm_of(c);
    int par = s->calls++ & 1;
    const CallDesc *mine = &s->hdr->slots[c->rank].desc[par];
    for (int r = 0; r < c->world; r++) {
        const CallDesc *theirs = &s->hdr->slots[r].desc[par];
        if (!memcmp(mine, theirs, sizeof *mine)) continue;
        char a[96], b[96];
        describe(a, sizeof a, mine);
        describe(b, sizeof b, theirs);
        err_set(err, "rank %d called %s while rank %d called %s", c->rank, a, r, b);
        abort_group(c, err);
        return -1;
    }
    return 0;
}

// The barrier after staging a step; the first step of a call checks the call.
static int step_barrier(Comm *c, int first, Err *err) {
    if (barrier(c, err)) return -1;
    return first ? check_same_call(c, err) : 0;
}

static void next_set(Shm *s) {
    s->parity ^= 1;
}

// dst[i] = (src[0][i] + src[1][i] + ...) * scale, in rank order so that the
// bits do not depend on which rank computes them. dst2 (optional) gets a copy.
// Summed block by block in an L1-resident buffer, so dst may be a source.
static void reduce_ranks(float *dst, float *dst2, const float *const *src, int nsrc, size_t n,
                         CommOp op) {
    float scale = 1.0f / (float)nsrc;
    float acc[REDUCE_BLOCK];
    for (size_t b = 0; b < n; b += REDUCE_BLOCK) {
        size_t m = n - b < REDUCE_BLOCK ? n - b : REDUCE_BLOCK;
        const float *x0 = src[0] + b, *x1 = nsrc > 1 ? src[1] + b : NULL;
        if (x1)
            for (size_t i = 0; i < m; i++)
                acc[i] = x0[i] + x1[i];
        else
            memcpy(acc, x0, m * sizeof(float));
        for (int k = 2; k < nsrc; k++) {
            const float *x = src[k] + b;
            for (size_t i = 0; i < m; i++)
                acc[i] += x[i];
        }
        if (op == COMM_AVG)
            for (size_t i = 0; i < m; i++)
                acc[i] *= scale;
        memcpy(dst + b, acc, m * sizeof(float));
        if (dst2) memcpy(dst2 + b, acc, m * sizeof(float));
    }
}

// ---------------------------------------------------------------- collectives

static int shm_barrier(Comm *c, Err *err) {
    begin_call(c, OP_BARRIER, 0, 0);
    return step_barrier(c, 1, err);
}

// Copies the other ranks' result slices of a step (m floats at `chunk`) out
// of the result slot of set `parity`.
static void gather_results(Comm *c, float *chunk, size_t m, int parity) {
    Shm *s = shm_of(c);
    const float *result = slot_data(s, c->world, parity, c->world);
    for (int r = 0; r < c->world; r++) {
        size_t lo, hi;
        slice_of(m, c->world, r, &lo, &hi);
        if (r != c->rank) memcpy(chunk + lo, result + lo, (hi - lo) * sizeof(float));
    }
}

// Per step k: stage the slices of my chunk that other ranks reduce, barrier,
// reduce my slice across ranks (my own input read in place) into my output
// and the set's result slot, then copy step k-1's other slices (finished by
// everybody before this barrier). One barrier per step, plus one at the end.
// With 2 ranks each reads and writes the buffer about twice (a memcpy: once),
// and reads its half of the peer's data across cores, as any all_reduce must.
// Reductions carry gradients and sums, fp32 whatever the compute dtype (docs/design.md §15):
// reducing bf16 or fp16 here would be a bug upstream, not a format.
static int fp32_only(DType dt, const char *call, Err *err) {
    if (dt == DT_F32) return 0;
    return err_set(err, "%s: the shm backend reduces fp32 only, not %s", call, dtype_name(dt));
}

static int shm_all_reduce(Comm *c, void *buf_, size_t n, DType dt, CommOp op, Err *err) {
    if (fp32_only(dt, "all_reduce", err)) return -1;
    float *buf = buf_;
    Shm *s = shm_of(c);
    int W = c->world, me = c->rank;
    begin_call(c, OP_ALL_REDUCE, op, n);
    float *prev = NULL; // the step whose other slices are still to be copied
    size_t off = 0, prev_m = 0;
    do {
        size_t m = n - off < s->chunk_floats ? n - off : s->chunk_floats, lo, hi;
        float *mine = slot_data(s, W, s->parity, me), *chunk = buf + off;
        for (int r = 0; r < W; r++) {
            slice_of(m, W, r, &lo, &hi);
            if (r != me) memcpy(mine + lo, chunk + lo, (hi - lo) * sizeof(float));
        }
        if (step_barrier(c, off == 0, err)) return -1;
        slice_of(m, W, me, &lo, &hi);
        const float *src[W];
        for (int r = 0; r < W; r++)
            src[r] = (r == me ? chunk : slot_data(s, W, s->parity, r)) + lo;
        reduce_ranks(chunk + lo, slot_data(s, W, s->parity, W) + lo, src, W, hi - lo, op);
        if (prev) gather_results(c, prev, prev_m, !s->parity);
        prev = chunk;
        prev_m = m;
        next_set(s);
        off += m;
    } while (off < n);
    if (barrier(c, err)) return -1;
    gather_results(c, prev, prev_m, !s->parity);
    return 0;
}

// Per step: stage a piece of every other rank's block, barrier, reduce my
// block (my own piece read in place).
static int shm_reduce_scatter(Comm *c, const void *send_, void *recv_, size_t n, DType dt,
                              CommOp op, Err *err) {
    if (fp32_only(dt, "reduce_scatter", err)) return -1;
    const float *send = send_;
    float *recv = recv_;
    Shm *s = shm_of(c);
    int W = c->world, me = c->rank;
    size_t per = s->chunk_floats / W / ALIGN_FLOATS * ALIGN_FLOATS;
    begin_call(c, OP_REDUCE_SCATTER, op, n);
    size_t off = 0;
    do {
        size_t m = n - off < per ? n - off : per;
        float *mine = slot_data(s, W, s->parity, me);
        for (int r = 0; r < W; r++)
            if (r != me) memcpy(mine + r * per, send + r * n + off, m * sizeof(float));
        if (step_barrier(c, off == 0, err)) return -1;
        const float *src[W];
        for (int r = 0; r < W; r++)
            src[r] = r == me ? send + me * n + off : slot_data(s, W, s->parity, r) + me * per;
        reduce_ranks(recv + off, NULL, src, W, m, op);
        next_set(s);
        off += m;
    } while (off < n);
    return 0;
}

// Per step: stage my chunk, barrier, copy every other rank's chunk. A copy: any dtype,
// in bytes. The caller began the call.
static int gather_bytes(Comm *c, const char *send, char *recv, size_t bytes, Err *err) {
    Shm *s = shm_of(c);
    int W = c->world, me = c->rank;
    size_t chunk = s->chunk_floats * sizeof(float);
    memcpy(recv + me * bytes, send, bytes);
    size_t off = 0;
    do {
        size_t m = bytes - off < chunk ? bytes - off : chunk;
        memcpy(slot_data(s, W, s->parity, me), send + off, m);
        if (step_barrier(c, off == 0, err)) return -1;
        for (int r = 0; r < W; r++)
            if (r != me) memcpy(recv + r * bytes + off, slot_data(s, W, s->parity, r), m);
        next_set(s);
        off += m;
    } while (off < bytes);
    return 0;
}

static int shm_all_gather(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err) {
    begin_call(c, OP_ALL_GATHER, (uint32_t)dt, n);
    return gather_bytes(c, send, recv, n * dtype_size(dt), err);
}

// Per step: the root stages up to a whole set, barrier, the others copy it.
static int shm_broadcast(Comm *c, void *buf, size_t bytes, int root, Err *err) {
    Shm *s = shm_of(c);
    int W = c->world;
    size_t per = ((size_t)W + 1) * s->chunk_floats * sizeof(float);
    begin_call(c, OP_BROADCAST, (uint32_t)root, bytes);
    size_t off = 0;
    do {
        size_t m = bytes - off < per ? bytes - off : per;
        char *set = (char *)slot_data(s, W, s->parity, 0);
        if (c->rank == root) memcpy(set, (char *)buf + off, m);
        if (step_barrier(c, off == 0, err)) return -1;
        if (c->rank != root) memcpy((char *)buf + off, set, m);
        next_set(s);
        off += m;
    } while (off < bytes);
    return 0;
}

// ---------------------------------------------------------------- all-to-all

// A rank's stream: its send buffer without its own part (copied directly), staged a whole
// chunk per step whatever the sizes per destination, so the steps are those of the largest
// stream, not of the largest part.
typedef struct {
    uint64_t at, bytes; // this rank's part of the sender's stream: where, how long
    uint64_t total;     // the sender's stream
} A2aPart;

// Rank q's sizes as staged by exchange_sizes: [0, W) what it sends, [W, 2W) what it receives.
static const uint64_t *staged_sizes(Shm *s, int world, int q) {
    return (const uint64_t *)slot_data(s, world, s->parity, q);
}

// Every pair, in the same order on every rank, so all fail with the same message.
static int check_pair_sizes(Comm *c, Err *err) {
    Shm *s = shm_of(c);
    int W = c->world;
    for (int q = 0; q < W; q++)
        for (int r = 0; r < W; r++) {
            uint64_t sent = staged_sizes(s, W, q)[r], got = staged_sizes(s, W, r)[W + q];
            if (sent == got) continue;
            err_set(err,
                    "all_to_all: rank %d sends %llu bytes to rank %d, which receives %llu from "
                    "rank %d",
                    q, (unsigned long long)sent, r, (unsigned long long)got, q);
            abort_group(c, err);
            return -1;
        }
    return 0;
}

// Where this rank's part lies in rank q's stream (q's sizes staged). For q == this rank: where
// its own part is cut out of its send buffer, and its stream's length.
static A2aPart locate_part(Shm *s, int world, int q, int me) {
    const uint64_t *sent = staged_sizes(s, world, q);
    A2aPart p = {0, sent[me], 0};
    for (int d = 0; d < world; d++)
        if (d != q) {
            p.at += d < me ? sent[d] : 0;
            p.total += sent[d];
        }
    return p;
}

// The call's first step: every rank stages its sizes (2 * world * 8 bytes: a chunk holds at
// least 64 * world), each checks every pair and locates its parts. *longest: the longest
// stream, which sets the steps of every rank.
static int exchange_sizes(Comm *c, const size_t *send_bytes, const size_t *recv_bytes,
                          A2aPart *parts, uint64_t *longest, Err *err) {
    Shm *s = shm_of(c);
    int W = c->world;
    uint64_t *mine = (uint64_t *)slot_data(s, W, s->parity, c->rank);
    for (int r = 0; r < W; r++) {
        mine[r] = send_bytes[r];
        mine[W + r] = recv_bytes[r];
    }
    if (step_barrier(c, 1, err) || check_pair_sizes(c, err)) return -1;
    *longest = 0;
    for (int q = 0; q < W; q++) {
        parts[q] = locate_part(s, W, q, c->rank);
        if (parts[q].total > *longest) *longest = parts[q].total;
    }
    next_set(s);
    return 0;
}

// Stages bytes [from, from + chunk) of my stream: send without its `skip` bytes at `cut`.
static void stage_stream(Comm *c, const char *send, const A2aPart *mine, uint64_t from) {
    Shm *s = shm_of(c);
    if (from >= mine->total) return; // a shorter stream than the longest: done already
    size_t m = min_size(s->chunk_floats * sizeof(float), (size_t)(mine->total - from));
    size_t at = (size_t)from, cut = (size_t)mine->at, skip = (size_t)mine->bytes;
    size_t first = at < cut ? min_size(m, cut - at) : 0;
    char *dst = (char *)slot_data(s, c->world, s->parity, c->rank);
    memcpy(dst, send + at, first);
    memcpy(dst + first, send + at + first + skip, m - first);
}

// What of q's step (its stream's bytes [from, from + chunk)) is my part, into its place.
static void take_part(char *dst, const char *slot, const A2aPart *p, uint64_t from, size_t chunk) {
    uint64_t lo = p->at > from ? p->at : from, hi = p->at + p->bytes;
    if (hi > from + chunk) hi = from + chunk;
    if (lo < hi) memcpy(dst + (lo - p->at), slot + (lo - from), (size_t)(hi - lo));
}

// Per step: stage the next chunk of my stream, barrier, copy my parts out of every other
// rank's.
static int move_streams(Comm *c, const char *send, char *recv, const size_t *recv_bytes,
                        const A2aPart *parts, uint64_t longest, Err *err) {
    Shm *s = shm_of(c);
    int W = c->world, me = c->rank;
    size_t chunk = s->chunk_floats * sizeof(float);
    for (uint64_t from = 0; from < longest; from += chunk) {
        stage_stream(c, send, &parts[me], from);
        if (step_barrier(c, 0, err)) return -1;
        size_t at = 0;
        for (int q = 0; q < W; at += recv_bytes[q++])
            if (q != me)
                take_part(recv + at, (const char *)slot_data(s, W, s->parity, q), &parts[q], from,
                          chunk);
        next_set(s);
    }
    return 0;
}

// Sizes first (one step, checked), then the streams; my own part is a plain copy.
static int shm_all_to_all(Comm *c, const void *send, const size_t *send_bytes, void *recv,
                          const size_t *recv_bytes, Err *err) {
    int me = c->rank;
    A2aPart *parts = malloc((size_t)c->world * sizeof *parts);
    if (!parts) {
        err_resource(err, "all_to_all: out of memory for %d ranks", c->world);
        abort_group(c, err); // the others need not wait for the timeout
        return -1;
    }
    begin_call(c, OP_ALL_TO_ALL, 0, 0); // the sizes differ by rank: exchange_sizes checks them
    uint64_t longest;
    int rc = exchange_sizes(c, send_bytes, recv_bytes, parts, &longest, err) ||
             move_streams(c, send, recv, recv_bytes, parts, longest, err);
    size_t own = 0; // where my own part goes in recv
    for (int q = 0; q < me; q++)
        own += recv_bytes[q];
    if (rc == 0) memcpy((char *)recv + own, (const char *)send + parts[me].at, send_bytes[me]);
    free(parts);
    return rc ? -1 : 0;
}

// ---------------------------------------------------------------- create / attach / destroy

static void release(Shm *s, size_t mapped) {
    if (s->hdr) munmap(s->hdr, mapped);
    if (s->fd >= 0) close(s->fd);
    free(s);
}

static void *map_shared(int fd, size_t size, Err *err) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) return p;
    err_set(err, "mmap of %zu bytes: %s", size, strerror(errno));
    return NULL;
}

static int map_segment(Shm *s, Err *err) {
    return (s->hdr = map_shared(s->fd, s->size, err)) ? 0 : -1;
}

// A fresh segment under the name, replacing a stale one from a crashed run: its fd.
static int open_fresh(const char *name, Err *err) {
    int fd;
    for (int tries = 0; (fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600)) < 0; tries++) {
        if (errno != EEXIST || tries == 8)
            return err_set(err, "shm_open(%s, O_CREAT|O_EXCL): %s", name, strerror(errno));
        shm_unlink(name); // stale: its ranks are gone (names are unique per job)
    }
    return fd;
}

// Rank 0: the group's segment.
static int create_segment(Shm *s, int world, Err *err) {
    if ((s->fd = open_fresh(s->name, err)) < 0) return -1;
    if (lock_byte(s->fd, 0, F_WRLCK, F_OFD_SETLK))
        return err_set(err, "locking rank 0's liveness byte: %s", strerror(errno));
    if (ftruncate(s->fd, (off_t)s->size))
        return err_set(err, "ftruncate to %zu bytes: %s", s->size, strerror(errno));
    if (map_segment(s, err)) return -1;
    ShmHeader *h = s->hdr;
    if (getrandom(&h->nonce, sizeof h->nonce, 0) != sizeof h->nonce)
        h->nonce = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL);
    h->world = (uint32_t)world;
    h->chunk_bytes = s->chunk_floats * sizeof(float);
    atomic_store(&h->abort_by, -1);
    atomic_store(&h->slots[0].pid, getpid());
    atomic_store(&h->slots[0].state, SLOT_ATTACHED);
    atomic_store(&h->ready, SHM_MAGIC ^ h->nonce);
    return 0;
}

// One attempt to attach to the segment under the name. Returns 0 attached, 1
// not (yet) usable — absent, still being set up, or stale — with the reason
// in `why`, -1 a hard error.
static int try_attach(Comm *c, Shm *s, char *why, size_t why_size, Err *err) {
    s->fd = shm_open(s->name, O_RDWR, 0);
    if (s->fd < 0) {
        snprintf(why, why_size, "shm_open: %s", strerror(errno));
        return 1;
    }
    struct stat st = {0};
    if (fstat(s->fd, &st) || (size_t)st.st_size != s->size) {
        snprintf(why, why_size,
                 "segment has %lld bytes, expected %zu (not set up yet, stale, or "
                 "world/chunk differ between ranks)",
                 (long long)st.st_size, s->size);
        goto not_yet;
    }
    if (map_segment(s, err)) return -1;
    ShmHeader *h = s->hdr;
    if (atomic_load(&h->ready) != (SHM_MAGIC ^ h->nonce) || h->world != (uint32_t)c->world ||
        h->chunk_bytes != s->chunk_floats * sizeof(float)) {
        snprintf(why, why_size, "segment header is not (yet) a group of world %d", c->world);
        goto not_yet;
    }
    if (!lock_held(s->fd, 0)) {
        snprintf(why, why_size, "segment is stale (its rank 0 is gone)");
        goto not_yet;
    }
    if (lock_byte(s->fd, c->rank, F_WRLCK, F_OFD_SETLK))
        return err_set(err, "rank %d is already attached (pid %d): %s", c->rank,
                       (int)atomic_load(&h->slots[c->rank].pid), strerror(errno));
    atomic_store(&h->slots[c->rank].pid, getpid());
    atomic_store(&h->slots[c->rank].state, SLOT_ATTACHED);
    return 0;
not_yet:
    if (s->hdr) munmap(s->hdr, s->size);
    s->hdr = NULL;
    close(s->fd);
    s->fd = -1;
    return 1;
}

static int attach_segment(Comm *c, Shm *s, Err *err) {
    char why[256] = "";
    for (;;) {
        int rc = try_attach(c, s, why, sizeof why, err);
        if (rc <= 0) return rc;
        if (past(s->deadline))
            return err_set(err,
                           "timed out after %d ms waiting for rank 0 to create the segment "
                           "(last: %s)",
                           c->timeout_ms, why);
        sleep_ns(POLL_NS);
    }
}

static int check_shm_config(const CommConfig *cfg, size_t chunk, Err *err) {
    if (!cfg->shm_name || cfg->shm_name[0] != '/' || strchr(cfg->shm_name + 1, '/') ||
        strlen(cfg->shm_name) < 2 || strlen(cfg->shm_name) > 200)
        return err_set(err, "shm_name \"%s\" must be \"/name\" (one leading slash, 1..199 chars)",
                       cfg->shm_name ? cfg->shm_name : "(null)");
    if (cfg->world_size > SHM_MAX_WORLD)
        return err_set(err, "world_size %d is above the shm backend's %d", cfg->world_size,
                       SHM_MAX_WORLD);
    if (chunk % 64 || chunk < 64 * (size_t)cfg->world_size)
        return err_set(err,
                       "shm_chunk_bytes %zu must be a multiple of 64 and at least 64 * "
                       "world_size (%d)",
                       chunk, 64 * cfg->world_size);
    return 0;
}

// ---------------------------------------------------------------- point-to-point: pair segments

static size_t ring_bytes(Shm *s) {
    return s->chunk_floats * sizeof(float);
}

static void pair_name(Comm *c, int peer, char *out, size_t size) {
    int lo = c->rank < peer ? c->rank : peer, hi = c->rank ^ peer ^ lo;
    snprintf(out, size, "%s-p%d-%d", shm_of(c)->name, lo, hi);
}

// Wakes a rank waiting in comm_p2p: one of its transfers moved.
static void ring_bell(Comm *c, int peer) {
    RankSlot *slot = &shm_of(c)->hdr->slots[peer];
    atomic_fetch_add(&slot->bell, 1);
    if (atomic_load(&slot->bell_waiters)) futex_wake_all(&slot->bell);
}

static void use_pair(Comm *c, int peer, PairHeader *h, int creator) {
    Peer *p = &shm_of(c)->peers[peer];
    char *data = (char *)h + PAGE_BYTES;
    int up = c->rank < peer; // ring 0 carries lower to higher
    p->hdr = h;
    p->creator = creator;
    p->out = &h->ring[!up];
    p->in = &h->ring[up];
    p->out_data = data + (size_t)!up * ring_bytes(shm_of(c));
    p->in_data = data + (size_t)up * ring_bytes(shm_of(c));
}

// The lower rank of a pair, at its first transfer with peer: never waits.
static int create_pair(Comm *c, int peer, Err *err) {
    Shm *s = shm_of(c);
    char name[sizeof s->name + 32];
    pair_name(c, peer, name, sizeof name);
    size_t size = PAGE_BYTES + 2 * ring_bytes(s);
    int fd = open_fresh(name, err);
    if (fd < 0) return -1;
    PairHeader *h = NULL;
    if (ftruncate(fd, (off_t)size))
        err_errno(err, errno, "ftruncate of %s to %zu bytes", name, size);
    else
        h = map_shared(fd, size, err);
    close(fd);
    if (!h) {
        shm_unlink(name);
        return -1;
    }
    atomic_store(&h->ready, PAIR_MAGIC ^ s->hdr->nonce);
    use_pair(c, peer, h, 1);
    ring_bell(c, peer); // it may be waiting to attach
    return 1;
}

// The higher rank: one try. 1 attached, 0 not yet (absent, being set up, or stale: another
// group's), -1 an error.
static int attach_pair(Comm *c, int peer, Err *err) {
    Shm *s = shm_of(c);
    char name[sizeof s->name + 32];
    pair_name(c, peer, name, sizeof name);
    size_t size = PAGE_BYTES + 2 * ring_bytes(s);
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0)
        return errno == ENOENT ? 0 : err_errno(err, errno, "shm_open(%s) of rank %d", name, peer);
    struct stat st = {0};
    PairHeader *h = NULL;
    if (!fstat(fd, &st) && (size_t)st.st_size == size && !(h = map_shared(fd, size, err))) {
        close(fd);
        return -1;
    }
    close(fd);
    if (h && atomic_load(&h->ready) != (PAIR_MAGIC ^ s->hdr->nonce)) {
        munmap(h, size);
        h = NULL;
    }
    if (!h) return 0;
    atomic_store(&h->attached, 1);
    shm_unlink(name); // both have it mapped: the name has done its job
    use_pair(c, peer, h, 0);
    return 1;
}

// Unmaps the pair segments; a creator whose peer never came unlinks the name itself.
static void release_pairs(Comm *c) {
    Shm *s = shm_of(c);
    if (!s->peers) return;
    for (int r = 0; r < c->world; r++) {
        Peer *p = &s->peers[r];
        if (!p->hdr) continue;
        if (p->creator && !atomic_load(&p->hdr->attached)) {
            char name[sizeof s->name + 32];
            pair_name(c, r, name, sizeof name);
            shm_unlink(name);
        }
        munmap(p->hdr, PAGE_BYTES + 2 * ring_bytes(s));
    }
    free(s->peers);
    s->peers = NULL;
}

// ---------------------------------------------------------------- point-to-point: transfers

// n bytes at stream position pos of a ring of cap bytes (wrapping).
static void ring_put(char *ring, size_t cap, uint64_t pos, const void *src, size_t n) {
    size_t at = (size_t)(pos % cap), first = min_size(n, cap - at);
    memcpy(ring + at, src, first);
    memcpy(ring, (const char *)src + first, n - first);
}

static void ring_get(const char *ring, size_t cap, uint64_t pos, void *dst, size_t n) {
    size_t at = (size_t)(pos % cap), first = min_size(n, cap - at);
    memcpy(dst, ring + at, first);
    memcpy((char *)dst + first, ring, n - first);
}

// This call's progress on one transfer.
typedef struct {
    uint64_t index; // the message's number in its direction
    int header;     // sender: the size written; receiver: the size read and checked
    int agreed;     // sender: the receiver's posted size checked; receiver: posted
    size_t moved;   // data bytes
    int done;
} Transfer;

static int sizes_differ(Comm *c, const CommP2p *o, const Transfer *t, uint64_t theirs, Err *err) {
    return err_set(err,
                   "p2p: rank %d %s %zu bytes %s rank %d, which %s %llu (message %llu from "
                   "rank %d to rank %d)",
                   c->rank, o->send ? "sends" : "receives", o->bytes, o->send ? "to" : "from",
                   o->peer, o->send ? "receives" : "sends", (unsigned long long)theirs,
                   (unsigned long long)t->index, o->send ? c->rank : o->peer,
                   o->send ? o->peer : c->rank);
}

// The sender: the size, then as much data as the ring has room for. Returns whether
// anything moved.
static int send_step(Comm *c, const CommP2p *o, Transfer *t, Peer *p, Err *err) {
    size_t cap = ring_bytes(shm_of(c));
    int moved = 0;
    if (!t->agreed && atomic_load_explicit(&p->out->posted, memory_order_acquire) > t->index) {
        uint64_t theirs = atomic_load(&p->out->posted_bytes[t->index & 1]);
        if (theirs != o->bytes) return sizes_differ(c, o, t, theirs, err);
        t->agreed = moved = 1;
    }
    uint64_t head = atomic_load_explicit(&p->out->head, memory_order_relaxed);
    size_t room = cap - (size_t)(head - atomic_load_explicit(&p->out->tail, memory_order_acquire));
    if (!t->header && room >= sizeof(uint64_t)) {
        uint64_t size = o->bytes;
        ring_put(p->out_data, cap, head, &size, sizeof size);
        head += sizeof size;
        room -= sizeof size;
        t->header = moved = 1;
    }
    size_t m = t->header ? min_size(o->bytes - t->moved, room) : 0;
    if (m) ring_put(p->out_data, cap, head, (const char *)o->buf + t->moved, m); // buf: NULL for 0
    t->moved += m;
    atomic_store_explicit(&p->out->head, head + m, memory_order_release);
    t->done = t->header && t->agreed && t->moved == o->bytes;
    return moved || m;
}

// The receiver: posts its size, checks the sender's, copies what arrived.
static int recv_step(Comm *c, const CommP2p *o, Transfer *t, Peer *p, Err *err) {
    size_t cap = ring_bytes(shm_of(c));
    int moved = 0;
    if (!t->agreed) {
        atomic_store(&p->in->posted_bytes[t->index & 1], o->bytes);
        atomic_store_explicit(&p->in->posted, t->index + 1, memory_order_release);
        t->agreed = moved = 1;
    }
    uint64_t tail = atomic_load_explicit(&p->in->tail, memory_order_relaxed);
    size_t avail = (size_t)(atomic_load_explicit(&p->in->head, memory_order_acquire) - tail);
    if (!t->header && avail >= sizeof(uint64_t)) {
        uint64_t theirs;
        ring_get(p->in_data, cap, tail, &theirs, sizeof theirs);
        if (theirs != o->bytes) return sizes_differ(c, o, t, theirs, err);
        tail += sizeof theirs;
        avail -= sizeof theirs;
        t->header = moved = 1;
    }
    size_t m = t->header ? min_size(o->bytes - t->moved, avail) : 0;
    if (m) ring_get(p->in_data, cap, tail, (char *)o->buf + t->moved, m); // buf: NULL for 0
    t->moved += m;
    atomic_store_explicit(&p->in->tail, tail + m, memory_order_release);
    t->done = t->header && t->moved == o->bytes;
    return moved || m;
}

// One transfer's turn: its pair segment first, then its message once the earlier ones of
// its direction are done. 1: something moved, 0: it waits, -1: an error.
static int step(Comm *c, const CommP2p *o, Transfer *t, Err *err) {
    Peer *p = &shm_of(c)->peers[o->peer];
    if (!p->hdr) {
        int rc = c->rank < o->peer ? create_pair(c, o->peer, err) : attach_pair(c, o->peer, err);
        if (rc <= 0) return rc;
    }
    if (t->index != p->done[o->send]) return 0;
    int moved = o->send ? send_step(c, o, t, p, err) : recv_step(c, o, t, p, err);
    if (moved < 0) return -1;
    if (moved) ring_bell(c, o->peer);
    if (t->done) p->done[o->send]++;
    return moved;
}

typedef struct {
    const CommP2p *ops;
    const Transfer *t;
    int n;
} P2pCall;

// A p2p wait's check: only the peers of unfinished transfers matter (the other ranks may be
// anywhere, even gone).
static int check_p2p(Comm *c, const void *ctx, Err *err) {
    const P2pCall *call = ctx;
    if (check_abort(c, err)) return -1;
    int waited = -1;
    for (int i = 0; i < call->n; i++) {
        if (call->t[i].done) continue;
        if (waited < 0) waited = call->ops[i].peer;
        if (check_alive(c, call->ops[i].peer, err)) return -1;
    }
    return check_deadline(c, waited, err);
}

// Passes over every unfinished transfer until all are done, sleeping on this rank's bell
// when a pass moved nothing (read before the pass, so a ring during it is not missed).
static int run_transfers(Comm *c, const CommP2p *ops, Transfer *t, int n, Err *err) {
    RankSlot *me = &shm_of(c)->hdr->slots[c->rank];
    P2pCall call = {ops, t, n};
    for (;;) {
        Waitee bell = {&me->bell, &me->bell_waiters, atomic_load(&me->bell), 1};
        int moved = 0, left = 0;
        for (int i = 0; i < n; i++) {
            int rc = t[i].done ? 0 : step(c, &ops[i], &t[i], err);
            if (rc < 0) return -1;
            moved |= rc;
            left += !t[i].done;
        }
        if (!left) return 0;
        if (!moved && wait_on(c, &bell, check_p2p, &call, err)) return -1;
    }
}

// Numbers each transfer's message in its direction: per ordered pair, FIFO.
static int number_transfers(Comm *c, const CommP2p *ops, Transfer *t, int n, Err *err) {
    Shm *s = shm_of(c);
    if (!s->peers && !(s->peers = calloc((size_t)c->world, sizeof *s->peers)))
        return err_resource(err, "p2p: out of memory for %d peers", c->world);
    for (int i = 0; i < n; i++)
        t[i].index = s->peers[ops[i].peer].next[ops[i].send]++;
    return 0;
}

static int shm_p2p(Comm *c, const CommP2p *ops, int n, Err *err) {
    Shm *s = shm_of(c);
    s->op = OP_P2P; // not a collective: no call description, no barrier
    s->deadline = deadline_after(c->timeout_ms);
    Transfer *t = calloc((size_t)n, sizeof *t);
    int rc = t ? number_transfers(c, ops, t, n, err)
               : err_resource(err, "p2p: out of memory for %d transfers", n);
    if (rc == 0) rc = run_transfers(c, ops, t, n, err);
    free(t);
    if (rc) abort_group(c, err); // broken as after a collective: the others need not wait
    return rc;
}

// ---------------------------------------------------------------- sub-communicators

// This rank's place in its color's group, from every rank's (color, key).
static void place_in_group(const int32_t (*all)[2], int world, int me, int *rank, int *size) {
    *rank = *size = 0;
    for (int r = 0; r < world; r++) {
        if (all[r][0] != all[me][0]) continue;
        (*size)++;
        *rank += all[r][1] < all[me][1] || (all[r][1] == all[me][1] && r < me);
    }
}

static int shm_split(Comm *c, int color, int key, Comm *out, Err *err) {
    Shm *s = shm_of(c);
    int32_t mine[2] = {color, key}, (*all)[2] = malloc((size_t)c->world * sizeof *all);
    if (!all) return err_resource(err, "comm_split: out of memory for %d ranks", c->world);
    begin_call(c, OP_SPLIT, 0, 0);
    int rc = gather_bytes(c, (const char *)mine, (char *)all, sizeof mine, err);
    if (rc == 0)
        place_in_group((const int32_t(*)[2])all, c->world, c->rank, &out->rank, &out->world);
    free(all);
    if (rc) return -1;
    char name[sizeof s->name + 16];
    snprintf(name, sizeof name, "%s-g%d", s->name, color);
    CommConfig cfg = {.backend = "shm",
                      .rank = out->rank,
                      .world_size = out->world,
                      .timeout_ms = c->timeout_ms,
                      .shm_name = name,
                      .shm_chunk_bytes = ring_bytes(s)};
    return shm_comm_init(out, &cfg, err);
}

// ---------------------------------------------------------------- destroy and init

static void shm_destroy(Comm *c) {
    Shm *s = shm_of(c);
    release_pairs(c);
    // LEFT before the lock goes, so peers report "left", not "died".
    atomic_store(&s->hdr->slots[c->rank].state, SLOT_LEFT);
    if (c->rank == 0 && !s->unlinked) shm_unlink(s->name);
    release(s, s->size);
}

static const CommBackend SHM_OPS = {.device_memory = 0,
                                    .all_reduce = shm_all_reduce,
                                    .reduce_scatter = shm_reduce_scatter,
                                    .all_gather = shm_all_gather,
                                    .broadcast = shm_broadcast,
                                    .barrier = shm_barrier,
                                    .all_to_all = shm_all_to_all,
                                    .p2p = shm_p2p,
                                    .split = shm_split,
                                    .destroy = shm_destroy};

int shm_comm_init(Comm *c, const CommConfig *cfg, Err *err) {
    snprintf(c->label, sizeof c->label, "shm %s rank %d/%d", cfg->shm_name ? cfg->shm_name : "?",
             c->rank, c->world);
    size_t chunk = cfg->shm_chunk_bytes ? cfg->shm_chunk_bytes : COMM_SHM_DEFAULT_CHUNK;
    if (check_shm_config(cfg, chunk, err)) return -1;
    Shm *s = calloc(1, sizeof *s);
    if (!s) return err_resource(err, "shm: out of memory");
    snprintf(s->name, sizeof s->name, "%s", cfg->shm_name);
    s->fd = -1;
    s->chunk_floats = chunk / sizeof(float);
    s->size = segment_size(c->world, chunk);
    s->deadline = deadline_after(c->timeout_ms);
    s->op = OP_CREATE;
    c->state = s;
    c->ops = &SHM_OPS;
    int rc = c->rank == 0 ? create_segment(s, c->world, err) : attach_segment(c, s, err);
    if (rc == 0) {
        s->data = (float *)((char *)s->hdr + segment_size(c->world, 0));
        begin_call(c, OP_CREATE, 0, 0);
        rc = step_barrier(c, 1, err);
    }
    // Everybody attached (or the group failed): the name has done its job.
    if (c->rank == 0 && s->fd >= 0) {
        shm_unlink(s->name);
        s->unlinked = 1;
    }
    if (rc) {
        if (s->hdr) atomic_store(&s->hdr->slots[c->rank].state, SLOT_LEFT);
        release(s, s->size);
        c->state = NULL;
        return err_prefix(err, "%s", c->label);
    }
    return 0;
}

// ---------------------------------------------------------------- segment names

void comm_shm_new_name(char *out, size_t cap) {
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce)
        nonce = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    snprintf(out, cap, "/astrai-%d-%016llx", (int)getpid(), (unsigned long long)nonce);
}

void comm_shm_remove(const char *name) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    size_t n = strlen(name + 1);
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, name + 1, n) || (e->d_name[n] && e->d_name[n] != '-')) continue;
        char path[NAME_MAX + 2];
        snprintf(path, sizeof path, "/%s", e->d_name);
        shm_unlink(path);
    }
    closedir(d);
}
