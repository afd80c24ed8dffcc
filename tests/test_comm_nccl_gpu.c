// test_comm_nccl_gpu.c: the nccl backend of comm/ on a real GPU, world size 1 on device 0.
//
// The ncclUniqueId comes from comm_nccl_unique_id and travels through rendezvous_run (world
// 1), then every collective runs on device buffers of the CUDA backend (all_reduce sum/avg in
// fp32 and bf16, reduce_scatter, all_gather in fp32 and bf16, broadcast, barrier) and the
// results are checked exactly (with one rank every collective is a copy, so the expected
// values are the inputs; outputs start as 0xff bytes so a short copy shows). Then the abort
// path: comm_create for world size 2 with only this rank must fail within its 2 s timeout
// with an error that says so, never hang (an alarm fails the test after 60 s). Pipeline
// parallelism's parts that one GPU can run: comm_split of the 1-rank communicator (ncclCommSplit)
// gives a working communicator, and comm_p2p with this rank as its peer is refused clearly.
// The communicator is given the CUDA backend's compute stream, as astrai-train does: no
// explicit sync anywhere, so a collective that does not wait for the upload before it, or
// returns before it finished, shows as wrong values. Expert parallelism's all_to_all at world
// 1: its own part, an ncclSend/ncclRecv to itself.
//
// Exit 77 (ctest SKIP_RETURN_CODE) when built without NCCL or CUDA, or when no GPU is visible.
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "comm/comm.h"
#include "common/dtype.h"
#include "engine/backend.h"
#include "train/rendezvous.h"
#ifdef ASTRAI_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

#if defined(ASTRAI_HAVE_NCCL) && defined(ASTRAI_HAVE_CUDA)
static const Backend *gpu; // the CUDA backend (bf16 tables; only its memory ops are used)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "test_comm_nccl_gpu: FAIL: hung for 60 s (no timeout/abort)\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(1);
}

static void *dev_alloc(size_t bytes) {
    Err err = {0};
    void *p = gpu->alloc(bytes, &err);
    if (!p) {
        fprintf(stderr, "test_comm_nccl_gpu: alloc %zu bytes: %s\n", bytes, err.msg);
        exit(1);
    }
    return p;
}

// A device buffer holding host[0..bytes).
static void *dev_with(const void *host, size_t bytes) {
    void *p = dev_alloc(bytes);
    gpu->upload(p, host, bytes);
    return p;
}

// A device buffer of 0xff bytes (NaN in fp32 and bf16): an element a collective forgot shows.
static void *dev_poisoned(size_t bytes) {
    unsigned char *h = malloc(bytes);
    if (!h) exit(1);
    memset(h, 0xff, bytes);
    void *p = dev_with(h, bytes);
    free(h);
    return p;
}

// n values exactly representable in bf16 (and fp32): small multiples of 1/4, with signs.
static void fill_values(float *f, uint16_t *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = (float)((int)(i % 509) - 254) * 0.25f;
        uint32_t u;
        memcpy(&u, &v, 4);
        f[i] = v;
        b[i] = (uint16_t)(u >> 16); // exact: the low 16 bits of these values are 0
    }
}

// Whether device buffer dev holds want[0..bytes) bit for bit.
static int same_as(const void *dev, const void *want, size_t bytes, const char *what,
                   const char *type) {
    unsigned char *got = malloc(bytes);
    if (!got) exit(1);
    gpu->download(got, dev, bytes);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < bytes; i++)
        if (got[i] != ((const unsigned char *)want)[i] && !bad++) first = i;
    free(got);
    if (bad)
        fprintf(stderr, "FAIL %s (%s): %zu of %zu bytes differ, first at byte %zu\n", what, type,
                bad, bytes, first);
    else
        printf("PASS %s (%s, %zu bytes)\n", what, type, bytes);
    return bad == 0;
}

