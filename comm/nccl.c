// nccl.c: the `nccl` backend (GPU ranks): the same collectives on CUDA device
// buffers, with the timeouts NCCL itself does not have.
//
// NCCL and the CUDA runtime are loaded with dlopen at comm_create, not linked:
// every astrai binary links astrai_core, and must start (and run the CPU
// path) on a machine without a GPU driver or without these libraries.
//
// Ordering: each call first makes our stream wait for an event recorded on the caller's
// compute stream (CommConfig.cuda_stream), so it reads buffers the compute has finished.
//
// Timeouts: the communicator is created non-blocking, every call is enqueued
// on our own stream and then polled (stream done? NCCL async error?) until the
// deadline; past it the communicator is aborted (ncclCommAbort), which is what
// unblocks the GPU when a peer died, and the Comm stays broken.
//
// Point-to-point transfers are one ncclGroupStart/End of ncclSend/ncclRecv, run and waited
// for as a collective; so is all-to-all, a send to and a receive from every rank (itself
// included) in one group. Sub-communicators come from ncclCommSplit (NCCL 2.18 or later; loaded
// only when present, so an older library still runs everything else).
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/comm_backend.h"
#include "common/clock.h"

#define POLL_NS 100000 // 0.1 ms between polls of a running collective

#ifndef ASTRAI_NCCL_LIB
#define ASTRAI_NCCL_LIB "libnccl.so.2"
#endif
#ifndef ASTRAI_CUDART_LIB
#define ASTRAI_CUDART_LIB "libcudart.so"
#endif

// The entry points we use, typed from the headers.
#define API_FN(name) __typeof__(&name) name
typedef struct {
    void *nccl, *cudart;
    API_FN(ncclGetUniqueId);
    API_FN(ncclCommInitRankConfig);
    API_FN(ncclCommGetAsyncError);
    API_FN(ncclCommAbort);
    API_FN(ncclCommFinalize);
    API_FN(ncclCommDestroy);
    API_FN(ncclGetErrorString);
    API_FN(ncclGetLastError);
    API_FN(ncclAllReduce);
    API_FN(ncclReduceScatter);
    API_FN(ncclAllGather);
    API_FN(ncclBroadcast);
    API_FN(ncclSend);
    API_FN(ncclRecv);
    API_FN(ncclGroupStart);
    API_FN(ncclGroupEnd);
    API_FN(ncclCommCount);
    API_FN(ncclCommUserRank);
    API_FN(ncclCommSplit); // NULL when the library predates it
    API_FN(cudaGetDeviceCount);
    API_FN(cudaSetDevice);
    API_FN(cudaStreamCreateWithFlags);
    API_FN(cudaStreamQuery);
    API_FN(cudaStreamDestroy);
    API_FN(cudaEventCreateWithFlags);
    API_FN(cudaEventRecord);
    API_FN(cudaEventDestroy);
    API_FN(cudaStreamWaitEvent);
    API_FN(cudaMalloc);
    API_FN(cudaFree);
    API_FN(cudaGetErrorString);
} Api;

typedef struct {
    Api api;
    ncclComm_t comm;
    cudaStream_t stream;  // where the collectives run
    cudaStream_t compute; // the caller's compute stream (CommConfig.cuda_stream)
    cudaEvent_t ready;    // recorded on `compute` before each collective
    cudaEvent_t done;     // recorded on `stream` for comm_join
    float *scratch;       // one float on the device, for the barrier
    int device;
} Nccl;

// ---------------------------------------------------------------- loading

static void *open_lib(const char *path, const char *fallback, Err *err) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen(fallback, RTLD_NOW | RTLD_LOCAL);
    if (!h) err_set(err, "cannot load %s: %s", fallback, dlerror());
    return h;
}

static int load_sym(void *lib, const char *name, void **fn, Err *err) {
    *fn = dlsym(lib, name);
    if (!*fn) return err_set(err, "symbol %s missing: %s", name, dlerror());
    return 0;
}

#define LOAD(lib, name) load_sym(a->lib, #name, (void **)&a->name, err)

