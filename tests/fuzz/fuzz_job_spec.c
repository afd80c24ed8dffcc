// fuzz_job_spec.c: libFuzzer harness of the job spec validator on the path of a submit
// (astraictl and astraid's submit: job_spec_parse of a JSON object; astraid's runner:
// job_spec_argv; each rank: train_spec_parse_args of that argv).
// Checked:
//   - a refused spec gets an error message that, sent as astraid's reply, is one line
//     of valid UTF-8 JSON;
//   - an accepted spec gives an argv that astrai-train accepts and validates, and that
//     parses back to the same training spec (every key, as train_spec_to_json writes it):
//     a job astraid queues is never refused by its ranks, nor run with other values.
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "proto/job_spec.h"
#include "proto/rpc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_error_reply(const Err *err) {
    cJSON *id = cJSON_CreateNumber(1);
    char *reply = rpc_error(id, RPC_INVALID_PARAMS, err->msg, NULL);
    if (!reply || !rpc_utf8_valid(reply, strlen(reply))) abort();
    cJSON *back = cJSON_Parse(reply);
    if (!cJSON_IsObject(back)) abort();
    cJSON_Delete(back);
    free(reply);
    cJSON_Delete(id);
}

static void check_argv(const JobSpec *spec) {
    char **argv = job_spec_argv(spec, "astrai-train");
    if (!argv) abort();
    int argc = 0;
    while (argv[argc])
        argc++;
    TrainSpec ts;
    bool help;
    Err err = {0};
    if (train_spec_defaults(&ts, &err) || train_spec_parse_args(&ts, argc, argv, &help, &err) ||
        help || train_spec_validate(&ts, &err))
        abort(); // err.msg says why astrai-train would refuse the queued job
    cJSON *want = train_spec_to_json(&spec->train), *got = train_spec_to_json(&ts);
    if (!want || !got || !cJSON_Compare(want, got, 1)) abort();
    cJSON_Delete(want);
    cJSON_Delete(got);
    train_spec_free(&ts);
    job_spec_free_argv(argv);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    // Only what could arrive: a request line is valid UTF-8 (rpc.c refuses the rest).
    if (!rpc_utf8_valid((const char *)data, size)) return 0;
    cJSON *obj = cJSON_ParseWithLength((const char *)data, size);
    if (!obj) return 0;
    JobSpec spec;
    Err err = {0};
    if (job_spec_parse(&spec, obj, &err) == 0) {
        if (spec.n_devices != spec.train.nprocs) abort();
        check_argv(&spec);
        job_spec_free(&spec);
    } else
        check_error_reply(&err);
    cJSON_Delete(obj);
    return 0;
}
