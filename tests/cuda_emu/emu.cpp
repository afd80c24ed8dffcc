// emu.cpp: the scheduler behind emu.h: runs a kernel launch block by block, one fiber
// (ucontext) per CUDA thread, all on the calling OS thread, and implements __syncthreads,
// warp-collective operations (shuffles; ldmatrix and mma.sync compute in mma.cpp), dynamic
// shared memory, cp.async and the few runtime calls the ops make (cudaMemcpyAsync, ...).
//
// Within a block, warp by warp (in order, or the reverse: emu::set_reverse), the scheduler
// resumes each lane of the warp that can run until it ends or waits at a barrier, and
// releases the warp once its 32 lanes all wait at the same warp-collective operation (its
// compute runs on the lanes' operands before any lane runs on), until the warp has ended or
// waits at __syncthreads; then the next warp. So warps drift as far apart as CUDA allows,
// and a missing __syncthreads between a shared-memory write and another warp's read shows.
// Once every live thread waits at __syncthreads, the block goes on.
// Anything else is an error CUDA leaves undefined (a hang or garbage on the GPU), reported
// with the launch site, block and thread: a barrier some threads skipped by returning
// early, a warp-collective operation with exited lanes, or threads waiting at different
// barriers.
//
// cp.async (PTX ISA, "Data Movement and Conversion Instructions: cp.async"): each thread
// keeps its copies in flight, oldest first; commit_group closes the ones not yet committed
// into a group, wait_group N completes all but the N most recent committed groups. Only
// then do the bytes land in shared memory: until that wait the destination holds 0xff
// (poison), so a read too early, or by another thread before a __syncthreads, sees NaNs.
// A thread that ends with copies in flight (uncommitted, or committed and not waited for)
// is an error, as is a misaligned address or one outside the dynamic shared memory.
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <deque>
#include <map>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "tests/cuda_emu/emu.h"

