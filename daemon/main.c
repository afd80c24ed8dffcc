// main.c: astraid's flags and config file, startup and shutdown.
//
// Every flag is also a key of the JSON config file (`--config FILE`, default
// /etc/astraid/astraid.json when it exists): {"socket": "/run/astraid/astraid.sock",
// "max-restarts": 3, ...} (underscores work too: "max_restarts"). Flags win.
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/fsutil.h"
#include "daemon/daemon.h"

#define DEFAULT_CONFIG "/etc/astraid/astraid.json"

Astraid astraid;

double now_wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

// ---------------------------------------------------------------- options

typedef enum { OPT_STR, OPT_LONG, OPT_DOUBLE } OptType;

typedef struct {
    const char *name;
    OptType type;
    size_t offset;
    double lo, hi;
    const char *help;
} Option;

static const Option OPTIONS[] = {
    {"socket", OPT_STR, offsetof(Config, socket_path), 0, 0, "unix control socket"},
    {"state-dir", OPT_STR, offsetof(Config, state_dir), 0, 0, "database and job run directories"},
    {"tcp", OPT_STR, offsetof(Config, tcp), 0, 0, "HOST:PORT to listen on (off by default)"},
    {"token-file", OPT_STR, offsetof(Config, token_file), 0, 0, "bearer token for tcp (mode 0600)"},
    {"devices", OPT_STR, offsetof(Config, devices), 0, 0, "N | cpu:N | cuda:0,1,..."},
    {"train-binary", OPT_STR, offsetof(Config, train_binary), 0, 0, "astrai-train to run"},
    {"log-level", OPT_STR, offsetof(Config, log_level), 0, 0, "error | warn | info | debug"},
    {"max-restarts", OPT_LONG, offsetof(Config, max_restarts), 0, 1000,
     "restarts of a failed run (job default)"},
    {"stop-timeout", OPT_DOUBLE, offsetof(Config, stop_timeout), 0, 86400,
     "seconds ranks get to checkpoint and exit"},
    {"max-connections", OPT_LONG, offsetof(Config, max_connections), 1, 100000,
     "open connections at once"},
    {"poll-interval", OPT_DOUBLE, offsetof(Config, poll_interval), 0.01, 60,
     "seconds between progress reads"},
};
#define N_OPTIONS (sizeof OPTIONS / sizeof *OPTIONS)

static const Option *find_option(const char *name) {
    char norm[64];
    snprintf(norm, sizeof norm, "%s", name);
    for (char *p = norm; *p; p++)
        if (*p == '_') *p = '-';
    for (size_t i = 0; i < N_OPTIONS; i++)
        if (!strcmp(norm, OPTIONS[i].name)) return &OPTIONS[i];
    return NULL;
}

static int set_option(Config *c, const Option *o, const char *value, Err *err) {
    void *field = (char *)c + o->offset;
    if (o->type == OPT_STR) {
        char **s = field;
        free(*s);
        *s = strdup(value);
        return 0;
    }
    char *end;
    errno = 0;
    double x = strtod(value, &end);
    if (end == value || *end || errno || !isfinite(x) || x < o->lo || x > o->hi ||
        (o->type == OPT_LONG && x != floor(x)))
        return err_set(err, "%s: '%s' is not %s in [%g, %g]", o->name, value,
                       o->type == OPT_LONG ? "an integer" : "a number", o->lo, o->hi);
    if (o->type == OPT_LONG)
        *(long *)field = (long)x;
    else
        *(double *)field = x;
    return 0;
}

static int apply_config_file(Config *c, const char *path, Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(path, &text, &len, err)) return -1;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return err_set(err, "%s: not a JSON object", path);
    }
    int rc = 0;
    for (cJSON *kv = root->child; kv && !rc; kv = kv->next) {
        const Option *o = find_option(kv->string);
        char num[64];
        if (!o)
            rc = err_set(err, "%s: unknown key '%s'", path, kv->string);
        else if (cJSON_IsString(kv))
            rc = set_option(c, o, kv->valuestring, err);
        else if (cJSON_IsNumber(kv) && o->type != OPT_STR) {
            snprintf(num, sizeof num, "%.17g", kv->valuedouble);
            rc = set_option(c, o, num, err);
        } else
            rc = err_set(err, "%s: key '%s' expects a %s", path, kv->string,
                         o->type == OPT_STR ? "string" : "number");
        if (rc && o) err_prefix(err, "%s", path);
    }
    cJSON_Delete(root);
    return rc;
}

static void usage(void) {
    printf("usage: astraid [--config FILE] [--flag=VALUE ...]\n\n"
           "The astrai training service: runs astrai-train jobs submitted with astraictl.\n"
           "Every flag is also a key of the JSON config file (default " DEFAULT_CONFIG ").\n\n");
    for (size_t i = 0; i < N_OPTIONS; i++)
        printf("  --%-16s %s\n", OPTIONS[i].name, OPTIONS[i].help);
    printf("  --%-16s %s\n  --%-16s %s\n", "config", "JSON config file", "version",
           "print the version");
}

// "--name=value" or "--name value"; *value NULL when missing.
static const char *flag_value(int argc, char **argv, int *i, char *name, size_t cap) {
    const char *a = argv[*i] + 2, *eq = strchr(a, '=');
    size_t n = eq ? (size_t)(eq - a) : strlen(a);
    snprintf(name, cap, "%.*s", (int)n, a);
    if (eq) return eq + 1;
    return *i + 1 < argc ? argv[++*i] : NULL;
}

