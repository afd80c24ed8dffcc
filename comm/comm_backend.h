// comm_backend.h: what a comm backend (shm.c, gloo.cc, hier.c, nccl.c) provides to the dispatch in
// comm.c (internal).
#pragma once
#include "comm/comm.h"

typedef struct {
    int device_memory; // buffers are device pointers
    // Reductions: the backend says which dtypes it reduces (an error naming it otherwise).
    int (*all_reduce)(Comm *c, void *buf, size_t n, DType dt, CommOp op, Err *err);
    int (*reduce_scatter)(Comm *c, const void *send, void *recv, size_t n, DType dt, CommOp op,
                          Err *err);
    int (*all_gather)(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err);
    // Asynchrony (NULL: the *_start calls run the blocking ones, join and wait return).
    int (*reduce_scatter_start)(Comm *c, const void *send, void *recv, size_t n, DType dt,
                                CommOp op, Err *err);
    int (*all_gather_start)(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err);
    int (*join)(Comm *c, Err *err); // NULL: nothing to do
    int (*wait)(Comm *c, Err *err);
    int (*broadcast)(Comm *c, void *buf, size_t bytes, int root, Err *err);
    int (*barrier)(Comm *c, Err *err);
    // send_bytes, recv_bytes: world entries each, their sums checked not to overflow; the
    // buffers non-overlapping, NULL replaced by a valid address when their sum is 0.
    int (*all_to_all)(Comm *c, const void *send, const size_t *send_bytes, void *recv,
                      const size_t *recv_bytes, Err *err);
    // ops: checked (n > 0, peers in range and not this rank); buf is NULL only for 0 bytes.
    int (*p2p)(Comm *c, const CommP2p *ops, int n, Err *err);
    int (*p2p_start)(Comm *c, const CommP2p *ops, int n, Err *err); // NULL: p2p
    // Fills out (calloc'ed, timeout_ms set) as the *_comm_init below do.
    int (*split)(Comm *c, int color, int key, Comm *out, Err *err);
    void (*destroy)(Comm *c);
} CommBackend;

struct Comm {
    const CommBackend *ops;
    int rank, world;
    int timeout_ms;
    char label[96]; // "shm /astrai-x rank 1/4": the prefix of every error message
    int broken;     // an earlier call failed; later calls repeat its error
    Err first_err;
    void *state; // the backend's own
};

// Each fills c->ops, c->state and c->label (c->rank, world, timeout_ms are set); on
// failure it frees what it allocated and leaves c->state NULL.
int shm_comm_init(Comm *c, const CommConfig *cfg, Err *err);
// comm/hier.c: its gloo sub-Comms fail with comm.c's "not built" message without gloo.
int hier_comm_init(Comm *c, const CommConfig *cfg, Err *err);
#ifdef ASTRAI_HAVE_NCCL
int nccl_comm_init(Comm *c, const CommConfig *cfg, Err *err);
int nccl_unique_id(uint8_t id[COMM_NCCL_ID_BYTES], Err *err);
#endif
#ifdef ASTRAI_HAVE_GLOO
// comm/gloo.cc (C++, extern "C"): needs cfg->exchange for the connect.
#ifdef __cplusplus
extern "C"
#endif
    int
    gloo_comm_init(Comm *c, const CommConfig *cfg, Err *err);
#endif
