// test_job_spec.c: proto/job_spec.c: every class of invalid job spec, job keys,
// devices vs nprocs, and the astrai-train argv round trip.
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "proto/job_spec.h"

#define BASE "\"train_type\":\"seq\",\"param_path\":\"/m\",\"data_root_path\":\"/d\""

// Parses json; want_msg NULL means it must be valid, else the error must contain it.
static void expect_spec(const char *json, const char *want_msg) {
    cJSON *obj = cJSON_Parse(json);
    JobSpec spec;
    Err err = {0};
    int rc = job_spec_parse(&spec, obj, &err);
    if (!want_msg)
        CHECK_MSG(rc == 0, "%s: %s", json, err.msg);
    else
        CHECK_MSG(rc == -1 && strstr(err.msg, want_msg), "%s: rc %d, message '%s', expected '%s'",
                  json, rc, err.msg, want_msg);
    job_spec_free(&spec);
    cJSON_Delete(obj);
}

static void test_invalid_specs(void) {
    expect_spec("[1]", "must be a JSON object");
    // unknown keys, with suggestions from the training keys and the job keys
    expect_spec("{" BASE ",\"max_lrr\":1e-3}", "unknown key 'max_lrr' (did you mean 'max_lr'?)");
    expect_spec("{" BASE ",\"priorty\":1}", "unknown key 'priorty' (did you mean 'priority'?)");
    expect_spec("{" BASE ",\"devics\":1}", "unknown key 'devics' (did you mean 'devices'?)");
    // wrong types
    expect_spec("{" BASE ",\"n_epoch\":\"2\"}", "n_epoch: expected an integer");
    expect_spec("{" BASE ",\"n_epoch\":1.5}", "n_epoch: expected an integer");
    expect_spec("{" BASE ",\"max_lr\":\"fast\"}", "max_lr: expected a number");
    expect_spec("{" BASE ",\"muon_adjust_lr\":\"fast\"}",
                "muon_adjust_lr: 'fast' is not one of original|match_rms_adamw");
    expect_spec("{" BASE ",\"tp_size\":2}", "tp_size: 2 is refused");
    // astrai-train's multi-node launch flags: a job says "nodes" instead
    expect_spec("{" BASE ",\"nnodes\":2}", "nnodes: astraid starts a job's ranks itself");
    expect_spec("{" BASE ",\"node_rank\":0}", "node_rank: astraid starts a job's ranks itself");
    expect_spec("{" BASE ",\"nproc_per_node\":2}", "nproc_per_node: astraid starts");
    expect_spec("{" BASE ",\"checkpoint_keep_last\":-1}", "checkpoint_keep_last");
    expect_spec("{" BASE ",\"checkpoint_keep_last\":3,\"checkpoint_keep_best\":1}", NULL);
    // pipelines (docs/design.md §13): devices = nprocs = pp_size x replicas
    expect_spec("{" BASE ",\"nprocs\":3,\"pp_size\":2}", "pp_size: 2 does not divide nprocs 3");
    expect_spec("{" BASE ",\"pp_schedule\":\"zigzag\"}",
                "pp_schedule: 'zigzag' is not one of 1f1b|gpipe");
    expect_spec("{" BASE ",\"nprocs\":4,\"pp_size\":2,\"parallel_mode\":\"none\"}",
                "4 ranks are 2 replicas of a pipeline of pp_size 2");
    expect_spec("{" BASE ",\"devices\":3,\"pp_size\":2}", "pp_size: 2 does not divide nprocs 3");
    expect_spec("{" BASE ",\"devices\":2,\"pp_size\":2,\"parallel_mode\":\"none\"}", NULL);
    expect_spec("{" BASE ",\"shuffle\":1}", "shuffle: expected true or false");
    expect_spec("{" BASE ",\"name\":5}", "name: expected a string");
    expect_spec("{" BASE ",\"priority\":\"high\"}", "priority: expected an integer");
    expect_spec("{" BASE ",\"max_restarts\":1.5}", "max_restarts: expected an integer");
    expect_spec("{" BASE ",\"devices\":\"0,1\"}", "devices: expected an integer or a list");
    expect_spec("{" BASE ",\"devices\":[0,\"1\"]}", "devices[1]: expected an integer");
    // out of range
    expect_spec("{" BASE ",\"batch_per_device\":0}", "batch_per_device: value 0 is out of range");
    expect_spec("{" BASE ",\"warmup_ratio\":1.5}", "warmup_ratio: value");
    expect_spec("{" BASE ",\"max_restarts\":-1}",
                "max_restarts: value -1 is out of range [0, 1000]");
    expect_spec("{" BASE ",\"priority\":5000}", "priority: value 5000 is out of range");
    expect_spec("{" BASE ",\"devices\":0}", "devices: value 0 is out of range");
    expect_spec("{" BASE ",\"devices\":[-1]}", "devices[0]: value -1 is out of range");
    expect_spec("{" BASE ",\"devices\":[]}", "devices: a list needs 1 to");
    expect_spec("{" BASE ",\"devices\":[0,1,0],\"parallel_mode\":\"ddp\"}",
                "device 0 is listed twice");
    expect_spec("{" BASE ",\"name\":\"\"}", "name: length 0");
    expect_spec("{" BASE ",\"name\":\"a\\nb\"}", "name: control characters");
    // bad choice
    expect_spec("{" BASE ",\"schedule_type\":\"linear\"}", "schedule_type: 'linear' is not one of");
    expect_spec("{\"train_type\":\"rl\",\"param_path\":\"/m\",\"data_root_path\":\"/d\"}",
                "train_type: 'rl' is not one of");
    // missing required keys
    expect_spec("{\"param_path\":\"/m\",\"data_root_path\":\"/d\"}", "train_type: required");
    expect_spec("{\"train_type\":\"seq\",\"data_root_path\":\"/d\"}", "param_path: required");
    expect_spec("{\"train_type\":\"seq\",\"param_path\":\"/m\"}", "data_root_path: required");
    // cross-field
    // parallel_mode defaults to fsdp as AstrAI's; none with 2 ranks is refused.
    expect_spec("{" BASE ",\"nprocs\":2}", NULL);
    expect_spec("{" BASE ",\"nprocs\":2,\"parallel_mode\":\"none\"}",
                "nprocs: 2 ranks need parallel_mode ddp or fsdp");
    expect_spec("{" BASE ",\"nprocs\":2,\"devices\":3,\"parallel_mode\":\"ddp\"}",
                "devices: 3 device(s) but nprocs is 2");
    expect_spec("{" BASE ",\"nprocs\":1,\"devices\":[0,1],\"parallel_mode\":\"ddp\"}",
                "devices: 2 device(s) but nprocs is 1");
}

