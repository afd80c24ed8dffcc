// comm_gloo_util.h: what the tests of the TCP backends share (tests/test_comm_gloo.c,
// tests/test_comm_hier.c): a file CommExchange, forked ranks on 127.0.0.1, and the checks of
// the reductions and gathers.
//
// The CommExchange of the connect is files: round k of rank r writes its blob to
// <dir>/<k>.<r> (a temporary name, then rename, so a reader never sees half of it) and polls
// for every other rank's file of round k until the timeout.
#pragma once
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "comm/comm.h"
#include "comm_test_util.h"

#define TIMEOUT_MS 5000

static const char *const HOSTS[MAX_WORLD] = {"host-a", "host-b", "host-c", "host-d"};

// ---------------------------------------------------------------- the file exchange

typedef struct {
    char dir[128];
    int rank, world, timeout_ms;
    int round;
} FileExchange;

static inline int write_blob(const FileExchange *x, const void *mine, size_t len, Err *err) {
    char tmp[192], path[192];
    snprintf(tmp, sizeof tmp, "%s/tmp.%d", x->dir, x->rank);
    snprintf(path, sizeof path, "%s/%d.%d", x->dir, x->round, x->rank);
    FILE *f = fopen(tmp, "wb");
    if (!f) return err_errno(err, errno, "exchange: %s", tmp);
    int bad = fwrite(mine, 1, len, f) != len;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path)) return err_errno(err, errno, "exchange: writing %s", path);
    return 0;
}

// Appends rank r's blob of this round to *all (grown); waits for it up to the timeout.
static inline int read_blob(const FileExchange *x, int r, uint8_t **all, size_t *total, size_t *len,
                            Err *err) {
    char path[192];
    snprintf(path, sizeof path, "%s/%d.%d", x->dir, x->round, r);
    double end = now_ms() + x->timeout_ms;
    FILE *f;
    while (!(f = fopen(path, "rb"))) {
        if (now_ms() > end)
            return err_set(err, "exchange round %d: no blob from rank %d after %d ms", x->round, r,
                           x->timeout_ms);
        sleep_ms(2);
    }
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    rewind(f);
    uint8_t *grown = realloc(*all, *total + *len + 1);
    int bad = !grown || fread(grown + *total, 1, *len, f) != *len;
    fclose(f);
    if (grown) *all = grown;
    if (bad) return err_set(err, "exchange: reading %s", path);
    *total += *len;
    return 0;
}

static inline int file_all_gather(void *ctx, const void *mine, size_t len, uint8_t **all,
                                  size_t *lens, Err *err) {
    FileExchange *x = ctx;
    size_t total = 0;
    *all = NULL;
    int rc = write_blob(x, mine, len, err);
    for (int r = 0; rc == 0 && r < x->world; r++)
        rc = read_blob(x, r, all, &total, &lens[r], err);
    x->round++;
    if (rc) {
        free(*all);
        *all = NULL;
    }
    return rc;
}

static inline void remove_dir(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[400];
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.') {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    if (d) closedir(d);
    rmdir(dir);
}

// ---------------------------------------------------------------- forked ranks

typedef int (*RankBody)(Comm *c, void *ctx);

typedef struct {
    int world, timeout_ms;
    int hosts; // give CommConfig.hosts
    RankBody body;
    void *ctx;
    const char *backend; // NULL: "gloo"
    const int *host_of;  // CommConfig.host_of (hier)
} Group;

static inline void rank_main(const Group *g, const char *dir, int rank) {
    FileExchange fx = {.rank = rank, .world = g->world, .timeout_ms = g->timeout_ms};
    snprintf(fx.dir, sizeof fx.dir, "%s", dir);
    CommExchange x = {file_all_gather, &fx};
    CommConfig cfg = {.backend = g->backend ? g->backend : "gloo",
                      .rank = rank,
                      .world_size = g->world,
                      .timeout_ms = g->timeout_ms,
                      .exchange = &x,
                      .gloo_addr = "127.0.0.1",
                      .hosts = g->hosts ? HOSTS : NULL,
                      .host_of = g->host_of,
                      .shm_name = dir + strlen("/tmp")}; // hier's: "/astrai-test-gloo-XXXXXX"
    Err err = {0};
    Comm *c;
    if (comm_create(&c, &cfg, &err)) {
        report_failure(rank, &err);
        _exit(3);
    }
    reports[rank].started = 1;
    int rc = g->body(c, g->ctx);
    comm_destroy(c);
    _exit(rc);
}

