// server.c: the control sockets of astraid (docs/design.md §3, docs/protocol.md).
//
// A unix stream socket (bound here, or passed by systemd socket activation) and
// optionally TCP. Each connection splits its bytes into lines (proto/rpc.h
// RpcReader: a line over 1 MiB gets one -32005 reply and is skipped, the connection
// stays usable) and answers each line in order (a request whose change is being written
// holds the lines after it until its answer: conn_defer). Replies and pushes go out through
// libuv's write queue. Nobody can stall the loop or grow the daemon without bound:
//   - a client is answered at most SLICE lines per turn of the loop, and not at all
//     while more than PAUSE_AT of its output is unread; with more than INPUT_CAP of its
//     requests waiting it is not read from (the kernel then holds its sender back), and
//     if it does not read its replies either for STALL_MS, it is dropped;
//   - a client with more than OUTPUT_CAP unread is dropped, and when all clients
//     together hold more than CLIENT_MEMORY_CAP (unread output, unanswered input) the
//     ones holding most are dropped until they fit, those that stopped reading (no write to
//     them completed for READING_MS) before any that still reads;
//   - memory a leaving client held goes back to the system (malloc_trim).
// Unix peers (their uid from SO_PEERCRED) and authenticated TCP peers share
// max-connections; TCP peers that have not authenticated yet have their own limit,
// max-unauthenticated, and auth-timeout seconds to authenticate, so that they can
// never lock unix users out. Over a limit a client gets one -32004 reply and is closed.
// Out of memory: a connection there is no memory for is accepted and closed at once; a client
// whose bytes there is no memory to keep gets one -32603 reply and is hung up on.
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <malloc.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/fsutil.h"
#include "daemon/daemon.h"

#define OUTPUT_CAP (8u << 20)         // unread bytes one client may hold before it is dropped
#define CLIENT_MEMORY_CAP (64u << 20) // what all clients together may hold
#define PAUSE_AT (64u << 10)          // unread output above which a client's requests wait
#define INPUT_CAP (256u << 10)        // unanswered input read from one client
#define PREAUTH_INPUT_CAP (16u << 10) // unanswered input a TCP peer may send before auth
#define SLICE 32                      // lines a client gets answered per turn of the loop
#define STALL_MS 5000                 // a client not read from and not reading is dropped
#define READING_MS 1000               // a client whose last write completed this recently reads
#define TRIM_AFTER (1u << 20)         // bytes left behind by clients before malloc_trim
#define BACKLOG 128
#define TOKEN_MAX 4096

// The handle of a peer: a unix or a tcp stream.
typedef union {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
} PeerHandle;

static void peer_init(PeerHandle *h, int tcp) {
    if (tcp)
        uv_tcp_init(astraid.loop, &h->tcp);
    else
        uv_pipe_init(astraid.loop, &h->pipe, 0);
}

struct Conn {
    PeerHandle h;
    int tcp, closing, reading;
    int preauth; // a TCP peer that has not authenticated (counted in n_preauth)
    uint64_t accepted_ms, progress_ms; // progress: the last write to it that completed
    long uid;
    RpcReader reader;
    size_t queued;  // bytes of the writes libuv holds for it (messages and requests)
    size_t held;    // queued + the reader's buffer, as counted in client_memory
    int backlog;    // answered a full SLICE: more lines may wait for the next turn
    int lines_wait; // serving stopped before its reader ran out of complete lines
    int waiting;    // a request's answer waits for its change to be written (conn_defer)
    int gone;       // closed while waiting: freed by conn_answer
    int watching;
    long watch_job; // 0: every job
    int following, follow_rank;
    long follow_job;
    Conn *prev, *next;
};

typedef struct {
    uv_write_t req;
    char *msg;
    size_t bytes; // what it adds to its connection's queued
} WriteReq;

static Conn *conns;
static int n_conns, n_preauth;
static size_t client_memory; // sum of held over the open connections
static size_t left_behind;   // held by clients that left since the last malloc_trim
static uv_pipe_t unix_listener;
static uv_tcp_t tcp_listener;
static uv_timer_t sweep_timer, trim_timer;
static uv_idle_t backlog_idle; // active while a client may have lines waiting for its turn
static int unix_open, tcp_open, unix_bound_here;
static char token[TOKEN_MAX];
static size_t token_len;

int server_connections(void) {
    return n_conns;
}

long conn_uid(const Conn *c) {
    return c->uid;
}

