// fail_alloc.c: an LD_PRELOAD library that makes one allocation fail, SQLite's way of testing
// what happens when memory runs out (tests/test_out_of_memory.py).
//
// It replaces malloc, calloc, realloc, reallocarray, strdup, strndup, posix_memalign,
// aligned_alloc and memalign; each counts the call and forwards it to glibc's own allocator
// (__libc_malloc and friends, so free stays glibc's). Counting starts when the program's
// main is entered (the library wraps __libc_start_main), so the dynamic loader's and the
// libraries' constructors are never counted; every thread's calls count, in one sequence.
//
//   FAIL_ALLOC_N=K    the K-th call (1-based) returns NULL with errno ENOMEM; the others succeed
//   FAIL_ALLOC_LOG=F  appends "CALL OBJECT" to F for every call (OBJECT: the file name of the
//                     code that called, e.g. astraid or libsqlite3.so.0), and "failed CALL
//                     OBJECT" for the one that failed, followed by its backtrace (lines
//                     that start with two spaces)
//   FAIL_ALLOC_ONLY=FN  counts (and fails) only the calls of the function FN (e.g.
//                     aligned_alloc); the others pass uncounted
//
// Both variables, and LD_PRELOAD, are removed from the environment as main starts: the
// processes the program spawns (ranks, sbatch) allocate normally.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE // dladdr, RTLD_NEXT (the build defines it for every file)
#endif
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

void *__libc_malloc(size_t size);
void *__libc_calloc(size_t n, size_t size);
void *__libc_realloc(void *p, size_t size);
void *__libc_memalign(size_t align, size_t size);

static atomic_int armed;
static atomic_long calls;
static long fail_at = -1;
static const char *only_fn; // FAIL_ALLOC_ONLY
static int log_fd = -1;
static __thread int in_hook; // the allocations of our own logging: not counted

// The file name (without directories) of the object that holds the code at address pc.
static const char *object_of(const void *pc) {
    Dl_info info;
    if (!dladdr(pc, &info) || !info.dli_fname || !*info.dli_fname) return "?";
    const char *slash = strrchr(info.dli_fname, '/');
    return slash ? slash + 1 : info.dli_fname;
}

static void log_call(long n, const void *caller) {
    if (log_fd < 0) return;
    in_hook = 1;
    char line[512];
    int len = snprintf(line, sizeof line, "%ld %s\n", n, object_of(caller));
    if (len > 0 && write(log_fd, line, (size_t)len) < 0) {
        // the log is the test's; a full disk shows there as missing lines
    }
    in_hook = 0;
}

// "failed CALL OBJECT" and the backtrace, in one write (other threads log meanwhile).
static void log_failure(long n, const void *caller) {
    if (log_fd < 0) return;
    in_hook = 1; // backtrace_symbols allocates
    void *frames[32];
    int depth = backtrace(frames, 32);
    char **names = backtrace_symbols(frames, depth), text[8192];
    int len = snprintf(text, sizeof text, "failed %ld %s\n", n, object_of(caller));
    for (int i = 0; names && i < depth && len < (int)sizeof text; i++)
        len += snprintf(text + len, sizeof text - (size_t)len, "  %s\n", names[i]);
    free(names);
    if (len >= (int)sizeof text) len = (int)sizeof text - 1; // cut short
    if (write(log_fd, text, (size_t)len) < 0) {
        // as in log_call
    }
    in_hook = 0;
}

// Whether this call of fn (made from caller) is the one that fails.
static int should_fail(const char *fn, const void *caller) {
    if (!atomic_load(&armed) || in_hook || (only_fn && strcmp(fn, only_fn))) return 0;
    long n = atomic_fetch_add(&calls, 1) + 1;
    if (n != fail_at) {
        log_call(n, caller);
        return 0;
    }
    log_failure(n, caller);
    errno = ENOMEM;
    return 1;
}

#define CALLER __func__, __builtin_return_address(0)

EXPORT void *malloc(size_t size) {
    return should_fail(CALLER) ? NULL : __libc_malloc(size);
}

EXPORT void *calloc(size_t n, size_t size) {
    return should_fail(CALLER) ? NULL : __libc_calloc(n, size);
}

// realloc(p, 0) frees p: not an allocation.
EXPORT void *realloc(void *p, size_t size) {
    return size && should_fail(CALLER) ? NULL : __libc_realloc(p, size);
}

EXPORT void *reallocarray(void *p, size_t n, size_t size) {
    if (size && n > SIZE_MAX / size) {
        errno = ENOMEM;
        return NULL;
    }
    return should_fail(CALLER) ? NULL : __libc_realloc(p, n * size);
}

static char *copy(const char *s, size_t n) {
    char *d = __libc_malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

EXPORT char *strdup(const char *s) {
    return should_fail(CALLER) ? NULL : copy(s, strlen(s));
}

EXPORT char *strndup(const char *s, size_t n) {
    return should_fail(CALLER) ? NULL : copy(s, strnlen(s, n));
}

EXPORT int posix_memalign(void **out, size_t align, size_t size) {
    if (should_fail(CALLER)) return ENOMEM;
    void *p = __libc_memalign(align, size);
    if (!p) return ENOMEM;
    *out = p;
    return 0;
}

EXPORT void *aligned_alloc(size_t align, size_t size) {
    return should_fail(CALLER) ? NULL : __libc_memalign(align, size);
}

EXPORT void *memalign(size_t align, size_t size) {
    return should_fail(CALLER) ? NULL : __libc_memalign(align, size);
}

// ---------------------------------------------------------------- arming at main

typedef int (*MainFn)(int, char **, char **);
static MainFn real_main;

static int armed_main(int argc, char **argv, char **envp) {
    const char *n = getenv("FAIL_ALLOC_N"), *log = getenv("FAIL_ALLOC_LOG"),
               *only = getenv("FAIL_ALLOC_ONLY");
    if (n) fail_at = atol(n);
    if (only) only_fn = copy(only, strlen(only)); // unsetenv below may drop the string
    if (log) log_fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    unsetenv("FAIL_ALLOC_N");
    unsetenv("FAIL_ALLOC_LOG");
    unsetenv("FAIL_ALLOC_ONLY");
    unsetenv("LD_PRELOAD");
    atomic_store(&armed, 1);
    return real_main(argc, argv, envp);
}

typedef int (*StartFn)(MainFn, int, char **, void (*)(void), void (*)(void), void (*)(void),
                       void *);

EXPORT int __libc_start_main(MainFn main, int argc, char **argv, void (*init)(void),
                             void (*fini)(void), void (*rtld_fini)(void), void *stack_end) {
    StartFn start = (StartFn)dlsym(RTLD_NEXT, "__libc_start_main");
    real_main = main;
    return start(armed_main, argc, argv, init, fini, rtld_fini, stack_end);
}
