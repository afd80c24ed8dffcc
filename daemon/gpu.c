// gpu.c: the GPUs as NVML sees them (docs/design.md §1): how many, their names, memory and
// utilisation, and the memory each process uses on each.
//
// NVML is loaded with dlopen("libnvidia-ml.so.1"), so astraid starts on machines
// without a driver, and astraid never initialises CUDA itself. This is the one NVML
// loader of astraid: scheduler.c counts the GPUs with gpu_count().
//
// Request handlers never call NVML: they read a cache. The cache is filled once at
// startup and then every SAMPLE_MS by a libuv timer that hands the NVML calls to the
// threadpool (uv_queue_work); the finished sample replaces the cache on the loop
// thread. NVML calls are usually quick, but a GPU that has fallen off the bus can
// make them slow, and the loop must never wait for that. Without NVML or GPUs there
// is no timer and every list is empty.
//
// Each sample also reads a GPU's health where the driver says (preflight.c): its retired pages
// (both causes) and whether a retirement waits for a reset, and its uncorrected ECC errors since
// the driver loaded (volatile).
//
// GPU indices are NVML's (PCI bus order); runner.c sets CUDA_DEVICE_ORDER=PCI_BUS_ID
// for the ranks so that CUDA numbers the GPUs the same way.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "daemon/daemon.h"

#define SAMPLE_MS 2000
#define NAME_BYTES 96 // NVML_DEVICE_NAME_V2_BUFFER_SIZE
#define PROCS_FIRST 64
#define PROCS_MAX 65536

// ---------------------------------------------------------------- NVML's ABI (nvml.h)

typedef int nvmlReturn_t;
enum { NVML_SUCCESS = 0, NVML_ERROR_INSUFFICIENT_SIZE = 7 };
#define NVML_VALUE_NOT_AVAILABLE_ULL (~0ULL) // usedGpuMemory unknown (e.g. under WDDM)

typedef struct nvmlDevice_st *nvmlDevice_t;

// nvmlDeviceGetRetiredPages' causes, nvmlDeviceGetTotalEccErrors' error and counter types.
enum { NVML_PAGE_RETIREMENT_CAUSE_SBE = 0, NVML_PAGE_RETIREMENT_CAUSE_DBE = 1 };
enum { NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1, NVML_VOLATILE_ECC = 0 };

typedef struct {
    unsigned long long total, free, used; // bytes
} nvmlMemory_t;

typedef struct {
    unsigned int gpu, memory; // percent of the last sample period
} nvmlUtilization_t;

// nvmlDeviceGetComputeRunningProcesses (the plain symbol, legacy layout).
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

// nvmlDeviceGetComputeRunningProcesses_v3 (nvmlProcessInfo_t = nvmlProcessInfo_v2_t).
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_v2_t;

// ---------------------------------------------------------------- state

typedef struct {
    pid_t pid;
    int64_t bytes; // -1: NVML does not say
} GpuProc;

// What one sample found on one GPU; -1 where the call failed (or the driver does not say).
typedef struct {
    int64_t mem_total, mem_used;
    int util_pct;
    GpuProc *procs; // (n_procs,)
    int n_procs;
    GpuHealth health;
    // NVML's return codes, logged on the loop thread
    nvmlReturn_t rc_mem, rc_util, rc_procs;
} GpuSample;

typedef nvmlReturn_t (*InitFn)(void);
typedef nvmlReturn_t (*CountFn)(unsigned int *);
typedef nvmlReturn_t (*HandleFn)(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t (*NameFn)(nvmlDevice_t, char *, unsigned int);
typedef nvmlReturn_t (*MemoryFn)(nvmlDevice_t, nvmlMemory_t *);
typedef nvmlReturn_t (*UtilFn)(nvmlDevice_t, nvmlUtilization_t *);
typedef nvmlReturn_t (*ProcsV3Fn)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_v2_t *);
typedef nvmlReturn_t (*ProcsV1Fn)(nvmlDevice_t, unsigned int *, nvmlProcessInfo_v1_t *);
typedef const char *(*ErrorStringFn)(nvmlReturn_t);
typedef nvmlReturn_t (*RetiredFn)(nvmlDevice_t, int, unsigned int *, unsigned long long *);
typedef nvmlReturn_t (*PendingFn)(nvmlDevice_t, int *);
typedef nvmlReturn_t (*EccFn)(nvmlDevice_t, int, int, unsigned long long *);

