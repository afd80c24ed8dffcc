// astrai-train: one training run with AstrAI's train.py flags (docs/design.md §1, §8).
//
// Exit codes (every rank, and the launcher of --nprocs ranks): 0 the run reached its end (all
// epochs, or --max_steps); 1 failure (while training, or for want of a resource: memory, a
// device, I/O); 2 bad input (flags, config, weights, data); 3 (EXIT_INTERRUPTED) stopped before
// its end by SIGTERM/SIGINT or a stop request, after the checkpoint --resume continues from.
//
// The environment is read here once: the launcher's variables by launch_detect (launch.h), a
// supervisor's by supervisor_env; the trainer gets what they say as TrainerOptions.
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm/comm.h"
#include "common/fsutil.h"
#include "common/json.h"
#include "engine/backend.h"
#include "engine/param_table.h"
#include "proto/train_spec.h"
#include "train/executor.h"
#include "train/launch.h"
#include "train/pipeline.h"
#include "train/rendezvous.h"
#include "train/train_ckpt.h"
#include "train/trainer.h"

static void on_stop(int sig) {
    (void)sig;
    trainer_stop_requested = 1;
}

static void on_checkpoint(int sig) {
    (void)sig;
    trainer_checkpoint_requested = 1;
}

static void install_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sigemptyset(&sa.sa_mask);
    sa.sa_handler = on_stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_checkpoint;
    sigaction(SIGUSR1, &sa, NULL);
    // A supervisor that died leaves our stderr a broken pipe: a progress line must not kill
    // the rank before its stop checkpoint (the write fails instead).
    sa.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &sa, NULL);
}

// The backend of this rank: --device_type (auto: cuda when a GPU is visible) and
// --dtype (auto: bf16 on cuda, fp32 on the CPU). A rank drives GPU LOCAL_RANK of the
// GPUs CUDA_VISIBLE_DEVICES shows it (as under torchrun).
static int open_backend(const LaunchInfo *li, const TrainSpec *spec, const Backend **be, Err *err) {
    bool cuda = spec->is.device_type == DEVICE_CUDA ||
                (spec->is.device_type == DEVICE_AUTO && backend_cuda_available());
    DtypeChoice d = spec->is.dtype;
    DType dtype = d == DTYPE_FP16                                ? DT_F16
                  : d == DTYPE_BF16 || (d == DTYPE_AUTO && cuda) ? DT_BF16
                                                                 : DT_F32;
    if (!backend_open(be, cuda ? BACKEND_CUDA : BACKEND_CPU, li->local_rank, dtype, err)) {
        // Once per job (rank 0): which GEMMs a reduced-precision CPU run uses (docs/training.md).
        if (li->rank == 0 && !cuda && dtype != DT_F32)
            fprintf(stderr, "cpu %s GEMM: %s\n", dtype_name(dtype), backend_cpu_gemm_path(dtype));
        return 0;
    }
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    return err_prefix(err, "LOCAL_RANK %d, CUDA_VISIBLE_DEVICES=%s", li->local_rank,
                      visible ? visible : "unset");
}

// Each rank's host name from the meeting's layout (the gloo backend's messages name peers by
// them), copied: the meeting closes once the Comm is connected; kept for the life of the
// process (a name is "?" when out of memory).
static const char *const *rank_hosts(const LaunchInfo *li) {
    static char **hosts;
    if (hosts) return (const char *const *)hosts;
    hosts = calloc((size_t)li->world_size, sizeof *hosts);
    for (int r = 0; hosts && r < li->world_size; r++)
        if (!(hosts[r] =
                  strdup(rendezvous_host_name(li->meeting, rendezvous_host_of(li->meeting, r)))))
            hosts[r] = (char *)"?";
    return (const char *const *)hosts;
}

// Each rank's host index from the meeting's layout (CommConfig.host_of), kept for the life of
// the process as rank_hosts' names are (NULL when out of memory: hier then refuses).
static const int *rank_host_of(const LaunchInfo *li) {
    static int *host_of;
    if (host_of) return host_of;
    host_of = calloc((size_t)li->world_size, sizeof *host_of);
    for (int r = 0; host_of && r < li->world_size; r++)
        host_of[r] = rendezvous_host_of(li->meeting, r);
    return host_of;
}

