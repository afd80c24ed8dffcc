// bench_comm: shm all_reduce bus bandwidth with 2 forked ranks, against this
// machine's single-thread memcpy bandwidth measured in the same run; then shm
// all_to_all bandwidth the same way.
//
// busbw = 2 (n-1)/n * bytes / time (nccl-tests' definition: the bytes each rank
// must move for a ring all_reduce); memcpy bandwidth = bytes copied / time.
// all_to_all: each rank sends `bytes` in all, half to itself (a copy), half to the
// other rank (through the segment); bandwidth = bytes / time, against a memcpy of
// the same bytes. Times are the best of several runs (the machine is shared and noisy).
//
// usage: bench_comm [chunk_bytes]   (default COMM_SHM_DEFAULT_CHUNK)
//        bench_comm --backend gloo --rank R --world W --master ADDR:PORT
// The second form is one rank of a gloo all_reduce bench (one process per host, each started by
// hand or by bench/bench_multihost.py): the ranks meet through train/rendezvous.h, rank 0
// prints the all_reduce table (its memcpy column is rank 0's own).
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "train/rendezvous.h"

#define WORLD 2
#define MiB ((size_t)1 << 20)
static const size_t SIZES_MIB[] = {1, 4, 16, 64, 256};
#define NSIZES (sizeof SIZES_MIB / sizeof SIZES_MIB[0])
static const size_t A2A_MIB[] = {1, 16, 64}; // per rank, all parts together
#define NA2A (sizeof A2A_MIB / sizeof A2A_MIB[0])

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int reps_for(size_t bytes) {
    size_t r = 1024 * MiB / bytes;
    return r < 5 ? 5 : r > 50 ? 50 : (int)r;
}

// Best times per size, written by rank 0 into shared memory.
typedef struct {
    double all_reduce[NSIZES], memcpy[NSIZES];
    double all_to_all[NA2A], a2a_memcpy[NA2A];
} Times;

static double memcpy_once(char *dst, const char *src, size_t bytes) {
    double t = now_s();
    memcpy(dst, src, bytes);
    return now_s() - t;
}

// One size: rounds of (rank 0 alone: memcpy; both: all_reduce), so that both
// are measured under the same (noisy, shared) conditions; keeps the best.
static int measure(Comm *c, size_t k, Times *times, Err *err) {
    size_t bytes = SIZES_MIB[k] * MiB, n = bytes / sizeof(float);
    float *buf = malloc(bytes), *copy = malloc(bytes);
    if (!buf || !copy) exit(1);
    for (size_t i = 0; i < n; i++)
        buf[i] = copy[i] = (float)(i % 7) * 1e-3f;
    double best_ar = 1e30, best_copy = 1e30;
    int rc = 0;
    for (int r = -1; r < reps_for(bytes) && rc == 0; r++) { // r = -1: warm-up
        double t = comm_rank(c) == 0 ? memcpy_once((char *)copy, (char *)buf, bytes) : 1e30;
        if (r >= 0 && t < best_copy) best_copy = t;
        if ((rc = comm_barrier(c, err))) break;
        t = now_s();
        rc = comm_all_reduce(c, buf, n, DT_F32, COMM_AVG, err);
        t = now_s() - t;
        if (r >= 0 && t < best_ar) best_ar = t;
    }
    free(buf);
    free(copy);
    times->all_reduce[k] = best_ar;
    times->memcpy[k] = best_copy;
    return rc;
}

// One size of all_to_all, as measure(): rounds of (rank 0 alone: memcpy of the bytes; both:
// all_to_all of them, split evenly between the two ranks).
static int measure_a2a(Comm *c, size_t k, Times *times, Err *err) {
    size_t bytes = A2A_MIB[k] * MiB, parts[WORLD] = {bytes / WORLD, bytes / WORLD};
    char *send = malloc(bytes), *recv = malloc(bytes);
    if (!send || !recv) exit(1);
    memset(send, comm_rank(c) + 1, bytes);
    memset(recv, 0, bytes);
    double best_a2a = 1e30, best_copy = 1e30;
    int rc = 0;
    for (int r = -1; r < reps_for(bytes) && rc == 0; r++) { // r = -1: warm-up
        double t = comm_rank(c) == 0 ? memcpy_once(recv, send, bytes) : 1e30;
        if (r >= 0 && t < best_copy) best_copy = t;
        if ((rc = comm_barrier(c, err))) break;
        t = now_s();
        rc = comm_all_to_all(c, send, parts, recv, parts, err);
        t = now_s() - t;
        if (r >= 0 && t < best_a2a) best_a2a = t;
    }
    free(send);
    free(recv);
    times->all_to_all[k] = best_a2a;
    times->a2a_memcpy[k] = best_copy;
    return rc;
}

static int rank_main(int rank, const char *name, size_t chunk, Times *times) {
    CommConfig cfg = {.backend = "shm",
                      .rank = rank,
                      .world_size = WORLD,
                      .timeout_ms = 60000,
                      .shm_name = name,
                      .shm_chunk_bytes = chunk};
    Comm *c = NULL;
    Err err;
    int rc = comm_create(&c, &cfg, &err);
    Times ignored; // rank 1's
    for (size_t k = 0; k < NSIZES && rc == 0; k++)
        rc = measure(c, k, rank == 0 ? times : &ignored, &err);
    for (size_t k = 0; k < NA2A && rc == 0; k++)
        rc = measure_a2a(c, k, rank == 0 ? times : &ignored, &err);
    if (rc) fprintf(stderr, "rank %d: %s\n", rank, err.msg);
    if (c) comm_destroy(c);
    return rc ? 1 : 0;
}