static int load_api(Api *a, Err *err) {
    memset(a, 0, sizeof *a);
    if (!(a->cudart = open_lib(ASTRAI_CUDART_LIB, "libcudart.so", err))) return -1;
    if (!(a->nccl = open_lib(ASTRAI_NCCL_LIB, "libnccl.so.2", err))) return -1;
    if (LOAD(nccl, ncclGetUniqueId) || LOAD(nccl, ncclCommInitRankConfig) ||
        LOAD(nccl, ncclCommGetAsyncError) || LOAD(nccl, ncclCommAbort) ||
        LOAD(nccl, ncclCommFinalize) || LOAD(nccl, ncclCommDestroy) ||
        LOAD(nccl, ncclGetErrorString) || LOAD(nccl, ncclGetLastError) ||
        LOAD(nccl, ncclAllReduce) || LOAD(nccl, ncclReduceScatter) || LOAD(nccl, ncclAllGather) ||
        LOAD(nccl, ncclBroadcast) || LOAD(nccl, ncclSend) || LOAD(nccl, ncclRecv) ||
        LOAD(nccl, ncclGroupStart) || LOAD(nccl, ncclGroupEnd) || LOAD(nccl, ncclCommCount) ||
        LOAD(nccl, ncclCommUserRank) || LOAD(cudart, cudaGetDeviceCount) ||
        LOAD(cudart, cudaSetDevice) || LOAD(cudart, cudaStreamCreateWithFlags) ||
        LOAD(cudart, cudaStreamQuery) || LOAD(cudart, cudaStreamDestroy) ||
        LOAD(cudart, cudaEventCreateWithFlags) || LOAD(cudart, cudaEventRecord) ||
        LOAD(cudart, cudaEventDestroy) || LOAD(cudart, cudaStreamWaitEvent) ||
        LOAD(cudart, cudaMalloc) || LOAD(cudart, cudaFree) || LOAD(cudart, cudaGetErrorString))
        return -1;
    a->ncclCommSplit = (__typeof__(a->ncclCommSplit))dlsym(a->nccl, "ncclCommSplit");
    return 0;
}

static void unload_api(Api *a) {
    // Only after a failed load: once NCCL ran, its threads may still reference the library.
    if (a->nccl) dlclose(a->nccl);
    if (a->cudart) dlclose(a->cudart);
}

// ---------------------------------------------------------------- errors and waiting

static int cuda_fail(const Api *a, cudaError_t e, const char *what, Err *err) {
    return err_set(err, "%s: %s (CUDA error %d)", what, a->cudaGetErrorString(e), (int)e);
}

static int nccl_fail(Nccl *x, ncclResult_t r, const char *what, Err *err) {
    const char *detail = x->comm ? x->api.ncclGetLastError(x->comm) : "";
    return err_set(err, "%s: %s%s%s", what, x->api.ncclGetErrorString(r),
                   detail && *detail ? ": " : "", detail ? detail : "");
}

static void pause_poll(void) {
    struct timespec t = {0, POLL_NS};
    nanosleep(&t, NULL);
}

// Aborts the communicator: the only way to free a GPU stuck on a dead peer.
static int abort_after(Comm *c, const char *what, Err *err) {
    Nccl *x = c->state;
    x->api.ncclCommAbort(x->comm);
    x->comm = NULL;
    return err_set(err,
                   "timed out after %d ms in %s (a peer died, hangs or was not started with "
                   "the same id); communicator aborted",
                   c->timeout_ms, what);
}

// Waits until the communicator leaves ncclInProgress (non-blocking init / enqueue).
static int wait_comm_ready(Comm *c, double deadline, const char *what, Err *err) {
    Nccl *x = c->state;
    for (;;) {
        ncclResult_t state;
        ncclResult_t r = x->api.ncclCommGetAsyncError(x->comm, &state);
        if (r != ncclSuccess) return nccl_fail(x, r, what, err);
        if (state == ncclSuccess) return 0;
        if (state != ncclInProgress) return nccl_fail(x, state, what, err);
        if ((double)clock_mono_ms() > deadline) return abort_after(c, what, err);
        pause_poll();
    }
}

