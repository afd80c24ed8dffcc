// job_spec.c: the job spec validator (job_spec.h): training keys through
// proto/train_spec.c, job keys (name, devices, max_restarts, priority, nodes,
// gpus_per_node, hang_timeout_s, max_duration_hours) here.
#include "proto/job_spec.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NAME_MAX_LEN 128
#define MAX_DEVICES 4096

static const char *const JOB_KEYS[] = {
    "name",          "devices",        "max_restarts",       "priority", "nodes",
    "gpus_per_node", "hang_timeout_s", "max_duration_hours", NULL};

const char *const JOB_SPEC_PATH_KEYS[] = {
    "param_path", "data_root_path", "ckpt_dir", "sample_prompts",
    "tokenizer",  "chat_template",  NULL};

bool job_spec_value_is_path(const char *key, const char *value) {
    return *value && !(!strcmp(key, "tokenizer") && !strcmp(value, "bytes"));
}

static int is_job_key(const char *key) {
    for (const char *const *k = JOB_KEYS; *k; k++)
        if (!strcmp(*k, key)) return 1;
    return 0;
}

static size_t min3(size_t a, size_t b, size_t c) {
    size_t m = a < b ? a : b;
    return m < c ? m : c;
}

// Levenshtein distance, for suggesting a job key to a misspelt one.
static size_t edit_distance(const char *a, const char *b) {
    size_t n = strlen(b), row[64];
    if (n >= 64) return n;
    for (size_t j = 0; j <= n; j++)
        row[j] = j;
    for (size_t i = 1; a[i - 1]; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= n; j++) {
            size_t up = row[j];
            size_t sub = diag + (a[i - 1] != b[j - 1]);
            row[j] = min3(row[j] + 1, row[j - 1] + 1, sub);
            diag = up;
        }
    }
    return row[n];
}

// An unknown key one or two edits away from a job key is a misspelt job key (the
// training validator only knows the training keys).
static void suggest_job_key(const char *key, Err *err) {
    if (!err || strncmp(err->msg, "unknown key", 11)) return;
    for (const char *const *k = JOB_KEYS; *k; k++)
        if (edit_distance(key, *k) <= 2) {
            err_set(err, "unknown key '%s' (did you mean '%s'?)", key, *k);
            return;
        }
}

static int get_integer(const cJSON *v, const char *key, long lo, long hi, long *out, Err *err) {
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return err_set(err, "%s: expected an integer", key);
    if (v->valuedouble < (double)lo || v->valuedouble > (double)hi)
        return err_set(err, "%s: value %.17g is out of range [%ld, %ld]", key, v->valuedouble, lo,
                       hi);
    *out = (long)v->valuedouble;
    return 0;
}

// A number in [lo, hi] (fractions allowed).
static int get_number(const cJSON *v, const char *key, double lo, double hi, double *out,
                      Err *err) {
    if (!cJSON_IsNumber(v)) return err_set(err, "%s: expected a number", key);
    if (!(v->valuedouble >= lo && v->valuedouble <= hi))
        return err_set(err, "%s: value %.17g is out of range [%g, %g]", key, v->valuedouble, lo,
                       hi);
    *out = v->valuedouble;
    return 0;
}

static int parse_name(JobSpec *spec, const cJSON *v, Err *err) {
    if (!cJSON_IsString(v)) return err_set(err, "name: expected a string");
    size_t n = strlen(v->valuestring);
    if (n == 0 || n > NAME_MAX_LEN)
        return err_set(err, "name: length %zu is out of range [1, %d]", n, NAME_MAX_LEN);
    for (const unsigned char *c = (const unsigned char *)v->valuestring; *c; c++)
        if (*c < 0x20 || *c == 0x7F)
            return err_set(err, "name: control characters are not allowed");
    free(spec->name);
    spec->name = strdup(v->valuestring);
    return spec->name ? 0 : err_resource(err, "name: out of memory");
}

// Takes the n ids (malloc'd) as the job's devices after checking they are distinct.
static int set_device_ids(JobSpec *spec, long *ids, int n, Err *err) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (ids[j] == ids[i]) {
                err_set(err, "devices: device %ld is listed twice", ids[i]);
                free(ids);
                return -1;
            }
    free(spec->device_ids);
    spec->device_ids = ids;
    spec->n_devices = n;
    return 0;
}