static void test_valid_specs(void) {
    cJSON *obj = cJSON_Parse("{" BASE ",\"name\":\"tiny\",\"priority\":-3,\"max_restarts\":2,"
                             "\"devices\":[2,5],\"parallel_mode\":\"ddp\",\"max_lr\":1e-3}");
    JobSpec spec;
    Err err;
    CHECK_MSG(job_spec_parse(&spec, obj, &err) == 0, "%s", err.msg);
    CHECK(spec.name && !strcmp(spec.name, "tiny"));
    CHECK(spec.priority == -3 && spec.max_restarts == 2);
    CHECK(spec.n_devices == 2 && spec.train.nprocs == 2); // devices set nprocs
    CHECK(spec.device_ids && spec.device_ids[0] == 2 && spec.device_ids[1] == 5);
    CHECK(spec.train.max_lr == 1e-3 && !strcmp(spec.train.parallel_mode, "ddp"));
    job_spec_free(&spec);
    cJSON_Delete(obj);
    // Defaults: no name, max_restarts -1 (the daemon's), priority 0, devices = nprocs.
    obj = cJSON_Parse("{" BASE ",\"nprocs\":3,\"parallel_mode\":\"fsdp\"}");
    CHECK_MSG(job_spec_parse(&spec, obj, &err) == 0, "%s", err.msg);
    CHECK(!spec.name && spec.max_restarts == -1 && spec.priority == 0);
    CHECK(spec.n_devices == 3 && !spec.device_ids);
    job_spec_free(&spec);
    cJSON_Delete(obj);
    expect_spec("{" BASE ",\"devices\":4,\"nprocs\":4,\"parallel_mode\":\"ddp\"}", NULL);
}

