// comm.c: the backend-independent half of the collectives: config and argument
// checks, dispatch, error context, and the "unusable after an error" rule.
#include "comm/comm.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/comm_backend.h"

#define GLOO_NOT_BUILT "gloo backend not built (libgloo-dev not found at configure time)"
#define NCCL_NOT_BUILT "nccl backend not built (CUDA/NCCL not found at configure time)"

static int check_config(const CommConfig *cfg, Err *err) {
    if (!cfg->backend)
        return err_set(err,
                       "comm: backend is not set (want \"shm\", \"gloo\", \"hier\" or \"nccl\")");
    if (cfg->world_size < 1)
        return err_set(err, "comm: world_size %d must be at least 1", cfg->world_size);
    if (cfg->rank < 0 || cfg->rank >= cfg->world_size)
        return err_set(err, "comm: rank %d is outside 0..%d (world_size %d)", cfg->rank,
                       cfg->world_size - 1, cfg->world_size);
    if (cfg->timeout_ms <= 0)
        return err_set(err, "comm: timeout_ms %d must be positive", cfg->timeout_ms);
    return 0;
}

static int init_backend(Comm *c, const CommConfig *cfg, Err *err) {
    if (!strcmp(cfg->backend, "shm")) return shm_comm_init(c, cfg, err);
    if (!strcmp(cfg->backend, "hier")) return hier_comm_init(c, cfg, err);
    if (!strcmp(cfg->backend, "gloo")) {
#ifdef ASTRAI_HAVE_GLOO
        return gloo_comm_init(c, cfg, err);
#else
        return err_set(err, GLOO_NOT_BUILT);
#endif
    }
    if (!strcmp(cfg->backend, "nccl")) {
#ifdef ASTRAI_HAVE_NCCL
        return nccl_comm_init(c, cfg, err);
#else
        return err_set(err, NCCL_NOT_BUILT);
#endif
    }
    return err_set(err,
                   "comm: unknown backend \"%s\" (want \"shm\", \"gloo\", \"hier\" or \"nccl\")",
                   cfg->backend);
}

int comm_create(Comm **out, const CommConfig *cfg, Err *err) {
    *out = NULL;
    if (check_config(cfg, err)) return -1;
    Comm *c = calloc(1, sizeof *c);
    if (!c) return err_resource(err, "comm: out of memory");
    c->rank = cfg->rank;
    c->world = cfg->world_size;
    c->timeout_ms = cfg->timeout_ms;
    if (init_backend(c, cfg, err)) {
        free(c);
        return -1;
    }
    *out = c;
    return 0;
}

void comm_destroy(Comm *c) {
    if (!c) return;
    c->ops->destroy(c);
    free(c);
}

int comm_rank(const Comm *c) {
    return c->rank;
}

int comm_world_size(const Comm *c) {
    return c->world;
}

int comm_nccl_unique_id(uint8_t id[COMM_NCCL_ID_BYTES], Err *err) {
#ifdef ASTRAI_HAVE_NCCL
    return nccl_unique_id(id, err);
#else
    (void)id;
    return err_set(err, NCCL_NOT_BUILT);
#endif
}

// Called before each collective: a broken Comm repeats its first error.
static int usable(Comm *c, Err *err) {
    if (!c->broken) return 0;
    err_set(err, "%s", c->first_err.msg);
    return err_prefix(err, "comm unusable after an earlier error");
}

// Called after each collective: adds the context and remembers the first error.
static int finish(Comm *c, int rc, Err *err) {
    if (rc == 0) return 0;
    err_prefix(err, "%s", c->label);
    if (!c->broken) {
        c->broken = 1;
        c->first_err = *err;
    }
    return -1;
}

// Empty buffers may be NULL; the backends get a valid address all the same
// (zero-length copies from NULL are undefined behaviour).
static float empty_buffer[1];
#define OR_EMPTY(p) ((p) ? (p) : empty_buffer)

// Bad arguments fail this rank only (its peers then time out naming it).
static int check_buffer(Comm *c, const void *p, size_t n, const char *call, const char *what,
                        Err *err) {
    if (!n || p) return 0;
    err_set(err, "%s: %s is NULL for %zu elements", call, what, n);
    return finish(c, -1, err);
}

static int check_op(Comm *c, CommOp op, const char *call, Err *err) {
    if (op == COMM_SUM || op == COMM_AVG) return 0;
    err_set(err, "%s: op %d is not COMM_SUM or COMM_AVG", call, (int)op);
    return finish(c, -1, err);
}

static int check_dtype(Comm *c, DType dt, const char *call, Err *err) {
    if (dt == DT_F32 || dt == DT_BF16 || dt == DT_F16) return 0;
    err_set(err, "%s: dtype %d is not fp32, bf16 or fp16", call, (int)dt);
    return finish(c, -1, err);
}

