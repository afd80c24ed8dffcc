// group.c: the bookkeeping and exit policy of a group of ranks (ranks.h).
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ranks/ranks.h"

int ranks_group_init(RankGroup *g, int n, int stages, Err *err) {
    *g = (RankGroup){.n = n, .stages = stages > 1 ? stages : 1, .failed = -1, .interrupted = -1};
    g->rank = calloc(n > 0 ? (size_t)n : 1, sizeof *g->rank);
    if (!g->rank) return err_resource(err, "out of memory for %d ranks", n);
    return 0;
}

void ranks_group_free(RankGroup *g) {
    free(g->rank);
    g->rank = NULL;
}

void ranks_started(RankGroup *g, int rank, pid_t pid) {
    g->rank[rank] = (RankExit){.pid = pid, .alive = 1};
    g->alive++;
}

static int code_of(const RankExit *r) {
    return r->term_signal ? 128 + r->term_signal : r->exit_code;
}

RanksAction ranks_exited(RankGroup *g, int rank, int exit_code, int term_signal) {
    RankExit *r = &g->rank[rank];
    if (r->alive) g->alive--;
    r->alive = 0;
    r->exit_code = term_signal ? 0 : exit_code;
    r->term_signal = term_signal;
    int code = code_of(r);
    if (g->stop_asked || code == 0) return RANKS_CONTINUE;
    if (code == EXIT_INTERRUPTED) {
        if (g->interrupted < 0) g->interrupted = rank;
    } else if (g->failed < 0) {
        g->failed = rank;
    } else {
        return RANKS_CONTINUE; // a consequence of the root cause
    }
    if (g->stopping) return RANKS_CONTINUE; // told to stop already: nothing new to do
    g->stopping = 1;
    return RANKS_STOP_OTHERS;
}

void ranks_start_failed(RankGroup *g, int rank) {
    g->rank[rank] = (RankExit){0};
    if (g->failed < 0) g->failed = rank;
    g->stopping = 1;
}

void ranks_stop_asked(RankGroup *g) {
    g->stop_asked = g->stopping = 1;
}

void ranks_signal(const RankGroup *g, int sig) {
    for (int i = 0; i < g->n; i++)
        if (g->rank[i].alive) kill(-g->rank[i].pid, sig);
}

int ranks_exit_code(const RankGroup *g) {
    if (g->failed >= 0) return g->rank[g->failed].pid ? code_of(&g->rank[g->failed]) : 1;
    return g->interrupted >= 0 ? EXIT_INTERRUPTED : 0;
}

void ranks_describe(const RankGroup *g, int rank, char *out, size_t cap) {
    const RankExit *r = &g->rank[rank];
    int global = g->first_rank + rank;
    // Under a pipeline the stage is what the user needs: the others' errors name it too.
    char who[96];
    if (g->stages > 1)
        snprintf(who, sizeof who, "rank %d (pipeline stage %d of %d, pid %d)", global,
                 global % g->stages, g->stages, (int)r->pid);
    else
        snprintf(who, sizeof who, "rank %d (pid %d)", global, (int)r->pid);
    if (!r->pid)
        snprintf(out, cap, "rank %d could not be started", global);
    else if (r->term_signal)
        snprintf(out, cap, "%s was killed by signal %d (%s)", who, r->term_signal,
                 strsignal(r->term_signal));
    else
        snprintf(out, cap, "%s exited with code %d", who, r->exit_code);
}
