// comm_test_util.h: what the tests of the comm backends share (tests/test_comm_*.c): forked
// ranks reporting to the parent through shared memory, waiting for them with a limit, and the
// values and messages whose every bit is known.
#pragma once
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"

#ifndef MAX_WORLD
#define MAX_WORLD 4
#endif

// What each forked rank reports back to the parent (in MAP_SHARED memory).
typedef struct {
    int started;     // comm_create succeeded
    int failed;      // a call returned an error
    double fail_ms;  // when (CLOCK_MONOTONIC)
    uint64_t digest; // FNV-1a of every result this rank got
    char msg[ERR_MSG_MAX];
} Report;

static Report *reports; // [MAX_WORLD], mapped MAP_SHARED by main

static inline double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static inline void sleep_ms(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static inline void report_failure(int rank, const Err *err) {
    Report *r = &reports[rank];
    r->fail_ms = now_ms();
    snprintf(r->msg, sizeof r->msg, "%s", err->msg);
    r->failed = 1;
}

// Waits for one child up to limit_ms; kills it past that. Returns its exit
// code, or -1 when it had to be killed (a hang), -2 when a signal ended it.
static inline int wait_child(pid_t pid, int limit_ms) {
    double end = now_ms() + limit_ms;
    int status;
    while (waitpid(pid, &status, WNOHANG) == 0) {
        if (now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        sleep_ms(2);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -2;
}

// A float for (seed, rank, i): irregular mantissas so that the order of the sum matters.
static inline float value(uint32_t seed, int rank, size_t i) {
    uint32_t h = seed * 2654435761u ^ (uint32_t)rank * 40503u ^ (uint32_t)i * 2246822519u;
    h ^= h >> 15;
    h *= 2654435761u;
    h ^= h >> 13;
    return ((float)(h % 2000003u) - 1000001.0f) / 7919.0f;
}

static inline uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static inline int fail_call(Comm *c, const Err *err) {
    report_failure(comm_rank(c), err);
    fprintf(stderr, "%s\n", err->msg);
    return 1;
}

// Byte i of message `seed` from rank `from`: every message's bytes differ.
static inline unsigned char byte_of(uint32_t seed, int from, size_t i) {
    uint32_t h = seed * 2654435761u ^ (uint32_t)from * 40503u ^ (uint32_t)i * 2246822519u;
    return (unsigned char)(h ^ h >> 13 ^ h >> 24);
}

static inline unsigned char *message(uint32_t seed, int from, size_t bytes) {
    unsigned char *m = malloc(bytes + 1);
    for (size_t i = 0; m && i < bytes; i++)
        m[i] = byte_of(seed, from, i);
    return m;
}

// 0 when got holds message (seed, from) exactly; prints the first difference.
static inline int check_message(Comm *c, const unsigned char *got, uint32_t seed, int from,
                                size_t bytes) {
    for (size_t i = 0; i < bytes; i++)
        if (got[i] != byte_of(seed, from, i)) {
            fprintf(stderr, "rank %d: message %u of %zu bytes from rank %d: byte %zu differs\n",
                    comm_rank(c), seed, bytes, from, i);
            return 1;
        }
    return 0;
}
