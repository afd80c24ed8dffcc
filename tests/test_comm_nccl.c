// test_comm_nccl.c: the nccl backend's error paths, which must work without a
// GPU: a clear error (not built / no nccl_id / no CUDA device), never a crash.
// The collectives themselves are test_comm_nccl_gpu.c's, run on a GPU (tests/gpu/run.sh).
#include <string.h>

#include "check.h"
#include "comm/comm.h"

static CommConfig nccl_config(const uint8_t *id) {
    return (CommConfig){.backend = "nccl",
                        .rank = 0,
                        .world_size = 1,
                        .timeout_ms = 2000,
                        .nccl_id = id,
                        .cuda_device = 0};
}

#ifdef ASTRAI_HAVE_NCCL
// Built: without an id the config is refused; with one, either a device is
// present (the communicator comes up) or the error names CUDA.
static void test_built(void) {
    Comm *c = NULL;
    Err err = {0};
    CommConfig cfg = nccl_config(NULL);
    CHECK(comm_create(&c, &cfg, &err) == -1 && c == NULL);
    CHECK_MSG(strstr(err.msg, "nccl backend needs nccl_id"), "%s", err.msg);

    uint8_t id[COMM_NCCL_ID_BYTES];
    int have_id = comm_nccl_unique_id(id, &err) == 0;
    if (!have_id) memset(id, 0, sizeof id);
    cfg = nccl_config(id);
    if (comm_create(&c, &cfg, &err) == 0) {
        fprintf(stderr, "a CUDA device is present: nccl communicator created\n");
        comm_destroy(c);
        return;
    }
    CHECK(c == NULL);
    CHECK_MSG(strstr(err.msg, "nccl rank 0/1 (cuda device 0)"), "%s", err.msg);
    CHECK_MSG(strstr(err.msg, "CUDA") || strstr(err.msg, "cannot load"), "%s", err.msg);
    fprintf(stderr, "expected error without a GPU: %s\n", err.msg);
}
#else
static void test_not_built(void) {
    Comm *c = NULL;
    Err err = {0};
    uint8_t id[COMM_NCCL_ID_BYTES] = {0};
    CommConfig cfg = nccl_config(id);
    const char *want = "nccl backend not built (CUDA/NCCL not found at configure time)";
    CHECK(comm_create(&c, &cfg, &err) == -1 && c == NULL);
    CHECK_MSG(strstr(err.msg, want), "%s", err.msg);
    CHECK(comm_nccl_unique_id(id, &err) == -1);
    CHECK_MSG(strstr(err.msg, want), "%s", err.msg);
}
#endif

int main(void) {
#ifdef ASTRAI_HAVE_NCCL
    test_built();
#else
    test_not_built();
#endif
    CHECK_DONE();
}
