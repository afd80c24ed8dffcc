// test_comm_shm.c: the shm collectives with real processes (forked ranks):
// results against sums computed here, bitwise equal on every rank; a peer
// killed mid-collective, a rank that never arrives, a stale segment, calls
// that do not match, bad configs and arguments. Point-to-point transfers (rings of
// ranks, both ways at once, FIFO order, sizes that differ, a peer killed or silent),
// sub-communicators, and all-to-all (random sizes per pair from 0 to many chunks, checked
// byte for byte; sizes that differ; a peer killed or late; in sub-communicators).
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "comm/comm.h"
#include "comm_test_util.h"

static CommConfig group_config(const char *name, int world, int rank, int timeout_ms,
                               size_t chunk) {
    return (CommConfig){.backend = "shm",
                        .rank = rank,
                        .world_size = world,
                        .timeout_ms = timeout_ms,
                        .shm_name = name,
                        .shm_chunk_bytes = chunk};
}

static void unique_name(char *out, size_t size, const char *what) {
    static int counter;
    snprintf(out, size, "/astrai-test-%d-%s-%d", (int)getpid(), what, counter++);
}

static int segment_exists(const char *name) {
    char path[300];
    snprintf(path, sizeof path, "/dev/shm%s", name);
    return access(path, F_OK) == 0;
}

typedef int (*RankBody)(Comm *c, void *ctx);

// In the child: create, run the body, destroy. Exit 0 when the body is happy.
static void rank_main(const CommConfig *cfg, RankBody body, void *ctx) {
    Err err = {0};
    Comm *c;
    if (comm_create(&c, cfg, &err)) {
        report_failure(cfg->rank, &err);
        _exit(3);
    }
    reports[cfg->rank].started = 1;
    int rc = body(c, ctx);
    comm_destroy(c);
    _exit(rc);
}

static pid_t spawn(const CommConfig *cfg, RankBody body, void *ctx) {
    pid_t pid = fork();
    if (pid == 0) rank_main(cfg, body, ctx);
    return pid;
}

// Waits up to limit_ms for pid to sleep (state S in /proc/PID/stat: blocked in a
// wait, not running, not gone). Returns whether it did.
static int wait_sleeping(pid_t pid, int limit_ms) {
    double end = now_ms() + limit_ms;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    while (now_ms() < end) {
        char text[512] = "";
        FILE *f = fopen(path, "r");
        if (!f) return 0;
        size_t n = fread(text, 1, sizeof text - 1, f);
        fclose(f);
        text[n] = 0;
        const char *paren = strrchr(text, ')');
        if (!paren || paren[1] != ' ') return 0;
        if (paren[2] == 'S') return 1;
        if (paren[2] == 'Z' || paren[2] == 'X') return 0;
        sleep_ms(1);
    }
    return 0;
}

static void reset_reports(void) {
    memset(reports, 0, MAX_WORLD * sizeof *reports);
}

// Runs a group of `world` ranks, all with the same body; returns how many
// ranks did not exit 0 (a hang counts).
static int run_group(const char *name, int world, int timeout_ms, size_t chunk, RankBody body,
                     void *ctx) {
    reset_reports();
    pid_t pids[MAX_WORLD];
    for (int r = 0; r < world; r++) {
        CommConfig cfg = group_config(name, world, r, timeout_ms, chunk);
        pids[r] = spawn(&cfg, body, ctx);
    }
    int bad = 0;
    for (int r = 0; r < world; r++) {
        int rc = wait_child(pids[r], 60000);
        if (rc != 0) fprintf(stderr, "rank %d exited %d: %s\n", r, rc, reports[r].msg);
        bad += rc != 0;
    }
    return bad;
}

// ---------------------------------------------------------------- values and expectations

// The documented result: summed in rank order, AVG then scaled by 1/world.
static float expected_reduce(uint32_t seed, int world, size_t i, CommOp op) {
    float acc = value(seed, 0, i);
    for (int r = 1; r < world; r++)
        acc += value(seed, r, i);
    return op == COMM_AVG ? acc * (1.0f / (float)world) : acc;
}

static int same_bits(float a, float b) {
    return memcmp(&a, &b, sizeof a) == 0;
}

// Compares got[i] with want(i) bitwise; prints the first difference.
#define EXPECT_FLOATS(what, rank, n, got, want_expr)                                               \
    do {                                                                                           \
        for (size_t i = 0; i < (n); i++) {                                                         \
            float want = (want_expr);                                                              \
            if (!same_bits((got)[i], want)) {                                                      \
                fprintf(stderr, "rank %d: %s n=%zu: [%zu] = %.9g, want %.9g\n", rank, what, n, i,  \
                        (double)(got)[i], (double)want);                                           \
                return 1;                                                                          \
            }                                                                                      \
        }                                                                                          \
    } while (0)

// ---------------------------------------------------------------- every collective, every size

typedef struct {
    size_t sizes[6];
    int nsizes;
} SizesCtx;

static int check_all_reduce(Comm *c, size_t n, CommOp op, uint32_t seed, float *buf) {
    int me = comm_rank(c), W = comm_world_size(c);
    Err err;
    for (size_t i = 0; i < n; i++)
        buf[i] = value(seed, me, i);
    if (comm_all_reduce(c, buf, n, DT_F32, op, &err)) return fail_call(c, &err);
    EXPECT_FLOATS(op == COMM_AVG ? "all_reduce avg" : "all_reduce sum", me, n, buf,
                  expected_reduce(seed, W, i, op));
    reports[me].digest = fnv(reports[me].digest, buf, n * sizeof(float));
    return 0;
}

static int check_reduce_scatter(Comm *c, size_t n, CommOp op, uint32_t seed, float *send,
                                float *recv) {
    int me = comm_rank(c), W = comm_world_size(c);
    Err err;
    for (size_t i = 0; i < (size_t)W * n; i++)
        send[i] = value(seed, me, i);
    if (comm_reduce_scatter(c, send, recv, n, DT_F32, op, &err)) return fail_call(c, &err);
    EXPECT_FLOATS("reduce_scatter", me, n, recv, expected_reduce(seed, W, me * n + i, op));
    return 0;
}

