// launch.c: launch detection, the local launcher and its supervision loop.
//
// The local parent never forks after initialising anything a child could inherit
// in a bad state (CUDA, NCCL, OpenMP pools in use): it forks and immediately
// execs /proc/self/exe, and between fork and exec the child makes only
// async-signal-safe calls (its environment is built before the fork).
#include "train/launch.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common/clock.h"
#include "ranks/ranks.h"
#include "train/rendezvous.h"

#define DEFAULT_RENDEZVOUS_TIMEOUT_S 300.0
#define KILL_WAIT_MS 5000    // after SIGKILL, how long to wait for a rank stuck in the kernel
#define EXIT_LAUNCHER_GONE 1 // a child whose parent died before it could exec
#define SHM_PAYLOAD 64       // bytes of the rendezvous payload that carry the shm name
#define DEFAULT_MASTER_PORT 29500

LaunchInfo *launch_info(void) {
    static LaunchInfo info = {.rendezvous_fd = -1};
    return &info;
}

// ---------------------------------------------------------------- environment

// The integer value v of `name` in [lo, hi]; *present = 0 (and *out untouched) when v is NULL.
static int int_value(const char *name, const char *v, long lo, long hi, int *out, int *present,
                     Err *err) {
    *present = v != NULL;
    if (!v) return 0;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi)
        return err_set(err, "%s='%s' is not an integer in [%ld, %ld]", name, v, lo, hi);
    *out = (int)x;
    return 0;
}

// An integer variable in [lo, hi]; *present = 0 (and *out untouched) when unset.
static int env_int(const char *name, long lo, long hi, int *out, int *present, Err *err) {
    return int_value(name, getenv(name), lo, hi, out, present, err);
}

// A number of seconds from the environment, or `fallback` when unset.
static int env_seconds(const char *name, double fallback, double *out, Err *err) {
    const char *v = getenv(name);
    *out = fallback;
    if (!v) return 0;
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !isfinite(x) || x < 0 || x > 1e6)
        return err_set(err, "%s='%s' is not a number of seconds in [0, 1e6]", name, v);
    *out = x;
    return 0;
}

// ---------------------------------------------------------------- detection

// The names under which a launcher gives a process its place in the job.
typedef struct {
    const char *rank, *world, *local_rank, *local_world;
} RankVars;

static const RankVars TORCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
static const RankVars SLURM_VARS = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                    "SLURM_TASKS_PER_NODE"};

// The variables of the launcher that started this process: torchrun's (also set by our local
// parent, or by hand), else srun's; NULL: none (a single process or a local parent).
static const RankVars *rank_vars(void) {
    if (getenv("RANK") || getenv("WORLD_SIZE")) return &TORCH_VARS;
    return getenv("SLURM_PROCID") ? &SLURM_VARS : NULL;
}

// SLURM_TASKS_PER_NODE ("2(x3),1": 2 tasks on each of 3 nodes, then 1 task) at
// node `node`; -1 when it does not parse.
static int slurm_tasks_on_node(const char *spec, long node) {
    const char *p = spec;
    while (*p) {
        char *end;
        long n = strtol(p, &end, 10), reps = 1;
        if (end == p || n <= 0 || n > INT_MAX) return -1;
        if (!strncmp(end, "(x", 2)) {
            reps = strtol(end + 2, &end, 10);
            if (*end != ')' || reps <= 0) return -1;
            end++;
        }
        if (node < reps) return (int)n;
        node -= reps;
        if (*end == ',')
            end++;
        else if (*end)
            return -1;
        p = end;
    }
    return -1;
}

static int local_world_from_env(LaunchInfo *li, const RankVars *vars, Err *err) {
    li->local_world_size = li->world_size; // one host unless told otherwise
    int present;
    if (vars == &TORCH_VARS)
        return env_int(vars->local_world, 1, INT_MAX, &li->local_world_size, &present, err);
    const char *tasks = getenv(vars->local_world), *node = getenv("SLURM_NODEID");
    int n = tasks && node ? slurm_tasks_on_node(tasks, strtol(node, NULL, 10)) : -1;
    if (n > 0) li->local_world_size = n;
    return 0;
}