static int check_total(Comm *c, size_t n, const char *call, Err *err) {
    if (n <= SIZE_MAX / sizeof(float) / (size_t)c->world) return 0;
    err_set(err, "%s: n %zu times world_size %d overflows", call, n, c->world);
    return finish(c, -1, err);
}

int comm_device_memory(const Comm *c) {
    return c->ops->device_memory;
}

int comm_all_reduce(Comm *c, void *buf, size_t n, DType dt, CommOp op, Err *err) {
    const char *call = "all_reduce";
    if (usable(c, err) || check_buffer(c, buf, n, call, "buf", err) || check_op(c, op, call, err) ||
        check_dtype(c, dt, call, err))
        return -1;
    return finish(c, c->ops->all_reduce(c, OR_EMPTY(buf), n, dt, op, err), err);
}

static int check_reduce_scatter(Comm *c, const void *send, const void *recv, size_t n, DType dt,
                                CommOp op, const char *call, Err *err) {
    return usable(c, err) || check_total(c, n, call, err) ||
           check_buffer(c, send, n, call, "send", err) ||
           check_buffer(c, recv, n, call, "recv", err) || check_op(c, op, call, err) ||
           check_dtype(c, dt, call, err);
}

int comm_reduce_scatter(Comm *c, const void *send, void *recv, size_t n, DType dt, CommOp op,
                        Err *err) {
    if (check_reduce_scatter(c, send, recv, n, dt, op, "reduce_scatter", err)) return -1;
    return finish(c, c->ops->reduce_scatter(c, OR_EMPTY(send), OR_EMPTY(recv), n, dt, op, err),
                  err);
}

int comm_reduce_scatter_start(Comm *c, const void *send, void *recv, size_t n, DType dt, CommOp op,
                              Err *err) {
    if (check_reduce_scatter(c, send, recv, n, dt, op, "reduce_scatter_start", err)) return -1;
    int (*start)(Comm *, const void *, void *, size_t, DType, CommOp, Err *) =
        c->ops->reduce_scatter_start ? c->ops->reduce_scatter_start : c->ops->reduce_scatter;
    return finish(c, start(c, OR_EMPTY(send), OR_EMPTY(recv), n, dt, op, err), err);
}

int comm_wait(Comm *c, Err *err) {
    if (usable(c, err)) return -1;
    return c->ops->wait ? finish(c, c->ops->wait(c, err), err) : 0;
}

static int check_all_gather(Comm *c, const void *send, const void *recv, size_t n, DType dt,
                            const char *call, Err *err) {
    return usable(c, err) || check_total(c, n, call, err) ||
           check_buffer(c, send, n, call, "send", err) ||
           check_buffer(c, recv, n, call, "recv", err) || check_dtype(c, dt, call, err);
}

int comm_all_gather(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err) {
    if (check_all_gather(c, send, recv, n, dt, "all_gather", err)) return -1;
    return finish(c, c->ops->all_gather(c, OR_EMPTY(send), OR_EMPTY(recv), n, dt, err), err);
}

int comm_all_gather_start(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err) {
    if (check_all_gather(c, send, recv, n, dt, "all_gather_start", err)) return -1;
    int (*start)(Comm *, const void *, void *, size_t, DType, Err *) =
        c->ops->all_gather_start ? c->ops->all_gather_start : c->ops->all_gather;
    return finish(c, start(c, OR_EMPTY(send), OR_EMPTY(recv), n, dt, err), err);
}

int comm_join(Comm *c, Err *err) {
    if (usable(c, err)) return -1;
    return c->ops->join ? finish(c, c->ops->join(c, err), err) : 0;
}

int comm_broadcast(Comm *c, void *buf, size_t bytes, int root, Err *err) {
    if (usable(c, err) || check_buffer(c, buf, bytes, "broadcast", "buf", err)) return -1;
    if (root < 0 || root >= c->world) {
        err_set(err, "broadcast: root %d is outside 0..%d", root, c->world - 1);
        return finish(c, -1, err);
    }
    return finish(c, c->ops->broadcast(c, buf ? buf : (void *)empty_buffer, bytes, root, err), err);
}

int comm_barrier(Comm *c, Err *err) {
    if (usable(c, err)) return -1;
    return finish(c, c->ops->barrier(c, err), err);
}

// The sum of an all_to_all's sizes (what its buffer holds), or -1 with the error when a size
// list is missing or its sum overflows.
static int sum_sizes(Comm *c, const size_t *bytes, const char *what, size_t *total, Err *err) {
    *total = 0;
    if (!bytes) {
        err_set(err, "all_to_all: %s is NULL (want %d sizes)", what, c->world);
        return finish(c, -1, err);
    }
    for (int r = 0; r < c->world; r++) {
        if (bytes[r] > SIZE_MAX - *total) {
            err_set(err, "all_to_all: %s overflows at rank %d's %zu bytes (after %zu)", what, r,
                    bytes[r], *total);
            return finish(c, -1, err);
        }
        *total += bytes[r];
    }
    return 0;
}