static int check_all_gather(Comm *c, size_t n, uint32_t seed, float *send, float *recv) {
    int me = comm_rank(c), W = comm_world_size(c);
    Err err;
    for (size_t i = 0; i < n; i++)
        send[i] = value(seed, me, i);
    if (comm_all_gather(c, send, recv, n, DT_F32, &err)) return fail_call(c, &err);
    EXPECT_FLOATS("all_gather", me, (size_t)W * n, recv, value(seed, (int)(i / n), i % n));
    reports[me].digest = fnv(reports[me].digest, recv, (size_t)W * n * sizeof(float));
    return 0;
}

// bf16 elements (2 bytes: n odd splits a float) gathered as bytes; their bits identify the
// rank and the index.
static int check_all_gather_bf16(Comm *c, size_t n, uint16_t *send, uint16_t *recv) {
    int me = comm_rank(c), W = comm_world_size(c);
    Err err;
    for (size_t i = 0; i < n; i++)
        send[i] = (uint16_t)(me * 7919 + i);
    if (comm_all_gather(c, send, recv, n, DT_BF16, &err)) return fail_call(c, &err);
    for (size_t i = 0; i < (size_t)W * n; i++)
        if (recv[i] != (uint16_t)((i / n) * 7919 + i % n)) {
            fprintf(stderr, "rank %d: bf16 all_gather of %zu: element %zu = %u\n", me, n, i,
                    recv[i]);
            return 1;
        }
    return 0;
}

// An odd byte count, from the last rank.
static int check_broadcast(Comm *c, size_t n, unsigned char *buf) {
    int me = comm_rank(c), W = comm_world_size(c);
    size_t bytes = n * 4 + (n ? 3 : 0);
    Err err;
    for (size_t i = 0; i < bytes; i++)
        buf[i] = me == W - 1 ? (unsigned char)(i * 7 + n) : 0;
    if (comm_broadcast(c, buf, bytes, W - 1, &err)) return fail_call(c, &err);
    for (size_t i = 0; i < bytes; i++)
        if (buf[i] != (unsigned char)(i * 7 + n)) {
            fprintf(stderr, "rank %d: broadcast %zu bytes: byte %zu = %d\n", me, bytes, i, buf[i]);
            return 1;
        }
    return 0;
}

static int body_all_collectives(Comm *c, void *ctx) {
    const SizesCtx *sz = ctx;
    int W = comm_world_size(c);
    Err err;
    for (int k = 0; k < sz->nsizes; k++) {
        size_t n = sz->sizes[k];
        float *a = malloc((size_t)W * n * sizeof(float) + 16);
        float *b = malloc((size_t)W * n * sizeof(float) + 16);
        int bad = check_all_reduce(c, n, COMM_SUM, 11 + k, a) ||
                  check_all_reduce(c, n, COMM_AVG, 23 + k, a) ||
                  check_reduce_scatter(c, n, COMM_SUM, 37 + k, a, b) ||
                  check_reduce_scatter(c, n, COMM_AVG, 41 + k, a, b) ||
                  check_all_gather(c, n, 53 + k, a, b) ||
                  check_all_gather_bf16(c, n, (void *)a, (void *)b) ||
                  check_broadcast(c, n, (void *)a);
        free(a);
        free(b);
        if (bad) return 1;
        if (comm_barrier(c, &err)) return fail_call(c, &err);
    }
    return 0;
}

static void test_collectives(int world, size_t chunk, SizesCtx sizes) {
    char name[96];
    unique_name(name, sizeof name, "all");
    int bad = run_group(name, world, 20000, chunk, body_all_collectives, &sizes);
    CHECK_MSG(bad == 0, "world %d chunk %zu: %d rank(s) failed", world, chunk, bad);
    for (int r = 1; r < world; r++)
        CHECK_MSG(reports[r].digest == reports[0].digest, "world %d: rank %d's results differ",
                  world, r);
    CHECK_MSG(!segment_exists(name), "%s left behind", name);
}

// ---------------------------------------------------------------- a peer killed mid-collective

// The collective that the kill and lateness tests repeat: its name in messages, and one call
// of it on a buffer of COLL_BYTES zero bytes.
#define COLL_BYTES ((size_t)256 << 10)
typedef struct {
    const char *name;
    int (*call)(Comm *c, void *buf, Err *err);
} Collective;

static int one_all_reduce(Comm *c, void *buf, Err *err) {
    return comm_all_reduce(c, buf, COLL_BYTES / sizeof(float), DT_F32, COMM_SUM, err);
}

static const Collective ALL_REDUCE = {"all_reduce", one_all_reduce};

static int body_until_error(Comm *c, void *ctx) {
    const Collective *coll = ctx;
    void *buf = calloc(1, COLL_BYTES);
    Err err;
    double end = now_ms() + 30000;
    while (now_ms() < end)
        if (coll->call(c, buf, &err)) {
            report_failure(comm_rank(c), &err);
            free(buf);
            return 0; // the expected way out
        }
    free(buf);
    return 1;
}

static void test_peer_killed(int world, int victim, const Collective *coll) {
    char name[96];
    unique_name(name, sizeof name, "kill");
    int timeout_ms = 4000;
    reset_reports();
    pid_t pids[MAX_WORLD];
    for (int r = 0; r < world; r++) {
        CommConfig cfg = group_config(name, world, r, timeout_ms, 4096);
        pids[r] = spawn(&cfg, body_until_error, (void *)coll);
    }
    double until = now_ms() + 10000;
    for (int r = 0; r < world; r++)
        while (!reports[r].started && now_ms() < until)
            sleep_ms(1);
    sleep_ms(100); // well into the all_reduce loop
    double killed_at = now_ms();
    kill(pids[victim], SIGKILL);
    // The victim stays an unreaped zombie while the survivors must notice it.
    for (int r = 0; r < world; r++) {
        if (r == victim) continue;
        int rc = wait_child(pids[r], 3 * timeout_ms);
        CHECK_MSG(rc == 0, "survivor rank %d exited %d (-1: hung)", r, rc);
        char want[96];
        snprintf(want, sizeof want, "rank %d (pid %d) died during %s", victim, (int)pids[victim],
                 coll->name);
        CHECK_MSG(strstr(reports[r].msg, want), "rank %d's error does not say \"%s\": %s", r, want,
                  reports[r].msg);
        double took = reports[r].fail_ms - killed_at;
        CHECK_MSG(reports[r].failed && took < timeout_ms / 2,
                  "rank %d noticed the death after %.0f ms (timeout %d)", r, took, timeout_ms);
    }
    waitpid(pids[victim], NULL, 0);
    CHECK_MSG(!segment_exists(name), "%s left behind", name);
}