int conn_is_tcp(const Conn *c) {
    return c->tcp;
}

int conn_is_authed(const Conn *c) {
    return !c->preauth;
}

int conn_set_authed(Conn *c) {
    if (!c->preauth) return 0;
    if (n_conns - n_preauth >= astraid.cfg.max_connections) return -1;
    c->preauth = 0;
    n_preauth--;
    return 0;
}

// Constant time in the token's content (docs/design.md §3).
int server_check_token(const char *given) {
    size_t n = strlen(given);
    unsigned char diff = (unsigned char)(n != token_len);
    for (size_t i = 0; i < token_len; i++)
        diff |= (unsigned char)(token[i] ^ (i < n ? given[i] : 0));
    return token_len > 0 && diff == 0;
}

// ---------------------------------------------------------------- closing

static void on_conn_closed(uv_handle_t *h) {
    Conn *c = h->data;
    rpc_reader_free(&c->reader);
    if (c->waiting)
        c->gone = 1; // its answer still holds it
    else
        free(c);
}

static void on_trim(uv_timer_t *t) {
    (void)t;
    left_behind = 0;
#ifdef __GLIBC__
    malloc_trim(0); // freed queues and buffers back to the system, not only to malloc
#endif
}

static void unlink_conn(Conn *c) {
    c->closing = 1;
    if (c->prev)
        c->prev->next = c->next;
    else
        conns = c->next;
    if (c->next) c->next->prev = c->prev;
    n_conns--;
    n_preauth -= c->preauth;
    client_memory -= c->held;
    left_behind += c->held;
    c->held = 0;
    // After the close callbacks have freed its queue (a later turn of the loop).
    if (left_behind > TRIM_AFTER && !uv_is_active((uv_handle_t *)&trim_timer) &&
        !uv_is_closing((uv_handle_t *)&trim_timer))
        uv_timer_start(&trim_timer, on_trim, 100, 0);
}

static void conn_close(Conn *c) {
    if (c->closing) return;
    unlink_conn(c);
    uv_read_stop(&c->h.stream);
    uv_close(&c->h.handle, on_conn_closed);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
    (void)status;
    uv_close((uv_handle_t *)req->handle, on_conn_closed);
    free(req);
}

// Closes c once what it was sent is written (an error reply before hanging up); at
// once when libuv already holds output for it (it does not read: it would never go).
void conn_hang_up(Conn *c) {
    if (c->closing) return;
    if (c->queued) {
        conn_close(c);
        return;
    }
    unlink_conn(c);
    uv_read_stop(&c->h.stream);
    uv_shutdown_t *req = malloc(sizeof *req);
    if (!req || uv_shutdown(req, &c->h.stream, on_shutdown)) {
        free(req);
        uv_close(&c->h.handle, on_conn_closed);
    }
}

// ---------------------------------------------------------------- memory

// Whether c reads what it is sent: nothing waits for it, or a write to it completed within
// READING_MS. A follower that reads falls behind a burst on a busy machine: it holds bytes for a
// moment, not for good.
static bool still_reading(const Conn *c, uint64_t now) {
    return c->queued == 0 || now - c->progress_ms < READING_MS;
}

// Whether the memory cap drops a before b: clients that stopped reading first, then the one
// holding most.
static bool drop_before(const Conn *a, const Conn *b, uint64_t now) {
    bool a_reads = still_reading(a, now), b_reads = still_reading(b, now);
    return a_reads != b_reads ? !a_reads : a->held > b->held;
}

// Drops clients until all of them together fit in CLIENT_MEMORY_CAP: those that stopped
// reading, holding most first, before any that still reads.
static void enforce_memory_cap(void) {
    uint64_t now = uv_now(astraid.loop);
    while (client_memory > CLIENT_MEMORY_CAP) {
        Conn *big = conns;
        for (Conn *c = conns; c; c = c->next)
            if (drop_before(c, big, now)) big = c;
        if (!big) return;
        log_warn("dropping a client holding %zu bytes: clients hold %zu bytes, over %u", big->held,
                 client_memory, CLIENT_MEMORY_CAP);
        conn_close(big);
    }
}

// Brings c's share of client_memory up to date (its queue or its reader changed).
static void account(Conn *c) {
    if (c->closing) return;
    size_t held = c->queued + c->reader.cap;
    client_memory = client_memory - c->held + held;
    c->held = held;
    enforce_memory_cap();
}

