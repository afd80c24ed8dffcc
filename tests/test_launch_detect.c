// Launch detection from the environment: torchrun/by-hand variables, SLURM's, our
// own local parent's; the errors name the variable and its value.
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "train/launch.h"

static const char *const VARS[] = {"RANK",
                                   "WORLD_SIZE",
                                   "LOCAL_RANK",
                                   "LOCAL_WORLD_SIZE",
                                   "MASTER_ADDR",
                                   "MASTER_PORT",
                                   "SLURM_PROCID",
                                   "SLURM_NTASKS",
                                   "SLURM_LOCALID",
                                   "SLURM_NODEID",
                                   "SLURM_TASKS_PER_NODE",
                                   "ASTRAI_LAUNCHED",
                                   "ASTRAI_SHM_NAME",
                                   "ASTRAI_LAUNCHER_PID",
                                   "ASTRAI_RENDEZVOUS_FD",
                                   "ASTRAI_RENDEZVOUS_PORT",
                                   "ASTRAI_RENDEZVOUS_TIMEOUT_S",
                                   "ASTRAI_STOP_GRACE_S",
                                   "TORCHELASTIC_USE_AGENT_STORE",
                                   NULL};

// Sets "K=V" pairs on a clean slate.
static void env(const char *const *kv) {
    for (const char *const *v = VARS; *v; v++)
        unsetenv(*v);
    for (; kv && *kv; kv++) {
        char name[64];
        const char *eq = strchr(*kv, '=');
        snprintf(name, sizeof name, "%.*s", (int)(eq - *kv), *kv);
        setenv(name, eq + 1, 1);
    }
}

// Detection must fail with a message containing `want`.
static void expect_error(const char *const *kv, long nprocs, const char *want) {
    env(kv);
    LaunchInfo li;
    Err err = {0};
    CHECK_MSG(launch_detect(&li, nprocs, &err) == -1 && strstr(err.msg, want),
              "want '%s', got '%s'", want, err.msg);
}

static LaunchInfo expect_ok(const char *const *kv, long nprocs) {
    env(kv);
    LaunchInfo li;
    Err err = {0};
    CHECK_MSG(launch_detect(&li, nprocs, &err) == 0, "%s", err.msg);
    return li;
}

#define KV(...) ((const char *const[]){__VA_ARGS__, NULL})

static void test_without_rank_variables(void) {
    LaunchInfo li = expect_ok(NULL, 1);
    CHECK(li.mode == LAUNCH_SINGLE && li.rank == 0 && li.world_size == 1);
    li = expect_ok(NULL, 4);
    CHECK(li.mode == LAUNCH_LOCAL_PARENT && li.world_size == 4 && li.local_world_size == 4);
    expect_error(NULL, 0, "nprocs: 0");
}

static void test_torchrun_variables(void) {
    // --nprocs is ignored under an external launcher: the world size is WORLD_SIZE.
    LaunchInfo li =
        expect_ok(KV("RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=node0", "MASTER_PORT=29500"), 8);
    CHECK(li.mode == LAUNCH_RANK && li.external && li.rank == 1 && li.world_size == 2);
    CHECK(li.local_rank == 1 && li.local_world_size == 2);
    CHECK(!strcmp(li.master_addr, "node0") && li.master_port == 29500);
    CHECK(li.rendezvous_fd == -1 && li.shm_name[0] == 0);
    li =
        expect_ok(KV("RANK=3", "WORLD_SIZE=4", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2",
                     "MASTER_ADDR=node0", "MASTER_PORT=29500", "TORCHELASTIC_USE_AGENT_STORE=True"),
                  1);
    CHECK(li.local_rank == 1 && li.local_world_size == 2);
    CHECK(li.master_port == 29501); // torchrun's own store holds MASTER_PORT
    li = expect_ok(KV("RANK=0", "WORLD_SIZE=2", "MASTER_ADDR=node0", "MASTER_PORT=29500",
                      "TORCHELASTIC_USE_AGENT_STORE=True", "ASTRAI_RENDEZVOUS_PORT=4000"),
                   1);
    CHECK(li.master_port == 4000);
    li = expect_ok(KV("RANK=0", "WORLD_SIZE=1"), 1); // alone: no master needed
    CHECK(li.mode == LAUNCH_RANK && li.world_size == 1);
}

static void test_torchrun_errors(void) {
    const char *m = "MASTER_ADDR=h", *p = "MASTER_PORT=29500";
    expect_error(KV("RANK=2", "WORLD_SIZE=2", m, p), 1, "RANK=2 is not below WORLD_SIZE=2");
    expect_error(KV("RANK=abc", "WORLD_SIZE=2", m, p), 1, "RANK='abc' is not an integer");
    expect_error(KV("RANK=-1", "WORLD_SIZE=2", m, p), 1, "RANK='-1' is not an integer");
    expect_error(KV("RANK=0", "WORLD_SIZE=0", m, p), 1, "WORLD_SIZE='0' is not an integer");
    expect_error(KV("RANK=1", m, p), 1, "RANK is set but WORLD_SIZE is not");
    expect_error(KV("WORLD_SIZE=2", m, p), 1, "WORLD_SIZE is set but RANK is not");
    expect_error(KV("RANK=1", "WORLD_SIZE=2", p), 1, "MASTER_ADDR is not set");
    expect_error(KV("RANK=1", "WORLD_SIZE=2", m), 1, "MASTER_PORT is not set");
    expect_error(KV("RANK=1", "WORLD_SIZE=2", m, "MASTER_PORT=70000"), 1,
                 "MASTER_PORT='70000' is not an integer in [1, 65535]");
    expect_error(KV("RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=3", "LOCAL_WORLD_SIZE=2", m, p), 1,
                 "LOCAL_RANK=3 is not below LOCAL_WORLD_SIZE=2");
}