// ---------------------------------------------------------------- ranks that never arrive

static int body_nothing(Comm *c, void *ctx) {
    (void)c;
    (void)ctx;
    return 0;
}

// Rank 0 alone: comm_create must time out naming rank 1, and unlink its segment.
static void test_rank_never_joins(void) {
    char name[96];
    unique_name(name, sizeof name, "nojoin");
    reset_reports();
    CommConfig cfg = group_config(name, 2, 0, 500, 0);
    double t0 = now_ms();
    int rc = wait_child(spawn(&cfg, body_nothing, NULL), 5000);
    double took = now_ms() - t0;
    CHECK_MSG(rc == 3, "rank 0 exited %d, want 3 (comm_create failed)", rc);
    CHECK_MSG(strstr(reports[0].msg, "timed out after 500 ms waiting for rank 1 to join"),
              "message: %s", reports[0].msg);
    CHECK_MSG(took < 3 * 500, "took %.0f ms", took);
    CHECK_MSG(!segment_exists(name), "%s left behind", name);
}

// Rank 1 alone: it must time out waiting for rank 0's segment.
static void test_rank0_never_creates(void) {
    char name[96];
    unique_name(name, sizeof name, "norank0");
    reset_reports();
    CommConfig cfg = group_config(name, 2, 1, 300, 0);
    int rc = wait_child(spawn(&cfg, body_nothing, NULL), 5000);
    CHECK_MSG(rc == 3, "rank 1 exited %d, want 3", rc);
    CHECK_MSG(strstr(reports[1].msg, "timed out after 300 ms waiting for rank 0 to create"),
              "message: %s", reports[1].msg);
}

// Rank 1 joins but is late to the first all_reduce: rank 0 times out naming
// it; rank 1, arriving once rank 0 has failed, fails too instead of waiting for
// nobody.
static int body_late_rank1(Comm *c, void *ctx) {
    const Collective *coll = ctx;
    void *buf = calloc(1, COLL_BYTES);
    Err err;
    double until = now_ms() + 60000;
    while (comm_rank(c) == 1 && !__atomic_load_n(&reports[0].failed, __ATOMIC_ACQUIRE) &&
           now_ms() < until)
        sleep_ms(1);
    int rc = coll->call(c, buf, &err);
    free(buf);
    if (rc == 0) return 1;
    report_failure(comm_rank(c), &err);
    return 0;
}

static void test_rank_late_to_collective(const Collective *coll) {
    char name[96], want[64];
    unique_name(name, sizeof name, "late");
    snprintf(want, sizeof want, "in %s", coll->name);
    double t0 = now_ms();
    int bad = run_group(name, 2, 1000, 0, body_late_rank1, (void *)coll);
    CHECK_MSG(bad == 0, "%s: %d rank(s) did not fail cleanly", coll->name, bad);
    CHECK_MSG(strstr(reports[0].msg, "timed out after 1000 ms waiting for rank 1 (pid ") &&
                  strstr(reports[0].msg, want),
              "rank 0: %s", reports[0].msg);
    CHECK_MSG(reports[0].fail_ms - t0 < 3 * 1000, "rank 0 failed after %.0f ms",
              reports[0].fail_ms - t0);
    CHECK_MSG(strstr(reports[1].msg, "rank 0"), "rank 1: %s", reports[1].msg);
}

// ---------------------------------------------------------------- stale segments

static int body_one_all_reduce(Comm *c, void *ctx) {
    (void)ctx;
    float x[3] = {1, 2, (float)comm_rank(c)};
    Err err;
    if (comm_all_reduce(c, x, 3, DT_F32, COMM_SUM, &err)) return fail_call(c, &err);
    int W = comm_world_size(c);
    return !(x[0] == W && x[1] == 2 * W && x[2] == W * (W - 1) / 2);
}

static void write_garbage_segment(const char *name, size_t bytes) {
    int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
    CHECK(fd >= 0);
    if (fd < 0) return;
    unsigned char page[4096];
    for (size_t i = 0; i < sizeof page; i++)
        page[i] = (unsigned char)(i * 131 + 7);
    for (size_t off = 0; off < bytes; off += sizeof page)
        CHECK(write(fd, page, sizeof page) == (ssize_t)sizeof page);
    close(fd);
}

static void test_stale_garbage(void) {
    char name[96];
    unique_name(name, sizeof name, "garbage");
    write_garbage_segment(name, 1 << 20);
    CHECK(segment_exists(name));
    int bad = run_group(name, 3, 5000, 0, body_one_all_reduce, NULL);
    CHECK_MSG(bad == 0, "group over a garbage segment: %d rank(s) failed", bad);
    CHECK_MSG(!segment_exists(name), "%s left behind", name);
}

// A crashed run: rank 0 created a valid segment and was killed. A new rank 1
// that comes first must not attach to it; the new group must work.
static void test_stale_crashed_run(void) {
    char name[96];
    unique_name(name, sizeof name, "crashed");
    reset_reports();
    CommConfig old0 = group_config(name, 2, 0, 30000, 0);
    pid_t old = spawn(&old0, body_nothing, NULL);
    // Asleep waiting for rank 1 to join: past its ftruncate and header.
    CHECK_MSG(wait_sleeping(old, 20000), "the crashed run's rank 0 never waited for rank 1");
    kill(old, SIGKILL);
    waitpid(old, NULL, 0);
    CHECK_MSG(segment_exists(name), "the crashed run left no segment: the test proves nothing");
    reset_reports();
    CommConfig c1 = group_config(name, 2, 1, 5000, 0), c0 = group_config(name, 2, 0, 5000, 0);
    pid_t p1 = spawn(&c1, body_one_all_reduce, NULL);
    // Rank 1 sees the stale segment first: asleep between two tries to attach.
    CHECK_MSG(wait_sleeping(p1, 20000), "rank 1 never waited for a usable segment");
    pid_t p0 = spawn(&c0, body_one_all_reduce, NULL);
    CHECK_MSG(wait_child(p0, 20000) == 0, "rank 0: %s", reports[0].msg);
    CHECK_MSG(wait_child(p1, 20000) == 0, "rank 1: %s", reports[1].msg);
    CHECK_MSG(!segment_exists(name), "%s left behind", name);
}

// ---------------------------------------------------------------- mismatched calls

