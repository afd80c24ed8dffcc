// test_comm_hier.c: the hier collectives (comm/hier.c) with forked ranks on 127.0.0.1 that
// pretend to be 2 hosts of 2 through CommConfig.host_of: each "host" its own shm segment, gloo
// between them. Reductions of sizes 0, 1, odd and > 1 MiB against sums computed here and bitwise
// equal on every rank, reduce_scatter, gathers of fp32 and bf16, broadcasts (through the flat
// gloo Comm); hosts whose ranks are contiguous and interleaved; layouts refused; a peer killed.
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "check.h"
#include "comm/comm.h"
#include "comm_gloo_util.h"

static const int CONTIGUOUS[] = {0, 0, 1, 1};
static const int INTERLEAVED[] = {5, 7, 5, 7}; // any values name hosts

static void test_hosts(const int *host_of) {
    test_collectives_of((Group){4, TIMEOUT_MS, 0, NULL, NULL, "hier", host_of});
}

static int body_unreached(Comm *c, void *ctx) {
    (void)c, (void)ctx;
    return 1;
}

// Every rank refuses the layout before any connect: nobody waits for a peer.
static void expect_refused(int world, const int *host_of, const char *want) {
    Group g = {world, 2000, 0, body_unreached, NULL, "hier", host_of};
    pid_t pids[MAX_WORLD];
    char dir[64];
    spawn_group(&g, world, pids, dir, sizeof dir);
    for (int r = 0; r < world; r++) {
        int rc = wait_child(pids[r], 10000);
        CHECK_MSG(rc == 3 && strstr(reports[r].msg, "hier rank") && strstr(reports[r].msg, want),
                  "rank %d exited %d: %s", r, rc, reports[r].msg);
    }
    remove_dir(dir);
}

// Rank 3 killed in an all_reduce loop: every survivor fails within the sub-Comms' timeouts,
// its message naming the hier call, then the sub-Comm that failed (its label: shm within
// the host, gloo between).
static void test_peer_killed(void) {
    Group g = {4, 2000, 1, body_until_error, NULL, "hier", CONTIGUOUS};
    pid_t pids[MAX_WORLD];
    char dir[64];
    spawn_connected(&g, pids, dir, sizeof dir);
    kill(pids[3], SIGKILL);
    for (int r = 0; r < 3; r++) {
        int rc = wait_child(pids[r], 4 * g.timeout_ms);
        char want[48];
        snprintf(want, sizeof want, "hier rank %d/4: all_reduce: ", r);
        const char *m = reports[r].msg, *sub = m + strlen(want);
        CHECK_MSG(rc == 0 && reports[r].failed && strstr(m, want) == m &&
                      (!strncmp(sub, "shm /", 5) || !strncmp(sub, "gloo rank", 9)),
                  "survivor rank %d exited %d: %s", r, rc, m);
        fprintf(stderr, "peer killed: rank %d: %s\n", r, m);
    }
    waitpid(pids[3], NULL, 0);
    remove_dir(dir);
}

int main(void) {
    reports = mmap(NULL, MAX_WORLD * sizeof *reports, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (reports == MAP_FAILED) return 1;
    test_hosts(CONTIGUOUS);
    test_hosts(INTERLEAVED);
    static const int UNEVEN[] = {0, 0, 1};
    expect_refused(3, UNEVEN, "different numbers of ranks (2 on rank 0's host, 1 on host 1)");
    expect_refused(2, NULL, "host_of is not set");
    test_peer_killed();
    CHECK_DONE();
}
