// server.c: the control sockets of astraid (DESIGN §3, docs/protocol.md).
//
// A unix stream socket (bound here, or passed by systemd socket activation) and
// optionally TCP. Each connection splits its bytes into lines (proto/rpc.h
// RpcReader: a line over 1 MiB gets one -32005 reply and is skipped, the connection
// stays usable) and answers each line in order. Replies and pushes go out through
// libuv's write queue; a client whose queue passes OUTPUT_CAP (it stopped reading)
// is dropped, so nobody can stall the loop. Over the connection limit a client gets
// one -32004 reply and is closed. The unix peer's uid comes from SO_PEERCRED.
#include <errno.h>
#include <libgen.h>
#include <limits.h>
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

#define OUTPUT_CAP (8u << 20) // bytes queued to one client before it is dropped
#define BACKLOG 128
#define TOKEN_MAX 4096

struct Conn {
    union {
        uv_handle_t handle;
        uv_stream_t stream;
        uv_pipe_t pipe;
        uv_tcp_t tcp;
    } h;
    int tcp, authed, closing;
    long uid;
    RpcReader reader;
    int watching;
    long watch_job; // 0: every job
    int following, follow_rank;
    long follow_job;
    Conn *prev, *next;
};

typedef struct {
    uv_write_t req;
    char *msg;
} WriteReq;

static Conn *conns;
static int n_conns;
static uv_pipe_t unix_listener;
static uv_tcp_t tcp_listener;
static int unix_open, tcp_open, unix_bound_here;
static char token[TOKEN_MAX];
static size_t token_len;

int server_connections(void) {
    return n_conns;
}

long conn_uid(const Conn *c) {
    return c->uid;
}

int conn_is_authed(const Conn *c) {
    return !c->tcp || c->authed;
}

void conn_set_authed(Conn *c) {
    c->authed = 1;
}

// Constant time in the token's content (DESIGN §3).
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
    free(c);
}

