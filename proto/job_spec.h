// job_spec.h: the job spec of astraid (docs/design.md §4): the astrai-train keys of
// proto/train_spec.h plus the job keys below. One validator for astraictl (client
// side), astraid (on submit) and astrai-train.
//
//   name          string, default the file name / "job-<id>"
//   devices       integer >= 1 (defaults to nprocs), a non-empty list of distinct device
//                 ids (integers >= 0), or "cuda:0,1" (those GPUs; astraid refuses it when it
//                 has CPU slots). When nprocs is given too, the number of devices must
//                 equal it; when only devices is given, nprocs is set to that number.
//   max_restarts  integer >= 0 (default: the daemon's --max-restarts)
//   priority      integer (higher starts first; FIFO within a priority), default 0
//   nodes         integer >= 1: nodes of a Slurm job (astraid --executor slurm; the local
//                 executor refuses more than 1), default 1; its ranks are spread evenly
//   gpus_per_node integer >= 1: GPUs (= ranks) per node of a Slurm job; sets nprocs to
//                 nodes x gpus_per_node (nprocs/devices, when given too, must equal it)
//   hang_timeout_s number in [1, 604800]: seconds without a new optimizer step that make a run
//                 hung (astraid's watchdog); default derived from the job's step time
//   max_duration_hours number in [1e-4, 87600] (fractions allowed: 0.0003 is about a second):
//                 hours a job runs before astraid pauses it with a checkpoint
#pragma once
#include <stdbool.h>

#include "common/error.h"
#include "proto/train_spec.h"

typedef struct cJSON cJSON;

#define HANG_TIMEOUT_MIN_S 1.0
#define HANG_TIMEOUT_MAX_S 604800.0 // a week
#define MAX_DURATION_MIN_H 1e-4
#define MAX_DURATION_MAX_H 87600.0 // ten years

typedef struct {
    TrainSpec train;
    char *name;        // NULL when not given
    long max_restarts; // -1 when not given
    long priority;
    long n_devices;            // devices asked for (= train.nprocs unless given)
    long *device_ids;          // the n_devices ids when devices is a list, else NULL
    long nodes;                // 0 when not given
    long gpus_per_node;        // 0 when not given
    double hang_timeout_s;     // 0 when not given
    double max_duration_hours; // 0 when not given
} JobSpec;

// Validates obj (a JSON object) into spec. Errors name the key and suggest the
// nearest valid one for unknown keys; required training keys must be present.
int job_spec_parse(JobSpec *spec, const cJSON *obj, Err *err);
void job_spec_free(JobSpec *spec);

// The training keys that name a file or directory, NULL-terminated: their relative values are
// taken from astraictl's directory (the ranks run elsewhere) and astraid refuses any left.
extern const char *const JOB_SPEC_PATH_KEYS[];
// Whether `value` of path key `key` names a file: all but "" (unset) and tokenizer's "bytes".
bool job_spec_value_is_path(const char *key, const char *value);

// The astrai-train argv for the spec (NULL-terminated, malloc'd strings):
// {binary, "--key=value", ..., NULL}. Free with job_spec_free_argv.
char **job_spec_argv(const JobSpec *spec, const char *binary);
void job_spec_free_argv(char **argv);