// ---------------------------------------------------------------- output

static void serve_lines(Conn *c);
static void input_flow(Conn *c);
static void on_backlog(uv_idle_t *h);

static void on_written(uv_write_t *req, int status) {
    WriteReq *w = (WriteReq *)req;
    Conn *c = req->handle->data;
    c->queued -= w->bytes;
    free(w->msg);
    free(w);
    if (status >= 0) c->progress_ms = uv_now(astraid.loop);
    if (status < 0 && !c->closing) conn_close(c); // the client went away mid-reply
    if (c->closing) return;
    if (c->queued < PAUSE_AT / 2 && rpc_reader_pending(&c->reader)) {
        serve_lines(c); // its waiting requests, now that it reads
        input_flow(c);
    }
    account(c);
}

void conn_send(Conn *c, char *msg) {
    if (!msg || c->closing) {
        free(msg);
        return;
    }
    if (c->queued > OUTPUT_CAP) {
        log_warn("dropping a client that does not read (%zu bytes queued)", c->queued);
        free(msg);
        conn_close(c);
        return;
    }
    size_t len = strlen(msg);
    uv_buf_t buf = uv_buf_init(msg, (unsigned)len);
    int n = uv_try_write(&c->h.stream, &buf, 1);
    if (n == (int)len) {
        free(msg);
        return;
    }
    if (n < 0 && n != UV_EAGAIN) {
        free(msg);
        conn_close(c);
        return;
    }
    size_t done = n > 0 ? (size_t)n : 0;
    WriteReq *w = malloc(sizeof *w);
    if (!w) {
        free(msg);
        conn_close(c);
        return;
    }
    w->msg = msg;
    w->bytes = len + 1 + sizeof *w; // what malloc holds for it, near enough
    buf = uv_buf_init(msg + done, (unsigned)(len - done));
    if (uv_write(&w->req, &c->h.stream, &buf, 1, on_written)) {
        free(msg);
        free(w);
        conn_close(c);
        return;
    }
    c->queued += w->bytes;
    account(c);
}

// ---------------------------------------------------------------- input

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    (void)h;
    (void)suggested;
    static char chunk[64 * 1024]; // fed to the reader before the next allocation
    *buf = uv_buf_init(chunk, sizeof chunk);
}

// Answers c's complete lines in order: at most SLICE of them (the next ones on a later
// turn, from backlog_idle), and none while more than PAUSE_AT of its output is unread
// (on_written resumes them).
static void serve_lines(Conn *c) {
    char *line;
    size_t len;
    int kind = RPC_LINE_OK, n = 0;
    while (!c->closing && !c->waiting && c->queued < PAUSE_AT && n < SLICE) {
        if ((kind = rpc_reader_next(&c->reader, &line, &len)) == RPC_LINE_NONE) break;
        n++;
        if (kind == RPC_LINE_OK)
            dispatch_line(c, line, len);
        else
            conn_send(c,
                      rpc_error(NULL, RPC_LINE_TOO_LONG, "line longer than 1 MiB; skipped", NULL));
    }
    c->lines_wait = !c->closing && kind != RPC_LINE_NONE;
    c->backlog = c->lines_wait && !c->waiting && n == SLICE;
    if (c->backlog && !uv_is_active((uv_handle_t *)&backlog_idle))
        uv_idle_start(&backlog_idle, on_backlog);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf);

void conn_defer(Conn *c) {
    c->waiting = 1;
}

void conn_answer(Conn *c, char *msg) {
    c->waiting = 0;
    if (c->gone) {
        free(msg);
        free(c);
        return;
    }
    conn_send(c, msg);
    if (c->closing) return;
    serve_lines(c); // the lines that came meanwhile
    input_flow(c);
    account(c);
}

// Reads from c only while fewer than INPUT_CAP bytes of its requests wait to be answered
// (a line still arriving is no request yet: the reader bounds it by RPC_MAX_LINE), so
// that one sending faster than it is answered, or than it reads, is held back by the
// kernel. (The sweep drops one that stays held back without reading.)
static void input_flow(Conn *c) {
    if (c->closing) return;
    size_t pending = rpc_reader_pending(&c->reader);
    int full = c->lines_wait && pending > INPUT_CAP;
    if (c->preauth && pending > PREAUTH_INPUT_CAP) {
        log_warn("dropping a TCP client that sent %zu bytes without authenticating", pending);
        conn_close(c);
    } else if (full && c->reading) {
        uv_read_stop(&c->h.stream);
        c->reading = 0;
    } else if (!c->reading && (!c->lines_wait || pending <= INPUT_CAP / 2)) {
        uv_read_start(&c->h.stream, on_alloc, on_read);
        c->reading = 1;
    }
}

