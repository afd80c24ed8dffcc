// fake_nvml.c: a stand-in libnvidia-ml.so.1 for the astraid GPU tests
// (tests/test_daemon_gpu.py). Real NVML needs an NVIDIA driver and GPUs, which the
// machines that run the test suite do not have; this library exports the few NVML
// functions astraid uses, with NVML's real signatures and struct layouts (nvml.h),
// so astraid's own dlopen/dlsym code path is what gets tested.
//
// The GPUs are read, at every call, from the text file named by $FAKE_NVML_FILE
// (nvmlInit_v2 fails with NVML_ERROR_DRIVER_NOT_LOADED when it is unset or missing),
// one GPU per line, '#' starts a comment:
//
//   MEMORY_TOTAL_BYTES MEMORY_USED_BYTES UTILIZATION_PCT PROCESS_BYTES NAME...
//   150000000000 2147483648 87 1073741824 Fake H200
//
// UTILIZATION_PCT "-" makes nvmlDeviceGetUtilizationRates answer NOT_SUPPORTED.
//
// The GPU's health (astraid's preflight): words retired=N (pages retired for double-bit ECC
// errors), pending=1 (a retirement waits for a reset) and ecc=N (volatile uncorrected ECC
// errors) before NAME; without them the three calls answer NOT_SUPPORTED.
//
// Compute processes: a process runs on GPU i when its environment (read from
// /proc/PID/environ) has CUDA_VISIBLE_DEVICES whose LOCAL_RANK-th entry (LOCAL_RANK
// defaults to 0) is i — the GPU a rank of astraid picks — and it uses PROCESS_BYTES
// of that GPU's line. Built with -DFAKE_NVML_NO_V3 it lacks
// nvmlDeviceGetComputeRunningProcesses_v3 (an older driver): astraid must then use
// the plain call with the legacy struct.
#include <ctype.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

// ---------------------------------------------------------------- nvml.h

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct nvmlMemory_st {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct nvmlUtilization_st {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct nvmlProcessInfo_v1_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct nvmlProcessInfo_v2_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_v2_t, nvmlProcessInfo_t;

// ---------------------------------------------------------------- the GPUs file

#define MAX_GPUS 64
#define MAX_PROCS 4096

struct nvmlDevice_st {
    unsigned int index;
};

typedef struct {
    unsigned long long total, used, proc_bytes;
    int util;                        // -1: not supported
    long long retired, pending, ecc; // -1: not supported
    char name[128];
} FakeGpu;

// Takes the leading "key=N" health words off name.
static const char *read_health(FakeGpu *g, const char *name) {
    g->retired = g->pending = g->ecc = -1;
    for (;;) {
        long long v;
        int used = 0;
        if (sscanf(name, "retired=%lld %n", &v, &used) == 1 && used)
            g->retired = v;
        else if (sscanf(name, "pending=%lld %n", &v, &used) == 1 && used)
            g->pending = v;
        else if (sscanf(name, "ecc=%lld %n", &v, &used) == 1 && used)
            g->ecc = v;
        else
            return name;
        name += used;
    }
}

static struct nvmlDevice_st handles[MAX_GPUS];
static int init_count;

// Reads $FAKE_NVML_FILE into gpus; the number of GPUs, -1 when it cannot be read.
static int read_gpus(FakeGpu *gpus) {
    const char *path = getenv("FAKE_NVML_FILE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return -1;
    char line[512];
    int n = 0;
    while (n < MAX_GPUS && fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = 0;
        line[strcspn(line, "\n")] = 0;
        char util[16];
        int name_at = 0;
        FakeGpu *g = &gpus[n];
        if (sscanf(line, "%llu %llu %15s %llu %n", &g->total, &g->used, util, &g->proc_bytes,
                   &name_at) < 4 ||
            !name_at)
            continue;
        g->util = util[0] == '-' ? -1 : atoi(util);
        snprintf(g->name, sizeof g->name, "%s", read_health(g, line + name_at));
        n++;
    }
    fclose(f);
    return n;
}

static nvmlReturn_t get_gpu(nvmlDevice_t device, FakeGpu *out) {
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    if (!device || device < handles || device >= handles + MAX_GPUS)
        return NVML_ERROR_INVALID_ARGUMENT;
    FakeGpu gpus[MAX_GPUS];
    int n = read_gpus(gpus);
    if (n < 0) return NVML_ERROR_UNKNOWN;
    if ((int)device->index >= n) return NVML_ERROR_INVALID_ARGUMENT;
    *out = gpus[device->index];
    return NVML_SUCCESS;
}

// ---------------------------------------------------------------- processes

// The value of NAME in a NUL-separated environment block, or NULL.
static const char *env_value(const char *env, size_t len, const char *name) {
    size_t n = strlen(name);
    for (size_t at = 0; at < len; at += strlen(env + at) + 1)
        if (!strncmp(env + at, name, n) && env[at + n] == '=') return env + at + n + 1;
    return NULL;
}

// The GPU pid's environment picks (see the header), -1 for none.
static int process_gpu(int pid) {
    char path[64], env[65536];
    snprintf(path, sizeof path, "/proc/%d/environ", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t len = 0;
    ssize_t got;
    while (len < sizeof env - 1 && (got = read(fd, env + len, sizeof env - 1 - len)) > 0)
        len += (size_t)got;
    close(fd);
    env[len] = 0;
    const char *visible = env_value(env, len, "CUDA_VISIBLE_DEVICES");
    const char *local = env_value(env, len, "LOCAL_RANK");
    if (!visible || !*visible) return -1;
    int want = local ? atoi(local) : 0;
    for (int k = 0; *visible; k++) {
        char *end;
        long id = strtol(visible, &end, 10);
        if (end == visible) return -1; // a UUID or garbage: not ours
        if (k == want) return (int)id;
        visible = *end == ',' ? end + 1 : end;
    }
    return -1;
}

// Pids of the processes on GPU index (at most cap); the number found (may exceed cap).
static unsigned int processes_on(unsigned int index, unsigned int *pids, unsigned int cap) {
    DIR *d = opendir("/proc");
    if (!d) return 0;
    unsigned int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!isdigit((unsigned char)e->d_name[0])) continue;
        int pid = atoi(e->d_name);
        if (process_gpu(pid) != (int)index) continue;
        if (n < cap) pids[n] = (unsigned int)pid;
        n++;
    }
    closedir(d);
    return n;
}

// Fills *count entries through put(i, pid, bytes), as NVML does: INSUFFICIENT_SIZE
// with the needed count when there is not room.
static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *count, void *infos,
                                      void (*put)(void *, unsigned int, unsigned int,
                                                  unsigned long long)) {
    FakeGpu g;
    nvmlReturn_t rc = get_gpu(device, &g);
    if (rc) return rc;
    if (!count || (*count && !infos)) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int pids[MAX_PROCS];
    unsigned int n = processes_on(device->index, pids, MAX_PROCS);
    if (n > *count) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++)
        put(infos, i, pids[i], g.proc_bytes);
    *count = n;
    return NVML_SUCCESS;
}