// Forks ranks [0, spawned) of g (the rest never come) into pids; returns the exchange's dir.
static inline void spawn_group(const Group *g, int spawned, pid_t *pids, char *dir, size_t size) {
    memset(reports, 0, MAX_WORLD * sizeof *reports);
    snprintf(dir, size, "/tmp/astrai-test-gloo-XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        exit(1);
    }
    for (int r = 0; r < spawned; r++)
        if ((pids[r] = fork()) == 0) rank_main(g, dir, r);
}

// Forks every rank of g and waits (up to 10 s) until each has connected, then 200 ms of its
// collectives: the moment to kill one.
static inline void spawn_connected(const Group *g, pid_t *pids, char *dir, size_t size) {
    spawn_group(g, g->world, pids, dir, size);
    double until = now_ms() + 10000;
    for (int r = 0; r < g->world; r++)
        while (!reports[r].started && now_ms() < until)
            sleep_ms(1);
    sleep_ms(200);
}

// Runs every rank of g; returns how many did not exit 0 (a hang counts).
static inline int run_group(const Group *g) {
    pid_t pids[MAX_WORLD];
    char dir[64];
    spawn_group(g, g->world, pids, dir, sizeof dir);
    int bad = 0;
    for (int r = 0; r < g->world; r++) {
        int rc = wait_child(pids[r], 60000);
        if (rc != 0) fprintf(stderr, "rank %d exited %d: %s\n", r, rc, reports[r].msg);
        bad += rc != 0;
    }
    remove_dir(dir);
    return bad;
}

static inline int run(int world, RankBody body, void *ctx) {
    Group g = {world, TIMEOUT_MS, 0, body, ctx, NULL, NULL};
    return run_group(&g);
}

// ---------------------------------------------------------------- collectives

// Sums in any order: within this tolerance of the rank-order sum (bitwise agreement between
// ranks is checked through the digests).
static inline int near(float got, float want, float scale) {
    return fabsf(got - want) <= 1e-5f * scale;
}

static inline int check_all_reduce(Comm *c, size_t n, CommOp op, uint32_t seed) {
    int me = comm_rank(c), W = comm_world_size(c);
    float *buf = malloc(n * sizeof *buf + 1);
    Err err;
    for (size_t i = 0; i < n; i++)
        buf[i] = value(seed, me, i);
    if (comm_all_reduce(c, buf, n, DT_F32, op, &err)) return fail_call(c, &err);
    for (size_t i = 0; i < n; i++) {
        float want = 0, scale = 0;
        for (int r = 0; r < W; r++) {
            want += value(seed, r, i);
            scale += fabsf(value(seed, r, i));
        }
        if (op == COMM_AVG) want *= 1.0f / (float)W;
        if (!near(buf[i], want, scale)) {
            fprintf(stderr, "rank %d: all_reduce n=%zu [%zu] = %.9g, want %.9g\n", me, n, i,
                    (double)buf[i], (double)want);
            return 1;
        }
    }
    reports[me].digest = fnv(reports[me].digest, buf, n * sizeof(float));
    free(buf);
    return 0;
}