static void on_backlog(uv_idle_t *h) {
    int more = 0;
    for (Conn *c = conns, *next; c; c = next) {
        next = c->next; // serving c may drop another client
        if (!c->backlog) continue;
        serve_lines(c);
        input_flow(c);
        account(c);
        more |= c->backlog;
    }
    if (!more) uv_idle_stop(h);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
    Conn *c = s->data;
    if (n < 0) {
        conn_close(c);
        return;
    }
    if (n == 0) return;
    if (rpc_reader_feed(&c->reader, buf->base, (size_t)n)) { // no memory: those bytes are lost
        log_error("out of memory for a client's request: hanging up");
        conn_send(c, rpc_error(NULL, RPC_INTERNAL_ERROR,
                               "out of memory reading the request; closing the connection", NULL));
        conn_hang_up(c);
        return;
    }
    serve_lines(c);
    input_flow(c);
    account(c);
}

// The unix peer's uid, -1 when unknown.
static long peer_uid(Conn *c) {
    uv_os_fd_t fd;
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (uv_fileno(&c->h.handle, &fd) || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len))
        return -1;
    return (long)cred.uid;
}

// A connection there is no memory for is accepted into a handle of the listener's own and
// closed at once: libuv accepts nothing more on a listener until its pending one is taken.
// One that comes while the handle is still closing is taken once it is closed.
typedef struct {
    PeerHandle h;
    int closing;
    uv_stream_t *waiting; // its listener, when a connection waits
} Refusal;

static Refusal refusals[2]; // the unix listener's, the tcp one's

static void on_connection(uv_stream_t *listener, int status);

static void on_refused_closed(uv_handle_t *h) {
    Refusal *r = h->data;
    uv_stream_t *listener = r->waiting;
    r->closing = 0;
    r->waiting = NULL;
    if (listener) on_connection(listener, 0); // memory may be back
}

static void refuse(uv_stream_t *listener) {
    int tcp = listener == (uv_stream_t *)&tcp_listener;
    Refusal *r = &refusals[tcp];
    log_error("out of memory for a new connection: refused");
    if (r->closing) {
        r->waiting = listener;
        return;
    }
    peer_init(&r->h, tcp);
    r->h.handle.data = r;
    r->closing = 1;
    uv_accept(listener, &r->h.stream);
    uv_close(&r->h.handle, on_refused_closed);
}

static void on_connection(uv_stream_t *listener, int status) {
    if (status < 0) {
        log_warn("accept: %s", uv_strerror(status));
        return;
    }
    Conn *c = calloc(1, sizeof *c);
    if (!c) {
        refuse(listener);
        return;
    }
    c->tcp = listener == (uv_stream_t *)&tcp_listener;
    peer_init(&c->h, c->tcp);
    c->h.handle.data = c;
    rpc_reader_init(&c->reader);
    c->preauth = c->tcp;
    c->accepted_ms = c->progress_ms = uv_now(astraid.loop);
    c->next = conns;
    if (conns) conns->prev = c;
    conns = c;
    n_conns++;
    n_preauth += c->preauth;
    if (uv_accept(listener, &c->h.stream)) {
        conn_close(c);
        return;
    }
    c->uid = c->tcp ? -1 : peer_uid(c);
    if (c->preauth ? n_preauth > astraid.cfg.max_unauthenticated
                   : n_conns - n_preauth > astraid.cfg.max_connections) {
        conn_send(c, rpc_error(NULL, RPC_BUSY,
                               c->preauth ? "too many unauthenticated connections; try again later"
                                          : "too many connections; try again later",
                               NULL));
        conn_hang_up(c);
        return;
    }
    input_flow(c); // starts reading
}

// ---------------------------------------------------------------- pushes

void conn_watch(Conn *c, long job_id) {
    c->watching = 1;
    c->watch_job = job_id;
}

void conn_follow(Conn *c, long job_id, int rank) {
    c->following = 1;
    c->follow_job = job_id;
    c->follow_rank = rank;
}