static int run_ranks(size_t chunk, Times *times) {
    char name[64];
    snprintf(name, sizeof name, "/astrai-bench-%d", (int)getpid());
    pid_t pids[WORLD];
    for (int r = 0; r < WORLD; r++)
        if ((pids[r] = fork()) == 0) _exit(rank_main(r, name, chunk, times));
    int bad = 0;
    for (int r = 0; r < WORLD; r++) {
        int status;
        waitpid(pids[r], &status, 0);
        bad |= !WIFEXITED(status) || WEXITSTATUS(status);
    }
    return bad;
}

static void print_a2a(const Times *times) {
    printf("\nshm all_to_all, %d ranks, each rank's bytes split evenly between the ranks (half "
           "its own, copied; half to the other); memcpy of the same bytes in the same rounds\n",
           WORLD);
    printf("%10s %14s %14s %14s %8s\n", "per rank", "all_to_all ms", "GB/s", "memcpy GB/s",
           "ratio");
    for (size_t k = 0; k < NA2A; k++) {
        double bytes = (double)(A2A_MIB[k] * MiB);
        double bw = bytes / times->all_to_all[k] / 1e9, copy = bytes / times->a2a_memcpy[k] / 1e9;
        printf("%7zu MiB %14.3f %14.2f %14.2f %7.0f%%\n", A2A_MIB[k], times->all_to_all[k] * 1e3,
               bw, copy, 100 * bw / copy);
    }
}

// The all_reduce table of times (rank 0's) over world ranks of backend.
static double print_all_reduce(const char *backend, int world, const char *extra,
                               const Times *times) {
    printf("%s all_reduce (AVG, fp32), %d ranks%s; best of several rounds, memcpy (1 thread) "
           "measured in the same rounds\n",
           backend, world, extra);
    printf("%10s %14s %14s %14s %8s\n", "size", "all_reduce ms", "busbw GB/s", "memcpy GB/s",
           "ratio");
    double ratio64 = 0;
    for (size_t k = 0; k < NSIZES; k++) {
        double bytes = (double)(SIZES_MIB[k] * MiB);
        double busbw = 2.0 * (world - 1) / world * bytes / times->all_reduce[k] / 1e9;
        double copy = bytes / times->memcpy[k] / 1e9;
        printf("%7zu MiB %14.3f %14.2f %14.2f %7.0f%%\n", SIZES_MIB[k], times->all_reduce[k] * 1e3,
               busbw, copy, 100 * busbw / copy);
        if (SIZES_MIB[k] == 64) ratio64 = busbw / copy;
    }
    return ratio64;
}

static int shm_main(size_t chunk) {
    Times *times =
        mmap(NULL, sizeof *times, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (times == MAP_FAILED || run_ranks(chunk, times)) return 1;
    char extra[64];
    snprintf(extra, sizeof extra, ", chunk %zu bytes", chunk ? chunk : COMM_SHM_DEFAULT_CHUNK);
    double ratio64 = print_all_reduce("shm", WORLD, extra, times);
    printf("at 64 MiB: busbw / memcpy = %.0f%% (target >= 50%%)\n", 100 * ratio64);
    print_a2a(times);
    return 0;
}

// The all_reduce sizes over an open gloo Comm; rank 0 prints them.
static int gloo_measure(Comm *c, Err *err) {
    Times times = {0};
    for (size_t k = 0; k < NSIZES; k++)
        if (measure(c, k, &times, err)) return -1;
    if (comm_rank(c) == 0) print_all_reduce("gloo", comm_world_size(c), "", &times);
    return 0;
}

// One gloo rank: the meeting at master ("ADDR:PORT"), the Comm, the sizes.
static int gloo_main(int rank, int world, const char *master) {
    char addr[256];
    const char *colon = strrchr(master, ':');
    if (!colon || (size_t)(colon - master) >= sizeof addr)
        return fprintf(stderr, "bad --master\n"), 2;
    snprintf(addr, sizeof addr, "%.*s", (int)(colon - master), master);
    RendezvousConfig rc_cfg = {.rank = rank,
                               .world_size = world,
                               .master_addr = addr,
                               .port = atoi(colon + 1),
                               .listen_fd = -1,
                               .timeout_ms = 60000};
    uint8_t payload[8] = {0};
    Rendezvous *r = NULL;
    Comm *c = NULL;
    Err err;
    int rc = rendezvous_open(&rc_cfg, payload, sizeof payload, &r, &err);
    if (!rc) {
        CommExchange exchange = {.all_gather = rendezvous_all_gather, .ctx = r};
        CommConfig cfg = {.backend = "gloo",
                          .rank = rank,
                          .world_size = world,
                          .timeout_ms = 120000,
                          .exchange = &exchange,
                          .gloo_addr = rendezvous_local_addr(r)};
        rc = comm_create(&c, &cfg, &err) || gloo_measure(c, &err);
    }
    if (rc) fprintf(stderr, "rank %d: %s\n", rank, err.msg);
    if (c) comm_destroy(c);
    if (r) rendezvous_close(r);
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--backend")) {
        if (argc != 9 || strcmp(argv[2], "gloo") || strcmp(argv[3], "--rank") ||
            strcmp(argv[5], "--world") || strcmp(argv[7], "--master"))
            return fprintf(stderr, "usage: bench_comm --backend gloo --rank R --world W --master "
                                   "ADDR:PORT\n"),
                   2;
        return gloo_main(atoi(argv[4]), atoi(argv[6]), argv[8]);
    }
    return shm_main(argc > 1 ? strtoull(argv[1], NULL, 0) : 0);
}