// Waits for the enqueued collective to finish on the stream.
static int wait_stream(Comm *c, double deadline, const char *what, Err *err) {
    Nccl *x = c->state;
    for (;;) {
        cudaError_t e = x->api.cudaStreamQuery(x->stream);
        if (e == cudaSuccess) return 0;
        if (e != cudaErrorNotReady) return cuda_fail(&x->api, e, what, err);
        ncclResult_t state;
        if (x->api.ncclCommGetAsyncError(x->comm, &state) == ncclSuccess && state != ncclSuccess &&
            state != ncclInProgress)
            return nccl_fail(x, state, what, err);
        if ((double)clock_mono_ms() > deadline) return abort_after(c, what, err);
        pause_poll();
    }
}

// Every collective: refuse after an abort, enqueue, wait for the enqueue, wait for the GPU.
static int run(Comm *c, ncclResult_t enqueued, const char *what, Err *err) {
    Nccl *x = c->state;
    double deadline = (double)clock_mono_ms() + c->timeout_ms;
    if (enqueued != ncclSuccess && enqueued != ncclInProgress)
        return nccl_fail(x, enqueued, what, err);
    if (wait_comm_ready(c, deadline, what, err)) return -1;
    return wait_stream(c, deadline, what, err);
}

static int aborted(Comm *c, Err *err) {
    if (((Nccl *)c->state)->comm) return 0;
    return err_set(err, "the communicator was aborted after an earlier error");
}

// ---------------------------------------------------------------- collectives

static ncclRedOp_t red_op(CommOp op) {
    return op == COMM_AVG ? ncclAvg : ncclSum;
}

static ncclDataType_t nccl_type(DType dt) {
    return dt == DT_BF16 ? ncclBfloat16 : dt == DT_F16 ? ncclHalf : ncclFloat;
}

// Orders the collective after the compute enqueued so far: our stream waits for an
// event recorded on the compute stream (the buffers are ready when the event is).
static int after_compute(Comm *c, const char *what, Err *err) {
    Nccl *x = c->state;
    cudaError_t e = x->api.cudaEventRecord(x->ready, x->compute);
    if (e == cudaSuccess) e = x->api.cudaStreamWaitEvent(x->stream, x->ready, 0);
    return e == cudaSuccess ? 0 : cuda_fail(&x->api, e, what, err);
}

static int nccl_all_reduce(Comm *c, void *buf, size_t n, DType dt, CommOp op, Err *err) {
    Nccl *x = c->state;
    if (aborted(c, err) || after_compute(c, "ncclAllReduce", err)) return -1;
    return run(c, x->api.ncclAllReduce(buf, buf, n, nccl_type(dt), red_op(op), x->comm, x->stream),
               "ncclAllReduce", err);
}

static int nccl_reduce_scatter(Comm *c, const void *send, void *recv, size_t n, DType dt, CommOp op,
                               Err *err) {
    Nccl *x = c->state;
    if (aborted(c, err) || after_compute(c, "ncclReduceScatter", err)) return -1;
    return run(
        c, x->api.ncclReduceScatter(send, recv, n, nccl_type(dt), red_op(op), x->comm, x->stream),
        "ncclReduceScatter", err);
}

// Enqueued only: the compute stream goes on; nccl_wait (or any blocking call, which waits
// for our stream) finishes it.
static int nccl_reduce_scatter_start(Comm *c, const void *send, void *recv, size_t n, DType dt,
                                     CommOp op, Err *err) {
    Nccl *x = c->state;
    const char *what = "ncclReduceScatter (overlapped)";
    if (aborted(c, err) || after_compute(c, what, err)) return -1;
    ncclResult_t r =
        x->api.ncclReduceScatter(send, recv, n, nccl_type(dt), red_op(op), x->comm, x->stream);
    if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(x, r, what, err);
    return wait_comm_ready(c, (double)clock_mono_ms() + c->timeout_ms, what, err);
}

static int nccl_all_gather_start(Comm *c, const void *send, void *recv, size_t n, DType dt,
                                 Err *err) {
    Nccl *x = c->state;
    const char *what = "ncclAllGather (overlapped)";
    if (aborted(c, err) || after_compute(c, what, err)) return -1;
    ncclResult_t r = x->api.ncclAllGather(send, recv, n, nccl_type(dt), x->comm, x->stream);
    if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(x, r, what, err);
    return wait_comm_ready(c, (double)clock_mono_ms() + c->timeout_ms, what, err);
}

