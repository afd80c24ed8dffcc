// comm.h: collectives between the ranks of one job (docs/design.md §9).
//
// One interface, four backends: `shm` (CPU ranks on one host, process-shared
// memory: each rank reduces its slice of the buffer, then every rank gathers
// the slices), `gloo` (CPU ranks on any hosts: Facebook's Gloo over TCP, through
// the C++ shim gloo.cc), `hier` (CPU ranks, the same number on each of several
// hosts: shm within a host and gloo between hosts, comm/hier.c) and `nccl` (GPU,
// compiled when NCCL and CUDA are found).
// Every call has a timeout: a dead or stuck peer gives a clear error naming it
// (and a non-zero exit in the caller), never a silent hang. Results of the
// reductions, gathers and broadcasts are bitwise identical on every rank.
//
// Collectives: all_reduce, reduce_scatter, all_gather (also started without
// waiting), broadcast, barrier, all_to_all (variable sizes), comm_split; besides
// them, point-to-point transfers (comm_p2p), which are not collectives.
// Every rank must call the same collectives in the same order with the same
// sizes (all_to_all: sizes that agree per pair of ranks; the shm backend checks
// this and fails every rank on a mismatch).
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

// gloo: the store of Gloo's full-mesh connect. Every rank calls all_gather at the same point
// with its own blob (mine, len bytes); on success *all (malloc'ed, the caller frees it) holds
// every rank's blob one after the other in rank order and lens[r] (world_size entries) the size
// of rank r's. train/rendezvous.h serves it over the meeting's connections.
typedef struct {
    int (*all_gather)(void *ctx, const void *mine, size_t len, uint8_t **all, size_t *lens,
                      Err *err);
    void *ctx;
} CommExchange;

typedef struct {
    const char *backend; // "shm" | "gloo" | "hier" | "nccl"
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
    // gloo: the exchange of the connect (above), the local address its TCP device binds (the
    // address this rank reached rank 0 from; NULL: GLOO_SOCKET_IFNAME's interface, else the
    // host name's address), and each rank's host (world_size names, for the messages that
    // name a peer; NULL: unknown).
    const CommExchange *exchange;
    const char *gloo_addr;
    const char *const *hosts;
    // hier: each rank's host (world_size entries; equal values = one host; NULL: unknown,
    // which hier refuses). Within a host it takes shm_name + "-h<host index>" as its segment
    // and needs shm_chunk_bytes valid for the host's ranks; between hosts gloo's fields above.
    const int *host_of;
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
// All-to-all of variable sizes (expert parallelism, docs/design.md §7a): rank r's send holds, one
// after the other, send_bytes[0] bytes for rank 0, send_bytes[1] for rank 1, ...; its recv gets,
// one after the other, recv_bytes[q] bytes from each rank q (its own part copied). Per ordered
// pair, send_bytes[r] on rank q must equal recv_bytes[q] on rank r (shm checks this and fails both
// ranks with both sizes named; nccl trusts it). Buffers: host memory (shm) or device memory (nccl),
// send and recv must not overlap. A collective: every rank of c calls it, in the same order as the
// others. Blocking; timeout and broken-Comm rules as for the other collectives.
int comm_all_to_all(Comm *c, const void *send, const size_t *send_bytes, void *recv,
                    const size_t *recv_bytes, Err *err);

// Point-to-point (pipeline stages, docs/design.md §13). One transfer of a group:
typedef struct {
    int peer;  // the other rank of this communicator
    int send;  // 1: buf goes to peer; 0: buf is filled with what peer sends
    void *buf; // (bytes) host memory (shm) or device memory (nccl)
    size_t bytes;
} CommP2p;

// Runs the transfers ops[0..n) together and returns when all are done (nccl: ncclSend/ncclRecv
// between ncclGroupStart/End on the communicator's stream, ordered after the compute as the
// collectives are). Per ordered pair of ranks, the k-th send of a to b is the k-th receive of b
// from a: their sizes must be equal (an error on both ranks naming both sizes otherwise; shm checks
// this, as it checks the collectives; nccl trusts it as NCCL does). 0 bytes is a transfer too: it
// matches a receive of 0 bytes and moves nothing. Transfers of one group progress together, so two
// neighbours that each send to the other in one group (1F1B's send-forward / receive-backward)
// never deadlock, whatever the sizes. A peer that died or never posts its side: an error after the
// timeout naming the peer, and the Comm is broken as after a failed collective. Point-to-point
// calls are not collectives: ranks not involved call nothing, and they do not count in the "same
// collectives in the same order" check.
int comm_p2p(Comm *c, const CommP2p *ops, int n, Err *err);
// comm_p2p without waiting for it, as comm_reduce_scatter_start: enqueued behind the compute
// issued so far (nccl), the buffers untouched until comm_wait; the compute that reads what it
// receives comes after comm_join. Backends without asynchrony (shm) complete it before returning.
int comm_p2p_start(Comm *c, const CommP2p *ops, int n, Err *err);
int comm_send(Comm *c, const void *buf, size_t bytes, int peer, Err *err); // comm_p2p of one
int comm_recv(Comm *c, void *buf, size_t bytes, int peer, Err *err);

// A sub-communicator (collective over c: every rank of c calls it): the ranks that give the same
// color (>= 0) form one group, ranked by key (ties by their rank in c). shm: a segment of its own
// named after c's ("<name>-g<color>", so comm_shm_remove of the run's name removes it too); nccl:
// ncclCommSplit (loaded with dlsym like the rest; a clear error when the NCCL library lacks it).
// The new Comm has c's timeout, stream and device; comm_destroy it before c.
int comm_split(Comm *c, int color, int key, Comm **out, Err *err);

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
