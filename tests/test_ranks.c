// The supervision of a group of ranks shared by astrai-train's launcher and astraid
// (ranks/ranks.h): the exit policy (root cause, interruptions, the supervisor's own stop,
// the group's exit code), the root-cause text, signalling the ranks' process groups, a
// rank's environment and the rendezvous listener; and comm/'s shm segment names.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "comm/comm.h"
#include "ranks/ranks.h"

static void start(RankGroup *g, int n) {
    Err err = {0};
    CHECK(ranks_group_init(g, n, 1, &err) == 0);
    for (int r = 0; r < n; r++)
        ranks_started(g, r, 1000 + r);
    CHECK(g->alive == n && g->failed < 0 && g->interrupted < 0 && !g->stopping);
}

// All ranks done: nothing to stop, exit 0.
static void test_success(void) {
    RankGroup g;
    start(&g, 3);
    for (int r = 0; r < 3; r++)
        CHECK(ranks_exited(&g, r, 0, 0) == RANKS_CONTINUE);
    CHECK(g.alive == 0 && ranks_exit_code(&g) == 0 && !g.stopping);
    ranks_group_free(&g);
}

// The first failure is the root cause; what the stop does to the others is a consequence.
static void test_first_failure_is_root_cause(void) {
    RankGroup g;
    start(&g, 3);
    CHECK(ranks_exited(&g, 1, 0, SIGSEGV) == RANKS_STOP_OTHERS);
    CHECK(g.failed == 1 && g.stopping);
    CHECK(ranks_exited(&g, 0, 1, 0) == RANKS_CONTINUE);       // a dead peer: a consequence
    CHECK(ranks_exited(&g, 2, 0, SIGKILL) == RANKS_CONTINUE); // killed after the grace
    CHECK(g.failed == 1 && g.alive == 0);
    CHECK(ranks_exit_code(&g) == 128 + SIGSEGV);
    char text[128];
    ranks_describe(&g, 1, text, sizeof text);
    CHECK_MSG(!strcmp(text, "rank 1 (pid 1001) was killed by signal 11 (Segmentation fault)"), "%s",
              text);
    ranks_describe(&g, 0, text, sizeof text);
    CHECK_MSG(!strcmp(text, "rank 0 (pid 1000) exited with code 1"), "%s", text);
    ranks_group_free(&g);
}

// Under a pipeline the text names the stage (rank = replica * stages + stage), whichever
// collective the others were in when they found the rank gone.
static void test_describe_names_the_stage(void) {
    RankGroup g;
    Err err = {0};
    CHECK(ranks_group_init(&g, 6, 3, &err) == 0);
    ranks_started(&g, 4, 1004);
    CHECK(ranks_exited(&g, 4, 0, SIGKILL) == RANKS_STOP_OTHERS);
    char text[128];
    ranks_describe(&g, 4, text, sizeof text);
    CHECK_MSG(!strcmp(text, "rank 4 (pipeline stage 1 of 3, pid 1004) was killed by signal 9 "
                            "(Killed)"),
              "%s", text);
    ranks_group_free(&g);
}

// An interrupted rank stops the others but is no failure; a real failure after it still
// becomes the root cause (and the group's code), without a second stop.
static void test_interrupted(void) {
    RankGroup g;
    start(&g, 3);
    CHECK(ranks_exited(&g, 2, EXIT_INTERRUPTED, 0) == RANKS_STOP_OTHERS);
    CHECK(g.interrupted == 2 && g.failed < 0 && g.stopping);
    CHECK(ranks_exited(&g, 0, EXIT_INTERRUPTED, 0) == RANKS_CONTINUE);
    CHECK(g.interrupted == 2 && ranks_exit_code(&g) == EXIT_INTERRUPTED);
    CHECK(ranks_exited(&g, 1, 0, SIGKILL) == RANKS_CONTINUE);
    CHECK(g.failed == 1 && ranks_exit_code(&g) == 128 + SIGKILL);
    ranks_group_free(&g);

    start(&g, 2); // all interrupted: the group is interrupted
    CHECK(ranks_exited(&g, 0, EXIT_INTERRUPTED, 0) == RANKS_STOP_OTHERS);
    CHECK(ranks_exited(&g, 1, EXIT_INTERRUPTED, 0) == RANKS_CONTINUE);
    CHECK(ranks_exit_code(&g) == EXIT_INTERRUPTED && g.failed < 0);
    ranks_group_free(&g);
}