// The compute stream waits (on the device) for an event recorded behind our collectives.
static int nccl_join(Comm *c, Err *err) {
    Nccl *x = c->state;
    if (aborted(c, err)) return -1;
    cudaError_t e = x->api.cudaEventRecord(x->done, x->stream);
    if (e == cudaSuccess) e = x->api.cudaStreamWaitEvent(x->compute, x->done, 0);
    return e == cudaSuccess ? 0 : cuda_fail(&x->api, e, "joining the compute stream", err);
}

static int nccl_wait(Comm *c, Err *err) {
    if (aborted(c, err)) return -1;
    return wait_stream(c, (double)clock_mono_ms() + c->timeout_ms, "the overlapped collectives",
                       err);
}

static int nccl_all_gather(Comm *c, const void *send, void *recv, size_t n, DType dt, Err *err) {
    Nccl *x = c->state;
    if (aborted(c, err) || after_compute(c, "ncclAllGather", err)) return -1;
    return run(c, x->api.ncclAllGather(send, recv, n, nccl_type(dt), x->comm, x->stream),
               "ncclAllGather", err);
}

static int nccl_broadcast(Comm *c, void *buf, size_t bytes, int root, Err *err) {
    Nccl *x = c->state;
    if (aborted(c, err) || after_compute(c, "ncclBroadcast", err)) return -1;
    return run(c, x->api.ncclBroadcast(buf, buf, bytes, ncclUint8, root, x->comm, x->stream),
               "ncclBroadcast", err);
}

static int nccl_barrier(Comm *c, Err *err) {
    return nccl_all_reduce(c, ((Nccl *)c->state)->scratch, 1, DT_F32, COMM_SUM, err);
}

// One group of sends and receives; the group is closed even after a failed call in it.
static ncclResult_t enqueue_p2p(Nccl *x, const CommP2p *ops, int n) {
    ncclResult_t r = x->api.ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (int i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); i++)
        r = ops[i].send ? x->api.ncclSend(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, x->comm,
                                          x->stream)
                        : x->api.ncclRecv(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, x->comm,
                                          x->stream);
    ncclResult_t end = x->api.ncclGroupEnd();
    return r == ncclSuccess || r == ncclInProgress ? end : r;
}

// "ncclSend/ncclRecv with rank 1, 3": the peers a timeout names.
static void describe_p2p(const CommP2p *ops, int n, char *out, size_t size) {
    size_t len = (size_t)snprintf(out, size, "ncclSend/ncclRecv with rank");
    for (int i = 0; i < n && len < size; i++)
        len += (size_t)snprintf(out + len, size - len, "%s %d", i ? "," : "", ops[i].peer);
}

static int nccl_p2p(Comm *c, const CommP2p *ops, int n, Err *err) {
    Nccl *x = c->state;
    char what[160];
    describe_p2p(ops, n, what, sizeof what);
    if (aborted(c, err) || after_compute(c, what, err)) return -1;
    return run(c, enqueue_p2p(x, ops, n), what, err);
}

// Enqueued on the comm stream behind the compute; comm_join / comm_wait follow it.
static int nccl_p2p_start(Comm *c, const CommP2p *ops, int n, Err *err) {
    Nccl *x = c->state;
    char what[176];
    describe_p2p(ops, n, what, sizeof what);
    if (aborted(c, err) || after_compute(c, what, err)) return -1;
    ncclResult_t r = enqueue_p2p(x, ops, n);
    if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(x, r, what, err);
    return wait_comm_ready(c, (double)clock_mono_ms() + c->timeout_ms, what, err);
}

// One send and one receive per rank with bytes to move, as one p2p group: NCCL pairs a group's
// sends and receives between two ranks whatever their order, and both sides skip the same
// 0-byte pairs (the sizes agree per pair). ops: room for 2 * world.
static int a2a_ops(Comm *c, const void *send, const size_t *send_bytes, void *recv,
                   const size_t *recv_bytes, CommP2p *ops) {
    int n = 0;
    size_t sent = 0, got = 0;
    for (int r = 0; r < c->world; r++) {
        if (send_bytes[r]) ops[n++] = (CommP2p){r, 1, (char *)send + sent, send_bytes[r]};
        if (recv_bytes[r]) ops[n++] = (CommP2p){r, 0, (char *)recv + got, recv_bytes[r]};
        sent += send_bytes[r];
        got += recv_bytes[r];
    }
    return n;
}

