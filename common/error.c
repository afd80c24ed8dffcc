#include "common/error.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static void vset(Err *err, const char *fmt, va_list ap) {
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
}

int err_set(Err *err, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vset(err, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int err_resource(Err *err, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vset(err, fmt, ap);
        va_end(ap);
        err->resource = 1;
    }
    return -1;
}

// The errnos that blame the name or value given, not the system: the one classification of
// astrai (astraid's runner too: a rank that could not start for one of these fails its job,
// for any other errno, EACCES included, the job tries again later).
static int input_errno(int e) {
    return e == ENOENT || e == ENOTDIR || e == EISDIR || e == ENAMETOOLONG || e == ELOOP ||
           e == EINVAL || e == EEXIST || e == ENXIO || e == ENODEV || e == ENOEXEC || e == E2BIG;
}

int err_errno(Err *err, int errnum, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vset(err, fmt, ap);
        va_end(ap);
        size_t n = strlen(err->msg);
        snprintf(err->msg + n, sizeof err->msg - n, ": %s", strerror(errnum));
        err->resource = !input_errno(errnum);
    }
    return -1;
}

int err_exit_status(const Err *err) {
    return err->resource ? 1 : EXIT_BAD_INPUT;
}

int err_prefix(Err *err, const char *fmt, ...) {
    if (!err) return -1;
    char prefix[ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    // Shift the old message right to make room for "prefix: " (truncating its tail).
    size_t plen = strnlen(prefix, ERR_MSG_MAX - 3);
    size_t room = ERR_MSG_MAX - 1 - (plen + 2);
    size_t olen = strnlen(err->msg, room);
    memmove(err->msg + plen + 2, err->msg, olen);
    memcpy(err->msg, prefix, plen);
    memcpy(err->msg + plen, ": ", 2);
    err->msg[plen + 2 + olen] = 0;
    return -1;
}

void first_failure_record(FirstFailure *f, const char *fmt, ...) {
    int none = 0;
    if (!__atomic_compare_exchange_n(&f->state, &none, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return; // the first one stands
    va_list ap;
    va_start(ap, fmt);
    vset(&f->err, fmt, ap);
    va_end(ap);
    f->err.resource = 1;
    __atomic_store_n(&f->state, 2, __ATOMIC_RELEASE);
}

int first_failure_check(FirstFailure *f, Err *err) {
    int state = __atomic_load_n(&f->state, __ATOMIC_ACQUIRE);
    if (state == 0) return 0;
    if (state != 2) return err_resource(err, "a backend op failed (its message is being written)");
    if (err) *err = f->err;
    return -1;
}
