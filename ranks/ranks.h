// ranks.h: running the N ranks of one job on this host and supervising them (docs/design.md §5).
//
// Two supervisors start ranks: astrai-train's local launcher (train/launch.c: fork and
// exec, blocking on sigtimedwait) and astraid's runner (daemon/runner.c: uv_spawn, pipes, the
// libuv loop). Each keeps only its process mechanics; what they decide alike is here: the
// group's bookkeeping and exit policy, the grace before SIGKILL, the environment of a rank
// and the loopback listener of the rendezvous.
//
// Exit policy of a group (ranks_exited):
//  - exit 0 is a rank done.
//  - the first rank that fails (a non-zero exit other than EXIT_INTERRUPTED, or a signal)
//    is the root cause: the others are stopped (SIGTERM, then SIGKILL after the grace).
//    Later failures are its consequences.
//  - a rank that exits EXIT_INTERRUPTED (stopped after its checkpoint by a signal or a stop
//    its supervisor did not send) is no failure, but its job is stopping: the others are
//    stopped too. A real failure after it is still the root cause.
//  - once the supervisor itself stopped the ranks (ranks_stop_asked: astraid's pause,
//    shutdown, cancel) every exit is expected: none becomes a root cause.
// The group's exit code: the root cause's (128+signal for a signal), else EXIT_INTERRUPTED
// when a rank was interrupted, else 0.
#pragma once
#include <stddef.h>
#include <sys/types.h>

#include "common/error.h"

// Seconds between SIGTERM and SIGKILL when ranks are stopped, for both supervisors
// (ASTRAI_STOP_GRACE_S, astraid --stop-timeout): long enough for a stop checkpoint of a
// large model, which a SIGKILL mid-write would lose.
#define RANKS_STOP_GRACE_S 60.0

typedef struct {
    pid_t pid;       // 0: not started
    int alive;       // started and not yet exited
    int exit_code;   // once exited: its exit code (0 when a signal killed it)
    int term_signal; // once exited: the signal that killed it, or 0
} RankExit;

typedef struct {
    RankExit *rank;  // (n,)
    int n;           // ranks of the group
    int stages;      // pipeline stages of a replica (--pp_size; rank = replica * stages + stage)
    int alive;       // ranks started and not yet exited
    int failed;      // the root cause: the first rank that failed, -1 when none
    int interrupted; // the first rank that exited EXIT_INTERRUPTED, -1 when none
    int stopping;    // the ranks were told to stop (by the policy or the supervisor)
    int stop_asked;  // the supervisor stopped them itself: their exits are expected
    int first_rank;  // the job's rank of this group's rank 0 (a node of a multi-node launch), for
                     // messages; 0 by ranks_group_init
} RankGroup;

// What the supervisor does after an exit.
typedef enum {
    RANKS_CONTINUE,    // nothing: the others go on (or are stopping already)
    RANKS_STOP_OTHERS, // report this rank (ranks_describe) and stop the others
} RanksAction;

// stages: --pp_size (1: no pipeline), for ranks_describe.
int ranks_group_init(RankGroup *g, int n, int stages, Err *err);
void ranks_group_free(RankGroup *g);

void ranks_started(RankGroup *g, int rank, pid_t pid);
// Rank `rank` exited with exit_code, or was killed by term_signal (non-zero): records it
// and applies the exit policy above (sets g->stopping when it returns RANKS_STOP_OTHERS).
RanksAction ranks_exited(RankGroup *g, int rank, int exit_code, int term_signal);
// Rank `rank` could not be started: the root cause, unless there is one already.
void ranks_start_failed(RankGroup *g, int rank);
// The supervisor stops the ranks itself: from now on no exit is a failure.
void ranks_stop_asked(RankGroup *g);

// Sends sig to the process group of every live rank (a rank leads its own group, so the
// processes it started get it too).
void ranks_signal(const RankGroup *g, int sig);

// The group's exit code (see above).
int ranks_exit_code(const RankGroup *g);
// "rank R (pid P) was killed by signal S (name)", "rank R (pid P) exited with code C", or
// "rank R could not be started" for an exited rank; under a pipeline "rank R (pipeline stage
// S of N, pid P) ...".
void ranks_describe(const RankGroup *g, int rank, char *out, size_t cap);

// ---------------------------------------------------------------- a rank's environment

// A local launch: every rank on this host, rank 0 serving the rendezvous on a socket it
// inherits from its supervisor; or this node's part of a multi-node launch (local_world ranks
// from rank_base on).
typedef struct {
    int world_size;
    int rank_base, local_world; // the job's rank of local rank 0, ranks on this node (0: all)
    const char *master_addr;    // where rank 0 listens; NULL or "": 127.0.0.1
    int port;                   // its port
    int listen_fd;              // the listening socket's fd number in rank 0; -1: not on this node
    const char *shm_name;     // the collectives' shm segment (comm_shm_new_name)
    const char *const *extra; // more "NAME=value" for every rank, NULL-terminated; may be NULL
} RanksLaunch;

// The environment of local rank `rank`: ours without inherited rank variables and without the
// variables `extra` sets, then `extra`, then RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT, ASTRAI_LAUNCHED=1, ASTRAI_SHM_NAME, ASTRAI_LAUNCHER_PID (this
// process: the rank arms PR_SET_PDEATHSIG against it) and for rank 0 ASTRAI_RENDEZVOUS_FD.
// NULL when out of memory; free with ranks_free_env.
char **ranks_env(const RanksLaunch *l, int rank);
void ranks_free_env(char **env);

// ---------------------------------------------------------------- the rendezvous listener

// A listening TCP socket (close-on-exec, SO_REUSEADDR) on `host` (a name or address: the
// first of its addresses that can be bound), or on every address when host is NULL; port 0
// picks a free port, *port_out (may be NULL) gets it. A port in use is an error naming
// host:port (no rank waits on another program's port).
int ranks_listen(const char *host, int port, int *fd_out, int *port_out, Err *err);