static int rank_from_env(LaunchInfo *li, const RankVars *vars, Err *err) {
    int has_rank, has_world, has_local;
    if (env_int(vars->rank, 0, INT_MAX, &li->rank, &has_rank, err) ||
        env_int(vars->world, 1, INT_MAX, &li->world_size, &has_world, err))
        return -1;
    if (!has_rank || !has_world)
        return err_set(err, "%s is set but %s is not (an external launch needs both)",
                       has_rank ? vars->rank : vars->world, has_rank ? vars->world : vars->rank);
    if (li->rank >= li->world_size)
        return err_set(err, "%s=%d is not below %s=%d", vars->rank, li->rank, vars->world,
                       li->world_size);
    li->local_rank = li->rank;
    if (env_int(vars->local_rank, 0, INT_MAX, &li->local_rank, &has_local, err) ||
        local_world_from_env(li, vars, err))
        return -1;
    if (li->local_rank >= li->local_world_size)
        return err_set(err, "%s=%d is not below %s=%d", vars->local_rank, li->local_rank,
                       vars->local_world, li->local_world_size);
    li->source = vars->rank;
    return 0;
}

// Where rank 0 serves the rendezvous: MASTER_ADDR and MASTER_PORT, or the flags given in their
// place.
static int master_from_env(LaunchInfo *li, const LaunchFlags *flags, Err *err) {
    const char *addr = flags->master_addr ? flags->master_addr : getenv("MASTER_ADDR");
    const char *port_text = flags->master_port ? flags->master_port : getenv("MASTER_PORT");
    int has_port, has_override, port = 0;
    if (int_value("MASTER_PORT", port_text, 1, 65535, &port, &has_port, err) ||
        env_int("ASTRAI_RENDEZVOUS_PORT", 1, 65535, &li->master_port, &has_override, err))
        return -1;
    if (li->world_size == 1) return 0; // nobody to meet
    if (!addr || !*addr || !has_port)
        return err_set(err, "%s is not set (rank %d of %d from %s needs rank 0's address)",
                       !addr || !*addr ? "MASTER_ADDR" : "MASTER_PORT", li->rank, li->world_size,
                       li->source);
    if (strlen(addr) >= sizeof li->master_addr)
        return err_set(err, "MASTER_ADDR='%.40s...' is too long", addr);
    strcpy(li->master_addr, addr);
    if (!has_override) { // torchrun's static rendezvous keeps its own store on MASTER_PORT
        const char *agent_store = getenv("TORCHELASTIC_USE_AGENT_STORE");
        li->master_port = port + (agent_store && !strcmp(agent_store, "True") && port < 65535);
    }
    return 0;
}

// A rank must not outlive its parent (docs/design.md §5): SIGTERM when it dies, and an
// error now if it died before PDEATHSIG was armed.
static int guard_parent(pid_t expected, const char *who, Err *err) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != expected) return err_set(err, "%s (pid %d) is gone", who, (int)expected);
    return 0;
}

// A rank started by our own local parent: the segment name, the rendezvous socket.
static int local_rank_from_env(LaunchInfo *li, Err *err) {
    const char *shm = getenv("ASTRAI_SHM_NAME");
    if (!shm || shm[0] != '/' || strlen(shm) >= sizeof li->shm_name)
        return err_set(err, "ASTRAI_SHM_NAME='%s' is not a shm segment name", shm ? shm : "");
    strcpy(li->shm_name, shm);
    int present, launcher = 0;
    if (env_int("ASTRAI_LAUNCHER_PID", 1, INT_MAX, &launcher, &present, err) ||
        env_int("ASTRAI_RENDEZVOUS_FD", 0, INT_MAX, &li->rendezvous_fd, &present, err))
        return -1;
    if (!present)
        li->rendezvous_fd = -1;
    else if (fcntl(li->rendezvous_fd, F_GETFD) < 0)
        return err_set(err, "ASTRAI_RENDEZVOUS_FD=%d is not an open file descriptor",
                       li->rendezvous_fd);
    li->source = "astrai-train --nprocs";
    return launcher ? guard_parent(launcher, "the launcher", err) : 0;
}

// A node of a multi-node launch: its place, and node 0's address where the ranks meet.
static int node_from_flags(LaunchInfo *li, const LaunchFlags *flags, Err *err) {
    if (flags->nnodes > 4096 || flags->nprocs * flags->nnodes > INT_MAX)
        return err_set(err, "nnodes: %ld nodes of %ld ranks are too many", flags->nnodes,
                       flags->nprocs);
    if (flags->node_rank < 0 || flags->node_rank >= flags->nnodes)
        return err_set(err, "node_rank: %ld is not below nnodes %ld", flags->node_rank,
                       flags->nnodes);
    if (!flags->master_addr)
        return err_set(err,
                       "master_addr: --nnodes %ld needs node 0's address (--master_addr, as "
                       "torchrun's), where the ranks of every node meet",
                       flags->nnodes);
    li->mode = LAUNCH_LOCAL_PARENT;
    li->nnodes = (int)flags->nnodes;
    li->node_rank = (int)flags->node_rank;
    li->world_size = (int)(flags->nprocs * flags->nnodes);
    li->source = "--nnodes";
    return 0;
}

