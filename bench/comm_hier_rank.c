// bench_comm_hier_rank: one rank of bench/bench_comm_hier.py: connects backend B (gloo or hier)
// through the file CommExchange of tests/comm_gloo_util.h, then times fp32 all_reduce SUM of
// each size; rank 0 prints one line per size: "<MiB> <best seconds> <median seconds>".
//
// usage: bench_comm_hier_rank BACKEND RANK HOST_OF(0,0,1,1) DIR ADDR SHM_NAME REPS MIB...
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_gloo_util.h"

#define MiB ((size_t)1 << 20)

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// host_of from "0,0,1,1"; returns the world size.
static int parse_hosts(const char *s, int *host_of) {
    int world = 0;
    for (char *end; *s && world < MAX_WORLD; s = *end ? end + 1 : end)
        host_of[world++] = (int)strtol(s, &end, 10);
    return world;
}

// A warm-up call, then reps calls each after a barrier (so that one rank's lead is not timed);
// times[] sorted.
static int time_size(Comm *c, size_t mib, int reps, double *times, Err *err) {
    size_t n = mib * MiB / sizeof(float);
    float *buf = calloc(n, sizeof *buf);
    if (!buf) return err_resource(err, "out of memory");
    int rc = comm_all_reduce(c, buf, n, DT_F32, COMM_SUM, err);
    for (int k = 0; !rc && k < reps; k++) {
        rc = comm_barrier(c, err);
        double t = now_ms();
        rc = rc || comm_all_reduce(c, buf, n, DT_F32, COMM_SUM, err);
        times[k] = (now_ms() - t) / 1e3;
    }
    free(buf);
    qsort(times, (size_t)reps, sizeof *times, cmp_double);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 9) {
        fprintf(stderr, "usage: %s BACKEND RANK HOST_OF DIR ADDR SHM_NAME REPS MIB...\n", argv[0]);
        return 2;
    }
    int host_of[MAX_WORLD], rank = atoi(argv[2]), world = parse_hosts(argv[3], host_of);
    int reps = atoi(argv[7]);
    FileExchange fx = {.rank = rank, .world = world, .timeout_ms = 60000};
    snprintf(fx.dir, sizeof fx.dir, "%s", argv[4]);
    CommExchange x = {file_all_gather, &fx};
    CommConfig cfg = {.backend = argv[1],
                      .rank = rank,
                      .world_size = world,
                      .timeout_ms = 60000,
                      .exchange = &x,
                      .gloo_addr = argv[5],
                      .shm_name = argv[6],
                      .host_of = host_of};
    Err err = {0};
    Comm *c;
    if (comm_create(&c, &cfg, &err)) goto fail;
    double *times = malloc((size_t)reps * sizeof *times);
    for (int i = 8; i < argc; i++) {
        if (time_size(c, (size_t)atoi(argv[i]), reps, times, &err)) goto fail;
        if (rank == 0) printf("%s %.6f %.6f\n", argv[i], times[0], times[reps / 2]);
        fflush(stdout);
    }
    comm_destroy(c);
    free(times);
    return 0;
fail:
    fprintf(stderr, "rank %d: %s\n", rank, err.msg);
    return 1;
}
