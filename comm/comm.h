// comm.h: collectives between the ranks of one job (docs/design.md §9).
//
// One interface, two backends: `shm` (CPU ranks on one host, process-shared
// memory: each rank reduces its slice of the buffer, then every rank gathers
// the slices) and `nccl` (GPU, compiled when NCCL and CUDA are found).
// Every call has a timeout: a dead or stuck peer gives a clear error naming it
// (and a non-zero exit in the caller), never a silent hang. Results are
// bitwise identical on every rank.
//
// Every rank must call the same collectives in the same order with the same
// sizes (the shm backend checks this and fails every rank on a mismatch).
// After any error the Comm is unusable: every later call fails with the first
// error; comm_destroy() is still required.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/error.h"

typedef enum { COMM_SUM, COMM_AVG } CommOp;

typedef struct Comm Comm;

// Size of the ncclUniqueId handed from rank 0 to every rank.
#define COMM_NCCL_ID_BYTES 128

typedef struct {
    const char *backend; // "shm" | "nccl"
    int rank, world_size;
    int timeout_ms; // per collective call (and for comm_create to see every rank)
    // shm: the segment name, the same on every rank ("/astrai-<job>-<nonce>").
    const char *shm_name;
    // nccl: the 128-byte ncclUniqueId from the rendezvous, and the CUDA device.
    const uint8_t *nccl_id;
    int cuda_device;
    // nccl: the stream (cudaStream_t) of the compute that produces and consumes the
    // buffers; every collective waits for what was enqueued on it before the call, and
    // finishes before the call returns. NULL: the legacy default stream's order.
    void *cuda_stream;
    // shm: bytes each rank stages per step; 0 = COMM_SHM_DEFAULT_CHUNK. Must be
    // the same on every rank, a multiple of 64 and at least 64 * world_size.
    // Buffers larger than this are processed in steps.
    size_t shm_chunk_bytes;
} CommConfig;

#define COMM_SHM_DEFAULT_CHUNK ((size_t)512 << 10)

// shm: rank 0 creates the segment (replacing a stale one left by a crashed
// run), the others attach; returns once every rank is attached, and the
// segment name is unlinked by then so nothing outlives the processes.
// nccl: buffers given to the collectives are CUDA device pointers on
// cfg->cuda_device; NCCL and the CUDA runtime are loaded at this call (dlopen),
// so binaries start on machines without them.
int comm_create(Comm **out, const CommConfig *cfg, Err *err);
void comm_destroy(Comm *c);

int comm_rank(const Comm *c);
int comm_world_size(const Comm *c);
// 1 when the buffers are device memory (nccl), 0 when host memory (shm).
int comm_device_memory(const Comm *c);

// Buffers hold n elements of dtype dt (fp32 or bf16). shm reduces fp32 only (CPU ranks
// compute in fp32); gathers and broadcasts move any dtype.
//
// buf: (n,) reduced in place on every rank. AVG = SUM, then multiplied by
// 1/world_size. shm sums in rank order (rank 0 + rank 1 + ...).
int comm_all_reduce(Comm *c, void *buf, size_t n, DType dt, CommOp op, Err *err);
// send: (world*n,); recv: (n,) = rank r's slice of the reduction.
int comm_reduce_scatter(Comm *c, const void *send, void *recv, size_t n, DType dt, CommOp op,
                        Err *err);
// send: (n,) from each rank; recv: (world*n,), rank r's at r*n.
int comm_all_gather(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err);
// comm_reduce_scatter without waiting for it: enqueued behind the compute issued so far
// (nccl), so the caller's compute goes on while it runs; send and recv stay untouched until
// comm_wait. Backends without asynchrony (shm) complete it before returning.
int comm_reduce_scatter_start(Comm *c, const void *send, void *recv, size_t n, DType dt, CommOp op,
                              Err *err);
// comm_all_gather without waiting for it, as comm_reduce_scatter_start.
int comm_all_gather_start(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err);
// The compute enqueued from now on (CommConfig.cuda_stream) runs after every collective
// started so far; the host does not wait (nccl; shm: nothing to do). A later comm_wait
// still watches them for the timeout.
int comm_join(Comm *c, Err *err);
// Waits for every collective started with comm_*_start (deadline: the call timeout).
int comm_wait(Comm *c, Err *err);
// bytes from root's buf to every rank's buf.
int comm_broadcast(Comm *c, void *buf, size_t bytes, int root, Err *err);
int comm_barrier(Comm *c, Err *err);

// shm segment names: "/astrai-<pid>-<random>", unique per run, so a crashed run's segment
// is never reused. The supervisor of the ranks (or rank 0 when there is none) picks it.
void comm_shm_new_name(char *out, size_t cap);
// Removes a run's segments ("<name>" and any "<name>-..." of it) that a rank killed before
// its cleanup left behind; the ranks' supervisor calls it once they are all gone.
void comm_shm_remove(const char *name);

// nccl rendezvous, rank 0's side: a fresh ncclUniqueId to hand to every rank
// (by astraid, or train/rendezvous.h). Fails with a clear error when the nccl
// backend is not built or NCCL cannot be loaded.
int comm_nccl_unique_id(uint8_t id[COMM_NCCL_ID_BYTES], Err *err);