namespace emu {

uint3 thread_idx, block_idx;
dim3 block_dim, grid_dim;

namespace {

enum State { kReady, kAtSync, kAtWarp, kDone };

// A cp.async copy in flight: its source bytes (read at issue) and where they land.
struct Copy {
    unsigned char *dst;
    unsigned char data[16];
    int bytes;
};

struct Fiber {
    ucontext_t ctx;
    char *stack;
    State state;
    // at a barrier: __syncthreads_or or a plain __syncthreads; the predicate in, the OR out
    bool bar_or;
    int pred;
    // at a warp-collective operation: which, and this lane's operands and result
    const char *what;
    WarpCompute compute;
    const void *in;
    void *out;
    // cp.async: the copies in flight, oldest first: committed groups of groups[0],
    // groups[1], ... copies (oldest first), then `uncommitted` more
    std::vector<Copy> copies;
    std::deque<size_t> groups;
    size_t uncommitted;
};

// Per-thread stack: the kernels need little, but unoptimised (-O0) builds and deep
// inlining take more; untouched pages cost nothing. A PROT_NONE page below catches overflow.
constexpr size_t kStackBytes = 256 << 10;

// Dynamic shared memory: at most 48 KiB unless the kernel opted in to more
// (cudaFuncAttributeMaxDynamicSharedMemorySize), up to 163 KiB: sm_80's limit, the smallest
// of the GPUs built for (sm_90: 227 KiB).
constexpr size_t kDefaultShared = 48 << 10, kMaxShared = 163 << 10;

std::deque<Fiber> fibers; // stable addresses: a ucontext_t points into itself
ucontext_t scheduler;
int current = -1; // the running fiber, -1 outside kernels
void (*run_invoke)(void *);
void *run_closure;
const Config *run_cfg;
cudaError_t last_error = cudaSuccess;
bool reverse = false;
Stats stats;
std::map<KernelId, size_t> max_shared; // the opt-ins, per kernel
unsigned char *shared_end;             // an unmapped page starts here
unsigned char *shared_base;            // the running launch's dynamic shared memory
size_t shared_bytes;

void set_thread(int t) {
    const dim3 &b = run_cfg->block;
    thread_idx = {t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
}

[[noreturn]] void vfail(int t, const char *fmt, va_list ap) {
    fprintf(stderr, "cuda_emu: ");
    vfprintf(stderr, fmt, ap);
    if (run_cfg) {
        fprintf(stderr,
                "\n  in the kernel launched at %s:%d, grid (%u,%u,%u), block (%u,%u,%u); "
                "at block (%u,%u,%u)",
                run_cfg->file, run_cfg->line, run_cfg->grid.x, run_cfg->grid.y, run_cfg->grid.z,
                run_cfg->block.x, run_cfg->block.y, run_cfg->block.z, block_idx.x, block_idx.y,
                block_idx.z);
        if (run_cfg->shmem)
            fprintf(stderr, " (%zu bytes of dynamic shared memory)", run_cfg->shmem);
        if (t >= 0) {
            set_thread(t);
            fprintf(stderr, ", thread (%u,%u,%u)", thread_idx.x, thread_idx.y, thread_idx.z);
        }
    }
    fprintf(stderr, "\n");
    abort();
}

[[noreturn]] __attribute__((format(printf, 2, 3))) void fail(int t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(t, fmt, ap);
}

// `bytes` of fresh memory between two unmapped pages (less than a page of slack below it,
// none above), so that a run past either end faults: a fiber's stack overflowing, an index
// past the dynamic shared memory.
unsigned char *map_guarded(size_t bytes) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), mapped = (bytes + page - 1) / page * page;
    void *p = mmap(nullptr, mapped + 2 * page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
        fprintf(stderr, "cuda_emu: mmap of %zu bytes: %s\n", bytes, strerror(errno));
        abort();
    }
    unsigned char *end = (unsigned char *)p + page + mapped;
    mprotect(p, page, PROT_NONE);
    mprotect(end, page, PROT_NONE);
    return end - bytes;
}

void grow(size_t n) {
    while (fibers.size() < n) {
        fibers.emplace_back();
        fibers.back().stack = (char *)map_guarded(kStackBytes);
        // Once: makecontext needs a context from getcontext (a system call); a fiber's
        // context, saved by swapcontext when it last ran, serves again afterwards.
        getcontext(&fibers.back().ctx);
    }
}

// A fault in a kernel (out of bounds, or a misaligned 16-byte access, which faults on the
// GPU too) names the launch, block and thread, from an alternate stack (the fiber's may be
// what overflowed).
void on_fault(int sig, siginfo_t *info, void *) {
    if (run_cfg) // else return: the handler is reset, the fault repeats and kills as usual
        fail(current, "%s at address %p: an access out of bounds, or a vector access misaligned",
             sig == SIGBUS ? "SIGBUS" : "SIGSEGV", info->si_addr);
}

struct FaultHandler {
    FaultHandler() {
        static char alt[1 << 16];
        stack_t ss = {};
        ss.ss_sp = alt;
        ss.ss_size = sizeof alt;
        sigaltstack(&ss, nullptr);
        struct sigaction sa = {};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
        sigaction(SIGSEGV, &sa, nullptr);
        sigaction(SIGBUS, &sa, nullptr);
    }
} fault_handler;

// The running thread's fiber, for `what` (which only a kernel may do).
Fiber &running(const char *what) {
    if (current < 0) fail(-1, "%s outside a kernel", what);
    return fibers[current];
}

void trampoline() {
    run_invoke(run_closure);
    Fiber &f = fibers[current];
    if (!f.copies.empty())
        fail(current,
             "the thread returns with %zu cp.async copies in flight (%zu of them not "
             "committed): undefined on the GPU (wait_group 0 before the end)",
             f.copies.size(), f.uncommitted);
    f.groups.clear();
    f.state = kDone;
    swapcontext(&fibers[current].ctx, &scheduler); // never resumed
}

// Parks the running thread in state s until the scheduler releases it.
void wait_as(State s) {
    fibers[current].state = s;
    swapcontext(&fibers[current].ctx, &scheduler);
}

// Releases the warp [lo, hi) if all its lanes wait at a warp-collective operation (running
// its compute); fails on a warp that can never complete. Returns whether it released.
bool release_warp(int lo, int hi) {
    int waiting = 0, done = 0, first = -1;
    for (int t = lo; t < hi; t++) {
        if (fibers[t].state == kAtWarp) {
            waiting++;
            if (first < 0) first = t;
        }
        done += fibers[t].state == kDone;
    }
    if (waiting == 0) return false;
    const Fiber &f0 = fibers[first];
    if (hi - lo < 32)
        fail(first, "%s in a partial warp (%d threads): the block size is not a multiple of 32",
             f0.what, hi - lo);
    if (done)
        fail(first,
             "%s that %d lane(s) of the warp never reach (they returned): undefined on the GPU",
             f0.what, done);
    if (waiting < hi - lo) return false; // lanes at __syncthreads: a deadlock unless resolved
    const void *in[32];
    void *out[32];
    for (int t = lo; t < hi; t++) {
        const Fiber &f = fibers[t];
        if (f.compute != f0.compute)
            fail(t, "lanes of one warp at different warp-wide operations (%s and %s)", f.what,
                 f0.what);
        in[t - lo] = f.in;
        out[t - lo] = f.out;
    }
    f0.compute(in, out);
    for (int t = lo; t < hi; t++)
        fibers[t].state = kReady;
    return true;
}

// Releases the block's threads, all at __syncthreads (or all at __syncthreads_or: each
// gets the OR of their predicates).
void release_block(int nt) {
    int any = 0;
    for (int t = 0; t < nt; t++) {
        if (fibers[t].bar_or != fibers[0].bar_or)
            fail(t, "threads of the block at different barriers (__syncthreads and "
                    "__syncthreads_or)");
        any |= fibers[t].pred;
    }
    for (int t = 0; t < nt; t++) {
        fibers[t].pred = any;
        fibers[t].state = kReady;
    }
    stats.barriers++;
}

void run_block(int nt) {
    for (int t = 0; t < nt; t++) {
        Fiber &f = fibers[t];
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, trampoline, 0);
        f.state = kReady;
    }
    memset(shared_base, 0xff, shared_bytes); // what the block has not written reads as NaN
    const int warps = (nt + 31) / 32;
    for (;;) {
        // Each warp runs as far as it can (to its end or a __syncthreads) before the next
        // starts: the most skew between warps, so a missing __syncthreads shows.
        for (int k = 0; k < warps; k++) {
            int w = reverse ? warps - 1 - k : k;
            int lo = 32 * w, hi = lo + 32 < nt ? lo + 32 : nt;
            do {
                for (int j = 0; j < hi - lo; j++) {
                    int t = reverse ? hi - 1 - j : lo + j;
                    if (fibers[t].state != kReady) continue;
                    current = t;
                    set_thread(t);
                    swapcontext(&scheduler, &fibers[t].ctx);
                    stats.switches++;
                }
                current = -1;
            } while (release_warp(lo, hi));
        }
        int done = 0, at_sync = 0, first_sync = -1;
        for (int t = 0; t < nt; t++) {
            done += fibers[t].state == kDone;
            if (fibers[t].state == kAtSync && at_sync++ == 0) first_sync = t;
        }
        if (done == nt) return;
        if (at_sync == nt - done) {
            if (done)
                fail(first_sync,
                     "__syncthreads reached by %d thread(s) after %d thread(s) of "
                     "the block returned: undefined on the GPU",
                     at_sync, done);
            release_block(nt);
            continue;
        }
        fail(first_sync,
             "deadlock: %d thread(s) wait at __syncthreads while others wait at a "
             "warp-collective operation",
             at_sync);
    }
}