static struct {
    void *lib;
    InitFn init, shutdown;
    CountFn count;
    HandleFn handle;
    NameFn name;
    MemoryFn memory;
    UtilFn util;
    ProcsV3Fn procs_v3; // NULL on older drivers: then procs_v1
    ProcsV1Fn procs_v1;
    ErrorStringFn error_string;
    RetiredFn retired; // the health calls: NULL where the driver lacks them (unknown)
    PendingFn pending;
    EccFn ecc;
    int initialised;
    int n;                 // GPUs
    nvmlDevice_t *handles; // (n,) NULL where NVML gave none
    char (*names)[NAME_BYTES];
    GpuSample *cache;       // (n,) the last finished sample: what requests read
    GpuSample *next;        // (n,) the sample under way on the threadpool
    nvmlReturn_t logged[3]; // the last failure logged per call kind, to log changes only
    uv_timer_t timer;
    uv_work_t work;
    int busy; // a sample is under way
} nv;

static const char *nvml_error(nvmlReturn_t rc) {
    const char *s = nv.error_string ? nv.error_string(rc) : NULL;
    return s ? s : "unknown error";
}

// ---------------------------------------------------------------- sampling (any thread)

static void sample_clear(GpuSample *s) {
    free(s->procs);
    *s = (GpuSample){.mem_total = -1,
                     .mem_used = -1,
                     .util_pct = -1,
                     .health = {.retired_pages = -1, .retired_pending = -1, .ecc_uncorrected = -1}};
}

// Retired pages of both causes (NVML counts them with no room for addresses), pending
// retirements, volatile uncorrected ECC errors; -1 where the driver does not say (a GPU that
// remaps rows instead of retiring pages, ECC off).
static void sample_health(nvmlDevice_t h, GpuHealth *out) {
    unsigned int sbe = 0, dbe = 0;
    nvmlReturn_t a = nv.retired ? nv.retired(h, NVML_PAGE_RETIREMENT_CAUSE_SBE, &sbe, NULL) : -1;
    nvmlReturn_t b = nv.retired ? nv.retired(h, NVML_PAGE_RETIREMENT_CAUSE_DBE, &dbe, NULL) : -1;
    int ok_a = a == NVML_SUCCESS || a == NVML_ERROR_INSUFFICIENT_SIZE;
    int ok_b = b == NVML_SUCCESS || b == NVML_ERROR_INSUFFICIENT_SIZE;
    if (ok_a && ok_b) out->retired_pages = (int64_t)sbe + dbe;
    int pending = 0;
    if (nv.pending && nv.pending(h, &pending) == NVML_SUCCESS) out->retired_pending = pending != 0;
    unsigned long long ecc = 0;
    if (nv.ecc &&
        nv.ecc(h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, &ecc) == NVML_SUCCESS)
        out->ecc_uncorrected = (int64_t)ecc;
}