static void test_slurm_variables(void) {
    const char *m = "MASTER_ADDR=h", *p = "MASTER_PORT=29500";
    LaunchInfo li = expect_ok(KV("SLURM_PROCID=3", "SLURM_NTASKS=5", "SLURM_LOCALID=1",
                                 "SLURM_NODEID=1", "SLURM_TASKS_PER_NODE=2(x2),1", m, p),
                              1);
    CHECK(li.mode == LAUNCH_RANK && li.external && li.rank == 3 && li.world_size == 5);
    CHECK(li.local_rank == 1 && li.local_world_size == 2);
    li = expect_ok(KV("SLURM_PROCID=4", "SLURM_NTASKS=5", "SLURM_LOCALID=0", "SLURM_NODEID=2",
                      "SLURM_TASKS_PER_NODE=2(x2),1", m, p),
                   1);
    CHECK(li.local_world_size == 1);
    expect_error(KV("SLURM_PROCID=4", "SLURM_NTASKS=4", m, p), 1,
                 "SLURM_PROCID=4 is not below SLURM_NTASKS=4");
    expect_error(KV("SLURM_PROCID=1", "SLURM_NTASKS=2", p), 1, "MASTER_ADDR is not set");
    expect_error(KV("SLURM_PROCID=3", "SLURM_NTASKS=4", "SLURM_LOCALID=1", "SLURM_NODEID=1",
                    "SLURM_TASKS_PER_NODE=3,1", m, p),
                 1, "SLURM_LOCALID=1 is not below SLURM_TASKS_PER_NODE=1");
    // torchrun inside a SLURM allocation: torchrun's variables win.
    li = expect_ok(KV("RANK=1", "WORLD_SIZE=2", "SLURM_PROCID=0", "SLURM_NTASKS=1", m, p), 1);
    CHECK(li.rank == 1 && li.world_size == 2);
}

static void test_local_parent_variables(void) {
    char parent[32], shm[] = "ASTRAI_SHM_NAME=/astrai-1-abc";
    snprintf(parent, sizeof parent, "ASTRAI_LAUNCHER_PID=%d", (int)getppid());
    const char *base[] = {"RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=4000",
                          "ASTRAI_LAUNCHED=1"};
    LaunchInfo li = expect_ok(KV(base[0], base[1], base[2], base[3], base[4], shm, parent), 1);
    CHECK(li.mode == LAUNCH_RANK && !li.external && !strcmp(li.shm_name, "/astrai-1-abc"));
    expect_error(KV(base[0], base[1], base[2], base[3], base[4], parent), 1,
                 "ASTRAI_SHM_NAME='' is not a shm segment name");
    expect_error(KV(base[0], base[1], base[2], base[3], base[4], shm, "ASTRAI_RENDEZVOUS_FD=999"),
                 1, "ASTRAI_RENDEZVOUS_FD=999 is not an open file descriptor");
    // A launcher that is not our parent any more: we were orphaned before PDEATHSIG.
    char other[32];
    snprintf(other, sizeof other, "ASTRAI_LAUNCHER_PID=%d", (int)getppid() + 1);
    char want[64];
    snprintf(want, sizeof want, "the launcher (pid %d) is gone", (int)getppid() + 1);
    expect_error(KV(base[0], base[1], base[2], base[3], base[4], shm, other), 1, want);
}

static void test_knobs(void) {
    LaunchInfo li = expect_ok(NULL, 2);
    CHECK(launch_threads(&li, 3) == 3);
    li.local_world_size = 1 << 20; // more ranks than cores: still one thread each
    CHECK(launch_threads(&li, 0) == 1);
    Err err = {0};
    env(KV("ASTRAI_STOP_GRACE_S=soon"));
    CHECK(launch_local(&li, (char *[]){"x", NULL}, &err) == -1 &&
          strstr(err.msg, "ASTRAI_STOP_GRACE_S='soon' is not a number of seconds"));
    li = expect_ok(KV("RANK=1", "WORLD_SIZE=2", "MASTER_ADDR=h", "MASTER_PORT=1",
                      "ASTRAI_RENDEZVOUS_TIMEOUT_S=-1"),
                   1);
    CHECK(launch_rendezvous(&li, NULL, &err) == -1 &&
          strstr(err.msg, "ASTRAI_RENDEZVOUS_TIMEOUT_S='-1' is not a number of seconds"));
}

int main(void) {
    test_without_rank_variables();
    test_torchrun_variables();
    test_torchrun_errors();
    test_slurm_variables();
    test_local_parent_variables();
    test_knobs();
    CHECK_DONE();
}
