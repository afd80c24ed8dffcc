// launch.c: launch detection, the local launcher and its supervision loop.
//
// The local parent never forks after initialising anything a child could inherit
// in a bad state (CUDA, NCCL, OpenMP pools in use): it forks and immediately
// execs /proc/self/exe, and between fork and exec the child makes only
// async-signal-safe calls (its environment is built before the fork).
#include "worker/lib/launch.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "worker/lib/rendezvous.h"

#define DEFAULT_STOP_GRACE_S 30.0
#define DEFAULT_RENDEZVOUS_TIMEOUT_S 300.0
#define KILL_WAIT_MS 5000    // after SIGKILL, how long to wait for a rank stuck in the kernel
#define EXIT_LAUNCHER_GONE 1 // a child whose parent died before it could exec
#define SHM_PAYLOAD 64       // bytes of the rendezvous payload that carry the shm name

extern char **environ;

LaunchInfo *launch_info(void) {
    static LaunchInfo info = {.rendezvous_fd = -1};
    return &info;
}

// ---------------------------------------------------------------- environment

// An integer variable in [lo, hi]; *present = 0 (and *out untouched) when unset.
static int env_int(const char *name, long lo, long hi, int *out, int *present, Err *err) {
    const char *v = getenv(name);
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

void launch_new_shm_name(char *out, size_t cap) {
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce)
        nonce = (uint64_t)clock_mono_ms() ^ ((uint64_t)getpid() << 32);
    snprintf(out, cap, "/astrai-%d-%016llx", (int)getpid(), (unsigned long long)nonce);
}

// ---------------------------------------------------------------- detection

// The names under which a launcher gives a process its place in the job.
typedef struct {
    const char *rank, *world, *local_rank, *local_world;
} RankVars;

static const RankVars TORCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
static const RankVars SLURM_VARS = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                                    "SLURM_TASKS_PER_NODE"};

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