// Rank 0: all_reduce(n=10); rank 1: all_reduce(n=9) (kind 0), all_gather(n=10) (kind 1) or
// all_to_all (kind 2).
static int body_mismatch(Comm *c, void *ctx) {
    const int *kind = ctx;
    float a[10] = {0}, b[20];
    Err err;
    int rc;
    if (comm_rank(c) == 0)
        rc = comm_all_reduce(c, a, 10, DT_F32, COMM_SUM, &err);
    else if (*kind == 0)
        rc = comm_all_reduce(c, a, 9, DT_F32, COMM_SUM, &err);
    else if (*kind == 1)
        rc = comm_all_gather(c, a, b, 10, DT_F32, &err);
    else
        rc = comm_all_to_all(c, a, (size_t[2]){4, 4}, b, (size_t[2]){4, 4}, &err);
    if (rc == 0) return 1;
    report_failure(comm_rank(c), &err);
    return 0;
}

static void test_mismatched_calls(void) {
    int kinds[3] = {0, 1, 2};
    for (int k = 0; k < 3; k++) {
        char name[96];
        unique_name(name, sizeof name, "mismatch");
        int bad = run_group(name, 2, 5000, 0, body_mismatch, &kinds[k]);
        CHECK_MSG(bad == 0, "kind %d: %d rank(s) did not fail", k, bad);
        for (int r = 0; r < 2; r++)
            CHECK_MSG(strstr(reports[r].msg, "called all_reduce(n=10"), "kind %d rank %d: %s", k, r,
                      reports[r].msg);
    }
}

// ---------------------------------------------------------------- point-to-point

// One group: `bytes` to the next rank, the same from the previous one; odd seeds through
// comm_p2p_start and comm_wait (on shm the same transfers, done by the start).
static int ring_exchange(Comm *c, size_t bytes, uint32_t seed) {
    int me = comm_rank(c), W = comm_world_size(c), next = (me + 1) % W, prev = (me + W - 1) % W;
    unsigned char *out = message(seed, me, bytes), *in = malloc(bytes + 1);
    Err err;
    CommP2p ops[2] = {{.peer = next, .send = 1, .buf = out, .bytes = bytes},
                      {.peer = prev, .send = 0, .buf = in, .bytes = bytes}};
    int rc = seed % 2 ? comm_p2p_start(c, ops, 2, &err) || comm_join(c, &err) || comm_wait(c, &err)
                      : comm_p2p(c, ops, 2, &err);
    int bad = rc ? fail_call(c, &err) : check_message(c, in, seed, prev, bytes);
    free(out);
    free(in);
    return bad;
}

static int body_ring(Comm *c, void *ctx) {
    const SizesCtx *sz = ctx;
    for (int k = 0; k < sz->nsizes; k++)
        if (ring_exchange(c, sz->sizes[k], 100 + k)) return 1;
    return 0;
}

static void test_p2p_ring(int world) {
    char name[96];
    unique_name(name, sizeof name, "p2pring");
    // A 4 KiB ring: 0 bytes (a transfer all the same), 1, odd sizes, 3 MiB through it.
    SizesCtx sizes = {{0, 1, 37, 4096 * 3 + 5, (3 << 20) + 1}, 5};
    int bad = run_group(name, world, 20000, 4096, body_ring, &sizes);
    CHECK_MSG(bad == 0, "p2p ring of %d ranks: %d rank(s) failed", world, bad);
    char pair[128];
    snprintf(pair, sizeof pair, "%s-p0-1", name);
    CHECK_MSG(!segment_exists(name) && !segment_exists(pair), "%s's segments left behind", name);
}

// Both ranks send 4 rings' worth to each other in one group, the send first: only transfers
// that progress together complete.
static int body_both_ways(Comm *c, void *ctx) {
    (void)ctx;
    return ring_exchange(c, 4 * 4096 + 3, 7);
}

static void test_p2p_both_ways(void) {
    char name[96];
    unique_name(name, sizeof name, "p2pboth");
    int bad = run_group(name, 2, 20000, 4096, body_both_ways, NULL);
    CHECK_MSG(bad == 0, "two ranks sending each other 4 rings: %d rank(s) failed", bad);
}

// 20 messages alternating in direction, of varying sizes, then three in one group of rank
// 0's taken by three separate receives: they arrive in order.
static const size_t FIFO_SIZES[20] = {5,    0,    4096, 1,  9001, 63, 4095, 17, 0,   12345,
                                      4097, 8192, 2,    77, 0,    3,  5000, 1,  640, 20000};

static int fifo_one(Comm *c, int k, size_t bytes, int sending) {
    int me = comm_rank(c), peer = 1 - me;
    // 0 bytes from and into NULL: a transfer all the same.
    unsigned char *buf = !bytes ? NULL : sending ? message(200 + k, me, bytes) : malloc(bytes);
    Err err;
    int rc = sending ? comm_send(c, buf, bytes, peer, &err) : comm_recv(c, buf, bytes, peer, &err);
    int bad = rc ? fail_call(c, &err) : !sending && check_message(c, buf, 200 + k, peer, bytes);
    free(buf);
    return bad;
}

static int body_fifo(Comm *c, void *ctx) {
    (void)ctx;
    int me = comm_rank(c);
    for (int k = 0; k < 20; k++)
        if (fifo_one(c, k, FIFO_SIZES[k], (k % 2) == me)) return 1;
    if (me == 1) {
        for (int k = 20; k < 23; k++)
            if (fifo_one(c, k, FIFO_SIZES[k - 20] * 3, 0)) return 1;
        return 0;
    }
    unsigned char *m[3];
    CommP2p ops[3];
    for (int k = 0; k < 3; k++) {
        m[k] = message(220 + k, 0, FIFO_SIZES[k] * 3);
        ops[k] = (CommP2p){.peer = 1, .send = 1, .buf = m[k], .bytes = FIFO_SIZES[k] * 3};
    }
    Err err;
    int bad = comm_p2p(c, ops, 3, &err) ? fail_call(c, &err) : 0;
    for (int k = 0; k < 3; k++)
        free(m[k]);
    return bad;
}

static void test_p2p_fifo(void) {
    char name[96];
    unique_name(name, sizeof name, "p2pfifo");
    int bad = run_group(name, 2, 20000, 4096, body_fifo, NULL);
    CHECK_MSG(bad == 0, "FIFO sequence: %d rank(s) failed", bad);
}