static void test_collectives(Comm *c, DType dt) {
    Err err = {0};
    const size_t n = 1000003; // odd: no multiple-of-anything shortcut
    size_t es = dtype_size(dt), bytes = n * es;
    float *f = malloc(n * 4);
    uint16_t *b = malloc(n * 2);
    if (!f || !b) exit(1);
    fill_values(f, b, n);
    const void *want = dt == DT_BF16 ? (const void *)b : (const void *)f;

    // all_reduce in place, SUM then AVG: one rank, so both leave the values as they are.
    void *buf = dev_with(want, bytes);
    CHECK_MSG(comm_all_reduce(c, buf, n, dt, COMM_SUM, &err) == 0, "%s", err.msg);
    CHECK(same_as(buf, want, bytes, "all_reduce sum", dtype_name(dt)));
    CHECK_MSG(comm_all_reduce(c, buf, n, dt, COMM_AVG, &err) == 0, "%s", err.msg);
    CHECK(same_as(buf, want, bytes, "all_reduce avg", dtype_name(dt)));

    // reduce_scatter: send (world*n) -> recv (n) = rank 0's slice = send.
    void *recv = dev_poisoned(bytes);
    CHECK_MSG(comm_reduce_scatter(c, buf, recv, n, dt, COMM_SUM, &err) == 0, "%s", err.msg);
    CHECK(same_as(recv, want, bytes, "reduce_scatter sum", dtype_name(dt)));
    gpu->free(recv);
    recv = dev_poisoned(bytes);
    CHECK_MSG(comm_reduce_scatter(c, buf, recv, n, dt, COMM_AVG, &err) == 0, "%s", err.msg);
    CHECK(same_as(recv, want, bytes, "reduce_scatter avg", dtype_name(dt)));
    gpu->free(recv);

    // all_gather: send (n) -> recv (world*n).
    recv = dev_poisoned(bytes);
    CHECK_MSG(comm_all_gather(c, buf, recv, n, dt, &err) == 0, "%s", err.msg);
    CHECK(same_as(recv, want, bytes, "all_gather", dtype_name(dt)));
    gpu->free(recv);

    // The overlapped forms: started, then the compute stream joined behind them (a device
    // copy reads the result without any host wait), then waited for.
    recv = dev_poisoned(bytes);
    void *copy = dev_poisoned(bytes);
    CHECK_MSG(comm_reduce_scatter_start(c, buf, recv, n, dt, COMM_AVG, &err) == 0, "%s", err.msg);
    CHECK_MSG(comm_join(c, &err) == 0, "%s", err.msg);
    gpu->copy(copy, recv, bytes);
    CHECK_MSG(comm_wait(c, &err) == 0, "%s", err.msg);
    CHECK(same_as(copy, want, bytes, "reduce_scatter_start + join", dtype_name(dt)));
    gpu->free(recv);
    recv = dev_poisoned(bytes);
    CHECK_MSG(comm_all_gather_start(c, buf, recv, n, dt, &err) == 0, "%s", err.msg);
    CHECK_MSG(comm_join(c, &err) == 0, "%s", err.msg);
    gpu->copy(copy, recv, bytes);
    CHECK_MSG(comm_wait(c, &err) == 0, "%s", err.msg);
    CHECK(same_as(copy, want, bytes, "all_gather_start + join", dtype_name(dt)));
    gpu->free(recv);
    gpu->free(copy);
    gpu->free(buf);
    free(f);
    free(b);
}

static void test_broadcast_barrier(Comm *c) {
    Err err = {0};
    const size_t bytes = 777777;
    unsigned char *h = malloc(bytes);
    if (!h) exit(1);
    for (size_t i = 0; i < bytes; i++)
        h[i] = (unsigned char)(i * 31 + 7);
    void *buf = dev_with(h, bytes);
    CHECK_MSG(comm_broadcast(c, buf, bytes, 0, &err) == 0, "%s", err.msg);
    CHECK(same_as(buf, h, bytes, "broadcast", "bytes"));
    CHECK_MSG(comm_barrier(c, &err) == 0, "%s", err.msg);
    printf("PASS barrier\n");
    gpu->free(buf);
    free(h);
}

// all_to_all at world 1: its own part, an ncclSend/ncclRecv to itself in one group; then an
// exchange of 0 bytes (an empty group, NULL buffers).
static void test_all_to_all(Comm *c) {
    Err err = {0};
    size_t bytes = 777781, none = 0;
    unsigned char *h = malloc(bytes);
    if (!h) exit(1);
    for (size_t i = 0; i < bytes; i++)
        h[i] = (unsigned char)(i * 13 + 5);
    void *send = dev_with(h, bytes), *recv = dev_poisoned(bytes);
    CHECK_MSG(comm_all_to_all(c, send, &bytes, recv, &bytes, &err) == 0, "%s", err.msg);
    CHECK(same_as(recv, h, bytes, "all_to_all", "bytes"));
    CHECK_MSG(comm_all_to_all(c, NULL, &none, NULL, &none, &err) == 0, "0 bytes: %s", err.msg);
    gpu->free(send);
    gpu->free(recv);
    free(h);
}

// comm_split of a 1-rank communicator: a communicator of 1 whose all_reduce works; then
// comm_p2p with peer == this rank is refused (which leaves c unusable: call it last).
static void test_split_and_p2p(Comm *c) {
    Err err = {0};
    Comm *sub = NULL;
    if (comm_split(c, 0, 0, &sub, &err)) {
        CHECK_MSG(0, "comm_split(nccl, world 1): %s", err.msg);
        return;
    }
    CHECK(comm_rank(sub) == 0 && comm_world_size(sub) == 1 && comm_device_memory(sub) == 1);
    const size_t n = 4099;
    float *f = malloc(n * 4);
    uint16_t *b = malloc(n * 2);
    if (!f || !b) exit(1);
    fill_values(f, b, n);
    void *buf = dev_with(f, n * 4);
    CHECK_MSG(comm_all_reduce(sub, buf, n, DT_F32, COMM_SUM, &err) == 0, "%s", err.msg);
    CHECK(same_as(buf, f, n * 4, "all_reduce on a comm_split communicator", "fp32"));
    comm_destroy(sub);
    CHECK_MSG(comm_send(c, buf, 16, 0, &err) == -1 &&
                  strstr(err.msg, "p2p: transfer 0's peer 0 is not another rank of 0..0"),
              "comm_send to itself: %s", err.msg);
    printf("%s p2p to itself refused: %s\n",
           strstr(err.msg, "is not another rank") ? "PASS" : "FAIL", err.msg);
    gpu->free(buf);
    free(f);
    free(b);
}