static int master_from_env(LaunchInfo *li, Err *err) {
    const char *addr = getenv("MASTER_ADDR");
    int has_port, has_override, port = 0;
    if (env_int("MASTER_PORT", 1, 65535, &port, &has_port, err) ||
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

// A rank must not outlive its parent (DESIGN §5): SIGTERM when it dies, and an
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

int launch_detect(LaunchInfo *li, long nprocs, Err *err) {
    memset(li, 0, sizeof *li);
    li->rendezvous_fd = -1;
    const RankVars *vars = getenv("RANK") || getenv("WORLD_SIZE") ? &TORCH_VARS
                           : getenv("SLURM_PROCID")               ? &SLURM_VARS
                                                                  : NULL;
    if (!vars) {
        if (nprocs < 1 || nprocs > INT_MAX)
            return err_set(err, "nprocs: %ld is not a number of ranks", nprocs);
        li->mode = nprocs > 1 ? LAUNCH_LOCAL_PARENT : LAUNCH_SINGLE;
        li->world_size = li->local_world_size = (int)nprocs;
        li->source = "--nprocs";
        return 0;
    }
    li->mode = LAUNCH_RANK;
    if (rank_from_env(li, vars, err) || master_from_env(li, err)) return -1;
    const char *ours = getenv("ASTRAI_LAUNCHED");
    if (ours && !strcmp(ours, "1")) return local_rank_from_env(li, err);
    li->external = 1;
    return guard_parent(getppid(), "the parent process", err);
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
    uint8_t payload[SHM_PAYLOAD + LAUNCH_NCCL_ID_BYTES] = {0};
    size_t len = SHM_PAYLOAD + (nccl_id ? LAUNCH_NCCL_ID_BYTES : 0);
    if (li->rank == 0) {
        if (!li->shm_name[0]) launch_new_shm_name(li->shm_name, sizeof li->shm_name);
        memcpy(payload, li->shm_name, sizeof li->shm_name);
        if (nccl_id) memcpy(payload + SHM_PAYLOAD, nccl_id, LAUNCH_NCCL_ID_BYTES);
    }
    RendezvousConfig cfg = {.rank = li->rank,
                            .world_size = li->world_size,
                            .master_addr = li->master_addr,
                            .port = li->master_port,
                            .listen_fd = li->rendezvous_fd,
                            .timeout_ms = (int)(timeout_s * 1000)};
    int rc = rendezvous_run(&cfg, payload, len, err);
    if (li->rendezvous_fd >= 0) {
        close(li->rendezvous_fd);
        li->rendezvous_fd = -1;
    }
    if (rc || li->rank == 0) return rc;
    if (payload[0] != '/' || !memchr(payload, 0, SHM_PAYLOAD))
        return err_set(err, "rendezvous: rank 0 sent no valid shm segment name");
    memcpy(li->shm_name, payload, sizeof li->shm_name);
    if (nccl_id) memcpy(nccl_id, payload + SHM_PAYLOAD, LAUNCH_NCCL_ID_BYTES);
    return 0;
}

// ---------------------------------------------------------------- local launcher

// Variables the parent sets for its ranks; inherited values of these are dropped.
static const char *const RANK_ENV[] = {"RANK",
                                       "WORLD_SIZE",
                                       "LOCAL_RANK",
                                       "LOCAL_WORLD_SIZE",
                                       "MASTER_ADDR",
                                       "MASTER_PORT",
                                       "ASTRAI_LAUNCHED",
                                       "ASTRAI_SHM_NAME",
                                       "ASTRAI_LAUNCHER_PID",
                                       "ASTRAI_RENDEZVOUS_FD",
                                       "ASTRAI_RENDEZVOUS_PORT",
                                       "TORCHELASTIC_USE_AGENT_STORE",
                                       NULL};
#define RANK_ENV_SET 10 // the first ten are set (the fd only for rank 0)

static int is_rank_env(const char *entry) {
    for (const char *const *v = RANK_ENV; *v; v++) {
        size_t n = strlen(*v);
        if (!strncmp(entry, *v, n) && entry[n] == '=') return 1;
    }
    return 0;
}

void launch_free_env(char **env) {
    if (!env) return;
    for (char **e = env; *e; e++)
        free(*e);
    free(env);
}

// Appends one formatted entry; on failure the slot stays NULL (the end for launch_free_env).
static int env_add(char **env, size_t *k, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = vasprintf(&env[*k], fmt, ap);
    va_end(ap);
    if (rc < 0) {
        env[*k] = NULL;
        return -1;
    }
    (*k)++;
    return 0;
}

// 1 if entry ("NAME=value") sets one of the variables of extra (NULL-terminated, may be NULL).
static int overridden(const char *entry, const char *const *extra) {
    for (; extra && *extra; extra++) {
        const char *eq = strchr(*extra, '=');
        size_t n = eq ? (size_t)(eq - *extra) : strlen(*extra);
        if (!strncmp(entry, *extra, n) && entry[n] == '=') return 1;
    }
    return 0;
}

// The address rank 0 of a local launch listens on and the other ranks connect to.
static const char *local_master(const LaunchInfo *li) {
    return li->master_addr[0] ? li->master_addr : "127.0.0.1";
}

char **launch_rank_env(const LaunchInfo *li, int rank, int port, int listen_fd,
                       const char *const *extra) {
    size_t n = 0, k = 0, n_extra = 0;
    while (environ[n])
        n++;
    while (extra && extra[n_extra])
        n_extra++;
    char **env = calloc(n + RANK_ENV_SET + n_extra + 1, sizeof *env);
    if (!env) return NULL;
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++)
        if (!is_rank_env(environ[i]) && !overridden(environ[i], extra))
            rc = env_add(env, &k, "%s", environ[i]);
    for (size_t i = 0; i < n_extra && !rc; i++)
        rc = env_add(env, &k, "%s", extra[i]);
    if (rc || env_add(env, &k, "RANK=%d", rank) ||
        env_add(env, &k, "WORLD_SIZE=%d", li->world_size) ||
        env_add(env, &k, "LOCAL_RANK=%d", rank) ||
        env_add(env, &k, "LOCAL_WORLD_SIZE=%d", li->world_size) ||
        env_add(env, &k, "MASTER_ADDR=%s", local_master(li)) ||
        env_add(env, &k, "MASTER_PORT=%d", port) || env_add(env, &k, "ASTRAI_LAUNCHED=1") ||
        env_add(env, &k, "ASTRAI_SHM_NAME=%s", li->shm_name) ||
        env_add(env, &k, "ASTRAI_LAUNCHER_PID=%d", (int)getpid()) ||
        (rank == 0 && env_add(env, &k, "ASTRAI_RENDEZVOUS_FD=%d", listen_fd))) {
        launch_free_env(env);
        return NULL;
    }
    return env;
}

typedef struct {
    pid_t pid;
    int running;
} RankProc;

typedef struct {
    RankProc *ranks;
    int n, running;
    int first_rank, first_code; // the first rank that failed, and its exit code
    int interrupted;            // a rank exited EXIT_INTERRUPTED (stopped after its checkpoint)
    int stopping, killed;
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

static int spawn_rank(Supervisor *s, const LaunchInfo *li, int rank, char **argv, int port,
                      int listen_fd, Err *err) {
    char **env = launch_rank_env(li, rank, port, listen_fd, NULL);
    if (!env) return err_set(err, "cannot start rank %d: out of memory", rank);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) exec_rank(argv, env, rank == 0 ? listen_fd : -1, parent);
    int fork_errno = errno;
    launch_free_env(env);
    if (pid < 0) return err_set(err, "cannot start rank %d: fork: %s", rank, strerror(fork_errno));
    setpgid(pid, pid); // also here, so the group exists before we might signal it
    s->ranks[rank] = (RankProc){.pid = pid, .running = 1};
    s->n = rank + 1;
    s->running++;
    return 0;
}

static void signal_ranks(const Supervisor *s, int sig) {
    for (int i = 0; i < s->n; i++)
        if (s->ranks[i].running) kill(-s->ranks[i].pid, sig); // the whole process group of the rank
}

static void start_stop(Supervisor *s, int sig) {
    s->stopping = 1;
    s->deadline = clock_mono_ms() + (int64_t)(s->grace_s * 1000);
    signal_ranks(s, sig);
}

// after_grace: the ranks had their grace period (else the user asked twice).
static void kill_ranks(Supervisor *s, int after_grace) {
    for (int i = 0; i < s->n && after_grace; i++)
        if (s->ranks[i].running)
            fprintf(stderr, "astrai-train: rank %d (pid %d) did not stop within %g s; SIGKILL\n", i,
                    (int)s->ranks[i].pid, s->grace_s);
    s->killed = 1;
    s->deadline = clock_mono_ms() + KILL_WAIT_MS;
    signal_ranks(s, SIGKILL);
}

static void report_failure(const Supervisor *s, int rank, int status) {
    char how[96];
    if (WIFSIGNALED(status))
        snprintf(how, sizeof how, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(how, sizeof how, "exited with code %d%s", WEXITSTATUS(status),
                 WEXITSTATUS(status) == EXIT_INTERRUPTED ? " (interrupted after its checkpoint)"
                                                         : "");
    fprintf(stderr, "astrai-train: rank %d (pid %d) %s; stopping the other %d rank(s)\n", rank,
            (int)s->ranks[rank].pid, how, s->running);
}

static void on_rank_exit(Supervisor *s, int rank, int status) {
    s->ranks[rank].running = 0;
    s->running--;
    int code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
    // An interrupted rank is not a failure, but its job is stopping: the others stop too (they
    // agreed on the same step and are on their way out). A failure stays the root cause.
    int interrupted = code == EXIT_INTERRUPTED;
    s->interrupted |= interrupted;
    if (code == 0 || (!interrupted && s->first_rank >= 0)) return;
    if (!interrupted) {
        s->first_rank = rank;
        s->first_code = code;
    }
    if (s->stopping) return; // the ranks were already told to stop: not a failure of its own
    report_failure(s, rank, status);
    start_stop(s, SIGTERM);
}

static void reap(Supervisor *s) {
    for (int i = 0; i < s->n; i++) {
        if (!s->ranks[i].running) continue;
        int status;
        pid_t r = waitpid(s->ranks[i].pid, &status, WNOHANG);
        if (r == s->ranks[i].pid)
            on_rank_exit(s, i, status);
        else if (r < 0 && errno == ECHILD) // reaped behind our back: gone, its code lost
            on_rank_exit(s, i, W_EXITCODE(1, 0));
    }
}

static void on_stop_signal(Supervisor *s, int sig) {
    const char *name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    if (s->stopping && !s->killed) { // asked twice: no more waiting
        fprintf(stderr, "astrai-train: %s again; killing the ranks\n", name);
        kill_ranks(s, 0);
    } else if (!s->stopping) {
        fprintf(stderr, "astrai-train: got %s; forwarding it to %d rank(s)\n", name, s->running);
        start_stop(s, sig);
    }
}

// Gives up on ranks that survive even SIGKILL (stuck in the kernel): never wait unbounded.
static void abandon_ranks(Supervisor *s) {
    for (int i = 0; i < s->n; i++)
        if (s->ranks[i].running)
            fprintf(stderr, "astrai-train: rank %d (pid %d) is still alive after SIGKILL\n", i,
                    (int)s->ranks[i].pid);
    if (s->first_rank < 0) s->first_code = 128 + SIGKILL;
    s->running = 0;
}

static void supervise(Supervisor *s, const sigset_t *watched) {
    while (s->running > 0) {
        struct timespec ts, *timeout = NULL;
        if (s->stopping) {
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
            signal_ranks(s, SIGUSR1); // checkpoint request: every rank takes part
        else if (sig < 0 && errno == EAGAIN && !s->killed)
            kill_ranks(s, 1);
        else if (sig < 0 && errno == EAGAIN)
            abandon_ranks(s);
    }
}

void launch_remove_shm(const char *name) {
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    size_t n = strlen(name + 1);
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, name + 1, n)) continue;
        char path[NAME_MAX + 2];
        snprintf(path, sizeof path, "/%s", e->d_name);
        shm_unlink(path);
    }
    closedir(d);
}

