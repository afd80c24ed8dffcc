// main.c: astraid's main(): flags and config file and startup (the daemon's
// subsystems are daemon/*.c, daemon/daemon.h).
//
// Every flag is also a key of the JSON config file (`--config FILE`, default
// /etc/astraid/astraid.json when it exists): {"socket": "/run/astraid/astraid.sock",
// "max-restarts": 3, ...} (underscores work too: "max_restarts"). Flags win. The
// options and the file's parser are in config.c.
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/flags.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "common/path.h"
#include "common/socket_path.h"
#include "daemon/daemon.h"
#include "ranks/ranks.h"

#define DEFAULT_CONFIG "/etc/astraid/astraid.json"

// Flags: every option of the config file, then --config, --version, --help. Two passes
// over the command line: the config file first, then the other flags (they win).
typedef struct {
    Flag *flags;
    size_t n;
    int config_pass;
} FlagTable;

static FlagTable flag_table;

static int set_option(const Flag *f, const char *value, Err *err) {
    return flag_table.config_pass ? 0 : config_set(f->target, f->data, value, err);
}

static int apply_config_file(const Flag *f, const char *value, Err *err) {
    return flag_table.config_pass ? config_apply_file(f->target, value, err) : 0;
}

static int make_flag_table(Config *c, Err *err) {
    static bool ignored; // --version and --help are handled before the config
    flag_table.n = CONFIG_N_OPTIONS + 3;
    Flag *f = flag_table.flags = calloc(flag_table.n, sizeof *f);
    if (!f) return err_resource(err, "out of memory for the flag table");
    for (size_t i = 0; i < CONFIG_N_OPTIONS; i++)
        f[i] = (Flag){.name = CONFIG_OPTIONS[i].name,
                      .kind = FLAG_PARSED,
                      .target = c,
                      .parse = set_option,
                      .data = &CONFIG_OPTIONS[i],
                      .help = CONFIG_OPTIONS[i].help};
    f[CONFIG_N_OPTIONS] = (Flag){.name = "config",
                                 .kind = FLAG_PARSED,
                                 .target = c,
                                 .parse = apply_config_file,
                                 .value_name = "FILE",
                                 .help = "JSON config file"};
    f[CONFIG_N_OPTIONS + 1] = (Flag){
        .name = "version", .kind = FLAG_SWITCH, .target = &ignored, .help = "print the version"};
    f[CONFIG_N_OPTIONS + 2] =
        (Flag){.name = "help", .kind = FLAG_SWITCH, .target = &ignored, .short_name = 'h'};
    return 0;
}

static void usage(void) {
    printf("usage: astraid [--config FILE] [--flag=VALUE ...]\n\n"
           "The astrai training service: runs astrai-train jobs submitted with astraictl.\n"
           "Every flag is also a key of the JSON config file (default " DEFAULT_CONFIG ").\n\n");
    Err err = {0};
    Config unused = {0};
    if (make_flag_table(&unused, &err) == 0) flags_usage(stdout, flag_table.flags, flag_table.n);
    free(flag_table.flags);
}

static int parse_flags(int argc, char **argv, int config_pass, Err *err) {
    flag_table.config_pass = config_pass;
    return flags_parse(flag_table.flags, flag_table.n, argc - 1, argv + 1, NULL, err);
}

static const char *env_dir(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

// $STATE_DIRECTORY (systemd), /var/lib/astraid as root, else ~/.local/state/astraid.
static char *default_state_dir(void) {
    char buf[PATH_MAX];
    if (env_dir("STATE_DIRECTORY"))
        snprintf(buf, sizeof buf, "%s", env_dir("STATE_DIRECTORY"));
    else if (geteuid() == 0)
        snprintf(buf, sizeof buf, "/var/lib/astraid");
    else if (env_dir("XDG_STATE_HOME"))
        snprintf(buf, sizeof buf, "%s/astraid", env_dir("XDG_STATE_HOME"));
    else
        snprintf(buf, sizeof buf, "%s/.local/state/astraid",
                 env_dir("HOME") ? env_dir("HOME") : "/tmp");
    return strdup(buf);
}

static char *default_train_binary(void) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return strdup("astrai-train");
    self[n] = 0;
    char *slash = strrchr(self, '/');
    char out[PATH_MAX + 16];
    snprintf(out, sizeof out, "%.*s/astrai-train", (int)(slash - self), self);
    return strdup(out);
}

