// lifecycle.c: the daemon's one state (Astraid) and its end: SIGTERM/SIGINT stop every running
// job (each checkpoints first; a second signal kills the ranks), and the loop ends once no run
// is left.
#include <signal.h>

#include "daemon/daemon.h"

Astraid astraid;

static uv_signal_t sig_term, sig_int;

static void close_handle(uv_handle_t *h, void *arg) {
    (void)arg;
    if (!uv_is_closing(h)) uv_close(h, NULL);
}

void daemon_close_all(void) {
    server_close_all();
    http_stop(); // its threads wake the loop: gone before the loop's handles close
    uv_walk(astraid.loop, close_handle, NULL); // timers, signals: uv_run then returns
}

void daemon_maybe_finish(void) {
    if (!astraid.stopping || runner_alive()) return;
    log_info("every job is stopped; exiting");
    daemon_close_all();
}

static void on_stop_signal(uv_signal_t *h, int signum) {
    (void)h;
    const char *name = signum == SIGINT ? "SIGINT" : "SIGTERM";
    if (astraid.stopping) {
        log_warn("%s again: killing the ranks now", name);
    } else {
        astraid.stopping = 1;
        int running = runner_alive();
        log_info("%s: stopping %d running job(s) (they checkpoint first)", name, running);
        // systemd waits TimeoutStopSec; ranks may need up to stop-timeout to checkpoint.
        systemd_notify("STOPPING=1\nSTATUS=stopping %d job(s)\nEXTEND_TIMEOUT_USEC=%llu", running,
                       (unsigned long long)((astraid.cfg.stop_timeout + 10) * 1e6));
        server_close_listeners();
    }
    for (Job *j = astraid.jobs; j; j = j->next)
        if (job_has_run(j)) astraid.site->stop(j, STOP_SHUTDOWN); // slurm: kept running
    daemon_maybe_finish();
}

void daemon_watch_signals(void) {
    uv_signal_init(astraid.loop, &sig_term);
    uv_signal_init(astraid.loop, &sig_int);
    uv_signal_start(&sig_term, on_stop_signal, SIGTERM);
    uv_signal_start(&sig_int, on_stop_signal, SIGINT);
}
