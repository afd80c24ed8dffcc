// test_comm_gloo.c: the gloo collectives with real processes (forked ranks on 127.0.0.1):
// reductions against sums computed here and bitwise equal on every rank, gathers, broadcasts
// from each root, all-to-all of random sizes, point-to-point rings, FIFO order and sizes that
// differ, sub-communicators; a peer killed mid-collective, a rank that never comes, bad configs.
//
// The CommExchange of the connect is files (comm_gloo_util.h).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "comm/comm.h"
#include "comm_gloo_util.h"

// ---------------------------------------------------------------- all-to-all

// Bytes `from` sends `to` in exchange `seed`: 0 for about a third of the pairs, else up to 70000.
static size_t a2a_size(uint32_t seed, int from, int to) {
    uint32_t h = (seed * 2654435761u ^ (uint32_t)from * 40503u ^ (uint32_t)to * 97u) * 2246822519u;
    h ^= h >> 15;
    return h % 3 == 0 ? 0 : h % 70001;
}

static int a2a_exchange(Comm *c, uint32_t seed) {
    int me = comm_rank(c), W = comm_world_size(c);
    size_t sb[MAX_WORLD], rb[MAX_WORLD], st = 0, rt = 0;
    for (int r = 0; r < W; r++) {
        st += sb[r] = a2a_size(seed, me, r);
        rt += rb[r] = a2a_size(seed, r, me);
    }
    unsigned char *send = malloc(st + 1), *recv = malloc(rt + 1);
    for (int r = 0, at = 0; r < W; at += (int)sb[r++]) {
        unsigned char *part = message(seed * 16 + r, me, sb[r]);
        memcpy(send + at, part, sb[r]);
        free(part);
    }
    Err err;
    if (comm_all_to_all(c, send, sb, recv, rb, &err)) return fail_call(c, &err);
    size_t at = 0;
    for (int q = 0; q < W; at += rb[q++])
        if (check_message(c, recv + at, seed * 16 + me, q, rb[q])) return 1;
    free(send);
    free(recv);
    return 0;
}

static int body_all_to_all(Comm *c, void *ctx) {
    (void)ctx;
    for (uint32_t seed = 1; seed <= 6; seed++)
        if (a2a_exchange(c, seed)) return 1;
    return 0;
}

// Rank 1 expects 99 bytes from rank 0, which sends it 100: every rank fails naming both.
static int body_a2a_mismatch(Comm *c, void *ctx) {
    (void)ctx;
    int me = comm_rank(c);
    size_t sb[2] = {10, me ? 10 : 100}, rb[2] = {me ? 99 : 10, 10};
    static unsigned char send[200], recv[200];
    Err err;
    if (comm_all_to_all(c, send, sb, recv, rb, &err) == 0) return 1;
    report_failure(comm_rank(c), &err);
    return 0;
}

static void test_all_to_all(void) {
    for (int world = 2; world <= 4; world++)
        CHECK_MSG(run(world, body_all_to_all, NULL) == 0, "all_to_all of %d ranks failed", world);
    CHECK(run(2, body_a2a_mismatch, NULL) == 0);
    for (int r = 0; r < 2; r++)
        CHECK_MSG(strstr(reports[r].msg, "rank 0 sends 100 bytes to rank 1, which receives 99"),
                  "rank %d: %s", r, reports[r].msg);
}

// ---------------------------------------------------------------- point-to-point

// `bytes` to the next rank and from the previous one (dir 1), or the other way (dir -1).
static int ring_exchange(Comm *c, size_t bytes, uint32_t seed, int dir) {
    int me = comm_rank(c), W = comm_world_size(c);
    int to = (me + W + dir) % W, from = (me + W - dir) % W;
    unsigned char *out = message(seed, me, bytes), *in = malloc(bytes + 1);
    CommP2p ops[2] = {{.peer = to, .send = 1, .buf = out, .bytes = bytes},
                      {.peer = from, .send = 0, .buf = in, .bytes = bytes}};
    Err err;
    int bad =
        comm_p2p(c, ops, 2, &err) ? fail_call(c, &err) : check_message(c, in, seed, from, bytes);
    free(out);
    free(in);
    return bad;
}