// Rank 0 sends 100 bytes, rank 1 expects 99: both fail, naming both sizes.
static int body_size_mismatch(Comm *c, void *ctx) {
    (void)ctx;
    unsigned char buf[100] = {0};
    Err err;
    int rc = comm_rank(c) == 0 ? comm_send(c, buf, 100, 1, &err) : comm_recv(c, buf, 99, 0, &err);
    if (rc == 0) return 1;
    report_failure(comm_rank(c), &err);
    return 0;
}

static void test_p2p_size_mismatch(void) {
    char name[96];
    unique_name(name, sizeof name, "p2psize");
    int bad = run_group(name, 2, 5000, 0, body_size_mismatch, NULL);
    CHECK_MSG(bad == 0, "size mismatch: %d rank(s) did not fail", bad);
    for (int r = 0; r < 2; r++)
        CHECK_MSG(strstr(reports[r].msg, "sends 100") && strstr(reports[r].msg, "receives 99"),
                  "rank %d: %s", r, reports[r].msg);
}

// Rank 1 gets one message from rank 0, then waits for a second that never comes: rank 0
// sleeps until it is killed (mid-wait) or, silent, until rank 1 has failed.
static int body_second_message(Comm *c, void *ctx) {
    const int *killed = ctx;
    unsigned char buf[64];
    Err err;
    if (comm_rank(c) == 0) {
        if (comm_send(c, buf, sizeof buf, 1, &err)) return fail_call(c, &err);
        double until = now_ms() + 30000;
        while ((*killed || !__atomic_load_n(&reports[1].failed, __ATOMIC_ACQUIRE)) &&
               now_ms() < until)
            sleep_ms(1);
        return *killed;
    }
    if (comm_recv(c, buf, sizeof buf, 0, &err)) return fail_call(c, &err);
    reports[1].started = 2; // in the second receive
    if (comm_recv(c, buf, sizeof buf, 0, &err) == 0) return 1;
    report_failure(1, &err);
    return 0;
}

static void test_p2p_peer_killed(void) {
    char name[96];
    unique_name(name, sizeof name, "p2pkill");
    int timeout_ms = 4000, killed = 1;
    reset_reports();
    pid_t pids[2];
    for (int r = 0; r < 2; r++) {
        CommConfig cfg = group_config(name, 2, r, timeout_ms, 0);
        pids[r] = spawn(&cfg, body_second_message, &killed);
    }
    double until = now_ms() + 10000;
    while (reports[1].started != 2 && now_ms() < until)
        sleep_ms(1);
    sleep_ms(50); // well into the wait
    double killed_at = now_ms();
    kill(pids[0], SIGKILL);
    CHECK_MSG(wait_child(pids[1], 3 * timeout_ms) == 0, "rank 1 did not fail cleanly: %s",
              reports[1].msg);
    char want[64];
    snprintf(want, sizeof want, "rank 0 (pid %d) died during p2p", (int)pids[0]);
    CHECK_MSG(strstr(reports[1].msg, want), "rank 1's error does not say \"%s\": %s", want,
              reports[1].msg);
    double took = reports[1].fail_ms - killed_at;
    CHECK_MSG(took < timeout_ms / 2, "rank 1 noticed the death after %.0f ms", took);
    waitpid(pids[0], NULL, 0);
    char pair[128];
    snprintf(pair, sizeof pair, "%s-p0-1", name);
    CHECK_MSG(!segment_exists(name) && !segment_exists(pair), "%s's segments left behind", name);
}

static void test_p2p_never_sends(void) {
    char name[96];
    unique_name(name, sizeof name, "p2psilent");
    int killed = 0;
    double t0 = now_ms();
    int bad = run_group(name, 2, 500, 0, body_second_message, &killed);
    CHECK_MSG(bad == 0, "silent peer: %d rank(s) did not end cleanly", bad);
    CHECK_MSG(strstr(reports[1].msg, "timed out after 500 ms waiting for rank 0 (pid ") &&
                  strstr(reports[1].msg, "in p2p"),
              "rank 1: %s", reports[1].msg);
    double took = reports[1].fail_ms - t0;
    CHECK_MSG(took >= 500 && took < 5000, "rank 1 failed after %.0f ms", took);
}

// ---------------------------------------------------------------- sub-communicators

// 4 ranks, colors rank % 2, keys reversed: {0, 2} and {1, 3}, each in descending rank order.
static int body_split(Comm *c, void *ctx) {
    (void)ctx;
    int me = comm_rank(c), W = comm_world_size(c);
    Comm *sub;
    Err err;
    if (comm_split(c, me % 2, W - me, &sub, &err)) return fail_call(c, &err);
    int want_rank = me < 2 ? 1 : 0, bad = comm_rank(sub) != want_rank || comm_world_size(sub) != 2;
    float x = (float)(me + 1), ranks[2], mine = (float)me;
    if (!bad && (comm_all_reduce(sub, &x, 1, DT_F32, COMM_SUM, &err) ||
                 comm_all_gather(sub, &mine, ranks, 1, DT_F32, &err)))
        bad = fail_call(sub, &err);
    else if (!bad)
        bad = x != (me % 2 ? 2 + 4 : 1 + 3) || ranks[0] != (float)(me % 2 + 2) ||
              ranks[1] != (float)(me % 2);
    if (bad)
        fprintf(stderr, "rank %d: sub rank %d/%d, sum %g\n", me, comm_rank(sub),
                comm_world_size(sub), (double)x);
    bad = bad || ring_exchange(sub, 5000, 300 + me % 2) || ring_exchange(c, 333, 400);
    comm_destroy(sub);
    return bad;
}

static void test_split(void) {
    char name[96];
    unique_name(name, sizeof name, "split");
    int bad = run_group(name, 4, 10000, 1024, body_split, NULL);
    CHECK_MSG(bad == 0, "split: %d rank(s) failed", bad);
    const char *left[] = {"-g0", "-g1", "-g0-p0-1", "-g1-p0-1", "-p0-1"};
    for (int k = 0; k < 5; k++) {
        char seg[128];
        snprintf(seg, sizeof seg, "%s%s", name, left[k]);
        CHECK_MSG(!segment_exists(seg), "%s left behind", seg);
    }
    // A rank killed before its cleanup leaves them: the run's comm_shm_remove takes them too.
    for (int k = 0; k < 5; k++) {
        char seg[128];
        snprintf(seg, sizeof seg, "%s%s", name, left[k]);
        write_garbage_segment(seg, 4096);
    }
    comm_shm_remove(name);
    for (int k = 0; k < 5; k++) {
        char seg[128];
        snprintf(seg, sizeof seg, "%s%s", name, left[k]);
        CHECK_MSG(!segment_exists(seg), "%s survived comm_shm_remove", seg);
    }
}