// The CPU collectives: shared memory when every rank is on one host (the fastest), Gloo across
// hosts (not comm/hier.c's "hier": no faster than Gloo at 64 MiB, bench/README.md), and Gloo
// whenever --backend gloo is given (AstrAI's meaning).
static const char *cpu_backend(const LaunchInfo *li, const TrainSpec *spec) {
    if (train_spec_given(spec, "backend") && spec->is.backend == COLLECTIVES_GLOO) return "gloo";
    return rendezvous_hosts(li->meeting) > 1 ? "gloo" : "shm";
}

// Once per job (rank 0): which collectives, and where the ranks are when that is several hosts.
static void print_layout(const LaunchInfo *li, const char *backend) {
    const Rendezvous *m = li->meeting;
    if (li->rank != 0 || rendezvous_hosts(m) == 1) {
        if (li->rank == 0)
            fprintf(stderr, "collectives: %s, %d ranks on one host\n", backend, li->world_size);
        return;
    }
    fprintf(stderr, "collectives: %s, %d ranks on %d hosts:", backend, li->world_size,
            rendezvous_hosts(m));
    for (int h = 0; h < rendezvous_hosts(m); h++) {
        fprintf(stderr, "%s %s (rank", h ? ";" : "", rendezvous_host_name(m, h));
        for (int r = 0; r < li->world_size; r++)
            if (rendezvous_host_of(m, r) == h) fprintf(stderr, " %d", r);
        fprintf(stderr, ")");
    }
    fprintf(stderr, "\n");
}

// The collectives of a multi-rank job: ranks meet (rendezvous), then attach to the
// shm segment rank 0 named or connect Gloo's mesh through the meeting (CPU), or join the NCCL
// communicator of the ncclUniqueId rank 0 made (GPU).
static int connect_ranks(LaunchInfo *li, const TrainSpec *spec, const Backend *be, Comm **comm,
                         Err *err) {
    *comm = NULL;
    if (li->world_size == 1) return 0;
    if (spec->is.parallel_mode == PARALLEL_NONE && li->world_size > spec->pp_size)
        return err_set(err,
                       "parallel_mode: 'none' cannot run %d ranks (%s) in pipelines of pp_size "
                       "%ld; use ddp or fsdp",
                       li->world_size, li->source, spec->pp_size);
    bool gpu = be->device >= 0;
    uint8_t nccl_id[COMM_NCCL_ID_BYTES] = {0};
    int rc = (gpu && li->rank == 0 && comm_nccl_unique_id(nccl_id, err)) ||
             launch_rendezvous(li, gpu ? nccl_id : NULL, err);
    if (!rc) {
        // shm_name and nccl_id were filled by the rendezvous.
        CommExchange exchange = {.all_gather = rendezvous_all_gather, .ctx = li->meeting};
        CommConfig cfg = {.backend = gpu ? "nccl" : cpu_backend(li, spec),
                          .rank = li->rank,
                          .world_size = li->world_size,
                          .timeout_ms = (int)(spec->comm_timeout * 1000),
                          .shm_name = li->shm_name,
                          .nccl_id = nccl_id,
                          .cuda_device = be->device,
                          .cuda_stream = be->stream(),
                          .exchange = &exchange,
                          .gloo_addr = rendezvous_local_addr(li->meeting),
                          .hosts = rank_hosts(li),
                          .host_of = rank_host_of(li)};
        print_layout(li, cfg.backend);
        rc = comm_create(comm, &cfg, err);
        // Ranks that read or write ckpt_dir themselves need every host to see the same one.
        if (!rc && rendezvous_hosts(li->meeting) > 1 &&
            (spec->is.ckpt_format == CKPT_SHARDED || spec->resume))
            rc = train_ckpt_check_shared_dir(spec, *comm, cfg.hosts, err);
    }
    launch_end_meeting(li);
    // The job's failure (a rank that never came, a peer that died, no shm segment or
    // NCCL), not its input: exit 1, which a supervisor may retry.
    if (rc) err->resource = 1;
    return rc ? -1 : 0;
}

// Exit code of a failure before training: interrupted when a stop signal cut the setup short
// (a rendezvous waiting for ranks that never came), 1 for a resource (memory, device, I/O),
// else 2.
static int setup_failed(const Err *err) {
    if (trainer_stop_requested) return EXIT_INTERRUPTED;
    return err_exit_status(err);
}