static int body_ring(Comm *c, void *ctx) {
    (void)ctx;
    const size_t sizes[] = {0, 1, 37, (3 << 20) + 1};
    for (size_t k = 0; k < 4; k++)
        if (ring_exchange(c, sizes[k], 100 + k, 1) || ring_exchange(c, sizes[k], 200 + k, -1))
            return 1;
    return 0;
}

// 12 messages of rank 0 to rank 1 and back, alternating, then three sends in one group taken
// by three receives: they arrive in order.
static int body_fifo(Comm *c, void *ctx) {
    (void)ctx;
    const size_t sizes[12] = {5, 0, 4096, 1, 9001, 63, 70000, 17, 0, 12345, 2, 300000};
    int me = comm_rank(c), other = 1 - me;
    Err err;
    for (int k = 0; k < 12; k++) {
        int from = k % 2;
        unsigned char *m = message(300 + k, from, sizes[k]), *in = malloc(sizes[k] + 1);
        int rc = me == from ? comm_send(c, m, sizes[k], other, &err)
                            : comm_recv(c, in, sizes[k], other, &err);
        if (rc) return fail_call(c, &err);
        if (me != from && check_message(c, in, 300 + k, from, sizes[k])) return 1;
        free(m);
        free(in);
    }
    unsigned char *m[3], in[100];
    CommP2p ops[3];
    for (int k = 0; k < 3; k++) {
        m[k] = message(400 + k, 0, 10 * (k + 1));
        ops[k] = (CommP2p){.peer = 1, .send = 1, .buf = m[k], .bytes = 10 * (size_t)(k + 1)};
    }
    if (me == 0 && comm_p2p(c, ops, 3, &err)) return fail_call(c, &err);
    for (int k = 0; me == 1 && k < 3; k++) {
        if (comm_recv(c, in, 10 * (size_t)(k + 1), 0, &err)) return fail_call(c, &err);
        if (check_message(c, in, 400 + k, 0, 10 * (size_t)(k + 1))) return 1;
    }
    for (int k = 0; k < 3; k++)
        free(m[k]);
    return 0;
}

// Rank 0 sends 100 bytes, rank 1 expects 99: both fail, naming both sizes.
static int body_p2p_mismatch(Comm *c, void *ctx) {
    (void)ctx;
    static unsigned char buf[100];
    Err err;
    int rc = comm_rank(c) == 0 ? comm_send(c, buf, 100, 1, &err) : comm_recv(c, buf, 99, 0, &err);
    if (rc == 0) return 1;
    report_failure(comm_rank(c), &err);
    return 0;
}

static void test_p2p(void) {
    for (int world = 2; world <= 4; world++)
        CHECK_MSG(run(world, body_ring, NULL) == 0, "p2p ring of %d ranks failed", world);
    CHECK(run(2, body_fifo, NULL) == 0);
    CHECK(run(2, body_p2p_mismatch, NULL) == 0);
    CHECK_MSG(strstr(reports[0].msg, "rank 0 sends 100 bytes to rank 1, which receives 99"), "%s",
              reports[0].msg);
    CHECK_MSG(strstr(reports[1].msg, "rank 1 receives 99 bytes from rank 0, which sends 100"), "%s",
              reports[1].msg);
}

// ---------------------------------------------------------------- sub-communicators