// ---------------------------------------------------------------- all-to-all

// Bytes rank `from` sends rank `to` in exchange `seed` of a group of `world`: the same table on
// every rank. Seed 0: nothing at all (NULL buffers); seed 1: only `big` bytes from the last rank
// to rank 0 (one part of many chunks, the others idle); else a mix of 0, small, around the
// 1 KiB chunk and several chunks.
static size_t a2a_size(uint32_t seed, size_t big, int world, int from, int to) {
    static const size_t SIZES[] = {0, 1, 63, 64, 1000, 1024, 1025, 3001, 9000};
    if (seed == 0) return 0;
    if (seed == 1) return from == world - 1 && to == 0 ? big : 0;
    uint32_t h = seed * 2654435761u ^ (uint32_t)(from * world + to + 1) * 2246822519u;
    h ^= h >> 15;
    h *= 2654435761u;
    return SIZES[(h >> 16) % (sizeof SIZES / sizeof SIZES[0])];
}

// Part `seed` of `from` for `to`: its bytes differ from every other part's.
static uint32_t part_seed(uint32_t seed, int to) {
    return 1000 + seed * MAX_WORLD + (uint32_t)to;
}

#define A2A_GUARD 64 // bytes past recv that must stay untouched

// The parts of rank `me` to (to_me 0) or from (to_me 1) every rank; returns their sum.
static size_t a2a_sizes(uint32_t seed, size_t big, int W, int me, int to_me, size_t *out) {
    size_t total = 0;
    for (int r = 0; r < W; r++)
        total += out[r] = to_me ? a2a_size(seed, big, W, r, me) : a2a_size(seed, big, W, me, r);
    return total;
}

// recv holds every rank's part for me, and nothing past its end moved.
static int check_a2a_recv(Comm *c, const unsigned char *recv, const size_t *rb, size_t total,
                          uint32_t seed) {
    int me = comm_rank(c);
    size_t at = 0;
    for (int q = 0; q < comm_world_size(c); at += rb[q++])
        if (check_message(c, recv + at, part_seed(seed, me), q, rb[q])) return 1;
    for (size_t i = 0; i < A2A_GUARD; i++)
        if (recv[total + i] != 0xa5) {
            fprintf(stderr, "rank %d: all_to_all %u wrote past recv's %zu bytes\n", me, seed,
                    total);
            return 1;
        }
    return 0;
}

// One all_to_all of exchange `seed` on c, every byte checked; send must come back unchanged.
static int a2a_exchange(Comm *c, uint32_t seed, size_t big) {
    int me = comm_rank(c), W = comm_world_size(c);
    size_t sb[MAX_WORLD], rb[MAX_WORLD];
    size_t st = a2a_sizes(seed, big, W, me, 0, sb), rt = a2a_sizes(seed, big, W, me, 1, rb);
    unsigned char *send = seed ? malloc(st + 1) : NULL,
                  *recv = seed ? malloc(rt + A2A_GUARD) : NULL;
    if (seed && (!send || !recv)) exit(1);
    size_t at = 0;
    for (int r = 0; seed && r < W; at += sb[r++])
        for (size_t i = 0; i < sb[r]; i++)
            send[at + i] = byte_of(part_seed(seed, r), me, i);
    if (recv) memset(recv, 0xa5, rt + A2A_GUARD);
    Err err;
    int bad = comm_all_to_all(c, send, sb, recv, rb, &err) ? fail_call(c, &err)
              : seed                                       ? check_a2a_recv(c, recv, rb, rt, seed)
                                                           : 0;
    at = 0;
    for (int r = 0; !bad && seed && r < W; at += sb[r++])
        bad = check_message(c, send + at, part_seed(seed, r), me, sb[r]);
    free(send);
    free(recv);
    return bad;
}

// Exchanges 0..9, a barrier after the odd ones (another collective between them).
static int body_all_to_all(Comm *c, void *ctx) {
    size_t big = *(const size_t *)ctx;
    Err err;
    for (uint32_t seed = 0; seed < 10; seed++) {
        if (a2a_exchange(c, seed, big)) return 1;
        if (seed % 2 && comm_barrier(c, &err)) return fail_call(c, &err);
    }
    return 0;
}

static void test_all_to_all(int world, size_t chunk, size_t big) {
    char name[96];
    unique_name(name, sizeof name, "a2a");
    int bad = run_group(name, world, 20000, chunk, body_all_to_all, &big);
    CHECK_MSG(bad == 0, "all_to_all, world %d chunk %zu: %d rank(s) failed", world, chunk, bad);
    CHECK_MSG(!segment_exists(name), "%s left behind", name);
}

// Rank 2 sends rank 1 100 bytes where rank 1 expects 99; every other part is 10 bytes.
static int body_a2a_mismatch(Comm *c, void *ctx) {
    (void)ctx;
    int me = comm_rank(c);
    size_t sb[3] = {10, 10, 10}, rb[3] = {10, 10, 10};
    if (me == 2) sb[1] = 100;
    if (me == 1) rb[2] = 99;
    unsigned char send[120] = {0}, recv[120];
    Err err;
    if (comm_all_to_all(c, send, sb, recv, rb, &err) == 0) return 1;
    report_failure(me, &err);
    return 0;
}

static void test_a2a_size_mismatch(void) {
    char name[96];
    unique_name(name, sizeof name, "a2asize");
    double t0 = now_ms();
    int bad = run_group(name, 3, 5000, 0, body_a2a_mismatch, NULL);
    CHECK_MSG(bad == 0, "all_to_all size mismatch: %d rank(s) did not fail", bad);
    const char *want =
        "all_to_all: rank 2 sends 100 bytes to rank 1, which receives 99 from rank 2";
    for (int r = 0; r < 3; r++) {
        CHECK_MSG(strstr(reports[r].msg, want), "rank %d: %s", r, reports[r].msg);
        CHECK_MSG(reports[r].fail_ms - t0 < 2500, "rank %d failed after %.0f ms (timeout 5000)", r,
                  reports[r].fail_ms - t0);
    }
}

// COLL_BYTES: the first half sent, 20000 bytes to each rank; the second half received.
static int one_all_to_all(Comm *c, void *buf, Err *err) {
    size_t bytes[MAX_WORLD] = {20000, 20000, 20000, 20000};
    return comm_all_to_all(c, buf, bytes, (char *)buf + COLL_BYTES / 2, bytes, err);
}