// job_spec_argv parsed back by astrai-train's own parser gives the same spec.
static void test_argv_round_trip(void) {
    cJSON *obj = cJSON_Parse("{" BASE ",\"name\":\"rt\",\"max_lr\":0.00031415926535897931,"
                             "\"warmup_ratio\":0.1,\"shuffle\":false,\"random_seed\":123456789012,"
                             "\"ckpt_dir\":\"/tmp/a b=c\",\"nprocs\":2,\"parallel_mode\":\"ddp\","
                             "\"schedule_type\":\"wsd\",\"min_rate\":1e-7,\"resume\":true,"
                             "\"muon_adjust_lr\":\"original\",\"muon_nesterov\":false,"
                             "\"start_samples\":5}");
    JobSpec spec;
    Err err;
    CHECK_MSG(job_spec_parse(&spec, obj, &err) == 0, "%s", err.msg);
    char **argv = job_spec_argv(&spec, "/usr/bin/astrai-train");
    CHECK(argv && !strcmp(argv[0], "/usr/bin/astrai-train"));
    int argc = 0;
    while (argv && argv[argc])
        argc++;
    CHECK(argc > 30 && !strcmp(argv[1], "--train_type=seq"));
    TrainSpec back;
    bool help;
    CHECK(train_spec_defaults(&back, &err) == 0);
    CHECK_MSG(train_spec_parse_args(&back, argc, argv, &help, &err) == 0, "%s", err.msg);
    cJSON *a = train_spec_to_json(&spec.train), *b = train_spec_to_json(&back);
    char *ta = cJSON_PrintUnformatted(a), *tb = cJSON_PrintUnformatted(b);
    CHECK_MSG(!strcmp(ta, tb), "\n%s\n%s", ta, tb);
    CHECK(back.max_lr == 0.00031415926535897931 && back.min_rate == 1e-7);
    CHECK(back.random_seed == 123456789012L && !back.shuffle && back.resume);
    CHECK(!strcmp(back.ckpt_dir, "/tmp/a b=c"));
    // AstrAI's train.py keys (issue 8) travel too; compile "" (off) passes as --compile=.
    CHECK(!strcmp(back.muon_adjust_lr, "original") && !back.muon_nesterov);
    CHECK(back.start_samples == 5 && !*back.compile && !strcmp(back.parallel_mode, "ddp"));
    free(ta);
    free(tb);
    cJSON_Delete(a);
    cJSON_Delete(b);
    train_spec_free(&back);
    job_spec_free_argv(argv);
    job_spec_free(&spec);
    cJSON_Delete(obj);
}