// A stop the supervisor started on its own (a forwarded SIGTERM): failures still count.
// A stop it asked for (astraid's pause, shutdown, cancel): no exit is a failure.
static void test_stops(void) {
    RankGroup g;
    start(&g, 2);
    g.stopping = 1;
    CHECK(ranks_exited(&g, 0, EXIT_BAD_INPUT, 0) == RANKS_CONTINUE);
    CHECK(g.failed == 0 && ranks_exit_code(&g) == EXIT_BAD_INPUT);
    ranks_group_free(&g);

    start(&g, 3);
    ranks_stop_asked(&g);
    CHECK(ranks_exited(&g, 0, EXIT_INTERRUPTED, 0) == RANKS_CONTINUE);
    CHECK(ranks_exited(&g, 1, 0, SIGKILL) == RANKS_CONTINUE);
    CHECK(ranks_exited(&g, 2, 1, 0) == RANKS_CONTINUE);
    CHECK(g.failed < 0 && g.interrupted < 0 && g.alive == 0 && ranks_exit_code(&g) == 0);
    ranks_group_free(&g);
}

// A rank that could not be started is the root cause, described as such.
static void test_start_failed(void) {
    RankGroup g;
    Err err = {0};
    CHECK(ranks_group_init(&g, 3, 1, &err) == 0);
    ranks_started(&g, 0, 77);
    ranks_start_failed(&g, 1);
    CHECK(g.failed == 1 && g.stopping && g.alive == 1);
    CHECK(ranks_exited(&g, 0, 0, SIGKILL) == RANKS_CONTINUE && g.failed == 1);
    char text[128];
    ranks_describe(&g, 1, text, sizeof text);
    CHECK_MSG(!strcmp(text, "rank 1 could not be started"), "%s", text);
    CHECK(ranks_exit_code(&g) != 0);
    ranks_group_free(&g);
}

// Whether SIGUSR1 waits on pid (its SigPnd or ShdPnd mask in /proc/PID/status).
static int usr1_pending(pid_t pid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    CHECK_MSG(f != NULL, "%s: %s", path, strerror(errno));
    int pending = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "SigPnd:", 7) || !strncmp(line, "ShdPnd:", 7))
            pending |= (strtoull(line + 7, NULL, 16) >> (SIGUSR1 - 1)) & 1;
    if (f) fclose(f);
    return pending;
}

// ranks_signal reaches each live rank's whole process group, and no exited rank.
static void test_signal(void) {
    RankGroup g;
    Err err = {0};
    CHECK(ranks_group_init(&g, 2, 1, &err) == 0);
    pid_t kids[2], grandkid[2];
    int p[2];
    CHECK(pipe(p) == 0);
    for (int r = 0; r < 2; r++) {
        kids[r] = fork();
        if (kids[r] == 0) { // a rank leading its group, with a child of its own
            setpgid(0, 0);
            if (r == 1) { // its group must get nothing: a SIGUSR1 would stay pending
                sigset_t usr1;
                sigemptyset(&usr1);
                sigaddset(&usr1, SIGUSR1);
                sigprocmask(SIG_BLOCK, &usr1, NULL);
            }
            pid_t c = fork();
            if (c == 0) {
                pause();
                _exit(0);
            }
            ssize_t w = write(p[1], &c, sizeof c);
            (void)w;
            int st;
            waitpid(c, &st, 0);
            _exit(WIFSIGNALED(st) ? 40 + WTERMSIG(st) : 1);
        }
        setpgid(kids[r], kids[r]);
        CHECK(read(p[0], &grandkid[r], sizeof grandkid[r]) == sizeof grandkid[r]);
        ranks_started(&g, r, kids[r]);
    }
    ranks_exited(&g, 1, 0, 0); // recorded as gone: must not be signalled
    ranks_signal(&g, SIGUSR1);
    int st;
    CHECK(waitpid(kids[0], &st, 0) == kids[0] && WIFSIGNALED(st) && WTERMSIG(st) == SIGUSR1);
    // kill() is synchronous: a SIGUSR1 sent to rank 1's group would be pending there now.
    CHECK(!usr1_pending(kids[1]) && !usr1_pending(grandkid[1])); // rank 1's group untouched
    kill(-kids[1], SIGKILL);
    waitpid(kids[1], &st, 0);
    close(p[0]);
    close(p[1]);
    ranks_group_free(&g);
}

