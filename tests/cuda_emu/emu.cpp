// emu.cpp: the scheduler behind emu.h: runs a kernel launch block by block, one fiber
// (ucontext) per CUDA thread, all on the calling OS thread, and implements __syncthreads,
// warp shuffles and the few runtime calls the ops make (cudaMemcpyAsync, ...).
//
// Within a block, warp by warp (in order, or the reverse: emu::set_reverse), the scheduler
// resumes each lane of the warp that can run until it ends or waits at a barrier, and
// releases the warp once its 32 lanes all wait at a shuffle (each lane gets its source
// lane's value, taken before any lane runs on), until the warp has ended or waits at
// __syncthreads; then the next warp. So warps drift as far apart as CUDA allows, and a
// missing __syncthreads between a shared-memory write and another warp's read shows.
// Once every live thread waits at __syncthreads, the block goes on.
// Anything else is an error CUDA leaves undefined (a hang or garbage on the GPU), reported
// with the launch site, block and thread: a barrier some threads skipped by returning
// early, a full-mask shuffle with exited lanes, or threads waiting at different barriers.
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <deque>

#include "engine/cuda/cuda_backend.h"
#include "tests/cuda_emu/emu.h"

namespace emu {

uint3 thread_idx, block_idx;
dim3 block_dim, grid_dim;

namespace {

enum State { kReady, kAtSync, kAtWarp, kDone };

struct Fiber {
    ucontext_t ctx;
    char *stack;
    State state;
    // a pending warp exchange
    unsigned mask;
    int bytes, src;
    unsigned char in[8], out[8];
};

// Per-thread stack: the kernels need little, but unoptimised (-O0) builds and deep
// inlining take more; untouched pages cost nothing. A PROT_NONE page below catches overflow.
constexpr size_t kStackBytes = 256 << 10;

std::deque<Fiber> fibers; // stable addresses: a ucontext_t points into itself
ucontext_t scheduler;
int current = -1; // the running fiber, -1 outside kernels
void (*run_invoke)(void *);
void *run_closure;
const Config *run_cfg;
cudaError_t last_error = cudaSuccess;
bool reverse = false;
Stats stats;

void set_thread(int t) {
    const dim3 &b = run_cfg->block;
    thread_idx = {t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
}

[[noreturn]] void fail(int t, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuda_emu: ");
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (run_cfg) {
        fprintf(stderr,
                "\n  in the kernel launched at %s:%d, grid (%u,%u,%u), block (%u,%u,%u); "
                "at block (%u,%u,%u)",
                run_cfg->file, run_cfg->line, run_cfg->grid.x, run_cfg->grid.y, run_cfg->grid.z,
                run_cfg->block.x, run_cfg->block.y, run_cfg->block.z, block_idx.x, block_idx.y,
                block_idx.z);
        if (t >= 0) {
            set_thread(t);
            fprintf(stderr, ", thread (%u,%u,%u)", thread_idx.x, thread_idx.y, thread_idx.z);
        }
    }
    fprintf(stderr, "\n");
    abort();
}

void grow(size_t n) {
    long page = sysconf(_SC_PAGESIZE);
    while (fibers.size() < n) {
        void *p = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            fprintf(stderr, "cuda_emu: mmap of a fiber stack: %s\n", strerror(errno));
            abort();
        }
        mprotect(p, page, PROT_NONE);
        fibers.emplace_back();
        fibers.back().stack = (char *)p + page;
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

void trampoline() {
    run_invoke(run_closure);
    fibers[current].state = kDone;
    swapcontext(&fibers[current].ctx, &scheduler); // never resumed
}

// Parks the running thread in state s until the scheduler releases it.
void wait_as(State s) {
    if (current < 0) fail(-1, "a barrier or shuffle outside a kernel");
    fibers[current].state = s;
    swapcontext(&fibers[current].ctx, &scheduler);
}

// Releases the warp [lo, hi) if all its lanes wait at an exchange; fails on a warp that can
// never complete. Returns whether it released.
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
    if (hi - lo < 32)
        fail(first,
             "a full-warp shuffle or __syncwarp in a partial warp (%d threads): the "
             "block size is not a multiple of 32",
             hi - lo);
    if (done)
        fail(first,
             "a full-mask shuffle or __syncwarp that %d lane(s) of the warp never reach "
             "(they returned): undefined on the GPU",
             done);
    if (waiting < hi - lo) return false; // lanes at __syncthreads: a deadlock unless resolved
    for (int t = lo; t < hi; t++) {
        const Fiber &f = fibers[t];
        if (f.mask != 0xffffffffu)
            fail(t, "shuffle mask 0x%08x: only full-warp masks are emulated", f.mask);
        if (f.bytes != fibers[lo].bytes)
            fail(t, "lanes of one warp in different shuffles (%d vs %d bytes)", f.bytes,
                 fibers[lo].bytes);
    }
    for (int t = lo; t < hi; t++) {
        Fiber &f = fibers[t];
        memcpy(f.out, fibers[lo + f.src].in, (size_t)f.bytes);
    }
    for (int t = lo; t < hi; t++)
        fibers[t].state = kReady;
    return true;
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
            for (int t = 0; t < nt; t++)
                fibers[t].state = kReady;
            stats.barriers++;
            continue;
        }
        fail(first_sync,
             "deadlock: %d thread(s) wait at __syncthreads while others wait at a "
             "warp shuffle",
             at_sync);
    }
}

bool bad_config(const Config &c) {
    const dim3 &b = c.block, &g = c.grid;
    unsigned long long threads = (unsigned long long)b.x * b.y * b.z;
    const char *why = nullptr;
    if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0)
        why = "an empty grid or block";
    else if (b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024)
        why = "more than 1024 threads a block (or a block dimension over its limit)";
    else if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535)
        why = "a grid dimension over its limit (2^31-1, 65535, 65535)";
    else if (c.shmem != 0)
        why = "dynamic shared memory (not emulated)";
    if (!why) return false;
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

void launch(const Config &c, void (*invoke)(void *), void *closure) {
    if (current >= 0 || run_cfg) fail(current, "a kernel launch inside a kernel");
    if (c.stream != (cudaStream_t)cuda_stream()) {
        fprintf(stderr, "cuda_emu: the kernel launched at %s:%d is not on cuda_stream()\n", c.file,
                c.line);
        abort();
    }
    if (bad_config(c)) {
        last_error = cudaErrorInvalidConfiguration;
        return;
    }
    int nt = (int)(c.block.x * c.block.y * c.block.z);
    grow((size_t)nt);
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
    wait_as(kAtSync);
}

void warp_exchange(unsigned mask, const void *in, void *out, int bytes, int src_lane) {
    if (current < 0) fail(-1, "a shuffle outside a kernel");
    Fiber &f = fibers[current];
    f.mask = mask;
    f.bytes = bytes;
    f.src = src_lane;
    memcpy(f.in, in, (size_t)bytes);
    wait_as(kAtWarp);
    memcpy(out, fibers[current].out, (size_t)bytes);
}

void syncwarp(unsigned mask) {
    unsigned char none = 0;
    warp_exchange(mask, &none, &none, 1, lane());
}

int lane() {
    return current % 32;
}

void set_reverse(bool on) {
    reverse = on;
}

const Stats &stats_now() {
    return stats;
}

} // namespace emu

// ---------------------------------------------------------------- runtime API subset

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
    (void)kind;
    if (emu::current >= 0) emu::fail(emu::current, "cudaMemcpyAsync inside a kernel");
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