// No launcher: one process, or the local parent of flags->nprocs ranks, which listens where the
// flags say.
static int local_from_flags(LaunchInfo *li, const LaunchFlags *flags, Err *err) {
    if (flags->nprocs < 1 || flags->nprocs > INT_MAX)
        return err_set(err, "nprocs: %ld is not a number of ranks", flags->nprocs);
    li->mode = flags->nprocs > 1 ? LAUNCH_LOCAL_PARENT : LAUNCH_SINGLE;
    li->world_size = li->local_world_size = (int)flags->nprocs;
    li->nnodes = 1;
    li->source = "--nprocs";
    if (flags->nnodes > 1 && node_from_flags(li, flags, err)) return -1;
    const char *addr = flags->master_addr;
    if (addr && strlen(addr) >= sizeof li->master_addr)
        return err_set(err, "master_addr: '%.40s...' is too long", addr);
    if (addr) strcpy(li->master_addr, addr);
    int given;
    if (int_value("master_port", flags->master_port, 1, 65535, &li->master_port, &given, err))
        return -1;
    // Nodes must agree on the port without being told: torchrun's default.
    if (li->nnodes > 1 && !given) li->master_port = DEFAULT_MASTER_PORT;
    return 0;
}

int launch_detect_flags(LaunchInfo *li, const LaunchFlags *flags, Err *err) {
    memset(li, 0, sizeof *li);
    li->rendezvous_fd = -1;
    li->stages = flags->pp_size > 1 && flags->pp_size <= INT_MAX ? (int)flags->pp_size : 1;
    const RankVars *vars = rank_vars();
    if (!vars) return local_from_flags(li, flags, err);
    li->mode = LAUNCH_RANK;
    const char *launched = getenv("ASTRAI_LAUNCHED");
    int ours = launched && !strcmp(launched, "1");
    // A rank of our own local launch meets where its parent said, whatever the flags.
    LaunchFlags master = ours ? (LaunchFlags){0} : *flags;
    if (rank_from_env(li, vars, err) || master_from_env(li, &master, err)) return -1;
    if (ours) return local_rank_from_env(li, err);
    li->external = 1;
    return guard_parent(getppid(), "the parent process", err);
}

int launch_detect(LaunchInfo *li, long nprocs, Err *err) {
    return launch_detect_flags(li, &(LaunchFlags){.nprocs = nprocs}, err);
}

long launch_threads(const LaunchInfo *li, long threads) {
    if (threads > 0) return threads;
    cpu_set_t set;
    long cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                             : sysconf(_SC_NPROCESSORS_ONLN);
    long per_rank = cores / (li->local_world_size > 0 ? li->local_world_size : 1);
    return per_rank > 0 ? per_rank : 1;
}

// ---------------------------------------------------------------- rendezvous

int launch_rendezvous(LaunchInfo *li, uint8_t *nccl_id, Err *err) {
    if (li->mode != LAUNCH_RANK || li->world_size <= 1) return 0;
    double timeout_s;
    if (env_seconds("ASTRAI_RENDEZVOUS_TIMEOUT_S", DEFAULT_RENDEZVOUS_TIMEOUT_S, &timeout_s, err))
        return -1;
    uint8_t payload[SHM_PAYLOAD + COMM_NCCL_ID_BYTES] = {0};
    size_t len = SHM_PAYLOAD + (nccl_id ? COMM_NCCL_ID_BYTES : 0);
    if (li->rank == 0) {
        if (!li->shm_name[0]) comm_shm_new_name(li->shm_name, sizeof li->shm_name);
        memcpy(payload, li->shm_name, sizeof li->shm_name);
        if (nccl_id) memcpy(payload + SHM_PAYLOAD, nccl_id, COMM_NCCL_ID_BYTES);
    }
    RendezvousConfig cfg = {.rank = li->rank,
                            .world_size = li->world_size,
                            .master_addr = li->master_addr,
                            .port = li->master_port,
                            .listen_fd = li->rendezvous_fd,
                            .timeout_ms = (int)(timeout_s * 1000),
                            .stop = li->stop};
    // Our own multi-node launch and torchrun's run as many ranks on every node.
    if (li->local_world_size < li->world_size) cfg.node_size = li->local_world_size;
    int rc = rendezvous_open(&cfg, payload, len, &li->meeting, err);
    if (li->rendezvous_fd >= 0) {
        close(li->rendezvous_fd);
        li->rendezvous_fd = -1;
    }
    if (rc || li->rank == 0) return rc;
    if (payload[0] != '/' || !memchr(payload, 0, SHM_PAYLOAD)) {
        launch_end_meeting(li);
        return err_set(err, "rendezvous: rank 0 sent no valid shm segment name");
    }
    memcpy(li->shm_name, payload, sizeof li->shm_name);
    if (nccl_id) memcpy(nccl_id, payload + SHM_PAYLOAD, COMM_NCCL_ID_BYTES);
    return 0;
}