static void put_v1(void *infos, unsigned int i, unsigned int pid, unsigned long long bytes) {
    ((nvmlProcessInfo_v1_t *)infos)[i] = (nvmlProcessInfo_v1_t){pid, bytes};
}

#ifndef FAKE_NVML_NO_V3
static void put_v2(void *infos, unsigned int i, unsigned int pid, unsigned long long bytes) {
    ((nvmlProcessInfo_t *)infos)[i] = (nvmlProcessInfo_t){pid, bytes, 0xFFFFFFFFu, 0xFFFFFFFFu};
}
#endif

// ---------------------------------------------------------------- the API

EXPORT nvmlReturn_t nvmlInit_v2(void) {
    FakeGpu gpus[MAX_GPUS];
    if (read_gpus(gpus) < 0) return NVML_ERROR_DRIVER_NOT_LOADED;
    for (unsigned int i = 0; i < MAX_GPUS; i++)
        handles[i].index = i;
    init_count++;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t rc) {
    switch (rc) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
        return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED:
        return "Driver Not Loaded";
    default:
        return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!init_count) return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    FakeGpu gpus[MAX_GPUS];
    int n = read_gpus(gpus);
    if (n < 0) return NVML_ERROR_UNKNOWN;
    *deviceCount = (unsigned int)n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    unsigned int n;
    nvmlReturn_t rc = nvmlDeviceGetCount_v2(&n);
    if (rc) return rc;
    if (index >= n || !device) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &handles[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    FakeGpu g;
    nvmlReturn_t rc = get_gpu(device, &g);
    if (rc) return rc;
    if (!name) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(g.name) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(name, g.name, strlen(g.name) + 1);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    FakeGpu g;
    nvmlReturn_t rc = get_gpu(device, &g);
    if (rc) return rc;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    *memory = (nvmlMemory_t){.total = g.total, .used = g.used, .free = g.total - g.used};
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                  nvmlUtilization_t *utilization) {
    FakeGpu g;
    nvmlReturn_t rc = get_gpu(device, &g);
    if (rc) return rc;
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    if (g.util < 0) return NVML_ERROR_NOT_SUPPORTED;
    *utilization = (nvmlUtilization_t){.gpu = (unsigned int)g.util, .memory = 0};
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device,
                                                         unsigned int *infoCount,
                                                         nvmlProcessInfo_v1_t *infos) {
    return running_processes(device, infoCount, infos, put_v1);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause,
                                              unsigned int *pageCount,
                                              unsigned long long *addresses) {
    FakeGpu g;
    nvmlReturn_t rc = get_gpu(device, &g);
    if (rc) return rc;
    if (!pageCount || (*pageCount && !addresses)) return NVML_ERROR_INVALID_ARGUMENT;
    if (g.retired < 0) return NVML_ERROR_NOT_SUPPORTED;
    unsigned int n = cause == 1 ? (unsigned int)g.retired : 0; // all double-bit
    if (n > *pageCount) {
        *pageCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < n; i++)
        addresses[i] = 0x1000ull * (i + 1);
    *pageCount = n;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *isPending) {
    FakeGpu g;
    nvmlReturn_t rc = get_gpu(device, &g);
    if (rc) return rc;
    if (!isPending) return NVML_ERROR_INVALID_ARGUMENT;
    if (g.pending < 0) return NVML_ERROR_NOT_SUPPORTED;
    *isPending = g.pending != 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                                unsigned long long *eccCounts) {
    FakeGpu g;
    nvmlReturn_t rc = get_gpu(device, &g);
    if (rc) return rc;
    if (!eccCounts) return NVML_ERROR_INVALID_ARGUMENT;
    if (g.ecc < 0) return NVML_ERROR_NOT_SUPPORTED;
    *eccCounts = errorType == 1 && counterType == 0 ? (unsigned long long)g.ecc : 0;
    return NVML_SUCCESS;
}

#ifndef FAKE_NVML_NO_V3
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                            unsigned int *infoCount,
                                                            nvmlProcessInfo_t *infos) {
    return running_processes(device, infoCount, infos, put_v2);
}
#endif