// World size 1: the id from comm_nccl_unique_id through the rendezvous, every collective.
static void test_world1(void) {
    Err err = {0};
    uint8_t id[COMM_NCCL_ID_BYTES];
    if (comm_nccl_unique_id(id, &err)) {
        CHECK_MSG(0, "comm_nccl_unique_id: %s", err.msg);
        return;
    }
    RendezvousConfig rc = {.rank = 0,
                           .world_size = 1,
                           .master_addr = "127.0.0.1",
                           .port = 0,
                           .listen_fd = -1,
                           .timeout_ms = 10000};
    if (rendezvous_run(&rc, id, sizeof id, &err)) {
        CHECK_MSG(0, "rendezvous_run: %s", err.msg);
        return;
    }
    CommConfig cfg = {.backend = "nccl",
                      .rank = 0,
                      .world_size = 1,
                      .timeout_ms = 30000,
                      .nccl_id = id,
                      .cuda_device = 0,
                      // The backend's compute stream, as astrai-train passes it: the uploads
                      // and downloads are ordered around the collectives by it alone.
                      .cuda_stream = cuda_stream()};
    Comm *c = NULL;
    if (comm_create(&c, &cfg, &err)) {
        CHECK_MSG(0, "comm_create(nccl, world 1): %s", err.msg);
        return;
    }
    CHECK(comm_rank(c) == 0 && comm_world_size(c) == 1);
    CHECK(comm_device_memory(c) == 1);
    test_collectives(c, DT_F32);
    test_collectives(c, DT_BF16);
    test_broadcast_barrier(c);
    test_all_to_all(c);
    test_split_and_p2p(c);
    comm_destroy(c);
}

// World size 2 with only rank 0: the init cannot complete; the timeout must abort it.
static void test_abort(void) {
    Err err = {0};
    uint8_t id[COMM_NCCL_ID_BYTES];
    if (comm_nccl_unique_id(id, &err)) {
        CHECK_MSG(0, "comm_nccl_unique_id: %s", err.msg);
        return;
    }
    CommConfig cfg = {.backend = "nccl",
                      .rank = 0,
                      .world_size = 2,
                      .timeout_ms = 2000,
                      .nccl_id = id,
                      .cuda_device = 0,
                      .cuda_stream = cuda_stream()};
    Comm *c = NULL;
    double t0 = now_s();
    alarm(60);
    int rc = comm_create(&c, &cfg, &err);
    alarm(0);
    double dt = now_s() - t0;
    if (rc == 0) { // creation may be lazy: then the first collective must time out
        void *buf = dev_alloc(4096);
        alarm(60);
        rc = comm_all_reduce(c, buf, 1024, DT_F32, COMM_SUM, &err);
        alarm(0);
        dt = now_s() - t0;
        comm_destroy(c);
        gpu->free(buf);
    }
    CHECK_MSG(rc == -1, "world 2 with one rank did not fail");
    CHECK_MSG(strcasestr(err.msg, "timeout") || strcasestr(err.msg, "timed out") ||
                  strcasestr(err.msg, "abort"),
              "error does not mention the timeout/abort: %s", err.msg);
    CHECK_MSG(dt < 20.0, "took %.1f s for a 2 s timeout", dt);
    printf("%s abort path: failed after %.1f s: %s\n", rc == -1 ? "PASS" : "FAIL", dt, err.msg);
}

#endif

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    (void)check_failures; // unused where the test is compiled out
#if !defined(ASTRAI_HAVE_NCCL)
    printf("test_comm_nccl_gpu: SKIPPED (built without NCCL)\n");
    return 77;
#elif !defined(ASTRAI_HAVE_CUDA)
    printf("test_comm_nccl_gpu: SKIPPED (built without CUDA)\n");
    return 77;
#else
    if (!backend_cuda_available()) {
        printf("test_comm_nccl_gpu: SKIPPED (no GPU visible)\n");
        return 77;
    }
    signal(SIGALRM, on_alarm);
    Err err = {0};
    if (backend_open(&gpu, BACKEND_CUDA, 0, DT_BF16, &err)) {
        fprintf(stderr, "test_comm_nccl_gpu: backend_open(cuda): %s\n", err.msg);
        return 1;
    }
    test_world1();
    test_abort();
    CHECK_DONE();
#endif
}