static int parse_device_list(JobSpec *spec, const cJSON *v, Err *err) {
    int n = cJSON_GetArraySize(v);
    if (n < 1 || n > MAX_DEVICES)
        return err_set(err, "devices: a list needs 1 to %d device ids, got %d", MAX_DEVICES, n);
    long *ids = calloc((size_t)n, sizeof *ids);
    if (!ids) return err_resource(err, "devices: out of memory");
    for (int i = 0; i < n; i++) {
        char key[48];
        snprintf(key, sizeof key, "devices[%d]", i);
        if (get_integer(cJSON_GetArrayItem(v, i), key, 0, MAX_DEVICES - 1, &ids[i], err)) {
            free(ids);
            return -1;
        }
    }
    return set_device_ids(spec, ids, n, err);
}

static int bad_cuda_string(const char *s, Err *err) {
    return err_set(err,
                   "devices: expected an integer or a list of device ids, or \"cuda:0,1,...\" "
                   "(got '%s')",
                   s);
}

// "cuda:0,1": these GPUs (NVML indices), as astraid's --devices writes them.
static int parse_cuda_string(JobSpec *spec, const char *s, Err *err) {
    if (strncmp(s, "cuda:", 5)) return bad_cuda_string(s, err);
    int n = 1;
    for (const char *p = s + 5; *p; p++)
        n += *p == ',';
    if (n > MAX_DEVICES)
        return err_set(err, "devices: a list needs 1 to %d device ids, got %d", MAX_DEVICES, n);
    long *ids = calloc((size_t)n, sizeof *ids);
    if (!ids) return err_resource(err, "devices: out of memory");
    const char *p = s + 5;
    for (int i = 0; i < n; i++) {
        char *end;
        errno = 0;
        ids[i] = *p >= '0' && *p <= '9' ? strtol(p, &end, 10) : -1;
        if (ids[i] < 0 || errno || ids[i] > MAX_DEVICES - 1 || (*end && *end != ',')) {
            free(ids);
            return bad_cuda_string(s, err);
        }
        p = end + 1;
    }
    return set_device_ids(spec, ids, n, err);
}

static int parse_devices(JobSpec *spec, const cJSON *v, Err *err) {
    if (cJSON_IsArray(v)) return parse_device_list(spec, v, err);
    if (cJSON_IsString(v)) return parse_cuda_string(spec, v->valuestring, err);
    if (!cJSON_IsNumber(v))
        return err_set(err,
                       "devices: expected an integer or a list of device ids, or \"cuda:0,1,...\"");
    return get_integer(v, "devices", 1, MAX_DEVICES, &spec->n_devices, err);
}

static int parse_job_key(JobSpec *spec, const cJSON *item, Err *err) {
    const char *key = item->string;
    if (!strcmp(key, "name")) return parse_name(spec, item, err);
    if (!strcmp(key, "devices")) return parse_devices(spec, item, err);
    if (!strcmp(key, "max_restarts"))
        return get_integer(item, key, 0, 1000, &spec->max_restarts, err);
    if (!strcmp(key, "nodes")) return get_integer(item, key, 1, MAX_DEVICES, &spec->nodes, err);
    if (!strcmp(key, "gpus_per_node"))
        return get_integer(item, key, 1, MAX_DEVICES, &spec->gpus_per_node, err);
    if (!strcmp(key, "hang_timeout_s"))
        return get_number(item, key, HANG_TIMEOUT_MIN_S, HANG_TIMEOUT_MAX_S, &spec->hang_timeout_s,
                          err);
    if (!strcmp(key, "max_duration_hours"))
        return get_number(item, key, MAX_DURATION_MIN_H, MAX_DURATION_MAX_H,
                          &spec->max_duration_hours, err);
    return get_integer(item, key, -1000, 1000, &spec->priority, err); // priority
}

// Applies one training key through the training validator.
static int parse_train_key(JobSpec *spec, const cJSON *item, Err *err) {
    cJSON *one = cJSON_CreateObject();
    if (!one || !cJSON_AddItemReferenceToObject(one, item->string, (cJSON *)item)) {
        cJSON_Delete(one);
        return err_resource(err, "%s: out of memory", item->string);
    }
    int rc = train_spec_apply_json(&spec->train, one, NULL, err);
    cJSON_Delete(one);
    if (rc) suggest_job_key(item->string, err);
    return rc;
}