// The compute processes on one GPU: _v3 when the driver has it, else the legacy call.
static nvmlReturn_t sample_procs(nvmlDevice_t h, GpuSample *s) {
    unsigned int cap = PROCS_FIRST;
    for (;;) {
        size_t size = nv.procs_v3 ? sizeof(nvmlProcessInfo_v2_t) : sizeof(nvmlProcessInfo_v1_t);
        void *buf = calloc(cap, size);
        GpuProc *out = calloc(cap, sizeof *out);
        if (!buf || !out) {
            free(buf);
            free(out);
            return -1;
        }
        unsigned int n = cap;
        nvmlReturn_t rc = nv.procs_v3 ? nv.procs_v3(h, &n, buf) : nv.procs_v1(h, &n, buf);
        for (unsigned int i = 0; rc == NVML_SUCCESS && i < n && i < cap; i++) {
            unsigned long long used = nv.procs_v3 ? ((nvmlProcessInfo_v2_t *)buf)[i].usedGpuMemory
                                                  : ((nvmlProcessInfo_v1_t *)buf)[i].usedGpuMemory;
            out[i].pid = (pid_t)(nv.procs_v3 ? ((nvmlProcessInfo_v2_t *)buf)[i].pid
                                             : ((nvmlProcessInfo_v1_t *)buf)[i].pid);
            out[i].bytes = used == NVML_VALUE_NOT_AVAILABLE_ULL ? -1 : (int64_t)used;
        }
        free(buf);
        // More processes than room (they come and go): again with the room NVML asked for.
        if (rc == NVML_ERROR_INSUFFICIENT_SIZE && n > cap && cap < PROCS_MAX) {
            free(out);
            cap = n + 16 < PROCS_MAX ? n + 16 : PROCS_MAX;
            continue;
        }
        if (rc != NVML_SUCCESS) {
            free(out);
            return rc;
        }
        s->procs = out;
        s->n_procs = (int)(n < cap ? n : cap);
        return rc;
    }
}

static void sample_gpu(int i, GpuSample *s) {
    sample_clear(s);
    nvmlDevice_t h = nv.handles[i];
    if (!h) return;
    nvmlMemory_t mem;
    s->rc_mem = nv.memory(h, &mem);
    if (s->rc_mem == NVML_SUCCESS) {
        s->mem_total = (int64_t)mem.total;
        s->mem_used = (int64_t)mem.used;
    }
    nvmlUtilization_t util;
    s->rc_util = nv.util(h, &util);
    if (s->rc_util == NVML_SUCCESS) s->util_pct = (int)util.gpu;
    s->rc_procs = sample_procs(h, s);
    sample_health(h, &s->health);
}

static void sample_all(GpuSample *s) {
    for (int i = 0; i < nv.n; i++)
        sample_gpu(i, &s[i]);
}

// ---------------------------------------------------------------- the cache (loop thread)

// Logs a failing call once, and again only when its error changes.
static void log_failure(int kind, const char *call, int gpu, nvmlReturn_t rc) {
    if (rc == NVML_SUCCESS || rc == nv.logged[kind]) return;
    nv.logged[kind] = rc;
    if (rc < 0)
        log_warn("gpu %d: %s: out of memory", gpu, call);
    else
        log_warn("gpu %d: NVML %s failed: %s (error %d); shown as unknown", gpu, call,
                 nvml_error(rc), rc);
}

static void take_sample(void) {
    for (int i = 0; i < nv.n; i++) {
        log_failure(0, "nvmlDeviceGetMemoryInfo", i, nv.next[i].rc_mem);
        log_failure(1, "nvmlDeviceGetUtilizationRates", i, nv.next[i].rc_util);
        log_failure(2,
                    nv.procs_v3 ? "nvmlDeviceGetComputeRunningProcesses_v3"
                                : "nvmlDeviceGetComputeRunningProcesses",
                    i, nv.next[i].rc_procs);
    }
    GpuSample *old = nv.cache;
    nv.cache = nv.next;
    nv.next = old;
}

static void on_sample_work(uv_work_t *w) {
    (void)w;
    sample_all(nv.next);
}

static void on_sample_done(uv_work_t *w, int status) {
    (void)w;
    nv.busy = 0;
    if (status == 0) take_sample();
}