// 4 ranks, colors rank % 2, keys reversed: {0, 2} and {1, 3}, each in descending rank order;
// collectives inside, then in the world again.
static int body_split(Comm *c, void *ctx) {
    (void)ctx;
    int me = comm_rank(c);
    Comm *sub;
    Err err;
    if (comm_split(c, me % 2, -me, &sub, &err)) return fail_call(c, &err);
    int want_rank = me < 2 ? 1 : 0;
    if (comm_world_size(sub) != 2 || comm_rank(sub) != want_rank) {
        fprintf(stderr, "rank %d: sub-rank %d/%d, want %d/2\n", me, comm_rank(sub),
                comm_world_size(sub), want_rank);
        return 1;
    }
    float x = (float)me;
    if (comm_all_reduce(sub, &x, 1, DT_F32, COMM_SUM, &err)) return fail_call(sub, &err);
    int bad = x != (float)(me % 2 ? 4 : 2);
    bad = bad || check_all_gather(sub, 1001, DT_F32, 7) || ring_exchange(sub, 5000, 9, 1);
    comm_destroy(sub);
    return bad || check_all_reduce(c, 1001, COMM_SUM, 3);
}

// ---------------------------------------------------------------- failures

// World 3, rank 2 (host-c) killed in the all_reduce loop: both others fail within the timeout
// naming it.
static void test_peer_killed(void) {
    Group g = {3, 3000, 1, body_until_error, NULL, NULL, NULL};
    pid_t pids[MAX_WORLD];
    char dir[64];
    spawn_connected(&g, pids, dir, sizeof dir);
    double killed_at = now_ms();
    kill(pids[2], SIGKILL);
    for (int r = 0; r < 2; r++) {
        int rc = wait_child(pids[r], 3 * g.timeout_ms);
        CHECK_MSG(rc == 0, "survivor rank %d exited %d (-1: hung)", r, rc);
        CHECK_MSG(strstr(reports[r].msg, "all_reduce") && strstr(reports[r].msg, "rank 2 (host-c)"),
                  "rank %d: %s", r, reports[r].msg);
        double took = reports[r].fail_ms - killed_at;
        CHECK_MSG(reports[r].failed && took < g.timeout_ms + 1000,
                  "rank %d noticed the death after %.0f ms (timeout %d)", r, took, g.timeout_ms);
        fprintf(stderr, "peer killed: rank %d failed after %.0f ms: %s\n", r, took, reports[r].msg);
    }
    waitpid(pids[2], NULL, 0);
    remove_dir(dir);
}

// Rank 0 of 2 alone: comm_create fails after the timeout, naming rank 1.
static void test_rank_never_comes(void) {
    Group g = {2, 1500, 0, body_until_error, NULL, NULL, NULL};
    pid_t pids[MAX_WORLD];
    char dir[64];
    double start = now_ms();
    spawn_group(&g, 1, pids, dir, sizeof dir);
    int rc = wait_child(pids[0], 10000);
    double took = now_ms() - start;
    CHECK_MSG(rc == 3 && !reports[0].started, "rank 0 exited %d", rc);
    CHECK_MSG(strstr(reports[0].msg, "gloo rank 0/2") && strstr(reports[0].msg, "rank 1"), "%s",
              reports[0].msg);
    CHECK_MSG(took >= g.timeout_ms && took < g.timeout_ms + 3000, "failed after %.0f ms", took);
    remove_dir(dir);
}

static void test_bad_config(void) {
    CommConfig cfg = {.backend = "gloo", .rank = 0, .world_size = 2, .timeout_ms = 1000};
    Comm *c;
    Err err;
    CHECK(comm_create(&c, &cfg, &err) == -1 && c == NULL);
    CHECK_MSG(strstr(err.msg, "gloo") && strstr(err.msg, "exchange is not set"), "%s", err.msg);
    CommExchange empty = {NULL, NULL};
    cfg.exchange = &empty;
    CHECK(comm_create(&c, &cfg, &err) == -1);
    CHECK_MSG(strstr(err.msg, "exchange has no all_gather"), "%s", err.msg);
}

int main(void) {
    reports = mmap(NULL, MAX_WORLD * sizeof *reports, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (reports == MAP_FAILED) return 1;
    test_bad_config();
    for (int world = 2; world <= 4; world++)
        test_collectives(world);
    test_all_to_all();
    test_p2p();
    CHECK_MSG(run(4, body_split, NULL) == 0, "split failed");
    test_peer_killed();
    test_rank_never_comes();
    CHECK_DONE();
}
