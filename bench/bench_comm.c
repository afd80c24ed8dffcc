// bench_comm: shm all_reduce bus bandwidth with 2 forked ranks, against this
// machine's single-thread memcpy bandwidth measured in the same run.
//
// busbw = 2 (n-1)/n * bytes / time (nccl-tests' definition: the bytes each rank
// must move for a ring all_reduce); memcpy bandwidth = bytes copied / time.
// Times are the best of several runs (the machine is shared and noisy).
//
// usage: bench_comm [chunk_bytes]   (default COMM_SHM_DEFAULT_CHUNK)
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"

#define WORLD 2
#define MiB ((size_t)1 << 20)
static const size_t SIZES_MIB[] = {1, 4, 16, 64, 256};
#define NSIZES (sizeof SIZES_MIB / sizeof SIZES_MIB[0])

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int reps_for(size_t bytes) {
    size_t r = 1024 * MiB / bytes;
    return r < 5 ? 5 : r > 50 ? 50 : (int)r;
}

// Best single-thread memcpy time for `bytes` (buffers touched first).
static double memcpy_seconds(size_t bytes) {
    char *a = malloc(bytes), *b = malloc(bytes);
    if (!a || !b) exit(1);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double best = 1e30;
    for (int r = 0; r < reps_for(bytes); r++) {
        double t = now_s();
        memcpy(b, a, bytes);
        t = now_s() - t;
        best = t < best ? t : best;
        a[r] = b[bytes - 1 - r]; // keep the copies observable
    }
    free(a);
    free(b);
    return best;
}

// One rank: the best all_reduce time per size, written to times[] by rank 0.
static int rank_main(int rank, const char *name, size_t chunk, double *times) {
    CommConfig cfg = {.backend = "shm",
                      .rank = rank,
                      .world_size = WORLD,
                      .timeout_ms = 60000,
                      .shm_name = name,
                      .shm_chunk_bytes = chunk};
    Comm *c;
    Err err;
    if (comm_create(&c, &cfg, &err)) {
        fprintf(stderr, "rank %d: %s\n", rank, err.msg);
        return 1;
    }
    for (size_t k = 0; k < NSIZES; k++) {
        size_t n = SIZES_MIB[k] * MiB / sizeof(float);
        float *buf = malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++)
            buf[i] = (float)(i % 7) * 1e-3f;
        double best = 1e30;
        for (int r = -1; r < reps_for(n * sizeof(float)); r++) { // r = -1: warm-up
            if (comm_barrier(c, &err)) break;
            double t = now_s();
            if (comm_all_reduce(c, buf, n, COMM_AVG, &err)) break;
            t = now_s() - t;
            if (r >= 0 && t < best) best = t;
        }
        free(buf);
        if (best == 1e30) {
            fprintf(stderr, "rank %d: %s\n", rank, err.msg);
            comm_destroy(c);
            return 1;
        }
        if (rank == 0) times[k] = best;
    }
    comm_destroy(c);
    return 0;
}

static int run_ranks(size_t chunk, double *times) {
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

int main(int argc, char **argv) {
    size_t chunk = argc > 1 ? strtoull(argv[1], NULL, 0) : 0;
    double *times = mmap(NULL, NSIZES * sizeof(double), PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (times == MAP_FAILED || run_ranks(chunk, times)) return 1;
    printf("shm all_reduce (AVG, fp32), %d ranks, chunk %zu bytes; best of several runs\n", WORLD,
           chunk ? chunk : COMM_SHM_DEFAULT_CHUNK);
    printf("%10s %14s %14s %14s %8s\n", "size", "all_reduce ms", "busbw GB/s", "memcpy GB/s",
           "ratio");
    double ratio64 = 0;
    for (size_t k = 0; k < NSIZES; k++) {
        size_t bytes = SIZES_MIB[k] * MiB;
        double busbw = 2.0 * (WORLD - 1) / WORLD * bytes / times[k] / 1e9;
        double copy = bytes / memcpy_seconds(bytes) / 1e9;
        printf("%7zu MiB %14.3f %14.2f %14.2f %7.0f%%\n", SIZES_MIB[k], times[k] * 1e3, busbw, copy,
               100 * busbw / copy);
        if (SIZES_MIB[k] == 64) ratio64 = busbw / copy;
    }
    printf("at 64 MiB: busbw / memcpy = %.0f%% (target >= 50%%)\n", 100 * ratio64);
    return 0;
}
