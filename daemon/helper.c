// helper.c: short-lived helper programs astraid runs beside its jobs (the hang watchdog's gdb,
// notify_command): an argv run directly (never through a shell) in its own process group, its
// input written to its stdin, its stdout kept when asked (else /dev/null), its stderr astraid's.
// Nothing waits on one: it ends through its callback on the loop, and past its time bound its
// process group gets SIGKILL. Those still running when astraid exits are killed and freed
// (helpers_free).
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "daemon/daemon.h"

#define OUTPUT_MAX (1 << 20) // stdout bytes kept: the rest is read and dropped

typedef struct Helper {
    uv_process_t proc;
    uv_pipe_t in, out;
    uv_timer_t timer;
    uv_write_t write;
    char *input;
    Buf output;
    int keep_output;
    int handles;   // open libuv handles: freed at 0
    int exited;    // its exit was seen
    int out_open;  // its stdout is being read
    int timed_out; // killed at its bound
    int exit_code, term_signal;
    HelperDone done;
    void *arg;
    struct Helper *prev, *next;
} Helper;

static Helper *helpers; // running ones, for helpers_free

static void unlink_helper(Helper *h) {
    if (h->prev) h->prev->next = h->next;
    if (h->next) h->next->prev = h->prev;
    if (helpers == h) helpers = h->next;
}

static void free_helper(Helper *h) {
    free(h->input);
    buf_free(&h->output);
    free(h);
}

static void on_closed(uv_handle_t *handle) {
    Helper *h = handle->data;
    if (--h->handles == 0) free_helper(h);
}

static void close_one(uv_handle_t *handle) {
    if (!uv_is_closing(handle)) uv_close(handle, on_closed);
}

static void maybe_done(Helper *h) {
    if (!h->exited || h->out_open) return;
    unlink_helper(h);
    uv_timer_stop(&h->timer);
    close_one((uv_handle_t *)&h->timer);
    close_one((uv_handle_t *)&h->in);
    close_one((uv_handle_t *)&h->out);
    close_one((uv_handle_t *)&h->proc);
    h->done(h->arg, h->output.data ? h->output.data : "", h->output.len, h->exit_code,
            h->term_signal, h->timed_out);
}

static void on_exit_cb(uv_process_t *p, int64_t status, int term_signal) {
    Helper *h = p->data;
    h->exited = 1;
    h->exit_code = (int)status;
    h->term_signal = term_signal;
    // Whatever it started and left behind (holding the pipe) goes with it.
    uv_kill(-h->proc.pid, SIGKILL);
    maybe_done(h);
}

static void on_timeout(uv_timer_t *t) {
    Helper *h = t->data;
    h->timed_out = 1;
    uv_kill(-h->proc.pid, SIGKILL);
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
    (void)handle, (void)suggested;
    static char chunk[16384]; // consumed by on_read before the next allocation
    *buf = uv_buf_init(chunk, sizeof chunk);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
    Helper *h = s->data;
    if (n > 0 && h->output.len + (size_t)n <= OUTPUT_MAX)
        buf_append(&h->output, buf->base, (size_t)n); // out of memory: less output
    if (n >= 0) return;
    uv_read_stop(s);
    h->out_open = 0;
    maybe_done(h);
}

static void on_written(uv_write_t *w, int status) {
    (void)status; // a helper that does not read its input is none of astraid's concern
    Helper *h = w->data;
    close_one((uv_handle_t *)&h->in);
}

// The pipes and the timer, before the spawn: every handle is closed through on_closed.
static void init_handles(Helper *h) {
    uv_pipe_init(astraid.loop, &h->in, 0);
    uv_pipe_init(astraid.loop, &h->out, 0);
    uv_timer_init(astraid.loop, &h->timer);
    h->in.data = h->out.data = h->timer.data = h->proc.data = h->write.data = h;
    h->handles = 3;
}

static void start_io(Helper *h, size_t input_len, double timeout_s) {
    uv_buf_t b = uv_buf_init(h->input, (unsigned)input_len);
    if (uv_write(&h->write, (uv_stream_t *)&h->in, &b, 1, on_written))
        close_one((uv_handle_t *)&h->in);
    h->out_open = h->keep_output && !uv_read_start((uv_stream_t *)&h->out, on_alloc, on_read);
    if (!h->out_open) close_one((uv_handle_t *)&h->out);
    uv_timer_start(&h->timer, on_timeout, (uint64_t)(timeout_s * 1000), 0);
}

int helper_run(char *const *argv, const char *input, size_t input_len, int keep_output,
               double timeout_s, HelperDone done, void *arg, Err *err) {
    Helper *h = calloc(1, sizeof *h);
    if (!h || !(h->input = malloc(input_len + 1))) {
        free(h);
        return err_resource(err, "%s: out of memory", argv[0]);
    }
    memcpy(h->input, input, input_len);
    *h = (Helper){.input = h->input, .keep_output = keep_output, .done = done, .arg = arg};
    init_handles(h);
    uv_stdio_container_t stdio[3] = {
        {.flags = UV_CREATE_PIPE | UV_READABLE_PIPE, .data.stream = (uv_stream_t *)&h->in},
        {.flags = keep_output ? UV_CREATE_PIPE | UV_WRITABLE_PIPE : UV_IGNORE,
         .data.stream = (uv_stream_t *)&h->out},
        {.flags = UV_INHERIT_FD, .data.fd = 2},
    };
    uv_process_options_t opt = {.exit_cb = on_exit_cb,
                                .file = argv[0],
                                .args = (char **)argv,
                                .flags = UV_PROCESS_DETACHED, // its own group: killed whole
                                .stdio_count = 3,
                                .stdio = stdio};
    int rc = uv_spawn(astraid.loop, &h->proc, &opt);
    h->handles++; // uv_spawn initialises the handle even when it fails
    if (rc) {
        close_one((uv_handle_t *)&h->proc);
        close_one((uv_handle_t *)&h->in);
        close_one((uv_handle_t *)&h->out);
        close_one((uv_handle_t *)&h->timer);
        return err_errno(err, -rc, "cannot run %s", argv[0]);
    }
    start_io(h, input_len, timeout_s);
    h->next = helpers;
    if (helpers) helpers->prev = h;
    helpers = h;
    return 0;
}

void helpers_free(void) {
    while (helpers) {
        Helper *h = helpers;
        helpers = h->next;
        uv_kill(-h->proc.pid, SIGKILL);
        h->done(h->arg, NULL, 0, -1, SIGKILL, 1); // NULL output: astraid is exiting
        free_helper(h);                           // its handles were closed with the loop's
    }
}
