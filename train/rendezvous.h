// rendezvous.h: the meeting of the ranks of one job before the collectives exist
// (docs/design.md §9, §18). Rank 0 listens on a TCP port; every other rank connects (retrying
// while nobody listens yet), answers rank 0's challenge and says who it is: protocol version,
// rank, world size, payload size and its host. Rank 0 checks that they agree (same WORLD_SIZE,
// distinct ranks) and hands every rank the same payload (the shm segment name, the
// ncclUniqueId) and the job's layout: which ranks share a host. Every wait has a deadline: a
// missing rank, a disagreeing rank or an unreachable master is a clear error on every rank that
// can be told, never a hang.
//
// Strangers on the port are refused and logged (stderr), never taken for a rank, and the
// meeting goes on: a connection that does not speak the protocol (garbage, a wrong magic), a
// hello that does not answer this connection's challenge (a replayed or forged one), a second
// claim on a rank that is already taken (that process is told so).
//
// After the meeting the connections stay open until rendezvous_close: rendezvous_all_gather
// swaps one blob per rank over them (the store of the gloo backend's connect, comm.h).
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
    int timeout_ms;          // for the whole meeting, and for each rendezvous_all_gather
    // A stop request (the rank's SIGTERM/SIGINT flag), or NULL: once it is non-zero the
    // meeting gives up at once instead of waiting for ranks that may never come.
    const volatile sig_atomic_t *stop;
    // Ranks per node when every node runs as many (torchrun's LOCAL_WORLD_SIZE, --nproc_per_node),
    // so that missing ranks are also named by node (node = rank / node_size); 0: unknown.
    int node_size;
} RendezvousConfig;

typedef struct Rendezvous Rendezvous;

// The meeting. Rank 0 sends payload[0..len) to every rank; the other ranks receive it into
// payload. On success *out holds the open connections and the layout (free with
// rendezvous_close). With world_size 1 it meets nobody and the layout is this host alone.
int rendezvous_open(const RendezvousConfig *cfg, uint8_t *payload, size_t len, Rendezvous **out,
                    Err *err);
// rendezvous_open, then rendezvous_close.
int rendezvous_run(const RendezvousConfig *cfg, uint8_t *payload, size_t len, Err *err);
void rendezvous_close(Rendezvous *r);

// The layout: the job's distinct hosts (numbered in the order of their lowest rank), the host of
// each rank, a host's name (its host name as the machine gives it).
int rendezvous_hosts(const Rendezvous *r);
int rendezvous_host_of(const Rendezvous *r, int rank);
const char *rendezvous_host_name(const Rendezvous *r, int host);
// The local address this rank's connection of the meeting has (rank 0: the one a rank on another
// host reached it on, else any rank's), "" with world_size 1: the address the others can reach
// this rank at.
const char *rendezvous_local_addr(const Rendezvous *r);

// A collective over the open connections (CommExchange.all_gather, comm.h; ctx is the
// Rendezvous): every rank gives its blob (mine, len bytes); *all (malloc'ed) gets every rank's,
// one after the other in rank order, lens[r] (world_size entries) rank r's size. A rank that died
// or sent garbage: an error on every rank naming it and its host.
int rendezvous_all_gather(void *rendezvous, const void *mine, size_t len, uint8_t **all,
                          size_t *lens, Err *err);

// This machine's identity as the meeting compares it: the host name, the boot id and the device of
// /dev/shm (processes with the same identity share shared memory). "" parts when unreadable.
void rendezvous_host_identity(char *out, size_t cap);