bool bad_config(const Config &c, KernelId kernel) {
    const dim3 &b = c.block, &g = c.grid;
    unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    auto opt_in = max_shared.find(kernel);
    size_t shared_limit = opt_in == max_shared.end() ? kDefaultShared : opt_in->second;
    char why[200] = "";
    if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0)
        snprintf(why, sizeof why, "an empty grid or block");
    else if (b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024)
        snprintf(why, sizeof why,
                 "more than 1024 threads a block (or a block dimension over its limit)");
    else if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535)
        snprintf(why, sizeof why, "a grid dimension over its limit (2^31-1, 65535, 65535)");
    else if (c.shmem > shared_limit)
        snprintf(why, sizeof why,
                 "%zu bytes of dynamic shared memory, over the kernel's %zu (48 KiB unless "
                 "raised by cudaFuncAttributeMaxDynamicSharedMemorySize)",
                 c.shmem, shared_limit);
    if (!why[0]) return false;
    fprintf(stderr, "cuda_emu: invalid launch at %s:%d, grid (%u,%u,%u), block (%u,%u,%u): %s\n",
            c.file, c.line, g.x, g.y, g.z, b.x, b.y, b.z, why);
    return true;
}

void check_stream(cudaStream_t s, const char *what) {
    if (s != (cudaStream_t)cuda_stream()) {
        fprintf(stderr, "cuda_emu: %s on a stream other than cuda_stream()\n", what);
        abort();
    }
}

} // namespace