static const char *find(char **env, const char *prefix) {
    for (; *env; env++)
        if (!strncmp(*env, prefix, strlen(prefix))) return *env;
    return NULL;
}

// A rank's environment: inherited rank variables replaced, extra wins over ours, the
// rendezvous fd for rank 0 only.
static void test_env(void) {
    setenv("RANK", "7", 1);
    setenv("ASTRAI_RENDEZVOUS_PORT", "4000", 1);
    setenv("SUP_TEST_KEEP", "yes", 1);
    setenv("SUP_TEST_OVER", "old", 1);
    const char *extra[] = {"SUP_TEST_OVER=new", "ASTRAI_CONTROL_FD=3", NULL};
    RanksLaunch l = {
        .world_size = 2, .port = 4321, .listen_fd = 4, .shm_name = "/astrai-test", .extra = extra};
    char **e0 = ranks_env(&l, 0), **e1 = ranks_env(&l, 1);
    CHECK(e0 && e1);
    if (e0 && e1) {
        CHECK(!strcmp(find(e0, "RANK="), "RANK=0") && !strcmp(find(e1, "RANK="), "RANK=1"));
        CHECK(!strcmp(find(e1, "WORLD_SIZE="), "WORLD_SIZE=2"));
        CHECK(!strcmp(find(e1, "MASTER_ADDR="), "MASTER_ADDR=127.0.0.1"));
        CHECK(!strcmp(find(e1, "MASTER_PORT="), "MASTER_PORT=4321"));
        CHECK(!strcmp(find(e1, "ASTRAI_SHM_NAME="), "ASTRAI_SHM_NAME=/astrai-test"));
        CHECK(!find(e1, "ASTRAI_RENDEZVOUS_PORT=")); // inherited: dropped
        CHECK(find(e0, "ASTRAI_RENDEZVOUS_FD=4") && !find(e1, "ASTRAI_RENDEZVOUS_FD="));
        CHECK(find(e1, "SUP_TEST_KEEP=yes") && find(e1, "ASTRAI_CONTROL_FD=3"));
        CHECK(!strcmp(find(e1, "SUP_TEST_OVER="), "SUP_TEST_OVER=new"));
        int n = 0;
        for (char **e = e1; *e; e++)
            n += !strncmp(*e, "RANK=", 5) || !strncmp(*e, "SUP_TEST_OVER=", 14);
        CHECK(n == 2); // each once
    }
    ranks_free_env(e0);
    ranks_free_env(e1);
}

// Port 0 picks a free port; a port in use is an error naming host:port.
static void test_listen(void) {
    int fd, port = 0, fd2 = -1;
    Err err = {0};
    CHECK(ranks_listen("127.0.0.1", 0, &fd, &port, &err) == 0 && port > 0);
    CHECK(ranks_listen("127.0.0.1", port, &fd2, NULL, &err) == -1);
    char want[64];
    snprintf(want, sizeof want, "cannot listen on 127.0.0.1:%d", port);
    CHECK_MSG(strstr(err.msg, want) != NULL, "%s", err.msg);
    close(fd);
}

static int shm_exists(const char *name) {
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd >= 0) close(fd);
    return fd >= 0;
}

// Names are unique; removal takes the run's segments and no other run's.
static void test_shm_names(void) {
    char a[64], b[64], other[96], sub[96];
    comm_shm_new_name(a, sizeof a);
    comm_shm_new_name(b, sizeof b);
    CHECK(a[0] == '/' && !strncmp(a, "/astrai-", 8) && strcmp(a, b));
    snprintf(sub, sizeof sub, "%s-nccl", a);
    snprintf(other, sizeof other, "%sx", a); // another name that merely starts alike
    const char *names[] = {a, sub, other, b};
    for (int i = 0; i < 4; i++) {
        int fd = shm_open(names[i], O_CREAT | O_RDWR, 0600);
        CHECK(fd >= 0);
        if (fd >= 0) close(fd);
    }
    comm_shm_remove(a);
    CHECK(!shm_exists(a) && !shm_exists(sub));
    CHECK(shm_exists(other) && shm_exists(b));
    shm_unlink(other);
    shm_unlink(b);
}

int main(void) {
    test_success();
    test_first_failure_is_root_cause();
    test_describe_names_the_stage();
    test_interrupted();
    test_stops();
    test_start_failed();
    test_signal();
    test_env();
    test_listen();
    test_shm_names();
    CHECK_DONE();
}