// Integer-valued floats sum exactly in any order: every element checked bitwise.
static inline int check_reduce_scatter(Comm *c, size_t n, CommOp op) {
    int me = comm_rank(c), W = comm_world_size(c);
    float *send = malloc((size_t)W * n * sizeof *send + 1), *recv = malloc(n * sizeof *recv + 1);
    Err err;
    for (size_t i = 0; i < (size_t)W * n; i++)
        send[i] = (float)((i * 7 + (size_t)me * 13) % 1001);
    if (comm_reduce_scatter(c, send, recv, n, DT_F32, op, &err)) return fail_call(c, &err);
    for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < W; r++)
            want += (float)(((me * n + i) * 7 + (size_t)r * 13) % 1001);
        if (op == COMM_AVG) want *= 1.0f / (float)W;
        if (memcmp(&recv[i], &want, sizeof want)) {
            fprintf(stderr, "rank %d: reduce_scatter n=%zu [%zu] = %.9g, want %.9g\n", me, n, i,
                    (double)recv[i], (double)want);
            return 1;
        }
    }
    free(send);
    free(recv);
    return 0;
}

// fp32 and bf16 (2 bytes: an odd n splits a float) gathered as bytes.
static inline int check_all_gather(Comm *c, size_t n, DType dt, uint32_t seed) {
    int me = comm_rank(c), W = comm_world_size(c);
    size_t bytes = n * (dt == DT_F32 ? 4 : 2);
    unsigned char *send = message(seed, me, bytes), *recv = malloc((size_t)W * bytes + 1);
    Err err;
    if (comm_all_gather(c, send, recv, n, dt, &err)) return fail_call(c, &err);
    for (int r = 0; r < W; r++)
        if (check_message(c, recv + r * bytes, seed, r, bytes)) return 1;
    free(send);
    free(recv);
    return 0;
}

static inline int check_broadcasts(Comm *c, size_t bytes, uint32_t seed) {
    int me = comm_rank(c);
    Err err;
    for (int root = 0; root < comm_world_size(c); root++) {
        unsigned char *buf = message(seed + root, me, bytes);
        if (comm_broadcast(c, buf, bytes, root, &err)) return fail_call(c, &err);
        if (check_message(c, buf, seed + root, root, bytes)) return 1;
        free(buf);
    }
    return 0;
}

static const size_t SIZES[] = {0, 1, 37, 1001, (1 << 20) / 4 * 3 + 5}; // the last > 1 MiB

static inline int body_collectives(Comm *c, void *ctx) {
    (void)ctx;
    Err err;
    for (size_t k = 0; k < sizeof SIZES / sizeof *SIZES; k++) {
        size_t n = SIZES[k];
        if (check_all_reduce(c, n, COMM_SUM, 10 + k) || check_all_reduce(c, n, COMM_AVG, 20 + k) ||
            check_reduce_scatter(c, n, k % 2 ? COMM_AVG : COMM_SUM) ||
            check_all_gather(c, n, DT_F32, 30 + k) || check_all_gather(c, n, DT_BF16, 40 + k) ||
            check_broadcasts(c, n * 3 + 1, 50 + k))
            return 1;
        if (comm_barrier(c, &err)) return fail_call(c, &err);
    }
    return 0;
}

// Every collective of body_collectives on g's ranks (g->body, g->ctx unused).
static inline void test_collectives_of(Group g) {
    g.body = body_collectives;
    int bad = run_group(&g);
    CHECK_MSG(bad == 0, "collectives of %d ranks: %d rank(s) failed", g.world, bad);
    for (int r = 1; r < g.world; r++)
        CHECK_MSG(reports[r].digest == reports[0].digest,
                  "world %d: rank %d's all_reduce results differ from rank 0's", g.world, r);
}

static inline void test_collectives(int world) {
    test_collectives_of((Group){world, TIMEOUT_MS, 0, NULL, NULL, NULL, NULL});
}

// all_reduce until one fails (a peer killed): that error is the expected way out (exit 0).
static inline int body_until_error(Comm *c, void *ctx) {
    (void)ctx;
    size_t n = (size_t)64 << 10;
    float *buf = calloc(n, sizeof *buf);
    Err err;
    double end = now_ms() + 30000;
    while (now_ms() < end)
        if (comm_all_reduce(c, buf, n, DT_F32, COMM_SUM, &err)) {
            report_failure(comm_rank(c), &err);
            free(buf);
            return 0; // the expected way out
        }
    free(buf);
    return 1;
}