static void on_timer(uv_timer_t *t) {
    (void)t;
    if (nv.busy) return; // the last sample is still under way (a slow driver): skip a beat
    if (uv_queue_work(astraid.loop, &nv.work, on_sample_work, on_sample_done) == 0) nv.busy = 1;
}

// ---------------------------------------------------------------- loading

static void *sym(const char *name, int required) {
    void *p = dlsym(nv.lib, name);
    if (!p && required) log_warn("NVML: libnvidia-ml.so.1 has no %s; no GPUs", name);
    return p;
}

static int load_symbols(void) {
    nv.init = (InitFn)sym("nvmlInit_v2", 1);
    nv.shutdown = (InitFn)sym("nvmlShutdown", 1);
    nv.count = (CountFn)sym("nvmlDeviceGetCount_v2", 1);
    nv.handle = (HandleFn)sym("nvmlDeviceGetHandleByIndex_v2", 1);
    nv.name = (NameFn)sym("nvmlDeviceGetName", 1);
    nv.memory = (MemoryFn)sym("nvmlDeviceGetMemoryInfo", 1);
    nv.util = (UtilFn)sym("nvmlDeviceGetUtilizationRates", 1);
    nv.procs_v3 = (ProcsV3Fn)sym("nvmlDeviceGetComputeRunningProcesses_v3", 0);
    nv.procs_v1 = (ProcsV1Fn)sym("nvmlDeviceGetComputeRunningProcesses", !nv.procs_v3);
    nv.error_string = (ErrorStringFn)sym("nvmlErrorString", 0);
    nv.retired = (RetiredFn)sym("nvmlDeviceGetRetiredPages", 0);
    nv.pending = (PendingFn)sym("nvmlDeviceGetRetiredPagesPendingStatus", 0);
    nv.ecc = (EccFn)sym("nvmlDeviceGetTotalEccErrors", 0);
    return nv.init && nv.shutdown && nv.count && nv.handle && nv.name && nv.memory && nv.util &&
                   (nv.procs_v3 || nv.procs_v1)
               ? 0
               : -1;
}

// nvmlInit_v2 and the device handles and names; 0 GPUs on any failure.
static int open_nvml(void) {
    nv.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!nv.lib) {
        log_debug("NVML: %s; no GPUs", dlerror());
        return 0;
    }
    if (load_symbols()) return 0;
    nvmlReturn_t rc = nv.init();
    if (rc != NVML_SUCCESS) {
        log_warn("NVML: nvmlInit_v2 failed: %s (error %d); no GPUs", nvml_error(rc), rc);
        return 0;
    }
    nv.initialised = 1;
    unsigned int n = 0;
    if ((rc = nv.count(&n)) != NVML_SUCCESS) {
        log_warn("NVML: nvmlDeviceGetCount_v2 failed: %s (error %d); no GPUs", nvml_error(rc), rc);
        return 0;
    }
    return (int)(n > 4096 ? 4096 : n);
}

static int alloc_gpus(int n) {
    nv.handles = calloc((size_t)n, sizeof *nv.handles);
    nv.names = calloc((size_t)n, sizeof *nv.names);
    nv.cache = calloc((size_t)n, sizeof *nv.cache);
    nv.next = calloc((size_t)n, sizeof *nv.next);
    if (!nv.handles || !nv.names || !nv.cache || !nv.next) {
        log_error("NVML: out of memory for %d GPUs; no GPUs", n);
        return -1;
    }
    nv.n = n;
    return 0;
}