static const Collective ALL_TO_ALL = {"all_to_all", one_all_to_all};

// 4 ranks: groups {0, 1, 2} and {3} (a group of one: its own part only), then {0, 2} and
// {1, 3}; exchanges in each, and in the world between them.
static int body_a2a_split(Comm *c, void *ctx) {
    size_t big = *(const size_t *)ctx;
    int me = comm_rank(c);
    Comm *sub;
    Err err;
    for (int k = 0; k < 2; k++) {
        int color = k == 0 ? me == 3 : me % 2;
        if (comm_split(c, color, me, &sub, &err)) return fail_call(c, &err);
        int bad = 0;
        for (uint32_t seed = 0; seed < 6 && !bad; seed++)
            bad = a2a_exchange(sub, seed + 10 * (uint32_t)k, big);
        comm_destroy(sub);
        if (bad || a2a_exchange(c, 7 + (uint32_t)k, big)) return 1;
    }
    return 0;
}

static void test_a2a_split(void) {
    char name[96];
    unique_name(name, sizeof name, "a2asplit");
    size_t big = 50000;
    int bad = run_group(name, 4, 20000, 1024, body_a2a_split, &big);
    CHECK_MSG(bad == 0, "all_to_all in sub-communicators: %d rank(s) failed", bad);
    CHECK_MSG(!segment_exists(name), "%s left behind", name);
}

// ---------------------------------------------------------------- bad configs and arguments

static void expect_create_error(CommConfig cfg, const char *want) {
    Comm *c = NULL;
    Err err = {0};
    CHECK_MSG(comm_create(&c, &cfg, &err) == -1 && c == NULL, "no error, want \"%s\"", want);
    CHECK_MSG(strstr(err.msg, want), "got \"%s\", want \"%s\"", err.msg, want);
}

static void test_bad_configs(void) {
    CommConfig ok = group_config("/astrai-test-bad", 1, 0, 1000, 0);
    CommConfig cfg = ok;
    cfg.backend = "mpi";
    expect_create_error(cfg,
                        "unknown backend \"mpi\" (want \"shm\", \"gloo\", \"hier\" or \"nccl\")");
    cfg = ok, cfg.rank = 2, cfg.world_size = 2;
    expect_create_error(cfg, "rank 2 is outside 0..1");
    cfg = ok, cfg.world_size = 0;
    expect_create_error(cfg, "world_size 0 must be at least 1");
    cfg = ok, cfg.timeout_ms = 0;
    expect_create_error(cfg, "timeout_ms 0 must be positive");
    cfg = ok, cfg.shm_name = "astrai-no-slash";
    expect_create_error(cfg, "shm_name \"astrai-no-slash\" must be");
    cfg = ok, cfg.shm_name = NULL;
    expect_create_error(cfg, "shm_name \"(null)\"");
    cfg = ok, cfg.shm_chunk_bytes = 100;
    expect_create_error(cfg, "shm_chunk_bytes 100 must be a multiple of 64");
}