void launch_end_meeting(LaunchInfo *li) {
    rendezvous_close(li->meeting);
    li->meeting = NULL;
}

// ---------------------------------------------------------------- local launcher

// The address rank 0 of a local launch listens on and the other ranks connect to.
static const char *local_master(const LaunchInfo *li) {
    return li->master_addr[0] ? li->master_addr : "127.0.0.1";
}

// The ranks of this launch (ranks/ranks.h keeps their exits and decides), and the
// deadline of the stop under way.
typedef struct {
    RankGroup g;
    int killed;
    int64_t deadline; // stopping: when to SIGKILL; killed: when to give up waiting
    double grace_s;
} Supervisor;

// Child side of fork: async-signal-safe calls only, then exec.
static void exec_rank(char **argv, char **env, int keep_fd, pid_t parent) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(EXIT_LAUNCHER_GONE);
    if (keep_fd >= 0) fcntl(keep_fd, F_SETFD, 0); // rank 0 inherits the rendezvous socket
    struct sigaction dfl = {.sa_handler = SIG_DFL};
    sigaction(SIGTERM, &dfl, NULL);
    sigaction(SIGINT, &dfl, NULL);
    sigaction(SIGUSR1, &dfl, NULL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execve("/proc/self/exe", argv, env);
    static const char msg[] = "astrai-train: cannot exec /proc/self/exe for a rank\n";
    ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)w;
    _exit(127);
}

static int spawn_rank(Supervisor *s, const RanksLaunch *l, int rank, char **argv, Err *err) {
    char **env = ranks_env(l, rank);
    if (!env) return err_resource(err, "cannot start rank %d: out of memory", rank);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) exec_rank(argv, env, rank == 0 ? l->listen_fd : -1, parent);
    int fork_errno = errno;
    ranks_free_env(env);
    if (pid < 0) return err_set(err, "cannot start rank %d: fork: %s", rank, strerror(fork_errno));
    setpgid(pid, pid); // also here, so the group exists before we might signal it
    ranks_started(&s->g, rank, pid);
    return 0;
}

static void start_stop(Supervisor *s, int sig) {
    s->g.stopping = 1;
    s->deadline = clock_mono_ms() + (int64_t)(s->grace_s * 1000);
    ranks_signal(&s->g, sig);
}

// after_grace: the ranks had their grace period (else the user asked twice).
static void kill_ranks(Supervisor *s, int after_grace) {
    for (int i = 0; i < s->g.n && after_grace; i++)
        if (s->g.rank[i].alive)
            fprintf(stderr, "astrai-train: rank %d (pid %d) did not stop within %g s; SIGKILL\n", i,
                    (int)s->g.rank[i].pid, s->grace_s);
    s->killed = 1;
    s->deadline = clock_mono_ms() + KILL_WAIT_MS;
    ranks_signal(&s->g, SIGKILL);
}

static void on_rank_exit(Supervisor *s, int rank, int status) {
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (ranks_exited(&s->g, rank, sig ? 0 : WEXITSTATUS(status), sig) != RANKS_STOP_OTHERS) return;
    char how[128];
    ranks_describe(&s->g, rank, how, sizeof how);
    fprintf(stderr, "astrai-train: %s%s; stopping the other %d rank(s)\n", how,
            !sig && WEXITSTATUS(status) == EXIT_INTERRUPTED ? " (interrupted after its checkpoint)"
                                                            : "",
            s->g.alive);
    start_stop(s, SIGTERM);
}

static void reap(Supervisor *s) {
    for (int i = 0; i < s->g.n; i++) {
        if (!s->g.rank[i].alive) continue;
        int status;
        pid_t r = waitpid(s->g.rank[i].pid, &status, WNOHANG);
        if (r == s->g.rank[i].pid)
            on_rank_exit(s, i, status);
        else if (r < 0 && errno == ECHILD) // reaped behind our back: gone, its code lost
            on_rank_exit(s, i, W_EXITCODE(1, 0));
    }
}