// One rank (or the single process) of the job, with what the supervisor said in `env`.
// Exit codes as documented above.
static int train_rank(LaunchInfo *li, const TrainSpec *spec, const TrainerOptions *env) {
    Err err = {0};
    TrainerOptions opt = *env;
    opt.threads = launch_threads(li, spec->threads);
    // Rank 0 settles what a killed writer left in ckpt_dir before the ranks meet, so that no
    // rank looks for the checkpoint to resume from meanwhile.
    if ((li->rank == 0 && train_ckpt_clean_dir(spec, &err)) ||
        open_backend(li, spec, &opt.be, &err) || connect_ranks(li, spec, opt.be, &opt.comm, &err)) {
        fprintf(stderr, "astrai-train: rank %d: %s\n", li->rank, err.msg);
        return setup_failed(&err);
    }
    Trainer t;
    int rc = 0;
    if (trainer_init(&t, spec, &opt, &err)) {
        if (err.resource) err_prefix(&err, "rank %d", li->rank);
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        rc = setup_failed(&err);
    } else if ((rc = trainer_run(&t, &err)) < 0) {
        fprintf(stderr, "astrai-train: rank %d: %s\n", li->rank, err.msg);
        rc = 1;
    } else if (rc > 0) {
        rc = EXIT_INTERRUPTED;
    }
    trainer_free(&t);
    comm_destroy(opt.comm);
    return rc;
}

// The flags that say where the ranks meet, when given explicitly (LaunchFlags).
static LaunchFlags launch_flags(const TrainSpec *spec) {
    return (LaunchFlags){
        .nprocs = spec->nproc_per_node > 0 ? spec->nproc_per_node : spec->nprocs,
        .nnodes = spec->nnodes,
        .node_rank = spec->node_rank,
        .pp_size = spec->pp_size,
        .master_addr = train_spec_given(spec, "master_addr") ? spec->master_addr : NULL,
        .master_port = train_spec_given(spec, "master_port") ? spec->master_port : NULL};
}

static int run(const TrainSpec *spec, const TrainerOptions *env, char **argv) {
    Err err = {0};
    LaunchInfo *li = launch_info();
    LaunchFlags flags = launch_flags(spec);
    if (launch_detect_flags(li, &flags, &err)) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        return err_exit_status(&err);
    }
    // Once per job: rank 0's (the local parent's rank 0 prints them, not the parent).
    if (li->mode != LAUNCH_LOCAL_PARENT && li->rank == 0) train_spec_warn_ignored(spec, stderr);
    if (li->mode != LAUNCH_LOCAL_PARENT) {
        install_signals();
        li->stop = &trainer_stop_requested;
        return train_rank(li, spec, env);
    }
    // The ranks meet where --master_addr/--master_port say when given explicitly (AstrAI
    // hands them to the rendezvous of its local spawn; launch_flags); else on 127.0.0.1 at a
    // free port.
    int rc = launch_local(li, argv, &err);
    if (rc < 0) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        return 1;
    }
    return rc;
}

// --backend given explicitly chooses device_type auto's device (gloo: our CPU collectives,
// nccl: GPUs).
static int resolve_backend(TrainSpec *spec, Err *err) {
    if (train_spec_given(spec, "backend") && spec->is.device_type == DEVICE_AUTO &&
        train_spec_set(spec, "device_type", spec->is.backend == COLLECTIVES_GLOO ? "cpu" : "cuda",
                       err))
        return -1;
    return 0;
}

// ckpt_dir must be writable: the directory itself, or the nearest existing parent.
static int check_ckpt_dir(const char *dir, Err *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    while (access(path, F_OK) != 0) {
        char *slash = strrchr(path, '/');
        if (!slash || slash == path) {
            snprintf(path, sizeof path, "%s", slash == path ? "/" : ".");
            break;
        }
        *slash = 0;
    }
    if (access(path, W_OK | X_OK) != 0)
        return err_errno(err, errno, "ckpt_dir %s: %s is not writable", dir, path);
    return 0;
}

// ---------------------------------------------------------------- --dry-run's account of the ranks

// What one rank of the job keeps: its stage's tensors, those whose weights it holds between steps
// and those whose optimizer state it keeps (parameters and tensors of each).
typedef struct {
    size_t stage, held, stepped;
    int stage_n, held_n, stepped_n;
} RankShare;

// The parameters of `blocks` blocks of c, `total` in all, that one token computes with
// (model_active_params of a model of those blocks).
static size_t stage_active(const ModelConfig *c, int blocks, size_t total) {
    ModelConfig part = *c;
    part.num_hidden_layers = blocks;
    return model_active_params(&part, total);
}