static int fill_defaults(Config *c, Err *err) {
    char path[PATH_MAX];
    if (!c->socket_path) { // where astraictl looks too
        if (socket_default_path(path, sizeof path, err)) return -1;
        c->socket_path = strdup(path);
    }
    if (!c->state_dir) c->state_dir = default_state_dir();
    if (!c->train_binary) c->train_binary = default_train_binary();
    if (!c->log_level) c->log_level = strdup("info");
    if (!c->executor) c->executor = strdup("local");
    if (!c->shared_dir && c->state_dir) c->shared_dir = strdup(c->state_dir);
    if (!c->socket_path || !c->state_dir || !c->train_binary || !c->log_level || !c->executor ||
        !c->shared_dir)
        return err_resource(err, "out of memory for the configuration's defaults");
    return 0;
}

static int check_config(const Config *c, Err *err) {
    if (access(c->train_binary, X_OK))
        return err_set(err, "train-binary: %s is not an executable file", c->train_binary);
    if (c->tcp && !c->token_file)
        return err_set(err, "tcp: --tcp %s needs --token-file (clients authenticate with it)",
                       c->tcp);
    struct stat st;
    if (c->token_file && stat(c->token_file, &st))
        return err_set(err, "token-file: %s: %s", c->token_file, strerror(errno));
    if (c->token_file && (st.st_mode & 077))
        return err_set(err, "token-file: %s has mode %04o; it must be 0600 (chmod 600 %s)",
                       c->token_file, (unsigned)(st.st_mode & 07777), c->token_file);
    if (http_check_config(c, err) || retention_configure(c->keep_finished, err)) return -1;
    if (strcmp(c->executor, "local") && strcmp(c->executor, "slurm"))
        return err_set(err, "executor: '%s' is not local or slurm", c->executor);
    if (c->shared_dir[0] != '/')
        return err_set(err, "shared-dir: '%s' is not an absolute path", c->shared_dir);
    if (slurm_check_config(c, err) || notify_check_config(c, err)) return -1;
    return log_set_level(c->log_level, err);
}

static int load_config(Config *c, int argc, char **argv, Err *err) {
    *c = (Config){.max_restarts = 3,
                  .stop_timeout = RANKS_STOP_GRACE_S,
                  .max_connections = 256,
                  .poll_interval = 0.5,
                  .max_unauthenticated = 64,
                  .auth_timeout = 10,
                  .notify_timeout = 10,
                  .slurm_nodes = 1};
    int has_config = 0;
    for (int i = 1; i < argc; i++)
        has_config |= !strncmp(argv[i], "--config", 8);
    if (!has_config && access(DEFAULT_CONFIG, F_OK) == 0 &&
        config_apply_file(c, DEFAULT_CONFIG, err))
        return -1;
    if (make_flag_table(c, err)) return -1;
    int rc = parse_flags(argc, argv, 1, err) || parse_flags(argc, argv, 0, err);
    free(flag_table.flags);
    if (rc) return -1;
    if (fill_defaults(c, err) || check_config(c, err)) return -1;
    astraid.site = !strcmp(c->executor, "slurm") ? &SLURM_SITE : &LOCAL_SITE;
    return 0;
}

// ---------------------------------------------------------------- startup

// The devices jobs run on: those --devices names (a bad value, or GPUs NVML does not find,
// is bad input: exit 2), else the GPUs NVML finds or one CPU slot per core.
static int open_devices(Err *err) {
    gpu_init(); // before devices_init: without --devices the GPUs are NVML's
    return devices_init(&astraid.devices, astraid.cfg.devices, err);
}