static void on_stop_signal(Supervisor *s, int sig) {
    const char *name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    if (s->g.stopping && !s->killed) { // asked twice: no more waiting
        fprintf(stderr, "astrai-train: %s again; killing the ranks\n", name);
        kill_ranks(s, 0);
    } else if (!s->g.stopping) {
        fprintf(stderr, "astrai-train: got %s; forwarding it to %d rank(s)\n", name, s->g.alive);
        start_stop(s, sig);
    }
}

// Gives up on ranks that survive even SIGKILL (stuck in the kernel): never wait unbounded.
static void abandon_ranks(Supervisor *s) {
    for (int i = 0; i < s->g.n; i++)
        if (s->g.rank[i].alive) {
            fprintf(stderr, "astrai-train: rank %d (pid %d) is still alive after SIGKILL\n", i,
                    (int)s->g.rank[i].pid);
            ranks_exited(&s->g, i, 0, SIGKILL);
        }
}

static void supervise(Supervisor *s, const sigset_t *watched) {
    while (s->g.alive > 0) {
        struct timespec ts, *timeout = NULL;
        if (s->g.stopping) {
            int64_t left = s->deadline - clock_mono_ms();
            left = left < 0 ? 0 : left;
            ts = (struct timespec){left / 1000, (left % 1000) * 1000000L};
            timeout = &ts;
        }
        int sig = sigtimedwait(watched, NULL, timeout);
        if (sig == SIGCHLD)
            reap(s);
        else if (sig == SIGTERM || sig == SIGINT)
            on_stop_signal(s, sig);
        else if (sig == SIGUSR1)
            ranks_signal(&s->g, SIGUSR1); // checkpoint request: every rank takes part
        else if (sig < 0 && errno == EAGAIN && !s->killed)
            kill_ranks(s, 1);
        else if (sig < 0 && errno == EAGAIN)
            abandon_ranks(s);
    }
}

// The parent binds the rendezvous socket before any rank exists, so a port in use fails
// the launch at once; rank 0 inherits the socket and serves the meeting on it. Node 0 of a
// multi-node launch listens on every address (master_addr is how the other nodes reach it);
// the other nodes' ranks connect to it.
static int spawn_all(Supervisor *s, const LaunchInfo *li, char **argv, Err *err) {
    RanksLaunch l = {.world_size = li->world_size,
                     .rank_base = li->node_rank * li->local_world_size,
                     .local_world = li->local_world_size,
                     .master_addr = local_master(li),
                     .port = li->master_port,
                     .listen_fd = -1,
                     .shm_name = li->shm_name};
    if (li->node_rank == 0 && ranks_listen(li->nnodes > 1 ? NULL : l.master_addr, li->master_port,
                                           &l.listen_fd, &l.port, err))
        return -1;
    int rc = 0;
    for (int r = 0; r < li->local_world_size && !rc; r++)
        rc = spawn_rank(s, &l, r, argv, err);
    if (l.listen_fd >= 0) close(l.listen_fd); // rank 0 has its own copy
    return rc;
}

int launch_local(const LaunchInfo *li, char **argv, Err *err) {
    Supervisor s = {0};
    if (env_seconds("ASTRAI_STOP_GRACE_S", RANKS_STOP_GRACE_S, &s.grace_s, err) ||
        ranks_group_init(&s.g, li->local_world_size, li->stages, err))
        return -1;
    s.g.first_rank = li->node_rank * li->local_world_size;
    LaunchInfo job = *li;
    comm_shm_new_name(job.shm_name, sizeof job.shm_name);
    // Signals are taken synchronously (sigtimedwait), so none can slip in between
    // a check and a wait; SIGCHLD must not be ignored or the exit codes are lost.
    struct sigaction dfl = {.sa_handler = SIG_DFL};
    sigaction(SIGCHLD, &dfl, NULL);
    sigset_t watched, old;
    sigemptyset(&watched);
    int sigs[] = {SIGCHLD, SIGTERM, SIGINT, SIGUSR1};
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++)
        sigaddset(&watched, sigs[i]);
    sigprocmask(SIG_BLOCK, &watched, &old);
    int rc = spawn_all(&s, &job, argv, err);
    if (rc && s.g.alive > 0) // some ranks started: stop them before reporting
        start_stop(&s, SIGTERM);
    supervise(&s, &watched);
    comm_shm_remove(job.shm_name);
    sigprocmask(SIG_SETMASK, &old, NULL);
    int code = ranks_exit_code(&s.g);
    ranks_group_free(&s.g);
    return rc ? -1 : code;
}
