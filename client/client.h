// client.h: the pieces of astraictl (docs/astraictl.md): connection and calls
// (connect.c), commands (commands.c), human rendering (render.c).
#pragma once
#include <stdbool.h>
#include <stdio.h>

#include "common/error.h"
#include "proto/rpc.h"

typedef struct cJSON cJSON;

// Exit codes of astraictl (docs/astraictl.md).
enum {
    EXIT_OK = 0,
    EXIT_DAEMON_ERROR = 1, // the daemon answered with an error
    EXIT_USAGE = 2,        // bad usage or an invalid job file (= EXIT_BAD_INPUT)
    EXIT_CONNECT = 3,      // cannot connect, connection lost, or no reply in time
    EXIT_JOB_FAILED = 4,   // submit --wait: the job ended failed or cancelled
};

typedef struct {
    const char *socket_path; // NULL: $ASTRAID_SOCKET, else the default
    const char *host;        // HOST:PORT for TCP, NULL for the Unix socket
    const char *token_file;
    bool json;
    double timeout_s; // connect and each reply; pushes are waited for without limit
    long reconnect_s; // how long a stream retries a lost connection; -1: no limit, 0: not
    // command options
    bool wait, follow;
    const char *state;
    long rank, tail;          // -1 when not given
    const char *metric, *svg; // plot
    long width, height;       // plot: -1 when not given
    long step;                // samples: -1 when not given
    bool all;                 // samples
    unsigned given;           // OPT_* bits of the command options on the command line
} Options;

enum {
    OPT_WAIT = 1,
    OPT_FOLLOW = 2,
    OPT_STATE = 4,
    OPT_RANK = 8,
    OPT_TAIL = 16,
    OPT_METRIC = 32,
    OPT_SVG = 64,
    OPT_WIDTH = 128,
    OPT_HEIGHT = 256,
    OPT_STEP = 512,
    OPT_ALL = 1024,
};

// Called for each server push (a message without id) while waiting.
typedef void (*PushHandler)(const char *method, const cJSON *params, void *ctx);

typedef struct {
    int fd;
    RpcReader reader;
    long next_id;
    int timeout_ms;
    bool raw;  // --json: the strings as sent, else made safe for a terminal (text.h)
    bool lost; // the last failure was the connection itself: closed, reset, refused
    PushHandler on_push;
    void *push_ctx;
} Client;

// connect.c. Functions return an exit code (EXIT_OK on success) with err filled.
int client_socket_path(const Options *o, char *buf, size_t cap, Err *err);
int client_open(Client *c, const Options *o, Err *err);
void client_close(Client *c);
// Sends a request (takes params) and waits for its reply; *result is owned by the caller.
int client_call(Client *c, const char *method, cJSON *params, cJSON **result, Err *err);
// Waits (without limit) for the next message and hands pushes to c->on_push.
int client_wait_push(Client *c, Err *err);

// One run of a stream on c (watch, logs -f, plot --follow, submit --wait): resumed is true
// when it runs again on a new connection after the last one was lost.
typedef int (*StreamFn)(Client *c, void *ctx, bool resumed, Err *err);
// Runs fn; each time it ends because the connection was lost (c->lost), reconnects with a
// backoff (100 ms doubling to 2 s, for o->reconnect_s at most), saying so on stderr, and
// runs it again, resumed. A job gone meanwhile is fn's error (the daemon's "no such job").
int client_stream(Client *c, const Options *o, StreamFn fn, void *ctx, Err *err);

// commands.c: `astraictl COMMAND args...`; returns the exit code.
int run_command(const char *command, int argc, char **argv, const Options *o);
// The commands' lines of --help.
void commands_usage(FILE *out);

// render.c
void render_job_table(FILE *out, const cJSON *jobs);
void render_job_detail(FILE *out, const cJSON *job);
void render_daemon_info(FILE *out, const cJSON *info);
void render_preflight(FILE *out, const cJSON *report); // the `preflight` method's report
// One progress line for a job: a bar sized to `width` columns on a terminal, else
// plain text ("job 3 tiny running step 120/400 loss 3.4172 tok/s 51.2k ETA 5m12s").
void render_progress_line(const cJSON *job, bool bar, int width, char *buf, size_t cap);
bool job_state_is_final(const char *state);