static char *end_push(const Job *j) {
    cJSON *p = cJSON_CreateObject();
    cJSON_AddNumberToObject(p, "job", (double)j->id);
    cJSON_AddStringToObject(p, "state", job_state_name(j->state));
    return rpc_push("end", p);
}

// A one-job watch or a log follow of j ends with an end push once j is final
// (completed, failed, cancelled); through pause, interruption and restarts it goes on.
static void end_if_final(Conn *c, const Job *j) {
    int watch = c->watching && c->watch_job == j->id;
    int follow = c->following && c->follow_job == j->id;
    if (c->closing || !(watch || follow) || !job_is_final(j->state)) return;
    c->watching = c->watching && !watch;
    c->following = c->following && !follow;
    conn_send(c, end_push(j));
}

void conn_end_if_final(Conn *c) {
    const Job *j = c->following ? job_find(c->follow_job) : NULL;
    if (j) end_if_final(c, j);
    j = c->watching && c->watch_job ? job_find(c->watch_job) : NULL;
    if (j) end_if_final(c, j);
}

static void push_progress(const Job *j) {
    char *msg = NULL;
    for (Conn *c = conns, *next; c; c = next) {
        next = c->next; // conn_send may drop c
        int watched = c->watching && (c->watch_job == 0 || c->watch_job == j->id);
        if (watched && !msg) msg = rpc_push("progress", job_to_raw_json(j));
        if (watched && msg) conn_send(c, strdup(msg));
        end_if_final(c, j);
    }
    free(msg);
}

void server_on_job(const Job *j, JobChange what, const char *event) {
    (void)event;
    if (j && (what == JOB_SHOWN || what == JOB_PROGRESS)) push_progress(j);
}

void server_push_log(const Job *j, int rank, const char *line) {
    char *msg = NULL;
    for (Conn *c = conns, *next; c; c = next) {
        next = c->next;
        if (!c->following || c->follow_job != j->id ||
            (c->follow_rank >= 0 && c->follow_rank != rank))
            continue;
        if (!msg) {
            cJSON *p = cJSON_CreateObject();
            cJSON_AddNumberToObject(p, "job", (double)j->id);
            cJSON_AddNumberToObject(p, "rank", rank);
            cJSON_AddStringToObject(p, "line", line);
            msg = rpc_push("log", p);
        }
        if (msg) conn_send(c, strdup(msg));
    }
    free(msg);
}

// ---------------------------------------------------------------- listeners

// Refuses to take over the socket of a live daemon; removes a stale one.
static int claim_socket_path(const char *path, Err *err) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        return err_set(err, "socket: path '%s' is longer than %zu bytes", path,
                       sizeof addr.sun_path - 1);
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int live = fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0;
    if (fd >= 0) close(fd);
    if (live) return err_set(err, "socket: another astraid is serving on %s", path);
    if (unlink(path) && errno != ENOENT)
        return err_set(err, "socket: cannot remove the stale %s: %s", path, strerror(errno));
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    return fs_mkdir_p(dirname(dir), err);
}

static int listen_unix(Err *err) {
    const char *path = astraid.cfg.socket_path;
    int fd = sd_listen_fd(), rc;
    uv_pipe_init(astraid.loop, &unix_listener, 0);
    unix_open = 1;
    if (fd >= 0) {
        if ((rc = uv_pipe_open(&unix_listener, fd)))
            return err_set(err, "socket activation: fd %d: %s", fd, uv_strerror(rc));
        log_info("using the socket passed by systemd (fd %d)", fd);
    } else {
        if (claim_socket_path(path, err)) return -1;
        if ((rc = uv_pipe_bind(&unix_listener, path)))
            return err_set(err, "socket: bind %s: %s", path, uv_strerror(rc));
        unix_bound_here = 1;
        chmod(path, 0660); // the owner and the group (astraid) may connect
    }
    if ((rc = uv_listen((uv_stream_t *)&unix_listener, BACKLOG, on_connection)))
        return err_set(err, "socket: listen %s: %s", path, uv_strerror(rc));
    return 0;
}

static int read_token(const char *path, Err *err) {
    char *text;
    size_t len;
    if (fs_read_file(path, &text, &len, err)) return err_prefix(err, "token-file");
    while (len && (text[len - 1] == '\n' || text[len - 1] == '\r' || text[len - 1] == ' ' ||
                   text[len - 1] == '\t'))
        len--;
    int ok = len > 0 && len < sizeof token;
    if (ok) memcpy(token, text, len);
    token_len = ok ? len : 0;
    free(text);
    return ok ? 0 : err_set(err, "token-file: %s is empty or too long", path);
}

