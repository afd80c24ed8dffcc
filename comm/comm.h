// comm.h: collectives between the ranks of one job (DESIGN §9).
//
// One interface, two backends: `shm` (CPU ranks on one host, process-shared
// memory: each rank reduces its slice of the buffer, then every rank gathers
// the slices) and `nccl` (GPU, compiled when NCCL and CUDA are found).
// Every call has a timeout: a dead or stuck peer gives a clear error naming it
// (and a non-zero exit in the caller), never a silent hang. Results are
// bitwise identical on every rank.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef enum { COMM_SUM, COMM_AVG } CommOp;

typedef struct Comm Comm;

typedef struct {
    const char *backend; // "shm" | "nccl"
    int rank, world_size;
    int timeout_ms;      // per collective call
    // shm: the segment name, the same on every rank ("/astrai-<job>-<nonce>").
    const char *shm_name;
    // nccl: the 128-byte ncclUniqueId from the rendezvous, and the CUDA device.
    const uint8_t *nccl_id;
    int cuda_device;
} CommConfig;

int comm_create(Comm **out, const CommConfig *cfg, Err *err);
void comm_destroy(Comm *c);

int comm_rank(const Comm *c);
int comm_world_size(const Comm *c);

// buf: (n,) floats, reduced in place on every rank.
int comm_all_reduce(Comm *c, float *buf, size_t n, CommOp op, Err *err);
// send: (world*n,) floats; recv: (n,) = rank r's slice of the reduction.
int comm_reduce_scatter(Comm *c, const float *send, float *recv, size_t n, CommOp op, Err *err);
// send: (n,) floats from each rank; recv: (world*n,), rank r's at r*n.
int comm_all_gather(Comm *c, const float *send, float *recv, size_t n, Err *err);
// bytes from root's buf to every rank's buf.
int comm_broadcast(Comm *c, void *buf, size_t bytes, int root, Err *err);
int comm_barrier(Comm *c, Err *err);