// Whether the job's ranks are GPUs (their default gradient buckets, train/executor.h).
static bool job_on_gpus(const TrainSpec *spec) {
    return spec->is.device_type == DEVICE_CUDA ||
           (spec->is.device_type == DEVICE_AUTO && backend_cuda_available());
}

// share[d] for each replica d of the stage of blocks [first, end) in a job of `replicas`
// data-parallel replicas.
static int stage_shares(const TrainSpec *spec, const ModelConfig *c, int first, int end,
                        int replicas, RankShare *share, Err *err) {
    LayerParams *layer = calloc((size_t)c->num_hidden_layers, sizeof *layer);
    int(*ranges)[2] = malloc(((size_t)(end - first) + 2) * sizeof *ranges);
    ParamSpec *p = NULL;
    int *owner = NULL, n = 0, ends[3];
    size_t floats = 0;
    int rc = !layer || !ranges ? err_resource(err, "--dry-run: out of memory for a stage's table")
                               : param_table_fill(c, first, end, layer, &p, &n, &floats, ends, err);
    bool sharded = !rc && replicas > 1 && spec->is.parallel_mode != PARALLEL_NONE;
    if (sharded && !(owner = calloc((size_t)n, sizeof *owner)))
        rc = err_resource(err, "--dry-run: out of memory for the shard plan");
    if (sharded && !rc)
        rc = executor_plan_owners(p, n, (const int(*)[2])ranges,
                                  param_table_grad_ranges(c, first, end, layer, ends, n, ranges),
                                  replicas, job_on_gpus(spec),
                                  (size_t)(spec->bucket_mb * (1 << 20)), owner, err);
    for (int d = 0; !rc && d < replicas; d++) {
        RankShare *s = &share[d];
        *s = (RankShare){.stage = floats, .stage_n = n};
        for (int i = 0; i < n; i++) {
            bool owns = !sharded || owner[i] == d;
            bool holds = owns || spec->is.parallel_mode != PARALLEL_FSDP;
            s->held += holds ? p[i].numel : 0, s->held_n += holds;
            s->stepped += owns ? p[i].numel : 0, s->stepped_n += owns;
        }
    }
    free(owner);
    free(p);
    free(ranges);
    free(layer);
    return rc;
}

// One "# rank" line: its stage, the stage's parameters, what it holds and steps (its executor's
// share), and under --ep_size the routed experts it computes.
static void print_rank(const TrainSpec *spec, const ModelConfig *c, int g, int stage,
                       const int *blocks, int replica, int replicas, const RankShare *s) {
    int P = (int)spec->pp_size, first = blocks[stage], end = blocks[stage + 1];
    bool moe = c->ffn_type == FFN_MOE;
    printf("# rank %d: stage %d of %d, ", g, stage, P);
    if (end - first == 1)
        printf("block %d", first);
    else
        printf("blocks %d-%d", first, end - 1);
    printf("%s%s: %zu parameters (%d tensors)", first == 0 ? ", embedding" : "",
           end == c->num_hidden_layers ? ", head" : "", s->stage, s->stage_n);
    if (moe) printf(", %zu active per token", stage_active(c, end - first, s->stage));
    bool sharded = replicas > 1 && spec->is.parallel_mode != PARALLEL_NONE;
    if (!sharded)
        printf("; holds and steps all of them");
    else if (spec->is.parallel_mode == PARALLEL_DDP)
        printf("; ddp: holds all of them, steps %zu (%d tensors)", s->stepped, s->stepped_n);
    else
        printf("; fsdp: holds and steps %zu (%d tensors), gathers the rest for each micro-batch",
               s->held, s->held_n);
    if (moe && spec->ep_size > 1) {
        int E = (int)spec->ep_size, q = replica % E, per = c->n_routed_experts / E;
        printf("; ep: computes routed experts %d-%d of each MoE layer", q * per, (q + 1) * per - 1);
    }
    printf("\n");
}