// Every value of every enumerated key decodes to its enum (TrainChoices), in the order of the
// key's choices; the defaults decode too, and train_type starts unset.
static void test_choices_decoded(void) {
    TrainSpec t;
    Err err = {0};
    CHECK(train_spec_defaults(&t, &err) == 0);
    CHECK(t.is.train_type == TRAIN_UNSET && t.is.optimizer == OPTIMIZER_MUON &&
          t.is.parallel_mode == PARALLEL_FSDP && t.is.dtype == DTYPE_AUTO &&
          t.is.device_type == DEVICE_AUTO && t.is.muon_adjust_lr == MUON_LR_MATCH_RMS_ADAMW);
    const struct {
        const char *key, *value;
        const int *field;
        int want;
    } cases[] = {
        {"train_type", "seq", (int *)&t.is.train_type, TRAIN_SEQ},
        {"train_type", "sft", (int *)&t.is.train_type, TRAIN_SFT},
        {"train_type", "dpo", (int *)&t.is.train_type, TRAIN_DPO},
        {"train_type", "grpo", (int *)&t.is.train_type, TRAIN_GRPO},
        {"train_type", "online_grpo", (int *)&t.is.train_type, TRAIN_ONLINE_GRPO},
        {"train_type", "online_dpo", (int *)&t.is.train_type, TRAIN_ONLINE_DPO},
        {"optimizer", "adamw", (int *)&t.is.optimizer, OPTIMIZER_ADAMW},
        {"optimizer", "muon", (int *)&t.is.optimizer, OPTIMIZER_MUON},
        {"schedule_type", "wsd", (int *)&t.is.schedule_type, SCHEDULE_WSD},
        {"schedule_type", "sgdr", (int *)&t.is.schedule_type, SCHEDULE_SGDR},
        {"schedule_type", "cosine", (int *)&t.is.schedule_type, SCHEDULE_COSINE},
        {"ckpt_dtype", "bf16", (int *)&t.is.ckpt_dtype, CKPT_BF16},
        {"ckpt_dtype", "fp32", (int *)&t.is.ckpt_dtype, CKPT_FP32},
        {"ckpt_format", "sharded", (int *)&t.is.ckpt_format, CKPT_SHARDED},
        {"ckpt_format", "full", (int *)&t.is.ckpt_format, CKPT_FULL},
        {"parallel_mode", "none", (int *)&t.is.parallel_mode, PARALLEL_NONE},
        {"parallel_mode", "ddp", (int *)&t.is.parallel_mode, PARALLEL_DDP},
        {"parallel_mode", "fsdp", (int *)&t.is.parallel_mode, PARALLEL_FSDP},
        {"device_type", "cpu", (int *)&t.is.device_type, DEVICE_CPU},
        {"device_type", "cuda", (int *)&t.is.device_type, DEVICE_CUDA},
        {"device_type", "auto", (int *)&t.is.device_type, DEVICE_AUTO},
        {"dtype", "bf16", (int *)&t.is.dtype, DTYPE_BF16},
        {"dtype", "fp16", (int *)&t.is.dtype, DTYPE_FP16},
        {"dtype", "fp32", (int *)&t.is.dtype, DTYPE_FP32},
        {"dtype", "auto", (int *)&t.is.dtype, DTYPE_AUTO},
        {"muon_adjust_lr", "original", (int *)&t.is.muon_adjust_lr, MUON_LR_ORIGINAL},
        {"muon_adjust_lr", "match_rms_adamw", (int *)&t.is.muon_adjust_lr, MUON_LR_MATCH_RMS_ADAMW},
        {"backend", "gloo", (int *)&t.is.backend, COLLECTIVES_GLOO},
        {"backend", "nccl", (int *)&t.is.backend, COLLECTIVES_NCCL},
        {"pp_schedule", "gpipe", (int *)&t.is.pp_schedule, PIPELINE_GPIPE},
        {"pp_schedule", "1f1b", (int *)&t.is.pp_schedule, PIPELINE_1F1B},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        CHECK(train_spec_set(&t, cases[i].key, cases[i].value, &err) == 0);
        CHECK_MSG(*cases[i].field == cases[i].want, "%s=%s decoded as %d, not %d", cases[i].key,
                  cases[i].value, *cases[i].field, cases[i].want);
    }
    // a refused value leaves the decoded choice as it was
    CHECK(train_spec_set(&t, "dtype", "int8", &err) == -1 && t.is.dtype == DTYPE_AUTO);
    train_spec_free(&t);
}

int main(void) {
    test_choices_decoded();
    test_invalid_specs();
    test_valid_specs();
    test_argv_round_trip();
    CHECK_DONE();
}
