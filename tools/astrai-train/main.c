// astrai-train: one training run with AstrAI's train.py flags (DESIGN §1, §8).
//
// Exit codes: 0 done (or stopped by SIGTERM/SIGINT after a checkpoint),
// 1 failure while training, 2 bad input (flags, config, weights, data).
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "proto/train_spec.h"
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
    install_signals();
    Trainer t;
    int rc = 0;
    if (trainer_init(&t, &spec, &err)) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        rc = 2;
    } else if (trainer_run(&t, &err)) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        rc = 1;
    }
    trainer_free(&t);
    train_spec_free(&spec);
    return rc;
}