static int parse_flags(Config *c, int argc, char **argv, int config_pass, Err *err) {
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--", 2))
            return err_set(err, "unexpected argument '%s' (flags are --name=value)", argv[i]);
        char name[64];
        const char *value = flag_value(argc, argv, &i, name, sizeof name);
        const Option *o = find_option(name);
        if (!o && strcmp(name, "config")) return err_set(err, "unknown flag --%s", name);
        if (!value) return err_set(err, "--%s needs a value", name);
        if (config_pass && !o && apply_config_file(c, value, err)) return -1;
        if (!config_pass && o && set_option(c, o, value, err)) return -1;
    }
    return 0;
}

static const char *env_dir(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

// $RUNTIME_DIRECTORY (systemd), /run/astraid as root, else under $XDG_RUNTIME_DIR.
static char *default_socket(void) {
    char buf[PATH_MAX];
    if (env_dir("RUNTIME_DIRECTORY"))
        snprintf(buf, sizeof buf, "%s/astraid.sock", env_dir("RUNTIME_DIRECTORY"));
    else if (geteuid() == 0)
        snprintf(buf, sizeof buf, "/run/astraid/astraid.sock");
    else if (env_dir("XDG_RUNTIME_DIR"))
        snprintf(buf, sizeof buf, "%s/astraid/astraid.sock", env_dir("XDG_RUNTIME_DIR"));
    else
        snprintf(buf, sizeof buf, "/tmp/astraid-%u/astraid.sock", (unsigned)geteuid());
    return strdup(buf);
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

static void fill_defaults(Config *c) {
    if (!c->socket_path) c->socket_path = default_socket();
    if (!c->state_dir) c->state_dir = default_state_dir();
    if (!c->train_binary) c->train_binary = default_train_binary();
    if (!c->log_level) c->log_level = strdup("info");
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
    return log_set_level(c->log_level, err);
}

static int load_config(Config *c, int argc, char **argv, Err *err) {
    *c = (Config){
        .max_restarts = 3, .stop_timeout = 60, .max_connections = 256, .poll_interval = 0.5};
    int has_config = 0;
    for (int i = 1; i < argc; i++)
        has_config |= !strncmp(argv[i], "--config", 8);
    if (!has_config && access(DEFAULT_CONFIG, F_OK) == 0 &&
        apply_config_file(c, DEFAULT_CONFIG, err))
        return -1;
    if (parse_flags(c, argc, argv, 1, err) || parse_flags(c, argc, argv, 0, err)) return -1;
    fill_defaults(c);
    return check_config(c, err);
}

static void config_free(Config *c) {
    for (size_t i = 0; i < N_OPTIONS; i++)
        if (OPTIONS[i].type == OPT_STR) free(*(char **)((char *)c + OPTIONS[i].offset));
}

// ---------------------------------------------------------------- shutdown

static uv_signal_t sig_term, sig_int;

static void close_handle(uv_handle_t *h, void *arg) {
    (void)arg;
    if (!uv_is_closing(h)) uv_close(h, NULL);
}

void daemon_maybe_finish(void) {
    if (!astraid.stopping || runner_alive()) return;
    log_info("every job is stopped; exiting");
    server_close_all();
    uv_walk(astraid.loop, close_handle, NULL); // timers, signals: uv_run then returns
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
        sd_notifyf("STOPPING=1\nSTATUS=stopping %d job(s)\nEXTEND_TIMEOUT_USEC=%llu", running,
                   (unsigned long long)((astraid.cfg.stop_timeout + 10) * 1e6));
        server_close_listeners();
    }
    for (Job *j = astraid.jobs; j; j = j->next)
        if (j->run) runner_stop(j, STOP_SHUTDOWN);
    daemon_maybe_finish();
}

// ---------------------------------------------------------------- startup

static int start(Err *err) {
    char jobs_dir[PATH_MAX];
    snprintf(jobs_dir, sizeof jobs_dir, "%s/jobs", astraid.cfg.state_dir);
    gpu_init(); // before devices_init: without --devices the GPUs are NVML's
    if (fs_mkdir_p(jobs_dir, err) || devices_init(&astraid.devices, astraid.cfg.devices, err) ||
        state_open(astraid.cfg.state_dir, err) || state_recover(err))
        return -1;
    astraid.next_id = state_max_job_id() + 1;
    if (server_start(err)) return -1;
    uv_signal_init(astraid.loop, &sig_term);
    uv_signal_init(astraid.loop, &sig_int);
    uv_signal_start(&sig_term, on_stop_signal, SIGTERM);
    uv_signal_start(&sig_int, on_stop_signal, SIGINT);
    progress_reader_start();
    scheduler_kick();
    return 0;
}

int main(int argc, char **argv) {
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
    astraid.started_at = now_wall();
    int rc = load_config(&astraid.cfg, argc, argv, &err) ? EXIT_BAD_INPUT : start(&err) ? 1 : 0;
    if (rc) {
        fprintf(stderr, "astraid: %s\n", err.msg);
        sd_notifyf("STATUS=failed: %s", err.msg);
        server_close_all();
        uv_walk(astraid.loop, close_handle, NULL);
    } else {
        log_info("ready: socket %s, state %s, %d %s device(s), train binary %s",
                 astraid.cfg.socket_path, astraid.cfg.state_dir, astraid.devices.n,
                 astraid.devices.gpu ? "cuda" : "cpu", astraid.cfg.train_binary);
        sd_notifyf("READY=1\nSTATUS=serving on %s", astraid.cfg.socket_path);
    }
    uv_run(astraid.loop, UV_RUN_DEFAULT);
    uv_loop_close(astraid.loop);
    jobs_free_all();
    state_close();
    devices_free(&astraid.devices);
    gpu_free();
    config_free(&astraid.cfg);
    return rc;
}
