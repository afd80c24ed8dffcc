// astrai-train: one training run with AstrAI's train.py flags (DESIGN §1, §8).
//
// Exit codes: 0 done (or stopped by SIGTERM/SIGINT after a checkpoint),
// 1 failure while training, 2 bad input (flags, config, weights, data).
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "comm/comm.h"
#include "proto/train_spec.h"
#include "worker/lib/launch.h"
#include "worker/lib/trainer.h"

static void on_stop(int sig) {
    (void)sig;
    trainer_stop_requested = 1;
}

static void on_checkpoint(int sig) {
    (void)sig;
    trainer_checkpoint_requested = 1;
}

static void install_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_checkpoint;
    sigaction(SIGUSR1, &sa, NULL);
}

// The collectives of a multi-rank job: ranks meet (rendezvous), then attach to the
// shm segment rank 0 named.
static int connect_ranks(LaunchInfo *li, const TrainSpec *spec, Comm **comm, Err *err) {
    *comm = NULL;
    if (li->world_size == 1) return 0;
    if (!strcmp(spec->parallel_mode, "none"))
        return err_set(err, "parallel_mode: 'none' cannot run %d ranks (%s); use ddp or fsdp",
                       li->world_size, li->source);
    if (launch_rendezvous(li, NULL, err)) return -1;
    CommConfig cfg = {.backend = "shm",
                      .rank = li->rank,
                      .world_size = li->world_size,
                      .timeout_ms = (int)(spec->comm_timeout * 1000),
                      .shm_name = li->shm_name};
    return comm_create(comm, &cfg, err);
}

// One rank (or the single process) of the job. Exit codes as documented above.
static int train_rank(LaunchInfo *li, const TrainSpec *spec) {
    Err err = {{0}};
    Comm *comm;
    if (connect_ranks(li, spec, &comm, &err)) {
        fprintf(stderr, "astrai-train: rank %d: %s\n", li->rank, err.msg);
        return 2;
    }
    Trainer t;
    int rc = 0;
    if (trainer_init(&t, spec, comm, launch_threads(li, spec->threads), &err)) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        rc = 2;
    } else if (trainer_run(&t, &err)) {
        fprintf(stderr, "astrai-train: rank %d: %s\n", li->rank, err.msg);
        rc = 1;
    }
    trainer_free(&t);
    comm_destroy(comm);
    return rc;
}

static int run(const TrainSpec *spec, char **argv) {
    Err err = {{0}};
    LaunchInfo *li = launch_info();
    if (launch_detect(li, spec->nprocs, &err)) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        return 2;
    }
    if (li->mode != LAUNCH_LOCAL_PARENT) {
        install_signals();
        return train_rank(li, spec);
    }
    int rc = launch_local(li, argv, &err);
    if (rc < 0) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        return 1;
    }
    return rc;
}

int main(int argc, char **argv) {
    TrainSpec spec;
    Err err = {{0}};
    bool help;
    train_spec_defaults(&spec);
    if (train_spec_parse_args(&spec, argc, argv, &help, &err) ||
        (!help && train_spec_validate(&spec, &err))) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        train_spec_free(&spec);
        return 2;
    }
    if (help) {
        train_spec_print_help("astrai-train");
        train_spec_free(&spec);
        return 0;
    }
    int rc = run(&spec, argv);
    train_spec_free(&spec);
    return rc;
}