static void unlink_conn(Conn *c) {
    c->closing = 1;
    if (c->prev)
        c->prev->next = c->next;
    else
        conns = c->next;
    if (c->next) c->next->prev = c->prev;
    n_conns--;
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

// Closes c once what it was sent is written (an error reply before hanging up).
void conn_hang_up(Conn *c) {
    if (c->closing) return;
    unlink_conn(c);
    uv_read_stop(&c->h.stream);
    uv_shutdown_t *req = malloc(sizeof *req);
    if (!req || uv_shutdown(req, &c->h.stream, on_shutdown)) {
        free(req);
        uv_close(&c->h.handle, on_conn_closed);
    }
}

// ---------------------------------------------------------------- output

static void on_written(uv_write_t *req, int status) {
    WriteReq *w = (WriteReq *)req;
    Conn *c = req->handle->data;
    free(w->msg);
    free(w);
    if (status < 0 && !c->closing) conn_close(c); // the client went away mid-reply
}

void conn_send(Conn *c, char *msg) {
    if (!msg || c->closing) {
        free(msg);
        return;
    }
    if (uv_stream_get_write_queue_size(&c->h.stream) > OUTPUT_CAP) {
        log_warn("dropping a client that does not read (%zu bytes queued)",
                 uv_stream_get_write_queue_size(&c->h.stream));
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
    buf = uv_buf_init(msg + done, (unsigned)(len - done));
    if (uv_write(&w->req, &c->h.stream, &buf, 1, on_written)) {
        free(msg);
        free(w);
        conn_close(c);
    }
}

// ---------------------------------------------------------------- input

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
    (void)h;
    (void)suggested;
    static char chunk[64 * 1024]; // fed to the reader before the next allocation
    *buf = uv_buf_init(chunk, sizeof chunk);
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
    Conn *c = s->data;
    if (n < 0) {
        conn_close(c);
        return;
    }
    if (n == 0) return;
    if (rpc_reader_feed(&c->reader, buf->base, (size_t)n)) {
        conn_close(c);
        return;
    }
    char *line;
    size_t len;
    int kind;
    while (!c->closing && (kind = rpc_reader_next(&c->reader, &line, &len)) != RPC_LINE_NONE) {
        if (kind == RPC_LINE_OK)
            dispatch_line(c, line, len);
        else
            conn_send(c,
                      rpc_error(NULL, RPC_LINE_TOO_LONG, "line longer than 1 MiB; skipped", NULL));
    }
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

static void on_connection(uv_stream_t *listener, int status) {
    if (status < 0) {
        log_warn("accept: %s", uv_strerror(status));
        return;
    }
    Conn *c = calloc(1, sizeof *c);
    if (!c) return;
    c->tcp = listener == (uv_stream_t *)&tcp_listener;
    if (c->tcp)
        uv_tcp_init(astraid.loop, &c->h.tcp);
    else
        uv_pipe_init(astraid.loop, &c->h.pipe, 0);
    c->h.handle.data = c;
    rpc_reader_init(&c->reader);
    c->next = conns;
    if (conns) conns->prev = c;
    conns = c;
    n_conns++;
    if (uv_accept(listener, &c->h.stream)) {
        conn_close(c);
        return;
    }
    c->uid = c->tcp ? -1 : peer_uid(c);
    if (n_conns > astraid.cfg.max_connections) {
        conn_send(c, rpc_error(NULL, RPC_BUSY, "too many connections; try again later", NULL));
        conn_hang_up(c);
        return;
    }
    uv_read_start(&c->h.stream, on_alloc, on_read);
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

static int ends_follow(JobState s) {
    return s == JOB_COMPLETED || s == JOB_FAILED || s == JOB_CANCELLED || s == JOB_PAUSED ||
           s == JOB_INTERRUPTED;
}

static char *end_push(const Job *j) {
    cJSON *p = cJSON_CreateObject();
    cJSON_AddNumberToObject(p, "job", (double)j->id);
    cJSON_AddStringToObject(p, "state", job_state_name(j->state));
    return rpc_push("end", p);
}

void server_push_progress(const Job *j) {
    char *msg = NULL;
    int end = ends_follow(j->state);
    for (Conn *c = conns, *next; c; c = next) {
        next = c->next; // conn_send may drop c
        int watched = c->watching && (c->watch_job == 0 || c->watch_job == j->id);
        if (watched && !msg) msg = rpc_push("progress", job_to_json(j));
        if (watched && msg) conn_send(c, strdup(msg));
        int one = (watched && c->watch_job == j->id) || (c->following && c->follow_job == j->id);
        if (end && one && !c->closing) {
            c->watching = c->watching && c->watch_job != j->id;
            c->following = c->following && c->follow_job != j->id;
            conn_send(c, end_push(j));
        }
    }
    free(msg);
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

// "HOST:PORT", "[::1]:PORT".
static int parse_host_port(const char *spec, struct sockaddr_storage *ss, Err *err) {
    const char *colon = strrchr(spec, ':');
    char host[256];
    if (!colon || colon == spec || (size_t)(colon - spec) >= sizeof host)
        return err_set(err, "tcp: '%s' is not HOST:PORT", spec);
    snprintf(host, sizeof host, "%.*s", (int)(colon - spec), spec);
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (end == colon + 1 || *end || port < 1 || port > 65535)
        return err_set(err, "tcp: '%s' has no valid port", spec);
    if (host[0] == '[' && host[strlen(host) - 1] == ']') {
        host[strlen(host) - 1] = 0;
        if (!uv_ip6_addr(host + 1, (int)port, (struct sockaddr_in6 *)ss)) return 0;
    } else if (!uv_ip4_addr(host, (int)port, (struct sockaddr_in *)ss)) {
        return 0;
    }
    return err_set(err, "tcp: '%s' is not a numeric IPv4 or [IPv6] address", host);
}

static int listen_tcp(Err *err) {
    struct sockaddr_storage ss;
    if (read_token(astraid.cfg.token_file, err) || parse_host_port(astraid.cfg.tcp, &ss, err))
        return -1;
    uv_tcp_init(astraid.loop, &tcp_listener);
    tcp_open = 1;
    int rc = uv_tcp_bind(&tcp_listener, (struct sockaddr *)&ss, 0);
    if (!rc) rc = uv_listen((uv_stream_t *)&tcp_listener, BACKLOG, on_connection);
    if (rc) return err_set(err, "tcp: listen on %s: %s", astraid.cfg.tcp, uv_strerror(rc));
    return 0;
}

int server_start(Err *err) {
    if (listen_unix(err)) return -1;
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
