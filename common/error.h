// error.h: the one error convention of astrai.
//
// Every function that can fail takes an `Err *` as its last argument, returns
// 0 on success and -1 on failure, and on failure fills err->msg with a message
// that names the file, key or value at fault ("model.safetensors: tensor
// 'norm.weight' ends at byte 900 past the data size 512"). Callers add context
// with err_prefix() and never print-and-continue.
//
// Two kinds of failure, two exit codes: bad input (a flag, a file, a value the user gave:
// err_set, exit 2, EXIT_BAD_INPUT) and everything else (err_resource, err->resource = 1, exit
// 1). Out of memory, on the host or a device, is always the second: err_resource with a
// message naming what was being allocated ("model: 1048576 master weights: out of memory
// allocating 4.0 MiB"); astraid tries a run that failed so again later, as any resource
// failure. A library must not turn a failed allocation into bad input either: cJSON's
// allocations go through common/json.h's hooks (json_out_of_memory tells a parse that ran
// out of memory from malformed text), SQLITE_NOMEM and libyaml's YAML_MEMORY_ERROR are
// resource failures. Nothing aborts for want of memory. tests/test_out_of_memory.py makes
// each allocation of astrai-train's run (training's too, in bf16) and astraid's start paths fail
// in turn and checks this.
#pragma once
#include <stddef.h>

#define ERR_MSG_MAX 1024

typedef struct {
    char msg[ERR_MSG_MAX];
    int resource; // set by whoever failed for want of a resource (memory, a device), not input
} Err;

// Formats the message into err (if err is non-NULL) and returns -1.
int err_set(Err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// err_set for a failure for want of a resource (out of memory, no device): the message,
// and err->resource = 1 so that binaries exit 1 (a failure), not 2 (bad input).
int err_resource(Err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// err_set for a failed system call: the message, then ": " and strerror(errnum). A failure of
// the system (no memory or space, an I/O error, no permission, a read-only file system, too
// many open files, ...) sets err->resource, so that binaries exit 1; the errors that say the
// input names the wrong thing (no such file, not a directory, a directory, a name too long or
// looping, an invalid argument, not an executable, arguments too long) stay bad input.
int err_errno(Err *err, int errnum, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

// The exit status of a binary that failed with err: 1 for a resource, else EXIT_BAD_INPUT.
int err_exit_status(const Err *err);

// Prepends "prefix: " to an existing message (e.g. the file name); returns -1.
int err_prefix(Err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// The first failure of work that has no way to return one when it happens (a backend's ops
// return nothing, engine/backend.h): recorded once, later ones dropped, reported when the owner
// checks. Safe from any thread; zero-initialised means none.
typedef struct {
    int state; // 0: none, 1: being recorded, 2: recorded (GCC atomics: C and CUDA's C++ alike)
    Err err;
} FirstFailure;

// Records the message (a resource failure: exit 1) unless a failure is recorded already.
void first_failure_record(FirstFailure *f, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
// -1 with the recorded failure in err, or 0 when none was.
int first_failure_check(FirstFailure *f, Err *err);

// Exit code for bad input (flags, files, data) in every astrai binary.
#define EXIT_BAD_INPUT 2
// Exit code of a run stopped before its end (SIGTERM/SIGINT, or a stop request of its
// supervisor) after writing the checkpoint that --resume continues from.
#define EXIT_INTERRUPTED 3
