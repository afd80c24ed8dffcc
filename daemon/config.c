// config.c: astraid's options (each a --flag and a key of the JSON config file) and the
// config file's parser, apart from main.c so that it runs on its own (tests/fuzz/).
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/fsutil.h"
#include "common/json.h"
#include "daemon/daemon.h"

const ConfigOption CONFIG_OPTIONS[] = {
    {"socket", OPT_STR, offsetof(Config, socket_path), 0, 0, "unix control socket"},
    {"state-dir", OPT_STR, offsetof(Config, state_dir), 0, 0, "database and job run directories"},
    {"tcp", OPT_STR, offsetof(Config, tcp), 0, 0, "HOST:PORT to listen on (off by default)"},
    {"token-file", OPT_STR, offsetof(Config, token_file), 0, 0,
     "bearer token for tcp and http (mode 0600)"},
    {"admin-group", OPT_STR, offsetof(Config, admin_group), 0, 0,
     "group whose members may pause/resume/checkpoint/cancel/rm any user's job"},
    {"http", OPT_STR, offsetof(Config, http), 0, 0,
     "HOST:PORT of the HTTP listener: web page, /metrics, /api (off by default)"},
    {"devices", OPT_STR, offsetof(Config, devices), 0, 0, "N | cpu:N | cuda:0,1,..."},
    {"train-binary", OPT_STR, offsetof(Config, train_binary), 0, 0, "astrai-train to run"},
    {"log-level", OPT_STR, offsetof(Config, log_level), 0, 0, "error | warn | info | debug"},
    {"max-restarts", OPT_LONG, offsetof(Config, max_restarts), 0, 1000,
     "restarts of a failed run (job default)"},
    {"stop-timeout", OPT_DOUBLE, offsetof(Config, stop_timeout), 0, 86400,
     "seconds ranks get to checkpoint and exit"},
    {"max-connections", OPT_LONG, offsetof(Config, max_connections), 1, 100000,
     "open unix and authenticated tcp connections at once"},
    {"max-unauthenticated", OPT_LONG, offsetof(Config, max_unauthenticated), 1, 100000,
     "tcp connections not authenticated yet, at once"},
    {"auth-timeout", OPT_DOUBLE, offsetof(Config, auth_timeout), 0.01, 3600,
     "seconds a tcp connection gets to authenticate"},
    {"poll-interval", OPT_DOUBLE, offsetof(Config, poll_interval), 0.01, 60,
     "seconds between progress reads"},
    {"keep-finished", OPT_STR, offsetof(Config, keep_finished), 0, 0,
     "keep the N newest finished jobs (N), or those of the last D days (Dd)"},
    {"executor", OPT_STR, offsetof(Config, executor), 0, 0, "local | slurm"},
    {"shared-dir", OPT_STR, offsetof(Config, shared_dir), 0, 0,
     "the jobs' run directories, seen by every node (default: state-dir)"},
    {"slurm-partition", OPT_STR, offsetof(Config, slurm_partition), 0, 0, "sbatch --partition"},
    {"slurm-account", OPT_STR, offsetof(Config, slurm_account), 0, 0, "sbatch --account"},
    {"slurm-time", OPT_STR, offsetof(Config, slurm_time), 0, 0, "sbatch --time of a job"},
    {"slurm-sbatch-args", OPT_STR, offsetof(Config, slurm_sbatch_args), 0, 0,
     "more sbatch arguments, split as sh would (quotes, backslashes)"},
    {"slurm-nodes", OPT_LONG, offsetof(Config, slurm_nodes), 1, 4096,
     "nodes of a CPU job that does not say (default 1)"},
    {"slurm-gpus-per-node", OPT_LONG, offsetof(Config, slurm_gpus_per_node), 0, 4096,
     "GPUs per node of a job that does not say (0: CPU tasks)"},
    {"notify-command", OPT_STR, offsetof(Config, notify_command), 0, 0,
     "program run on job events (words as sh splits them, no shell): EVENT argument, JOB on stdin"},
    {"notify-timeout", OPT_DOUBLE, offsetof(Config, notify_timeout), 0.1, 3600,
     "seconds a notify-command gets before SIGKILL (default 10)"},
    {"gdb", OPT_STR, offsetof(Config, gdb), 0, 0,
     "gdb that records a hung run's stacks (default gdb on PATH; none: /proc only)"},
};
const size_t CONFIG_N_OPTIONS = sizeof CONFIG_OPTIONS / sizeof *CONFIG_OPTIONS;

const ConfigOption *config_option(const char *name) {
    char norm[64];
    snprintf(norm, sizeof norm, "%s", name);
    for (char *p = norm; *p; p++)
        if (*p == '_') *p = '-';
    for (size_t i = 0; i < CONFIG_N_OPTIONS; i++)
        if (!strcmp(norm, CONFIG_OPTIONS[i].name)) return &CONFIG_OPTIONS[i];
    return NULL;
}

int config_set(Config *c, const ConfigOption *o, const char *value, Err *err) {
    void *field = (char *)c + o->offset;
    if (o->type == OPT_STR) {
        char **s = field, *copy = strdup(value);
        if (!copy) return err_resource(err, "%s: out of memory", o->name);
        free(*s);
        *s = copy;
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

int config_apply_json(Config *c, const char *text, size_t len, const char *path, Err *err) {
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (!root && len && json_out_of_memory()) return err_resource(err, "%s: out of memory", path);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return err_set(err, "%s: not a JSON object", path);
    }
    // A key "socket\u0000x" would be "socket" to cJSON's C strings.
    if (json_text_check(text, len, err)) {
        cJSON_Delete(root);
        return err_prefix(err, "%s", path);
    }
    int rc = 0;
    for (cJSON *kv = root->child; kv && !rc; kv = kv->next) {
        const ConfigOption *o = config_option(kv->string);
        char num[64];
        if (!o)
            rc = err_set(err, "unknown key '%s'", kv->string);
        else if (cJSON_IsString(kv))
            rc = config_set(c, o, kv->valuestring, err);
        else if (cJSON_IsNumber(kv) && o->type != OPT_STR) {
            snprintf(num, sizeof num, "%.17g", kv->valuedouble);
            rc = config_set(c, o, num, err);
        } else
            rc = err_set(err, "key '%s' expects a %s", kv->string,
                         o->type == OPT_STR ? "string" : "number");
        if (rc) err_prefix(err, "%s", path);
    }
    cJSON_Delete(root);
    return rc;
}

int config_apply_file(Config *c, const char *path, Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(path, &text, &len, err)) return -1;
    int rc = config_apply_json(c, text, len, path, err);
    free(text);
    return rc;
}

void config_free(Config *c) {
    for (size_t i = 0; i < CONFIG_N_OPTIONS; i++)
        if (CONFIG_OPTIONS[i].type == OPT_STR)
            free(*(char **)((char *)c + CONFIG_OPTIONS[i].offset));
}
