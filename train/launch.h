// launch.h: how this astrai-train process came to be, and the launcher of local
// ranks (docs/design.md §1, §5, §9).
//
// Three ways to run:
//  - single:       no rank variables and nprocs == 1: one process is the whole job.
//  - local parent: no rank variables and nprocs > 1: this process spawns nprocs
//                  ranks (fork+exec of itself, same argv), supervises them and
//                  exits with the first failure's code (3 when they were interrupted
//                  and none failed); it never trains itself. With --nnodes N > 1 (torchrun's
//                  multi-node launch) it is node --node_rank R's launcher: it spawns
//                  --nproc_per_node K ranks (default --nprocs), the job's ranks R·K .. R·K+K-1
//                  of N·K, which meet at --master_addr:--master_port (node 0's address; node
//                  0's launcher listens there, on every address).
//  - rank:         RANK/WORLD_SIZE[/LOCAL_RANK/LOCAL_WORLD_SIZE] (torchrun, or by
//                  hand) or SLURM_PROCID/SLURM_NTASKS[/SLURM_LOCALID] (srun), with
//                  MASTER_ADDR/MASTER_PORT; or the same variables set by our own
//                  local parent (ASTRAI_LAUNCHED=1). Under an external launcher the
//                  world size comes from the environment and --nprocs is ignored,
//                  as in AstrAI.
//
// Environment knobs: ASTRAI_STOP_GRACE_S (seconds between SIGTERM and SIGKILL when ranks
// are stopped, default RANKS_STOP_GRACE_S: 60), ASTRAI_RENDEZVOUS_TIMEOUT_S (default 300),
// ASTRAI_RENDEZVOUS_PORT (rendezvous port; default MASTER_PORT, or MASTER_PORT+1
// under torchrun's static rendezvous, whose own store holds MASTER_PORT).
#pragma once
#include <signal.h>
#include <stdint.h>

#include "comm/comm.h" // COMM_NCCL_ID_BYTES: the id the rendezvous hands out
#include "common/error.h"

typedef enum { LAUNCH_SINGLE, LAUNCH_LOCAL_PARENT, LAUNCH_RANK } LaunchMode;

typedef struct {
    LaunchMode mode;
    int rank, world_size, local_rank, local_world_size;
    int external;       // launched by torchrun/SLURM/by hand, not by our local parent
    const char *source; // the variables it came from, for messages ("SLURM_PROCID", ...)
    // Where rank 0 serves the rendezvous. A rank: from MASTER_ADDR and MASTER_PORT, or the
    // flags in their place (see LaunchFlags and ASTRAI_RENDEZVOUS_PORT above). The local
    // parent: the flags ("" and 0 when not given: 127.0.0.1, a free port).
    char master_addr[256];
    int master_port;
    int rendezvous_fd; // rank 0 of a local launch: the socket the parent listens on; else -1
    // The shm segment of the collectives: set by the local parent (ASTRAI_SHM_NAME),
    // or chosen by rank 0 and handed out by launch_rendezvous().
    char shm_name[64];
    int stages; // --pp_size: the pipeline stages of a replica (1 without), for messages
    int nnodes, node_rank; // a local parent of a multi-node launch: the nodes, this node's rank
    // After launch_rendezvous (world_size > 1): the open meeting (its layout, and the exchange
    // of the gloo backend's connect); launch_end_meeting closes it.
    struct Rendezvous *meeting;
    // The rank's stop flag (set by its SIGTERM/SIGINT handler), or NULL: a rendezvous still
    // waiting for ranks gives up when it is set.
    const volatile sig_atomic_t *stop;
} LaunchInfo;

// This process's launch: astrai-train's main fills it with launch_detect_flags() and meets
// the other ranks with it (rank, world size, shm name). Its rank is the one answer to which
// rank this process is: what is printed once per job, rank 0 prints (a local parent leaves it
// to its rank 0).
LaunchInfo *launch_info(void);

// The command line's part in the launch: --nprocs, and --master_addr/--master_port when given
// explicitly (NULL otherwise). Given, they say where the ranks meet: where a local parent
// listens, and for a rank of another launcher (torchrun, srun, by hand) they stand in for
// MASTER_ADDR/MASTER_PORT; a rank of our own local launch keeps what its parent set.
typedef struct {
    long nprocs;                           // ranks of this node (--nproc_per_node, else --nprocs)
    long nnodes, node_rank;                // 0 or 1 node: a one-host launch
    long pp_size;                          // 0 or 1: no pipeline
    const char *master_addr, *master_port; // master_port: digits (train_spec validates it)
} LaunchFlags;

// Reads the environment (see above) and the flags. Errors name the variable
// ("RANK=2 is not below WORLD_SIZE=2", "MASTER_ADDR is not set ..."). A rank also
// arranges to get SIGTERM when its parent (launcher, torchrun) dies, and fails if
// that parent is already gone.
int launch_detect_flags(LaunchInfo *li, const LaunchFlags *flags, Err *err);
// launch_detect_flags with --nprocs alone.
int launch_detect(LaunchInfo *li, long nprocs, Err *err);

// Local parent: listens on li->master_addr:li->master_port for the rendezvous (a port
// in use is an error naming them, before any rank starts), runs li->world_size ranks of
// /proc/self/exe with argv, each in its own process group (rank 0 holds the listening
// socket, the others connect to it), and supervises them with the exit policy of
// ranks/ranks.h: SIGTERM/SIGINT/SIGUSR1 are forwarded to every rank; the first failure
// stops the others (SIGTERM, SIGKILL after the grace), and so does a rank interrupted after
// its checkpoint. Prints which rank failed and how, removes the run's shm segments, and
// returns the group's exit code (ranks_exit_code); -1 with err when the ranks could not
// be started.
int launch_local(const LaunchInfo *li, char **argv, Err *err);

// Ranks meet before the collectives exist (every mode; returns at once when there
// is only one rank): rank 0 hands every rank the shm segment name (filling
// li->shm_name), the layout (li->meeting) and, when nccl_id is not NULL, its
// COMM_NCCL_ID_BYTES bytes (read on rank 0, written on the others). Every rank must pass
// nccl_id alike.
int launch_rendezvous(LaunchInfo *li, uint8_t *nccl_id, Err *err);
// Closes li->meeting (once the collectives are connected); nothing when there is none.
void launch_end_meeting(LaunchInfo *li);

// CPU threads for one rank: `threads` if > 0, else the usable cores divided by the
// ranks on this host (at least 1).
long launch_threads(const LaunchInfo *li, long threads);