// The model's parameters (and a MoE model's active ones per token), then what each rank of the
// job (nprocs ranks: replica d of stage s is rank d * pp_size + s) holds.
static int print_ranks(const TrainSpec *spec, const ModelConfig *c, size_t total, Err *err) {
    printf("# model: %zu parameters", total);
    if (c->ffn_type == FFN_MOE)
        printf(" (%zu active per token: %d of %d routed experts)", model_active_params(c, total),
               c->n_activated_experts, c->n_routed_experts);
    printf("\n");
    int P = (int)spec->pp_size, D = (int)(spec->nprocs / spec->pp_size);
    if (D < 1) D = 1;
    int *blocks = malloc(((size_t)P + 1) * sizeof *blocks);
    RankShare *share = calloc((size_t)D * (size_t)P, sizeof *share); // [stage * D + replica]
    int64_t window = spec->window_size ? spec->window_size : c->max_position_embeddings;
    int rc = !blocks || !share ? err_resource(err, "--dry-run: out of memory for %d ranks", D * P)
                               : pipeline_partition(c, P, (long)window, blocks, err);
    for (int st = 0; !rc && st < P; st++)
        rc = stage_shares(spec, c, blocks[st], blocks[st + 1], D, share + (size_t)st * D, err);
    for (int g = 0; !rc && g < D * P; g++)
        print_rank(spec, c, g, g % P, blocks, g / P, D, &share[(size_t)(g % P) * D + g / P]);
    free(share);
    free(blocks);
    return rc;
}

// --dry-run: sets up everything a rank would (model config and weights, dataset shards and
// their ids, checkpoint to resume, optimizer) on the CPU, with progress.db in a scratch
// directory, then prints the model's parameters (a MoE model's active ones per token too), what
// each rank holds and the resolved configuration. 0, or 2 on bad input.
static int dry_run(const TrainSpec *spec) {
    Err err = {0};
    train_spec_warn_ignored(spec, stderr); // one process, not a rank of a job
    const Backend *be;
    char scratch[] = "/tmp/astrai-dry-run-XXXXXX";
    if (check_ckpt_dir(spec->ckpt_dir, &err) || backend_open(&be, BACKEND_CPU, 0, DT_F32, &err)) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        return setup_failed(&err);
    }
    if (!mkdtemp(scratch)) {
        fprintf(stderr, "astrai-train: --dry-run: cannot make a scratch directory\n");
        return 1;
    }
    TrainerOptions opt = {
        .be = be, .threads = 1, .run_dir = scratch, .control_fd = -1, .dry_run = true};
    Trainer t;
    int rc = 0;
    if (trainer_init(&t, spec, &opt, &err)) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        rc = setup_failed(&err);
    } else {
        printf("# astrai-train --dry-run: valid; %ld optimizer steps per the schedule\n",
               t.total_steps);
        if (print_ranks(spec, &t.model.cfg, t.model.num_floats, &err)) {
            fprintf(stderr, "astrai-train: %s\n", err.msg);
            rc = setup_failed(&err);
        } else {
            train_spec_print(spec, stdout);
        }
    }
    trainer_free(&t);
    if (fs_remove_tree(scratch, &err)) fprintf(stderr, "warning: %s\n", err.msg);
    return rc;
}

// What a supervisor (astraid) hands a rank in its environment, read here once:
// ASTRAI_RUN_DIR (where progress.db goes), ASTRAI_MEMORY_REPORT (a directory for the ranks'
// resident memory reports), ASTRAI_CONTROL_FD (the control pipe). Unset or empty: none.
static TrainerOptions supervisor_env(void) {
    const char *run_dir = getenv("ASTRAI_RUN_DIR"), *report = getenv("ASTRAI_MEMORY_REPORT");
    const char *fd = getenv("ASTRAI_CONTROL_FD");
    return (TrainerOptions){.run_dir = run_dir && *run_dir ? run_dir : NULL,
                            .memory_report = report && *report ? report : NULL,
                            .control_fd = fd && *fd ? atoi(fd) : -1};
}

int main(int argc, char **argv) {
    TrainSpec spec;
    Err err = {0};
    bool help;
    json_init();
    if (train_spec_defaults(&spec, &err) || train_spec_parse_args(&spec, argc, argv, &help, &err) ||
        (!help && (train_spec_validate(&spec, &err) || resolve_backend(&spec, &err)))) {
        fprintf(stderr, "astrai-train: %s\n", err.msg);
        train_spec_free(&spec);
        return err_exit_status(&err);
    }
    if (help) {
        train_spec_print_help("astrai-train");
        train_spec_free(&spec);
        return 0;
    }
    TrainerOptions env = supervisor_env();
    int rc = spec.dry_run ? dry_run(&spec) : run(&spec, &env, argv);
    train_spec_free(&spec);
    return rc;
}
