// launch_probe: a stand-in for astrai-train that uses the launch API the same way
// (launch_detect, then launch_local as the local parent, else one rank) and whose
// ranks report what they saw and then behave as told, for tests/test_launch*.py.
//
//   launch_probe --out=DIR [--nprocs=N] [--sleep-ms=M] [--exit=R:C] [--ignore-term=R]
//                [--term-code=C] [--rendezvous] [--shm]
//
// A rank writes DIR/rank<R>.txt (key=value lines: rank, world, local_rank,
// local_world, external, pid, shm, and with --rendezvous the shm name and the
// 128-byte id that rank 0 handed out), then sleeps M ms (default 0) and exits 0.
// --exit=R:C: rank R exits with code C once every rank has reported. On SIGTERM a rank writes
// DIR/term<R> and exits with --term-code (default 0), except rank --ignore-term,
// which keeps sleeping. --shm: every rank creates the run's shm segment and leaves
// it behind, as a backend killed before its cleanup would.
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "train/launch.h"

typedef struct {
    const char *out;
    long nprocs, sleep_ms;
    int exit_rank, exit_code, ignore_term_rank, term_code, rendezvous, shm;
} ProbeArgs;

static char term_path[4096];
static int term_code;
static volatile sig_atomic_t ignore_term;

static void on_term(int sig) {
    (void)sig;
    int fd = open(term_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) close(fd);
    if (!ignore_term) _exit(term_code);
}

static int parse_args(ProbeArgs *a, int argc, char **argv) {
    *a = (ProbeArgs){.nprocs = 1, .exit_rank = -1, .ignore_term_rank = -1};
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        if (!strncmp(s, "--out=", 6))
            a->out = s + 6;
        else if (sscanf(s, "--nprocs=%ld", &a->nprocs) == 1 ||
                 sscanf(s, "--sleep-ms=%ld", &a->sleep_ms) == 1 ||
                 sscanf(s, "--exit=%d:%d", &a->exit_rank, &a->exit_code) == 2 ||
                 sscanf(s, "--ignore-term=%d", &a->ignore_term_rank) == 1 ||
                 sscanf(s, "--term-code=%d", &a->term_code) == 1)
            continue;
        else if (!strcmp(s, "--rendezvous"))
            a->rendezvous = 1;
        else if (!strcmp(s, "--shm"))
            a->shm = 1;
        else {
            fprintf(stderr, "launch_probe: unknown argument '%s'\n", s);
            return -1;
        }
    }
    if (!a->out) fprintf(stderr, "launch_probe: --out=DIR is required\n");
    return a->out ? 0 : -1;
}

// Sleeps the whole time even when a signal handler interrupts the sleep.
static void sleep_ms(long ms) {
    struct timespec left = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&left, &left) != 0)
        ;
}

static void hex(const uint8_t *b, size_t n, char *out) {
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", b[i]);
}

// DIR/rank<R>.txt, written whole then renamed so a reader never sees half of it.
static int write_report(const ProbeArgs *a, const LaunchInfo *li, const uint8_t *id) {
    char path[4096], tmp[4200], idhex[2 * COMM_NCCL_ID_BYTES + 1] = "";
    snprintf(path, sizeof path, "%s/rank%d.txt", a->out, li->rank);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (id) hex(id, COMM_NCCL_ID_BYTES, idhex);
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    fprintf(f,
            "rank=%d\nworld=%d\nlocal_rank=%d\nlocal_world=%d\nexternal=%d\npid=%d\nshm=%s\n"
            "nccl_id=%s\nthreads=%ld\n",
            li->rank, li->world_size, li->local_rank, li->local_world_size, li->external,
            (int)getpid(), li->shm_name, idhex, launch_threads(li, 0));
    return fclose(f) || rename(tmp, path) ? -1 : 0;
}

// Waits (up to 10 s) until every rank wrote its report, so the test knows every pid.
static void wait_for_reports(const ProbeArgs *a, int world) {
    for (int waited = 0, r = 0; r < world && waited < 10000;) {
        char path[4096];
        snprintf(path, sizeof path, "%s/rank%d.txt", a->out, r);
        if (access(path, F_OK) == 0) {
            r++;
            continue;
        }
        sleep_ms(10);
        waited += 10;
    }
}

static int run_rank(const ProbeArgs *a, LaunchInfo *li) {
    snprintf(term_path, sizeof term_path, "%s/term%d", a->out, li->rank);
    term_code = a->term_code;
    ignore_term = li->rank == a->ignore_term_rank;
    struct sigaction sa = {.sa_handler = on_term};
    sigaction(SIGTERM, &sa, NULL);
    uint8_t id[COMM_NCCL_ID_BYTES] = {0};
    Err err = {0};
    if (li->rank == 0 && getrandom(id, sizeof id, 0) != (ssize_t)sizeof id) return 1;
    if (a->rendezvous && launch_rendezvous(li, id, &err)) {
        fprintf(stderr, "launch_probe: rank %d: %s\n", li->rank, err.msg);
        return 1;
    }
    launch_end_meeting(li);
    if (a->shm) {
        int fd = shm_open(li->shm_name, O_CREAT | O_RDWR, 0600);
        if (fd < 0 || ftruncate(fd, 4096)) return 1;
        close(fd);
    }
    if (write_report(a, li, a->rendezvous ? id : NULL)) return 1;
    if (li->rank == a->exit_rank) {
        wait_for_reports(a, li->world_size);
        return a->exit_code;
    }
    sleep_ms(a->sleep_ms);
    return 0;
}

int main(int argc, char **argv) {
    ProbeArgs a;
    if (parse_args(&a, argc, argv)) return 2;
    LaunchInfo *li = launch_info();
    Err err = {0};
    if (launch_detect(li, a.nprocs, &err)) {
        fprintf(stderr, "launch_probe: %s\n", err.msg);
        return 2;
    }
    if (li->mode != LAUNCH_LOCAL_PARENT) return run_rank(&a, li);
    int rc = launch_local(li, argv, &err);
    if (rc < 0) fprintf(stderr, "launch_probe: %s\n", err.msg);
    return rc < 0 ? 1 : rc;
}