void gpu_init(void) {
    int n = open_nvml();
    if (n <= 0 || alloc_gpus(n)) {
        gpu_free();
        return;
    }
    for (int i = 0; i < n; i++) {
        nvmlReturn_t rc = nv.handle((unsigned int)i, &nv.handles[i]);
        if (rc != NVML_SUCCESS) {
            log_warn("gpu %d: NVML nvmlDeviceGetHandleByIndex_v2 failed: %s (error %d); its "
                     "name and use are unknown",
                     i, nvml_error(rc), rc);
            nv.handles[i] = NULL;
        }
        if (!nv.handles[i] || nv.name(nv.handles[i], nv.names[i], NAME_BYTES) != NVML_SUCCESS)
            snprintf(nv.names[i], NAME_BYTES, "unknown");
        nv.names[i][NAME_BYTES - 1] = 0;
    }
    sample_all(nv.next); // the first sample before serving, so daemon.info has it at once
    take_sample();
    uv_timer_init(astraid.loop, &nv.timer);
    uv_timer_start(&nv.timer, on_timer, SAMPLE_MS, SAMPLE_MS);
    log_info("NVML: %d GPU(s); processes from %s, sampled every %d ms", n,
             nv.procs_v3 ? "nvmlDeviceGetComputeRunningProcesses_v3"
                         : "nvmlDeviceGetComputeRunningProcesses (legacy)",
             SAMPLE_MS);
    for (int i = 0; i < n; i++)
        log_info("gpu %d: %s, %.1f GiB", i, nv.names[i],
                 nv.cache[i].mem_total >= 0 ? (double)nv.cache[i].mem_total / (1 << 30) : 0.0);
}

// After uv_run returned: the timer is closed (uv_walk at shutdown) and no sample is
// under way (uv_run waits for queued work).
void gpu_free(void) {
    for (int i = 0; i < nv.n; i++) {
        free(nv.cache[i].procs);
        free(nv.next[i].procs);
    }
    free(nv.handles);
    free(nv.names);
    free(nv.cache);
    free(nv.next);
    if (nv.initialised) nv.shutdown();
    if (nv.lib) dlclose(nv.lib);
    memset(&nv, 0, sizeof nv);
}

// ---------------------------------------------------------------- queries (from the cache)

int gpu_count(void) {
    return nv.n;
}

int gpu_utilization(int index) {
    return index >= 0 && index < nv.n ? nv.cache[index].util_pct : -1;
}

int64_t gpu_process_memory(int index, pid_t pid) {
    if (index < 0 || index >= nv.n || pid <= 0) return -1;
    const GpuSample *s = &nv.cache[index];
    for (int k = 0; k < s->n_procs; k++)
        if (s->procs[k].pid == pid) return s->procs[k].bytes;
    return -1; // not listed: no CUDA context yet, or another pid namespace
}

int gpu_health(int index, GpuHealth *out) {
    if (index < 0 || index >= nv.n) return -1;
    *out = nv.cache[index].health;
    return 0;
}

int gpu_processes(int index, pid_t *pids, int64_t *bytes, int cap) {
    if (index < 0 || index >= nv.n) return 0;
    const GpuSample *s = &nv.cache[index];
    for (int k = 0; k < s->n_procs && k < cap; k++) {
        pids[k] = s->procs[k].pid;
        bytes[k] = s->procs[k].bytes;
    }
    return s->n_procs;
}

static void add_count(cJSON *o, const char *key, int64_t v) {
    if (v >= 0)
        cJSON_AddNumberToObject(o, key, (double)v);
    else
        cJSON_AddNullToObject(o, key);
}

// [{"index":0,"name":"NVIDIA H200","memory_total_bytes":...,"memory_used_bytes":...,
//   "utilization_pct":87}, ...] (docs/protocol.md, daemon.info)
cJSON *gpus_to_json(void) {
    cJSON *list = cJSON_CreateArray();
    for (int i = 0; i < nv.n; i++) {
        cJSON *g = cJSON_CreateObject();
        cJSON_AddNumberToObject(g, "index", i);
        cJSON_AddStringToObject(g, "name", nv.names[i]);
        add_count(g, "memory_total_bytes", nv.cache[i].mem_total);
        add_count(g, "memory_used_bytes", nv.cache[i].mem_used);
        add_count(g, "utilization_pct", nv.cache[i].util_pct);
        cJSON_AddItemToArray(list, g);
    }
    return list;
}