// A fresh world-1 Comm refuses comm_p2p(&op, n) with `want`, and is unusable after.
static void expect_p2p_error(const CommConfig *cfg, CommP2p op, int n, const char *want) {
    Comm *c;
    Err err = {0};
    if (comm_create(&c, cfg, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    CHECK_MSG(comm_p2p(c, &op, n, &err) == -1 && strstr(err.msg, want), "got \"%s\", want \"%s\"",
              err.msg, want);
    CHECK(comm_barrier(c, &err) == -1);
    comm_destroy(c);
}

// A fresh world-1 Comm refuses comm_all_to_all with `want`, and is unusable after.
static void expect_a2a_error(const CommConfig *cfg, const void *send, const size_t *sb, void *recv,
                             const size_t *rb, const char *want) {
    Comm *c;
    Err err = {0};
    if (comm_create(&c, cfg, &err)) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    CHECK_MSG(comm_all_to_all(c, send, sb, recv, rb, &err) == -1 && strstr(err.msg, want),
              "got \"%s\", want \"%s\"", err.msg, want);
    CHECK(comm_barrier(c, &err) == -1);
    comm_destroy(c);
}

// World 1: its own part copied; sizes that differ, NULL buffers or size lists, overlap.
static void test_a2a_bad_arguments(const CommConfig *cfg) {
    Comm *c;
    Err err = {0};
    unsigned char in[8] = "abcdefg", out[8] = {0};
    size_t five = 5, four = 4, none = 0;
    CHECK_MSG(comm_create(&c, cfg, &err) == 0, "%s", err.msg);
    CHECK(comm_all_to_all(c, in, &five, out, &five, &err) == 0 && !memcmp(out, "abcde", 6));
    CHECK(comm_all_to_all(c, NULL, &none, NULL, &none, &err) == 0);
    comm_destroy(c);
    expect_a2a_error(cfg, in, &five, out, &four,
                     "all_to_all: rank 0 sends 5 bytes to rank 0, which receives 4 from rank 0");
    expect_a2a_error(cfg, NULL, &five, out, &five, "all_to_all: send is NULL for 5 bytes");
    expect_a2a_error(cfg, in, &five, NULL, &five, "all_to_all: recv is NULL for 5 bytes");
    expect_a2a_error(cfg, in, NULL, out, &five, "all_to_all: send_bytes is NULL (want 1 sizes)");
    expect_a2a_error(cfg, in, &five, out, NULL, "all_to_all: recv_bytes is NULL");
    expect_a2a_error(cfg, in, &five, in + 4, &five, "bytes) overlap");
}

// World 1 runs in this process: argument errors, and a Comm unusable after one.
static void test_bad_arguments(void) {
    char name[96];
    unique_name(name, sizeof name, "args");
    CommConfig cfg = group_config(name, 1, 0, 1000, 0);
    Comm *c;
    Err err = {0};
    int created = comm_create(&c, &cfg, &err) == 0;
    CHECK_MSG(created, "%s", err.msg);
    if (!created) return;
    float x[4] = {1, 2, 3, 4}, y[4];
    CHECK(comm_all_reduce(c, x, 4, DT_F32, COMM_AVG, &err) == 0 && x[3] == 4);
    CHECK(comm_all_gather(c, x, y, 4, DT_F32, &err) == 0 && y[2] == 3);
    CHECK(comm_broadcast(c, NULL, 0, 0, &err) == 0);
    CHECK(comm_all_reduce(c, NULL, 0, DT_F32, COMM_SUM, &err) == 0);
    CHECK(comm_reduce_scatter(c, NULL, NULL, 0, DT_F32, COMM_SUM, &err) == 0);
    CHECK(comm_all_gather(c, NULL, NULL, 0, DT_F32, &err) == 0);
    CHECK(comm_broadcast(c, x, 4, 1, &err) == -1);
    CHECK_MSG(strstr(err.msg, "broadcast: root 1 is outside 0..0"), "%s", err.msg);
    CHECK(comm_barrier(c, &err) == -1);
    CHECK_MSG(strstr(err.msg, "comm unusable after an earlier error"), "%s", err.msg);
    comm_destroy(c);

    CHECK(comm_create(&c, &cfg, &err) == 0);
    CHECK(comm_all_reduce(c, NULL, 3, DT_F32, COMM_SUM, &err) == -1);
    CHECK_MSG(strstr(err.msg, "all_reduce: buf is NULL for 3 elements"), "%s", err.msg);
    comm_destroy(c);

    CHECK(comm_create(&c, &cfg, &err) == 0);
    CHECK(comm_reduce_scatter(c, x, y, 4, DT_F32, (CommOp)7, &err) == -1);
    CHECK_MSG(strstr(err.msg, "reduce_scatter: op 7 is not COMM_SUM or COMM_AVG"), "%s", err.msg);
    comm_destroy(c);

    // The overlapped forms complete at once on shm; join and wait have nothing to do.
    CHECK(comm_create(&c, &cfg, &err) == 0);
    float z[4] = {0};
    CHECK(comm_reduce_scatter_start(c, x, z, 4, DT_F32, COMM_SUM, &err) == 0 && z[2] == x[2]);
    CHECK(comm_all_gather_start(c, x, y, 4, DT_F32, &err) == 0 && y[3] == x[3]);
    CHECK(comm_join(c, &err) == 0 && comm_wait(c, &err) == 0);
    comm_destroy(c);

    // CPU ranks reduce fp32: a bf16 reduction is refused, naming the dtype.
    CHECK(comm_create(&c, &cfg, &err) == 0);
    CHECK(comm_all_reduce(c, x, 4, DT_BF16, COMM_SUM, &err) == -1);
    CHECK_MSG(strstr(err.msg, "all_reduce: the shm backend reduces fp32 only, not bf16"), "%s",
              err.msg);
    comm_destroy(c);

    // Point-to-point needs another rank; a split of one rank is a Comm of one.
    Comm *sub = NULL;
    CHECK(comm_create(&c, &cfg, &err) == 0);
    CHECK_MSG(comm_split(c, 3, 0, &sub, &err) == 0 && comm_world_size(sub) == 1, "%s", err.msg);
    CHECK(sub && comm_all_reduce(sub, x, 4, DT_F32, COMM_SUM, &err) == 0);
    comm_destroy(sub);
    CHECK(comm_split(c, -1, 0, &sub, &err) == -1 && sub == NULL);
    CHECK_MSG(strstr(err.msg, "comm_split: color -1 must be >= 0"), "%s", err.msg);
    comm_destroy(c);
    expect_p2p_error(&cfg, (CommP2p){.peer = 0, .send = 1, .buf = x, .bytes = 4}, 1,
                     "p2p: transfer 0's peer 0 is not another rank of 0..0 (this is 0)");
    expect_p2p_error(&cfg, (CommP2p){.peer = 5, .send = 0, .buf = x, .bytes = 4}, 1,
                     "transfer 0's peer 5 is not another rank");
    expect_p2p_error(&cfg, (CommP2p){.peer = -1, .send = 0, .buf = x, .bytes = 4}, 1,
                     "transfer 0's peer -1 is not another rank");
    expect_p2p_error(&cfg, (CommP2p){.peer = 0, .send = 0, .buf = NULL, .bytes = 5}, 1,
                     "p2p: transfer 0's buf (from rank 0) is NULL for 5 bytes");
    expect_p2p_error(&cfg, (CommP2p){0}, -1, "p2p: -1 transfers (want at least 1)");
    expect_p2p_error(&cfg, (CommP2p){0}, 0, "p2p: 0 transfers (want at least 1)");
    test_a2a_bad_arguments(&cfg);
    CHECK_MSG(!segment_exists(name), "%s left behind", name);
    char sub_name[128];
    snprintf(sub_name, sizeof sub_name, "%s-g3", name);
    CHECK_MSG(!segment_exists(sub_name), "%s left behind", sub_name);
}

int main(void) {
    reports = mmap(NULL, MAX_WORLD * sizeof *reports, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (reports == MAP_FAILED) return 1;
    // A 1 KiB chunk (256 floats): 1000 floats take several steps, misaligned.
    SizesCtx small = {{0, 1, 37, 1000}, 4};
    for (int world = 2; world <= 4; world++)
        test_collectives(world, 1024, small);
    // The default chunk, with a buffer of two and a bit chunks.
    SizesCtx big = {{COMM_SHM_DEFAULT_CHUNK / sizeof(float) * 2 + 5}, 1};
    test_collectives(2, 0, big);
    test_peer_killed(3, 2, &ALL_REDUCE);
    test_peer_killed(2, 0, &ALL_REDUCE);
    test_rank_never_joins();
    test_rank0_never_creates();
    test_rank_late_to_collective(&ALL_REDUCE);
    test_stale_garbage();
    test_stale_crashed_run();
    test_mismatched_calls();
    for (int world = 2; world <= 4; world++)
        test_p2p_ring(world);
    test_p2p_both_ways();
    test_p2p_fifo();
    test_p2p_size_mismatch();
    test_p2p_peer_killed();
    test_p2p_never_sends();
    test_split();
    // A 1 KiB chunk: parts of 0 to 9000 bytes, and one of 50000 alone.
    for (int world = 2; world <= 4; world++)
        test_all_to_all(world, 1024, 50000);
    test_all_to_all(2, 0, 2 * COMM_SHM_DEFAULT_CHUNK + 5); // the default chunk, a part of 2+
    test_a2a_size_mismatch();
    test_peer_killed(3, 1, &ALL_TO_ALL);
    test_rank_late_to_collective(&ALL_TO_ALL);
    test_a2a_split();
    test_bad_configs();
    test_bad_arguments();
    CHECK_DONE();
}