void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(current, fmt, ap);
}

cudaError_t set_max_dynamic_shared(KernelId kernel, int bytes) {
    if (bytes < 0 || (size_t)bytes > kMaxShared) return cudaErrorInvalidValue;
    max_shared[kernel] = (size_t)bytes;
    return cudaSuccess;
}

void launch(const Config &c, KernelId kernel, void (*invoke)(void *), void *closure) {
    if (current >= 0 || run_cfg) fail(current, "a kernel launch inside a kernel");
    if (c.stream != (cudaStream_t)cuda_stream()) {
        fprintf(stderr, "cuda_emu: the kernel launched at %s:%d is not on cuda_stream()\n", c.file,
                c.line);
        abort();
    }
    if (bad_config(c, kernel)) {
        last_error = cudaErrorInvalidConfiguration;
        return;
    }
    int nt = (int)(c.block.x * c.block.y * c.block.z);
    grow((size_t)nt);
    if (!shared_end) shared_end = map_guarded(kMaxShared) + kMaxShared;
    shared_bytes = c.shmem;
    shared_base = shared_end - (c.shmem + 15) / 16 * 16;
    run_cfg = &c;
    run_invoke = invoke;
    run_closure = closure;
    grid_dim = c.grid;
    block_dim = c.block;
    unsigned long long blocks = (unsigned long long)c.grid.x * c.grid.y * c.grid.z;
    for (unsigned long long k = 0; k < blocks; k++) {
        unsigned long long b = reverse ? blocks - 1 - k : k;
        block_idx = {(unsigned)(b % c.grid.x), (unsigned)(b / c.grid.x % c.grid.y),
                     (unsigned)(b / ((unsigned long long)c.grid.x * c.grid.y))};
        run_block(nt);
    }
    stats.launches++;
    stats.threads += blocks * (unsigned long long)nt;
    run_cfg = nullptr;
}

void syncthreads() {
    running("__syncthreads").bar_or = false;
    wait_as(kAtSync);
}

int syncthreads_or(int pred) {
    Fiber &f = running("__syncthreads_or");
    f.bar_or = true;
    f.pred = pred != 0;
    wait_as(kAtSync);
    return fibers[current].pred;
}

void warp_collective(const char *what, WarpCompute compute, const void *in, void *out) {
    Fiber &f = running(what);
    f.what = what;
    f.compute = compute;
    f.in = in;
    f.out = out;
    wait_as(kAtWarp);
}

namespace {
struct ShuffleIn {
    const void *value;
    int src;
};
template <int N> void shuffle(const void *const in[32], void *const out[32]) {
    for (int l = 0; l < 32; l++) {
        const ShuffleIn *s = static_cast<const ShuffleIn *>(in[l]);
        memcpy(out[l], static_cast<const ShuffleIn *>(in[s->src])->value, N);
    }
}
void no_exchange(const void *const *, void *const *) {}
} // namespace

void warp_exchange(unsigned mask, const void *in, void *out, int bytes, int src_lane) {
    if (mask != 0xffffffffu)
        fail(current, "shuffle mask 0x%08x: only full-warp masks are emulated", mask);
    const ShuffleIn s = {in, src_lane};
    switch (bytes) { // each size its own operation: lanes of one warp must agree on it
    case 1:
        return warp_collective("a 1-byte shuffle", shuffle<1>, &s, out);
    case 2:
        return warp_collective("a 2-byte shuffle", shuffle<2>, &s, out);
    case 4:
        return warp_collective("a 4-byte shuffle", shuffle<4>, &s, out);
    case 8:
        return warp_collective("an 8-byte shuffle", shuffle<8>, &s, out);
    default:
        fail(current, "a shuffle of %d bytes: not emulated (1, 2, 4 or 8)", bytes);
    }
}