static int nccl_all_to_all(Comm *c, const void *send, const size_t *send_bytes, void *recv,
                           const size_t *recv_bytes, Err *err) {
    Nccl *x = c->state;
    char what[96];
    snprintf(what, sizeof what, "all_to_all (ncclSend/ncclRecv with each of %d ranks)", c->world);
    if (aborted(c, err) || after_compute(c, what, err)) return -1;
    CommP2p *ops = malloc(2 * (size_t)c->world * sizeof *ops);
    if (!ops) return err_resource(err, "all_to_all: out of memory for %d ranks", c->world);
    int n = a2a_ops(c, send, send_bytes, recv, recv_bytes, ops);
    ncclResult_t r = n ? enqueue_p2p(x, ops, n) : ncclSuccess;
    free(ops);
    return run(c, r, what, err);
}

// ---------------------------------------------------------------- create / destroy

static void nccl_destroy(Comm *c) {
    Nccl *x = c->state;
    if (x->comm && c->broken)
        x->api.ncclCommAbort(x->comm);
    else if (x->comm) {
        // Finalize flushes pending work (non-blocking: wait for it, abort past the timeout).
        Err ignored;
        ncclResult_t r = x->api.ncclCommFinalize(x->comm);
        if ((r == ncclSuccess || r == ncclInProgress) &&
            !wait_comm_ready(c, (double)clock_mono_ms() + c->timeout_ms, "ncclCommFinalize",
                             &ignored))
            x->api.ncclCommDestroy(x->comm);
        else if (x->comm)
            x->api.ncclCommAbort(x->comm);
    }
    if (x->scratch) x->api.cudaFree(x->scratch);
    if (x->ready) x->api.cudaEventDestroy(x->ready);
    if (x->done) x->api.cudaEventDestroy(x->done);
    if (x->stream) x->api.cudaStreamDestroy(x->stream);
    free(x);
}

static int nccl_split(Comm *c, int color, int key, Comm *out, Err *err);

static const CommBackend NCCL_OPS = {.device_memory = 1,
                                     .all_reduce = nccl_all_reduce,
                                     .reduce_scatter = nccl_reduce_scatter,
                                     .all_gather = nccl_all_gather,
                                     .reduce_scatter_start = nccl_reduce_scatter_start,
                                     .all_gather_start = nccl_all_gather_start,
                                     .join = nccl_join,
                                     .wait = nccl_wait,
                                     .broadcast = nccl_broadcast,
                                     .barrier = nccl_barrier,
                                     .all_to_all = nccl_all_to_all,
                                     .p2p = nccl_p2p,
                                     .p2p_start = nccl_p2p_start,
                                     .split = nccl_split,
                                     .destroy = nccl_destroy};

static int open_device(Nccl *x, int device, void *compute_stream, Err *err) {
    const Api *a = &x->api;
    int count = 0;
    cudaError_t e = a->cudaGetDeviceCount(&count);
    if (e != cudaSuccess) return cuda_fail(a, e, "no usable CUDA device (cudaGetDeviceCount)", err);
    if (device < 0 || device >= count)
        return err_set(err, "cuda_device %d is outside the %d device(s) present", device, count);
    if ((e = a->cudaSetDevice(device))) return cuda_fail(a, e, "cudaSetDevice", err);
    if ((e = a->cudaStreamCreateWithFlags(&x->stream, cudaStreamNonBlocking)))
        return cuda_fail(a, e, "cudaStreamCreateWithFlags", err);
    if ((e = a->cudaEventCreateWithFlags(&x->ready, cudaEventDisableTiming)) ||
        (e = a->cudaEventCreateWithFlags(&x->done, cudaEventDisableTiming)))
        return cuda_fail(a, e, "cudaEventCreateWithFlags", err);
    x->compute = (cudaStream_t)compute_stream;
    x->device = device;
    if ((e = a->cudaMalloc((void **)&x->scratch, sizeof(float))))
        return cuda_fail(a, e, "cudaMalloc", err);
    return 0;
}