// One astraid per state directory (two would run the same jobs into one ckpt_dir): an
// exclusive flock on state_dir/astraid.lock, held by the open descriptor for the daemon's
// life (close-on-exec: no rank inherits it), with our pid in it for the next one's error.
static int lock_state_dir(Err *err) {
    char path[PATH_MAX], pid[32];
    if (path_join(path, sizeof path, astraid.cfg.state_dir, "astraid.lock", err)) return -1;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return err_errno(err, errno, "%s: cannot open", path);
    if (flock(fd, LOCK_EX | LOCK_NB)) {
        int e = errno;
        ssize_t n = e == EWOULDBLOCK ? pread(fd, pid, sizeof pid - 1, 0) : -1;
        close(fd);
        if (n < 0) return err_errno(err, e, "%s: cannot lock", path);
        pid[n] = 0;
        pid[strcspn(pid, "\n")] = 0;
        return err_set(err, "state dir %s is in use by astraid pid %s", astraid.cfg.state_dir,
                       *pid ? pid : "(not yet written)");
    }
    int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) || pwrite(fd, pid, (size_t)n, 0) != n) {
        int e = errno;
        close(fd);
        return err_errno(err, e, "%s: cannot write", path);
    }
    return 0;
}

static int start(Err *err) {
    // The listeners of job changes (recovery's included), in the order they hear of one: the
    // HTTP snapshot, the watchers, notify_command, the retention, the queue.
    JobListener listeners[] = {http_on_job, server_on_job, notify_on_job, retention_on_job,
                               scheduler_on_job};
    for (size_t i = 0; i < sizeof listeners / sizeof *listeners; i++)
        if (jobs_listen(listeners[i], err)) return -1;
    char jobs_dir[PATH_MAX];
    snprintf(jobs_dir, sizeof jobs_dir, "%s/jobs", astraid.cfg.shared_dir);
    if (fs_mkdir_p(astraid.cfg.state_dir, err) || fs_mkdir_p(jobs_dir, err) ||
        lock_state_dir(err) || state_open(astraid.cfg.state_dir, err) || state_recover(err) ||
        jobs_init_ids(err))
        return -1;
    retention_apply();
    if (server_start(err) || http_start(err)) return -1;
    daemon_watch_signals();
    progress_reader_start();
    job_watch_start();
    if (astraid.site->init) astraid.site->init();
    scheduler_kick();
    return 0;
}

int main(int argc, char **argv) {
    json_init();
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage();
            return 0;
        }
        if (!strcmp(argv[i], "--version")) {
            printf("astraid %s\n", ASTRAID_VERSION);
            return 0;
        }
    }
    signal(SIGPIPE, SIG_IGN); // a vanished client is an error return, never a signal
    sd_init();
    Err err = {0};
    astraid.loop = uv_default_loop();
    if (!astraid.loop) { // libuv could not allocate it
        fprintf(stderr, "astraid: out of memory for the event loop\n");
        return 1;
    }
    astraid.started_at = clock_mono_s();
    int rc = load_config(&astraid.cfg, argc, argv, &err) ? err_exit_status(&err)
             : open_devices(&err)                        ? err_exit_status(&err)
             : start(&err)                               ? 1
                                                         : 0;
    if (rc) {
        fprintf(stderr, "astraid: %s\n", err.msg);
        systemd_notify("STATUS=failed: %s", err.msg);
        daemon_close_all();
    } else {
        log_info("ready: socket %s, state %s, %d %s device(s), train binary %s",
                 astraid.cfg.socket_path, astraid.cfg.state_dir, astraid.devices.n,
                 astraid.devices.gpu ? "cuda" : "cpu", astraid.cfg.train_binary);
        systemd_notify("READY=1\nSTATUS=serving on %s", astraid.cfg.socket_path);
    }
    uv_run(astraid.loop, UV_RUN_DEFAULT);
    helpers_free();
    uv_loop_close(astraid.loop);
    slurm_free();
    jobs_free_all();
    state_close();
    devices_free(&astraid.devices);
    gpu_free();
    config_free(&astraid.cfg);
    return rc;
}