// devices and nprocs describe the same number of ranks; either one sets the other, and
// so do nodes x gpus_per_node.
static int reconcile_devices(JobSpec *spec, const cJSON *obj, Err *err) {
    int has_devices = cJSON_HasObjectItem(obj, "devices");
    int has_nprocs = cJSON_HasObjectItem(obj, "nprocs");
    if (spec->gpus_per_node) {
        long ranks = (spec->nodes ? spec->nodes : 1) * spec->gpus_per_node;
        if ((has_devices || has_nprocs) &&
            (has_devices ? spec->n_devices : spec->train.nprocs) != ranks)
            return err_set(err,
                           "gpus_per_node: nodes x gpus_per_node is %ld rank(s) but %s is %ld "
                           "(they must match)",
                           ranks, has_devices ? "devices" : "nprocs",
                           has_devices ? spec->n_devices : spec->train.nprocs);
        spec->n_devices = spec->train.nprocs = ranks;
        return 0;
    }
    if (spec->nodes > 1 && has_devices + has_nprocs == 0)
        return err_set(err, "nodes: %ld nodes need gpus_per_node, nprocs or devices", spec->nodes);
    if (!has_devices)
        spec->n_devices = spec->train.nprocs;
    else if (!has_nprocs)
        spec->train.nprocs = spec->n_devices;
    else if (spec->n_devices != spec->train.nprocs)
        return err_set(err, "devices: %ld device(s) but nprocs is %ld (they must match)",
                       spec->n_devices, spec->train.nprocs);
    return 0;
}

// astrai-train's own multi-node launch flags have no place in a job: astraid (or Slurm) starts
// the ranks, and the JOB key "nodes" says over how many nodes.
static int refuse_launch_flags(const cJSON *obj, Err *err) {
    static const char *const keys[] = {"nnodes", "node_rank", "nproc_per_node"};
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++)
        if (cJSON_HasObjectItem(obj, keys[i]))
            return err_set(err,
                           "%s: astraid starts a job's ranks itself; say how many nodes with "
                           "\"nodes\" (the slurm executor; %s is astrai-train's own launch flag)",
                           keys[i], keys[i]);
    return 0;
}

int job_spec_parse(JobSpec *spec, const cJSON *obj, Err *err) {
    memset(spec, 0, sizeof *spec);
    if (train_spec_defaults(&spec->train, err)) return -1;
    spec->max_restarts = -1;
    if (!cJSON_IsObject(obj)) {
        job_spec_free(spec);
        return err_set(err, "the job spec must be a JSON object");
    }
    const cJSON *item;
    cJSON_ArrayForEach(item, obj) {
        int rc = is_job_key(item->string) ? parse_job_key(spec, item, err)
                                          : parse_train_key(spec, item, err);
        if (rc) goto fail;
    }
    if (refuse_launch_flags(obj, err) || reconcile_devices(spec, obj, err) ||
        train_spec_validate(&spec->train, err))
        goto fail;
    return 0;
fail:
    job_spec_free(spec);
    return -1;
}

void job_spec_free(JobSpec *spec) {
    train_spec_free(&spec->train);
    free(spec->name);
    free(spec->device_ids);
    memset(spec, 0, sizeof *spec);
    spec->max_restarts = -1;
}

// "--key=value" for one member of train_spec_to_json's object.
static char *flag_for(const cJSON *item) {
    char value[64];
    const char *text = value;
    if (cJSON_IsString(item))
        text = item->valuestring;
    else if (cJSON_IsBool(item))
        text = cJSON_IsTrue(item) ? "true" : "false";
    else if (item->valuedouble == floor(item->valuedouble) && fabs(item->valuedouble) < 1e19)
        snprintf(value, sizeof value, "%.0f", item->valuedouble);
    else
        snprintf(value, sizeof value, "%.17g", item->valuedouble);
    size_t n = strlen(item->string) + strlen(text) + 4;
    char *flag = malloc(n);
    if (flag) snprintf(flag, n, "--%s=%s", item->string, text);
    return flag;
}

char **job_spec_argv(const JobSpec *spec, const char *binary) {
    cJSON *keys = train_spec_to_json(&spec->train);
    int n = keys ? cJSON_GetArraySize(keys) : 0;
    char **argv = keys ? calloc((size_t)n + 2, sizeof *argv) : NULL;
    if (!argv) goto fail;
    argv[0] = strdup(binary);
    if (!argv[0]) goto fail;
    int i = 1;
    const cJSON *item;
    cJSON_ArrayForEach(item, keys) {
        if (!(argv[i++] = flag_for(item))) goto fail;
    }
    cJSON_Delete(keys);
    return argv;
fail:
    cJSON_Delete(keys);
    job_spec_free_argv(argv);
    return NULL;
}

void job_spec_free_argv(char **argv) {
    for (char **a = argv; a && *a; a++)
        free(*a);
    free(argv);
}