void syncwarp(unsigned mask) {
    if (mask != 0xffffffffu)
        fail(current, "__syncwarp mask 0x%08x: only full-warp masks are emulated", mask);
    warp_collective("__syncwarp", no_exchange, nullptr, nullptr);
}

int lane() {
    return current % 32;
}

void *dynamic_shared() {
    return shared_base;
}

uint32_t shared_address(const void *p) {
    const unsigned char *q = static_cast<const unsigned char *>(p);
    if (q < shared_base || q > shared_base + shared_bytes)
        fail(current,
             "__cvta_generic_to_shared(%p): not in the dynamic shared memory (%zu bytes at %p; "
             "static __shared__ variables are outside the emulated shared window)",
             p, shared_bytes, (void *)shared_base);
    return (uint32_t)(q - shared_base);
}

unsigned char *shared_at(uint32_t addr, size_t bytes, const char *what) {
    if ((size_t)addr + bytes > shared_bytes)
        fail(current,
             "%s of %zu bytes at shared address %u: outside the dynamic shared memory "
             "(%zu bytes)",
             what, bytes, addr, shared_bytes);
    return shared_base + addr;
}

void set_reverse(bool on) {
    reverse = on;
}

const Stats &stats_now() {
    return stats;
}

namespace ptx {

void cp_async(bool cg, uint32_t dst, uint64_t src, int cp_size, uint32_t src_size) {
    Fiber &f = running("cp.async");
    if ((cp_size != 4 && cp_size != 8 && cp_size != 16) || (cg && cp_size != 16))
        fail(current, "cp.async.%s of %d bytes: cp-size must be %s", cg ? "cg" : "ca", cp_size,
             cg ? "16" : "4, 8 or 16");
    if (src_size > (uint32_t)cp_size)
        fail(current, "cp.async src-size %u over its cp-size %d", src_size, cp_size);
    if (dst % cp_size || src % cp_size)
        fail(current,
             "cp.async of %d bytes from %p to shared address %u: both must be %d-byte aligned",
             cp_size, (const void *)(uintptr_t)src, dst, cp_size);
    Copy c = {shared_at(dst, (size_t)cp_size, "cp.async"), {}, cp_size};
    memcpy(c.data, (const void *)(uintptr_t)src, src_size); // the rest zero-filled
    memset(c.dst, 0xff, (size_t)cp_size);                   // in flight: poison until waited
    f.copies.push_back(c);
    f.uncommitted++;
}

void cp_async_commit_group() {
    Fiber &f = running("cp.async.commit_group");
    f.groups.push_back(f.uncommitted); // an empty group when there is none: as PTX says
    f.uncommitted = 0;
}

void cp_async_wait_group(int n) {
    Fiber &f = running("cp.async.wait_group");
    size_t landed = 0;
    while (f.groups.size() > (size_t)n) {
        landed += f.groups.front();
        f.groups.pop_front();
    }
    for (size_t k = 0; k < landed; k++)
        memcpy(f.copies[k].dst, f.copies[k].data, (size_t)f.copies[k].bytes);
    f.copies.erase(f.copies.begin(), f.copies.begin() + (ptrdiff_t)landed);
}

} // namespace ptx

} // namespace emu

// ---------------------------------------------------------------- runtime API subset

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
    (void)kind;
    if (emu::current >= 0) emu::fail("cudaMemcpyAsync inside a kernel");
    emu::check_stream(stream, "cudaMemcpyAsync");
    memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    emu::check_stream(stream, "cudaStreamSynchronize");
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = emu::last_error;
    emu::last_error = cudaSuccess;
    return e;
}

const char *cudaGetErrorString(cudaError_t e) {
    return e == cudaSuccess                     ? "no error"
           : e == cudaErrorInvalidConfiguration ? "invalid configuration argument"
                                                : "error";
}