// The parent binds the rendezvous socket before any rank exists, so a port in use fails
// the launch at once; rank 0 inherits the socket and serves the meeting on it.
static int spawn_all(Supervisor *s, const LaunchInfo *li, char **argv, Err *err) {
    int fd, port;
    if (rendezvous_listen_on(local_master(li), li->master_port, &fd, &port, err)) return -1;
    int rc = 0;
    for (int r = 0; r < li->world_size && !rc; r++)
        rc = spawn_rank(s, li, r, argv, port, fd, err);
    close(fd); // rank 0 has its own copy
    return rc;
}

int launch_local(const LaunchInfo *li, char **argv, Err *err) {
    Supervisor s = {.first_rank = -1};
    if (env_seconds("ASTRAI_STOP_GRACE_S", DEFAULT_STOP_GRACE_S, &s.grace_s, err)) return -1;
    s.ranks = calloc((size_t)li->world_size, sizeof *s.ranks);
    if (!s.ranks) return err_set(err, "out of memory for %d ranks", li->world_size);
    LaunchInfo job = *li;
    launch_new_shm_name(job.shm_name, sizeof job.shm_name);
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
    if (rc && s.n > 0) // some ranks started: stop them before reporting
        start_stop(&s, SIGTERM);
    supervise(&s, &watched);
    launch_remove_shm(job.shm_name);
    sigprocmask(SIG_SETMASK, &old, NULL);
    free(s.ranks);
    if (rc) return -1;
    return s.first_code ? s.first_code : s.interrupted ? EXIT_INTERRUPTED : 0;
}