static int check_bytes_buffer(Comm *c, const void *p, size_t bytes, const char *what, Err *err) {
    if (!bytes || p) return 0;
    err_set(err, "all_to_all: %s is NULL for %zu bytes", what, bytes);
    return finish(c, -1, err);
}

// Overlap would let the copies read what they already overwrote (and NCCL forbids it).
static int check_disjoint(Comm *c, const void *send, size_t send_total, const void *recv,
                          size_t recv_total, Err *err) {
    uintptr_t s = (uintptr_t)send, r = (uintptr_t)recv;
    if (!send_total || !recv_total || s + send_total <= r || r + recv_total <= s) return 0;
    err_set(err, "all_to_all: send (%p, %zu bytes) and recv (%p, %zu bytes) overlap", send,
            send_total, recv, recv_total);
    return finish(c, -1, err);
}

int comm_all_to_all(Comm *c, const void *send, const size_t *send_bytes, void *recv,
                    const size_t *recv_bytes, Err *err) {
    size_t send_total, recv_total;
    if (usable(c, err) || sum_sizes(c, send_bytes, "send_bytes", &send_total, err) ||
        sum_sizes(c, recv_bytes, "recv_bytes", &recv_total, err) ||
        check_bytes_buffer(c, send, send_total, "send", err) ||
        check_bytes_buffer(c, recv, recv_total, "recv", err) ||
        check_disjoint(c, send, send_total, recv, recv_total, err))
        return -1;
    return finish(
        c, c->ops->all_to_all(c, OR_EMPTY(send), send_bytes, OR_EMPTY(recv), recv_bytes, err), err);
}

// Bad transfers fail this rank only, as bad collective arguments do.
static int check_p2p(Comm *c, const CommP2p *ops, int n, Err *err) {
    if (n <= 0 || !ops) {
        err_set(err, "p2p: %d transfers%s (want at least 1)", n, ops ? "" : " at NULL");
        return finish(c, -1, err);
    }
    for (int i = 0; i < n; i++) {
        const CommP2p *o = &ops[i];
        if (!o->buf && o->bytes) {
            err_set(err, "p2p: transfer %d's buf (%s rank %d) is NULL for %zu bytes", i,
                    o->send ? "to" : "from", o->peer, o->bytes);
            return finish(c, -1, err);
        }
        if (o->peer < 0 || o->peer >= c->world || o->peer == c->rank) {
            err_set(err, "p2p: transfer %d's peer %d is not another rank of 0..%d (this is %d)", i,
                    o->peer, c->world - 1, c->rank);
            return finish(c, -1, err);
        }
    }
    return 0;
}

int comm_p2p(Comm *c, const CommP2p *ops, int n, Err *err) {
    if (usable(c, err) || check_p2p(c, ops, n, err)) return -1;
    return finish(c, c->ops->p2p(c, ops, n, err), err);
}

int comm_p2p_start(Comm *c, const CommP2p *ops, int n, Err *err) {
    if (usable(c, err) || check_p2p(c, ops, n, err)) return -1;
    int (*start)(Comm *, const CommP2p *, int, Err *) =
        c->ops->p2p_start ? c->ops->p2p_start : c->ops->p2p;
    return finish(c, start(c, ops, n, err), err);
}

int comm_send(Comm *c, const void *buf, size_t bytes, int peer, Err *err) {
    CommP2p op = {.peer = peer, .send = 1, .buf = (void *)buf, .bytes = bytes};
    return comm_p2p(c, &op, 1, err);
}

int comm_recv(Comm *c, void *buf, size_t bytes, int peer, Err *err) {
    CommP2p op = {.peer = peer, .send = 0, .buf = buf, .bytes = bytes};
    return comm_p2p(c, &op, 1, err);
}

int comm_split(Comm *c, int color, int key, Comm **out, Err *err) {
    *out = NULL;
    if (usable(c, err)) return -1;
    if (color < 0) {
        err_set(err, "comm_split: color %d must be >= 0", color);
        return finish(c, -1, err);
    }
    Comm *sub = calloc(1, sizeof *sub);
    if (!sub) {
        err_resource(err, "comm_split: out of memory");
        return finish(c, -1, err);
    }
    sub->timeout_ms = c->timeout_ms;
    if (c->ops->split(c, color, key, sub, err)) {
        free(sub);
        return finish(c, -1, err);
    }
    *out = sub;
    return 0;
}