int server_parse_address(const char *option, const char *spec, struct sockaddr_storage *ss,
                         Err *err) {
    const char *colon = strrchr(spec, ':');
    char host[256];
    if (!colon || colon == spec || (size_t)(colon - spec) >= sizeof host)
        return err_set(err, "%s: '%s' is not HOST:PORT", option, spec);
    snprintf(host, sizeof host, "%.*s", (int)(colon - spec), spec);
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (end == colon + 1 || *end || port < 1 || port > 65535)
        return err_set(err, "%s: '%s' has no valid port", option, spec);
    if (host[0] == '[' && host[strlen(host) - 1] == ']') {
        host[strlen(host) - 1] = 0;
        if (!uv_ip6_addr(host + 1, (int)port, (struct sockaddr_in6 *)ss)) return 0;
    } else if (!uv_ip4_addr(host, (int)port, (struct sockaddr_in *)ss)) {
        return 0;
    }
    return err_set(err, "%s: '%s' is not a numeric IPv4 or [IPv6] address", option, host);
}

// Every second (4 times per auth-timeout when that is shorter): TCP peers that did not
// authenticate within auth-timeout are told so and closed; clients held back (not read
// from) that have not read any of their replies for STALL_MS are dropped.
static void on_sweep(uv_timer_t *t) {
    (void)t;
    uint64_t now = uv_now(astraid.loop), auth_ms = (uint64_t)(astraid.cfg.auth_timeout * 1000);
    for (Conn *c = conns, *next; c; c = next) {
        next = c->next;
        if (c->preauth && now - c->accepted_ms >= auth_ms) {
            char msg[100];
            snprintf(msg, sizeof msg, "unauthorized: no auth within %g s",
                     astraid.cfg.auth_timeout);
            conn_send(c, rpc_error(NULL, RPC_UNAUTHORIZED, msg, NULL));
            conn_hang_up(c);
        } else if (!c->reading && c->queued && now - c->progress_ms >= STALL_MS) {
            log_warn("dropping a client that sends requests but does not read the replies "
                     "(%zu bytes unread, %zu bytes of requests waiting)",
                     c->queued, rpc_reader_pending(&c->reader));
            conn_close(c);
        }
    }
}

static int listen_tcp(Err *err) {
    struct sockaddr_storage ss;
    if (server_parse_address("tcp", astraid.cfg.tcp, &ss, err)) return -1;
    uv_tcp_init(astraid.loop, &tcp_listener);
    tcp_open = 1;
    int rc = uv_tcp_bind(&tcp_listener, (struct sockaddr *)&ss, 0);
    if (!rc) rc = uv_listen((uv_stream_t *)&tcp_listener, BACKLOG, on_connection);
    if (rc) return err_set(err, "tcp: listen on %s: %s", astraid.cfg.tcp, uv_strerror(rc));
    return 0;
}

int server_start(Err *err) {
    uv_timer_init(astraid.loop, &sweep_timer);
    uv_timer_init(astraid.loop, &trim_timer);
    uv_idle_init(astraid.loop, &backlog_idle);
    // A peer goes within 1.25 auth-timeouts.
    double quarter = astraid.cfg.auth_timeout * 250;
    uint64_t ms = quarter < 10 ? 10 : quarter > 1000 ? 1000 : (uint64_t)quarter;
    uv_timer_start(&sweep_timer, on_sweep, ms, ms);
    if (listen_unix(err)) return -1;
    // The token of tcp and http peers (main.c requires it with --tcp).
    if (astraid.cfg.token_file && read_token(astraid.cfg.token_file, err)) return -1;
    return astraid.cfg.tcp ? listen_tcp(err) : 0;
}

void server_close_listeners(void) {
    if (unix_open && !uv_is_closing((uv_handle_t *)&unix_listener))
        uv_close((uv_handle_t *)&unix_listener, NULL);
    if (tcp_open && !uv_is_closing((uv_handle_t *)&tcp_listener))
        uv_close((uv_handle_t *)&tcp_listener, NULL);
    if (unix_bound_here) unlink(astraid.cfg.socket_path);
    unix_bound_here = 0;
}

void server_close_all(void) {
    server_close_listeners();
    while (conns)
        conn_close(conns);
}
