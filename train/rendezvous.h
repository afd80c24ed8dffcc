// rendezvous.h: the meeting of the ranks of one job before the collectives exist
// (docs/design.md §9). Rank 0 listens on a TCP port; every other rank connects (retrying
// while nobody listens yet) and says who it is: protocol version, rank, world size,
// payload size. Rank 0 checks that they agree (same WORLD_SIZE, distinct ranks) and
// hands every rank the same payload (the shm segment name, the ncclUniqueId). Every
// wait has a deadline: a missing rank, a disagreeing rank or an unreachable master
// is a clear error on every rank that can be told, never a hang.
#pragma once
#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef struct {
    int rank, world_size;
    const char *master_addr; // where rank 0 listens (host name or address)
    int port;                // rank 0's port
    int listen_fd;           // rank 0: an already listening socket to use, or -1 to bind `port`
    int timeout_ms;          // for the whole meeting
    // A stop request (the rank's SIGTERM/SIGINT flag), or NULL: once it is non-zero the
    // meeting gives up at once instead of waiting for ranks that may never come.
    const volatile sig_atomic_t *stop;
} RendezvousConfig;

// Rank 0 sends payload[0..len) to every rank; the other ranks receive it into
// payload. With world_size 1 it returns at once.
int rendezvous_run(const RendezvousConfig *cfg, uint8_t *payload, size_t len, Err *err);