static int init_comm(Comm *c, const CommConfig *cfg, Err *err) {
    Nccl *x = c->state;
    ncclUniqueId id;
    memcpy(id.internal, cfg->nccl_id, sizeof id.internal);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0; // so that a missing peer times out instead of hanging here
    ncclResult_t r = x->api.ncclCommInitRankConfig(&x->comm, c->world, id, c->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        x->comm = NULL;
        return nccl_fail(x, r, "ncclCommInitRankConfig", err);
    }
    return wait_comm_ready(c, (double)clock_mono_ms() + c->timeout_ms, "ncclCommInitRankConfig",
                           err);
}

static void set_label(Comm *c, int device) {
    snprintf(c->label, sizeof c->label, "nccl rank %d/%d (cuda device %d)", c->rank, c->world,
             device);
}

// After a failed init: abort, not finalize, a communicator that failed to come up.
static int init_failed(Comm *c, Err *err) {
    c->broken = 1;
    nccl_destroy(c);
    c->state = NULL;
    return err_prefix(err, "%s", c->label);
}

int nccl_comm_init(Comm *c, const CommConfig *cfg, Err *err) {
    set_label(c, cfg->cuda_device);
    _Static_assert(sizeof(ncclUniqueId) == COMM_NCCL_ID_BYTES, "ncclUniqueId size");
    if (!cfg->nccl_id)
        return err_set(err,
                       "nccl backend needs nccl_id (the %d-byte ncclUniqueId from rank 0 "
                       "via the rendezvous)",
                       COMM_NCCL_ID_BYTES);
    Nccl *x = calloc(1, sizeof *x);
    if (!x) return err_resource(err, "nccl: out of memory");
    if (load_api(&x->api, err)) {
        unload_api(&x->api);
        free(x);
        return err_prefix(err, "nccl backend");
    }
    c->state = x;
    c->ops = &NCCL_OPS;
    if (open_device(x, cfg->cuda_device, cfg->cuda_stream, err) || init_comm(c, cfg, err))
        return init_failed(c, err);
    return 0;
}

// ncclCommSplit of the parent's communicator (non-blocking as it is), then its rank and size.
static int split_comm(Comm *out, const Nccl *parent, int color, int key, Err *err) {
    Nccl *x = out->state;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = x->api.ncclCommSplit(parent->comm, color, key, &x->comm, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        x->comm = NULL;
        return nccl_fail(x, r, "ncclCommSplit", err);
    }
    if (wait_comm_ready(out, (double)clock_mono_ms() + out->timeout_ms, "ncclCommSplit", err))
        return -1;
    if ((r = x->api.ncclCommUserRank(x->comm, &out->rank)) ||
        (r = x->api.ncclCommCount(x->comm, &out->world)))
        return nccl_fail(x, r, "ncclCommUserRank/ncclCommCount", err);
    set_label(out, x->device);
    return 0;
}

static int nccl_split(Comm *c, int color, int key, Comm *out, Err *err) {
    Nccl *parent = c->state;
    if (aborted(c, err)) return -1;
    if (!parent->api.ncclCommSplit)
        return err_set(err, "comm_split: %s has no ncclCommSplit (NCCL 2.18 or later needed)",
                       ASTRAI_NCCL_LIB);
    Nccl *x = calloc(1, sizeof *x);
    if (!x) return err_resource(err, "comm_split: out of memory");
    x->api = parent->api;
    out->state = x;
    out->ops = &NCCL_OPS;
    snprintf(out->label, sizeof out->label, "nccl comm_split(color %d, key %d)", color, key);
    if (open_device(x, parent->device, parent->compute, err) ||
        split_comm(out, parent, color, key, err))
        return init_failed(out, err);
    return 0;
}

int nccl_unique_id(uint8_t id[COMM_NCCL_ID_BYTES], Err *err) {
    Api a;
    if (load_api(&a, err)) {
        unload_api(&a);
        return err_prefix(err, "nccl backend");
    }
    ncclUniqueId uid;
    ncclResult_t r = a.ncclGetUniqueId(&uid);
    if (r != ncclSuccess) return err_set(err, "ncclGetUniqueId: %s", a.ncclGetErrorString(r));
    memcpy(id, uid.internal, COMM_NCCL_ID_BYTES);
    return 0;
}
